//! Fuzzing the request decoders (bounded, in CI): arbitrary bytes and mutated encodings never
//! panic, and arbitrary structured requests round-trip through both formats.

use proptest::prelude::*;
use xdistill_shared::codec::{decode_request, encode_request, Format};
use xdistill_shared::protocol::{TopkRequest, ValuesKind};

fn request() -> impl Strategy<Value = TopkRequest> {
    let seqs = prop::collection::vec(prop::collection::vec(any::<u32>(), 0..12), 0..6);
    (
        seqs,
        any::<usize>(),
        any::<f32>(),
        any::<usize>(),
        prop::option::of(prop::collection::vec(any::<usize>(), 0..6)),
        prop::bool::ANY,
        prop::option::of(prop::collection::vec(
            prop::collection::vec(prop::collection::vec(any::<u32>(), 0..4), 0..4),
            0..4,
        )),
    )
        .prop_map(
            |(sequences, k, temperature, start, starts, logits, ids)| TopkRequest {
                sequences,
                k,
                temperature,
                start,
                starts,
                values: if logits {
                    ValuesKind::Logits
                } else {
                    ValuesKind::Logprobs
                },
                ids,
            },
        )
}

/// Equality that treats NaN temperatures as equal (a NaN never equals itself).
fn same(a: &TopkRequest, b: &TopkRequest) -> bool {
    let t = a.temperature.to_bits() == b.temperature.to_bits()
        || (a.temperature.is_nan() && b.temperature.is_nan());
    let mut b2 = b.clone();
    b2.temperature = a.temperature;
    t && *a == b2
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = decode_request(Format::Json, &bytes);
        let _ = decode_request(Format::Msgpack, &bytes);
    }

    #[test]
    fn structured_requests_round_trip_and_mutations_never_panic(
        req in request(),
        cut in any::<prop::sample::Index>(),
        flip in any::<prop::sample::Index>(),
        byte in any::<u8>(),
    ) {
        let packed = encode_request(Format::Msgpack, &req).unwrap();
        let back = decode_request(Format::Msgpack, &packed).unwrap();
        prop_assert!(same(&req, &back), "{req:?} vs {back:?}");
        if req.temperature.is_finite() {
            let json = encode_request(Format::Json, &req).unwrap();
            let back = decode_request(Format::Json, &json).unwrap();
            prop_assert!(same(&req, &back));
            let mut m = json.clone();
            let i = flip.index(m.len());
            m[i] = byte;
            let _ = decode_request(Format::Json, &m);
            let _ = decode_request(Format::Json, &json[..cut.index(json.len())]);
        }
        // A truncated MessagePack body is an error (never a panic, never a shorter request).
        let n = cut.index(packed.len());
        prop_assert!(decode_request(Format::Msgpack, &packed[..n]).is_err());
        let mut m = packed.clone();
        let i = flip.index(m.len());
        m[i] = byte;
        let _ = decode_request(Format::Msgpack, &m);
    }
}
