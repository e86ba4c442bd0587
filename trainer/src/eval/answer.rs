//! Answer extraction and comparison for GSM8K-style tasks (`... #### 72`).
//!
//! Rules (see `docs/evaluation.md`):
//! 1. **Strict**: the first number after the *last* `####` in the text.
//! 2. **Fallback**: otherwise the last number anywhere in the text.
//!
//! A number is an optional sign (`-`, `+`, or the unicode minus `−`), an optional currency sign
//! (`$ € £`), digits with optional thousands separators (`1,234`; groups of exactly three) and an
//! optional decimal part. A sign only counts when it is not preceded by a digit or letter (`10-3`
//! is `10` and `3`, `= -3` is `-3`). Digits glued to a preceding letter are part of a word, not a
//! number (`x2`, `abc123`). Numbers are returned in a canonical form: no sign on zero, no leading
//! zeros, no trailing fractional zeros, no separators (`+5.0` → `5`, `-0` → `0`, `1,234.50` →
//! `1234.5`), so two canonical strings are equal exactly when the numbers are equal.

/// Which rule produced an extracted answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AnswerSource {
    /// The first number after the last `####`.
    Marker,
    /// The last number in the text (no `####`, or no number after it).
    LastNumber,
}

/// An extracted answer in canonical form and the rule that found it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Extracted {
    pub value: String,
    pub source: AnswerSource,
}

/// The answer of `text` in canonical numeric form, or `None` when the text holds no number.
pub fn extract_answer(text: &str) -> Option<String> {
    extract_answer_detailed(text).map(|e| e.value)
}

/// As [`extract_answer`], also saying which rule matched (the `####` format-following rate is a
/// useful training signal on its own).
pub fn extract_answer_detailed(text: &str) -> Option<Extracted> {
    if let Some(pos) = text.rfind("####") {
        let tail = &text[pos + 4..];
        if let Some(n) = numbers(tail).into_iter().next() {
            return Some(Extracted {
                value: n,
                source: AnswerSource::Marker,
            });
        }
    }
    numbers(text).pop().map(|n| Extracted {
        value: n,
        source: AnswerSource::LastNumber,
    })
}

/// True when `pred` and `gold` are the same answer: numerically (canonical forms equal) when both
/// parse as a number, else equal as trimmed, case-insensitive strings.
pub fn answers_match(pred: &str, gold: &str) -> bool {
    match (normalize_number(pred), normalize_number(gold)) {
        (Some(a), Some(b)) => a == b,
        _ => pred.trim().to_lowercase() == gold.trim().to_lowercase(),
    }
}

/// Canonical form of `s` when the whole string (trimmed, with a trailing `.` allowed) is one
/// number: `" $1,234.50. "` → `1234.5`. `None` otherwise.
pub fn normalize_number(s: &str) -> Option<String> {
    let t = s.trim();
    let t = t.strip_suffix('.').unwrap_or(t).trim_end();
    let chars: Vec<char> = t.chars().collect();
    let (value, end) = parse_number_at(&chars, 0)?;
    (end == chars.len()).then_some(value)
}

/// Every number in `text`, in order, canonical.
pub fn numbers(text: &str) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let starts_here = is_sign(chars[i]) || is_currency(chars[i]) || chars[i].is_ascii_digit();
        // A number cannot start inside a word or in the middle of another number.
        let prev_ok = i == 0 || !(chars[i - 1].is_alphanumeric() || chars[i - 1] == '.');
        if starts_here && prev_ok {
            if let Some((value, end)) = parse_number_at(&chars, i) {
                out.push(value);
                i = end;
                continue;
            }
        }
        i += 1;
    }
    out
}

fn is_sign(c: char) -> bool {
    matches!(c, '-' | '+' | '\u{2212}')
}

fn is_currency(c: char) -> bool {
    matches!(c, '$' | '€' | '£')
}

/// Parses `[sign][currency][sign]digits[,ddd]*[.digits]` at `start`; returns the canonical value
/// and the index after the number. A trailing `.` not followed by a digit is not consumed.
fn parse_number_at(chars: &[char], start: usize) -> Option<(String, usize)> {
    let mut i = start;
    let mut negative = false;
    let mut take_sign = |i: &mut usize| {
        if *i < chars.len() && is_sign(chars[*i]) {
            if chars[*i] != '+' {
                negative = !negative;
            }
            *i += 1;
            true
        } else {
            false
        }
    };
    let had_sign = take_sign(&mut i);
    if i < chars.len() && is_currency(chars[i]) {
        i += 1;
        if !had_sign {
            take_sign(&mut i); // "$-5"
        }
    }
    // Integer part: digits, then ",ddd" groups only when the first run has 1..=3 digits.
    let int_start = i;
    while i < chars.len() && chars[i].is_ascii_digit() {
        i += 1;
    }
    if i == int_start {
        return None;
    }
    let mut int_digits: String = chars[int_start..i].iter().collect();
    if int_digits.len() <= 3 {
        while chars.get(i) == Some(&',')
            && i + 3 < chars.len()
            && chars[i + 1..i + 4].iter().all(|c| c.is_ascii_digit())
            && !chars.get(i + 4).is_some_and(|c| c.is_ascii_digit())
        {
            int_digits.extend(&chars[i + 1..i + 4]);
            i += 4;
        }
    }
    let mut frac_digits = String::new();
    if i + 1 < chars.len() && chars[i] == '.' && chars[i + 1].is_ascii_digit() {
        i += 1;
        while i < chars.len() && chars[i].is_ascii_digit() {
            frac_digits.push(chars[i]);
            i += 1;
        }
    }
    Some((canonical(negative, &int_digits, &frac_digits), i))
}

/// `-`, integer digits, fraction digits → canonical decimal string.
fn canonical(negative: bool, int_digits: &str, frac_digits: &str) -> String {
    let int = int_digits.trim_start_matches('0');
    let frac = frac_digits.trim_end_matches('0');
    let int = if int.is_empty() { "0" } else { int };
    let is_zero = int == "0" && frac.is_empty();
    let mut s = String::new();
    if negative && !is_zero {
        s.push('-');
    }
    s.push_str(int);
    if !frac.is_empty() {
        s.push('.');
        s.push_str(frac);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ex(s: &str) -> Option<String> {
        extract_answer(s)
    }

    #[test]
    fn marker_takes_the_last_one() {
        assert_eq!(ex("first #### 3 then\n#### 72"), Some("72".into()));
        assert_eq!(
            extract_answer_detailed("#### 72").map(|e| e.source),
            Some(AnswerSource::Marker)
        );
        // The first number after the last marker, not the last number of the text.
        assert_eq!(ex("#### 12 apples, not 13"), Some("12".into()));
    }

    #[test]
    fn marker_without_number_falls_back() {
        let e = extract_answer_detailed("so 4+5=9 and #### ").unwrap();
        assert_eq!(e.value, "9");
        assert_eq!(e.source, AnswerSource::LastNumber);
        assert_eq!(ex("####"), None);
        assert_eq!(ex("#### unknown"), None);
    }

    #[test]
    fn negatives_signs_and_unicode_minus() {
        assert_eq!(ex("#### -5"), Some("-5".into()));
        assert_eq!(ex("#### \u{2212}5"), Some("-5".into()));
        assert_eq!(ex("#### +5"), Some("5".into()));
        assert_eq!(ex("#### -0"), Some("0".into()));
        assert_eq!(ex("#### -0.00"), Some("0".into()));
        // A minus between digits is subtraction, not a sign.
        assert_eq!(ex("10-3"), Some("3".into()));
        assert_eq!(ex("x = -3"), Some("-3".into()));
        assert_eq!(ex("#### -$5"), Some("-5".into()));
        assert_eq!(ex("#### $-5"), Some("-5".into()));
    }

    #[test]
    fn commas_decimals_currency_punctuation() {
        assert_eq!(ex("#### 1,234"), Some("1234".into()));
        assert_eq!(ex("#### $1,234,567.50."), Some("1234567.5".into()));
        assert_eq!(ex("The answer is 5."), Some("5".into()));
        assert_eq!(ex("#### 5.0"), Some("5".into()));
        assert_eq!(ex("#### 007"), Some("7".into()));
        assert_eq!(ex("#### 0.50"), Some("0.5".into()));
        assert_eq!(ex("#### €3"), Some("3".into()));
        assert_eq!(ex("#### 50%"), Some("50".into()));
        // A list is several numbers, not one with separators.
        assert_eq!(ex("1,2,3"), Some("3".into()));
        assert_eq!(ex("5, 6"), Some("6".into()));
        // Groups of other than three digits are not thousands separators.
        assert_eq!(ex("12,34"), Some("34".into()));
        assert_eq!(ex("1234,567"), Some("567".into()));
        // Version-like strings: the second dot ends the number.
        assert_eq!(numbers("1.2.3"), vec!["1.2".to_string()]);
    }

    #[test]
    fn no_number_and_numbers_inside_words() {
        assert_eq!(ex(""), None);
        assert_eq!(ex("no digits here."), None);
        assert_eq!(ex("abc123def"), None);
        assert_eq!(ex("step x2 gives 7"), Some("7".into()));
        assert_eq!(ex("7 then step2"), Some("7".into()));
        // Followed by letters is fine (units, ordinals).
        assert_eq!(ex("#### 5kg"), Some("5".into()));
        assert_eq!(numbers("the 2nd and 3rd"), vec!["2", "3"]);
    }

    #[test]
    fn matching_is_numeric() {
        assert!(answers_match("5.0", "5"));
        assert!(answers_match("-0", "0"));
        assert!(answers_match("+5", "5"));
        assert!(answers_match("1,234", "1234"));
        assert!(answers_match(" $1,234. ", "1234"));
        assert!(!answers_match("5", "50"));
        assert!(!answers_match("0.5", "5"));
        assert!(!answers_match("-5", "5"));
        // Non-numbers compare as trimmed strings.
        assert!(answers_match(" Yes", "yes"));
        assert!(!answers_match("yes", "5"));
        // Long integers compare exactly (no f64 rounding).
        assert!(!answers_match(
            "12345678901234567891",
            "12345678901234567890"
        ));
        assert_eq!(normalize_number("5 apples"), None);
    }

    #[test]
    fn gsm8k_gold_solutions() {
        let gold = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n\
                    Natalia sold 48+24 = <<48+24=72>>72 clips altogether.\n#### 72";
        assert_eq!(ex(gold), Some("72".into()));
        let gold = "she earned 0.2 x 50 = $<<0.2*50=10>>10.\n#### 10";
        assert_eq!(ex(gold), Some("10".into()));
    }
}
