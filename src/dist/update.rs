//! The optimizer update of a training step, one code path for every world size and
//! ZeRO stage: the global gradient norm, the skip of a step whose loss or norm is
//! not finite, clipping (folded into AdamW) and the AdamW step. The cases differ
//! only in the gradients this rank's optimizer owns and in how its update reaches
//! the other ranks:
//!
//! ```text
//!                  gradients owned        sum of squares         after the step
//! one process      all (model.grads)      its own                -
//! ZeRO 0, W ranks  all, summed over ranks its own (= everyone's) - (all step alike)
//! ZeRO 1, W ranks  its shard of the sum   all-reduced            all-gather
//! ZeRO 2, W ranks  its shard of the sum   all-reduced            all-gather by bucket
//! ZeRO 3, W ranks  its shard of the sum   all-reduced            - (weights sharded)
//! ```

use super::{Collective, DataParallel};
use crate::model::Gpt;
use crate::optim::{clip_factor, grad_sq_sum, AdamW};
use crate::profile::{self, Section};

/// What the update of one optimizer step did.
#[derive(Clone, Copy, Debug)]
pub struct Update {
    /// The global gradient norm before clipping.
    pub grad_norm: f32,
    /// False when the loss or the norm was not finite and the step was skipped:
    /// parameters and AdamW state are untouched on every rank.
    pub applied: bool,
    /// The step also zeroed `model.grads` and refreshed the bf16 weight copy
    /// ([`Gpt::step_adamw`]: one process and ZeRO 0, when applied).
    pub fused: bool,
}

/// The settings of one step's update.
#[derive(Clone, Copy, Debug)]
pub struct StepSettings {
    /// The learning rate of this step.
    pub lr: f32,
    /// The global gradient norm to clip to; 0 or less: no clipping.
    pub grad_clip: f32,
}

/// Clips the gradients to the global norm `settings.grad_clip` and takes the AdamW
/// step at `settings.lr`, after backward (and, with several ranks, the reduction of
/// [`DataParallel::backward_reduce`]; `dp` is `None` on one process). The step is
/// skipped unless both `loss_finite` and the norm are finite; both are global
/// values, so every rank decides alike and, skipping, changes nothing (the replicas
/// stay equal without a gather).
pub fn clip_and_step(
    dp: Option<&mut DataParallel>,
    comm: &dyn Collective,
    model: &mut Gpt,
    opt: &mut AdamW,
    settings: StepSettings,
    loss_finite: bool,
) -> Update {
    // Replicated ranks (ZeRO 0) own the whole summed gradient, as one process does.
    let mut shard = dp.filter(|dp| dp.plan.zero_stage > 0);
    let owned: &[f32] = match &shard {
        None => &model.grads,
        Some(dp) => dp.shard_grads(),
    };
    let sq_sum = {
        let _t = profile::scope(Section::GradNorm);
        grad_sq_sum(owned)
    };
    let sq_sum = match shard.as_deref_mut() {
        None => sq_sum,
        Some(dp) => dp.sum_over_ranks(comm, sq_sum),
    };
    let grad_norm = sq_sum.sqrt() as f32;
    let applied = loss_finite && grad_norm.is_finite();
    let mut fused = false;
    if applied {
        let (lr, factor) = (settings.lr, clip_factor(grad_norm, settings.grad_clip));
        match shard {
            None => {
                model.step_adamw(opt, lr, factor);
                fused = true;
            }
            Some(dp) => dp.step_shard(comm, opt, &mut model.params, lr, factor),
        }
    }
    Update {
        grad_norm,
        applied,
        fused,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dist::Single;
    use crate::model::ModelConfig;
    use crate::optim::{grad_norm, AdamWConfig};

    const SETTINGS: StepSettings = StepSettings {
        lr: 1e-2,
        grad_clip: 1.0,
    };

    /// A one-layer model with gradients large enough to be clipped.
    fn model_with_grads() -> Gpt {
        let config = ModelConfig {
            vocab_size: 8,
            block_size: 4,
            n_layer: 1,
            n_head: 1,
            n_embd: 4,
            bias: true,
            dropout: 0.0,
            llama: None,
        };
        let mut model = Gpt::new(config, 1, 4).unwrap();
        model.init_gpt2(7);
        for (i, g) in model.grads.iter_mut().enumerate() {
            *g = (i % 11) as f32 * 0.3 - 1.5;
        }
        model
    }

    /// One process: the bits of computing the norm, clipping and stepping by hand.
    #[test]
    fn one_process_is_norm_then_clipped_step() {
        let mut model = model_with_grads();
        let mut opt = AdamW::new(&model.layout.decay_ranges(), AdamWConfig::default());
        let mut want_opt = AdamW::new(&model.layout.decay_ranges(), AdamWConfig::default());
        let mut want = model.params.clone();
        let norm = grad_norm(&model.grads);
        assert!(norm > SETTINGS.grad_clip, "the test must clip");
        let factor = clip_factor(norm, SETTINGS.grad_clip);
        want_opt.step_scaled(&mut want, &model.grads, SETTINGS.lr, factor);
        let update = clip_and_step(None, &Single, &mut model, &mut opt, SETTINGS, true);
        assert_eq!((update.grad_norm, update.applied), (norm, true));
        assert_eq!(model.params, want);
        assert_eq!((opt.m, opt.v, opt.step), (want_opt.m, want_opt.v, 1));
    }

    #[test]
    fn a_non_finite_loss_or_norm_skips_the_step() {
        let mut model = model_with_grads();
        let mut opt = AdamW::new(&model.layout.decay_ranges(), AdamWConfig::default());
        let before = model.params.clone();
        let update = clip_and_step(None, &Single, &mut model, &mut opt, SETTINGS, false);
        assert!(update.grad_norm.is_finite() && !update.applied);
        model.grads[3] = f32::INFINITY;
        let update = clip_and_step(None, &Single, &mut model, &mut opt, SETTINGS, true);
        assert!(!update.grad_norm.is_finite() && !update.applied);
        assert_eq!(model.params, before);
        assert_eq!(opt.step, 0);
        assert!(opt.m.iter().chain(&opt.v).all(|&x| x == 0.0));
    }
}
