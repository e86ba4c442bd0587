//! Where the real tokenizers (and the optional real text) are found: at run time, from the
//! environment, the running binary and the current directory — never from where the code was
//! compiled, so a binary that is moved or installed elsewhere still finds them.

use std::path::{Path, PathBuf};

/// Names of the tokenizers `scripts/get-tokenizers.sh` and `trainer demo` provide.
pub const TOKENIZER_NAMES: [&str; 5] = ["qwen3", "llama3", "llama2", "gemma3", "deepseek_v3"];

/// The environment variable naming a folder that holds `NAME/tokenizer.json`.
pub const TOKENIZERS_ENV: &str = "XDISTILL_TOKENIZERS";

/// The repository root this crate was compiled in (the parent of its manifest directory).
/// For tests and benchmarks, which run inside the checkout; run-time lookups use
/// [`tokenizer_search_dirs`] instead.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// Whether `dir` is the root of an xdistill checkout.
fn is_checkout(dir: &Path) -> bool {
    dir.join("Cargo.toml").is_file()
        && dir.join("shared").join("Cargo.toml").is_file()
        && dir.join("scripts").join("get-tokenizers.sh").is_file()
}

/// The checkout holding `start` (itself or its nearest ancestor that is one).
fn checkout_above(start: &Path) -> Option<PathBuf> {
    start
        .ancestors()
        .find(|d| is_checkout(d))
        .map(Path::to_path_buf)
}

/// The per-user cache folder of xdistill: `$XDG_CACHE_HOME/xdistill`, else
/// `~/Library/Caches/xdistill` on macOS and `~/.cache/xdistill` elsewhere.
pub fn user_cache_dir() -> Option<PathBuf> {
    if let Some(x) = std::env::var_os("XDG_CACHE_HOME").filter(|x| !x.is_empty()) {
        return Some(PathBuf::from(x).join("xdistill"));
    }
    let home = PathBuf::from(std::env::var_os("HOME").filter(|h| !h.is_empty())?);
    Some(if cfg!(target_os = "macos") {
        home.join("Library").join("Caches").join("xdistill")
    } else {
        home.join(".cache").join("xdistill")
    })
}

/// Where fetched tokenizers go: `<user cache>/tokenizers`.
pub fn tokenizer_cache_dir() -> Option<PathBuf> {
    user_cache_dir().map(|d| d.join("tokenizers"))
}

/// The folders searched for `NAME/tokenizer.json`, in order:
/// 1. `$XDISTILL_TOKENIZERS`;
/// 2. beside the running binary (`<bin dir>/tokenizers`), then the checkout holding the binary
///    (`target/<profile>/…`): its `.cache/tokenizers` (what `scripts/get-tokenizers.sh`
///    fills) and a `shared/tokenizers` folder beside it (where this project's development
///    machines keep them);
/// 3. the same two folders of the checkout holding the current directory;
/// 4. the user cache ([`tokenizer_cache_dir`], where `trainer demo` fetches them).
pub fn tokenizer_search_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(d) = std::env::var_os(TOKENIZERS_ENV).filter(|d| !d.is_empty()) {
        dirs.push(PathBuf::from(d));
    }
    let exe_dir = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(Path::to_path_buf));
    if let Some(d) = &exe_dir {
        dirs.push(d.join("tokenizers"));
    }
    let cwd = std::env::current_dir().ok();
    for root in [exe_dir.as_deref(), cwd.as_deref()]
        .into_iter()
        .flatten()
        .filter_map(checkout_above)
    {
        dirs.push(root.join(".cache").join("tokenizers"));
        if let Some(parent) = root.parent() {
            dirs.push(parent.join("shared").join("tokenizers"));
        }
    }
    dirs.extend(tokenizer_cache_dir());
    let mut seen = std::collections::HashSet::new();
    dirs.retain(|d| seen.insert(d.clone()));
    dirs
}

/// `NAME/tokenizer.json` in the first searched folder that has it ([`tokenizer_search_dirs`]).
pub fn find_tokenizer(name: &str) -> Option<PathBuf> {
    tokenizer_search_dirs()
        .into_iter()
        .map(|d| d.join(name).join("tokenizer.json"))
        .find(|p| p.is_file())
}

/// The first searched folder holding every tokenizer of [`TOKENIZER_NAMES`].
pub fn tokenizers_dir() -> Option<PathBuf> {
    tokenizer_search_dirs().into_iter().find(|d| {
        TOKENIZER_NAMES
            .iter()
            .all(|n| d.join(n).join("tokenizer.json").is_file())
    })
}

/// The environment variable naming a folder of real text (`gsm8k/train.jsonl`, …).
pub const DATA_ENV: &str = "XDISTILL_DATA";

/// Real text (GSM8K) for the alignment benchmark and an optional evaluation test:
/// `$XDISTILL_DATA`, else a `shared/data` folder beside the checkout, if present. Optional: what
/// uses it skips or says so without it.
pub fn shared_data_dir() -> Option<PathBuf> {
    let from_env = std::env::var_os(DATA_ENV)
        .filter(|d| !d.is_empty())
        .map(PathBuf::from);
    let beside = repo_root().parent().map(|p| p.join("shared").join("data"));
    [from_env, beside]
        .into_iter()
        .flatten()
        .find(|d| d.is_dir())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_checkout_is_found_from_inside_it_and_not_elsewhere() {
        let root = repo_root();
        assert!(is_checkout(&root));
        assert_eq!(checkout_above(&root.join("shared").join("src")), Some(root));
        let tmp = std::env::temp_dir().join(format!("xdistill-paths-{}", std::process::id()));
        std::fs::create_dir_all(tmp.join("a")).unwrap();
        assert_eq!(checkout_above(&tmp.join("a")), None);
        std::fs::remove_dir_all(&tmp).unwrap();
    }

    #[test]
    fn search_dirs_start_with_the_variable_and_end_with_the_user_cache() {
        // This test binary runs from target/<profile>/deps inside the checkout.
        let dirs = tokenizer_search_dirs();
        let root = repo_root();
        assert!(
            dirs.contains(&root.join(".cache").join("tokenizers")),
            "{dirs:?}"
        );
        if let Some(d) = std::env::var_os(TOKENIZERS_ENV).filter(|d| !d.is_empty()) {
            assert_eq!(dirs[0], PathBuf::from(d));
        }
        if let Some(c) = tokenizer_cache_dir() {
            assert_eq!(dirs.last(), Some(&c));
        }
        let unique: std::collections::HashSet<_> = dirs.iter().collect();
        assert_eq!(unique.len(), dirs.len(), "no folder twice");
    }
}
