//! The bf16 matmuls of `dtype = "bfloat16"` and their kernels. Large products run on
//! the AMX-BF16 kernel ([`super::bf16_amx`]) where the CPU has AMX and the OS lets
//! the process use its tiles; elsewhere on the f32 GEMM over bf16-valued operands
//! ([`super::matmul::matmul`]), which computes the same products. `NANOGPT_BF16_GEMM`
//! = `amx`, `avx512bf16` or `f32` overrides the choice ([`kernel`]), for A/B runs.
//!
//! This module also holds an AVX512-BF16 (`vdpbf16ps`) kernel, opt-in only: on the
//! development machine it measured at parity with the f32 GEMM on GPT-2 124M shapes
//! and 1.45× slower on the quick-start shapes (docs/PERFORMANCE.md). That is what one
//! would see if `vdpbf16ps` (the work of two f32 FMAs) issued at half the FMA rate on
//! that core; not verified.
//!
//! `vdpbf16ps` multiplies pairs of bf16 values along `k` (exact in f32) and adds both
//! products to an f32 accumulator lane. Operands are packed once per call into bf16
//! pairs: A in blocks of [`MR`] rows, B in panels of [`NR`] columns, each laid out
//! `k`-pair by `k`-pair, zero-padded at the edges. A register tile of `MR × NR`
//! accumulators (16 zmm registers) runs over all of `k`; tasks own disjoint output
//! tiles and add in a fixed order, so results do not depend on the thread count.
//! The instruction treats subnormal inputs and results as zero (bf16 subnormals are
//! below 1.2e-38, far under anything a model holds).

use super::bf16::Bf16;
use super::bf16_amx;
use super::matmul::{matmul, Mat};
use super::SharedMut;
use rayon::prelude::*;
use std::cell::RefCell;
use std::sync::OnceLock;

/// Rows of the register tile.
const MR: usize = 8;
/// Columns of the register tile: two zmm registers of 16 f32 lanes.
const NR: usize = 32;
/// Row blocks and column panels of one parallel task (A: 128 rows, B: 128 columns).
const TASK_BLOCKS: usize = 16;
const TASK_PANELS: usize = 4;
/// Below this many multiply-adds (m·n·k) packing costs more than it saves.
const MIN_MACS: usize = 1 << 20;

/// Whether this CPU has AVX512-BF16 (checked once).
pub fn available() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bf16")
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    })
}

/// Which kernel runs the large bf16 matmuls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// AMX-BF16 tiles ([`super::bf16_amx`]).
    Amx,
    /// AVX512-BF16 `vdpbf16ps` (this module).
    Avx512Bf16,
    /// The f32 GEMM over bf16-valued operands.
    F32,
}

/// The kernel for large bf16 matmuls, chosen once: `NANOGPT_BF16_GEMM=amx`,
/// `avx512bf16` or `f32` picks one (an unusable choice falls back to the f32 GEMM);
/// unset (or any other value), AMX where the CPU has it and the process may use it,
/// else the f32 GEMM.
pub fn kernel() -> Kernel {
    #[cfg(test)]
    if let Some(k) = FORCED.get() {
        return k;
    }
    static K: OnceLock<Kernel> = OnceLock::new();
    *K.get_or_init(|| match std::env::var("NANOGPT_BF16_GEMM").as_deref() {
        Ok("f32") => Kernel::F32,
        Ok("avx512bf16") if available() => Kernel::Avx512Bf16,
        Ok("avx512bf16") => Kernel::F32,
        _ if bf16_amx::permitted() => Kernel::Amx,
        _ => Kernel::F32,
    })
}

#[cfg(test)]
thread_local! {
    /// A kernel forced for bf16 matmuls dispatched from this thread (tests only).
    static FORCED: std::cell::Cell<Option<Kernel>> = const { std::cell::Cell::new(None) };
}

/// Runs `f` with the bf16 matmuls it dispatches from this thread on `k` (tests only;
/// `k` must be usable on this machine).
#[cfg(test)]
pub(crate) fn with_kernel<R>(k: Kernel, f: impl FnOnce() -> R) -> R {
    let before = FORCED.replace(Some(k));
    let r = f();
    FORCED.set(before);
    r
}

/// Whether bf16 matmuls use a packing kernel (AMX or AVX512-BF16) for large products.
pub fn enabled() -> bool {
    kernel() != Kernel::F32
}

/// `dst = a · b` (or `+=` when `accumulate`) for operands that hold bf16 values
/// (exactly representable; other values are rounded to nearest even while packing).
/// Large products run on the [`kernel`] chosen, the rest on the f32 GEMM; all
/// accumulate in f32.
pub fn matmul_bf16(dst: &mut [f32], a: Mat, b: Mat, accumulate: bool) {
    let macs = a.rows * a.cols * b.cols;
    match kernel() {
        _ if macs < MIN_MACS => matmul(dst, a, b, accumulate),
        Kernel::Amx => amx(dst, a, b, accumulate),
        Kernel::Avx512Bf16 => native(dst, a, b, accumulate),
        Kernel::F32 => matmul(dst, a, b, accumulate),
    }
}

/// The AMX path of [`matmul_bf16`], on this thread's packing buffers; the caller
/// checked [`bf16_amx::permitted`].
pub(crate) fn amx(dst: &mut [f32], a: Mat, b: Mat, accumulate: bool) {
    PACKS.with_borrow_mut(|(pa, pb)| bf16_amx::matmul(dst, a, b, accumulate, pa, pb));
}

/// [`matmul_bf16`] with a right-hand operand packed beforehand for AMX (the caller
/// made the pack because [`kernel`] is [`Kernel::Amx`]).
pub fn matmul_bf16_packed(dst: &mut [f32], a: Mat, b: &bf16_amx::PackedB, accumulate: bool) {
    PACKS.with_borrow_mut(|(pa, _)| bf16_amx::matmul_packed(dst, a, b, accumulate, pa));
}

thread_local! {
    /// Packing buffers of the calling thread, grown to the largest product and
    /// reused, so a training step allocates nothing once warm.
    static PACKS: RefCell<(Vec<u32>, Vec<u32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// Two bf16 values in one 32-bit lane: `lo` is element `2p`, `hi` element `2p + 1`
/// (the pair layout both bf16 kernels pack into).
#[inline]
pub(super) fn pair(lo: f32, hi: f32) -> u32 {
    Bf16::from_f32(lo).0 as u32 | (Bf16::from_f32(hi).0 as u32) << 16
}

/// Element `(i, j)` of `m`, or 0 outside it (the zero padding of the packs).
#[inline]
pub(super) fn at(m: &Mat, i: usize, j: usize) -> f32 {
    if i < m.rows && j < m.cols {
        m.data[i * m.rs + j * m.cs]
    } else {
        0.0
    }
}

/// A packed as `[m / MR][k / 2][MR]` pairs.
fn pack_a(out: &mut [u32], a: &Mat, kp: usize) {
    out.par_chunks_mut(kp * MR)
        .enumerate()
        .for_each(|(blk, dst)| {
            for p in 0..kp {
                for r in 0..MR {
                    let i = blk * MR + r;
                    dst[p * MR + r] = pair(at(a, i, 2 * p), at(a, i, 2 * p + 1));
                }
            }
        });
}

/// B packed as `[n / NR][k / 2][NR]` pairs.
fn pack_b(out: &mut [u32], b: &Mat, kp: usize) {
    out.par_chunks_mut(kp * NR)
        .enumerate()
        .for_each(|(panel, dst)| {
            for p in 0..kp {
                for c in 0..NR {
                    let j = panel * NR + c;
                    dst[p * NR + c] = pair(at(b, 2 * p, j), at(b, 2 * p + 1, j));
                }
            }
        });
}

/// The AVX512-BF16 path of [`matmul_bf16`]; the caller checked [`available`].
pub(crate) fn native(dst: &mut [f32], a: Mat, b: Mat, accumulate: bool) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert_eq!(b.rows, k, "inner dimensions differ");
    assert_eq!(dst.len(), m * n, "destination does not match m × n");
    assert!(
        available(),
        "the AVX512-BF16 kernel needs a CPU with AVX512-BF16"
    );
    if m == 0 || n == 0 {
        return;
    }
    let (mb, np, kp) = (m.div_ceil(MR), n.div_ceil(NR), k.div_ceil(2));
    PACKS.with_borrow_mut(|(pa, pb)| {
        pa.resize(mb * kp * MR, 0);
        pb.resize(np * kp * NR, 0);
        pack_a(pa, &a, kp);
        pack_b(pb, &b, kp);
        let (pa, pb) = (&pa[..], &pb[..]);
        let out = SharedMut::new(dst);
        let (tm, tn) = (mb.div_ceil(TASK_BLOCKS), np.div_ceil(TASK_PANELS));
        (0..tm * tn).into_par_iter().for_each(|task| {
            let (bi, pj) = (task / tn, task % tn);
            let panels = pj * TASK_PANELS..((pj + 1) * TASK_PANELS).min(np);
            for panel in panels {
                let bp = &pb[panel * kp * NR..(panel + 1) * kp * NR];
                for blk in bi * TASK_BLOCKS..((bi + 1) * TASK_BLOCKS).min(mb) {
                    let ap = &pa[blk * kp * MR..(blk + 1) * kp * MR];
                    let mut tile = [[0.0f32; NR]; MR];
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: `available()` confirmed AVX-512F and AVX512-BF16; ap and bp
                    // hold kp·MR and kp·NR pairs, which is what the kernel reads.
                    unsafe {
                        x86::tile(kp, ap, bp, &mut tile)
                    };
                    let rows = (m - blk * MR).min(MR);
                    let cols = (n - panel * NR).min(NR);
                    for (r, acc) in tile.iter().enumerate().take(rows) {
                        let at = (blk * MR + r) * n + panel * NR;
                        // SAFETY: rows blk·MR.. and columns panel·NR.. of dst belong to
                        // this task alone (tasks partition the (block, panel) grid), and
                        // at + cols ≤ m·n since row < m and panel·NR + cols ≤ n.
                        let row = unsafe { out.slice(at, cols) };
                        if accumulate {
                            row.iter_mut().zip(acc).for_each(|(d, s)| *d += s);
                        } else {
                            row.copy_from_slice(&acc[..cols]);
                        }
                    }
                }
            }
        });
    });
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{MR, NR};
    use std::arch::x86_64::*;

    /// The same 64 bytes seen as 32 bf16 values.
    #[inline(always)]
    fn bh(v: __m512i) -> __m512bh {
        // SAFETY: both are plain 64-byte vectors with no invalid bit patterns; the
        // bits are packed bf16 pairs, which is what __m512bh holds.
        unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
    }

    /// `tile = Σ_p A-pairs[p] ⊗ B-pairs[p]` over `kp` pairs of one row block and one
    /// column panel.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) fn tile(kp: usize, a: &[u32], b: &[u32], tile: &mut [[f32; NR]; MR]) {
        assert!(a.len() >= kp * MR && b.len() >= kp * NR);
        let mut c = [[_mm512_setzero_ps(); 2]; MR];
        for p in 0..kp {
            // SAFETY: p < kp, so p·NR + 32 ≤ b.len() (checked above); unaligned loads.
            let (b0, b1) = unsafe {
                let ptr = b.as_ptr().add(p * NR) as *const __m512i;
                (_mm512_loadu_si512(ptr), _mm512_loadu_si512(ptr.add(1)))
            };
            let (b0, b1) = (bh(b0), bh(b1));
            for (r, acc) in c.iter_mut().enumerate() {
                let av = bh(_mm512_set1_epi32(a[p * MR + r] as i32));
                acc[0] = _mm512_dpbf16_ps(acc[0], av, b0);
                acc[1] = _mm512_dpbf16_ps(acc[1], av, b1);
            }
        }
        for (row, acc) in tile.iter_mut().zip(&c) {
            // SAFETY: each row holds NR = 32 f32, two unaligned 16-lane stores.
            unsafe {
                _mm512_storeu_ps(row.as_mut_ptr(), acc[0]);
                _mm512_storeu_ps(row.as_mut_ptr().add(16), acc[1]);
            }
        }
    }
}

/// How bf16 matmuls run on this machine, for the start-of-run report.
pub fn path() -> &'static str {
    match kernel() {
        Kernel::Amx => "AMX-BF16 (tdpbf16ps) for the large linear layers, f32 GEMM over bf16 values elsewhere",
        Kernel::Avx512Bf16 => "AVX512-BF16 (vdpbf16ps) for the large linear layers (NANOGPT_BF16_GEMM=avx512bf16), f32 GEMM over bf16 values elsewhere",
        Kernel::F32 if std::env::var("NANOGPT_BF16_GEMM").is_ok_and(|v| v == "f32") => {
            "emulated via f32 GEMM (bf16 operands, f32 accumulation), as NANOGPT_BF16_GEMM=f32 asks"
        }
        Kernel::F32 if bf16_amx::cpu_has_amx() => {
            "emulated via f32 GEMM (bf16 operands, f32 accumulation); the CPU has AMX but the OS refused the tile permission"
        }
        Kernel::F32 if available() => {
            "emulated via f32 GEMM (bf16 operands, f32 accumulation); no AMX on this CPU (NANOGPT_BF16_GEMM=avx512bf16 selects the slower AVX512-BF16 kernel)"
        }
        Kernel::F32 => {
            "emulated via f32 GEMM (bf16 operands, f32 accumulation); no AMX or AVX512-BF16 on this CPU"
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::bf16::round;
    use crate::kernels::testutil::*;

    fn rounded(n: usize, seed: u64) -> Vec<f32> {
        rand_vec(n, seed).into_iter().map(round).collect()
    }

    /// The native kernel against the f32 GEMM on the same bf16 values (step 1's
    /// path): equal up to summation order.
    fn check(m: usize, k: usize, n: usize, transpose_a: bool, transpose_b: bool, acc: bool) {
        let a = rounded(m * k, 1);
        let b = rounded(k * n, 2);
        let am = if transpose_a {
            Mat::new(&a, k, m).t()
        } else {
            Mat::new(&a, m, k)
        };
        let bm = if transpose_b {
            Mat::new(&b, n, k).t()
        } else {
            Mat::new(&b, k, n)
        };
        let prior = rand_vec(m * n, 3);
        let (mut want, mut got) = (prior.clone(), prior.clone());
        matmul(&mut want, am, bm, acc);
        native(&mut got, am, bm, acc);
        // |error| ≤ k · 2^-23 · Σ|a·b| roughly; Σ|a·b| ≤ k for values in [-1, 1].
        let tol = 1e-6 * k as f64;
        let want64: Vec<f64> = want.iter().map(|&v| v as f64).collect();
        assert_close(&format!("{m}×{k}×{n}"), &got, &want64, 0.0, tol);
    }

    #[test]
    fn native_kernel_matches_the_f32_gemm_on_bf16_values() {
        if !available() {
            eprintln!("no AVX512-BF16 on this CPU: the native kernel is not tested here");
            return;
        }
        check(8, 2, 32, false, false, false); // one tile exactly
        check(1, 1, 1, false, false, true); // all padding
        check(37, 75, 101, false, false, false); // ragged in m, k (odd) and n
        check(64, 96, 48, false, true, true); // forward: x · Wᵀ, accumulating
        check(50, 130, 70, false, false, true); // dinp = dout · W
        check(70, 33, 129, true, false, true); // dweight += doutᵀ · x
        check(300, 256, 200, true, true, false); // several tasks in both directions
    }

    #[test]
    fn non_bf16_inputs_are_rounded_to_nearest_even_when_packed() {
        if !available() {
            return;
        }
        let (m, k, n) = (9, 40, 33);
        let (a, b) = (rand_vec(m * k, 4), rand_vec(k * n, 5));
        let (ra, rb): (Vec<f32>, Vec<f32>) = (
            a.iter().map(|&v| round(v)).collect(),
            b.iter().map(|&v| round(v)).collect(),
        );
        let mut want = vec![0.0; m * n];
        matmul(&mut want, Mat::new(&ra, m, k), Mat::new(&rb, k, n), false);
        let mut got = vec![0.0; m * n];
        native(&mut got, Mat::new(&a, m, k), Mat::new(&b, k, n), false);
        let want64: Vec<f64> = want.iter().map(|&v| v as f64).collect();
        assert_close("rounded on packing", &got, &want64, 0.0, 1e-5);
    }

    #[test]
    fn small_products_take_the_f32_gemm() {
        // Below MIN_MACS (and whenever the kernel is not enabled), matmul_bf16 is the
        // f32 GEMM, bit for bit.
        let (m, k, n) = (16, 16, 48);
        let (a, b) = (rounded(m * k, 6), rounded(k * n, 7));
        let (mut x, mut y) = (vec![0.0; m * n], vec![0.0; m * n]);
        matmul(&mut x, Mat::new(&a, m, k), Mat::new(&b, k, n), false);
        matmul_bf16(&mut y, Mat::new(&a, m, k), Mat::new(&b, k, n), false);
        assert_eq!(x, y);
    }

    /// Timing, not correctness: `cargo test --release --lib bf16_gemm -- --ignored
    /// --nocapture`. Alternates the two paths on GPT-2 124M shapes (B·T = 1024).
    #[test]
    #[ignore]
    fn native_kernel_speed() {
        if !available() {
            return;
        }
        {
            // Peak of the register tile alone, on L1-resident packs.
            let kp = 64;
            let (pa, pb) = (vec![0x3F80_3F80u32; kp * MR], vec![0x3F80_3F80u32; kp * NR]);
            let mut tile = [[0.0f32; NR]; MR];
            let reps = 200_000;
            let s = std::time::Instant::now();
            for _ in 0..reps {
                // SAFETY: available() checked; the packs hold kp pairs per row/column.
                unsafe { x86::tile(kp, std::hint::black_box(&pa), &pb, &mut tile) };
            }
            let t = s.elapsed().as_secs_f64();
            let flops = (reps * 2 * MR * NR * 2 * kp) as f64;
            println!(
                "tile kernel alone, one thread: {:.1} GFLOP/s",
                flops / t / 1e9
            );
        }
        if bf16_amx::permitted() {
            // Peak of one 32 × 32 AMX block, on cache-resident packs.
            let kc = 24;
            let p = vec![0x3F80_3F80u32; 2 * kc * 256];
            let mut c = [[0.0f32; 32]; 32];
            let reps = 20_000;
            // SAFETY: permitted() checked; the config is loaded on this thread before
            // the blocks and released after.
            let t = unsafe {
                bf16_amx::x86::configure();
                let s = std::time::Instant::now();
                for _ in 0..reps {
                    bf16_amx::x86::block(kc, std::hint::black_box(&p), &p, &mut c);
                }
                let t = s.elapsed().as_secs_f64();
                bf16_amx::x86::release();
                t
            };
            let flops = (reps * 2 * 32 * 32 * 32 * kc) as f64;
            println!(
                "AMX block alone, one thread: {:.1} GFLOP/s",
                flops / t / 1e9
            );
        }
        // (m, k, n, A transposed, B transposed) as the linear layers pass them:
        // forward x · Wᵀ, dinp = dout · W, dweight = doutᵀ · x.
        let shapes = [
            (1024, 768, 2304, false, true),
            (1024, 768, 3072, false, true),
            (1024, 3072, 768, false, true),
            (1024, 2304, 768, false, false),
            (1024, 768, 3072, false, false),
            (768, 1024, 3072, true, false),
            (3072, 1024, 768, true, false),
        ];
        let amx_ok = bf16_amx::permitted();
        for (m, k, n, ta, tb) in shapes {
            let (a, b) = (rounded(m * k, 1), rounded(k * n, 2));
            let mut out = vec![0.0; m * n];
            let am = if ta {
                Mat::new(&a, k, m).t()
            } else {
                Mat::new(&a, m, k)
            };
            let bm = if tb {
                Mat::new(&b, n, k).t()
            } else {
                Mat::new(&b, k, n)
            };
            let mut t = [Vec::new(), Vec::new(), Vec::new()];
            for _ in 0..7 {
                let s = std::time::Instant::now();
                matmul(&mut out, am, bm, false);
                t[0].push(s.elapsed().as_secs_f64());
                let s = std::time::Instant::now();
                native(&mut out, am, bm, false);
                t[1].push(s.elapsed().as_secs_f64());
                if amx_ok {
                    let s = std::time::Instant::now();
                    amx(&mut out, am, bm, false);
                    t[2].push(s.elapsed().as_secs_f64());
                }
            }
            let gf = |t: &mut Vec<f64>| match t.len() {
                0 => f64::NAN,
                _ => {
                    t.sort_by(f64::total_cmp);
                    2.0 * (m * n * k) as f64 / t[t.len() / 2] / 1e9
                }
            };
            let (f32, avx, amx) = (gf(&mut t[0]), gf(&mut t[1]), gf(&mut t[2]));
            println!(
                "{m}×{k}×{n} (Aᵀ {ta}, Bᵀ {tb}): f32 GEMM {f32:.1}, AVX512-BF16 {avx:.1}, \
                 AMX-BF16 {amx:.1} GFLOP/s (medians of 7, alternating)"
            );
        }
    }
}
