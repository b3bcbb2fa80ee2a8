//! The GPT-2 model: configuration, parameter layout, activations, and the forward and
//! backward passes that string the kernels together.
//!
//! ```text
//! x = drop(wte[tokens] + wpe)                       (B, T, C)
//! for each block:  x = x + drop(attn(ln_1(x)))
//!                  x = x + drop(mlp(ln_2(x)))
//! loss = cross_entropy(ln_f(x) · wteᵀ, targets)      logits never stored whole
//! ```

pub mod activations;
pub mod config;
pub mod decode;
pub mod init;
pub mod layout;
#[cfg(test)]
mod tests_bf16;

pub use activations::Activations;
pub use config::ModelConfig;
pub use layout::{ParamLayout, TensorInfo};

use crate::config::Dtype;
use crate::kernels::attention::{attention_backward, attention_forward};
use crate::kernels::classifier::{
    classifier_forward, classifier_forward_bf16, classifier_logits, ClassifierGrads, WtePacks,
};
use crate::kernels::dropout::{self, Dropout};
use crate::kernels::encoder::{encoder_backward, encoder_forward};
use crate::kernels::gelu::{gelu_backward, gelu_backward_bf16, gelu_forward, gelu_forward_bf16};
use crate::kernels::layernorm::{
    layernorm_apply_bf16, layernorm_backward, layernorm_forward, layernorm_forward_bf16,
};
use crate::kernels::matmul::{
    linear_backward, linear_backward_bf16, linear_backward_input, linear_backward_params,
    linear_forward, linear_forward_bf16,
};
use crate::kernels::residual::residual_add_inplace;
use crate::kernels::{bf16, bf16_gemm, Dims};
use activations::{HalfScratch, LayerActs};
use layout::LayerRanges;

/// Errors from building a model out of a parameter buffer.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("invalid model config: {0}")]
    Config(String),
    #[error("parameter buffer holds {got} floats but this config needs {want}")]
    ParamCount { got: usize, want: usize },
}

/// Dropout site numbers within a block, for deriving mask seeds.
const SITE_ATTN_PROBS: u64 = 1;
const SITE_ATTN_RESID: u64 = 2;
const SITE_MLP_RESID: u64 = 3;
const SITES_PER_LAYER: u64 = 4;

/// A GPT-2 with its parameters, gradients and activation buffers.
pub struct Gpt {
    pub config: ModelConfig,
    pub layout: ParamLayout,
    /// All parameters, laid out by `layout`.
    pub params: Vec<f32>,
    /// Gradients, same layout as `params`.
    pub grads: Vec<f32>,
    /// Precision of the matmuls (see [`Gpt::set_dtype`]).
    dtype: Dtype,
    /// bf16 mode: `params` rounded to bf16 (held as f32, same layout), the operand
    /// of every matmul; refreshed by [`Gpt::sync_bf16_weights`]. Empty in f32 mode.
    params_bf16: Vec<f32>,
    /// bf16 mode on AMX: the bf16 `wte` packed for the classifier's two products with
    /// it, refreshed with `params_bf16`. None otherwise.
    wte_packs: Option<WtePacks>,
    acts: Activations,
    max_b: usize,
    max_t: usize,
    training: bool,
    grad_scale: f32,
    /// Seed of the next training pass's dropout masks.
    dropout_seed: u64,
    /// The last training forward's shape and mask seed, which backward needs.
    pending: Option<(Dims, u64)>,
}

impl Gpt {
    /// A model with all-zero parameters whose activations fit batches up to
    /// `max_b × max_t` (`max_t ≤ block_size`). Call [`Gpt::init_gpt2`] or fill `params`.
    pub fn new(config: ModelConfig, max_b: usize, max_t: usize) -> Result<Gpt, ModelError> {
        config.validate().map_err(ModelError::Config)?;
        if max_t > config.block_size || max_b == 0 || max_t == 0 {
            return Err(ModelError::Config(format!(
                "batch shape {max_b}×{max_t} must be at least 1×1 with T ≤ block_size ({})",
                config.block_size
            )));
        }
        let layout = ParamLayout::new(&config);
        let acts = Activations::new(&config, max_b, max_t, Dtype::Float32);
        Ok(Gpt {
            params: vec![0.0; layout.len],
            grads: vec![0.0; layout.len],
            dtype: Dtype::Float32,
            params_bf16: Vec::new(),
            wte_packs: None,
            layout,
            acts,
            max_b,
            max_t,
            config,
            training: true,
            grad_scale: 1.0,
            dropout_seed: 0,
            pending: None,
        })
    }

    /// A model over an existing parameter buffer (laid out by `ParamLayout::new`).
    pub fn from_params(
        config: ModelConfig,
        params: Vec<f32>,
        max_b: usize,
        max_t: usize,
    ) -> Result<Gpt, ModelError> {
        let mut gpt = Gpt::new(config, max_b, max_t)?;
        if params.len() != gpt.layout.len {
            return Err(ModelError::ParamCount {
                got: params.len(),
                want: gpt.layout.len,
            });
        }
        gpt.params = params;
        Ok(gpt)
    }

    /// nanoGPT's GPT-2 initialisation from `seed` (see [`init::init_gpt2`]).
    pub fn init_gpt2(&mut self, seed: u64) {
        init::init_gpt2(&mut self.params, &self.layout, &self.config, seed);
    }

    /// Training mode (like `model.train()` in PyTorch): dropout is active and
    /// `forward` prepares `backward`. Off (`model.eval()`): neither.
    pub fn set_training(&mut self, on: bool) {
        self.training = on;
        self.pending = None;
    }

    /// Multiplies the gradients of the following backward passes, e.g. by
    /// `1 / gradient_accumulation_steps` so accumulated gradients are a mean.
    pub fn set_grad_scale(&mut self, scale: f32) {
        self.grad_scale = scale;
    }

    /// Seeds the dropout masks of the next training forward (each forward then
    /// advances the seed). Set it per micro-step for runs that resume exactly.
    pub fn set_dropout_seed(&mut self, seed: u64) {
        self.dropout_seed = seed;
    }

    /// Switches the matmul precision. `Bfloat16` is autocast: every matmul operand
    /// (weights, activations, output gradients) is rounded to bf16, products are
    /// accumulated in f32, and `params`, `grads` and everything outside the matmuls
    /// stay f32; activations that only feed matmuls are stored in bf16. Rebuilds the
    /// activation arena (call it before training, not in the step loop) and makes
    /// the bf16 copy of the weights.
    pub fn set_dtype(&mut self, dtype: Dtype) {
        if dtype != self.dtype {
            self.acts = Activations::new(&self.config, 0, 0, Dtype::Float32);
            self.acts = Activations::new(&self.config, self.max_b, self.max_t, dtype);
            self.params_bf16 = match dtype {
                Dtype::Float32 => Vec::new(),
                Dtype::Bfloat16 => vec![0.0; self.params.len()],
            };
            let amx = bf16_gemm::kernel() == bf16_gemm::Kernel::Amx;
            self.wte_packs = (dtype == Dtype::Bfloat16 && amx).then(WtePacks::default);
            self.dtype = dtype;
            self.pending = None;
        }
        self.sync_bf16_weights();
    }

    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// bf16 mode: re-rounds the weight copy the matmuls read from `params`. Call it
    /// whenever `params` changed (after each optimizer step, after loading); the
    /// micro-steps of one optimizer step share the copy. A no-op in f32 mode.
    pub fn sync_bf16_weights(&mut self) {
        if self.dtype == Dtype::Bfloat16 {
            let _t = crate::profile::scope(crate::profile::Section::Bf16Weights);
            bf16::round_into(&mut self.params_bf16, &self.params);
            if let Some(packs) = self.wte_packs.as_mut() {
                let wte = &self.params_bf16[self.layout.wte.clone()];
                packs.pack(wte, self.config.n_embd, self.config.vocab_size);
            }
        }
    }

    /// The weights the matmuls read: `params`, or their bf16 copy.
    fn matmul_weights(&self) -> &[f32] {
        match self.dtype {
            Dtype::Float32 => &self.params,
            Dtype::Bfloat16 => &self.params_bf16,
        }
    }

    /// Bytes held by the activation arena.
    pub fn activation_bytes(&self) -> usize {
        self.acts.num_bytes()
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
        let dims = self.check_batch(inputs, b, t);
        assert_eq!(targets.len(), b * t, "targets must be B·T long");
        let seed = self.dropout_seed;
        let dropout = (self.training && self.config.dropout > 0.0).then_some(seed);
        self.trunk_forward(inputs, dims, dropout);
        let (c, v, bt) = (dims.c, self.config.vocab_size, dims.bt());
        let wte = match self.dtype {
            Dtype::Float32 => &self.params[self.layout.wte.clone()],
            Dtype::Bfloat16 => &self.params_bf16[self.layout.wte.clone()],
        };
        let acts = &mut self.acts;
        let grads = self.training.then(|| ClassifierGrads {
            dx: &mut acts.dbtc[..bt * c],
            dwte: &mut self.grads[self.layout.wte.clone()],
            scale: self.grad_scale,
        });
        let (x, losses) = (&acts.lnf[..bt * c], &mut acts.losses[..bt]);
        let scratch = &mut acts.logits_chunk;
        let loss = match self.dtype {
            Dtype::Float32 => classifier_forward(x, wte, targets, losses, scratch, c, v, grads),
            Dtype::Bfloat16 => {
                let packs = self.wte_packs.as_ref();
                classifier_forward_bf16(x, wte, packs, targets, losses, scratch, c, v, grads)
            }
        };
        if self.training {
            self.pending = Some((dims, seed));
            self.dropout_seed = dropout::mix64(seed.wrapping_add(1));
        }
        loss
    }

    /// Completes the gradient of the last training `forward`, accumulating into `grads`.
    pub fn backward(&mut self) {
        self.backward_with(|_, _| {});
    }

    /// The ranges of the arena whose gradients [`Gpt::backward_with`] reports final,
    /// in the order it reports them: `ln_f`, the last block down to the first, then
    /// the embeddings (`wte` and `wpe`). Descending, and together they tile `0..len`
    /// exactly (alignment gaps included), so they can serve as all-reduce buckets.
    pub fn grad_buckets(&self) -> Vec<std::ops::Range<usize>> {
        let layers = &self.layout.layers;
        let mut out = Vec::with_capacity(layers.len() + 2);
        let mut hi = self.layout.len;
        if let Some(last) = layers.last().filter(|l| l.span.end < hi) {
            out.push(last.span.end..hi);
            hi = last.span.end;
        }
        for span in layers.iter().rev().map(|l| &l.span) {
            out.push(span.start..hi);
            hi = span.start;
        }
        out.push(0..hi);
        out
    }

    /// [`Gpt::backward`], calling `done(range, grads)` as soon as the gradients in
    /// `range` are final for this pass: once per range of [`Gpt::grad_buckets`], in
    /// that order, with the whole gradient buffer to read from. Data-parallel
    /// training starts each bucket's all-reduce there, while backward continues.
    pub fn backward_with(&mut self, mut done: impl FnMut(std::ops::Range<usize>, &[f32])) {
        let (dims, seed) = self
            .pending
            .take()
            .expect("backward() needs a forward() in training mode first");
        let dropout = (self.config.dropout > 0.0).then_some(seed);
        let (bt, c) = (dims.bt(), dims.c);
        let Gpt {
            params,
            params_bf16,
            grads,
            acts,
            layout,
            ..
        } = self;
        // The classifier left d(lnf) in dbtc; the residual stream gradient starts at 0.
        acts.dres[..bt * c].fill(0.0);
        let last_res = match acts.layers.last() {
            Some(l) => &l.res3[..bt * c],
            None => &acts.encoded[..bt * c],
        };
        let (dw, db) = split_two(grads, layout.ln_f_w.clone(), layout.ln_f_b.clone());
        layernorm_backward(
            &mut acts.dres[..bt * c],
            dw,
            db,
            &acts.dbtc[..bt * c],
            last_res,
            &params[layout.ln_f_w.clone()],
            &acts.lnf_mean[..bt],
            &acts.lnf_rstd[..bt],
            c,
        );
        // The ranges of `grad_buckets`, computed as we go (no allocation here).
        let mut hi = layout.len;
        if let Some(last) = layout.layers.last().filter(|l| l.span.end < hi) {
            done(last.span.end..hi, grads); // ln_f
            hi = last.span.end;
        }
        for l in (0..layout.layers.len()).rev() {
            let (before, this) = acts.layers.split_at_mut(l);
            let x = before
                .last()
                .map_or(&acts.encoded[..bt * c], |p| &p.res3[..bt * c]);
            let scratch = Scratch {
                dres: &mut acts.dres,
                dbtc: &mut acts.dbtc,
                dbranch: &mut acts.dbranch,
                d4c: &mut acts.d4c,
            };
            let drop = dropout.map(|s| layer_dropout(s, l, self.config.dropout));
            match acts.half.as_mut() {
                None => layer_backward(
                    params,
                    grads,
                    &layout.layers[l],
                    &this[0],
                    x,
                    scratch,
                    dims,
                    drop,
                ),
                Some(half) => {
                    let w = Weights {
                        p: params,
                        wr: params_bf16,
                        r: &layout.layers[l],
                    };
                    layer_backward_bf16(w, grads, &this[0], x, scratch, half, dims, drop)
                }
            }
            let start = layout.layers[l].span.start;
            done(start..hi, grads);
            hi = start;
        }
        if let Some(s) = dropout {
            let mask = Dropout {
                p: self.config.dropout,
                seed: Dropout::derive(s, 0),
            };
            dropout::apply(&mut acts.dres[..bt * c], mask, 0);
        }
        let (dwte, dwpe) = split_two(grads, layout.wte.clone(), layout.wpe.clone());
        encoder_backward(
            dwte,
            dwpe,
            &acts.dres[..bt * c],
            &acts.inputs[..bt],
            dims.t,
            c,
        );
        done(0..hi, grads); // wte, wpe
    }

    /// Logits of the last position of each sequence: (B, V), real vocabulary only.
    /// Runs without dropout and leaves gradients alone.
    pub fn logits_last(&mut self, inputs: &[u32], b: usize, t: usize) -> &[f32] {
        let dims = self.check_batch(inputs, b, t);
        self.trunk_forward(inputs, dims, None);
        let (c, v) = (dims.c, self.config.vocab_size);
        let acts = &mut self.acts;
        for (row, x) in acts.last_x[..b * c].chunks_mut(c).enumerate() {
            let last = (row * t + t - 1) * c;
            x.copy_from_slice(&acts.lnf[last..last + c]);
        }
        let wte = match self.dtype {
            Dtype::Float32 => &self.params[self.layout.wte.clone()],
            Dtype::Bfloat16 => &self.params_bf16[self.layout.wte.clone()],
        };
        classifier_logits(
            &mut acts.last_logits[..b * v],
            &acts.last_x[..b * c],
            wte,
            c,
            v,
        );
        self.pending = None;
        &acts.last_logits[..b * v]
    }

    /// All logits, (B, T, V). Allocates the full matrix: for tests and tools, never
    /// for training.
    pub fn logits(&mut self, inputs: &[u32], b: usize, t: usize) -> Vec<f32> {
        let dims = self.check_batch(inputs, b, t);
        self.trunk_forward(inputs, dims, None);
        let (c, v, bt) = (dims.c, self.config.vocab_size, dims.bt());
        let mut out = vec![0.0; bt * v];
        let wte = &self.matmul_weights()[self.layout.wte.clone()];
        classifier_logits(&mut out, &self.acts.lnf[..bt * c], wte, c, v);
        self.pending = None;
        out
    }

    fn check_batch(&mut self, inputs: &[u32], b: usize, t: usize) -> Dims {
        assert!(
            b <= self.max_b && t <= self.max_t && b * t > 0,
            "batch {b}×{t} exceeds the model's buffers ({}×{})",
            self.max_b,
            self.max_t
        );
        assert_eq!(inputs.len(), b * t, "inputs must be B·T long");
        let vp = self.config.padded_vocab_size() as u32;
        assert!(
            inputs.iter().all(|&tok| tok < vp),
            "token id beyond the vocabulary"
        );
        Dims {
            b,
            t,
            c: self.config.n_embd,
            nh: self.config.n_head,
        }
    }

    /// Embedding, all blocks and the final layer norm; fills `acts` for `dims`.
    fn trunk_forward(&mut self, inputs: &[u32], dims: Dims, dropout: Option<u64>) {
        let (bt, c) = (dims.bt(), dims.c);
        let Gpt {
            params,
            params_bf16,
            acts,
            layout,
            config,
            ..
        } = self;
        acts.inputs[..bt].copy_from_slice(inputs);
        let wte = &params[layout.wte.clone()];
        let wpe = &params[layout.wpe.clone()];
        encoder_forward(&mut acts.encoded[..bt * c], inputs, wte, wpe, dims.t, c);
        if let Some(s) = dropout {
            let mask = Dropout {
                p: config.dropout,
                seed: Dropout::derive(s, 0),
            };
            dropout::apply(&mut acts.encoded[..bt * c], mask, 0);
        }
        for l in 0..layout.layers.len() {
            let (before, this) = acts.layers.split_at_mut(l);
            let x = before
                .last()
                .map_or(&acts.encoded[..bt * c], |p| &p.res3[..bt * c]);
            let drop = dropout.map(|s| layer_dropout(s, l, config.dropout));
            match acts.half.as_mut() {
                None => {
                    let (r, gelu) = (&layout.layers[l], &mut acts.d4c[..]);
                    layer_forward(params, r, &mut this[0], x, gelu, dims, drop)
                }
                Some(half) => {
                    let w = Weights {
                        p: params,
                        wr: params_bf16,
                        r: &layout.layers[l],
                    };
                    let scratch = ForwardScratch {
                        wide: &mut acts.dbtc,
                        pre_gelu: &mut acts.d4c,
                        gelu: &mut half.wide4c,
                    };
                    layer_forward_bf16(w, &mut this[0], x, scratch, dims, drop)
                }
            }
        }
        let last = acts.layers.last().map_or(&acts.encoded, |l| &l.res3);
        layernorm_forward(
            &mut acts.lnf[..bt * c],
            &mut acts.lnf_mean[..bt],
            &mut acts.lnf_rstd[..bt],
            &last[..bt * c],
            &params[layout.ln_f_w.clone()],
            &params[layout.ln_f_b.clone()],
            c,
        );
        if acts.half.is_some() {
            // The classifier's operand: bf16 values (kept in f32, it is one buffer).
            bf16::round_in_place(&mut acts.lnf[..bt * c]);
        }
    }
}

/// The three dropout masks of one block for one pass.
#[derive(Clone, Copy)]
struct LayerDropout {
    attn_probs: Dropout,
    attn_resid: Dropout,
    mlp_resid: Dropout,
}

fn layer_dropout(pass_seed: u64, layer: usize, p: f32) -> LayerDropout {
    let site = |s: u64| Dropout {
        p,
        seed: Dropout::derive(pass_seed, 1 + layer as u64 * SITES_PER_LAYER + s),
    };
    LayerDropout {
        attn_probs: site(SITE_ATTN_PROBS),
        attn_resid: site(SITE_ATTN_RESID),
        mlp_resid: site(SITE_MLP_RESID),
    }
}

/// One block forward: `x` (B, T, C) in, `a.res3` out. `gelu` is (B, T, 4C) scratch for
/// the GELU output, which is not kept: backward recomputes it from `a.fch`.
fn layer_forward(
    p: &[f32],
    w: &LayerRanges,
    a: &mut LayerActs,
    x: &[f32],
    gelu: &mut [f32],
    d: Dims,
    drop: Option<LayerDropout>,
) {
    let (bt, c) = (d.bt(), d.c);
    let (ln1, qkv, atty) = (
        &mut a.ln1[..bt * c],
        &mut a.qkv[..bt * 3 * c],
        &mut a.atty[..bt * c],
    );
    let (m1, r1) = (&mut a.ln1_mean[..bt], &mut a.ln1_rstd[..bt]);
    layernorm_forward(
        ln1,
        m1,
        r1,
        x,
        &p[w.ln_1_w.clone()],
        &p[w.ln_1_b.clone()],
        c,
    );
    linear_forward(
        qkv,
        ln1,
        &p[w.c_attn_w.clone()],
        &p[w.c_attn_b.clone()],
        c,
        3 * c,
    );
    let lse = &mut a.att_lse[..d.b * d.nh * d.t];
    attention_forward(atty, lse, qkv, d, drop.map(|m| m.attn_probs));
    let res2 = &mut a.res2[..bt * c];
    linear_forward(
        res2,
        atty,
        &p[w.attn_proj_w.clone()],
        &p[w.attn_proj_b.clone()],
        c,
        c,
    );
    if let Some(m) = drop {
        dropout::apply(res2, m.attn_resid, 0);
    }
    residual_add_inplace(res2, x);

    let (ln2, fch, gelu) = (
        &mut a.ln2[..bt * c],
        &mut a.fch[..bt * 4 * c],
        &mut gelu[..bt * 4 * c],
    );
    let (m2, r2) = (&mut a.ln2_mean[..bt], &mut a.ln2_rstd[..bt]);
    layernorm_forward(
        ln2,
        m2,
        r2,
        res2,
        &p[w.ln_2_w.clone()],
        &p[w.ln_2_b.clone()],
        c,
    );
    linear_forward(
        fch,
        ln2,
        &p[w.c_fc_w.clone()],
        &p[w.c_fc_b.clone()],
        c,
        4 * c,
    );
    gelu_forward(gelu, fch);
    let res3 = &mut a.res3[..bt * c];
    linear_forward(
        res3,
        gelu,
        &p[w.mlp_proj_w.clone()],
        &p[w.mlp_proj_b.clone()],
        4 * c,
        c,
    );
    if let Some(m) = drop {
        dropout::apply(res3, m.mlp_resid, 0);
    }
    residual_add_inplace(res3, res2);
}

/// Backward scratch shared by all blocks (see [`Activations`]).
struct Scratch<'a> {
    dres: &'a mut [f32],
    dbtc: &'a mut [f32],
    dbranch: &'a mut [f32],
    d4c: &'a mut [f32],
}

/// One block backward. On entry `s.dres` holds d(block output); on return, d(block
/// input) `x`. Parameter gradients accumulate into `g`.
#[allow(clippy::too_many_arguments)]
fn layer_backward(
    p: &[f32],
    g: &mut [f32],
    w: &LayerRanges,
    a: &LayerActs,
    x: &[f32],
    s: Scratch,
    d: Dims,
    drop: Option<LayerDropout>,
) {
    let (bt, c) = (d.bt(), d.c);
    let dres = &mut s.dres[..bt * c];
    let dbtc = &mut s.dbtc[..bt * c];

    // MLP branch: res3 = res2 + drop(gelu(ln2 · W_fcᵀ) · W_projᵀ). The GELU output is
    // recomputed into d4c, used for W_proj's gradient, then overwritten by its own.
    let dmlp_out = branch_grad(dres, s.dbranch, drop.map(|m| m.mlp_resid));
    let (fch, d4c) = (&a.fch[..bt * 4 * c], &mut s.d4c[..bt * 4 * c]);
    gelu_forward(d4c, fch);
    let (dw, db) = split_two(g, w.mlp_proj_w.clone(), w.mlp_proj_b.clone());
    linear_backward_params(dw, db, dmlp_out, d4c, 4 * c, c);
    let dgelu = d4c;
    linear_backward_input(dgelu, dmlp_out, &p[w.mlp_proj_w.clone()], 4 * c, c);
    gelu_backward(dgelu, fch);
    let (dw, db) = split_two(g, w.c_fc_w.clone(), w.c_fc_b.clone());
    linear_backward(
        dbtc,
        dw,
        db,
        dgelu,
        &a.ln2[..bt * c],
        &p[w.c_fc_w.clone()],
        c,
        4 * c,
    );
    let (dw, db) = split_two(g, w.ln_2_w.clone(), w.ln_2_b.clone());
    let res2 = &a.res2[..bt * c];
    let (m2, r2) = (&a.ln2_mean[..bt], &a.ln2_rstd[..bt]);
    layernorm_backward(dres, dw, db, dbtc, res2, &p[w.ln_2_w.clone()], m2, r2, c);

    // Attention branch: res2 = x + drop(attn(ln1 · W_attnᵀ) · W_projᵀ).
    let dattn_out = branch_grad(dres, s.dbranch, drop.map(|m| m.attn_resid));
    let (dw, db) = split_two(g, w.attn_proj_w.clone(), w.attn_proj_b.clone());
    let atty = &a.atty[..bt * c];
    linear_backward(
        dbtc,
        dw,
        db,
        dattn_out,
        atty,
        &p[w.attn_proj_w.clone()],
        c,
        c,
    );
    let dqkv = &mut s.d4c[..bt * 3 * c];
    let (qkv, lse) = (&a.qkv[..bt * 3 * c], &a.att_lse[..d.b * d.nh * d.t]);
    attention_backward(dqkv, dbtc, qkv, atty, lse, d, drop.map(|m| m.attn_probs));
    let (dw, db) = split_two(g, w.c_attn_w.clone(), w.c_attn_b.clone());
    linear_backward(
        dbtc,
        dw,
        db,
        dqkv,
        &a.ln1[..bt * c],
        &p[w.c_attn_w.clone()],
        c,
        3 * c,
    );
    let (dw, db) = split_two(g, w.ln_1_w.clone(), w.ln_1_b.clone());
    let (m1, r1) = (&a.ln1_mean[..bt], &a.ln1_rstd[..bt]);
    layernorm_backward(dres, dw, db, dbtc, x, &p[w.ln_1_w.clone()], m1, r1, c);
}

/// A block's weights in bf16 mode: `p` the f32 master parameters (biases and
/// layer-norm parameters are read from it), `wr` their bf16-rounded copy (the matmul
/// weights), `r` where the block's tensors live in both.
#[derive(Clone, Copy)]
struct Weights<'a> {
    p: &'a [f32],
    wr: &'a [f32],
    r: &'a LayerRanges,
}

/// f32 scratch of [`layer_forward_bf16`], shared by all blocks.
struct ForwardScratch<'a> {
    /// (B, T, C): a layer-norm or attention output, rounded to bf16.
    wide: &'a mut [f32],
    /// (B, T, 4C): the MLP hidden layer before GELU.
    pre_gelu: &'a mut [f32],
    /// (B, T, 4C): the GELU output, rounded to bf16.
    gelu: &'a mut [f32],
}

/// [`layer_forward`] under bf16 autocast. Every matmul operand holds bf16 values:
/// the weights come from `w.wr`, and each activation feeding a matmul is rounded
/// (the layer-norm outputs, q/k/v, the attention output, the pre-GELU layer and the
/// GELU output). Accumulation, layer norm, softmax, GELU and the residual stream
/// are f32. `a.half` keeps q/k/v, atty and the pre-GELU layer in bf16 for backward;
/// the layer-norm outputs are recomputed there.
fn layer_forward_bf16(
    w: Weights,
    a: &mut LayerActs,
    x: &[f32],
    s: ForwardScratch,
    d: Dims,
    drop: Option<LayerDropout>,
) {
    let (bt, c, r, p, wr) = (d.bt(), d.c, w.r, w.p, w.wr);
    let h = a.half.as_mut().expect("bf16 activations");
    let wide = &mut s.wide[..bt * c];
    let (m1, r1) = (&mut a.ln1_mean[..bt], &mut a.ln1_rstd[..bt]);
    let (ln_w, ln_b) = (&p[r.ln_1_w.clone()], &p[r.ln_1_b.clone()]);
    layernorm_forward_bf16(wide, m1, r1, x, ln_w, ln_b, c);
    // q, k, v: in the pre-GELU scratch (free until the MLP), kept in bf16.
    let qkv = &mut s.pre_gelu[..bt * 3 * c];
    let (wt, b) = (&wr[r.c_attn_w.clone()], &p[r.c_attn_b.clone()]);
    linear_forward_bf16(qkv, wide, wt, b, c, 3 * c);
    bf16::round_and_store(qkv, &mut h.qkv[..bt * 3 * c]);
    let lse = &mut a.att_lse[..d.b * d.nh * d.t];
    let probs = drop.map(|m| m.attn_probs);
    attention_forward(wide, lse, qkv, d, probs);
    bf16::round_and_store(wide, &mut h.atty[..bt * c]);
    let res2 = &mut a.res2[..bt * c];
    let (wt, b) = (&wr[r.attn_proj_w.clone()], &p[r.attn_proj_b.clone()]);
    linear_forward_bf16(res2, wide, wt, b, c, c);
    if let Some(m) = drop {
        dropout::apply(res2, m.attn_resid, 0);
    }
    residual_add_inplace(res2, x);

    let (m2, r2) = (&mut a.ln2_mean[..bt], &mut a.ln2_rstd[..bt]);
    let (ln_w, ln_b) = (&p[r.ln_2_w.clone()], &p[r.ln_2_b.clone()]);
    layernorm_forward_bf16(wide, m2, r2, res2, ln_w, ln_b, c);
    let pre_gelu = &mut s.pre_gelu[..bt * 4 * c];
    let (wt, b) = (&wr[r.c_fc_w.clone()], &p[r.c_fc_b.clone()]);
    linear_forward_bf16(pre_gelu, wide, wt, b, c, 4 * c);
    bf16::round_and_store(pre_gelu, &mut h.fch[..bt * 4 * c]);
    let gelu = &mut s.gelu[..bt * 4 * c];
    gelu_forward_bf16(gelu, pre_gelu);
    let res3 = &mut a.res3[..bt * c];
    let (wt, b) = (&wr[r.mlp_proj_w.clone()], &p[r.mlp_proj_b.clone()]);
    linear_forward_bf16(res3, gelu, wt, b, 4 * c, c);
    if let Some(m) = drop {
        dropout::apply(res3, m.mlp_resid, 0);
    }
    residual_add_inplace(res3, res2);
}

/// [`layer_backward`] under bf16 autocast, for [`layer_forward_bf16`]. The output
/// gradient of every matmul is rounded to bf16 before it is multiplied (as autocast's
/// bf16 matmul receives a bf16 gradient); stored bf16 activations are widened into
/// `hs` for the f32 GEMM; the layer-norm outputs are recomputed from the block's
/// input, the residual stream and their statistics, the GELU output from the stored
/// bf16 pre-GELU values. Parameter gradients accumulate in f32.
#[allow(clippy::too_many_arguments)]
fn layer_backward_bf16(
    w: Weights,
    g: &mut [f32],
    a: &LayerActs,
    x: &[f32],
    s: Scratch,
    hs: &mut HalfScratch,
    d: Dims,
    drop: Option<LayerDropout>,
) {
    let (bt, c, r, p, wr) = (d.bt(), d.c, w.r, w.p, w.wr);
    let h = a.half.as_ref().expect("bf16 activations");
    let dres = &mut s.dres[..bt * c];
    let dbtc = &mut s.dbtc[..bt * c];
    let (wide, dround) = (&mut hs.wide[..bt * c], &mut hs.dround[..bt * c]);
    let wide4c = &mut hs.wide4c[..bt * 4 * c];
    let d4c = &mut s.d4c[..bt * 4 * c];

    // MLP branch. d4c ← gelu(pre-GELU) rounded: the operand of W_proj's dweight.
    bf16::round_into(
        dround,
        branch_grad(dres, s.dbranch, drop.map(|m| m.mlp_resid)),
    );
    gelu_forward_bf16(d4c, &h.fch[..bt * 4 * c]);
    let (dw, db) = split_two(g, r.mlp_proj_w.clone(), r.mlp_proj_b.clone());
    let wt = &wr[r.mlp_proj_w.clone()];
    linear_backward_bf16(wide4c, dw, db, dround, d4c, wt, 4 * c, c);
    // wide4c now holds d(gelu output); GELU's derivative reads the bf16 pre-GELU.
    gelu_backward_bf16(wide4c, &h.fch[..bt * 4 * c]);
    let res2 = &a.res2[..bt * c];
    let (m2, r2) = (&a.ln2_mean[..bt], &a.ln2_rstd[..bt]);
    let (ln_w, ln_b) = (&p[r.ln_2_w.clone()], &p[r.ln_2_b.clone()]);
    layernorm_apply_bf16(wide, res2, m2, r2, ln_w, ln_b, c);
    let (dw, db) = split_two(g, r.c_fc_w.clone(), r.c_fc_b.clone());
    linear_backward_bf16(dbtc, dw, db, wide4c, wide, &wr[r.c_fc_w.clone()], c, 4 * c);
    let (dw, db) = split_two(g, r.ln_2_w.clone(), r.ln_2_b.clone());
    layernorm_backward(dres, dw, db, dbtc, res2, &p[r.ln_2_w.clone()], m2, r2, c);

    // Attention branch.
    bf16::round_into(
        dround,
        branch_grad(dres, s.dbranch, drop.map(|m| m.attn_resid)),
    );
    bf16::load(wide, &h.atty[..bt * c]);
    let (dw, db) = split_two(g, r.attn_proj_w.clone(), r.attn_proj_b.clone());
    let wt = &wr[r.attn_proj_w.clone()];
    linear_backward_bf16(dbtc, dw, db, dround, wide, wt, c, c);
    let dqkv = &mut d4c[..bt * 3 * c];
    let qkv = &mut wide4c[..bt * 3 * c];
    bf16::load(qkv, &h.qkv[..bt * 3 * c]);
    let lse = &a.att_lse[..d.b * d.nh * d.t];
    let probs = drop.map(|m| m.attn_probs);
    attention_backward(dqkv, dbtc, qkv, wide, lse, d, probs);
    bf16::round_in_place(dqkv);
    let (m1, r1) = (&a.ln1_mean[..bt], &a.ln1_rstd[..bt]);
    let (ln_w, ln_b) = (&p[r.ln_1_w.clone()], &p[r.ln_1_b.clone()]);
    layernorm_apply_bf16(wide, x, m1, r1, ln_w, ln_b, c);
    let (dw, db) = split_two(g, r.c_attn_w.clone(), r.c_attn_b.clone());
    linear_backward_bf16(dbtc, dw, db, dqkv, wide, &wr[r.c_attn_w.clone()], c, 3 * c);
    let (dw, db) = split_two(g, r.ln_1_w.clone(), r.ln_1_b.clone());
    layernorm_backward(dres, dw, db, dbtc, x, &p[r.ln_1_w.clone()], m1, r1, c);
}

/// The gradient reaching a residual branch's output: `dres` itself, or a copy with the
/// branch's dropout mask applied.
fn branch_grad<'a>(dres: &'a [f32], dbranch: &'a mut [f32], mask: Option<Dropout>) -> &'a [f32] {
    match mask {
        None => dres,
        Some(m) => {
            let out = &mut dbranch[..dres.len()];
            out.copy_from_slice(dres);
            dropout::apply(out, m, 0);
            out
        }
    }
}

/// Two disjoint mutable sub-slices of one buffer (`second` may be empty).
fn split_two(
    buf: &mut [f32],
    first: std::ops::Range<usize>,
    second: std::ops::Range<usize>,
) -> (&mut [f32], &mut [f32]) {
    if second.is_empty() {
        return (&mut buf[first], &mut []);
    }
    assert!(
        first.end <= second.start,
        "ranges must be ordered and disjoint"
    );
    let (lo, hi) = buf.split_at_mut(second.start);
    (&mut lo[first], &mut hi[..second.len()])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::rand_vec;

    fn tiny(bias: bool, dropout: f32) -> ModelConfig {
        ModelConfig {
            vocab_size: 37,
            block_size: 8,
            n_layer: 2,
            n_head: 2,
            n_embd: 16,
            bias,
            dropout,
        }
    }

    fn batch(b: usize, t: usize, v: usize) -> (Vec<u32>, Vec<i32>) {
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
        let mut gpt = Gpt::new(cfg, b, t).unwrap();
        let real = gpt.config.vocab_size * gpt.config.n_embd;
        let noise = rand_vec(gpt.params.len(), 9);
        for (i, (p, n)) in gpt.params.iter_mut().zip(noise).enumerate() {
            *p = 0.3 * n;
            if (real..gpt.layout.wte.end).contains(&i) {
                *p = 0.0;
            }
        }
        gpt
    }

    fn loss_at(gpt: &mut Gpt, x: &[u32], y: &[i32], b: usize, t: usize, seed: u64) -> f64 {
        gpt.set_dropout_seed(seed);
        let loss = gpt.forward(x, y, b, t) as f64;
        gpt.pending = None;
        loss
    }

    /// Whole-model backward against central differences of the f32 forward, on a
    /// sample of parameters from every tensor (with the same dropout masks).
    fn check_gradients(bias: bool, dropout: f32) {
        let (b, t) = (2, 5);
        let mut gpt = model(tiny(bias, dropout), b, t);
        let (x, y) = batch(b, t, gpt.config.vocab_size);
        gpt.zero_grad();
        gpt.set_dropout_seed(77);
        gpt.forward(&x, &y, b, t);
        gpt.backward();
        let grads = gpt.grads.clone();
        let eps = 1e-2f32;
        for tensor in gpt.layout.tensors.clone() {
            let mut range = tensor.range();
            if tensor.name == "transformer.wte.weight" {
                range.end = range.start + gpt.config.vocab_size * gpt.config.n_embd;
            }
            for i in range.step_by(7) {
                let orig = gpt.params[i];
                gpt.params[i] = orig + eps;
                let plus = loss_at(&mut gpt, &x, &y, b, t, 77);
                gpt.params[i] = orig - eps;
                let minus = loss_at(&mut gpt, &x, &y, b, t, 77);
                gpt.params[i] = orig;
                let numeric = (plus - minus) / (2.0 * eps as f64);
                let analytic = grads[i] as f64;
                assert!(
                    (numeric - analytic).abs() <= 2e-3 + 2e-2 * numeric.abs(),
                    "{} [{}]: backward {analytic} vs finite difference {numeric}",
                    tensor.name,
                    i - tensor.offset
                );
            }
        }
        let vp_rows = gpt.config.vocab_size * gpt.config.n_embd..gpt.layout.wte.end;
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
        let (x, y) = batch(b, t, gpt.config.vocab_size);
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
    fn logits_agree_with_the_loss_and_the_last_position() {
        let (b, t) = (2, 6);
        let mut gpt = model(tiny(true, 0.0), b, t);
        let v = gpt.config.vocab_size;
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
        let last = gpt.logits_last(&x, b, t).to_vec();
        for row in 0..b {
            // Equal up to the GEMM's summation order, which depends on the row count.
            let full = &logits[(row * t + t - 1) * v..(row * t + t) * v];
            let got = &last[row * v..(row + 1) * v];
            assert!(got.iter().zip(full).all(|(a, b)| (a - b).abs() < 1e-6));
        }
        // A shorter sequence through the same buffers gives a causal prefix.
        let short: Vec<u32> = x[..3].to_vec();
        let prefix = gpt.logits_last(&short, 1, 3).to_vec();
        let want = &logits[2 * v..3 * v];
        assert!(prefix.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-5));
    }

    #[test]
    fn training_is_bit_identical_across_runs() {
        let run = || {
            let (b, t) = (2, 8);
            let mut gpt = model(tiny(true, 0.1), b, t);
            gpt.set_dropout_seed(5);
            let (x, y) = batch(b, t, gpt.config.vocab_size);
            let mut opt = crate::optim::AdamW::new(&gpt.layout, Default::default());
            (0..5)
                .map(|_| {
                    gpt.zero_grad();
                    let loss = gpt.forward(&x, &y, b, t);
                    gpt.backward();
                    crate::optim::clip_grad_norm(&mut gpt.grads, 1.0);
                    opt.step(&mut gpt.params, &gpt.grads, 1e-3);
                    loss
                })
                .collect::<Vec<f32>>()
        };
        let first = run();
        assert_eq!(first, run());
        assert!(first[4] < first[0], "the loss goes down: {first:?}");
    }

    #[test]
    fn backward_with_reports_each_bucket_once_final() {
        let (b, t) = (2, 6);
        for bias in [true, false] {
            let mut gpt = model(tiny(bias, 0.1), b, t);
            let (x, y) = batch(b, t, gpt.config.vocab_size);
            let buckets = gpt.grad_buckets();
            assert_eq!(buckets.len(), gpt.config.n_layer + 2);
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

    #[test]
    fn from_params_checks_the_length() {
        let cfg = tiny(true, 0.0);
        let err = Gpt::from_params(cfg, vec![0.0; 3], 1, 4).err().unwrap();
        assert!(err.to_string().contains("needs"));
    }
}
