//! The model: configuration, family description, parameter layout, activations, and
//! the forward and backward passes that string the kernels together, for GPT-2 and
//! the Llama architecture alike (the family, `family.rs`, says which pieces).
//!
//! ```text
//! x = drop(wte[tokens] (+ wpe))                     (B, T, C); Llama: no wpe (RoPE)
//! for each block:  x = x + drop(attn(norm_1(x)))     (block.rs)
//!                  x = x + drop(mlp(norm_2(x)))
//! loss = cross_entropy(norm_f(x) · Wᵀ, targets)      W: wte, or an untied lm_head;
//!                                                    logits never stored whole
//! ```

pub mod activations;
pub mod block;
pub mod config;
pub mod decode;
pub mod family;
pub mod init;
pub mod layout;
pub mod lora;
pub mod packs;
#[cfg(test)]
mod tests_bf16;
#[cfg(test)]
pub(crate) mod tests_llama;
#[cfg(test)]
mod tests_lora;

pub use activations::Activations;
pub use config::{Dtype, ModelConfig};
pub use layout::{ParamLayout, Span, TensorInfo};

use crate::kernels::bf16::{self, Backend};
use crate::kernels::classifier::{
    classifier_forward, classifier_logits, Classifier, ClassifierGrads,
};
use crate::kernels::dropout::{self, Dropout};
use crate::kernels::encoder::{encoder_backward, encoder_forward};
use crate::kernels::rope::RopeTable;
use crate::kernels::Dims;
use crate::optim::AdamW;
use crate::resident::release;
use anyhow::{bail, Context, Result};
use block::{attention_branch_backward, block_forward, mlp_backward};
use block::{norm_backward, norm_forward, norm_grads, split_two};
use block::{Attend, BlockDropout, BlockWeights};
use family::Family;
use lora::{BlockLora, Frozen, LoraConfig, LoraLayout};
use packs::Packs;
use std::borrow::Cow;
use std::ops::Range;

/// A model of any family: what it *is* — its config and family, the parameter
/// layout, the trained parameters and their gradients, and with LoRA the frozen base —
/// and, apart from that, what a step *uses*: the matmuls' `Precision` (with the
/// bf16 weights made from the parameters) and the `PassState` (activations and the
/// pass's settings).
///
/// `layout`, `params` and `grads` are the *trained* parameters: the whole model, or
/// with LoRA ([`Gpt::with_lora`]) the adapters, the base then being frozen in
/// [`Gpt::frozen`] without gradients. Optimizer, clipping, all-reduce and
/// checkpoints work on the trained arena either way.
pub struct Gpt {
    config: ModelConfig,
    /// What the blocks are made of (from `config`).
    family: Family,
    /// The rotary table of families with RoPE, for positions `0..block_size`.
    rope: Option<RopeTable>,
    pub layout: ParamLayout,
    /// All trained parameters, laid out by `layout`.
    pub params: Vec<f32>,
    /// Gradients, same layout as `params`.
    pub grads: Vec<f32>,
    /// LoRA: the frozen base model and the adapters' places. None: full training.
    frozen: Option<Box<Frozen>>,
    precision: Precision,
    pass: PassState,
}

/// The matmuls' precision and the bf16 weights made from the parameters for it.
struct Precision {
    /// Precision of the matmuls (see [`Gpt::set_dtype`]).
    dtype: Dtype,
    /// The kernel of the bf16 products and what follows from it: packs or a rounded
    /// copy (see [`Gpt::set_dtype`]).
    backend: Backend,
    /// bf16 mode on a kernel that reads no packs, or with lent weights: `params`
    /// rounded to bf16 (held as f32, same layout), the operand of every matmul;
    /// refreshed by [`Gpt::sync_bf16_weights`]. Empty otherwise: in f32 mode, and
    /// where the products run on AMX or AVX512-BF16, which read `params` (or `packs`
    /// made from them) and round while packing ([`Backend::keeps_bf16_copy`]).
    params_bf16: Vec<f32>,
    /// bf16 mode on AMX or AVX512-BF16, weights not lent: the bf16 `wte` and linear
    /// weights packed for the products that read them ([`packs`]), refreshed with
    /// `params_bf16` (with LoRA the frozen base's, packed once). None otherwise.
    packs: Option<Packs>,
    /// The weights are lent range by range through [`PassHooks`] (ZeRO-3, see
    /// [`Gpt::set_weights_lent`]): the bf16 copy is made per range.
    lent: bool,
    /// bf16 mode: the copy is stale and the next full forward rounds each range right
    /// after its `need` ([`Gpt::refresh_bf16_at_next_forward`]).
    bf16_owed: bool,
}

/// What a pass uses beside the weights, and what the training forward leaves for
/// backward.
struct PassState {
    acts: Activations,
    /// Activation checkpointing (see [`Gpt::set_activation_checkpointing`]).
    checkpointing: bool,
    /// Micro-steps per optimizer step when training (see [`Gpt::set_micro_steps`]).
    micro_steps: Option<usize>,
    /// The largest batch the activations hold: `max_b × max_t` tokens.
    max_b: usize,
    max_t: usize,
    training: bool,
    grad_scale: f32,
    /// Seed of the next training pass's dropout masks.
    dropout_seed: u64,
    /// The last training forward's shape and mask seed, which backward needs.
    pending: Option<(Dims, u64)>,
}

/// What a pass tells the code around it, one bucket of the trained arena at a time
/// (the ranges of [`Gpt::grad_buckets`]): weights about to be read, weights no longer
/// read, gradients final. ZeRO-3 gathers a bucket's weights from the ranks in `need`,
/// releases them in `done` and reduces its gradients in `grads_done`; every method
/// does nothing by default. Without LoRA only: with LoRA `need` and `done` are not
/// called (the frozen base is whole on every rank).
pub trait PassHooks {
    /// `params[range]` is about to be read.
    fn need(&mut self, _range: Range<usize>, _params: &mut [f32]) {}
    /// `params[range]` is not read again before the next `need` of it.
    fn done(&mut self, _range: Range<usize>, _params: &mut [f32]) {}
    /// Backward: `grads[range]` is final for this pass.
    fn grads_done(&mut self, _range: Range<usize>, _grads: &mut [f32]) {}
    /// Backward: halfway through each block (between its MLP's and its attention's
    /// backward), where nothing new is final: a moment to move communication on.
    fn midway(&mut self) {}
    /// Backward (without LoRA): report the embeddings' bucket first, before `ln_f`'s,
    /// and hand this pass's encoder gradient to [`PassHooks::encoder_grads`] instead
    /// of adding it to `grads`. Everything else in the bucket is final when backward
    /// starts: the classifier adds its share of `dwte` during the forward.
    fn embeddings_first(&self) -> bool {
        false
    }
    /// With [`PassHooks::embeddings_first`], at the end of backward: the gradient of
    /// the encoder's output `dout` (B, T, C; dropout applied) and the `tokens` (B, T)
    /// of rows of `t` positions, for the hook to add ([`EncoderGrad::add_to`]).
    fn encoder_grads(&mut self, _dout: &[f32], _tokens: &[u32], _t: usize) {}
}

/// One pass's encoder gradient held back from `dwte` and `dwpe`
/// ([`Gpt::backward_reporting`] with the embeddings first): row `i` of `dout` (B·T
/// rows of C) belongs to token `tokens[i]` and position `i % t`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EncoderGrad {
    pub dout: Vec<f32>,
    pub tokens: Vec<u32>,
    pub t: usize,
}

impl EncoderGrad {
    /// Adds the rows into the gradient arena's `window` (laid out by `layout`), held
    /// in `dst` (`window.len()` floats): row `i` into `dwte[tokens[i]]` and
    /// `dwpe[i % t]`, the parts of them inside the window only. Rows are added in
    /// order, so every rank adding the same rows gets the same bits.
    pub fn add_to(&self, layout: &ParamLayout, window: Range<usize>, dst: &mut [f32]) {
        add_encoder_rows(layout, (&self.dout, &self.tokens, self.t), window, dst);
    }
}

/// [`EncoderGrad::add_to`] of the rows `dout` of `tokens` (rows of `t` positions).
pub fn add_encoder_rows(
    layout: &ParamLayout,
    (dout, tokens, t): (&[f32], &[u32], usize),
    window: Range<usize>,
    dst: &mut [f32],
) {
    assert_eq!(dst.len(), window.len());
    if tokens.is_empty() {
        return;
    }
    let c = dout.len() / tokens.len();
    for (i, (&tok, row)) in tokens.iter().zip(dout.chunks_exact(c)).enumerate() {
        let wte = layout.wte.start + tok as usize * c;
        let wpe = layout.wpe.start + (i % t) * c;
        assert!(wte + c <= layout.wte.end);
        // Rotary families have no position table.
        let positions = (!layout.wpe.is_empty()).then_some(wpe);
        assert!(positions.is_none_or(|p| p + c <= layout.wpe.end));
        for at in std::iter::once(wte).chain(positions) {
            let (lo, hi) = (at.max(window.start), (at + c).min(window.end));
            if lo >= hi {
                continue;
            }
            let src = &row[lo - at..hi - at];
            let out = &mut dst[lo - window.start..hi - window.start];
            for (o, g) in out.iter_mut().zip(src) {
                *o += g;
            }
        }
    }
}

/// What [`Gpt::backward_reporting`] tells its caller, in the order backward reaches it.
pub enum Reported<'g> {
    /// `grads[range]` is final for this pass (`grads`: the whole gradient arena).
    Final(Range<usize>, &'g [f32]),
    /// Halfway through a block ([`PassHooks::midway`]).
    Midway,
}

/// [`PassHooks`] of [`Gpt::backward_reporting`] (and so of [`Gpt::backward_with`]):
/// each final bucket and each block's midway, in order, to the closure `report`.
struct Reporting<F> {
    report: F,
    embeddings_first: bool,
    held: EncoderGrad,
}
impl<F: FnMut(Reported)> PassHooks for Reporting<F> {
    fn grads_done(&mut self, range: Range<usize>, grads: &mut [f32]) {
        (self.report)(Reported::Final(range, grads))
    }
    fn midway(&mut self) {
        (self.report)(Reported::Midway)
    }
    fn embeddings_first(&self) -> bool {
        self.embeddings_first
    }
    fn encoder_grads(&mut self, dout: &[f32], tokens: &[u32], t: usize) {
        self.held = EncoderGrad {
            dout: dout.to_vec(),
            tokens: tokens.to_vec(),
            t,
        };
    }
}

/// A pass that tells nobody.
pub struct NoHooks;
impl PassHooks for NoHooks {}

impl Gpt {
    /// A model with all-zero parameters whose activations fit batches up to
    /// `max_b × max_t` (`max_t ≤ block_size`). Call [`Gpt::init_gpt2`] or fill `params`.
    pub fn new(config: ModelConfig, max_b: usize, max_t: usize) -> Result<Gpt> {
        config.validate().context("invalid model config")?;
        if max_t > config.block_size || max_b == 0 || max_t == 0 {
            bail!(
                "invalid model config: batch shape {max_b}×{max_t} must be at least 1×1 with \
                 T ≤ block_size ({})",
                config.block_size
            );
        }
        let layout = ParamLayout::new(&config);
        let acts = Activations::new(&config, max_b, max_t, Dtype::Float32, false);
        let family = config.family();
        let rope = rope_table(&family, config.block_size);
        Ok(Gpt {
            family,
            rope,
            params: vec![0.0; layout.len],
            grads: vec![0.0; layout.len],
            frozen: None,
            precision: Precision {
                dtype: Dtype::Float32,
                backend: Backend::portable(),
                params_bf16: Vec::new(),
                packs: None,
                lent: false,
                bf16_owed: false,
            },
            layout,
            pass: PassState {
                acts,
                checkpointing: false,
                micro_steps: None,
                max_b,
                max_t,
                training: true,
                grad_scale: 1.0,
                dropout_seed: 0,
                pending: None,
            },
            config,
        })
    }

    /// A model over an existing parameter buffer (laid out by `ParamLayout::new`).
    pub fn from_params(
        config: ModelConfig,
        params: Vec<f32>,
        max_b: usize,
        max_t: usize,
    ) -> Result<Gpt> {
        let mut gpt = Gpt::new(config, max_b, max_t)?;
        if params.len() != gpt.layout.len {
            bail!(
                "parameter buffer holds {} floats but this config needs {}",
                params.len(),
                gpt.layout.len
            );
        }
        gpt.params = params;
        Ok(gpt)
    }

    /// This model as the frozen base of LoRA adapters `lora`, initialised as PEFT
    /// does from `seed` (`B = 0`: the adapted model starts as the base). Its
    /// parameters become the base (named `base.0`, GPT-2-initialised from `base.1`
    /// when `scratch`; its fingerprint is taken here); `params`, `grads` and
    /// `layout` the adapters'.
    pub fn with_lora(mut self, lora: LoraConfig, base: (&str, u64), seed: u64) -> Gpt {
        assert!(self.frozen.is_none(), "the model already has adapters");
        let adapters = LoraLayout::new(&self.config, &lora);
        let len = adapters.params.len;
        let dtype = self.precision.dtype;
        let (rank, dropout) = (lora.rank, lora.dropout > 0.0);
        let state = lora::LoraState {
            config: lora,
            base: base.0.to_string(),
            base_seed: base.1,
            base_fingerprint: lora::fingerprint(&self.params),
            base_blocks: Some(lora::blocks_fingerprint(&self.params, &self.layout)),
        };
        let mut frozen = Frozen::new(
            std::mem::replace(&mut self.layout, adapters.params.clone()),
            std::mem::replace(&mut self.params, vec![0.0; len]),
            state,
            adapters,
        );
        frozen.set_dtype(Dtype::Float32, &self.precision.backend);
        lora::init_adapters(&mut self.params, &frozen.adapters, seed);
        self.grads = vec![0.0; len];
        self.frozen = Some(Box::new(frozen));
        // The bf16 copies for the adapted model, and the adapters' buffers beside the
        // arena, which stays: made again, its pages could all be touched at once
        // (the allocator zeroes reused memory), beside the whole f32 base.
        self.precision.dtype = Dtype::Float32;
        self.precision.params_bf16 = Vec::new();
        self.precision.packs = None;
        self.rebuild_weights(dtype);
        let (b, t) = (self.pass.max_b, self.pass.max_t);
        self.pass.acts.add_lora(&self.config, b * t, rank, dropout);
        self.sync_bf16_weights();
        self
    }

    /// LoRA: the frozen base and the adapters' settings; None for full training.
    pub fn frozen(&self) -> Option<&Frozen> {
        self.frozen.as_deref()
    }

    /// The base model's parameters, to write: `params` without LoRA. With LoRA,
    /// only for receiving rank 0's base at start-up (before [`Gpt::set_dtype`]: the
    /// bf16 copy and the fingerprint are not refreshed).
    pub fn base_params_mut(&mut self) -> &mut [f32] {
        match self.frozen.as_mut() {
            None => &mut self.params,
            Some(f) => &mut f.params,
        }
    }

    /// The base model's parameter layout: `layout` itself without LoRA.
    pub fn base_layout(&self) -> &ParamLayout {
        self.frozen.as_ref().map_or(&self.layout, |f| &f.layout)
    }

    /// LoRA: gives back the frozen base's f32 linears wherever a rounded bf16 copy
    /// or the packs hold them (bf16), now or as [`Gpt::set_dtype`] makes them,
    /// matrix by matrix or block by block: no pass reads them again
    /// ([`Frozen::release_linears`]). Returns the bytes given back now.
    pub fn release_frozen_linears(&mut self) -> usize {
        self.frozen.as_mut().map_or(0, |f| f.release_linears())
    }

    /// The whole model's parameters as one arena laid out by [`Gpt::base_layout`]:
    /// `params` itself, or with LoRA the base with the adapters merged in
    /// (`W + s·B·A`), for sampling and export.
    ///
    /// # Panics
    /// With LoRA after [`Gpt::release_frozen_linears`] gave memory back: merge into
    /// the base loaded again instead.
    pub fn merged_params(&self) -> Cow<'_, [f32]> {
        match &self.frozen {
            None => Cow::Borrowed(&self.params),
            Some(f) => Cow::Owned(f.merged(&self.params)),
        }
    }

    /// The architecture (fixed when the model is built: the buffers follow from it).
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The model family's description (from [`Gpt::config`]).
    pub fn family(&self) -> &Family {
        &self.family
    }

    /// Training FLOPs per token of sequences of `t` ([`ModelConfig::flops_per_token`]).
    /// With LoRA the frozen weights get no weight gradient: their matmuls cost 4·N
    /// (forward and input gradient) instead of 6·N, and the adapters' 6·A is added.
    pub fn flops_per_token(&self, t: usize) -> f64 {
        let full = self.config.flops_per_token(t);
        if self.frozen.is_none() {
            return full;
        }
        let base = self.config.matmul_params() as f64;
        let adapters: usize = (self.layout.tensors.iter())
            .map(|t| t.shape.iter().product::<usize>())
            .sum();
        full - 2.0 * base + 6.0 * adapters as f64
    }

    /// nanoGPT's GPT-2 initialisation from `seed` (see [`init::init_gpt2`]).
    pub fn init_gpt2(&mut self, seed: u64) {
        init::init_gpt2(&mut self.params, &self.layout, &self.config, seed);
    }

    /// Training mode (like `model.train()` in PyTorch): dropout is active and
    /// `forward` prepares `backward`. Off (`model.eval()`): neither.
    pub fn set_training(&mut self, on: bool) {
        self.pass.training = on;
        self.pass.pending = None;
    }

    /// Whether passes train (see [`Gpt::set_training`]).
    pub fn is_training(&self) -> bool {
        self.pass.training
    }

    /// Multiplies the gradients of the following backward passes, e.g. by
    /// `1 / gradient_accumulation_steps` so accumulated gradients are a mean.
    pub fn set_grad_scale(&mut self, scale: f32) {
        self.pass.grad_scale = scale;
    }

    /// Seeds the dropout masks of the next training forward (each forward then
    /// advances the seed). Set it per micro-step for runs that resume exactly.
    pub fn set_dropout_seed(&mut self, seed: u64) {
        self.pass.dropout_seed = seed;
    }

    /// Switches the matmul precision. `Bfloat16` is autocast: every matmul operand
    /// (weights, activations, output gradients) is rounded to bf16, products are
    /// accumulated in f32, and `params`, `grads` and everything outside the matmuls
    /// stay f32; activations that only feed matmuls are stored in bf16. Rebuilds the
    /// activation arena (call it before training, not in the step loop) and makes
    /// the bf16 copy of the weights. `backend` is the kernel the bf16 products run on,
    /// which decides whether the model packs its weights or keeps a rounded copy.
    pub fn set_dtype(&mut self, dtype: Dtype, backend: &Backend) {
        if (dtype, *backend) != (self.precision.dtype, self.precision.backend) {
            self.precision.backend = *backend;
            self.pass.acts = Activations::new(&self.config, 0, 0, Dtype::Float32, false);
            self.set_dtype_rebuild(dtype);
        } else {
            self.sync_bf16_weights();
        }
    }

    /// [`Gpt::set_dtype`] once the old activations are freed: the bf16 copies (with
    /// LoRA, the frozen base's, made once, and its packs), then the arena, so that a
    /// LoRA base whose f32 linears are given back as it is rounded or packed
    /// ([`Gpt::release_frozen_linears`]) never coexists whole with the activations.
    fn set_dtype_rebuild(&mut self, dtype: Dtype) {
        self.rebuild_weights(dtype);
        self.rebuild_activations(dtype, self.pass.checkpointing);
        self.sync_bf16_weights();
    }

    /// The bf16 copies and packs for `dtype` (with LoRA, the frozen base's, made
    /// once), before [`Gpt::sync_bf16_weights`] fills the trained arena's.
    fn rebuild_weights(&mut self, dtype: Dtype) {
        let bf16 = dtype == Dtype::Bfloat16;
        let len =
            self.precision
                .backend
                .bf16_copy_len(bf16, self.precision.lent, self.params.len());
        self.precision.params_bf16 = vec![0.0; len];
        self.precision.dtype = dtype;
        self.precision.packs = self.new_packs();
        self.pass.pending = None;
        if let Some(f) = self.frozen.as_mut() {
            f.set_dtype(dtype, &self.precision.backend);
            if let Some(packs) = self.precision.packs.as_mut() {
                f.pack_into(packs, &self.config);
            }
        }
    }

    /// Empty (stale) packs where the bf16 products read packs
    /// ([`Backend::packs_weights`]).
    fn new_packs(&self) -> Option<Packs> {
        let bf16 = self.precision.dtype == Dtype::Bfloat16;
        let made = self
            .precision
            .backend
            .packs_weights(bf16, self.precision.lent);
        let frozen = self.frozen.is_some();
        let linears = Packs::linears_pay(self.pass.micro_steps, self.pass.checkpointing, frozen);
        made.then(|| Packs::new(self.config.n_layer, linears))
    }

    /// Training: `n` micro-steps (forward and backward) per optimizer step on this
    /// rank. With one, and no activation checkpointing, the linear weights are
    /// packed per product rather than once per step ([`Packs::linears_pay`]: the same
    /// packing work, without holding the packs). Unset (evaluation, sampling), they
    /// are packed once. Set it before [`Gpt::set_dtype`].
    pub fn set_micro_steps(&mut self, n: usize) {
        self.pass.micro_steps = Some(n);
    }

    /// Bytes held by the bf16 weight copies (with LoRA the frozen base's too; 0
    /// where the model keeps none, [`Backend::keeps_bf16_copy`]).
    pub fn bf16_copy_bytes(&self) -> usize {
        let frozen = self.frozen.as_ref().map_or(0, |f| f.params_bf16.len());
        4 * (self.precision.params_bf16.len() + frozen)
    }

    /// Bytes held by the packed bf16 weights (0 without them).
    pub fn packs_bytes(&self) -> usize {
        self.precision.packs.as_ref().map_or(0, Packs::bytes)
    }

    /// Activation checkpointing: training forward keeps only each block's input (the
    /// previous block's output), and backward runs each block's forward again, with
    /// the same dropout masks, before differentiating it. The losses and gradients are
    /// bit-identical to a run without; the arena keeps one block's activations instead
    /// of every block's, for about one more forward pass of compute. Rebuilds the
    /// activation arena (call it before training, not in the step loop).
    pub fn set_activation_checkpointing(&mut self, on: bool) {
        if on != self.pass.checkpointing {
            self.rebuild_activations(self.precision.dtype, on);
            self.pass.checkpointing = on;
            self.pass.pending = None;
        }
    }

    /// A new activation arena: the old one is freed first, so the two never coexist.
    fn rebuild_activations(&mut self, dtype: Dtype, checkpointing: bool) {
        let (b, t) = (self.pass.max_b, self.pass.max_t);
        self.pass.acts = Activations::new(&self.config, 0, 0, Dtype::Float32, false);
        self.pass.acts = Activations::new(&self.config, b, t, dtype, checkpointing);
        if let Some(f) = self.frozen.as_deref() {
            let (r, drop) = (f.state.config.rank, f.state.config.dropout > 0.0);
            self.pass.acts.add_lora(&self.config, b * t, r, drop);
        }
    }

    /// Weights lent range by range (ZeRO-3): `params` holds a range only between
    /// the `need` and the `done` of it that hooked passes report ([`PassHooks`]).
    /// In bf16 mode the weight copy is then made per range — rounded from `params`
    /// right after its `need`, released (zero, its memory given back) at its `done`
    /// — and never as a whole ([`Gpt::sync_bf16_weights`] only releases it). Set it
    /// before [`Gpt::set_dtype`]. Without LoRA only (the hooks' ranges are the
    /// trained arena's).
    pub fn set_weights_lent(&mut self, on: bool) {
        assert!(!on || self.frozen.is_none(), "LoRA passes lend no weights");
        self.precision.lent = on;
        if on {
            self.precision.packs = None;
        }
        if self.precision.dtype == Dtype::Bfloat16 {
            // Lent weights keep a copy made per range on every kernel.
            let len = self
                .precision
                .backend
                .bf16_copy_len(true, on, self.params.len());
            self.precision.params_bf16.resize(len, 0.0);
        }
        release_lent_copy(
            on,
            0..self.precision.params_bf16.len(),
            &mut self.precision.params_bf16,
        );
        if on {
            // Every pass releases and refills most of these.
            for buf in [&self.params, &self.grads, &self.precision.params_bf16] {
                crate::resident::prefer_huge_pages(buf);
            }
        }
    }

    /// bf16 mode: re-rounds the weight copy the matmuls read from `params`, and
    /// repacks the packs. Call it whenever `params` changed (after each optimizer
    /// step, after loading); the micro-steps of one optimizer step share the copy.
    /// A no-op in f32 mode, and with lent weights (the passes round each range they
    /// receive).
    pub fn sync_bf16_weights(&mut self) {
        self.precision.bf16_owed = false;
        if self.precision.dtype == Dtype::Bfloat16 && !self.precision.lent {
            if !self.precision.params_bf16.is_empty() {
                let _t = crate::profile::scope(crate::profile::Section::Bf16Weights);
                bf16::round_into(&mut self.precision.params_bf16, &self.params);
            }
            self.repack();
        }
    }

    /// bf16 mode, instead of [`Gpt::sync_bf16_weights`] while `params` are still
    /// arriving (ZeRO-1/2's all-gathers in flight): the next forward rounds each
    /// range of the copy (and packs its weights) right after its `need`, when the range has
    /// arrived: the same bits as the whole copy. Call [`Gpt::sync_bf16_weights`]
    /// instead if anything else reads the copy first ([`Gpt::bf16_refresh_owed`]).
    /// Without LoRA only (its passes call no `need`).
    pub fn refresh_bf16_at_next_forward(&mut self) {
        assert!(self.frozen.is_none(), "LoRA passes call no need");
        self.precision.bf16_owed = true;
        if let Some(packs) = self.precision.packs.as_mut() {
            packs.mark_stale();
        }
    }

    /// Whether the bf16 copy waits for the next forward to be refreshed.
    pub fn bf16_refresh_owed(&self) -> bool {
        self.precision.bf16_owed
    }

    /// The AdamW step of `opt` (built by `AdamW::new` for this arena) at `lr` on the
    /// gradients times `grad_factor`, in one pass that also zeroes the gradients and,
    /// in bf16 mode, refreshes the bf16 weight copy: the same bits as
    /// `opt.step_scaled(params, grads, lr, grad_factor)`, then
    /// [`Gpt::sync_bf16_weights`] and [`Gpt::zero_grad`], whose passes it replaces.
    pub fn step_adamw(&mut self, opt: &mut AdamW, lr: f32, grad_factor: f32) {
        let copy =
            (!self.precision.params_bf16.is_empty()).then_some(&mut self.precision.params_bf16[..]);
        opt.step_fused(&mut self.params, &mut self.grads, copy, lr, grad_factor);
        self.repack();
    }

    /// bf16 on AMX or AVX512-BF16: packs the weights just changed, rounding them
    /// (with LoRA the packs are the frozen base's, packed once).
    fn repack(&mut self) {
        let packs = self
            .precision
            .packs
            .as_mut()
            .filter(|_| self.frozen.is_none());
        if let Some(packs) = packs {
            let _t = crate::profile::scope(crate::profile::Section::Bf16Weights);
            let w = matmul_weights(true, &self.params, &self.precision.params_bf16);
            packs.pack_all(w, &self.layout, &self.config);
        }
    }

    /// Bytes held by the activation arena.
    pub fn activation_bytes(&self) -> usize {
        self.pass.acts.num_bytes()
    }

    pub fn zero_grad(&mut self) {
        use rayon::prelude::*;
        self.grads.par_chunks_mut(1 << 16).for_each(|g| g.fill(0.0));
    }

    /// Mean cross-entropy of the next-token predictions (targets of -1 are ignored).
    ///
    /// inputs, targets: (B, T). In training mode the classifier's gradient is computed
    /// in the same pass (the `(B, T, V)` logits are never kept) and `backward` must
    /// follow to complete it; gradients then accumulate into `grads`.
    pub fn forward(&mut self, inputs: &[u32], targets: &[i32], b: usize, t: usize) -> f32 {
        self.forward_hooked(inputs, targets, b, t, &mut NoHooks)
    }

    /// [`Gpt::forward`], telling `hooks` which weights it reads when. The embeddings
    /// and `ln_f` are needed first and, in training mode, stay needed until backward
    /// ends (the classifier reads `wte`, backward `ln_f`); each block is needed and
    /// done in turn.
    pub fn forward_hooked(
        &mut self,
        inputs: &[u32],
        targets: &[i32],
        b: usize,
        t: usize,
        hooks: &mut dyn PassHooks,
    ) -> f32 {
        let dims = self.check_batch(inputs, b, t);
        assert_eq!(targets.len(), b * t, "targets must be B·T long");
        let seed = self.pass.dropout_seed;
        let pass = self.pass.training.then_some(seed);
        let loss = match self.precision.dtype {
            Dtype::Float32 => self.forward_loss::<false>(inputs, targets, dims, pass, hooks),
            Dtype::Bfloat16 => self.forward_loss::<true>(inputs, targets, dims, pass, hooks),
        };
        if !self.pass.training {
            self.pass_done(hooks);
        }
        if self.pass.training {
            self.pass.pending = Some((dims, seed));
            self.pass.dropout_seed = dropout::mix64(seed.wrapping_add(1));
        }
        loss
    }

    /// The whole model's weights (with LoRA: the adapters of the frozen base) as the
    /// matmuls of precision `bf16` read them.
    fn weights(&self, bf16: bool) -> Weights<'_> {
        let source = Source::new(bf16, &self.layout, &self.frozen, &self.precision.backend);
        source.weights(
            &self.params,
            &self.precision.params_bf16,
            self.precision.packs.as_ref(),
        )
    }

    /// [`Gpt::forward`] in one precision: the trunk, then the classifier with its loss
    /// (and, in training, its gradient). `pass`: the training pass's dropout seed.
    fn forward_loss<const BF16: bool>(
        &mut self,
        inputs: &[u32],
        targets: &[i32],
        d: Dims,
        pass: Option<u64>,
        hooks: &mut dyn PassHooks,
    ) -> f32 {
        self.trunk_forward::<BF16>(inputs, d, pass, hooks);
        let n = d.bt();
        let Gpt {
            params,
            grads,
            layout,
            config,
            frozen,
            precision:
                Precision {
                    params_bf16,
                    packs,
                    backend,
                    ..
                },
            pass:
                PassState {
                    acts,
                    training,
                    grad_scale,
                    ..
                },
            ..
        } = self;
        let source = Source::new(BF16, layout, frozen, backend);
        let base = source.weights(params, params_bf16, packs.as_ref());
        let cls = Classifier {
            wte: &base.matmul[base.layout.classifier()],
            packs: packs.as_ref().map(Packs::wte),
            c: d.c,
            v: config.vocab_size,
            backend,
        };
        // With LoRA the layout's classifier is empty: the frozen one gets no gradient.
        let grads = training.then(|| ClassifierGrads {
            dx: &mut acts.scratch.dinp[..n * d.c],
            dwte: &mut grads[layout.classifier()],
            scale: *grad_scale,
        });
        let (x, losses) = (&acts.lnf[..n * d.c], &mut acts.losses[..n]);
        classifier_forward::<BF16>(x, cls, targets, losses, &mut acts.logits_chunk, grads)
    }

    /// Completes the gradient of the last training `forward`, accumulating into `grads`.
    pub fn backward(&mut self) {
        self.backward_with(|_, _| {});
    }

    /// The most tokens (B · T) one pass can hold.
    pub fn max_tokens(&self) -> usize {
        self.pass.max_b * self.pass.max_t
    }

    /// The ranges of the arena whose gradients [`Gpt::backward_with`] reports final,
    /// in the order it reports them: `ln_f`, the last block down to the first, then
    /// the embeddings (`wte` and `wpe`). Descending, and together they tile `0..len`
    /// exactly (alignment gaps included), so they can serve as all-reduce buckets.
    /// With LoRA: each block's adapters, from the last block down to the first.
    pub fn grad_buckets(&self) -> Vec<Range<usize>> {
        match &self.frozen {
            None => grad_buckets_of(&self.layout),
            Some(f) => f.adapters.buckets.clone(),
        }
    }

    /// [`Gpt::backward`], calling `done(range, grads)` as soon as the gradients in
    /// `range` are final for this pass: once per range of [`Gpt::grad_buckets`], in
    /// that order, with the whole gradient buffer to read from. Data-parallel
    /// training starts each bucket's all-reduce there, while backward continues.
    pub fn backward_with(&mut self, mut done: impl FnMut(Range<usize>, &[f32])) {
        self.backward_reporting(false, |r| {
            if let Reported::Final(range, grads) = r {
                done(range, grads)
            }
        });
    }

    /// [`Gpt::backward_with`], also reporting each block's midway, for communication
    /// to move on there. With `embeddings_first`, the embeddings' bucket is reported
    /// first (then `ln_f`'s and the blocks' in [`Gpt::grad_buckets`] order) and this
    /// pass's encoder gradient is returned instead of added to `grads`: data-parallel
    /// training starts reducing the largest bucket before the blocks' backward and
    /// adds every rank's encoder gradient to the sum afterwards. Otherwise, and with
    /// LoRA (whose embeddings are frozen), the gradient returned is empty.
    pub fn backward_reporting(
        &mut self,
        embeddings_first: bool,
        report: impl FnMut(Reported),
    ) -> EncoderGrad {
        let mut hooks = Reporting {
            report,
            embeddings_first,
            held: EncoderGrad::default(),
        };
        self.backward_hooked(&mut hooks);
        hooks.held
    }

    /// [`Gpt::backward_with`], telling `hooks` the weights it reads (each block's,
    /// needed and done in turn) and the gradients it completes; the embeddings and
    /// `ln_f`, needed since the forward, are done at the end.
    pub fn backward_hooked(&mut self, hooks: &mut dyn PassHooks) {
        let (dims, seed) = self
            .pass
            .pending
            .take()
            .expect("backward() needs a forward() in training mode first");
        match self.precision.dtype {
            Dtype::Float32 => self.backward_pass::<false>(dims, seed, hooks),
            Dtype::Bfloat16 => self.backward_pass::<true>(dims, seed, hooks),
        }
        self.pass_done(hooks);
    }

    /// The end of a pass: the embeddings and `ln_f`, needed for the whole pass, done.
    fn pass_done(&mut self, hooks: &mut dyn PassHooks) {
        if self.frozen.is_none() {
            for range in [embeddings_bucket(&self.layout), ln_f_bucket(&self.layout)] {
                hooks.done(range.clone(), &mut self.params);
                release_lent_copy(self.precision.lent, range, &mut self.precision.params_bf16);
            }
        }
    }

    /// [`Gpt::backward_with`] in one precision: ln_f, the blocks from the last, the
    /// embeddings (with LoRA: no embedding or `ln_f` gradients, the blocks' adapters').
    /// `pass`: the dropout seed of the forward pass.
    fn backward_pass<const BF16: bool>(&mut self, d: Dims, pass: u64, hooks: &mut dyn PassHooks) {
        let (n, c) = (d.bt(), d.c);
        let Gpt {
            family,
            rope,
            params,
            grads,
            layout,
            config,
            frozen,
            precision:
                Precision {
                    params_bf16,
                    packs,
                    backend,
                    lent,
                    ..
                },
            pass: PassState { acts, .. },
        } = self;
        let source = Source::new(BF16, layout, frozen, backend);
        let full = frozen.is_none();
        let fam = (&*family, rope.as_ref());
        let base = source.weights(params, params_bf16, packs.as_ref());
        let (dropout, lora_dropout) = pass_dropout(Some(pass), config, frozen);
        let s = &mut acts.scratch;
        // The classifier left d(final norm output) in `dinp`; the residual gradient
        // starts at 0.
        s.dres[..n * c].fill(0.0);
        let last = acts.blocks.last().map_or(&acts.encoded, |l| &l.res3);
        let (dres, dlnf) = (&mut s.dres[..n * c], &s.dinp[..n * c]);
        let ln_f = base.layout.ln_f;
        let g = match base.lora {
            None => norm_grads(grads, layout.ln_f),
            Some(_) => block::sink_grads(&mut s.norm_sink, ln_f),
        };
        let x = &last[..n * c];
        norm_backward(
            family,
            base.params,
            ln_f,
            g,
            (dres, dlnf),
            x,
            &acts.lnf_stats,
        );
        let mut buckets = match frozen.as_deref() {
            None => Buckets::Full(buckets(layout)),
            Some(f) => Buckets::Adapters(f.adapters.buckets.iter()),
        };
        let early = full && hooks.embeddings_first();
        if early {
            hooks.grads_done(embeddings_bucket(layout), grads);
        }
        if full {
            hooks.grads_done(buckets.next().expect("the ln_f bucket"), grads);
        }
        for l in (0..config.n_layer).rev() {
            let range = buckets.next().expect("a block's bucket");
            if full {
                hooks.need(range.clone(), params);
                let packs = packs.as_mut();
                round_lent_copy(
                    *lent,
                    range.clone(),
                    params,
                    params_bf16,
                    packs,
                    layout,
                    config,
                );
            }
            let base = source.weights(params, params_bf16, packs.as_ref());
            let x = match l {
                0 => &acts.encoded[..n * c],
                _ => &acts.blocks[l - 1].res3[..n * c],
            };
            let w = base.block(l, lora_dropout, fam);
            let drop = dropout.map(|seed| BlockDropout::new(seed, l, config.dropout));
            let a = match acts.recompute.as_mut() {
                Some(a) => {
                    block_forward::<BF16>(&w, x, a, s, Attend::Causal, drop, d);
                    &*a
                }
                None => &acts.blocks[l],
            };
            mlp_backward::<BF16>(&w, grads, a, s, drop, d);
            hooks.midway();
            attention_branch_backward::<BF16>(&w, grads, x, a, s, drop, d);
            if full {
                hooks.done(range.clone(), params);
                release_lent_copy(*lent, range.clone(), params_bf16);
            }
            hooks.grads_done(range, grads);
        }
        if !full {
            return; // the embeddings are frozen
        }
        let dres = &mut s.dres[..n * c];
        if let Some(seed) = dropout {
            dropout::apply(dres, embedding_dropout(seed, config.dropout), 0);
        }
        let embeddings = buckets.next().expect("the embeddings' bucket");
        if early {
            hooks.encoder_grads(dres, &acts.inputs[..n], d.t);
            return;
        }
        let (dwte, dwpe) = split_two(grads, layout.wte, layout.wpe);
        encoder_backward(dwte, dwpe, dres, &acts.inputs[..n], d.t, c);
        hooks.grads_done(embeddings, grads);
    }

    /// All logits, (B, T, V). Allocates the full matrix: for tests and tools, never
    /// for training. Runs without dropout and leaves gradients alone.
    pub fn logits(&mut self, inputs: &[u32], b: usize, t: usize) -> Vec<f32> {
        let d = self.check_batch(inputs, b, t);
        match self.precision.dtype {
            Dtype::Float32 => self.trunk_forward::<false>(inputs, d, None, &mut NoHooks),
            Dtype::Bfloat16 => self.trunk_forward::<true>(inputs, d, None, &mut NoHooks),
        }
        let (n, v) = (d.bt(), self.config.vocab_size);
        let mut out = vec![0.0; n * v];
        let bf16 = self.precision.dtype == Dtype::Bfloat16;
        let base = self.weights(bf16);
        // The f32 GEMM reads its operands as they are: in bf16, the classifier rounded
        // (it is `params`'s where the model keeps no rounded copy).
        let wte = &base.matmul[base.layout.classifier()];
        let wte: Cow<[f32]> = match bf16 {
            true => Cow::Owned(wte.iter().copied().map(bf16::round).collect()),
            false => Cow::Borrowed(wte),
        };
        let cls = Classifier {
            wte: &wte,
            packs: None,
            c: d.c,
            v,
            backend: &self.precision.backend,
        };
        classifier_logits(&mut out, &self.pass.acts.lnf[..n * d.c], cls);
        self.pass.pending = None;
        out
    }

    fn check_batch(&mut self, inputs: &[u32], b: usize, t: usize) -> Dims {
        assert!(
            b <= self.pass.max_b && t <= self.pass.max_t && b * t > 0,
            "batch {b}×{t} exceeds the model's buffers ({}×{})",
            self.pass.max_b,
            self.pass.max_t
        );
        assert_eq!(inputs.len(), b * t, "inputs must be B·T long");
        let vp = self.config.padded_vocab_size() as u32;
        assert!(
            inputs.iter().all(|&tok| tok < vp),
            "token id beyond the vocabulary"
        );
        let f = &self.family;
        Dims::new(b, t, f.c, f.nh).with_heads(f.kv, f.hs)
    }

    /// Embedding, all blocks and the final layer norm; fills `acts` for `d`. `pass`:
    /// the training pass's dropout seed (None: no dropout).
    fn trunk_forward<const BF16: bool>(
        &mut self,
        inputs: &[u32],
        d: Dims,
        pass: Option<u64>,
        hooks: &mut dyn PassHooks,
    ) {
        let (n, c) = (d.bt(), d.c);
        let Gpt {
            family,
            rope,
            params,
            layout,
            config,
            frozen,
            precision:
                Precision {
                    params_bf16,
                    packs,
                    backend,
                    lent,
                    bf16_owed,
                    ..
                },
            pass: PassState { acts, .. },
            ..
        } = self;
        let source = Source::new(BF16, layout, frozen, backend);
        let fam = (&*family, rope.as_ref());
        let full = frozen.is_none();
        // Lent weights, or a stale copy: each range rounded as it is needed.
        let round = *lent || (full && std::mem::take(bf16_owed));
        let lent = *lent;
        if full {
            for range in [embeddings_bucket(layout), ln_f_bucket(layout)] {
                hooks.need(range.clone(), params);
                let packs = packs.as_mut();
                round_lent_copy(round, range, params, params_bf16, packs, layout, config);
            }
        }
        let base = source.weights(params, params_bf16, packs.as_ref());
        let (dropout, lora_dropout) = pass_dropout(pass, config, frozen);
        acts.inputs[..n].copy_from_slice(inputs);
        let (wte, wpe) = (&base.params[base.layout.wte], &base.params[base.layout.wpe]);
        let encoded = &mut acts.encoded[..n * c];
        encoder_forward(encoded, inputs, wte, wpe, d.t, c);
        if let Some(seed) = dropout {
            dropout::apply(encoded, embedding_dropout(seed, config.dropout), 0);
        }
        for l in 0..config.n_layer {
            if full {
                hooks.need(block_bucket(layout, l), params);
                let (range, packs) = (block_bucket(layout, l), packs.as_mut());
                round_lent_copy(round, range, params, params_bf16, packs, layout, config);
            }
            let base = source.weights(params, params_bf16, packs.as_ref());
            let (before, this) = acts.blocks.split_at_mut(l);
            let x = before.last().map_or(&acts.encoded, |p| &p.res3);
            let w = base.block(l, lora_dropout, fam);
            let drop = dropout.map(|seed| BlockDropout::new(seed, l, config.dropout));
            let s = &mut acts.scratch;
            match acts.recompute.as_mut() {
                Some(a) => {
                    block_forward::<BF16>(&w, &x[..n * c], a, s, Attend::Causal, drop, d);
                    std::mem::swap(&mut a.res3, &mut this[0].res3);
                }
                None => {
                    block_forward::<BF16>(&w, &x[..n * c], &mut this[0], s, Attend::Causal, drop, d)
                }
            }
            if full {
                hooks.done(block_bucket(layout, l), params);
                release_lent_copy(lent, block_bucket(layout, l), params_bf16);
            }
        }
        let base = source.weights(params, params_bf16, packs.as_ref());
        let last = acts.blocks.last().map_or(&acts.encoded, |l| &l.res3);
        let (out, x) = (&mut acts.lnf[..n * c], &last[..n * c]);
        norm_forward::<BF16>(
            family,
            base.params,
            base.layout.ln_f,
            out,
            &mut acts.lnf_stats,
            x,
        );
    }
}

/// Lent weights ([`Gpt::set_weights_lent`]) or a stale copy
/// ([`Gpt::refresh_bf16_at_next_forward`]), `lent` either, in bf16 mode: the copy of
/// `range` (if the model keeps one) rounded from the weights its `need` has just
/// filled, and its weights packed (if the model packs). Nothing otherwise.
fn round_lent_copy(
    lent: bool,
    range: Range<usize>,
    params: &[f32],
    copy: &mut [f32],
    packs: Option<&mut Packs>,
    layout: &ParamLayout,
    config: &ModelConfig,
) {
    if !lent {
        return;
    }
    if !copy.is_empty() {
        bf16::round_into(&mut copy[range.clone()], &params[range.clone()]);
    }
    if let Some(packs) = packs {
        let w = matmul_weights(true, params, copy);
        packs.pack_range(range, w, layout, config);
    }
}

/// Lent weights in bf16 mode: the copy of `range`, no longer read, released (zero,
/// its whole pages given back).
fn release_lent_copy(lent: bool, range: Range<usize>, copy: &mut [f32]) {
    if lent && !copy.is_empty() {
        release(copy, range);
    }
}

/// The base model's weights as one precision's kernels read them and, with LoRA,
/// the adapters'.
struct Weights<'a> {
    layout: &'a ParamLayout,
    /// f32 parameters (biases, layer norms, embeddings).
    params: &'a [f32],
    /// The matmul operand: `params` or its bf16 copy.
    matmul: &'a [f32],
    /// LoRA: the frozen base's settings and the adapters' matmul operand.
    lora: Option<(&'a Frozen, &'a [f32])>,
    /// The base's matmul weights packed (bf16 on AMX or AVX512-BF16).
    packs: Option<&'a Packs>,
    /// The kernel of the bf16 products.
    backend: &'a Backend,
}

impl<'a> Weights<'a> {
    /// Block `l`'s weights; `lora_dropout`: the pass seed of the adapters' dropout;
    /// `fam`: the family and its rotary table.
    fn block(
        &self,
        l: usize,
        lora_dropout: Option<u64>,
        fam: (&'a Family, Option<&'a RopeTable>),
    ) -> BlockWeights<'a> {
        BlockWeights {
            family: fam.0,
            rope: fam.1,
            params: self.params,
            matmul: self.matmul,
            at: &self.layout.layers[l],
            lora: self.lora.map(|(f, weights)| BlockLora {
                weights,
                at: &f.adapters.blocks[l],
                scale: f.state.config.scale(),
                dropout: lora_dropout.map(|seed| (f.state.config.dropout, seed)),
                layer: l,
                backend: self.backend,
            }),
            matmul_bf16: None,
            decoding: false,
            packs: self.packs.and_then(|p| p.layer(l)),
            backend: self.backend,
        }
    }
}

/// How a pass reads its weights, fixed for the pass: the precision, the trained
/// arena's layout, with LoRA the frozen base, and the back-end. The arena itself
/// (`params`, its bf16 copy, the packs) is given to [`Source::weights`] each time,
/// as a pass rounds and packs it range by range in between.
#[derive(Clone, Copy)]
struct Source<'a> {
    bf16: bool,
    layout: &'a ParamLayout,
    frozen: &'a Option<Box<Frozen>>,
    backend: &'a Backend,
}

impl<'a> Source<'a> {
    fn new(
        bf16: bool,
        layout: &'a ParamLayout,
        frozen: &'a Option<Box<Frozen>>,
        backend: &'a Backend,
    ) -> Source<'a> {
        Source {
            bf16,
            layout,
            frozen,
            backend,
        }
    }

    /// The weights of the arena `(params, params_bf16, packs)`: the whole model, or
    /// with `frozen` the adapters of that base.
    fn weights(
        self,
        params: &'a [f32],
        params_bf16: &'a [f32],
        packs: Option<&'a Packs>,
    ) -> Weights<'a> {
        let (bf16, backend) = (self.bf16, self.backend);
        match self.frozen.as_deref() {
            None => Weights {
                layout: self.layout,
                params,
                matmul: matmul_weights(bf16, params, params_bf16),
                lora: None,
                packs,
                backend,
            },
            Some(f) => Weights {
                layout: &f.layout,
                params: &f.params,
                matmul: matmul_weights(bf16, &f.params, &f.params_bf16),
                lora: Some((f, matmul_weights(bf16, params, params_bf16))),
                packs,
                backend,
            },
        }
    }
}

/// The seeds of a pass's model dropout and adapter dropout (each None when its
/// probability is 0 or the pass is not a training one).
fn pass_dropout(
    pass: Option<u64>,
    config: &ModelConfig,
    frozen: &Option<Box<Frozen>>,
) -> (Option<u64>, Option<u64>) {
    let lora_p = frozen.as_ref().map_or(0.0, |f| f.state.config.dropout);
    (
        pass.filter(|_| config.dropout > 0.0),
        pass.filter(|_| lora_p > 0.0),
    )
}

/// The bucket order of a backward pass: the whole model's, or the adapters'.
enum Buckets<'a, I> {
    Full(I),
    Adapters(std::slice::Iter<'a, Range<usize>>),
}

impl<I: Iterator<Item = Range<usize>>> Iterator for Buckets<'_, I> {
    type Item = Range<usize>;
    fn next(&mut self) -> Option<Range<usize>> {
        match self {
            Buckets::Full(i) => i.next(),
            Buckets::Adapters(i) => i.next().cloned(),
        }
    }
}

/// [`Gpt::grad_buckets`] of a model laid out by `layout`, without building it.
pub fn grad_buckets_of(layout: &ParamLayout) -> Vec<Range<usize>> {
    buckets(layout).collect()
}

/// The weights the matmuls read: `params`, or under bf16 autocast their bf16 copy
/// where the model keeps one ([`Backend::keeps_bf16_copy`]).
fn matmul_weights<'a>(bf16: bool, params: &'a [f32], params_bf16: &'a [f32]) -> &'a [f32] {
    match bf16 && !params_bf16.is_empty() {
        true => params_bf16,
        false => params,
    }
}

/// The ranges of [`Gpt::grad_buckets`], made as they are needed (no allocation): `ln_f`
/// (which follows the last block in the arena), the blocks from the last, the
/// embeddings.
fn buckets(layout: &ParamLayout) -> impl Iterator<Item = Range<usize>> + '_ {
    let blocks = layout.layers.iter().rev();
    let ln_f_start = blocks.clone().take(1).map(|l| l.span.end);
    let lows = ln_f_start
        .chain(blocks.map(|l| l.span.start))
        .chain(std::iter::once(0));
    lows.scan(layout.len, |hi, lo| {
        let bucket = lo..*hi;
        *hi = lo;
        Some(bucket)
    })
}

/// The bucket of block `l` in [`Gpt::grad_buckets`]: from its first tensor to the
/// next block's (or to `ln_f`'s bucket).
fn block_bucket(layout: &ParamLayout, l: usize) -> Range<usize> {
    let this = &layout.layers[l].span;
    let end = layout
        .layers
        .get(l + 1)
        .map_or(this.end, |next| next.span.start);
    this.start..end
}

/// The embeddings' bucket (`wte`, `wpe`): everything before the first block.
fn embeddings_bucket(layout: &ParamLayout) -> Range<usize> {
    0..layout.layers.first().map_or(layout.len, |l| l.span.start)
}

/// `ln_f`'s bucket: everything after the last block.
fn ln_f_bucket(layout: &ParamLayout) -> Range<usize> {
    layout.layers.last().map_or(layout.len, |l| l.span.end)..layout.len
}

/// The rotary table of `family` (None without RoPE) for positions `0..positions`.
pub fn rope_table(family: &Family, positions: usize) -> Option<RopeTable> {
    family
        .rope
        .map(|rope| RopeTable::new(&rope, family.hs, positions))
}

/// The embedding's dropout mask in the pass seeded `pass_seed` (site 0 of the pass).
fn embedding_dropout(pass_seed: u64, p: f32) -> Dropout {
    Dropout {
        p,
        seed: Dropout::derive(pass_seed, 0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::rand_vec;
    use std::ops::Range;

    /// The model tests' tiny model: a vocabulary of 37 (padded to 64), 2 blocks, C = 16.
    pub(super) fn tiny(bias: bool, dropout: f32) -> ModelConfig {
        ModelConfig {
            vocab_size: 37,
            block_size: 8,
            n_layer: 2,
            n_head: 2,
            n_embd: 16,
            bias,
            dropout,
            llama: None,
        }
    }

    /// Inputs and targets of `b` rows of `t` tokens below `v`, every fifth target
    /// masked out (-1).
    pub(super) fn batch(b: usize, t: usize, v: usize) -> (Vec<u32>, Vec<i32>) {
        let inputs = (0..b * t).map(|i| ((i * 11 + 5) % v) as u32).collect();
        let targets = (0..b * t)
            .map(|i| {
                if i % 5 == 3 {
                    -1
                } else {
                    ((i * 7 + 2) % v) as i32
                }
            })
            .collect();
        (inputs, targets)
    }

    /// A model with random (not GPT-2-init) weights so every path carries signal.
    fn model(cfg: ModelConfig, b: usize, t: usize) -> Gpt {
        random_model(cfg, b, t, 9)
    }

    /// [`model`] with the weights drawn from `seed` (the padded vocabulary rows 0).
    pub(super) fn random_model(cfg: ModelConfig, b: usize, t: usize, seed: u64) -> Gpt {
        let mut gpt = Gpt::new(cfg, b, t).unwrap();
        let real = gpt.config().vocab_size * gpt.config().n_embd;
        let noise = rand_vec(gpt.params.len(), seed);
        for (i, (p, n)) in gpt.params.iter_mut().zip(noise).enumerate() {
            *p = 0.3 * n;
            if (real..gpt.layout.wte.end).contains(&i) {
                *p = 0.0;
            }
        }
        gpt
    }

    /// `base` with adapters (rank 3, alpha 6) on `targets`, `B` made non-zero so that
    /// the adapters change the output.
    pub(super) fn with_adapters(base: Gpt, targets: &str, lora_dropout: f32) -> Gpt {
        let lora = LoraConfig::new(3, 6.0, lora_dropout, targets).unwrap();
        lora.check(base.config()).unwrap();
        let mut gpt = base.with_lora(lora, ("test", 0), 5);
        let noise = rand_vec(gpt.params.len(), 4);
        for tensor in gpt.layout.tensors.clone() {
            if tensor.name.contains("lora_B") {
                for i in tensor.range() {
                    gpt.params[i] = 0.4 * noise[i];
                }
            }
        }
        gpt
    }

    fn loss_at(gpt: &mut Gpt, x: &[u32], y: &[i32], b: usize, t: usize, seed: u64) -> f64 {
        gpt.set_dropout_seed(seed);
        let loss = gpt.forward(x, y, b, t) as f64;
        gpt.pass.pending = None;
        loss
    }

    /// Forward and backward of `(x, y, b, t)` (dropout seed 77), then the gradient
    /// at every `step`-th parameter of each tensor's `range` against central
    /// differences (ε = 0.01) of the f32 loss with the same masks. Returns the
    /// gradients and how many of those checked were not near zero.
    pub(super) fn check_finite_differences(
        gpt: &mut Gpt,
        (x, y, b, t): (&[u32], &[i32], usize, usize),
        step: usize,
        range: impl Fn(&Gpt, &TensorInfo) -> Range<usize>,
    ) -> (Vec<f32>, usize) {
        gpt.zero_grad();
        gpt.set_dropout_seed(77);
        gpt.forward(x, y, b, t);
        gpt.backward();
        let grads = gpt.grads.clone();
        let eps = 1e-2f32;
        let mut checked = 0;
        for tensor in gpt.layout.tensors.clone() {
            for i in range(gpt, &tensor).step_by(step) {
                let orig = gpt.params[i];
                gpt.params[i] = orig + eps;
                let plus = loss_at(gpt, x, y, b, t, 77);
                gpt.params[i] = orig - eps;
                let minus = loss_at(gpt, x, y, b, t, 77);
                gpt.params[i] = orig;
                let numeric = (plus - minus) / (2.0 * eps as f64);
                let analytic = grads[i] as f64;
                assert!(
                    (numeric - analytic).abs() <= 2e-3 + 2e-2 * numeric.abs(),
                    "{} [{}]: backward {analytic} vs finite difference {numeric}",
                    tensor.name,
                    i - tensor.offset
                );
                checked += (analytic.abs() > 1e-4) as usize;
            }
        }
        (grads, checked)
    }

    /// Reporting the embeddings first changes the order only: the embeddings' bucket
    /// comes before the others and, once the held-back encoder gradient is added (in
    /// two windows, as two ranks' pieces would be), the gradients are those of the
    /// plain backward, bit for bit (dropout on, so the encoder's mask matters).
    #[test]
    fn embeddings_first_reports_the_embeddings_early_and_holds_back_only_the_encoder() {
        let (b, t) = (2, 5);
        let mut gpt = model(tiny(true, 0.1), b, t);
        let (x, y) = batch(b, t, gpt.config().vocab_size);
        let run = |gpt: &mut Gpt, early: bool| {
            gpt.zero_grad();
            gpt.set_dropout_seed(5);
            gpt.forward(&x, &y, b, t);
            let mut order = Vec::new();
            let held = match early {
                true => gpt.backward_reporting(true, |r| {
                    if let Reported::Final(r, _) = r {
                        order.push(r)
                    }
                }),
                false => {
                    gpt.backward_with(|r, _| order.push(r));
                    EncoderGrad::default()
                }
            };
            (order, held, gpt.grads.clone())
        };
        let (plain_order, _, want) = run(&mut gpt, false);
        let (order, held, mut got) = run(&mut gpt, true);
        let emb = embeddings_bucket(&gpt.layout);
        assert_eq!(order[0], emb);
        assert_eq!(order[1..], plain_order[..plain_order.len() - 1]);
        assert_eq!(
            (held.tokens.len(), held.dout.len(), held.t),
            (b * t, b * t * 16, t)
        );
        assert_ne!(
            got[emb.clone()],
            want[emb.clone()],
            "the encoder's share held back"
        );
        let cut = gpt.layout.wte.start + 5 * 16 + 7; // inside the row of token 5 (x[0])
        for w in [0..cut, cut..emb.end] {
            held.add_to(&gpt.layout, w.clone(), &mut got[w]);
        }
        assert!(got
            .iter()
            .zip(&want)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
    }

    /// Whole-model backward against central differences of the f32 forward, on a
    /// sample of parameters from every tensor (with the same dropout masks).
    fn check_gradients(bias: bool, dropout: f32) {
        let (b, t) = (2, 5);
        let mut gpt = model(tiny(bias, dropout), b, t);
        let (x, y) = batch(b, t, gpt.config().vocab_size);
        // The embeddings' real rows only: the padded ones are checked for zeros below.
        let real_rows = |gpt: &Gpt, tensor: &TensorInfo| match tensor.name.as_str() {
            "transformer.wte.weight" => {
                tensor.offset..tensor.offset + gpt.config().vocab_size * gpt.config().n_embd
            }
            _ => tensor.range(),
        };
        let (grads, _) = check_finite_differences(&mut gpt, (&x, &y, b, t), 7, real_rows);
        let vp_rows = gpt.config().vocab_size * gpt.config().n_embd..gpt.layout.wte.end;
        assert!(
            grads[vp_rows].iter().all(|&g| g == 0.0),
            "padded rows get no gradient"
        );
    }

    #[test]
    fn backward_matches_finite_differences() {
        check_gradients(true, 0.0);
        check_gradients(false, 0.0);
    }

    #[test]
    fn backward_matches_finite_differences_with_dropout() {
        check_gradients(true, 0.2);
    }

    #[test]
    fn accumulated_half_batches_equal_one_full_batch() {
        let (b, t) = (4, 6);
        let cfg = tiny(true, 0.0);
        let (x, y) = batch(b, t, cfg.vocab_size);
        // Targets without ignored rows, so each half has the same count.
        let y: Vec<i32> = y.iter().map(|&v| v.max(0)).collect();
        let mut full = model(cfg.clone(), b, t);
        full.zero_grad();
        let loss = full.forward(&x, &y, b, t);
        full.backward();

        let mut acc = model(cfg, b, t);
        acc.zero_grad();
        acc.set_grad_scale(0.5);
        let half = b / 2 * t;
        let mut losses = 0.0;
        for k in 0..2 {
            let r = k * half..(k + 1) * half;
            losses += 0.5 * acc.forward(&x[r.clone()], &y[r], b / 2, t);
            acc.backward();
        }
        assert!((losses - loss).abs() < 1e-6);
        for (i, (a, f)) in acc.grads.iter().zip(&full.grads).enumerate() {
            assert!(
                (a - f).abs() <= 1e-6 + 1e-4 * f.abs(),
                "grad {i}: {a} vs {f}"
            );
        }
    }

    #[test]
    fn eval_mode_ignores_dropout_and_leaves_gradients_alone() {
        let (b, t) = (2, 8);
        let mut gpt = model(tiny(true, 0.5), b, t);
        let (x, y) = batch(b, t, gpt.config().vocab_size);
        gpt.set_training(false);
        gpt.zero_grad();
        let first = gpt.forward(&x, &y, b, t);
        assert_eq!(first, gpt.forward(&x, &y, b, t), "no dropout in eval");
        assert!(gpt.grads.iter().all(|&g| g == 0.0));
        gpt.set_training(true);
        let a = gpt.forward(&x, &y, b, t);
        gpt.backward();
        let b2 = gpt.forward(&x, &y, b, t);
        assert_ne!(a, b2, "each training pass draws new masks");
    }

    #[test]
    fn logits_agree_with_the_loss_and_are_causal() {
        let (b, t) = (2, 6);
        let mut gpt = model(tiny(true, 0.0), b, t);
        let v = gpt.config().vocab_size;
        let (x, y) = batch(b, t, v);
        gpt.set_training(false);
        let loss = gpt.forward(&x, &y, b, t) as f64;
        let logits = gpt.logits(&x, b, t);
        let (mut total, mut n) = (0.0f64, 0);
        for (row, &target) in y.iter().enumerate() {
            if target < 0 {
                continue;
            }
            let l = &logits[row * v..(row + 1) * v];
            let max = l.iter().cloned().fold(f32::MIN, f32::max) as f64;
            let lse = max + l.iter().map(|&z| (z as f64 - max).exp()).sum::<f64>().ln();
            total += lse - l[target as usize] as f64;
            n += 1;
        }
        assert!((total / n as f64 - loss).abs() < 1e-5);
        // A shorter sequence through the same buffers gives a causal prefix (equal up
        // to the GEMM's summation order, which depends on the row count).
        let short: Vec<u32> = x[..3].to_vec();
        let prefix = gpt.logits(&short, 1, 3);
        assert!(prefix
            .iter()
            .zip(&logits)
            .all(|(a, b)| (a - b).abs() < 1e-5));
    }

    /// The losses of `steps` optimizer steps on one batch, in `dtype`, with dropout.
    fn train_losses(dtype: Dtype, steps: usize, lr: f32) -> Vec<f32> {
        train_run(tiny(true, 0.1), dtype, false, steps, lr).0
    }

    /// The losses and final parameters of `steps` optimizer steps on one batch.
    fn train_run(
        cfg: ModelConfig,
        dtype: Dtype,
        checkpointing: bool,
        steps: usize,
        lr: f32,
    ) -> (Vec<f32>, Vec<f32>) {
        let (b, t) = (2, 8);
        let mut gpt = model(cfg, b, t);
        gpt.set_activation_checkpointing(checkpointing);
        gpt.set_dtype(dtype, &Backend::detect(None));
        gpt.set_dropout_seed(5);
        let (x, y) = batch(b, t, gpt.config().vocab_size);
        let mut opt = crate::optim::AdamW::new(&gpt.layout.decay_ranges(), Default::default());
        let losses = (0..steps)
            .map(|_| {
                gpt.zero_grad();
                let loss = gpt.forward(&x, &y, b, t);
                gpt.backward();
                crate::optim::clip_grad_norm(&mut gpt.grads, 1.0);
                opt.step(&mut gpt.params, &gpt.grads, lr);
                gpt.sync_bf16_weights();
                loss
            })
            .collect();
        (losses, gpt.params)
    }

    #[test]
    fn fused_adamw_step_equals_step_copy_and_zeroing() {
        for dtype in [Dtype::Float32, Dtype::Bfloat16] {
            let (b, t) = (2, 8);
            let (x, y) = batch(b, t, 37);
            let run = |fused: bool| {
                let mut gpt = model(tiny(true, 0.1), b, t);
                gpt.set_dtype(dtype, &Backend::detect(None));
                gpt.set_dropout_seed(5);
                let mut opt =
                    crate::optim::AdamW::new(&gpt.layout.decay_ranges(), Default::default());
                gpt.zero_grad();
                let mut losses = Vec::new();
                for _ in 0..4 {
                    losses.push(gpt.forward(&x, &y, b, t));
                    gpt.backward();
                    let norm = crate::optim::grad_norm(&gpt.grads);
                    let factor = crate::optim::clip_factor(norm, 1.0);
                    if fused {
                        gpt.step_adamw(&mut opt, 1e-2, factor);
                        assert!(gpt.grads.iter().all(|&g| g == 0.0), "zeroed");
                    } else {
                        opt.step_scaled(&mut gpt.params, &gpt.grads, 1e-2, factor);
                        gpt.sync_bf16_weights();
                        gpt.zero_grad();
                    }
                }
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                (losses, bits(&gpt.params), bits(&gpt.precision.params_bf16))
            };
            let want = run(false);
            assert_eq!(run(true), want, "{dtype:?}");
            assert!(want.0[3] < want.0[0], "{dtype:?} trains: {:?}", want.0);
        }
    }

    #[test]
    fn activation_checkpointing_is_bit_identical() {
        for dtype in [Dtype::Float32, Dtype::Bfloat16] {
            for dropout in [0.0, 0.2] {
                let mut cfg = tiny(true, dropout);
                cfg.n_layer = 3;
                let plain = train_run(cfg.clone(), dtype, false, 4, 1e-2);
                let checkpointed = train_run(cfg, dtype, true, 4, 1e-2);
                assert_eq!(
                    plain.0, checkpointed.0,
                    "{dtype:?} dropout {dropout}: losses"
                );
                let same = plain
                    .1
                    .iter()
                    .zip(&checkpointed.1)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{dtype:?} dropout {dropout}: parameters differ");
            }
        }
    }

    #[test]
    fn activation_checkpointing_keeps_one_block_and_the_block_inputs() {
        let cfg = ModelConfig::preset("gpt2").unwrap();
        let (b, t, c) = (4, 1024, cfg.n_embd);
        for dtype in [Dtype::Float32, Dtype::Bfloat16] {
            let full = Activations::new(&cfg, b, t, dtype, false);
            let ckpt = Activations::new(&cfg, b, t, dtype, true);
            let block = full.blocks[0].num_bytes();
            // Every block but one drops all it keeps except its (B, T, C) f32 output.
            let dropped = (cfg.n_layer - 1) * (block - b * t * c * 4) - b * t * c * 4;
            assert_eq!(full.num_bytes() - ckpt.num_bytes(), dropped, "{dtype:?}");
            println!(
                "activation arena, GPT-2 124M, B=4, T=1024, {dtype:?}: {} bytes, \
                 checkpointed {} bytes",
                full.num_bytes(),
                ckpt.num_bytes()
            );
        }
    }

    #[test]
    fn training_is_bit_identical_across_runs_and_lowers_the_loss() {
        for dtype in [Dtype::Float32, Dtype::Bfloat16] {
            let first = train_losses(dtype, 6, 1e-2);
            assert_eq!(first, train_losses(dtype, 6, 1e-2), "{dtype:?}");
            assert!(first[5] < first[0] * 0.95, "{dtype:?}: {first:?}");
        }
    }

    #[test]
    fn backward_with_reports_each_bucket_once_final() {
        let (b, t) = (2, 6);
        for bias in [true, false] {
            let mut gpt = model(tiny(bias, 0.1), b, t);
            let (x, y) = batch(b, t, gpt.config().vocab_size);
            let buckets = gpt.grad_buckets();
            assert_eq!(buckets.len(), gpt.config().n_layer + 2);
            assert_eq!(buckets.last().unwrap().start, 0);
            assert_eq!(buckets[0].end, gpt.layout.len);
            assert!(buckets.windows(2).all(|w| w[1].end == w[0].start), "tiles");
            gpt.zero_grad();
            gpt.set_dropout_seed(3);
            gpt.forward(&x, &y, b, t);
            let mut seen = Vec::new();
            gpt.backward_with(|range, grads| seen.push((range.clone(), grads[range].to_vec())));
            assert_eq!(
                seen.iter().map(|(r, _)| r.clone()).collect::<Vec<_>>(),
                buckets
            );
            for (range, at_report) in seen {
                assert_eq!(gpt.grads[range].to_vec(), at_report, "final when reported");
            }
        }
    }

    /// Each block's backward reports one midway, after the bucket before it (`ln_f`'s
    /// or the next block's) and before its own.
    #[test]
    fn backward_reporting_tells_one_midway_per_block_between_its_halves() {
        let (b, t) = (2, 6);
        let mut gpt = model(tiny(true, 0.1), b, t);
        let (x, y) = batch(b, t, gpt.config().vocab_size);
        gpt.zero_grad();
        gpt.forward(&x, &y, b, t);
        let n_layer = gpt.config().n_layer;
        let mut events = Vec::new();
        let held = gpt.backward_reporting(false, |r| match r {
            Reported::Final(range, _) => events.push(Some(range)),
            Reported::Midway => events.push(None),
        });
        assert!(held.tokens.is_empty());
        let buckets = gpt.grad_buckets();
        let mut want = vec![Some(buckets[0].clone())];
        for bucket in &buckets[1..=n_layer] {
            want.extend([None, Some(bucket.clone())]);
        }
        want.push(Some(buckets[n_layer + 1].clone()));
        assert_eq!(events, want);
    }

    /// Hooks that keep the weights elsewhere, as ZeRO-3 does: `need` copies a range
    /// in, `done` zeroes it, so a pass that read weights it did not ask for would
    /// compute with zeros.
    struct Lender {
        weights: Vec<f32>,
        log: Vec<(char, Range<usize>)>,
    }
    impl PassHooks for Lender {
        fn need(&mut self, range: Range<usize>, params: &mut [f32]) {
            params[range.clone()].copy_from_slice(&self.weights[range.clone()]);
            self.log.push(('n', range));
        }
        fn done(&mut self, range: Range<usize>, params: &mut [f32]) {
            params[range.clone()].fill(0.0);
            self.log.push(('d', range));
        }
        fn grads_done(&mut self, range: Range<usize>, _: &mut [f32]) {
            self.log.push(('g', range));
        }
    }

    #[test]
    fn hooked_passes_read_only_the_weights_they_need() {
        let (b, t) = (2, 6);
        for ckpt in [false, true] {
            let mut plain = model(tiny(true, 0.1), b, t);
            plain.set_activation_checkpointing(ckpt);
            let (x, y) = batch(b, t, plain.config().vocab_size);
            let mut lent = model(tiny(true, 0.1), b, t);
            lent.set_activation_checkpointing(ckpt);
            let mut hooks = Lender {
                weights: std::mem::replace(&mut lent.params, vec![0.0; plain.params.len()]),
                log: Vec::new(),
            };
            for gpt in [&mut plain, &mut lent] {
                gpt.zero_grad();
                gpt.set_dropout_seed(3);
            }
            let loss = plain.forward(&x, &y, b, t);
            plain.backward();
            assert_eq!(lent.forward_hooked(&x, &y, b, t, &mut hooks), loss);
            lent.backward_hooked(&mut hooks);
            assert_eq!(lent.grads, plain.grads, "checkpointing {ckpt}");
            assert!(lent.params.iter().all(|&p| p == 0.0), "all done");
            // Embeddings and ln_f for the pass, each block in the forward and again in
            // backward, its gradients reported after it is done.
            let bk = plain.grad_buckets();
            let (ln_f, emb) = (bk[0].clone(), bk[bk.len() - 1].clone());
            let (b0, b1) = (bk[2].clone(), bk[1].clone());
            let want = [
                ('n', emb.clone()),
                ('n', ln_f.clone()),
                ('n', b0.clone()),
                ('d', b0.clone()),
                ('n', b1.clone()),
                ('d', b1.clone()),
                ('g', ln_f.clone()),
                ('n', b1.clone()),
                ('d', b1.clone()),
                ('g', b1),
                ('n', b0.clone()),
                ('d', b0.clone()),
                ('g', b0),
                ('g', emb.clone()),
                ('d', emb.clone()),
                ('d', ln_f.clone()),
            ];
            assert_eq!(hooks.log, want);
            // Evaluation: everything done at the end of the forward.
            hooks.log.clear();
            lent.set_training(false);
            plain.set_training(false);
            let eval = lent.forward_hooked(&x, &y, b, t, &mut hooks);
            assert_eq!(eval, plain.forward(&x, &y, b, t));
            assert_eq!(hooks.log.last(), Some(&('d', ln_f)));
            assert!(lent.params.iter().all(|&p| p == 0.0));
        }
    }

    /// Lent weights in bf16 mode (ZeRO-3): each range's bf16 copy is rounded when
    /// `need` fills it and released at its `done`, giving the bits of the whole
    /// copy a plain bf16 model rounds at once.
    #[test]
    fn lent_weights_in_bf16_round_each_range_as_it_arrives() {
        let (b, t) = (2, 6);
        for ckpt in [false, true] {
            let mut plain = model(tiny(true, 0.1), b, t);
            let mut lent = model(tiny(true, 0.1), b, t);
            lent.set_weights_lent(true);
            let (x, y) = batch(b, t, plain.config().vocab_size);
            let mut hooks = Lender {
                weights: std::mem::replace(&mut lent.params, vec![0.0; plain.params.len()]),
                log: Vec::new(),
            };
            for gpt in [&mut plain, &mut lent] {
                gpt.set_activation_checkpointing(ckpt);
                gpt.set_dtype(Dtype::Bfloat16, &Backend::detect(None));
                gpt.zero_grad();
                gpt.set_dropout_seed(3);
            }
            assert!(
                lent.precision.params_bf16.iter().all(|&p| p == 0.0),
                "no whole copy"
            );
            let loss = plain.forward(&x, &y, b, t);
            plain.backward();
            assert_eq!(lent.forward_hooked(&x, &y, b, t, &mut hooks), loss);
            lent.backward_hooked(&mut hooks);
            assert_eq!(lent.grads, plain.grads, "checkpointing {ckpt}");
            let copy = &lent.precision.params_bf16;
            assert!(copy.iter().all(|&p| p == 0.0), "each range's copy released");
            // A step leaves the copy to the passes.
            lent.sync_bf16_weights();
            assert!(lent.precision.params_bf16.iter().all(|&p| p == 0.0));
        }
    }

    #[test]
    fn from_params_checks_the_length() {
        let cfg = tiny(true, 0.0);
        let err = Gpt::from_params(cfg, vec![0.0; 3], 1, 4).err().unwrap();
        assert!(err.to_string().contains("needs"));
    }
}
