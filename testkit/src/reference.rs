//! The independent reference a teacher's answers are checked against (the model loaded here,
//! one sequence at a time, in f64), and deterministic test inputs.

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use std::path::Path;
use xdistill_shared::hf::ModelDir;
use xdistill_shared::model::{Decoder, Ops};
use xdistill_shared::protocol::ValuesKind;

/// The independent reference: the model loaded here, one sequence at a time (no batching, no
/// padding), full logits [S, V], log-softmax over the tokenizer's vocabulary in f64.
pub struct Reference {
    decoder: Decoder,
    vocab: usize,
}

impl Reference {
    pub fn load(dir: &Path) -> Reference {
        let md = ModelDir::open(dir).expect("open model");
        let vocab = md
            .load_tokenizer()
            .expect("tokenizer")
            .get_vocab_size(true)
            .min(md.config.vocab_size);
        let vb = unsafe {
            VarBuilder::from_mmaped_safetensors(&md.weights, DType::F32, &Device::Cpu).expect("vb")
        };
        Reference {
            decoder: Decoder::new(&md.config, vb, Ops::Fused).expect("decoder"),
            vocab,
        }
    }

    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Rows `start..S-1` of `(logits / t)[..vocab]` and their log-softmax, in f64.
    pub fn rows(&self, ids: &[u32], start: usize, t: f64) -> Vec<(Vec<f64>, Vec<f64>)> {
        let x = Tensor::new(ids, &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let logits = self.decoder.forward(&x).unwrap().squeeze(0).unwrap();
        let logits: Vec<Vec<f32>> = logits.to_vec2().unwrap();
        logits[start..ids.len() - 1]
            .iter()
            .map(|row| {
                let y: Vec<f64> = row[..self.vocab].iter().map(|&v| v as f64 / t).collect();
                let m = y.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let lse = m + y.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
                let lp = y.iter().map(|v| v - lse).collect();
                (y, lp)
            })
            .collect()
    }

    /// Checks one sequence's answer against the reference to `tol`: every returned id carries
    /// its reference value, values descend, no better id was left out (ties allowed), the
    /// target log-prob and the logsumexp agree.
    pub fn check(
        &self,
        got: &xdistill_shared::protocol::SequenceScores,
        ids: &[u32],
        start: usize,
        t: f64,
        values: ValuesKind,
        tol: f64,
    ) {
        let rows = self.rows(ids, start, t);
        assert_eq!(got.rows, rows.len(), "row count");
        for (r, (y, lp)) in rows.iter().enumerate() {
            let vals = if values == ValuesKind::Logits { y } else { lp };
            // The k largest values, descending.
            let sorted = largest_values(vals, got.k);
            let (gi, gv) = (got.ids_row(r), got.values_row(r));
            for j in 0..got.k {
                let id = gi[j] as usize;
                assert!(id < self.vocab, "row {r}: id {id} >= vocab {}", self.vocab);
                assert!(
                    (gv[j] as f64 - vals[id]).abs() < tol,
                    "row {r} entry {j}: id {id} value {} vs reference {}",
                    gv[j],
                    vals[id]
                );
                assert!(
                    (gv[j] as f64 - sorted[j]).abs() < tol,
                    "row {r} entry {j}: value {} but the reference's {j}-th largest is {}",
                    gv[j],
                    sorted[j]
                );
                if j > 0 {
                    assert!(gv[j] <= gv[j - 1], "row {r}: values not descending");
                    assert!(!gi[..j].contains(&gi[j]), "row {r}: duplicate id");
                }
            }
            let target = ids[start + r + 1] as usize;
            assert!((got.target_logprobs[r] as f64 - lp[target]).abs() < tol);
            let lse = y[0] - lp[0];
            assert!((got.logsumexp[r] as f64 - lse).abs() < tol * lse.abs().max(1.0));
        }
    }
}

/// A tensor's values in the order of its logical shape, flattened, as f64: what the tests
/// compare against their references.
pub fn f64s(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// Log-probs of one hidden-state row `h` through a `/v1/head` file, and their logsumexp, in
/// f64: `log_softmax(c · tanh((h · Wᵀ + b) · s / c))` over the ids `< vocab_size` (no cap
/// where the model has none): what `/hidden_states` × `/v1/head` must give back.
pub fn head_logprobs(head: &xdistill_shared::codec::HeadFile, row: &[f32]) -> (Vec<f64>, f64) {
    let m = &head.meta;
    let h = m.hidden_size;
    assert_eq!(row.len(), h, "a hidden-state row of the head's width");
    let z: Vec<f64> = (0..m.vocab_size)
        .map(|v| {
            let w = &head.weight[v * h..(v + 1) * h];
            let mut x: f64 = w.iter().zip(row).map(|(&a, &b)| a as f64 * b as f64).sum();
            if let Some(b) = &head.bias {
                x += b[v] as f64;
            }
            x *= m.logit_scale;
            if let Some(cap) = m.logit_softcap {
                x = cap * (x / cap).tanh();
            }
            x
        })
        .collect();
    let max = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let lse = max + z.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
    (z.iter().map(|x| x - lse).collect(), lse)
}

/// The ids of the `k` largest of `values`, largest first (ties: the smaller id first): a
/// selection, then a sort of `k` (sorting whole rows of a 262k vocabulary cost seconds per test).
pub fn largest(values: &[f64], k: usize) -> Vec<usize> {
    largest_by_key(values, k)
}

/// [`largest`] of an f32 row (a model's logits), without widening it first: compiled here,
/// optimised, for tests that run unoptimised.
pub fn largest_f32(values: &[f32], k: usize) -> Vec<usize> {
    largest_by_key(values, k)
}

fn largest_by_key<T: Copy + Into<f64>>(values: &[T], k: usize) -> Vec<usize> {
    let desc = |a: &usize, b: &usize| {
        let (va, vb): (f64, f64) = (values[*a].into(), values[*b].into());
        vb.total_cmp(&va).then(a.cmp(b))
    };
    let mut order: Vec<usize> = (0..values.len()).collect();
    if k < order.len() {
        order.select_nth_unstable_by(k, desc);
        order.truncate(k);
    }
    order.sort_by(desc);
    order
}

/// The `k` largest of `values` themselves, largest first (see [`largest`]).
pub fn largest_values(values: &[f64], k: usize) -> Vec<f64> {
    largest(values, k).into_iter().map(|i| values[i]).collect()
}

/// Every id and value of a sequence's scores as bits (see `SequenceScores::bits`).
pub fn score_bits(s: &xdistill_shared::protocol::SequenceScores) -> Vec<u32> {
    s.bits()
}

/// Deterministic pseudo-random ids below `vocab`.
pub fn ids(seed: u64, len: usize, vocab: usize) -> Vec<u32> {
    let mut s = seed.wrapping_mul(0x9E3779B97F4A7C15).wrapping_add(1);
    (0..len)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 33) % vocab as u64) as u32
        })
        .collect()
}
