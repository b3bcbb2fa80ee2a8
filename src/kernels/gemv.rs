//! Matrix times a few vectors, for decoding: `out = x · Wᵀ` with x (N, C) for a small
//! N (one row per sequence being decoded) and W (OC, C), f32 or bf16.
//!
//! A decoding step does little arithmetic per weight (N multiply-adds) and reads every
//! weight once, so its speed is the speed of streaming W from memory. Here the threads
//! split W by output rows, each streams its rows front to back once, and the N input
//! rows meet each task's rows of W while they are in L2. bf16 weights halve the bytes read;
//! they are widened to f32 exactly (a bf16 is the top half of an f32), and products and
//! sums stay f32.
//!
//! The dot products run on AVX-512, on AVX2 with FMA, or in portable Rust, picked once
//! per process from what the CPU offers (the tests run every variant the CPU can).

use super::bf16::Bf16;
use super::SharedMut;
use rayon::prelude::*;
use std::sync::OnceLock;

/// The weight matrix (OC, C), row-major, in its stored precision.
#[derive(Clone, Copy)]
pub enum Weights<'a> {
    F32(&'a [f32]),
    Bf16(&'a [Bf16]),
}

impl Weights<'_> {
    fn len(&self) -> usize {
        match self {
            Weights::F32(w) => w.len(),
            Weights::Bf16(w) => w.len(),
        }
    }
}

/// Output rows of W per parallel task: 64 rows of GPT-2's C = 768 are 192 KB of f32,
/// enough to hide rayon's per-task cost, small enough to balance the threads.
const TASK_ROWS: usize = 64;

thread_local! {
    /// [`gemv`] calls made from this thread.
    static CALLS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// How many [`gemv`] products this thread has run: a decoding step adds one per
/// linear layer and one for the classifier (tested).
pub fn gemv_calls_on_this_thread() -> usize {
    CALLS.get()
}

/// `out = x · Wᵀ`, or `out += x · Wᵀ` when `accumulate` (out already holds a bias).
///
/// out: (N, OC); x: (N, C); w: (OC, C). Any N works; the kernel is meant for small N
/// (decoding), where it reads W from memory once for all N rows.
///
/// # Panics
/// If the lengths do not match these shapes.
pub fn gemv(out: &mut [f32], x: &[f32], w: Weights, c: usize, accumulate: bool) {
    assert!(c > 0, "gemv: C must be at least 1");
    assert_eq!(w.len() % c, 0, "gemv: W must be (OC, C)");
    assert_eq!(x.len() % c, 0, "gemv: x must be (N, C)");
    let (oc, n) = (w.len() / c, x.len() / c);
    assert_eq!(out.len(), n * oc, "gemv: out must be (N, OC)");
    CALLS.set(CALLS.get() + 1);
    gemv_on(isa(), out, x, w, c, accumulate);
}

/// [`gemv`] on the kernels of `isa` (shapes checked by the caller).
fn gemv_on(isa: Isa, out: &mut [f32], x: &[f32], w: Weights, c: usize, accumulate: bool) {
    let oc = w.len() / c;
    let halves = isa.halves(x, c, w);
    let shared = SharedMut::new(out);
    (0..oc.div_ceil(TASK_ROWS))
        .into_par_iter()
        .for_each(|task| {
            let (j0, j1) = (task * TASK_ROWS, ((task + 1) * TASK_ROWS).min(oc));
            // The first input row streams this task's rows of W from memory; the others
            // find them in L2 (64 rows of C = 768 are 192 KB).
            for (r, xr) in x.chunks_exact(c).enumerate() {
                // SAFETY: this task alone writes columns j0..j1 of every row of out (the
                // tasks split 0..OC), so the pieces of distinct tasks are disjoint.
                let o = unsafe { shared.slice(r * oc + j0, j1 - j0) };
                let input = Input {
                    x: xr,
                    halves: halves.get(r * c..(r + 1) * c).unwrap_or(&[]),
                };
                isa.rows(o, input, w, j0, accumulate);
            }
        });
}

/// One input row, and for bf16 weights on AVX-512 its even elements then its odd ones
/// (`C / 2` each; empty otherwise).
#[derive(Clone, Copy)]
struct Input<'a> {
    x: &'a [f32],
    halves: &'a [f32],
}

/// The instruction set the dot products run on, detected once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Isa {
    Avx512,
    /// AVX2 with FMA (AMD Zen 1–3, Intel Haswell to the client cores without AVX-512).
    Avx2,
    Scalar,
}

fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| *Isa::available().first().expect("Scalar is always there"))
}

impl Isa {
    /// Every variant this CPU can run, fastest first.
    fn available() -> Vec<Isa> {
        let mut v = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f") {
                v.push(Isa::Avx512);
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                v.push(Isa::Avx2);
            }
        }
        v.push(Isa::Scalar);
        v
    }

    /// Each row of x (N, C) as the bf16 kernels read it: its `C / 2` even elements, then
    /// its `C / 2` odd ones, in C values per row (empty for f32 weights and the
    /// portable kernel). Made once per call, for every row of W.
    fn halves(self, x: &[f32], c: usize, w: Weights) -> Vec<f32> {
        if self == Isa::Scalar || matches!(w, Weights::F32(_)) {
            return Vec::new();
        }
        let h = c / 2;
        let mut out = vec![0.0; x.len()];
        for (o, x) in out.chunks_exact_mut(c).zip(x.chunks_exact(c)) {
            for (q, pair) in x.chunks_exact(2).enumerate() {
                (o[q], o[h + q]) = (pair[0], pair[1]);
            }
        }
        out
    }

    /// `out[k] (+)= x · W[j0 + k]` for the rows of W (OC, C) from j0 (out's length of them).
    fn rows(self, out: &mut [f32], input: Input, w: Weights, j0: usize, accumulate: bool) {
        let c = input.x.len();
        for (k, o) in out.iter_mut().enumerate() {
            let j = j0 + k;
            let d = self.dot(input, w, j * c..(j + 1) * c);
            *o = if accumulate { *o + d } else { d };
        }
    }

    /// x · W[row], `row` the range of W's row.
    fn dot(self, input: Input, w: Weights, row: std::ops::Range<usize>) -> f32 {
        let x = input.x;
        match (self, w) {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: Avx512 is chosen only where the CPU reports avx512f.
            (Isa::Avx512, Weights::F32(w)) => unsafe { x86::dot_f32(x, &w[row]) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above; `halves` were made for Avx512 on bf16 weights.
            (Isa::Avx512, Weights::Bf16(w)) => unsafe {
                let (even, odd) = input.halves.split_at(x.len() / 2);
                x86::dot_bf16(x, even, odd, &w[row])
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: Avx2 is chosen only where the CPU reports avx2 and fma.
            (Isa::Avx2, Weights::F32(w)) => unsafe { x86_avx2::dot_f32(x, &w[row]) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above; `halves` were made for Avx2 on bf16 weights.
            (Isa::Avx2, Weights::Bf16(w)) => unsafe {
                let (even, odd) = input.halves.split_at(x.len() / 2);
                x86_avx2::dot_bf16(x, even, odd, &w[row])
            },
            (_, Weights::F32(w)) => dot_scalar(x, &w[row], |v| v),
            (_, Weights::Bf16(w)) => dot_scalar(x, &w[row], Bf16::to_f32),
        }
    }
}

/// Lanes of the portable kernel's partial sums: independent chains the compiler keeps
/// in vector registers of any x86-64 (SSE2) or Arm CPU, where one running sum would
/// wait on each add in turn.
const SCALAR_LANES: usize = 8;

/// Σ x·w, w widened by `f`: lane `l` sums the elements `l`, `l + 8`, …, then the lanes
/// and the tail past the last whole 8 are added.
fn dot_scalar<T: Copy>(x: &[f32], w: &[T], f: impl Fn(T) -> f32) -> f32 {
    let mut lanes = [0.0f32; SCALAR_LANES];
    let (xs, ws) = (x.chunks_exact(SCALAR_LANES), w.chunks_exact(SCALAR_LANES));
    let tail: f32 = xs
        .remainder()
        .iter()
        .zip(ws.remainder())
        .map(|(&a, &b)| a * f(b))
        .sum();
    for (xc, wc) in xs.zip(ws) {
        for l in 0..SCALAR_LANES {
            lanes[l] += xc[l] * f(wc[l]);
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// The dot products, one row of W at a time: each row is one stream from memory,
/// read front to back with four accumulators in flight. One stream at a time ran a
/// 124M decoding pass at 1.15× (f32) and 1.3× (bf16) the speed of four rows
/// interleaved sharing each load of x (`gemv_model_pass_speed`): x is in L1 either way,
/// and four streams 1.5–3 KB long each left the prefetchers behind.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::Bf16;
    use std::arch::x86_64::*;

    /// Lanes of one AVX-512 register.
    const L: usize = 16;

    /// The sum of the four accumulators, with the elements past the last whole register
    /// (`tail`) added.
    #[target_feature(enable = "avx512f")]
    fn finish(acc: [__m512; 4], tail: f32) -> f32 {
        let pairs = [_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])];
        _mm512_reduce_add_ps(_mm512_add_ps(pairs[0], pairs[1])) + tail
    }

    /// Σ x·w over one row of f32 weights.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn dot_f32(x: &[f32], w: &[f32]) -> f32 {
        let n = x.len();
        assert_eq!(w.len(), n);
        let (xp, wp) = (x.as_ptr(), w.as_ptr());
        let mut acc = [_mm512_setzero_ps(); 4];
        let mut i = 0;
        // SAFETY: every load reads 16 floats from an offset o with o + 16 ≤ n, of x
        // and w (both n long, asserted).
        unsafe {
            while i + 4 * L <= n {
                for (u, a) in acc.iter_mut().enumerate() {
                    let at = i + u * L;
                    *a = _mm512_fmadd_ps(
                        _mm512_loadu_ps(xp.add(at)),
                        _mm512_loadu_ps(wp.add(at)),
                        *a,
                    );
                }
                i += 4 * L;
            }
            while i + L <= n {
                acc[0] = _mm512_fmadd_ps(
                    _mm512_loadu_ps(xp.add(i)),
                    _mm512_loadu_ps(wp.add(i)),
                    acc[0],
                );
                i += L;
            }
        }
        finish(acc, (i..n).map(|j| x[j] * w[j]).sum())
    }

    /// Σ x·w over one row of bf16 weights, widened exactly to f32; `even` and `odd`
    /// are x's even and odd elements (n / 2 each).
    ///
    /// The row is read 32 values (one 64-byte load) at a time: as 16 32-bit lanes, a
    /// lane's low half is the even element and its high half the odd one, so shifting
    /// left by 16 gives the even elements' f32 values and masking off the low half the
    /// odd ones', each multiplied by the matching 16 of `even` or `odd`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn dot_bf16(x: &[f32], even: &[f32], odd: &[f32], w: &[Bf16]) -> f32 {
        let n = x.len();
        assert!(w.len() == n && even.len() >= n / 2 && odd.len() >= n / 2);
        let (ep, op, wp) = (even.as_ptr(), odd.as_ptr(), w.as_ptr() as *const __m512i);
        let high = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
        let mut acc = [_mm512_setzero_ps(); 4];
        // `acc[2u]` (even) and `acc[2u + 1]` (odd) += the 32 values of w from `at`.
        // SAFETY (of each call): at + 32 ≤ n, so the load reads 32 values of w (`Bf16`
        // is a transparent u16: 64 bytes, unaligned) and 16 of `even` and `odd` from
        // at / 2 (both ≥ n / 2 long, asserted). Shifted into the top half of a 32-bit
        // lane, a bf16 is its f32 value.
        let step = |acc: &mut [__m512; 4], u: usize, at: usize| unsafe {
            let v = _mm512_loadu_si512(wp.byte_add(2 * at));
            let we = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
            let wo = _mm512_castsi512_ps(_mm512_and_si512(v, high));
            acc[2 * u] = _mm512_fmadd_ps(_mm512_loadu_ps(ep.add(at / 2)), we, acc[2 * u]);
            acc[2 * u + 1] = _mm512_fmadd_ps(_mm512_loadu_ps(op.add(at / 2)), wo, acc[2 * u + 1]);
        };
        let mut i = 0;
        while i + 4 * L <= n {
            step(&mut acc, 0, i);
            step(&mut acc, 1, i + 2 * L);
            i += 4 * L;
        }
        while i + 2 * L <= n {
            step(&mut acc, 0, i);
            i += 2 * L;
        }
        finish(acc, (i..n).map(|j| x[j] * w[j].to_f32()).sum())
    }
}

/// The AVX2 + FMA forms of [`x86`]'s kernels: the same streams and the same splitting
/// of bf16 pairs, 8 lanes to a register.
#[cfg(target_arch = "x86_64")]
mod x86_avx2 {
    use super::Bf16;
    use std::arch::x86_64::*;

    /// Lanes of one AVX2 register.
    const L: usize = 8;

    /// The sum of the four accumulators, with the elements past the last whole register
    /// (`tail`) added.
    #[target_feature(enable = "avx2,fma")]
    fn finish(acc: [__m256; 4], tail: f32) -> f32 {
        let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let q = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
        let d = _mm_add_ps(q, _mm_movehl_ps(q, q));
        _mm_cvtss_f32(_mm_add_ss(d, _mm_movehdup_ps(d))) + tail
    }

    /// Σ x·w over one row of f32 weights.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_f32(x: &[f32], w: &[f32]) -> f32 {
        let n = x.len();
        assert_eq!(w.len(), n);
        let (xp, wp) = (x.as_ptr(), w.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        // SAFETY: every load reads 8 floats from an offset o with o + 8 ≤ n, of x and
        // w (both n long, asserted).
        unsafe {
            while i + 4 * L <= n {
                for (u, a) in acc.iter_mut().enumerate() {
                    let at = i + u * L;
                    *a = _mm256_fmadd_ps(
                        _mm256_loadu_ps(xp.add(at)),
                        _mm256_loadu_ps(wp.add(at)),
                        *a,
                    );
                }
                i += 4 * L;
            }
            while i + L <= n {
                acc[0] = _mm256_fmadd_ps(
                    _mm256_loadu_ps(xp.add(i)),
                    _mm256_loadu_ps(wp.add(i)),
                    acc[0],
                );
                i += L;
            }
        }
        finish(acc, (i..n).map(|j| x[j] * w[j]).sum())
    }

    /// Σ x·w over one row of bf16 weights, widened exactly to f32; `even` and `odd`
    /// are x's even and odd elements (n / 2 each). The row is read 16 values (one
    /// 32-byte load) at a time, as 8 32-bit lanes of an even (low) and an odd (high)
    /// element, as in [`super::x86::dot_bf16`].
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_bf16(x: &[f32], even: &[f32], odd: &[f32], w: &[Bf16]) -> f32 {
        let n = x.len();
        assert!(w.len() == n && even.len() >= n / 2 && odd.len() >= n / 2);
        let (ep, op, wp) = (even.as_ptr(), odd.as_ptr(), w.as_ptr() as *const __m256i);
        let high = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
        let mut acc = [_mm256_setzero_ps(); 4];
        // `acc[2u]` (even) and `acc[2u + 1]` (odd) += the 16 values of w from `at`.
        // SAFETY (of each call): at + 16 ≤ n, so the load reads 16 values of w (`Bf16`
        // is a transparent u16: 32 bytes, unaligned) and 8 of `even` and `odd` from
        // at / 2 (both ≥ n / 2 long, asserted). Shifted into the top half of a 32-bit
        // lane, a bf16 is its f32 value.
        let step = |acc: &mut [__m256; 4], u: usize, at: usize| unsafe {
            let v = _mm256_loadu_si256(wp.byte_add(2 * at));
            let we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
            let wo = _mm256_castsi256_ps(_mm256_and_si256(v, high));
            acc[2 * u] = _mm256_fmadd_ps(_mm256_loadu_ps(ep.add(at / 2)), we, acc[2 * u]);
            acc[2 * u + 1] = _mm256_fmadd_ps(_mm256_loadu_ps(op.add(at / 2)), wo, acc[2 * u + 1]);
        };
        let mut i = 0;
        while i + 4 * L <= n {
            step(&mut acc, 0, i);
            step(&mut acc, 1, i + 2 * L);
            i += 4 * L;
        }
        while i + 2 * L <= n {
            step(&mut acc, 0, i);
            i += 2 * L;
        }
        finish(acc, (i..n).map(|j| x[j] * w[j].to_f32()).sum())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::bf16::round;
    use crate::kernels::testutil::{assert_close, rand_vec};

    /// f64 `x · Wᵀ` (+ `init`).
    fn reference(x: &[f32], w: &[f64], c: usize, init: &[f32]) -> Vec<f64> {
        let oc = w.len() / c;
        let mut out: Vec<f64> = init.iter().map(|&v| v as f64).collect();
        for (r, xr) in x.chunks_exact(c).enumerate() {
            for j in 0..oc {
                let d: f64 = (0..c).map(|i| xr[i] as f64 * w[j * c + i]).sum();
                out[r * oc + j] += d;
            }
        }
        out
    }

    /// Every variant this CPU runs, against the f64 reference.
    fn check(n: usize, c: usize, oc: usize) {
        for isa in Isa::available() {
            check_on(isa, n, c, oc);
        }
    }

    fn check_on(isa: Isa, n: usize, c: usize, oc: usize) {
        let gemv = |out: &mut [f32], x: &[f32], w: Weights, c: usize, acc: bool| {
            gemv_on(isa, out, x, w, c, acc)
        };
        let x = rand_vec(n * c, 1);
        let w = rand_vec(oc * c, 2);
        let bias = rand_vec(n * oc, 3);
        let zero = vec![0.0; n * oc];
        let tol = 1e-6 * c as f64;
        // f32 weights, written and accumulated.
        let w64: Vec<f64> = w.iter().map(|&v| v as f64).collect();
        let mut out = vec![f32::NAN; n * oc];
        gemv(&mut out, &x, Weights::F32(&w), c, false);
        let what = |kind: &str| format!("{isa:?} {kind}, N {n} C {c} OC {oc}");
        assert_close(&what("f32"), &out, &reference(&x, &w64, c, &zero), tol, tol);
        let mut out = bias.clone();
        gemv(&mut out, &x, Weights::F32(&w), c, true);
        assert_close(
            &what("f32 +="),
            &out,
            &reference(&x, &w64, c, &bias),
            tol,
            tol,
        );
        // bf16 weights: exactly the product with the rounded weights.
        let wb: Vec<Bf16> = w.iter().map(|&v| Bf16::from_f32(v)).collect();
        let wb64: Vec<f64> = w.iter().map(|&v| round(v) as f64).collect();
        let mut out = bias.clone();
        gemv(&mut out, &x, Weights::Bf16(&wb), c, true);
        assert_close(
            &what("bf16 +="),
            &out,
            &reference(&x, &wb64, c, &bias),
            tol,
            tol,
        );
        let mut out = vec![f32::NAN; n * oc];
        gemv(&mut out, &x, Weights::Bf16(&wb), c, false);
        assert_close(
            &what("bf16"),
            &out,
            &reference(&x, &wb64, c, &zero),
            tol,
            tol,
        );
    }

    #[test]
    fn matches_f64_on_odd_shapes() {
        // C below one register, between strides, with 64-wide strides and a tail;
        // OC across task boundaries; one row and several.
        for &(n, c, oc) in &[
            (1, 1, 1),
            (1, 7, 3),
            (2, 16, 65),
            (3, 37, 129),
            (1, 64, 64),
            (4, 200, 70),
            (1, 768, 131),
            (2, 95, 33),
            (1, 896, 17),
        ] {
            check(n, c, oc);
        }
    }

    #[test]
    fn every_variant_agrees_with_the_portable_one() {
        let (c, oc) = (100, 9);
        let x = rand_vec(c, 4);
        let w = rand_vec(oc * c, 5);
        let wb: Vec<Bf16> = w.iter().map(|&v| Bf16::from_f32(v)).collect();
        for isa in Isa::available() {
            for w in [Weights::F32(&w), Weights::Bf16(&wb)] {
                let (mut a, mut b) = (vec![0.0; oc], vec![0.0; oc]);
                let halves = isa.halves(&x, c, w);
                let input = Input {
                    x: &x,
                    halves: &halves,
                };
                isa.rows(&mut a, input, w, 0, false);
                Isa::Scalar.rows(&mut b, Input { x: &x, halves: &[] }, w, 0, false);
                for (j, (a, b)) in a.iter().zip(&b).enumerate() {
                    assert!((a - b).abs() <= 1e-4, "{isa:?} row {j}: {a} vs {b}");
                }
            }
        }
    }

    /// Rows of x decoded together give each row the bits it gets alone: a sequence
    /// samples the same in a batch.
    #[test]
    fn each_row_gets_its_bits_alone_whatever_the_batch() {
        let (c, oc) = (200, 70);
        let w = rand_vec(oc * c, 6);
        let wb: Vec<Bf16> = w.iter().map(|&v| Bf16::from_f32(v)).collect();
        for w in [Weights::F32(&w), Weights::Bf16(&wb)] {
            for n in 1..=9 {
                let x = rand_vec(n * c, 7 + n as u64);
                let mut together = vec![0.0; n * oc];
                gemv(&mut together, &x, w, c, false);
                for (r, xr) in x.chunks_exact(c).enumerate() {
                    let mut alone = vec![0.0; oc];
                    gemv(&mut alone, xr, w, c, false);
                    let got = &together[r * oc..(r + 1) * oc];
                    assert!(
                        got.iter()
                            .zip(&alone)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "row {r} of {n}"
                    );
                }
            }
        }
    }
}

#[cfg(test)]
mod speed {
    use super::*;
    use crate::kernels::mat::{matmul, Mat};
    use std::time::Instant;

    /// GB/s of weights streamed: this kernel (f32 and bf16 weights) against the f32
    /// GEMM on GPT-2 124M's decoding shapes, one input row.
    /// `cargo test --release --lib -- --ignored --nocapture gemv_speed`
    #[test]
    #[ignore = "benchmark: needs a release build"]
    fn gemv_speed() {
        for (oc, c) in [(2304, 768), (3072, 768), (768, 3072), (50257, 768)] {
            let x = vec![0.5f32; c];
            let w = vec![0.25f32; oc * c];
            let wb = vec![Bf16::from_f32(0.25); oc * c];
            let mut out = vec![0.0f32; oc];
            let best = |f: &mut dyn FnMut()| {
                (0..20)
                    .map(|_| {
                        let t = Instant::now();
                        f();
                        t.elapsed().as_secs_f64()
                    })
                    .fold(f64::INFINITY, f64::min)
            };
            let gemm = best(&mut || {
                let wt = Mat::new(&w, oc, c).t();
                matmul(&mut out, Mat::new(&x, 1, c), wt, false)
            });
            let f32s = best(&mut || gemv(&mut out, &x, Weights::F32(&w), c, false));
            let bf16s = best(&mut || gemv(&mut out, &x, Weights::Bf16(&wb), c, false));
            let gb = (oc * c * 4) as f64 / 1e9;
            println!(
                "{oc}×{c}, {} threads: gemm {:.1} GB/s ({:.3} ms), gemv f32 {:.1} GB/s \
                 ({:.3} ms), gemv bf16 {:.3} ms",
                rayon::current_num_threads(),
                gb / gemm,
                gemm * 1e3,
                gb / f32s,
                f32s * 1e3,
                bf16s * 1e3
            );
        }
    }

    /// GB/s of one decoding step's products from memory, as `sample` runs them: every
    /// matmul weight of GPT-2 124M (12 layers of four, then the classifier), each in
    /// its own allocation and read once per pass, 494 MB (f32) or 247 MB (bf16), far
    /// more than the caches hold; for 1 and 4 sequences (rows of x). Best of 10 passes
    /// of each, alternating.
    /// `cargo test --release --lib -- --ignored --nocapture --test-threads=1 gemv_model_pass_speed`
    #[test]
    #[ignore = "benchmark: needs a release build and ~750 MB"]
    fn gemv_model_pass_speed() {
        let c = 768;
        let mut shapes = [(3 * c, c), (c, c), (4 * c, c), (c, 4 * c)].repeat(12);
        shapes.push((50257, c));
        let f32w: Vec<Vec<f32>> = shapes.iter().map(|&(oc, c)| vec![0.25; oc * c]).collect();
        let bf16w: Vec<Vec<Bf16>> = shapes
            .iter()
            .map(|&(oc, c)| vec![Bf16::from_f32(0.25); oc * c])
            .collect();
        let floats: usize = shapes.iter().map(|&(oc, c)| oc * c).sum();
        for n in [1, 4] {
            let xs: Vec<Vec<f32>> = shapes.iter().map(|&(_, c)| vec![0.5; n * c]).collect();
            let mut outs: Vec<Vec<f32>> = shapes.iter().map(|&(oc, _)| vec![0.0; n * oc]).collect();
            let (mut f32s, mut bf16s) = (f64::INFINITY, f64::INFINITY);
            for _ in 0..10 {
                let t = Instant::now();
                for (((o, x), w), &(_, c)) in outs.iter_mut().zip(&xs).zip(&f32w).zip(&shapes) {
                    gemv(o, x, Weights::F32(w), c, false);
                }
                f32s = f32s.min(t.elapsed().as_secs_f64());
                let t = Instant::now();
                for (((o, x), w), &(_, c)) in outs.iter_mut().zip(&xs).zip(&bf16w).zip(&shapes) {
                    gemv(o, x, Weights::Bf16(w), c, false);
                }
                bf16s = bf16s.min(t.elapsed().as_secs_f64());
            }
            println!(
                "one 124M decoding pass, {n} row(s), {} threads: f32 {:.2} ms ({:.1} GB/s), bf16 {:.2} ms ({:.1} GB/s)",
                rayon::current_num_threads(),
                f32s * 1e3,
                (floats * 4) as f64 / 1e9 / f32s,
                bf16s * 1e3,
                (floats * 2) as f64 / 1e9 / bf16s
            );
        }
    }
}
