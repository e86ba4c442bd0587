//! `tokenizer_json::parse` against the `tokenizers` crate's own parse of the same bytes: the same
//! tokenizer (its whole serialization, every id of the vocabulary with the added tokens, the
//! encodings of text with special tokens) for every real tokenizer the project uses and for
//! files of the forms it hands back to the crate, and the crate's errors for broken files.
//! Parsing the five real tokenizers twice and serializing them is about 7 s of the suite (Gemma
//! 3's 262k ids are most of it); they are the files whose variety matters (merges as strings
//! and as pairs, byte fallback, `ignore_merges`, thousands of added tokens).

use tokenizers::Tokenizer;
use xdistill_shared::tokenizer_json::parse;

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
    assert_eq!(
        got.get_vocab_size(true),
        want.get_vocab_size(true),
        "{name}"
    );
    for special in [false, true] {
        let (g, w) = (
            got.encode(TEXT, special).unwrap(),
            want.encode(TEXT, special).unwrap(),
        );
        assert_eq!(g.get_ids(), w.get_ids(), "{name}: ids");
        assert_eq!(g.get_offsets(), w.get_offsets(), "{name}: offsets");
        assert_eq!(
            got.decode(g.get_ids(), false).unwrap(),
            want.decode(w.get_ids(), false).unwrap(),
            "{name}: decoding"
        );
    }
}

#[test]
fn real_tokenizers_parse_as_the_tokenizers_crate_parses_them() {
    for name in xdistill_shared::paths::TOKENIZER_NAMES {
        let bytes = std::fs::read(xdistill_testkit::tokenizer_json(name)).unwrap();
        assert_same(name, &bytes);
    }
    let bytes = std::fs::read(xdistill_testkit::byte_tokenizer_json()).unwrap();
    assert_same("byte tokenizer (no merges)", &bytes);
}

/// A small tokenizer.json with `model` and the other top-level fields given.
fn file(model: serde_json::Value, added: serde_json::Value) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": {"type": "Lowercase"},
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null, "decoder": null, "model": model
    }))
    .unwrap()
}

fn added(id: u32, content: &str, special: bool) -> serde_json::Value {
    serde_json::json!({"id": id, "content": content, "single_word": false, "lstrip": false,
        "rstrip": false, "normalized": !special, "special": special})
}

#[test]
fn other_models_legacy_forms_and_added_tokens_parse_as_the_crate_parses_them() {
    let vocab = serde_json::json!({"<unk>": 0, "h": 1, "e": 2, "l": 3, "o": 4, "he": 5,
        "ll": 6, "hell": 7, "hello": 8});
    let bpe = |typed: bool, merges: serde_json::Value| {
        let mut m = serde_json::json!({"dropout": null, "unk_token": "<unk>",
            "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
            "byte_fallback": false, "vocab": vocab, "merges": merges});
        if typed {
            m["type"] = "BPE".into();
        }
        m
    };
    let pairs = serde_json::json!([["h", "e"], ["l", "l"], ["he", "ll"], ["hell", "o"]]);
    let strings = serde_json::json!(["h e", "l l", "he ll", "hell o"]);
    let tokens = serde_json::json!([
        added(0, "<unk>", true),
        added(9, "<eot>", true),
        added(10, "world", false),
        added(3, "l", false)
    ]);
    let files = [
        (
            "BPE, merges as pairs",
            file(bpe(true, pairs.clone()), tokens.clone()),
        ),
        (
            "BPE, merges as strings",
            file(bpe(true, strings), tokens.clone()),
        ),
        // No "type": the crate tries BPE first, as the fast path does.
        (
            "BPE without its type",
            file(bpe(false, pairs), tokens.clone()),
        ),
        (
            "WordPiece",
            file(
                serde_json::json!({"type": "WordPiece", "unk_token": "<unk>",
                    "continuing_subword_prefix": "##", "max_input_chars_per_word": 100,
                    "vocab": {"<unk>": 0, "hello": 1, "##o": 2, "hell": 3}}),
                tokens.clone(),
            ),
        ),
        (
            "WordLevel",
            file(
                serde_json::json!({"type": "WordLevel", "unk_token": "<unk>",
                    "vocab": {"<unk>": 0, "hello": 1}}),
                tokens.clone(),
            ),
        ),
        (
            "Unigram",
            file(
                serde_json::json!({"type": "Unigram", "unk_id": 0, "byte_fallback": false,
                    "vocab": [["<unk>", 0.0], ["hello", -1.0], ["h", -3.0], ["e", -3.0],
                        ["l", -3.0], ["o", -3.0]]}),
                tokens,
            ),
        ),
        (
            "no added tokens",
            file(bpe(true, serde_json::json!([])), serde_json::json!([])),
        ),
    ];
    for (name, bytes) in &files {
        assert_same(name, bytes);
    }
    // Without the key at all.
    let mut v: serde_json::Value = serde_json::from_slice(&files[0].1).unwrap();
    v.as_object_mut().unwrap().remove("added_tokens");
    assert_same("no added_tokens key", &serde_json::to_vec(&v).unwrap());
}

#[test]
fn broken_files_get_the_crates_errors() {
    let good = std::fs::read(xdistill_testkit::byte_tokenizer_json()).unwrap();
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
        ("a merge of unknown tokens", {
            let mut v: serde_json::Value = serde_json::from_slice(&good).unwrap();
            v["model"]["merges"] = serde_json::json!([["no such", "token"]]);
            serde_json::to_vec(&v).unwrap()
        }),
        ("a model of no known type", {
            let mut v: serde_json::Value = serde_json::from_slice(&good).unwrap();
            v["model"]["type"] = "Nonsense".into();
            serde_json::to_vec(&v).unwrap()
        }),
        ("no model", {
            let mut v: serde_json::Value = serde_json::from_slice(&good).unwrap();
            v.as_object_mut().unwrap().remove("model");
            serde_json::to_vec(&v).unwrap()
        }),
        ("an array", b"[1, 2]".to_vec()),
    ];
    for (name, bytes) in broken {
        let want = Tokenizer::from_bytes(&bytes).err().map(|e| e.to_string());
        let got = parse(&bytes).err().map(|e| e.to_string());
        assert!(want.is_some(), "{name}: the crate accepts it");
        assert_eq!(got, want, "{name}");
    }
}

/// Parse times, the `tokenizers` crate's and [`parse`]'s, of each real tokenizer (medians of 3,
/// one after the other): `cargo test -p xdistill-shared --test integration
/// tokenizer_parse_speed -- --ignored --nocapture` (bench/README.md).
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
    for name in xdistill_shared::paths::TOKENIZER_NAMES {
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
