//! `nanogpt doctor`'s check of the gradient reductions of ZeRO 1-3: integer-valued
//! gradients (every sum exact, in any order) reduced the way training reduces them
//! (during backward at stages 1 and 2, started one bucket at a time at stage 3;
//! stage 1 with bf16 on the wire too, where these small integers and their sums are
//! exact) must give exactly what the blocking `MPI_Reduce_scatter` gives. With our ring
//! (the default), this compares it with MPI's own algorithm; a round skipped or a
//! piece misplaced changes a sum.

use super::{Collective, GradPlan, Pending, Reduce};
use std::ops::Range;

/// Bucket lengths: a large one, short ones whose pieces are uneven, and (from 3
/// ranks) empty pieces.
const LENGTHS: [usize; 5] = [100_003, 10, 7, 2, 1];

/// Rank `rank`'s gradient `i`: a small integer, different on every rank (|sums| ≤
/// 256 up to 8 ranks: exact in bf16 too).
fn gradient(i: usize, rank: usize) -> f32 {
    ((i * 7 + rank * 13) % 61) as f32 - 30.0
}

/// Compares every ZeRO stage's reduction with `MPI_Reduce_scatter` (a collective:
/// every rank calls it). Returns what it compared, or the first difference.
pub fn check_reductions(comm: &dyn Collective) -> Result<String, String> {
    let (w, rank) = (comm.world_size(), comm.rank());
    let mut ranges = Vec::new();
    let mut at = 0;
    for n in LENGTHS {
        ranges.push(at..at + n);
        at += n;
    }
    let grads: Vec<f32> = (0..at).map(|i| gradient(i, rank)).collect();
    for (stage, bf16) in [(1u8, false), (1, true), (2, false), (3, false)] {
        let plan = GradPlan::new(&ranges, at, w, rank, stage);
        let got = reduce_as_training_does(comm, &plan, &grads, bf16);
        for (b, bucket) in plan.buckets.iter().enumerate() {
            let mut want = vec![0.0; bucket.counts[rank]];
            comm.reduce_scatter_pieces(&grads[bucket.arena.clone()], &mut want, &bucket.counts);
            let mine = &got[bucket.recv.start..][..want.len()];
            if let Some(i) = (0..want.len()).find(|&i| mine[i].to_bits() != want[i].to_bits()) {
                return Err(format!(
                    "the ZeRO-{stage} gradient reduction ({}{}) differs from \
                     MPI_Reduce_scatter: bucket {b} (pieces {:?}), rank {rank}'s float {i} \
                     is {} instead of {}",
                    comm.reduction_name(),
                    if bf16 { ", bf16 on the wire" } else { "" },
                    bucket.counts,
                    mine[i],
                    want[i]
                ));
            }
        }
    }
    Ok(format!(
        "{} = MPI_Reduce_scatter (ZeRO 1-3 and ZeRO-1 in bf16, buckets of {LENGTHS:?} floats)",
        comm.reduction_name()
    ))
}

/// This rank's pieces of the sum, at each bucket's `recv` range, reduced as stage
/// `plan.zero_stage` does during training (`bf16`: on the wire, stage 1).
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
            (1, false) => Reduce::ReduceScatter,
            (1, true) => Reduce::ReduceScatterBf16,
            _ => Reduce::ReducePieces,
        };
        let mut send = vec![f32::NAN; plan.send_len];
        comm.reduce_during_backward(kind, &plan.buckets, &mut send, &mut recv, &mut |hook| {
            for a in &arenas {
                hook(a.clone(), grads);
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
