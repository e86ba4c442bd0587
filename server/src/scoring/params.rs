//! What scoring is asked to do: where it runs (`--topk`, `--lm-head`), what a request asks of
//! every row ([`ScoreParams`], [`NextToken`]) and how the rows' logits and candidates are laid
//! out ([`RowLayout`], [`CandidateRows`]).

use xdistill_shared::protocol::ValuesKind;

/// Where the scores of logit rows are computed (`--topk`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum TopkPath {
    /// On the model's device for a GPU, on the host for the CPU.
    #[default]
    Auto,
    /// On the model's device with tensor ops (only `[N, k]` results leave it); on the CPU this
    /// is the GPU code path run on the CPU, for checks.
    Device,
    /// Logits scored on the host ([`super::host`]).
    Host,
}

impl TopkPath {
    /// Whether scoring runs on `device` (true) or on the host.
    pub fn on_device(self, device: &candle_core::Device) -> bool {
        match self {
            TopkPath::Auto => !device.is_cpu(),
            TopkPath::Device => true,
            TopkPath::Host => false,
        }
    }
}

/// How the host path turns hidden states into scores (`--lm-head`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LmHead {
    /// Logits a vocabulary tile at a time, each tile folded into the rows' running scores
    /// while it is in cache: `[N, V]` is never materialised and LM-head padding columns are
    /// never computed. With AVX-512 and an f32 head the server's kernel makes and folds the
    /// tiles ([`super::RowFolds::fold_head`]); otherwise candle's matmul makes tiles of
    /// [`super::RowFolds::TILE`] columns (and requests for ranks fall back to `full`).
    #[default]
    Fused,
    /// The `[N, V]` logits of a chunk of positions, then [`super::score_rows`] over them.
    Full,
}

/// What a request asks for, shared by all its sequences.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScoreParams {
    /// Top entries per row (0: only target log-probs and logsumexps).
    pub k: usize,
    pub temperature: f32,
    pub values: ValuesKind,
    /// Also report each target's rank over the vocabulary (vLLM's `rank`).
    pub ranks: bool,
    /// Score one row past the last token and choose the next token from it (the compatible
    /// routes' `max_tokens: 1`).
    pub next: Option<NextToken>,
    /// Return each row's final-norm hidden state instead of scores (`/hidden_states`; then
    /// `k` is 0 and nothing else is computed).
    pub hidden: bool,
}

impl ScoreParams {
    /// `/hidden_states`' parameters: hidden states only.
    pub fn hidden_states() -> ScoreParams {
        ScoreParams {
            hidden: true,
            ..ScoreParams::native(0, 1.0, ValuesKind::Logprobs)
        }
    }

    /// The native route's parameters: no ranks, no next token.
    pub fn native(k: usize, temperature: f32, values: ValuesKind) -> ScoreParams {
        ScoreParams {
            k,
            temperature,
            values,
            ranks: false,
            next: None,
            hidden: false,
        }
    }
}

/// How the token after a sequence is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NextToken {
    /// The most likely token (the lowest id among equal maxima).
    Greedy,
    /// A draw from `softmax(logits / temperature)`, reproducible from the seed.
    Sample { seed: u64 },
}

/// Layout of logit rows: `width` columns, of which the first `valid` are real tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowLayout {
    pub width: usize,
    pub valid: usize,
}

/// Candidate ids of a run of rows, `[rows, m]` row-major (`m = 0`: none).
#[derive(Debug, Clone, Copy, Default)]
pub struct CandidateRows<'a> {
    pub ids: &'a [u32],
    pub m: usize,
}

impl<'a> CandidateRows<'a> {
    /// Rows `r0..r1` of these candidates.
    pub fn rows(&self, r0: usize, r1: usize) -> CandidateRows<'a> {
        CandidateRows {
            ids: &self.ids[r0 * self.m..r1 * self.m],
            m: self.m,
        }
    }
}
