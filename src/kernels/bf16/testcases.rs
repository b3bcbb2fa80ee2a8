//! The inputs every bf16 matmul kernel is tested on (oneDNN, AVX512-BF16): odd shapes
//! against an f64 reference, strided views, rounding of non-bf16 inputs (tests only).

use super::round;
use crate::kernels::mat::Mat;
use crate::kernels::testutil::*;

pub use super::products::GPT2_PRODUCTS;

/// A bf16 matmul kernel: `dst (=|+=) a · b`.
pub type Kernel = fn(&mut [f32], Mat, Mat, bool);

/// `n` values in [-1, 1) rounded to bf16, reproducible from `seed`.
pub fn rounded(n: usize, seed: u64) -> Vec<f32> {
    rand_vec(n, seed).into_iter().map(round).collect()
}

/// `a` (m × k) and `b` (k × n) as the linear layers pass them: stored transposed when
/// asked.
pub fn views<'a>(a: &'a [f32], b: &'a [f32], dims: [usize; 3], t: [bool; 2]) -> [Mat<'a>; 2] {
    let [m, k, n] = dims;
    let am = match t[0] {
        true => Mat::new(a, k, m).t(),
        false => Mat::new(a, m, k),
    };
    let bm = match t[1] {
        true => Mat::new(b, n, k).t(),
        false => Mat::new(b, k, n),
    };
    [am, bm]
}

/// `prior (+)= a · b` in f64, element (i, j) read through the views.
pub fn reference(prior: &[f32], a: Mat, b: Mat, acc: bool) -> Vec<f64> {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    let at = |x: &Mat, i: usize, j: usize| x.data[i * x.rs + j * x.cs] as f64;
    (0..m * n)
        .map(|ij| {
            let (i, j) = (ij / n, ij % n);
            let dot: f64 = (0..k).map(|p| at(&a, i, p) * at(&b, p, j)).sum();
            dot + if acc { prior[ij] as f64 } else { 0.0 }
        })
        .collect()
}

/// `kernel` against an f64 reference on the same bf16 values.
pub fn check(kernel: Kernel, dims: [usize; 3], t: [bool; 2], acc: bool) {
    let [m, k, n] = dims;
    let (a, b) = (rounded(m * k, 1), rounded(k * n, 2));
    let [am, bm] = views(&a, &b, dims, t);
    let prior = rand_vec(m * n, 3);
    let mut got = prior.clone();
    kernel(&mut got, am, bm, acc);
    // Products of bf16 values are exact in f32; the f32 sums of k of them in [-1, 1]
    // err by at most about k · 2^-24 · k: well under 1e-6 · k.
    let tol = 1e-6 * k as f64;
    let what = format!("{m}×{k}×{n} Aᵀ {} Bᵀ {} acc {acc}", t[0], t[1]);
    assert_close(&what, &got, &reference(&prior, am, bm, acc), 0.0, tol);
}

/// The odd shapes: one row, one column, `k` odd and not a multiple of 32, ragged
/// edges, transposed operands as the three products of a linear layer pass them,
/// accumulating and not.
pub fn odd_shapes(kernel: Kernel) {
    check(kernel, [1, 1, 1], [false, false], false);
    check(kernel, [1, 77, 50], [false, true], true); // one row
    check(kernel, [45, 77, 1], [false, false], true); // one column
    check(kernel, [37, 75, 101], [false, false], false); // k not a multiple of 32
    check(kernel, [64, 96, 48], [false, true], true); // forward: x · Wᵀ, accumulating
    check(kernel, [64, 96, 48], [false, true], false);
    check(kernel, [50, 130, 70], [false, false], false); // dinp = dout · W
    check(kernel, [70, 33, 129], [true, false], true); // dweight += doutᵀ · x
    check(kernel, [300, 256, 200], [true, true], false);
    check(kernel, [200, 777, 161], [false, true], true);
}

/// A column range of a wider matrix (row stride > cols) times a view with neither
/// stride 1 (every other row of a transposed matrix).
pub fn strided_views(kernel: Kernel) {
    let (m, k, n) = (9, 40, 33);
    let wide = rounded(m * 50, 4);
    let a = Mat::new(&wide, m, 50).columns(7, 7 + k);
    let store = rounded(2 * n * k, 5);
    let b = Mat::strided(&store, (k, n), (1, 2 * k));
    let mut got = vec![0.0; m * n];
    kernel(&mut got, a, b, false);
    assert_close("strided", &got, &reference(&got, a, b, false), 0.0, 1e-4);
}

/// Inputs that are not bf16 values give the product of their nearest bf16 values.
pub fn non_bf16_inputs_round(kernel: Kernel) {
    let (m, k, n) = (9, 40, 33);
    let (a, b) = (rand_vec(m * k, 4), rand_vec(k * n, 5));
    let ra: Vec<f32> = a.iter().map(|&v| round(v)).collect();
    let rb: Vec<f32> = b.iter().map(|&v| round(v)).collect();
    let mut got = vec![0.0; m * n];
    kernel(&mut got, Mat::new(&a, m, k), Mat::new(&b, k, n), false);
    let want = reference(&got, Mat::new(&ra, m, k), Mat::new(&rb, k, n), false);
    assert_close("rounded", &got, &want, 0.0, 1e-5);
}

/// An empty inner dimension zeroes `dst`, or leaves it when accumulating.
pub fn empty_inner_dimension(kernel: Kernel) {
    let mut dst = vec![5.0; 6];
    kernel(&mut dst, Mat::new(&[], 2, 0), Mat::new(&[], 0, 3), true);
    assert_eq!(dst, vec![5.0; 6]);
    kernel(&mut dst, Mat::new(&[], 2, 0), Mat::new(&[], 0, 3), false);
    assert_eq!(dst, vec![0.0; 6]);
}

/// `kernel` gives the same bits on `dims` (m, k, n) on one thread as on each of
/// `threads` (tasks own disjoint blocks of C and add k in a fixed order).
pub fn same_bits_on_any_thread_count(kernel: Kernel, dims: [usize; 3], threads: &[usize]) {
    let [m, k, n] = dims;
    let (a, b) = (rounded(m * k, 6), rounded(k * n, 7));
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let mut out = vec![0.0; m * n];
        pool.install(|| kernel(&mut out, Mat::new(&a, m, k), Mat::new(&b, k, n), false));
        out
    };
    let one = run(1);
    for &t in threads {
        assert_eq!(one, run(t), "{t} threads");
    }
}
