//! Alignment on every ordered pair of the five real tokenizers, over texts covering byte-level
//! and SentencePiece quirks, specials, padding and truncation.

use crate::align_common::{check_pair, get, pairs, tokenizers};
use xdistill_trainer::align::{align, tokenize_pair, ChunkKind, PairOptions, TokenizerKind};

/// One text per quirk the alignment must be exact on.
const TEXTS: &[&str] = &[
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "   three leading spaces, trailing ones   ",
    " one leading space",
    "\ttabs\tand\nnewlines\n\n\n  \r\n mixed \t\n\n",
    "digits 1234567890 12 123 1234 12345 3.14159 1,000,000 and 31415926535897932384626433832795",
    "中文测试：你好，世界。日本語のテキスト、カタカナとひらがな。한국어 문장입니다.",
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 rainbow flag 🏳️‍🌈 flag 🇫🇷 🤖🧠",
    "Accents: café naïve résumé Ångström Zürich São Paulo; combining: cafe\u{301} n\u{303}o",
    "Ελληνικά, русский, العربية, עברית, हिन्दी, ไทย",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n",
    "<s>[INST] typed llama2 markers [/INST] answer</s>",
    "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\nhello<end_of_turn>",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
    "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜>hello",
    "a literal ▁ lower block: x▁y ▁▁z",
    "He writes 3*2=<<3*2=6>>6 pages a week\nSo 6*2=<<6*2=12>>12\n#### 624",
    "    def f(x):\n        return x ** 2  # comment\n\n\n",
    "zero\u{200b}width\u{feff} soft\u{ad}hyphen \u{7f} nbsp\u{a0}here",
    "",
    " ",
    "\n",
    "x",
];

#[test]
fn every_pair_aligns_every_text_exactly() {
    for (sn, tn) in pairs() {
        let (s, t) = (get(sn), get(tn));
        for (i, text) in TEXTS.iter().enumerate() {
            for add_special in [true, false] {
                let ctx = format!("{sn}->{tn} text {i} specials {add_special}");
                let opts = PairOptions {
                    add_special_tokens: add_special,
                    ..PairOptions::default()
                };
                let p = tokenize_pair(text, s, t, opts).unwrap_or_else(|e| panic!("{ctx}: {e}"));
                check_pair(&p, s, t, &ctx);
                // From ids alone (no text: special roles decided against the other side's
                // bytes), the chunks are the same.
                let ids_only = align(&p.student_ids, &p.teacher_ids, &s.bytes, &t.bytes)
                    .unwrap_or_else(|e| panic!("{ctx}: ids only: {e}"));
                assert_eq!(ids_only, p.chunks, "{ctx}: ids only");
            }
        }
    }
}

/// Independent reference for the byte tables: Hugging Face's own decoder, on texts without
/// special-token strings, must give back the canonical text from the same ids.
#[test]
fn byte_tables_agree_with_the_tokenizers_decoders() {
    for (name, tok) in tokenizers() {
        for text in TEXTS.iter().filter(|t| !t.contains('<')) {
            let canon = tok.bytes.canonicalize(text).into_owned();
            let ids = tok.encode(&canon, false).unwrap();
            let ours = tok.bytes.decode(&ids, false).unwrap();
            let theirs = tok.tokenizer.decode(&ids, false).unwrap();
            assert_eq!(String::from_utf8_lossy(&ours), theirs, "{name}: {text:?}");
            assert_eq!(ours, canon.as_bytes(), "{name}: {text:?}");
        }
    }
}

#[test]
fn tokenizer_kinds_are_detected() {
    for (name, tok) in tokenizers() {
        let want = match *name {
            "llama2" | "gemma3" => TokenizerKind::SentencePiece,
            _ => TokenizerKind::ByteLevel,
        };
        assert_eq!(tok.bytes.kind(), want, "{name}");
    }
}

#[test]
fn special_tokens_pair_mask_or_read_as_text() {
    let opts = PairOptions::default();
    // Both add a BOS: the BOS tokens form a special one-to-one chunk.
    let p = tokenize_pair("Hello", get("llama2"), get("gemma3"), opts).unwrap();
    assert_eq!(p.chunks[0].kind, ChunkKind::Special);
    assert_eq!(
        (p.chunks[0].student.clone(), p.chunks[0].teacher.clone()),
        (0..1, 0..1)
    );
    assert_eq!((p.student_ids[0], p.teacher_ids[0]), (1, 2)); // <s>, <bos>
                                                              // Only the student adds one: it is masked (in no chunk).
    let p = tokenize_pair("Hello", get("llama2"), get("qwen3"), opts).unwrap();
    assert_eq!(p.student_ids[0], 1);
    assert!(p.chunks.iter().all(|c| c.student.start >= 1));
    // Qwen3 reads "<|im_start|>" as one special token, Llama 3 as text: one text chunk.
    let text = "<|im_start|>user\nhi";
    let p = tokenize_pair(text, get("qwen3"), get("llama3"), opts).unwrap();
    let im_start = get("qwen3").tokenizer.token_to_id("<|im_start|>").unwrap();
    assert_eq!(p.student_ids[0], im_start);
    assert_eq!(p.chunks[0].kind, ChunkKind::Text);
    assert_eq!(p.chunks[0].bytes, 0..12);
    assert_eq!(p.chunks[0].student, 0..1);
    assert!(p.chunks[0].teacher.len() > 1);
    // Gemma 3 reads "<start_of_turn>" as a special, Llama 2 as text after its BOS: the BOS pair
    // first, then the marker as a text chunk.
    let p = tokenize_pair("<start_of_turn>user", get("gemma3"), get("llama2"), opts).unwrap();
    assert_eq!(p.chunks[0].kind, ChunkKind::Special);
    assert_eq!(p.chunks[1].kind, ChunkKind::Text);
    assert_eq!(p.chunks[1].bytes, 0.."<start_of_turn>".len());
}

#[test]
fn truncation_cuts_both_sides_at_the_same_text_offset() {
    let text = TEXTS.join(" ");
    for (sn, tn) in pairs() {
        let (s, t) = (get(sn), get(tn));
        let full = tokenize_pair(&text, s, t, PairOptions::default()).unwrap();
        for (ms, mt) in [(7usize, 50usize), (40, 9), (33, 33), (1, 1)] {
            let ctx = format!("{sn}->{tn} max {ms}/{mt}");
            let opts = PairOptions {
                max_student_tokens: Some(ms),
                max_teacher_tokens: Some(mt),
                ..PairOptions::default()
            };
            let p = tokenize_pair(&text, s, t, opts).unwrap();
            assert!(p.truncated, "{ctx}");
            assert!(
                p.student_ids.len() <= ms && p.teacher_ids.len() <= mt,
                "{ctx}"
            );
            // Reference: the kept chunks are the longest prefix of the untruncated chunks that
            // fits both limits, found by a plain scan.
            let mut keep = 0;
            while keep < full.chunks.len()
                && full.chunks[keep].student.end <= ms
                && full.chunks[keep].teacher.end <= mt
            {
                keep += 1;
            }
            assert_eq!(p.chunks, full.chunks[..keep], "{ctx}");
            assert_eq!(
                p.student_ids,
                full.student_ids[..p.student_ids.len()],
                "{ctx}"
            );
            assert_eq!(
                p.teacher_ids,
                full.teacher_ids[..p.teacher_ids.len()],
                "{ctx}"
            );
            assert!(full.text.starts_with(&p.text), "{ctx}");
            check_pair(&p, s, t, &ctx);
        }
    }
}
