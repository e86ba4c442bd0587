//! Vocabulary projection on real tokenizers: exact rows one-hot, other rows spell the token,
//! weights follow 0.9·0.1^i, save/load round trip, cache keyed by both tokenizer hashes.

use std::collections::HashSet;
use std::path::Path;
use xdistill_testkit::tokenizer_json;
use xdistill_trainer::align::projection::{Csr, ProjectionMaps};
use xdistill_trainer::align::AlignTokenizer;

/// Checks one direction against the two byte tables, with references computed here.
fn check_direction(m: &Csr, src: &AlignTokenizer, dst: &AlignTokenizer, max: usize, what: &str) {
    let (sb, db) = (&src.bytes, &dst.bytes);
    assert_eq!(m.rows(), sb.vocab_size(), "{what}");
    // Reference set of the destination's ordinary token byte strings.
    let dst_set: HashSet<&[u8]> = (0..db.vocab_size() as u32)
        .filter(|&i| !db.is_special(i))
        .filter_map(|i| db.raw_bytes(i))
        .collect();
    let (mut exact, mut multi) = (0, 0);
    for r in 0..m.rows() {
        let (ids, w) = m.row(r);
        let Some(bytes) = sb.raw_bytes(r as u32) else {
            assert!(ids.is_empty());
            continue;
        };
        if sb.is_special(r as u32) {
            // Specials map only to a special with the same content.
            for &i in ids {
                assert!(
                    db.is_special(i) && db.raw_bytes(i) == Some(bytes),
                    "{what} row {r}"
                );
            }
            continue;
        }
        assert!(ids.len() <= max, "{what} row {r}");
        if dst_set.contains(bytes) {
            // Identical byte string on the other side: one-hot, weight exactly 1.
            assert_eq!(ids.len(), 1, "{what} row {r} {bytes:?}");
            assert_eq!(w, &[1.0], "{what} row {r}");
            assert_eq!(db.raw_bytes(ids[0]), Some(bytes), "{what} row {r}");
            exact += 1;
            continue;
        }
        if bytes.is_empty() {
            continue;
        }
        assert!(!ids.is_empty(), "{what} row {r} {bytes:?} is empty");
        // The first entry starts the token; every entry is a piece of it.
        let piece = |i: u32| db.raw_bytes(i).unwrap();
        assert!(bytes.starts_with(piece(ids[0])), "{what} row {r}");
        for &i in ids {
            assert!(
                bytes.windows(piece(i).len()).any(|x| x == piece(i)),
                "{what} row {r}"
            );
        }
        // Without repeated pieces the entries spell the token's start (all of it when it fits).
        let spelled: Vec<u8> = ids.iter().flat_map(|&i| piece(i).to_vec()).collect();
        // Weights: sum to 1, and when the ids are distinct, equal 0.9·0.1^i / Σ (f64 reference).
        let sum: f64 = w.iter().map(|&x| x as f64).sum();
        assert!((sum - 1.0).abs() < 1e-6, "{what} row {r}: sum {sum}");
        let distinct = ids.iter().collect::<HashSet<_>>().len() == ids.len();
        if distinct && spelled == bytes {
            let raw: Vec<f64> = (0..ids.len())
                .map(|i| 0.9 * 0.1f64.powi(i as i32))
                .collect();
            let z: f64 = raw.iter().sum();
            for (k, &x) in w.iter().enumerate() {
                assert!((x as f64 - raw[k] / z).abs() < 1e-6, "{what} row {r}");
            }
        }
        multi += 1;
    }
    assert!(
        exact > 1000 && multi > 10,
        "{what}: exact {exact}, multi {multi}"
    );
}

#[test]
fn cross_family_projection_is_sparse_and_spells_tokens() {
    let s = AlignTokenizer::from_file(&tokenizer_json("llama2")).unwrap();
    let t = AlignTokenizer::from_file(&tokenizer_json("llama3")).unwrap();
    let p = ProjectionMaps::build(&s, &t, 4, "s".into(), "t".into()).unwrap();
    check_direction(&p.student_to_teacher, &s, &t, 4, "llama2->llama3");
    check_direction(&p.teacher_to_student, &t, &s, 4, "llama3->llama2");
    // A known row: Llama 2's "▁Hello" is " Hello", one Llama 3 token ("ĠHello").
    let hello = s.tokenizer.token_to_id("▁Hello").unwrap();
    let (ids, w) = p.student_to_teacher.row(hello as usize);
    assert_eq!(
        (ids, w),
        (
            &[t.tokenizer.token_to_id("ĠHello").unwrap()][..],
            &[1.0f32][..]
        )
    );

    // Save / load round trip through a file.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("p.safetensors");
    p.save(&path).unwrap();
    assert_eq!(ProjectionMaps::load(&path).unwrap(), p);
    std::fs::write(&path, b"not a projection").unwrap();
    assert!(ProjectionMaps::load(&path).is_err());
}

#[test]
fn cache_is_reused_only_for_the_same_tokenizers() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let a = tokenizer_json("llama2");
    // A copy with different bytes (an extra newline) is the same vocabulary, another hash.
    let b = dir.path().join("tokenizer.json");
    let mut text = std::fs::read(&a).unwrap();
    text.push(b'\n');
    std::fs::write(&b, &text).unwrap();
    let tok = AlignTokenizer::from_file(&a).unwrap();
    let load = |b: &Path| ProjectionMaps::load_or_build(&cache, (&a, &tok), (b, &tok), 2).unwrap();

    let (p1, built) = load(&b);
    assert!(built);
    let (p2, built) = load(&b);
    assert!(!built, "second call must load from the cache");
    assert_eq!(p1, p2);
    // Same vocabulary on both sides: every ordinary row is exact.
    assert!(p1.s2t_exact > 31_000);
    // Another teacher file: rebuilt, cached under another name.
    text.push(b'\n');
    std::fs::write(&b, &text).unwrap();
    let (p3, built) = load(&b);
    assert!(built);
    assert_ne!(p3.teacher_sha256, p1.teacher_sha256);
    assert_eq!(std::fs::read_dir(&cache).unwrap().count(), 2);
    // A corrupt cache file is rebuilt, not trusted.
    let path = ProjectionMaps::cache_path(&cache, &p3.student_sha256, &p3.teacher_sha256, 2);
    std::fs::write(&path, b"garbage").unwrap();
    let (p4, built) = load(&b);
    assert!(built);
    assert_eq!(p4, p3);
}
