pub trait Float:
    Copy
    + Send
    + Sync
    + PartialOrd
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
{
    fn zero() -> Self;
    fn to_f64(self) -> f64;
    fn from_f64(v: f64) -> Self;
    /// The row's largest value.
    fn row_max(x: &[Self]) -> Self;
    /// `Σ e^{x_i − m}` (m ≥ every x_i), accumulated in f64.
    fn sum_exp(x: &[Self], m: Self) -> f64;
    /// `out_i = scale · e^{x_i − shift}` (shift ≥ every x_i).
    fn exp_scaled(x: &[Self], shift: Self, scale: Self, out: &mut [Self]);
}

impl Float for f64 {
    fn zero() -> Self {
        0.0
    }
    fn to_f64(self) -> f64 {
        self
    }
    fn from_f64(v: f64) -> Self {
        v
    }
    fn row_max(x: &[Self]) -> Self {
        x.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b))
    }
    fn sum_exp(x: &[Self], m: Self) -> f64 {
        x.iter().map(|&v| (v - m).exp()).sum()
    }
    fn exp_scaled(x: &[Self], shift: Self, scale: Self, out: &mut [Self]) {
        for (o, &v) in out.iter_mut().zip(x) {
            *o = (v - shift).exp() * scale;
        }
    }
}

impl Float for f32 {
    fn zero() -> Self {
        0.0
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn from_f64(v: f64) -> Self {
        v as f32
    }
    fn row_max(x: &[Self]) -> Self {
        crate::vmath::max(x)
    }
    fn sum_exp(x: &[Self], m: Self) -> f64 {
        crate::vmath::sum_exp(x, m)
    }
    fn exp_scaled(x: &[Self], shift: Self, scale: Self, out: &mut [Self]) {
        crate::vmath::exp_scaled(x, shift, scale, out)
    }
}
