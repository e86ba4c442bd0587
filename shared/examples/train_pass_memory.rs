//! Peak memory and time of one student forward + backward at one sequence length: the decoder's
//! training pass (`keep`: plain autograd; `selective`: all but the attention core kept, which
//! is recomputed in query blocks; `checkpoint`: layers recomputed, attention in query blocks)
//! followed by next-token cross-entropy with the LM head applied `--head-rows` positions at a time (each chunk's `[n, V]` logits live only through its own backward). Trainable f32
//! `Var`s as the trainer holds them. `bench/step_memory.py` runs it beside PyTorch.
//!
//! `cargo run --release -p xdistill-shared --example train_pass_memory -- MODEL_DIR T MODE [HEAD_ROWS]`
//!
//! Prints one JSON line: `seq_len`, `mode`, `peak_rss_mib` (VmHWM: the process's high-water
//! mark), `base_rss_mib` (after loading, before the pass), `step_s`, `loss`.
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, Var, D};
use candle_nn::{VarBuilder, VarMap};
use std::time::Instant;
use xdistill_shared::hf::ModelDir;
use xdistill_shared::model::{Activations, Decoder, Ops};

/// `VmRSS` or `VmHWM` of this process in MiB.
fn status_mib(key: &str) -> Result<f64> {
    Ok(xdistill_shared::process::status_mib("self", key)?)
}

// The allocator of every xdistill binary: jemalloc with transparent huge pages.
xdistill_shared::global_allocator!();

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 4 {
        bail!("usage: train_pass_memory MODEL_DIR SEQ_LEN keep|selective|checkpoint [HEAD_ROWS]");
    }
    let (dir, t, mode) = (&args[1], args[2].parse::<usize>()?, args[3].as_str());
    let head_rows: usize = args.get(4).map(|s| s.parse()).transpose()?.unwrap_or(1024);
    let act = match mode {
        "keep" => Activations::Keep,
        "selective" => Activations::Selective,
        "checkpoint" => Activations::Checkpoint,
        other => bail!("mode {other:?}: keep, selective or checkpoint"),
    };
    let dev = Device::Cpu;
    let md = ModelDir::open(dir)?;
    let varmap = VarMap::new();
    {
        let mut data = varmap.data().lock().expect("fresh varmap");
        for f in &md.weights {
            for (name, t) in candle_core::safetensors::load(f, &dev)? {
                data.insert(name, Var::from_tensor(&t.to_dtype(DType::F32)?)?);
            }
        }
    }
    let model = Decoder::new(
        &md.config,
        VarBuilder::from_varmap(&varmap, DType::F32, &dev),
        Ops::Differentiable,
    )?;
    // A reproducible batch of one row: ids from an LCG over the vocabulary.
    let v = md.config.vocab_size as u64;
    let mut s = 7u64;
    let ids: Vec<u32> = (0..t)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1);
            ((s >> 33) % v) as u32
        })
        .collect();
    let base = status_mib("VmRSS")?;
    let start = Instant::now();
    let input = Tensor::from_vec(ids.clone(), (1, t), &dev)?;
    let pass = model.train_forward(&input, act)?;
    // Next-token CE over positions 0..t-1, the head a chunk of rows at a time.
    let hidden = pass.hidden().squeeze(0)?; // [T, H]
    let n = t - 1;
    let mut grads_hidden = Vec::new();
    // The head's gradient summed as the chunks go (one [V, H] sum, not one per chunk).
    let mut head_grads = candle_core::backprop::GradStore::default();
    let mut loss = 0f64;
    for r0 in (0..n).step_by(head_rows) {
        let r = head_rows.min(n - r0);
        let rows = Var::from_tensor(&hidden.narrow(0, r0, r)?)?;
        let logits = model.logits(rows.as_tensor())?; // [r, V]
        let lp = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
        let tgt = Tensor::from_vec(ids[r0 + 1..r0 + 1 + r].to_vec(), (r, 1), &dev)?;
        let l = (lp.gather(&tgt, 1)?.sum_all()?.neg()? / n as f64)?;
        loss += l.to_scalar::<f32>()? as f64;
        let mut g = l.backward()?;
        grads_hidden.push(g.remove(rows.as_tensor()).context("no row gradient")?);
        head_grads.extend(g)?;
    }
    let zero_last = hidden.narrow(0, n, 1)?.zeros_like()?;
    grads_hidden.push(zero_last);
    let g = Tensor::cat(&grads_hidden, 0)?.unsqueeze(0)?;
    let mut grads = pass.backward(&g)?;
    grads.extend(head_grads)?;
    let step_s = start.elapsed().as_secs_f64();
    let n_grads = varmap
        .all_vars()
        .iter()
        .filter(|v| grads.get(v.as_tensor()).is_some())
        .count();
    if n_grads != varmap.all_vars().len() {
        bail!(
            "{n_grads} of {} parameters got a gradient",
            varmap.all_vars().len()
        );
    }
    println!(
        "{{\"impl\": \"xdistill\", \"seq_len\": {t}, \"mode\": \"{mode}\", \"head_rows\": {head_rows}, \
         \"base_rss_mib\": {base:.1}, \"peak_rss_mib\": {:.1}, \"step_s\": {step_s:.3}, \"loss\": {loss:.6}}}",
        status_mib("VmHWM")?
    );
    Ok(())
}
