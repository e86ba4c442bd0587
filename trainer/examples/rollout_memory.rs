//! Peak memory of one on-policy rollout: the student loaded as trainable f32 masters (as the
//! trainer holds it), its generation decoder, and `ROWS` rows of `TOKENS` new tokens each
//! sampled at temperature 1 with no end-of-sequence stop, in one batch. Prints one JSON line:
//! `base_rss_mib` (after loading), `peak_rss_mib` (VmHWM) and the KV cache's own size.
//!
//! `cargo run --release -p xdistill-trainer --example rollout_memory -- MODEL_DIR [ROWS [TOKENS]]`
use anyhow::{Context, Result};
use candle_core::{DType, Device};
use std::time::Instant;
use xdistill_trainer::generate::{generate_seeded, GenerationConfig};
use xdistill_trainer::student::Student;

/// `VmRSS` or `VmHWM` of this process in MiB.
fn status_mib(key: &str) -> Result<f64> {
    Ok(xdistill_shared::process::status_mib("self", key)?)
}

// The allocator of every xdistill binary: jemalloc with transparent huge pages.
xdistill_shared::global_allocator!();

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let dir = args
        .get(1)
        .context("usage: rollout_memory MODEL_DIR [ROWS [TOKENS]]")?;
    let rows: usize = args.get(2).map(|s| s.parse()).transpose()?.unwrap_or(32);
    let tokens: usize = args.get(3).map(|s| s.parse()).transpose()?.unwrap_or(256);
    let student = Student::load(dir.as_ref(), &Device::Cpu, DType::F32)?;
    let tok = xdistill_shared::hf::load_tokenizer(&student.tokenizer_json)?;
    let prompts: Vec<Vec<u32>> = (0..rows as u32)
        .map(|r| vec![1 + r, 2 + r, 3 + r, 4 + r])
        .collect();
    let cfg = GenerationConfig {
        max_new_tokens: tokens,
        temperature: 1.0,
        eos_ids: Some(vec![]),
        ..Default::default()
    };
    let base = status_mib("VmRSS")?;
    let start = Instant::now();
    let model = student.inference_model()?;
    let out = generate_seeded(&model, &tok, &prompts, &cfg)?;
    let secs = start.elapsed().as_secs_f64();
    let c = &student.config;
    let kv_mib = (rows * (4 + tokens) * c.num_hidden_layers * 2 * c.kv_heads() * c.head_dim() * 4)
        as f64
        / (1 << 20) as f64;
    let generated: usize = out.iter().map(|g| g.completion_ids.len()).sum();
    println!(
        "{{\"rows\": {rows}, \"tokens\": {tokens}, \"generated\": {generated}, \"base_rss_mib\": {base:.1}, \
         \"peak_rss_mib\": {:.1}, \"kv_cache_mib\": {kv_mib:.1}, \"seconds\": {secs:.2}}}",
        status_mib("VmHWM")?
    );
    Ok(())
}
