//! The run's teachers: one connection per `[[teachers]]` entry (or `[teacher]`), each with its
//! own tokenizer relation to the student (same, or cross with its own projection), and which of
//! them scores each record: the teacher a record names (`route`) or the mixture of all of them
//! (`ensemble`: exact on the union of their top-k when they share the student's tokenizer, at the
//! chunk level otherwise; the math is in [`ensemble`]).

use super::ensemble;
use super::pairing::mixture::{identity_projection, item_starts, virtual_item};
use super::pairing::Pairing;
use super::pairing::{Item, Tokenization};
use super::prepare::{prepare_record, too_long, Group, Limits};
use crate::align::projection::{Csr, ProjectionMaps};
use crate::align::AlignTokenizer;
use crate::client::{BlockingClient, TeacherClient, TeacherTokenizer};
use crate::config::{Config, TeacherConfig, TeacherMode};
use crate::data::Record;
use crate::loss::KdConfig;
use crate::loss::{LossConfig, Projection};
use anyhow::{bail, Context, Result};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Instant;
use xdistill_shared::protocol::{SequenceScores, TopkRequest, ValuesKind};

/// A scoring request that failed (after the client's retries), naming the teacher.
#[derive(Debug, thiserror::Error)]
#[error("teacher {teacher:?}: {message}")]
pub struct ScoreError {
    pub teacher: String,
    pub message: String,
}

type Scores = std::result::Result<Vec<SequenceScores>, ScoreError>;

/// `f` of every job, one thread each (one job runs here): teacher requests go out at once, so
/// the caller waits for the slowest, not the sum. The first error (in job order) is returned.
pub fn in_parallel<J: Sync, R: Send>(
    jobs: &[J],
    f: impl Fn(&J) -> std::result::Result<R, ScoreError> + Sync,
) -> std::result::Result<Vec<R>, ScoreError> {
    if let [one] = jobs {
        return Ok(vec![f(one)?]);
    }
    std::thread::scope(|scope| {
        let f = &f;
        let handles: Vec<_> = jobs.iter().map(|j| scope.spawn(move || f(j))).collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(ScoreError {
                        teacher: String::new(),
                        message: "request thread panicked".into(),
                    })
                })
            })
            .collect()
    })
}

/// One connected teacher service.
pub struct Teacher {
    pub name: String,
    pub cfg: TeacherConfig,
    /// Its share of an ensemble (normalised over the run's teachers).
    pub weight: f64,
    pub client: Arc<BlockingClient>,
    pub tokenization: Arc<Tokenization>,
    /// Cross tokenizer: the student→teacher projection of the loss.
    pub projection: Option<Projection>,
    pub limits: Limits,
    /// The server's most ids per row (top-k or candidates).
    pub max_k: usize,
}

impl Teacher {
    /// Waits for the teacher, checks its replicas agree, decides same vs cross tokenizer and
    /// builds (or loads) the projection. Errors name the teacher.
    /// `loss` / `loss_cross`: the losses its records would train with, same or cross tokenizer.
    pub fn connect(
        cfg: &Config,
        name: &str,
        tc: &TeacherConfig,
        losses: [&LossConfig; 2],
    ) -> Result<Teacher> {
        Self::connect_inner(cfg, name, tc, losses).with_context(|| format!("teacher {name:?}"))
    }

    fn connect_inner(
        cfg: &Config,
        name: &str,
        tc: &TeacherConfig,
        [loss, loss_cross]: [&LossConfig; 2],
    ) -> Result<Teacher> {
        let client = Arc::new(BlockingClient::new(TeacherClient::from_config(tc)?)?);
        let url = client.wait_ready(tc.max_wait())?;
        tracing::info!("teacher {name:?} ready at {url}");
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
        if tc.k > info.limits.max_k {
            bail!(
                "k = {} exceeds the teacher's max_k {}",
                tc.k,
                info.limits.max_k
            );
        }
        let student_tok = cfg.student_tokenizer();
        // A tokenizer that does not parse is named as such, not taken for a different tokenizer.
        xdistill_shared::hf::load_tokenizer(&student_tok)?;
        if let Some(local) = &tc.tokenizer {
            xdistill_shared::hf::load_tokenizer(local)?;
        }
        let cache = cfg.teacher_tokenizer_cache();
        let which =
            client.teacher_tokenizer(&info, &student_tok, tc.tokenizer.as_deref(), &cache)?;
        let (tokenization, projection) = match which {
            TeacherTokenizer::Same => {
                if loss.kd.is_cross_tokenizer() {
                    bail!("loss.kd = {:?} is a cross-tokenizer loss but student and teacher share a tokenizer", loss.kd);
                }
                let tok = xdistill_shared::hf::load_tokenizer(&student_tok)?;
                (Tokenization::Same(tok), None)
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
                let t0 = Instant::now();
                // Cached by the pair of tokenizer hashes: teachers sharing a tokenizer share it.
                let (p, built) =
                    ProjectionMaps::load_or_build(&cache, &student_tok, &teacher_tok, 4)?;
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
                let student = AlignTokenizer::from_file(&student_tok)?;
                let teacher = AlignTokenizer::from_file(&teacher_tok)?;
                (Tokenization::Cross { student, teacher }, Some(lp))
            }
        };
        Ok(Teacher {
            name: name.to_string(),
            cfg: tc.clone(),
            weight: tc.weight,
            client,
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

    pub fn pairing(&self) -> Pairing<'_> {
        match &self.projection {
            Some(p) => Pairing::Cross(p),
            None => Pairing::Same,
        }
    }
}

/// Who scores a group of records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Source {
    /// The teacher at this index.
    One(usize),
    /// The weighted mixture of every teacher (same tokenizer as the student).
    Mixture,
}

/// The run's teachers and how records are assigned to them.
pub struct Teachers {
    pub list: Vec<Teacher>,
    pub mode: TeacherMode,
    /// An ensemble with a teacher of another tokenizer: the identity projection of its virtual
    /// teacher in the student's tokenization (mixed at the chunk level, trained with first_kl).
    chunk_projection: Option<Projection>,
    by_name: HashMap<String, usize>,
    default: Option<usize>,
}

impl Teachers {
    /// Connects every configured teacher (in order; the first unreachable one is the error).
    pub fn connect(cfg: &Config, loss: &LossConfig, loss_cross: &LossConfig) -> Result<Teachers> {
        let mut list = vec![];
        for (name, tc) in cfg.teacher_list() {
            list.push(Teacher::connect(cfg, &name, tc, [loss, loss_cross])?);
        }
        let total: f64 = list.iter().map(|t| t.weight).sum();
        for t in &mut list {
            t.weight /= total;
        }
        let mode = cfg.distillation.teachers;
        let ensemble = mode == TeacherMode::Ensemble;
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
            chunk_projection,
            by_name,
            default,
        })
    }

    /// Several teachers are routed per record.
    pub fn routed(&self) -> bool {
        self.mode == TeacherMode::Route && self.list.len() > 1
    }

    /// The source of `r`: its named teacher, the default, or (ensemble) the mixture; the error
    /// says why it has none.
    pub fn source_of(&self, r: &Record) -> std::result::Result<Source, String> {
        // An ensemble of one teacher goes through the ensemble's path too (where its mixture is
        // that teacher's answer itself).
        if self.mode == TeacherMode::Ensemble {
            return Ok(Source::Mixture);
        }
        if self.list.len() == 1 {
            return Ok(Source::One(0));
        }
        let named = r
            .teacher
            .as_deref()
            .and_then(|n| self.by_name.get(n).copied());
        match (named, self.default, &r.teacher) {
            (Some(i), _, _) => Ok(Source::One(i)),
            (None, Some(d), _) => Ok(Source::One(d)),
            (None, None, Some(n)) => Err(format!(
                "names teacher {n:?}, which is not configured (teachers: {}); fix the record or set data.default_teacher",
                self.names()
            )),
            (None, None, None) => Err(
                "names no teacher (data.teacher_field) and there is no data.default_teacher".to_string()
            ),
        }
    }

    fn names(&self) -> String {
        self.list
            .iter()
            .map(|t| format!("{:?}", t.name))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Checks at start that every record has a teacher: the first that has none is the error;
    /// records naming an unknown teacher that go to the default are counted in one warning.
    pub fn check_records(&self, records: &[Record], what: &str) -> Result<()> {
        if !self.routed() {
            return Ok(());
        }
        let mut unknown: BTreeMap<&str, usize> = BTreeMap::new();
        let mut per: BTreeMap<usize, usize> = BTreeMap::new();
        for r in records {
            match self.source_of(r) {
                Ok(Source::One(i)) => *per.entry(i).or_default() += 1,
                Ok(Source::Mixture) => {}
                Err(e) => bail!("{what} record at line {} {e}", r.line),
            }
            if let Some(n) = r
                .teacher
                .as_deref()
                .filter(|n| !self.by_name.contains_key(*n))
            {
                *unknown.entry(n).or_default() += 1;
            }
        }
        if !unknown.is_empty() {
            let d = self.default.map_or("", |d| self.list[d].name.as_str());
            tracing::warn!(
                "{what} records naming no configured teacher go to the default {d:?}: {unknown:?}"
            );
        }
        let counts: Vec<String> = per
            .iter()
            .map(|(&i, n)| format!("{} {n}", self.list[i].name))
            .collect();
        tracing::info!("{what} records per teacher: {}", counts.join(", "));
        Ok(())
    }

    /// The teacher of a source (the mixture: the first).
    fn of(&self, s: Source) -> &Teacher {
        match s {
            Source::One(i) => &self.list[i],
            Source::Mixture => &self.list[0],
        }
    }

    /// How a source's answers lie against the student's tokens: the same tokenizer, another
    /// one (with its projection), or a chunk-level ensemble's virtual teacher.
    pub fn pairing(&self, s: Source) -> Pairing<'_> {
        match (s, &self.chunk_projection) {
            (Source::Mixture, Some(p)) => Pairing::Mixture(p),
            (Source::Mixture, None) if self.list.len() == 1 => self.list[0].pairing(),
            (Source::Mixture, None) => Pairing::Same,
            (Source::One(i), _) => self.list[i].pairing(),
        }
    }

    /// Whether a source's records are aligned across tokenizers (its loss is `[loss_cross]`).
    pub fn is_cross(&self, s: Source) -> bool {
        self.pairing(s).is_cross()
    }

    /// Whether `r` is over its teacher's or the student's token limits (an ensemble: any
    /// teacher's); records without a teacher are not (they fail the start's check).
    pub fn too_long(&self, r: &Record) -> bool {
        match self.source_of(r) {
            Ok(Source::Mixture) => self
                .list
                .iter()
                .any(|t| too_long(r, &t.tokenization, t.limits)),
            Ok(s) => too_long(r, &self.of(s).tokenization, self.limits(s)),
            Err(_) => false,
        }
    }

    /// The student tokenizer (every teacher's tokenization holds the same one).
    pub fn student_tokenizer(&self) -> &tokenizers::Tokenizer {
        self.list[0].tokenization.student_tokenizer()
    }

    /// Tokenizes `records` for `source` (the chunk-level ensemble: for every teacher, and the
    /// virtual teacher's record from them); returns the group and the indices of the records it
    /// holds (the others could not be tokenized, or their tokenizations disagree on the
    /// student's tokens; each is logged).
    pub fn prepare_group(
        &self,
        source: Source,
        records: &[&Record],
        lim: Limits,
    ) -> (Group, Vec<usize>) {
        let mut g = Group {
            source,
            items: vec![],
            parts: vec![],
        };
        let mut used = vec![];
        if self.chunk_projection.is_none() || source != Source::Mixture {
            let tok = &self.of(source).tokenization;
            for (i, r) in records.iter().enumerate() {
                if let Some(item) = prepare_record(r, tok, lim) {
                    g.items.push(item);
                    used.push(i);
                }
            }
            return (g, used);
        }
        g.parts = vec![vec![]; self.list.len()];
        for (i, r) in records.iter().enumerate() {
            let each: Option<Vec<Item>> = self
                .list
                .iter()
                .map(|t| {
                    prepare_record(
                        r,
                        &t.tokenization,
                        Limits {
                            max_teacher_tokens: t.limits.max_teacher_tokens,
                            ..lim
                        },
                    )
                })
                .collect();
            let Some(each) = each else { continue };
            match virtual_item(&each) {
                Ok(item) => {
                    g.items.push(item);
                    for (p, it) in g.parts.iter_mut().zip(each) {
                        p.push(it);
                    }
                    used.push(i);
                }
                Err(e) => tracing::warn!("record at line {} skipped: {e}", r.line),
            }
        }
        (g, used)
    }

    /// A group's answers, one per item: its teacher's, or the ensemble's target ([`Self::score`]
    /// for the same-tokenizer mixture; the chunk-level mixture from each teacher's answers for
    /// its own tokenization of the records).
    pub fn score_group(&self, g: &Group) -> Scores {
        if g.items.is_empty() {
            return Ok(vec![]);
        }
        if g.parts.is_empty() {
            let seqs = g.items.iter().map(|i| i.teacher_ids().to_vec()).collect();
            return self.score(g.source, &self.request(g.source, seqs, None));
        }
        let reqs: Vec<(usize, TopkRequest)> = (g.parts.iter().enumerate())
            .map(|(i, items)| {
                let seqs = items.iter().map(|it| it.teacher_ids().to_vec()).collect();
                (i, self.request(Source::One(i), seqs, None))
            })
            .collect();
        let answers = in_parallel(&reqs, |(i, req)| self.ask(*i, req))?;
        let weights: Vec<f64> = self.list.iter().map(|t| t.weight).collect();
        let firsts: Vec<Box<dyn Fn(u32) -> Option<u32> + '_>> = self
            .list
            .iter()
            .map(|t| -> Box<dyn Fn(u32) -> Option<u32> + '_> {
                match &t.projection {
                    Some(p) => Box::new(move |u| p.teacher_first(u as usize)),
                    None => Box::new(Some),
                }
            })
            .collect();
        let first_refs: Vec<&dyn Fn(u32) -> Option<u32>> =
            firsts.iter().map(|f| f.as_ref()).collect();
        let mut rows_per_item = vec![];
        for (r, item) in g.items.iter().enumerate() {
            let Some((pair, _)) = item.aligned() else {
                unreachable!("a chunk-level ensemble's items are aligned")
            };
            let starts: Vec<BTreeMap<usize, usize>> =
                g.parts.iter().map(|p| item_starts(&p[r])).collect();
            let scored: Vec<&SequenceScores> = answers.iter().map(|a| &a[r]).collect();
            let rows: Vec<(usize, Vec<(u32, f64)>)> = ensemble::chunk_rows(pair)
                .into_iter()
                .map(|j| {
                    (
                        j,
                        ensemble::mix_first_tokens(j, &starts, &scored, &first_refs, &weights),
                    )
                })
                .collect();
            rows_per_item.push((pair.student_ids.len(), rows));
        }
        let m = rows_per_item
            .iter()
            .flat_map(|(_, rows)| rows.iter().map(|(_, g)| g.len()))
            .max()
            .unwrap_or(1)
            .max(1);
        Ok(rows_per_item
            .iter()
            .map(|(n, rows)| ensemble::virtual_answer(*n, rows, m))
            .collect())
    }

    /// Limits of a source's records (the mixture: the tightest teacher's).
    pub fn limits(&self, s: Source) -> Limits {
        match s {
            Source::One(i) => self.list[i].limits,
            Source::Mixture => {
                let mut l = self.list[0].limits;
                for t in &self.list {
                    l.max_teacher_tokens = l.max_teacher_tokens.min(t.limits.max_teacher_tokens);
                }
                l
            }
        }
    }

    /// The name metrics use for a source.
    pub fn name(&self, s: Source) -> &str {
        match s {
            Source::One(i) => &self.list[i].name,
            Source::Mixture => "ensemble",
        }
    }

    /// A source's request for `sequences` (`start = 0`, the source's k and temperature; the
    /// mixture asks each teacher with its own k).
    pub fn request(
        &self,
        s: Source,
        sequences: Vec<Vec<u32>>,
        starts: Option<Vec<usize>>,
    ) -> TopkRequest {
        let t = self.of(s);
        TopkRequest {
            sequences,
            k: t.cfg.k,
            temperature: t.cfg.temperature,
            start: 0,
            starts,
            values: ValuesKind::Logprobs,
            ids: None,
        }
    }

    /// A source's answers to `req`, one per sequence: one teacher's, or the mixture (each
    /// teacher's top-k in parallel, then each teacher's log-probs at the union in parallel,
    /// [`ensemble`]). A one-teacher mixture is that teacher's answer itself.
    pub fn score(&self, s: Source, req: &TopkRequest) -> Scores {
        if req.sequences.is_empty() {
            return Ok(vec![]);
        }
        match s {
            Source::One(i) => self.ask(i, req),
            Source::Mixture if self.list.len() == 1 => self.ask(0, req),
            Source::Mixture => {
                // Each teacher asked with its own request, all at once.
                let each = |make: &dyn Fn(&Teacher) -> TopkRequest| {
                    let reqs: Vec<(usize, TopkRequest)> =
                        self.list.iter().map(make).enumerate().collect();
                    in_parallel(&reqs, |(i, req)| self.ask(*i, req))
                };
                let topk = each(&|t: &Teacher| TopkRequest {
                    k: t.cfg.k,
                    ..req.clone()
                })?;
                let refs: Vec<&[SequenceScores]> = topk.iter().map(Vec::as_slice).collect();
                let ids = ensemble::union_ids(&refs);
                let scored = each(&|_: &Teacher| TopkRequest {
                    k: 0,
                    ids: Some(ids.clone()),
                    ..req.clone()
                })?;
                let refs: Vec<&[SequenceScores]> = scored.iter().map(Vec::as_slice).collect();
                let weights: Vec<f64> = self.list.iter().map(|t| t.weight).collect();
                Ok(ensemble::mix(&ids, &refs, &weights))
            }
        }
    }

    fn ask(&self, i: usize, req: &TopkRequest) -> Scores {
        let t = &self.list[i];
        match t.client.topk(req) {
            Ok(resp) => Ok(resp.results),
            Err(e) => Err(ScoreError {
                teacher: t.name.clone(),
                message: e.to_string(),
            }),
        }
    }

    /// Several groups' answers at once (one thread per group: a step waits for the slowest
    /// teacher, not the sum).
    pub fn score_all(
        &self,
        groups: &[&Group],
    ) -> std::result::Result<Vec<Vec<SequenceScores>>, ScoreError> {
        in_parallel(groups, |g| self.score_group(g))
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
