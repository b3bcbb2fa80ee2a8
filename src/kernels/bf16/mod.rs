//! bfloat16 for `dtype = "bfloat16"` training: the [`Bf16`] type and the rounding and
//! widening passes (here), the choice of the bf16 products' kernel and what follows
//! from it ([`backend`]), the bf16 matmuls on it ([`gemm`]), the packed operand layout ([`pack`]) that the AMX-BF16 kernel ([`amx`])
//! and the AVX512-BF16 kernel ([`dpbf16`]) read, and, with the `onednn` feature,
//! oneDNN's bf16 matmul (`onednn`).
//!
//! bf16 is the top half of an IEEE f32: sign, 8 exponent bits, 7 mantissa bits. Every
//! bf16 value is exactly an f32, and the product of two bf16 values is exact in f32
//! (8 + 8 significant bits fit in 24), so a GEMM over bf16-rounded f32 operands with
//! f32 accumulation computes what a bf16 GEMM with f32 accumulation computes, up to
//! the summation order. That is how matmuls run where the CPU has no AMX, and for
//! small products (see [`gemm`]).
//!
//! Rounding from f32 is round-to-nearest-even; NaN stays NaN (quiet), infinities and
//! signed zeros are kept, subnormals round like any other value (bf16 has f32's
//! exponent range, so it has the same subnormals, with fewer mantissa bits), and
//! values that round past the largest finite bf16 become infinity.

pub mod amx;
pub mod backend;
pub mod dpbf16;
pub mod gemm;
#[cfg(feature = "onednn")]
pub mod onednn;
pub mod pack;
pub mod products;
#[cfg(test)]
mod testcases;

pub use backend::{Backend, Kernel};

use super::fastmath::{simd_fn, Simd};
use rayon::prelude::*;

/// A bfloat16 number, stored as its bit pattern.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct Bf16(pub u16);

impl Bf16 {
    /// The nearest bf16 to `x` (ties to even). Branch-free (the NaN case is a
    /// select), so loops over it vectorise.
    #[inline(always)]
    pub fn from_f32(x: f32) -> Bf16 {
        let bits = x.to_bits();
        // NaN: keep the sign and the top payload bits; force a quiet NaN so the
        // truncated payload can never read as infinity.
        let nan = ((bits >> 16) as u16) | 0x0040;
        // Add 0x7FFF plus the lowest kept bit: halfway cases carry only when the kept
        // part is odd (ties to even); a carry out of the mantissa bumps the exponent,
        // which is the correct rounding, up to infinity.
        let lsb = (bits >> 16) & 1;
        let rounded = (bits.wrapping_add(0x7FFF + lsb) >> 16) as u16;
        Bf16(if x.is_nan() { nan } else { rounded })
    }

    #[inline(always)]
    pub fn to_f32(self) -> f32 {
        f32::from_bits((self.0 as u32) << 16)
    }
}

impl From<Bf16> for f32 {
    fn from(x: Bf16) -> f32 {
        x.to_f32()
    }
}

/// `x` rounded to the nearest bf16, as an f32.
#[inline(always)]
pub fn round(x: f32) -> f32 {
    Bf16::from_f32(x).to_f32()
}

/// `x`, or `x` rounded to bf16 when `ROUND`: for element-wise kernels whose output
/// is a matmul operand (bf16 autocast rounds every one; doing it there saves a pass).
#[inline(always)]
pub fn round_if<const ROUND: bool>(x: f32) -> f32 {
    if ROUND {
        round(x)
    } else {
        x
    }
}

/// Elements per parallel task: large enough that rayon's overhead is invisible.
const TASK: usize = 1 << 14;

// The passes below are compiled for AVX-512, AVX2 and the baseline (`simd_fn`), and
// run on the widest the CPU has: the same integer rounding in every lane, so the
// results are the scalar [`Bf16::from_f32`]'s bit for bit.

simd_fn! {
    fn round_lanes(x: &mut [f32]) {
        x.iter_mut().for_each(|v| *v = round(*v));
    }
}

simd_fn! {
    fn round_into_lanes(dst: &mut [f32], src: &[f32]) {
        dst.iter_mut().zip(src).for_each(|(d, &s)| *d = round(s));
    }
}

simd_fn! {
    fn store_lanes(dst: &mut [Bf16], src: &[f32]) {
        dst.iter_mut().zip(src).for_each(|(d, &s)| *d = Bf16::from_f32(s));
    }
}

simd_fn! {
    fn round_and_store_lanes(x: &mut [f32], dst: &mut [Bf16]) {
        for (x, d) in x.iter_mut().zip(dst) {
            *d = Bf16::from_f32(*x);
            *x = d.to_f32();
        }
    }
}

simd_fn! {
    fn load_lanes(dst: &mut [f32], src: &[Bf16]) {
        dst.iter_mut().zip(src).for_each(|(d, s)| *d = s.to_f32());
    }
}

/// Rounds every element of `x` to bf16 in place (the values stay f32).
pub fn round_in_place(x: &mut [f32]) {
    let _t = crate::profile::scope(crate::profile::Section::Bf16Round);
    let simd = Simd::detect();
    x.par_chunks_mut(TASK).for_each(|x| round_lanes(simd, x));
}

/// [`round_in_place`] on the calling thread, untimed: for kernels that round their
/// output a row at a time while it is in cache.
#[inline]
pub fn round_slice(x: &mut [f32]) {
    round_lanes(Simd::detect(), x);
}

/// `dst = round(src)`, both f32.
pub fn round_into(dst: &mut [f32], src: &[f32]) {
    let _t = crate::profile::scope(crate::profile::Section::Bf16Round);
    assert_eq!(dst.len(), src.len(), "round_into: lengths differ");
    let simd = Simd::detect();
    dst.par_chunks_mut(TASK)
        .zip(src.par_chunks(TASK))
        .for_each(|(d, s)| round_into_lanes(simd, d, s));
}

/// `dst = bf16(src)`.
pub fn store(dst: &mut [Bf16], src: &[f32]) {
    let _t = crate::profile::scope(crate::profile::Section::Bf16Round);
    assert_eq!(dst.len(), src.len(), "store: lengths differ");
    let simd = Simd::detect();
    dst.par_chunks_mut(TASK)
        .zip(src.par_chunks(TASK))
        .for_each(|(d, s)| store_lanes(simd, d, s));
}

/// Rounds `x` to bf16 in place and stores the same values in `dst`.
pub fn round_and_store(x: &mut [f32], dst: &mut [Bf16]) {
    let _t = crate::profile::scope(crate::profile::Section::Bf16Round);
    assert_eq!(dst.len(), x.len(), "round_and_store: lengths differ");
    let simd = Simd::detect();
    x.par_chunks_mut(TASK)
        .zip(dst.par_chunks_mut(TASK))
        .for_each(|(x, d)| round_and_store_lanes(simd, x, d));
}

/// `dst = f32(src)` (exact).
pub fn load(dst: &mut [f32], src: &[Bf16]) {
    let _t = crate::profile::scope(crate::profile::Section::Bf16Round);
    assert_eq!(dst.len(), src.len(), "load: lengths differ");
    let simd = Simd::detect();
    dst.par_chunks_mut(TASK)
        .zip(src.par_chunks(TASK))
        .for_each(|(d, s)| load_lanes(simd, d, s));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bits(x: f32) -> u16 {
        Bf16::from_f32(x).0
    }

    #[test]
    fn exact_values_round_trip() {
        for x in [0.0f32, -0.0, 1.0, -2.5, 0.15625, 3.0e38, f32::MIN_POSITIVE] {
            let r = round(x);
            assert_eq!(r.to_bits() & 0xFFFF, 0, "{x} is not a bf16");
            if x.to_bits() & 0xFFFF == 0 {
                assert_eq!(r.to_bits(), x.to_bits(), "{x} changed");
            }
        }
        assert_eq!(bits(-0.0), 0x8000);
        assert_eq!(bits(1.0), 0x3F80);
    }

    #[test]
    fn rounds_to_nearest_and_ties_to_even() {
        // 1.0 = 0x3F80_0000; one bf16 ulp at 1.0 is 2^-7.
        let f = f32::from_bits;
        assert_eq!(bits(f(0x3F80_7FFF)), 0x3F80, "below half: down");
        assert_eq!(bits(f(0x3F80_8000)), 0x3F80, "tie, even kept part: down");
        assert_eq!(bits(f(0x3F81_8000)), 0x3F82, "tie, odd kept part: up");
        assert_eq!(bits(f(0x3F80_8001)), 0x3F81, "above half: up");
        assert_eq!(bits(f(0xBF80_8001)), 0xBF81, "negative: away from zero");
        // Mantissa carry into the exponent: 1.9999 → 2.0.
        assert_eq!(bits(f(0x3FFF_FFFF)), 0x4000);
        // Against a slow reference: nearest of the two neighbours, ties to even.
        let mut s = 0x1234_5678u32;
        for _ in 0..100_000 {
            s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            let x = f(s);
            if !x.is_finite() {
                continue;
            }
            let lo = f32::from_bits(s & 0xFFFF_0000);
            let hi = f32::from_bits((s & 0xFFFF_0000).wrapping_add(0x1_0000));
            // Past the largest finite value, the next step up is ±2^128 (infinity).
            let hi64 = match hi.is_infinite() {
                true => 2f64.powi(128).copysign(x as f64),
                false => hi as f64,
            };
            let (dl, dh) = ((x as f64 - lo as f64).abs(), (hi64 - x as f64).abs());
            let want = if dl < dh || (dl == dh && (s >> 16) & 1 == 0) {
                lo
            } else {
                hi
            };
            assert_eq!(round(x).to_bits(), want.to_bits(), "{x:e} ({s:#x})");
        }
    }

    #[test]
    fn nan_inf_overflow_and_subnormals() {
        assert!(round(f32::NAN).is_nan());
        // A signalling NaN whose payload lives only in the low bits stays NaN.
        let low_payload = f32::from_bits(0x7F80_0001);
        assert!(low_payload.is_nan() && round(low_payload).is_nan());
        assert!(round(-f32::NAN).is_sign_negative());
        assert_eq!(round(f32::INFINITY), f32::INFINITY);
        assert_eq!(round(f32::NEG_INFINITY), f32::NEG_INFINITY);
        // f32::MAX is above the largest bf16 (0x7F7F) by more than half an ulp.
        assert_eq!(round(f32::MAX), f32::INFINITY);
        assert_eq!(bits(f32::from_bits(0x7F7F_7FFF)), 0x7F7F, "largest finite");
        // Subnormals: the smallest bf16 subnormal is 2^-133 (bits 0x0001).
        let tiny = f32::from_bits(0x0001_0000);
        assert_eq!(bits(tiny), 0x0001);
        assert_eq!(
            bits(f32::from_bits(0x0000_8000)),
            0x0000,
            "half of it: tie to 0"
        );
        assert_eq!(bits(f32::from_bits(0x0000_8001)), 0x0001);
        assert_eq!(bits(f32::from_bits(0x8000_0001)), 0x8000, "to -0");
        // The largest subnormal rounds up to the smallest normal.
        assert_eq!(bits(f32::from_bits(0x007F_FFFF)), 0x0080);
    }

    /// Rounding with branches, as it was first written: the reference for the
    /// branch-free, vectorised conversions.
    fn branchy_bits(x: f32) -> u16 {
        let bits = x.to_bits();
        if x.is_nan() {
            return ((bits >> 16) as u16) | 0x0040;
        }
        let lsb = (bits >> 16) & 1;
        (bits.wrapping_add(0x7FFF + lsb) >> 16) as u16
    }

    /// Values that exercise every path: ties both ways, carries into the exponent and
    /// to infinity, NaNs with payloads only in the low bits, subnormals, zeros, then
    /// random bit patterns; an odd count, so the vector loops have a tail.
    fn awkward_values() -> Vec<f32> {
        let mut v: Vec<u32> = vec![
            0x3F80_8000,
            0x3F81_8000,
            0x3F80_7FFF,
            0x3FFF_FFFF,
            0x7F7F_FFFF,
            0xFF7F_FFFF,
            0x7F80_0000,
            0xFF80_0000,
            0x7F80_0001,
            0xFF80_0001,
            0x7FC0_0000,
            0x7FFF_FFFF,
            0x0000_8000,
            0x0000_8001,
            0x007F_FFFF,
            0x8000_0001,
            0x0000_0000,
            0x8000_0000,
        ];
        let mut s = 0x9E37_79B9u32;
        for _ in 0..10_001 {
            s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            v.push(s);
        }
        v.into_iter().map(f32::from_bits).collect()
    }

    #[test]
    fn every_simd_level_rounds_like_the_branchy_scalar_code() {
        let src = awkward_values();
        let want: Vec<u16> = src.iter().map(|&x| branchy_bits(x)).collect();
        let want_f32: Vec<u32> = want.iter().map(|&b| (b as u32) << 16).collect();
        let f32_bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for simd in Simd::available() {
            let mut x = src.clone();
            round_lanes(simd, &mut x);
            assert_eq!(f32_bits(&x), want_f32, "{simd:?} round");
            let mut d = vec![f32::NAN; src.len()];
            round_into_lanes(simd, &mut d, &src);
            assert_eq!(f32_bits(&d), want_f32, "{simd:?} round_into");
            let mut h = vec![Bf16::default(); src.len()];
            store_lanes(simd, &mut h, &src);
            assert_eq!(
                h.iter().map(|b| b.0).collect::<Vec<_>>(),
                want,
                "{simd:?} store"
            );
            let mut both = src.clone();
            let mut h2 = vec![Bf16::default(); src.len()];
            round_and_store_lanes(simd, &mut both, &mut h2);
            assert_eq!(
                (f32_bits(&both), &h2),
                (want_f32.clone(), &h),
                "{simd:?} both"
            );
            let mut back = vec![f32::NAN; src.len()];
            load_lanes(simd, &mut back, &h);
            assert_eq!(f32_bits(&back), want_f32, "{simd:?} load");
        }
    }

    #[test]
    fn slice_conversions_match_the_scalar_ones() {
        let src: Vec<f32> = (0..40_000).map(|i| (i as f32 * 0.37).sin() * 3.1).collect();
        let mut h = vec![Bf16::default(); src.len()];
        store(&mut h, &src);
        let mut back = vec![0.0; src.len()];
        load(&mut back, &h);
        let mut rounded = vec![0.0; src.len()];
        round_into(&mut rounded, &src);
        let mut in_place = src.clone();
        round_in_place(&mut in_place);
        let mut both = src.clone();
        let mut h2 = vec![Bf16::default(); src.len()];
        round_and_store(&mut both, &mut h2);
        assert_eq!(h2, h);
        assert_eq!(both, in_place);
        for i in 0..src.len() {
            let want = round(src[i]);
            assert_eq!(back[i], want);
            assert_eq!(rounded[i], want);
            assert_eq!(in_place[i], want);
            assert!((want - src[i]).abs() <= src[i].abs() * 2f32.powi(-8));
        }
    }
}
