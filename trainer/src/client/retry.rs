//! Pure pieces of the retry policy: backoff with jitter, `Retry-After` parsing, replica choice.

use std::time::{Duration, Instant};

/// Longest `Retry-After` taken literally (a day); longer values are capped.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(86_400);

/// Delay before the retry that follows `failures` earlier failures (0 for the first retry):
/// `min(initial · 2^failures, max)`, scaled by `0.5 + 0.5 · u` for jitter (`u` uniform in
/// [0, 1)), so that many trainers do not retry in lockstep.
pub fn backoff_delay(failures: u32, initial: Duration, max: Duration, u: f64) -> Duration {
    let exp = initial.as_secs_f64() * 2f64.powi(failures.min(62) as i32);
    let capped = exp.min(max.as_secs_f64());
    Duration::from_secs_f64(capped * (0.5 + 0.5 * u.clamp(0.0, 1.0)))
}

/// `Retry-After` as a delay: delta-seconds (`"3"`; decimals accepted). HTTP dates are not
/// supported (the caller falls back to its backoff).
pub fn parse_retry_after(v: &str) -> Option<Duration> {
    let secs: f64 = v.trim().parse().ok()?;
    if !secs.is_finite() || secs < 0.0 {
        return None;
    }
    // Capped before the conversion, which panics from 2^64 s on (`Retry-After: 1e20`).
    Some(Duration::from_secs_f64(
        secs.min(MAX_RETRY_AFTER.as_secs_f64()),
    ))
}

/// The replica for the next attempt: the first whose `not_before` has passed, scanning from
/// `cursor` in round-robin order; else the one ready soonest. Returns (index, when).
pub(crate) fn pick(not_before: &[Instant], cursor: usize, now: Instant) -> (usize, Instant) {
    let n = not_before.len();
    let mut best = (cursor % n, not_before[cursor % n]);
    for i in 0..n {
        let j = (cursor + i) % n;
        if not_before[j] <= now {
            return (j, now);
        }
        if not_before[j] < best.1 {
            best = (j, not_before[j]);
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_caps_and_jitters_within_half() {
        let (i, m) = (Duration::from_millis(100), Duration::from_secs(1));
        // u = 1: no reduction.
        let full: Vec<u128> = (0..6)
            .map(|f| backoff_delay(f, i, m, 1.0).as_millis())
            .collect();
        assert_eq!(full, [100, 200, 400, 800, 1000, 1000]);
        // u = 0: half.
        assert_eq!(backoff_delay(2, i, m, 0.0).as_millis(), 200);
        assert_eq!(backoff_delay(1000, i, m, 0.5), Duration::from_millis(750));
    }

    #[test]
    fn retry_after_seconds() {
        assert_eq!(parse_retry_after("2"), Some(Duration::from_secs(2)));
        assert_eq!(
            parse_retry_after(" 0.25 "),
            Some(Duration::from_millis(250))
        );
        assert_eq!(parse_retry_after("-1"), None);
        assert_eq!(parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT"), None);
        assert_eq!(parse_retry_after("1e9"), Some(MAX_RETRY_AFTER));
        // Past Duration's range (2^64 s): capped, not a panic.
        assert_eq!(parse_retry_after("1e20"), Some(MAX_RETRY_AFTER));
        assert_eq!(parse_retry_after("1e308"), Some(MAX_RETRY_AFTER));
        assert_eq!(parse_retry_after("inf"), None);
        assert_eq!(parse_retry_after("NaN"), None);
    }

    #[test]
    fn pick_prefers_ready_replicas_in_order() {
        let now = Instant::now();
        let later = |ms| now + Duration::from_millis(ms);
        assert_eq!(pick(&[now, now, now], 1, now), (1, now));
        assert_eq!(pick(&[now, later(50), now], 1, now), (2, now));
        assert_eq!(
            pick(&[later(30), later(10), later(20)], 0, now),
            (1, later(10))
        );
        assert_eq!(pick(&[later(10)], 5, now), (0, later(10)));
    }
}
