//! Linear layers, through the `gemm` crate.
//!
//! Weights are `(OC, C)` (PyTorch `nn.Linear` order): `out = inp · weightᵀ + bias`.

use super::bf16::gemm::{matmul_bf16, matmul_bf16_packed, WeightPacks};
use super::SharedMut;
use rayon::prelude::*;

/// A read-only strided view of a matrix: element `(i, j)` is `data[i·rs + j·cs]`.
#[derive(Clone, Copy)]
pub struct Mat<'a> {
    pub(crate) data: &'a [f32],
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) rs: usize,
    pub(crate) cs: usize,
}

impl<'a> Mat<'a> {
    /// A dense row-major `rows × cols` matrix.
    pub fn new(data: &'a [f32], rows: usize, cols: usize) -> Mat<'a> {
        assert_eq!(
            data.len(),
            rows * cols,
            "matrix data does not match its shape"
        );
        Mat {
            data,
            rows,
            cols,
            rs: cols,
            cs: 1,
        }
    }

    /// The transpose, as a view (no copy).
    pub fn t(self) -> Mat<'a> {
        Mat {
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }

    /// The columns `start..end`, as a view (no copy).
    pub fn columns(self, start: usize, end: usize) -> Mat<'a> {
        assert!(
            start <= end && end <= self.cols,
            "column range out of bounds"
        );
        Mat {
            data: &self.data[(start * self.cs).min(self.data.len())..],
            cols: end - start,
            ..self
        }
    }
}

/// Checks that `dst = a · b` fits together (panics otherwise) and does the products
/// with nothing to multiply: an empty `dst`, or an empty inner dimension (`dst`
/// zeroed, or left as it is when `accumulate`). True when that was the whole product.
pub fn shapes_checked_and_trivial(dst: &mut [f32], a: Mat, b: Mat, accumulate: bool) -> bool {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert_eq!(b.rows, k, "inner dimensions differ");
    assert_eq!(dst.len(), m * n, "destination does not match m × n");
    if m == 0 || n == 0 {
        return true;
    }
    if k == 0 && !accumulate {
        dst.fill(0.0);
    }
    k == 0
}

/// `dst = a · b` (or `dst += a · b` when `accumulate`), dst dense row-major `m × n`.
///
/// Large products with a row-major `a` are split by columns into one piece per
/// thread, each a single-threaded `gemm` call: as fast as the crate's own threading
/// or faster on GPT-2's shapes (`f32_split_speed`, 2 threads: a 256-row prompt's
/// products 1.00–1.72×, a training step's forward and input-gradient products
/// 0.99–1.36×), and the same bits, since the crate's depth blocking (`kc`) depends on
/// k only, so every element sums its k products in the same order however the
/// columns are split (tested). Products of a transposed `a` (the weight gradients,
/// `doutᵀ · inp`) measured 0.87–1.00× split, so they keep the crate's threading.
pub fn matmul(dst: &mut [f32], a: Mat, b: Mat, accumulate: bool) {
    if shapes_checked_and_trivial(dst, a, b, accumulate) {
        return;
    }
    let (m, k, n) = (a.rows, a.cols, b.cols);
    let threads = rayon::current_num_threads();
    let split =
        threads > 1 && a.cs == 1 && n >= SPLIT_MIN_COLUMNS * threads && m * n * k >= SPLIT_MIN_MACS;
    if !split {
        // SAFETY: dst is exclusively borrowed and holds m × n (checked above).
        return unsafe { gemm_into(dst.as_mut_ptr(), a, b, n, accumulate, threads) };
    }
    let width = n.div_ceil(threads).next_multiple_of(16);
    let out = SharedMut::new(dst);
    (0..n.div_ceil(width)).into_par_iter().for_each(|part| {
        let (j0, j1) = (part * width, ((part + 1) * width).min(n));
        // SAFETY: piece `part` writes only columns j0..j1 (< n) of dst's m rows of n
        // (checked above): the pieces are disjoint.
        unsafe { gemm_into(out.ptr().add(j0), a, b.columns(j0, j1), n, accumulate, 1) };
    });
}

/// Products with fewer multiply-adds stay on one `gemm` call (the crate's threading).
const SPLIT_MIN_MACS: usize = 1 << 20;
/// Columns per thread below which a product stays on one `gemm` call.
const SPLIT_MIN_COLUMNS: usize = 64;

/// `dst = a · b` (or `+=`) into `a.rows` rows of `b.cols` values, `ldd` apart, on
/// `threads` threads (1: the calling one).
///
/// # Safety
/// `dst` must be valid for writes of every element `i·ldd + j`, i < a.rows,
/// j < b.cols, and not accessed otherwise meanwhile; `a.cols == b.rows`.
unsafe fn gemm_into(dst: *mut f32, a: Mat, b: Mat, ldd: usize, accumulate: bool, threads: usize) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    let parallelism = match threads {
        1 => gemm::Parallelism::None,
        t => gemm::Parallelism::Rayon(t),
    };
    // SAFETY: `Mat::new` checked that each operand's data holds rows × cols elements,
    // `t()` only swaps the strides and `columns()` starts the slice at its first column
    // and narrows `cols` to match, so every index gemm forms from (m, n, k) and the
    // strides lies inside its slice; dst as the caller guarantees.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            ldd as isize,
            accumulate,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
}

/// A linear layer's parameters: `weight` (OC, C) and `bias` (OC), or no bias (empty).
#[derive(Clone, Copy)]
pub struct Linear<'a> {
    pub weight: &'a [f32],
    pub bias: &'a [f32],
    /// Input channels (C).
    pub c: usize,
    /// Output channels (OC).
    pub oc: usize,
    /// bf16 on AMX or AVX512-BF16: `weight` packed beforehand (once per optimizer
    /// step) for the forward and input-gradient products, which then read the packs
    /// instead of packing `weight` per call: the same bits. None: packed per call.
    pub packs: Option<&'a WeightPacks>,
}

/// Where a linear layer's parameter gradients accumulate: `dweight` (OC, C) and
/// `dbias` (OC), or no bias (empty).
pub struct LinearGrads<'a> {
    pub dweight: &'a mut [f32],
    pub dbias: &'a mut [f32],
}

/// The GEMM of a precision: the f32 one, or, for bf16 autocast (operands holding bf16
/// values), [`matmul_bf16`].
fn gemm<const BF16: bool>() -> fn(&mut [f32], Mat, Mat, bool) {
    if BF16 {
        matmul_bf16
    } else {
        matmul
    }
}

/// `out = inp · weightᵀ + bias`. With `BF16`, `inp` and `weight` hold bf16 values and
/// the product runs on [`matmul_bf16`] (f32 accumulation, f32 bias and output).
///
/// out: (N, OC) written; inp: (N, C).
pub fn linear_forward<const BF16: bool>(out: &mut [f32], inp: &[f32], w: Linear) {
    let _t = crate::profile::scope(crate::profile::Section::MatmulForward);
    let n = inp.len() / w.c;
    assert_eq!(out.len(), n * w.oc, "linear_forward: out must be (N, OC)");
    if !w.bias.is_empty() {
        out.par_chunks_mut(w.oc)
            .for_each(|row| row.copy_from_slice(w.bias));
    }
    let (weight, x) = (Mat::new(w.weight, w.oc, w.c), Mat::new(inp, n, w.c));
    let acc = !w.bias.is_empty();
    match w.packs.filter(|_| BF16) {
        Some(p) => matmul_bf16_packed(out, x, weight.t(), &p.t, acc),
        None => gemm::<BF16>()(out, x, weight.t(), acc),
    }
}

/// Backward of [`linear_forward`]: `dinp = dout · weight` (**overwritten**),
/// `dweight += doutᵀ · inp` and `dbias += Σ_rows dout` (accumulated). With `BF16`,
/// `dout`, `inp` and `weight` hold bf16 values; the gradients are f32.
pub fn linear_backward<const BF16: bool>(
    dinp: &mut [f32],
    g: LinearGrads,
    dout: &[f32],
    inp: &[f32],
    w: Linear,
) {
    linear_backward_input::<BF16>(dinp, dout, w);
    linear_backward_params::<BF16>(g, dout, inp, w.c, w.oc);
}

/// The parameter half of [`linear_backward`]: `dweight += doutᵀ · inp` and
/// `dbias += Σ_rows dout`. With [`linear_backward_input`] it lets a caller reuse
/// `inp`'s buffer for `dinp` (the MLP recomputes its GELU output into the buffer that
/// then receives the GELU's gradient).
///
/// dout: (N, OC); inp: (N, C).
pub fn linear_backward_params<const BF16: bool>(
    g: LinearGrads,
    dout: &[f32],
    inp: &[f32],
    c: usize,
    oc: usize,
) {
    let _t = crate::profile::scope(crate::profile::Section::MatmulBackward);
    let n = inp.len() / c;
    let (dout, inp) = (Mat::new(dout, n, oc), Mat::new(inp, n, c));
    gemm::<BF16>()(g.dweight, dout.t(), inp, true);
    if !g.dbias.is_empty() {
        bias_backward(g.dbias, dout.data, oc);
    }
}

/// The input half of [`linear_backward`]: `dinp = dout · weight` (**overwritten**).
///
/// dinp: (N, C); dout: (N, OC).
pub fn linear_backward_input<const BF16: bool>(dinp: &mut [f32], dout: &[f32], w: Linear) {
    let _t = crate::profile::scope(crate::profile::Section::MatmulBackward);
    let n = dinp.len() / w.c;
    let (weight, dy) = (Mat::new(w.weight, w.oc, w.c), Mat::new(dout, n, w.oc));
    match w.packs.filter(|_| BF16) {
        Some(p) => matmul_bf16_packed(dinp, dy, weight, &p.n, false),
        None => gemm::<BF16>()(dinp, dy, weight, false),
    }
}

/// `dbias[o] += Σ_rows dout[row, o]`, parallel over column blocks.
fn bias_backward(dbias: &mut [f32], dout: &[f32], oc: usize) {
    const BLOCK: usize = 64;
    dbias
        .par_chunks_mut(BLOCK)
        .enumerate()
        .for_each(|(blk, db)| {
            let cols = blk * BLOCK..blk * BLOCK + db.len();
            for row in dout.chunks_exact(oc) {
                for (d, &g) in db.iter_mut().zip(&row[cols.clone()]) {
                    *d += g;
                }
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::*;

    fn reference(x: &[f64], w: &[f64], b: &[f64], c: usize, oc: usize) -> Vec<f64> {
        let n = x.len() / c;
        let mut out = vec![0.0; n * oc];
        for r in 0..n {
            for o in 0..oc {
                let dot: f64 = (0..c).map(|i| x[r * c + i] * w[o * c + i]).sum();
                out[r * oc + o] = dot + b.get(o).copied().unwrap_or(0.0);
            }
        }
        out
    }

    #[test]
    fn column_views_multiply_as_their_columns() {
        let (m, k) = (3, 7);
        let a = rand_vec(m * k, 1);
        let b = rand_vec(3 * 2, 2);
        // Columns 2..5 of a: element (i, p) is a[i·k + 2 + p].
        let mut got = vec![f32::NAN; m * 2];
        matmul(
            &mut got,
            Mat::new(&a, m, k).columns(2, 5),
            Mat::new(&b, 3, 2),
            false,
        );
        let want: Vec<f64> = (0..m * 2)
            .map(|e| {
                let (i, j) = (e / 2, e % 2);
                (0..3)
                    .map(|p| a[i * k + 2 + p] as f64 * b[p * 2 + j] as f64)
                    .sum()
            })
            .collect();
        assert_close("a[:, 2..5] · b", &got, &want, 1e-6, 1e-6);
        // Through a transpose: columns 1..4 of aᵀ are rows 1..4 of a, element (p, i) of
        // the view is a[(1 + p)·k + i].
        let rows = Mat::new(&a, m, k).t().columns(1, 3).t();
        let c = rand_vec(k * 2, 3);
        let mut got = vec![f32::NAN; 2 * 2];
        matmul(&mut got, rows, Mat::new(&c, k, 2), false);
        let want: Vec<f64> = (0..2 * 2)
            .map(|e| {
                let (p, j) = (e / 2, e % 2);
                (0..k)
                    .map(|i| a[(1 + p) * k + i] as f64 * c[i * 2 + j] as f64)
                    .sum()
            })
            .collect();
        assert_close("a[1..3, :] · c", &got, &want, 1e-6, 1e-6);
    }

    fn check(n: usize, c: usize, oc: usize, with_bias: bool) {
        let x = rand_vec(n * c, 1);
        let w = rand_vec(oc * c, 2);
        let b = if with_bias { rand_vec(oc, 3) } else { vec![] };
        let g = rand_vec(n * oc, 4);
        let (x64, w64, b64) = (to_f64(&x), to_f64(&w), to_f64(&b));

        let lin = Linear {
            weight: &w,
            bias: &b,
            c,
            oc,
            packs: None,
        };
        let mut out = vec![f32::NAN; n * oc];
        linear_forward::<false>(&mut out, &x, lin);
        assert_close("out", &out, &reference(&x64, &w64, &b64, c, oc), 1e-5, 1e-5);

        let mut dx = vec![f32::NAN; n * c];
        let prior_dw = rand_vec(oc * c, 5);
        let mut dw = prior_dw.clone();
        let mut db = vec![0.5; b.len()];
        let grads = LinearGrads {
            dweight: &mut dw,
            dbias: &mut db,
        };
        linear_backward::<false>(&mut dx, grads, &g, &x, lin);

        let loss = |x: &[f64], w: &[f64], b: &[f64]| dot(&reference(x, w, b, c, oc), &g);
        let want_dx = numeric_grad(|v| loss(v, &w64, &b64), &x64, 1e-4);
        assert_close("dinp", &dx, &want_dx, 1e-4, 1e-5);
        let mut want_dw = numeric_grad(|v| loss(&x64, v, &b64), &w64, 1e-4);
        for (d, &p) in want_dw.iter_mut().zip(&prior_dw) {
            *d += p as f64;
        }
        assert_close("dweight", &dw, &want_dw, 1e-4, 1e-5);
        if with_bias {
            let mut want_db = numeric_grad(|v| loss(&x64, &w64, v), &b64, 1e-4);
            want_db.iter_mut().for_each(|d| *d += 0.5);
            assert_close("dbias", &db, &want_db, 1e-4, 1e-5);
        }
    }

    #[test]
    fn matches_reference_and_finite_differences() {
        check(5, 8, 12, true);
        check(7, 33, 65, true);
        check(3, 16, 4, false);
    }

    #[test]
    fn backward_halves_equal_the_whole() {
        let (n, c, oc) = (9, 20, 14);
        let (x, w, g) = (rand_vec(n * c, 1), rand_vec(oc * c, 2), rand_vec(n * oc, 3));
        let (mut dx, mut dw, mut db) = (vec![0.0; n * c], rand_vec(oc * c, 4), vec![0.5; oc]);
        let (mut dx2, mut dw2, mut db2) = (vec![f32::NAN; n * c], dw.clone(), db.clone());
        let bias = vec![0.0; oc];
        let lin = Linear {
            weight: &w,
            bias: &bias,
            c,
            oc,
            packs: None,
        };
        let grads = |dweight, dbias| LinearGrads { dweight, dbias };
        linear_backward::<false>(&mut dx, grads(&mut dw, &mut db), &g, &x, lin);
        linear_backward_params::<false>(grads(&mut dw2, &mut db2), &g, &x, c, oc);
        linear_backward_input::<false>(&mut dx2, &g, lin);
        assert_eq!((dx, dw, db), (dx2, dw2, db2));
    }

    #[test]
    fn column_split_gives_the_bits_of_one_call() {
        // Large enough to split; n not a multiple of the pieces' 16-column rounding;
        // every orientation of the operands training uses; written and accumulated.
        let (m, k, n) = (67, 1031, 333);
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build();
        let pool = pool.expect("a pool of 3 threads");
        let a = rand_vec(m * k, 1);
        let b = rand_vec(k * n, 2);
        let init = rand_vec(m * n, 3);
        let am = [Mat::new(&a, m, k), Mat::new(&a, k, m).t()];
        let bm = [Mat::new(&b, k, n), Mat::new(&b, n, k).t()];
        for (a, b, acc) in am
            .iter()
            .flat_map(|&a| bm.iter().flat_map(move |&b| [(a, b, false), (a, b, true)]))
        {
            let (mut split, mut one) = (init.clone(), init.clone());
            pool.install(|| matmul(&mut split, a, b, acc));
            // SAFETY: `one` is m × n.
            unsafe { gemm_into(one.as_mut_ptr(), a, b, n, acc, 1) };
            assert!(m * n * k >= SPLIT_MIN_MACS && n >= 3 * SPLIT_MIN_COLUMNS);
            assert_eq!(split, one, "a·b split by columns, accumulate {acc}");
        }
    }

    #[test]
    fn large_product_matches_reference() {
        // Big enough that gemm packs and splits across threads.
        let (n, c, oc) = (96, 128, 200);
        let x = rand_vec(n * c, 7);
        let w = rand_vec(oc * c, 8);
        let b = rand_vec(oc, 9);
        let mut out = vec![0.0; n * oc];
        let lin = Linear {
            weight: &w,
            bias: &b,
            c,
            oc,
            packs: None,
        };
        linear_forward::<false>(&mut out, &x, lin);
        let want = reference(&to_f64(&x), &to_f64(&w), &to_f64(&b), c, oc);
        assert_close("out", &out, &want, 1e-5, 1e-4);
    }

    #[test]
    fn bf16_operands_give_the_bf16_gemm_result() {
        // Products of bf16 values are exact in f32, so the f32 GEMM over bf16-rounded
        // operands differs from an exact bf16 GEMM with f32 accumulation only by the
        // f32 summation order. The reference sums the exact products in f64.
        use crate::kernels::bf16::round;
        let (n, c, oc) = (64, 96, 80);
        let r = |v: Vec<f32>| -> Vec<f32> { v.into_iter().map(round).collect() };
        let (x, w, g) = (
            r(rand_vec(n * c, 1)),
            r(rand_vec(oc * c, 2)),
            r(rand_vec(n * oc, 3)),
        );
        let mut out = vec![0.0; n * oc];
        let lin = Linear {
            weight: &w,
            bias: &[],
            c,
            oc,
            packs: None,
        };
        linear_forward::<false>(&mut out, &x, lin);
        let want = reference(&to_f64(&x), &to_f64(&w), &[], c, oc);
        assert_close("out", &out, &want, 1e-6, 1e-6);
        let (mut dx, mut dw) = (vec![0.0; n * c], vec![0.0; oc * c]);
        let grads = LinearGrads {
            dweight: &mut dw,
            dbias: &mut [],
        };
        linear_backward::<false>(&mut dx, grads, &g, &x, lin);
        let (x64, w64, g64) = (to_f64(&x), to_f64(&w), to_f64(&g));
        let want_dx: Vec<f64> = (0..n * c)
            .map(|e| {
                (0..oc)
                    .map(|o| g64[e / c * oc + o] * w64[o * c + e % c])
                    .sum()
            })
            .collect();
        let want_dw: Vec<f64> = (0..oc * c)
            .map(|e| {
                (0..n)
                    .map(|i| g64[i * oc + e / c] * x64[i * c + e % c])
                    .sum()
            })
            .collect();
        assert_close("dinp", &dx, &want_dx, 1e-6, 1e-6);
        assert_close("dweight", &dw, &want_dw, 1e-6, 1e-6);
    }
}

#[cfg(test)]
mod speed {
    use super::*;
    use crate::kernels::testutil::rand_vec;
    use std::time::Instant;

    /// Timing, not correctness: `cargo test --release --lib f32_split_speed --
    /// --ignored --nocapture`. GPT-2 124M's linear and classifier products of a
    /// training step (B·T = 1,024 rows: forward, input gradient, weight gradient) and
    /// a prompt's 256-row forward products: [`matmul`] (split by columns) against one
    /// `gemm` call on the crate's threading; best of 5, alternating.
    #[test]
    #[ignore = "benchmark: needs a release build and ~1 GB"]
    fn f32_split_speed() {
        let threads = rayon::current_num_threads();
        let (bt, c, v) = (1024, 768, 50304);
        let mut shapes: Vec<(&str, usize, usize, usize)> = Vec::new();
        for (oc, ic) in [(3 * c, c), (c, c), (4 * c, c), (c, 4 * c)] {
            shapes.push(("prompt forward", 256, oc, ic));
            shapes.push(("forward", bt, oc, ic));
            shapes.push(("input gradient", bt, oc, ic));
            shapes.push(("weight gradient", bt, oc, ic));
        }
        shapes.push(("forward", bt, v, c));
        shapes.push(("input gradient", bt, v, c));
        shapes.push(("weight gradient", bt, v, c));
        for (what, rows, oc, ic) in shapes {
            let (x, w, g) = (
                rand_vec(rows * ic, 1),
                rand_vec(oc * ic, 2),
                rand_vec(rows * oc, 3),
            );
            // out = x·Wᵀ (rows × oc); dx = g·W (rows × ic); dW = gᵀ·x (oc × ic).
            let (a, b) = match what {
                "input gradient" => (Mat::new(&g, rows, oc), Mat::new(&w, oc, ic)),
                "weight gradient" => (Mat::new(&g, rows, oc).t(), Mat::new(&x, rows, ic)),
                _ => (Mat::new(&x, rows, ic), Mat::new(&w, oc, ic).t()),
            };
            let len = a.rows * b.cols;
            let (mut d1, mut d2) = (vec![0.0; len], vec![0.0; len]);
            let (mut split, mut one) = (f64::INFINITY, f64::INFINITY);
            for _ in 0..5 {
                let t = Instant::now();
                matmul(&mut d1, a, b, false);
                split = split.min(t.elapsed().as_secs_f64());
                let t = Instant::now();
                // SAFETY: d2 is a.rows × b.cols.
                unsafe { gemm_into(d2.as_mut_ptr(), a, b, b.cols, false, threads) };
                one = one.min(t.elapsed().as_secs_f64());
            }
            assert_eq!(d1, d2);
            let gf = 2.0 * (a.rows * a.cols * b.cols) as f64 / 1e9;
            println!(
                "{what} {}×{}×{}, {threads} threads: one gemm call {:.0} GFLOP/s, split by columns {:.0} ({:.2}×)",
                a.rows, a.cols, b.cols, gf / one, gf / split, one / split
            );
        }
    }
}
