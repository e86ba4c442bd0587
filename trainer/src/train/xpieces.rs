//! A cross-tokenizer micro-batch cut into head chunks at alignment-chunk boundaries.
//!
//! The cross-tokenizer losses are sums over aligned chunks, each reading only its own student
//! and teacher positions, so a piece of the batch that holds every position of its chunks has
//! the loss of those chunks exactly. Whole rows are grouped while they fit the row budget; a
//! row longer than the budget is cut between chunks (never inside one: a chunk longer than the
//! budget stays whole). Each piece gets its own [`XTokenBatch`] with the chunk ids renumbered.

use crate::loss::XTokenBatch;
use std::ops::Range;

/// A stretch of one batch row: the student positions `student` and teacher positions
/// `teacher` (shifted view) that hold the chunks `chunks` (the row's ids) whole.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    pub row: usize,
    pub student: Range<usize>,
    pub teacher: Range<usize>,
    pub chunks: Range<i64>,
}

/// Segments that run the head together, as `[segments, student_len]` logits (every segment
/// of a piece has `student_len` positions).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XPiece {
    pub segments: Vec<Segment>,
    pub student_len: usize,
    pub teacher_len: usize,
}

impl XPiece {
    /// The flat `[B·Ts]` indices of the piece's student positions, row-major.
    pub fn rows(&self, ts: usize) -> Vec<u32> {
        self.segments
            .iter()
            .flat_map(|s| (s.student.clone()).map(move |p| (s.row * ts + p) as u32))
            .collect()
    }
}

/// Per chunk id of one row, the first and last student and teacher positions (`None`: no
/// position on that side).
struct Extents {
    student: Vec<Option<(usize, usize)>>,
    teacher: Vec<Option<(usize, usize)>>,
}

fn extend(e: &mut Option<(usize, usize)>, p: usize) {
    *e = Some(match *e {
        Some((a, b)) => (a.min(p), b.max(p)),
        None => (p, p),
    });
}

impl Extents {
    fn of(x: &XTokenBatch, row: usize) -> Extents {
        let n = x.num_chunks.get(row).copied().unwrap_or(0);
        let (ts, tt) = (x.student_len, x.teacher_len);
        let mut e = Extents {
            student: vec![None; n],
            teacher: vec![None; n],
        };
        for (side, ids, len) in [
            (&mut e.student, &x.student_chunk, ts),
            (&mut e.teacher, &x.teacher_chunk, tt),
        ] {
            for (p, &c) in ids[row * len..(row + 1) * len].iter().enumerate() {
                if let Some(slot) = usize::try_from(c).ok().and_then(|c| side.get_mut(c)) {
                    extend(slot, p);
                }
            }
        }
        e
    }

    /// The segment of student positions `s` of `row`: the chunks whose first student position
    /// lies in it, and the teacher positions they cover.
    fn segment(&self, row: usize, s: Range<usize>) -> Segment {
        let mut chunks: Option<(i64, i64)> = None;
        let mut teacher: Option<(usize, usize)> = None;
        for (c, e) in self.student.iter().enumerate() {
            let Some((a, _)) = *e else { continue };
            if !s.contains(&a) {
                continue;
            }
            let c = c as i64;
            chunks = Some(chunks.map_or((c, c), |(lo, hi)| (lo.min(c), hi.max(c))));
            if let Some((ta, tb)) = self.teacher[c as usize] {
                teacher = Some(teacher.map_or((ta, tb), |(x, y)| (x.min(ta), y.max(tb))));
            }
        }
        Segment {
            row,
            student: s,
            teacher: teacher.map_or(0..0, |(a, b)| a..b + 1),
            chunks: chunks.map_or(0..0, |(lo, hi)| lo..hi + 1),
        }
    }
}

/// Cuts `x` into pieces of at most `max_rows` student positions (whole rows grouped when a row
/// fits, else each row cut between chunks). `wanted[b·Ts + p]`: whether position `p` of row `b`
/// needs its logits (a chunk or a cross-entropy target); pieces with none are left out.
pub fn plan(x: &XTokenBatch, max_rows: usize, wanted: &[bool]) -> Vec<XPiece> {
    let (b, ts, tt) = (x.batch, x.student_len, x.teacher_len);
    let max_rows = max_rows.max(1);
    let any = |row: usize, s: &Range<usize>| {
        s.clone()
            .any(|p| wanted.get(row * ts + p).copied().unwrap_or(false))
    };
    let mut out = Vec::new();
    if ts <= max_rows {
        let per = (max_rows / ts.max(1)).max(1);
        let rows: Vec<usize> = (0..b).filter(|&r| any(r, &(0..ts))).collect();
        for group in rows.chunks(per) {
            out.push(XPiece {
                segments: group
                    .iter()
                    .map(|&row| Segment {
                        row,
                        student: 0..ts,
                        teacher: 0..tt,
                        chunks: 0..x.num_chunks.get(row).copied().unwrap_or(0) as i64,
                    })
                    .collect(),
                student_len: ts,
                teacher_len: tt,
            });
        }
        return out;
    }
    for row in 0..b {
        let e = Extents::of(x, row);
        // A cut at s (between positions s − 1 and s) is allowed unless a chunk spans it.
        let mut blocked = vec![false; ts + 1];
        for &(a, z) in e.student.iter().flatten() {
            for cut in blocked.iter_mut().take(z + 1).skip(a + 1) {
                *cut = true;
            }
        }
        let mut s0 = 0;
        while s0 < ts {
            let limit = s0 + max_rows;
            let s1 = if limit >= ts {
                ts
            } else {
                (s0 + 1..=limit)
                    .rev()
                    .find(|&c| !blocked[c])
                    .or_else(|| (limit + 1..=ts).find(|&c| !blocked[c]))
                    .unwrap_or(ts)
            };
            if any(row, &(s0..s1)) {
                let seg = e.segment(row, s0..s1);
                out.push(XPiece {
                    student_len: s1 - s0,
                    teacher_len: seg.teacher.len().max(1),
                    segments: vec![seg],
                });
            }
            s0 = s1;
        }
    }
    out
}

/// The loss input of `piece`: its segments as rows, positions relative to each segment's
/// start, chunk ids relative to its first; positions of other segments' chunks are `−1`.
pub fn batch(x: &XTokenBatch, piece: &XPiece) -> XTokenBatch {
    let (nb, sl, tl, k) = (
        piece.segments.len(),
        piece.student_len,
        piece.teacher_len,
        x.k,
    );
    let (ts, tt) = (x.student_len, x.teacher_len);
    let mut o = XTokenBatch::empty(nb, sl, tl, k);
    let has = |v: &Vec<u32>| !v.is_empty();
    let (with_targets, with_topk) = (has(&x.student_targets), has(&x.teacher_topk_ids));
    for (i, seg) in piece.segments.iter().enumerate() {
        let lo = seg.chunks.start;
        let n = (seg.chunks.end - lo).max(0) as usize;
        o.num_chunks[i] = n;
        // The chunks of this segment: those with a student position in it.
        let mut member = vec![false; n];
        for p in seg.student.clone() {
            let c = x.student_chunk[seg.row * ts + p];
            if seg.chunks.contains(&c) {
                member[(c - lo) as usize] = true;
            }
        }
        let local = |c: i64| -> i64 {
            if seg.chunks.contains(&c) && member[(c - lo) as usize] {
                c - lo
            } else {
                -1
            }
        };
        for (j, p) in seg.student.clone().enumerate().take(sl) {
            let src = seg.row * ts + p;
            o.student_chunk[i * sl + j] = local(x.student_chunk[src]);
            if with_targets {
                o.student_targets[i * sl + j] = x.student_targets[src];
            }
        }
        for (j, p) in seg.teacher.clone().enumerate().take(tl) {
            let (src, dst) = (seg.row * tt + p, i * tl + j);
            o.teacher_chunk[dst] = local(x.teacher_chunk[src]);
            if !x.teacher_targets.is_empty() {
                o.teacher_targets[dst] = x.teacher_targets[src];
            }
            if !x.teacher_target_logprobs.is_empty() {
                o.teacher_target_logprobs[dst] = x.teacher_target_logprobs[src];
            }
            if with_topk {
                o.teacher_topk_ids[dst * k..(dst + 1) * k]
                    .copy_from_slice(&x.teacher_topk_ids[src * k..(src + 1) * k]);
                o.teacher_topk_logprobs[dst * k..(dst + 1) * k]
                    .copy_from_slice(&x.teacher_topk_logprobs[src * k..(src + 1) * k]);
            }
        }
    }
    o
}
