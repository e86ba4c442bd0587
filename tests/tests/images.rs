//! The Docker images, checked without a Docker daemon (none runs in CI; scripts/check-images.sh
//! builds and runs them where one does):
//!
//! - **Build context.** For every `docker/Dockerfile*`, the context BuildKit would send (the
//!   repository less the Dockerfile's own `.dockerignore`, by Docker's matching rules) is
//!   rebuilt, each build stage's `COPY`s are replayed into a temporary root, and cargo loads the
//!   workspace there (`cargo metadata --offline`): every member must be present (the bug of
//!   issue 35: "failed to load manifest for workspace member `kernels`"), every target's source
//!   file, every file an `include_str!`/`include_bytes!` names, and the packages, binaries and
//!   features the `cargo build` line asks for. A context that still carries `target/`, `.git`
//!   or another ignored local folder fails too.
//! - **Command lines.** Every way the teacher image is started (its own ENTRYPOINT + CMD, the
//!   compose services, the Kubernetes Deployment) passes `teacher … --check-args` on a tiny
//!   model with the image's ENV (overlaid by the service's environment) applied, listens on the
//!   exposed port, and leaves `--max-wait-ms` at the server's default. The images run as the
//!   unprivileged user the Kubernetes pods name, with a HEALTHCHECK on `/health`.
//! - **The trainer image.** Its entrypoint is `trainer`; the Kubernetes Jobs (the data-parallel
//!   one's rank 0 as a world of one) and the compose `trainer` service run it with their own
//!   arguments, environment, config and volume layout against a running teacher, and a restart
//!   resumes from the checkpoint the first run left.

use clap::{CommandFactory, Parser};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use xdistill_server::Args;

/// What these tests take from `xdistill_testkit`: the binaries, a running teacher, tiny models
/// (under this package's `CARGO_TARGET_TMPDIR`) and compose's variable defaults.
mod common {
    use std::path::{Path, PathBuf};
    pub use xdistill_testkit::{compose_defaults, start_teacher, teacher_binary as teacher_bin};

    pub fn tiny_model(name: &str, arch: &str, tokenizer: &str, pad_to: usize) -> PathBuf {
        let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
        xdistill_testkit::tiny_teacher_model(tmp, name, arch, tokenizer, pad_to)
    }
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("server/ has a parent")
        .to_path_buf()
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(repo().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

fn yaml(rel: &str) -> serde_yaml::Value {
    serde_yaml::from_str(&read(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// Every document of a multi-document YAML file.
fn yaml_docs(rel: &str) -> Vec<serde_yaml::Value> {
    use serde::Deserialize;
    serde_yaml::Deserializer::from_str(&read(rel))
        .map(|d| serde_yaml::Value::deserialize(d).unwrap_or_else(|e| panic!("{rel}: {e}")))
        .collect()
}

// ---- .dockerignore ---------------------------------------------------------------------------

/// One piece of a compiled pattern (Docker's patternmatcher turns each into a regex piece).
#[derive(Debug, Clone)]
enum Tok {
    Lit(char),
    /// `*`: any run of characters but `/`.
    Star,
    /// `?`: one character but `/`.
    One,
    /// `**` (with the `/` after it, if any) before more pattern: `(.*/)?`, zero or more whole
    /// leading directories.
    Dirs,
    /// `**` at the end: `.*`, anything.
    Rest,
    /// `[...]`: one character of the set (ranges; `^` negates), `/` included as in a regex.
    Class(bool, Vec<(char, char)>),
}

#[derive(Debug, Clone)]
struct Pattern {
    /// A `!` line: brings back what earlier lines left out.
    exception: bool,
    text: String,
    toks: Vec<Tok>,
}

/// A `.dockerignore` with the rules of Docker's `moby/patternmatcher` (what BuildKit applies).
#[derive(Debug, Clone)]
struct Ignore {
    patterns: Vec<Pattern>,
}

/// Go's `filepath.Clean` on a slash-separated path.
fn clean(path: &str) -> String {
    let rooted = path.starts_with('/');
    let mut parts: Vec<&str> = Vec::new();
    for seg in path.split('/') {
        match seg {
            "" | "." => {}
            ".." => {
                if parts.last().is_some_and(|p| *p != "..") {
                    parts.pop();
                } else if !rooted {
                    parts.push("..");
                }
            }
            s => parts.push(s),
        }
    }
    let body = parts.join("/");
    match (rooted, body.is_empty()) {
        (true, _) => format!("/{body}"),
        (false, true) => ".".into(),
        (false, false) => body,
    }
}

fn compile(pattern: &str) -> Vec<Tok> {
    let chars: Vec<char> = pattern.chars().collect();
    let mut toks = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        match chars[i] {
            '*' if chars.get(i + 1) == Some(&'*') => {
                i += 2;
                if chars.get(i) == Some(&'/') {
                    i += 1;
                }
                toks.push(if i >= chars.len() {
                    Tok::Rest
                } else {
                    Tok::Dirs
                });
                continue;
            }
            '*' => toks.push(Tok::Star),
            '?' => toks.push(Tok::One),
            '\\' if i + 1 < chars.len() => {
                i += 1;
                toks.push(Tok::Lit(chars[i]));
            }
            '[' => {
                let mut j = i + 1;
                let negated = matches!(chars.get(j), Some('^') | Some('!'));
                if negated {
                    j += 1;
                }
                let mut set = Vec::new();
                while j < chars.len() && (chars[j] != ']' || set.is_empty()) {
                    let lo = chars[j];
                    if chars.get(j + 1) == Some(&'-') && chars.get(j + 2).is_some_and(|c| *c != ']')
                    {
                        set.push((lo, chars[j + 2]));
                        j += 3;
                    } else {
                        set.push((lo, lo));
                        j += 1;
                    }
                }
                assert!(j < chars.len(), "unterminated [ in pattern {pattern:?}");
                toks.push(Tok::Class(negated, set));
                i = j;
            }
            c => toks.push(Tok::Lit(c)),
        }
        i += 1;
    }
    toks
}

/// Whether `toks` match all of `s` (anchored at both ends, as the compiled regex is).
fn full_match(toks: &[Tok], s: &[char]) -> bool {
    let Some((first, rest)) = toks.split_first() else {
        return s.is_empty();
    };
    match first {
        Tok::Lit(c) => s.first() == Some(c) && full_match(rest, &s[1..]),
        Tok::One => s.first().is_some_and(|c| *c != '/') && full_match(rest, &s[1..]),
        Tok::Class(neg, set) => {
            s.first()
                .is_some_and(|c| set.iter().any(|(lo, hi)| lo <= c && c <= hi) != *neg)
                && full_match(rest, &s[1..])
        }
        Tok::Star => {
            let run = s.iter().take_while(|c| **c != '/').count();
            (0..=run).any(|n| full_match(rest, &s[n..]))
        }
        Tok::Rest => true,
        Tok::Dirs => {
            full_match(rest, s)
                || (0..s.len()).any(|i| s[i] == '/' && full_match(rest, &s[i + 1..]))
        }
    }
}

impl Pattern {
    fn matches(&self, path: &str) -> bool {
        full_match(&self.toks, &path.chars().collect::<Vec<_>>())
    }

    /// The pattern matches `path` or one of its parent directories (`MatchesOrParentMatches`:
    /// a directory left out takes its contents with it).
    fn matches_or_parent(&self, path: &str) -> bool {
        if self.matches(path) {
            return true;
        }
        let parts: Vec<&str> = path.split('/').collect();
        (1..parts.len()).any(|n| self.matches(&parts[..n].join("/")))
    }
}

impl Ignore {
    /// Reads the file as `moby/patternmatcher/ignorefile.ReadAll` does: `#` only at the start
    /// of a line, surrounding blanks trimmed, `!` for exceptions, each pattern cleaned and a
    /// leading `/` dropped.
    fn parse(text: &str) -> Ignore {
        let mut patterns = Vec::new();
        for line in text.trim_start_matches('\u{feff}').lines() {
            if line.starts_with('#') {
                continue;
            }
            let mut p = line.trim();
            if p.is_empty() {
                continue;
            }
            let exception = p.starts_with('!');
            if exception {
                p = p[1..].trim();
            }
            if p.is_empty() {
                continue;
            }
            let mut p = clean(p);
            if p.len() > 1 && p.starts_with('/') {
                p.remove(0);
            }
            patterns.push(Pattern {
                exception,
                toks: compile(&p),
                text: p,
            });
        }
        Ignore { patterns }
    }

    /// Whether the file or directory at `path` (relative, `/`-separated) is left out of the
    /// context: the last pattern that matches it (or a parent) decides.
    fn excluded(&self, path: &str) -> bool {
        let mut matched = false;
        for p in &self.patterns {
            // As Docker: once excluded only exceptions matter, and before only exclusions.
            if p.exception != matched {
                continue;
            }
            if p.matches_or_parent(path) {
                matched = !p.exception;
            }
        }
        matched
    }

    /// Whether an exception could bring back something below the excluded directory `dir`
    /// (then the walk goes on inside it; otherwise it is skipped whole, as BuildKit does).
    fn may_reinclude_below(&self, dir: &str) -> bool {
        self.patterns.iter().filter(|p| p.exception).any(|p| {
            let literal: String = p
                .toks
                .iter()
                .map_while(|t| match t {
                    Tok::Lit(c) => Some(*c),
                    _ => None,
                })
                .collect();
            let dir = format!("{dir}/");
            literal.starts_with(&dir) || dir.starts_with(&literal)
        })
    }
}

/// The files of the build context: every file under `root` that `ignore` does not leave out
/// (BuildKit sends the directory as it is on disk, tracked by git or not).
fn context_files(root: &Path, ignore: &Ignore) -> BTreeSet<String> {
    fn walk(root: &Path, rel: &str, ignore: &Ignore, out: &mut BTreeSet<String>) {
        let dir = if rel.is_empty() {
            root.to_path_buf()
        } else {
            root.join(rel)
        };
        let entries = std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        for entry in entries {
            let entry = entry.expect("a directory entry");
            let name = entry.file_name().to_string_lossy().into_owned();
            let path = if rel.is_empty() {
                name
            } else {
                format!("{rel}/{name}")
            };
            let kind = entry.file_type().expect("a file type");
            if kind.is_dir() {
                if !ignore.excluded(&path) || ignore.may_reinclude_below(&path) {
                    walk(root, &path, ignore, out);
                }
            } else if !ignore.excluded(&path) {
                out.insert(path);
            }
        }
    }
    let mut out = BTreeSet::new();
    walk(root, "", ignore, &mut out);
    out
}

#[test]
fn dockerignore_patterns_match_as_docker_does() {
    let ig = Ignore::parse(
        "# comment\n\
         \n\
         target\n\
         **/pyenv\n\
         /docs/\n\
         *.md\n\
         !README.md\n\
         bench/*.py\n\
         data/**\n\
         !data/keep/**\n\
         a?c\n\
         x[0-9]y\n\
         #not-a-comment-inside\n\
         \x20 spaced  \n",
    );
    let cases = [
        // Anchored at the root: `target` is not `server/target`.
        ("target", true),
        ("target/debug/teacher", true),
        ("server/target", false),
        // `**/` reaches any depth, including none.
        ("pyenv/bin/python", true),
        ("target2", false),
        ("x/y/pyenv", true),
        ("x/pyenvs", false),
        // A leading and a trailing `/` change nothing.
        ("docs/deploy.md", true),
        // `*` stays within one segment; the last matching line wins.
        ("notes.md", true),
        ("README.md", false),
        ("server/notes.md", false),
        ("bench/replicas.py", true),
        ("bench/sub/replicas.py", false), // `*` does not cross a `/`...
        ("bench/sub.py/x", true),         // ...and a matching parent takes its contents along
        ("bench/teacher.md", false),
        // `**` at the end: everything below; an exception below it.
        ("data/a/b.jsonl", true),
        ("data/keep/x.jsonl", false),
        ("a/c", false),
        ("abc", true),
        ("x5y", true),
        ("xay", false),
        ("spaced", true),
        ("#not-a-comment-inside", false), // a comment line, not a pattern
    ];
    // The file's last two lines: `#…` is a comment, the spaces around `spaced` are trimmed.
    assert!(ig.patterns.iter().any(|p| p.text == "spaced"));
    assert!(!ig.patterns.iter().any(|p| p.text.starts_with('#')));
    for (path, want) in cases {
        assert_eq!(ig.excluded(path), want, "{path}");
    }
    // The walk may skip `target/` whole, but must look inside `data/` (an exception below it).
    assert!(!ig.may_reinclude_below("target"));
    assert!(ig.may_reinclude_below("data"));
    assert!(ig.may_reinclude_below("data/keep"));
    assert!(!ig.may_reinclude_below("data/other"));
    assert_eq!(clean("./a//b/../c/"), "a/c");
    assert_eq!(clean("/"), "/");
}

// ---- Dockerfile --------------------------------------------------------------------------------

#[derive(Debug, Clone)]
struct Instr {
    /// The instruction, upper case (`COPY`, `RUN`, …).
    cmd: String,
    /// The rest of the logical line (continuations joined).
    args: String,
}

#[derive(Debug, Clone)]
struct Stage {
    name: String,
    base: String,
    instrs: Vec<Instr>,
}

#[derive(Debug, Clone)]
struct Dockerfile {
    rel: String,
    stages: Vec<Stage>,
}

/// Shell-like words: blanks separate, quotes group, a backslash escapes.
fn words(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut has = false;
    let mut quote: Option<char> = None;
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some('"'), '\\') | (None, '\\') => {
                if let Some(n) = chars.next() {
                    cur.push(n);
                }
            }
            (Some(_), c) => cur.push(c),
            (None, '"' | '\'') => {
                quote = Some(c);
                has = true;
            }
            (None, c) if c.is_whitespace() => {
                if has || !cur.is_empty() {
                    out.push(std::mem::take(&mut cur));
                }
                has = false;
            }
            (None, c) => cur.push(c),
        }
    }
    if has || !cur.is_empty() {
        out.push(cur);
    }
    out
}

impl Dockerfile {
    fn parse(rel: &str, text: &str) -> Dockerfile {
        // Logical lines: comment lines dropped (also inside a continuation), `\` joins.
        let mut logical = Vec::new();
        let mut cur = String::new();
        for line in text.lines() {
            let t = line.trim();
            if t.starts_with('#') || (t.is_empty() && !cur.is_empty()) {
                continue;
            }
            if t.is_empty() {
                continue;
            }
            if let Some(body) = line.trim_end().strip_suffix('\\') {
                cur.push_str(body);
                cur.push(' ');
            } else {
                cur.push_str(line);
                logical.push(std::mem::take(&mut cur));
            }
        }
        assert!(cur.is_empty(), "{rel}: ends inside a continuation");
        let mut stages: Vec<Stage> = Vec::new();
        for l in logical {
            let l = l.trim();
            let (cmd, args) = l.split_once(char::is_whitespace).unwrap_or((l, ""));
            let instr = Instr {
                cmd: cmd.to_ascii_uppercase(),
                args: args.trim().to_string(),
            };
            if instr.cmd == "FROM" {
                let toks: Vec<&str> = instr
                    .args
                    .split_whitespace()
                    .filter(|t| !t.starts_with("--"))
                    .collect();
                let name = match toks.as_slice() {
                    [_, as_, name] if as_.eq_ignore_ascii_case("as") => name.to_string(),
                    _ => stages.len().to_string(),
                };
                stages.push(Stage {
                    name,
                    base: toks[0].to_string(),
                    instrs: Vec::new(),
                });
            } else if let Some(stage) = stages.last_mut() {
                stage.instrs.push(instr);
            }
        }
        Dockerfile {
            rel: rel.to_string(),
            stages,
        }
    }

    fn stage(&self, name: &str) -> &Stage {
        self.stages
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("{}: no stage `{name}`", self.rel))
    }

    /// `stage` and the stages it is built `FROM`, the base first.
    fn chain<'a>(&'a self, stage: &'a Stage) -> Vec<&'a Stage> {
        let mut chain = vec![stage];
        while let Some(parent) = self
            .stages
            .iter()
            .find(|s| s.name == chain[chain.len() - 1].base)
        {
            chain.push(parent);
        }
        chain.reverse();
        chain
    }

    /// The instructions a stage runs, its bases' first.
    fn instrs<'a>(&'a self, stage: &'a Stage) -> impl Iterator<Item = &'a Instr> {
        self.chain(stage).into_iter().flat_map(|s| s.instrs.iter())
    }

    /// The last value of an instruction in the stage (with its bases'), e.g. `USER`.
    fn last(&self, stage: &Stage, cmd: &str) -> Option<String> {
        self.instrs(stage)
            .filter(|i| i.cmd == cmd)
            .last()
            .map(|i| i.args.clone())
    }

    /// ENTRYPOINT or CMD as an argument vector (the shell form runs `/bin/sh -c`).
    fn exec(&self, stage: &Stage, cmd: &str) -> Vec<String> {
        self.last(stage, cmd)
            .map(|a| exec_form(&a))
            .unwrap_or_default()
    }

    /// The image's environment: every `ENV` of the stage and its bases.
    fn env(&self, stage: &Stage) -> BTreeMap<String, String> {
        let mut env = BTreeMap::new();
        for i in self.instrs(stage).filter(|i| i.cmd == "ENV") {
            let w = words(&i.args);
            if w.first().is_some_and(|w| w.contains('=')) {
                for kv in w {
                    let (k, v) = kv.split_once('=').expect("ENV k=v");
                    env.insert(k.to_string(), v.to_string());
                }
            } else {
                // The legacy `ENV KEY value with spaces`.
                let (k, v) = i
                    .args
                    .split_once(char::is_whitespace)
                    .expect("ENV KEY value");
                env.insert(k.to_string(), v.trim().to_string());
            }
        }
        env
    }

    /// The numeric user of `USER uid[:gid]` (a name cannot be checked against Kubernetes'
    /// runAsUser).
    fn uid(&self, stage: &Stage) -> u64 {
        let user = self
            .last(stage, "USER")
            .unwrap_or_else(|| panic!("{} stage {}: no USER (runs as root)", self.rel, stage.name));
        let uid = user.split(':').next().unwrap_or("");
        uid.parse()
            .unwrap_or_else(|_| panic!("{}: USER {user} is not numeric", self.rel))
    }
}

fn exec_form(args: &str) -> Vec<String> {
    if args.trim_start().starts_with('[') {
        serde_json::from_str(args).unwrap_or_else(|e| panic!("exec form {args}: {e}"))
    } else {
        vec!["/bin/sh".into(), "-c".into(), args.into()]
    }
}

/// A `COPY`: its `--flag=value` options, sources and destination.
#[derive(Debug)]
struct Copy {
    from: Option<String>,
    srcs: Vec<String>,
    dest: String,
}

fn parse_copy(args: &str) -> Copy {
    let mut rest = args.trim();
    let mut from = None;
    while rest.starts_with("--") {
        let (flag, tail) = rest.split_once(char::is_whitespace).unwrap_or((rest, ""));
        if let Some(v) = flag.strip_prefix("--from=") {
            from = Some(v.to_string());
        }
        rest = tail.trim_start();
    }
    let mut all: Vec<String> = if rest.starts_with('[') {
        serde_json::from_str(rest).unwrap_or_else(|e| panic!("COPY {args}: {e}"))
    } else {
        rest.split_whitespace().map(str::to_string).collect()
    };
    assert!(
        all.len() >= 2,
        "COPY {args}: needs a source and a destination"
    );
    let dest = all.pop().expect("a destination");
    Copy {
        from,
        srcs: all,
        dest,
    }
}

/// What a `RUN … cargo build …` asks for.
#[derive(Debug, Default)]
struct CargoBuild {
    packages: Vec<String>,
    bins: Vec<String>,
    features: Vec<String>,
    locked: bool,
    /// `cp target/release/BIN DEST` after the build: BIN → DEST.
    copies: BTreeMap<String, String>,
}

fn parse_cargo_build(run: &str) -> Option<CargoBuild> {
    let toks: Vec<&str> = run.split_whitespace().collect();
    let start = toks.windows(2).position(|w| w == ["cargo", "build"])?;
    let mut b = CargoBuild::default();
    let mut i = start + 2;
    while i < toks.len() && !matches!(toks[i], "&&" | ";" | "||") {
        let next = toks.get(i + 1).map(|s| s.to_string());
        match toks[i] {
            "-p" | "--package" => b.packages.extend(next.clone()),
            "--bin" => b.bins.extend(next.clone()),
            "-F" | "--features" => b.features.extend(
                next.iter()
                    .flat_map(|f| f.split(',').map(str::to_string).collect::<Vec<_>>()),
            ),
            "--locked" => b.locked = true,
            _ => {}
        }
        i += 1;
    }
    for w in toks.windows(3) {
        if w[0] == "cp" {
            if let Some(bin) = w[1].strip_prefix("target/release/") {
                b.copies.insert(bin.to_string(), w[2].to_string());
            }
        }
    }
    Some(b)
}

#[test]
fn dockerfile_instructions_parse() {
    let df = Dockerfile::parse(
        "t",
        "# c\nARG X=1\nFROM a:1 AS base\nENV A=1 \\\n    # inside\n    B=\"two words\"\n\
         ENV LEGACY some value\nWORKDIR /src\nCOPY --chown=1:1 x y /dst/\n\
         FROM base AS next\nUSER 10001:10001\nCOPY [\"a b\", \"c\"]\n\
         RUN --mount=type=cache,target=/t cargo build --release --locked -p p1 --bin b1 \\\n\
         --features cuda,x && cp target/release/b1 /usr/local/bin/b1\n\
         ENTRYPOINT [\"/bin/b1\"]\nCMD run it\n",
    );
    assert_eq!(df.stages.len(), 2);
    let next = df.stage("next");
    assert_eq!(
        df.chain(next).iter().map(|s| &s.name).collect::<Vec<_>>(),
        ["base", "next"]
    );
    let env = df.env(next);
    assert_eq!(env["A"], "1");
    assert_eq!(env["B"], "two words");
    assert_eq!(env["LEGACY"], "some value");
    assert_eq!(df.uid(next), 10001);
    assert_eq!(df.exec(next, "ENTRYPOINT"), ["/bin/b1"]);
    assert_eq!(df.exec(next, "CMD"), ["/bin/sh", "-c", "run it"]);
    let copies: Vec<Copy> = df
        .instrs(next)
        .filter(|i| i.cmd == "COPY")
        .map(|i| parse_copy(&i.args))
        .collect();
    assert_eq!(
        (copies[0].srcs.clone(), copies[0].dest.as_str()),
        (vec!["x".to_string(), "y".into()], "/dst/")
    );
    assert_eq!(
        (copies[1].srcs.clone(), copies[1].dest.as_str()),
        (vec!["a b".to_string()], "c")
    );
    let run = df.last(next, "RUN").unwrap();
    let b = parse_cargo_build(&run).unwrap();
    assert_eq!(
        (b.packages, b.bins, b.features, b.locked),
        (
            vec!["p1".to_string()],
            vec!["b1".to_string()],
            vec!["cuda".to_string(), "x".into()],
            true
        )
    );
    assert_eq!(b.copies["b1"], "/usr/local/bin/b1");
}

// ---- the build context, rebuilt --------------------------------------------------------------

/// The Dockerfiles of docker/ (every `Dockerfile*` but the ignore files).
fn dockerfiles() -> Vec<String> {
    let mut out: Vec<String> = std::fs::read_dir(repo().join("docker"))
        .expect("docker/")
        .map(|e| {
            e.expect("an entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .filter(|n| n.starts_with("Dockerfile") && !n.ends_with(".dockerignore"))
        .map(|n| format!("docker/{n}"))
        .collect();
    out.sort();
    out
}

/// The ignore file BuildKit uses for a Dockerfile: `<Dockerfile>.dockerignore` beside it, else
/// the context's `.dockerignore`.
fn ignore_file_of(dockerfile: &str) -> Option<String> {
    [format!("{dockerfile}.dockerignore"), ".dockerignore".into()]
        .into_iter()
        .find(|f| repo().join(f).is_file())
}

/// The paths (relative to the context) one COPY source names, or an error as Docker's.
fn copy_sources(ctx: &BTreeSet<String>, src: &str) -> Result<Vec<(String, String)>, String> {
    assert!(
        !src.contains(['*', '?', '[']),
        "COPY {src}: wildcards are not modelled by this test"
    );
    let s = clean(src.trim_start_matches('/'));
    let s = if s == "." { String::new() } else { s };
    if ctx.contains(&s) {
        // A file: (its path, its name).
        let name = s.rsplit('/').next().unwrap_or(&s).to_string();
        return Ok(vec![(s.clone(), name)]);
    }
    let prefix = if s.is_empty() {
        String::new()
    } else {
        format!("{s}/")
    };
    let under: Vec<(String, String)> = ctx
        .iter()
        .filter_map(|f| {
            f.strip_prefix(&prefix)
                .map(|rest| (f.clone(), rest.to_string()))
        })
        .collect();
    if under.is_empty() {
        return Err(format!(
            "COPY {src}: \"/{s}\": not found in the build context (left out by the ignore file?)"
        ));
    }
    Ok(under)
}

/// Replays the `COPY`s (not `--from`) of `stage` and its bases into `root` up to its
/// `cargo build` RUN; returns the RUN's working directory under `root`.
fn materialize(
    df: &Dockerfile,
    stage: &Stage,
    ctx_root: &Path,
    ctx: &BTreeSet<String>,
    root: &Path,
) -> Result<PathBuf, String> {
    let mut workdir = PathBuf::from("/");
    for i in df.instrs(stage) {
        match i.cmd.as_str() {
            "WORKDIR" => workdir = workdir.join(&i.args),
            "ADD" => return Err(format!("{}: ADD is not modelled by this test", df.rel)),
            "COPY" => {
                let c = parse_copy(&i.args);
                if c.from.is_some() {
                    continue;
                }
                let dest = workdir.join(&c.dest);
                let into_dir = c.dest.ends_with('/') || c.srcs.len() > 1;
                for src in &c.srcs {
                    let is_file = ctx.contains(&clean(src.trim_start_matches('/')));
                    for (from, rel) in copy_sources(ctx, src)? {
                        let target = if is_file && !into_dir {
                            dest.clone()
                        } else {
                            dest.join(&rel)
                        };
                        let target = root.join(target.strip_prefix("/").expect("absolute"));
                        std::fs::create_dir_all(target.parent().expect("a parent"))
                            .map_err(|e| e.to_string())?;
                        std::fs::copy(ctx_root.join(&from), &target)
                            .map_err(|e| format!("{from}: {e}"))?;
                    }
                }
            }
            "RUN" if i.args.contains("cargo build") => {
                return Ok(root.join(workdir.strip_prefix("/").expect("absolute")));
            }
            _ => {}
        }
    }
    Err(format!("{} stage {}: no cargo build", df.rel, stage.name))
}

fn cargo() -> Command {
    Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

fn host_triple() -> String {
    let out = Command::new(std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into()))
        .arg("-vV")
        .output()
        .expect("rustc -vV");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(str::to_string))
        .expect("rustc -vV names the host")
}

/// The files `include_str!`/`include_bytes!` name in one source file, as paths relative to
/// `file`'s directory or to the crate's manifest directory (for a file in the build script's
/// `OUT_DIR`, the build script); an argument of another form is an error (extend this reader
/// rather than let a missing file through).
fn includes(text: &str, file: &Path, manifest_dir: &Path) -> Result<Vec<PathBuf>, String> {
    let mut out = Vec::new();
    for kind in ["str", "bytes"] {
        // Built at run time so that this file's own source does not contain the needle.
        let needle = format!("include_{kind}!(");
        let mut at = 0;
        while let Some(pos) = text[at..].find(&needle) {
            let start = at + pos;
            at = start + needle.len();
            let line_start = text[..start].rfind('\n').map_or(0, |i| i + 1);
            if text[line_start..start].trim_start().starts_with("//") {
                continue;
            }
            let arg = text[at..].trim_start();
            // A file the crate's build script writes (`OUT_DIR`): made by the build from the
            // context, so what must be in the context is the build script itself.
            if arg.starts_with("concat!(env!(\"OUT_DIR\"),") {
                // The file's own crate: the nearest folder above it with a manifest (a crate
                // nested in another's folder, kernels/cuda in kernels, is walked with it).
                let own = file
                    .ancestors()
                    .skip(1)
                    .find(|d| d.join("Cargo.toml").is_file())
                    .unwrap_or(manifest_dir);
                out.push(own.join("build.rs"));
                continue;
            }
            let manifest_prefix = "concat!(env!(\"CARGO_MANIFEST_DIR\"),";
            let (base, lit) = if let Some(rest) = arg.strip_prefix(manifest_prefix) {
                (manifest_dir.to_path_buf(), rest.trim_start())
            } else {
                (file.parent().expect("a parent").to_path_buf(), arg)
            };
            let Some(lit) = lit.strip_prefix('"') else {
                return Err(format!(
                    "{}: an include of a form this test cannot resolve: {}",
                    file.display(),
                    &arg[..arg.len().min(60)]
                ));
            };
            let end = lit
                .find('"')
                .ok_or_else(|| format!("{}: unterminated", file.display()))?;
            out.push(base.join(lit[..end].trim_start_matches('/')));
        }
    }
    Ok(out)
}

fn rs_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            rs_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Rebuilds the context of a Dockerfile (its text and its ignore file's) from the repository
/// and checks each `cargo build` stage in it; returns notes on what could not be checked here.
fn check_context(
    ctx_root: &Path,
    rel: &str,
    dockerfile: &str,
    ignore: &str,
) -> Result<Vec<String>, String> {
    let df = Dockerfile::parse(rel, dockerfile);
    let ctx = context_files(ctx_root, &Ignore::parse(ignore));
    let mut notes = Vec::new();
    // Every COPY from the context names something in it (also in the runtime stages).
    for stage in &df.stages {
        for i in stage.instrs.iter().filter(|i| i.cmd == "COPY") {
            let c = parse_copy(&i.args);
            if c.from.is_none() {
                for src in &c.srcs {
                    copy_sources(&ctx, src)?;
                }
            }
        }
    }
    let mut built = 0;
    for stage in &df.stages {
        let Some(run) = stage
            .instrs
            .iter()
            .find(|i| i.cmd == "RUN" && i.args.contains("cargo build"))
        else {
            continue;
        };
        built += 1;
        let build = parse_cargo_build(&run.args).expect("a cargo build");
        let tmp = tempfile::tempdir().map_err(|e| e.to_string())?;
        let workdir = materialize(&df, stage, ctx_root, &ctx, tmp.path())?;
        let what = format!("{rel} stage {}", stage.name);
        // 1. The workspace loads: every member's manifest, in the context. (--no-deps: the
        // dependencies' sources are not needed to find a missing member, and may not all be
        // downloaded on this machine.)
        let out = cargo()
            .args([
                "metadata",
                "--format-version",
                "1",
                "--no-deps",
                "--offline",
            ])
            .current_dir(&workdir)
            .output()
            .map_err(|e| format!("cargo metadata: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "{what}: cargo metadata in the rebuilt context failed:\n{}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        let meta: serde_json::Value =
            serde_json::from_slice(&out.stdout).map_err(|e| e.to_string())?;
        let packages = meta["packages"].as_array().cloned().unwrap_or_default();
        // 2. Every target's source file and every compile-time include is there.
        for p in &packages {
            for t in p["targets"].as_array().into_iter().flatten() {
                let src = PathBuf::from(t["src_path"].as_str().unwrap_or_default());
                if !src.is_file() {
                    return Err(format!("{what}: {} is not in the context", src.display()));
                }
            }
            let manifest_dir = Path::new(p["manifest_path"].as_str().unwrap_or_default())
                .parent()
                .expect("a manifest directory")
                .to_path_buf();
            let mut files = Vec::new();
            rs_files(&manifest_dir, &mut files);
            for f in files {
                let text = std::fs::read_to_string(&f).map_err(|e| e.to_string())?;
                for inc in includes(&text, &f, &manifest_dir)? {
                    if !inc.is_file() {
                        return Err(format!(
                            "{what}: {} includes {}, which is not in the context",
                            f.display(),
                            inc.display()
                        ));
                    }
                }
            }
        }
        // 3. What the build line asks for exists.
        let selected: Vec<&serde_json::Value> = packages
            .iter()
            .filter(|p| build.packages.iter().any(|n| p["name"] == n.as_str()))
            .collect();
        if build.packages.is_empty() || selected.len() != build.packages.len() {
            return Err(format!(
                "{what}: -p {:?} names no workspace package",
                build.packages
            ));
        }
        for bin in &build.bins {
            let found = selected.iter().any(|p| {
                p["targets"].as_array().into_iter().flatten().any(|t| {
                    t["name"] == bin.as_str()
                        && t["kind"]
                            .as_array()
                            .is_some_and(|k| k.iter().any(|k| k == "bin"))
                })
            });
            if !found {
                return Err(format!("{what}: --bin {bin}: no such binary"));
            }
        }
        for f in &build.features {
            if !selected.iter().all(|p| p["features"].get(f).is_some()) {
                return Err(format!("{what}: --features {f}: no such feature"));
            }
        }
        if !build.locked {
            return Err(format!("{what}: the image build must use --locked"));
        }
        // 4. With Cargo.lock, the whole resolution (--locked: the lock file in the context is
        // complete). It needs every dependency of this platform downloaded: true after the
        // workspace's own build (CI's `cargo test --workspace`), maybe not after a build of one
        // package; then it is noted, not failed.
        let out = cargo()
            .args(["metadata", "--format-version", "1", "--locked", "--offline"])
            .args(["--filter-platform", &host_triple()])
            .current_dir(&workdir)
            .output()
            .map_err(|e| format!("cargo metadata: {e}"))?;
        let err = String::from_utf8_lossy(&out.stderr);
        if !out.status.success() {
            if err.contains("--offline was specified") {
                notes.push(format!("{what}: lock resolution not checked (not all dependencies are downloaded here)"));
            } else {
                return Err(format!("{what}: cargo metadata --locked failed:\n{err}"));
            }
        }
    }
    if built == 0 {
        return Err(format!("{rel}: no stage runs cargo build"));
    }
    Ok(notes)
}

/// The build stage of docker/Dockerfile before issue 35 (it named the workspace members one by
/// one and missed `kernels` and `tests`), with its ignore file.
const OLD_DOCKERFILE: &str = "\
FROM rust:1-slim-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY shared shared
COPY server server
COPY trainer trainer
RUN --mount=type=cache,target=/usr/local/cargo/registry \\
    --mount=type=cache,target=/src/target \\
    cargo build --release --locked -p xdistill-server --bin teacher \\
    && cp target/release/teacher /usr/local/bin/teacher
";
const OLD_DOCKERIGNORE: &str = "target\n**/target\n.git\n.cache\nbench\ndocs\n*.safetensors\n";

/// The check catches the reported failure: the old file's context lacks workspace members
/// ("failed to load manifest for workspace member `…/kernels`").
#[test]
fn a_context_without_every_workspace_member_is_caught() {
    let err = check_context(&repo(), "old Dockerfile", OLD_DOCKERFILE, OLD_DOCKERIGNORE)
        .expect_err("the old Dockerfile's context must fail to load the workspace");
    assert!(
        err.contains("failed to load manifest for workspace member"),
        "{err}"
    );
}

/// The other failures the check looks for, on a two-crate workspace made here: a member left
/// out, a compile-time include left out, a COPY of something ignored, a binary or feature the
/// workspace lacks; and the same context passes when nothing is missing.
#[test]
fn the_context_check_catches_what_a_build_would_miss() {
    let ws = tempfile::tempdir().expect("tmp");
    let w = ws.path();
    let write = |rel: &str, text: &str| {
        let p = w.join(rel);
        std::fs::create_dir_all(p.parent().expect("a parent")).expect("mkdir");
        std::fs::write(p, text).expect("write");
    };
    write(
        "Cargo.toml",
        "[workspace]\nresolver = \"2\"\nmembers = [\"app\", \"extra\"]\n",
    );
    write(
        "app/Cargo.toml",
        "[package]\nname = \"app\"\nversion = \"0.1.0\"\nedition = \"2021\"\n\
         [features]\nfast = []\n",
    );
    // Spelled in two pieces so that this file holds no include of its own.
    let include = format!("include_{}!(\"../assets/words.txt\")", "str");
    write(
        "app/src/main.rs",
        &format!("const WORDS: &str = {include};\nfn main() {{ print!(\"{{WORDS}}\"); }}\n"),
    );
    write("app/assets/words.txt", "hello\n");
    write(
        "extra/Cargo.toml",
        "[package]\nname = \"extra\"\nversion = \"0.1.0\"\nedition = \"2021\"\n",
    );
    write("extra/src/lib.rs", "");
    write("notes/big.txt", "not needed\n");
    let lock = cargo()
        .args(["generate-lockfile", "--offline"])
        .current_dir(w)
        .output()
        .expect("cargo generate-lockfile");
    assert!(
        lock.status.success(),
        "{}",
        String::from_utf8_lossy(&lock.stderr)
    );
    let dockerfile = |copy: &str, build: &str| {
        format!(
            "FROM rust AS build\nWORKDIR /src\n{copy}\n\
             RUN cargo build --release --locked {build} && cp target/release/app /app\n\
             FROM debian AS run\nCOPY --from=build /app /app\n"
        )
    };
    let all = dockerfile("COPY . .", "-p app --bin app --features fast");
    let check = |df: &str, ignore: &str| check_context(w, "t", df, ignore);
    check(&all, "notes\n").expect("a complete context passes");
    let cases = [
        (
            all.clone(),
            "extra\n",
            "failed to load manifest for workspace member",
        ),
        (all.clone(), "app/assets\n", "includes"),
        (
            dockerfile(
                "COPY Cargo.toml Cargo.lock ./\nCOPY app app\nCOPY notes notes",
                "-p app",
            ),
            "notes\n",
            "not found in the build context",
        ),
        (
            dockerfile("COPY . .", "-p app --bin nope"),
            "",
            "--bin nope",
        ),
        (
            dockerfile("COPY . .", "-p app --features slow"),
            "",
            "--features slow",
        ),
        (
            dockerfile("COPY . .", "-p nope"),
            "",
            "names no workspace package",
        ),
    ];
    for (df, ignore, want) in cases {
        let err = check(&df, ignore).expect_err(want);
        assert!(err.contains(want), "want {want:?}, got: {err}");
    }
}

#[test]
fn every_dockerfile_context_holds_the_workspace() {
    let files = dockerfiles();
    assert!(files.len() >= 2, "{files:?}");
    let gitignore = read(".gitignore");
    for rel in &files {
        // Each Dockerfile has its own ignore file (one for the root would serve every file).
        let ignore_rel = ignore_file_of(rel).unwrap_or_else(|| panic!("{rel}: no ignore file"));
        assert_eq!(ignore_rel, format!("{rel}.dockerignore"));
        let ignore_text = read(&ignore_rel);
        let ignore = Ignore::parse(&ignore_text);
        // Local state stays out: every .gitignore entry (at the root when anchored, else at
        // any depth), the venvs, version control.
        for line in gitignore.lines().map(str::trim) {
            if line.is_empty() || line.starts_with('#') || line.starts_with('!') {
                continue;
            }
            let anchored = line.trim_end_matches('/').contains('/');
            let sample = line.trim_matches('/').replace('*', "x");
            let mut paths = vec![format!("{sample}/f")];
            if !anchored {
                paths.push(format!("server/src/{sample}/f"));
            }
            for p in paths {
                assert!(
                    ignore.excluded(&p),
                    "{ignore_rel} keeps {p} (.gitignore: {line})"
                );
            }
        }
        for p in [
            ".git/HEAD",
            "target/pyenv/bin/python",
            "x/hfenv/lib",
            "bench/x.py",
            "trainer/a.safetensors",
        ] {
            assert!(ignore.excluded(p), "{ignore_rel} keeps {p}");
        }
        let ctx = context_files(&repo(), &ignore);
        let bytes: u64 = ctx
            .iter()
            .map(|f| {
                std::fs::metadata(repo().join(f))
                    .map(|m| m.len())
                    .unwrap_or(0)
            })
            .sum();
        assert!(bytes < 64 << 20, "{rel}: a {bytes}-byte context");
        assert!(
            ctx.contains("Cargo.lock") && ctx.contains("LICENSE"),
            "{rel}"
        );
        // The whole workspace, whatever it is: the build copies the context, not a list.
        let text = read(rel);
        let notes =
            check_context(&repo(), rel, &text, &ignore_text).unwrap_or_else(|e| panic!("{e}"));
        for n in notes {
            eprintln!("note: {n}");
        }
        let df = Dockerfile::parse(rel, &text);
        let copies_context = df.stages.iter().flat_map(|s| &s.instrs).any(|i| {
            i.cmd == "COPY" && {
                let c = parse_copy(&i.args);
                c.from.is_none() && c.srcs == ["."]
            }
        });
        assert!(
            copies_context,
            "{rel}: the build stage copies the whole context (`COPY . .`)"
        );
        // Each binary copied into a runtime stage (from `/usr/local/bin`; other copies between
        // stages are libraries) comes from a build stage that builds it.
        for stage in &df.stages {
            for i in stage.instrs.iter().filter(|i| i.cmd == "COPY") {
                let c = parse_copy(&i.args);
                let Some(from) = c.from else { continue };
                if !c.srcs[0].starts_with("/usr/local/bin/") {
                    continue;
                }
                let builder = df.stage(&from);
                let run = builder
                    .instrs
                    .iter()
                    .find(|i| i.cmd == "RUN" && i.args.contains("cargo build"))
                    .unwrap_or_else(|| panic!("{rel}: stage {from} builds nothing"));
                let b = parse_cargo_build(&run.args).expect("cargo build");
                let bin = c.srcs[0].rsplit('/').next().expect("a name");
                assert!(
                    b.bins.iter().any(|x| x == bin),
                    "{rel}: {from} does not build {bin}"
                );
                assert_eq!(
                    b.copies.get(bin),
                    Some(&c.srcs[0]),
                    "{rel}: where {from} puts {bin}"
                );
            }
        }
    }
}

/// The `cargo build` of the stage a runtime stage copies `bin` from.
fn build_of(df: &Dockerfile, stage: &str, bin: &str) -> CargoBuild {
    let from = df
        .instrs(df.stage(stage))
        .filter(|i| i.cmd == "COPY")
        .map(|i| parse_copy(&i.args))
        .find(|c| c.srcs.iter().any(|s| s.ends_with(&format!("/{bin}"))))
        .and_then(|c| c.from)
        .unwrap_or_else(|| panic!("{}: stage {stage} copies no {bin}", df.rel));
    let run = df
        .instrs(df.stage(&from))
        .find(|i| i.cmd == "RUN" && i.args.contains("cargo build"))
        .unwrap_or_else(|| panic!("{}: stage {from} builds nothing", df.rel));
    parse_cargo_build(&run.args).expect("a cargo build")
}

/// The CUDA trainer image trains data parallel over NCCL, as docs/cuda.md says: its trainer is
/// built with the `nccl` feature, and the image's build stops unless the image carries
/// `libnccl.so.2` (which that trainer is linked against). The teacher links no NCCL.
#[test]
fn the_cuda_trainer_image_is_built_with_nccl_and_carries_it() {
    let rel = "docker/Dockerfile.cuda";
    let df = Dockerfile::parse(rel, &read(rel));
    let trainer = build_of(&df, "trainer", "trainer");
    assert!(
        trainer.features.iter().any(|f| f == "nccl"),
        "{rel}: the trainer is built without `--features nccl`: {:?}",
        trainer.features
    );
    let teacher = build_of(&df, "teacher", "teacher");
    assert!(
        teacher.features.iter().any(|f| f == "cuda")
            && !teacher.features.iter().any(|f| f == "nccl"),
        "{rel}: the teacher's features {:?}",
        teacher.features
    );
    // A RUN of the trainer stage (or its bases) that fails the build without libnccl.so.2.
    let checks = df.instrs(df.stage("trainer")).any(|i| {
        i.cmd == "RUN" && i.args.contains("libnccl\\.so\\.2") && i.args.contains("exit 1")
    });
    assert!(
        checks,
        "{rel}: no step of the trainer stage checks for libnccl.so.2"
    );
    // The Kubernetes manifests and docs launch the CUDA trainer image for NCCL runs.
    assert!(
        read("docs/cuda.md").contains("xdistill-trainer:cuda"),
        "docs/cuda.md names the image that trains over NCCL"
    );
}

/// Both CUDA images carry cuDNN for the fused attention (`XDISTILL_ATTENTION=cudnn`), the same
/// release whose headers the shim is built against (`scripts/build-cuda.sh`'s pins), and their
/// build stops where the loader would not find `libcudnn.so.9`.
#[test]
fn the_cuda_images_carry_the_cudnn_they_are_built_against() {
    let rel = "docker/Dockerfile.cuda";
    let df = Dockerfile::parse(rel, &read(rel));
    let script = read("scripts/build-cuda.sh");
    let pins = script
        .lines()
        .find_map(|l| l.strip_prefix("cudnn_pkgs=("))
        .expect("scripts/build-cuda.sh pins cuDNN's wheels (cudnn_pkgs=(...))")
        .trim_end_matches(')');
    for pin in pins.split_whitespace() {
        let fetched = df
            .instrs(df.stage("source"))
            .any(|i| i.cmd == "RUN" && i.args.contains(pin));
        assert!(fetched, "{rel}: the source stage does not fetch {pin}");
    }
    for target in ["teacher", "trainer"] {
        let stage = df.stage(target);
        let libs = df.instrs(stage).any(|i| {
            i.cmd == "COPY" && {
                let c = parse_copy(&i.args);
                c.from.as_deref() == Some("source")
                    && c.srcs.iter().any(|s| s.contains("nvidia/cudnn/lib"))
            }
        });
        assert!(libs, "{rel}: the {target} image copies no cuDNN libraries");
        let checks = df.instrs(stage).any(|i| {
            i.cmd == "RUN" && i.args.contains("libcudnn\\.so\\.9") && i.args.contains("exit 1")
        });
        assert!(
            checks,
            "{rel}: no step of the {target} image checks for libcudnn.so.9"
        );
    }
}

// ---- command lines -----------------------------------------------------------------------------

/// `XDISTILL_*` variables the binaries read outside their flags.
const NON_FLAG_VARIABLES: &[&str] = &["XDISTILL_SIMD"];

/// The teacher's arguments with `env` applied as the binary would (each `XDISTILL_*` variable
/// is the variable of one flag, which a flag on the command line overrides). A variable that
/// is no flag's is an error: clap would silently ignore a misspelt one.
fn teacher_args(argv: &[String], env: &BTreeMap<String, String>) -> Result<Args, String> {
    let cmd = Args::command();
    let mut full = vec!["teacher".to_string()];
    full.extend(argv.iter().cloned());
    for (k, v) in env {
        if !k.starts_with("XDISTILL_") || NON_FLAG_VARIABLES.contains(&k.as_str()) {
            continue;
        }
        let arg = cmd
            .get_arguments()
            .find(|a| a.get_env().is_some_and(|e| e == k.as_str()))
            .ok_or_else(|| format!("{k} is no flag's variable"))?;
        let long = arg.get_long().expect("a long flag");
        let flag = format!("--{long}");
        if argv
            .iter()
            .any(|a| *a == flag || a.starts_with(&format!("{flag}=")))
        {
            continue;
        }
        if arg.get_action().takes_values() {
            full.push(format!("{flag}={v}"));
        } else if !matches!(v.as_str(), "" | "0" | "false") {
            full.push(flag);
        }
    }
    let args = Args::try_parse_from(full).map_err(|e| e.to_string())?;
    args.check()?;
    Ok(args)
}

fn str_list(v: &serde_yaml::Value) -> Vec<String> {
    v.as_sequence()
        .map(|s| {
            s.iter()
                .map(|x| common::compose_defaults(x.as_str().expect("a string")))
                .collect()
        })
        .unwrap_or_default()
}

/// Image name → (Dockerfile, target), from compose's `build:` sections and docs/deploy.md's
/// table of images.
fn images() -> BTreeMap<String, (Dockerfile, String)> {
    let compose = yaml("docker/compose.yaml");
    let mut out: BTreeMap<String, (Dockerfile, String)> = BTreeMap::new();
    for (_, svc) in compose["services"].as_mapping().expect("services") {
        let build = &svc["build"];
        if !build.is_mapping() {
            continue;
        }
        assert_eq!(
            build["context"].as_str(),
            Some(".."),
            "the context is the repository"
        );
        let rel = build["dockerfile"]
            .as_str()
            .expect("a dockerfile")
            .to_string();
        let target = build["target"]
            .as_str()
            .unwrap_or_else(|| panic!("{rel}: compose names no target"))
            .to_string();
        let df = Dockerfile::parse(&rel, &read(&rel));
        df.stage(&target);
        let image = svc["image"].as_str().expect("an image name").to_string();
        if let Some((prev, t)) = out.get(&image) {
            assert_eq!(
                (prev.rel.as_str(), t.as_str()),
                (rel.as_str(), target.as_str()),
                "{image}"
            );
        }
        out.insert(image, (df, target));
    }
    // The names of docs/deploy.md's table, which compose must agree with: `xdistill-<target>`,
    // tagged `latest` from docker/Dockerfile and `cuda` from docker/Dockerfile.cuda (the
    // Kubernetes manifests name the CUDA images compose does not build).
    let table = read("docs/deploy.md");
    for (rel, tag) in [
        ("docker/Dockerfile", "latest"),
        ("docker/Dockerfile.cuda", "cuda"),
    ] {
        let df = Dockerfile::parse(rel, &read(rel));
        for target in ["teacher", "trainer"] {
            df.stage(target);
            let image = format!("xdistill-{target}:{tag}");
            assert!(
                table.contains(&format!("`{image}`")),
                "docs/deploy.md: {image}"
            );
            if let Some((prev, t)) = out.get(&image) {
                assert_eq!((prev.rel.as_str(), t.as_str()), (rel, target), "{image}");
            }
            out.insert(image, (df.clone(), target.to_string()));
        }
    }
    out
}

/// One way the teacher image is started.
struct Launch {
    what: String,
    argv: Vec<String>,
    env: BTreeMap<String, String>,
    /// The port the container publishes (EXPOSE, compose's container port, containerPort).
    port: u16,
}

#[test]
fn the_teacher_image_accepts_every_command_line_it_is_started_with() {
    let images = images();
    // The server's default batching window on `device` (5 ms where a GPU packs batches, 0 on
    // the CPU's forward per sequence).
    let default_wait_on = |device: &str| {
        let argv = ["--model", "m", "--device", device].map(String::from);
        teacher_args(&argv, &BTreeMap::new())
            .expect("defaults")
            .max_wait_ms()
    };
    let default_wait = default_wait_on("cpu");
    let mut launches = Vec::new();
    // 1. Each Dockerfile's teacher image as it starts: ENTRYPOINT + CMD with its ENV.
    for rel in dockerfiles() {
        let df = Dockerfile::parse(&rel, &read(&rel));
        let stage = df.stage("teacher");
        // The default target (`docker build` without --target) is the teacher.
        assert_eq!(
            df.stages.last().map(|s| s.name.as_str()),
            Some("teacher"),
            "{rel}"
        );
        let entry = df.exec(stage, "ENTRYPOINT");
        assert!(
            entry[0].ends_with("/teacher"),
            "{rel}: entrypoint {entry:?}"
        );
        let expose: u16 = df
            .last(stage, "EXPOSE")
            .and_then(|p| p.trim_end_matches("/tcp").parse().ok())
            .unwrap_or_else(|| panic!("{rel}: EXPOSE a port"));
        let mut argv = entry[1..].to_vec();
        argv.extend(df.exec(stage, "CMD"));
        let env = df.env(stage);
        let args = teacher_args(&argv, &env).unwrap_or_else(|e| panic!("{rel}: {e}"));
        // The HEALTHCHECK probes /health on the port the server listens on, with a start
        // period for loading, using a tool the image installs.
        let hc = df
            .last(stage, "HEALTHCHECK")
            .unwrap_or_else(|| panic!("{rel}: no HEALTHCHECK"));
        let (opts, cmd) = hc.split_once("CMD").expect("HEALTHCHECK … CMD …");
        let probe = exec_form(cmd.trim());
        let tool = probe[0].rsplit('/').next().expect("a tool");
        assert!(matches!(tool, "curl" | "wget"), "{rel}: {probe:?}");
        let installs = df.instrs(stage).any(|i| {
            i.cmd == "RUN"
                && i.args.contains("apt-get install")
                && words(&i.args).iter().any(|w| w == tool)
        });
        assert!(installs, "{rel}: {tool} is not installed in the image");
        let url = format!("http://127.0.0.1:{}/health", args.port);
        assert!(
            probe.contains(&url),
            "{rel}: {probe:?} does not probe {url}"
        );
        let start = words(opts)
            .iter()
            .find_map(|o| o.strip_prefix("--start-period=").map(str::to_string))
            .unwrap_or_else(|| panic!("{rel}: HEALTHCHECK without --start-period"));
        let secs: u64 = match start.strip_suffix('m') {
            Some(m) => m.parse::<u64>().expect("minutes") * 60,
            None => start.trim_end_matches('s').parse().expect("seconds"),
        };
        assert!(
            secs >= 120,
            "{rel}: start period {secs} s is shorter than a model load"
        );
        launches.push(Launch {
            what: format!("{rel} (ENTRYPOINT + CMD)"),
            argv,
            env,
            port: expose,
        });
    }
    // 2. The compose services that run a teacher image: `command:` replaces CMD; `environment:`
    // overlays the image's ENV.
    let compose = yaml("docker/compose.yaml");
    for (name, svc) in compose["services"].as_mapping().expect("services") {
        let name = name.as_str().expect("a name");
        let Some((df, target)) = svc["image"].as_str().and_then(|i| images.get(i)) else {
            continue;
        };
        if target != "teacher" {
            continue;
        }
        let stage = df.stage(target);
        let mut argv = df.exec(stage, "ENTRYPOINT")[1..].to_vec();
        argv.extend(str_list(&svc["command"]));
        let mut env = df.env(stage);
        for (k, v) in svc["environment"].as_mapping().into_iter().flatten() {
            env.insert(
                k.as_str().expect("a name").to_string(),
                common::compose_defaults(v.as_str().unwrap_or("")),
            );
        }
        // The published container port, or (replicas behind the balancer) the exposed one.
        let port = str_list(&svc["ports"])
            .first()
            .map(|p| {
                p.rsplit(':')
                    .next()
                    .and_then(|p| p.parse().ok())
                    .expect("a port")
            })
            .or_else(|| df.last(stage, "EXPOSE").and_then(|p| p.parse().ok()))
            .expect("a port");
        launches.push(Launch {
            what: format!("compose service {name}"),
            argv,
            env,
            port,
        });
    }
    // 3. The Kubernetes Deployment: `args` replaces CMD, `env` overlays ENV, and the pod runs as
    // the image's user.
    let dep = yaml("deploy/k8s/deployment.yaml");
    let pod = &dep["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    let (df, target) = &images[c["image"].as_str().expect("an image")];
    assert_eq!(target, "teacher");
    assert!(c["command"].is_null(), "the image's ENTRYPOINT runs");
    let stage = df.stage(target);
    assert_eq!(
        pod["securityContext"]["runAsUser"].as_u64(),
        Some(df.uid(stage))
    );
    let mut argv = df.exec(stage, "ENTRYPOINT")[1..].to_vec();
    argv.extend(str_list(&c["args"]));
    let mut env = df.env(stage);
    for e in c["env"].as_sequence().into_iter().flatten() {
        env.insert(
            e["name"].as_str().expect("a name").into(),
            e["value"].as_str().unwrap_or("").into(),
        );
    }
    launches.push(Launch {
        what: "deploy/k8s/deployment.yaml".into(),
        argv,
        env,
        port: c["ports"][0]["containerPort"].as_u64().expect("a port") as u16,
    });
    assert!(launches.len() >= 6, "{}", launches.len());

    let model = common::tiny_model("images-llama", "llama", "llama2", 1);
    for l in &launches {
        let args = teacher_args(&l.argv, &l.env).unwrap_or_else(|e| panic!("{}: {e}", l.what));
        // Reachable from outside the container, on the port it publishes.
        assert_eq!(args.host.to_string(), "0.0.0.0", "{}", l.what);
        assert_eq!(args.port, l.port, "{}", l.what);
        // The batching window is the server's own default, not a copy that can drift from it
        // (compose and Kubernetes once set 5 ms while the server's default is 0).
        assert_eq!(
            args.max_wait_ms(),
            default_wait_on(&args.device),
            "{}: --max-wait-ms",
            l.what
        );
        // The binary accepts it, in exactly this environment, with the model path pointed at a
        // real model (--check-args opens the model directory, not the device).
        let container_model = args.model.display().to_string();
        let swap = |s: &String| {
            if *s == container_model {
                model.display().to_string()
            } else {
                s.clone()
            }
        };
        let out = Command::new(common::teacher_bin())
            .args(l.argv.iter().map(swap))
            .arg("--check-args")
            .env_clear()
            .envs(l.env.iter().map(|(k, v)| (k.clone(), swap(v))))
            .output()
            .expect("running teacher");
        assert!(
            out.status.success(),
            "{}: teacher {:?} --check-args:\n{}",
            l.what,
            l.argv,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // A variable that is no flag's, or a value a flag refuses, is caught by the same check.
    let mut env = BTreeMap::new();
    env.insert("XDISTILL_MAX_WAIT".to_string(), "5".to_string());
    assert!(teacher_args(&["--model".into(), "m".into()], &env).is_err());
    env.clear();
    env.insert("XDISTILL_MAX_WAIT_MS".to_string(), "5".to_string());
    let a = teacher_args(&["--model".into(), "m".into()], &env).expect("parses");
    assert_ne!(
        a.max_wait_ms(),
        default_wait,
        "a copied 5 ms would be caught"
    );
}

// ---- the trainer image ---------------------------------------------------------------------------

/// The `trainer` of this build: beside `teacher` (`cargo test --workspace` builds both), or
/// `$XDISTILL_TRAINER_BIN`.
fn trainer_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("XDISTILL_TRAINER_BIN") {
        return PathBuf::from(p);
    }
    let p =
        common::teacher_bin().with_file_name(format!("trainer{}", std::env::consts::EXE_SUFFIX));
    assert!(
        p.is_file(),
        "no `trainer` at {}: this test runs the workspace's trainer binary, which `cargo test \
         --workspace` builds but `cargo test -p xdistill-server` does not; run `cargo build \
         -p xdistill-trainer-cli` first, or set $XDISTILL_TRAINER_BIN",
        p.display()
    );
    p
}

/// A tiny model with the llama2 tokenizer (teacher and student share it).
fn tiny(dir: &Path, name: &str, seed: u64) -> PathBuf {
    let out = dir.join(name);
    xdistill_shared::init::init_model_dir(&xdistill_shared::init::InitSpec {
        arch: "llama".into(),
        tokenizer: xdistill_testkit::tokenizer_json("llama2"),
        hidden_size: 32,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        intermediate_size: 64,
        head_dim: None,
        pad_vocab_to: 1,
        max_position_embeddings: 1024,
        tie_embeddings: false,
        init_std: 0.1,
        seed,
        out: out.clone(),
        features: Default::default(),
    })
    .expect("init-model");
    out
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for e in std::fs::read_dir(from).expect("read_dir").flatten() {
        let p = e.path();
        if p.is_dir() {
            copy_dir(&p, &to.join(e.file_name()));
        } else {
            std::fs::copy(&p, to.join(e.file_name())).expect("copy");
        }
    }
}

/// A container's view emulated under `root`: each mount point is `root/<mount point>`, so the
/// container's absolute paths map to `root` + path.
struct Container {
    root: PathBuf,
    mounts: Vec<String>,
}

impl Container {
    fn host(&self, container_path: &str) -> PathBuf {
        self.root.join(container_path.trim_start_matches('/'))
    }

    /// A command-line argument naming a path in a mount, moved under `root`.
    fn arg(&self, a: &str) -> String {
        for m in &self.mounts {
            if a == m || a.starts_with(&format!("{m}/")) {
                return self.host(a).display().to_string();
            }
        }
        a.to_string()
    }

    /// A config file's text with its quoted paths in mounts (`"/inputs/x"`, `"/output"`) moved
    /// under `root` (each quoted string once: a moved path is not moved again).
    fn text(&self, s: &str) -> String {
        s.split('"')
            .enumerate()
            .map(|(i, part)| {
                if i % 2 == 1 {
                    self.arg(part)
                } else {
                    part.to_string()
                }
            })
            .collect::<Vec<_>>()
            .join("\"")
    }
}

/// Runs the trainer image's entrypoint with `argv` in `env` (nothing else), working directory
/// `/` as in the image; returns stderr, failing the test on a non-zero exit.
fn run_trainer(
    what: &str,
    c: &Container,
    argv: &[String],
    env: &BTreeMap<String, String>,
) -> String {
    let out = Command::new(trainer_bin())
        .args(argv)
        .env_clear()
        .envs(env)
        .current_dir(&c.root)
        .output()
        .expect("running trainer");
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{what}: trainer {argv:?}:\n{err}");
    err
}

fn flag_value<'a>(argv: &'a [String], flag: &str) -> &'a str {
    let i = argv
        .iter()
        .position(|a| a == flag)
        .unwrap_or_else(|| panic!("{flag} missing from {argv:?}"));
    argv.get(i + 1)
        .map(String::as_str)
        .unwrap_or_else(|| panic!("{flag} has no value"))
}

/// A trainer Job file's pod of completion index 0, run as the trainer image runs it: the image's
/// ENTRYPOINT with the Job's args and environment (`env_over` replaces variables the Job sets,
/// `extra` adds arguments), the ConfigMap, the inputs and the output volume at their mount
/// points under `root`, the teacher's Service replaced by `teacher`. Two steps with a checkpoint
/// after each, then the same command again, as the pod's restart runs it: it resumes from the
/// first run's checkpoint.
fn run_job(
    rel: &str,
    images: &BTreeMap<String, (Dockerfile, String)>,
    root: PathBuf,
    student: &Path,
    teacher: &str,
    env_over: &[(&str, String)],
    extra: &[&str],
) {
    let docs = yaml_docs(rel);
    let job = docs.iter().find(|d| d["kind"] == "Job").expect("a Job");
    let pod = &job["spec"]["template"]["spec"];
    let ct = &pod["containers"][0];
    let (df, target) = &images[ct["image"].as_str().expect("an image")];
    assert_eq!(target, "trainer");
    assert!(ct["command"].is_null(), "the image's ENTRYPOINT runs");
    let stage = df.stage(target);
    assert_eq!(
        pod["securityContext"]["runAsUser"].as_u64(),
        Some(df.uid(stage))
    );
    let mut argv = df.exec(stage, "ENTRYPOINT")[1..].to_vec();
    argv.extend(str_list(&ct["args"]));
    let mut env = df.env(stage);
    for e in ct["env"].as_sequence().into_iter().flatten() {
        let name = e["name"].as_str().expect("a name");
        let value = match e["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
            // What Kubernetes gives the pod of an Indexed Job's completion index 0.
            Some("metadata.annotations['batch.kubernetes.io/job-completion-index']") => "0",
            Some(other) => panic!("{rel}: {name} from {other}"),
            None => e["value"].as_str().unwrap_or(""),
        };
        env.insert(name.into(), value.into());
    }
    for (name, value) in env_over {
        let old = env.insert(name.to_string(), value.clone());
        assert!(old.is_some(), "{rel}: the Job sets no {name}");
    }
    let mounts: Vec<String> = ct["volumeMounts"]
        .as_sequence()
        .expect("mounts")
        .iter()
        .map(|m| m["mountPath"].as_str().expect("a path").to_string())
        .collect();
    let container = Container { root, mounts };
    let (mut input_dir, mut output_dir) = (None, None);
    for m in ct["volumeMounts"].as_sequence().expect("mounts") {
        let path = m["mountPath"].as_str().expect("a path");
        let vol = pod["volumes"]
            .as_sequence()
            .expect("volumes")
            .iter()
            .find(|v| v["name"] == m["name"])
            .expect("the mount's volume");
        let host = container.host(path);
        std::fs::create_dir_all(&host).expect("mkdir");
        if let Some(cm) = vol["configMap"]["name"].as_str() {
            let cm = docs
                .iter()
                .find(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == cm)
                .expect("the ConfigMap is in the file");
            for (k, v) in cm["data"].as_mapping().expect("data") {
                let text = container.text(v.as_str().expect("text"));
                std::fs::write(host.join(k.as_str().expect("a key")), text).expect("write");
            }
        } else if vol["persistentVolumeClaim"].is_mapping() {
            // The read-only claim holds the inputs, the writable one receives the output (a
            // persistent volume: the checkpoints a restart resumes from outlive the pod).
            if m["readOnly"] == true {
                input_dir = Some(host);
            } else {
                output_dir = Some(host);
            }
        }
    }
    // The inputs volume as the Job's comment describes it: student/ and train.jsonl.
    let input_dir = input_dir.expect("a read-only inputs volume");
    copy_dir(student, &input_dir.join("student"));
    std::fs::copy(
        repo().join("configs/data/gsm8k_sample.jsonl"),
        input_dir.join("train.jsonl"),
    )
    .expect("data");
    // The teacher is the Service of service.yaml; here, the one just started.
    let svc = yaml("deploy/k8s/service.yaml");
    let url = format!(
        "http://{}:{}",
        svc["metadata"]["name"].as_str().expect("a name"),
        svc["spec"]["ports"][0]["port"].as_u64().expect("a port")
    );
    assert_eq!(flag_value(&argv, "--teacher-url"), url);
    let argv: Vec<String> = argv
        .iter()
        .map(|a| {
            if *a == url {
                teacher.to_string()
            } else {
                container.arg(a)
            }
        })
        .collect();
    // Two steps with a checkpoint after each (only the last step writes final/ instead), then
    // the same command again, as the pod's restart runs it: it finds step 1's checkpoint on the
    // output volume and resumes from it.
    let mut short = argv.clone();
    short.extend(extra.iter().map(|a| a.to_string()));
    short.extend(["--max-steps", "2", "--set", "checkpointing.save_period=1"].map(String::from));
    let log = run_trainer(rel, &container, &short, &env);
    assert!(
        log.contains("no checkpoint"),
        "the first run starts fresh:\n{log}"
    );
    let out_dir = output_dir.expect("a writable persistent output volume");
    for f in ["metrics.jsonl", "step_1", "final"] {
        assert!(out_dir.join(f).exists(), "no {f} on the output volume");
    }
    let log = run_trainer(&format!("{rel}, restarted"), &container, &short, &env);
    assert!(
        log.contains("resumed from") && log.contains("(step 1)"),
        "{log}"
    );
}

#[test]
fn the_trainer_image_runs_the_job_and_the_compose_service_against_a_teacher() {
    let images = images();
    for rel in dockerfiles() {
        let df = Dockerfile::parse(&rel, &read(&rel));
        let stage = df.stage("trainer");
        let entry = df.exec(stage, "ENTRYPOINT");
        assert!(
            entry[0].ends_with("/trainer") && entry.len() == 1,
            "{rel}: {entry:?}"
        );
        assert_ne!(df.uid(stage), 0, "{rel}: the trainer runs as root");
    }
    let tmp = tempfile::tempdir().expect("tmp");
    let models = tmp.path().join("models");
    let teacher_model = tiny(&models, "teacher", 1);
    let student = tiny(&models, "student", 2);
    let teacher = common::start_teacher(&teacher_model, &[]);

    // 1. The Kubernetes Job: the trainer image's ENTRYPOINT with the Job's args; the ConfigMap,
    // the inputs and the output volume at their mount points.
    run_job(
        "deploy/k8s/trainer-job.yaml",
        &images,
        tmp.path().join("job"),
        &student,
        &teacher.base,
        &[],
        &[],
    );
    // 2. The data-parallel Job's rank 0, as a world of one (the collectives between ranks are
    // the trainer's own tests): rank 0's address and port on loopback, and the CPU build runs
    // the GPU pod's config on the CPU.
    run_job(
        "deploy/k8s/trainer-dp-job.yaml",
        &images,
        tmp.path().join("dp-job"),
        &student,
        &teacher.base,
        &[
            ("WORLD_SIZE", "1".into()),
            ("MASTER_ADDR", "127.0.0.1".into()),
            (
                "XDISTILL_DIST_PORT",
                xdistill_testkit::free_port().to_string(),
            ),
        ],
        &[
            "--set",
            "policy.device=cpu",
            "--set",
            "policy.precision=f32",
        ],
    );

    // 3. The compose `trainer` service: the repository's configs/ read-only, runs/ writable
    // (holding the student, as the service's comment says), the `teacher` service's URL.
    let compose = yaml("docker/compose.yaml");
    let svc = &compose["services"]["trainer"];
    assert!(
        format!("{:?}", svc["profiles"]).contains("train"),
        "opt-in profile"
    );
    let (df, target) = &images[svc["image"].as_str().expect("an image")];
    assert_eq!(target, "trainer");
    let stage = df.stage(target);
    let user = common::compose_defaults(svc["user"].as_str().unwrap_or(""));
    assert_eq!(
        user.split(':').next(),
        Some(df.uid(stage).to_string().as_str())
    );
    assert_eq!(
        svc["depends_on"]["teacher"]["condition"].as_str(),
        Some("service_healthy")
    );
    let mut argv = df.exec(stage, "ENTRYPOINT")[1..].to_vec();
    argv.extend(str_list(&svc["command"]));
    let mut env = df.env(stage);
    for (k, v) in svc["environment"].as_mapping().into_iter().flatten() {
        env.insert(
            k.as_str().expect("a name").into(),
            common::compose_defaults(v.as_str().unwrap_or("")),
        );
    }
    let root = tmp.path().join("compose");
    let mut mounts = Vec::new();
    for v in str_list(&svc["volumes"]) {
        let parts: Vec<&str> = v.split(':').collect();
        let (src, dst) = (parts[0], parts[1]);
        let host = root.join(dst.trim_start_matches('/'));
        if parts.get(2) == Some(&"ro") {
            // A read-only bind mount of the repository (relative to docker/).
            copy_dir(&repo().join("docker").join(src), &host);
        } else {
            std::fs::create_dir_all(&host).expect("mkdir");
            // runs/: the student made beforehand.
            copy_dir(&student, &host.join("student"));
        }
        mounts.push(dst.to_string());
    }
    let container = Container { root, mounts };
    let url = flag_value(&argv, "--teacher-url").to_string();
    let teacher_svc = &compose["services"]["teacher"];
    assert_eq!(
        url, "http://teacher:8000",
        "the teacher service at its container port"
    );
    assert!(teacher_svc["healthcheck"].is_mapping());
    let mut argv: Vec<String> = argv
        .iter()
        .map(|a| {
            if *a == url {
                teacher.base.clone()
            } else {
                container.arg(a)
            }
        })
        .collect();
    argv.extend(["--max-steps".into(), "1".into()]);
    run_trainer("compose trainer", &container, &argv, &env);
    let runs = container.host("/work/runs");
    assert!(
        runs.join("off_policy").join("metrics.jsonl").is_file(),
        "configs/off_policy.toml writes runs/off_policy"
    );
    // The image's default command works.
    let out = Command::new(trainer_bin())
        .args(df.exec(stage, "CMD"))
        .output()
        .expect("trainer --help");
    assert!(out.status.success());
}
