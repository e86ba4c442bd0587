//! Requests as the teacher decodes and validates them (`/topk_logits` and `/hidden_states`, JSON
//! and MessagePack): an error, or a valid request whose costs and answer size can be computed
//! (what admission and the batcher do with it next) and whose re-encoding validates the same.
#![no_main]

use libfuzzer_sys::fuzz_target;
use xdistill_server::request::RequestLimits;
use xdistill_server::validation::{validate, validate_hidden};
use xdistill_shared::codec::{self, Format};

/// The teacher's default limits (`server/src/args.rs`) over a small vocabulary, so that ids
/// the fuzzer writes are as often valid as not; or an operator's largest: `--max-k` at the
/// vocabulary, no practical limit on queue tokens, sequences or answer bytes.
fn limits(sel: u8) -> RequestLimits {
    let wide = sel & 1 == 1;
    RequestLimits {
        vocab_size: 300,
        max_k: if wide { 300 } else { 256 },
        max_seq_len: 4096,
        max_queue_tokens: if wide { usize::MAX } else { 262_144 },
        max_sequences: if wide { usize::MAX } else { 16_384 },
        max_answer_bytes: if wide { usize::MAX } else { 1 << 30 },
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&sel, body)) = data.split_first() else {
        return;
    };
    let format = if sel & 4 == 0 {
        Format::Json
    } else {
        Format::Msgpack
    };
    let lim = limits(sel);
    if sel & 8 == 0 {
        let Ok(req) = codec::decode_request(format, body) else {
            return;
        };
        let again = codec::encode_request(format, &req).expect("a decoded request encodes");
        let Ok(v) = validate(req, &lim) else {
            return;
        };
        let _ = (
            v.input_tokens(),
            v.cost(),
            v.answer_bytes(),
            v.native_answer_bytes(true),
        );
        let back = codec::decode_request(format, &again).expect("its own encoding decodes");
        let back = validate(back, &lim).expect("its own encoding validates");
        assert_eq!(format!("{back:?}"), format!("{v:?}"));
    } else {
        let Ok(req) = codec::decode_hidden_request(format, body) else {
            return;
        };
        if let Ok(v) = validate_hidden(req, &lim) {
            let _ = (v.input_tokens(), v.cost());
        }
    }
});
