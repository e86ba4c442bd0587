//! Checks of the source tree's shape: import cycles between the modules of a directory, and the
//! repository paths `docs/architecture.md` names. Text-level (no compiler): cheap enough to run
//! as unit tests.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

/// One import cycle: the modules of a strongly connected component and, for each edge between
/// them, the first place (`file:line`) that makes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cycle {
    pub modules: Vec<String>,
    pub edges: Vec<(String, String, String)>,
}

impl std::fmt::Display for Cycle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "cycle among {{{}}}:", self.modules.join(", "))?;
        for (from, to, at) in &self.edges {
            write!(f, "\n  {from} -> {to}  ({at})")?;
        }
        Ok(())
    }
}

/// The import cycles among the modules directly under `dir` (a directory below some crate's
/// `src/`; its files and subfolders are the modules, each subfolder one module with its
/// children). Edges come from `crate::`, `super::` and `self::` paths and relative `use` trees
/// in non-test code (`#[cfg(test)]` items, `tests.rs` and files below a `tests/` folder are skipped: a test may
/// import anything); a path through the directory's root file's `pub use` counts as a path to
/// the module it re-exports.
pub fn import_cycles(dir: &Path) -> io::Result<Vec<Cycle>> {
    let (crate_src, prefix) = crate_src_and_prefix(dir)?;
    let root_file = if prefix.is_empty() {
        dir.join("lib.rs")
    } else if dir.join("mod.rs").exists() {
        dir.join("mod.rs")
    } else {
        dir.with_extension("rs")
    };
    let nodes = child_modules(dir)?;
    let mut files = Vec::new();
    rust_files(dir, &mut files)?;
    // Names the root file re-exports from a child module: `pub use decoder::{Decoder, KvCache}`.
    let mut reexports: BTreeMap<String, String> = BTreeMap::new();
    if let Ok(text) = fs::read_to_string(&root_file) {
        for (path, _) in use_paths(&strip_tests(&strip_comments(&text)), true) {
            if let (Some(first), Some(last)) = (path.first(), path.last()) {
                if nodes.contains(first) {
                    reexports.insert(last.clone(), first.clone());
                }
            }
        }
    }
    let mut edges: BTreeMap<(String, String), String> = BTreeMap::new();
    for file in &files {
        if *file == root_file || is_test_file(file) || file.file_name() == Some("main.rs".as_ref())
        {
            continue;
        }
        let rel = file.strip_prefix(dir).map_err(io::Error::other)?;
        let from = rel
            .components()
            .next()
            .map(|c| {
                c.as_os_str()
                    .to_string_lossy()
                    .trim_end_matches(".rs")
                    .to_string()
            })
            .unwrap_or_default();
        let module = module_path(&prefix, rel);
        let text = strip_tests(&strip_comments(&fs::read_to_string(file)?));
        for (path, line) in use_paths(&text, false) {
            let Some(abs) = resolve(&path, &module, file, &crate_src) else {
                continue;
            };
            if abs.len() <= prefix.len() || abs[..prefix.len()] != prefix[..] {
                continue;
            }
            let name = &abs[prefix.len()];
            let to = if nodes.contains(name) {
                name.clone()
            } else if let Some(m) = reexports.get(name) {
                m.clone()
            } else {
                continue;
            };
            if to != from {
                let at = format!("{}:{line}", rel.display());
                edges.entry((from.clone(), to)).or_insert(at);
            }
        }
    }
    Ok(cycles(&nodes, &edges))
}

/// The backticked repository paths in a markdown file that name no file or folder of the
/// repository. A backticked token counts as a path when it has a `/` or a file extension
/// (`.rs`, `.md`, `.py`, `.json`, `.toml`, `.sh`); `{a,b}` alternatives are expanded, a
/// trailing `::item` dropped and `dir/*` read as `dir`. Tables name files relative to the folder they are about, so a
/// token matches any repository path that ends with it.
pub fn missing_doc_paths(repo: &Path, doc: &Path) -> io::Result<Vec<String>> {
    let text = fs::read_to_string(doc)?;
    let mut all = Vec::new();
    repo_paths(repo, repo, &mut all)?;
    let mut missing = Vec::new();
    for token in text.split('`').skip(1).step_by(2) {
        let token = token.split("::").next().unwrap_or(token).trim();
        let exts = [".rs", ".md", ".py", ".json", ".toml", ".sh"];
        let is_path = !token.contains(' ')
            && !token.is_empty()
            && (token.contains('/') || exts.iter().any(|e| token.ends_with(e)))
            && !token.starts_with('/');
        if !is_path {
            continue;
        }
        for path in expand_braces(token) {
            // `compat/*`: the folder.
            let path = path.trim_end_matches('*').trim_end_matches('/');
            let suffix = format!("/{path}");
            if !all.iter().any(|p| p == path || p.ends_with(&suffix)) {
                missing.push(path.to_string());
            }
        }
    }
    Ok(missing)
}

/// The places (`file:line`) below `dir` that lay a module's tests out another way than the one
/// layout: a `tests` child module, inline or in `<module>/tests.rs`, never a `#[path]` file.
pub fn path_attributes(dir: &Path) -> io::Result<Vec<String>> {
    let mut files = Vec::new();
    rust_files(dir, &mut files)?;
    let mut found = Vec::new();
    for file in files {
        let text = fs::read_to_string(&file)?;
        for (i, line) in text.lines().enumerate() {
            if line.trim_start().starts_with("#[path") {
                found.push(format!("{}:{}", file.display(), i + 1));
            }
        }
    }
    Ok(found)
}

fn repo_paths(repo: &Path, dir: &Path, out: &mut Vec<String>) -> io::Result<()> {
    for entry in fs::read_dir(dir)? {
        let path = entry?.path();
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        if name.starts_with('.') || name == "target" || name == "node_modules" {
            continue;
        }
        if let Ok(rel) = path.strip_prefix(repo) {
            out.push(rel.to_string_lossy().into_owned());
        }
        if path.is_dir() {
            repo_paths(repo, &path, out)?;
        }
    }
    Ok(())
}

fn expand_braces(s: &str) -> Vec<String> {
    let (Some(open), Some(close)) = (s.find('{'), s.find('}')) else {
        return vec![s.to_string()];
    };
    if close < open {
        return vec![s.to_string()];
    }
    let (head, tail) = (&s[..open], &s[close + 1..]);
    s[open + 1..close]
        .split(',')
        .flat_map(|alt| expand_braces(&format!("{head}{}{tail}", alt.trim())))
        .collect()
}

fn crate_src_and_prefix(dir: &Path) -> io::Result<(PathBuf, Vec<String>)> {
    let mut prefix = Vec::new();
    let mut at = dir;
    while at.file_name() != Some("src".as_ref()) {
        prefix.push(
            at.file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned(),
        );
        at = at
            .parent()
            .ok_or_else(|| io::Error::other(format!("{} is under no src/", dir.display())))?;
    }
    prefix.reverse();
    Ok((at.to_path_buf(), prefix))
}

fn child_modules(dir: &Path) -> io::Result<BTreeSet<String>> {
    let mut out = BTreeSet::new();
    for entry in fs::read_dir(dir)? {
        let path = entry?.path();
        let name = path
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        if path.is_dir() {
            out.insert(name);
        } else if let Some(stem) = name.strip_suffix(".rs") {
            if !["lib", "main", "mod"].contains(&stem) && !is_test_file(&path) {
                out.insert(stem.to_string());
            }
        }
    }
    Ok(out)
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) -> io::Result<()> {
    for entry in fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            rust_files(&path, out)?;
        } else if path.extension() == Some("rs".as_ref()) {
            out.push(path);
        }
    }
    out.sort();
    Ok(())
}

/// A unit-test module's file: `tests.rs`, or a file below a `tests/` folder of a crate's `src/`.
fn is_test_file(path: &Path) -> bool {
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let in_src = path.components().skip_while(|c| c.as_os_str() != "src");
    name == "tests.rs" || in_src.into_iter().any(|c| c.as_os_str() == "tests")
}

/// The module path of a file relative to `dir`: `compat/admit.rs` → prefix + [compat, admit].
fn module_path(prefix: &[String], rel: &Path) -> Vec<String> {
    let mut path = prefix.to_vec();
    for c in rel.components() {
        path.push(
            c.as_os_str()
                .to_string_lossy()
                .trim_end_matches(".rs")
                .to_string(),
        );
    }
    if path.last().map(String::as_str) == Some("mod") {
        path.pop();
    }
    path
}

/// A path's absolute module path, or `None` for an external crate's.
fn resolve(
    path: &[String],
    module: &[String],
    file: &Path,
    crate_src: &Path,
) -> Option<Vec<String>> {
    let first = path.first()?;
    match first.as_str() {
        "crate" => Some(path[1..].to_vec()),
        "self" => Some([module, &path[1..]].concat()),
        "super" => {
            let ups = path.iter().take_while(|s| *s == "super").count();
            let base = module.get(..module.len().checked_sub(ups)?)?;
            Some([base, &path[ups..]].concat())
        }
        name => {
            // A relative path that starts at a child module of this file's module.
            let own_dir = if file.file_name() == Some("mod.rs".as_ref()) {
                file.parent()?.to_path_buf()
            } else {
                file.with_extension("")
            };
            let _ = crate_src;
            let child = own_dir.join(name);
            (child.with_extension("rs").exists() || child.is_dir()).then(|| [module, path].concat())
        }
    }
}

/// Every module path in `text` with its line: `use` trees expanded, and inline
/// `crate::`/`super::`/`self::` paths. With `uses_only`, only `use` trees.
fn use_paths(text: &str, uses_only: bool) -> Vec<(Vec<String>, usize)> {
    let mut out = Vec::new();
    let bytes = text.as_bytes();
    let line_at = |i: usize| text[..i].matches('\n').count() + 1;
    let is_ident = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
    let mut i = 0;
    while i < bytes.len() {
        if !text.is_char_boundary(i) {
            i += 1;
            continue;
        }
        let word_start = i == 0 || !is_ident(bytes[i - 1]);
        if word_start
            && text[i..].starts_with("use")
            && bytes.get(i + 3).is_some_and(|b| b.is_ascii_whitespace())
        {
            let end = text[i..].find(';').map_or(bytes.len(), |e| i + e);
            let tree: String = text[i + 3..end]
                .replace(" as ", " @ ")
                .chars()
                .filter(|c| !c.is_whitespace())
                .collect();
            for p in expand_use_tree(&tree) {
                out.push((p, line_at(i)));
            }
            i = end;
            continue;
        }
        if !uses_only && word_start {
            for root in ["crate::", "super::", "self::"] {
                if text[i..].starts_with(root) {
                    let end = text[i..]
                        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
                        .map_or(bytes.len(), |e| i + e);
                    let segs: Vec<String> = text[i..end]
                        .split("::")
                        .filter(|s| !s.is_empty())
                        .map(str::to_string)
                        .collect();
                    out.push((segs, line_at(i)));
                    i = end;
                    break;
                }
            }
        }
        i += 1;
    }
    out
}

/// `a::{b, c::{d, e}}` → `[a, b]`, `[a, c, d]`, `[a, c, e]` (`self` in a group names the
/// prefix itself; `as` renames dropped).
fn expand_use_tree(tree: &str) -> Vec<Vec<String>> {
    let tree = tree.strip_prefix("::").unwrap_or(tree);
    let Some(open) = tree.find('{') else {
        let path = tree.split('@').next().unwrap_or(tree);
        let segs: Vec<String> = path
            .split("::")
            .filter(|s| !s.is_empty() && *s != "*")
            .map(str::to_string)
            .collect();
        return if segs.is_empty() { vec![] } else { vec![segs] };
    };
    let head: Vec<String> = tree[..open]
        .split("::")
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect();
    let close = tree.rfind('}').unwrap_or(tree.len());
    let inner = &tree[open + 1..close.max(open + 1)];
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0, 0);
    for (j, c) in inner.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&inner[start..j]);
                start = j + 1;
            }
            _ => {}
        }
    }
    parts.push(&inner[start..]);
    let mut out = Vec::new();
    for part in parts.into_iter().filter(|p| !p.is_empty()) {
        if part == "self" {
            out.push(head.clone());
            continue;
        }
        for tail in expand_use_tree(part) {
            out.push([head.clone(), tail].concat());
        }
    }
    if out.is_empty() && !head.is_empty() {
        out.push(head);
    }
    out
}

/// The text with comments blanked (newlines kept, so line numbers hold) and string and char
/// literals emptied.
fn strip_comments(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i..].starts_with(b"//") {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i..].starts_with(b"/*") {
            let mut depth = 0;
            while i < b.len() {
                if b[i..].starts_with(b"/*") {
                    depth += 1;
                    i += 2;
                } else if b[i..].starts_with(b"*/") {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    if b[i] == b'\n' {
                        out.push(b'\n');
                    }
                    i += 1;
                }
            }
        } else if b[i] == b'r'
            && (b.get(i + 1) == Some(&b'"') || b.get(i + 1) == Some(&b'#'))
            && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_'))
        {
            let hashes = b[i + 1..].iter().take_while(|&&c| c == b'#').count();
            if b.get(i + 1 + hashes) != Some(&b'"') {
                out.push(b[i]);
                i += 1;
                continue;
            }
            let close: Vec<u8> = std::iter::once(b'"')
                .chain(std::iter::repeat_n(b'#', hashes))
                .collect();
            i += 2 + hashes;
            while i < b.len() && !b[i..].starts_with(&close) {
                if b[i] == b'\n' {
                    out.push(b'\n');
                }
                i += 1;
            }
            i += close.len();
            out.extend_from_slice(b"\"\"");
        } else if b[i] == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' {
                    i += 1;
                }
                if b.get(i) == Some(&b'\n') {
                    out.push(b'\n');
                }
                i += 1;
            }
            i += 1;
            out.extend_from_slice(b"\"\"");
        } else if b[i] == b'\'' {
            // A char literal ('x', '\n', '"') or a lifetime ('a).
            if b.get(i + 1) == Some(&b'\\') {
                let end = b[i + 2..]
                    .iter()
                    .position(|&c| c == b'\'')
                    .map_or(b.len(), |p| i + 3 + p);
                i = end;
            } else if b.get(i + 2) == Some(&b'\'') {
                i += 3;
            } else {
                out.push(b[i]);
                i += 1;
            }
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The text with `#[cfg(test)]` items blanked (newlines kept).
fn strip_tests(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let item = &rest[at..];
        let (mut depth, mut end) = (0usize, item.len());
        for (j, c) in item.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        end = j + 1;
                        break;
                    }
                }
                ';' if depth == 0 => {
                    end = j + 1;
                    break;
                }
                _ => {}
            }
        }
        out.extend(item[..end].chars().filter(|&c| c == '\n'));
        rest = &item[end..];
    }
    out.push_str(rest);
    out
}

/// The strongly connected components of more than one module (Tarjan), sorted.
fn cycles(nodes: &BTreeSet<String>, edges: &BTreeMap<(String, String), String>) -> Vec<Cycle> {
    let names: Vec<&String> = nodes.iter().collect();
    let idx = |n: &str| names.iter().position(|m| *m == n);
    let mut adj = vec![Vec::new(); names.len()];
    for (from, to) in edges.keys() {
        if let (Some(a), Some(b)) = (idx(from), idx(to)) {
            adj[a].push(b);
        }
    }
    struct Tarjan<'a> {
        adj: &'a [Vec<usize>],
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        on: Vec<bool>,
        stack: Vec<usize>,
        next: usize,
        out: Vec<Vec<usize>>,
    }
    fn visit(t: &mut Tarjan, v: usize) {
        t.index[v] = Some(t.next);
        t.low[v] = t.next;
        t.next += 1;
        t.stack.push(v);
        t.on[v] = true;
        for &w in &t.adj[v] {
            match t.index[w] {
                None => {
                    visit(t, w);
                    t.low[v] = t.low[v].min(t.low[w]);
                }
                Some(iw) if t.on[w] => t.low[v] = t.low[v].min(iw),
                _ => {}
            }
        }
        if Some(t.low[v]) == t.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = t.stack.pop() {
                t.on[w] = false;
                comp.push(w);
                if w == v {
                    break;
                }
            }
            t.out.push(comp);
        }
    }
    let n = names.len();
    let mut t = Tarjan {
        adj: &adj,
        index: vec![None; n],
        low: vec![0; n],
        on: vec![false; n],
        stack: Vec::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in 0..n {
        if t.index[v].is_none() {
            visit(&mut t, v);
        }
    }
    let mut found: Vec<Cycle> = t
        .out
        .into_iter()
        .filter(|c| c.len() > 1)
        .map(|comp| {
            let mut modules: Vec<String> = comp.iter().map(|&i| names[i].clone()).collect();
            modules.sort();
            let edges = edges
                .iter()
                .filter(|((a, b), _)| modules.contains(a) && modules.contains(b))
                .map(|((a, b), at)| (a.clone(), b.clone(), at.clone()))
                .collect();
            Cycle { modules, edges }
        })
        .collect();
    found.sort_by(|a, b| a.modules.cmp(&b.modules));
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The server has no import cycle between its modules, nor has the model package (the
    /// architectures' files read a resolved `LayerSpec` and the facts' types, never the
    /// configuration or the table), the trainer's training loop (`train/`: the step, the
    /// pairings, the teachers, batch preparation), its pairings or its losses.
    #[test]
    fn no_import_cycles_in_server_and_model() {
        let root = crate::repo_root();
        let server = import_cycles(&root.join("server/src")).expect("reading server/src");
        let model = import_cycles(&root.join("shared/src/model")).expect("reading the model");
        let mut trainer = vec![];
        for dir in [
            "trainer/src/train",
            "trainer/src/train/pairing",
            "trainer/src/loss",
        ] {
            trainer.extend(import_cycles(&root.join(dir)).expect("reading the trainer"));
        }
        for c in server.iter().chain(&model).chain(&trainer) {
            println!("{c}");
        }
        assert!(
            server.is_empty(),
            "import cycles in server/src: {server:#?}"
        );
        assert!(
            trainer.is_empty(),
            "import cycles in the trainer's training loop, pairings or losses: {trainer:#?}"
        );
        assert!(
            model.is_empty(),
            "import cycles in shared/src/model: {model:#?}"
        );
    }

    /// The checker finds a cycle through a `use` tree, an inline `super::` path and a root
    /// re-export, and none through test code or comments.
    #[test]
    fn finds_a_planted_cycle() {
        let base = std::env::temp_dir().join(format!("xdistill-cycles-{}", std::process::id()));
        let dir = base.join("src/pkg");
        fs::create_dir_all(&dir).unwrap();
        fs::write(
            dir.join("mod.rs"),
            "mod a;\nmod b;\nmod c;\npub use c::Thing;\n",
        )
        .unwrap();
        fs::write(dir.join("a.rs"), "use super::{b::{self, B}, x};\n").unwrap();
        fs::write(
            dir.join("b.rs"),
            "// crate::pkg::c::X\nfn f() { super::Thing::new(); }\n",
        )
        .unwrap();
        fs::write(
            dir.join("c.rs"),
            "use crate::pkg::a::A;\n#[cfg(test)]\nmod t { use super::super::b; }\n",
        )
        .unwrap();
        let found = import_cycles(&dir).unwrap();
        let planted = found
            .iter()
            .map(|c| c.modules.join(","))
            .collect::<Vec<_>>();
        fs::write(
            dir.join("c.rs"),
            "#[cfg(test)]\nmod t { use crate::pkg::a::A; }\n",
        )
        .unwrap();
        let after = import_cycles(&dir).unwrap();
        let _ = fs::remove_dir_all(&base);
        assert_eq!(planted, ["a,b,c"], "{found:?}");
        assert!(after.is_empty(), "{after:?}");
    }

    /// Unit tests follow one layout in every crate's sources (docs/architecture.md).
    #[test]
    fn unit_tests_have_one_layout() {
        let root = crate::repo_root();
        let mut found = vec![];
        for src in [
            "shared/src",
            "server/src",
            "kernels/src",
            "kernels/cpu/src",
            "kernels/cudnn/src",
            "trainer/src",
            "trainer/cli/src",
            "trainer/demo/src",
            "testkit/src",
        ] {
            found.extend(path_attributes(&root.join(src)).expect("reading the sources"));
        }
        assert!(found.is_empty(), "#[path] test files: {found:?}");
        // The check sees one where there is one.
        let dir = std::env::temp_dir().join(format!("xdistill-layout-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        fs::write(
            dir.join("m.rs"),
            "#[cfg(test)]\n#[path = \"m_tests.rs\"]\nmod tests;\n",
        )
        .unwrap();
        let planted = path_attributes(&dir).unwrap();
        let _ = fs::remove_dir_all(&dir);
        assert_eq!(planted.len(), 1, "{planted:?}");
    }

    /// Every repository path `docs/architecture.md` names in backticks exists.
    #[test]
    fn architecture_doc_names_real_paths() {
        let root = crate::repo_root();
        let missing = missing_doc_paths(&root, &root.join("docs/architecture.md")).unwrap();
        assert!(
            missing.is_empty(),
            "docs/architecture.md names paths that do not exist: {missing:?}"
        );
    }
}
