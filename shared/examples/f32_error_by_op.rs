//! Where the f32 teacher's forward loses accuracy against f64 (issue 49), op by op: the
//! forward retraced with one kind of op at a time in f32 (everything else in f64), and with
//! every kind in f32 but one, on a GGUF model (dequantized, as the teacher loads it) and real
//! text, for the teacher's fused ops at the process's SIMD level and for candle's generic ops in
//! f32. The errors are `bench/f32_accuracy.py`'s: the worst absolute error over every position
//! of the f64 top-k's log-probs, the target log-probs and the logsumexps.
//!
//! ```sh
//! cargo run --release -p xdistill-shared --example f32_error_by_op -- \
//!     FILE.gguf /work/shared/data/gsm8k/train.jsonl [--rows 2] [--tokens 145] [--k 20]
//! XDISTILL_SIMD=avx2 cargo run …   # the AVX2 kernels
//! ```
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use std::io::BufRead;
use xdistill_shared::gguf::{GgufModel, WeightMode};
use xdistill_shared::model::precision::{OpKind, ScoreErrors, Trace};
use xdistill_shared::model::{Decoder, Ops};

xdistill_shared::global_allocator!();

/// `rows × tokens` ids of GSM8K's questions and answers ("question\nanswer\n\n", one after
/// another), one stream cut into rows, as `bench/gguf_teacher.py` reads them.
fn rows_of_text(
    tok: &tokenizers::Tokenizer,
    jsonl: &str,
    rows: usize,
    tokens: usize,
) -> Result<Vec<u32>> {
    let mut stream = Vec::new();
    let file = std::fs::File::open(jsonl).with_context(|| format!("reading {jsonl}"))?;
    for line in std::io::BufReader::new(file).lines() {
        let r: serde_json::Value = serde_json::from_str(&line?)?;
        let (q, a) = (r["question"].as_str(), r["answer"].as_str());
        let (Some(q), Some(a)) = (q, a) else {
            bail!("{jsonl}: a record without question/answer")
        };
        let enc = tok
            .encode(format!("{q}\n{a}\n\n"), true)
            .map_err(anyhow::Error::msg)?;
        stream.extend_from_slice(enc.get_ids());
        if stream.len() >= rows * tokens {
            stream.truncate(rows * tokens);
            return Ok(stream);
        }
    }
    bail!(
        "{jsonl} holds {} tokens, {} wanted",
        stream.len(),
        rows * tokens
    )
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let opt = |name: &str, default: usize| -> Result<usize> {
        match args.iter().position(|a| a == name) {
            Some(i) => Ok(args.get(i + 1).context("a value after the flag")?.parse()?),
            None => Ok(default),
        }
    };
    let (Some(gguf), Some(text)) = (args.first(), args.get(1)) else {
        bail!("usage: f32_error_by_op FILE.gguf GSM8K.jsonl [--rows 2] [--tokens 145] [--k 20]");
    };
    let (rows, tokens, k) = (opt("--rows", 2)?, opt("--tokens", 145)?, opt("--k", 20)?);
    let dev = Device::Cpu;
    let g = GgufModel::open(gguf)?;
    let fused = g.decoder(WeightMode::Dequantize, DType::F32, &dev)?;
    let candle = Decoder::new(
        &g.config,
        g.var_builder(DType::F32, &dev)?,
        Ops::Differentiable,
    )?;
    let exact = Decoder::new(
        &g.config,
        g.var_builder(DType::F64, &dev)?,
        Ops::Differentiable,
    )?;
    let ids = rows_of_text(&g.load_tokenizer()?, text, rows, tokens)?;
    let ids = Tensor::from_vec(ids, (rows, tokens), &dev)?;
    let level = xdistill_cpu_kernels::simd::Simd::current().name();
    println!(
        "{} ({} layers), {} positions ({rows} rows × {tokens} tokens), k = {k}, SIMD level {level}",
        g.path.display(),
        g.config.num_hidden_layers,
        rows * (tokens - 1)
    );
    let reference = Trace::new(&exact, &fused)?.logits(&ids, &|_| false)?;
    let mut table: Vec<(String, Vec<f64>)> = Vec::new();
    for (label, f32_side) in [("fused", &fused), ("candle", &candle)] {
        let trace = Trace::new(&exact, f32_side)?;
        trace.check(&ids)?;
        let errors = |in_f32: &dyn Fn(OpKind) -> bool| -> Result<f64> {
            Ok(ScoreErrors::of(&trace.logits(&ids, in_f32)?, &reference, &ids, k)?.worst())
        };
        let all = ScoreErrors::of(&trace.logits(&ids, &|_| true)?, &reference, &ids, k)?;
        println!(
            "{label} f32 forward: top-k {:.2e}, target {:.2e}, logsumexp {:.2e}",
            all.topk, all.target, all.logsumexp
        );
        let mut col = vec![all.worst()];
        for kind in OpKind::ALL {
            col.push(errors(&|o| o == kind)?);
            col.push(errors(&|o| o != kind)?);
        }
        table.push((label.to_string(), col));
    }
    println!(
        "\nworst |error| against the f64 forward (f32: the ops of that kind; the rest in f64)\n"
    );
    print!("| ops in f32 |");
    for (label, _) in &table {
        print!(" {label}: only these | {label}: all but these |");
    }
    println!("\n|---|{}", "---|---|".repeat(table.len()));
    print!("| every op (the f32 forward) |");
    for (_, col) in &table {
        print!(" {:.2e} | |", col[0]);
    }
    println!();
    for (i, kind) in OpKind::ALL.iter().enumerate() {
        print!("| {} |", kind.name());
        for (_, col) in &table {
            print!(" {:.2e} | {:.2e} |", col[1 + 2 * i], col[2 + 2 * i]);
        }
        println!();
    }
    Ok(())
}
