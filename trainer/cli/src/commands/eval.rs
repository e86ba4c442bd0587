//! `trainer eval`: flags, the printed summary and the result files of
//! [`xdistill_trainer::eval::evaluate`].

use anyhow::Context;
use std::io::Write;
use std::path::PathBuf;
use xdistill_trainer::eval::{evaluate, load_model, load_records, EvalConfig, EvalReport};

/// `\n`, `\t` and `\\` escapes in command-line stop strings.
fn unescape(s: &str) -> String {
    let mut out = String::new();
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some('t') => out.push('\t'),
            Some('\\') => out.push('\\'),
            Some(other) => {
                out.push('\\');
                out.push(other);
            }
            None => out.push('\\'),
        }
    }
    out
}

/// `trainer eval`: accuracy of a model on a prompts file.
#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// Model directory (config.json, safetensors, tokenizer.json) or GGUF file.
    #[arg(long)]
    pub model: PathBuf,
    /// JSONL with `prompt` (or `question`) and `answer`.
    #[arg(long)]
    pub prompts: PathBuf,
    /// Evaluate only the first N records.
    #[arg(long)]
    pub limit: Option<usize>,
    #[arg(long, default_value_t = 256)]
    pub max_new_tokens: usize,
    /// Sampled completions per prompt (0 = greedy only).
    #[arg(long, default_value_t = 4)]
    pub samples: usize,
    #[arg(long, default_value_t = 1.0)]
    pub temperature: f64,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f64,
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 32)]
    pub batch_size: usize,
    /// Stop string (repeatable; `\n` escapes understood). Default: `\n\n` and `\nQ:`.
    #[arg(long = "stop")]
    pub stop: Vec<String>,
    /// No stop strings at all (only EOS and --max-new-tokens end a completion).
    #[arg(long, conflicts_with = "stop")]
    pub no_stop: bool,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// auto (the first GPU where this binary has CUDA and the machine a GPU, else the CPU;
    /// resolved when parsed), cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto", value_parser = crate::commands::device_arg)]
    pub device: String,
    /// auto (bf16 on a GPU, f32 on the CPU), f32, bf16 or f16.
    #[arg(long, default_value = "auto")]
    pub dtype: String,
    /// Write per-example results (JSONL) here.
    #[arg(long)]
    pub output: Option<PathBuf>,
    /// Write the summary (JSON) here.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Hide the progress bars.
    #[arg(long)]
    pub quiet: bool,
}

impl Args {
    /// The evaluation settings the flags give.
    pub fn config(&self) -> EvalConfig {
        EvalConfig {
            max_new_tokens: self.max_new_tokens,
            samples: self.samples,
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            batch_size: self.batch_size,
            stop_strings: if self.no_stop {
                Vec::new()
            } else if self.stop.is_empty() {
                EvalConfig::default().stop_strings
            } else {
                self.stop.iter().map(|s| unescape(s)).collect()
            },
            seed: self.seed,
            progress: !self.quiet,
        }
    }
}

/// Human-readable summary lines.
pub fn summary(r: &EvalReport) -> String {
    let mut s = format!(
        "examples {}\ngreedy accuracy {:.4}\n",
        r.n, r.greedy_accuracy
    );
    if let (Some(acc), Some(pass)) = (r.sampled_accuracy, r.pass_at_samples) {
        s.push_str(&format!(
            "sampled accuracy {acc:.4} ({} samples, temperature {})\npass@{} {pass:.4}\n",
            r.samples, r.temperature, r.samples
        ));
    }
    s.push_str(&format!(
        "mean completion tokens {:.1}\ngreedy #### rate {:.4}\ngreedy EOS rate {:.4}\n\
         generated {} tokens in {:.2} s ({:.1} tokens/s)",
        r.mean_completion_tokens,
        r.greedy_marker_rate,
        r.greedy_eos_rate,
        r.generated_tokens,
        r.seconds,
        r.generated_tokens as f64 / r.seconds.max(1e-9)
    ));
    s
}

/// Runs `trainer eval`: loads the model and the prompts, evaluates, writes `--output` and
/// `--report`, prints the summary.
pub fn run(a: Args) -> anyhow::Result<EvalReport> {
    let cfg = a.config();
    let device = xdistill_shared::device::parse_device(&a.device)?;
    let dtype = xdistill_shared::device::dtype_for(&a.dtype, &device)?;
    let (model, tok) = load_model(&a.model, &device, dtype)?;
    let records = load_records(&a.prompts, a.limit)?;
    tracing::info!(
        "evaluating {} on {} examples ({} samples each)",
        a.model.display(),
        records.len(),
        cfg.samples
    );
    let mut report = evaluate(&model, &tok, &records, &cfg)?;
    if let Some(path) = &a.output {
        let mut f = std::io::BufWriter::new(
            std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?,
        );
        for e in &report.examples {
            serde_json::to_writer(&mut f, e)?;
            f.write_all(b"\n")?;
        }
        f.flush()?;
    }
    let examples = std::mem::take(&mut report.examples);
    if let Some(path) = &a.report {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    println!("{}", summary(&report));
    report.examples = examples;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_stop_strings() {
        assert_eq!(unescape(r"\n\nQ:"), "\n\nQ:");
        assert_eq!(unescape(r"a\\n\t\x"), "a\\n\t\\x");
    }
}
