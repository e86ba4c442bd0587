//! Dense, padded alignment tensors for a batch (a superset of NeMo RL's `AlignmentBatch`), and
//! the shifted view the loss needs (logits at position t predict token t + 1).

use super::chunks::{Chunk, ChunkKind};
use super::AlignError;

/// The chunk tensors of a batch, row-major. B = batch, Ts/Tt = padded student/teacher length,
/// P = the most chunks of any row. −1 / `false` / 0 mark padding.
#[derive(Debug, Clone, PartialEq)]
pub struct AlignmentBatch {
    pub batch_size: usize,
    pub student_len: usize,
    pub teacher_len: usize,
    pub max_chunks: usize,
    /// `[B, Ts]` chunk of each student token; −1 for padding and masked specials.
    pub student_chunk_id: Vec<i32>,
    /// `[B, Tt]`.
    pub teacher_chunk_id: Vec<i32>,
    /// `[B, Ts]` the token forms a one-to-one chunk (NeMo `student_exact_partition_mask`).
    pub student_exact_1to1: Vec<bool>,
    /// `[B, Tt]` (NeMo `teacher_exact_partition_mask`).
    pub teacher_exact_1to1: Vec<bool>,
    /// `[B]`.
    pub num_chunks: Vec<u32>,
    /// `[B, P]` the chunk exists (NeMo `pair_valid`; exact alignment makes every valid chunk
    /// correct, so it is also NeMo's `pair_is_correct`).
    pub chunk_valid: Vec<bool>,
    /// `[B, P]` one token on each side.
    pub chunk_is_1to1: Vec<bool>,
    /// `[B, P]` a special-token pair (BOS↔BOS, EOS↔EOS).
    pub chunk_is_special: Vec<bool>,
    /// `[B, P]` half-open token ranges of each chunk.
    pub chunk_student_start: Vec<u32>,
    pub chunk_student_end: Vec<u32>,
    pub chunk_teacher_start: Vec<u32>,
    pub chunk_teacher_end: Vec<u32>,
    /// `[B, P]` byte span of each chunk in its text, for inspection.
    pub chunk_byte_start: Vec<u32>,
    pub chunk_byte_end: Vec<u32>,
    pub shifted: ShiftedAlignment,
}

/// The same chunks indexed by the logit position that predicts each token: position t holds
/// what token t + 1 had, the last position −1. A chunk whose first token (on either side) is at
/// position 0 has no logit predicting that token; it is invalid here and all its positions −1.
#[derive(Debug, Clone, PartialEq)]
pub struct ShiftedAlignment {
    /// `[B, Ts]`.
    pub student_chunk_id: Vec<i32>,
    /// `[B, Tt]`.
    pub teacher_chunk_id: Vec<i32>,
    /// `[B, Ts]`.
    pub student_exact_1to1: Vec<bool>,
    /// `[B, Tt]`.
    pub teacher_exact_1to1: Vec<bool>,
    /// `[B, P]` every token of the chunk is predicted by some position on both sides.
    pub chunk_valid: Vec<bool>,
}

fn check_row(b: usize, chunks: &[Chunk], s_len: usize, t_len: usize) -> Result<(), AlignError> {
    let (mut s_prev, mut t_prev) = (0usize, 0usize);
    for (c, ch) in chunks.iter().enumerate() {
        let ok = !ch.student.is_empty()
            && !ch.teacher.is_empty()
            && ch.student.start >= s_prev
            && ch.teacher.start >= t_prev
            && ch.student.end <= s_len
            && ch.teacher.end <= t_len;
        if !ok {
            return Err(AlignError::Batch(format!(
                "row {b} chunk {c}: tokens {:?}/{:?} are empty, out of order or beyond the \
                 lengths {s_len}/{t_len}",
                ch.student, ch.teacher
            )));
        }
        s_prev = ch.student.end;
        t_prev = ch.teacher.end;
    }
    Ok(())
}

/// `dst[t] = src[t + 1]` per row of length `len`, `fill` at the last position.
fn shift_rows<T: Copy>(src: &[T], len: usize, fill: T) -> Vec<T> {
    let mut out = vec![fill; src.len()];
    for (o, s) in out.chunks_mut(len.max(1)).zip(src.chunks(len.max(1))) {
        if len > 0 {
            o[..len - 1].copy_from_slice(&s[1..]);
        }
    }
    out
}

impl AlignmentBatch {
    /// Builds the dense tensors from each row's chunks and unpadded student/teacher lengths.
    /// Rows are right-padded to `pad_to_s` / `pad_to_t` tokens.
    pub fn new(
        rows: &[(Vec<Chunk>, usize, usize)],
        pad_to_s: usize,
        pad_to_t: usize,
    ) -> Result<AlignmentBatch, AlignError> {
        let b_n = rows.len();
        let p = rows.iter().map(|r| r.0.len()).max().unwrap_or(0);
        for (b, (chunks, s_len, t_len)) in rows.iter().enumerate() {
            if *s_len > pad_to_s || *t_len > pad_to_t {
                return Err(AlignError::Batch(format!(
                    "row {b}: lengths {s_len}/{t_len} exceed the padded lengths {pad_to_s}/{pad_to_t}"
                )));
            }
            check_row(b, chunks, *s_len, *t_len)?;
        }
        let (ts, tt) = (pad_to_s, pad_to_t);
        let mut out = AlignmentBatch {
            batch_size: b_n,
            student_len: ts,
            teacher_len: tt,
            max_chunks: p,
            student_chunk_id: vec![-1; b_n * ts],
            teacher_chunk_id: vec![-1; b_n * tt],
            student_exact_1to1: vec![false; b_n * ts],
            teacher_exact_1to1: vec![false; b_n * tt],
            num_chunks: vec![0; b_n],
            chunk_valid: vec![false; b_n * p],
            chunk_is_1to1: vec![false; b_n * p],
            chunk_is_special: vec![false; b_n * p],
            chunk_student_start: vec![0; b_n * p],
            chunk_student_end: vec![0; b_n * p],
            chunk_teacher_start: vec![0; b_n * p],
            chunk_teacher_end: vec![0; b_n * p],
            chunk_byte_start: vec![0; b_n * p],
            chunk_byte_end: vec![0; b_n * p],
            shifted: ShiftedAlignment {
                student_chunk_id: Vec::new(),
                teacher_chunk_id: Vec::new(),
                student_exact_1to1: Vec::new(),
                teacher_exact_1to1: Vec::new(),
                chunk_valid: vec![false; b_n * p],
            },
        };
        for (b, (chunks, _, _)) in rows.iter().enumerate() {
            out.num_chunks[b] = chunks.len() as u32;
            for (c, ch) in chunks.iter().enumerate() {
                let one = ch.is_one_to_one();
                for t in ch.student.clone() {
                    out.student_chunk_id[b * ts + t] = c as i32;
                    out.student_exact_1to1[b * ts + t] = one;
                }
                for t in ch.teacher.clone() {
                    out.teacher_chunk_id[b * tt + t] = c as i32;
                    out.teacher_exact_1to1[b * tt + t] = one;
                }
                let k = b * p + c;
                out.chunk_valid[k] = true;
                out.chunk_is_1to1[k] = one;
                out.chunk_is_special[k] = ch.kind == ChunkKind::Special;
                out.chunk_student_start[k] = ch.student.start as u32;
                out.chunk_student_end[k] = ch.student.end as u32;
                out.chunk_teacher_start[k] = ch.teacher.start as u32;
                out.chunk_teacher_end[k] = ch.teacher.end as u32;
                out.chunk_byte_start[k] = ch.bytes.start as u32;
                out.chunk_byte_end[k] = ch.bytes.end as u32;
                out.shifted.chunk_valid[k] = ch.student.start >= 1 && ch.teacher.start >= 1;
            }
        }
        // Shifted view: position t carries token t + 1; chunks missing their first prediction
        // are dropped entirely so a loss over chunk ids never sees half a chunk.
        let drop_invalid = |ids: &mut [i32], ex: &mut [bool], len: usize, valid: &[bool]| {
            for (row, (ids, ex)) in ids
                .chunks_mut(len.max(1))
                .zip(ex.chunks_mut(len.max(1)))
                .enumerate()
            {
                for (id, e) in ids.iter_mut().zip(ex.iter_mut()) {
                    if *id >= 0 && !valid[row * p + *id as usize] {
                        *id = -1;
                        *e = false;
                    }
                }
            }
        };
        let mut s_ids = shift_rows(&out.student_chunk_id, ts, -1);
        let mut s_ex = shift_rows(&out.student_exact_1to1, ts, false);
        let mut t_ids = shift_rows(&out.teacher_chunk_id, tt, -1);
        let mut t_ex = shift_rows(&out.teacher_exact_1to1, tt, false);
        drop_invalid(&mut s_ids, &mut s_ex, ts, &out.shifted.chunk_valid);
        drop_invalid(&mut t_ids, &mut t_ex, tt, &out.shifted.chunk_valid);
        out.shifted.student_chunk_id = s_ids;
        out.shifted.student_exact_1to1 = s_ex;
        out.shifted.teacher_chunk_id = t_ids;
        out.shifted.teacher_exact_1to1 = t_ex;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(s: std::ops::Range<usize>, t: std::ops::Range<usize>, kind: ChunkKind) -> Chunk {
        Chunk {
            student: s,
            teacher: t,
            bytes: 0..0,
            kind,
        }
    }

    #[test]
    fn dense_fields_match_a_naive_lookup() {
        // Row 0: [BOS↔BOS] [s1..3 ↔ t1] [s3 ↔ t2..4]; row 1: one 1:1 chunk, student BOS masked.
        let rows = vec![
            (
                vec![
                    chunk(0..1, 0..1, ChunkKind::Special),
                    chunk(1..3, 1..2, ChunkKind::Text),
                    chunk(3..4, 2..4, ChunkKind::Text),
                ],
                4,
                4,
            ),
            (vec![chunk(1..2, 0..1, ChunkKind::Text)], 2, 1),
        ];
        let b = AlignmentBatch::new(&rows, 5, 6).unwrap();
        assert_eq!(
            (b.batch_size, b.student_len, b.teacher_len, b.max_chunks),
            (2, 5, 6, 3)
        );
        // Reference: for every position, search the chunk lists directly.
        for (r, (chunks, _, _)) in rows.iter().enumerate() {
            for t in 0..5 {
                let want = chunks.iter().position(|c| c.student.contains(&t));
                assert_eq!(b.student_chunk_id[r * 5 + t], want.map_or(-1, |c| c as i32));
                let one = want
                    .is_some_and(|c| chunks[c].student.len() == 1 && chunks[c].teacher.len() == 1);
                assert_eq!(b.student_exact_1to1[r * 5 + t], one);
                // Shifted: position t holds token t + 1 if its chunk starts after 0 on both sides.
                let sh = chunks
                    .iter()
                    .position(|c| c.student.contains(&(t + 1)))
                    .filter(|&c| chunks[c].student.start > 0 && chunks[c].teacher.start > 0);
                assert_eq!(
                    b.shifted.student_chunk_id[r * 5 + t],
                    sh.map_or(-1, |c| c as i32)
                );
            }
            for t in 0..6 {
                let want = chunks.iter().position(|c| c.teacher.contains(&t));
                assert_eq!(b.teacher_chunk_id[r * 6 + t], want.map_or(-1, |c| c as i32));
            }
        }
        assert_eq!(b.num_chunks, vec![3, 1]);
        assert_eq!(b.chunk_valid, vec![true, true, true, true, false, false]);
        assert_eq!(
            b.chunk_is_special,
            vec![true, false, false, false, false, false]
        );
        assert_eq!(
            b.shifted.chunk_valid,
            vec![false, true, true, false, false, false]
        );
        assert_eq!(b.chunk_teacher_end[2], 4);
    }

    #[test]
    fn rejects_bad_rows() {
        let over = vec![(vec![chunk(0..3, 0..1, ChunkKind::Text)], 3, 1)];
        assert!(AlignmentBatch::new(&over, 2, 4).is_err());
        let beyond = vec![(vec![chunk(0..3, 0..2, ChunkKind::Text)], 3, 1)];
        assert!(AlignmentBatch::new(&beyond, 4, 4).is_err());
        let unordered = vec![(
            vec![
                chunk(1..2, 1..2, ChunkKind::Text),
                chunk(0..1, 0..1, ChunkKind::Text),
            ],
            2,
            2,
        )];
        assert!(AlignmentBatch::new(&unordered, 4, 4).is_err());
        let empty = AlignmentBatch::new(&[], 4, 4).unwrap();
        assert_eq!(empty.max_chunks, 0);
    }
}
