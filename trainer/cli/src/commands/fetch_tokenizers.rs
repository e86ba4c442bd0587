//! `trainer fetch-tokenizers`: flags and the printed folders of [`xdistill_demo::tokenizers`].

use anyhow::Result;
use std::path::PathBuf;
use xdistill_demo::tokenizers::{checksum, fetch, sha256_file, tokenizer};
use xdistill_shared::paths;

/// `trainer fetch-tokenizers`: fetches (or finds) the real tokenizers the tests, benchmarks
/// and demo use, and prints their folder.
#[derive(clap::Args, Debug, Clone)]
pub struct FetchArgs {
    /// Which tokenizers (default: all five).
    #[arg(value_parser = clap::builder::PossibleValuesParser::new(paths::TOKENIZER_NAMES))]
    pub names: Vec<String>,
    /// Folder to fetch into (default: the user cache, e.g. ~/.cache/xdistill/tokenizers).
    #[arg(long)]
    pub dest: Option<PathBuf>,
}

/// Runs `trainer fetch-tokenizers`: with `--dest`, every named tokenizer that folder lacks is
/// fetched into it; without, each is looked up first and fetched into the user cache if missing.
pub fn run_fetch(a: FetchArgs) -> Result<()> {
    let names: Vec<String> = if a.names.is_empty() {
        paths::TOKENIZER_NAMES
            .iter()
            .map(|n| n.to_string())
            .collect()
    } else {
        a.names
    };
    for name in &names {
        let path = match &a.dest {
            Some(dest) if dest.join(name).join("tokenizer.json").is_file() => {
                dest.join(name).join("tokenizer.json")
            }
            Some(dest) => fetch(name, dest)?,
            None => tokenizer(name)?,
        };
        let got = sha256_file(&path)?;
        if Some(got.as_str()) != checksum(name) {
            eprintln!(
                "warning: {} is not the pinned {name} tokenizer (SHA-256 {got})",
                path.display()
            );
        }
        println!("{name}\t{}", path.display());
    }
    Ok(())
}
