//! A `tokenizer.json` through the project's own parse (`tokenizer_json::parse`, a fast path for
//! BPE vocabularies): an error, or the tokenizer the `tokenizers` crate's own parse gives,
//! which encodes and decodes a fixed text to the same ids and text. (Where the file gives one
//! id to two tokens, each parse decodes it to either, by its hash map's order: only the ids
//! are compared then. No real tokenizer does it.)
#![no_main]

use libfuzzer_sys::fuzz_target;
use tokenizers::Tokenizer;

const TEXT: &str = "The quick brown fox <|endoftext|> jumps over thé lazy dog 12345 \u{1F600}\n";

fn run(t: &Tokenizer) -> Option<(Vec<u32>, String)> {
    let enc = t.encode(TEXT, true).ok()?;
    let ids = enc.get_ids().to_vec();
    let text = t.decode(&ids, false).ok()?;
    Some((ids, text))
}

fuzz_target!(init: xdistill_fuzz::allow_caught_panics(), |data: &[u8]| {
    let Ok(ours) = xdistill_shared::tokenizer_json::parse(data) else {
        return;
    };
    let theirs = Tokenizer::from_bytes(data).expect("what our parse takes, the crate's takes too");
    let vocab = theirs.get_vocab(true);
    let ids: std::collections::HashSet<u32> = vocab.values().copied().collect();
    let (a, b) = (run(&ours), run(&theirs));
    if ids.len() == vocab.len() {
        assert_eq!(a, b);
    } else {
        assert_eq!(a.map(|x| x.0), b.map(|x| x.0));
    }
});
