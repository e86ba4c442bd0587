//! Connecting the run's teachers: each one's handshake (health, every replica's `/v1/info`,
//! tokenizer, projection) and the checks that the teachers fit the run's losses and mode.

use super::{hidden, TeacherPool, Teachers};
use crate::align::projection::{Csr, ProjectionMaps};
use crate::align::AlignTokenizer;
use crate::client::{TeacherClient, TeacherTokenizer};
use crate::config::{Config, TeacherConfig, TeacherMode};
use crate::loss::full_vocab::TeacherHead;
use crate::loss::KdConfig;
use crate::loss::{LossConfig, Projection};
use crate::train::pairing::mixture::identity_projection;
use crate::train::pairing::{Limits, Pairing, Tokenization};
use anyhow::{bail, Context, Result};
use candle_core::Device;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

/// One connected teacher service.
pub struct Teacher {
    pub name: String,
    pub cfg: TeacherConfig,
    /// Its share of an ensemble (normalised over the run's teachers).
    pub weight: f64,
    pub tokenization: Arc<Tokenization>,
    /// Cross tokenizer: the student→teacher projection of the loss.
    pub projection: Option<Projection>,
    pub limits: Limits,
    /// The server's most ids per row (top-k or candidates).
    pub max_k: usize,
    /// `transport = "hidden"`: the teacher's LM head on the student's device; the teacher
    /// sends hidden states and the loss sees its whole distribution.
    pub head: Option<TeacherHead>,
}

impl Teacher {
    /// Waits for the teacher, checks its replicas agree, decides same vs cross tokenizer and
    /// builds (or loads) the projection; then adds its client to `pool` (as the pool's next
    /// teacher). Errors name the teacher.
    /// `loss` / `loss_cross`: the losses its records would train with, same or cross tokenizer.
    /// `student`: the student's tokenizer (parsed once for all the teachers).
    pub fn connect(
        cfg: &Config,
        (name, tc): (&str, &TeacherConfig),
        losses: [&LossConfig; 2],
        student: tokenizers::Tokenizer,
        (pool, device): (&mut TeacherPool, &Device),
    ) -> Result<Teacher> {
        let client = TeacherClient::from_config(tc).with_context(|| format!("teacher {name:?}"))?;
        let t = Self::connect_inner(cfg, (name, tc), losses, student, (pool, &client, device))
            .with_context(|| format!("teacher {name:?}"))?;
        pool.add(name, client);
        Ok(t)
    }

    fn connect_inner(
        cfg: &Config,
        (name, tc): (&str, &TeacherConfig),
        [loss, loss_cross]: [&LossConfig; 2],
        student_tokenizer: tokenizers::Tokenizer,
        (pool, client, device): (&TeacherPool, &TeacherClient, &Device),
    ) -> Result<Teacher> {
        let url = pool.block_on(client.wait_ready(tc.max_wait()))?;
        tracing::info!("teacher {name:?} ready at {url}");
        let infos: Vec<_> = pool
            .block_on(client.info_all())
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
        client.pin_model(&info.model_fingerprint);
        if let Some(probe) = &info.probe {
            client.pin_probe(&probe.hash);
        }
        if tc.k > info.limits.max_k {
            bail!(
                "k = {} exceeds the teacher's max_k {}",
                tc.k,
                info.limits.max_k
            );
        }
        let student_tok = cfg.student_tokenizer();
        // A configured teacher tokenizer that does not parse is an error even where the
        // teacher turns out to share the student's; parsed once, kept for the alignment.
        let mut local = tc
            .tokenizer
            .as_deref()
            .map(xdistill_shared::hf::load_tokenizer)
            .transpose()?;
        let cache = cfg.teacher_tokenizer_cache();
        let which = pool.block_on(client.teacher_tokenizer(
            &info,
            &student_tok,
            tc.tokenizer.as_deref(),
            &cache,
        ))?;
        let (tokenization, projection) = match which {
            TeacherTokenizer::Same => {
                if loss.kd.is_cross_tokenizer() {
                    bail!("loss.kd = {:?} is a cross-tokenizer loss but student and teacher share a tokenizer", loss.kd);
                }
                (Tokenization::Same(student_tokenizer), None)
            }
            TeacherTokenizer::Different(_)
                if tc.transport.is_hidden() && !loss_cross.kd.is_cross_tokenizer() =>
            {
                bail!(
                    "teacher.transport = \"hidden\" with a student of another tokenizer trains \
                     with first_kl, pkl or gold over the teacher's whole distribution, or alm: \
                     set loss_cross.kd (or loss.kd) to {{ type = \"first_kl\" }}, \"pkl\", \
                     \"gold\" or \"alm\", not {:?}",
                    loss_cross.kd
                )
            }
            TeacherTokenizer::Different(teacher_tok) => {
                if !loss_cross.kd.works_across_tokenizers() {
                    bail!(
                        "student and teacher tokenizers differ: use a cross-tokenizer loss \
                         (loss.kd = {{ type = \"first_kl\" }}, \"pkl\", \"gold\", \"alm\", or \
                         \"sampled_kl\" on-policy; or [loss_cross] beside a same-tokenizer \
                         [loss]), not {:?}",
                        loss_cross.kd
                    );
                }
                let student = AlignTokenizer::new(student_tokenizer)?;
                let teacher = match local.take() {
                    Some(t) if tc.tokenizer.as_deref() == Some(teacher_tok.as_path()) => {
                        AlignTokenizer::new(t)?
                    }
                    _ => AlignTokenizer::from_file(&teacher_tok)?,
                };
                let t0 = Instant::now();
                // Cached by the pair of tokenizer hashes: teachers sharing a tokenizer share it.
                let (p, built) = ProjectionMaps::load_or_build(
                    &cache,
                    (&student_tok, &student),
                    (&teacher_tok, &teacher),
                    4,
                )?;
                tracing::info!(
                    "teacher {name:?}: projection map {} in {:.1}s",
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
                (Tokenization::Cross { student, teacher }, Some(lp))
            }
        };
        let head = if tc.transport.is_hidden() {
            if !tokenization.is_cross() && loss.divergence().is_none() {
                bail!(
                    "teacher.transport = \"hidden\" trains with an exact full-vocabulary \
                     divergence: set loss.kd to {}, not {:?}",
                    crate::loss::DIVERGENCES,
                    loss.kd
                );
            }
            // The same tokenizer: every teacher token must be a student logit. Across
            // tokenizers the projection relates the two vocabularies.
            let v = if tokenization.is_cross() {
                None
            } else {
                let student = xdistill_shared::hf::ModelDir::open(&cfg.policy.model_name)?;
                Some(student.config.vocab_size)
            };
            let cache = cfg.teacher_head_cache();
            Some(hidden::load(tc, (client, pool), v, device, &cache)?)
        } else {
            None
        };
        Ok(Teacher {
            head,
            name: name.to_string(),
            cfg: tc.clone(),
            weight: tc.weight,
            tokenization: Arc::new(tokenization),
            projection,
            limits: Limits {
                max_student_tokens: cfg.policy.max_total_sequence_length,
                max_teacher_tokens: info.max_seq_len.min(info.limits.max_seq_len),
                truncate: cfg.data.truncate,
            },
            max_k: info.limits.max_k,
        })
    }

    /// How this teacher's answers lie against the student's tokens.
    pub fn pairing(&self) -> Pairing<'_> {
        match (&self.projection, &self.head) {
            (Some(p), Some(h)) => Pairing::CrossFullVocab(p, h),
            (Some(p), None) => Pairing::Cross(p),
            (None, Some(h)) => Pairing::FullVocab(h),
            (None, None) => Pairing::Same,
        }
    }
}

impl Teachers {
    /// Connects every configured teacher (in order; the first unreachable one is the error).
    pub fn connect(
        cfg: &Config,
        loss: &LossConfig,
        loss_cross: &LossConfig,
        device: &Device,
    ) -> Result<Teachers> {
        let mut pool = TeacherPool::new()?;
        // A tokenizer that does not parse is named as such, not taken for a different tokenizer.
        // Parsed once here and kept for the run: Qwen3's takes 0.8 s, a copy of it for each
        // further teacher 0.09 s (2 AMD EPYC cores).
        let student = xdistill_shared::hf::load_tokenizer(&cfg.student_tokenizer())?;
        let entries = cfg.teacher_list();
        let mut students: Vec<_> = (1..entries.len()).map(|_| student.clone()).collect();
        students.push(student);
        let mut list = vec![];
        for ((name, tc), student) in entries.into_iter().zip(students) {
            list.push(Teacher::connect(
                cfg,
                (&name, tc),
                [loss, loss_cross],
                student,
                (&mut pool, device),
            )?);
        }
        let total: f64 = list.iter().map(|t| t.weight).sum();
        for t in &mut list {
            t.weight /= total;
        }
        let mode = cfg.distillation.teachers;
        let ensemble = mode == TeacherMode::Ensemble;
        if ensemble && list.len() > 1 {
            if let Some(t) = list.iter().find(|t| t.head.is_some()) {
                bail!(
                    "distillation.teachers = \"ensemble\" mixes the teachers' top-k: teacher {:?} \
                     has transport = \"hidden\" (route its records instead, or use \"topk\")",
                    t.name
                );
            }
        }
        let cross = list.iter().find(|t| t.tokenization.is_cross());
        let chunk_projection = match cross {
            // An ensemble of one teacher is that teacher (same or cross tokenizer).
            Some(t) if ensemble && list.len() > 1 => {
                if !matches!(loss_cross.kd, KdConfig::FirstKl {}) {
                    bail!(
                        "distillation.teachers = \"ensemble\" with teacher {:?} of another \
                         tokenizer mixes the teachers at the chunk level and trains with first_kl: \
                         set loss_cross.kd (or loss.kd) = {{ type = \"first_kl\" }}, not {:?}",
                        t.name,
                        loss_cross.kd
                    );
                }
                let v = t.projection.as_ref().map_or(0, |p| p.student_vocab());
                Some(identity_projection(v)?)
            }
            _ => None,
        };
        if ensemble && list.len() > 1 && chunk_projection.is_none() {
            // Every teacher scores the union of all top-k sets as candidate ids.
            let union: usize = list.iter().map(|t| t.cfg.k).sum();
            if let Some(t) = list.iter().find(|t| t.max_k < union) {
                bail!(
                    "distillation.teachers = \"ensemble\": the union of the teachers' top-k can \
                     hold {union} ids (the sum of their k), more than teacher {:?} scores per row \
                     (its max_k {}); lower the teachers' k or raise the server's --max-k",
                    t.name,
                    t.max_k
                );
            }
        }
        let by_name = list
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect::<HashMap<_, _>>();
        let default = match &cfg.data.default_teacher {
            Some(d) => by_name.get(d).copied(),
            // One teacher takes every record.
            None if list.len() == 1 => Some(0),
            None => None,
        };
        Ok(Teachers {
            list,
            mode,
            pool,
            chunk_projection,
            by_name,
            default,
        })
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
