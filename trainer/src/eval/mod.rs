//! Task evaluation: generate for each prompt, extract answers ([`answer`]), report greedy and
//! sampled accuracy. Part of the core because `trainer sft` measures task accuracy while it
//! trains ([`evaluate`]) and the loops encode prompts as evaluation does ([`encode_prompt`]);
//! `trainer eval` is its command-line front.

pub mod answer;

use crate::generate::{generate, GenerateError, Generation, GenerationConfig, StopReason};
use answer::{answers_match, extract_answer, extract_answer_detailed, AnswerSource};
use anyhow::Context;
use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use tokenizers::Tokenizer;
use xdistill_shared::model::{Decoder, Ops};
use xdistill_shared::ModelDir;

#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}:{line}: {message}")]
    Record {
        path: PathBuf,
        line: usize,
        message: String,
    },
    #[error("{0}: no records")]
    Empty(PathBuf),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("record {index}: prompt encodes to no tokens")]
    EmptyPrompt { index: usize },
    #[error(transparent)]
    Generate(#[from] GenerateError),
}

/// One example: the prompt text and the gold answer (canonical when numeric).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EvalRecord {
    pub prompt: String,
    pub answer: String,
}

/// The prompt template for records that give a `question` (GSM8K files) instead of a `prompt`;
/// the synthetic task uses the same one.
pub fn question_prompt(question: &str) -> String {
    format!("Q: {}\nA:", question.trim())
}

/// The gold answer of a record's `answer` field: the `#### N` of a worked solution (GSM8K), else
/// the field itself (trimmed).
pub fn gold_answer(answer: &str) -> String {
    if answer.contains("####") {
        if let Some(a) = extract_answer(answer) {
            return a;
        }
    }
    answer.trim().to_string()
}

/// Reads a JSONL prompts file: per line an object with `prompt` (or `question`, wrapped by
/// [`question_prompt`]) and `answer` (string or number). Blank lines are skipped; at most
/// `limit` records are read.
pub fn load_records(path: &Path, limit: Option<usize>) -> Result<Vec<EvalRecord>, EvalError> {
    let text = std::fs::read_to_string(path).map_err(|source| EvalError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if limit.is_some_and(|n| out.len() >= n) {
            break;
        }
        if line.trim().is_empty() {
            continue;
        }
        let bad = |message: String| EvalError::Record {
            path: path.to_path_buf(),
            line: i + 1,
            message,
        };
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| bad(format!("invalid JSON: {e}")))?;
        let prompt = match (v.get("prompt"), v.get("question")) {
            (Some(serde_json::Value::String(p)), _) => p.clone(),
            (None, Some(serde_json::Value::String(q))) => question_prompt(q),
            _ => return Err(bad("needs a string `prompt` (or `question`)".into())),
        };
        let answer = match v.get("answer") {
            Some(serde_json::Value::String(a)) => gold_answer(a),
            Some(serde_json::Value::Number(n)) => gold_answer(&n.to_string()),
            _ => return Err(bad("needs an `answer` (string or number)".into())),
        };
        out.push(EvalRecord { prompt, answer });
    }
    if out.is_empty() {
        return Err(EvalError::Empty(path.to_path_buf()));
    }
    Ok(out)
}

/// Prompt text → ids, with the tokenizer's special tokens (e.g. Llama's BOS) added, as the
/// training loops must encode prompts too.
pub fn encode_prompt(tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>, EvalError> {
    tokenizer
        .encode(text, true)
        .map(|e| e.get_ids().to_vec())
        .map_err(|e| EvalError::Tokenizer(e.to_string()))
}

fn default_stops() -> Vec<String> {
    vec!["\n\n".into(), "\nQ:".into()]
}

/// Evaluation settings (embeddable in training configs; every field has a default).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EvalConfig {
    pub max_new_tokens: usize,
    /// Sampled completions per prompt (0 = greedy only).
    pub samples: usize,
    pub temperature: f64,
    pub top_p: f64,
    pub top_k: usize,
    /// Rows per forward pass.
    pub batch_size: usize,
    /// Generation stops at these (besides EOS): a model that never learned EOS would otherwise
    /// run into a made-up next question, whose `####` would be the last one.
    pub stop_strings: Vec<String>,
    pub seed: u64,
    pub progress: bool,
}

impl Default for EvalConfig {
    fn default() -> Self {
        EvalConfig {
            max_new_tokens: 256,
            samples: 4,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            batch_size: 32,
            stop_strings: default_stops(),
            seed: 0,
            progress: false,
        }
    }
}

impl EvalConfig {
    fn generation(&self, greedy: bool) -> GenerationConfig {
        GenerationConfig {
            max_new_tokens: self.max_new_tokens,
            temperature: if greedy { 0.0 } else { self.temperature },
            top_p: self.top_p,
            top_k: self.top_k,
            num_generations: if greedy { 1 } else { self.samples },
            seed: self.seed,
            stop_strings: self.stop_strings.clone(),
            eos_ids: None,
            batch_size: self.batch_size,
            progress: self.progress,
        }
    }
}

/// One scored completion.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Scored {
    pub completion: String,
    pub predicted: Option<String>,
    /// The answer followed `####` (not the last-number fallback).
    pub marker: bool,
    pub correct: bool,
    pub tokens: usize,
    pub stop: StopReason,
}

/// Per-example results.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalExample {
    pub index: usize,
    pub prompt: String,
    pub gold: String,
    pub greedy: Scored,
    pub sampled: Vec<Scored>,
}

/// Aggregate results.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalReport {
    pub n: usize,
    pub greedy_accuracy: f64,
    /// Mean correctness over all sampled completions (None when `samples` = 0).
    pub sampled_accuracy: Option<f64>,
    /// Fraction of prompts with at least one correct sample (pass@samples).
    pub pass_at_samples: Option<f64>,
    pub samples: usize,
    pub temperature: f64,
    /// Mean generated tokens of the greedy completions.
    pub mean_completion_tokens: f64,
    /// Greedy completions whose answer followed `####`.
    pub greedy_marker_rate: f64,
    /// Greedy completions that ended with EOS.
    pub greedy_eos_rate: f64,
    /// Tokens generated (greedy and sampled) and the wall time of generation and scoring.
    pub generated_tokens: usize,
    pub seconds: f64,
    #[serde(skip_serializing_if = "Vec::is_empty", default)]
    pub examples: Vec<EvalExample>,
}

fn score(g: &Generation, gold: &str) -> Scored {
    let ex = extract_answer_detailed(&g.completion_text);
    let correct = ex.as_ref().is_some_and(|e| answers_match(&e.value, gold));
    Scored {
        completion: g.completion_text.clone(),
        marker: ex
            .as_ref()
            .is_some_and(|e| e.source == AnswerSource::Marker),
        predicted: ex.map(|e| e.value),
        correct,
        tokens: g.completion_ids.len(),
        stop: g.stop,
    }
}

fn mean(xs: impl Iterator<Item = f64>) -> f64 {
    let (s, n) = xs.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    if n == 0 {
        0.0
    } else {
        s / n as f64
    }
}

/// Generates greedily (and `samples` times per prompt when > 0) and scores every completion.
pub fn evaluate(
    model: &Decoder,
    tokenizer: &Tokenizer,
    records: &[EvalRecord],
    cfg: &EvalConfig,
) -> Result<EvalReport, EvalError> {
    let mut prompts = Vec::with_capacity(records.len());
    for (index, r) in records.iter().enumerate() {
        let ids = encode_prompt(tokenizer, &r.prompt)?;
        if ids.is_empty() {
            return Err(EvalError::EmptyPrompt { index });
        }
        prompts.push(ids);
    }
    let start = std::time::Instant::now();
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed);
    let greedy = generate(model, tokenizer, &prompts, &cfg.generation(true), &mut rng)?;
    let sampled = if cfg.samples > 0 {
        generate(model, tokenizer, &prompts, &cfg.generation(false), &mut rng)?
    } else {
        Vec::new()
    };
    let examples: Vec<EvalExample> = records
        .iter()
        .enumerate()
        .map(|(i, r)| EvalExample {
            index: i,
            prompt: r.prompt.clone(),
            gold: r.answer.clone(),
            greedy: score(&greedy[i], &r.answer),
            sampled: sampled
                .iter()
                .skip(i * cfg.samples)
                .take(cfg.samples)
                .map(|g| score(g, &r.answer))
                .collect(),
        })
        .collect();
    let b = |x: bool| if x { 1.0 } else { 0.0 };
    let with_samples = cfg.samples > 0 && !examples.is_empty();
    Ok(EvalReport {
        n: examples.len(),
        greedy_accuracy: mean(examples.iter().map(|e| b(e.greedy.correct))),
        sampled_accuracy: with_samples.then(|| {
            mean(
                examples
                    .iter()
                    .flat_map(|e| &e.sampled)
                    .map(|s| b(s.correct)),
            )
        }),
        pass_at_samples: with_samples.then(|| {
            mean(
                examples
                    .iter()
                    .map(|e| b(e.sampled.iter().any(|s| s.correct))),
            )
        }),
        samples: cfg.samples,
        temperature: cfg.temperature,
        mean_completion_tokens: mean(examples.iter().map(|e| e.greedy.tokens as f64)),
        greedy_marker_rate: mean(examples.iter().map(|e| b(e.greedy.marker))),
        greedy_eos_rate: mean(examples.iter().map(|e| b(e.greedy.stop == StopReason::Eos))),
        generated_tokens: greedy
            .iter()
            .chain(&sampled)
            .map(|g| g.completion_ids.len())
            .sum(),
        seconds: start.elapsed().as_secs_f64(),
        examples,
    })
}

/// Loads a model for inference: a directory (fused kernels, weights memory-mapped) or a GGUF
/// file (weights dequantized to `dtype`, the tokenizer rebuilt from its metadata).
pub fn load_model(
    dir: &Path,
    device: &Device,
    dtype: DType,
) -> anyhow::Result<(Decoder, Tokenizer)> {
    if xdistill_shared::gguf::is_gguf(dir) {
        let g = xdistill_shared::gguf::GgufModel::open(dir)?;
        let vb = g.var_builder(dtype, device)?;
        let model = Decoder::new(&g.config, vb, Ops::Fused)
            .with_context(|| format!("building the model of {}", dir.display()))?;
        return Ok((model, g.load_tokenizer()?));
    }
    let md = ModelDir::open(dir).with_context(|| format!("opening model {}", dir.display()))?;
    crate::model_check::check_model_dir(&md)?;
    // SAFETY: the files are memory-mapped read-only; nothing in this process writes them.
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&md.weights, dtype, device)? };
    let model = Decoder::new(&md.config, vb, Ops::Fused)
        .with_context(|| format!("building the model of {}", dir.display()))?;
    Ok((model, md.load_tokenizer()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_from_prompt_and_gsm8k_files() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("p.jsonl");
        std::fs::write(
            &p,
            "{\"prompt\": \"Q: 1+2=?\\nA:\", \"answer\": \"3\"}\n\n\
             {\"question\": \" How many? \", \"answer\": \"2 + 3 = 5\\n#### 1,005\"}\n\
             {\"prompt\": \"x\", \"answer\": 7}\n",
        )
        .unwrap();
        let r = load_records(&p, None).unwrap();
        assert_eq!(r.len(), 3);
        assert_eq!(r[0].answer, "3");
        assert_eq!(r[1].prompt, "Q: How many?\nA:");
        assert_eq!(r[1].answer, "1005");
        assert_eq!(r[2].answer, "7");
        assert_eq!(load_records(&p, Some(2)).unwrap().len(), 2);

        std::fs::write(
            &p,
            "{\"prompt\": \"a\", \"answer\": \"1\"}\n{\"prompt\": \"b\"}\n",
        )
        .unwrap();
        let e = load_records(&p, None).unwrap_err().to_string();
        assert!(e.contains(":2:") && e.contains("answer"), "{e}");
        std::fs::write(&p, "not json\n").unwrap();
        assert!(load_records(&p, None)
            .unwrap_err()
            .to_string()
            .contains(":1: invalid JSON"));
        std::fs::write(&p, "\n\n").unwrap();
        assert!(matches!(load_records(&p, None), Err(EvalError::Empty(_))));
        assert!(matches!(
            load_records(&dir.path().join("missing"), None),
            Err(EvalError::Io { .. })
        ));
    }

    #[test]
    fn the_real_gsm8k_gold_answers_extract() {
        let Some(dir) = xdistill_shared::paths::shared_data_dir() else {
            return; // GSM8K is not part of the checkout
        };
        let r = load_records(&dir.join("gsm8k").join("train.jsonl"), Some(200)).unwrap();
        assert_eq!(r.len(), 200);
        for rec in &r {
            assert!(rec.prompt.starts_with("Q: "));
            assert!(
                answer::normalize_number(&rec.answer).is_some(),
                "{:?}",
                rec.answer
            );
        }
        assert_eq!(r[0].answer, "72");
    }
}
