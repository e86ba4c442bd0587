//! Property tests: random Unicode strings align exactly for all 20 ordered tokenizer pairs.

use crate::align_common::{check_pair, get, pairs};
use proptest::prelude::*;
use xdistill_trainer::align::{tokenize_pair, PairOptions};

/// Characters from the classes that break aligners: ASCII, whitespace runs, digits, accents and
/// combining marks, CJK, emoji with modifiers and ZWJ, the SentencePiece `▁`, and any char.
fn atom() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-zA-Z]{1,6}",
        "[ \t\n\r]{1,4}",
        "[0-9]{1,7}",
        "[.,;:!?'\"()<>|=*#-]{1,3}",
        "[àéîõüñçÅØß]{1,3}",
        "[aeo][\u{300}-\u{36f}]{1,2}",
        "[\u{4e00}-\u{9fff}]{1,4}",
        "[\u{3040}-\u{30ff}]{1,3}",
        "[\u{1f300}-\u{1faff}][\u{1f3fb}-\u{1f3ff}]?",
        Just("👨\u{200d}👩\u{200d}👧".to_string()),
        Just("\u{2581}".to_string()),
        Just("<|im_start|>".to_string()),
        Just("<s>".to_string()),
        any::<char>().prop_map(String::from),
    ]
}

fn text() -> impl Strategy<Value = String> {
    prop::collection::vec(atom(), 0..24).prop_map(|v| v.concat())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn random_unicode_aligns_for_every_pair(t in text(), add_special in any::<bool>()) {
        for (sn, tn) in pairs() {
            let (s, tk) = (get(sn), get(tn));
            let opts = PairOptions { add_special_tokens: add_special, ..PairOptions::default() };
            let p = tokenize_pair(&t, s, tk, opts);
            prop_assert!(p.is_ok(), "{sn}->{tn} {t:?}: {:?}", p.err());
            if let Ok(p) = p {
                check_pair(&p, s, tk, &format!("{sn}->{tn} {t:?}"));
            }
        }
    }

    #[test]
    fn truncated_pairs_stay_aligned(t in text(), ms in 1usize..30, mt in 1usize..30) {
        for (sn, tn) in pairs() {
            let (s, tk) = (get(sn), get(tn));
            let opts = PairOptions {
                max_student_tokens: Some(ms),
                max_teacher_tokens: Some(mt),
                ..PairOptions::default()
            };
            let p = tokenize_pair(&t, s, tk, opts);
            prop_assert!(p.is_ok(), "{sn}->{tn} {t:?}: {:?}", p.err());
            if let Ok(p) = p {
                prop_assert!(p.student_ids.len() <= ms && p.teacher_ids.len() <= mt);
                if !p.text.contains('\u{fffd}') {
                    check_pair(&p, s, tk, &format!("{sn}->{tn} {t:?} max {ms}/{mt}"));
                }
            }
        }
    }
}
