//! The packed layout both bf16 kernels read ([`super::amx`], [`super::dpbf16`]): bf16
//! values in pairs along `k`, in 1 KiB tiles of 16 × 16 pairs, zero-padded at the edges.
//! A right-hand operand B (`k × n`) is packed as `[n / 16][k / 32][16 pairs][16
//! columns]`: along `k` a column panel of 16 is `[k / 2 pairs][16 columns]`, row after
//! row, which the AMX tiles and the AVX512-BF16 microkernel read alike, so one packed
//! weight ([`PackedB`]) serves either kernel. AMX's A tiles are the transposed
//! orientation of the same tiles.
//!
//! Packing rounds to nearest even; where the CPU has AVX512-BF16 whole runs are
//! converted 16 pairs per instruction (`pairs_along`, `pairs_across`: the same
//! bits, bar subnormals, which both kernels read as zero anyway).

use super::Bf16;
use crate::kernels::cpu;
use crate::kernels::mat::Mat;
use rayon::prelude::*;
use std::ops::Range;

/// Rows and columns of one tile (16 f32 accumulators or 16 bf16 pairs per row).
pub(super) const T: usize = 16;
/// bf16 values of `k` per tile (16 pairs).
pub(super) const KT: usize = 32;
/// u32 pairs per packed tile.
pub(super) const TILE: usize = T * T;
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
pub(super) fn pack_len(blocks16: usize, kc: usize) -> usize {
    blocks16 * kc * TILE
}

/// One tile of pairs along `k` of `x` (rows `i`, columns `k`):
/// `dst[r·SI + p·SP] = (x(i0 + r, k0 + 2p), x(i0 + r, k0 + 2p + 1))` for r, p < 16.
/// An A tile is `x = a` with (SI, SP) = (16, 1); a B tile is `x = bᵀ` with (1, 16).
/// Whole tiles read runs of the operand directly (along `k` when its column stride
/// is 1, along `i` when its row stride is 1), 16 pairs per AVX512-BF16 instruction
/// when `vector` (then subnormals become zero, which both kernels' multiplications
/// do anyway); edge tiles pad with zeros.
pub(super) fn pack_tile<const SI: usize, const SP: usize>(
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
                let pairs = pairs_along(run);
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
                let pairs = pairs_across(lo, hi);
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

/// Packs B (`k × n`) as `[n / 16][k / 32][16 pairs][16 columns]` tiles into `pb`.
/// Along `k` a column panel of 16 is `[k / 2 pairs][16 columns]`, row after row: the
/// AVX512-BF16 kernel ([`super::dpbf16`]) reads the same pack.
pub(super) fn pack_b(pb: &mut Vec<u32>, b: Mat) {
    pack_b_with(pb, b, cpu::avx512_bf16());
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

/// `[pair(x[0], x[1]), pair(x[2], x[3]), …]` for 32 values, in one instruction:
/// [`pair`]'s rounding, except that subnormals become zero (as `vdpbf16ps` and
/// `tdpbf16ps` read them anyway). Needs AVX512-BF16 ([`cpu::avx512_bf16`]).
pub(super) fn pairs_along(x: &[f32]) -> [u32; 16] {
    assert!(x.len() == 32 && cpu::avx512_bf16());
    let mut out = [0; 16];
    // SAFETY: the CPU has AVX512-BF16 (asserted); 32 floats in, 16 pairs out.
    unsafe { x86::pairs16(x.as_ptr(), out.as_mut_ptr()) };
    out
}

/// `[pair(lo[0], hi[0]), pair(lo[1], hi[1]), …]` for 16 values of each, rounded as
/// [`pairs_along`]. Needs AVX512-BF16 ([`cpu::avx512_bf16`]).
pub(super) fn pairs_across(lo: &[f32], hi: &[f32]) -> [u32; 16] {
    assert!(lo.len() == 16 && hi.len() == 16 && cpu::avx512_bf16());
    let mut out = [0; 16];
    // SAFETY: the CPU has AVX512-BF16 (asserted); 16 floats in each, 16 pairs out.
    unsafe { x86::interleave16(lo.as_ptr(), hi.as_ptr(), out.as_mut_ptr()) };
    out
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// `out[q] = pair(x[2q], x[2q + 1])` for q < 16 (subnormals flushed to zero).
    ///
    /// # Safety
    /// The CPU has AVX-512 F and AVX512-BF16; `x` holds 32 floats, `out` 16 pairs.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn pairs16(x: *const f32, out: *mut u32) {
        // SAFETY: 32 floats at x and 16 u32 at out (caller). The low half of the
        // result is the second operand's 16 values, in order: pairs (2q, 2q + 1).
        unsafe {
            let lo = _mm512_loadu_ps(x);
            let hi = _mm512_loadu_ps(x.add(16));
            let packed: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
            _mm512_storeu_si512(out.cast(), packed);
        }
    }

    /// `out[q] = pair(lo[q], hi[q])` for q < 16 (subnormals flushed to zero).
    ///
    /// # Safety
    /// The CPU has AVX-512 F and AVX512-BF16; `lo` and `hi` hold 16 floats, `out` 16
    /// pairs.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn interleave16(lo: *const f32, hi: *const f32, out: *mut u32) {
        // SAFETY: 16 floats at lo and hi, 16 u32 at out (caller). Each value's bf16
        // widened to 32 bits: lo's in the low half of the lane, hi's in the high half.
        unsafe {
            let lo16: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(_mm512_loadu_ps(lo)));
            let hi16: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(_mm512_loadu_ps(hi)));
            let pairs = _mm512_or_si512(
                _mm512_cvtepu16_epi32(lo16),
                _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(hi16)),
            );
            _mm512_storeu_si512(out.cast(), pairs);
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod x86 {
    /// Never called: `cpu::avx512_bf16` is false off x86-64.
    ///
    /// # Safety
    /// None needed; it panics.
    pub(super) unsafe fn pairs16(_: *const f32, _: *mut u32) {
        unreachable!("AVX512-BF16 is x86-64 only")
    }

    /// Never called: `cpu::avx512_bf16` is false off x86-64.
    ///
    /// # Safety
    /// None needed; it panics.
    pub(super) unsafe fn interleave16(_: *const f32, _: *const f32, _: *mut u32) {
        unreachable!("AVX512-BF16 is x86-64 only")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::*;

    /// Timing, not correctness: `cargo test --release --lib pack_speed -- --ignored
    /// --nocapture`. Packs GPT-2's fc weight (768 × 3,072) in both orientations with
    /// and without the AVX512-BF16 conversions, alternating, on the process's CPU
    /// time (wall time on a shared machine is mostly waiting for a core).
    #[test]
    #[ignore]
    fn pack_speed() {
        if !cpu::avx512_bf16() {
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
        crate::kernels::bf16::store(&mut w16, &w);
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
        if !cpu::avx512_bf16() {
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

    #[test]
    fn the_vector_pairing_rounds_like_the_scalar_one() {
        if !cpu::avx512_bf16() {
            eprintln!("vector pairing not tested: no AVX512-BF16 on this CPU");
            return;
        }
        // Ties both ways, a carry into the exponent, overflow to infinity, NaN,
        // infinity, zeros, then random values; subnormals are flushed to zero.
        let awkward = [
            0x3F80_8000u32,
            0x3F81_8000,
            0x3F80_7FFF,
            0x3FFF_FFFF,
            0x7F7F_FFFF,
            0xFF80_0000,
            0x7FC0_0001,
            0x8000_0000,
        ];
        let mut x: Vec<f32> = awkward.into_iter().map(f32::from_bits).collect();
        x.extend(rand_vec(32 * 8 - x.len(), 9).iter().map(|v| v * 1e3));
        x.extend([1e-39f32, -3e-40].iter().cycle().take(32));
        for run in x.chunks_exact(32) {
            let mut got = [0u32; 16];
            // SAFETY: the CPU has AVX512-BF16 (checked above); 32 floats in, 16 pairs out.
            unsafe { x86::pairs16(run.as_ptr(), got.as_mut_ptr()) };
            let flush = |v: f32| {
                if v.is_subnormal() {
                    0.0 * v.signum()
                } else {
                    v
                }
            };
            let want: Vec<u32> = run
                .chunks_exact(2)
                .map(|p| pair(flush(p[0]), flush(p[1])))
                .collect();
            assert_eq!(got[..], want[..], "{run:?}");
        }
    }

    /// Packing runs on any CPU (only the products need AMX or AVX512-BF16).
    #[test]
    fn a_bf16_weight_packs_like_its_widened_transpose() {
        let mut got = PackedB::default();
        // Large first: the smaller packs reuse an allocation holding other values.
        for (n, k) in [(100, 130), (1, 1), (37, 75), (33, 64), (64, 32), (16, 31)] {
            let w = rand_vec(n * k, (n * k) as u64);
            let mut w16 = vec![Bf16::default(); n * k];
            crate::kernels::bf16::store(&mut w16, &w);
            let wide: Vec<f32> = w16.iter().map(|b| b.to_f32()).collect();
            let mut want = PackedB::default();
            want.pack(Mat::new(&wide, n, k).t());
            got.pack_t_bf16(&w16, n, k);
            assert_eq!((got.k, got.n), (k, n));
            assert!(got.tiles == want.tiles, "{n} × {k}: the packs differ");
        }
    }
}
