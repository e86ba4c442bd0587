//! A student's first mistake, and whether the teacher still knows the way after it.
//!
//! On-policy distillation asks the teacher about the student's own samples, and a weak student's
//! samples go wrong early: past the first wrong digit every prefix is one the teacher never saw
//! in training (it saw correct worked solutions only). This module
//!
//! - finds the digits of a worked completion that are *computed* (a column's sum after `=`, the
//!   carry, the answer after `####`) rather than copied from the question,
//! - makes the mistake: one computed digit replaced by another, the rest of the completion
//!   still the correct one ([`corrupt`]),
//! - measures a model's top-1 next-token accuracy on the computed digits that follow the
//!   mistake, against the same positions without it ([`after_mistake`]): does the teacher still
//!   put the right digit first, or does it follow the mistake?
//! - writes the teacher's corrected-prefix records ([`corrected_records`]): a prompt that ends
//!   in a mistaken prefix, the correct rest of the solution as the completion, so that a teacher
//!   trained on them learns to continue correctly after a student's mistake.

use crate::task::TaskRecord;
use anyhow::{Context, Result};
use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// Byte positions of the computed digits of a worked completion: every digit of a digit run that
/// follows `=`, `carry ` (or `borrow `) or `#### `.
pub fn computed_digits(completion: &str) -> Vec<usize> {
    let b = completion.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if !b[i].is_ascii_digit() {
            i += 1;
            continue;
        }
        let start = i;
        while i < b.len() && b[i].is_ascii_digit() {
            i += 1;
        }
        let before = &completion[..start];
        if ["=", "carry ", "borrow ", "#### "]
            .iter()
            .any(|m| before.ends_with(m))
        {
            out.extend(start..i);
        }
    }
    out
}

/// A completion with one computed digit made wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mistake {
    /// The completion up to and including the wrong digit.
    pub prefix: String,
    /// The correct completion after the wrong digit.
    pub rest: String,
    /// Byte position of the wrong digit in the completion.
    pub at: usize,
}

/// Replaces the computed digit at `digits[pick]` of `completion` by a different digit chosen
/// by `rng`; `None` when the completion has no computed digit.
pub fn corrupt(completion: &str, rng: &mut ChaCha8Rng) -> Option<Mistake> {
    let digits = computed_digits(completion);
    if digits.is_empty() {
        return None;
    }
    let at = digits[rng.random_range(0..digits.len())];
    let right = completion.as_bytes()[at] - b'0';
    let wrong = (right + rng.random_range(1..10u8)) % 10;
    Some(Mistake {
        prefix: format!("{}{}", &completion[..at], wrong),
        rest: completion[at + 1..].to_string(),
        at,
    })
}

/// Teacher records that start from a mistaken prefix: prompt = the question and the completion
/// up to and including one wrong digit, completion = the correct rest. One per record of
/// `records` (seeded); a record whose wrong digit leaves only whitespace after it (the last
/// answer digit before the end marker) is skipped: SFT data needs a non-blank completion.
pub fn corrected_records(records: &[TaskRecord], seed: u64) -> Vec<TaskRecord> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    records
        .iter()
        .filter_map(|r| {
            let m = corrupt(&r.completion, &mut rng)?;
            (!m.rest.trim().is_empty()).then(|| TaskRecord {
                prompt: format!("{}{}", r.prompt, m.prefix),
                completion: m.rest,
                answer: r.answer.clone(),
            })
        })
        .collect()
}

/// Top-1 next-token accuracy of a model on the computed digits that follow a mistake, and on
/// the same digits of the uncorrupted text.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct AfterMistake {
    /// Share of the scored digits whose correct token is the model's top-1 after the mistake.
    pub after_mistake_top1: f64,
    /// The same digits without the mistake (the teacher's home ground).
    pub clean_top1: f64,
    /// Digits scored (each once in each condition).
    pub digits: usize,
    /// Records with at least one computed digit after the mistake.
    pub records: usize,
}

/// The model's top-1 token at every position of `text` whose token starts at one of the byte
/// offsets in `at` (the offsets index `text`); `None` for an offset no token starts at.
fn top1_at(
    model: &xdistill_shared::model::Decoder,
    tok: &tokenizers::Tokenizer,
    text: &str,
    at: &[usize],
) -> Result<Vec<Option<(u32, u32)>>> {
    let enc = tok
        .encode(text, true)
        .map_err(|e| anyhow::anyhow!("tokenizing {text:?}: {e}"))?;
    let ids = enc.get_ids();
    let input = Tensor::new(ids, &Device::Cpu)?.unsqueeze(0)?;
    // [1, T, V] → top-1 id per position.
    let best: Vec<u32> = model.forward(&input)?.squeeze(0)?.argmax(1)?.to_vec1()?;
    let offsets = enc.get_offsets();
    Ok(at
        .iter()
        .map(|&byte| {
            let t = offsets.iter().position(|o| o.0 == byte && o.1 > o.0)?;
            // The prediction for token t is made at position t - 1.
            (t > 0).then(|| (best[t - 1], ids[t]))
        })
        .collect())
}

/// Measures [`AfterMistake`] of the model in `model_dir` on `records` (one seeded mistake per
/// record; only the computed digits after it are scored).
pub fn after_mistake(model_dir: &Path, records: &[TaskRecord], seed: u64) -> Result<AfterMistake> {
    let (model, tok) =
        xdistill_trainer::eval::load_model(model_dir, &Device::Cpu, candle_core::DType::F32)
            .with_context(|| format!("loading {}", model_dir.display()))?;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (mut hits_after, mut hits_clean, mut n, mut used) = (0usize, 0usize, 0usize, 0usize);
    for r in records {
        let Some(m) = corrupt(&r.completion, &mut rng) else {
            continue;
        };
        let later: Vec<usize> = computed_digits(&r.completion)
            .into_iter()
            .filter(|&p| p > m.at)
            .map(|p| r.prompt.len() + p)
            .collect();
        if later.is_empty() {
            continue;
        }
        let clean = format!("{}{}", r.prompt, r.completion);
        let wrong = format!("{}{}{}", r.prompt, m.prefix, m.rest);
        let a = top1_at(&model, &tok, &wrong, &later)?;
        let c = top1_at(&model, &tok, &clean, &later)?;
        let mut scored = false;
        for (a, c) in a.into_iter().zip(c) {
            // Both texts put the same digit at the same byte: score only where both
            // tokenizations start a token there.
            let (Some((pa, ta)), Some((pc, tc))) = (a, c) else {
                continue;
            };
            hits_after += (pa == ta) as usize;
            hits_clean += (pc == tc) as usize;
            n += 1;
            scored = true;
        }
        used += scored as usize;
    }
    Ok(AfterMistake {
        after_mistake_top1: hits_after as f64 / n.max(1) as f64,
        clean_top1: hits_clean as f64 / n.max(1) as f64,
        digits: n,
        records: used,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::task::{Op, Problem};

    #[test]
    fn computed_digits_are_sums_carries_and_the_answer() {
        // " 7+8=15, carry 1. 4+3+1=8. #### 85"
        let c = Problem {
            op: Op::Add,
            a: 47,
            b: 38,
        }
        .worked();
        assert_eq!(c, " 7+8=15, carry 1. 4+3+1=8. #### 85");
        let got: String = computed_digits(&c)
            .iter()
            .map(|&i| c.as_bytes()[i] as char)
            .collect();
        // 15, the carry 1, 8, the answer 85; never the operands 7, 8, 4, 3 or the added 1.
        assert_eq!(got, "151885");
        assert_eq!(computed_digits(" no digits here"), Vec::<usize>::new());
    }

    #[test]
    fn a_mistake_changes_exactly_one_computed_digit() {
        let c = " 7+8=15, carry 1. 4+3+1=8. #### 85";
        let digits = computed_digits(c);
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        for _ in 0..50 {
            let m = corrupt(c, &mut rng).unwrap();
            assert!(digits.contains(&m.at));
            let text = format!("{}{}", m.prefix, m.rest);
            assert_eq!(text.len(), c.len());
            let diff: Vec<usize> = (0..c.len())
                .filter(|&i| text.as_bytes()[i] != c.as_bytes()[i])
                .collect();
            assert_eq!(diff, [m.at]);
            assert!(text.as_bytes()[m.at].is_ascii_digit());
            assert_eq!(&c[m.at + 1..], m.rest);
        }
        assert_eq!(corrupt(" none", &mut rng), None);
    }

    #[test]
    fn corrected_records_continue_correctly_after_the_mistake() {
        let r = Problem {
            op: Op::Add,
            a: 47,
            b: 38,
        }
        .record();
        let out = corrected_records(&vec![r.clone(); 20], 3);
        assert!(!out.is_empty() && out.len() <= 20);
        for x in &out {
            // The question is kept, the prompt ends in the wrong digit, and prompt + completion
            // differ from the correct text in exactly that digit.
            assert!(x.prompt.starts_with(&r.prompt));
            let full = format!("{}{}", x.prompt, x.completion);
            let right = format!("{}{}", r.prompt, r.completion);
            let diff = (0..full.len())
                .filter(|&i| full.as_bytes()[i] != right.as_bytes()[i])
                .count();
            assert_eq!(diff, 1);
            assert!(right.ends_with(&x.completion));
            assert_eq!(x.answer, r.answer);
        }
    }
}
