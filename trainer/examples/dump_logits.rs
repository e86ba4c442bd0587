//! Dumps the logits of one sequence as JSON, for the transformers parity check
//! (`scripts/checks/hf_parity.py`). Usage: `dump_logits MODEL_DIR OUT.json ID ID ...`.

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use xdistill_shared::hf::ModelDir;
use xdistill_shared::model::{Decoder, Ops};

// The allocator of every xdistill binary: jemalloc with transparent huge pages.
xdistill_shared::global_allocator!();

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (dir, out, ids) = match args.as_slice() {
        [d, o, rest @ ..] if !rest.is_empty() => (d, o, rest),
        _ => anyhow::bail!("usage: dump_logits MODEL_DIR OUT.json ID ID ..."),
    };
    let ids: Vec<u32> = ids
        .iter()
        .map(|s| s.parse())
        .collect::<Result<_, _>>()
        .context("ids")?;
    let md = ModelDir::open(dir)?;
    // SAFETY: the files are not modified while mapped (a read-only check tool).
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&md.weights, DType::F32, &Device::Cpu)? };
    let model = Decoder::new(&md.config, vb, Ops::Fused)?;
    let logits = model.forward(&Tensor::new(ids.as_slice(), &Device::Cpu)?.unsqueeze(0)?)?;
    let rows: Vec<Vec<f32>> = logits.squeeze(0)?.to_vec2()?;
    std::fs::write(
        out,
        serde_json::to_vec(&serde_json::json!({"ids": ids, "logits": rows}))?,
    )?;
    Ok(())
}
