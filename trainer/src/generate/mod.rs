//! Student generation: batched sampling with a KV cache, for on-policy rollouts and evaluation.
//!
//! - Prompts are grouped into batches of `batch_size` rows (sorted by length to limit padding),
//!   **left-padded**, and prefilled once with per-row RoPE `positions` and a `key_valid` mask,
//!   so every row computes exactly what it would alone. Then one token per step is fed for all
//!   rows, reusing the cache.
//! - Finished rows stay in the batch (the cache cannot drop rows): they are fed a pad token whose
//!   key is masked, and their outputs are ignored. The batch stops when every row is done.
//! - Each row (prompt × generation) gets its own ChaCha8 stream, seeded from the caller's RNG in
//!   (prompt, generation) order before any work, so samples do not depend on `batch_size`, on
//!   the length sort, or on the cache: [`generate_no_cache`] draws the same tokens.
//! - `sampled_logprobs[t]` = `log_softmax(z_t / τ)[x_t]` over the whole vocabulary the tokenizer
//!   knows, **before** top-k/top-p truncation (τ = 1 when greedy): the `lp_S_old` of on-policy
//!   distillation. See [`sampling`].

pub mod on_device;
pub mod sampling;

use candle_core::{DType, Tensor};
use indicatif::{ProgressBar, ProgressStyle};
use on_device::Draw;
use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use tokenizers::Tokenizer;
use xdistill_shared::model::{Decoder, KvCache};

pub use sampling::{sample_token, SampleError, Sampled, SamplingParams};

#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    #[error("invalid generation config: {0}")]
    Config(String),
    #[error("prompt {0} is empty")]
    EmptyPrompt(usize),
    #[error("prompt {index} has token id {id}, outside the model vocabulary of {vocab}")]
    TokenOutOfRange { index: usize, id: u32, vocab: usize },
    #[error(
        "prompt {index} has {len} tokens, which leaves no room to generate within \
         max_position_embeddings {max}"
    )]
    PromptTooLong {
        index: usize,
        len: usize,
        max: usize,
    },
    #[error("sampling: {0}")]
    Sample(#[from] SampleError),
    #[error("model: {0}")]
    Model(#[from] candle_core::Error),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
}

/// Generation settings. Every field has a default, so a config file may name only some.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GenerationConfig {
    /// Upper bound on generated tokens per row (the EOS token counts).
    pub max_new_tokens: usize,
    /// 0 = greedy.
    pub temperature: f64,
    /// 1 = off.
    pub top_p: f64,
    /// 0 = off.
    pub top_k: usize,
    /// Completions per prompt.
    pub num_generations: usize,
    /// Seed of [`GenerationConfig::rng`]; training loops make one RNG from it for the whole run.
    pub seed: u64,
    /// Stop once the completion text contains one of these (the text is cut before it).
    pub stop_strings: Vec<String>,
    /// End-of-sequence ids; `None` = the model config's `eos_token_id`, `Some([])` = never.
    pub eos_ids: Option<Vec<u32>>,
    /// Rows (prompt × generation) per forward pass; 0 = all at once.
    pub batch_size: usize,
    /// Show a progress bar (rows finished).
    pub progress: bool,
}

impl Default for GenerationConfig {
    fn default() -> Self {
        GenerationConfig {
            max_new_tokens: 256,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            num_generations: 1,
            seed: 0,
            stop_strings: Vec::new(),
            eos_ids: None,
            batch_size: 32,
            progress: false,
        }
    }
}

impl GenerationConfig {
    /// Greedy decoding, one generation per prompt.
    pub fn greedy(max_new_tokens: usize) -> Self {
        GenerationConfig {
            max_new_tokens,
            temperature: 0.0,
            ..Default::default()
        }
    }

    pub fn sampling(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
        }
    }

    /// A fresh RNG from `seed`.
    pub fn rng(&self) -> ChaCha8Rng {
        ChaCha8Rng::seed_from_u64(self.seed)
    }

    pub fn validate(&self) -> Result<(), GenerateError> {
        self.sampling()
            .validate()
            .map_err(|e| GenerateError::Config(e.to_string()))?;
        if !(1..=MAX_GENERATIONS).contains(&self.num_generations) {
            return Err(GenerateError::Config(format!(
                "num_generations must be between 1 and {MAX_GENERATIONS}, not {}",
                self.num_generations
            )));
        }
        if self.stop_strings.iter().any(|s| s.is_empty()) {
            return Err(GenerateError::Config(
                "stop strings must not be empty".into(),
            ));
        }
        Ok(())
    }
}

/// The most samples per prompt: rows are made for all of them at once (a billion, a typo, would
/// size the rows' allocation past any memory).
pub const MAX_GENERATIONS: usize = 4096;

/// Why a row stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// Sampled an EOS id (it is the last completion id).
    Eos,
    /// The completion text contains a stop string.
    StopString,
    /// Reached `max_new_tokens`.
    MaxNewTokens,
    /// Reached the model's `max_position_embeddings` (see the module docs on padding).
    ContextFull,
}

/// One completion.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Generation {
    /// Index into the `prompts` argument.
    pub prompt_index: usize,
    /// 0..num_generations.
    pub sample_index: usize,
    pub prompt_ids: Vec<u32>,
    /// Generated ids: with the EOS id when `hit_eos`, and up to and including the token that
    /// completed a stop string.
    pub completion_ids: Vec<u32>,
    /// The text of `completion_ids` after the prompt ([`decode_after`]) without the EOS,
    /// special tokens skipped, cut before the first stop string.
    pub completion_text: String,
    /// The stop string that ended the row (`stop == StopString`): the text the model produced is
    /// `completion_text + matched_stop`, which is what a teacher should score so the student
    /// learns where to stop.
    #[serde(default)]
    pub matched_stop: Option<String>,
    pub hit_eos: bool,
    pub stop: StopReason,
    /// Per completion id: `log_softmax(z / τ)[x_t]`, untruncated by top-k/top-p (τ = 1 greedy).
    pub sampled_logprobs: Vec<f32>,
}

/// One row being generated: its RNG, tokens so far and stop state.
struct Row {
    prompt_index: usize,
    sample_index: usize,
    prompt: Vec<u32>,
    rng: ChaCha8Rng,
    ids: Vec<u32>,
    logprobs: Vec<f32>,
    /// Most tokens this row may generate (max_new_tokens and the context limit).
    limit: usize,
    limited_by_context: bool,
    done: Option<StopReason>,
    text: Option<String>,
    matched_stop: Option<String>,
    /// `decode(prompt)`, filled on first use.
    prompt_text: Option<String>,
}

/// Settings shared by every row of one call.
struct Ctx<'a> {
    tokenizer: &'a Tokenizer,
    params: SamplingParams,
    eos: Vec<u32>,
    stops: &'a [String],
    /// Ids the tokenizer can decode; logits beyond are never sampled.
    support: usize,
}

fn decode(tok: &Tokenizer, ids: &[u32]) -> Result<String, GenerateError> {
    tok.decode(ids, true)
        .map_err(|e| GenerateError::Tokenizer(e.to_string()))
}

/// The text `ids` add after `prompt`: `decode(prompt ++ ids)` minus `decode(prompt)`.
///
/// Decoding the completion on its own loses what depends on its left context: SentencePiece
/// (Llama 2) drops the leading space of a sequence's first token, so `▁8` alone is `"8"` but
/// `" 8"` after `A:`. A teacher with another tokenizer would then score `A:8` instead of the
/// `A: 8` the student produced. Falls back to the plain decode if the prompt's text is not a
/// prefix (a normaliser that rewrites across the join).
pub fn decode_after(tok: &Tokenizer, prompt: &[u32], ids: &[u32]) -> Result<String, GenerateError> {
    decode_after_head(tok, &decode(tok, prompt)?, prompt, ids)
}

/// [`decode_after`] with `head = decode(prompt)` already known (a row decodes its prompt once).
fn decode_after_head(
    tok: &Tokenizer,
    head: &str,
    prompt: &[u32],
    ids: &[u32],
) -> Result<String, GenerateError> {
    let full = decode(tok, &[prompt, ids].concat())?;
    match full.strip_prefix(head) {
        Some(tail) => Ok(tail.to_string()),
        None => decode(tok, ids),
    }
}

impl Row {
    fn finished(&self) -> bool {
        self.done.is_some()
    }

    /// The text of the first `n` generated ids after the prompt ([`decode_after`]).
    fn text_of(&mut self, tok: &Tokenizer, n: usize) -> Result<String, GenerateError> {
        if self.prompt_text.is_none() {
            self.prompt_text = Some(decode(tok, &self.prompt)?);
        }
        let head = self.prompt_text.as_deref().unwrap_or_default();
        decode_after_head(tok, head, &self.prompt, &self.ids[..n])
    }

    /// Appends the sampled token and updates the stop state.
    fn record(&mut self, s: Sampled, ctx: &Ctx) -> Result<u32, GenerateError> {
        self.ids.push(s.id);
        self.logprobs.push(s.logprob);
        if ctx.eos.contains(&s.id) {
            self.done = Some(StopReason::Eos);
        } else if !ctx.stops.is_empty() {
            let text = self.text_of(ctx.tokenizer, self.ids.len())?;
            let first = ctx
                .stops
                .iter()
                .filter_map(|s| text.find(s.as_str()).map(|pos| (pos, s)))
                .min_by_key(|(pos, _)| *pos);
            if let Some((pos, stop)) = first {
                self.text = Some(text[..pos].to_string());
                self.matched_stop = Some(stop.clone());
                self.done = Some(StopReason::StopString);
            }
        }
        if self.done.is_none() && self.ids.len() >= self.limit {
            self.done = Some(if self.limited_by_context {
                StopReason::ContextFull
            } else {
                StopReason::MaxNewTokens
            });
        }
        Ok(s.id)
    }

    fn finish(mut self, tok: &Tokenizer) -> Result<Generation, GenerateError> {
        let stop = self.done.unwrap_or(StopReason::MaxNewTokens);
        let hit_eos = stop == StopReason::Eos;
        let completion_text = match self.text {
            Some(t) => t,
            None => {
                let n = self.ids.len() - usize::from(hit_eos);
                self.text_of(tok, n)?
            }
        };
        Ok(Generation {
            prompt_index: self.prompt_index,
            sample_index: self.sample_index,
            prompt_ids: self.prompt,
            completion_ids: self.ids,
            completion_text,
            matched_stop: self.matched_stop,
            hit_eos,
            stop,
            sampled_logprobs: self.logprobs,
        })
    }
}

/// Checks the prompts and makes one row per (prompt, generation), each with its own RNG drawn
/// from `rng` in that order.
fn make_rows(
    model: &Decoder,
    prompts: &[Vec<u32>],
    cfg: &GenerationConfig,
    rng: &mut ChaCha8Rng,
) -> Result<Vec<Row>, GenerateError> {
    cfg.validate()?;
    let mc = model.config();
    let max_pos = mc.max_position_embeddings;
    let mut rows = Vec::with_capacity(prompts.len() * cfg.num_generations);
    for (i, p) in prompts.iter().enumerate() {
        if p.is_empty() {
            return Err(GenerateError::EmptyPrompt(i));
        }
        if let Some(&id) = p.iter().find(|&&id| id as usize >= mc.vocab_size) {
            return Err(GenerateError::TokenOutOfRange {
                index: i,
                id,
                vocab: mc.vocab_size,
            });
        }
        if p.len() >= max_pos && cfg.max_new_tokens > 0 {
            return Err(GenerateError::PromptTooLong {
                index: i,
                len: p.len(),
                max: max_pos,
            });
        }
        let room = max_pos.saturating_sub(p.len());
        for s in 0..cfg.num_generations {
            rows.push(Row {
                prompt_index: i,
                sample_index: s,
                prompt: p.clone(),
                rng: ChaCha8Rng::seed_from_u64(rng.next_u64()),
                ids: Vec::new(),
                logprobs: Vec::new(),
                limit: cfg.max_new_tokens.min(room),
                limited_by_context: room < cfg.max_new_tokens,
                done: (cfg.max_new_tokens == 0).then_some(StopReason::MaxNewTokens),
                text: None,
                matched_stop: None,
                prompt_text: None,
            });
        }
    }
    Ok(rows)
}

fn make_ctx<'a>(
    model: &Decoder,
    tokenizer: &'a Tokenizer,
    cfg: &'a GenerationConfig,
) -> Result<Ctx<'a>, GenerateError> {
    let vocab = model.config().vocab_size;
    let support = tokenizer.get_vocab_size(true).min(vocab);
    if support == 0 {
        return Err(GenerateError::Tokenizer(
            "tokenizer has an empty vocabulary".into(),
        ));
    }
    Ok(Ctx {
        tokenizer,
        params: cfg.sampling(),
        eos: cfg
            .eos_ids
            .clone()
            .unwrap_or_else(|| model.config().eos_ids()),
        stops: &cfg.stop_strings,
        support,
    })
}

fn progress_bar(show: bool, n: usize) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(n as u64);
    if let Ok(style) =
        ProgressStyle::with_template("generate {bar:30} {pos}/{len} rows {elapsed} eta {eta}")
    {
        pb.set_style(style);
    }
    pb
}

/// Generates completions for `prompts` (token ids, at least one each) with a KV cache.
///
/// Returns `prompts.len() * num_generations` generations ordered by (prompt, generation).
/// Reproducible: the same `rng` state, prompts and config give the same tokens.
pub fn generate(
    model: &Decoder,
    tokenizer: &Tokenizer,
    prompts: &[Vec<u32>],
    cfg: &GenerationConfig,
    rng: &mut ChaCha8Rng,
) -> Result<Vec<Generation>, GenerateError> {
    let ctx = make_ctx(model, tokenizer, cfg)?;
    let rows = make_rows(model, prompts, cfg, rng)?;
    let pb = progress_bar(cfg.progress, rows.len());
    // Longest prompts first, so each batch pads little; results go back to their slots.
    let mut order: Vec<usize> = (0..rows.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(rows[i].prompt.len()));
    let mut slots: Vec<Option<Row>> = rows.into_iter().map(Some).collect();
    let bs = if cfg.batch_size == 0 {
        order.len().max(1)
    } else {
        cfg.batch_size
    };
    let mut done: Vec<Option<Generation>> = vec![None; slots.len()];
    for chunk in order.chunks(bs) {
        let mut batch: Vec<Row> = chunk.iter().filter_map(|&i| slots[i].take()).collect();
        generate_batch(model, &ctx, &mut batch, &pb)?;
        for (&i, row) in chunk.iter().zip(batch) {
            done[i] = Some(row.finish(tokenizer)?);
        }
    }
    pb.finish_and_clear();
    Ok(done.into_iter().flatten().collect())
}

/// [`generate`] seeded from `cfg.seed`.
pub fn generate_seeded(
    model: &Decoder,
    tokenizer: &Tokenizer,
    prompts: &[Vec<u32>],
    cfg: &GenerationConfig,
) -> Result<Vec<Generation>, GenerateError> {
    generate(model, tokenizer, prompts, cfg, &mut cfg.rng())
}

/// Logits of the last position over the supported vocabulary, on the model's device:
/// `hidden` [B, T, H] → [B, support].
fn last_logits(model: &Decoder, hidden: &Tensor, ctx: &Ctx) -> Result<Tensor, GenerateError> {
    let t = hidden.dim(1)?;
    // [B, 1, H] -> [B, H]: a rank-2 product multiplies by the transposed LM head in place,
    // where the rank-3 broadcast would copy the whole [H, V] head every step.
    let last = hidden.narrow(1, t - 1, 1)?.squeeze(1)?.contiguous()?;
    Ok(model.logits(&last)?.narrow(1, 0, ctx.support)?) // [B, support]
}

/// Samples the next token of every live row of the batch from `logits` [B, support]: greedy
/// and untruncated sampling on the logits' device ([`on_device`]; a few floats per row reach
/// the host), top-k/top-p on the host. Each row draws from its own RNG. Finished rows get 0.
fn sample_live(rows: &mut [Row], logits: &Tensor, ctx: &Ctx) -> Result<Vec<u32>, GenerateError> {
    let mut next = vec![0u32; rows.len()];
    if on_device::supported(&ctx.params) {
        let u: Vec<f64> = rows
            .iter_mut()
            .map(|r| match r.finished() || ctx.params.is_greedy() {
                true => 0.0,
                false => r.rng.random::<f64>(),
            })
            .collect();
        let draws = on_device::sample_rows(logits, &ctx.params, &u)?;
        for (r, (row, d)) in rows.iter_mut().zip(draws).enumerate() {
            if row.finished() {
                continue;
            }
            let s = match d {
                Draw::Token(s) => s,
                // NaN, +inf or nothing finite: the host sampler says which.
                Draw::Host => {
                    let host: Vec<f32> = logits.get(r)?.to_dtype(DType::F32)?.to_vec1()?;
                    sample_token(&host, &ctx.params, &mut row.rng)?
                }
            };
            next[r] = row.record(s, ctx)?;
        }
    } else {
        let host: Vec<Vec<f32>> = logits.to_dtype(DType::F32)?.to_vec2()?;
        for (r, row) in rows.iter_mut().enumerate() {
            if !row.finished() {
                let s = sample_token(&host[r], &ctx.params, &mut row.rng)?;
                next[r] = row.record(s, ctx)?;
            }
        }
    }
    Ok(next)
}

/// Runs one left-padded batch to completion.
fn generate_batch(
    model: &Decoder,
    ctx: &Ctx,
    rows: &mut [Row],
    pb: &ProgressBar,
) -> Result<(), GenerateError> {
    let b = rows.len();
    let dev = model.device();
    let max_pos = model.config().max_position_embeddings;
    let p = rows.iter().map(|r| r.prompt.len()).max().unwrap_or(0);
    if b == 0 || p == 0 || rows.iter().all(Row::finished) {
        return Ok(());
    }
    // 1. Left-pad to [B, P]: pads get id 0, position 0 and an invalid key.
    let mut ids = vec![0u32; b * p];
    let mut pos = vec![0u32; b * p];
    let mut valid = vec![0f32; b * p];
    for (r, row) in rows.iter().enumerate() {
        let off = p - row.prompt.len();
        for (j, &id) in row.prompt.iter().enumerate() {
            ids[r * p + off + j] = id;
            pos[r * p + off + j] = j as u32;
            valid[r * p + off + j] = 1.0;
        }
    }
    // Which keys are real, [B, S] on the device; grows by one column per step.
    let mut valid = Tensor::from_vec(valid, (b, p), dev)?;
    let mut cache = KvCache::new(model.config().num_hidden_layers);
    let hidden = model.forward_hidden(
        &Tensor::from_vec(ids, (b, p), dev)?,
        Some(&mut cache),
        Some(&Tensor::from_vec(pos, (b, p), dev)?),
        Some(&valid),
    )?;
    let mut logits = last_logits(model, &hidden, ctx)?;
    pb.inc(rows.iter().filter(|r| r.finished()).count() as u64);

    // 2. Decode: sample for every live row, then feed all rows one token.
    loop {
        let was_live: Vec<bool> = rows.iter().map(|r| !r.finished()).collect();
        let next = sample_live(rows, &logits, ctx)?;
        // Rows finished before this step keep position 0 (their key is masked anyway).
        let next_pos: Vec<u32> = rows
            .iter()
            .zip(&was_live)
            .map(|(row, &live)| match live {
                true => (row.prompt.len() + row.ids.len() - 1) as u32,
                false => 0,
            })
            .collect();
        let ended = was_live
            .iter()
            .zip(rows.iter())
            .filter(|(&l, r)| l && r.finished());
        pb.inc(ended.count() as u64);
        if rows.iter().all(Row::finished) {
            return Ok(());
        }
        // The padded cache holds P + steps keys; rows shorter than P can hit that first.
        if cache.seq_len() + 1 > max_pos {
            for row in rows.iter_mut().filter(|r| !r.finished()) {
                row.done = Some(StopReason::ContextFull);
                pb.inc(1);
            }
            return Ok(());
        }
        // A finished row's new key is masked, so it never disturbs anything (it only attends
        // to itself).
        let col: Vec<f32> = rows
            .iter()
            .map(|r| f32::from(u8::from(!r.finished())))
            .collect();
        valid = Tensor::cat(&[&valid, &Tensor::from_vec(col, (b, 1), dev)?], 1)?;
        let hidden = model.forward_hidden(
            &Tensor::from_vec(next, (b, 1), dev)?,
            Some(&mut cache),
            Some(&Tensor::from_vec(next_pos, (b, 1), dev)?),
            Some(&valid),
        )?;
        logits = last_logits(model, &hidden, ctx)?;
    }
}

/// Reference path: every row alone, unpadded, re-running the whole sequence each step (no
/// cache). Same rows, RNG streams and stop rules as [`generate`]; used by the tests.
pub fn generate_no_cache(
    model: &Decoder,
    tokenizer: &Tokenizer,
    prompts: &[Vec<u32>],
    cfg: &GenerationConfig,
    rng: &mut ChaCha8Rng,
) -> Result<Vec<Generation>, GenerateError> {
    let ctx = make_ctx(model, tokenizer, cfg)?;
    let rows = make_rows(model, prompts, cfg, rng)?;
    let mut out = Vec::with_capacity(rows.len());
    for mut row in rows {
        while !row.finished() {
            let seq: Vec<u32> = row.prompt.iter().chain(&row.ids).copied().collect();
            let n = seq.len();
            let ids = Tensor::from_vec(seq, (1, n), model.device())?;
            let hidden = model.forward_hidden(&ids, None, None, None)?;
            let logits = last_logits(model, &hidden, &ctx)?;
            sample_live(std::slice::from_mut(&mut row), &logits, &ctx)?;
        }
        out.push(row.finish(tokenizer)?);
    }
    Ok(out)
}
