//! Which GEMM to build on: the `gemm` crate (what the kernels use) against
//! `matrixmultiply`, on the matmul shapes of a GPT-2 124M training step
//! (B·T = 1024 rows). `bench/gemm_numpy.py` times OpenBLAS (numpy) on the same shapes.
//!
//!     cargo bench --bench gemm            # RAYON_NUM_THREADS / MATMUL_NUM_THREADS = cores

use nanogpt::kernels::matmul::{matmul, Mat};
use std::time::Instant;

/// (name, m, k, n): dst (m×n) = a (m×k) · b (k×n).
const SHAPES: [(&str, usize, usize, usize); 7] = [
    ("qkv forward", 1024, 768, 2304),
    ("attn proj forward", 1024, 768, 768),
    ("fc forward", 1024, 768, 3072),
    ("mlp proj forward", 1024, 3072, 768),
    ("fc dW (768×1024·1024×3072)", 3072, 1024, 768),
    ("classifier chunk", 166, 768, 50257),
    ("square 2048", 2048, 2048, 2048),
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

fn main() {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("threads: {threads} (gemm via rayon, matrixmultiply via its own pool)");
    println!(
        "{:<28} {:>12} {:>16}",
        "shape", "gemm GF/s", "matrixmult GF/s"
    );
    for (name, m, k, n) in SHAPES {
        let a: Vec<f32> = (0..m * k).map(|i| (i % 13) as f32 * 0.1).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i % 7) as f32 * 0.1).collect();
        let mut c = vec![0.0f32; m * n];
        let flops = 2.0 * (m * n * k) as f64;
        let g = median_gflops(flops, || {
            matmul(&mut c, Mat::new(&a, m, k), Mat::new(&b, k, n), false)
        });
        let mm = median_gflops(flops, || unsafe {
            // SAFETY: a, b, c are dense row-major m×k, k×n, m×n buffers of exactly
            // those sizes, matching the strides passed.
            matrixmultiply::sgemm(
                m,
                k,
                n,
                1.0,
                a.as_ptr(),
                k as isize,
                1,
                b.as_ptr(),
                n as isize,
                1,
                0.0,
                c.as_mut_ptr(),
                n as isize,
                1,
            )
        });
        println!("{name:<28} {g:>12.1} {mm:>16.1}");
    }
}
