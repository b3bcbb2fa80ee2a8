//! A strided matrix view ([`Mat`]) and the f32 GEMM over it, through the `gemm`
//! crate: the leaf every matmul kernel (f32 linear layers, the bf16 kernels, the
//! classifier) builds on.

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

    /// A `rows × cols` view of `data` with element `(i, j)` at `i·rs + j·cs` (tests
    /// of the kernels' strided operands).
    pub fn strided(
        data: &'a [f32],
        (rows, cols): (usize, usize),
        (rs, cs): (usize, usize),
    ) -> Mat<'a> {
        let last = (rows.max(1) - 1) * rs + (cols.max(1) - 1) * cs;
        assert!(
            rows * cols == 0 || last < data.len(),
            "strided view out of bounds"
        );
        Mat {
            data,
            rows,
            cols,
            rs,
            cs,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::*;

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
