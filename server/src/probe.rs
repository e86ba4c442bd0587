//! The start-up probe: a fixed sequence the worker scores once the model is loaded, through the
//! same scoring pass as `/topk_logits`. Its SHA-256 is published in `/v1/info` and sent with
//! every scoring answer ([`PROBE_HEADER`]), so that clients can refuse to mix replicas whose
//! numbers differ (another dtype, device or scoring path over the same weights).
//!
//! The probe depends only on the vocabulary size (and the model's context, when shorter than
//! [`PROBE_LEN`]): [`PROBE_LEN`] ids drawn by splitmix64 from [`PROBE_SEED`], each modulo the
//! vocabulary size, scored with `k = min(PROBE_K, vocab)`, temperature 1, log-probs, start 0.
//!
//! [`PROBE_HEADER`]: xdistill_shared::protocol::PROBE_HEADER

use crate::scoring::ScoreParams;
use sha2::{Digest, Sha256};
use xdistill_shared::protocol::{ProbeInfo, SequenceScores, ValuesKind};

/// Tokens of the probe (at most; fewer when the model's context is shorter).
pub const PROBE_LEN: usize = 32;
/// Top entries per row of the probe's scores (at most the vocabulary size).
pub const PROBE_K: usize = 8;
/// Seed of the probe's ids: the bytes of `"xdistill"`.
pub const PROBE_SEED: u64 = 0x7864_6973_7469_6c6c;
/// Prefix of the hashed bytes, so that a change of the hashed layout changes every hash.
const DOMAIN: &[u8] = b"xdistill-probe-v1\0";

/// One step of splitmix64: the next state and its output.
fn splitmix64(state: u64) -> (u64, u64) {
    let s = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = s;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (s, z ^ (z >> 31))
}

/// The probe's ids: `min(PROBE_LEN, max_len)` draws below `vocab_size`; empty when the
/// vocabulary is empty or fewer than two tokens fit (nothing to score).
pub fn probe_ids(vocab_size: usize, max_len: usize) -> Vec<u32> {
    let n = PROBE_LEN.min(max_len);
    if vocab_size == 0 || n < 2 {
        return Vec::new();
    }
    let mut state = PROBE_SEED;
    (0..n)
        .map(|_| {
            let (next, out) = splitmix64(state);
            state = next;
            (out % vocab_size as u64) as u32
        })
        .collect()
}

/// The parameters the probe is scored with.
pub fn probe_params(vocab_size: usize) -> ScoreParams {
    ScoreParams::native(PROBE_K.min(vocab_size), 1.0, ValuesKind::Logprobs)
}

/// SHA-256 hex of the probe's ids alone (each u32 little-endian, after their count).
pub fn ids_hash(ids: &[u32]) -> String {
    let mut h = Sha256::new();
    h.update(DOMAIN);
    hash_u32s(&mut h, ids);
    hex::encode(h.finalize())
}

/// SHA-256 hex of the probe and its scores: the ids, then k and rows, then the top-k ids, top-k
/// values, target log-probs and logsumexps (each list after its length; u32 and f32 as their
/// little-endian bytes, so that any bit of difference changes the hash).
pub fn probe_hash(ids: &[u32], s: &SequenceScores) -> String {
    let mut h = Sha256::new();
    h.update(DOMAIN);
    hash_u32s(&mut h, ids);
    h.update((s.k as u32).to_le_bytes());
    h.update((s.rows as u32).to_le_bytes());
    hash_u32s(&mut h, &s.topk_ids);
    for v in [&s.topk_values, &s.target_logprobs, &s.logsumexp] {
        let bits: Vec<u32> = v.iter().map(|x| x.to_bits()).collect();
        hash_u32s(&mut h, &bits);
    }
    hex::encode(h.finalize())
}

fn hash_u32s(h: &mut Sha256, xs: &[u32]) {
    h.update((xs.len() as u32).to_le_bytes());
    for x in xs {
        h.update(x.to_le_bytes());
    }
}

/// What `/v1/info` publishes of a scored probe.
pub fn probe_info(ids: &[u32], scores: &SequenceScores) -> ProbeInfo {
    ProbeInfo {
        hash: probe_hash(ids, scores),
        ids_hash: ids_hash(ids),
        k: scores.k,
        positions: scores.rows,
        target_logprobs: scores.target_logprobs.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scores(target: f32) -> SequenceScores {
        SequenceScores {
            rows: 2,
            k: 1,
            topk_ids: vec![3, 4],
            topk_values: vec![-0.5, -0.25],
            target_logprobs: vec![target, -2.0],
            logsumexp: vec![1.0, 1.5],
            ..Default::default()
        }
    }

    /// The ids are fixed by the vocabulary size (pinned so that a change is seen), below it, and
    /// cut to the model's context.
    #[test]
    fn ids_depend_on_the_vocabulary_only() {
        let a = probe_ids(32000, 4096);
        assert_eq!(a.len(), PROBE_LEN);
        assert_eq!(a, probe_ids(32000, 4096));
        assert!(a.iter().all(|&i| i < 32000));
        assert_ne!(a, probe_ids(32001, 4096));
        assert_eq!(probe_ids(32000, 5), a[..5]);
        assert!(probe_ids(32000, 1).is_empty());
        assert!(probe_ids(0, 64).is_empty());
        // splitmix64's first output from the seed, modulo 1 << 32 (a fixed, documented list).
        let (_, first) = splitmix64(PROBE_SEED);
        assert_eq!(probe_ids(1 << 32, 64)[0] as u64, first % (1 << 32));
    }

    /// Any bit of a value changes the hash, -0.0 vs 0.0 included; the ids hash does not move.
    #[test]
    fn the_hash_sees_every_bit() {
        let ids = [1, 2, 3];
        let h = probe_hash(&ids, &scores(-1.0));
        assert_eq!(h.len(), 64);
        assert_eq!(h, probe_hash(&ids, &scores(-1.0)));
        let nudged = f32::from_bits((-1.0f32).to_bits() + 1);
        assert_ne!(h, probe_hash(&ids, &scores(nudged)));
        assert_ne!(
            probe_hash(&ids, &scores(0.0)),
            probe_hash(&ids, &scores(-0.0))
        );
        assert_ne!(h, probe_hash(&[1, 2, 4], &scores(-1.0)));
        let (a, b) = (
            probe_info(&ids, &scores(-1.0)),
            probe_info(&ids, &scores(-1.5)),
        );
        assert_eq!(a.ids_hash, b.ids_hash);
        assert_ne!(a.hash, b.hash);
        assert_eq!((a.k, a.positions), (1, 2));
        assert_eq!(a.max_abs_diff(&b), Some(0.5));
    }
}
