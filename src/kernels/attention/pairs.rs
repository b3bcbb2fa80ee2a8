//! The products of bf16 attention on AVX512-BF16 (`vdpbf16ps`): operands rounded and
//! packed into bf16 pairs in stack tiles, and one register-tiled kernel over them.
//!
//! One `vdpbf16ps` multiplies 16 lanes of bf16 pairs by 16 lanes of bf16 pairs and
//! adds each lane's two products to an f32 accumulator. A product `C (+)= A·B` over
//! `k` reads (see [`PairGemm`]):
//! - A as pairs along `k`, one pair of a row broadcast to all lanes;
//! - B as pair rows: pair row `p` holds `(B[2p][j], B[2p + 1][j])` for each column
//!   `j`, read 16 columns at a time (rows padded to a multiple of 16 columns).
//!
//! For an odd `k` the last pair's second half is zero on both sides. Packing rounds
//! to nearest even (`vcvtne2ps2bf16`), flushing subnormals to zero as the product
//! instruction reads them anyway. Everything here is x86-64 only and needs
//! AVX-512 F and AVX512-BF16.

use std::arch::x86_64::*;

/// Pair rows of a product over `k`: `⌈k / 2⌉`.
pub(super) fn pairs(k: usize) -> usize {
    k.div_ceil(2)
}

/// `C (+)= A·B` of an `m × k` by a `k × n` matrix, over `kp = ⌈k / 2⌉` pairs:
/// - pair `p` of A's row `i` at `a + i·ars + p·aps`;
/// - pair row `p` of B at `b + p·ldb`, with at least `16·⌈n / 16⌉` columns;
/// - `C[i][j]` at `c + i·ldc + j`.
#[derive(Clone, Copy)]
pub(super) struct PairGemm {
    pub(super) m: usize,
    pub(super) n: usize,
    pub(super) kp: usize,
    pub(super) a: *const u32,
    pub(super) ars: usize,
    pub(super) aps: usize,
    pub(super) b: *const u32,
    pub(super) ldb: usize,
    pub(super) c: *mut f32,
    pub(super) ldc: usize,
    /// `C += A·B` if set, else `C = A·B`.
    pub(super) add: bool,
}

/// The lanes `0..n` of a 16-lane vector (`n <= 16`).
#[inline(always)]
fn lanes(n: usize) -> __mmask16 {
    ((1u32 << n.min(16)) - 1) as __mmask16
}

/// Runs `g`: column strips of up to 64, row blocks of 4 (8 for narrow strips). Each
/// element sums its pairs in a fixed order (`p` ascending).
///
/// # Safety
/// The CPU has AVX-512 F and AVX512-BF16; the elements `g` describes for `i < m`,
/// `j < 16·⌈n / 16⌉` (B) or `j < n` (C), `p < kp` lie in live allocations, and no one
/// else accesses those of C meanwhile.
#[target_feature(enable = "avx512f,avx512bf16")]
pub(super) unsafe fn pair_gemm(g: PairGemm) {
    let mut j0 = 0;
    while j0 < g.n {
        let w = (g.n - j0).min(64);
        // SAFETY: the strip's columns j0..j0 + w are within g (caller).
        unsafe {
            match w.div_ceil(16) {
                4 => strip::<4, 4>(&g, j0, w),
                3 => strip::<3, 4>(&g, j0, w),
                2 => strip::<2, 8>(&g, j0, w),
                _ => strip::<1, 8>(&g, j0, w),
            }
        }
        j0 += w;
    }
}

/// The columns `j0..j0 + w` of `g`, `w <= 16·NV`, in blocks of `R` rows, then single
/// rows.
///
/// # Safety
/// As [`pair_gemm`].
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn strip<const NV: usize, const R: usize>(g: &PairGemm, j0: usize, w: usize) {
    let mut i0 = 0;
    // SAFETY: rows i0..i0 + R (or + 1) <= m (caller).
    unsafe {
        while i0 + R <= g.m {
            block::<R, NV>(g, i0, j0, w);
            i0 += R;
        }
        while i0 < g.m {
            block::<1, NV>(g, i0, j0, w);
            i0 += 1;
        }
    }
}

/// The register block: rows `i0..i0 + R`, columns `j0..j0 + w` of C, `R·NV`
/// accumulators.
///
/// # Safety
/// As [`pair_gemm`], for these rows and columns.
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn block<const R: usize, const NV: usize>(g: &PairGemm, i0: usize, j0: usize, w: usize) {
    let mut masks = [0 as __mmask16; NV];
    for (v, m) in masks.iter_mut().enumerate() {
        *m = lanes(w.saturating_sub(16 * v));
    }
    let mut acc = [[_mm512_setzero_ps(); NV]; R];
    let c = g.c.wrapping_add(i0 * g.ldc + j0);
    // SAFETY: B's pair rows p < kp hold 16·NV columns from j0, A's rows i0..i0 + R
    // hold kp pairs, and C's rows its first w columns from j0 (caller); masked-off
    // lanes are neither read nor written.
    unsafe {
        if g.add {
            for (r, acc) in acc.iter_mut().enumerate() {
                for (v, acc) in acc.iter_mut().enumerate() {
                    *acc = _mm512_maskz_loadu_ps(masks[v], c.add(r * g.ldc + 16 * v));
                }
            }
        }
        for p in 0..g.kp {
            let brow = g.b.add(p * g.ldb + j0);
            let mut bv = [_mm512_setzero_si512(); NV];
            for (v, b) in bv.iter_mut().enumerate() {
                *b = _mm512_loadu_si512(brow.add(16 * v).cast());
            }
            let arow = g.a.add(i0 * g.ars + p * g.aps);
            for (r, acc) in acc.iter_mut().enumerate() {
                let a: __m512bh =
                    std::mem::transmute(_mm512_set1_epi32(*arow.add(r * g.ars) as i32));
                for (acc, &b) in acc.iter_mut().zip(&bv) {
                    *acc = _mm512_dpbf16_ps(*acc, a, std::mem::transmute::<__m512i, __m512bh>(b));
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            for (v, &acc) in acc.iter().enumerate() {
                _mm512_mask_storeu_ps(c.add(r * g.ldc + 16 * v), masks[v], acc);
            }
        }
    }
}

/// Pairs along rows: `dst[i·drs + p·dcs] = pair(src[i·srs + 2p], src[i·srs + 2p + 1])`
/// for rows `i < ni` and pairs `p < ⌈nj / 2⌉` (the second half of an odd row's last
/// pair is zero). With `dcs = 1` a row's pairs are stored contiguously (an A operand);
/// otherwise they are spread `dcs` apart (a transposed B operand).
///
/// # Safety
/// The CPU has AVX-512 F and AVX512-BF16; `src` holds `ni` rows of `nj` floats `srs`
/// apart, and `dst` the pairs written.
#[target_feature(enable = "avx512f,avx512bf16")]
pub(super) unsafe fn pack_along(
    dst: *mut u32,
    (drs, dcs): (usize, usize),
    src: *const f32,
    srs: usize,
    (ni, nj): (usize, usize),
) {
    for i in 0..ni {
        let row = src.wrapping_add(i * srs);
        for j in (0..nj).step_by(32) {
            let left = nj - j;
            let np = pairs(left.min(32));
            let first = dst.wrapping_add(i * drs + j / 2 * dcs);
            // SAFETY: only the lanes within the row's nj floats are loaded, and only
            // the np pairs of this run are stored (caller).
            unsafe {
                let lo = _mm512_maskz_loadu_ps(lanes(left), row.wrapping_add(j));
                let hi =
                    _mm512_maskz_loadu_ps(lanes(left.saturating_sub(16)), row.wrapping_add(j + 16));
                // The low half of the result is `lo`'s 16 values in order, so lane q
                // holds elements (2q, 2q + 1).
                let packed: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
                if dcs == 1 {
                    _mm512_mask_storeu_epi32(first.cast(), lanes(np), packed);
                } else {
                    let mut run = [0u32; 16];
                    _mm512_storeu_si512(run.as_mut_ptr().cast(), packed);
                    for (q, &v) in run[..np].iter().enumerate() {
                        *first.add(q * dcs) = v;
                    }
                }
            }
        }
    }
}

/// Pairs across rows: `dst[p·drs + j] = pair(src[2p·srs + j], src[(2p + 1)·srs + j])`
/// for pairs `p < ⌈ni / 2⌉` and columns `j < nj` (row `ni` of an odd `ni` counts as
/// zero): a B operand over `k = ni`, or a transposed A operand.
///
/// # Safety
/// The CPU has AVX-512 F and AVX512-BF16; `src` holds `ni` rows of `nj` floats `srs`
/// apart, and `dst` the pair rows written.
#[target_feature(enable = "avx512f,avx512bf16")]
pub(super) unsafe fn pack_across(
    dst: *mut u32,
    drs: usize,
    src: *const f32,
    srs: usize,
    (ni, nj): (usize, usize),
) {
    for p in 0..pairs(ni) {
        let lo_row = src.wrapping_add(2 * p * srs);
        let hi_row = src.wrapping_add((2 * p + 1) * srs);
        for j in (0..nj).step_by(16) {
            let m = lanes(nj - j);
            // SAFETY: only the row's nj floats are loaded (the second row only if it
            // is one of the ni), and the pair row's nj lanes stored (caller).
            unsafe {
                let lo = _mm512_maskz_loadu_ps(m, lo_row.add(j));
                let hi = if 2 * p + 1 < ni {
                    _mm512_maskz_loadu_ps(m, hi_row.add(j))
                } else {
                    _mm512_setzero_ps()
                };
                let lo16: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(lo));
                let hi16: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(hi));
                let packed = _mm512_or_si512(
                    _mm512_cvtepu16_epi32(lo16),
                    _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(hi16)),
                );
                _mm512_mask_storeu_epi32(dst.add(p * drs + j).cast(), m, packed);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::bf16::round;
    use crate::kernels::cpu;
    use crate::kernels::testutil::rand_vec;

    /// A product through both packings against an f64 sum of the rounded operands,
    /// on ragged shapes: odd k, n not a multiple of 16, row tails.
    #[test]
    fn packed_products_match_an_f64_reference() {
        if !cpu::avx512_bf16() {
            eprintln!("not tested: no AVX512-BF16 on this CPU");
            return;
        }
        for (m, k, n) in [
            (1, 1, 1),
            (5, 7, 9),
            (32, 64, 32),
            (17, 33, 80),
            (9, 128, 71),
        ] {
            let a = rand_vec(m * k, 1);
            let b = rand_vec(k * n, 2);
            let prior = rand_vec(m * n, 3);
            let kp = pairs(k);
            let ldb = n.div_ceil(16) * 16;
            // A by rows (pairs along k), and B as pair rows.
            let mut ap = vec![0u32; m * kp];
            let mut bp = vec![0u32; kp * ldb];
            // A again, transposed in memory and packed across its rows.
            let at: Vec<f32> = (0..k * m).map(|x| a[(x % m) * k + x / m]).collect();
            let mut atp = vec![0u32; kp * m];
            // SAFETY: the CPU has AVX512-BF16; the buffers hold what is written.
            unsafe {
                pack_along(ap.as_mut_ptr(), (kp, 1), a.as_ptr(), k, (m, k));
                pack_across(bp.as_mut_ptr(), ldb, b.as_ptr(), n, (k, n));
                pack_across(atp.as_mut_ptr(), m, at.as_ptr(), m, (k, m));
            }
            for (add, (ap, ars, aps)) in [(false, (&ap, kp, 1)), (true, (&atp, 1, m))] {
                let mut c = prior.clone();
                // SAFETY: as above; C is m × n.
                unsafe {
                    pair_gemm(PairGemm {
                        m,
                        n,
                        kp,
                        a: ap.as_ptr(),
                        ars,
                        aps,
                        b: bp.as_ptr(),
                        ldb,
                        c: c.as_mut_ptr(),
                        ldc: n,
                        add,
                    })
                };
                for i in 0..m {
                    for j in 0..n {
                        let mut want = if add { prior[i * n + j] as f64 } else { 0.0 };
                        for p in 0..k {
                            want += round(a[i * k + p]) as f64 * round(b[p * n + j]) as f64;
                        }
                        let got = c[i * n + j] as f64;
                        assert!(
                            (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                            "{m}x{k}x{n} add {add} ({i}, {j}): {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    /// The transposed store of [`pack_along`] writes the same pairs as the contiguous
    /// one.
    #[test]
    fn spread_pairs_equal_contiguous_ones() {
        if !cpu::avx512_bf16() {
            return;
        }
        let (ni, nj) = (3, 45);
        let x = rand_vec(ni * nj, 4);
        let kp = pairs(nj);
        let mut rows = vec![0u32; ni * kp];
        let mut cols = vec![0u32; kp * ni];
        // SAFETY: the CPU has AVX512-BF16; both buffers hold ni · kp pairs.
        unsafe {
            pack_along(rows.as_mut_ptr(), (kp, 1), x.as_ptr(), nj, (ni, nj));
            pack_along(cols.as_mut_ptr(), (1, ni), x.as_ptr(), nj, (ni, nj));
        }
        for i in 0..ni {
            for p in 0..kp {
                assert_eq!(rows[i * kp + p], cols[p * ni + i]);
            }
            assert_eq!(rows[i * kp + kp - 1] >> 16, 0, "odd row padded with zero");
        }
    }
}

#[cfg(test)]
mod speed {
    use super::*;
    use crate::kernels::cpu;

    /// Timing only: `cargo test --release --lib pair_gemm_speed -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn pair_gemm_speed() {
        if !cpu::avx512_bf16() {
            return;
        }
        for (m, n, kp) in [(32, 32, 32), (32, 64, 16)] {
            let a = vec![0x3F80_3F80u32; 32 * 64];
            let b = vec![0x3F80_3F80u32; 64 * 64];
            let mut c = vec![0.0f32; 64 * 64];
            let reps = 200_000;
            let s = std::time::Instant::now();
            for _ in 0..reps {
                // SAFETY: the buffers are larger than the shapes read and written.
                unsafe {
                    pair_gemm(PairGemm {
                        m,
                        n,
                        kp,
                        a: a.as_ptr(),
                        ars: kp,
                        aps: 1,
                        b: b.as_ptr(),
                        ldb: 64,
                        c: c.as_mut_ptr(),
                        ldc: 64,
                        add: true,
                    })
                };
                std::hint::black_box(&mut c);
            }
            let macs = (m * n * 2 * kp * reps) as f64;
            println!(
                "{m}x{n}x{}: {:.1} GMAC/s",
                2 * kp,
                macs / s.elapsed().as_secs_f64() / 1e9
            );
        }
    }
}
