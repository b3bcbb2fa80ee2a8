//! A bf16 GEMM on AVX512-BF16 (`vdpbf16ps`), for CPUs that have it but no AMX.
//!
//! One `vdpbf16ps` multiplies 16 lanes of bf16 pairs by 16 lanes of bf16 pairs and adds
//! each lane's two products (exact in f32) into an f32 accumulator: 32 multiply-adds,
//! twice an f32 FMA's 16 on the same register width.
//!
//! Operands are packed into bf16 pairs along `k`, zero-padded at the edges:
//! - B in AMX's layout (`super::pack::pack_b`, or a [`PackedB`] made once for many
//!   products): 16-column panels of `[k / 2 pairs][16 columns]`, so one packed
//!   weight serves either kernel;
//! - A in row panels of `MR` rows, `[k / 2 pairs][MR rows]`, so a pair of one row is
//!   one 32-bit broadcast.
//!
//! The microkernel keeps an `MR` × 32 block of C in 24 registers and, per pair of
//! `k`, loads 32 columns of B (two 16-column panels) and broadcasts `MR` pairs of A.
//! `k` runs in blocks of `KB` pairs (32 columns × 384 pairs of B, 48 KiB, from L2
//! while the task's row panels stream past; C is loaded and stored once per block, and
//! a block boundary changes no bit: the accumulators go to C and come back exactly).
//! Tasks own disjoint blocks of C (up to
//! `TASK_PANELS` row panels × a few 32-column panels) and add the `k` blocks in a
//! fixed order, so results do not depend on the thread count. The instruction treats
//! subnormal inputs and results as zero (bf16 subnormals are below 1.2e-38, far under
//! anything a model holds) and rounds each step to nearest even.

use super::pack::{self, pack_b, pair, pairs_along, PackedB, TILE};
use crate::kernels::cpu;
use crate::kernels::mat::{shapes_checked_and_trivial, Mat};
use crate::kernels::SharedMut;
use rayon::prelude::*;
use std::cell::RefCell;

/// Rows of C per microkernel (one A panel).
const MR: usize = 12;
/// Columns of C per microkernel: two 16-column panels of the B pack.
const NR: usize = 32;
/// Pairs of `k` per cache block.
/// 384: k = 768 (every x·Wᵀ of GPT-2 small but the MLP's) in one block, k = 3072 in
/// four. Over a 124M step's linear forward and dX products it ran at 1.01–1.06× the
/// speed of blocks of 256 and 1.15× of blocks of 128 (`cargo bench --bench bf16`,
/// CPU-time clock, loaded machine).
const KB: usize = 384;
/// Row panels per task (96 rows: the task's A block, 144 KiB per `k` block, in L2).
const TASK_PANELS: usize = 8;
/// Most 32-column panels per task.
const TASK_COLS: usize = 8;

thread_local! {
    /// Packing buffers (A, B) of the calling thread, grown to its largest product and
    /// reused, so a training step allocates nothing once warm. The bf16 matmuls are
    /// called from the thread that runs the step, never from inside a parallel task.
    static PACKS: RefCell<(Vec<u32>, Vec<u32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// `dst = a · b` (or `+=` when `accumulate`) for operands holding bf16 values (others
/// are rounded to nearest even while packing). Panics if [`cpu::avx512_bf16`] is false.
pub fn matmul(dst: &mut [f32], a: Mat, b: Mat, accumulate: bool) {
    if shapes_checked_and_trivial(dst, a, b, accumulate) {
        return;
    }
    PACKS.with_borrow_mut(|(pa, pb)| {
        pack_b(pb, b);
        multiply(dst, a, pb, b.cols, accumulate, pa);
    });
}

/// [`matmul`] with a right-hand operand packed beforehand (the AMX pack).
pub fn matmul_packed(dst: &mut [f32], a: Mat, b: &PackedB, accumulate: bool) {
    assert_eq!(b.k, a.cols, "inner dimensions differ");
    let b_shape = Mat {
        data: &[],
        rows: b.k,
        cols: b.n,
        rs: 0,
        cs: 0,
    };
    if shapes_checked_and_trivial(dst, a, b_shape, accumulate) {
        return;
    }
    PACKS.with_borrow_mut(|(pa, _)| multiply(dst, a, &b.tiles, b.n, accumulate, pa));
}

/// Pairs per vectorised run when packing a row-major A.
const RUN: usize = 16;

/// Packs A (`m × k`) as `[m / MR][k / 2 pairs][MR rows]` into `pa`.
fn pack_a(pa: &mut Vec<u32>, a: Mat) {
    let kp = a.cols.div_ceil(2);
    pa.resize(a.rows.div_ceil(MR) * kp * MR, 0);
    pa.par_chunks_mut(kp * MR)
        .enumerate()
        .for_each(|(panel, d)| pack_a_panel(d, &a, panel * MR));
}

/// One row panel of A (rows `i0..i0 + MR`, zero beyond the last row or column). Reads
/// runs of the operand: along the rows when its row stride is 1 (a transposed
/// operand), along `k` when its column stride is 1 (32 values of a row rounded and
/// paired by one instruction, then the panel's rows interleaved), element by
/// element otherwise. The instruction rounds like [`pair`] except that it flushes
/// subnormal values to zero, which the multiplications do anyway.
fn pack_a_panel(d: &mut [u32], a: &Mat, i0: usize) {
    let (k, kp) = (a.cols, a.cols.div_ceil(2));
    let rows = MR.min(a.rows - i0);
    let get = |i: usize, p: usize| {
        if p < k {
            a.data[i * a.rs + p * a.cs]
        } else {
            0.0
        }
    };
    d.fill(0);
    if a.rs == 1 && a.cs != 1 {
        for p in 0..kp {
            let lo = &a.data[2 * p * a.cs + i0..][..rows];
            let out = &mut d[p * MR..][..rows];
            if 2 * p + 1 < k {
                let hi = &a.data[(2 * p + 1) * a.cs + i0..][..rows];
                for r in 0..rows {
                    out[r] = pair(lo[r], hi[r]);
                }
            } else {
                for r in 0..rows {
                    out[r] = pair(lo[r], 0.0);
                }
            }
        }
    } else if a.cs == 1 {
        let row = |r: usize| &a.data[(i0 + r) * a.rs..][..k];
        // Whole runs of 16 pairs with `vcvtne2ps2bf16`, the rest one pair at a time.
        let runs = k / (2 * RUN);
        for run in 0..runs {
            let mut stage = [[0u32; RUN]; MR];
            for (r, s) in stage.iter_mut().enumerate().take(rows) {
                *s = pairs_along(&row(r)[run * 2 * RUN..][..2 * RUN]);
            }
            let out = &mut d[run * RUN * MR..][..RUN * MR];
            for (q, out) in out.chunks_exact_mut(MR).enumerate() {
                for (o, s) in out.iter_mut().zip(&stage) {
                    *o = s[q];
                }
            }
        }
        for r in 0..rows {
            let rest = &row(r)[runs * 2 * RUN..];
            let mut pairs = rest.chunks_exact(2);
            for (p, x) in pairs.by_ref().enumerate() {
                d[(runs * RUN + p) * MR + r] = pair(x[0], x[1]);
            }
            if let [last] = pairs.remainder() {
                d[(kp - 1) * MR + r] = pair(*last, 0.0);
            }
        }
    } else {
        for r in 0..rows {
            let i = i0 + r;
            for p in 0..kp {
                d[p * MR + r] = pair(get(i, 2 * p), get(i, 2 * p + 1));
            }
        }
    }
}

/// Packs A into `pa`, then `dst (=|+=) a · b` over the packed B `pb` of `n` columns.
fn multiply(dst: &mut [f32], a: Mat, pb: &[u32], n: usize, accumulate: bool, pa: &mut Vec<u32>) {
    multiply_in(dst, a, pb, n, accumulate, pa, KB);
}

/// [`multiply`] with `k` in blocks of `kb` pairs (any `kb` gives the same bits).
fn multiply_in(
    dst: &mut [f32],
    a: Mat,
    pb: &[u32],
    n: usize,
    accumulate: bool,
    pa: &mut Vec<u32>,
    kb_pairs: usize,
) {
    assert!(
        cpu::avx512_bf16(),
        "the AVX512-BF16 kernel needs AVX512-BF16"
    );
    let (m, k) = (a.rows, a.cols);
    let kp = k.div_ceil(2);
    // Pairs per 16-column panel of the B pack (k rounded up to whole AMX tiles).
    let b_panel = k.div_ceil(pack::KT) * TILE;
    let (mp, np) = (m.div_ceil(MR), n.div_ceil(NR));
    assert!(pb.len() >= 2 * np * b_panel, "B pack too short");
    pack_a(pa, a);
    let pa = &pa[..];
    let out = SharedMut::new(dst);
    let tasks = pack::tasks(mp, np, TASK_PANELS, TASK_COLS);
    tasks.into_par_iter().for_each(|(panels, cols)| {
        for kb in (0..kp).step_by(kb_pairs) {
            let kl = kb_pairs.min(kp - kb);
            let load = accumulate || kb > 0;
            for j in cols.clone() {
                let b0 = &pb[2 * j * b_panel + kb * pack::T..][..kl * pack::T];
                let b1 = &pb[(2 * j + 1) * b_panel + kb * pack::T..][..kl * pack::T];
                for i in panels.clone() {
                    let ap = &pa[i * kp * MR + kb * MR..][..kl * MR];
                    let rows = MR.min(m - i * MR);
                    let width = NR.min(n - j * NR);
                    // SAFETY: rows i·MR.. and columns j·NR.. of dst belong to this task
                    // alone (tasks partition the panel grid); the tile's last element
                    // (i·MR + rows − 1)·n + j·NR + width − 1 is < m·n.
                    let c = unsafe { out.slice((i * MR) * n + j * NR, (rows - 1) * n + width) };
                    tile(ap, b0, b1, c, n, rows, width, load);
                }
            }
        }
    });
}

/// `c (=|+=) a · [b0 b1]` for one `rows × width` tile of C (row stride `ldc`): `a` an A
/// panel's `kl` pairs, `b0`/`b1` the same pairs of two 16-column B panels. Full tiles
/// work on C in place, edge tiles on a copy.
#[allow(clippy::too_many_arguments)]
fn tile(
    a: &[u32],
    b0: &[u32],
    b1: &[u32],
    c: &mut [f32],
    ldc: usize,
    rows: usize,
    width: usize,
    load: bool,
) {
    let kl = a.len() / MR;
    assert!(b0.len() == kl * pack::T && b1.len() == kl * pack::T);
    // The register block on `out`, MR rows of NR at stride `ld`.
    let micro = |out: &mut [f32], ld: usize| {
        assert!(out.len() > (MR - 1) * ld + NR - 1);
        // SAFETY: cpu::avx512_bf16() was checked by multiply; a holds kl·MR pairs, b0
        // and b1 kl·16 each, and out holds MR rows of NR at stride ld (all asserted).
        unsafe {
            let (a, b0, b1) = (a.as_ptr(), b0.as_ptr(), b1.as_ptr());
            x86::micro(kl, a, b0, b1, out.as_mut_ptr(), ld, load)
        }
    };
    if rows == MR && width == NR {
        return micro(c, ldc);
    }
    let mut tmp = [0.0f32; MR * NR];
    if load {
        for r in 0..rows {
            tmp[r * NR..][..width].copy_from_slice(&c[r * ldc..][..width]);
        }
    }
    micro(&mut tmp, NR);
    for r in 0..rows {
        c[r * ldc..][..width].copy_from_slice(&tmp[r * NR..][..width]);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::MR;
    use std::arch::x86_64::*;

    /// The register block: `c[r][0..32] (=|+=) Σ_p a[p][r] · (b0[p] | b1[p])` over `kl`
    /// pairs, 24 accumulators (MR rows × two 16-lane halves).
    ///
    /// # Safety
    /// The CPU has AVX-512 F and AVX512-BF16; `a` holds `kl · MR` pairs, `b0` and `b1`
    /// `kl · 16` each; `c` holds MR rows of 32 floats at stride `ldc`.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn micro(
        kl: usize,
        a: *const u32,
        b0: *const u32,
        b1: *const u32,
        c: *mut f32,
        ldc: usize,
        load: bool,
    ) {
        let mut acc = [[_mm512_setzero_ps(); 2]; MR];
        if load {
            for (r, acc) in acc.iter_mut().enumerate() {
                // SAFETY: row r of c is in bounds (caller).
                unsafe {
                    acc[0] = _mm512_loadu_ps(c.add(r * ldc));
                    acc[1] = _mm512_loadu_ps(c.add(r * ldc + 16));
                }
            }
        }
        for p in 0..kl {
            // SAFETY: pair row p < kl of b0, b1 and of the A panel (caller).
            unsafe {
                let x0: __m512bh = std::mem::transmute(_mm512_loadu_si512(b0.add(p * 16).cast()));
                let x1: __m512bh = std::mem::transmute(_mm512_loadu_si512(b1.add(p * 16).cast()));
                let ar = a.add(p * MR);
                for (r, acc) in acc.iter_mut().enumerate() {
                    let y: __m512bh = std::mem::transmute(_mm512_set1_epi32(*ar.add(r) as i32));
                    acc[0] = _mm512_dpbf16_ps(acc[0], y, x0);
                    acc[1] = _mm512_dpbf16_ps(acc[1], y, x1);
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            // SAFETY: row r of c is in bounds (caller).
            unsafe {
                _mm512_storeu_ps(c.add(r * ldc), acc[0]);
                _mm512_storeu_ps(c.add(r * ldc + 16), acc[1]);
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod x86 {
    /// Never called: `cpu::avx512_bf16` is false off x86-64.
    ///
    /// # Safety
    /// None needed; it panics.
    pub(super) unsafe fn micro(
        _: usize,
        _: *const u32,
        _: *const u32,
        _: *const u32,
        _: *mut f32,
        _: usize,
        _: bool,
    ) {
        unreachable!("AVX512-BF16 is x86-64 only")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::bf16::testcases::*;
    use crate::kernels::mat::matmul as f32_gemm;
    use crate::kernels::testutil::*;

    fn usable() -> bool {
        if !cpu::avx512_bf16() {
            eprintln!("AVX512-BF16 kernel not tested: no AVX512-BF16 on this CPU");
        }
        cpu::avx512_bf16()
    }

    #[test]
    fn dpbf16_matches_an_f64_reference_on_odd_shapes() {
        if !usable() {
            return;
        }
        odd_shapes(matmul);
        // Several k blocks (KB pairs) and row and column tasks, ragged everywhere; the
        // later k blocks add to what the first wrote, accumulating or not.
        check(matmul, [205, 1029, 99], [true, false], true);
        check(matmul, [99, 1029, 205], [false, true], false);
    }

    #[test]
    fn dpbf16_reads_strided_views_and_rounds_its_inputs() {
        if !usable() {
            return;
        }
        strided_views(matmul);
        // An A with neither stride 1 (packed element by element), k odd.
        let (m, k, n) = (30, 41, 35);
        let store = rounded(2 * m * k, 6);
        let a = Mat::strided(&store, (m, k), (2, 2 * m));
        let b = rounded(k * n, 7);
        let b = Mat::new(&b, k, n);
        let mut got = vec![0.0; m * n];
        matmul(&mut got, a, b, false);
        assert_close("A strided", &got, &reference(&got, a, b, false), 0.0, 1e-4);
        non_bf16_inputs_round(matmul);
        empty_inner_dimension(matmul);
    }

    #[test]
    fn a_b_packed_beforehand_gives_the_same_bits() {
        if !usable() {
            return;
        }
        let dims = [70, 300, 90];
        let (a, b) = (rounded(70 * 300, 1), rounded(300 * 90, 2));
        let [am, bm] = views(&a, &b, dims, [false, true]);
        let mut packed = PackedB::default();
        packed.pack(bm);
        let prior = rand_vec(70 * 90, 3);
        let (mut x, mut y) = (prior.clone(), prior);
        matmul(&mut x, am, bm, true);
        matmul_packed(&mut y, am, &packed, true);
        assert_eq!(x, y);
    }

    #[test]
    fn results_do_not_depend_on_the_thread_count() {
        // Tasks own disjoint blocks of C and add the k blocks in a fixed order.
        if !usable() {
            return;
        }
        same_bits_on_any_thread_count(matmul, [260, 1000, 300], &[2, 5, 1]);
    }

    #[test]
    fn the_k_blocking_changes_no_bit() {
        // Between k blocks the accumulators go to C and come back exactly: blocks of
        // any size, ragged or not, give one pass's bits, accumulating or not.
        if !usable() {
            return;
        }
        let (m, k, n) = (40, 1001, 70);
        let (a, b) = (rounded(m * k, 1), rounded(k * n, 2));
        let [am, bm] = views(&a, &b, [m, k, n], [false, false]);
        let mut pb = Vec::new();
        pack_b(&mut pb, bm);
        let prior = rand_vec(m * n, 3);
        for acc in [false, true] {
            let run = |kb: usize| {
                let mut c = prior.clone();
                multiply_in(&mut c, am, &pb, n, acc, &mut Vec::new(), kb);
                c
            };
            let whole = run(k.div_ceil(2));
            for kb in [1, 7, 128, KB] {
                assert!(run(kb) == whole, "blocks of {kb} pairs, acc {acc}");
            }
        }
    }

    /// Timing, not correctness: `cargo test --release --lib dpbf16_speed -- --ignored
    /// --nocapture`. Alternates the f32 GEMM and this kernel (packing included) on
    /// GPT-2 124M's products (B·T = 1024; the classifier's 256-row chunks).
    #[test]
    #[ignore]
    fn dpbf16_speed() {
        if !usable() {
            return;
        }
        // The classifier's dwte in the 4,096-row vocabulary blocks it runs in.
        let dwte = ("cls dwte dlᵀ·x", 4096, 256, 768, true, false);
        let shapes = [&GPT2_PRODUCTS[..], &[dwte]].concat();
        let reps = std::env::var("DPBF16_REPS").map_or(5, |r| r.parse().unwrap());
        // DPBF16_SHAPES=qkv,cls runs only the products whose names contain one of them.
        let only = std::env::var("DPBF16_SHAPES").unwrap_or_default();
        let picked = |name: &str| only.is_empty() || only.split(',').any(|s| name.contains(s));
        for (name, m, k, n, ta, tb) in shapes.into_iter().filter(|s| picked(s.0)) {
            let (a, b) = (rounded(m * k, 1), rounded(k * n, 2));
            let [am, bm] = views(&a, &b, [m, k, n], [ta, tb]);
            let mut out = vec![0.0; m * n];
            matmul(&mut out, am, bm, false);
            let mut packed = PackedB::default();
            packed.pack(bm);
            let mut t = [Vec::new(), Vec::new(), Vec::new()];
            for _ in 0..reps {
                let s = std::time::Instant::now();
                f32_gemm(&mut out, am, bm, false);
                t[0].push(s.elapsed().as_secs_f64());
                let s = std::time::Instant::now();
                matmul(&mut out, am, bm, false);
                t[1].push(s.elapsed().as_secs_f64());
                let s = std::time::Instant::now();
                matmul_packed(&mut out, am, &packed, false);
                t[2].push(s.elapsed().as_secs_f64());
            }
            let median = |t: &mut Vec<f64>| {
                t.sort_by(f64::total_cmp);
                t[t.len() / 2]
            };
            let flop = 2.0 * (m * n * k) as f64 / 1e9;
            let [f, d, p] = t.map(|mut t| flop / median(&mut t));
            println!(
                "{name:<16} {m:>5}×{k:>5}×{n:>5}: f32 GEMM {f:>6.1}, AVX512-BF16 {d:>6.1} \
                 ({p:>6.1} with B packed before) GFLOP/s, {:.2}× (medians of {reps}, alternating)",
                d / f
            );
        }
    }
}
