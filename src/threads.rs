//! Threads and cores: the one rayon thread pool every kernel runs on, sized from
//! the cores this process may run on and shared among the ranks on its host.

/// The most threads per usable core a run may ask for. More only adds switching
/// (and thousands of threads take minutes to start): it is refused, with the number
/// that works.
pub const MAX_THREADS_PER_CORE: usize = 4;

/// Sizes rayon's global pool to `threads`, or with `threads = 0` to this process's
/// share of the cores: the cores it may run on divided by `local_ranks` (the ranks
/// on this host; 1 for a single process), at least one. Call once, before any
/// kernel runs; later calls keep the first size and return it. Refuses more than
/// [`MAX_THREADS_PER_CORE`] threads per usable core.
pub fn init_pool(threads: usize, local_ranks: usize) -> anyhow::Result<usize> {
    let cores = usable_cores();
    let most = MAX_THREADS_PER_CORE * cores;
    if threads > most {
        anyhow::bail!(
            "threads = {threads} is more than this machine can use ({cores} cores here, at \
             most {most} threads); set threads=0 (one per core) or a number up to {most}"
        );
    }
    let n = match threads {
        0 => default_threads(local_ranks),
        n => n,
    };
    // An error only means the pool was already built (by an earlier call or by a
    // kernel that ran first); the pool that exists is the one in use.
    let _ = rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build_global();
    Ok(rayon::current_num_threads())
}

/// A warning when the launcher pinned this rank to fewer cores than its share of
/// the host (Open MPI binds each rank to one core when it starts two or fewer).
pub fn binding_warning(local_ranks: usize) -> Option<String> {
    let usable = std::thread::available_parallelism().ok()?.get();
    let share = host_cores()? / local_ranks.max(1);
    (usable < share).then(|| {
        format!(
            "this rank may only run on {usable} of its {share} cores (the MPI launcher bound \
             it to them); with Open MPI add `--bind-to none`, or set `threads` and the \
             launcher's binding to match"
        )
    })
}

/// Worker threads for `threads = 0`: the usable cores shared among `local_ranks`.
fn default_threads(local_ranks: usize) -> usize {
    (usable_cores() / local_ranks.max(1)).max(1)
}

/// The cores this process may run on (its CPU affinity), at least one.
fn usable_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The host's online cores (`/sys/devices/system/cpu/online`), if known.
pub fn host_cores() -> Option<usize> {
    let text = std::fs::read_to_string("/sys/devices/system/cpu/online").ok()?;
    parse_cpu_list(text.trim())
}

/// Counts the CPUs of a Linux CPU list such as `0-3,8,10-11`.
fn parse_cpu_list(list: &str) -> Option<usize> {
    let mut n = 0;
    for part in list.split(',').filter(|p| !p.is_empty()) {
        n += match part.split_once('-') {
            Some((a, b)) => (b.parse::<usize>().ok()? + 1).checked_sub(a.parse().ok()?)?,
            None => part.parse::<usize>().map(|_| 1).ok()?,
        };
    }
    Some(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_are_counted() {
        assert_eq!(parse_cpu_list("0-3,8,10-11"), Some(7));
        assert_eq!(parse_cpu_list("0"), Some(1));
        assert_eq!(parse_cpu_list("x"), None);
        assert_eq!(parse_cpu_list("3-1"), None);
    }

    #[test]
    fn default_threads_share_the_cores() {
        let cores = usable_cores();
        assert_eq!(default_threads(1), cores);
        assert_eq!(default_threads(cores * 4), 1);
    }
}
