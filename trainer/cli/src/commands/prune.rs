//! `trainer prune`: flags and the printed summary; the pruning is [`xdistill_trainer::prune`].

use anyhow::{bail, Result};
use std::path::PathBuf;
use xdistill_trainer::prune::{evenly_spaced, parse_layers, prune, source_layers};

/// `trainer prune`.
#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// The model to copy: a Hugging Face directory or a `.gguf` file.
    #[arg(long)]
    pub from: PathBuf,
    /// Layers to keep, 0-based and increasing, e.g. `0,1,2,27,28,29` or ranges `0-2,27-29`.
    #[arg(long, conflicts_with = "layers")]
    pub keep: Option<String>,
    /// Keep this many layers, spread evenly from the first to the last.
    #[arg(long)]
    pub layers: Option<usize>,
    /// The directory to write.
    #[arg(long)]
    pub out: PathBuf,
}

/// `trainer prune`: prints the kept layers and the parameter count.
pub fn run(a: Args) -> Result<()> {
    let total = source_layers(&a.from)?;
    let keep = match (&a.keep, a.layers) {
        (Some(list), _) => parse_layers(list)?,
        (None, Some(n)) => evenly_spaced(total, n)?,
        (None, None) => bail!("say which layers to keep: --keep 0,1,29 or --layers N"),
    };
    let params = prune(&a.from, &keep, &a.out)?;
    println!(
        "{}",
        serde_json::json!({
            "out": a.out.display().to_string(),
            "kept_layers": keep,
            "of_layers": total,
            "parameters": params,
        })
    );
    Ok(())
}
