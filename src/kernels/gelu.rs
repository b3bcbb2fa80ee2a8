//! GELU, GPT-2's tanh approximation: `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`.

use super::bf16::{self, Bf16};
use super::fastmath::{exp_fast, fmadd, has_avx2_fma};
use rayon::prelude::*;

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const COEF: f32 = 0.044_715;
const CHUNK: usize = 4096;

// `0.5·(1 + tanh(u)) = sigmoid(2u)`, so `gelu(x) = x · sigmoid(2u)` with
// `u = √(2/π)·(x + 0.044715·x³)`; this form keeps full relative precision in both
// tails. Its derivative is `s + 2·x·s·(1 − s)·u'` with `s = sigmoid(2u)`.

/// `sigmoid(2u)` and `u'(x)`.
#[inline(always)]
fn sigmoid_2u(fma: bool, x: f32) -> (f32, f32) {
    let x2 = x * x;
    let u = SQRT_2_OVER_PI * fmadd(fma, COEF * x2, x, x);
    let s = 1.0 / (1.0 + exp_fast(fma, -2.0 * u));
    (s, SQRT_2_OVER_PI * fmadd(fma, 3.0 * COEF, x2, 1.0))
}

/// An element GELU reads: f32, or bf16 (bf16 autocast keeps the pre-GELU layer in
/// two bytes; reading it here saves widening it into a scratch first).
pub trait Input: Copy + Send + Sync {
    fn get(self) -> f32;
}

impl Input for f32 {
    #[inline(always)]
    fn get(self) -> f32 {
        self
    }
}

impl Input for Bf16 {
    #[inline(always)]
    fn get(self) -> f32 {
        self.to_f32()
    }
}

#[inline(always)]
fn forward_chunk<const FMA: bool, const ROUND: bool, X: Input>(out: &mut [f32], inp: &[X]) {
    for (o, &x) in out.iter_mut().zip(inp) {
        let x = x.get();
        *o = bf16::round_if::<ROUND>(x * sigmoid_2u(FMA, x).0);
    }
}

#[inline(always)]
fn backward_chunk<const FMA: bool, const ROUND: bool, X: Input>(d: &mut [f32], inp: &[X]) {
    for (d, &x) in d.iter_mut().zip(inp) {
        let x = x.get();
        let (s, du) = sigmoid_2u(FMA, x);
        *d = bf16::round_if::<ROUND>(*d * fmadd(FMA, 2.0 * x * s * (1.0 - s), du, s));
    }
}

/// The chunk loops compiled for AVX2 + FMA, chosen at run time.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::Input;

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn forward<const ROUND: bool, X: Input>(out: &mut [f32], inp: &[X]) {
        super::forward_chunk::<true, ROUND, X>(out, inp)
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn backward<const ROUND: bool, X: Input>(d: &mut [f32], inp: &[X]) {
        super::backward_chunk::<true, ROUND, X>(d, inp)
    }
}

/// `out = gelu(inp)`, element-wise; any shape. With `BF16` the output is rounded to
/// bf16 (it is a bf16 matmul operand); `inp` may be f32 or bf16. Bit for bit what
/// widening, the f32 GELU and rounding give.
pub fn gelu_forward<const BF16: bool, X: Input>(out: &mut [f32], inp: &[X]) {
    forward_with::<BF16, X>(out, inp)
}

fn forward_with<const ROUND: bool, X: Input>(out: &mut [f32], inp: &[X]) {
    let _t = crate::profile::scope(crate::profile::Section::Activation);
    assert_eq!(out.len(), inp.len());
    let avx2 = has_avx2_fma();
    out.par_chunks_mut(CHUNK)
        .zip(inp.par_chunks(CHUNK))
        .for_each(|(o, x)| {
            #[cfg(target_arch = "x86_64")]
            if avx2 {
                // SAFETY: the CPU has AVX2 and FMA (checked by has_avx2_fma).
                return unsafe { x86::forward::<ROUND, X>(o, x) };
            }
            let _ = avx2;
            forward_chunk::<false, ROUND, X>(o, x)
        });
}

/// In place: `d` holds `dout` on entry and `dinp = gelu'(inp) · dout` on return. With
/// `BF16`, `dinp` is rounded to bf16 (it is the next matmul's operand); `inp` may be
/// f32 or bf16. Bit for bit what widening, the f32 derivative and rounding give.
pub fn gelu_backward<const BF16: bool, X: Input>(d: &mut [f32], inp: &[X]) {
    backward_with::<BF16, X>(d, inp)
}

fn backward_with<const ROUND: bool, X: Input>(d: &mut [f32], inp: &[X]) {
    let _t = crate::profile::scope(crate::profile::Section::Activation);
    assert_eq!(d.len(), inp.len());
    let avx2 = has_avx2_fma();
    d.par_chunks_mut(CHUNK)
        .zip(inp.par_chunks(CHUNK))
        .for_each(|(d, x)| {
            #[cfg(target_arch = "x86_64")]
            if avx2 {
                // SAFETY: the CPU has AVX2 and FMA (checked by has_avx2_fma).
                return unsafe { x86::backward::<ROUND, X>(d, x) };
            }
            let _ = avx2;
            backward_chunk::<false, ROUND, X>(d, x)
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::*;

    fn reference(x: &[f64]) -> Vec<f64> {
        let s = (2.0 / std::f64::consts::PI).sqrt();
        x.iter()
            .map(|&x| 0.5 * x * (1.0 + (s * (x + 0.044715 * x * x * x)).tanh()))
            .collect()
    }

    #[test]
    fn matches_reference_and_finite_differences() {
        let x: Vec<f32> = rand_vec(5000, 1).iter().map(|v| 4.0 * v).collect();
        let g = rand_vec(5000, 2);
        let x64 = to_f64(&x);
        let mut out = vec![0.0; x.len()];
        gelu_forward::<false, f32>(&mut out, &x);
        assert_close("out", &out, &reference(&x64), 1e-6, 1e-6);
        let mut dx = g.clone();
        gelu_backward::<false, f32>(&mut dx, &x);
        let want = numeric_grad(|v| dot(&reference(v), &g), &x64[..200], 1e-5);
        assert_close("dinp", &dx[..200], &want, 1e-5, 1e-6);
        // Element-wise: check the rest against per-element differences.
        let per_elem: Vec<f64> = x64
            .iter()
            .zip(&g)
            .map(|(&x, &g)| {
                let f = |v: f64| reference(&[v])[0];
                (f(x + 1e-6) - f(x - 1e-6)) / 2e-6 * g as f64
            })
            .collect();
        assert_close("dinp (all)", &dx, &per_elem, 1e-5, 1e-6);
        // The portable build of the loops agrees too (the dispatch may pick AVX2).
        let mut portable = vec![0.0; x.len()];
        forward_chunk::<false, false, f32>(&mut portable, &x);
        assert_close("out (portable)", &portable, &reference(&x64), 1e-6, 1e-6);
        let mut dportable = g.clone();
        backward_chunk::<false, false, f32>(&mut dportable, &x);
        assert_close("dinp (portable)", &dportable, &per_elem, 1e-5, 1e-6);
    }

    #[test]
    fn bf16_variants_equal_widen_then_gelu_then_round_bit_for_bit() {
        use crate::kernels::bf16::{load, round_in_place, store};
        let x: Vec<f32> = rand_vec(10_000, 3).iter().map(|v| 6.0 * v).collect();
        let g = rand_vec(x.len(), 4);
        let mut xb = vec![Bf16::default(); x.len()];
        store(&mut xb, &x);
        let mut wide = vec![0.0; x.len()];
        load(&mut wide, &xb);

        let mut want = vec![0.0; x.len()];
        gelu_forward::<false, f32>(&mut want, &wide);
        round_in_place(&mut want);
        let (mut from_bf16, mut from_f32) = (vec![f32::NAN; x.len()], vec![f32::NAN; x.len()]);
        gelu_forward::<true, Bf16>(&mut from_bf16, &xb);
        gelu_forward::<true, f32>(&mut from_f32, &wide);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&from_bf16), bits(&want));
        assert_eq!(bits(&from_f32), bits(&want));
        assert!(want
            .iter()
            .zip(&wide)
            .any(|(r, w)| *r != w * sigmoid_2u(false, *w).0));

        let mut want = g.clone();
        gelu_backward::<false, f32>(&mut want, &wide);
        round_in_place(&mut want);
        let mut got = g.clone();
        gelu_backward::<true, Bf16>(&mut got, &xb);
        assert_eq!(bits(&got), bits(&want));
        // The portable loops round the same way.
        let mut portable = g.clone();
        backward_chunk::<false, true, Bf16>(&mut portable, &xb);
        let mut plain = g.clone();
        backward_chunk::<false, false, f32>(&mut plain, &wide);
        round_in_place(&mut plain);
        assert_eq!(bits(&portable), bits(&plain));
    }
}
