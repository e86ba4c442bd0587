//! What a loss divides by instead of its own valid count, as a type: made once from a step's
//! global count where the step meets the loss, so the losses take it without checking it again.

/// A normalizer outside `(0, ∞)`: a step with no valid units cannot normalise a loss.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
#[error("invalid loss input `normalizer`: must be a positive count, got {0}")]
pub struct BadNormalizer(pub f64);

/// The global count of valid units (tokens, or chunks across tokenizers) of an accumulated
/// batch that a loss divides its sum by: finite and > 0.
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd)]
pub struct Normalizer(f64);

impl Normalizer {
    /// 1: the loss's sum as it is.
    pub const ONE: Normalizer = Normalizer(1.0);

    /// `count` as a normalizer, or the error naming it when it is not finite and > 0.
    pub fn new(count: f64) -> Result<Normalizer, BadNormalizer> {
        if count.is_finite() && count > 0.0 {
            Ok(Normalizer(count))
        } else {
            Err(BadNormalizer(count))
        }
    }

    /// The count.
    pub fn get(self) -> f64 {
        self.0
    }
}

impl TryFrom<f64> for Normalizer {
    type Error = BadNormalizer;
    fn try_from(count: f64) -> Result<Self, Self::Error> {
        Normalizer::new(count)
    }
}

impl From<BadNormalizer> for super::LossError {
    fn from(e: BadNormalizer) -> Self {
        super::LossError::input(
            "normalizer",
            format!("must be a positive count, got {}", e.0),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_positive_counts_and_rejects_the_rest() {
        for v in [1.0, 0.5, 7.0, 1e12] {
            assert_eq!(Normalizer::new(v).unwrap().get(), v);
        }
        for v in [0.0, -0.0, -3.0, f64::NAN, f64::INFINITY] {
            let e = Normalizer::new(v).unwrap_err();
            assert_eq!(
                e.to_string(),
                format!("invalid loss input `normalizer`: must be a positive count, got {v}")
            );
            assert_eq!(super::super::LossError::from(e).to_string(), e.to_string());
        }
        assert!(Normalizer::try_from(-1.0).is_err());
    }
}
