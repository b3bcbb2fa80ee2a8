//! The bf16 matmuls of `dtype = "bfloat16"`, on the kernel the [`Backend`] chose
//! (see [`super::backend`] for the kernels and the choice). On oneDNN only the large
//! products (at least 2^20 multiply-adds; below that its operand copies cost more than
//! they save) run on it, the rest on the f32 GEMM over bf16-valued operands
//! ([`matmul`], the same products up to summation order). Our AMX and AVX512-BF16
//! kernels take every product, whatever its size, rounding their operands while packing
//! them; a weight read by many products is packed once ([`WeightPacks`]).

use super::backend::{Backend, Kernel};
use super::pack::PackedB;
use super::{amx, dpbf16, Bf16};
use crate::kernels::mat::{matmul, Mat};
use std::cell::{Cell, RefCell};

/// Below this many multiply-adds (m·n·k) oneDNN's operand copies, or a bf16 weight's
/// pack made for one product ([`matmul_bf16_wt`]), cost more than they save.
const MIN_MACS: usize = 1 << 20;

/// From this inner dimension on, the AVX512-BF16 kernel loses to the f32 GEMM when it
/// packs B per call: the classifier's input gradient (256 × 50,304 × 768 per chunk of
/// rows) ran at 0.65–0.85× of it, packing both long operands on every call, and at
/// 1.2× with `wte` packed beforehand, which the classifier does
/// ([`matmul_bf16_packed`] has no such limit).
const DPBF16_MAX_K: usize = 16 * 1024;

/// `dst = a · b` (or `+=` when `accumulate`), f32 accumulation, for bf16 operands, on
/// `backend`'s kernel. Where it reads packs (AMX, AVX512-BF16) any f32 values may come:
/// the kernel rounds them to nearest even while packing, as [`super::round`] does
/// (bar subnormals, read as zero), so the weights need no rounded copy. Elsewhere
/// (oneDNN below 2^20 multiply-adds, the f32 GEMM, and AVX512-BF16 from a depth of
/// `DPBF16_MAX_K` without a pack) the product runs on the f32 GEMM, which reads the
/// values as they are: there the operands must hold bf16 values, and the model keeps
/// its rounded weight copy ([`Backend::keeps_bf16_copy`]).
pub fn matmul_bf16(backend: &Backend, dst: &mut [f32], a: Mat, b: Mat, accumulate: bool) {
    match backend.kernel() {
        Kernel::Amx => amx::matmul(dst, a, b, accumulate),
        Kernel::Avx512Bf16 if a.cols < DPBF16_MAX_K => dpbf16::matmul(dst, a, b, accumulate),
        #[cfg(feature = "onednn")]
        Kernel::OneDnn if a.rows * a.cols * b.cols >= MIN_MACS => {
            super::onednn::matmul(dst, a, b, accumulate)
        }
        _ => matmul(dst, a, b, accumulate),
    }
}

/// `dst = a · b` (or `+=`) in the precision of a pass: the f32 GEMM, or with `BF16`
/// (autocast: operands holding bf16 values) [`matmul_bf16`] on `backend`'s kernel.
pub fn product<const BF16: bool>(
    backend: &Backend,
    dst: &mut [f32],
    a: Mat,
    b: Mat,
    accumulate: bool,
) {
    match BF16 {
        true => matmul_bf16(backend, dst, a, b, accumulate),
        false => matmul(dst, a, b, accumulate),
    }
}

/// [`matmul_bf16`] with `packed`, the right-hand operand `b` packed beforehand (made
/// because [`Backend::reads_packs`]). The product runs on the kernel [`matmul_bf16`] picks for
/// its shape, on the same values, so the bits are the same with or without the pack
/// (bar one case: where `k` ≥ `DPBF16_MAX_K`, the AVX512-BF16 kernel takes the
/// product only with the pack, as packing B per call is what made it lose there).
pub fn matmul_bf16_packed(
    backend: &Backend,
    dst: &mut [f32],
    a: Mat,
    b: Mat,
    packed: &PackedB,
    accumulate: bool,
) {
    assert!(
        (packed.k, packed.n) == (b.rows, b.cols),
        "the pack is not of b"
    );
    match backend.kernel() {
        Kernel::Amx => amx::matmul_packed(dst, a, packed, accumulate),
        Kernel::Avx512Bf16 => dpbf16::matmul_packed(dst, a, packed, accumulate),
        _ => matmul_bf16(backend, dst, a, b, accumulate),
    }
}

thread_local! {
    /// [`matmul_bf16_wt`]'s buffers on this thread, reused by its next call: the
    /// pack of `wᵀ` (AMX, AVX512-BF16), or the weight widened to f32 and `a` rounded
    /// (other kernels).
    static WT: RefCell<(PackedB, Vec<f32>, Vec<f32>)> = RefCell::default();
    /// [`matmul_bf16_wt`] products this thread ran from a pack of the bf16 weight.
    static WT_PACKED: Cell<usize> = const { Cell::new(0) };
}

/// `dst (=|+=) round(a) · wᵀ`, f32 accumulation: a linear layer's product from its
/// weight stored in bf16, with the activations rounded to bf16 as operands
/// (autocast, as `dtype = "bfloat16"` training's products). Decoding's prompt rows
/// run it (src/model/decode.rs); its steps stay on the GEMV.
///
/// a: (m, k), any f32 values; w: (n, k) row-major (a linear layer's (OC, C));
/// dst: (m, n).
///
/// On the AMX or AVX512-BF16 kernel, products of at least `MIN_MACS` pack `wᵀ`
/// straight from bf16 ([`PackedB::pack_t_bf16`], per call: a prompt reads each
/// weight once) and the kernel rounds `a` while packing it; otherwise `w` is widened
/// to f32, `a` rounded, and the product runs where [`matmul_bf16`] sends it (oneDNN,
/// or the f32 GEMM): the same values, summed in another order.
pub fn matmul_bf16_wt(
    backend: &Backend,
    dst: &mut [f32],
    a: &[f32],
    w: &[Bf16],
    k: usize,
    accumulate: bool,
) {
    assert!(
        k > 0 && a.len().is_multiple_of(k) && w.len().is_multiple_of(k),
        "a and w must have k columns"
    );
    let (m, n) = (a.len() / k, w.len() / k);
    assert_eq!(dst.len(), m * n, "dst must be m × n");
    let x = Mat::new(a, m, k);
    let packed = backend.reads_packs() && m * n * k >= MIN_MACS;
    WT.with_borrow_mut(|(pack, wide, rounded)| {
        if packed {
            pack.pack_t_bf16(w, n, k);
            WT_PACKED.set(WT_PACKED.get() + 1);
            return match backend.kernel() {
                Kernel::Amx => amx::matmul_packed(dst, x, pack, accumulate),
                _ => dpbf16::matmul_packed(dst, x, pack, accumulate),
            };
        }
        wide.resize(w.len(), 0.0);
        super::load(wide, w);
        rounded.resize(a.len(), 0.0);
        super::round_into(rounded, a);
        let (x, wt) = (Mat::new(rounded, m, k), Mat::new(wide, n, k).t());
        matmul_bf16(backend, dst, x, wt, accumulate);
    });
}

/// How many [`matmul_bf16_wt`] products this thread has run on a pack of the bf16
/// weight (AMX or AVX512-BF16), not on a widened f32 copy: a decoder's prompt on
/// such a CPU adds four per layer (tested).
pub fn bf16_weight_packs_on_this_thread() -> usize {
    WT_PACKED.get()
}

/// A weight `w` (rows × cols, row-major: a linear layer's (OC, C), or the first V
/// rows of `wte`) packed as the right-hand operand of both products that read it,
/// made once per optimizer step when [`Backend::reads_packs`] instead of once per call:
/// `x · wᵀ` (forward, logits) and `dy · w` (input gradient).
#[derive(Default)]
pub struct WeightPacks {
    /// wᵀ, (cols, rows): the right operand of `x · wᵀ`.
    pub(crate) t: PackedB,
    /// w, (rows, cols): the right operand of `dy · w`.
    pub(crate) n: PackedB,
}

impl WeightPacks {
    /// Packs `w` (`rows × cols`, holding bf16 values) in both orientations, reusing
    /// the allocations.
    pub fn pack(&mut self, w: &[f32], rows: usize, cols: usize) {
        let w = Mat::new(&w[..rows * cols], rows, cols);
        self.t.pack(w.t());
        self.n.pack(w);
    }

    /// Bytes the packs of a `rows × cols` weight hold (the memory plan's count).
    pub fn bytes_for(rows: usize, cols: usize) -> usize {
        PackedB::bytes_for(cols, rows) + PackedB::bytes_for(rows, cols)
    }

    /// Bytes these packs hold.
    pub fn bytes(&self) -> usize {
        self.t.bytes() + self.n.bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::bf16::{round, testcases};
    use crate::kernels::testutil::*;

    /// This machine's back-end on kernel `k`, if `k` runs here.
    fn on(k: Kernel) -> Option<Backend> {
        Backend::with_kernel(k)
    }

    /// The f32 GEMM, which runs everywhere.
    fn f32_gemm() -> Backend {
        on(Kernel::F32).expect("the f32 GEMM runs everywhere")
    }

    #[test]
    fn small_products_run_on_the_packing_kernels_and_round_their_operands() {
        // On the f32 GEMM a small product is the f32 GEMM's, bit for bit. On AMX and
        // AVX512-BF16 every product runs on the kernel, whatever its size, and reads
        // f32 operands as their bf16 rounding: unrounded operands give the bits of
        // the rounded ones (what lets a model keep no rounded weight copy there).
        let (m, k, n) = (3, 17, 5);
        let (a, b) = (rand_vec(m * k, 6), rand_vec(k * n, 7));
        let a16: Vec<f32> = a.iter().copied().map(round).collect();
        let b16: Vec<f32> = b.iter().copied().map(round).collect();
        let (a16m, b16m) = (Mat::new(&a16, m, k), Mat::new(&b16, k, n));
        let (mut x, mut y) = (vec![0.0; m * n], vec![0.0; m * n]);
        matmul(&mut x, a16m, b16m, false);
        matmul_bf16(&f32_gemm(), &mut y, a16m, b16m, false);
        assert_eq!(x, y);
        let direct: [(Kernel, testcases::Kernel); 2] = [
            (Kernel::Amx, amx::matmul),
            (Kernel::Avx512Bf16, dpbf16::matmul),
        ];
        for (kern, run) in direct {
            let Some(backend) = on(kern) else { continue };
            let (am, bm) = (Mat::new(&a, m, k), Mat::new(&b, k, n));
            let (mut want, mut got) = (vec![0.0; m * n], vec![0.0; m * n]);
            run(&mut want, a16m, b16m, false);
            matmul_bf16(&backend, &mut got, am, bm, false);
            assert_eq!(got, want, "{kern:?}");
            // The values are the rounded operands': an f64 reference agrees.
            let exact = testcases::reference(&[], a16m, b16m, false);
            assert_close(&format!("{kern:?}"), &got, &exact, 0.0, 1e-5);
        }
    }

    #[test]
    fn products_take_avx512bf16_when_it_is_the_kernel() {
        let Some(avx) = on(Kernel::Avx512Bf16) else {
            eprintln!("AVX512-BF16 kernel not tested: no AVX512-BF16 on this CPU");
            return;
        };
        let (m, k, n) = (128, 128, 64); // exactly MIN_MACS
        let a: Vec<f32> = rand_vec(m * k, 8).into_iter().map(round).collect();
        let b: Vec<f32> = rand_vec(k * n, 9).into_iter().map(round).collect();
        let (am, bm) = (Mat::new(&a, m, k), Mat::new(&b, k, n));
        let (mut f32_out, mut want, mut got) =
            (vec![0.0; m * n], vec![0.0; m * n], vec![0.0; m * n]);
        matmul(&mut f32_out, am, bm, false);
        dpbf16::matmul(&mut want, am, bm, false);
        matmul_bf16(&avx, &mut got, am, bm, false);
        assert_eq!(got, want);
        assert_ne!(
            got, f32_out,
            "the two kernels sum in the same order here: pick another shape"
        );
        // Forced to the f32 GEMM, the same product is the f32 GEMM's.
        matmul_bf16(&f32_gemm(), &mut got, am, bm, false);
        assert_eq!(got, f32_out);
        // So is a product as deep as DPBF16_MAX_K without a pack.
        let (m, k, n) = (8, DPBF16_MAX_K, 8);
        let a: Vec<f32> = rand_vec(m * k, 10).into_iter().map(round).collect();
        let b: Vec<f32> = rand_vec(k * n, 11).into_iter().map(round).collect();
        let (am, bm) = (Mat::new(&a, m, k), Mat::new(&b, k, n));
        let (mut f32_out, mut got) = (vec![0.0; m * n], vec![0.0; m * n]);
        matmul(&mut f32_out, am, bm, false);
        matmul_bf16(&avx, &mut got, am, bm, false);
        assert_eq!(got, f32_out);
        dpbf16::matmul(&mut got, am, bm, false);
        assert_ne!(got, f32_out, "the kernels agree here: pick another shape");
    }

    /// `matmul_bf16_wt` on every kernel usable here: against an f64 reference of
    /// round(a) · wᵀ, bit for bit [`matmul_bf16`] on the rounded and widened operands
    /// (the same values, packed the same), and on a pack of the bf16 weight exactly
    /// when the kernel reads packs and the product is large.
    #[test]
    fn bf16_weight_products_round_a_and_read_w_in_bf16() {
        use crate::kernels::bf16::{store, testcases::reference};
        let shapes = [(1, 77, 50), (37, 75, 101), (128, 128, 64), (200, 777, 161)];
        let kernels = [Kernel::Amx, Kernel::Avx512Bf16, Kernel::OneDnn, Kernel::F32];
        for (kern, backend) in kernels.into_iter().filter_map(|k| Some((k, on(k)?))) {
            for (i, &(m, k, n)) in shapes.iter().enumerate() {
                let acc = i % 2 == 1;
                let a = rand_vec(m * k, 20 + i as u64);
                let mut w16 = vec![Bf16::default(); n * k];
                store(&mut w16, &rand_vec(n * k, 30 + i as u64));
                let prior = rand_vec(m * n, 40 + i as u64);
                let mut got = prior.clone();
                let before = bf16_weight_packs_on_this_thread();
                matmul_bf16_wt(&backend, &mut got, &a, &w16, k, acc);
                let packs = bf16_weight_packs_on_this_thread() - before;
                let what = format!("{kern:?} {m}×{k}×{n}");
                let big = m * n * k >= MIN_MACS;
                let reads_packs = matches!(kern, Kernel::Amx | Kernel::Avx512Bf16);
                assert_eq!(packs == 1, big && reads_packs, "{what}: packed");
                let ra: Vec<f32> = a.iter().map(|&v| round(v)).collect();
                let wide: Vec<f32> = w16.iter().map(|v| v.to_f32()).collect();
                let (am, wt) = (Mat::new(&ra, m, k), Mat::new(&wide, n, k).t());
                let want = reference(&prior, am, wt, acc);
                assert_close(&what, &got, &want, 0.0, 1e-6 * k as f64);
                let mut same = prior.clone();
                matmul_bf16(&backend, &mut same, am, wt, acc);
                assert_eq!(got, same, "{what}: not matmul_bf16's bits");
            }
        }
    }

    /// Timing, not correctness: `cargo test --release --lib bf16_weight_product_speed
    /// -- --ignored --nocapture`. A 256-token prompt's four linear products of GPT-2
    /// 124M from bf16 weights: [`matmul_bf16_wt`] on the kernel chosen here, against
    /// widening the weight and running the f32 GEMM (what decoding's prompt did
    /// before), and the pack alone; alternating, best of 7 on the process's CPU time
    /// and on the wall clock.
    #[test]
    #[ignore]
    fn bf16_weight_product_speed() {
        use crate::kernels::bf16::{load, store};
        use std::time::Instant;
        let cpu = || crate::kernels::testutil::cpu_seconds(libc::CLOCK_PROCESS_CPUTIME_ID);
        let (m, c) = (256, 768);
        let backend = Backend::detect(None);
        println!(
            "kernel {:?}, {} threads",
            backend.kernel(),
            rayon::current_num_threads()
        );
        let mut totals = [[0.0; 2]; 3];
        for (name, n, k) in [
            ("qkv", 3 * c, c),
            ("proj", c, c),
            ("fc", 4 * c, c),
            ("mlp", c, 4 * c),
        ] {
            let a = rand_vec(m * k, 1);
            let mut w16 = vec![Bf16::default(); n * k];
            store(&mut w16, &rand_vec(n * k, 2));
            let (mut dst, mut dst2) = (vec![0.0; m * n], vec![0.0; m * n]);
            let mut wide = vec![0.0; n * k];
            let mut pack = PackedB::default();
            let mut best = [[f64::INFINITY; 2]; 3];
            for _ in 0..7 {
                let runs: [&mut dyn FnMut(); 3] = [
                    &mut || matmul_bf16_wt(&backend, &mut dst, &a, &w16, k, false),
                    &mut || {
                        load(&mut wide, &w16);
                        let w = Mat::new(&wide, n, k).t();
                        matmul(&mut dst2, Mat::new(&a, m, k), w, false)
                    },
                    &mut || pack.pack_t_bf16(&w16, n, k),
                ];
                for (run, best) in runs.into_iter().zip(&mut best) {
                    let (w, c) = (Instant::now(), cpu());
                    run();
                    best[0] = best[0].min(cpu() - c);
                    best[1] = best[1].min(w.elapsed().as_secs_f64());
                }
            }
            let gflop = 2.0 * (m * n * k) as f64 / 1e9;
            for (t, b) in totals.iter_mut().zip(&best) {
                t[0] += b[0];
                t[1] += b[1];
            }
            println!(
                "{name} {m}×{k}×{n}: bf16 GEMM {:.2} ms CPU ({:.0} GFLOP/CPU-s), {:.2} ms wall; \
                 widen + f32 GEMM {:.2} ms CPU ({:.0}), {:.2} ms wall; pack {:.2} ms CPU",
                best[0][0] * 1e3,
                gflop / best[0][0],
                best[0][1] * 1e3,
                best[1][0] * 1e3,
                gflop / best[1][0],
                best[1][1] * 1e3,
                best[2][0] * 1e3,
            );
        }
        let [ours, before, pack] = totals.map(|t| t.map(|s| s * 1e3));
        println!(
            "one layer: bf16 GEMM {:.1} ms CPU / {:.1} wall, widen + f32 GEMM {:.1} / {:.1} \
             ({:.2}x CPU), of which packing {:.1} ms CPU",
            ours[0],
            ours[1],
            before[0],
            before[1],
            before[0] / ours[0],
            pack[0]
        );
    }

    #[cfg(feature = "onednn")]
    #[test]
    fn large_products_take_onednn_when_it_is_the_kernel() {
        use crate::kernels::bf16::onednn;
        if !onednn::testable() {
            return;
        }
        let on_dnnl = on(Kernel::OneDnn).expect("oneDNN is testable");
        let (m, k, n) = (128, 128, 64); // exactly MIN_MACS
        let a: Vec<f32> = rand_vec(m * k, 8).into_iter().map(round).collect();
        let b: Vec<f32> = rand_vec(k * n, 9).into_iter().map(round).collect();
        let (am, bm) = (Mat::new(&a, m, k), Mat::new(&b, k, n));
        let (mut f32_out, mut dnnl, mut got) =
            (vec![0.0; m * n], vec![0.0; m * n], vec![0.0; m * n]);
        matmul(&mut f32_out, am, bm, false);
        onednn::matmul(&mut dnnl, am, bm, false);
        matmul_bf16(&on_dnnl, &mut got, am, bm, false);
        assert_eq!(got, dnnl);
        assert_ne!(
            got, f32_out,
            "the two kernels sum in the same order here: pick another shape"
        );
        // One multiply-add fewer than MIN_MACS: the f32 GEMM.
        let am = Mat::new(&a[..(m - 1) * k], m - 1, k);
        let mut small = vec![0.0; (m - 1) * n];
        matmul_bf16(&on_dnnl, &mut small, am, bm, false);
        matmul(&mut f32_out[..(m - 1) * n], am, bm, false);
        assert_eq!(small, f32_out[..(m - 1) * n]);
    }
}
