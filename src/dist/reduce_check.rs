//! `nanogpt doctor`'s check of the collectives training runs on (our rings by
//! default): integer-valued gradients (every sum exact, in any order) reduced the
//! way training reduces them (during backward at stages 0-2, started one bucket at
//! a time at stage 3; stages 0 and 1 with bf16 on the wire too, where these small
//! integers and their sums are exact) must give exactly what MPI's blocking
//! collectives give (`MPI_Reduce_scatter`; `MPI_Allreduce` in f64 for stage 0), and
//! the weights' all-gathers (stages 1-2 as a group in flight, stage 3 in place)
//! must put every rank's piece in its place. A round skipped or a piece misplaced
//! changes a sum or a value.

use super::{Collective, GatherPart, GradPlan, Pending, Reduce, Reported};
use std::ops::Range;

/// Bucket lengths: a large one, short ones whose pieces are uneven, and (from 3
/// ranks) empty pieces.
const LENGTHS: [usize; 5] = [100_003, 10, 7, 2, 1];

/// Rank `rank`'s gradient `i`: a small integer, different on every rank (|sums| ≤
/// 256 up to 8 ranks: exact in bf16 too).
fn gradient(i: usize, rank: usize) -> f32 {
    ((i * 7 + rank * 13) % 61) as f32 - 30.0
}

/// Compares every ZeRO stage's reduction with MPI's blocking collectives, and the
/// all-gathers with the pieces they gather (a collective: every rank calls it).
/// Returns what it compared, or the first difference.
pub fn check_reductions(comm: &dyn Collective) -> Result<String, String> {
    let (w, rank) = (comm.world_size(), comm.rank());
    let ranges = bucket_ranges();
    let len = ranges.last().map_or(0, |r| r.end);
    let grads: Vec<f32> = (0..len).map(|i| gradient(i, rank)).collect();
    let whole = sums_in_f64(comm, &grads);
    for (stage, bf16) in [
        (0u8, false),
        (0, true),
        (1, false),
        (1, true),
        (2, false),
        (3, false),
    ] {
        let plan = GradPlan::new(&ranges, len, w, rank, stage);
        let got = reduce_as_training_does(comm, &plan, &grads, bf16);
        for (b, bucket) in plan.buckets.iter().enumerate() {
            let (mine, want) = match stage {
                0 => (
                    &got[bucket.recv.clone()],
                    whole[bucket.arena.clone()].to_vec(),
                ),
                _ => {
                    let mut want = vec![0.0; bucket.counts[rank]];
                    let grads = &grads[bucket.arena.clone()];
                    comm.reduce_scatter_pieces(grads, &mut want, &bucket.counts);
                    (&got[bucket.recv.start..][..want.len()], want)
                }
            };
            if let Some(i) = (0..want.len()).find(|&i| mine[i].to_bits() != want[i].to_bits()) {
                return Err(format!(
                    "the ZeRO-{stage} gradient reduction ({}{}) differs from MPI's \
                     blocking {}: bucket {b} (pieces {:?}), rank {rank}'s float {i} \
                     is {} instead of {}",
                    comm.reduction_name(),
                    if bf16 { ", bf16 on the wire" } else { "" },
                    if stage == 0 {
                        "MPI_Allreduce"
                    } else {
                        "MPI_Reduce_scatter"
                    },
                    bucket.counts,
                    mine[i],
                    want[i]
                ));
            }
        }
    }
    check_gathers(comm, &ranges)?;
    Ok(format!(
        "{}: reductions = MPI_Allreduce / MPI_Reduce_scatter (ZeRO 0-3, and ZeRO 0-1 \
         in bf16), all-gathers exact (ZeRO 1-3), buckets of {LENGTHS:?} floats",
        comm.reduction_name()
    ))
}

/// The buckets of [`LENGTHS`], one after the other.
fn bucket_ranges() -> Vec<Range<usize>> {
    let mut at = 0;
    let ranges = LENGTHS.map(|n| {
        at += n;
        at - n..at
    });
    ranges.to_vec()
}

/// Every rank's `grads` summed, by MPI in f64 (exact for these integers).
fn sums_in_f64(comm: &dyn Collective, grads: &[f32]) -> Vec<f32> {
    let mut sums: Vec<f64> = grads.iter().map(|&g| g as f64).collect();
    comm.all_reduce_sum_f64(&mut sums);
    sums.into_iter().map(|s| s as f32).collect()
}

/// The weights' all-gathers as training runs them: every bucket's at once, left
/// in flight and waited for in order (stages 1-2, from the shard), and one by one
/// in place (stage 3). Rank `q`'s piece holds `gradient(i, q)`: each value says
/// which rank it came from.
fn check_gathers(comm: &dyn Collective, ranges: &[Range<usize>]) -> Result<(), String> {
    let (w, rank) = (comm.world_size(), comm.rank());
    let len = ranges.last().map_or(0, |r| r.end);
    let plan = GradPlan::new(ranges, len, w, rank, 1);
    let mut want = vec![0.0; len];
    for b in 0..plan.buckets.len() {
        for q in 0..w {
            plan.piece(b, q).for_each(|i| want[i] = gradient(i, q));
        }
    }
    let mut shard = vec![0.0; plan.shard_len];
    plan.pack_shard(rank, &want, &mut shard);
    let parts: Vec<GatherPart> = (plan.buckets.iter().enumerate())
        .map(|(b, bucket)| GatherPart {
            from: plan.slot(b)..plan.slot(b) + bucket.counts[rank],
            into: bucket.arena.clone(),
            counts: &bucket.counts,
        })
        .collect();
    let mut grouped = vec![f32::NAN; len];
    // SAFETY: nothing reads or writes `shard` or `grouped` until every gather has
    // been waited for, just below; both outlive the waits.
    for gather in unsafe { comm.start_all_gathers(&shard, &mut grouped, &parts) } {
        gather.wait();
    }
    let mut in_place = vec![f32::NAN; len];
    for (b, bucket) in plan.buckets.iter().enumerate() {
        let own = plan.piece(b, rank);
        in_place[own.clone()].copy_from_slice(&want[own]);
        // SAFETY: the bucket is neither read nor written until the wait just after.
        unsafe {
            comm.start_all_gather_in_place(&mut in_place[bucket.arena.clone()], &bucket.counts)
        }
        .wait();
    }
    for (what, got) in [("in flight as a group", &grouped), ("in place", &in_place)] {
        if let Some(i) = (0..len).find(|&i| got[i].to_bits() != want[i].to_bits()) {
            return Err(format!(
                "the weights' all-gather {what} ({}) put {} at float {i} on rank {rank} \
                 instead of {}",
                comm.reduction_name(),
                got[i],
                want[i]
            ));
        }
    }
    Ok(())
}

/// This rank's pieces of the sum, at each bucket's `recv` range, reduced as stage
/// `plan.zero_stage` does during training (`bf16`: on the wire, stages 0 and 1;
/// stage 0's is the whole sum).
fn reduce_as_training_does(
    comm: &dyn Collective,
    plan: &GradPlan,
    grads: &[f32],
    bf16: bool,
) -> Vec<f32> {
    let mut recv = vec![f32::NAN; plan.recv_len];
    let arenas: Vec<Range<usize>> = plan.buckets.iter().map(|b| b.arena.clone()).collect();
    if plan.zero_stage < 3 {
        let kind = match (plan.zero_stage, bf16) {
            (0, false) => Reduce::AllReduce,
            (0, true) => Reduce::AllReduceBf16,
            (1, false) => Reduce::ReduceScatter,
            (1, true) => Reduce::ReduceScatterBf16,
            _ => Reduce::ReducePieces,
        };
        let mut send = vec![f32::NAN; plan.send_len];
        comm.reduce_during_backward(kind, &plan.buckets, &mut send, &mut recv, &mut |hook| {
            for a in &arenas {
                hook(Reported::Final(a.clone(), grads));
            }
        });
        return recv;
    }
    // Stage 3: one reduction per bucket, all in flight before the first wait.
    let mut outs: Vec<Vec<f32>> = plan
        .buckets
        .iter()
        .map(|b| vec![f32::NAN; b.counts[plan.rank]])
        .collect();
    let mut pending: Vec<Box<dyn Pending + '_>> = Vec::new();
    for (b, out) in plan.buckets.iter().zip(outs.iter_mut()) {
        // SAFETY: `grads` is not written and `out` neither read nor written until
        // every reduction has been waited for below; both outlive the waits.
        pending.push(unsafe {
            comm.start_reduce_scatter_pieces(&grads[b.arena.clone()], out, &b.counts)
        });
    }
    for p in pending {
        p.wait();
    }
    for (b, out) in plan.buckets.iter().zip(&outs) {
        recv[b.recv.start..][..out.len()].copy_from_slice(out);
    }
    recv
}
