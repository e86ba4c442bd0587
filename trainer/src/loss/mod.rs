//! Distillation losses: same-tokenizer top-k divergences ([`kl`]), cross-tokenizer chunk losses
//! ([`xtoken`], [`alm`]), the student's next-token cross-entropy ([`ce`]) and how they combine.
//!
//! Every loss is a pure function of candle tensors that is differentiable with respect to the
//! student logits (only ops with a backward pass), returns a scalar loss tensor and a small struct
//! of detached metrics. Formulas, conventions and shapes: `docs/losses.md`.

pub mod alm;
pub mod ce;
pub mod full_vocab;
pub mod fused_head;
pub mod kl;
pub mod normalizer;
pub mod sampled;
pub mod stable;
pub mod temperature;
#[cfg(test)]
pub(crate) mod testutil;
pub mod topk;
pub mod xtoken;
pub mod xtoken_full;

use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};

pub use alm::alm_loss;
pub use ce::{combine, cross_entropy, cross_entropy_known, Combined};
pub use kl::{topk_divergence, topk_divergence_figures, Divergence, TopkTargets};
pub use normalizer::{BadNormalizer, Normalizer};
pub use sampled::{
    chunk_sampled_loss, sampled_token_loss, sampled_token_loss_pending, SampledTargets,
};
pub use temperature::{BadTemperature, Temperature};
pub use xtoken::{first_kl_loss, gold_loss, pkl_loss, Projection, XTokenBatch};
pub use xtoken_full::{FullChunkLoss, TeacherStates, XTokenFull};

/// Errors of the loss functions: bad shapes or values in the inputs, a bad config, or candle.
#[derive(Debug, thiserror::Error)]
pub enum LossError {
    #[error("invalid loss input `{field}`: {message}")]
    Input {
        field: &'static str,
        message: String,
    },
    #[error("invalid loss config `{field}`: {message}")]
    Config {
        field: &'static str,
        message: String,
    },
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

impl LossError {
    pub(crate) fn input(field: &'static str, message: impl Into<String>) -> Self {
        LossError::Input {
            field,
            message: message.into(),
        }
    }
    pub(crate) fn config(field: &'static str, message: impl Into<String>) -> Self {
        LossError::Config {
            field,
            message: message.into(),
        }
    }
}

pub type Result<T> = std::result::Result<T, LossError>;

/// The whole loss section of a run config (TOML):
///
/// ```toml
/// [loss]
/// kd = { type = "jsd", beta = 0.5 }   # forward_kl | reverse_kl | jsd | total_variation | sampled_kl | pkl | first_kl | gold | alm
/// tail = "bucket"                     # renormalize | bucket | ignore (top-k losses and pkl)
/// temperature = 1.0                   # τ: both sides' logits / τ, loss · τ²
/// kd_weight = 1.0
/// ce = { type = "weight", weight = 0.1 }   # none | weight | dynamic
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LossConfig {
    /// Which distillation loss.
    pub kd: KdConfig,
    /// What to do with the probability mass outside the teacher's top-k. Unset: `bucket` for
    /// the same-tokenizer top-k losses, `renormalize` (NeMo's exact form) for P-KL.
    #[serde(default)]
    pub tail: Option<TailMode>,
    /// Distillation temperature τ (default 1), checked when the config is parsed. The teacher
    /// must be queried with the same `temperature`.
    #[serde(default)]
    pub temperature: Temperature,
    /// Multiplier of the distillation term.
    #[serde(default = "one")]
    pub kd_weight: f64,
    /// Next-token cross-entropy on the student's own targets.
    #[serde(default)]
    pub ce: CeConfig,
}

fn one() -> f64 {
    1.0
}

fn default_alm_tau() -> f64 {
    100.0
}

/// The distillation loss, tagged by `type`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum KdConfig {
    /// Σ_K p_T (lp_T − lp_S).
    ForwardKl {},
    /// Σ_K p_S (lp_S − lp_T).
    ReverseKl {},
    /// Generalized JSD(β), TRL convention: β = 0 is forward KL, β = 1 reverse KL.
    Jsd { beta: f64 },
    /// Total variation distance ½ Σ |p_T − p_S|: bounded by 1, finite where a KL is not.
    TotalVariation {},
    /// On-policy sampled-token reverse KL (REINFORCE form; needs only the teacher's log-prob
    /// of each sampled token). Across tokenizers the unit is an aligned chunk.
    SampledKl {},
    /// Cross-tokenizer chunk-level projected KL (NeMo's P-KL).
    Pkl {
        #[serde(default)]
        anchor: Anchor,
    },
    /// Cross-tokenizer forward KL at each chunk's first student position, the teacher's top-k
    /// grouped by the first student token that spells each entry (with a tail bucket).
    FirstKl {},
    /// Cross-tokenizer hybrid: KL on exactly mapped one-to-one tokens, sorted-probability L1
    /// (ULD) on the other chunks.
    Gold {
        #[serde(default = "one")]
        matched_weight: f64,
        #[serde(default = "one")]
        unmatched_weight: f64,
    },
    /// Cross-tokenizer approximate likelihood matching on chunk log-likelihoods.
    Alm {
        #[serde(default = "default_alm_tau")]
        tau: f64,
    },
}

impl KdConfig {
    /// Whether this loss needs the cross-tokenizer inputs ([`XTokenBatch`]).
    pub fn is_cross_tokenizer(&self) -> bool {
        matches!(
            self,
            KdConfig::Pkl { .. }
                | KdConfig::FirstKl {}
                | KdConfig::Gold { .. }
                | KdConfig::Alm { .. }
        )
    }

    /// Whether this loss can train a student whose tokenizer differs from the teacher's.
    pub fn works_across_tokenizers(&self) -> bool {
        self.is_cross_tokenizer() || self.is_sampled()
    }

    /// Whether this cross-tokenizer loss reads only the teacher's log-probs of its own tokens
    /// (ALM's chunk likelihoods), not its distribution: a hidden-state teacher's answers are
    /// turned into those log-probs before it runs.
    pub fn reads_token_logprobs_only(&self) -> bool {
        matches!(self, KdConfig::Alm { .. })
    }

    /// Whether this cross-tokenizer loss is itself a divergence between the chunk distributions
    /// (`first_kl`, P-KL), so that validation can report it (the others report P-KL).
    pub fn is_chunk_divergence(&self) -> bool {
        matches!(self, KdConfig::FirstKl {} | KdConfig::Pkl { .. })
    }

    /// Whether this loss needs the student's own samples (`trainer on-policy`).
    pub fn is_sampled(&self) -> bool {
        matches!(self, KdConfig::SampledKl {})
    }
}

/// Mass outside the teacher's top-k set K (same-tokenizer top-k losses and P-KL).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TailMode {
    /// Renormalise both sides over K (a k-way distribution).
    Renormalize,
    /// Add one bucket `log(1 − Σ_K p)` on both sides (a (k+1)-way distribution).
    Bucket,
    /// NeMo's `zero_outside_topk`: teacher values as given, student full-vocab log-probs gathered
    /// at K, no renormalisation. Kept for comparison; unstable for reverse KL.
    Ignore,
}

/// Which teacher position of a chunk supplies the top-k set K and its exact log-probs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Anchor {
    /// The chunk's first teacher position: its context is the text before the chunk, the same
    /// text the student has seen at the chunk's first position.
    #[default]
    First,
    /// The chunk's last teacher position.
    Last,
}

/// How the student's next-token cross-entropy enters the total loss.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum CeConfig {
    /// Distillation only.
    None {},
    /// `kd_weight·KD + weight·CE`.
    Weight { weight: f64 },
    /// NeMo's dynamic scaling: `kd_weight·sg(|CE|/|KD|)·KD + CE`.
    Dynamic {},
}

impl Default for CeConfig {
    fn default() -> Self {
        CeConfig::None {}
    }
}

impl LossConfig {
    /// Checks the ranges of every number (call once after parsing; the temperature is checked by
    /// parsing itself, [`Temperature`]).
    pub fn validate(&self) -> Result<()> {
        let pos = |field: &'static str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(LossError::config(field, format!("must be > 0, got {v}")))
            }
        };
        let nonneg = |field: &'static str, v: f64| {
            if v.is_finite() && v >= 0.0 {
                Ok(())
            } else {
                Err(LossError::config(field, format!("must be >= 0, got {v}")))
            }
        };
        nonneg("kd_weight", self.kd_weight)?;
        match self.kd {
            KdConfig::Jsd { beta } if !(0.0..=1.0).contains(&beta) => {
                return Err(LossError::config(
                    "kd.beta",
                    format!("must be in [0, 1], got {beta}"),
                ))
            }
            KdConfig::Alm { tau } => pos("kd.tau", tau)?,
            KdConfig::Gold {
                matched_weight,
                unmatched_weight,
            } => {
                nonneg("kd.matched_weight", matched_weight)?;
                nonneg("kd.unmatched_weight", unmatched_weight)?;
            }
            _ => {}
        }
        if let CeConfig::Weight { weight } = self.ce {
            nonneg("ce.weight", weight)?;
        }
        Ok(())
    }

    /// The same-tokenizer divergence of this config ([`DIVERGENCES`]), `None` for the
    /// cross-tokenizer and sampled-token losses.
    pub fn divergence(&self) -> Option<Divergence> {
        match self.kd {
            KdConfig::ForwardKl {} => Some(Divergence::Forward),
            KdConfig::ReverseKl {} => Some(Divergence::Reverse),
            KdConfig::Jsd { beta } => Some(Divergence::Jsd { beta }),
            KdConfig::TotalVariation {} => Some(Divergence::TotalVariation),
            _ => None,
        }
    }
}

/// The `kd` types [`LossConfig::divergence`] maps to a divergence: what the same-tokenizer
/// top-k and full-vocabulary inputs train with (for messages).
pub const DIVERGENCES: &str = "forward_kl, reverse_kl, jsd or total_variation";

/// What a distillation loss is computed from (see [`kd_loss`]).
#[derive(Debug, Clone, Copy)]
pub enum KdInputs<'a> {
    /// Same tokenizer: the teacher's top-k at the student's positions.
    Topk(&'a TopkTargets),
    /// On-policy: the teacher's log-probs of the student's sampled tokens.
    Sampled(&'a SampledTargets),
    /// Cross tokenizer: aligned chunks and the projection (ALM does not read the projection).
    XToken {
        batch: &'a XTokenBatch,
        projection: &'a Projection,
    },
    /// Same tokenizer, the teacher's whole distribution: its final hidden states `[B, T, H]` at
    /// the student's positions (valid where `mask` `[B, T]` is 1) and its LM head.
    TeacherHidden {
        head: &'a full_vocab::TeacherHead,
        hidden: &'a Tensor,
        mask: &'a Tensor,
    },
    /// Cross tokenizer, the teacher's whole distribution at each chunk's anchor.
    XTokenFull(xtoken_full::XTokenFull<'a>),
}

/// The distillation loss `config.kd` on `student_logits` `[B, T, V]` (before `kd_weight`; see
/// [`combine`]). `normalizer`: the global count of valid units (tokens, or chunks for the
/// cross-tokenizer losses) of an accumulated batch, else the local count is used.
pub fn kd_loss(
    config: &LossConfig,
    student_logits: &Tensor,
    inputs: KdInputs<'_>,
    normalizer: Option<Normalizer>,
) -> Result<(Tensor, KdMetrics)> {
    let (loss, figures) = kd_loss_figures(config, student_logits, inputs, normalizer)?;
    Ok((loss, figures.read()?))
}

/// [`kd_loss`] with its figures as the loss left them ([`KdFigures`]: the fused top-k loss's
/// stay on the device).
pub fn kd_loss_figures(
    config: &LossConfig,
    student_logits: &Tensor,
    inputs: KdInputs<'_>,
    normalizer: Option<Normalizer>,
) -> Result<(Tensor, KdFigures)> {
    if let (Some(div), KdInputs::Topk(t)) = (config.divergence(), inputs) {
        let tail = config.tail.unwrap_or(TailMode::Bucket);
        return topk_divergence_figures(
            student_logits,
            t,
            div,
            tail,
            config.temperature,
            normalizer,
        );
    }
    kd_loss_others(config, student_logits, inputs, normalizer)
}

/// Every distillation loss but the top-k divergences, their figures left on the device too
/// (but the same-tokenizer sampled-token loss's here, which counts its mask on the host).
fn kd_loss_others(
    config: &LossConfig,
    student_logits: &Tensor,
    inputs: KdInputs<'_>,
    normalizer: Option<Normalizer>,
) -> Result<(Tensor, KdFigures)> {
    let tau = config.temperature;
    // The same-tokenizer divergences ([`LossConfig::divergence`]) over the whole distribution
    // (the top-k ones are [`kd_loss_figures`]'s).
    if let (Some(div), KdInputs::TeacherHidden { head, hidden, mask }) =
        (config.divergence(), inputs)
    {
        return full_vocab::full_vocab_divergence(
            student_logits,
            head,
            hidden,
            mask,
            div,
            tau,
            full_vocab::DEFAULT_CHUNK_ROWS,
            normalizer,
        );
    }
    match (&config.kd, inputs) {
        (KdConfig::FirstKl {}, KdInputs::XTokenFull(x)) => {
            xtoken_full::chunk_loss(student_logits, x, FullChunkLoss::FirstKl, tau, normalizer)
        }
        (KdConfig::Pkl { anchor }, KdInputs::XTokenFull(x)) => {
            let tail = config.tail.unwrap_or(TailMode::Renormalize);
            let form = FullChunkLoss::Pkl {
                anchor: *anchor,
                tail,
            };
            xtoken_full::chunk_loss(student_logits, x, form, tau, normalizer)
        }
        (
            KdConfig::Gold {
                matched_weight,
                unmatched_weight,
            },
            KdInputs::XTokenFull(x),
        ) => {
            let form = FullChunkLoss::Gold {
                matched_weight: *matched_weight,
                unmatched_weight: *unmatched_weight,
            };
            xtoken_full::chunk_loss(student_logits, x, form, tau, normalizer)
        }
        (KdConfig::SampledKl {}, KdInputs::Sampled(s)) => {
            let (loss, metrics) = sampled_token_loss(student_logits, s, tau, normalizer)?;
            Ok((loss, metrics.into()))
        }
        (KdConfig::SampledKl {}, KdInputs::XToken { batch, .. }) => {
            chunk_sampled_loss(student_logits, batch, tau, normalizer)
        }
        (KdConfig::FirstKl {}, KdInputs::XToken { batch, projection }) => {
            first_kl_loss(student_logits, batch, projection, tau, normalizer)
        }
        (KdConfig::Pkl { anchor }, KdInputs::XToken { batch, projection }) => pkl_loss(
            student_logits,
            batch,
            projection,
            *anchor,
            config.tail.unwrap_or(TailMode::Renormalize),
            tau,
            normalizer,
        ),
        (
            KdConfig::Gold {
                matched_weight,
                unmatched_weight,
            },
            KdInputs::XToken { batch, projection },
        ) => gold_loss(
            student_logits,
            batch,
            projection,
            *matched_weight,
            *unmatched_weight,
            tau,
            normalizer,
        ),
        (KdConfig::Alm { tau: alm_tau }, KdInputs::XToken { batch, .. }) => {
            alm_loss(student_logits, batch, *alm_tau, tau, normalizer)
        }
        (kd, _) => Err(LossError::config(
            "kd",
            format!("{kd:?} cannot be computed from these inputs"),
        )),
    }
}

/// Detached numbers describing one loss evaluation (for logs and metrics).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct KdMetrics {
    /// The loss value as returned (τ² included where the loss has it; before `kd_weight`).
    pub loss: f64,
    /// Valid units the loss was averaged over in this call: tokens or chunks.
    pub count: f64,
    /// Mean over valid units of the teacher's probability mass inside its top-k set.
    pub teacher_topk_mass: Option<f64>,
    /// Mean over valid units of the student's probability mass on the teacher's top-k set.
    pub student_topk_mass: Option<f64>,
}

/// A distillation term's figures as its loss left them: read on the host, or (the fused loss,
/// `kl::fused_topk_divergence`) still on the device, so that a step's figures come back in
/// one copy instead of one per head chunk.
#[derive(Debug, Clone)]
pub enum KdFigures {
    Read(KdMetrics),
    /// `sums` f64 on the device: the loss (as returned), then the teacher's and the student's
    /// mass on the top-k summed over the `count` valid units, as far as the loss has them
    /// (`[1]`, `[2]` or `[3]`; one length for every chunk of a micro-batch: one loss).
    Pending {
        sums: Tensor,
        count: f64,
    },
}

impl From<KdMetrics> for KdFigures {
    fn from(m: KdMetrics) -> Self {
        KdFigures::Read(m)
    }
}

impl KdFigures {
    /// The figures on the host (one copy back when pending).
    pub fn read(self) -> Result<KdMetrics> {
        match self {
            KdFigures::Read(m) => Ok(m),
            KdFigures::Pending { sums, count } => {
                let v: Vec<f64> = sums.to_vec1()?;
                Ok(KdFigures::from_sums(&v, count))
            }
        }
    }

    /// Figures left on the device: `loss` (a scalar, as returned) and `masses` (scalars summed
    /// over the `count` units): none, the teacher's, or the teacher's and the student's. A
    /// mass known on the host is given as a tensor too (one small copy, no wait).
    pub fn pending(loss: &Tensor, masses: &[&Tensor], count: f64) -> Result<KdFigures> {
        let parts = std::iter::once(loss)
            .chain(masses.iter().copied())
            .map(|t| t.detach().to_dtype(DType::F64)?.reshape(()))
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(KdFigures::Pending {
            sums: Tensor::stack(&parts, 0)?,
            count,
        })
    }

    /// The metrics of pending `sums` (as read back: `[loss]`, `[loss, teacher mass]` or `[loss,
    /// teacher mass, student mass]`) over `count` units.
    pub fn from_sums(sums: &[f64], count: f64) -> KdMetrics {
        let mean = |s: f64| if count > 0.0 { s / count } else { 0.0 };
        let mass = |i: usize| sums.get(i).map(|&s| mean(s));
        KdMetrics {
            loss: sums.first().copied().unwrap_or(0.0),
            count,
            teacher_topk_mass: mass(1),
            student_topk_mass: mass(2),
        }
    }
}

/// The dtype losses are computed in: f64 stays f64 (used by gradient checks), the rest is f32.
pub(crate) fn compute_dtype(logits: &Tensor) -> DType {
    if logits.dtype() == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

#[cfg(test)]
mod tests;
