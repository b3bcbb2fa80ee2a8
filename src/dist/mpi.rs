//! The MPI backend (cargo feature `mpi`): MPI's world communicator through the `mpi`
//! crate (rsmpi), over Open MPI, MPICH or Intel MPI.
//!
//! The thread that initialised MPI makes every call, the rayon workers none, with
//! two exceptions: `MPI_Abort` from the watchdog thread or a panic hook (which ends
//! the job anyway), and a progress thread that pokes MPI while backward computes, so
//! the per-layer reductions move (MPI moves data only inside MPI calls). The
//! progress thread needs `MPI_THREAD_MULTIPLE` and runs when some ranks are on other
//! hosts (`NANOGPT_PROGRESS_THREAD=0|1` overrides); otherwise progress is made
//! between layers only. ZeRO-3's gathers and reductions in flight have such a thread
//! each, on one host too (`NANOGPT_PROGRESS_THREAD=0` turns it off), and ZeRO-1/2's
//! all-gathers of the updated weights one for the whole group.

use super::checkin::Checkin;
use super::ring::{Element, Ring, Rings, Shape};
use super::startup::Timer;
use super::{heartbeat, Reported, Watchdog};
use super::{BackwardFn, Bucket, Collective, GatherPart, OverlapTimes, Pending, Reduce};
use crate::kernels::bf16::Bf16;
use anyhow::{bail, Result};
use mpi::collective::{CommunicatorCollectives, Root, SystemOperation};
use mpi::datatype::{Partition, PartitionMut};
use mpi::environment::Universe;
use mpi::raw::AsRaw;
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::Threading;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// MPI stays initialised from [`Mpi::init`] until [`finalize`]: errors are
/// reported (and the job aborted) while it is still up.
static UNIVERSE: Mutex<Option<Universe>> = Mutex::new(None);

/// Whether some ranks run on other hosts than this one (see [`finalize`]).
static SPANS_HOSTS: AtomicBool = AtomicBool::new(false);

/// The MPI world as a [`Collective`].
pub struct Mpi {
    world: SimpleCommunicator,
    rank: usize,
    size: usize,
    local: usize,
    host: String,
    /// Every rank's host, in rank order.
    hosts: Vec<String>,
    watchdog: Watchdog,
    /// Start each bucket's reduction during backward (default); `NANOGPT_OVERLAP=0`
    /// waits for each at once instead, to measure what overlapping saves.
    overlap: bool,
    /// Drive MPI's progress from a second thread during backward.
    progress_thread: bool,
    /// Drive MPI's progress from a second thread while a collective started by
    /// `start_*` (ZeRO-3's) is in flight.
    progress_in_flight: bool,
    /// The sum of bf16 values (`MPI_UINT16_T`) as a user operation ([`bf16_sum`]).
    bf16_sum: mpi::ffi::MPI_Op,
    /// ZeRO 1-3 reduce gradients with our ring ([`super::ring`]; default) rather
    /// than MPI's reduce-scatter (`NANOGPT_RING_REDUCE=0`).
    ring: bool,
    /// The rings' own communicator (a duplicate of the world: their tags meet no
    /// other message), and the number of rings started so far, whose remainder
    /// modulo [`RING_TAGS`] tags the next one's messages.
    ring_comm: RawComm,
    rings_started: AtomicU32,
}

/// Tags of ring messages, one per ring in flight (MPI guarantees tags up to 32767).
const RING_TAGS: u32 = 32768;

impl Mpi {
    /// Starts `MPI_Iallgatherv` of `mine` (this rank's piece) into `all`, pieces
    /// placed by `arrays` (counts and displacements), and returns its request.
    ///
    /// # Safety
    /// Until the request completes, `mine` must stay allocated and unchanged, `all`
    /// allocated and neither read nor written, and `arrays` allocated.
    unsafe fn iallgatherv(
        &self,
        mine: &[f32],
        all: &mut [f32],
        arrays: &(Vec<mpi::Count>, Vec<mpi::Count>),
    ) -> mpi::ffi::MPI_Request {
        let mut request = std::mem::MaybeUninit::uninit();
        // SAFETY: the buffers and arrays are valid for the lengths given (the
        // caller's promise covers their life until the request completes).
        unsafe {
            mpi::ffi::MPI_Iallgatherv(
                mine.as_ptr() as *const _,
                count(mine.len()) as i32,
                mpi::ffi::RSMPI_FLOAT,
                all.as_mut_ptr() as *mut _,
                arrays.0.as_ptr(),
                arrays.1.as_ptr(),
                mpi::ffi::RSMPI_FLOAT,
                self.world.as_raw(),
                request.as_mut_ptr(),
            );
            request.assume_init()
        }
    }

    /// `MPI_Init_thread`, then the rank, world size, ranks on this host, every
    /// rank's host and build, and the heartbeat's port, all under the start-up timer
    /// ([`super::startup`]), which asks `checkin`'s hub who never started; `rank`
    /// is this process's rank as the launcher said.
    pub fn init(checkin: Arc<Checkin>, rank: Option<usize>) -> Result<Mpi> {
        let timer = Timer::start(Arc::clone(&checkin), rank, abort_world);
        let Some((universe, threading)) = mpi::initialize_with_threading(Threading::Multiple)
        else {
            bail!("MPI was already initialised in this process");
        };
        let world = universe.world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        // Ranks sharing memory with this one: the ranks on this host.
        let local = world.split_shared(world.rank()).size() as usize;
        SPANS_HOSTS.store(local < size, Ordering::SeqCst);
        let host = mpi::environment::processor_name().unwrap_or_else(|_| "?".into());
        let hosts = all_gather_names(&world, &host);
        let builds = all_gather_names(&world, super::identity::build_hash());
        // Rank 0's heartbeat port, told to every rank (see `super::heartbeat`).
        let beat_host = (rank == 0 && size > 1).then(heartbeat::listen).flatten();
        let invitation = beat_host.as_ref().map(|h| h.invitation.encode());
        let invitation = broadcast_text(&world, invitation.unwrap_or_default());
        // A second communicator, for the watchdog thread's messages only; never
        // freed (leaked), so its handle stays valid for the whole process.
        let diag = RawComm(Box::leak(Box::new(world.duplicate())).as_raw());
        // The rings' communicator, likewise never freed.
        let ring_comm = RawComm(Box::leak(Box::new(world.duplicate())).as_raw());
        timer.done();
        checkin.up();
        *UNIVERSE.lock().unwrap_or_else(|e| e.into_inner()) = Some(universe);
        let who = format!("rank {rank} of {size} (host {host})");
        // Every rank says the whole reason: a launcher that ends the job when the
        // first process fails (Open MPI's) may kill rank 0 before it prints.
        if let Some(why) = other_builds(&hosts, &builds) {
            bail!("{who}: refusing to start: {why}");
        }
        if size > 1 {
            let invitation = super::wire::Invitation::decode(&invitation);
            heartbeat::start(rank, hosts.clone(), beat_host, invitation, |msg| {
                crate::errln!("error: {msg}");
                abort_world(5);
            });
        }
        if size > 1 {
            let_the_heartbeat_speak_before_an_abort();
            // A panic on one rank must not leave the others waiting for it.
            let prev = std::panic::take_hook();
            std::panic::set_hook(Box::new(move |info| {
                prev(info);
                abort_world(101);
            }));
        }
        let multiple = threading == Threading::Multiple;
        let peers = hosts.clone();
        let watchdog = Watchdog::new(who, move |msg| {
            let missing = match multiple {
                true => Some(unanswered_peers(&diag, rank, size)),
                false => None,
            };
            crate::errln!(
                "error: {msg}: {}; aborting the job",
                diagnose(missing, &peers)
            );
            abort_world(3);
        });
        let mut op = std::mem::MaybeUninit::uninit();
        // SAFETY: MPI is initialised; `bf16_sum` has MPI_User_function's signature and
        // is commutative; the operation is never freed (it lives as long as MPI).
        let bf16_sum = unsafe {
            mpi::ffi::MPI_Op_create(Some(bf16_sum), 1, op.as_mut_ptr());
            op.assume_init()
        };
        Ok(Mpi {
            bf16_sum,
            ring: super::ring_reduce(),
            ring_comm,
            rings_started: AtomicU32::new(0),
            world,
            rank,
            size,
            local,
            host,
            hosts,
            watchdog,
            overlap: crate::tuning::get().overlap,
            // Across hosts the network moves data by itself once MPI has been poked;
            // within a host (shared memory) the copies are the CPU's work anyway and
            // the extra thread only costs (measured).
            progress_thread: multiple
                && crate::tuning::get().progress_thread.unwrap_or(local < size),
            // ZeRO-3 waits for a gather at every block: without a thread, a rank
            // computing a block answers none of its peers' messages until its next
            // MPI call, so the ranks step in lock-step, block by block. On one host
            // too, the thread made stage 3 faster (measured, docs/PERFORMANCE.md).
            progress_in_flight: multiple && crate::tuning::get().progress_thread != Some(false),
        })
    }

    fn root(&self, root: usize) -> mpi::topology::Process<'_> {
        self.world.process_at_rank(root as i32)
    }

    /// The tag of the next ring on the rings' communicator. Every rank starts the
    /// same rings in the same order, so the ranks of one ring share its tag, and
    /// fewer than [`RING_TAGS`] rings are ever in flight at once (a pass has one
    /// per bucket): no other message in flight on `ring_comm` carries it.
    fn next_tag(&self) -> i32 {
        (self.rings_started.fetch_add(1, Ordering::Relaxed) % RING_TAGS) as i32
    }

    /// A ring reduction of `shape` of `data` (Σ `counts`) into `out` (`counts[rank]`
    /// for a reduce-scatter, Σ `counts` for an all-reduce), not yet begun, on the
    /// rings' communicator with the next tag.
    ///
    /// # Safety
    /// Every rank makes the same calls in the same order, and the buffers obey
    /// [`Ring::reduce`]'s contract until the ring is done.
    unsafe fn ring<T: Element>(
        &self,
        shape: Shape,
        counts: &[usize],
        data: &[T],
        out: &mut [T],
    ) -> Ring<T> {
        let (comm, rank, tag) = (self.ring_comm.0, self.rank, self.next_tag());
        // SAFETY: the tag is this ring's alone (`next_tag`); the buffers are the
        // caller's promise.
        unsafe { Ring::reduce(shape, comm, rank, tag, counts, data, out) }
    }

    /// A ring all-gather into `out` (Σ `counts`) of this rank's piece `mine` (or,
    /// with `None`, its piece already in `out`), not yet begun.
    ///
    /// # Safety
    /// As [`Mpi::ring`]'s, with [`Ring::all_gather`]'s contract.
    unsafe fn ring_all_gather(
        &self,
        counts: &[usize],
        mine: Option<&[f32]>,
        out: &mut [f32],
    ) -> Ring<f32> {
        let (comm, rank, tag) = (self.ring_comm.0, self.rank, self.next_tag());
        // SAFETY: as in `ring`.
        unsafe { Ring::all_gather(comm, rank, tag, counts, mine, out) }
    }

    /// [`Collective::reduce_during_backward`] with our rings: every [`Reduce`] kind
    /// (ZeRO-0's all-reduces cut each bucket in the pieces stage 1 would).
    fn ring_during_backward(
        &self,
        kind: Reduce,
        buckets: &[Bucket],
        send: &mut [f32],
        recv: &mut [f32],
        backward: &mut BackwardFn,
    ) -> OverlapTimes {
        let rank = self.rank;
        // Equal blocks of the padded send buffer (ZeRO-1), as
        // MPI_Reduce_scatter_block would reduce them.
        let blocks = |r: &[f32]| vec![r.len(); self.size];
        // Each maker's rings read and write the ranges handed to it: the bucket's
        // gradients (backward no longer writes a reported range) and its own send and
        // receive ranges, all borrowed by the caller until `rings_during_backward`
        // returns, after every ring is done, and touched by nothing else meanwhile.
        match kind {
            Reduce::ReducePieces => {
                let make = |b: &Bucket, grads: &[f32], _: &mut [f32], r: &mut [f32]| {
                    // SAFETY: the ranges live and stay untouched until the ring is done
                    // (above), and every rank starts the same rings in the same order.
                    unsafe {
                        self.ring(
                            Shape::ReduceScatter,
                            &b.counts,
                            grads,
                            &mut r[..b.counts[rank]],
                        )
                    }
                };
                self.rings_during_backward(kind, buckets, send, recv, backward, &make)
            }
            Reduce::ReduceScatterBf16 | Reduce::AllReduceBf16 => {
                let make = |b: &Bucket, grads: &[f32], s: &mut [f32], r: &mut [f32]| {
                    fill_send(kind, grads, s);
                    let (shape, counts) = match kind {
                        Reduce::AllReduceBf16 => (Shape::AllReduce, b.counts.clone()),
                        _ => (Shape::ReduceScatter, blocks(r)),
                    };
                    // The result, bf16 in the front of `r`, widened once all are done.
                    // SAFETY: as for the f32 rings.
                    unsafe { self.ring(shape, &counts, bf16_view(s), bf16_view(r)) }
                };
                let mut times =
                    self.rings_during_backward(kind, buckets, send, recv, backward, &make);
                let start = Instant::now();
                widen_results(kind, buckets, recv);
                times.exposed += start.elapsed();
                times
            }
            Reduce::AllReduce => {
                let make = |b: &Bucket, grads: &[f32], _: &mut [f32], r: &mut [f32]| {
                    // SAFETY: as for the rings by pieces.
                    unsafe { self.ring(Shape::AllReduce, &b.counts, grads, r) }
                };
                self.rings_during_backward(kind, buckets, send, recv, backward, &make)
            }
            Reduce::ReduceScatter => {
                let make = |_: &Bucket, grads: &[f32], s: &mut [f32], r: &mut [f32]| {
                    let counts = blocks(r);
                    fill_send(kind, grads, s);
                    // SAFETY: as for the rings by pieces.
                    unsafe { self.ring(Shape::ReduceScatter, &counts, s, r) }
                };
                self.rings_during_backward(kind, buckets, send, recv, backward, &make)
            }
        }
    }

    /// Runs `backward`, starting each bucket's ring as it is reported (`make` builds
    /// it from the bucket, its gradients and its send and receive ranges; an empty
    /// send range where it reads the gradients themselves) and moving every ring on
    /// at every later report (and by the progress thread, when it runs), at most
    /// [`super::RINGS_IN_FLIGHT`] at once where they hold scratch; then finishes
    /// them under the watchdog.
    #[allow(clippy::type_complexity)]
    fn rings_during_backward<T: Element>(
        &self,
        kind: Reduce,
        buckets: &[Bucket],
        send: &mut [f32],
        recv: &mut [f32],
        backward: &mut BackwardFn,
        make: &dyn Fn(&Bucket, &[f32], &mut [f32], &mut [f32]) -> Ring<T>,
    ) -> OverlapTimes {
        let (mut sends, mut recvs) = bucket_slices((kind, true), buckets, send, recv);
        // Rings without scratch (2 ranks) need no limit.
        let limit = match super::plan::ring_scratch_buffers(self.size) {
            0 => usize::MAX,
            _ => super::RINGS_IN_FLIGHT,
        };
        let rings = Mutex::new(Rings::new(limit));
        let lock = || rings.lock().unwrap_or_else(|e| e.into_inner());
        let (watchdog, overlap) = (&self.watchdog, self.overlap);
        let mut exposed = Duration::ZERO;
        let stop = AtomicBool::new(false);
        std::thread::scope(|threads| {
            let progress = (overlap && self.progress_thread).then(|| {
                threads.spawn(|| {
                    progress_loop(&stop, || {
                        lock().advance();
                        false
                    })
                })
            });
            let mut seen = vec![false; buckets.len()];
            backward(&mut |report| {
                let Reported::Final(range, grads) = report else {
                    if overlap {
                        lock().advance();
                    }
                    return;
                };
                let i = super::reported(buckets, &range, &mut seen);
                let s = sends[i].take().expect("each bucket once");
                let r = recvs[i].take().expect("each bucket once");
                lock().add(make(&buckets[i], &grads[range], s, r));
                if !overlap {
                    let start = Instant::now();
                    let _g = watchdog.arm("gradient reduction", 1);
                    while !lock().advance() {}
                    exposed += start.elapsed();
                }
            });
            assert!(seen.iter().all(|&s| s), "every bucket reported");
            if let Some(thread) = progress {
                stop_progress(&stop, thread.thread());
                let _ = thread.join();
            }
            let start = Instant::now();
            let _g = watchdog.arm("gradient reduction", 1);
            let mut rings = lock();
            while !rings.advance() {}
            exposed += start.elapsed();
        });
        OverlapTimes { exposed }
    }
}

/// Every rank's `name` (a host name, a build hash), in rank order: an all-gather
/// of fixed-size names.
fn all_gather_names(world: &SimpleCommunicator, name: &str) -> Vec<String> {
    const MAX: usize = 256;
    let mut mine = [0u8; MAX];
    let n = name.len().min(MAX);
    mine[..n].copy_from_slice(&name.as_bytes()[..n]);
    let mut all = vec![0u8; MAX * world.size() as usize];
    world.all_gather_into(&mine[..], &mut all[..]);
    all.chunks(MAX)
        .map(|c| {
            String::from_utf8_lossy(&c[..c.iter().position(|&b| b == 0).unwrap_or(MAX)])
                .into_owned()
        })
        .collect()
}

/// Rank 0's `text` on every rank.
fn broadcast_text(world: &SimpleCommunicator, text: String) -> String {
    let root = world.process_at_rank(0);
    let mut bytes = text.into_bytes();
    let mut len = bytes.len() as u64;
    root.broadcast_into(&mut len);
    if len == 0 {
        // Open MPI refuses an empty buffer (MPI_ERR_ARG: a dangling pointer to no
        // bytes), and every rank knows there is nothing to send.
        return String::new();
    }
    bytes.resize(count(len as usize), 0);
    root.broadcast_into(&mut bytes[..]);
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The ranks whose binary is another build than rank 0's, named with their hosts
/// and the fix; None when every rank runs rank 0's build.
fn other_builds(hosts: &[String], builds: &[String]) -> Option<String> {
    let others: Vec<String> = builds
        .iter()
        .enumerate()
        .filter(|(_, b)| **b != builds[0])
        .map(|(r, b)| format!("rank {r} (host {}) runs build {b}", hosts[r]))
        .collect();
    (!others.is_empty()).then(|| {
        format!(
            "{}, rank 0 (host {}) build {}: every host needs the same nanogpt binary at the \
             same path; copy rank 0's to the others (e.g. scp), or use `nanogpt launch`, which \
             checks this before starting",
            others.join(", "),
            hosts[0],
            builds[0]
        )
    })
}

/// A raw communicator handle the watchdog thread may use.
struct RawComm(mpi::ffi::MPI_Comm);
// SAFETY: an MPI communicator handle is a plain value that any thread may pass to
// MPI when MPI runs with MPI_THREAD_MULTIPLE (checked before it is used off the
// main thread); the handle itself is never freed while the process runs.
unsafe impl Send for RawComm {}
unsafe impl Sync for RawComm {}

/// How long a rank whose watchdog fired waits for the other ranks' to answer.
const PROBE_WAIT: Duration = Duration::from_secs(3);

/// When this rank's watchdog fires: every rank waiting in the same collective fires
/// too, within a poll. Each sends a note to every other on `diag` and listens for
/// theirs for [`PROBE_WAIT`]; the ranks not heard from did not arrive (stopped,
/// hung, unreachable, or still computing). Returns their numbers.
fn unanswered_peers(diag: &RawComm, rank: usize, size: usize) -> Vec<usize> {
    const TAG: i32 = 7177;
    // Leaked on purpose: the requests may still be pending when the job aborts.
    let send: &'static u64 = Box::leak(Box::new(rank as u64));
    let recv: &'static mut [u64] = Box::leak(vec![0u64; size].into_boxed_slice());
    let mut pending = Vec::new();
    for (peer, slot) in recv.iter_mut().enumerate() {
        if peer == rank {
            continue;
        }
        let mut sreq = std::mem::MaybeUninit::uninit();
        let mut rreq = std::mem::MaybeUninit::uninit();
        // SAFETY: MPI is initialised with MPI_THREAD_MULTIPLE (the caller checked),
        // `diag` is a valid communicator, and both buffers live for the rest of the
        // process (leaked), as MPI may use them until the requests complete.
        unsafe {
            mpi::ffi::MPI_Isend(
                send as *const u64 as *const _,
                1,
                mpi::ffi::RSMPI_UINT64_T,
                peer as i32,
                TAG,
                diag.0,
                sreq.as_mut_ptr(),
            );
            mpi::ffi::MPI_Irecv(
                slot as *mut u64 as *mut _,
                1,
                mpi::ffi::RSMPI_UINT64_T,
                peer as i32,
                TAG,
                diag.0,
                rreq.as_mut_ptr(),
            );
            pending.push((peer, rreq.assume_init()));
        }
    }
    let start = Instant::now();
    while !pending.is_empty() && start.elapsed() < PROBE_WAIT {
        pending.retain_mut(|(_, req)| {
            let mut flag = 0;
            // SAFETY: `req` is a request from MPI_Irecv above, not yet completed.
            unsafe { mpi::ffi::MPI_Test(req, &mut flag, mpi::ffi::RSMPI_STATUS_IGNORE) };
            flag == 0
        });
        std::thread::sleep(Duration::from_millis(10));
    }
    pending.into_iter().map(|(peer, _)| peer).collect()
}

/// The second half of the watchdog's message: which ranks did not arrive, and why
/// that may be.
fn diagnose(missing: Option<Vec<usize>>, hosts: &[String]) -> String {
    let named = |ranks: &[usize]| {
        ranks
            .iter()
            .map(|&r| {
                format!(
                    "rank {r} (host {})",
                    hosts.get(r).map_or("?", |h| h.as_str())
                )
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    match missing {
        Some(m) if !m.is_empty() => format!(
            "{} did not arrive (stopped, hung, unreachable over the network, or still \
             computing); the other ranks are waiting",
            named(&m)
        ),
        Some(_) => "every rank answered a side message, so all are waiting: the collective \
                    itself is stuck (network trouble between hosts?)"
            .into(),
        None => "another rank is stopped, hung or unreachable (MPI without \
                 MPI_THREAD_MULTIPLE cannot tell which)"
            .into(),
    }
}

/// The linked MPI library's `MPI_Get_library_version` (callable before `MPI_Init`).
pub fn library_version() -> String {
    let version = mpi::environment::library_version().unwrap_or_default();
    version.trim_end_matches(['\0', '\n', ' ']).to_string()
}

/// How long a rank whose MPI library aborts it waits before the abort goes on.
const ABORT_WAIT: Duration = Duration::from_secs(1);

/// MPICH over UCX aborts a rank at once when a peer process vanishes in the middle of
/// a transfer (UCX's CMA transport: `process_vm_readv … No such process`, a backtrace,
/// `abort()`), often before the heartbeat thread, woken by the same death, has named
/// the peer that is gone. On SIGABRT this process therefore waits [`ABORT_WAIT`], in
/// which the heartbeat prints its message and ends the job; then the abort goes on.
fn let_the_heartbeat_speak_before_an_abort() {
    // SAFETY: the action only sleeps (`nanosleep`, async-signal-safe): it allocates
    // nothing, takes no lock and touches no shared state.
    // Not installed (it cannot fail for SIGABRT): a transport's abort may then come
    // before the heartbeat's message, as without it.
    let _ = unsafe {
        signal_hook::low_level::register(signal_hook::consts::SIGABRT, || {
            std::thread::sleep(ABORT_WAIT)
        })
    };
}

/// How long `MPI_Abort` may take before this process ends itself: with a host
/// unreachable, the launcher may never get the abort through.
const ABORT_GRACE: Duration = Duration::from_secs(5);

/// `MPI_Abort` on the world (every rank ends), or a plain exit when MPI is not up.
/// If `MPI_Abort` has not ended the process after [`ABORT_GRACE`], it exits anyway.
pub fn abort_world(code: i32) -> ! {
    heartbeat::aborting();
    let _ = std::thread::Builder::new()
        .name("abort-fallback".into())
        .spawn(move || {
            std::thread::sleep(ABORT_GRACE);
            // SAFETY: _exit ends the process at once, without running exit handlers
            // (MPI's could block on the same unreachable peer).
            unsafe { libc::_exit(code) }
        });
    if mpi::environment::is_initialized() && !mpi::environment::is_finalized() {
        // Give the launcher a moment to forward the message just printed: some
        // (Hydra) tear the output channels down as soon as a rank aborts.
        std::thread::sleep(Duration::from_millis(300));
        // SAFETY: MPI is initialised and not finalised; MPI_Abort on the world
        // communicator does not return (it ends every process of the job).
        unsafe {
            mpi::ffi::MPI_Abort(mpi::ffi::RSMPI_COMM_WORLD, code);
        }
    }
    std::process::exit(code)
}

/// How long `MPI_Finalize` may take before the process leaves without it.
const FINALIZE_GRACE: Duration = Duration::from_secs(15);

/// `MPI_Finalize`, if [`Mpi::init`] ran, under a timer: after [`FINALIZE_GRACE`]
/// the process exits without it, with `code`, the status the run meant (the run's
/// work is done and written by then).
///
/// MPICH across hosts skips `MPI_Finalize` after a barrier. Debian's MPICH 4.0.2
/// (ch4 over UCX) hangs in it in about half of the multi-host runs, even right after
/// a barrier: one rank spins in UCX closing its connections while the others wait
/// in the PMI barrier and no longer make progress (docs/multinode.md, "Which MPI",
/// has the stacks). Leaving after the barrier is clean under Hydra (exit status
/// passed on, no messages), whereas a rank that gives up on a hung `MPI_Finalize`
/// breaks its proxy's PMI barrier and Hydra reports the job as failed.
/// `NANOGPT_MPI_FINALIZE=1` calls it anyway (to reproduce the hang).
pub fn finalize(code: i32) {
    let universe = UNIVERSE.lock().unwrap_or_else(|e| e.into_inner()).take();
    let Some(universe) = universe else {
        return;
    };
    super::watchdog::leave_if_stuck(FINALIZE_GRACE, "MPI_Finalize", code, |code| {
        std::process::exit(code)
    });
    if skips_finalize() {
        universe.world().barrier();
        // Dropping the universe would call MPI_Finalize.
        std::mem::forget(universe);
        pmi_finalize();
        return;
    }
    drop(universe);
}

/// How long [`pmi_finalize`] waits for the launcher's answer.
const PMI_FINALIZE_GRACE: Duration = Duration::from_secs(5);

/// Tells Hydra's proxy that this process is done with it, as `MPI_Finalize` would:
/// `cmd=finalize` on the PMI socket Hydra passed in `PMI_FD` (the PMI-1 wire
/// protocol), then waits for `cmd=finalize_ack`, at most [`PMI_FINALIZE_GRACE`].
/// Without it, a proxy that notices the closed socket before the process's exit
/// counts the rank as failed (status 1, no message): about one multi-host job in a
/// hundred failed so after a complete run (docs/multinode.md, "Which MPI").
/// Does nothing where `PMI_FD` is not set.
fn pmi_finalize() {
    use std::io::{Read, Write};
    use std::os::unix::io::FromRawFd;
    let Some(fd) = std::env::var("PMI_FD")
        .ok()
        .and_then(|v| v.parse::<i32>().ok())
    else {
        return;
    };
    // SAFETY: PMI_FD is the socket the launcher opened for this process, open for
    // its whole life; MPI no longer uses it (it is done, short of MPI_Finalize), and
    // ManuallyDrop keeps it from being closed here.
    let sock =
        std::mem::ManuallyDrop::new(unsafe { std::os::unix::net::UnixStream::from_raw_fd(fd) });
    let mut sock: &std::os::unix::net::UnixStream = &sock;
    let mut reply = Vec::new();
    let answered = sock.set_read_timeout(Some(PMI_FINALIZE_GRACE)).is_ok()
        && sock.write_all(b"cmd=finalize\n").is_ok()
        && {
            let mut byte = [0u8; 1];
            while !reply.ends_with(b"\n") && matches!(sock.read(&mut byte), Ok(1)) {
                reply.push(byte[0]);
            }
            String::from_utf8_lossy(&reply).contains("finalize_ack")
        };
    if !answered {
        crate::errln!(
            "warning: the MPI launcher did not acknowledge this rank's end (PMI finalize on \
             PMI_FD {fd}: {:?}); it may report the job as failed although the run is complete",
            String::from_utf8_lossy(&reply).trim()
        );
    }
}

/// Whether [`finalize`] leaves without `MPI_Finalize`: MPICH with ranks on several
/// hosts, unless `NANOGPT_MPI_FINALIZE=1`.
fn skips_finalize() -> bool {
    let mpich = mpi::environment::library_version()
        .map(|v| v.starts_with("MPICH"))
        .unwrap_or(false);
    let forced = crate::tuning::env::get().mpi_finalize;
    mpich && SPANS_HOSTS.load(Ordering::SeqCst) && !forced
}

/// Makes MPI progress once: an `MPI_Iprobe`, which matches nothing (collectives do
/// not use the point-to-point tags it sees). Called from progress threads only.
fn poke_mpi() {
    let mut flag = 0;
    let mut status = std::mem::MaybeUninit::<mpi::ffi::MPI_Status>::uninit();
    // SAFETY: MPI runs with MPI_THREAD_MULTIPLE (checked before a progress thread is
    // started), is initialised, and is not finalised while the collective that owns
    // the thread runs; flag and status are valid for writing.
    unsafe {
        mpi::ffi::MPI_Iprobe(
            mpi::ffi::RSMPI_ANY_SOURCE,
            mpi::ffi::RSMPI_ANY_TAG,
            mpi::ffi::RSMPI_COMM_WORLD,
            &mut flag,
            status.as_mut_ptr(),
        );
    }
}

/// A progress thread's body: calls `work` every millisecond until `stop` is set or
/// `work` says it is done. It parks between calls, so that [`stop_progress`] wakes
/// it at once: asleep for its millisecond, it made the wait that stops it lose up
/// to a millisecond (0.76 ms measured when stopped 0.3 ms after a call), some 35
/// times per ZeRO-3 micro-step at 124M (each bucket's gathers and reduction).
fn progress_loop(stop: &AtomicBool, mut work: impl FnMut() -> bool) {
    while !stop.load(Ordering::Relaxed) && !work() {
        std::thread::park_timeout(Duration::from_millis(1));
    }
}

/// Tells `thread`, running [`progress_loop`] on `stop`, to end, and wakes it.
fn stop_progress(stop: &AtomicBool, thread: &std::thread::Thread) {
    stop.store(true, Ordering::Relaxed);
    thread.unpark();
}

/// A progress thread for a collective left in flight: calls `poke` every
/// millisecond until [`Poker::stop`], or until `poke` says the collective is done.
struct Poker {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<()>,
}

impl Poker {
    fn start(poke: impl Fn() -> bool + Send + 'static) -> Poker {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = std::thread::spawn(move || progress_loop(&flag, poke));
        Poker { stop, thread }
    }

    /// Stops the thread and waits for it to end (the wait for a collective does
    /// this first).
    fn stop(self) {
        stop_progress(&self.stop, self.thread.thread());
        let _ = self.thread.join();
    }
}

/// MPI counts are C ints.
fn count(n: usize) -> usize {
    assert!(
        n <= i32::MAX as usize,
        "an MPI message of {n} elements is too large"
    );
    n
}

/// Per-rank counts (C ints) and their offsets, pieces laid one after the other.
fn counts_and_displs(counts: &[usize]) -> (Vec<mpi::Count>, Vec<mpi::Count>) {
    let mut displs = Vec::with_capacity(counts.len());
    let mut at = 0;
    for &n in counts {
        displs.push(count(at) as mpi::Count);
        at += n;
    }
    count(at);
    (counts.iter().map(|&n| n as mpi::Count).collect(), displs)
}

/// Starts the sum over the ranks of `send` (len Σ `counts`), rank `q` receiving
/// piece `q` (`counts[q]` floats, pieces in rank order) into `recv`: a non-blocking
/// `MPI_Ireduce_scatter`, straight from the caller's buffer.
///
/// # Safety
/// `send` must neither change nor be freed until the request completes, although
/// its borrow here ends when this function returns (it is the gradient range
/// backward has just reported final).
unsafe fn reduce_pieces<'a, S: mpi::request::Scope<'a>>(
    world: &SimpleCommunicator,
    scope: S,
    send: &[f32],
    recv: &'a mut [f32],
    counts: &'a [mpi::Count],
) -> mpi::request::Request<'a, [f32], S> {
    assert_eq!(
        counts.iter().map(|&n| n as usize).sum::<usize>(),
        send.len()
    );
    let mut request = std::mem::MaybeUninit::uninit();
    // SAFETY: `send` holds Σ counts floats and stays unchanged until completion (the
    // caller's promise); `recv` holds this rank's count and `counts` the world's,
    // both borrowed for 'a, which the scope's requests cannot outlive.
    unsafe {
        mpi::ffi::MPI_Ireduce_scatter(
            send.as_ptr() as *const _,
            recv.as_mut_ptr() as *mut _,
            counts.as_ptr(),
            mpi::ffi::RSMPI_FLOAT,
            mpi::ffi::RSMPI_SUM,
            world.as_raw(),
            request.as_mut_ptr(),
        );
        mpi::request::Request::from_raw(request.assume_init(), &*recv, scope)
    }
}

/// What a collective in flight finishes when it is waited for: an MPI request
/// ([`MpiRequest`]) or one of our rings ([`SharedRing`]).
trait Finish {
    fn finish(&mut self);
}

/// A collective started by [`Mpi`] and not yet waited for: its `work`, and (where
/// MPI is driven from a second thread) the thread that makes it progress meanwhile.
/// Dropping it waits for completion, under the watchdog, so the caller's buffers
/// are never left to MPI.
struct InFlight<'a, W: Finish> {
    work: W,
    watchdog: &'a Watchdog,
    what: &'static str,
    progress: Option<Poker>,
}

/// A non-blocking MPI collective: its request, and the count arrays and the send
/// copy MPI reads until it completes (freed after the wait).
struct MpiRequest {
    request: mpi::ffi::MPI_Request,
    _counts: Vec<mpi::Count>,
    _displs: Vec<mpi::Count>,
    _send: Vec<f32>,
}

impl Finish for MpiRequest {
    fn finish(&mut self) {
        // SAFETY: `request` came from a non-blocking collective started by this
        // process and not yet completed (only this completes it, once: it is
        // called from `InFlight`'s drop); the count arrays it reads are still held.
        unsafe { mpi::ffi::MPI_Wait(&mut self.request, mpi::ffi::RSMPI_STATUS_IGNORE) };
    }
}

/// One of our rings (ZeRO-3's, started by [`Mpi::start_reduce_scatter_pieces`] or
/// [`Mpi::start_all_gather_in_place`]), shared with the progress thread that moves it
/// on where MPI runs one for collectives in flight.
type SharedRing = Arc<Mutex<Ring<f32>>>;

impl Finish for SharedRing {
    fn finish(&mut self) {
        self.lock().unwrap_or_else(|e| e.into_inner()).finish();
    }
}

impl<'a> InFlight<'a, MpiRequest> {
    /// Holds `request` (just started) with its count arrays; a progress thread
    /// pokes MPI until it is waited for when `mpi.progress_in_flight`.
    fn new(
        mpi: &'a Mpi,
        request: mpi::ffi::MPI_Request,
        arrays: (Vec<mpi::Count>, Vec<mpi::Count>),
        send: Vec<f32>,
        what: &'static str,
    ) -> Box<Self> {
        let progress = mpi.progress_in_flight;
        InFlight::with_progress(mpi, progress, request, arrays, send, what)
    }

    /// [`InFlight::new`], with a progress thread when `progress`.
    fn with_progress(
        mpi: &'a Mpi,
        progress: bool,
        request: mpi::ffi::MPI_Request,
        arrays: (Vec<mpi::Count>, Vec<mpi::Count>),
        send: Vec<f32>,
        what: &'static str,
    ) -> Box<Self> {
        let progress = progress.then(|| {
            Poker::start(|| {
                poke_mpi();
                false
            })
        });
        let work = MpiRequest {
            request,
            _counts: arrays.0,
            _displs: arrays.1,
            _send: send,
        };
        Box::new(InFlight {
            work,
            watchdog: &mpi.watchdog,
            what,
            progress,
        })
    }
}

impl<'a> InFlight<'a, SharedRing> {
    /// Holds `ring` (begun); a progress thread advances it until it is waited for
    /// when `mpi.progress_in_flight`.
    fn ring(mpi: &'a Mpi, ring: Ring<f32>, what: &'static str) -> Box<Self> {
        let ring = Arc::new(Mutex::new(ring));
        let progress = mpi.progress_in_flight.then(|| {
            let ring = Arc::clone(&ring);
            Poker::start(move || ring.lock().unwrap_or_else(|e| e.into_inner()).advance())
        });
        Box::new(InFlight {
            work: ring,
            watchdog: &mpi.watchdog,
            what,
            progress,
        })
    }
}

impl<W: Finish> Pending for InFlight<'_, W> {
    fn wait(self: Box<Self>) {} // dropping it waits
}

impl<W: Finish> Drop for InFlight<'_, W> {
    fn drop(&mut self) {
        if let Some(poker) = self.progress.take() {
            poker.stop();
        }
        let _g = self.watchdog.arm(self.what, 1);
        self.work.finish();
    }
}

/// Rings started together and waited for one by one, in the order started
/// (ZeRO-1/2's all-gathers of the updated weights, one per bucket): waiting for
/// one moves all of them on, and a progress thread, where MPI runs one for
/// collectives in flight, moves them on until the last is waited for.
struct RingGroup {
    rings: Mutex<Vec<Ring<f32>>>,
}

/// Rings of a [`RingGroup`] in flight at once. They begin in the order started, a
/// ring only when fewer than this many before it are still running: the first
/// bucket the forward needs (the embeddings, 31 % of GPT-2 124M's weights) then has
/// the link to itself instead of sharing it with every other bucket's gather, and
/// the second keeps the link busy while the first's last round completes.
const GATHERS_IN_FLIGHT: usize = 2;

impl RingGroup {
    /// The group of `rings` (not begun), as one handle per ring in their order.
    fn start<'a>(
        mpi: &'a Mpi,
        rings: Vec<Ring<f32>>,
        what: &'static str,
    ) -> Vec<Box<dyn Pending + 'a>> {
        let n = rings.len();
        let group = Arc::new(RingGroup {
            rings: Mutex::new(rings),
        });
        let mut progress = (mpi.progress_in_flight && n > 0).then(|| {
            let group = Arc::clone(&group);
            Poker::start(move || group.advance())
        });
        (0..n)
            .map(|index| {
                Box::new(OfGroup {
                    group: Arc::clone(&group),
                    index,
                    watchdog: &mpi.watchdog,
                    what,
                    // Held by the last ring, waited for last.
                    progress: if index + 1 == n {
                        progress.take()
                    } else {
                        None
                    },
                }) as Box<dyn Pending + 'a>
            })
            .collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Ring<f32>>> {
        self.rings.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Moves every ring on without blocking, beginning the next ones in order where
    /// fewer than [`GATHERS_IN_FLIGHT`] are running; returns whether all are done.
    fn advance(&self) -> bool {
        advance_in_order(&mut self.lock())
    }
}

/// [`RingGroup::advance`] on its rings.
fn advance_in_order(rings: &mut [Ring<f32>]) -> bool {
    let mut running = 0;
    for ring in rings.iter_mut() {
        if !ring.begun() {
            if running >= GATHERS_IN_FLIGHT {
                return false;
            }
            ring.begin();
        }
        if !ring.advance() {
            running += 1;
        }
    }
    running == 0
}

/// One ring of a [`RingGroup`]; waiting for it (or dropping it) moves the whole
/// group on until this ring is done, under the watchdog.
struct OfGroup<'a> {
    group: Arc<RingGroup>,
    index: usize,
    watchdog: &'a Watchdog,
    what: &'static str,
    progress: Option<Poker>,
}

impl Pending for OfGroup<'_> {
    fn wait(self: Box<Self>) {} // dropping it waits
}

impl Drop for OfGroup<'_> {
    fn drop(&mut self) {
        let _g = self.watchdog.arm(self.what, 1);
        loop {
            let mut rings = self.group.lock();
            advance_in_order(&mut rings);
            if rings[self.index].done() {
                break;
            }
        }
        if let Some(poker) = self.progress.take() {
            poker.stop();
        }
    }
}

/// MPI's user function for the sum of bf16 values (sent as `MPI_UINT16_T`):
/// `inout[i] = bf16(f32(in[i]) + f32(inout[i]))`, rounded to nearest, ties to even.
///
/// # Safety
/// MPI calls it with `len` valid values in both buffers.
unsafe extern "C" fn bf16_sum(
    input: *mut std::os::raw::c_void,
    inout: *mut std::os::raw::c_void,
    len: *mut std::os::raw::c_int,
    _: *mut mpi::ffi::MPI_Datatype,
) {
    // SAFETY: MPI passes two buffers of `*len` elements of the (2-byte) datatype
    // this operation is used with, and they do not overlap.
    let (a, b) = unsafe {
        let n = *len as usize;
        (
            std::slice::from_raw_parts(input as *const Bf16, n),
            std::slice::from_raw_parts_mut(inout as *mut Bf16, n),
        )
    };
    for (x, y) in a.iter().zip(b) {
        *y = Bf16::from_f32(x.to_f32() + y.to_f32());
    }
}

/// The first `buf.len()` bf16 values held in the bytes of `buf` (f32), to write.
fn bf16_view(buf: &mut [f32]) -> &mut [Bf16] {
    // SAFETY: `Bf16` is a `repr(transparent)` u16: any bits are valid, its alignment
    // (2) divides f32's, and `buf.len()` of them fill the first half of `buf`'s
    // bytes; the view borrows `buf` mutably, so nothing else reads it meanwhile.
    unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr() as *mut Bf16, buf.len()) }
}

/// Widens in place the bf16 values that the first half of `buf`'s bytes hold
/// ([`bf16_view`]) to f32, exactly.
fn widen_bf16_in_place(buf: &mut [f32]) {
    let ptr = buf.as_mut_ptr();
    for i in (0..buf.len()).rev() {
        // SAFETY: bf16 value `i` sits at bytes 2i..2i+2 and f32 `i` at 4i..4i+4, both
        // inside `buf`; going down, the f32 written at 4i only covers bf16 values i
        // and above (2i ≥ i), which have already been read.
        unsafe {
            let h = (ptr as *const Bf16).add(i).read();
            ptr.add(i).write(h.to_f32());
        }
    }
}

/// Starts the bf16 reduction of one bucket ([`Reduce::AllReduceBf16`] or
/// [`Reduce::ReduceScatterBf16`]): `grads` rounded to bf16 into the front of `send`
/// (the rest of its `send.len()` values zero), reduced with `op` into the front of
/// `recv` as bf16 ([`widen_bf16_in_place`] it once complete).
fn reduce_bf16<'a, S: mpi::request::Scope<'a>>(
    world: &SimpleCommunicator,
    scope: S,
    (kind, op): (Reduce, mpi::ffi::MPI_Op),
    grads: &[f32],
    send: &'a mut [f32],
    recv: &'a mut [f32],
) -> mpi::request::Request<'a, [f32], S> {
    let n = count(send.len());
    fill_send(kind, grads, send);
    let send: &'a [f32] = send;
    let mut request = std::mem::MaybeUninit::uninit();
    // SAFETY: `send` holds `n` bf16 values and `recv` the result's (n for the
    // all-reduce, n / world size for the reduce-scatter), both borrowed for 'a,
    // which the scope's requests cannot outlive; `op` is a valid operation.
    unsafe {
        match kind {
            Reduce::AllReduceBf16 => mpi::ffi::MPI_Iallreduce(
                send.as_ptr() as *const _,
                recv.as_mut_ptr() as *mut _,
                n as i32,
                mpi::ffi::RSMPI_UINT16_T,
                op,
                world.as_raw(),
                request.as_mut_ptr(),
            ),
            _ => mpi::ffi::MPI_Ireduce_scatter_block(
                send.as_ptr() as *const _,
                recv.as_mut_ptr() as *mut _,
                recv.len() as i32,
                mpi::ffi::RSMPI_UINT16_T,
                op,
                world.as_raw(),
                request.as_mut_ptr(),
            ),
        };
        mpi::request::Request::from_raw(request.assume_init(), &*recv, scope)
    }
}

/// Writes a bucket's `grads` into the front of its `send` range in `kind`'s wire
/// format (f32, or bf16 rounded to nearest, ties to even, in the front half of the
/// bytes: [`bf16_view`]) and zeroes the rest of the range (the padding of the last
/// rank's block).
fn fill_send(kind: Reduce, grads: &[f32], send: &mut [f32]) {
    match kind.wire_bytes() {
        2 => {
            let wire = bf16_view(send);
            crate::kernels::bf16::store(&mut wire[..grads.len()], grads);
            wire[grads.len()..].fill(Bf16(0));
        }
        _ => {
            send[..grads.len()].copy_from_slice(grads);
            send[grads.len()..].fill(0.0);
        }
    }
}

/// Each bucket's send and receive ranges of `send` and `recv`, taken once each as the
/// bucket is reported; reductions that read the gradients themselves
/// ([`Reduce::reads_gradients`], `ring`: with our rings) get an empty send range.
#[allow(clippy::type_complexity)]
fn bucket_slices<'b>(
    (kind, ring): (Reduce, bool),
    buckets: &[Bucket],
    send: &'b mut [f32],
    recv: &'b mut [f32],
) -> (Vec<Option<&'b mut [f32]>>, Vec<Option<&'b mut [f32]>>) {
    let send_ranges: Vec<_> = match kind.reads_gradients(ring) {
        true => vec![0..0; buckets.len()],
        false => buckets.iter().map(|b| b.send.clone()).collect(),
    };
    let recv_ranges: Vec<_> = buckets.iter().map(|b| b.recv.clone()).collect();
    (
        split_disjoint(send, &send_ranges),
        split_disjoint(recv, &recv_ranges),
    )
}

/// After a reduction with bf16 on the wire: each bucket's result, bf16 in the front
/// of its receive range, widened in place to f32 (nothing for f32 on the wire).
fn widen_results(kind: Reduce, buckets: &[Bucket], recv: &mut [f32]) {
    if kind.wire_bytes() == 2 {
        for b in buckets {
            widen_bf16_in_place(&mut recv[b.recv.clone()]);
        }
    }
}

fn split_disjoint<'b>(buf: &'b mut [f32], ranges: &[Range<usize>]) -> Vec<Option<&'b mut [f32]>> {
    let mut order: Vec<usize> = (0..ranges.len()).collect();
    order.sort_by_key(|&i| ranges[i].start);
    let mut out: Vec<Option<&'b mut [f32]>> = (0..ranges.len()).map(|_| None).collect();
    let (mut rest, mut at) = (buf, 0);
    for i in order {
        let r = &ranges[i];
        assert!(r.start >= at, "bucket ranges overlap");
        let tail = std::mem::take(&mut rest);
        let (_, tail) = tail.split_at_mut(r.start - at);
        let (piece, tail) = tail.split_at_mut(r.len());
        out[i] = Some(piece);
        rest = tail;
        at = r.end;
    }
    out
}

impl Collective for Mpi {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.size
    }

    fn local_size(&self) -> usize {
        self.local
    }

    fn host(&self) -> String {
        self.host.clone()
    }

    fn hosts(&self) -> Vec<String> {
        self.hosts.clone()
    }

    fn describe(&self) -> String {
        let lib = mpi::environment::library_version().unwrap_or_default();
        let first = lib.lines().next().unwrap_or("");
        let first = first.trim_matches(|c: char| c == '\0' || c.is_whitespace());
        format!("MPI ({first})")
    }

    fn reduction_name(&self) -> &'static str {
        match self.ring {
            true => "our ring collectives",
            false => "MPI's non-blocking collectives (NANOGPT_RING_REDUCE=0)",
        }
    }

    fn set_timeout(&self, timeout: Duration) {
        self.watchdog.set_timeout(timeout);
    }

    fn barrier_patient(&self) {
        let _g = self.watchdog.arm("barrier (waiting for rank 0)", 30);
        self.world.barrier();
    }

    fn all_reduce_sum_f64(&self, values: &mut [f64]) {
        let send = values.to_vec();
        let _g = self.watchdog.arm("all-reduce", 1);
        self.world
            .all_reduce_into(&send[..], values, SystemOperation::sum());
    }

    fn broadcast(&self, buf: &mut [f32], root: usize) {
        let _g = self.watchdog.arm("broadcast", 1);
        // Pieces of at most 2^28 floats keep every count a valid C int.
        for piece in buf.chunks_mut(1 << 28) {
            self.root(root).broadcast_into(piece);
        }
    }

    fn broadcast_bytes(&self, buf: &mut Vec<u8>, root: usize) {
        // Rank 0 may be loading a model meanwhile: be patient.
        let _g = self.watchdog.arm("broadcast (waiting for rank 0)", 30);
        let mut len = buf.len() as u64;
        self.root(root).broadcast_into(&mut len);
        buf.resize(count(len as usize), 0);
        if len > 0 {
            // (Open MPI refuses an empty buffer.)
            self.root(root).broadcast_into(&mut buf[..]);
        }
    }

    fn all_gather(&self, send: &[f32], recv: &mut [f32]) {
        assert_eq!(send.len() * self.size, recv.len());
        count(recv.len());
        let _g = self.watchdog.arm("all-gather", 1);
        self.world.all_gather_into(send, recv);
    }

    fn all_gather_u64(&self, value: u64) -> Vec<u64> {
        let mut out = vec![0u64; self.size];
        let _g = self.watchdog.arm("all-gather", 1);
        self.world.all_gather_into(&value, &mut out[..]);
        out
    }

    fn gather(&self, send: &[f32], recv: &mut [f32], root: usize) {
        let _g = self.watchdog.arm("gather", 1);
        if self.rank == root {
            assert_eq!(send.len() * self.size, recv.len());
            count(recv.len());
            self.root(root).gather_into_root(send, recv);
        } else {
            self.root(root).gather_into(send);
        }
    }

    fn scatter(&self, send: &[f32], recv: &mut [f32], root: usize) {
        let _g = self.watchdog.arm("scatter", 1);
        if self.rank == root {
            assert_eq!(recv.len() * self.size, send.len());
            count(send.len());
            self.root(root).scatter_into_root(send, recv);
        } else {
            self.root(root).scatter_into(recv);
        }
    }

    fn reduce_scatter_pieces(&self, send: &[f32], mine: &mut [f32], counts: &[usize]) {
        assert_eq!(counts.iter().sum::<usize>(), send.len());
        assert_eq!(counts[self.rank], mine.len());
        let (counts, _) = counts_and_displs(counts);
        let _g = self.watchdog.arm("reduce-scatter", 1);
        // SAFETY: `send` holds Σ counts floats, `mine` this rank's count; both are
        // borrowed for the whole (blocking) call, and `counts` has one entry per rank.
        unsafe {
            mpi::ffi::MPI_Reduce_scatter(
                send.as_ptr() as *const _,
                mine.as_mut_ptr() as *mut _,
                counts.as_ptr(),
                mpi::ffi::RSMPI_FLOAT,
                mpi::ffi::RSMPI_SUM,
                self.world.as_raw(),
            );
        }
    }

    fn all_gather_pieces(&self, mine: &[f32], buf: &mut [f32], counts: &[usize]) {
        assert_eq!(counts.iter().sum::<usize>(), buf.len());
        assert_eq!(counts[self.rank], mine.len());
        let (counts, displs) = counts_and_displs(counts);
        let _g = self.watchdog.arm("all-gather", 1);
        let mut parts = PartitionMut::new(buf, counts, displs);
        self.world.all_gather_varcount_into(mine, &mut parts);
    }

    fn gather_pieces(&self, mine: &[f32], buf: &mut [f32], counts: &[usize], root: usize) {
        assert_eq!(counts[self.rank], mine.len());
        let _g = self.watchdog.arm("gather", 1);
        if self.rank == root {
            assert_eq!(counts.iter().sum::<usize>(), buf.len());
            let (counts, displs) = counts_and_displs(counts);
            let mut parts = PartitionMut::new(buf, counts, displs);
            self.root(root).gather_varcount_into_root(mine, &mut parts);
        } else {
            self.root(root).gather_varcount_into(mine);
        }
    }

    fn scatter_pieces(&self, buf: &[f32], mine: &mut [f32], counts: &[usize], root: usize) {
        assert_eq!(counts[self.rank], mine.len());
        let _g = self.watchdog.arm("scatter", 1);
        if self.rank == root {
            assert_eq!(counts.iter().sum::<usize>(), buf.len());
            let (counts, displs) = counts_and_displs(counts);
            let parts = Partition::new(buf, counts, displs);
            self.root(root).scatter_varcount_into_root(&parts, mine);
        } else {
            self.root(root).scatter_varcount_into(mine);
        }
    }

    unsafe fn start_all_gather_in_place<'a>(
        &'a self,
        buf: &mut [f32],
        counts: &[usize],
    ) -> Box<dyn Pending + 'a> {
        assert_eq!(counts.iter().sum::<usize>(), buf.len());
        if self.ring {
            // SAFETY: every rank starts ZeRO-3's gathers in the same order; `buf` is
            // the caller's promise until the wait, which finishes the ring.
            let mut ring = unsafe { self.ring_all_gather(counts, None, buf) };
            ring.begin();
            return InFlight::ring(self, ring, "all-gather");
        }
        let at: usize = counts[..self.rank].iter().sum();
        // MPI's send and receive buffers must not overlap (and the mpi crate has no
        // MPI_IN_PLACE): this rank's piece travels from a copy, which the request
        // keeps until it completes.
        let mine = buf[at..at + counts[self.rank]].to_vec();
        let arrays = counts_and_displs(counts);
        // SAFETY: `mine` holds this rank's count and is moved into the returned
        // request's keeping below (a Vec's heap buffer does not move); `buf` holds
        // Σ counts floats and is MPI's until the request completes (the caller's
        // promise); the count arrays are kept by the request too.
        let request = unsafe { self.iallgatherv(&mine, buf, &arrays) };
        InFlight::new(self, request, arrays, mine, "all-gather")
    }

    unsafe fn start_all_gathers<'a>(
        &'a self,
        send: &[f32],
        recv: &mut [f32],
        parts: &[GatherPart],
    ) -> Vec<Box<dyn Pending + 'a>> {
        let what = "all-gather of the parameters";
        if self.ring {
            let rings = parts.iter().map(|part| {
                let (mine, all) = (&send[part.from.clone()], &mut recv[part.into.clone()]);
                // SAFETY: every rank starts the same gathers in the same order; `mine`
                // and `all` are the caller's promise until each is waited for, and
                // distinct borrows (`send` and `recv`), so they do not overlap.
                unsafe { self.ring_all_gather(part.counts, Some(mine), all) }
            });
            return RingGroup::start(self, rings.collect(), what);
        }
        let last = parts.len().saturating_sub(1);
        let mut started: Vec<Box<dyn Pending + 'a>> = Vec::with_capacity(parts.len());
        for (k, part) in parts.iter().enumerate() {
            let (mine, all) = (&send[part.from.clone()], &mut recv[part.into.clone()]);
            assert_eq!(part.counts.iter().sum::<usize>(), all.len());
            assert_eq!(part.counts[self.rank], mine.len());
            let arrays = counts_and_displs(part.counts);
            // SAFETY: `mine` holds this rank's count and `all` Σ counts floats; both
            // are MPI's until the request completes (the caller's promise: `mine`
            // unchanged, `all` untouched, both allocated); the count arrays are kept
            // by the request; `send` and `recv` are distinct borrows, so the pieces
            // MPI reads and writes do not overlap.
            let request = unsafe { self.iallgatherv(mine, all, &arrays) };
            // One progress thread for the whole group, held by the last one started,
            // which is waited for last: it runs while any of them is in flight.
            let progress = k == last && self.progress_in_flight;
            let empty = Vec::new();
            started.push(InFlight::with_progress(
                self, progress, request, arrays, empty, what,
            ));
        }
        started
    }

    unsafe fn start_reduce_scatter_pieces<'a>(
        &'a self,
        send: &[f32],
        mine: &mut [f32],
        counts: &[usize],
    ) -> Box<dyn Pending + 'a> {
        assert_eq!(counts.iter().sum::<usize>(), send.len());
        assert_eq!(counts[self.rank], mine.len());
        if self.ring {
            // SAFETY: every rank starts ZeRO-3's reductions in the same order; the
            // buffers are the caller's promise until the wait, which finishes the ring.
            let mut ring = unsafe { self.ring(Shape::ReduceScatter, counts, send, mine) };
            ring.begin();
            return InFlight::ring(self, ring, "reduce-scatter");
        }
        let arrays = counts_and_displs(counts);
        let mut request = std::mem::MaybeUninit::uninit();
        // SAFETY: `send` holds Σ counts floats, `mine` this rank's count, and both
        // are MPI's until the request completes (the caller's promise); the count
        // array is kept by the request.
        let request = unsafe {
            mpi::ffi::MPI_Ireduce_scatter(
                send.as_ptr() as *const _,
                mine.as_mut_ptr() as *mut _,
                arrays.0.as_ptr(),
                mpi::ffi::RSMPI_FLOAT,
                mpi::ffi::RSMPI_SUM,
                self.world.as_raw(),
                request.as_mut_ptr(),
            );
            request.assume_init()
        };
        InFlight::new(self, request, arrays, Vec::new(), "reduce-scatter")
    }

    fn reduce_during_backward(
        &self,
        kind: Reduce,
        buckets: &[Bucket],
        send: &mut [f32],
        recv: &mut [f32],
        backward: &mut BackwardFn,
    ) -> OverlapTimes {
        if self.ring {
            return self.ring_during_backward(kind, buckets, send, recv, backward);
        }
        let (mut sends, mut recvs) = bucket_slices((kind, false), buckets, send, recv);
        // Reductions by pieces: each bucket's per-rank counts, alive until all complete.
        let counts: Vec<Vec<i32>> = buckets
            .iter()
            .map(|b| counts_and_displs(&b.counts).0)
            .collect();
        let (world, watchdog, overlap) = (&self.world, &self.watchdog, self.overlap);
        let mut exposed = Duration::ZERO;
        let stop = AtomicBool::new(false);
        std::thread::scope(|threads| {
            let progress = (overlap && self.progress_thread).then(|| {
                threads.spawn(|| {
                    progress_loop(&stop, || {
                        poke_mpi();
                        false
                    })
                })
            });
            mpi::request::multiple_scope(buckets.len(), |scope, requests| {
                let mut done = Vec::with_capacity(buckets.len());
                let mut seen = vec![false; buckets.len()];
                backward(&mut |report| {
                    let Reported::Final(range, grads) = report else {
                        if overlap {
                            requests.test_some(&mut done);
                        }
                        return;
                    };
                    let i = super::reported(buckets, &range, &mut seen);
                    let b = &buckets[i];
                    let r = recvs[i].take().expect("each bucket once");
                    let request = match kind {
                        Reduce::AllReduceBf16 | Reduce::ReduceScatterBf16 => {
                            let s = sends[i].take().expect("each bucket once");
                            let wire = (kind, self.bf16_sum);
                            reduce_bf16(world, scope, wire, &grads[range], s, r)
                        }
                        Reduce::ReducePieces => {
                            let r = &mut r[..b.counts[self.rank]];
                            // SAFETY: backward no longer writes a reported range, and
                            // the caller holds the gradients borrowed until this
                            // function returns, after every request has completed.
                            unsafe { reduce_pieces(world, scope, &grads[range], r, &counts[i]) }
                        }
                        _ => {
                            let s = sends[i].take().expect("each bucket once");
                            fill_send(kind, &grads[range], s);
                            let s: &[f32] = s;
                            count(s.len());
                            let sum = SystemOperation::sum();
                            match kind {
                                Reduce::AllReduce => {
                                    world.immediate_all_reduce_into(scope, s, r, sum)
                                }
                                _ => world.immediate_reduce_scatter_block_into(scope, s, r, sum),
                            }
                        }
                    };
                    requests.add(request);
                    if overlap {
                        // MPI moves data only inside MPI calls: give it a turn per layer.
                        requests.test_some(&mut done);
                    } else {
                        let start = Instant::now();
                        let _g = watchdog.arm("gradient reduction", 1);
                        requests.wait_all(&mut done);
                        exposed += start.elapsed();
                    }
                });
                assert!(seen.iter().all(|&s| s), "every bucket reported");
                let start = Instant::now();
                let _g = watchdog.arm("gradient reduction", 1);
                requests.wait_all(&mut done);
                exposed += start.elapsed();
            });
            if let Some(thread) = &progress {
                stop_progress(&stop, thread.thread());
            }
        });
        let start = Instant::now();
        widen_results(kind, buckets, recv);
        exposed += start.elapsed();
        OverlapTimes { exposed }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::bf16::round;

    /// The wire format: values stored as bf16 into the front of an f32 buffer widen
    /// back in place to exactly their bf16 roundings, and the reduction's operation
    /// rounds each partial sum (1 + 2⁻⁸ is a tie between 1 and 1 + 2⁻⁷: to even, 1).
    #[test]
    fn bf16_wire_values_widen_in_place_and_partial_sums_are_rounded() {
        let vals: Vec<f32> = (0..37).map(|i| (i as f32 - 17.3) * 0.0137).collect();
        let mut buf = vec![f32::NAN; vals.len()];
        crate::kernels::bf16::store(bf16_view(&mut buf), &vals);
        widen_bf16_in_place(&mut buf);
        let want: Vec<f32> = vals.iter().map(|&x| round(x)).collect();
        assert_eq!(buf, want);
        assert_ne!(buf, vals, "the values were rounded");

        let a = [1.0f32, 0.75, -3.0].map(Bf16::from_f32);
        let mut b = [2f32.powi(-8), 2f32.powi(-8), 0.5].map(Bf16::from_f32);
        let mut n = 3;
        // SAFETY: both buffers hold `n` values, as MPI would pass them.
        unsafe {
            bf16_sum(
                a.as_ptr() as *mut _,
                b.as_mut_ptr() as *mut _,
                &mut n,
                std::ptr::null_mut(),
            )
        };
        assert_eq!(
            b.map(Bf16::to_f32),
            [1.0, round(0.75 + 2f32.powi(-8)), -2.5]
        );
    }
}
