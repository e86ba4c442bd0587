//! Locating the real tokenizers used by tests, benchmarks and the demo.

use std::path::{Path, PathBuf};

/// Names of the tokenizers `scripts/get-tokenizers.sh` provides.
pub const TOKENIZER_NAMES: [&str; 5] = ["qwen3", "llama3", "llama2", "gemma3", "deepseek_v3"];

/// The repository root (parent of this crate's manifest directory).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// Folder holding `NAME/tokenizer.json` for every tokenizer: `$XDISTILL_TOKENIZERS`, then
/// `../shared/tokenizers` beside the checkout, then `.cache/tokenizers` (filled by
/// `scripts/get-tokenizers.sh`).
pub fn tokenizers_dir() -> Option<PathBuf> {
    let root = repo_root();
    let candidates = [
        std::env::var_os("XDISTILL_TOKENIZERS").map(PathBuf::from),
        Some(root.join("..").join("shared").join("tokenizers")),
        Some(root.join(".cache").join("tokenizers")),
    ];
    candidates.into_iter().flatten().find(|d| {
        TOKENIZER_NAMES
            .iter()
            .all(|n| d.join(n).join("tokenizer.json").is_file())
    })
}

/// Path of `NAME/tokenizer.json`, panicking with the fix when the tokenizers are missing.
/// For tests and benchmarks only.
pub fn tokenizer_json(name: &str) -> PathBuf {
    let dir = tokenizers_dir().unwrap_or_else(|| {
        panic!("tokenizers not found: run scripts/get-tokenizers.sh (or set XDISTILL_TOKENIZERS)")
    });
    dir.join(name).join("tokenizer.json")
}

/// `../shared/data` beside the checkout (real text: GSM8K), if present.
pub fn shared_data_dir() -> Option<PathBuf> {
    let d = repo_root().join("..").join("shared").join("data");
    d.is_dir().then_some(d)
}
