//! A bf16 GEMM on AMX-BF16 (`tdpbf16ps`), the default path of the bf16 matmuls
//! on CPUs that have AMX and whose kernel lets the process use it.
//!
//! One `tdpbf16ps` adds a 16 × 32 bf16 A tile times a 32 × 16 bf16 B tile (held as
//! 16 rows of k-pairs) into a 16 × 16 f32 accumulator tile; the two products of a
//! pair are exact in f32. Operands are packed once per call (or, for a B reused by
//! many products, once beforehand: [`PackedB`]) into 1 KiB tiles of bf16 pairs,
//! zero-padded at the edges: A as `[m / 16][k / 32][16 rows][16 pairs]`, B as
//! `[n / 16][k / 32][16 pairs][16 columns]`. Each 32 × 32 output block holds four
//! accumulator tiles (tmm0–3) fed by two A tiles (tmm4–5) and two B tiles (tmm6–7).
//! `k` runs in blocks of `KB` tiles: per block, a task holds one block row's two A
//! tile rows (24 KiB, in L1) while B's column panels stream past from L2, prefetched
//! two tiles ahead, and loads and stores C once (exactly: a block boundary changes no
//! bit). Tasks own disjoint blocks of C and run `k` in a fixed order, so results do
//! not depend on the thread count. The instruction treats subnormal inputs
//! and results as zero (bf16 subnormals are below 1.2e-38, far under anything a model
//! holds).
//!
//! The tile registers need the process's permission (`arch_prctl(ARCH_REQ_XCOMP_PERM,
//! XFEATURE_XTILEDATA)`, asked once; the kernel grants it to the whole process) and a
//! tile configuration, which is per thread: every task loads it and releases the
//! tiles when done.

use super::pack::{pack_b, pack_len, pack_tile, tasks, PackedB, KT, T, TILE};
use crate::kernels::cpu;
use crate::kernels::mat::Mat;
use crate::kernels::SharedMut;
use rayon::prelude::*;
use std::cell::RefCell;
use std::ops::Range;

/// Tiles of `k` per cache block (384 values): the task's A block (up to 8 × 24 KiB)
/// stays in L2 and one block's two A tile rows in L1 while B's panels stream past,
/// prefetched two tiles ahead. C is loaded and stored once per `k` block.
const KB: usize = 12;
/// Most output blocks (32 × 32) of one parallel task, down and across.
const TASK_M: usize = 8;
const TASK_N: usize = 8;

thread_local! {
    /// Packing buffers (A, B) of the calling thread, grown to its largest product and
    /// reused, so a training step allocates nothing once warm. The bf16 matmuls are
    /// called from the thread that runs the step, never from inside a parallel task,
    /// so one thread's buffers serve them all.
    static PACKS: RefCell<(Vec<u32>, Vec<u32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// `dst = a · b` (or `+=` when `accumulate`) on the AMX tiles, packing into this
/// thread's buffers. The caller checked [`cpu::amx_permitted`].
pub(crate) fn matmul(dst: &mut [f32], a: Mat, b: Mat, accumulate: bool) {
    assert_eq!(b.rows, a.cols, "inner dimensions differ");
    if trivial(dst, a.rows, b.cols, a.cols, accumulate) {
        return;
    }
    PACKS.with_borrow_mut(|(pa, pb)| {
        pack_b(pb, b);
        multiply(dst, a, pb, b.cols, accumulate, pa);
    });
}

/// [`matmul`] with a right-hand operand packed beforehand.
pub(crate) fn matmul_packed(dst: &mut [f32], a: Mat, b: &PackedB, accumulate: bool) {
    assert_eq!(b.k, a.cols, "inner dimensions differ");
    if trivial(dst, a.rows, b.n, a.cols, accumulate) {
        return;
    }
    PACKS.with_borrow_mut(|(pa, _)| multiply(dst, a, &b.tiles, b.n, accumulate, pa));
}

/// Checks the shapes; true (with `dst` done) when there is nothing to multiply.
fn trivial(dst: &mut [f32], m: usize, n: usize, k: usize, accumulate: bool) -> bool {
    assert_eq!(dst.len(), m * n, "destination does not match m × n");
    assert!(
        cpu::amx_permitted(),
        "the AMX kernel needs AMX-BF16 and the tile permission"
    );
    if k == 0 && !accumulate {
        dst.fill(0.0);
    }
    m == 0 || n == 0 || k == 0
}

/// Packs A (`m × k`) into `pa`, then `dst (=|+=) a · b` over the packed B `pb` of `n`
/// columns, in 32 × 32 output blocks.
fn multiply(dst: &mut [f32], a: Mat, pb: &[u32], n: usize, accumulate: bool, pa: &mut Vec<u32>) {
    multiply_in(dst, a, pb, n, accumulate, pa, KB);
}

/// [`multiply`] with `k` in blocks of `kb_tiles` tiles (any size gives the same bits).
fn multiply_in(
    dst: &mut [f32],
    a: Mat,
    pb: &[u32],
    n: usize,
    accumulate: bool,
    pa: &mut Vec<u32>,
    kb_tiles: usize,
) {
    let (m, k) = (a.rows, a.cols);
    let (mb, nb, kc) = (m.div_ceil(2 * T), n.div_ceil(2 * T), k.div_ceil(KT));
    assert!(pb.len() >= pack_len(2 * nb, kc), "B pack too short");
    pa.resize(pack_len(2 * mb, kc), 0);
    let vector = cpu::avx512_bf16();
    pa.par_chunks_mut(kc * TILE)
        .enumerate()
        .for_each(|(blk, d)| {
            for (c, tile) in d.chunks_exact_mut(TILE).enumerate() {
                pack_tile::<T, 1>(tile, &a, blk * T, c * KT, vector);
            }
        });
    let pa = &pa[..];
    let out = SharedMut::new(dst);
    let tasks = tasks(mb, nb, TASK_M, TASK_N);
    tasks.into_par_iter().for_each(|(rows, cols)| {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: cpu::amx_permitted() confirmed AMX-BF16 and the tile permission; the config
        // is 64 valid bytes.
        unsafe {
            x86::configure()
        };
        for kb in (0..kc).step_by(kb_tiles) {
            let kl = kb_tiles.min(kc - kb);
            let load = accumulate || kb > 0;
            for bi in rows.clone() {
                let ap = tile_pair(pa, 2 * bi, kc, kb..kb + kl);
                for bj in cols.clone() {
                    let bp = tile_pair(pb, 2 * bj, kc, kb..kb + kl);
                    let (r, c) = ((m - bi * 2 * T).min(2 * T), (n - bj * 2 * T).min(2 * T));
                    // SAFETY: rows bi·32.. and columns bj·32.. of dst belong to this
                    // task alone (tasks partition the block grid); `block` checks that
                    // the r × c block lies inside dst.
                    unsafe { block(ap, bp, out, (bi * 2 * T, bj * 2 * T), (r, c), n, load) };
                }
            }
        }
        #[cfg(target_arch = "x86_64")]
        // SAFETY: releases this thread's tile state, loaded above.
        unsafe {
            x86::release()
        };
    });
}

/// Tiles `ks` of tile rows (or columns) `i` and `i + 1` of a pack of `kc` tiles each.
fn tile_pair(p: &[u32], i: usize, kc: usize, ks: Range<usize>) -> [&[u32]; 2] {
    [i, i + 1].map(|i| &p[(i * kc + ks.start) * TILE..(i * kc + ks.end) * TILE])
}

/// `C (=|+=) A · B` for the `rows × cols` block of `dst` (row stride `n`) at
/// `(i0, j0)`: `a` two A tile rows, `b` two B tile columns, the same `k` tiles each.
/// A whole 32 × 32 block works on `dst` in place, an edge block on a copy.
///
/// # Safety
/// The calling task owns the block of `dst` (no other thread reads or writes it
/// meanwhile), and this thread loaded the tile configuration.
#[allow(clippy::too_many_arguments)]
unsafe fn block(
    a: [&[u32]; 2],
    b: [&[u32]; 2],
    dst: SharedMut,
    (i0, j0): (usize, usize),
    (rows, cols): (usize, usize),
    n: usize,
    load: bool,
) {
    let kl = a[0].len() / TILE;
    assert!(kl > 0 && [a[1], b[0], b[1]].iter().all(|x| x.len() == kl * TILE));
    assert!(
        (i0 + rows - 1) * n + j0 + cols <= dst.len(),
        "block outside dst"
    );
    #[cfg(target_arch = "x86_64")]
    {
        let at = i0 * n + j0;
        if rows == 2 * T && cols == 2 * T {
            // SAFETY: the block's 32 rows of 32 at stride n are inside dst (asserted)
            // and this task's alone (caller); the packs hold kl tiles each (asserted).
            return unsafe { x86::block(kl, a, b, dst.ptr().add(at), 4 * n, load) };
        }
        let mut tmp = [[0.0f32; 2 * T]; 2 * T];
        // SAFETY: rows i0.. i0 + rows of cols values at stride n are inside dst
        // (asserted) and this task's alone (caller).
        let row = |r: usize| unsafe { dst.slice(at + r * n, cols) };
        if load {
            (0..rows).for_each(|r| tmp[r][..cols].copy_from_slice(row(r)));
        }
        // SAFETY: tmp holds 32 rows of 32 floats at a 128-byte stride; as above.
        unsafe { x86::block(kl, a, b, tmp.as_mut_ptr().cast(), 4 * 2 * T, load) };
        (0..rows).for_each(|r| row(r).copy_from_slice(&tmp[r][..cols]));
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("amx_permitted() is false off x86-64: {a:?}{b:?}{rows}{cols}{n}{load}{i0}{j0}");
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{T, TILE};
    use core::arch::asm;

    /// Palette 1 with all eight tiles 16 rows × 64 bytes.
    #[repr(C, align(64))]
    struct Config([u8; 64]);

    const CONFIG: Config = {
        let mut c = [0u8; 64];
        c[0] = 1; // palette
        let mut t = 0;
        while t < 8 {
            c[16 + 2 * t] = 64; // bytes per row (u16, little-endian)
            c[48 + t] = T as u8; // rows
            t += 1;
        }
        Config(c)
    };

    /// Loads the tile configuration for the calling thread.
    ///
    /// # Safety
    /// The CPU has AMX-TILE and the process holds the tile-data permission.
    pub(crate) unsafe fn configure() {
        // SAFETY: CONFIG is a valid 64-byte palette-1 configuration (caller: AMX usable).
        unsafe { asm!("ldtilecfg [{0}]", in(reg) &CONFIG.0, options(nostack, readonly)) };
    }

    /// Returns the tiles to their initial state (frees the thread's tile context).
    ///
    /// # Safety
    /// As for [`configure`].
    pub(crate) unsafe fn release() {
        // SAFETY: tilerelease only resets tile state (caller: AMX usable).
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }

    /// One `prefetcht0` per byte offset from the register `{$r}`.
    macro_rules! prefetch_lines {
        ($r:literal: $($off:literal)*) => {
            concat!($("prefetcht0 [{", $r, "} + ", $off, "]\n",)*)
        };
    }

    /// Sixteen `prefetcht0`, one per 64-byte line of the tile two tiles past `{$r}`.
    macro_rules! prefetch_tile_after_next {
        ($r:literal) => {
            prefetch_lines!($r: 2048 2112 2176 2240 2304 2368 2432 2496
                2560 2624 2688 2752 2816 2880 2944 3008)
        };
    }

    /// `C (=|+=) Σ_k A · B` for one 32 × 32 block of f32 at `c` (rows `ldc` bytes
    /// apart; added to when `load`): `a` two A tile rows (16 rows each) and `b` two B
    /// tile columns, `kl` tiles each. The loads are spread between the products,
    /// each as late as the product that needs it (the tile registers are not renamed,
    /// so a load waits for the products still reading the register), and B's tiles
    /// two steps ahead are prefetched into L1.
    ///
    /// # Safety
    /// [`configure`] ran on this thread; `a` and `b` hold `kl` ≥ 1 tiles each; `c`
    /// points to 32 rows of 32 writable floats, `ldc` bytes apart.
    pub(crate) unsafe fn block(
        kl: usize,
        a: [&[u32]; 2],
        b: [&[u32]; 2],
        c: *mut f32,
        ldc: usize,
        load: bool,
    ) {
        assert!(kl > 0 && a.iter().chain(&b).all(|x| x.len() >= kl * TILE));
        let (c1, c2) = (c.wrapping_add(T), c.wrapping_byte_add(T * ldc));
        let c3 = c2.wrapping_add(T);
        // SAFETY: the four accumulator tiles are 16 rows of 64 bytes at stride ldc
        // inside the caller's 32 × 32 block (caller's contract).
        unsafe {
            match load {
                true => asm!(
                    "tileloadd tmm0, [{c0} + {s}*1]",
                    "tileloadd tmm1, [{c1} + {s}*1]",
                    "tileloadd tmm2, [{c2} + {s}*1]",
                    "tileloadd tmm3, [{c3} + {s}*1]",
                    c0 = in(reg) c, c1 = in(reg) c1, c2 = in(reg) c2, c3 = in(reg) c3,
                    s = in(reg) ldc,
                    options(nostack, readonly),
                ),
                false => asm!(
                    "tilezero tmm0",
                    "tilezero tmm1",
                    "tilezero tmm2",
                    "tilezero tmm3",
                    options(nostack, nomem),
                ),
            }
        }
        // SAFETY: each tileloadd reads 16 rows of 64 bytes from within a packed tile
        // (tiles 0..kl of each operand; asserted above); prefetches do not fault.
        unsafe {
            asm!(
                "2:",
                "tileloadd tmm4, [{a0} + {s}*1]",
                "tileloadd tmm6, [{b0} + {s}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tileloadd tmm7, [{b1} + {s}*1]",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tileloadd tmm5, [{a1} + {s}*1]",
                prefetch_tile_after_next!("b0"),
                prefetch_tile_after_next!("b1"),
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "add {a0}, 1024",
                "add {a1}, 1024",
                "add {b0}, 1024",
                "add {b1}, 1024",
                "dec {n}",
                "jnz 2b",
                a0 = inout(reg) a[0].as_ptr() => _,
                a1 = inout(reg) a[1].as_ptr() => _,
                b0 = inout(reg) b[0].as_ptr() => _,
                b1 = inout(reg) b[1].as_ptr() => _,
                n = inout(reg) kl => _,
                s = in(reg) 64usize,
                options(nostack, readonly),
            );
        }
        // SAFETY: as for the loads of C above, now writing.
        unsafe {
            asm!(
                "tilestored [{c0} + {s}*1], tmm0",
                "tilestored [{c1} + {s}*1], tmm1",
                "tilestored [{c2} + {s}*1], tmm2",
                "tilestored [{c3} + {s}*1], tmm3",
                c0 = in(reg) c, c1 = in(reg) c1, c2 = in(reg) c2, c3 = in(reg) c3,
                s = in(reg) ldc,
                options(nostack),
            )
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::bf16::round;
    use crate::kernels::bf16::testcases::{rounded, same_bits_on_any_thread_count, views};
    use crate::kernels::mat::matmul as f32_gemm;
    use crate::kernels::testutil::*;

    fn usable() -> bool {
        if !cpu::amx_permitted() {
            eprintln!(
                "AMX kernel not tested: {}",
                match cpu::has_amx() {
                    true => "the OS refused the tile permission",
                    false => "no AMX-BF16 on this CPU",
                }
            );
        }
        cpu::amx_permitted()
    }

    /// The AMX kernel against the f32 GEMM on the same bf16 values: equal up to
    /// summation order.
    fn check(m: usize, k: usize, n: usize, ta: bool, tb: bool, acc: bool) {
        let (a, b) = (rounded(m * k, 1), rounded(k * n, 2));
        let [am, bm] = views(&a, &b, [m, k, n], [ta, tb]);
        let prior = rand_vec(m * n, 3);
        let (mut want, mut got) = (prior.clone(), prior.clone());
        f32_gemm(&mut want, am, bm, acc);
        matmul(&mut got, am, bm, acc);
        // |error| ≤ k · 2^-23 · Σ|a·b| roughly; Σ|a·b| ≤ k for values in [-1, 1].
        let tol = 1e-6 * k as f64;
        let want64: Vec<f64> = want.iter().map(|&v| v as f64).collect();
        assert_close(
            &format!("{m}×{k}×{n} ta={ta} tb={tb} acc={acc}"),
            &got,
            &want64,
            0.0,
            tol,
        );
    }

    #[test]
    fn amx_kernel_matches_the_f32_gemm_on_bf16_values() {
        if !usable() {
            return;
        }
        check(16, 32, 16, false, false, false); // one tile exactly
        check(32, 64, 32, false, false, true); // one block exactly, two k tiles
        check(1, 1, 1, false, false, true); // all padding
        check(37, 75, 101, false, false, false); // ragged in m, k (odd) and n
        check(64, 96, 48, false, true, true); // forward: x · Wᵀ, accumulating
        check(64, 96, 48, false, true, false); // forward, overwriting
        check(50, 130, 70, false, false, true); // dinp = dout · W
        check(70, 33, 129, true, false, true); // dweight += doutᵀ · x
        check(70, 33, 129, true, false, false);
        check(300, 256, 200, true, true, false); // several tasks in both directions
        check(200, 777, 161, false, true, true); // many k tiles, ragged everywhere
    }

    #[test]
    fn an_empty_inner_dimension_gives_zero_or_leaves_dst() {
        if !usable() {
            return;
        }
        let mut dst = vec![5.0; 6];
        matmul(&mut dst, Mat::new(&[], 2, 0), Mat::new(&[], 0, 3), true);
        assert_eq!(dst, vec![5.0; 6]);
        matmul(&mut dst, Mat::new(&[], 2, 0), Mat::new(&[], 0, 3), false);
        assert_eq!(dst, vec![0.0; 6]);
    }

    #[test]
    fn non_bf16_inputs_are_rounded_to_nearest_even_when_packed() {
        if !usable() {
            return;
        }
        let (m, k, n) = (9, 40, 33);
        let (a, b) = (rand_vec(m * k, 4), rand_vec(k * n, 5));
        let ra: Vec<f32> = a.iter().map(|&v| round(v)).collect();
        let rb: Vec<f32> = b.iter().map(|&v| round(v)).collect();
        let mut want = vec![0.0; m * n];
        f32_gemm(&mut want, Mat::new(&ra, m, k), Mat::new(&rb, k, n), false);
        let mut got = vec![0.0; m * n];
        matmul(&mut got, Mat::new(&a, m, k), Mat::new(&b, k, n), false);
        let want64: Vec<f64> = want.iter().map(|&v| v as f64).collect();
        assert_close("rounded on packing", &got, &want64, 0.0, 1e-5);
    }

    #[test]
    fn the_k_blocking_changes_no_bit() {
        // C goes to memory between k blocks and comes back exactly.
        if !usable() {
            return;
        }
        let (m, k, n) = (70, 777, 90);
        let (a, b) = (rounded(m * k, 8), rounded(k * n, 9));
        let [am, bm] = views(&a, &b, [m, k, n], [false, true]);
        let mut pb = Vec::new();
        pack_b(&mut pb, bm);
        for acc in [false, true] {
            let prior = rand_vec(m * n, 10);
            let runs = [1, 5, KB, 1000].map(|kb| {
                let mut c = prior.clone();
                multiply_in(&mut c, am, &pb, n, acc, &mut Vec::new(), kb);
                c
            });
            assert!(runs.iter().all(|c| c == &runs[0]), "accumulate {acc}");
        }
    }

    #[test]
    fn results_do_not_depend_on_the_thread_count() {
        // Tasks own disjoint output blocks and sum k in a fixed order, on whichever
        // worker thread (each loads its own tile config): bit-identical results.
        if !usable() {
            return;
        }
        same_bits_on_any_thread_count(matmul, [260, 200, 300], &[3, 8]);
    }

    /// Timing, not correctness: `cargo test --release --lib amx_kernel_speed -- --ignored
    /// --nocapture`. Alternates the two paths on GPT-2 124M shapes (B·T = 1024).
    #[test]
    #[ignore]
    #[cfg(target_arch = "x86_64")]
    fn amx_kernel_speed() {
        if !cpu::amx_permitted() {
            eprintln!("no usable AMX here: nothing to time");
            return;
        }
        {
            // Peak of one 32 × 32 AMX block, on cache-resident packs.
            let kc = 24;
            let p = vec![0x3F80_3F80u32; 2 * kc * 256];
            let mut c = [[0.0f32; 32]; 32];
            let reps = 20_000;
            // SAFETY: amx_permitted() checked; the config is loaded on this thread before
            // the blocks and released after.
            let t = unsafe {
                x86::configure();
                let s = std::time::Instant::now();
                let (a0, a1) = p.split_at(kc * 256);
                for _ in 0..reps {
                    let a = std::hint::black_box([a0, a1]);
                    x86::block(kc, a, [a0, a1], c.as_mut_ptr().cast(), 128, false);
                }
                let t = s.elapsed().as_secs_f64();
                x86::release();
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
        for (m, k, n, ta, tb) in shapes {
            let (a, b) = (rounded(m * k, 1), rounded(k * n, 2));
            let [am, bm] = views(&a, &b, [m, k, n], [ta, tb]);
            let mut out = vec![0.0; m * n];
            let mut t = [Vec::new(), Vec::new()];
            for _ in 0..7 {
                let s = std::time::Instant::now();
                f32_gemm(&mut out, am, bm, false);
                t[0].push(s.elapsed().as_secs_f64());
                let s = std::time::Instant::now();
                matmul(&mut out, am, bm, false);
                t[1].push(s.elapsed().as_secs_f64());
            }
            let gf = |t: &mut Vec<f64>| {
                t.sort_by(f64::total_cmp);
                2.0 * (m * n * k) as f64 / t[t.len() / 2] / 1e9
            };
            let (f32, amx) = (gf(&mut t[0]), gf(&mut t[1]));
            println!(
                "{m}×{k}×{n} (Aᵀ {ta}, Bᵀ {tb}): f32 GEMM {f32:.1}, AMX-BF16 {amx:.1} GFLOP/s \
                 (medians of 7, alternating)"
            );
        }
    }
}
