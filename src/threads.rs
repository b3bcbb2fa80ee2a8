//! The one rayon thread pool every kernel runs on.

/// Sizes rayon's global pool: `threads = 0` means one thread per core. Call once,
/// before any kernel runs; later calls keep the first size and return it.
pub fn init_pool(threads: usize) -> usize {
    let n = if threads == 0 {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        threads
    };
    // An error only means the pool was already built (by an earlier call or by a
    // kernel that ran first); the pool that exists is the one in use.
    let _ = rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build_global();
    rayon::current_num_threads()
}
