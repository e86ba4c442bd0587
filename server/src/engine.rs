//! The one scoring engine behind every route: a validated request → cache lookups → admission
//! (all or nothing) → the batcher → results, each cached. Routes differ only in how they decode
//! the request and encode the answer.

use crate::cache::cache_key;
use crate::error::ApiError;
use crate::request::ValidTopkRequest;
use crate::state::AppState;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use xdistill_shared::protocol::SequenceScores;

/// Scores every sequence of `valid`, in order.
pub async fn score(
    st: &AppState,
    valid: &ValidTopkRequest,
) -> Result<Vec<Arc<SequenceScores>>, ApiError> {
    let ready = st.ready()?;
    let p = valid.params;
    let m = &st.metrics;
    m.request_sequences
        .fetch_add(valid.sequences.len() as u64, Relaxed);

    // 1. Cache lookups; sequences with no rows need no work at all.
    let fingerprint = &ready.facts.fingerprint;
    let mut results: Vec<Option<Arc<SequenceScores>>> = Vec::with_capacity(valid.sequences.len());
    let mut misses = Vec::new();
    for (i, s) in valid.sequences.iter().enumerate() {
        if s.rows() == 0 {
            results.push(Some(Arc::new(SequenceScores {
                k: p.k,
                m: s.candidates.as_ref().map_or(0, |c| c.m),
                ..Default::default()
            })));
            continue;
        }
        let key = cache_key(fingerprint, s, &p);
        match st.cache.get(&key).await {
            Some(hit) => {
                m.cache_hits.fetch_add(1, Relaxed);
                results.push(Some(hit));
            }
            None => {
                m.cache_misses.fetch_add(1, Relaxed);
                results.push(None);
                misses.push((i, key));
            }
        }
    }

    // 2. Admission for the misses, all or nothing, then queue them.
    if !misses.is_empty() {
        let tokens: usize = misses
            .iter()
            .map(|&(i, _)| valid.sequences[i].input_tokens())
            .sum();
        let mut ticket = st.batcher.admit(tokens)?;
        let mut pending = Vec::with_capacity(misses.len());
        for &(i, key) in &misses {
            let rx = st
                .batcher
                .submit(&mut ticket, &valid.sequences[i], p)
                .await?;
            pending.push((i, key, rx));
        }
        drop(ticket);
        // 3. Results, routed back by index; each is cached.
        for (i, key, rx) in pending {
            let scores = rx
                .await
                .map_err(|_| ApiError::Internal("the model worker dropped the request".into()))?
                .map_err(ApiError::Scoring)?;
            let scores = Arc::new(scores);
            st.cache.insert(key, scores.clone()).await;
            results[i] = Some(scores);
        }
    }
    let results: Vec<Arc<SequenceScores>> =
        results.into_iter().map(|r| r.unwrap_or_default()).collect();
    let rows: usize = results.iter().map(|r| r.rows).sum();
    m.tokens_scored.fetch_add(rows as u64, Relaxed);
    Ok(results)
}
