//! The teacher's answers as a trainer decodes them (`/topk_logits` in JSON and MessagePack,
//! `/hidden_states`, the `/v1/head` file): an error or a value whose sizes agree with its data
//! (what the trainer indexes by), and that value's own encoding decodes to the same bits.
#![no_main]

use libfuzzer_sys::fuzz_target;
use xdistill_shared::codec::{self, Format};
use xdistill_shared::protocol::TopkResponse;

/// Every size and bit of an answer.
fn bits(r: &TopkResponse) -> Vec<Vec<u32>> {
    r.results
        .iter()
        .map(|s| [vec![s.rows as u32, s.k as u32, s.m as u32], s.bits()].concat())
        .collect()
}

fn topk(format: Format, body: &[u8]) {
    let Ok(r) = codec::decode_response(format, body) else {
        return;
    };
    for s in &r.results {
        s.check_shapes()
            .expect("a decoded answer's buffers agree with its sizes");
        assert_eq!(s.k, r.k, "a sequence's k is the answer's");
    }
    // JSON has no NaN or infinity (serde_json writes them as null, which is refused): a number
    // past f32's range parses to one, and is then not an answer any teacher sends.
    let finite = r.results.iter().all(|s| {
        [
            &s.topk_values,
            &s.target_logprobs,
            &s.logsumexp,
            &s.ids_logprobs,
        ]
        .iter()
        .all(|v| v.iter().all(|x| x.is_finite()))
    });
    if format == Format::Json && !finite {
        return;
    }
    let again = codec::encode_response(format, &r).expect("a decoded answer encodes");
    let back = codec::decode_response(format, &again).expect("its own encoding decodes");
    assert_eq!(bits(&r), bits(&back));
}

fn hidden(body: &[u8]) {
    let Ok(r) = codec::decode_hidden_response(body) else {
        return;
    };
    for s in &r.results {
        assert_eq!(s.data.len(), s.rows * r.hidden_size * r.dtype.size());
    }
    let again = codec::encode_hidden_response(&r).expect("encodes");
    assert_eq!(codec::decode_hidden_response(&again).expect("decodes"), r);
}

fn head(body: &[u8]) {
    let Ok(f) = codec::decode_head(body) else {
        return;
    };
    assert_eq!(f.weight.len(), f.meta.head_rows * f.meta.hidden_size);
    assert_eq!(
        f.bias.as_ref().map(Vec::len),
        f.meta.bias.then_some(f.meta.head_rows)
    );
    assert_eq!(body.len() as u64, f.meta.file_len());
}

fuzz_target!(|data: &[u8]| {
    let Some((&which, body)) = data.split_first() else {
        return;
    };
    match which % 4 {
        0 => topk(Format::Json, body),
        1 => topk(Format::Msgpack, body),
        2 => hidden(body),
        _ => head(body),
    }
});
