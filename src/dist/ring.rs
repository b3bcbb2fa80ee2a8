//! Our own ring collectives over non-blocking point-to-point messages: the
//! reduce-scatter of the ZeRO 1-3 gradient reductions, ZeRO-0's all-reduce (a
//! reduce-scatter, then an all-gather of the summed pieces) and the weights'
//! all-gathers (`NANOGPT_RING_REDUCE=0` goes back to MPI's collectives).
//!
//! Open MPI 4.1's non-blocking reduce-scatter (libnbc) reduces the whole bucket to
//! rank 0 and scatters it from there: rank 0's link carries several whole buckets
//! and rank 0 holds whole-bucket temporaries; its non-blocking all-reduce moved
//! about a third of the bytes per second of a ring across 3 hosts. A ring moves
//! `(N−1)/N` of the bucket in and out of every rank per phase, and holds at most two
//! pieces of scratch.
//!
//! One bucket of `N` ranks' pieces (`counts`, in rank order; unequal or empty
//! pieces allowed) takes `N−1` rounds per phase. Counting pieces backwards from this
//! rank `r`, `back(k) = (r − k) mod N`:
//!
//! - Reduce-scatter, round `j`: rank `r` sends the partial sum of piece `back(j+1)`
//!   to rank `r+1` (round 0: its own gradients) and receives rank `r−1`'s partial
//!   sum of piece `back(j+2)`, to which it adds its own gradients; that sum is what
//!   it sends in round `j+1`. The last round (`j = N−2`) receives piece `back(N) = r`,
//!   which then holds every rank's contribution. A round's messages complete before
//!   the next round starts, so a buffer received into at round `j` and sent at round
//!   `j+1` is free again at round `j+2`: the receives alternate between two buffers,
//!   the last one landing in the caller's output.
//! - All-gather, round `g`: rank `r` sends piece `back(g)` (round 0: its own) to rank
//!   `r+1` and receives piece `back(g+1)` from rank `r−1`, straight into the output,
//!   where it sends it from in round `g+1`.
//!
//! [`Ring`] is one bucket's state machine: [`Ring::advance`] tests the round in
//! flight without blocking and, when it has completed, adds and starts the next;
//! [`Ring::finish`] blocks until the last round is done.

use crate::kernels::bf16::Bf16;
use mpi::ffi;

/// What a ring's messages carry: f32 values, or bf16 values (`grad_reduce_dtype =
/// "bfloat16"`) whose every partial sum is computed in f32 from two bf16 values and
/// rounded to bf16 (to nearest, ties to even), as `Reduce::AllReduceBf16` says.
pub trait Element: Copy + 'static {
    /// The MPI datatype of one value.
    fn datatype() -> ffi::MPI_Datatype;
    /// `sum[i] ← sum[i] + own[i]`.
    fn add(sum: &mut [Self], own: &[Self]);
}

impl Element for f32 {
    fn datatype() -> ffi::MPI_Datatype {
        // SAFETY: reads a constant MPI handle that the mpi-sys shim defines.
        unsafe { ffi::RSMPI_FLOAT }
    }
    fn add(sum: &mut [f32], own: &[f32]) {
        for (s, g) in sum.iter_mut().zip(own) {
            *s += g;
        }
    }
}

impl Element for Bf16 {
    fn datatype() -> ffi::MPI_Datatype {
        // SAFETY: reads a constant MPI handle that the mpi-sys shim defines.
        unsafe { ffi::RSMPI_UINT16_T }
    }
    fn add(sum: &mut [Bf16], own: &[Bf16]) {
        for (s, g) in sum.iter_mut().zip(own) {
            *s = Bf16::from_f32(s.to_f32() + g.to_f32());
        }
    }
}

use super::plan::ring_scratch_buffers as scratch_buffers;

/// What a [`Ring`] computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    /// This rank's piece of the sum, into an output of `counts[rank]` values.
    ReduceScatter,
    /// The whole sum on every rank, into an output of Σ counts values: the
    /// reduce-scatter's rounds, then the all-gather's of the summed pieces.
    AllReduce,
    /// Every rank's piece, in rank order, into an output of Σ counts values.
    AllGather,
}

/// One bucket's ring collective in flight, of values `T` ([`Element`]).
pub struct Ring<T: Element> {
    shape: Shape,
    comm: ffi::MPI_Comm,
    rank: usize,
    size: usize,
    tag: i32,
    /// Values of each rank's piece, and where it starts in a whole bucket.
    counts: Vec<usize>,
    starts: Vec<usize>,
    /// This rank's input, read only: its contribution to the whole bucket (Σ counts
    /// values; reductions), or its own piece (an all-gather not in place), or null
    /// (an all-gather whose own piece is in the output already).
    data: *const T,
    /// The result: this rank's piece (reduce-scatter) or the whole bucket.
    out: *mut T,
    /// The receive buffers of the reduce-scatter's rounds before its last: the
    /// largest piece's count of f32 each ([`super::plan::ring_scratch_len`]),
    /// whatever `T` (a bf16 ring uses the first half of each).
    scratch: [Vec<f32>; 2],
    /// Rounds completed; the ring is done at [`Ring::rounds`].
    round: usize,
    /// Whether [`Ring::begin`] ran.
    started: bool,
    /// The round's send and receive.
    requests: [ffi::MPI_Request; 2],
}

// SAFETY: a ring is used by one thread at a time (the caller moves it or holds it
// under a lock); the buffers behind its pointers are the caller's for its whole
// life (the constructors' contract), and MPI request and communicator handles may
// be passed to MPI from any thread under MPI_THREAD_MULTIPLE (a ring is only shared
// with a second thread when MPI runs so).
unsafe impl<T: Element> Send for Ring<T> {}

impl<T: Element> Ring<T> {
    /// A reduction of `data` (Σ `counts` values, pieces in rank order) over `comm`,
    /// every message tagged `tag`, into `out`: this rank's piece of the sum
    /// (`counts[rank]` values) for [`Shape::ReduceScatter`], the whole sum (Σ
    /// `counts` values) for [`Shape::AllReduce`], piece `q` summed in ring order
    /// starting after rank `q` and then sent as it is to every rank, so every rank
    /// ends with the same bits. It starts with [`Ring::begin`].
    ///
    /// # Safety
    /// `comm` is a valid communicator whose ranks all run the same ring with the
    /// same `counts` and `tag`, and no other message in flight on it carries `tag`.
    /// Until the ring is done (or dropped), `data` must stay allocated and
    /// unchanged and `out` allocated and neither read nor written; they are
    /// distinct buffers.
    pub unsafe fn reduce(
        shape: Shape,
        comm: ffi::MPI_Comm,
        rank: usize,
        tag: i32,
        counts: &[usize],
        data: &[T],
        out: &mut [T],
    ) -> Ring<T> {
        assert_eq!(counts.iter().sum::<usize>(), data.len());
        let out_len = match shape {
            Shape::ReduceScatter => counts[rank],
            Shape::AllReduce => data.len(),
            Shape::AllGather => panic!("an all-gather sums nothing: Ring::all_gather"),
        };
        assert_eq!(out.len(), out_len);
        let data = data.as_ptr();
        // SAFETY: the caller's contract.
        unsafe { Ring::with(shape, comm, rank, tag, counts, data, out) }
    }

    /// The all-gather of every rank's piece into `out` (Σ `counts` values, pieces in
    /// rank order): this rank's from `mine` (`counts[rank]` values), or, with
    /// `None`, already in its place in `out`.
    ///
    /// # Safety
    /// As [`Ring::reduce`]'s, `mine` standing for `data`.
    pub unsafe fn all_gather(
        comm: ffi::MPI_Comm,
        rank: usize,
        tag: i32,
        counts: &[usize],
        mine: Option<&[T]>,
        out: &mut [T],
    ) -> Ring<T> {
        assert_eq!(counts.iter().sum::<usize>(), out.len());
        let data = match mine {
            Some(mine) => {
                assert_eq!(mine.len(), counts[rank]);
                mine.as_ptr()
            }
            None => std::ptr::null(),
        };
        // SAFETY: the caller's contract.
        unsafe { Ring::with(Shape::AllGather, comm, rank, tag, counts, data, out) }
    }

    /// # Safety
    /// The constructors' contracts, `data` and `out` checked against `shape` by them.
    unsafe fn with(
        shape: Shape,
        comm: ffi::MPI_Comm,
        rank: usize,
        tag: i32,
        counts: &[usize],
        data: *const T,
        out: &mut [T],
    ) -> Ring<T> {
        let size = counts.len();
        assert!(rank < size);
        let largest = counts.iter().copied().max().unwrap_or(0);
        assert!(largest <= i32::MAX as usize, "an MPI message too large");
        let mut starts = Vec::with_capacity(size);
        let mut at = 0;
        for &n in counts {
            starts.push(at);
            at += n;
        }
        Ring {
            shape,
            comm,
            rank,
            size,
            tag,
            counts: counts.to_vec(),
            starts,
            data,
            out: out.as_mut_ptr(),
            scratch: [Vec::new(), Vec::new()],
            round: 0,
            started: false,
            requests: [ffi::RSMPI_REQUEST_NULL; 2],
        }
    }

    /// Rounds of the reduce-scatter phase (none in an all-gather).
    fn reduce_rounds(&self) -> usize {
        match self.shape {
            Shape::AllGather => 0,
            _ => self.size - 1,
        }
    }

    /// Rounds in all.
    fn rounds(&self) -> usize {
        match self.shape {
            Shape::ReduceScatter | Shape::AllGather => self.size - 1,
            Shape::AllReduce => 2 * (self.size - 1),
        }
    }

    /// Allocates the scratch and starts round 0 (one rank: copies its piece).
    pub fn begin(&mut self) {
        assert!(!self.started, "a ring starts once");
        self.started = true;
        if self.reduce_rounds() > 0 {
            let buffers = scratch_buffers(self.size);
            let largest = self.counts.iter().copied().max().unwrap_or(0);
            for buf in &mut self.scratch[..buffers] {
                *buf = vec![0.0; largest];
            }
        }
        let own = self.counts[self.rank];
        match self.shape {
            // One rank: its contribution is the sum.
            Shape::ReduceScatter | Shape::AllReduce if self.size == 1 => {
                // SAFETY: `data` and this rank's place in `out` hold its whole piece
                // and are distinct buffers (the constructors' contract).
                unsafe { std::ptr::copy_nonoverlapping(self.data, self.piece_out(0), own) };
            }
            Shape::AllGather if !self.data.is_null() => {
                // SAFETY: `data` holds this rank's piece and its place in `out` has
                // room for it; they do not overlap (the contract of `all_gather`).
                let into = self.piece_out(self.rank);
                unsafe { std::ptr::copy_nonoverlapping(self.data, into, own) };
            }
            _ => {}
        }
        if !self.done() {
            // SAFETY: round 0 of a ring just begun; the constructors' contract covers
            // the caller's buffers.
            unsafe { self.post(0) };
        }
    }

    /// Whether [`Ring::begin`] has run.
    pub fn begun(&self) -> bool {
        self.started
    }

    /// Whether every round has completed: the output holds the result.
    pub fn done(&self) -> bool {
        self.started && self.round >= self.rounds()
    }

    /// The piece `k` places before this rank's, cyclically.
    fn back(&self, k: usize) -> usize {
        (self.rank + 2 * self.size - k) % self.size
    }

    /// Where piece `q`'s result goes in the output (a reduce-scatter's output is
    /// this rank's piece alone).
    fn piece_out(&self, q: usize) -> *mut T {
        match self.shape {
            Shape::ReduceScatter => {
                debug_assert_eq!(q, self.rank);
                self.out
            }
            // SAFETY: a whole bucket's output: piece `q` starts inside it.
            _ => unsafe { self.out.add(self.starts[q]) },
        }
    }

    /// Where reduce-scatter round `j` receives: this rank's place in the output in
    /// the last round, else a scratch buffer, alternating.
    fn landing(&mut self, j: usize) -> *mut T {
        match j + 1 == self.reduce_rounds() {
            true => self.piece_out(self.rank),
            // A scratch buffer: f32-aligned, which suits every `T` (f32, Bf16).
            false => self.scratch[(self.size - 3 - j) % 2].as_mut_ptr() as *mut T,
        }
    }

    /// Starts round `j`'s send and receive.
    ///
    /// # Safety
    /// Round `j − 1` has completed (what it received is in place).
    unsafe fn post(&mut self, j: usize) {
        let rs = self.reduce_rounds();
        let (sent, received, from, into) = if j < rs {
            let (sent, received) = (self.back(j + 1), self.back(j + 2));
            let from = match j {
                // SAFETY: the sent piece lies inside `data` (the starts tile it).
                0 => unsafe { self.data.add(self.starts[sent]) },
                _ => self.landing(j - 1) as *const T,
            };
            (sent, received, from, self.landing(j))
        } else {
            let (sent, received) = (self.back(j - rs), self.back(j - rs + 1));
            let from = self.piece_out(sent) as *const T;
            (sent, received, from, self.piece_out(received))
        };
        let right = ((self.rank + 1) % self.size) as i32;
        let left = ((self.rank + self.size - 1) % self.size) as i32;
        // SAFETY: `from` holds the sent piece's count (data, the buffer that received
        // it last round, or its place in the output) and `into` the received one's (a
        // scratch buffer holds the largest piece, the output every piece it is
        // given); both stay allocated and untouched until the requests complete (the
        // ring owns the scratch and the caller's contract covers the rest), and a
        // round's two buffers never overlap (distinct pieces or buffers).
        unsafe {
            ffi::MPI_Irecv(
                into as *mut _,
                self.counts[received] as i32,
                T::datatype(),
                left,
                self.tag,
                self.comm,
                &mut self.requests[1],
            );
            ffi::MPI_Isend(
                from as *const _,
                self.counts[sent] as i32,
                T::datatype(),
                right,
                self.tag,
                self.comm,
                &mut self.requests[0],
            );
        }
    }

    /// After the round in flight has completed: in the reduce-scatter phase adds this
    /// rank's gradients to the piece received; starts the next round.
    fn next_round(&mut self) {
        let j = self.round;
        if j < self.reduce_rounds() {
            let q = self.back(j + 2);
            let n = self.counts[q];
            let into = self.landing(j);
            // SAFETY: the round's receive has completed, so its landing buffer holds
            // `n` values that MPI no longer touches; `data` holds piece `q` at its
            // start (the caller's contract), and the two do not overlap (data is the
            // caller's input, landing buffers the ring's scratch or the output).
            let (sum, own) = unsafe {
                (
                    std::slice::from_raw_parts_mut(into, n),
                    std::slice::from_raw_parts(self.data.add(self.starts[q]), n),
                )
            };
            T::add(sum, own);
        }
        self.round += 1;
        if !self.done() {
            // SAFETY: round j has completed and what it received is in place.
            unsafe { self.post(self.round) };
        }
    }

    /// Moves the ring on without blocking: completes every round whose messages
    /// have arrived. Returns whether the ring is done.
    pub fn advance(&mut self) -> bool {
        assert!(self.started, "a ring advances once begun");
        while !self.done() {
            let mut flag = 0;
            // SAFETY: the two requests of the round in flight, started by `post`.
            unsafe {
                ffi::MPI_Testall(
                    2,
                    self.requests.as_mut_ptr(),
                    &mut flag,
                    ffi::RSMPI_STATUSES_IGNORE,
                )
            };
            if flag == 0 {
                return false;
            }
            self.next_round();
        }
        true
    }

    /// Blocks until every round has completed (beginning the ring if needed).
    pub fn finish(&mut self) {
        if !self.started {
            self.begin();
        }
        while !self.done() {
            // SAFETY: the two requests of the round in flight, started by `post`.
            unsafe { ffi::MPI_Waitall(2, self.requests.as_mut_ptr(), ffi::RSMPI_STATUSES_IGNORE) };
            self.next_round();
        }
    }
}

impl<T: Element> Drop for Ring<T> {
    /// A ring begun is finished before it is dropped (its caller waits for it):
    /// MPI must not be left writing into buffers that go away.
    fn drop(&mut self) {
        if self.started {
            self.finish();
        }
    }
}

/// Rings of several buckets in flight, begun in the order added (the same on every
/// rank): at most `limit` at once (each holds scratch); the others wait their turn.
pub struct Rings<T: Element> {
    limit: usize,
    running: Vec<Ring<T>>,
    /// Begun once a running one is done, first come first.
    queued: std::collections::VecDeque<Ring<T>>,
}

impl<T: Element> Rings<T> {
    pub fn new(limit: usize) -> Rings<T> {
        Rings {
            limit: limit.max(1),
            running: Vec::new(),
            queued: Default::default(),
        }
    }

    /// Adds a ring not yet begun: it begins now if fewer than the limit are
    /// running, else after the ones before it. Every rank adds the same rings in
    /// the same order, so a ring waits only for earlier ones, which every rank
    /// drives.
    pub fn add(&mut self, ring: Ring<T>) {
        self.queued.push_back(ring);
        self.advance();
    }

    /// Moves every running ring on without blocking, and begins queued ones in
    /// the room the finished ones leave. Returns whether all are done.
    pub fn advance(&mut self) -> bool {
        loop {
            self.running.retain_mut(|r| !r.advance());
            if self.running.len() >= self.limit || self.queued.is_empty() {
                break;
            }
            while self.running.len() < self.limit {
                let Some(mut ring) = self.queued.pop_front() else {
                    break;
                };
                ring.begin();
                self.running.push(ring);
            }
        }
        self.running.is_empty() && self.queued.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::bf16::round;

    /// A bf16 ring's partial sum: in f32 from two bf16 values, rounded to bf16 (1 +
    /// 2⁻⁸ is a tie between 1 and 1 + 2⁻⁷: to even, 1), as `Reduce::AllReduceBf16`
    /// says; f32 adds plainly.
    #[test]
    fn partial_sums_round_as_the_bf16_reduction_does() {
        let mut sum = [1.0f32, 0.75, -3.0].map(Bf16::from_f32);
        let own = [2f32.powi(-8), 2f32.powi(-8), 0.5].map(Bf16::from_f32);
        Bf16::add(&mut sum, &own);
        let want = [1.0, round(0.75 + 2f32.powi(-8)), -2.5];
        assert_eq!(sum.map(Bf16::to_f32), want);
        assert_ne!(want[0], 1.0 + 2f32.powi(-8), "rounded");
        let mut sum = [1.0f32, 0.75];
        f32::add(&mut sum, &[2f32.powi(-8), 0.25]);
        assert_eq!(sum, [1.0 + 2f32.powi(-8), 1.0]);
    }
}
