//! Which GEMM to build on, and how fast it runs on the products of a GPT-2 124M
//! training step (B·T = 1024 rows), in the operand layouts the kernels pass: the
//! `gemm` crate (what the kernels use) against `matrixmultiply`.
//! `bench/gemm_numpy.py` times OpenBLAS (numpy) on the same shapes.
//!
//!     cargo bench --bench gemm            # RAYON_NUM_THREADS / MATMUL_NUM_THREADS = cores

use nanogpt::kernels::mat::{matmul, Mat};
use std::time::Instant;

/// How an operand is stored: `N` dense row-major as used, `T` stored transposed
/// (the product reads a transposed view, e.g. `weightᵀ` in a linear forward).
#[derive(Clone, Copy, PartialEq)]
enum Layout {
    N,
    T,
}
use Layout::{N, T};

/// (name, m, k, n, a layout, b layout): dst (m×n) = a (m×k) · b (k×n). The classifier
/// runs 1,024 rows as four chunks of 256, and its `dwte` product in blocks of 4,096
/// vocabulary rows (src/kernels/classifier.rs).
const SHAPES: [(&str, usize, usize, usize, Layout, Layout); 17] = [
    ("qs qkv fwd", 768, 128, 384, N, T),
    ("qs fc fwd", 768, 128, 512, N, T),
    ("qs mlp fwd", 768, 512, 128, N, T),
    ("qs fc dx", 768, 512, 128, N, N),
    ("qs fc dW", 512, 768, 128, T, N),
    ("qkv fwd  x·Wᵀ", 1024, 768, 2304, N, T),
    ("proj fwd x·Wᵀ", 1024, 768, 768, N, T),
    ("fc fwd   x·Wᵀ", 1024, 768, 3072, N, T),
    ("mlp fwd  x·Wᵀ", 1024, 3072, 768, N, T),
    ("fc dx    dy·W", 1024, 3072, 768, N, N),
    ("mlp dx   dy·W", 1024, 768, 3072, N, N),
    ("fc dW    dyᵀ·x", 3072, 1024, 768, T, N),
    ("mlp dW   dyᵀ·x", 768, 1024, 3072, T, N),
    ("cls fwd  x·wteᵀ", 256, 768, 50304, N, T),
    ("cls dx   dl·wte", 256, 50304, 768, N, N),
    ("cls dwte dlᵀ·x", 4096, 256, 768, T, N),
    ("square 2048", 2048, 2048, 2048, N, N),
];

fn median_gflops(flops: f64, mut run: impl FnMut()) -> f64 {
    run();
    let mut rates: Vec<f64> = (0..7)
        .map(|_| {
            let start = Instant::now();
            run();
            flops / start.elapsed().as_secs_f64() / 1e9
        })
        .collect();
    rates.sort_by(f64::total_cmp);
    rates[rates.len() / 2]
}

/// A `rows × cols` operand stored in `layout`: its (row, col) strides.
fn strides(rows: usize, cols: usize, layout: Layout) -> (usize, usize) {
    match layout {
        N => (cols, 1),
        T => (1, rows),
    }
}

fn view(data: &[f32], rows: usize, cols: usize, layout: Layout) -> Mat<'_> {
    match layout {
        N => Mat::new(data, rows, cols),
        T => Mat::new(data, cols, rows).t(),
    }
}

fn main() {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("threads: {threads} (gemm via rayon, matrixmultiply via its own pool)");
    println!(
        "{:<20} {:>6} {:>6} {:>6} {:>10} {:>10}",
        "product", "m", "k", "n", "gemm GF/s", "mm GF/s"
    );
    for (name, m, k, n, la, lb) in SHAPES {
        let a: Vec<f32> = (0..m * k).map(|i| (i % 13) as f32 * 0.1).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i % 7) as f32 * 0.1).collect();
        let mut c = vec![0.0f32; m * n];
        let flops = 2.0 * (m * n * k) as f64;
        let g = median_gflops(flops, || {
            matmul(&mut c, view(&a, m, k, la), view(&b, k, n, lb), false)
        });
        let (ars, acs) = strides(m, k, la);
        let (brs, bcs) = strides(k, n, lb);
        let mm = median_gflops(flops, || unsafe {
            // SAFETY: a, b, c hold exactly m×k, k×n, m×n elements and the strides
            // address each element once within them.
            matrixmultiply::sgemm(
                m,
                k,
                n,
                1.0,
                a.as_ptr(),
                ars as isize,
                acs as isize,
                b.as_ptr(),
                brs as isize,
                bcs as isize,
                0.0,
                c.as_mut_ptr(),
                n as isize,
                1,
            )
        });
        println!("{name:<20} {m:>6} {k:>6} {n:>6} {g:>10.1} {mm:>10.1}");
    }
}
