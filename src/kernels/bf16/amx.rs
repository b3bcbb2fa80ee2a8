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

use super::Bf16;
use crate::kernels::matmul::Mat;
use crate::kernels::SharedMut;
use rayon::prelude::*;
use std::cell::RefCell;
use std::ops::Range;
use std::sync::OnceLock;

/// Rows and columns of one tile (16 f32 accumulators or 16 bf16 pairs per row).
pub(super) const T: usize = 16;
/// bf16 values of `k` per tile (16 pairs).
pub(super) const KT: usize = 32;
/// u32 pairs per packed tile.
pub(super) const TILE: usize = T * T;
/// Tiles of `k` per cache block (384 values): the task's A block (up to 8 × 24 KiB)
/// stays in L2 and one block's two A tile rows in L1 while B's panels stream past,
/// prefetched two tiles ahead. C is loaded and stored once per `k` block.
const KB: usize = 12;
/// Most output blocks (32 × 32) of one parallel task, down and across.
const TASK_M: usize = 8;
const TASK_N: usize = 8;

/// Whether this CPU has AMX-TILE and AMX-BF16 and the process may use the tiles
/// (asked of the kernel once, the first time this is called).
pub fn permitted() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| cpu_has_amx() && request_permission())
}

/// CPUID leaf 7: EDX bit 22 is AMX-BF16, bit 24 AMX-TILE.
pub fn cpu_has_amx() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // Leaf 7 exists when the maximum basic leaf (leaf 0's EAX) is at least 7.
        if std::arch::x86_64::__cpuid(0).eax < 7 {
            return false;
        }
        let edx = std::arch::x86_64::__cpuid_count(7, 0).edx;
        edx & (1 << 22) != 0 && edx & (1 << 24) != 0
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Asks Linux for the tile-data state component for this process.
fn request_permission() -> bool {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    {
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: arch_prctl with these arguments only changes which xsave features the
        // process may use; it reads and writes no memory of ours.
        let r = unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_REQ_XCOMP_PERM,
                XFEATURE_XTILEDATA,
            )
        };
        r == 0
    }
    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    false
}

/// Two bf16 values in one 32-bit lane: `lo` is element `2p`, `hi` element `2p + 1`
/// (the pair layout of the packed tiles).
#[inline]
pub(super) fn pair(lo: f32, hi: f32) -> u32 {
    Bf16::from_f32(lo).0 as u32 | (Bf16::from_f32(hi).0 as u32) << 16
}

/// Element `(i, j)` of `m`, or 0 outside it (the zero padding of the packs).
#[inline]
fn at(m: &Mat, i: usize, j: usize) -> f32 {
    if i < m.rows && j < m.cols {
        m.data[i * m.rs + j * m.cs]
    } else {
        0.0
    }
}

/// Pairs in a pack of `blocks16` tile rows (or columns) of `kc` tiles each.
fn pack_len(blocks16: usize, kc: usize) -> usize {
    blocks16 * kc * TILE
}

/// One tile of pairs along `k` of `x` (rows `i`, columns `k`):
/// `dst[r·SI + p·SP] = (x(i0 + r, k0 + 2p), x(i0 + r, k0 + 2p + 1))` for r, p < 16.
/// An A tile is `x = a` with (SI, SP) = (16, 1); a B tile is `x = bᵀ` with (1, 16).
/// Whole tiles read runs of the operand directly (along `k` when its column stride
/// is 1, along `i` when its row stride is 1), 16 pairs per AVX512-BF16 instruction
/// when `vector` (then subnormals become zero, which both kernels' multiplications
/// do anyway); edge tiles pad with zeros.
fn pack_tile<const SI: usize, const SP: usize>(
    dst: &mut [u32],
    x: &Mat,
    i0: usize,
    k0: usize,
    vector: bool,
) {
    let dst = &mut dst[..TILE];
    let whole = i0 + T <= x.rows && k0 + KT <= x.cols;
    if whole && x.cs == 1 {
        for r in 0..T {
            let run = &x.data[(i0 + r) * x.rs + k0..][..KT];
            if vector {
                let pairs = super::dpbf16::pairs_along(run);
                for (p, &v) in pairs.iter().enumerate() {
                    dst[r * SI + p * SP] = v;
                }
                continue;
            }
            for p in 0..T {
                dst[r * SI + p * SP] = pair(run[2 * p], run[2 * p + 1]);
            }
        }
    } else if whole && x.rs == 1 {
        for p in 0..T {
            let lo = &x.data[(k0 + 2 * p) * x.cs + i0..][..T];
            let hi = &x.data[(k0 + 2 * p + 1) * x.cs + i0..][..T];
            if vector {
                let pairs = super::dpbf16::pairs_across(lo, hi);
                for (r, &v) in pairs.iter().enumerate() {
                    dst[r * SI + p * SP] = v;
                }
                continue;
            }
            for r in 0..T {
                dst[r * SI + p * SP] = pair(lo[r], hi[r]);
            }
        }
    } else {
        for r in 0..T {
            for p in 0..T {
                let (i, j) = (i0 + r, k0 + 2 * p);
                dst[r * SI + p * SP] = pair(at(x, i, j), at(x, i, j + 1));
            }
        }
    }
}

thread_local! {
    /// Packing buffers (A, B) of the calling thread, grown to its largest product and
    /// reused, so a training step allocates nothing once warm. The bf16 matmuls are
    /// called from the thread that runs the step, never from inside a parallel task,
    /// so one thread's buffers serve them all.
    static PACKS: RefCell<(Vec<u32>, Vec<u32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// `dst = a · b` (or `+=` when `accumulate`) on the AMX tiles, packing into this
/// thread's buffers. The caller checked [`permitted`].
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

/// A `k × n` right-hand operand packed for the tiles once and reused by many
/// products (the classifier's `wte`, shared by every chunk of rows of a step).
#[derive(Default)]
pub struct PackedB {
    pub(super) tiles: Vec<u32>,
    pub(super) k: usize,
    pub(super) n: usize,
}

impl PackedB {
    /// Packs `b` (its bf16 values; others are rounded), reusing the allocation.
    pub fn pack(&mut self, b: Mat) {
        pack_b(&mut self.tiles, b);
        (self.k, self.n) = (b.rows, b.cols);
    }

    /// Packs `wᵀ` for a weight `w` stored in bf16 (`n × k`, row-major: a linear
    /// layer's (OC, C)), the right operand of `x · wᵀ`: the pack [`PackedB::pack`]
    /// makes of the widened `w`'s transpose, bit for bit (bar subnormals, which the
    /// kernels read as zero either way), without an f32 copy or any rounding. Column
    /// `j` of `wᵀ` is row `j` of `w`, so each pair is two neighbouring bf16 values
    /// of one row. Reuses the allocation.
    pub fn pack_t_bf16(&mut self, w: &[Bf16], n: usize, k: usize) {
        assert_eq!(w.len(), n * k, "w must be n × k");
        let (nb, kc) = (n.div_ceil(2 * T), k.div_ceil(KT));
        self.tiles.resize(pack_len(2 * nb, kc), 0);
        // One 16-column panel per task: `[kc · 16 pairs][16 columns]`, zero beyond
        // the last row of `w` (column of wᵀ) and its last value.
        self.tiles
            .par_chunks_mut(kc * TILE)
            .enumerate()
            .for_each(|(panel, d)| {
                let rows: [&[Bf16]; T] = std::array::from_fn(|r| {
                    let i = panel * T + r;
                    w.get(i * k..(i + 1) * k).unwrap_or(&[])
                });
                for (p, out) in d.chunks_exact_mut(T).enumerate() {
                    for (o, row) in out.iter_mut().zip(&rows) {
                        let lo = row.get(2 * p).map_or(0, |b| b.0 as u32);
                        let hi = row.get(2 * p + 1).map_or(0, |b| b.0 as u32);
                        *o = lo | hi << 16;
                    }
                }
            });
        (self.k, self.n) = (k, n);
    }

    /// Bytes the pack of a `k × n` operand holds (16 × 32 tiles, zero-padded): what
    /// [`PackedB::pack`] allocates, for the memory plan.
    pub fn bytes_for(k: usize, n: usize) -> usize {
        4 * pack_len(2 * n.div_ceil(2 * T), k.div_ceil(KT))
    }

    /// Bytes this pack holds.
    pub fn bytes(&self) -> usize {
        4 * self.tiles.len()
    }
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
        permitted(),
        "the AMX kernel needs AMX-BF16 and the tile permission"
    );
    if k == 0 && !accumulate {
        dst.fill(0.0);
    }
    m == 0 || n == 0 || k == 0
}

/// Packs B (`k × n`) as `[n / 16][k / 32][16 pairs][16 columns]` tiles into `pb`.
/// Along `k` a column panel of 16 is `[k / 2 pairs][16 columns]`, row after row: the
/// AVX512-BF16 kernel ([`super::dpbf16`]) reads the same pack.
pub(super) fn pack_b(pb: &mut Vec<u32>, b: Mat) {
    pack_b_with(pb, b, super::dpbf16::available());
}

/// [`pack_b`], with the AVX512-BF16 conversions when `vector`.
fn pack_b_with(pb: &mut Vec<u32>, b: Mat, vector: bool) {
    let (nb, kc) = (b.cols.div_ceil(2 * T), b.rows.div_ceil(KT));
    pb.resize(pack_len(2 * nb, kc), 0);
    let bt = b.t();
    pb.par_chunks_mut(kc * TILE)
        .enumerate()
        .for_each(|(blk, d)| {
            for (c, tile) in d.chunks_exact_mut(TILE).enumerate() {
                pack_tile::<1, T>(tile, &bt, blk * T, c * KT, vector);
            }
        });
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
    let vector = super::dpbf16::available();
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
        // SAFETY: permitted() confirmed AMX-BF16 and the tile permission; the config
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

/// The tasks of a product blocked `mb × nb` (row blocks by column blocks): up to
/// `most_rows` row blocks each, by enough column blocks (up to `most_cols`) that
/// every thread gets about four tasks, so a product with few rows (the
/// classifier's) still splits. Each task's blocks: (rows, columns).
pub(super) fn tasks(
    mb: usize,
    nb: usize,
    most_rows: usize,
    most_cols: usize,
) -> Vec<(Range<usize>, Range<usize>)> {
    let tp = most_rows.min(mb);
    let tm = mb.div_ceil(tp);
    let want = 4 * rayon::current_num_threads();
    let tc = (nb * tm / want).clamp(1, most_cols);
    let tn = nb.div_ceil(tc);
    let span = |t: usize, w: usize, end: usize| t * w..((t + 1) * w).min(end);
    (0..tm * tn)
        .map(|t| (span(t / tn, tp, mb), span(t % tn, tc, nb)))
        .collect()
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
    unreachable!("permitted() is false off x86-64: {a:?}{b:?}{rows}{cols}{n}{load}{i0}{j0}");
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
    use crate::kernels::matmul::matmul as f32_gemm;
    use crate::kernels::testutil::*;

    /// Timing, not correctness: `cargo test --release --lib pack_speed -- --ignored
    /// --nocapture`. Packs GPT-2's fc weight (768 × 3,072) in both orientations with
    /// and without the AVX512-BF16 conversions, alternating, on the process's CPU
    /// time (wall time on a shared machine is mostly waiting for a core).
    #[test]
    #[ignore]
    fn pack_speed() {
        if !super::super::dpbf16::available() {
            return;
        }
        let (c, oc) = (768, 3072);
        let w = rand_vec(c * oc, 1);
        let mut pb = Vec::new();
        let cpu = || crate::kernels::testutil::cpu_seconds(libc::CLOCK_PROCESS_CPUTIME_ID);
        for (name, b) in [
            ("x·Wᵀ", Mat::new(&w, oc, c).t()),
            ("dy·W", Mat::new(&w, oc, c)),
        ] {
            let mut t = [f64::INFINITY; 2];
            for _ in 0..15 {
                for (vector, t) in [true, false].into_iter().zip(&mut t) {
                    let s = cpu();
                    pack_b_with(&mut pb, b, vector);
                    *t = t.min(cpu() - s);
                }
            }
            let ms = t.map(|t| t * 1e3);
            println!(
                "pack {name}: vector {:.2} ms, scalar {:.2} ms of CPU time (best of 15)",
                ms[0], ms[1]
            );
        }
        // The decoder's prompt packs wᵀ straight from the bf16 weight.
        let mut w16 = vec![Bf16::default(); c * oc];
        super::super::store(&mut w16, &w);
        let mut packed = PackedB::default();
        let mut best = f64::INFINITY;
        for _ in 0..15 {
            let s = cpu();
            packed.pack_t_bf16(&w16, oc, c);
            best = best.min(cpu() - s);
        }
        println!(
            "pack_t_bf16 x·Wᵀ: {:.2} ms of CPU time (best of 15)",
            best * 1e3
        );
    }

    #[test]
    fn vector_packing_gives_the_scalar_packs_bits() {
        // Needs only AVX512-BF16 (no tiles): the packs both kernels read.
        if !super::super::dpbf16::available() {
            eprintln!("vector packing not tested: no AVX512-BF16 on this CPU");
            return;
        }
        // Whole tiles and ragged edges; values that are not bf16 (rounded alike).
        let (k, n) = (75, 53);
        let data = rand_vec(k * n, 3);
        for tb in [false, true] {
            let b = match tb {
                true => Mat::new(&data, n, k).t(),
                false => Mat::new(&data, k, n),
            };
            let (mut fast, mut slow) = (Vec::new(), Vec::new());
            pack_b_with(&mut fast, b, true);
            pack_b_with(&mut slow, b, false);
            assert_eq!(fast, slow, "B stored transposed: {tb}");
            // The A-tile orientation of the same conversions.
            let a = b.t();
            let (mut fast, mut slow) = ([0u32; TILE], [0u32; TILE]);
            pack_tile::<T, 1>(&mut fast, &a, 16, 32, true);
            pack_tile::<T, 1>(&mut slow, &a, 16, 32, false);
            assert_eq!(fast, slow, "A tile, transposed: {}", !tb);
            assert!(fast.iter().all(|&p| p != 0), "a whole tile");
        }
    }

    fn usable() -> bool {
        if !permitted() {
            eprintln!(
                "AMX kernel not tested: {}",
                match cpu_has_amx() {
                    true => "the OS refused the tile permission",
                    false => "no AMX-BF16 on this CPU",
                }
            );
        }
        permitted()
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

    /// Packing runs on any CPU (only the product needs AMX), so this runs everywhere.
    #[test]
    fn a_bf16_weight_packs_like_its_widened_transpose() {
        let mut got = PackedB::default();
        // Large first: the smaller packs reuse an allocation holding other values.
        for (n, k) in [(100, 130), (1, 1), (37, 75), (33, 64), (64, 32), (16, 31)] {
            let w = rand_vec(n * k, (n * k) as u64);
            let mut w16 = vec![Bf16::default(); n * k];
            super::super::store(&mut w16, &w);
            let wide: Vec<f32> = w16.iter().map(|b| b.to_f32()).collect();
            let mut want = PackedB::default();
            want.pack(Mat::new(&wide, n, k).t());
            got.pack_t_bf16(&w16, n, k);
            assert_eq!((got.k, got.n), (k, n));
            assert!(got.tiles == want.tiles, "{n} × {k}: the packs differ");
        }
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
        if !permitted() {
            eprintln!("no usable AMX here: nothing to time");
            return;
        }
        {
            // Peak of one 32 × 32 AMX block, on cache-resident packs.
            let kc = 24;
            let p = vec![0x3F80_3F80u32; 2 * kc * 256];
            let mut c = [[0.0f32; 32]; 32];
            let reps = 20_000;
            // SAFETY: permitted() checked; the config is loaded on this thread before
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
