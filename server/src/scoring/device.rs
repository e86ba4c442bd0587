//! The device path: top-k and log-softmax statistics of logit rows computed where the logits
//! are ([`xdistill_shared::topk::topk_rows`], the chunked device top-k the trainer uses too);
//! only the `[c, k]` and `[c]` results come back to the host.

use super::params::{CandidateRows, ScoreParams};
use candle_core::Tensor;
use xdistill_shared::protocol::SequenceScores;

/// Top-k, target log-prob and logsumexp of `logits` [c, V] where they are; only the `[c, k]`
/// and `[c]` results come back to the host.
pub(super) fn score_on_device(
    logits: &Tensor,
    targets: &[u32],
    cands: CandidateRows<'_>,
    p: &ScoreParams,
    valid: usize,
) -> candle_core::Result<SequenceScores> {
    let dev = logits.device();
    let tg = Tensor::new(targets, dev)?;
    let ct = match cands.m {
        0 => None,
        m => Some(Tensor::from_slice(cands.ids, (targets.len(), m), dev)?),
    };
    let q = xdistill_shared::topk::RowQuery {
        k: p.k,
        temperature: p.temperature,
        valid,
        values: p.values,
        ranks: p.ranks,
    };
    let r = xdistill_shared::topk::topk_rows(logits, &tg, ct.as_ref(), &q)?;
    let mut s = SequenceScores {
        rows: targets.len(),
        k: p.k,
        topk_ids: r.ids.flatten_all()?.to_vec1()?,
        topk_values: r.values.flatten_all()?.to_vec1()?,
        target_logprobs: r.target_logprobs.to_vec1()?,
        logsumexp: r.logsumexp.to_vec1()?,
        m: cands.m,
        ids_logprobs: match r.ids_logprobs {
            Some(t) => t.flatten_all()?.to_vec1()?,
            None => Vec::new(),
        },
        target_ranks: match r.target_ranks {
            Some(t) => t.to_vec1()?,
            None => Vec::new(),
        },
        next_token: None,
        hidden: Vec::new(),
    };
    // A target inside the top k is ranked by its position there (as on the host path); the
    // device count ranks ties last, which differs only for tied values.
    for (row, &t) in targets.iter().enumerate().take(s.target_ranks.len()) {
        if let Some(j) = s.topk_ids[row * p.k..(row + 1) * p.k]
            .iter()
            .position(|&id| id == t)
        {
            s.target_ranks[row] = j as u32 + 1;
        }
    }
    Ok(s)
}

/// The device sort keeps 2k candidates per chunk of [`xdistill_shared::topk::SORT_CHUNK`] columns;
/// larger k (only with a raised `--max-k`) goes to the host path.
pub fn device_topk_fits(k: usize) -> bool {
    2 * k <= xdistill_shared::topk::SORT_CHUNK
}
