//! The device path: top-k and log-softmax statistics of logit rows computed where the logits
//! are ([`xdistill_shared::topk::topk_rows`], the chunked device top-k the trainer uses too);
//! only the `[c, k]` and `[c]` results come back to the host.

use super::params::{CandidateRows, ScoreParams};
use candle_core::Tensor;
use xdistill_shared::protocol::SequenceScores;

/// Top-k, target log-prob and logsumexp of `logits` [c, V] computed where the logits are;
/// [`Found::to_host`] then copies only the `[c, k]` and `[c]` results back.
pub(super) fn topk_on_device(
    logits: &Tensor,
    targets: &[u32],
    cands: CandidateRows<'_>,
    p: &ScoreParams,
    valid: usize,
) -> candle_core::Result<Found> {
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
    Ok(Found {
        rows: xdistill_shared::topk::topk_rows(logits, &tg, ct.as_ref(), &q)?,
        m: cands.m,
    })
}

/// The device's answers for a run of rows, still on the device.
pub(super) struct Found {
    rows: xdistill_shared::topk::TopkRows,
    /// Candidate ids per row (0: none asked).
    m: usize,
}

impl Found {
    /// The answers as the host's [`SequenceScores`] of rows whose targets are `targets`.
    pub(super) fn to_host(self, targets: &[u32], k: usize) -> candle_core::Result<SequenceScores> {
        let r = self.rows;
        let mut s = SequenceScores {
            rows: targets.len(),
            k,
            topk_ids: r.ids.flatten_all()?.to_vec1()?,
            topk_values: r.values.flatten_all()?.to_vec1()?,
            target_logprobs: r.target_logprobs.to_vec1()?,
            logsumexp: r.logsumexp.to_vec1()?,
            m: self.m,
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
            if let Some(j) = s.topk_ids[row * k..(row + 1) * k]
                .iter()
                .position(|&id| id == t)
            {
                s.target_ranks[row] = j as u32 + 1;
            }
        }
        Ok(s)
    }
}

/// The device sort keeps 2k candidates per chunk of [`xdistill_shared::topk::SORT_CHUNK`] columns;
/// larger k (only with a raised `--max-k`) goes to the host path.
pub fn device_topk_fits(k: usize) -> bool {
    2 * k <= xdistill_shared::topk::SORT_CHUNK
}
