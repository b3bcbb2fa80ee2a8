//! Data parallelism across processes: the [`Collective`] operations training needs,
//! a single-process backend ([`Single`], the default build) and an MPI backend
//! (`mpi` cargo feature), launched the ordinary MPI way:
//!
//! ```text
//! mpirun -f hosts -n 3 -ppn 1 nanogpt train CONFIG.toml       # MPICH, Intel MPI
//! mpirun --hostfile hosts -n 3 --map-by node nanogpt train ...  # Open MPI
//! srun -N 3 --ntasks-per-node 1 nanogpt train ...               # Slurm
//! ```
//!
//! Rank and world size come from MPI. [`DataParallel`] holds what a training run
//! needs on top: the gradient buckets, the buffers of the overlapped all-reduce and
//! of ZeRO-1, and the communication timings.

pub mod checkin;
pub mod heartbeat;
pub mod identity;
pub mod launcher;
mod parallel;
mod plan;
pub mod preflight;
mod reduce_check;
pub mod route;
// Used by the MPI transport only; its tests run in every build.
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
mod startup;
mod update;
mod watchdog;
mod wire;

#[cfg(feature = "mpi")]
mod mpi;
#[cfg(feature = "mpi")]
mod ring;

/// What backward tells a reduction driving it ([`BackwardFn`]).
pub use crate::model::Reported;
pub use parallel::{save_buffer_len, CommReport, DataParallel};
pub use plan::{ring_scratch_len, Bucket, GradPlan, RINGS_IN_FLIGHT, STAGE3_REDUCTIONS_IN_FLIGHT};
pub use reduce_check::check_reductions;
pub use update::{clip_and_step, StepSettings, Update};
pub use watchdog::{leave_if_stuck, Watchdog};

use crate::model::Dtype;
use anyhow::Result;
use checkin::Checkin;
use std::ops::Range;
use std::sync::OnceLock;
use std::time::Duration;

/// What an overlapped gradient reduction does with each bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduce {
    /// Every rank receives the sum of the bucket (ZeRO stage 0).
    AllReduce,
    /// Rank `r` receives the sum of the `r`-th of `world_size` equal blocks of the
    /// bucket (ZeRO stage 1).
    ReduceScatter,
    /// Rank `r` receives the sum of its piece of the bucket ([`Bucket::counts`]),
    /// read straight from the gradients: no send buffer (ZeRO stages 2 and 3).
    ReducePieces,
    /// [`Reduce::AllReduce`] with bf16 on the wire (`grad_reduce_dtype =
    /// "bfloat16"`): each rank's gradients rounded to bf16 (to nearest, ties to
    /// even) into the send buffer, every partial sum of the reduction computed in f32
    /// from two bf16 values and rounded to bf16, the result widened back to f32.
    AllReduceBf16,
    /// [`Reduce::ReduceScatter`] with bf16 on the wire, as [`Reduce::AllReduceBf16`].
    ReduceScatterBf16,
}

impl Reduce {
    /// The reduction of ZeRO stage `stage` with `wire` values on the wire (bf16:
    /// stages 0 and 1 only).
    pub fn of_stage(stage: u8, wire: Dtype) -> Reduce {
        let kind = match stage {
            0 => Reduce::AllReduce,
            1 => Reduce::ReduceScatter,
            _ => Reduce::ReducePieces,
        };
        match wire {
            Dtype::Bfloat16 => kind.in_bf16(),
            _ => kind,
        }
    }

    /// Whether it reads the reported gradients themselves, with no send buffer:
    /// the reductions by pieces (stages 2 and 3), and with our `ring` ZeRO-0's f32
    /// all-reduce.
    pub fn reads_gradients(self, ring: bool) -> bool {
        matches!(
            (self, ring),
            (Reduce::ReducePieces, _) | (Reduce::AllReduce, true)
        )
    }

    /// The same reduction with bf16 on the wire (stages 0 and 1 only).
    pub fn in_bf16(self) -> Reduce {
        match self {
            Reduce::AllReduce | Reduce::AllReduceBf16 => Reduce::AllReduceBf16,
            Reduce::ReduceScatter | Reduce::ReduceScatterBf16 => Reduce::ReduceScatterBf16,
            Reduce::ReducePieces => panic!("bf16 reduction needs a send buffer (ZeRO 0 or 1)"),
        }
    }

    /// Bytes per gradient value on the wire.
    pub fn wire_bytes(self) -> usize {
        match self {
            Reduce::AllReduceBf16 | Reduce::ReduceScatterBf16 => 2,
            _ => 4,
        }
    }
}

/// The backward pass as [`Collective::reduce_during_backward`] drives it: called
/// once, it runs backward and tells the hook [`Reported::Final`] for each bucket as
/// soon as that bucket's gradients are final, and [`Reported::Midway`] halfway
/// through each block, where the reductions in flight can move on (see
/// `Gpt::backward_reporting`).
pub type BackwardFn<'f> = dyn FnMut(&mut dyn FnMut(Reported)) + 'f;

/// Timings of one overlapped reduction.
#[derive(Clone, Copy, Debug, Default)]
pub struct OverlapTimes {
    /// Waiting for the reductions after backward returned: the part of the
    /// communication that computation did not hide.
    pub exposed: Duration,
}

/// A non-blocking collective in flight (see [`Collective::start_all_gather_in_place`]);
/// its buffers are the caller's until [`Pending::wait`] returns.
pub trait Pending {
    /// Blocks until the collective has completed on this rank.
    fn wait(self: Box<Self>);
}

/// One all-gather of [`Collective::start_all_gathers`]: this rank's piece at `from`
/// of the send buffer, every rank's piece (`counts`, in rank order) into `into` of
/// the receive buffer.
#[derive(Clone, Debug)]
pub struct GatherPart<'p> {
    pub from: Range<usize>,
    pub into: Range<usize>,
    pub counts: &'p [usize],
}

/// A collective that completed when it started ([`Single`]'s).
struct Completed;
impl Pending for Completed {
    fn wait(self: Box<Self>) {}
}

/// The collective operations of data-parallel training, over all ranks of the job.
/// Every rank must make the same calls in the same order. Buffers are `f32` unless
/// named otherwise; sums are element-wise.
pub trait Collective {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// Ranks on this host (sharing its cores).
    fn local_size(&self) -> usize;
    /// This host's name, for messages.
    fn host(&self) -> String;
    /// Every rank's host, in rank order.
    fn hosts(&self) -> Vec<String> {
        vec![self.host()]
    }
    /// The backend's name and version, for the log.
    fn describe(&self) -> String;
    /// How the ZeRO 1-3 gradient reductions run, for messages.
    fn reduction_name(&self) -> &'static str {
        "a copy (one process)"
    }
    /// Abort the job when a collective makes no progress for this long (0: never).
    fn set_timeout(&self, timeout: Duration);
    /// Waits for every rank, patiently: for phases where one rank may legitimately
    /// work for long (preparing data, loading a model) while the others wait.
    fn barrier_patient(&self);
    /// Sums a few `f64` values across ranks, in place.
    fn all_reduce_sum_f64(&self, values: &mut [f64]);
    /// Copies `root`'s `buf` to every rank.
    fn broadcast(&self, buf: &mut [f32], root: usize);
    /// Copies `root`'s bytes (any length) to every rank.
    fn broadcast_bytes(&self, buf: &mut Vec<u8>, root: usize);
    /// `recv` (len n · world_size) = every rank's `send` (len n), in rank order.
    fn all_gather(&self, send: &[f32], recv: &mut [f32]);
    fn all_gather_u64(&self, value: u64) -> Vec<u64>;
    /// On `root`, `recv` (len n · world_size) = every rank's `send` (len n), in rank
    /// order; elsewhere `recv` is not used (pass an empty slice).
    fn gather(&self, send: &[f32], recv: &mut [f32], root: usize);
    /// Block `rank` of `root`'s `send` (len n · world_size) into `recv` (len n);
    /// `send` is only read on `root`.
    fn scatter(&self, send: &[f32], recv: &mut [f32], root: usize);
    /// `mine` (len `counts[rank]`) = this rank's piece of the sum over the ranks of
    /// `send` (len Σ counts, pieces in rank order): a reduce-scatter with per-rank
    /// counts.
    fn reduce_scatter_pieces(&self, send: &[f32], mine: &mut [f32], counts: &[usize]);
    /// `buf` (len Σ counts) = every rank's `mine` (len `counts[rank]`), one after
    /// the other in rank order: an all-gather with per-rank counts.
    fn all_gather_pieces(&self, mine: &[f32], buf: &mut [f32], counts: &[usize]);
    /// On `root`, `buf` (len Σ counts) = every rank's `mine` in rank order;
    /// elsewhere `buf` is not used (pass an empty slice).
    fn gather_pieces(&self, mine: &[f32], buf: &mut [f32], counts: &[usize], root: usize);
    /// `mine` (len `counts[rank]`) = this rank's piece of `root`'s `buf` (len Σ
    /// counts, pieces in rank order); `buf` is only read on `root`.
    fn scatter_pieces(&self, buf: &[f32], mine: &mut [f32], counts: &[usize], root: usize);
    /// Starts [`Collective::all_gather_pieces`] in place and returns at once: `buf`
    /// (len Σ counts) holds this rank's piece at its place (after the lower ranks'
    /// pieces) and, once the returned collective has been waited for, every rank's.
    ///
    /// # Safety
    /// Until [`Pending::wait`] returns, nothing may read or write `buf` (MPI writes
    /// it meanwhile, although its borrow ends here), and its memory must stay
    /// allocated.
    /// (By default: blocking, done when it returns.)
    unsafe fn start_all_gather_in_place<'a>(
        &'a self,
        buf: &mut [f32],
        counts: &[usize],
    ) -> Box<dyn Pending + 'a> {
        let at: usize = counts[..self.rank()].iter().sum();
        let mine = buf[at..at + counts[self.rank()]].to_vec();
        self.all_gather_pieces(&mine, buf, counts);
        Box::new(Completed)
    }
    /// Starts one [`Collective::all_gather_pieces`] per part, in the order given, and
    /// returns at once with their collectives in that order: part `k` gathers this
    /// rank's piece `send[parts[k].from]` (`counts[rank]` floats) and every rank's,
    /// in rank order, into `recv[parts[k].into]` (Σ counts floats). Wait for them in
    /// the order given: a backend may drive them all from one helper that lives as
    /// long as the last.
    ///
    /// # Safety
    /// Until a part's collective has been waited for, `send[from]` must not be
    /// written and `recv[into]` neither read nor written (their borrows end here),
    /// and both must stay allocated.
    /// (By default: blocking, each done when this returns.)
    unsafe fn start_all_gathers<'a>(
        &'a self,
        send: &[f32],
        recv: &mut [f32],
        parts: &[GatherPart],
    ) -> Vec<Box<dyn Pending + 'a>> {
        parts
            .iter()
            .map(|p| {
                self.all_gather_pieces(&send[p.from.clone()], &mut recv[p.into.clone()], p.counts);
                Box::new(Completed) as Box<dyn Pending + 'a>
            })
            .collect()
    }
    /// Starts [`Collective::reduce_scatter_pieces`] and returns at once; `mine`
    /// holds this rank's piece of the sum once the returned collective has been
    /// waited for.
    ///
    /// # Safety
    /// Until [`Pending::wait`] returns, `send` must not be written and `mine`
    /// neither read nor written (their borrows end here), and both must stay
    /// allocated.
    /// (By default: blocking, done when it returns.)
    unsafe fn start_reduce_scatter_pieces<'a>(
        &'a self,
        send: &[f32],
        mine: &mut [f32],
        counts: &[usize],
    ) -> Box<dyn Pending + 'a> {
        self.reduce_scatter_pieces(send, mine, counts);
        Box::new(Completed)
    }
    /// Runs `backward`, reducing each bucket as soon as it is reported (in any
    /// order, each once): its
    /// gradients are copied to the start of `send[bucket.send]` (the rest of that
    /// range is zeroed) and a non-blocking reduction into `recv[bucket.recv]` starts
    /// at once ([`Reduce::ReducePieces`]: straight from the reported gradients into
    /// the first `counts[rank]` floats of `recv[bucket.recv]`, `send` unused; the
    /// reported range must not change until this returns). Returns when every
    /// reduction has completed.
    fn reduce_during_backward(
        &self,
        kind: Reduce,
        buckets: &[Bucket],
        send: &mut [f32],
        recv: &mut [f32],
        backward: &mut BackwardFn,
    ) -> OverlapTimes;
}

/// The index of the bucket whose arena range backward has just reported, marked
/// seen. Backward may report the buckets in another order than the plan's (the
/// embeddings first: `Gpt::backward_reporting`); every rank reports them in
/// the same order, so the collectives still start in the same order everywhere.
fn reported(buckets: &[Bucket], range: &Range<usize>, seen: &mut [bool]) -> usize {
    let i = buckets.iter().position(|b| b.arena == *range);
    let i = i.expect("backward reports the plan's buckets");
    assert!(!seen[i], "bucket {range:?} reported twice");
    seen[i] = true;
    i
}

/// The methods of a unit test's stub [`Collective`] that move no data for it (they
/// do nothing) or that its tests never reach, for the stub's `impl Collective`; the
/// stub writes the rest (who it is, and the collectives its test looks at).
#[cfg(test)]
macro_rules! quiet_collective_methods {
    () => {
        fn host(&self) -> String {
            String::new()
        }
        fn describe(&self) -> String {
            String::new()
        }
        fn set_timeout(&self, _: std::time::Duration) {}
        fn barrier_patient(&self) {}
        fn all_reduce_sum_f64(&self, _: &mut [f64]) {}
        fn broadcast(&self, _: &mut [f32], _: usize) {}
        fn broadcast_bytes(&self, _: &mut Vec<u8>, _: usize) {}
        fn all_gather(&self, _: &[f32], _: &mut [f32]) {}
        fn all_gather_u64(&self, _: u64) -> Vec<u64> {
            unreachable!("a stub collective")
        }
        fn gather(&self, _: &[f32], _: &mut [f32], _: usize) {}
        fn scatter(&self, _: &[f32], _: &mut [f32], _: usize) {}
        fn gather_pieces(&self, _: &[f32], _: &mut [f32], _: &[usize], _: usize) {}
        fn scatter_pieces(&self, _: &[f32], _: &mut [f32], _: &[usize], _: usize) {}
        fn reduce_during_backward(
            &self,
            _: $crate::dist::Reduce,
            _: &[$crate::dist::Bucket],
            _: &mut [f32],
            _: &mut [f32],
            _: &mut $crate::dist::BackwardFn,
        ) -> $crate::dist::OverlapTimes {
            unreachable!("a stub collective")
        }
    };
}
#[cfg(test)]
pub(crate) use quiet_collective_methods;

/// One process: every collective is a copy or nothing.
#[derive(Clone, Copy, Debug, Default)]
pub struct Single;

impl Collective for Single {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn local_size(&self) -> usize {
        1
    }
    fn host(&self) -> String {
        "localhost".into()
    }
    fn describe(&self) -> String {
        "single process".into()
    }
    fn set_timeout(&self, _: Duration) {}
    fn barrier_patient(&self) {}
    fn all_reduce_sum_f64(&self, _: &mut [f64]) {}
    fn broadcast(&self, _: &mut [f32], _: usize) {}
    fn broadcast_bytes(&self, _: &mut Vec<u8>, _: usize) {}
    fn all_gather(&self, send: &[f32], recv: &mut [f32]) {
        recv.copy_from_slice(send);
    }
    fn all_gather_u64(&self, value: u64) -> Vec<u64> {
        vec![value]
    }
    fn gather(&self, send: &[f32], recv: &mut [f32], _: usize) {
        recv.copy_from_slice(send);
    }
    fn scatter(&self, send: &[f32], recv: &mut [f32], _: usize) {
        recv.copy_from_slice(send);
    }
    fn reduce_scatter_pieces(&self, send: &[f32], mine: &mut [f32], _: &[usize]) {
        mine.copy_from_slice(send);
    }
    fn all_gather_pieces(&self, mine: &[f32], buf: &mut [f32], _: &[usize]) {
        buf.copy_from_slice(mine);
    }
    fn gather_pieces(&self, mine: &[f32], buf: &mut [f32], _: &[usize], _: usize) {
        buf.copy_from_slice(mine);
    }
    fn scatter_pieces(&self, buf: &[f32], mine: &mut [f32], _: &[usize], _: usize) {
        mine.copy_from_slice(buf);
    }
    fn reduce_during_backward(
        &self,
        kind: Reduce,
        buckets: &[Bucket],
        _: &mut [f32],
        recv: &mut [f32],
        backward: &mut BackwardFn,
    ) -> OverlapTimes {
        let mut seen = vec![false; buckets.len()];
        backward(&mut |report| {
            let Reported::Final(range, grads) = report else {
                return; // nothing in flight
            };
            let b = &buckets[reported(buckets, &range, &mut seen)];
            let dst = &mut recv[b.recv.start..b.recv.start + range.len()];
            match kind.wire_bytes() {
                2 => crate::kernels::bf16::round_into(dst, &grads[range]),
                _ => dst.copy_from_slice(&grads[range]),
            }
        });
        assert!(seen.iter().all(|&s| s), "every bucket reported");
        OverlapTimes::default()
    }
}

/// Rank 0's outcome on every rank (collective): `outcome` is rank 0's (None
/// elsewhere). Its value stays where it is (`Some` on rank 0, `None` elsewhere);
/// its error, as one line, becomes every rank's error, rank 0's included.
pub fn root_outcome<T>(comm: &dyn Collective, outcome: Option<Result<T>>) -> Result<Option<T>> {
    let (value, mut status) = match outcome {
        Some(Ok(value)) => (Some(value), vec![0u8]),
        Some(Err(e)) => (None, [&[1u8][..], format!("{e:#}").as_bytes()].concat()),
        None => (None, Vec::new()),
    };
    comm.broadcast_bytes(&mut status, 0);
    match status.split_first() {
        Some((0, _)) => Ok(value),
        Some((_, error)) => anyhow::bail!("{}", String::from_utf8_lossy(error)),
        None => anyhow::bail!("internal error: nothing from rank 0"),
    }
}

/// Whether ZeRO 1-3 reduce gradients with our ring reduce-scatter (the default)
/// rather than MPI's collective (`NANOGPT_RING_REDUCE=0`, for A/B measurements:
/// [`crate::tuning`]).
pub fn ring_reduce() -> bool {
    crate::tuning::get().ring_reduce
}

/// The job this process belongs to, once [`init`] has run.
#[derive(Clone, Debug)]
pub struct JobInfo {
    pub rank: usize,
    pub world_size: usize,
    pub host: String,
}

static JOB: OnceLock<JobInfo> = OnceLock::new();

/// This process's place in the job, if [`init`] ran.
pub fn job() -> Option<&'static JobInfo> {
    JOB.get()
}

/// The collective for this process: MPI's world when launched by an MPI launcher
/// (mpirun, mpiexec, srun) and built with the `mpi` feature, else [`Single`].
/// Launched as several processes without MPI support, it refuses (each process
/// would otherwise train alone and overwrite the others' files).
pub fn init() -> Result<Box<dyn Collective>> {
    let comm = init_backend()?;
    let _ = JOB.set(JobInfo {
        rank: comm.rank(),
        world_size: comm.world_size(),
        host: comm.host(),
    });
    Ok(comm)
}

#[cfg(feature = "mpi")]
fn init_backend() -> Result<Box<dyn Collective>> {
    if !launched_by_mpi() {
        return Ok(Box::new(Single));
    }
    // Check in with the job's hub (`launch`, or rank 0), then refuse the other MPI's
    // launcher before MPI starts: it would make this process a job of one. What MPI
    // then sees is compared with the launcher's count too.
    let started = launcher::started();
    let checkin = std::sync::Arc::new(started.as_ref().map_or_else(Checkin::none, Checkin::start));
    let version = mpi::library_version();
    if let Some(started) = &started {
        if let Err(why) = launcher::check_library(started, &version) {
            checkin.fail(&why);
            anyhow::bail!(why);
        }
    }
    let comm = mpi::Mpi::init(checkin, started.as_ref().and_then(|s| s.rank))?;
    if let Some(started) = &started {
        launcher::check_world_size(started, comm.world_size(), &version)
            .map_err(anyhow::Error::msg)?;
    }
    Ok(Box::new(comm))
}

#[cfg(not(feature = "mpi"))]
fn init_backend() -> Result<Box<dyn Collective>> {
    let started = launcher::started().filter(|_| launched_by_mpi());
    if let Some(started) = started.filter(|s| s.size.is_some_and(|n| n > 1)) {
        let why = format!(
            "host {}: started as one of {} processes (mpirun/srun), but this nanogpt was \
             built without MPI support, so each process would train alone; rebuild it on this \
             host with `cargo build --release --features mpi` (see docs/multinode.md)",
            this_host(),
            started.size.unwrap_or(0)
        );
        Checkin::start(&started).fail(&why);
        anyhow::bail!(why);
    }
    Ok(Box::new(Single))
}

/// The linked MPI library's `MPI_Get_library_version` (MPI need not be started).
#[cfg(feature = "mpi")]
pub fn mpi_library_version() -> String {
    mpi::library_version()
}

/// This machine's host name (as `hostname` prints it), or `?`.
pub fn this_host() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "?".into())
}

/// Environment variables that MPI launchers set in every process they start.
const LAUNCHER_VARS: [&str; 6] = [
    "OMPI_COMM_WORLD_SIZE", // Open MPI
    "PMI_SIZE",             // MPICH (Hydra), Intel MPI, srun --mpi=pmi2
    "PMI_RANK",
    "PMIX_RANK", // PMIx: Open MPI 5, srun --mpi=pmix
    "MPI_LOCALNRANKS",
    "SLURM_STEP_NUM_TASKS", // inside an srun step
];

/// Whether this process was started by an MPI launcher. `NANOGPT_MPI=0` or `1`
/// overrides the guess.
pub fn launched_by_mpi() -> bool {
    if let Some(said) = crate::tuning::env::get().mpi {
        return said;
    }
    LAUNCHER_VARS.iter().any(|v| std::env::var_os(v).is_some())
}

/// Ends the process after an error: alone, prints `error: ...` and exits 1; in a
/// job of several ranks, names the rank and host and aborts the whole job
/// (`MPI_Abort`), so no other rank is left waiting.
pub fn fail(err: &anyhow::Error) -> ! {
    match job() {
        Some(job) if job.world_size > 1 => {
            crate::errln!(
                "error: rank {} of {} (host {}): {err:#}",
                job.rank,
                job.world_size,
                job.host
            );
            abort_job(1)
        }
        _ => {
            crate::errln!("error: {err:#}");
            std::process::exit(1)
        }
    }
}

/// Aborts every rank of the job (or this process, without MPI).
pub fn abort_job(code: i32) -> ! {
    heartbeat::aborting();
    #[cfg(feature = "mpi")]
    mpi::abort_world(code);
    #[allow(unreachable_code)]
    std::process::exit(code)
}

/// Shuts MPI down after a run that ends with `code` (a no-op without MPI); should
/// that hang, the process still leaves with `code`. Call once, after every
/// [`Collective`] has been dropped.
pub fn finish(code: i32) {
    heartbeat::bye();
    #[cfg(feature = "mpi")]
    mpi::finalize(code);
    #[cfg(not(feature = "mpi"))]
    let _ = code;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_reduce_during_backward_copies_each_bucket() {
        let grads: Vec<f32> = (0..10).map(|i| i as f32).collect();
        let plan = GradPlan::new(&[6..10, 2..6, 0..2], 10, 1, 0, 0);
        let mut recv = vec![0.0; plan.recv_len];
        let mut send = vec![0.0; plan.send_len];
        Single.reduce_during_backward(
            Reduce::AllReduce,
            &plan.buckets,
            &mut send,
            &mut recv,
            &mut |hook| {
                for r in [6..10, 2..6, 0..2] {
                    hook(Reported::Final(r, &grads));
                    hook(Reported::Midway);
                }
            },
        );
        assert_eq!(recv, grads);
    }
}
