//! `trainer off-policy`: distil a student from a teacher server on dataset text.
//!
//! Per step: `num_prompts_per_step` records are tokenized for both sides (and aligned when the
//! tokenizers differ) and scored by the teacher on the prefetch thread while the previous step
//! trains; the step runs micro-batches of `train_micro_batch_size`, accumulating gradients
//! normalised by the whole step's count, then clips, schedules and applies AdamW. Checkpoints
//! record the position *after* the last trained batch, so `--resume` continues exactly.

use super::prepare::{prepare, too_long, Limits, Prepared, Tokenization};
use super::runner::{Runner, Session};
use super::step::{accumulate, units, validation_sums, Units, ValSums};
use crate::align::AlignTokenizer;
use crate::checkpoint::TrainerState;
use crate::client::{BlockingClient, ClientError, Prefetcher, TeacherClient, TeacherTokenizer};
use crate::config::{Config, OffPolicyArgs};
use crate::data::{self, Record};
use crate::loss::{LossConfig, Projection as LossProjection};
use crate::metrics_log::{unix_time, MetricsLog, StepMetrics, ValMetrics};
use crate::optim::GradAccumulator;
use crate::projection::Projection;
use crate::student::Student;
use anyhow::{bail, Context, Result};
use candle_core::Device;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;
use xdistill_shared::protocol::{SequenceScores, TopkResponse};

/// Everything a run needs that does not change while it trains.
pub struct Setup {
    pub cfg: Config,
    pub loss: LossConfig,
    pub device: Device,
    pub client: Arc<BlockingClient>,
    pub tokenization: Arc<Tokenization>,
    pub projection: Option<LossProjection>,
    pub limits: Limits,
}

/// Connects to the teacher, decides same vs cross tokenizer, builds the projection if needed.
pub fn setup(cfg: Config) -> Result<Setup> {
    let loss: LossConfig = cfg.loss_as()?;
    loss.validate()?;
    let device = xdistill_shared::device::parse_device(&cfg.policy.device)?;
    let client = Arc::new(BlockingClient::new(TeacherClient::from_config(
        &cfg.teacher,
    )?)?);
    let url = client.wait_ready(cfg.teacher.max_wait())?;
    tracing::info!("teacher ready at {url}");
    let infos: Vec<_> = client
        .info_all()
        .into_iter()
        .filter_map(|(u, r)| match r {
            Ok(i) => Some((u, i)),
            Err(e) => {
                tracing::warn!("{u}: /v1/info failed: {e}");
                None
            }
        })
        .collect();
    let info = crate::client::check_replicas(&infos).map_err(anyhow::Error::msg)?;
    client.client().pin_model(&info.model_fingerprint);
    if cfg.teacher.k > info.limits.max_k {
        bail!(
            "teacher.k = {} exceeds the teacher's max_k {}",
            cfg.teacher.k,
            info.limits.max_k
        );
    }
    let student_tok = cfg.student_tokenizer();
    // A tokenizer that does not parse is named as such, not taken for a different tokenizer.
    xdistill_shared::hf::load_tokenizer(&student_tok)?;
    if let Some(local) = &cfg.teacher.tokenizer {
        xdistill_shared::hf::load_tokenizer(local)?;
    }
    let which = client.teacher_tokenizer(
        &info,
        &student_tok,
        cfg.teacher.tokenizer.as_deref(),
        &cfg.teacher_tokenizer_cache(),
    )?;
    let max_student = cfg.policy.max_total_sequence_length;
    let max_teacher = info.max_seq_len.min(info.limits.max_seq_len);
    let (tokenization, projection) = match which {
        TeacherTokenizer::Same => {
            if loss.kd.is_cross_tokenizer() {
                bail!("loss.kd = {:?} is a cross-tokenizer loss but student and teacher share a tokenizer", loss.kd);
            }
            let tok = xdistill_shared::hf::load_tokenizer(&student_tok)?;
            (Tokenization::Same(tok), None)
        }
        TeacherTokenizer::Different(teacher_tok) => {
            if !loss.kd.works_across_tokenizers() {
                bail!(
                    "student and teacher tokenizers differ: use a cross-tokenizer loss \
                     (loss.kd = {{ type = \"first_kl\" }}, \"pkl\", \"gold\", \"alm\", or \
                     \"sampled_kl\" on-policy), not {:?}",
                    loss.kd
                );
            }
            let t0 = Instant::now();
            let (p, built) = Projection::load_or_build(
                &cfg.teacher_tokenizer_cache(),
                &student_tok,
                &teacher_tok,
                4,
            )?;
            tracing::info!(
                "projection map {} in {:.1}s",
                if built { "built" } else { "loaded" },
                t0.elapsed().as_secs_f64()
            );
            let s2t = &p.student_to_teacher;
            let indptr: Vec<usize> = s2t.indptr.iter().map(|&x| x as usize).collect();
            let lp = LossProjection::from_csr(
                s2t.rows(),
                info.vocab_size,
                &indptr,
                &s2t.indices,
                &s2t.weights,
            )?
            .with_teacher_first(teacher_first_tokens(&p.teacher_to_student, info.vocab_size))?;
            let student = AlignTokenizer::from_file(&student_tok)?;
            let teacher = AlignTokenizer::from_file(&teacher_tok)?;
            (Tokenization::Cross { student, teacher }, Some(lp))
        }
    };
    Ok(Setup {
        limits: Limits {
            max_student_tokens: max_student,
            max_teacher_tokens: max_teacher,
            truncate: cfg.data.truncate,
        },
        cfg,
        loss,
        device,
        client,
        tokenization: Arc::new(tokenization),
        projection,
    })
}

/// Teacher answers of a prepared batch, in item order.
fn scores_of(resp: &TopkResponse) -> Vec<&SequenceScores> {
    resp.results.iter().collect()
}

/// Runs validation over `val` records; `None` when there are none.
fn validate(s: &Setup, student: &Student, val: &[Record]) -> Result<Option<ValSums>> {
    if val.is_empty() {
        return Ok(None);
    }
    let mb = s.cfg.policy.train_micro_batch_size;
    Ok(Some(kl_to_teacher(s, student.model(), val, mb)?))
}

/// KL to the teacher and cross-entropy of `model` on `records`, in batches of `batch` (sums
/// with their counts; see [`validation_sums`]). Also used by the demo to probe saved models.
pub fn kl_to_teacher(
    s: &Setup,
    model: &xdistill_shared::model::Decoder,
    records: &[Record],
    batch: usize,
) -> Result<ValSums> {
    let mb = batch.max(1);
    let val = records;
    let mut sums = ValSums::default();
    for chunk in val.chunks(mb) {
        let batch = data::Batch {
            records: chunk.to_vec(),
            start: Default::default(),
            next: Default::default(),
        };
        let p = prepare(
            batch,
            &s.tokenization,
            s.limits,
            s.cfg.teacher.k,
            s.cfg.teacher.temperature,
        );
        if p.items.is_empty() {
            continue;
        }
        let resp = s.client.topk(&p.request)?;
        sums += validation_sums(
            model,
            &p.items,
            &scores_of(&resp),
            s.cfg.teacher.k,
            s.loss.temperature,
            s.projection.as_ref(),
            &s.device,
        )?;
    }
    Ok(sums)
}

/// `trainer off-policy`.
pub fn run(args: OffPolicyArgs) -> Result<()> {
    let cfg = Config::load(&args)?;
    let out = cfg.checkpointing.checkpoint_dir.clone();
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let s = setup(cfg)?;
    let summary = train(&s, args.resume, None)?;
    println!("{}", serde_json::to_string(&summary)?);
    Ok(())
}

/// What a finished run reports.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Summary {
    pub steps: u64,
    pub seconds: f64,
    pub val_kl_start: Option<f64>,
    pub val_kl_end: Option<f64>,
    pub val_ce_end: Option<f64>,
    pub skipped_records: u64,
    pub final_dir: String,
    /// On-policy runs: mean teacher log-prob of the student's held-out samples.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_teacher_logprob_start: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_teacher_logprob_end: Option<f64>,
}

/// The training loop (also used by tests and the demo with a ready [`Setup`]).
/// `stop_after`: end after that step as an interruption would (no final model): tests use it to
/// check that `--resume` continues exactly.
pub fn train(s: &Setup, resume: bool, stop_after: Option<u64>) -> Result<Summary> {
    if s.loss.kd.is_sampled() {
        bail!("loss.kd = sampled_kl scores the student's own samples: run `trainer on-policy`, or pick a top-k loss for off-policy training");
    }
    let cfg = &s.cfg;
    let out = &cfg.checkpointing.checkpoint_dir;
    let t_start = Instant::now();
    let Session {
        mut runner,
        batcher,
        val,
        rng,
        hash,
        mut tokens_seen,
        mut skipped,
        resumed_from,
        mut log,
        progress,
    } = Session::open(
        cfg,
        &s.device,
        resume,
        Some(&|r| too_long(r, &s.tokenization, s.limits)),
    )?;
    let total_steps = runner.total_steps;
    let k = cfg.teacher.k;
    let val_metrics =
        |runner: &Runner, log: &mut MetricsLog, step: u64| -> Result<Option<(f64, f64)>> {
            let t0 = Instant::now();
            let Some(v) = validate(s, &runner.student, &val)? else {
                return Ok(None);
            };
            let (kl, ce) = (v.kl / v.kl_units.max(1.0), v.ce / v.ce_tokens.max(1.0));
            let mut parts = BTreeMap::new();
            parts.insert("ce".to_string(), ce);
            log.append(&ValMetrics {
                split: "val".into(),
                step,
                loss: kl,
                loss_parts: parts,
                kl: Some(kl),
                records: val.len() as u64,
                loss_tokens: v.ce_tokens as u64,
                time: t0.elapsed().as_secs_f64(),
            })?;
            progress.println(&format!(
                "validation at step {step}: kl {kl:.4} ce {ce:.4} ({:.1}s)",
                t0.elapsed().as_secs_f64()
            ));
            Ok(Some((kl, ce)))
        };
    let mut val_kl_start = None;
    if cfg.distillation.val_at_start && resumed_from.is_none() {
        val_kl_start = val_metrics(&runner, &mut log, 0)?.map(|x| x.0);
    }
    // 4. Prefetch: tokenize + score the next batches while the current one trains.
    let steps_left = total_steps.saturating_sub(runner.step) as usize;
    let tokenization = s.tokenization.clone();
    let (limits, temperature) = (s.limits, cfg.teacher.temperature);
    let client = s.client.clone();
    let batches = batcher
        .take(steps_left)
        .map(move |b| prepare(b, &tokenization, limits, k, temperature));
    let mut prefetch = Prefetcher::spawn(
        batches,
        cfg.teacher.prefetch.max(1),
        move |p: &Prepared| -> Result<TopkResponse, ClientError> {
            if p.items.is_empty() {
                return Ok(TopkResponse {
                    k,
                    ..Default::default()
                });
            }
            client.topk(&p.request)
        },
    );
    let mb = cfg.policy.train_micro_batch_size.max(1);
    let mut last_val = None;
    while runner.step < total_steps {
        let t_step = Instant::now();
        let Some(fetched) = prefetch.next() else {
            break;
        };
        let fetched = fetched.map_err(|e| anyhow::anyhow!("teacher: {e}"))?;
        let p = fetched.batch;
        skipped += p.skipped;
        let step_no = runner.step + 1;
        if p.items.is_empty() {
            tracing::warn!("step {step_no}: every record of the batch was skipped");
        }
        // 5. Micro-batches with gradients accumulated over the whole step.
        let scores = scores_of(&fetched.result);
        let norm: Units = units(&p.items);
        let mut acc = GradAccumulator::new(runner.vars().to_vec());
        let sums = accumulate(
            &mut acc,
            runner.student.model(),
            &p.items,
            &scores,
            mb,
            k,
            &s.loss,
            s.projection.as_ref(),
            norm,
            &s.device,
        )?;
        let update = runner.apply(acc.take())?;
        let tokens: u64 = p.items.iter().map(|i| i.teacher_ids().len() as u64).sum();
        tokens_seen += tokens;
        let kd_mean = sums.kd_mean(norm);
        let mut parts = BTreeMap::new();
        parts.insert("kd".to_string(), kd_mean);
        if let Some(ce) = sums.ce_mean() {
            parts.insert("ce".to_string(), ce);
        }
        parts.insert("kd_scale".to_string(), sums.kd_scale);
        let dt = t_step.elapsed().as_secs_f64();
        let m = StepMetrics {
            split: "train".into(),
            step: runner.step,
            epoch: p.batch.start.epoch,
            loss: kd_mean * sums.kd_scale + sums.ce_mean().unwrap_or(0.0),
            loss_parts: parts,
            kl: Some(kd_mean / (s.loss.temperature * s.loss.temperature)),
            grad_norm: Some(update.grad_norm),
            lr: update.lr,
            tokens,
            loss_tokens: norm.ce as u64,
            tokens_per_s: tokens as f64 / dt.max(1e-9),
            step_time_s: dt,
            teacher_latency_s: fetched.fetch_time.as_secs_f64(),
            teacher_wait_s: fetched.wait_time.as_secs_f64(),
            skipped_records: skipped,
            time: unix_time(),
        };
        log.append(&m)?;
        progress.step(&m);
        // 6. Validation and checkpoints.
        let step = runner.step;
        let val_due = cfg.distillation.val_period > 0 && step % cfg.distillation.val_period == 0;
        if val_due || (step == total_steps && cfg.distillation.val_at_end) {
            last_val = val_metrics(&runner, &mut log, step)?;
        }
        let mut state = TrainerState::new(step, p.batch.next, &rng, hash.clone());
        state.tokens_seen = tokens_seen;
        if let Some((kl, _)) = last_val {
            state.metrics.insert("val_kl".into(), kl);
        }
        runner.after_step(&cfg.checkpointing, &state, &|l| progress.println(l))?;
        if stop_after == Some(step) && step < total_steps {
            progress.finish();
            return Ok(Summary {
                steps: step,
                seconds: t_start.elapsed().as_secs_f64(),
                val_kl_start,
                val_kl_end: last_val.map(|v| v.0),
                val_ce_end: last_val.map(|v| v.1),
                skipped_records: skipped,
                final_dir: String::new(),
                val_teacher_logprob_start: None,
                val_teacher_logprob_end: None,
            });
        }
    }
    progress.finish();
    // Data ran out before max_num_steps: still write the final model.
    let final_dir = out.join("final");
    if !final_dir.is_dir() {
        let state = TrainerState::new(runner.step, batcher_position_unknown(), &rng, hash);
        runner.save_final(out, &state)?;
    }
    Ok(Summary {
        steps: runner.step,
        seconds: t_start.elapsed().as_secs_f64(),
        val_kl_start,
        val_kl_end: last_val.map(|v| v.0),
        val_ce_end: last_val.map(|v| v.1),
        skipped_records: skipped,
        final_dir: final_dir.display().to_string(),
        val_teacher_logprob_start: None,
        val_teacher_logprob_end: None,
    })
}

fn batcher_position_unknown() -> data::DataPosition {
    data::DataPosition::default()
}

/// Teacher id → the first student token of its re-tokenisation (the first entry of its
/// teacher→student row, which lists the pieces in order); `None` for empty rows and for ids past
/// the map (a padded teacher vocabulary).
fn teacher_first_tokens(t2s: &crate::projection::Csr, teacher_vocab: usize) -> Vec<Option<u32>> {
    (0..teacher_vocab)
        .map(|u| {
            (u < t2s.rows())
                .then(|| t2s.row(u).0.first().copied())
                .flatten()
        })
        .collect()
}
