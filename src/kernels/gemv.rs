//! Matrix times a few vectors, for decoding: `out = x · Wᵀ` with x (N, C) for a small
//! N (one row per sequence being decoded) and W (OC, C), f32 or bf16.
//!
//! A decoding step does little arithmetic per weight (N multiply-adds) and reads every
//! weight once, so its speed is the speed of streaming W from memory. Here the threads
//! split W by output rows, each streams its rows front to back once, and the N input
//! rows meet each task's rows of W while they are in L2. bf16 weights halve the bytes read;
//! they are widened to f32 exactly (a bf16 is the top half of an f32), and products and
//! sums stay f32.

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
    let isa = isa();
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
                isa.rows(o, xr, w, j0, accumulate);
            }
        });
}

/// The instruction set the dot products run on, detected once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Isa {
    Avx512,
    Scalar,
}

fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx512f") {
            return Isa::Avx512;
        }
        Isa::Scalar
    })
}

impl Isa {
    /// `out[k] (+)= x · W[j0 + k]` for the rows of W (OC, C) from j0 (out's length of them).
    fn rows(self, out: &mut [f32], x: &[f32], w: Weights, j0: usize, accumulate: bool) {
        let c = x.len();
        let put = |o: &mut f32, d: f32| *o = if accumulate { *o + d } else { d };
        let mut j = j0;
        let mut quads = out.chunks_exact_mut(4);
        for o in &mut quads {
            for (o, d) in o.iter_mut().zip(self.dot4(x, w, j, c)) {
                put(o, d);
            }
            j += 4;
        }
        for o in quads.into_remainder() {
            let d = match w {
                Weights::F32(w) => dot_scalar(x, &w[j * c..(j + 1) * c], |v| v),
                Weights::Bf16(w) => dot_scalar(x, &w[j * c..(j + 1) * c], Bf16::to_f32),
            };
            put(o, d);
            j += 1;
        }
    }

    /// x · W[j..j + 4].
    fn dot4(self, x: &[f32], w: Weights, j: usize, c: usize) -> [f32; 4] {
        match (self, w) {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: Avx512 is chosen only where the CPU reports avx512f.
            (Isa::Avx512, Weights::F32(w)) => unsafe {
                x86::dot4_f32(x, std::array::from_fn(|k| &w[(j + k) * c..(j + k + 1) * c]))
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            (Isa::Avx512, Weights::Bf16(w)) => unsafe {
                x86::dot4_bf16(x, std::array::from_fn(|k| &w[(j + k) * c..(j + k + 1) * c]))
            },
            (_, Weights::F32(w)) => {
                std::array::from_fn(|k| dot_scalar(x, &w[(j + k) * c..(j + k + 1) * c], |v| v))
            }
            (_, Weights::Bf16(w)) => std::array::from_fn(|k| {
                dot_scalar(x, &w[(j + k) * c..(j + k + 1) * c], Bf16::to_f32)
            }),
        }
    }
}

/// Σ x·w, w widened by `f`.
fn dot_scalar<T: Copy>(x: &[f32], w: &[T], f: impl Fn(T) -> f32) -> f32 {
    x.iter().zip(w).map(|(&a, &b)| a * f(b)).sum()
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::Bf16;
    use std::arch::x86_64::*;

    /// Lanes of one AVX-512 register.
    const L: usize = 16;

    /// Σ x·w_k for four rows w_k at once (four streams from memory in flight, each
    /// load of x used four times), over the first `n - n % 16` elements.
    ///
    /// `load(k, i)` is row k's 16 values from element i, widened to f32.
    #[inline(always)]
    unsafe fn dot4(x: &[f32], load: impl Fn(usize, usize) -> __m512) -> [__m512; 4] {
        let xp = x.as_ptr();
        let mut acc = [_mm512_setzero_ps(); 4];
        let mut i = 0;
        while i + L <= x.len() {
            let xv = _mm512_loadu_ps(xp.add(i));
            for (k, a) in acc.iter_mut().enumerate() {
                *a = _mm512_fmadd_ps(xv, load(k, i), *a);
            }
            i += L;
        }
        acc
    }

    /// The four sums, with the elements past the last whole register added.
    fn finish(acc: [__m512; 4], tail: impl Fn(usize) -> f32) -> [f32; 4] {
        // SAFETY: plain register arithmetic; the caller runs with avx512f enabled.
        std::array::from_fn(|k| unsafe { _mm512_reduce_add_ps(acc[k]) } + tail(k))
    }

    /// Σ x·w_k for four rows of x's length.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn dot4_f32(x: &[f32], w: [&[f32]; 4]) -> [f32; 4] {
        let n = x.len();
        assert!(w.iter().all(|r| r.len() == n));
        let p = w.map(|r| r.as_ptr());
        // SAFETY: dot4 loads 16 elements at offsets i with i + 16 ≤ n only.
        let acc = dot4(x, |k, i| _mm512_loadu_ps(p[k].add(i)));
        let from = n - n % L;
        finish(acc, |k| (from..n).map(|i| x[i] * w[k][i]).sum())
    }

    /// Σ x·w_k for four bf16 rows of x's length (widened exactly to f32).
    ///
    /// Each row is read 32 values (one 64-byte load) at a time: as 16 32-bit lanes,
    /// a lane's low half is the even element and its high half the odd one, so
    /// shifting left by 16 gives the even elements' f32 values and masking off the low
    /// half the odd ones'; x is split into its even and odd elements to match (once
    /// per 32, for the four rows).
    #[target_feature(enable = "avx512f")]
    pub unsafe fn dot4_bf16(x: &[f32], w: [&[Bf16]; 4]) -> [f32; 4] {
        let n = x.len();
        assert!(w.iter().all(|r| r.len() == n));
        let (xp, p) = (x.as_ptr(), w.map(|r| r.as_ptr() as *const __m512i));
        let even_idx = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        let odd_idx = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
        let high = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
        let mut even = [_mm512_setzero_ps(); 4];
        let mut odd = [_mm512_setzero_ps(); 4];
        let mut i = 0;
        // SAFETY: every load reads 32 elements from i with i + 32 ≤ n, of x (f32) and
        // of the rows (`Bf16` is a transparent u16: 32 of them are 512 bits, read
        // unaligned). Shifted into the top half of a 32-bit lane, a bf16 is its f32
        // value.
        while i + 2 * L <= n {
            let (x0, x1) = (_mm512_loadu_ps(xp.add(i)), _mm512_loadu_ps(xp.add(i + L)));
            let xe = _mm512_permutex2var_ps(x0, even_idx, x1);
            let xo = _mm512_permutex2var_ps(x0, odd_idx, x1);
            for k in 0..4 {
                let v = _mm512_loadu_si512(p[k].byte_add(2 * i));
                let we = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
                let wo = _mm512_castsi512_ps(_mm512_and_si512(v, high));
                even[k] = _mm512_fmadd_ps(xe, we, even[k]);
                odd[k] = _mm512_fmadd_ps(xo, wo, odd[k]);
            }
            i += 2 * L;
        }
        let acc = std::array::from_fn(|k| _mm512_add_ps(even[k], odd[k]));
        finish(acc, |k| (i..n).map(|j| x[j] * w[k][j].to_f32()).sum())
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

    fn check(n: usize, c: usize, oc: usize) {
        let x = rand_vec(n * c, 1);
        let w = rand_vec(oc * c, 2);
        let bias = rand_vec(n * oc, 3);
        let zero = vec![0.0; n * oc];
        let tol = 1e-6 * c as f64;
        // f32 weights, written and accumulated.
        let w64: Vec<f64> = w.iter().map(|&v| v as f64).collect();
        let mut out = vec![f32::NAN; n * oc];
        gemv(&mut out, &x, Weights::F32(&w), c, false);
        assert_close("f32", &out, &reference(&x, &w64, c, &zero), tol, tol);
        let mut out = bias.clone();
        gemv(&mut out, &x, Weights::F32(&w), c, true);
        assert_close("f32 +=", &out, &reference(&x, &w64, c, &bias), tol, tol);
        // bf16 weights: exactly the product with the rounded weights.
        let wb: Vec<Bf16> = w.iter().map(|&v| Bf16::from_f32(v)).collect();
        let wb64: Vec<f64> = w.iter().map(|&v| round(v) as f64).collect();
        let mut out = bias.clone();
        gemv(&mut out, &x, Weights::Bf16(&wb), c, true);
        assert_close("bf16 +=", &out, &reference(&x, &wb64, c, &bias), tol, tol);
        let mut out = vec![f32::NAN; n * oc];
        gemv(&mut out, &x, Weights::Bf16(&wb), c, false);
        assert_close("bf16", &out, &reference(&x, &wb64, c, &zero), tol, tol);
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
        ] {
            check(n, c, oc);
        }
    }

    #[test]
    fn scalar_and_simd_agree() {
        let (c, oc) = (100, 9);
        let x = rand_vec(c, 4);
        let w = rand_vec(oc * c, 5);
        let wb: Vec<Bf16> = w.iter().map(|&v| Bf16::from_f32(v)).collect();
        for w in [Weights::F32(&w), Weights::Bf16(&wb)] {
            let (mut a, mut b) = (vec![0.0; oc], vec![0.0; oc]);
            isa().rows(&mut a, &x, w, 0, false);
            Isa::Scalar.rows(&mut b, &x, w, 0, false);
            for (j, (a, b)) in a.iter().zip(&b).enumerate() {
                assert!((a - b).abs() <= 1e-4, "row {j}: {a} vs {b}");
            }
        }
    }
}

#[cfg(test)]
mod speed {
    use super::*;
    use crate::kernels::matmul::{matmul, Mat};
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
    /// more than the caches hold. Best of 10 passes of each, alternating.
    /// `cargo test --release --lib -- --ignored --nocapture gemv_model_pass_speed`
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
        let xs: Vec<Vec<f32>> = shapes.iter().map(|&(_, c)| vec![0.5; c]).collect();
        let mut outs: Vec<Vec<f32>> = shapes.iter().map(|&(oc, _)| vec![0.0; oc]).collect();
        let floats: usize = shapes.iter().map(|&(oc, c)| oc * c).sum();
        let (mut f32s, mut bf16s) = (f64::INFINITY, f64::INFINITY);
        for _ in 0..10 {
            let t = Instant::now();
            for ((o, x), w) in outs.iter_mut().zip(&xs).zip(&f32w) {
                gemv(o, x, Weights::F32(w), x.len(), false);
            }
            f32s = f32s.min(t.elapsed().as_secs_f64());
            let t = Instant::now();
            for ((o, x), w) in outs.iter_mut().zip(&xs).zip(&bf16w) {
                gemv(o, x, Weights::Bf16(w), x.len(), false);
            }
            bf16s = bf16s.min(t.elapsed().as_secs_f64());
        }
        println!(
            "one 124M decoding pass, {} threads: f32 {:.2} ms ({:.1} GB/s), bf16 {:.2} ms ({:.1} GB/s)",
            rayon::current_num_threads(),
            f32s * 1e3,
            (floats * 4) as f64 / 1e9 / f32s,
            bf16s * 1e3,
            (floats * 2) as f64 / 1e9 / bf16s
        );
    }
}
