//! Result cache: one entry per scored sequence, weighted by its size in bytes.

use crate::request::ValidSequence;
use crate::scoring::{NextToken, ScoreParams};
use moka::future::Cache;
use sha2::{Digest, Sha256};
use std::sync::Arc;
use xdistill_shared::protocol::{SequenceScores, ValuesKind};

/// A 128-bit digest of everything that determines a sequence's scores.
pub type CacheKey = u128;

/// The key of one sequence: model fingerprint, ids, start, every score parameter (k,
/// temperature bits, values, ranks, next-token mode and seed) and the candidate ids.
pub fn cache_key(fingerprint: &str, seq: &ValidSequence, p: &ScoreParams) -> CacheKey {
    let mut h = Sha256::new();
    h.update((fingerprint.len() as u64).to_le_bytes());
    h.update(fingerprint.as_bytes());
    let ids_bytes = |h: &mut Sha256, ids: &[u32]| {
        h.update((ids.len() as u64).to_le_bytes());
        for id in ids {
            h.update(id.to_le_bytes());
        }
    };
    ids_bytes(&mut h, &seq.ids);
    h.update((p.k as u64).to_le_bytes());
    h.update(p.temperature.to_bits().to_le_bytes());
    h.update([match p.values {
        ValuesKind::Logprobs => 0u8,
        ValuesKind::Logits => 1u8,
    }]);
    h.update((seq.start as u64).to_le_bytes());
    h.update([p.ranks as u8]);
    h.update([p.hidden as u8]);
    match p.next {
        None => h.update([0u8]),
        Some(NextToken::Greedy) => h.update([1u8]),
        Some(NextToken::Sample { seed }) => {
            h.update([2u8]);
            h.update(seed.to_le_bytes());
        }
    }
    match &seq.candidates {
        None => h.update([0u8]),
        Some(c) => {
            h.update([1u8]);
            h.update((c.m as u64).to_le_bytes());
            ids_bytes(&mut h, &c.ids);
        }
    }
    let d = h.finalize();
    let mut b = [0u8; 16];
    b.copy_from_slice(&d[..16]);
    u128::from_le_bytes(b)
}

/// Per-entry overhead beyond the arrays (key, Arc, struct), counted in the weight.
const ENTRY_OVERHEAD: usize = 96;

/// The cache; disabled (every lookup misses, nothing is stored) when built with 0 bytes.
#[derive(Clone)]
pub struct ScoreCache {
    inner: Option<Cache<CacheKey, Arc<SequenceScores>>>,
}

impl ScoreCache {
    pub fn new(max_bytes: u64) -> ScoreCache {
        let inner = (max_bytes > 0).then(|| {
            Cache::builder()
                .max_capacity(max_bytes)
                .weigher(|_k: &CacheKey, v: &Arc<SequenceScores>| {
                    u32::try_from(v.heap_bytes() + ENTRY_OVERHEAD).unwrap_or(u32::MAX)
                })
                .build()
        });
        ScoreCache { inner }
    }

    pub async fn get(&self, key: &CacheKey) -> Option<Arc<SequenceScores>> {
        self.inner.as_ref()?.get(key).await
    }

    pub async fn insert(&self, key: CacheKey, value: Arc<SequenceScores>) {
        if let Some(c) = &self.inner {
            c.insert(key, value).await;
        }
    }

    /// (entries, weighted bytes); approximate until moka runs its pending maintenance.
    pub fn usage(&self) -> (u64, u64) {
        match &self.inner {
            Some(c) => (c.entry_count(), c.weighted_size()),
            None => (0, 0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(ids: &[u32], start: usize) -> ValidSequence {
        ValidSequence {
            ids: ids.into(),
            start,
            next_row: false,
            candidates: None,
        }
    }

    #[test]
    fn key_depends_on_every_part() {
        let p = ScoreParams::native(4, 1.0, ValuesKind::Logprobs);
        let s = seq(&[1, 2, 3], 0);
        let base = cache_key("fp", &s, &p);
        assert_eq!(base, cache_key("fp", &seq(&[1, 2, 3], 0), &p));
        let mut others = vec![
            cache_key("fq", &s, &p),
            cache_key("fp", &seq(&[1, 2, 4], 0), &p),
            cache_key("fp", &seq(&[1, 2, 3], 1), &p),
            cache_key("fp", &s, &ScoreParams { k: 5, ..p }),
            cache_key(
                "fp",
                &s,
                &ScoreParams {
                    temperature: 0.5,
                    ..p
                },
            ),
            cache_key(
                "fp",
                &s,
                &ScoreParams {
                    values: ValuesKind::Logits,
                    ..p
                },
            ),
            cache_key("fp", &s, &ScoreParams { ranks: true, ..p }),
            cache_key("fp", &s, &ScoreParams { hidden: true, ..p }),
            cache_key(
                "fp",
                &s,
                &ScoreParams {
                    next: Some(NextToken::Greedy),
                    ..p
                },
            ),
            cache_key(
                "fp",
                &s,
                &ScoreParams {
                    next: Some(NextToken::Sample { seed: 1 }),
                    ..p
                },
            ),
            cache_key(
                "fp",
                &s,
                &ScoreParams {
                    next: Some(NextToken::Sample { seed: 2 }),
                    ..p
                },
            ),
        ];
        for (m, ids) in [(1usize, vec![7u32, 8]), (2, vec![7, 8]), (1, vec![7, 9])] {
            let with = ValidSequence {
                candidates: Some(crate::request::Candidates { m, ids: ids.into() }),
                ..s.clone()
            };
            others.push(cache_key("fp", &with, &p));
        }
        let n = others.len();
        others.push(base);
        others.sort_unstable();
        others.dedup();
        assert_eq!(others.len(), n + 1, "two different requests share a key");
    }

    #[tokio::test]
    async fn stores_and_disables() {
        let p = ScoreParams::native(1, 1.0, ValuesKind::Logprobs);
        let key = cache_key("fp", &seq(&[1, 2], 0), &p);
        let v = Arc::new(SequenceScores {
            rows: 1,
            k: 1,
            topk_ids: vec![1],
            topk_values: vec![-0.1],
            target_logprobs: vec![-0.2],
            logsumexp: vec![0.3],
            ..Default::default()
        });
        let c = ScoreCache::new(1 << 20);
        c.insert(key, v.clone()).await;
        assert_eq!(c.get(&key).await.as_deref(), Some(&*v));
        let off = ScoreCache::new(0);
        off.insert(key, v).await;
        assert!(off.get(&key).await.is_none());
    }
}
