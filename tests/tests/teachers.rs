//! Several teachers end to end on loopback, with real `teacher` processes: records routed by a
//! field to three teachers (one sharing the student's tokenizer, two with their own), off- and
//! on-policy, checked against each server's own `/metrics`; a same-tokenizer ensemble's target
//! against an f64 mixture of the teachers' full distributions, and an ensemble of one teacher
//! against single-teacher training, bit for bit; a chunk-level ensemble across tokenizers
//! against first_kl and against an f64 first-token mixture.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use xdistill_testkit::models::{model, token_driven_teacher};
use xdistill_testkit::{data_file, get_body, reference, teacher_binary, TeacherProcess};
use xdistill_tests::distill::{config, config_with};
use xdistill_trainer::config::{Config, TeacherConfig, TeacherMode};
use xdistill_trainer::student::Student;
use xdistill_trainer::train::teachers::Source;
use xdistill_trainer::train::{distill, off_policy, on_policy};

const NAMES: [&str; 3] = ["same", "qwen", "llama3"];

/// The GSM8K sample with a `domain` field naming a teacher: record i names `NAMES[i % 3]`,
/// except every 7th, which names none (it goes to `data.default_teacher`).
fn routed_data(dir: &Path) -> PathBuf {
    let text = std::fs::read_to_string(data_file()).unwrap();
    let mut out = String::new();
    for (i, line) in text.lines().filter(|l| !l.trim().is_empty()).enumerate() {
        let mut v: serde_json::Value = serde_json::from_str(line).unwrap();
        if i % 7 != 6 {
            v["domain"] = NAMES[i % 3].into();
        }
        out.push_str(&v.to_string());
        out.push('\n');
    }
    let path = dir.join("routed.jsonl");
    std::fs::write(&path, out).unwrap();
    path
}

/// `[[teachers]]` entries for running servers, named `names`.
fn teachers(names: &[&str], servers: &[&TeacherProcess], k: usize) -> Vec<TeacherConfig> {
    names
        .iter()
        .zip(servers)
        .map(|(n, t)| TeacherConfig {
            name: Some(n.to_string()),
            urls: vec![t.base.clone()],
            k,
            max_wait_s: 60.0,
            ..Default::default()
        })
        .collect()
}

/// A counter of a server's Prometheus `/metrics`.
fn counter(t: &TeacherProcess, name: &str) -> f64 {
    get_body(&t.url("/metrics"))
        .lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("{name} not in {}", t.url("/metrics")))
}

/// Per teacher name: (sequences, tokens) summed over the run's train lines.
type Sums = BTreeMap<String, (f64, f64)>;
/// Per teacher name: its KL at each step that had its records.
type Series = BTreeMap<String, Vec<f64>>;

/// Per teacher, the sums over the run's train lines of `teacher/<name>/sequences` and
/// `/tokens`, and the per-step KL series.
fn per_teacher(out: &Path) -> (Sums, Series) {
    let text = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let mut sums: BTreeMap<String, (f64, f64)> = BTreeMap::new();
    let mut kl: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for line in text.lines().filter(|l| l.contains("\"split\":\"train\"")) {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        for n in NAMES {
            let part = |w: &str| v["loss_parts"][format!("teacher/{n}/{w}")].as_f64();
            if let (Some(seqs), Some(tokens)) = (part("sequences"), part("tokens")) {
                let e = sums.entry(n.to_string()).or_default();
                e.0 += seqs;
                e.1 += tokens;
                kl.entry(n.to_string())
                    .or_default()
                    .push(part("kl").unwrap());
            }
        }
    }
    (sums, kl)
}

fn mean(x: &[f64]) -> f64 {
    x.iter().sum::<f64>() / x.len() as f64
}

/// Three teacher processes of different tokenizers behind one student.
struct Three {
    _dir: tempfile::TempDir,
    dir: PathBuf,
    student: PathBuf,
    servers: Vec<TeacherProcess>,
}

fn three() -> Three {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().to_path_buf();
    let student = model(&dir, "student", "qwen3", "llama2", 32, 2, 0.02, 2);
    let specs = [
        ("llama", "llama2", 1),
        ("qwen3", "qwen3", 2),
        ("llama", "llama3", 3),
    ];
    let servers = specs
        .iter()
        .enumerate()
        .map(|(i, (arch, tok, seed))| {
            let sub = dir.join(format!("t{i}"));
            std::fs::create_dir_all(&sub).unwrap();
            let m = token_driven_teacher(&sub, arch, tok, *seed);
            TeacherProcess::start(&teacher_binary(), &m, &[]).expect("starting a teacher")
        })
        .collect();
    Three {
        _dir: d,
        dir,
        student,
        servers,
    }
}

/// A routed run's config: `[loss]` for the teacher sharing the student's tokenizer, `[loss_cross]`
/// for the others; no validation, so the servers see exactly the training steps' sequences.
fn routed_config(t: &Three, out: &Path, steps: u64, loss: &str, extra: &str) -> Config {
    let data = routed_data(&t.dir);
    let mut cfg = config_with(
        &t.dir,
        &t.student,
        &t.servers[0].base,
        out,
        steps,
        loss,
        &data,
        "question",
        "answer",
        extra,
    );
    cfg.teacher = TeacherConfig::default();
    let refs: Vec<&TeacherProcess> = t.servers.iter().collect();
    cfg.teachers = teachers(&NAMES, &refs, 16);
    cfg.data.teacher_field = Some("domain".into());
    cfg.data.default_teacher = Some("qwen".into());
    cfg.distillation.num_prompts_per_step = 6;
    cfg.distillation.val_at_start = false;
    cfg.distillation.val_at_end = false;
    cfg.validate().unwrap();
    cfg
}

/// Each server received exactly the sequences its records made (its own counters, less
/// `before`, against the trainer's per-teacher figures) and every teacher had records; with
/// `whole`, every position but the last of each was scored (start = 0; on-policy asks only
/// for the completions).
fn check_servers(
    t: &Three,
    out: &Path,
    before: &[(f64, f64)],
    whole: bool,
) -> BTreeMap<String, Vec<f64>> {
    let (sums, kl) = per_teacher(out);
    for (i, n) in NAMES.iter().enumerate() {
        let (seqs, tokens) = sums
            .get(*n)
            .copied()
            .unwrap_or_else(|| panic!("no figures for {n}: {sums:?}"));
        let s = &t.servers[i];
        let got_seqs = counter(s, "xdistill_request_sequences_total") - before[i].0;
        let got_rows = counter(s, "xdistill_request_tokens_scored_total") - before[i].1;
        eprintln!(
            "{n}: trainer {seqs} sequences / {tokens} tokens; server {got_seqs} / {got_rows} rows"
        );
        assert!(seqs > 0.0, "{n} got no records");
        assert_eq!(got_seqs, seqs, "{n}: sequences the server received");
        if whole {
            assert_eq!(got_rows, tokens - seqs, "{n}: rows the server scored");
        }
    }
    kl
}

fn counts(t: &Three) -> Vec<(f64, f64)> {
    t.servers
        .iter()
        .map(|s| {
            (
                counter(s, "xdistill_request_sequences_total"),
                counter(s, "xdistill_request_tokens_scored_total"),
            )
        })
        .collect()
}

#[test]
fn routing_sends_each_record_to_its_teacher_off_and_on_policy() {
    let t = three();
    // 1. Off-policy: forward KL against the same-tokenizer teacher, first_kl across tokenizers.
    let out = t.dir.join("off");
    let loss = "kd = { type = \"forward_kl\" }\ntail = \"bucket\"\n[loss_cross]\nkd = { type = \"first_kl\" }";
    let cfg = routed_config(&t, &out, 24, loss, "");
    let s = distill::setup(cfg).expect("setup");
    assert!(s.teachers.routed());
    assert_eq!(
        s.teachers
            .list
            .iter()
            .map(|x| x.tokenization.is_cross())
            .collect::<Vec<_>>(),
        [false, true, true]
    );
    let before = counts(&t);
    let sum = off_policy::train(&s, false, None).expect("train");
    assert_eq!(sum.steps, 24);
    let kl = check_servers(&t, &out, &before, true);
    // The student's loss against each teacher falls.
    for (n, series) in &kl {
        let (a, b) = (mean(&series[..4]), mean(&series[series.len() - 4..]));
        eprintln!(
            "off-policy {n}: KL {a:.4} -> {b:.4} over {} steps",
            series.len()
        );
        assert!(b < 0.8 * a, "{n}: KL {a} -> {b}");
    }

    // 2. On-policy: the student's samples of each prompt go to the prompt's teacher.
    let out = t.dir.join("on");
    let extra = "[on_policy]\nlambda = 1.0\n[on_policy.generation]\nmax_new_tokens = 8\ntemperature = 1.0\nstop_strings = []\n";
    let cfg = routed_config(&t, &out, 6, "kd = { type = \"sampled_kl\" }", extra);
    let s = distill::setup(cfg).expect("setup");
    let before = counts(&t);
    let sum = on_policy::train(&s, false, None).expect("on-policy train");
    assert_eq!(sum.steps, 6);
    check_servers(&t, &out, &before, false);
}

/// The error (with its causes) of a setup that must fail for the reason `why`.
fn setup_error(cfg: Config, why: &str) -> String {
    match distill::setup(cfg) {
        Ok(_) => panic!("the setup succeeded; expected it to fail: {why}"),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn routing_errors_are_reported_at_start() {
    let t = three();
    let loss = "kd = { type = \"forward_kl\" }\n[loss_cross]\nkd = { type = \"first_kl\" }";
    // A record naming no configured teacher, without a default: the start fails naming it.
    let mut cfg = routed_config(&t, &t.dir.join("bad"), 2, loss, "");
    cfg.data.default_teacher = None;
    cfg.teachers.truncate(2);
    let s = distill::setup(cfg).expect("setup");
    let err = format!("{:#}", off_policy::train(&s, false, None).unwrap_err());
    assert!(
        err.contains("names teacher \"llama3\", which is not configured"),
        "{err}"
    );
    assert!(
        !t.dir.join("bad/metrics.jsonl").exists(),
        "nothing was trained"
    );
    // An unreachable teacher: the setup fails naming it.
    let mut cfg = routed_config(&t, &t.dir.join("dead"), 2, loss, "");
    cfg.teachers[1].urls = vec!["http://127.0.0.1:9".into()];
    cfg.teachers[1].max_wait_s = 1.0;
    let err = setup_error(cfg, "a dead teacher");
    assert!(err.contains("teacher \"qwen\""), "{err}");
    // A same-tokenizer ensemble whose union of top-k sets (16 + 16) can exceed what a server
    // scores per row (--max-k 20) is refused at start, naming the teacher.
    let small = TeacherProcess::start(
        &teacher_binary(),
        &t.dir.join("t0").join("teacher"),
        &["--max-k", "20"],
    )
    .expect("a teacher with --max-k 20");
    let mut cfg = routed_config(&t, &t.dir.join("union"), 2, loss, "");
    cfg.teachers = teachers(&["same", "small"], &[&t.servers[0], &small], 16);
    cfg.distillation.teachers = TeacherMode::Ensemble;
    let err = setup_error(cfg, "a union wider than max_k");
    assert!(
        err.contains("teacher \"small\"") && err.contains("max_k 20"),
        "{err}"
    );
    // An ensemble across tokenizers mixes at the chunk level with first_kl: another
    // cross-tokenizer loss is refused at start.
    let pkl = "kd = { type = \"forward_kl\" }\n[loss_cross]\nkd = { type = \"pkl\" }";
    let mut cfg = routed_config(&t, &t.dir.join("ens"), 2, pkl, "");
    cfg.distillation.teachers = TeacherMode::Ensemble;
    let err = setup_error(cfg, "a chunk-level ensemble without first_kl");
    assert!(err.contains("first_kl"), "{err}");
}

/// A model directory loaded on the CPU in f32, as the references below read it.
fn load(dir: &Path) -> Student {
    Student::load(dir, &candle_core::Device::Cpu, candle_core::DType::F32).unwrap()
}

/// The logits `[S, V]` (f32) of a model for one sequence.
fn logits_of(st: &Student, ids: &[u32]) -> candle_core::Tensor {
    let x = candle_core::Tensor::new(ids, &candle_core::Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    st.model().forward(&x).unwrap().squeeze(0).unwrap()
}

/// Full log-softmax rows `[S-1][V]` of a model for one sequence, in f64.
fn full_rows(st: &Student, ids: &[u32]) -> Vec<Vec<f64>> {
    let logits: Vec<Vec<f32>> = logits_of(st, ids).to_vec2().unwrap();
    logits[..ids.len() - 1]
        .iter()
        .map(|row| {
            let m = row
                .iter()
                .map(|&v| v as f64)
                .fold(f64::NEG_INFINITY, f64::max);
            let lse = m + row.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln();
            row.iter().map(|&v| v as f64 - lse).collect()
        })
        .collect()
}

/// At each position of one sequence (`[S-1]`), a model's `n` most likely next ids
/// with their log-probs, largest first: each row's logsumexp over the whole vocabulary in f64.
/// What [`full_rows`] gives at those ids, without `[S-1, V]` f64 rows: the chunk-level test
/// reads 12 sequences of up to 300 positions over vocabularies of 128k and 151k, and this
/// crate's tests run unoptimised (17 s there through `full_rows`).
fn top_log_probs(st: &Student, ids: &[u32], n: usize) -> Vec<Vec<(usize, f64)>> {
    let logits = logits_of(st, ids);
    (0..ids.len() - 1)
        .map(|p| {
            let row = logits.get(p).unwrap();
            let lse = row
                .to_dtype(candle_core::DType::F64)
                .and_then(|r| r.log_sum_exp(0))
                .and_then(|r| r.to_scalar::<f64>())
                .unwrap();
            let row: Vec<f32> = row.to_vec1().unwrap();
            reference::largest_f32(&row, n)
                .into_iter()
                .map(|i| (i, row[i] as f64 - lse))
                .collect()
        })
        .collect()
}

#[test]
fn ensemble_target_is_the_f64_mixture_and_one_teacher_ensemble_is_single_teacher_training() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let student = model(dir, "student", "qwen3", "llama2", 32, 2, 0.02, 2);
    let models: Vec<PathBuf> = (0..2)
        .map(|i| {
            let sub = dir.join(format!("t{i}"));
            std::fs::create_dir_all(&sub).unwrap();
            token_driven_teacher(&sub, "llama", "llama2", 5 + i)
        })
        .collect();
    let servers: Vec<TeacherProcess> = models
        .iter()
        .map(|m| TeacherProcess::start(&teacher_binary(), m, &[]).expect("teacher"))
        .collect();
    let loss = "kd = { type = \"forward_kl\" }\ntail = \"bucket\"";

    // 1. The target of a two-teacher ensemble (weights 3:1), from the real servers, against the
    //    mixture of the two models' full distributions computed here in f64.
    let mut cfg = config(dir, &student, &servers[0].base, &dir.join("mix"), 8, loss);
    cfg.teacher = TeacherConfig::default();
    cfg.teachers = teachers(&["a", "b"], &[&servers[0], &servers[1]], 8);
    cfg.teachers[0].weight = 3.0;
    cfg.distillation.teachers = TeacherMode::Ensemble;
    cfg.validate().unwrap();
    let s = distill::setup(cfg).expect("setup");
    let seqs: Vec<Vec<u32>> = vec![
        vec![1, 450, 4996, 17354, 1701, 432, 29889],
        vec![1, 29871, 29906, 29974, 29906],
    ];
    let req = s.teachers.request(Source::Mixture, seqs.clone(), None);
    let got = s
        .teachers
        .score(Source::Mixture, &req)
        .expect("ensemble scores");
    let w = [0.75, 0.25];
    let loaded: Vec<Student> = models.iter().map(|m| load(m)).collect();
    for (seq, out) in seqs.iter().zip(&got) {
        let full: Vec<Vec<Vec<f64>>> = loaded.iter().map(|m| full_rows(m, seq)).collect();
        assert_eq!(out.rows, seq.len() - 1);
        assert!(out.k >= 8 && out.k <= 16, "union width {}", out.k);
        for r in 0..out.rows {
            let p = |i: usize| w[0] * full[0][r][i].exp() + w[1] * full[1][r][i].exp();
            let mut inside = 0.0;
            for (&id, &lp) in out.ids_row(r).iter().zip(out.values_row(r)) {
                assert!(
                    (lp as f64 - p(id as usize).ln()).abs() < 2e-4,
                    "row {r} id {id}: {lp} vs {}",
                    p(id as usize).ln()
                );
                inside += p(id as usize);
            }
            // Both teachers' top-8 are in the set.
            for f in &full {
                for i in reference::largest(&f[r], 7) {
                    assert!(
                        out.ids_row(r).contains(&(i as u32)),
                        "row {r}: top id {i} missing"
                    );
                }
            }
            let tail = 1.0
                - out
                    .values_row(r)
                    .iter()
                    .map(|&x| (x as f64).exp())
                    .sum::<f64>();
            assert!(
                (tail - (1.0 - inside)).abs() < 2e-4,
                "tail {tail} vs {}",
                1.0 - inside
            );
            let target = seq[r + 1] as usize;
            assert!((out.target_logprobs[r] as f64 - p(target).ln()).abs() < 2e-4);
        }
    }
    // The ensemble trains: held-out KL to the mixture falls.
    let sum = off_policy::train(&s, false, None).expect("ensemble train");
    let (a, b) = (sum.val_kl_start.unwrap(), sum.val_kl_end.unwrap());
    eprintln!("two-teacher ensemble: held-out KL {a:.4} -> {b:.4}");
    assert!(b < a, "{a} -> {b}");

    // 2. An ensemble of one teacher trains exactly as that teacher alone.
    let single = dir.join("single");
    let cfg = config(dir, &student, &servers[0].base, &single, 6, loss);
    off_policy::train(&distill::setup(cfg).unwrap(), false, None).unwrap();
    let ens = dir.join("ensemble1");
    let mut cfg = config(dir, &student, &servers[0].base, &ens, 6, loss);
    cfg.teacher = TeacherConfig::default();
    cfg.teachers = teachers(&["only"], &[&servers[0]], 16);
    cfg.distillation.teachers = TeacherMode::Ensemble;
    cfg.validate().unwrap();
    let s = distill::setup(cfg).unwrap();
    assert_eq!(s.teachers.name(Source::Mixture), "ensemble");
    off_policy::train(&s, false, None).unwrap();
    let a = std::fs::read(single.join("final/model.safetensors")).unwrap();
    let b = std::fs::read(ens.join("final/model.safetensors")).unwrap();
    assert!(a == b, "a one-teacher ensemble changed the trained weights");
}

/// The first `n` GSM8K records as prompt/completion pairs (completion-only loss).
fn records(n: usize) -> Vec<xdistill_trainer::data::Record> {
    use xdistill_trainer::data::{Content, Record};
    std::fs::read_to_string(data_file())
        .unwrap()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .take(n)
        .enumerate()
        .map(|(i, l)| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            Record {
                line: i + 1,
                content: Content::Pair {
                    prompt: v["question"].as_str().unwrap().into(),
                    completion: v["answer"].as_str().unwrap().into(),
                },
                completion_only_loss: true,
                teacher: None,
            }
        })
        .collect()
}

#[test]
fn chunk_level_ensemble_across_tokenizers() {
    use xdistill_trainer::data::Batch;
    use xdistill_trainer::train::pairing::{units, Item, Pairing};
    use xdistill_trainer::train::prepare::prepare;
    use xdistill_trainer::train::step::micro_loss;
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let student = model(dir, "student", "qwen3", "llama2", 32, 2, 0.02, 2);
    let specs = [("qwen3", "qwen3", 21), ("llama", "llama3", 22)];
    let models: Vec<PathBuf> = specs
        .iter()
        .enumerate()
        .map(|(i, (arch, tok, seed))| {
            let sub = dir.join(format!("t{i}"));
            std::fs::create_dir_all(&sub).unwrap();
            token_driven_teacher(&sub, arch, tok, *seed)
        })
        .collect();
    let servers: Vec<TeacherProcess> = models
        .iter()
        .map(|m| TeacherProcess::start(&teacher_binary(), m, &[]).expect("teacher"))
        .collect();
    let loss = "kd = { type = \"first_kl\" }";
    let ensemble = |out: &str, names: &[&str], on: &[&TeacherProcess], w: &[f64]| {
        let mut cfg = config(dir, &student, &servers[0].base, &dir.join(out), 8, loss);
        cfg.teacher = TeacherConfig::default();
        cfg.teachers = teachers(names, on, 16);
        for (t, w) in cfg.teachers.iter_mut().zip(w) {
            t.weight = *w;
        }
        cfg.distillation.teachers = TeacherMode::Ensemble;
        cfg.validate().unwrap();
        distill::setup(cfg).expect("setup")
    };
    let batch = Batch {
        records: records(6),
        start: Default::default(),
        next: Default::default(),
    };
    let st = load(&student);

    // 1. The same teacher twice (equal weights) mixes to itself: the chunk-level ensemble's
    //    first_kl on its virtual teacher equals first_kl against that teacher directly.
    let single = distill::setup(config(
        dir,
        &student,
        &servers[0].base,
        &dir.join("single"),
        8,
        loss,
    ))
    .unwrap();
    let twice = ensemble(
        "twice",
        &["a", "a2"],
        &[&servers[0], &servers[0]],
        &[1.0, 1.0],
    );
    assert!(matches!(
        twice.teachers.pairing(Source::Mixture),
        Pairing::Mixture(_)
    ));
    let kd = |s: &distill::Setup| {
        let p = prepare(batch.clone(), &s.teachers);
        assert_eq!(p.groups.len(), 1);
        let g = &p.groups[0];
        let answers = s.teachers.score_group(g).unwrap();
        let refs: Vec<_> = answers.iter().collect();
        let k = answers[0].k;
        let lc = s.loss_ctx(g.source, k, st.model(), s.loss_of(g.source));
        let (_, out) = micro_loss(&lc, &g.items, &refs, units(&g.items)).unwrap();
        (out.kd.loss, units(&g.items).kd)
    };
    let (direct, n1) = kd(&single);
    let (mixed, n2) = kd(&twice);
    eprintln!(
        "first_kl {direct:.6} over {n1} chunks; the teacher mixed with itself {mixed:.6} over {n2}"
    );
    assert_eq!(n1, n2, "the same chunks");
    assert!(
        (direct - mixed).abs() < 1e-5 * direct.abs().max(1.0),
        "{direct} vs {mixed}"
    );

    // 2. Two teachers of two tokenizers (weights 2:1): at every distilled student position the
    //    virtual teacher's distribution is the mixture of each teacher's top-k, grouped by first
    //    student token, computed here from the models' full distributions in f64.
    let two = ensemble(
        "two",
        &["qwen", "llama3"],
        &[&servers[0], &servers[1]],
        &[2.0, 1.0],
    );
    let p = prepare(batch.clone(), &two.teachers);
    let g = &p.groups[0];
    assert_eq!(g.parts.len(), 2);
    let answers = two.teachers.score_group(g).unwrap();
    let w = [2.0 / 3.0, 1.0 / 3.0];
    let loaded: Vec<Student> = models.iter().map(|m| load(m)).collect();
    let mut checked = 0;
    for (r, (item, virt)) in g.items.iter().zip(&answers).enumerate() {
        let Item::Cross { pair, .. } = item else {
            panic!("virtual items are aligned")
        };
        let top: Vec<Vec<Vec<(usize, f64)>>> = (0..2)
            .map(|t| top_log_probs(&loaded[t], g.parts[t][r].teacher_ids(), 16))
            .collect();
        for c in pair.chunks.iter().filter(|c| c.student.start > 0) {
            let j = c.student.start;
            let mut want: BTreeMap<u32, f64> = BTreeMap::new();
            for t in 0..2 {
                let Item::Cross { pair: tp, .. } = &g.parts[t][r] else {
                    panic!()
                };
                let a = tp
                    .chunks
                    .iter()
                    .find(|x| x.student.start == j)
                    .expect("a common start")
                    .teacher
                    .start;
                let proj = two.teachers.list[t].projection.as_ref().unwrap();
                for &(u, lp) in &top[t][a - 1] {
                    if let Some(f) = proj.teacher_first(u) {
                        *want.entry(f).or_default() += w[t] * lp.exp();
                    }
                }
            }
            let got: BTreeMap<u32, f64> = virt
                .ids_row(j - 1)
                .iter()
                .zip(virt.values_row(j - 1))
                .filter(|(_, &v)| v > f32::NEG_INFINITY)
                .map(|(&id, &v)| (id, (v as f64).exp()))
                .collect();
            assert_eq!(
                got.keys().collect::<Vec<_>>(),
                want.keys().collect::<Vec<_>>(),
                "row {j}"
            );
            for (id, p) in &want {
                assert!(
                    (got[id] - p).abs() < 2e-4,
                    "row {j} id {id}: {} vs {p}",
                    got[id]
                );
            }
            checked += 1;
        }
    }
    assert!(checked > 20, "only {checked} positions checked");

    // 3. It trains, off-policy and on-policy: held-out first-token KL to the mixture falls.
    let sum = off_policy::train(&two, false, None).expect("train");
    let (a, b) = (sum.val_kl_start.unwrap(), sum.val_kl_end.unwrap());
    eprintln!("chunk-level ensemble: held-out KL {a:.4} -> {b:.4}");
    assert!(b < a, "{a} -> {b}");
    let mut cfg = config(dir, &student, &servers[0].base, &dir.join("on"), 3, loss);
    cfg.teacher = TeacherConfig::default();
    cfg.teachers = teachers(&["qwen", "llama3"], &[&servers[0], &servers[1]], 16);
    cfg.distillation.teachers = TeacherMode::Ensemble;
    cfg.on_policy.generation.max_new_tokens = 8;
    let s = distill::setup(cfg).unwrap();
    assert_eq!(
        on_policy::train(&s, false, None).expect("on-policy").steps,
        3
    );
}
