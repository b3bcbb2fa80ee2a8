//! Where each gradient bucket travels, and (ZeRO 1-3) which rank owns which part of
//! the arena.
//!
//! Buckets are the ranges `Gpt::grad_buckets` reports, in backward order. With ZeRO
//! stage 0 a bucket is all-reduced in place of itself: send and receive buffers have
//! the arena's layout. With stage 1, bucket `b` of `n_b` floats is cut into
//! `world_size` pieces of `p_b = ⌈n_b / W⌉` floats (the last ones may be short or
//! empty); rank `q` owns piece `q` of every bucket. Its shard — optimizer moments,
//! reduced gradients — stores those pieces one after the other, piece `b` at slot
//! `S_b = Σ_{b'<b} p_b'`, `S = Σ p_b` floats in all, the same for every rank. The
//! send buffer holds bucket `b` at `P_b = W · S_b`, zero-padded to `W · p_b`, so one
//! reduce-scatter per bucket delivers each rank its piece.
//!
//! Stages 2 and 3 cut the buckets the same way but need no send buffer: the pieces
//! of a bucket are consecutive ranges of the arena in rank order, so a reduce-scatter
//! with per-rank counts ([`Bucket::counts`]) reads the bucket straight from the
//! gradient arena, and an all-gather with the same counts writes it straight into
//! the parameters. Stage 3 keeps a scratch of two pieces (`send`, twice the largest
//! piece's length): a reduced piece lands there before it is added to the shard's
//! sum, and two reductions may be in flight at once (one bucket's starting while the
//! previous one's completes); its blocking collectives (start-up, checkpoints) copy
//! a piece to send into the first one (MPI's send and receive buffers must not
//! overlap).

use super::Reduce;
use std::ops::Range;

/// ZeRO-3: blocks whose weights a pass holds whole at once (one computed with, the
/// next one arriving).
pub const STAGE3_GATHERED_BLOCKS: usize = 2;
/// ZeRO-3: gradient reductions in flight at once (one bucket's starting while the
/// previous one's completes), each landing in its own piece of scratch.
pub const STAGE3_REDUCTIONS_IN_FLIGHT: usize = 2;

/// ZeRO 1-3 with the ring reduce-scatter (`dist::ring`): rings of buckets in
/// flight at once during backward, each holding its scratch; later buckets wait
/// their turn. (ZeRO-3 has [`STAGE3_REDUCTIONS_IN_FLIGHT`] by itself.)
pub const RINGS_IN_FLIGHT: usize = 2;

/// Scratch buffers of a ring reduce-scatter over `size` ranks: one per round but
/// the last (which lands in the output), two at most (they alternate).
pub fn ring_scratch_buffers(size: usize) -> usize {
    size.saturating_sub(2).min(2)
}

/// Floats of scratch a ring reduce-scatter of pieces `counts` holds: a buffer of
/// the largest piece per `ring_scratch_buffers`.
pub fn ring_scratch_len(counts: &[usize]) -> usize {
    ring_scratch_buffers(counts.len()) * counts.iter().copied().max().unwrap_or(0)
}

/// One gradient bucket of a [`GradPlan`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bucket {
    /// Its range of the arena.
    pub arena: Range<usize>,
    /// Its range of the send buffer (at least `arena.len()` floats).
    pub send: Range<usize>,
    /// Where this rank's result lands in the receive buffer.
    pub recv: Range<usize>,
    /// Floats of each rank's piece, in rank order (they tile `arena`): what it
    /// reduces and owns at stages 1-3, and at stage 0 the pieces a ring all-reduce
    /// sums by.
    pub counts: Vec<usize>,
}

/// The buckets and the shard layout of a data-parallel run.
#[derive(Clone, Debug)]
pub struct GradPlan {
    pub world_size: usize,
    pub rank: usize,
    /// 0 (replicated optimizer state), 1 (sharded moments), 2 (and gradients), 3
    /// (and parameters).
    pub zero_stage: u8,
    pub arena_len: usize,
    pub buckets: Vec<Bucket>,
    pub send_len: usize,
    pub recv_len: usize,
    /// Floats of every rank's shard (stages 1-3; the arena length at stage 0).
    pub shard_len: usize,
    /// Per bucket: piece length `p_b` and shard slot `S_b` (stages 1-3).
    pieces: Vec<(usize, usize)>,
}

impl GradPlan {
    /// The plan for buckets `ranges` (which tile `0..arena_len`) on `world_size`
    /// ranks, seen from `rank`.
    pub fn new(
        ranges: &[Range<usize>],
        arena_len: usize,
        world_size: usize,
        rank: usize,
        zero_stage: u8,
    ) -> GradPlan {
        assert!(rank < world_size && zero_stage <= 3);
        assert_eq!(
            ranges.iter().map(|r| r.len()).sum::<usize>(),
            arena_len,
            "buckets must tile the arena"
        );
        let w = world_size;
        let mut buckets = Vec::with_capacity(ranges.len());
        let mut pieces = Vec::with_capacity(ranges.len());
        let mut slot = 0;
        for r in ranges {
            let p = r.len().div_ceil(w);
            let counts = (0..w)
                .map(|q| (q * p).min(r.len())..((q + 1) * p).min(r.len()))
                .map(|piece| piece.len())
                .collect();
            if zero_stage == 0 {
                buckets.push(Bucket {
                    arena: r.clone(),
                    send: r.clone(),
                    recv: r.clone(),
                    counts,
                });
                pieces.push((r.len(), r.start));
            } else {
                let send = match zero_stage {
                    1 => w * slot..w * (slot + p),
                    2 => 0..0,
                    _ => 0..p,
                };
                buckets.push(Bucket {
                    arena: r.clone(),
                    send,
                    recv: slot..slot + p,
                    counts,
                });
                pieces.push((p, slot));
                slot += p;
            }
        }
        let largest = pieces.iter().map(|&(p, _)| p).max().unwrap_or(0);
        let (send_len, recv_len, shard_len) = match zero_stage {
            0 => (arena_len, arena_len, arena_len),
            1 => (w * slot, slot, slot),
            2 => (0, slot, slot),
            _ => (STAGE3_REDUCTIONS_IN_FLIGHT * largest, slot, slot),
        };
        GradPlan {
            world_size,
            rank,
            zero_stage,
            arena_len,
            buckets,
            send_len,
            recv_len,
            shard_len,
            pieces,
        }
    }

    /// Floats of the send buffer a reduction of `kind` (`ring`: with our rings)
    /// uses: none where it reads the gradients themselves (ZeRO-0's f32 ring
    /// all-reduce; stage 2 has none anyway), else `send_len`.
    pub fn send_len_for(&self, kind: Reduce, ring: bool) -> usize {
        match self.zero_stage == 0 && kind.reads_gradients(ring) {
            true => 0,
            false => self.send_len,
        }
    }

    /// ZeRO-3: floats of the arena a pass holds whole at once, weights and
    /// gradients each: the first and last buckets (`ln_f`, the embeddings) for the
    /// whole pass and `STAGE3_GATHERED_BLOCKS` of the largest block between them
    /// (weights: one computed with, the next arriving; gradients: one computed,
    /// the previous one being reduced). Buckets kept whole between passes count
    /// among these: the last two blocks from forward to backward, the first block
    /// with the embeddings and `ln_f` from backward to the next pass.
    pub fn gathered_len(&self) -> usize {
        self.ends_and_blocks(STAGE3_GATHERED_BLOCKS)
    }

    /// ZeRO-3 in bf16 mode: floats of the bf16 weight copy a pass holds at once.
    /// The copy of a bucket is rounded when its gather has completed and released
    /// with it: the first and last buckets and one block (the next block's copy is
    /// made after this one's is released).
    pub fn copied_len(&self) -> usize {
        self.ends_and_blocks(1)
    }

    /// The first and last buckets and `blocks` of the largest bucket between them.
    fn ends_and_blocks(&self, blocks: usize) -> usize {
        let whole = |b: &Bucket| b.arena.len();
        let n = self.buckets.len();
        let ends = self.buckets.first().map_or(0, whole) + self.buckets.last().map_or(0, whole);
        let middle = self.buckets.get(1..n.saturating_sub(1)).unwrap_or(&[]);
        ends + blocks * middle.iter().map(whole).max().unwrap_or(0)
    }

    /// The arena range of rank `q`'s piece of bucket `b` (stages 1-3; may be empty).
    pub fn piece(&self, b: usize, q: usize) -> Range<usize> {
        let arena = &self.buckets[b].arena;
        let p = self.pieces[b].0;
        let start = (arena.start + q * p).min(arena.end);
        start..(start + p).min(arena.end)
    }

    /// This rank's shard for `AdamW::for_shard`: (arena range, slot) of each piece.
    pub fn shard(&self) -> Vec<(Range<usize>, usize)> {
        if self.zero_stage == 0 {
            return vec![(0..self.arena_len, 0)];
        }
        (0..self.buckets.len())
            .map(|b| (self.piece(b, self.rank), self.pieces[b].1))
            .filter(|(r, _)| !r.is_empty())
            .collect()
    }

    /// The shard slot `S_b` of bucket `b` (stages 1-3).
    pub fn slot(&self, b: usize) -> usize {
        self.pieces[b].1
    }

    /// Copies rank `q`'s pieces of `arena` into `shard` (`shard_len` floats; the
    /// padding of short pieces is left alone).
    pub fn pack_shard(&self, q: usize, arena: &[f32], shard: &mut [f32]) {
        for b in 0..self.buckets.len() {
            let r = self.piece(b, q);
            let slot = self.pieces[b].1;
            shard[slot..slot + r.len()].copy_from_slice(&arena[r]);
        }
    }

    /// Copies rank `q`'s shard back into its pieces of `arena`.
    pub fn unpack_shard(&self, q: usize, shard: &[f32], arena: &mut [f32]) {
        for b in 0..self.buckets.len() {
            let r = self.piece(b, q);
            let slot = self.pieces[b].1;
            arena[r.clone()].copy_from_slice(&shard[slot..slot + r.len()]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TILES: [Range<usize>; 4] = [90..100, 40..90, 7..40, 0..7];

    #[test]
    fn stage_0_reduces_each_bucket_in_place() {
        let plan = GradPlan::new(&TILES, 100, 3, 1, 0);
        assert_eq!(
            (plan.send_len, plan.recv_len, plan.shard_len),
            (100, 100, 100)
        );
        for (b, t) in plan.buckets.iter().zip(TILES) {
            assert_eq!((&b.arena, &b.send, &b.recv), (&t, &t, &t));
        }
        assert_eq!(plan.shard(), vec![(0..100, 0)]);
    }

    #[test]
    fn stage_1_pieces_partition_every_bucket() {
        for w in 1..=4 {
            let plans: Vec<_> = (0..w)
                .map(|r| GradPlan::new(&TILES, 100, w, r, 1))
                .collect();
            let s = plans[0].shard_len;
            assert_eq!(plans[0].send_len, w * s);
            check_pieces(&plans);
            // Every arena float is owned by exactly one rank.
            let mut owner = vec![usize::MAX; 100];
            for (q, plan) in plans.iter().enumerate() {
                assert_eq!(plan.shard_len, s, "same shard size on every rank");
                for (range, slot) in plan.shard() {
                    assert!(slot + range.len() <= s);
                    for i in range {
                        assert_eq!(owner[i], usize::MAX, "owned twice");
                        owner[i] = q;
                    }
                }
            }
            assert!(owner.iter().all(|&o| o < w), "w={w}: {owner:?}");
            // Reduce-scatter of a bucket hands rank q its piece: send block q of the
            // bucket is exactly piece q of the arena.
            for (b, bucket) in plans[0].buckets.iter().enumerate() {
                let p = bucket.recv.len();
                assert_eq!(bucket.send.len(), w * p);
                for q in 0..w {
                    let piece = plans[0].piece(b, q);
                    assert_eq!(
                        piece.start,
                        (bucket.arena.start + q * p).min(bucket.arena.end)
                    );
                    assert_eq!(plans[q].buckets[b].recv, bucket.recv, "same slots");
                }
            }
            // Packing every rank's shard and unpacking it restores the arena.
            let arena: Vec<f32> = (0..100).map(|i| i as f32).collect();
            let mut back = vec![0.0; 100];
            for (q, plan) in plans.iter().enumerate() {
                let mut shard = vec![-1.0; s];
                plan.pack_shard(q, &arena, &mut shard);
                plan.unpack_shard(q, &shard, &mut back);
            }
            assert_eq!(back, arena);
        }
    }

    /// Each bucket's counts are its pieces, one after the other in rank order: what a
    /// reduce-scatter or all-gather with per-rank counts over the bucket delivers.
    fn check_pieces(plans: &[GradPlan]) {
        for (b, bucket) in plans[0].buckets.iter().enumerate() {
            assert_eq!(bucket.counts.len(), plans.len());
            assert_eq!(bucket.counts.iter().sum::<usize>(), bucket.arena.len());
            let mut at = bucket.arena.start;
            for (q, &n) in bucket.counts.iter().enumerate() {
                assert_eq!(plans[0].piece(b, q), at..at + n, "bucket {b} rank {q}");
                assert_eq!(plans[q].slot(b), plans[0].slot(b), "same slots");
                at += n;
            }
        }
    }

    #[test]
    fn stages_2_and_3_cut_the_same_pieces_without_a_padded_send_buffer() {
        for w in 1..=4 {
            for stage in [2u8, 3] {
                let plans: Vec<_> = (0..w)
                    .map(|r| GradPlan::new(&TILES, 100, w, r, stage))
                    .collect();
                let one = GradPlan::new(&TILES, 100, w, 0, 1);
                let s = one.shard_len;
                // Stage 2: no send buffer; stage 3: two of the largest piece, as
                // scratch (two reductions in flight).
                let largest = (0..TILES.len()).map(|b| one.piece(b, 0).len()).max();
                let send = if stage == 2 { 0 } else { 2 * largest.unwrap() };
                assert_eq!((plans[0].send_len, plans[0].recv_len), (send, s));
                check_pieces(&plans);
                for (q, plan) in plans.iter().enumerate() {
                    assert_eq!(plan.shard(), GradPlan::new(&TILES, 100, w, q, 1).shard());
                    for b in &plan.buckets {
                        assert!(b.send.end <= plan.send_len && b.recv.end <= s);
                    }
                }
            }
        }
    }
}
