//! `trainer align` through its library entry point: JSONL and plain-text input, `--output`
//! lines whose chunks spell the same bytes on both sides.

use xdistill_testkit::tokenizer_json;
use xdistill_trainer::align::cli::{read_documents, run_align, AlignArgs};
use xdistill_trainer::align::{AlignTokenizer, Piece};

#[test]
fn reads_jsonl_and_plain_text() {
    let dir = tempfile::tempdir().unwrap();
    let j = dir.path().join("a.jsonl");
    std::fs::write(
        &j,
        "{\"q\": \"a b\", \"a\": \"c\"}\n\n{\"q\": \"d\", \"a\": \"e\\nf\"}\n",
    )
    .unwrap();
    assert_eq!(
        read_documents(&j, &["q", "a"]).unwrap(),
        vec!["a b\nc", "d\ne\nf"]
    );
    assert!(read_documents(&j, &["missing"]).is_err());
    let t = dir.path().join("a.txt");
    std::fs::write(&t, "first doc\nline two\n\n\n second doc\n").unwrap();
    assert_eq!(
        read_documents(&t, &["text"]).unwrap(),
        vec!["first doc\nline two", " second doc"]
    );
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(&bad, "{\"text\": 1}\n").unwrap();
    assert!(read_documents(&bad, &["text"]).is_err());
}

#[test]
fn output_lines_hold_ids_and_chunks() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    let texts = [
        "Hello world 12345",
        "  café 😀 中文\n\tend",
        "<|im_start|>user\nhi",
    ];
    let lines: Vec<String> = texts
        .iter()
        .map(|t| serde_json::json!({ "text": t }).to_string())
        .collect();
    std::fs::write(&input, lines.join("\n")).unwrap();
    let output = dir.path().join("out.jsonl");
    let (sp, tp) = (tokenizer_json("llama2"), tokenizer_json("qwen3"));
    run_align(AlignArgs {
        student_tokenizer: sp.clone(),
        teacher_tokenizer: tp.clone(),
        input,
        text_field: "text".into(),
        output: Some(output.clone()),
        no_special_tokens: false,
        max_student_tokens: None,
        max_teacher_tokens: None,
        limit: None,
    })
    .unwrap();
    let (s, t) = (
        AlignTokenizer::from_file(&sp).unwrap(),
        AlignTokenizer::from_file(&tp).unwrap(),
    );
    let out = std::fs::read_to_string(&output).unwrap();
    assert_eq!(out.lines().count(), texts.len());
    for (line, text) in out.lines().zip(texts) {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let ids = |k: &str| -> Vec<u32> {
            v[k].as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect()
        };
        let (si, ti) = (ids("student_ids"), ids("teacher_ids"));
        // The ids are exactly what the tokenizers give (Llama 2 adds its BOS).
        assert_eq!(si, s.encode(text, true).unwrap());
        assert_eq!(ti, t.encode(text, true).unwrap());
        let bytes = |tb: &AlignTokenizer, ids: &[u32], r: std::ops::Range<usize>| -> Vec<u8> {
            r.flat_map(|k| match tb.bytes.piece(ids, k).unwrap() {
                Piece::Text(b) | Piece::Special(b) => b.to_vec(),
            })
            .collect()
        };
        let mut all = Vec::new();
        let (mut ps, mut pt) = (0, 0);
        for c in v["chunks"].as_array().unwrap() {
            let c: Vec<usize> = c
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as usize)
                .collect();
            assert!(
                c[0] >= ps && c[0] < c[1] && c[2] >= pt && c[2] < c[3],
                "{line}"
            );
            (ps, pt) = (c[1], c[3]);
            let (a, b) = (bytes(&s, &si, c[0]..c[1]), bytes(&t, &ti, c[2]..c[3]));
            assert_eq!(a, b, "{line}");
            all.extend(a);
        }
        assert_eq!(all, text.as_bytes());
    }
}
