//! After the first step, a training step (forward, backward, clipping, AdamW) makes
//! no allocation of its own: every buffer was sized up front. The only allocations
//! left are the `gemm` crate's per-call packing buffers, which it sizes from the CPU
//! caches, not from the batch; the test pins that down.
//!
//! The steps run on a pool of one thread, so that the counts depend on the step alone.
//! With more threads two things that are not nanogpt's buffers move them by one from
//! step to step. Work handed to a pool from outside it goes through rayon's global job
//! queue, which allocates a 1,520-byte block for every 63 jobs (and frees it once they
//! ran): a step that makes N parallel calls from outside the pool allocates ⌊N/63⌋ or
//! ⌈N/63⌉ such blocks (N = 220 for the bf16 step here, 178 for f32, so bf16 went 133,
//! 134, 133, ...). And per-thread buffers (the `gemm` crate's 1 MiB packing slab) are
//! made the first time a thread runs a piece of a product, which work stealing may
//! hand to a thread in any step.

use nanogpt::kernels::bf16::Backend;
use nanogpt::model::Dtype;
use nanogpt::model::{Gpt, ModelConfig};
use nanogpt::optim::{clip_grad_norm, AdamW};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

struct Counting;

static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);
static LARGEST: AtomicUsize = AtomicUsize::new(0);

fn count(layout: Layout) {
    ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
    LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
}

// SAFETY: forwards every call unchanged to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout);
        System.alloc(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(layout);
        System.alloc_zeroed(layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(Layout::from_size_align(new_size, layout.align()).unwrap());
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn a_training_step_allocates_nothing_after_the_first() {
    // One test, both dtypes in turn: the counters are global, so a second test
    // running in parallel would disturb them.
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    pool.install(|| check(Dtype::Float32));
    pool.install(|| check(Dtype::Bfloat16));
}

fn check(dtype: Dtype) {
    let cfg = ModelConfig {
        vocab_size: 500,
        block_size: 64,
        n_layer: 2,
        n_head: 4,
        n_embd: 128,
        bias: true,
        dropout: 0.1,
        llama: None,
    };
    let (b, t) = (4, 64);
    let mut gpt = Gpt::new(cfg, b, t).unwrap();
    gpt.init_gpt2(1);
    gpt.set_dtype(dtype, &Backend::detect(None));
    let mut opt = AdamW::new(&gpt.layout.decay_ranges(), Default::default());
    let inputs: Vec<u32> = (0..b * t).map(|i| (i * 37 % 500) as u32).collect();
    let targets: Vec<i32> = (0..b * t).map(|i| (i * 53 % 500) as i32).collect();
    let mut step = |gpt: &mut Gpt| {
        gpt.zero_grad();
        for _ in 0..2 {
            gpt.forward(&inputs, &targets, b, t);
            gpt.backward();
        }
        clip_grad_norm(&mut gpt.grads, 1.0);
        opt.step(&mut gpt.params, &gpt.grads, 1e-3);
        gpt.sync_bf16_weights();
    };
    step(&mut gpt);
    step(&mut gpt);
    let warm_step = |gpt: &mut Gpt, step: &mut dyn FnMut(&mut Gpt)| {
        LARGEST.store(0, Ordering::SeqCst);
        let before = ALLOCATIONS.load(Ordering::SeqCst);
        step(gpt);
        (
            ALLOCATIONS.load(Ordering::SeqCst) - before,
            LARGEST.load(Ordering::SeqCst),
        )
    };
    let (count1, largest1) = warm_step(&mut gpt, &mut step);
    let (count2, largest2) = warm_step(&mut gpt, &mut step);
    println!("{dtype:?} warm step: {count1} allocations, largest {largest1} bytes");
    // Steady state: the same allocations every step, none of them growing.
    assert_eq!(count1, count2, "{count1} then {count2} allocations");
    assert_eq!(largest1, largest2, "the largest allocation changed");
    // And all are packing-sized (bounded by the caches), never a fresh arena.
    let packing_bound = 8 << 20;
    assert!(
        largest1 <= packing_bound,
        "a {largest1}-byte allocation in a warm step"
    );
}
