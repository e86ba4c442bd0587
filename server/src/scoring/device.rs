//! The device path: top-k and log-softmax statistics of logit rows computed where the logits
//! are ([`xdistill_shared::topk::topk_rows`], the chunked device top-k the trainer uses too);
//! only the `[c, k]` and `[c]` results come back to the host.

use super::params::{CandidateRows, ScoreParams};
use candle_core::{DType, Tensor};
use xdistill_shared::protocol::SequenceScores;

/// Top-k, target log-prob and logsumexp of `logits` [c, V] computed where the logits are;
/// [`Found::into_host`] then copies only the `[c, k]` and `[c]` results back.
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
    let q = p.rows(valid);
    Ok(Found {
        rows: xdistill_shared::topk::topk_rows(logits, &tg, ct.as_ref(), &q)?,
        m: cands.m,
        exact_in_f32: valid <= MAX_EXACT_F32_ID,
    })
}

/// Ids and ranks at most this large are exact in f32 (2^24), so they can travel back in the
/// one f32 copy of [`Found::into_host`]; every vocabulary served today is far below.
const MAX_EXACT_F32_ID: usize = 1 << 24;

/// The device's answers for a run of rows, still on the device.
pub(super) struct Found {
    rows: xdistill_shared::topk::TopkRows,
    /// Candidate ids per row (0: none asked).
    m: usize,
    /// Whether every id and rank is exact in f32 (the valid vocabulary is at most 2^24).
    exact_in_f32: bool,
}

/// One row's answers as they come back: `[ids (k), values (k), target log-prob, logsumexp,
/// candidate log-probs (m), rank (0 or 1)]`, all f32.
struct Packed {
    k: usize,
    m: usize,
    ranks: bool,
}

impl Packed {
    fn width(&self) -> usize {
        2 * self.k + 2 + self.m + self.ranks as usize
    }
}

impl Found {
    /// The answers as the host's [`SequenceScores`] of rows whose targets are `targets`: packed
    /// into one `[c, width]` f32 tensor on the device and copied back in one transfer (one
    /// synchronisation per chunk of rows instead of one per result).
    pub(super) fn into_host(
        self,
        targets: &[u32],
        k: usize,
    ) -> candle_core::Result<SequenceScores> {
        if !self.exact_in_f32 || targets.is_empty() {
            return self.into_host_each(targets, k);
        }
        let r = &self.rows;
        let c = targets.len();
        let shape = Packed {
            k,
            m: self.m,
            ranks: r.target_ranks.is_some(),
        };
        let column = |t: &Tensor| t.to_dtype(DType::F32)?.reshape((c, ())); // [c, w]
        let mut parts = Vec::with_capacity(6);
        if k > 0 {
            parts.extend([column(&r.ids)?, column(&r.values)?]);
        }
        parts.extend([column(&r.target_logprobs)?, column(&r.logsumexp)?]);
        if let Some(t) = &r.ids_logprobs {
            parts.push(column(t)?);
        }
        if let Some(t) = &r.target_ranks {
            parts.push(column(t)?);
        }
        let host: Vec<f32> = Tensor::cat(&parts, 1)?.flatten_all()?.to_vec1()?; // [c * width]
        let mut s = SequenceScores {
            rows: c,
            k,
            m: self.m,
            ..SequenceScores::default()
        };
        for row in host.chunks_exact(shape.width().max(1)).take(c) {
            let (ids, rest) = row.split_at(k);
            let (values, rest) = rest.split_at(k);
            s.topk_ids.extend(ids.iter().map(|&x| x as u32));
            s.topk_values.extend_from_slice(values);
            s.target_logprobs.push(rest[0]);
            s.logsumexp.push(rest[1]);
            s.ids_logprobs.extend_from_slice(&rest[2..2 + shape.m]);
            if shape.ranks {
                s.target_ranks.push(rest[2 + shape.m] as u32);
            }
        }
        rank_within_topk(&mut s, targets, k);
        Ok(s)
    }

    /// [`Found::into_host`] one result at a time (ids or ranks too large for f32).
    fn into_host_each(self, targets: &[u32], k: usize) -> candle_core::Result<SequenceScores> {
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
        rank_within_topk(&mut s, targets, k);
        Ok(s)
    }
}

/// A target inside the top k is ranked by its position there (as on the host path); the
/// device count ranks ties last, which differs only for tied values.
fn rank_within_topk(s: &mut SequenceScores, targets: &[u32], k: usize) {
    for (row, &t) in targets.iter().enumerate().take(s.target_ranks.len()) {
        if let Some(j) = s.topk_ids[row * k..(row + 1) * k]
            .iter()
            .position(|&id| id == t)
        {
            s.target_ranks[row] = j as u32 + 1;
        }
    }
}

/// The device sort keeps 2k candidates per chunk of [`xdistill_shared::topk::SORT_CHUNK`] columns;
/// larger k (only with a raised `--max-k`) goes to the host path.
pub fn device_topk_fits(k: usize) -> bool {
    2 * k <= xdistill_shared::topk::SORT_CHUNK
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use xdistill_shared::protocol::ValuesKind;

    /// The one packed copy back gives exactly what copying each result on its own gives, for
    /// every combination of k (0 included), candidate ids and ranks.
    #[test]
    fn one_packed_copy_equals_a_copy_per_result() {
        let (c, v, valid) = (5usize, 300usize, 290usize);
        let data: Vec<f32> = (0..c * v)
            .map(|i| ((i * 7919 % 1009) as f32 / 1009.0 - 0.5) * 9.0)
            .collect();
        let logits = Tensor::from_vec(data, (c, v), &Device::Cpu).unwrap();
        let targets: Vec<u32> = (0..c).map(|r| (r * 53 % valid) as u32).collect();
        let cand_ids: Vec<u32> = (0..c * 3).map(|i| (i * 101 % valid) as u32).collect();
        for k in [0usize, 1, 7] {
            for m in [0usize, 3] {
                for ranks in [false, true] {
                    let p = ScoreParams {
                        ranks,
                        ..ScoreParams::native(k, 0.9, ValuesKind::Logprobs)
                    };
                    let cands = CandidateRows {
                        ids: if m == 0 { &[] } else { &cand_ids },
                        m,
                    };
                    let found = || topk_on_device(&logits, &targets, cands, &p, valid).unwrap();
                    let packed = found().into_host(&targets, k).unwrap();
                    let each = found().into_host_each(&targets, k).unwrap();
                    assert_eq!(packed.bits(), each.bits(), "k {k} m {m} ranks {ranks}");
                    assert_eq!(packed.target_ranks, each.target_ranks, "k {k} m {m}");
                    assert_eq!(
                        (packed.target_ranks.len(), packed.ids_logprobs.len()),
                        (if ranks { c } else { 0 }, c * m),
                        "k {k} m {m} ranks {ranks}"
                    );
                }
            }
        }
    }
}
