//! `tokenizer_json::parse` against the `tokenizers` crate's own parse of the same bytes: the same
//! tokenizer (its whole serialization, every id of the vocabulary with the added tokens, the
//! encodings of text with special tokens) for every real tokenizer the project uses and for
//! files of the forms it hands back to the crate, and the crate's errors for broken files.
//! Parsing the five real tokenizers twice and serializing them is about 7 s of the suite (Gemma
//! 3's 262k ids are most of it; not repeated in the SIMD pass, .config/nextest.toml); they are the files whose variety matters (merges as strings
//! and as pairs, byte fallback, `ignore_merges`, thousands of added tokens).

use super::parse;
use tokenizers::Tokenizer;

/// Text touching every tokenizer's special and added tokens, bytes outside the vocabulary
/// (byte fallback), several scripts and whitespace runs.
const TEXT: &str = "<s>Hello  world!\n\t<|im_start|>user\n12,345.67 naïve café 日本語 \
    עברית 🤗🦀<|im_end|><start_of_turn>model <bos></s><｜begin▁of▁sentence｜>\u{0}\u{7f}";

/// `parse` and the crate give the same tokenizer for `bytes`.
fn assert_same(name: &str, bytes: &[u8]) {
    let want = Tokenizer::from_bytes(bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
    let got = parse(bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert!(
        got.to_string(false).unwrap() == want.to_string(false).unwrap(),
        "{name}: the serializations differ"
    );
    assert_eq!(
        got.get_vocab(true),
        want.get_vocab(true),
        "{name}: vocabulary"
    );
    for special in [false, true] {
        let (g, w) = (
            got.encode(TEXT, special).unwrap(),
            want.encode(TEXT, special).unwrap(),
        );
        assert_eq!(g.get_ids(), w.get_ids(), "{name}: ids");
        assert_eq!(g.get_offsets(), w.get_offsets(), "{name}: offsets");
    }
}

#[test]
fn real_tokenizers_parse_as_the_tokenizers_crate_parses_them() {
    for name in crate::paths::TOKENIZER_NAMES {
        let bytes = std::fs::read(xdistill_testkit::tokenizer_json(name)).unwrap();
        assert_same(name, &bytes);
    }
    let bytes = std::fs::read(xdistill_testkit::byte_tokenizer_json()).unwrap();
    assert_same("byte tokenizer (no merges)", &bytes);
}

/// A small tokenizer.json with the `model` and `added_tokens` given (JSON text). The fixtures
/// are text rather than `serde_json::json!` values: this binary is built at opt-level 3, where
/// the macro's expansions cost seconds of the suite's build.
fn file(model: &str, added: &str) -> Vec<u8> {
    format!(
        r#"{{"version": "1.0", "truncation": null, "padding": null, "added_tokens": {added},
            "normalizer": {{"type": "Lowercase"}}, "pre_tokenizer": {{"type": "Whitespace"}},
            "post_processor": null, "decoder": null, "model": {model}}}"#
    )
    .into_bytes()
}

/// A BPE model (`"type"` given or not) with the merges given.
fn bpe(typed: bool, merges: &str) -> String {
    format!(
        r#"{{{} "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "vocab": {{"<unk>": 0, "h": 1, "e": 2, "l": 3, "o": 4, "he": 5, "ll": 6, "hell": 7,
            "hello": 8}}, "merges": {merges}}}"#,
        if typed { r#""type": "BPE","# } else { "" }
    )
}

/// Added tokens: special ones, a new normal one, one the model already has with its model id
/// and one the model has under another id than the file says (the model's id wins).
const ADDED: &str = r#"[
    {"id": 0, "content": "<unk>", "single_word": false, "lstrip": false, "rstrip": false,
     "normalized": false, "special": true},
    {"id": 9, "content": "<eot>", "single_word": false, "lstrip": true, "rstrip": false,
     "normalized": false, "special": true},
    {"id": 10, "content": "world", "single_word": true, "lstrip": false, "rstrip": true,
     "normalized": true, "special": false},
    {"id": 3, "content": "l", "single_word": false, "lstrip": false, "rstrip": false,
     "normalized": true, "special": false},
    {"id": 11, "content": "he", "single_word": false, "lstrip": false, "rstrip": false,
     "normalized": true, "special": false}]"#;

#[test]
fn other_models_legacy_forms_and_added_tokens_parse_as_the_crate_parses_them() {
    let pairs = r#"[["h", "e"], ["l", "l"], ["he", "ll"], ["hell", "o"]]"#;
    let strings = r#"["h e", "l l", "he ll", "hell o"]"#;
    let files = [
        ("BPE, merges as pairs", file(&bpe(true, pairs), ADDED)),
        ("BPE, merges as strings", file(&bpe(true, strings), ADDED)),
        // No "type": the crate tries BPE first, as the fast path does.
        ("BPE without its type", file(&bpe(false, pairs), ADDED)),
        ("no added tokens", file(&bpe(true, "[]"), "[]")),
        (
            "WordPiece",
            file(
                r###"{"type": "WordPiece", "unk_token": "<unk>", "continuing_subword_prefix": "##",
                    "max_input_chars_per_word": 100,
                    "vocab": {"<unk>": 0, "hello": 1, "##o": 2, "hell": 3}}"###,
                ADDED,
            ),
        ),
        (
            "WordLevel",
            file(
                r#"{"type": "WordLevel", "unk_token": "<unk>", "vocab": {"<unk>": 0, "hello": 1}}"#,
                ADDED,
            ),
        ),
        (
            "Unigram",
            file(
                r#"{"type": "Unigram", "unk_id": 0, "byte_fallback": false,
                    "vocab": [["<unk>", 0.0], ["hello", -1.0], ["h", -3.0], ["e", -3.0],
                        ["l", -3.0], ["o", -3.0]]}"#,
                ADDED,
            ),
        ),
    ];
    for (name, bytes) in &files {
        assert_same(name, bytes);
    }
    // Without the key at all.
    let text = String::from_utf8(files[0].1.clone()).unwrap();
    let (before, after) = text.split_once(r#""added_tokens": "#).unwrap();
    let after = &after[after.find("\"normalizer\"").unwrap()..];
    assert_same("no added_tokens key", format!("{before}{after}").as_bytes());
    // A key given twice, both values valid: the last one, in both parses.
    let twice = text.replacen(
        r#""normalizer": {"type": "Lowercase"}"#,
        r#""normalizer": {"type": "NFC"}, "normalizer": {"type": "Lowercase"}"#,
        1,
    );
    assert_ne!(twice, text);
    assert_same("a key given twice", twice.as_bytes());
}

#[test]
fn broken_files_get_the_crates_errors() {
    let good = file(&bpe(true, r#"[["h", "e"]]"#), ADDED);
    let text = String::from_utf8(good.clone()).unwrap();
    let broken: Vec<(&str, Vec<u8>)> = vec![
        ("truncated", good[..good.len() / 2].to_vec()),
        ("empty", Vec::new()),
        (
            "not UTF-8",
            [&good[..10], &[0xff, 0xfe], &good[10..]].concat(),
        ),
        (
            "another version",
            text.replacen("\"1.0\"", "\"2.0\"", 1).into_bytes(),
        ),
        (
            "a merge of unknown tokens",
            file(&bpe(true, r#"[["no such", "token"]]"#), ADDED),
        ),
        (
            "a model of no known type",
            file(r#"{"type": "Nonsense", "vocab": {}}"#, ADDED),
        ),
        (
            "an added token without an id",
            file(&bpe(true, "[]"), r#"[{"content": "x"}]"#),
        ),
        (
            "no model",
            br#"{"version": "1.0", "added_tokens": []}"#.to_vec(),
        ),
        ("an array", b"[1, 2]".to_vec()),
        (
            // The last `version` is right, the first is not a string (found by `fuzz/`).
            "a key given twice, first of the wrong type",
            text.replacen(
                r#""version": "1.0""#,
                r#""version": {}, "version": "1.0""#,
                1,
            )
            .into_bytes(),
        ),
    ];
    for (name, bytes) in broken {
        let want = Tokenizer::from_bytes(&bytes).err().map(|e| e.to_string());
        let got = parse(&bytes).err().map(|e| e.to_string());
        assert!(want.is_some(), "{name}: the crate accepts it");
        assert_eq!(got, want, "{name}");
    }
}

/// Files the `tokenizers` crate panics on (0.23: a syntax error inside `decoder`, a merge
/// shorter than the subword prefix; inputs `fuzz/`'s tokenizer_json target found) are errors
/// of [`parse`], not panics; the crate's own parse of the same bytes still panics (were it
/// fixed upstream, this says so).
#[test]
fn files_the_crate_panics_on_are_errors() {
    let good = file(&bpe(true, "[]"), ADDED);
    let text = String::from_utf8(good).unwrap();
    let with =
        |decoder: &str| text.replacen(r#""decoder": null"#, &format!(r#""decoder": {decoder}"#), 1);
    // The same decoder with its comma parses.
    assert!(parse(
        with(r###"{"prefix": "##", "cleanup": true, "type": "WordPiece"}"###).as_bytes()
    )
    .is_ok());
    let broken = with(r###"{"prefix": "##" "cleanup": true, "type": "WordPiece"}"###);
    let crate_panics =
        std::panic::catch_unwind(|| Tokenizer::from_bytes(broken.as_bytes())).is_err();
    assert!(
        crate_panics,
        "the tokenizers crate no longer panics on this file"
    );
    let err = parse(broken.as_bytes())
        .expect_err("a malformed file")
        .to_string();
    assert!(
        err.contains("malformed tokenizer.json") && err.contains("Helper"),
        "{err}"
    );

    // A BPE whose merge's second token is shorter than `continuing_subword_prefix`: the crate's
    // BPE builder slices past it (a panic inside the fast path's own BPE deserializer; found
    // by `fuzz/` too).
    let short = file(
        r###"{"type": "BPE", "continuing_subword_prefix": "##", "vocab": {"a": 0, "b": 1, "ab": 2},
            "merges": ["a b"]}"###,
        "[]",
    );
    let crate_panics = std::panic::catch_unwind(|| Tokenizer::from_bytes(&short)).is_err();
    assert!(
        crate_panics,
        "the tokenizers crate no longer panics on a short merge"
    );
    let err = parse(&short).expect_err("a malformed file").to_string();
    assert!(err.contains("malformed tokenizer.json"), "{err}");
}

/// Parse times, the `tokenizers` crate's and [`parse`]'s, of each real tokenizer (medians of 3,
/// one after the other): `cargo test -p xdistill-shared --lib tokenizer_parse_speed --
/// --ignored --nocapture` (bench/README.md).
#[test]
#[ignore = "a benchmark: prints figures"]
fn tokenizer_parse_speed() {
    let median = |f: &dyn Fn() -> Tokenizer| {
        let mut t: Vec<f64> = (0..3)
            .map(|_| {
                let t0 = std::time::Instant::now();
                std::hint::black_box(f());
                t0.elapsed().as_secs_f64()
            })
            .collect();
        t.sort_by(f64::total_cmp);
        t[1]
    };
    println!("| tokenizer | MB | ids | tokenizers crate | tokenizer_json::parse | ratio |");
    println!("|---|---|---|---|---|---|");
    for name in crate::paths::TOKENIZER_NAMES {
        let bytes = std::fs::read(xdistill_testkit::tokenizer_json(name)).unwrap();
        let crate_s = median(&|| Tokenizer::from_bytes(&bytes).unwrap());
        let ours = median(&|| parse(&bytes).unwrap());
        let ids = parse(&bytes).unwrap().get_vocab_size(true);
        println!(
            "| {name} | {:.1} | {ids} | {:.3} s | {:.3} s | {:.2}x |",
            bytes.len() as f64 / 1e6,
            crate_s,
            ours,
            crate_s / ours
        );
    }
}
