//! Wire types of the teacher API (see `docs/protocol.md` for the full description).
//!
//! For a sequence of length `S` and a request `start`, the teacher returns `S - 1 - start` rows:
//! row `r` is the distribution at position `p = start + r`, i.e. the one that *predicts token
//! `p + 1`*. So `target_logprobs[r]` is the log-prob of `sequence[start + r + 1]`.

use serde::{Deserialize, Serialize};

/// Path of the scoring route.
pub const TOPK_PATH: &str = "/topk_logits";

/// Path of the hidden-state route (`POST`): per position, the teacher's final-norm hidden state
/// (the LM head's input), for exact full-vocabulary distillation on the client's side.
pub const HIDDEN_PATH: &str = "/hidden_states";

/// Path of the output-head route (`GET`): the LM head's weight (and bias, scale, soft-cap) as
/// one safetensors file, served once per model version.
pub const HEAD_PATH: &str = "/v1/head";

/// Response header of `/v1/head` (and `/hidden_states`): SHA-256 hex of the head file's bytes.
pub const HEAD_FINGERPRINT_HEADER: &str = "x-xdistill-head-fingerprint";

/// Response header of the scoring routes (`/topk_logits`, `/hidden_states`): the answering
/// replica's [`ProbeInfo::hash`], so a client behind a load balancer sees whose numbers it got.
pub const PROBE_HEADER: &str = "x-xdistill-probe";

/// Header the clients send with a stable hash of a request's sequences, so that a load balancer
/// hashing on it (`docker/haproxy.cfg`) sends the same text to the same replica, whose cache then
/// answers it.
pub const AFFINITY_HEADER: &str = "x-xdistill-affinity";

/// The affinity key of a request: the first 16 hex digits of the SHA-256 of its sequences
/// (each as its length then its ids, u32 little-endian). `python/xdistill` computes the same.
pub fn affinity_key(sequences: &[Vec<u32>]) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for s in sequences {
        h.update((s.len() as u32).to_le_bytes());
        for id in s {
            h.update(id.to_le_bytes());
        }
    }
    hex::encode(&h.finalize()[..8])
}
/// Protocol version, reported by `/v1/info`. Version 2 added `k = 0` and `ids` (backwards
/// compatible: every version-1 request means the same and gets the same answer).
pub const PROTOCOL_VERSION: u32 = 2;

/// What `topk_values` holds (log-probs or scaled logits): the host scoring's own choice, whose
/// wire form is its name.
pub use xdistill_cpu_kernels::row_scores::ValuesKind;

/// Strict decoding of request fields: lists must be lists (MessagePack `bin` blobs are refused
/// where ids are expected, as JSON would refuse a string). Names must be strings too: `values`
/// ([`ValuesKind`]'s own `Deserialize`).
mod strict {
    use serde::de::{Deserialize, Deserializer, SeqAccess, Visitor};
    use std::fmt;
    use std::marker::PhantomData;

    /// A list decoded through `deserialize_any`, so that a `bin` blob is seen as bytes (and
    /// refused) instead of being read as a list of its bytes.
    pub struct List<T>(pub Vec<T>);

    impl<'de, T: Deserialize<'de>> Deserialize<'de> for List<T> {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V<T>(PhantomData<T>);
            impl<'de, T: Deserialize<'de>> Visitor<'de> for V<T> {
                type Value = List<T>;
                fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                    f.write_str("a list")
                }
                fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<List<T>, A::Error> {
                    // The size hint comes from the sender: cap the preallocation.
                    let mut out = Vec::with_capacity(a.size_hint().unwrap_or(0).min(4096));
                    while let Some(x) = a.next_element()? {
                        out.push(x);
                    }
                    Ok(List(out))
                }
            }
            d.deserialize_any(V(PhantomData))
        }
    }

    /// `[[u32]]`.
    pub fn lists<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Vec<u32>>, D::Error> {
        Ok(List::<List<u32>>::deserialize(d)?
            .0
            .into_iter()
            .map(|l| l.0)
            .collect())
    }

    /// `[usize]` or absent.
    pub fn opt_list<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<usize>>, D::Error> {
        Ok(Option::<List<usize>>::deserialize(d)?.map(|l| l.0))
    }

    /// Candidate ids: per sequence, per row, a list.
    type Candidates = Vec<Vec<Vec<u32>>>;

    /// `[[[u32]]]` or absent.
    pub fn opt_list3<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Candidates>, D::Error> {
        Ok(Option::<List<List<List<u32>>>>::deserialize(d)?.map(|a| {
            a.0.into_iter()
                .map(|b| b.0.into_iter().map(|c| c.0).collect())
                .collect()
        }))
    }
}

fn default_temperature() -> f32 {
    1.0
}

/// Body of `POST /topk_logits` (JSON or MessagePack, same field names).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TopkRequest {
    /// Token ids in the teacher's vocabulary, one list per sequence (lengths may differ).
    #[serde(deserialize_with = "strict::lists")]
    pub sequences: Vec<Vec<u32>>,
    /// Number of top entries per position.
    pub k: usize,
    /// Logits are divided by this before the softmax (and in `logsumexp`).
    #[serde(default = "default_temperature")]
    pub temperature: f32,
    /// First position returned, the same for every sequence (ignored when `starts` is given).
    #[serde(default)]
    pub start: usize,
    /// Optional per-sequence first positions (on-policy scoring: the completion starts differ).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "strict::opt_list"
    )]
    pub starts: Option<Vec<usize>>,
    #[serde(default)]
    pub values: ValuesKind,
    /// Optional candidate ids to score exactly (e.g. the student's own top-k): one entry per
    /// sequence, each `[rows][m]` (the same `m` for every row of a sequence). The answer's
    /// `ids_logprobs` holds the teacher's full-vocabulary log-probs at these ids.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "strict::opt_list3"
    )]
    pub ids: Option<Vec<Vec<Vec<u32>>>>,
}

impl TopkRequest {
    /// The start position of sequence `i` (per-sequence `starts` win over `start`).
    pub fn start_of(&self, i: usize) -> usize {
        match &self.starts {
            Some(s) => s.get(i).copied().unwrap_or(self.start),
            None => self.start,
        }
    }
}

/// Scores of one sequence, row-major flat buffers.
///
/// Shapes: `topk_ids` and `topk_values` are `[rows, k]`; `target_logprobs` and `logsumexp`
/// are `[rows]`; `ids_logprobs` is `[rows, m]` (empty with `m = 0` unless candidate ids were
/// asked for). Within a row, top-k entries are sorted by descending value.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SequenceScores {
    pub rows: usize,
    pub k: usize,
    pub topk_ids: Vec<u32>,
    pub topk_values: Vec<f32>,
    pub target_logprobs: Vec<f32>,
    pub logsumexp: Vec<f32>,
    /// Candidate ids per row (0 when none were asked for).
    pub m: usize,
    /// `[rows, m]`: log-probs at the request's candidate ids.
    pub ids_logprobs: Vec<f32>,
    /// `[rows]` or empty: 1-based rank of each row's target over the whole vocabulary (ties
    /// ranked last). Server-side only, for the vLLM-compatible route; never on the native wire.
    pub target_ranks: Vec<u32>,
    /// The token chosen after the last position (greedy or sampled) when a compatible route asked
    /// for one; its row is the last row. Server-side only, never on the native wire.
    pub next_token: Option<u32>,
    /// `[rows, H]` final-norm hidden states, little-endian bytes, when [`HIDDEN_PATH`] asked
    /// for them (then nothing else is filled and `k` is 0): in the model's dtype on the server
    /// (the route's answer is a [`HiddenResponse`]), widened to f32 by the trainer's client.
    /// Never on the native wire.
    pub hidden: Vec<u8>,
}

/// The host scoring's answer for a sequence's rows, with nothing else filled.
impl From<xdistill_cpu_kernels::row_scores::RowScores> for SequenceScores {
    fn from(s: xdistill_cpu_kernels::row_scores::RowScores) -> SequenceScores {
        SequenceScores {
            rows: s.rows,
            k: s.k,
            topk_ids: s.topk_ids,
            topk_values: s.topk_values,
            target_logprobs: s.target_logprobs,
            logsumexp: s.logsumexp,
            m: s.m,
            ids_logprobs: s.ids_logprobs,
            target_ranks: s.target_ranks,
            next_token: None,
            hidden: Vec::new(),
        }
    }
}

impl SequenceScores {
    /// Every id and value of the wire fields as bits, in a fixed order: equal vectors mean a
    /// bit-identical answer (f32 equality would hide -0.0 vs 0.0 and NaN).
    pub fn bits(&self) -> Vec<u32> {
        let f = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
        [
            self.topk_ids.clone(),
            f(&self.topk_values),
            f(&self.target_logprobs),
            f(&self.logsumexp),
            f(&self.ids_logprobs),
        ]
        .concat()
    }
    /// Row `r` of the top-k ids, `[k]`.
    pub fn ids_row(&self, r: usize) -> &[u32] {
        &self.topk_ids[r * self.k..(r + 1) * self.k]
    }
    /// Row `r` of the top-k values, `[k]`.
    pub fn values_row(&self, r: usize) -> &[f32] {
        &self.topk_values[r * self.k..(r + 1) * self.k]
    }
    /// Row `r` of the candidate-id log-probs, `[m]`.
    pub fn ids_logprobs_row(&self, r: usize) -> &[f32] {
        &self.ids_logprobs[r * self.m..(r + 1) * self.m]
    }
    /// Approximate heap size, used to weigh cache entries.
    pub fn heap_bytes(&self) -> usize {
        4 * (self.topk_ids.len()
            + self.topk_values.len()
            + self.target_logprobs.len()
            + self.logsumexp.len()
            + self.ids_logprobs.len()
            + self.target_ranks.len())
            + self.hidden.len()
    }
    /// Checks that the buffer lengths agree with `rows`, `k` and `m` (a product that
    /// overflows agrees with no length).
    pub fn check_shapes(&self) -> Result<(), String> {
        let rk = self.rows.checked_mul(self.k);
        if rk != Some(self.topk_ids.len())
            || rk != Some(self.topk_values.len())
            || self.target_logprobs.len() != self.rows
            || self.logsumexp.len() != self.rows
            || self.rows.checked_mul(self.m) != Some(self.ids_logprobs.len())
        {
            return Err(format!(
                "inconsistent shapes: rows={} k={} m={} ids={} values={} target={} lse={} \
                 ids_logprobs={}",
                self.rows,
                self.k,
                self.m,
                self.topk_ids.len(),
                self.topk_values.len(),
                self.target_logprobs.len(),
                self.logsumexp.len(),
                self.ids_logprobs.len()
            ));
        }
        Ok(())
    }
}

/// Response of `POST /topk_logits`: one entry per request sequence, in request order.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TopkResponse {
    pub k: usize,
    pub values: ValuesKind,
    pub temperature: f32,
    /// Fingerprint of the model that produced the scores (same as `/v1/info`).
    pub model: String,
    /// Whether the request sent candidate `ids` (then every result carries `ids_logprobs`).
    pub with_ids: bool,
    pub results: Vec<SequenceScores>,
}

/// Body of `POST /hidden_states` (JSON or MessagePack, same field names): the sequences and
/// their first returned positions, as in [`TopkRequest`] (the same S − 1 convention: row `r` is
/// position `start + r`, the hidden state whose logits predict token `start + r + 1`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HiddenRequest {
    #[serde(deserialize_with = "strict::lists")]
    pub sequences: Vec<Vec<u32>>,
    #[serde(default)]
    pub start: usize,
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "strict::opt_list"
    )]
    pub starts: Option<Vec<usize>>,
}

impl HiddenRequest {
    /// The start position of sequence `i` (per-sequence `starts` win over `start`).
    pub fn start_of(&self, i: usize) -> usize {
        match &self.starts {
            Some(s) => s.get(i).copied().unwrap_or(self.start),
            None => self.start,
        }
    }
}

/// The element type of hidden states and of the head: the teacher's compute dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WireDtype {
    F32,
    Bf16,
    F16,
}

impl WireDtype {
    /// The name `/v1/info` uses (`f32`, `bf16`, `f16`).
    pub fn name(self) -> &'static str {
        match self {
            WireDtype::F32 => "f32",
            WireDtype::Bf16 => "bf16",
            WireDtype::F16 => "f16",
        }
    }
    /// From [`WireDtype::name`]'s names (or safetensors' `F32`, `BF16`, `F16`).
    pub fn parse(s: &str) -> Option<WireDtype> {
        match s.to_ascii_lowercase().as_str() {
            "f32" => Some(WireDtype::F32),
            "bf16" => Some(WireDtype::Bf16),
            "f16" => Some(WireDtype::F16),
            _ => None,
        }
    }
    /// The safetensors dtype name.
    pub fn safetensors_name(self) -> &'static str {
        match self {
            WireDtype::F32 => "F32",
            WireDtype::Bf16 => "BF16",
            WireDtype::F16 => "F16",
        }
    }
    pub fn size(self) -> usize {
        match self {
            WireDtype::F32 => 4,
            WireDtype::Bf16 | WireDtype::F16 => 2,
        }
    }
    /// Little-endian bytes of this dtype → f32 (exact: bf16 and f16 widen without rounding).
    pub fn to_f32(self, bytes: &[u8]) -> Result<Vec<f32>, String> {
        if !bytes.len().is_multiple_of(self.size()) {
            return Err(format!(
                "{} bytes are not a whole number of {} values",
                bytes.len(),
                self.name()
            ));
        }
        Ok(match self {
            WireDtype::F32 => bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            WireDtype::Bf16 => bytes
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            WireDtype::F16 => bytes
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
        })
    }
}

/// The hidden states of one sequence: `[rows, hidden_size]`, little-endian, row-major, in the
/// response's dtype.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct HiddenStates {
    pub rows: usize,
    pub data: Vec<u8>,
}

/// Response of `POST /hidden_states` (always MessagePack; see `docs/protocol.md`).
#[derive(Debug, Clone, PartialEq)]
pub struct HiddenResponse {
    /// Model fingerprint (as in `/v1/info`).
    pub model: String,
    /// SHA-256 of the head file `/v1/head` serves: the head these states go with.
    pub head_fingerprint: String,
    pub dtype: WireDtype,
    pub hidden_size: usize,
    pub results: Vec<HiddenStates>,
}

impl HiddenResponse {
    /// Sequence `i`'s states as f32, `[rows * hidden_size]`.
    pub fn f32_rows(&self, i: usize) -> Result<Vec<f32>, String> {
        self.dtype.to_f32(&self.results[i].data)
    }
}

/// What `/v1/info` says about exact full-vocabulary distillation: the hidden-state and head
/// routes, and the head they serve.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FullVocabInfo {
    /// `POST` path of the hidden states ([`HIDDEN_PATH`]).
    pub hidden_route: String,
    /// `GET` path of the head ([`HEAD_PATH`]).
    pub head_route: String,
    /// Element type of the hidden states and of the head (`f32`, `bf16`, `f16`).
    pub dtype: String,
    pub hidden_size: usize,
    /// Rows of the head (`logits_size`); rows at or above `vocab_size` are padding, excluded
    /// from every log-softmax.
    pub head_rows: usize,
    pub vocab_size: usize,
    /// Whether the head is the input embedding (tied).
    pub tied: bool,
    /// Whether the head has a bias (`[head_rows]`).
    pub bias: bool,
    /// Logits are `(hidden · W^T + b) · logit_scale`, then, with a soft-cap `c`,
    /// `c · tanh(logits / c)`.
    pub logit_scale: f64,
    pub logit_softcap: Option<f64>,
    /// SHA-256 hex of exactly the bytes `/v1/head` serves.
    pub head_fingerprint: String,
    /// Length of the head file in bytes.
    pub head_bytes: u64,
}

/// Error body of every non-2xx answer, on every route:
/// `{"error": {"type": ..., "message": ..., "field": ..., "param": ..., "code": STATUS}}`.
/// `param` and `code` make it the OpenAI error shape too (what vLLM's clients parse).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorDetail {
    /// Machine-readable class, e.g. `invalid_request`, `queue_full`, `unauthorized`.
    #[serde(rename = "type")]
    pub kind: String,
    pub message: String,
    /// The offending request field, when there is one (e.g. `sequences[3][17]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    /// The same as `field`, under the OpenAI name (always sent; null when there is none).
    #[serde(default)]
    pub param: Option<String>,
    /// The HTTP status code.
    #[serde(default)]
    pub code: Option<u16>,
}

/// Limits the server enforces, reported in `/v1/info`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Limits {
    pub max_k: usize,
    pub max_seq_len: usize,
    pub max_batch_tokens: usize,
    pub max_queue_tokens: usize,
    pub max_body_bytes: usize,
    pub max_wait_ms: u64,
    /// Most sequences per request (0 when talking to a server older than protocol 2).
    #[serde(default)]
    pub max_sequences: usize,
    /// Most bytes of scores per answer (0 when talking to a server older than protocol 2).
    #[serde(default)]
    pub max_answer_bytes: usize,
}

/// Body of `GET /v1/info`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InfoResponse {
    pub protocol_version: u32,
    pub server_version: String,
    /// e.g. `Qwen3ForCausalLM`.
    pub architecture: String,
    /// `config.json`'s `model_type`: `qwen3`, `qwen2`, `llama`, `mistral`, `gemma3_text`,
    /// `phi3` or `qwen3_moe`.
    pub model_type: String,
    /// Number of valid token ids (the tokenizer's vocabulary incl. added tokens); ids must be below.
    pub vocab_size: usize,
    /// Rows of the LM head (≥ `vocab_size`; extra rows are padding and never returned).
    pub logits_size: usize,
    pub max_seq_len: usize,
    pub dtype: String,
    pub device: String,
    pub tokenizer_sha256: String,
    pub model_fingerprint: String,
    pub limits: Limits,
    /// RoPE of the full-attention layers as applied: base and scaling type (`default`,
    /// `linear`, `dynamic`, `llama3`, `yarn`, `longrope`); absent from servers older than
    /// protocol 2.
    #[serde(default)]
    pub rope_theta: f64,
    #[serde(default)]
    pub rope_scaling: String,
    /// The attention window of sliding layers, and how many of the layers slide (`null` and 0
    /// when every layer attends to the whole sequence).
    #[serde(default)]
    pub sliding_window: Option<usize>,
    #[serde(default)]
    pub sliding_layers: usize,
    /// The instruction set of the host scoring pass (`avx512`, `avx2` or `baseline`), chosen at
    /// start-up from the CPU; empty from older servers.
    #[serde(default)]
    pub host_simd: String,
    /// How logits become scores: `fused` (on the host, the LM head a vocabulary tile at a time,
    /// each tile scored in cache), `full` (the whole logits, then scored on the host) or
    /// `device` (scored where the model runs); empty from older servers.
    #[serde(default)]
    pub lm_head: String,
    /// Whether a sequence's scores are bit-identical whatever it is batched with
    /// (`--batch-invariant`; false from servers older than protocol 2).
    #[serde(default)]
    pub batch_invariant: bool,
    /// Where the weights came from: `safetensors`, or `gguf` and the file's quantization types
    /// (`gguf Q4_1+Q6_K`), dequantized at load to `dtype`; empty from older servers.
    #[serde(default)]
    pub weights: String,
    /// The start-up probe's result (see [`ProbeInfo`]); absent from older servers and from a
    /// server whose probe failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub probe: Option<ProbeInfo>,
}

/// `/v1/info`'s `probe`: a fixed sequence (derived from the vocabulary size only) scored by the
/// teacher at start-up. Replicas whose hashes differ give different numbers for the same input
/// (other dtype, device or scoring path) even when their weights are the same.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProbeInfo {
    /// SHA-256 hex of the probe's ids and of every id and f32 of its scores (docs/protocol.md).
    pub hash: String,
    /// SHA-256 hex of the probe's ids alone: equal when two probes scored the same input.
    pub ids_hash: String,
    /// Top entries per row of the probe's scoring.
    pub k: usize,
    /// Rows scored (the probe's length minus one).
    pub positions: usize,
    /// The log-prob of each next probe id, one per position: how far two replicas disagree.
    pub target_logprobs: Vec<f32>,
}

impl ProbeInfo {
    /// The largest absolute difference of the two probes' target log-probs (`None` when they
    /// did not score the same ids, so their values cannot be compared).
    pub fn max_abs_diff(&self, other: &ProbeInfo) -> Option<f32> {
        if self.ids_hash != other.ids_hash
            || self.target_logprobs.len() != other.target_logprobs.len()
        {
            return None;
        }
        Some(
            self.target_logprobs
                .iter()
                .zip(&other.target_logprobs)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max),
        )
    }
}

/// `GET /v1/info` with its `full_vocab` object: every field of [`InfoResponse`] plus what
/// [`FullVocabInfo`] holds (a separate type so that [`InfoResponse`]'s literals stay valid;
/// a client that decodes [`InfoResponse`] ignores `full_vocab`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InfoWithFullVocab {
    #[serde(flatten)]
    pub info: InfoResponse,
    /// The hidden-state and head routes; absent from servers without them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub full_vocab: Option<FullVocabInfo>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The key depends on the ids and their grouping into sequences; its value is pinned so the
    /// Python client (which must compute the same) can be checked against it:
    /// `hashlib.sha256(struct.pack("<IIII", 3, 1, 2, 3)).hexdigest()[:16]`.
    #[test]
    fn affinity_key_is_stable() {
        let k = affinity_key(&[vec![1, 2, 3]]);
        assert_eq!(k.len(), 16);
        let mut want = Vec::new();
        for x in [3u32, 1, 2, 3] {
            want.extend_from_slice(&x.to_le_bytes());
        }
        use sha2::{Digest, Sha256};
        assert_eq!(k, hex::encode(&Sha256::digest(&want)[..8]));
        assert_ne!(k, affinity_key(&[vec![1, 2], vec![3]]));
        assert_ne!(k, affinity_key(&[vec![1, 2, 4]]));
    }
}
