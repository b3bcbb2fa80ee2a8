//! The classifier (tied to `wte`) fused with softmax and cross-entropy.
//!
//! Logits are computed for a chunk of rows at a time into a caller-provided scratch
//! buffer, turned into losses and, when training, straight into gradients, so the full
//! `(N, V)` logits never exist. Only the real vocabulary `V` is computed: the padded
//! rows of `wte` never receive probability and get no gradient.

use super::bf16::gemm::{matmul_bf16_packed, product};
use super::bf16::Backend;
use super::fastmath::{exp_fast, has_avx2_fma};
use super::mat::{matmul, Mat};
use rayon::prelude::*;

/// Where the classifier's gradients go when training.
pub struct ClassifierGrads<'a> {
    /// (N, C): gradient w.r.t. the classifier input, **overwritten**.
    pub dx: &'a mut [f32],
    /// (Vp, C): gradient of the tied embedding, **accumulated**; empty when the
    /// embedding is frozen (not computed).
    pub dwte: &'a mut [f32],
    /// Multiplies the gradient of the mean loss (e.g. `1 / grad_accum_steps`).
    pub scale: f32,
}

/// `wte` (its bf16 copy, the first V rows) packed for the AMX and AVX512-BF16
/// kernels in both orientations the classifier multiplies by (`x · wteᵀ`,
/// `dlogits · wte`), once per optimizer step instead of twice per chunk of rows.
pub use super::bf16::gemm::WeightPacks as WtePacks;

/// The classifier's weights: the tied token embedding `wte` (≥ V rows of C), of which
/// the first V rows (the real vocabulary) are used, and, for bf16 on AMX or
/// AVX512-BF16, its packs.
#[derive(Clone, Copy)]
pub struct Classifier<'a> {
    pub wte: &'a [f32],
    /// Made by [`WtePacks::pack`] from the same `wte`; without them the bf16 products
    /// on AMX or AVX512-BF16 repack `wte` twice per chunk of rows. Ignored in f32 and
    /// on the other kernels.
    pub packs: Option<&'a WtePacks>,
    pub c: usize,
    pub v: usize,
    /// The kernel of the bf16 products (unused in f32).
    pub backend: &'a Backend,
}

/// Mean cross-entropy of `softmax(x · wteᵀ)` against `targets`, ignoring targets of -1.
///
/// x: (N, C); targets: (N) in `[0, V)` or -1; losses: (N) per-row loss written (0 for
/// ignored rows); scratch: (R, V) with R ≥ 1 rows, the chunk size. With `grads`, also
/// computes the gradient of `scale · mean loss`. Returns the mean over valid rows (0
/// when there are none).
///
/// With `BF16` (autocast), `x` and `wte` hold bf16 values, the matmuls run on the
/// back-end's bf16 kernel and the logits' gradient is rounded to bf16
/// before it enters the two backward matmuls; softmax and loss are f32.
pub fn classifier_forward<const BF16: bool>(
    x: &[f32],
    cls: Classifier,
    targets: &[i32],
    losses: &mut [f32],
    scratch: &mut [f32],
    mut grads: Option<ClassifierGrads>,
) -> f32 {
    let _t = crate::profile::scope(crate::profile::Section::Classifier);
    let (c, v, n) = (cls.c, cls.v, targets.len());
    assert!(x.len() == n * c && losses.len() == n && cls.wte.len() >= v * c);
    // Rows per chunk: as many as the scratch holds, spread evenly over the chunks
    // (each chunk reads and accumulates all of dwte, so a small last chunk costs
    // almost as much as a full one).
    let max_rows = (scratch.len() / v).clamp(1, n.max(1));
    let chunk = n.div_ceil(n.div_ceil(max_rows).max(1)).max(1);
    assert!(
        scratch.len() >= v,
        "classifier scratch must hold at least one row"
    );
    let count = targets.iter().filter(|&&t| t >= 0).count();
    let grad_scale = grads
        .as_ref()
        .map_or(0.0, |g| g.scale / count.max(1) as f32);
    let wte_v = Mat::new(&cls.wte[..v * c], v, c);
    let backend = cls.backend;
    // The packs are read by the AMX and AVX512-BF16 kernels only.
    let packs = cls.packs.filter(|_| BF16 && backend.reads_packs());
    for start in (0..n).step_by(chunk) {
        let rows = chunk.min(n - start);
        let logits = &mut scratch[..rows * v];
        let x_chunk = &x[start * c..(start + rows) * c];
        let x_m = Mat::new(x_chunk, rows, c);
        match packs {
            Some(p) => matmul_bf16_packed(backend, logits, x_m, wte_v.t(), &p.t, false),
            None => product::<BF16>(backend, logits, x_m, wte_v.t(), false),
        }
        let tgt = &targets[start..start + rows];
        let with_grad = grads.is_some();
        let loss_t = crate::profile::scope(crate::profile::Section::Loss);
        logits
            .par_chunks_mut(v)
            .zip(
                tgt.par_iter()
                    .zip(losses[start..start + rows].par_iter_mut()),
            )
            .for_each(|(row, (&target, loss))| {
                *loss = softmax_row_loss(row, target, with_grad.then_some(grad_scale));
                if BF16 && with_grad {
                    // The logit gradient is a bf16 matmul operand: round the row while
                    // it is still in cache rather than in a pass over the chunk.
                    super::bf16::round_slice(row);
                }
            });
        drop(loss_t);
        if let Some(g) = grads.as_mut() {
            let dlogits = Mat::new(logits, rows, v);
            let dx = &mut g.dx[start * c..(start + rows) * c];
            match packs {
                Some(p) => matmul_bf16_packed(backend, dx, dlogits, wte_v, &p.n, false),
                None => product::<BF16>(backend, dx, dlogits, wte_v, false),
            }
            // An empty `dwte` is a frozen embedding (LoRA): its gradient is not formed.
            if !g.dwte.is_empty() {
                let block = backend.dwte_block(BF16, v);
                weight_gradient::<BF16>(backend, &mut g.dwte[..v * c], dlogits, x_m, block);
            }
        }
    }
    if count == 0 {
        return 0.0;
    }
    // A fixed summation order keeps the loss bit-identical across thread counts.
    (losses.iter().map(|&l| l as f64).sum::<f64>() / count as f64) as f32
}

/// `dwte += dlogitsᵀ · x` for one chunk of rows, in blocks of `block` vocabulary rows.
///
/// dwte: (V, C); dlogits: (R, V); x: (R, C). The `gemm` crate packs the logit
/// gradients of a product into a buffer it allocates per call, R × V floats over all of
/// V (51 MB for a 256-row chunk): above malloc's mmap threshold, so it was mapped fresh
/// and faulted in page by page for every chunk of every step. A block of
/// 4,096 rows needs R × 4,096 floats, which malloc keeps and hands back on the
/// next call ([`Backend::dwte_block`] says where the blocks pay).
fn weight_gradient<const BF16: bool>(
    backend: &Backend,
    dwte: &mut [f32],
    dlogits: Mat,
    x: Mat,
    block: usize,
) {
    let (v, c) = (dlogits.cols, x.cols);
    for (i, dwte_block) in dwte.chunks_mut(block * c).enumerate() {
        let start = i * block;
        let end = (start + block).min(v);
        product::<BF16>(
            backend,
            dwte_block,
            dlogits.columns(start, end).t(),
            x,
            true,
        );
    }
}

/// Cross-entropy of one row of logits; with `grad_scale`, the row is replaced by
/// `grad_scale · (softmax − onehot(target))` (all zero for an ignored row). Without it
/// the row is left holding `e^(logit − max)`.
fn softmax_row_loss(row: &mut [f32], target: i32, grad_scale: Option<f32>) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA (checked by has_avx2_fma).
        return unsafe { x86::softmax_row_loss(row, target, grad_scale) };
    }
    softmax_row_loss_with::<false>(row, target, grad_scale)
}

/// The row loops compiled for AVX2 + FMA, chosen at run time.
#[cfg(target_arch = "x86_64")]
mod x86 {
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn softmax_row_loss(row: &mut [f32], target: i32, grad_scale: Option<f32>) -> f32 {
        super::softmax_row_loss_with::<true>(row, target, grad_scale)
    }
}

/// Independent partial results per lane, so that the reductions vectorise; their
/// order is fixed, so results do not depend on the thread count.
const LANES: usize = 16;

#[inline(always)]
fn softmax_row_loss_with<const FMA: bool>(
    row: &mut [f32],
    target: i32,
    grad_scale: Option<f32>,
) -> f32 {
    let max = row_max(row);
    let target_logit = (target >= 0).then(|| row[target as usize]);
    let sum = exp_in_place::<FMA>(row, max);
    let loss = target_logit.map_or(0.0, |logit| max + sum.ln() - logit);
    if let Some(s) = grad_scale {
        if target < 0 {
            row.fill(0.0);
        } else {
            let inv = s / sum;
            row.iter_mut().for_each(|p| *p *= inv);
            row[target as usize] -= s;
        }
    }
    loss
}

/// The largest element (NaNs are passed over here and surface in the sum).
#[inline(always)]
fn row_max(row: &[f32]) -> f32 {
    let bigger = |m: f32, x: f32| if x > m { x } else { m };
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let mut chunks = row.chunks_exact(LANES);
    for chunk in &mut chunks {
        for (m, &x) in lanes.iter_mut().zip(chunk) {
            *m = bigger(*m, x);
        }
    }
    let rest = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |m, &x| bigger(m, x));
    lanes.iter().fold(rest, |m, &x| bigger(m, x))
}

/// `row[j] = e^(row[j] − max)`; returns their sum.
#[inline(always)]
fn exp_in_place<const FMA: bool>(row: &mut [f32], max: f32) -> f32 {
    let mut lanes = [0.0f32; LANES];
    let mut chunks = row.chunks_exact_mut(LANES);
    for chunk in &mut chunks {
        for (acc, x) in lanes.iter_mut().zip(chunk) {
            *x = exp_fast(FMA, *x - max);
            *acc += *x;
        }
    }
    let mut rest = 0.0;
    for x in chunks.into_remainder() {
        *x = exp_fast(FMA, *x - max);
        rest += *x;
    }
    lanes.iter().sum::<f32>() + rest
}

/// Inference logits `out = x · wte[..V]ᵀ` on the f32 GEMM: out (N, V) written, x (N, C).
pub fn classifier_logits(out: &mut [f32], x: &[f32], cls: Classifier) {
    let (c, v) = (cls.c, cls.v);
    let n = x.len() / c;
    let wte_v = Mat::new(&cls.wte[..v * c], v, c);
    matmul(out, Mat::new(x, n, c), wte_v.t(), false);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::*;

    fn reference_loss(x: &[f64], wte: &[f64], targets: &[i32], c: usize, v: usize) -> f64 {
        let (mut total, mut count) = (0.0, 0);
        for (r, &tg) in targets.iter().enumerate() {
            if tg < 0 {
                continue;
            }
            let logits: Vec<f64> = (0..v)
                .map(|j| (0..c).map(|i| x[r * c + i] * wte[j * c + i]).sum())
                .collect();
            let max = logits.iter().cloned().fold(f64::MIN, f64::max);
            let lse = max + logits.iter().map(|l| (l - max).exp()).sum::<f64>().ln();
            total += lse - logits[tg as usize];
            count += 1;
        }
        total / count as f64
    }

    fn check(n: usize, c: usize, v: usize, vp: usize, chunk_rows: usize) {
        let x = rand_vec(n * c, 1);
        let wte: Vec<f32> = rand_vec(vp * c, 2).iter().map(|w| 2.0 * w).collect();
        let targets: Vec<i32> = (0..n)
            .map(|r| {
                if r % 4 == 1 {
                    -1
                } else {
                    ((r * 7 + 3) % v) as i32
                }
            })
            .collect();
        let (x64, wte64) = (to_f64(&x), to_f64(&wte));
        let mut losses = vec![0.0; n];
        let mut scratch = vec![0.0; chunk_rows * v];
        let mut dx = vec![f32::NAN; n * c];
        let mut dwte = vec![0.25; vp * c];
        let scale = 0.5;
        let cls = Classifier {
            wte: &wte,
            packs: None,
            c,
            v,
            backend: &Backend::portable(),
        };
        let grads = ClassifierGrads {
            dx: &mut dx,
            dwte: &mut dwte,
            scale,
        };
        let loss =
            classifier_forward::<false>(&x, cls, &targets, &mut losses, &mut scratch, Some(grads));
        let want = reference_loss(&x64, &wte64, &targets, c, v);
        assert!(
            (loss as f64 - want).abs() < 1e-5 * want.abs(),
            "{loss} vs {want}"
        );

        let f = |x: &[f64], w: &[f64]| scale as f64 * reference_loss(x, w, &targets, c, v);
        let want_dx = numeric_grad(|p| f(p, &wte64), &x64, 1e-5);
        assert_close("dx", &dx, &want_dx, 1e-4, 1e-6);
        let mut want_dwte = numeric_grad(|p| f(&x64, p), &wte64, 1e-5);
        want_dwte.iter_mut().for_each(|d| *d += 0.25);
        assert_close("dwte", &dwte, &want_dwte, 1e-4, 1e-6);
        // Padded rows are untouched.
        assert!(dwte[v * c..].iter().all(|&d| d == 0.25));

        // Without gradients the loss is the same and nothing else is touched.
        let mut losses2 = vec![0.0; n];
        let l2 = classifier_forward::<false>(&x, cls, &targets, &mut losses2, &mut scratch, None);
        assert_eq!(l2, loss);
    }

    #[test]
    fn loss_and_gradients_match_reference() {
        check(6, 8, 11, 16, 6); // one chunk
        check(9, 5, 13, 64, 4); // several chunks, a partial last one
        check(3, 4, 7, 7, 1); // one row per chunk, no padding
    }

    /// The softmax over rows longer than the lane width, in both builds of the loops.
    #[test]
    fn long_rows_match_f64_softmax() {
        let v = 1003; // 62 lanes of 16 and a remainder of 11
        let logits: Vec<f32> = rand_vec(v, 5).iter().map(|l| 12.0 * l).collect();
        let target = 700;
        let l64 = to_f64(&logits);
        let max = l64.iter().cloned().fold(f64::MIN, f64::max);
        let sum: f64 = l64.iter().map(|l| (l - max).exp()).sum();
        let want_loss = max + sum.ln() - l64[target];
        let scale = 0.25;
        let mut want_grad: Vec<f64> = l64.iter().map(|l| scale * (l - max).exp() / sum).collect();
        want_grad[target] -= scale;
        type Softmax = fn(&mut [f32], i32, Option<f32>) -> f32;
        let builds: [Softmax; 2] = [softmax_row_loss, softmax_row_loss_with::<false>];
        for softmax in builds {
            let mut row = logits.clone();
            let loss = softmax(&mut row, target as i32, Some(scale as f32));
            assert!(
                (loss as f64 - want_loss).abs() < 1e-5 * want_loss,
                "{loss} vs {want_loss}"
            );
            assert_close("dlogits", &row, &want_grad, 1e-5, 1e-9);
            let mut row = logits.clone();
            assert_eq!(softmax(&mut row, target as i32, None), loss);
            let mut row = logits.clone();
            assert_eq!(softmax(&mut row, -1, Some(1.0)), 0.0);
            assert!(row.iter().all(|&g| g == 0.0));
            // A NaN logit anywhere makes the loss NaN (the trainer's non-finite check).
            let mut row = logits.clone();
            row[977] = f32::NAN;
            assert!(softmax(&mut row, target as i32, None).is_nan());
        }
    }

    #[test]
    fn all_targets_ignored_gives_zero_loss_and_gradient() {
        let (n, c, v) = (3, 4, 5);
        let x = rand_vec(n * c, 1);
        let wte = rand_vec(v * c, 2);
        let mut scratch = vec![0.0; n * v];
        let mut losses = vec![1.0; n];
        let mut dx = vec![1.0; n * c];
        let mut dwte = vec![0.0; v * c];
        let grads = ClassifierGrads {
            dx: &mut dx,
            dwte: &mut dwte,
            scale: 1.0,
        };
        let cls = Classifier {
            wte: &wte,
            packs: None,
            c,
            v,
            backend: &Backend::portable(),
        };
        let loss =
            classifier_forward::<false>(&x, cls, &[-1; 3], &mut losses, &mut scratch, Some(grads));
        assert_eq!(loss, 0.0);
        assert!(dx.iter().chain(&dwte).all(|&d| d == 0.0));
    }

    #[test]
    fn weight_gradient_covers_every_vocabulary_block() {
        // Two full blocks and a partial one.
        let (r, c, v, block) = (3, 4, 11, 4);
        let dlogits = rand_vec(r * v, 1);
        let x = rand_vec(r * c, 2);
        let mut dwte = rand_vec(v * c, 3);
        let mut want = to_f64(&dwte);
        for (j, row) in want.chunks_mut(c).enumerate() {
            for (i, w) in row.iter_mut().enumerate() {
                *w += (0..r)
                    .map(|k| dlogits[k * v + j] as f64 * x[k * c + i] as f64)
                    .sum::<f64>();
            }
        }
        let (dlogits_m, x_m) = (Mat::new(&dlogits, r, v), Mat::new(&x, r, c));
        weight_gradient::<false>(&Backend::portable(), &mut dwte, dlogits_m, x_m, block);
        assert_close("dwte", &dwte, &want, 1e-5, 1e-6);
    }

    #[test]
    fn logits_match_reference() {
        let (n, c, v) = (3, 8, 10);
        let x = rand_vec(n * c, 1);
        let wte = rand_vec(16 * c, 2);
        let mut out = vec![0.0; n * v];
        let cls = Classifier {
            wte: &wte,
            packs: None,
            c,
            v,
            backend: &Backend::portable(),
        };
        classifier_logits(&mut out, &x, cls);
        for r in 0..n {
            for j in 0..v {
                let want: f32 = (0..c).map(|i| x[r * c + i] * wte[j * c + i]).sum();
                assert!((out[r * v + j] - want).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn bf16_gradients_use_rounded_logit_gradients() {
        check_bf16(7, 12, 9, 3, false);
        // Products of ≥ 2^20 multiply-adds: these take the AMX kernel where present.
        // (100 rows in 3 chunks of 34: 34 · 128 · 256 ≥ 2^20.)
        let unpacked = check_bf16(100, 128, 256, 48, false);
        if Backend::detect(None).reads_packs() {
            // With wte packed beforehand: the same kernel on the same values.
            assert_eq!(check_bf16(100, 128, 256, 48, true), unpacked);
        } else {
            println!("SKIPPED the packed-wte case: no AMX or AVX512-BF16 here");
        }
    }

    /// Checks the bf16 classifier against an f64 reference; returns (loss, dx, dwte).
    fn check_bf16(
        n: usize,
        c: usize,
        v: usize,
        chunk: usize,
        packed: bool,
    ) -> (f32, Vec<f32>, Vec<f32>) {
        use crate::kernels::bf16::round;
        let rounded = |x: Vec<f32>| x.into_iter().map(round).collect::<Vec<f32>>();
        let x = rounded(rand_vec(n * c, 11));
        let wte = rounded(rand_vec(v * c, 12).iter().map(|w| 3.0 * w).collect());
        let targets: Vec<i32> = (0..n).map(|r| ((r * 5 + 1) % v) as i32).collect();
        let scale = 0.5f32;
        let (mut dx, mut dwte) = (vec![0.0; n * c], vec![0.0; v * c]);
        let mut losses = vec![0.0; n];
        let mut scratch = vec![0.0; chunk * v];
        let grads = ClassifierGrads {
            dx: &mut dx,
            dwte: &mut dwte,
            scale,
        };
        let mut packs = WtePacks::default();
        if packed {
            packs.pack(&wte, v, c);
        }
        let cls = Classifier {
            wte: &wte,
            packs: packed.then_some(&packs),
            c,
            v,
            backend: &Backend::detect(None),
        };
        let loss =
            classifier_forward::<true>(&x, cls, &targets, &mut losses, &mut scratch, Some(grads));
        let want = reference_loss(&to_f64(&x), &to_f64(&wte), &targets, c, v);
        assert!((loss as f64 - want).abs() < 1e-5 * want, "{loss} vs {want}");
        // Reference: f64 softmax gradient, rounded to bf16, then exact f64 products.
        let mut dlogits = vec![0.0f64; n * v];
        for r in 0..n {
            let logits: Vec<f64> = (0..v)
                .map(|j| {
                    (0..c)
                        .map(|i| x[r * c + i] as f64 * wte[j * c + i] as f64)
                        .sum()
                })
                .collect();
            let max = logits.iter().cloned().fold(f64::MIN, f64::max);
            let sum: f64 = logits.iter().map(|l| (l - max).exp()).sum();
            for j in 0..v {
                let onehot = (j == targets[r] as usize) as u8 as f64;
                let g = scale as f64 / n as f64 * ((logits[j] - max).exp() / sum - onehot);
                dlogits[r * v + j] = round(g as f32) as f64;
            }
        }
        let mut want_dx = vec![0.0; n * c];
        let mut want_dwte = vec![0.0; v * c];
        for r in 0..n {
            for j in 0..v {
                for i in 0..c {
                    want_dx[r * c + i] += dlogits[r * v + j] * wte[j * c + i] as f64;
                    want_dwte[j * c + i] += dlogits[r * v + j] * x[r * c + i] as f64;
                }
            }
        }
        // f32 softmax may land one bf16 ulp (2^-8 relative) away from the f64 one.
        assert_close("dx", &dx, &want_dx, 8e-3, 1e-4);
        assert_close("dwte", &dwte, &want_dwte, 8e-3, 1e-4);
        // And the rounding happened: every term of dx is a product of bf16 values, so
        // the result differs from the unrounded gradient by more than f32 noise.
        let mut unrounded = vec![0.0f32; n * c];
        let mut unrounded_w = vec![0.0f32; v * c];
        let grads = ClassifierGrads {
            dx: &mut unrounded,
            dwte: &mut unrounded_w,
            scale,
        };
        classifier_forward::<false>(&x, cls, &targets, &mut losses, &mut scratch, Some(grads));
        let max_diff = dx
            .iter()
            .zip(&unrounded)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(
            max_diff > 1e-6,
            "bf16 rounding changed nothing ({max_diff})"
        );
        (loss, dx, dwte)
    }
}
