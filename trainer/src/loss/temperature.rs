//! The distillation temperature τ as a type: checked once where it enters the trainer (the
//! config's `[loss]`, a test, an example), so the losses take it without checking it again.

use serde::{Deserialize, Deserializer, Serialize};

/// A temperature outside `(0, ∞)`.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
#[error("temperature must be finite and > 0, got {0}")]
pub struct BadTemperature(pub f64);

/// A distillation temperature τ: finite and > 0. Both sides' logits are divided by τ and the
/// loss multiplied by τ². Serialises as the plain number; deserialising checks the range.
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd, Serialize)]
#[serde(transparent)]
pub struct Temperature(f64);

impl Temperature {
    /// τ = 1: the logits as they are.
    pub const ONE: Temperature = Temperature(1.0);

    /// `value` as a temperature, or the error naming it when it is not finite and > 0.
    pub fn new(value: f64) -> Result<Temperature, BadTemperature> {
        if value.is_finite() && value > 0.0 {
            Ok(Temperature(value))
        } else {
            Err(BadTemperature(value))
        }
    }

    /// The value τ.
    pub fn get(self) -> f64 {
        self.0
    }
}

impl Default for Temperature {
    fn default() -> Self {
        Temperature::ONE
    }
}

impl TryFrom<f64> for Temperature {
    type Error = BadTemperature;
    fn try_from(value: f64) -> Result<Self, Self::Error> {
        Temperature::new(value)
    }
}

impl std::fmt::Display for Temperature {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl<'de> Deserialize<'de> for Temperature {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Temperature::new(f64::deserialize(d)?).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Serialize, Deserialize, PartialEq)]
    struct Section {
        temperature: Temperature,
    }

    #[test]
    fn accepts_positive_finite_and_rejects_the_rest() {
        for v in [1.0, 0.1, 2.0, 1e-30, 1e30] {
            let t = Temperature::new(v).unwrap();
            assert_eq!(t.get(), v);
            assert_eq!(t.to_string(), v.to_string());
        }
        assert_eq!(Temperature::ONE.get(), 1.0);
        assert_eq!(Temperature::default(), Temperature::ONE);
        for v in [0.0, -0.0, -1.0, f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            let e = Temperature::new(v).unwrap_err();
            assert_eq!(
                e.to_string(),
                format!("temperature must be finite and > 0, got {v}")
            );
        }
        assert!(Temperature::try_from(-2.5).is_err());
    }

    #[test]
    fn serde_is_the_plain_number_and_checks_the_range() {
        let s = Section {
            temperature: Temperature::new(2.5).unwrap(),
        };
        let text = toml::to_string(&s).unwrap();
        assert_eq!(text.trim(), "temperature = 2.5");
        assert_eq!(toml::from_str::<Section>(&text).unwrap(), s);
        assert_eq!(serde_json::to_string(&s).unwrap(), r#"{"temperature":2.5}"#);
        for bad in [
            "temperature = 0.0",
            "temperature = -1.0",
            "temperature = nan",
            "temperature = inf",
        ] {
            let e = toml::from_str::<Section>(bad).unwrap_err().to_string();
            assert!(
                e.contains("temperature must be finite and > 0"),
                "{bad}: {e}"
            );
        }
        let e = serde_json::from_str::<Section>(r#"{"temperature":0}"#).unwrap_err();
        assert!(e.to_string().contains("got 0"), "{e}");
    }
}
