//! What scoring is asked to do: where it runs (`--topk`, `--lm-head`), what a request asks of
//! every row ([`ScoreParams`], [`NextToken`], defined with the request in [`crate::request`]) and how the rows' logits and candidates are laid
//! out ([`RowLayout`], [`CandidateRows`]).

pub use crate::request::{NextToken, ScoreParams};

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
