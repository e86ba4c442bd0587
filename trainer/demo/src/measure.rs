//! What the demo measures on a model: greedy held-out accuracy, the accuracy curve over a run's
//! checkpoints, and the KL to the teacher ([`KlProbe`]).

use anyhow::{Context, Result};
use candle_core::DType;
use std::path::Path;
use xdistill_trainer::config::Config;
use xdistill_trainer::data::Record;
use xdistill_trainer::eval::{self, EvalConfig, EvalRecord};
use xdistill_trainer::train::distill;

/// Greedy held-out accuracy of a model directory.
pub(crate) fn accuracy(dir: &Path, records: &[EvalRecord], max_new_tokens: usize) -> Result<f64> {
    let (model, tok) = eval::load_model(dir, &candle_core::Device::Cpu, DType::F32)?;
    let cfg = EvalConfig {
        max_new_tokens,
        samples: 0,
        progress: false,
        ..Default::default()
    };
    Ok(eval::evaluate(&model, &tok, records, &cfg)?.greedy_accuracy)
}

/// Measures a model's KL to the teacher on held-out records, as the off-policy trainer's
/// validation does (chunk-level P-KL across tokenizers, forward KL over the top-k with a tail
/// bucket on a shared one).
pub struct KlProbe {
    setup: distill::Setup,
    records: Vec<Record>,
}

impl KlProbe {
    /// A probe with the teacher and student of the config at `config_path`, on `records`.
    pub fn new(config_path: &Path, records: Vec<Record>) -> Result<KlProbe> {
        let cfg = Config::from_file(config_path)?;
        Ok(KlProbe {
            setup: distill::setup(cfg)?,
            records,
        })
    }

    /// Mean KL per unit of `model_dir` (whose tokenizer must be the probe's student tokenizer).
    pub fn kl(&self, model_dir: &Path) -> Result<f64> {
        let (model, _) = eval::load_model(model_dir, &self.setup.device, DType::F32)?;
        let sums = self.sums(&model)?;
        Ok(sums.kl / sums.kl_units.max(1.0))
    }

    /// KL and cross-entropy sums of a loaded `model` on the probe's records.
    pub fn sums(
        &self,
        model: &xdistill_shared::model::Decoder,
    ) -> Result<xdistill_trainer::train::micro::ValSums> {
        Ok(distill::kl_to_teacher(&self.setup, model, &self.records, 8)?.0)
    }

    /// The device models are measured on.
    pub fn device(&self) -> &candle_core::Device {
        &self.setup.device
    }
}

/// Evaluates `OUTPUT/<run>/step_N/` checkpoints (then removes them: they hold optimizer state)
/// and `final/`: the accuracy curve, starting from the initial student's point.
pub(crate) fn curve(
    run_dir: &Path,
    steps: u64,
    init: f64,
    records: &[EvalRecord],
    max_new_tokens: usize,
) -> Result<Vec<(u64, f64)>> {
    let mut points = vec![(0, init)];
    let mut ckpts = xdistill_trainer::checkpoint::list(run_dir)?;
    ckpts.retain(|(s, _)| *s > 0 && *s < steps);
    let bar = indicatif::ProgressBar::new(ckpts.len() as u64 + 1).with_style(
        indicatif::ProgressStyle::with_template("   evaluating {bar:30} {pos}/{len} checkpoints")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    for (s, dir) in ckpts {
        points.push((s, accuracy(&dir, records, max_new_tokens)?));
        std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
        bar.inc(1);
    }
    points.push((
        steps,
        accuracy(&run_dir.join("final"), records, max_new_tokens)?,
    ));
    bar.finish_and_clear();
    Ok(points)
}
