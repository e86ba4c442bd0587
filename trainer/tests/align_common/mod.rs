//! Shared by the alignment tests: the five real tokenizers (loaded once per test binary) and an
//! invariant checker that recomputes everything it can from the text itself.

#![allow(dead_code)]

use std::collections::BTreeSet;
use std::sync::OnceLock;
use xdistill_shared::paths::TOKENIZER_NAMES;
use xdistill_testkit::tokenizer_json;
use xdistill_trainer::align::{AlignTokenizer, ChunkKind, Piece, TokenizedPair};

/// `(name, tokenizer)` for qwen3, llama3, llama2, gemma3, deepseek_v3, loaded in parallel once.
pub fn tokenizers() -> &'static [(&'static str, AlignTokenizer)] {
    static TOKS: OnceLock<Vec<(&'static str, AlignTokenizer)>> = OnceLock::new();
    TOKS.get_or_init(|| {
        std::thread::scope(|s| {
            let handles: Vec<_> = TOKENIZER_NAMES
                .iter()
                .map(|&n| {
                    s.spawn(move || {
                        let t = AlignTokenizer::from_file(&tokenizer_json(n))
                            .unwrap_or_else(|e| panic!("{n}: {e}"));
                        (n, t)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    })
}

pub fn get(name: &str) -> &'static AlignTokenizer {
    &tokenizers().iter().find(|(n, _)| *n == name).unwrap().1
}

/// Every ordered pair of distinct tokenizers (20).
pub fn pairs() -> Vec<(&'static str, &'static str)> {
    let names: Vec<&str> = tokenizers().iter().map(|(n, _)| *n).collect();
    let mut out = Vec::new();
    for &s in &names {
        for &t in &names {
            if s != t {
                out.push((s, t));
            }
        }
    }
    out
}

/// Checks a pair against the text it claims to spell:
/// - every token lies in exactly one chunk, except masked special tokens;
/// - chunks are in order, contiguous on the text, never empty on either side;
/// - the bytes of a chunk's student tokens equal its teacher tokens' and the text's bytes there;
/// - the chunks together give back the text;
/// - chunk boundaries are exactly the byte offsets where both sides have a token boundary
///   (reference: intersection of the two prefix-sum sets, computed naively).
pub fn check_pair(p: &TokenizedPair, s: &AlignTokenizer, t: &AlignTokenizer, ctx: &str) {
    let text = p.text.as_bytes();
    let sides = [
        (&p.student_ids, &s.bytes, true),
        (&p.teacher_ids, &t.bytes, false),
    ];
    let mut boundary_sets: Vec<BTreeSet<usize>> = Vec::new();
    for (ids, tb, is_student) in sides {
        let range = |c: &xdistill_trainer::align::Chunk| {
            if is_student {
                c.student.clone()
            } else {
                c.teacher.clone()
            }
        };
        // Coverage: owner chunk of each token.
        let mut owner = vec![None; ids.len()];
        for (k, c) in p.chunks.iter().enumerate() {
            for i in range(c) {
                assert!(owner[i].is_none(), "{ctx}: token {i} in two chunks");
                owner[i] = Some(k);
            }
        }
        // Per-token byte length as the text reads it (masked specials and special chunks: 0).
        let mut prefix = 0usize;
        let mut set = BTreeSet::new();
        for (i, o) in owner.iter().enumerate() {
            let piece = tb.piece(ids, i).expect("known id");
            let len = match (o, piece) {
                (None, Piece::Special(_)) => 0,
                (None, Piece::Text(_)) => panic!("{ctx}: text token {i} in no chunk"),
                (Some(k), _) if p.chunks[*k].kind == ChunkKind::Special => 0,
                (Some(_), pc) => pc.bytes().len(),
            };
            prefix += len;
            set.insert(prefix);
        }
        assert_eq!(
            prefix,
            text.len(),
            "{ctx}: token bytes do not add up to the text"
        );
        boundary_sets.push(set);
    }
    // Order, non-emptiness, contiguity, byte equality.
    let mut at = 0usize;
    let (mut s_prev, mut t_prev) = (0, 0);
    let mut rebuilt = Vec::new();
    for (k, c) in p.chunks.iter().enumerate() {
        assert!(
            !c.student.is_empty() && !c.teacher.is_empty(),
            "{ctx}: chunk {k} empty"
        );
        assert!(
            c.student.start >= s_prev && c.teacher.start >= t_prev,
            "{ctx}: chunk {k} out of order"
        );
        s_prev = c.student.end;
        t_prev = c.teacher.end;
        assert_eq!(c.bytes.start, at, "{ctx}: chunk {k} not contiguous");
        at = c.bytes.end;
        if c.kind == ChunkKind::Special {
            assert!(c.bytes.is_empty() && c.is_one_to_one());
            assert!(s.bytes.is_special(p.student_ids[c.student.start]));
            assert!(t.bytes.is_special(p.teacher_ids[c.teacher.start]));
            continue;
        }
        let sb: Vec<u8> = c
            .student
            .clone()
            .flat_map(|i| s.bytes.piece(&p.student_ids, i).unwrap().bytes().to_vec())
            .collect();
        let tb: Vec<u8> = c
            .teacher
            .clone()
            .flat_map(|i| t.bytes.piece(&p.teacher_ids, i).unwrap().bytes().to_vec())
            .collect();
        assert_eq!(sb, tb, "{ctx}: chunk {k} bytes differ");
        assert_eq!(
            &sb[..],
            &text[c.bytes.clone()],
            "{ctx}: chunk {k} is not the text there"
        );
        rebuilt.extend_from_slice(&sb);
    }
    assert_eq!(rebuilt, text, "{ctx}: chunks do not give back the text");
    // Minimality: text chunk ends are exactly the common token boundaries.
    let common: BTreeSet<usize> = boundary_sets[0]
        .intersection(&boundary_sets[1])
        .copied()
        .filter(|&b| b > 0)
        .collect();
    let ends: BTreeSet<usize> = p
        .chunks
        .iter()
        .filter(|c| c.kind == ChunkKind::Text && !c.bytes.is_empty())
        .map(|c| c.bytes.end)
        .collect();
    assert_eq!(ends, common, "{ctx}: chunks are not the smallest");
}
