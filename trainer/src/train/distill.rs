//! What the two distillation objectives share: the connection to the teacher (same or cross
//! tokenizer, decided once), held-out KL to the teacher, and the run summary.

use super::prepare::{prepare, Limits, Tokenization};
use super::step::{validation_sums, LossCtx, Pairing, ValSums};
use crate::align::projection::{Csr, ProjectionMaps};
use crate::align::AlignTokenizer;
use crate::client::{BlockingClient, TeacherClient, TeacherTokenizer};
use crate::config::Config;
use crate::data::{self, Record};
use crate::loss::{LossConfig, Projection};
use anyhow::{bail, Result};
use candle_core::Device;
use std::sync::Arc;
use std::time::Instant;
use xdistill_shared::model::Decoder;
use xdistill_shared::protocol::{SequenceScores, TopkResponse};

/// Everything a run needs that does not change while it trains.
pub struct Setup {
    pub cfg: Config,
    pub loss: LossConfig,
    pub device: Device,
    pub client: Arc<BlockingClient>,
    pub tokenization: Arc<Tokenization>,
    pub projection: Option<Projection>,
    pub limits: Limits,
}

/// Connects to the teacher, decides same vs cross tokenizer, builds the projection if needed.
pub fn setup(cfg: Config) -> Result<Setup> {
    let loss: LossConfig = cfg.loss()?.clone();
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
            let (p, built) = ProjectionMaps::load_or_build(
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
            let lp = Projection::from_csr(
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

impl Setup {
    /// The loss context of `model` under `loss` (the run's `[loss]`, or an objective's variant
    /// of it).
    pub fn loss_ctx<'a>(&'a self, model: &'a Decoder, loss: &'a LossConfig) -> LossCtx<'a> {
        LossCtx {
            model,
            k: self.cfg.teacher.k,
            loss,
            pairing: match &self.projection {
                Some(p) => Pairing::Cross(p),
                None => Pairing::Same,
            },
            device: &self.device,
            micro_batch: self.cfg.policy.train_micro_batch_size.max(1),
        }
    }
}

/// Teacher answers of a prepared batch, in item order.
pub fn scores_of(resp: &TopkResponse) -> Vec<&SequenceScores> {
    resp.results.iter().collect()
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
        sums += validation_sums(&s.loss_ctx(model, &s.loss), &p.items, &scores_of(&resp))?;
    }
    Ok(sums)
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

/// A distillation command (`trainer off-policy`, `trainer on-policy`): loads the config,
/// connects to the teacher, runs `train` and prints its summary as one JSON line.
pub fn run_command(
    args: &crate::config::OffPolicyArgs,
    train: fn(&Setup, bool, Option<u64>) -> Result<Summary>,
) -> Result<()> {
    use anyhow::Context;
    let cfg = Config::load(args)?;
    let out = &cfg.checkpointing.checkpoint_dir;
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let s = setup(cfg)?;
    let summary = train(&s, args.resume, None)?;
    println!("{}", serde_json::to_string(&summary)?);
    Ok(())
}

impl Summary {
    /// The summary of a distillation run (on-policy validation also reports the teacher's
    /// log-prob of the student's samples).
    pub fn from_outcome(o: &super::runner::Outcome) -> Summary {
        let part = |v: &Option<super::runner::ValReport>, name: &str| {
            v.as_ref().and_then(|v| v.parts.get(name).copied())
        };
        Summary {
            steps: o.steps,
            seconds: o.seconds,
            val_kl_start: o.val_start.as_ref().map(|v| v.loss),
            val_kl_end: o.val_end.as_ref().map(|v| v.loss),
            val_ce_end: part(&o.val_end, "ce"),
            skipped_records: o.skipped_records,
            final_dir: o.final_dir.clone(),
            val_teacher_logprob_start: part(&o.val_start, "teacher_logprob"),
            val_teacher_logprob_end: part(&o.val_end, "teacher_logprob"),
        }
    }
}

/// Teacher id → the first student token of its re-tokenisation (the first entry of its
/// teacher→student row, which lists the pieces in order); `None` for empty rows and for ids past
/// the map (a padded teacher vocabulary).
fn teacher_first_tokens(t2s: &Csr, teacher_vocab: usize) -> Vec<Option<u32>> {
    (0..teacher_vocab)
        .map(|u| {
            (u < t2s.rows())
                .then(|| t2s.row(u).0.first().copied())
                .flatten()
        })
        .collect()
}
