//! The alignment walk: cumulative byte lengths on both sides, a chunk closes whenever they are
//! equal. Linear in the number of tokens; allocates only the output.

use std::ops::Range;

use super::token_bytes::{Piece, TokenBytes};
use super::{AlignError, Side};

/// What a chunk pairs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ChunkKind {
    /// Runs of tokens spelling the same bytes.
    Text,
    /// One special token on each side at the same text position (BOS↔BOS, EOS↔EOS, ...): a unit.
    Special,
}

/// The smallest pair of token runs covering the same bytes of the text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    /// Student token indices, half-open, never empty.
    pub student: Range<usize>,
    /// Teacher token indices, half-open, never empty.
    pub teacher: Range<usize>,
    /// Byte span in the (canonical) text; empty for `Special` chunks.
    pub bytes: Range<usize>,
    pub kind: ChunkKind,
}

impl Chunk {
    /// One token on each side.
    pub fn is_one_to_one(&self) -> bool {
        self.student.len() == 1 && self.teacher.len() == 1
    }
}

/// One side of the walk.
struct Seq<'a> {
    ids: &'a [u32],
    tb: &'a TokenBytes,
    side: Side,
    /// Per token: whether a special token stands for text characters (known from the text);
    /// `None` when only ids are known (then decided against the other side's bytes).
    textual: Option<&'a [bool]>,
}

impl<'a> Seq<'a> {
    /// The known text/unit role of special token `k`, if the text was given.
    #[inline]
    fn known_textual(&self, k: usize) -> Option<bool> {
        self.textual.and_then(|f| f.get(k).copied())
    }

    #[inline]
    fn get(&self, k: usize) -> Result<Option<Piece<'a>>, AlignError> {
        if k >= self.ids.len() {
            return Ok(None);
        }
        self.tb
            .piece(self.ids, k)
            .map(Some)
            .ok_or(AlignError::UnknownId {
                side: self.side,
                index: k,
                id: self.ids[k],
            })
    }

    /// Contents of the run of special tokens starting at `k`.
    fn special_run(&self, k: usize) -> impl Iterator<Item = &'a [u8]> + '_ {
        (k..self.ids.len()).map_while(move |i| match self.tb.piece(self.ids, i) {
            Some(Piece::Special(c)) => Some(c),
            _ => None,
        })
    }

    /// Bytes of the text tokens from `k` on, up to the next special token.
    fn text_from(&self, k: usize) -> impl Iterator<Item = &'a [u8]> + '_ {
        (k..self.ids.len()).map_while(move |i| match self.tb.piece(self.ids, i) {
            Some(Piece::Text(b)) => Some(b),
            _ => None,
        })
    }

    /// Index of the first non-special token at or after `k`.
    fn skip_specials(&self, mut k: usize) -> usize {
        while k < self.ids.len() && self.tb.is_special(self.ids[k]) {
            k += 1;
        }
        k
    }

    /// Iterator over the bytes of tokens `r` (specials contribute their content).
    fn bytes_of(&self, r: Range<usize>) -> impl Iterator<Item = &'a [u8]> + '_ {
        r.filter_map(move |k| self.tb.piece(self.ids, k).map(Piece::bytes))
    }
}

/// Whether two sequences of byte slices concatenate to the same bytes, without allocating.
fn concat_eq<'x>(
    mut a: impl Iterator<Item = &'x [u8]>,
    mut b: impl Iterator<Item = &'x [u8]>,
) -> bool {
    let (mut x, mut y): (&[u8], &[u8]) = (&[], &[]);
    loop {
        while x.is_empty() {
            match a.next() {
                Some(s) => x = s,
                None => break,
            }
        }
        while y.is_empty() {
            match b.next() {
                Some(s) => y = s,
                None => break,
            }
        }
        match (x.is_empty(), y.is_empty()) {
            (true, true) => return true,
            (true, false) | (false, true) => return false,
            _ => {}
        }
        let n = x.len().min(y.len());
        if x[..n] != y[..n] {
            return false;
        }
        x = &x[n..];
        y = &y[n..];
    }
}

fn special_chunk(i: usize, j: usize, pos: usize) -> Chunk {
    Chunk {
        student: i..i + 1,
        teacher: j..j + 1,
        bytes: pos..pos,
        kind: ChunkKind::Special,
    }
}

/// Whether the concatenation of `pat` is a non-empty prefix of the concatenation of `text`.
fn is_prefix<'x>(
    pat: impl Iterator<Item = &'x [u8]>,
    mut text: impl Iterator<Item = &'x [u8]>,
) -> bool {
    let mut y: &[u8] = &[];
    let mut any = false;
    for mut x in pat {
        while !x.is_empty() {
            any = true;
            while y.is_empty() {
                match text.next() {
                    Some(s) => y = s,
                    None => return false,
                }
            }
            let n = x.len().min(y.len());
            if x[..n] != y[..n] {
                return false;
            }
            x = &x[n..];
            y = &y[n..];
        }
    }
    any
}

/// Splits two tokenizations of the same text into chunks (in order, covering both sides).
///
/// Text tokens are walked on cumulative byte lengths: the side that is behind advances, and a
/// chunk closes when both totals are equal, so no token straddles a chunk boundary (a
/// multi-byte character split across tokens simply stays inside one chunk). Each chunk's bytes
/// are compared on both sides; any difference is an error, never a silent misalignment.
///
/// Special tokens (see `docs/alignment.md`): at a chunk boundary, specials on both sides with the
/// same content pair 1:1; a special whose content the other side spells as text is read as
/// text; a special facing a special with different content pairs 1:1 with it (BOS↔BOS), unless
/// one of them is spelled as text just after the other side's specials (then the other is
/// masked); any other special is masked (it belongs to no chunk).
///
/// Zero-byte text tokens join the chunk that follows them (or, at the very end, the last one).
pub fn align(
    student_ids: &[u32],
    teacher_ids: &[u32],
    student_bytes: &TokenBytes,
    teacher_bytes: &TokenBytes,
) -> Result<Vec<Chunk>, AlignError> {
    align_inner(
        Seq {
            ids: student_ids,
            tb: student_bytes,
            side: Side::Student,
            textual: None,
        },
        Seq {
            ids: teacher_ids,
            tb: teacher_bytes,
            side: Side::Teacher,
            textual: None,
        },
    )
}

/// Like [`align`], with each side's special tokens already known to be text or units (from
/// [`textual_specials`] on the text both sides tokenized): exact even when special-token strings
/// are typed in the text next to inserted BOS/EOS tokens.
pub fn align_known(
    student_ids: &[u32],
    teacher_ids: &[u32],
    student_bytes: &TokenBytes,
    teacher_bytes: &TokenBytes,
    student_textual: &[bool],
    teacher_textual: &[bool],
) -> Result<Vec<Chunk>, AlignError> {
    if student_textual.len() != student_ids.len() || teacher_textual.len() != teacher_ids.len() {
        return Err(AlignError::Batch(
            "textual flags and ids differ in length".into(),
        ));
    }
    align_inner(
        Seq {
            ids: student_ids,
            tb: student_bytes,
            side: Side::Student,
            textual: Some(student_textual),
        },
        Seq {
            ids: teacher_ids,
            tb: teacher_bytes,
            side: Side::Teacher,
            textual: Some(teacher_textual),
        },
    )
}

/// For each token of `ids` (which must spell `text`): whether it is a special token that stands
/// for characters of the text (typed "<|im_start|>") rather than one the tokenizer inserted
/// (BOS/EOS). A special is text when the text here spells it; of several identical specials in
/// a row with fewer copies in the text, the first ones count as inserted (BOS before `<s>`).
/// Errors name the first byte where the tokens stop spelling the text.
pub fn textual_specials(
    ids: &[u32],
    tb: &TokenBytes,
    text: &[u8],
    side: Side,
) -> Result<Vec<bool>, AlignError> {
    let seq = Seq {
        ids,
        tb,
        side,
        textual: None,
    };
    let mut flags = vec![false; ids.len()];
    let mut at = 0usize;
    for (k, flag) in flags.iter_mut().enumerate() {
        match seq.get(k)? {
            None => break,
            Some(Piece::Special(c)) => {
                // m identical specials in a row need m copies of their content in the text to
                // all be text; with fewer, the first ones were inserted (BOS before "<s>").
                let m = seq.special_run(k).take_while(|d| *d == c).count();
                let mut r = 0;
                while r < m && text[at + r * c.len()..].starts_with(c) {
                    r += 1;
                }
                if !c.is_empty() && r == m {
                    *flag = true;
                    at += c.len();
                }
            }
            Some(Piece::Text(b)) => {
                let rest = &text[at..];
                if !rest.starts_with(b) {
                    let d = (0..b.len().min(rest.len()))
                        .find(|&x| b[x] != rest[x])
                        .unwrap_or(b.len().min(rest.len()));
                    return Err(AlignError::TextMismatch { side, at: at + d });
                }
                at += b.len();
            }
        }
    }
    if at != text.len() {
        return Err(AlignError::TextMismatch { side, at });
    }
    Ok(flags)
}

fn align_inner(s: Seq<'_>, t: Seq<'_>) -> Result<Vec<Chunk>, AlignError> {
    let (student_ids, teacher_ids) = (s.ids, t.ids);
    let mut chunks = Vec::with_capacity(student_ids.len().min(teacher_ids.len()) + 2);
    let (mut i, mut j, mut pos) = (0usize, 0usize, 0usize);
    loop {
        // 1. At a chunk boundary: decide what to do with special tokens.
        let (a, b) = (s.get(i)?, t.get(j)?);
        match (a, b) {
            (None, None) => break,
            (Some(Piece::Special(x)), Some(Piece::Special(y))) => {
                match (s.known_textual(i), t.known_textual(j)) {
                    (Some(false), Some(true)) => {
                        i += 1;
                        continue;
                    }
                    (Some(true), Some(false)) => {
                        j += 1;
                        continue;
                    }
                    (Some(true), Some(true)) => {}
                    (Some(false), Some(false)) => {
                        chunks.push(special_chunk(i, j, pos));
                        i += 1;
                        j += 1;
                        continue;
                    }
                    _ => {
                        if x != y {
                            // A special run that the other side spells as text (after its own
                            // specials) is text; the other side's special facing it has no
                            // counterpart.
                            if is_prefix(s.special_run(i), t.text_from(t.skip_specials(j))) {
                                j += 1;
                                continue;
                            }
                            if is_prefix(t.special_run(j), s.text_from(s.skip_specials(i))) {
                                i += 1;
                                continue;
                            }
                        }
                        chunks.push(special_chunk(i, j, pos));
                        i += 1;
                        j += 1;
                        continue;
                    }
                }
            }
            // A special is read as text when the other side spells it, and every special after
            // it in its run, as text here (so an inserted BOS before a typed "<s>" is masked).
            (Some(Piece::Special(_)), Some(Piece::Text(_))) => {
                let textual = s
                    .known_textual(i)
                    .unwrap_or_else(|| is_prefix(s.special_run(i), t.text_from(j)));
                if !textual {
                    i += 1;
                    continue;
                }
            }
            (Some(Piece::Text(_)), Some(Piece::Special(_))) => {
                let textual = t
                    .known_textual(j)
                    .unwrap_or_else(|| is_prefix(t.special_run(j), s.text_from(i)));
                if !textual {
                    j += 1;
                    continue;
                }
            }
            (Some(Piece::Special(_)), None) => {
                i += 1;
                continue;
            }
            (None, Some(Piece::Special(_))) => {
                j += 1;
                continue;
            }
            (Some(Piece::Text(x)), None) | (None, Some(Piece::Text(x))) => {
                let on_student = a.is_some();
                let last_end = chunks.last().map(|c: &Chunk| {
                    if on_student {
                        c.student.end
                    } else {
                        c.teacher.end
                    }
                });
                let k = if on_student { i } else { j };
                if x.is_empty() && last_end == Some(k) {
                    if let Some(c) = chunks.last_mut() {
                        if on_student {
                            c.student.end += 1;
                            i += 1;
                        } else {
                            c.teacher.end += 1;
                            j += 1;
                        }
                    }
                    continue;
                }
                return Err(AlignError::LengthMismatch {
                    shorter: if on_student {
                        Side::Teacher
                    } else {
                        Side::Student
                    },
                    at: pos,
                });
            }
            (Some(Piece::Text(_)), Some(Piece::Text(_))) => {}
        }
        // 2. A text chunk: take one token from each side, then advance whichever is behind.
        let (i0, j0) = (i, j);
        let mut cs = a.map_or(0, |p| p.bytes().len());
        let mut ct = b.map_or(0, |p| p.bytes().len());
        i += 1;
        j += 1;
        while cs != ct {
            if cs < ct {
                match s.get(i)? {
                    Some(p) => cs += p.bytes().len(),
                    None => {
                        return Err(AlignError::LengthMismatch {
                            shorter: Side::Student,
                            at: pos + cs,
                        })
                    }
                }
                i += 1;
            } else {
                match t.get(j)? {
                    Some(p) => ct += p.bytes().len(),
                    None => {
                        return Err(AlignError::LengthMismatch {
                            shorter: Side::Teacher,
                            at: pos + ct,
                        })
                    }
                }
                j += 1;
            }
        }
        // 3. Equal lengths are not enough: the bytes must be the same.
        if !concat_eq(s.bytes_of(i0..i), t.bytes_of(j0..j)) {
            return Err(AlignError::ByteMismatch {
                at: pos,
                student_start: i0,
                student_end: i,
                teacher_start: j0,
                teacher_end: j,
            });
        }
        chunks.push(Chunk {
            student: i0..i,
            teacher: j0..j,
            bytes: pos..pos + cs,
            kind: ChunkKind::Text,
        });
        pos += cs;
    }
    Ok(chunks)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::align::token_bytes::{DummyPrefix, TokenizerKind};

    /// A vocabulary of the given strings; names starting with `<|` are special.
    fn vocab(words: &[&str]) -> TokenBytes {
        let entries: Vec<(&[u8], bool)> = words
            .iter()
            .map(|w| (w.as_bytes(), w.starts_with("<|")))
            .collect();
        TokenBytes::from_entries(TokenizerKind::ByteLevel, DummyPrefix::None, &entries)
    }

    fn ids(v: &[&str], words: &[&str]) -> Vec<u32> {
        words
            .iter()
            .map(|w| v.iter().position(|x| x == w).unwrap() as u32)
            .collect()
    }

    fn spans(c: &[Chunk]) -> Vec<(usize, usize, usize, usize)> {
        c.iter()
            .map(|c| {
                (
                    c.student.start,
                    c.student.end,
                    c.teacher.start,
                    c.teacher.end,
                )
            })
            .collect()
    }

    const V: &[&str] = &[
        "Hel", "lo", "Hello", " wor", "ld", " world", "!", "", "<|bos|>", "<|eos|>", "<|im|>", "<",
        "|im|>", "\u{e9}", "\u{c3}", "\u{a9}",
    ];

    #[test]
    fn chunks_close_at_common_boundaries() {
        let tb = vocab(V);
        let s = ids(V, &["Hel", "lo", " world", "!"]);
        let t = ids(V, &["Hello", " wor", "ld", "!"]);
        let c = align(&s, &t, &tb, &tb).unwrap();
        assert_eq!(spans(&c), vec![(0, 2, 0, 1), (2, 3, 1, 3), (3, 4, 3, 4)]);
        assert_eq!(c[1].bytes, 5..11);
        assert!(c[2].is_one_to_one());
    }

    #[test]
    fn split_multibyte_character_stays_in_one_chunk() {
        // 'é' is C3 A9: one side has it whole, the other as two byte tokens.
        let tb = vocab(V);
        let s = ids(V, &["\u{e9}", "!"]);
        let t = TokenBytes::from_entries(
            TokenizerKind::ByteLevel,
            DummyPrefix::None,
            &[(&[0xC3], false), (&[0xA9], false), (b"!", false)],
        );
        let c = align(&s, &[0, 1, 2], &tb, &t).unwrap();
        assert_eq!(spans(&c), vec![(0, 1, 0, 2), (1, 2, 2, 3)]);
    }

    #[test]
    fn specials_pair_mask_or_read_as_text() {
        let tb = vocab(V);
        // BOS on both sides pairs; EOS only on the student is masked.
        let s = ids(V, &["<|bos|>", "Hello", "<|eos|>"]);
        let t = ids(V, &["<|eos|>", "Hel", "lo"]);
        let c = align(&s, &t, &tb, &tb).unwrap();
        assert_eq!(spans(&c), vec![(0, 1, 0, 1), (1, 2, 1, 3)]);
        assert_eq!(c[0].kind, ChunkKind::Special);
        // A special the other side spells as text becomes a text chunk; the teacher's BOS, which
        // faces it, is masked.
        let s = ids(V, &["<|im|>", "Hello"]);
        let t = ids(V, &["<|bos|>", "<", "|im|>", "Hel", "lo"]);
        let c = align(&s, &t, &tb, &tb).unwrap();
        assert_eq!(spans(&c), vec![(0, 1, 1, 3), (1, 2, 3, 5)]);
        assert_eq!(c[0].kind, ChunkKind::Text);
        assert_eq!(c[0].bytes, 0..6);
    }

    #[test]
    fn zero_byte_tokens_join_a_neighbouring_chunk() {
        let tb = vocab(V);
        let s = ids(V, &["", "Hello", ""]);
        let t = ids(V, &["Hello"]);
        let c = align(&s, &t, &tb, &tb).unwrap();
        assert_eq!(spans(&c), vec![(0, 3, 0, 1)]);
    }

    #[test]
    fn mismatches_are_errors() {
        let tb = vocab(V);
        let r = align(&ids(V, &["Hello"]), &ids(V, &["Hel"]), &tb, &tb);
        assert!(matches!(
            r,
            Err(AlignError::LengthMismatch {
                shorter: Side::Teacher,
                at: 3
            })
        ));
        let r = align(&ids(V, &["Hello", "!"]), &ids(V, &["Hel", "ld"]), &tb, &tb);
        assert!(matches!(r, Err(AlignError::ByteMismatch { at: 0, .. })));
        let r = align(&[99], &ids(V, &["Hel"]), &tb, &tb);
        assert!(matches!(
            r,
            Err(AlignError::UnknownId {
                side: Side::Student,
                index: 0,
                id: 99
            })
        ));
        assert_eq!(align(&[], &[], &tb, &tb).unwrap(), vec![]);
    }

    #[test]
    fn concat_eq_ignores_slice_boundaries() {
        let a: [&[u8]; 3] = [b"ab", b"", b"cd"];
        let b: [&[u8]; 2] = [b"a", b"bcd"];
        assert!(concat_eq(a.iter().copied(), b.iter().copied()));
        assert!(!concat_eq(
            a.iter().copied(),
            [b"abc" as &[u8]].iter().copied()
        ));
        assert!(!concat_eq(
            a.iter().copied(),
            [b"abce" as &[u8]].iter().copied()
        ));
    }
}
