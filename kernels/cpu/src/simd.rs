//! The host's vector instruction set, chosen once at start-up, and the vectorisable exp both
//! sides' hot loops use: the teacher's scoring pass (top-k, logsumexp) and the trainer's fused
//! log-softmax kernels. The build stays portable (baseline x86-64);
//! [`simd_dispatch!`](crate::simd_dispatch!) compiles one body for each [`Simd`] level and runs
//! the widest the CPU has.

/// An instruction-set level of the host, ordered narrow to wide.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Simd {
    Baseline,
    Avx2,
    Avx512,
}

impl Simd {
    /// The widest level this CPU supports.
    pub fn detect() -> Simd {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma");
            if avx2 && std::arch::is_x86_feature_detected!("avx512f") {
                return Simd::Avx512;
            }
            if avx2 {
                return Simd::Avx2;
            }
        }
        Simd::Baseline
    }

    /// The level in use: the CPU's widest, capped by `$XDISTILL_SIMD` when that is set (fixed
    /// on first use). An unreadable `$XDISTILL_SIMD` is ignored here; the binaries call
    /// [`Simd::from_env`] first so that it is refused with a clear error instead.
    pub fn current() -> Simd {
        static LEVEL: std::sync::OnceLock<Simd> = std::sync::OnceLock::new();
        *LEVEL.get_or_init(|| {
            let cap = Simd::requested().ok().flatten();
            Simd::detect().min(cap.unwrap_or(Simd::Avx512))
        })
    }

    /// The cap `$XDISTILL_SIMD` asks for (`avx512`, `avx2` or `baseline`), if set. It can only
    /// lower the level — to run or measure the narrower paths on a wider CPU, e.g. the
    /// AVX-512 LM-head and linear kernels off with `XDISTILL_SIMD=avx2`.
    pub fn requested() -> Result<Option<Simd>, SimdError> {
        match std::env::var(SIMD_ENV) {
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(v)) => Err(SimdError(format!("{v:?}"))),
            Ok(v) if v.trim().is_empty() => Ok(None),
            Ok(v) => Simd::parse(v.trim()).map(Some).ok_or(SimdError(v)),
        }
    }

    /// Checks `$XDISTILL_SIMD` and returns the level in use: what the binaries call at start.
    pub fn from_env() -> Result<Simd, SimdError> {
        Simd::requested()?;
        Ok(Simd::current())
    }

    /// The level named `name` (as [`Simd::name`] writes it).
    pub fn parse(name: &str) -> Option<Simd> {
        [Simd::Avx512, Simd::Avx2, Simd::Baseline]
            .into_iter()
            .find(|l| l.name().eq_ignore_ascii_case(name))
    }

    pub fn name(self) -> &'static str {
        match self {
            Simd::Avx512 => "avx512",
            Simd::Avx2 => "avx2",
            Simd::Baseline => "baseline",
        }
    }
}

/// The environment variable that caps the SIMD level ([`Simd::requested`]).
pub const SIMD_ENV: &str = "XDISTILL_SIMD";

/// `$XDISTILL_SIMD` names no level.
#[derive(Debug, thiserror::Error)]
#[error("XDISTILL_SIMD={0} names no SIMD level: use avx512, avx2 or baseline (it caps the CPU's own level), or unset it")]
pub struct SimdError(String);

/// Defines `fn $name(level: Simd, args…) -> ret` that runs `$body(args…)` compiled for `level`
/// (at most the CPU's own [`Simd::current`]). `$body` should be `#[inline(always)]` so that it
/// is compiled inside each level's wrapper; what it calls through a generic (`impl Fn`) it
/// passes as a closure, not as a function item, whose `Fn::call` shim is compiled without the
/// level's features. The bodies must not use `mul_add`: every level then computes the same
/// operations in the same order and the results are bit-identical.
#[macro_export]
macro_rules! simd_dispatch {
    ($vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? = $body:path) => {
        $vis fn $name(level: $crate::simd::Simd, $($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx2,fma")]
                unsafe fn avx512($($arg: $ty),*) $(-> $ret)? {
                    $body($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? {
                    $body($($arg),*)
                }
                // SAFETY: never above `Simd::current()`, the level whose features the CPU has.
                match level.min($crate::simd::Simd::current()) {
                    $crate::simd::Simd::Avx512 => return unsafe { avx512($($arg),*) },
                    $crate::simd::Simd::Avx2 => return unsafe { avx2($($arg),*) },
                    $crate::simd::Simd::Baseline => {}
                }
            }
            let _ = level;
            $body($($arg),*)
        }
    };
}

/// Coefficients `[c1, …, c5]` of `2^f - 1 = f (c1 + f (c2 + …))` on `[-1/2, 1/2]` (a
/// relative-error fit), shared by [`exp2_nonpos`] and the teacher's AVX-512 LM-head kernel.
#[allow(clippy::approx_constant)] // c1 is fitted with the others: 3 ulps below ln 2
pub const EXP2_COEFFS: [f32; 5] = [
    0.693_147,
    0.240_222_42,
    0.055_507_34,
    0.009_671_513,
    0.001_326_471_8,
];

/// `2^t` for `t ≤ 0` in f32, branch-free so that it vectorises; relative error below 2.5e-7
/// (checked against f64 in the tests). Inputs below -126 return `2^-126` (negligible in a sum).
///
/// `t = n + f` with `n = round(t)` and `|f| ≤ 1/2` exact, then `2^f` by a degree-5 polynomial
/// fitted for relative error on that interval and `2^n` through the exponent bits: about 19
/// vector operations per 16 values, against 28 for `e^x` with a two-part `ln 2` reduction.
#[inline(always)]
pub fn exp2_nonpos(t: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23: adding and subtracting it rounds to integer
    let [c1, c2, c3, c4, c5] = EXP2_COEFFS;
    let t = if t < -126.0 { -126.0 } else { t };
    let r = t + MAGIC;
    let n = r - MAGIC;
    let f = t - n;
    // The integer n sits in the low mantissa bits of r; adding the exponent bias to it gives
    // 2^n's exponent field (n ≥ -126, so 2^n is normal).
    let e = (r.to_bits() as i32).wrapping_sub(MAGIC.to_bits() as i32 - 127);
    let p = 1.0 + f * (c1 + f * (c2 + f * (c3 + f * (c4 + f * c5))));
    p * f32::from_bits((e as u32) << 23)
}

/// `e^x` for `x ≤ 0` through [`exp2_nonpos`] (one more rounding, of `x · log2 e`).
#[inline(always)]
pub fn exp_nonpos(x: f32) -> f32 {
    exp2_nonpos(x * std::f32::consts::LOG2_E)
}

/// Lanes of [`max`] and [`sum_exp2`]: one AVX-512 register (two AVX2 ones). Fixed whatever the
/// level, so every level adds the same numbers in the same order.
pub const LANES: usize = 16;

/// The largest value of `x` (NaNs ignored; -inf when empty), in [`LANES`] lanes. Inline: it is
/// compiled at the SIMD level of the caller's [`simd_dispatch!`](crate::simd_dispatch!) body.
#[inline(always)]
pub fn max(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let mut it = x.chunks_exact(LANES);
    for c in &mut it {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a = if v > *a { v } else { *a };
        }
    }
    let rest = it.remainder().iter().copied();
    acc.into_iter()
        .chain(rest)
        .fold(f32::NEG_INFINITY, f32::max)
}

/// `Σ 2^{(x_i − m)·scale2}` over `x` (every x_i ≤ m), in [`LANES`] f32 lanes, the lanes and the
/// remainder added in f64. Callers keep `x` to a few thousand values so that each lane adds at
/// most a few hundred terms ≤ 1 in f32. Inline, like [`max`].
#[inline(always)]
pub fn sum_exp2(x: &[f32], m: f32, scale2: f32) -> f64 {
    let mut acc = [0f32; LANES];
    let mut it = x.chunks_exact(LANES);
    for c in &mut it {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += exp2_nonpos((v - m) * scale2);
        }
    }
    let rest: f64 = it
        .remainder()
        .iter()
        .map(|&v| exp2_nonpos((v - m) * scale2) as f64)
        .sum();
    acc.iter().map(|&a| a as f64).sum::<f64>() + rest
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_parse_by_name_and_order_narrow_to_wide() {
        for l in [Simd::Baseline, Simd::Avx2, Simd::Avx512] {
            assert_eq!(Simd::parse(l.name()), Some(l));
        }
        assert_eq!(Simd::parse("AVX2"), Some(Simd::Avx2));
        assert_eq!(Simd::parse("sse2"), None);
        assert!(Simd::Baseline < Simd::Avx2 && Simd::Avx2 < Simd::Avx512);
        // The level in use never exceeds the CPU's.
        assert!(Simd::current() <= Simd::detect());
    }

    #[test]
    fn exp2_matches_f64() {
        let mut worst = 0f64;
        let mut x = -130.0f32;
        while x <= 0.0 {
            let want = (x as f64).max(-126.0).exp2();
            let got = exp2_nonpos(x) as f64;
            worst = worst.max((got - want).abs() / want);
            x += 0.000_37;
        }
        assert!(worst < 2.5e-7, "worst relative error {worst}");
        assert_eq!(exp2_nonpos(0.0), 1.0);
        assert_eq!(exp2_nonpos(-3.0), 0.125);
        // e^x: within the f32 rounding of x·log2(e) (≤ |x| · 6e-8 relative) of the f64 value.
        for x in [-0.0f32, -1e-3, -0.5, -1.0, -7.25, -30.0, -80.0] {
            let want = (x as f64).exp();
            let err = (exp_nonpos(x) as f64 - want).abs() / want;
            assert!(err < 2.5e-7 + x.abs() as f64 * 1.2e-7, "e^{x}: {err}");
        }
    }

    simd_dispatch!(fn sum_at(x: &[f32]) -> f32 = sum_body);

    #[inline(always)]
    fn sum_body(x: &[f32]) -> f32 {
        let mut acc = [0f32; 16];
        for c in x.chunks_exact(16) {
            for (a, &v) in acc.iter_mut().zip(c) {
                *a += exp_nonpos(-v);
            }
        }
        acc.iter().sum()
    }

    /// The dispatched levels give the same bits, and a level the CPU lacks falls back.
    #[test]
    fn levels_agree() {
        let x: Vec<f32> = (0..4096).map(|i| (i % 97) as f32 * 0.37).collect();
        let base = sum_at(Simd::Baseline, &x);
        for level in [Simd::Avx2, Simd::Avx512] {
            assert_eq!(sum_at(level, &x).to_bits(), base.to_bits(), "{level:?}");
        }
        // The level in use is the CPU's, capped by $XDISTILL_SIMD when the suite sets it.
        let cap = Simd::requested().unwrap().unwrap_or(Simd::Avx512);
        assert_eq!(Simd::current(), Simd::detect().min(cap));
    }
}
