//! The bf16 matmul kernels on every linear and classifier product of a GPT-2 124M
//! training step at B·T = 1,024 (src/kernels/bf16/products.rs): the f32 GEMM over
//! bf16 values, our kernel for this CPU (AMX-BF16 where the CPU has it, else
//! AVX512-BF16: `Backend::with_kernel`), packing B per call and reading a B packed
//! beforehand, as the step does for every weight, and, in builds with `--features onednn`,
//! oneDNN (its operand copies included), alternating in one process, the fastest
//! repetition of each. The clock is the process's CPU time (all threads) by default:
//! on a machine shared with other work it counts the cycles spent on the product,
//! where wall time counts the waits for a core (the numbers are then GFLOP per
//! CPU-second, summed over threads; they do not see a thread left idle, so check
//! the wall clock on a quiet machine too). `BF16_BENCH_CLOCK=wall` times wall-clock
//! GFLOP/s instead. The last row weighs each product by how often a step runs it.
//!
//!     cargo bench --bench bf16
//!     cargo bench --features onednn --bench bf16     # with the oneDNN column
//!
//! `BF16_BENCH_REPS` (default 7) sets the repetitions, `BF16_BENCH_SHAPES=qkv,cls`
//! keeps the products whose names contain one of the words.

use nanogpt::kernels::bf16::gemm;
use nanogpt::kernels::bf16::pack::PackedB;
use nanogpt::kernels::bf16::products::{CLS_DWTE_BLOCK, GPT2_PRODUCTS};
use nanogpt::kernels::bf16::{Backend, Kernel};
use nanogpt::kernels::cpu;
use nanogpt::kernels::mat::{matmul, Mat};
use std::time::Instant;

/// How many times one step (12 layers; the classifier in 4 chunks of 256 rows, each
/// with 50,304 / 4,096 dwte blocks) runs the product called `name`.
fn per_step(name: &str) -> f64 {
    match name {
        n if n.starts_with("cls dwte") => 4.0 * 50_304.0 / 4_096.0,
        n if n.starts_with("cls") => 4.0,
        _ => 12.0,
    }
}

/// Whether the step reads this product's B packed beforehand: every product whose B
/// is a weight (forward and dX: src/model/packs.rs), not the weight gradients.
fn step_prepacks(name: &str) -> bool {
    name.contains(" fwd ") || name.contains(" dx ")
}

/// `n` reproducible values in [-1, 1), rounded to bf16.
fn bf16_values(n: usize, seed: u32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            let x = (s >> 8) as f32 / (1u32 << 23) as f32 - 1.0;
            f32::from_bits(x.to_bits() & 0xFFFF_0000)
        })
        .collect()
}

/// A `rows × cols` operand, stored transposed when `t`.
fn view(data: &[f32], rows: usize, cols: usize, t: bool) -> Mat<'_> {
    match t {
        true => Mat::new(data, cols, rows).t(),
        false => Mat::new(data, rows, cols),
    }
}

/// Seconds on the bench's clock: the process's CPU time, or the wall clock.
fn now(wall: bool) -> f64 {
    #[cfg(target_os = "linux")]
    if !wall {
        let mut t = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime writes one timespec, which `t` is.
        let r = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut t) };
        assert_eq!(r, 0, "clock_gettime(CLOCK_PROCESS_CPUTIME_ID)");
        return t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9;
    }
    let _ = wall;
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_secs_f64()
}

/// The fastest repetition: on a shared machine the least disturbed one.
fn best(t: Vec<f64>) -> f64 {
    t.into_iter().fold(f64::INFINITY, f64::min)
}

type Run<'a> = Box<dyn FnMut(&mut [f32]) + 'a>;

fn main() {
    // Ours, even in a build where oneDNN would be the default (its column calls it
    // directly).
    let ours = match cpu::amx_permitted() {
        true => Kernel::Amx,
        false => Kernel::Avx512Bf16,
    };
    let Some(backend) = Backend::with_kernel(ours) else {
        println!("no AMX or AVX512-BF16 kernel for this CPU: nothing to time");
        return;
    };
    let backend = &backend;
    let reps: usize = std::env::var("BF16_BENCH_REPS").map_or(7, |r| r.parse().unwrap());
    let only = std::env::var("BF16_BENCH_SHAPES").unwrap_or_default();
    let wall = std::env::var("BF16_BENCH_CLOCK").is_ok_and(|c| c == "wall");
    let wall = wall || cfg!(not(target_os = "linux"));
    // oneDNN's OpenMP threads would otherwise spin on the cores after each call,
    // while the next kernel runs (and on its CPU time).
    if std::env::var_os("OMP_WAIT_POLICY").is_none() {
        std::env::set_var("OMP_WAIT_POLICY", "passive");
    }
    let picked = |name: &str| only.is_empty() || only.split(',').any(|s| name.contains(s));
    #[cfg(feature = "onednn")]
    let dnnl = nanogpt::kernels::bf16::onednn::available();
    #[cfg(not(feature = "onednn"))]
    let dnnl = false;
    println!(
        "threads: {}; {}, best of {reps}, alternating; ours = {ours:?} packing B \
         per call, packed = B packed beforehand; step = what the step runs{}",
        rayon::current_num_threads(),
        if wall {
            "GFLOP/s (wall clock)"
        } else {
            "GFLOP per CPU-second"
        },
        if dnnl {
            ""
        } else {
            " (no oneDNN in this build)"
        }
    );
    println!(
        "{:<16} {:>5} {:>5} {:>5} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8}",
        "product", "m", "k", "n", "f32", "ours", "packed", "oneDNN", "step/f32", "step/dnn"
    );
    // Seconds per step of each column, over the products timed.
    let mut totals = [0.0f64; 4];
    let shapes = GPT2_PRODUCTS.iter().copied().chain([CLS_DWTE_BLOCK]);
    for (name, m, k, n, ta, tb) in shapes.filter(|s| picked(s.0)) {
        let (a, b) = (bf16_values(m * k, 1), bf16_values(k * n, 2));
        let (am, bm) = (view(&a, m, k, ta), view(&b, k, n, tb));
        let mut packed = PackedB::default();
        packed.pack(bm);
        let mut runs: Vec<Run> = vec![
            Box::new(|c| matmul(c, am, bm, false)),
            Box::new(|c| gemm::matmul_bf16(backend, c, am, bm, false)),
            Box::new(|c| gemm::matmul_bf16_packed(backend, c, am, bm, &packed, false)),
        ];
        #[cfg(feature = "onednn")]
        if dnnl {
            use nanogpt::kernels::bf16::onednn;
            runs.push(Box::new(|c| onednn::matmul(c, am, bm, false)));
        }
        let mut c = vec![0.0f32; m * n];
        runs.iter_mut().for_each(|r| r(&mut c)); // warm-up (oneDNN makes its primitive)
        let mut t = vec![Vec::new(); runs.len()];
        for _ in 0..reps {
            for (run, t) in runs.iter_mut().zip(&mut t) {
                let s = now(wall);
                run(&mut c);
                t.push(now(wall) - s);
            }
        }
        let secs: Vec<f64> = t.into_iter().map(best).collect();
        let step = secs[if step_prepacks(name) { 2 } else { 1 }];
        let dnn = secs.get(3).copied().unwrap_or(f64::NAN);
        let flop = 2.0 * (m * n * k) as f64;
        let gf = |s: f64| flop / s / 1e9;
        println!(
            "{name:<16} {m:>5} {k:>5} {n:>5} {:>8.1} {:>8.1} {:>8.1} {:>8.1} {:>8.2} {:>8.2}",
            gf(secs[0]),
            gf(secs[1]),
            gf(secs[2]),
            gf(dnn),
            secs[0] / step,
            dnn / step
        );
        let w = per_step(name);
        for (total, s) in totals.iter_mut().zip([secs[0], step, secs[2], dnn]) {
            *total += w * s;
        }
    }
    let [f32_s, step_s, _, dnn_s] = totals;
    println!(
        "per step: f32 {f32_s:.3} s, ours as the step runs it {step_s:.3} s, oneDNN {dnn_s:.3} s \
         (on the bench's clock): ours {:.2}× f32, {:.2}× oneDNN's speed",
        f32_s / step_s,
        dnn_s / step_s
    );
}
