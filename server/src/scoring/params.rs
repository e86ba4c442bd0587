//! What scoring is asked to do: where it runs (`--topk`, `--lm-head`), what a request asks of
//! every row ([`ScoreParams`], [`NextToken`], defined with the request in [`crate::request`];
//! as the row scorers read it, `xdistill_shared::topk::RowQuery`) and the rows' candidates
//! ([`CandidateRows`]).

pub use crate::request::{NextToken, ScoreParams};
pub use xdistill_cpu_kernels::row_scores::CandidateRows;

/// Where the scores of logit rows are computed (`--topk`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum TopkPath {
    /// On the model's device for a GPU, on the host for the CPU.
    #[default]
    Auto,
    /// On the model's device with tensor ops (only `[N, k]` results leave it); on the CPU this
    /// is the GPU code path run on the CPU, for checks.
    Device,
    /// Logits scored on the host (`super::host`).
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
    /// never computed. With AVX2 or AVX-512 and an f32 head the server's kernel makes and folds the
    /// tiles ([`super::RowFolds::fold_head`]); otherwise candle's matmul makes tiles of
    /// [`super::RowFolds::TILE`] columns (and requests for ranks fall back to `full`).
    #[default]
    Fused,
    /// The `[N, V]` logits of a chunk of positions, then [`super::score_rows`] over them.
    Full,
}
