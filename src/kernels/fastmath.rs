//! Branch-free math for the element-wise kernels, written so that loops over it
//! vectorise, and the run-time choice of instruction set for those loops.

/// Exponent below which [`exp_fast`] returns exactly zero (`e^-86 ≈ 4.5e-38`), so that
/// its results are never subnormal.
pub(crate) const EXP_MIN: f32 = -86.0;

/// `a·b + c`, fused if `fma`.
#[inline(always)]
pub(crate) fn fmadd(fma: bool, a: f32, b: f32, c: f32) -> f32 {
    if fma {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// `e^x` to within about 2 ulp, branch-free so that loops over it vectorise; exactly
/// `0` for `x < EXP_MIN` (including `-inf`).
#[inline(always)]
pub(crate) fn exp_fast(fma: bool, x: f32) -> f32 {
    // e^x = 2^n · e^f with n = round(x / ln 2) and |f| <= ln(2) / 2.
    const ROUND: f32 = 12_582_912.0; // 1.5 · 2^23: adding it rounds to an integer
    const LN2_HI: f32 = 0.693_359_4; // few mantissa bits: n · LN2_HI is exact
    const LN2_LO: f32 = -2.121_944_4e-4;
    let xc = x.clamp(EXP_MIN, 88.0);
    let shifted = fmadd(fma, xc, std::f32::consts::LOG2_E, ROUND);
    let n = shifted - ROUND;
    let f = fmadd(fma, -n, LN2_LO, fmadd(fma, -n, LN2_HI, xc));
    // Taylor series of e^f to degree 7: truncation error below 1e-8 for |f| <= 0.35.
    let mut p = 1.0 / 5040.0;
    for coef in [720.0, 120.0, 24.0, 6.0, 2.0, 1.0, 1.0] {
        p = fmadd(fma, p, f, 1.0 / coef);
    }
    // The low bits of `shifted` hold n (|n| <= 127), so 2^n is built from them directly.
    let n_int = (shifted.to_bits() as i32).wrapping_sub(0x4B40_0000);
    let pow2 = f32::from_bits((n_int + 127).wrapping_shl(23) as u32);
    if x < EXP_MIN {
        0.0
    } else {
        p * pow2
    }
}

/// Whether this CPU has AVX2 and FMA (checked once; the std macro caches it).
#[inline]
pub(crate) fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The instruction sets the element-wise passes are compiled for, as proof that the
/// CPU has one: made only by [`Simd::detect`] (and, in tests, [`Simd::available`]),
/// so a kernel given a `Simd` may run the code compiled for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Simd(Level);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Level {
    /// Baseline x86-64 (SSE2), or any other architecture.
    Portable,
    /// AVX2 with FMA.
    Avx2,
    /// AVX-512 (F, BW, VL) with AVX2 and FMA.
    Avx512,
}

impl Simd {
    /// The widest level this CPU runs (the std macro caches the CPU's answer).
    #[inline]
    pub(crate) fn detect() -> Simd {
        #[cfg(target_arch = "x86_64")]
        {
            let avx512 = is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl");
            if has_avx2_fma() {
                return Simd(if avx512 { Level::Avx512 } else { Level::Avx2 });
            }
        }
        Simd(Level::Portable)
    }

    /// Every level this CPU runs, narrowest first: for tests that check each
    /// compilation of a pass against the portable one.
    #[cfg(test)]
    pub(crate) fn available() -> Vec<Simd> {
        let all = [Level::Portable, Level::Avx2, Level::Avx512];
        let top = Simd::detect().0;
        let n = all.iter().position(|&l| l == top).unwrap_or(0) + 1;
        all[..n].iter().map(|&l| Simd(l)).collect()
    }

    pub(crate) fn level(self) -> Level {
        self.0
    }
}

/// Defines `fn name(simd: Simd, args...)` that runs `body` compiled for `simd`'s
/// instruction set: the same source, so the same IEEE operations in the same order
/// (Rust never contracts `a * b + c` into an FMA by itself), hence bit-identical
/// results on every level; only the vector width differs. Non-generic functions only.
macro_rules! simd_fn {
    ($(#[$m:meta])* $vis:vis fn $name:ident($($a:ident: $t:ty),* $(,)?) $(-> $r:ty)? $body:block) => {
        $(#[$m])*
        $vis fn $name(simd: $crate::kernels::fastmath::Simd, $($a: $t),*) $(-> $r)? {
            #[inline(always)]
            fn body($($a: $t),*) $(-> $r)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
                fn avx512($($a: $t),*) $(-> $r)? { body($($a),*) }
                #[target_feature(enable = "avx2,fma")]
                fn avx2($($a: $t),*) $(-> $r)? { body($($a),*) }
                use $crate::kernels::fastmath::Level;
                match simd.level() {
                    // SAFETY: a `Simd` of this level is only made where the CPU has
                    // these features (`Simd::detect`).
                    Level::Avx512 => return unsafe { avx512($($a),*) },
                    // SAFETY: as above.
                    Level::Avx2 => return unsafe { avx2($($a),*) },
                    Level::Portable => {}
                }
            }
            let _ = simd;
            body($($a),*)
        }
    };
}
pub(crate) use simd_fn;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_fast_is_accurate() {
        for fma in [false, true] {
            for i in -2000..=2000 {
                let x = i as f32 * 0.0437;
                let got = exp_fast(fma, x) as f64;
                let want = (x as f64).exp();
                if x < EXP_MIN {
                    assert_eq!(got, 0.0);
                } else {
                    assert!(
                        (got - want).abs() <= 3e-7 * want,
                        "exp({x}) = {got}, want {want}"
                    );
                }
            }
        }
        assert_eq!(exp_fast(false, f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_fast(false, 0.0), 1.0);
    }
}
