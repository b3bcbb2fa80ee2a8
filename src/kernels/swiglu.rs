//! SwiGLU, the MLP activation of Llama and Qwen: `h = silu(gate) · up` with
//! `silu(g) = g · σ(g)`, where `gate` and `up` are the two halves of one fused
//! projection (`gate_proj` and `up_proj` stacked), so the MLP is
//! `down(silu(gate(x)) · up(x))`.
//!
//! Shapes: `gate_up` (N, 2I), gate in channels `[0, I)` of each row and up in
//! `[I, 2I)`; `h` (N, I).

use super::bf16;
use super::fastmath::{exp_fast, has_avx2_fma};
use super::gelu::Input;
use rayon::prelude::*;

/// Rows per parallel task.
const ROWS: usize = 8;

/// `σ(g)`.
#[inline(always)]
fn sigmoid(fma: bool, g: f32) -> f32 {
    1.0 / (1.0 + exp_fast(fma, -g))
}

/// [`swiglu_forward`] on some rows.
#[inline(always)]
fn forward_rows<const FMA: bool, const ROUND: bool, X: Input>(
    h: &mut [f32],
    gate_up: &[X],
    i: usize,
) {
    for (h, gu) in h.chunks_exact_mut(i).zip(gate_up.chunks_exact(2 * i)) {
        let (gate, up) = gu.split_at(i);
        for ((h, &g), &u) in h.iter_mut().zip(gate).zip(up) {
            let g = g.get();
            *h = bf16::round_if::<ROUND>(g * sigmoid(FMA, g) * u.get());
        }
    }
}

/// [`swiglu_backward`] on some rows: `d(gate) = dh · u · σ(g)·(1 + g·(1 − σ(g)))`,
/// `d(up) = dh · silu(g)`.
#[inline(always)]
fn backward_rows<const FMA: bool, const ROUND: bool, X: Input>(
    dgate_up: &mut [f32],
    dh: &[f32],
    gate_up: &[X],
    i: usize,
) {
    let rows = dgate_up.chunks_exact_mut(2 * i).zip(dh.chunks_exact(i));
    for ((dgu, dh), gu) in rows.zip(gate_up.chunks_exact(2 * i)) {
        let ((dgate, dup), (gate, up)) = (dgu.split_at_mut(i), gu.split_at(i));
        let pairs = dgate.iter_mut().zip(dup).zip(dh);
        for (((dg, du), &dh), (&g, &u)) in pairs.zip(gate.iter().zip(up)) {
            let (g, u) = (g.get(), u.get());
            let s = sigmoid(FMA, g);
            *dg = bf16::round_if::<ROUND>(dh * u * (s * (1.0 + g * (1.0 - s))));
            *du = bf16::round_if::<ROUND>(dh * (g * s));
        }
    }
}

/// The row loops compiled for AVX2 + FMA, chosen at run time.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::Input;

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn forward<const ROUND: bool, X: Input>(h: &mut [f32], gate_up: &[X], i: usize) {
        super::forward_rows::<true, ROUND, X>(h, gate_up, i)
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn backward<const ROUND: bool, X: Input>(
        dgate_up: &mut [f32],
        dh: &[f32],
        gate_up: &[X],
        i: usize,
    ) {
        super::backward_rows::<true, ROUND, X>(dgate_up, dh, gate_up, i)
    }
}

/// `h = silu(gate) · up`, row by row; with `BF16` the output is rounded to bf16 (it is
/// the down projection's operand). `gate_up` may be f32 or bf16 (bf16 autocast may
/// keep the projection's output in two bytes).
///
/// h: (N, I); gate_up: (N, 2I).
pub fn swiglu_forward<const BF16: bool, X: Input>(h: &mut [f32], gate_up: &[X], i: usize) {
    let _t = crate::profile::scope(crate::profile::Section::Activation);
    assert!(i > 0 && h.len().is_multiple_of(i) && gate_up.len() == 2 * h.len());
    let avx2 = has_avx2_fma();
    h.par_chunks_mut(ROWS * i)
        .zip(gate_up.par_chunks(ROWS * 2 * i))
        .for_each(|(h, gu)| {
            #[cfg(target_arch = "x86_64")]
            if avx2 {
                // SAFETY: the CPU has AVX2 and FMA (checked by has_avx2_fma).
                return unsafe { x86::forward::<BF16, X>(h, gu, i) };
            }
            let _ = avx2;
            forward_rows::<false, BF16, X>(h, gu, i)
        });
}

/// Backward of [`swiglu_forward`]: `dgate_up` (N, 2I) **overwritten** with the
/// gradients of gate and up for the output gradient `dh` (N, I); with `BF16` rounded
/// to bf16 (they are the fused projection's output gradient, a bf16 matmul operand).
pub fn swiglu_backward<const BF16: bool, X: Input>(
    dgate_up: &mut [f32],
    dh: &[f32],
    gate_up: &[X],
    i: usize,
) {
    let _t = crate::profile::scope(crate::profile::Section::Activation);
    assert!(i > 0 && dh.len().is_multiple_of(i));
    assert!(gate_up.len() == 2 * dh.len() && dgate_up.len() == gate_up.len());
    let avx2 = has_avx2_fma();
    dgate_up
        .par_chunks_mut(ROWS * 2 * i)
        .zip(dh.par_chunks(ROWS * i))
        .zip(gate_up.par_chunks(ROWS * 2 * i))
        .for_each(|((dgu, dh), gu)| {
            #[cfg(target_arch = "x86_64")]
            if avx2 {
                // SAFETY: the CPU has AVX2 and FMA (checked by has_avx2_fma).
                return unsafe { x86::backward::<BF16, X>(dgu, dh, gu, i) };
            }
            let _ = avx2;
            backward_rows::<false, BF16, X>(dgu, dh, gu, i)
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::bf16::{load, round_in_place, store, Bf16};
    use crate::kernels::testutil::*;

    fn reference(gu: &[f64], i: usize) -> Vec<f64> {
        gu.chunks(2 * i)
            .flat_map(|row| {
                let (gate, up) = row.split_at(i);
                gate.iter()
                    .zip(up)
                    .map(|(&g, &u)| g / (1.0 + (-g).exp()) * u)
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    #[test]
    fn matches_reference_and_finite_differences() {
        // 13 rows (a partial task) of I = 37 (a vector tail), gates over a wide range.
        let (n, i) = (13, 37);
        let gu: Vec<f32> = rand_vec(n * 2 * i, 1).iter().map(|v| 6.0 * v).collect();
        let dh = rand_vec(n * i, 2);
        let gu64 = to_f64(&gu);
        let mut h = vec![f32::NAN; n * i];
        swiglu_forward::<false, f32>(&mut h, &gu, i);
        assert_close("h", &h, &reference(&gu64, i), 1e-5, 1e-6);
        let mut dgu = vec![f32::NAN; gu.len()];
        swiglu_backward::<false, f32>(&mut dgu, &dh, &gu, i);
        let want = numeric_grad(|v| dot(&reference(v, i), &dh), &gu64, 1e-6);
        assert_close("dgate_up", &dgu, &want, 1e-4, 1e-5);
        // The portable loops agree (the dispatch may pick AVX2).
        let mut portable = vec![f32::NAN; n * i];
        forward_rows::<false, false, f32>(&mut portable, &gu, i);
        assert_close("h (portable)", &portable, &reference(&gu64, i), 1e-5, 1e-6);
        let mut dportable = vec![f32::NAN; gu.len()];
        backward_rows::<false, false, f32>(&mut dportable, &dh, &gu, i);
        assert_close("dgate_up (portable)", &dportable, &want, 1e-4, 1e-5);
    }

    #[test]
    fn bf16_variants_equal_widen_then_swiglu_then_round_bit_for_bit() {
        let (n, i) = (20, 24);
        let gu: Vec<f32> = rand_vec(n * 2 * i, 3).iter().map(|v| 5.0 * v).collect();
        let dh = rand_vec(n * i, 4);
        let mut gub = vec![Bf16::default(); gu.len()];
        store(&mut gub, &gu);
        let mut wide = vec![0.0; gu.len()];
        load(&mut wide, &gub);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();

        let mut want = vec![0.0; n * i];
        swiglu_forward::<false, f32>(&mut want, &wide, i);
        round_in_place(&mut want);
        let mut got = vec![f32::NAN; n * i];
        swiglu_forward::<true, Bf16>(&mut got, &gub, i);
        assert_eq!(bits(&got), bits(&want));

        let mut want = vec![0.0; gu.len()];
        swiglu_backward::<false, f32>(&mut want, &dh, &wide, i);
        round_in_place(&mut want);
        let mut got = vec![f32::NAN; gu.len()];
        swiglu_backward::<true, Bf16>(&mut got, &dh, &gub, i);
        assert_eq!(bits(&got), bits(&want));
        let mut unrounded = vec![0.0; gu.len()];
        swiglu_backward::<false, Bf16>(&mut unrounded, &dh, &gub, i);
        assert_ne!(
            bits(&unrounded),
            bits(&want),
            "rounding changed some values"
        );
    }

    #[test]
    fn matches_transformers() {
        let f = LlamaFixture::load();
        let (gu, dh) = (f.f32("swiglu.gate_up"), f.f32("swiglu.dh"));
        let i = 44; // the script's intermediate size
        assert_eq!(dh.len() % i, 0);
        let mut h = vec![f32::NAN; dh.len()];
        swiglu_forward::<false, f32>(&mut h, &gu, i);
        assert_close("h", &h, &f.f64("swiglu.h"), 1e-5, 1e-7);
        let mut dgu = vec![f32::NAN; gu.len()];
        swiglu_backward::<false, f32>(&mut dgu, &dh, &gu, i);
        assert_close("dgate_up", &dgu, &f.f64("swiglu.dgate_up"), 1e-5, 1e-7);
    }
}
