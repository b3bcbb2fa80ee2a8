//! One transformer block, forward and backward, written once for every family and
//! both precisions (`BF16`: bf16 autocast), and run by training, evaluation and
//! decoding alike. The family ([`Family`]) says what its pieces are:
//!
//! ```text
//! qkv  = norm_1(x) · W_qkvᵀ                          (B, T, (NH + 2·KV)·HS)
//!        [Qwen3: q/k RMSNorm per head]  [RoPE: q, k turned by position]
//! res2 = x    + drop(attn(qkv) · W_outᵀ)             (B, T, C)
//! res3 = res2 + drop(act(norm_2(res2) · W_upᵀ) · W_downᵀ)
//! ```
//!
//! GPT-2: layer norms, learned positions (outside the block), GELU on `4C`. Llama:
//! RMS norms, RoPE, grouped-query attention, SwiGLU on the stacked gate and up (`2I`).
//!
//! Under bf16 autocast every matmul operand holds bf16 values: the weights come from
//! the bf16 copy, and each activation feeding a matmul is rounded (the norm outputs
//! and the activation's output by their kernels, q/k/v, the attention output and the
//! MLP's pre-activation layer when they are saved), as is each matmul's output
//! gradient. Accumulation, norms, RoPE, softmax, the activations and the residual
//! stream stay f32.

use super::activations::{BlockActs, NormStats, Saved, Scratch};
use super::config::LAYER_NORM_EPS;
use super::family::{Activation, Family, NormKind, Role};
use super::layout::{BlockLayout, LinearSpans, NormSpans, Span};
use super::lora::{BlockLora, LoraBufs};
use super::packs::LayerPacks;
use crate::kernels::attention::{attention_backward, attention_forward};
use crate::kernels::bf16::gemm::matmul_bf16_wt;
use crate::kernels::bf16::{self, Backend, Bf16};
use crate::kernels::dropout::{self, Dropout};
use crate::kernels::gelu::{gelu_backward, gelu_forward};
use crate::kernels::gemv::{gemv, Weights as GemvWeights};
use crate::kernels::layernorm::{
    layernorm_backward, layernorm_forward, layernorm_recompute, Norm, NormGrads,
};
use crate::kernels::matmul::{
    linear_backward, linear_backward_input, linear_backward_params, linear_forward, Linear,
    LinearGrads,
};
use crate::kernels::residual::residual_add_inplace;
use crate::kernels::rmsnorm::{
    qk_norm_backward, qk_norm_forward, rmsnorm_backward, rmsnorm_forward, rmsnorm_recompute,
    RmsNorm,
};
use crate::kernels::rope::{rope_backward, rope_forward, RopeTable};
use crate::kernels::swiglu::{swiglu_backward, swiglu_forward};
use crate::kernels::Dims;

/// A block's parameters as the kernels read them.
#[derive(Clone, Copy)]
pub struct BlockWeights<'a> {
    /// What the block is made of.
    pub family: &'a Family,
    /// The rotary table (families with RoPE), for every position a pass reaches.
    pub rope: Option<&'a RopeTable>,
    /// The f32 master parameters: biases and norm parameters come from here.
    pub params: &'a [f32],
    /// The matmul weights: `params` itself, or (bf16) its bf16-rounded copy.
    pub matmul: &'a [f32],
    pub at: &'a BlockLayout,
    /// LoRA: the block's adapters. The base is then frozen: backward forms no base
    /// parameter gradients, and the gradient arena it is given is the adapters'.
    pub lora: Option<BlockLora<'a>>,
    /// Decoding with bf16 weights: a bf16 copy of `params` (same layout) whose matmul
    /// weights the forward's linear layers read instead of `matmul`, through
    /// [`gemv`] (half the bytes; activations stay f32). Forward only.
    pub matmul_bf16: Option<&'a [Bf16]>,
    /// Decoding: feeds of up to 8 rows (`GEMV_MAX_ROWS`; decoding steps) run the
    /// forward's linear layers on [`gemv`], which streams each weight once for all
    /// rows, in f32 as with `matmul_bf16`. Training's passes keep the GEMM.
    pub decoding: bool,
    /// bf16 on AMX or AVX512-BF16: the block's matmul weights packed beforehand
    /// (from `matmul`), read by the forward and input-gradient products.
    pub packs: Option<&'a LayerPacks>,
    /// The kernel of the bf16 products, and what follows from it.
    pub backend: &'a Backend,
}

impl<'a> BlockWeights<'a> {
    fn linear(&self, l: LinearSpans) -> Linear<'a> {
        Linear {
            weight: &self.matmul[l.weight],
            bias: &self.params[l.bias],
            c: l.c,
            oc: l.oc,
            packs: self.packs.and_then(|p| p.of(l.weight)),
            backend: self.backend,
        }
    }

    /// `out = inp · Wᵀ + bias` for linear layer `l`: [`linear_forward`]; when
    /// `decoding`, the GEMV for a few rows (decoding steps: f32 activations against
    /// the f32 weights or `matmul_bf16`'s), and with `matmul_bf16` for more (a
    /// prompt) the bf16 GEMM on the bf16 weights ([`matmul_bf16_wt`]: activations
    /// rounded to bf16 as operands, the training step's kernel). out: (N, OC);
    /// inp: (N, C).
    fn forward<const BF16: bool>(&self, out: &mut [f32], inp: &[f32], l: LinearSpans) {
        let few = self.decoding && runs_on_the_gemv(inp.len() / l.c);
        let weights = match self.matmul_bf16 {
            Some(w16) => GemvWeights::Bf16(&w16[l.weight.start..l.weight.end]),
            None if few => GemvWeights::F32(&self.matmul[l.weight]),
            None => return linear_forward::<BF16>(out, inp, self.linear(l)),
        };
        let _t = crate::profile::scope(crate::profile::Section::MatmulForward);
        let bias = &self.params[l.bias];
        if !bias.is_empty() {
            out.chunks_exact_mut(l.oc)
                .for_each(|row| row.copy_from_slice(bias));
        }
        match weights {
            GemvWeights::Bf16(w16) if !few => {
                matmul_bf16_wt(self.backend, out, inp, w16, l.c, !bias.is_empty())
            }
            _ => gemv(out, inp, weights, l.c, !bias.is_empty()),
        }
    }

    /// Linear layer `role` with its adapters: `out = inp · Wᵀ + bias (+ LoRA)`;
    /// `lora_u` keeps the adapters' products for backward.
    fn adapted_forward<const BF16: bool>(
        &self,
        role: Role,
        out: &mut [f32],
        inp: &[f32],
        lora_u: &mut [f32],
        s: (&mut [f32], &mut [f32]),
    ) {
        self.forward::<BF16>(out, inp, self.at.linear(role));
        if let Some(l) = &self.lora {
            l.forward::<BF16>(role, out, inp, lora_u, s);
        }
    }

    /// `out = norm(x)` with the norm at `n` of the family's kind; `stats` keeps what
    /// backward needs (the mean, for layer norms, and 1/std).
    fn norm_forward<const BF16: bool>(
        &self,
        out: &mut [f32],
        stats: &mut NormStats,
        x: &[f32],
        n: NormSpans,
    ) {
        norm_forward::<BF16>(self.family, self.params, n, out, stats, x)
    }

    /// [`BlockWeights::norm_forward`]'s output again from its saved statistics.
    fn norm_recompute<const BF16: bool>(
        &self,
        out: &mut [f32],
        x: &[f32],
        stats: &NormStats,
        n: NormSpans,
    ) {
        let rows = x.len() / self.family.c;
        let (mean, rstd) = stats.rows(rows);
        match self.family.norm {
            NormKind::Layer => {
                layernorm_recompute::<BF16>(out, x, mean, rstd, norm_of(self.params, n))
            }
            NormKind::Rms => rmsnorm_recompute::<BF16>(out, x, rstd, self.rms(n)),
        }
    }

    fn rms(&self, n: NormSpans) -> RmsNorm<'a> {
        RmsNorm {
            weight: &self.params[n.weight],
            eps: self.family.norm_eps,
        }
    }
}

/// Rows up to which [`BlockWeights::forward`] runs a decoder's linear layers on the GEMV.
const GEMV_MAX_ROWS: usize = 8;

/// Whether a decoder's feed of `rows` rows (B·p) runs its linear layers on the GEMV:
/// a decoding step, not a prompt.
pub(super) fn runs_on_the_gemv(rows: usize) -> bool {
    rows <= GEMV_MAX_ROWS
}

/// `out = norm(x)` for the norm at `n` (weights in `params`) of `family`'s kind, over
/// x's rows (rows, C); `stats` keeps what backward needs (the mean, for layer norms,
/// and 1/std). The blocks' norms and `ln_f`, in training and in the decoder.
pub fn norm_forward<const BF16: bool>(
    family: &Family,
    params: &[f32],
    n: NormSpans,
    out: &mut [f32],
    stats: &mut NormStats,
    x: &[f32],
) {
    let (mean, rstd) = stats.rows_mut(x.len() / family.c);
    match family.norm {
        NormKind::Layer => layernorm_forward::<BF16>(out, mean, rstd, x, norm_of(params, n)),
        NormKind::Rms => {
            let w = RmsNorm {
                weight: &params[n.weight],
                eps: family.norm_eps,
            };
            rmsnorm_forward::<BF16>(out, rstd, x, w)
        }
    }
}

/// A layer norm's parameters in the arena `params`.
pub fn norm_of(params: &[f32], n: NormSpans) -> Norm<'_> {
    Norm {
        weight: &params[n.weight],
        bias: &params[n.bias],
        eps: LAYER_NORM_EPS,
    }
}

/// Backward of a norm of `family`'s kind at `n` (weights in `params`), given its
/// input `x` and saved `stats`: `dres += d(x)`, parameter gradients into `g`.
#[allow(clippy::too_many_arguments)]
pub fn norm_backward(
    family: &Family,
    params: &[f32],
    n: NormSpans,
    g: NormGrads,
    (dres, dout): (&mut [f32], &[f32]),
    x: &[f32],
    stats: &NormStats,
) {
    let rows = x.len() / family.c;
    let (mean, rstd) = stats.rows(rows);
    let w = &params[n.weight];
    match family.norm {
        NormKind::Layer => layernorm_backward(dres, g, dout, x, w, mean, rstd),
        NormKind::Rms => rmsnorm_backward(dres, g.dweight, dout, x, w, rstd),
    }
}

/// How a block's queries reach their keys and values.
pub enum Attend<'a> {
    /// Causally over the pass's own positions, `0..T` (training, evaluation); the
    /// log-sum-exp backward needs goes to the block's activations.
    Causal,
    /// Through a key/value cache (decoding): the new rows are at positions
    /// `start..start + T`, and `attend` appends their keys and values, `(out, qkv)`,
    /// to its cache and writes each new query's attention over everything cached up
    /// to it into `out`.
    Cache {
        start: usize,
        attend: &'a mut dyn FnMut(&mut [f32], &[f32]),
    },
}

impl Attend<'_> {
    /// The position of the pass's first row.
    fn start(&self) -> usize {
        match self {
            Attend::Causal => 0,
            Attend::Cache { start, .. } => *start,
        }
    }
}

/// The three dropout masks of one block in one pass.
#[derive(Clone, Copy)]
pub struct BlockDropout {
    pub attn_probs: Dropout,
    pub attn_resid: Dropout,
    pub mlp_resid: Dropout,
}

/// Dropout sites within a block, for deriving mask seeds.
const SITE_ATTN_PROBS: u64 = 1;
const SITE_ATTN_RESID: u64 = 2;
const SITE_MLP_RESID: u64 = 3;
const SITES_PER_LAYER: u64 = 4;

impl BlockDropout {
    /// Block `layer`'s masks of probability `p` for the pass seeded `pass_seed` (site 0
    /// of the pass is the embedding's).
    pub fn new(pass_seed: u64, layer: usize, p: f32) -> BlockDropout {
        let site = |s: u64| Dropout {
            p,
            seed: Dropout::derive(pass_seed, 1 + layer as u64 * SITES_PER_LAYER + s),
        };
        BlockDropout {
            attn_probs: site(SITE_ATTN_PROBS),
            attn_resid: site(SITE_ATTN_RESID),
            mlp_resid: site(SITE_MLP_RESID),
        }
    }
}

/// One block forward: `x` (B, T, C) in, `a.res3` out; `a` keeps what backward needs.
pub fn block_forward<const BF16: bool>(
    w: &BlockWeights,
    x: &[f32],
    a: &mut BlockActs,
    s: &mut Scratch,
    attend: Attend,
    drop: Option<BlockDropout>,
    d: Dims,
) {
    let (n, c, at, f) = (d.bt(), d.c, w.at, w.family);
    let (qkv_w, q_w, up_w) = (f.qkv_width(), f.q_width(), f.mlp_up_width());
    let lora_s = (&mut s.lora_x[..], &mut s.lora_y[..]);
    let ln1 = a.ln1.save(&mut s.staging, n * c, |o| {
        w.norm_forward::<BF16>(o, &mut a.ln1_stats, x, at.ln_1)
    });
    let start = attend.start();
    let (raw, rstd) = (&mut a.qkv_raw, &mut a.qk_rstd);
    let qkv = a.qkv.save(&mut s.staging_wide, n * qkv_w, |o| {
        if f.qk_norm {
            // Qwen3: the projection kept before its q/k norm, for the norm's backward.
            let raw = &mut raw[..n * qkv_w];
            w.adapted_forward::<BF16>(Role::Qkv, raw, ln1, &mut a.lora_u, lora_s);
            let rstd = &mut rstd[..n * (f.nh + f.kv)];
            let (q, k) = qk_norms(w);
            qk_norm_forward(o, rstd, raw, d, q, k);
        } else {
            w.adapted_forward::<BF16>(Role::Qkv, o, ln1, &mut a.lora_u, lora_s);
        }
        if let Some(table) = w.rope {
            rope_forward(o, d, table, start);
        }
    });
    let lse = &mut a.att_lse[..d.b * d.nh * d.t];
    let atty = a.atty.save(&mut s.staging, n * q_w, |o| match attend {
        Attend::Causal => {
            let probs = drop.map(|m| m.attn_probs);
            attention_forward::<BF16>(o, lse, qkv, d, probs, w.backend)
        }
        Attend::Cache { attend, .. } => attend(o, qkv),
    });
    let res2 = &mut a.res2[..n * c];
    let lora_s = (&mut s.lora_x[..], &mut s.lora_y[..]);
    w.adapted_forward::<BF16>(Role::AttnOut, res2, atty, &mut a.lora_u, lora_s);
    if let Some(m) = drop {
        dropout::apply(res2, m.attn_resid, 0);
    }
    residual_add_inplace(res2, x);

    let ln2 = a.ln2.save(&mut s.staging, n * c, |o| {
        w.norm_forward::<BF16>(o, &mut a.ln2_stats, res2, at.ln_2)
    });
    let fch = a.fch.save(&mut s.staging_wide, n * up_w, |o| {
        let lora_s = (&mut s.lora_x[..], &mut s.lora_y[..]);
        w.adapted_forward::<BF16>(Role::MlpUp, o, ln2, &mut a.lora_u, lora_s)
    });
    let hidden = &mut s.hidden[..n * f.mlp_width];
    match f.activation {
        Activation::Gelu => gelu_forward::<BF16, f32>(hidden, fch),
        Activation::SwiGlu => swiglu_forward::<BF16, f32>(hidden, fch, f.mlp_width),
    }
    let res3 = &mut a.res3[..n * c];
    let lora_s = (&mut s.lora_x[..], &mut s.lora_y[..]);
    w.adapted_forward::<BF16>(Role::MlpDown, res3, hidden, &mut a.lora_u, lora_s);
    if let Some(m) = drop {
        dropout::apply(res3, m.mlp_resid, 0);
    }
    residual_add_inplace(res3, res2);
}

/// Qwen3's q and k norms of block `w`.
fn qk_norms<'a>(w: &BlockWeights<'a>) -> (RmsNorm<'a>, RmsNorm<'a>) {
    let eps = w.family.norm_eps;
    let q = RmsNorm {
        weight: &w.params[w.at.q_norm],
        eps,
    };
    let k = RmsNorm {
        weight: &w.params[w.at.k_norm],
        eps,
    };
    (q, k)
}

/// One block backward is [`block_forward`] in reverse: [`mlp_backward`], then
/// [`attention_branch_backward`]; between the two, a caller may move communication
/// on. On entry `s.dres` holds d(block output); on return, d(block input `x`).
/// Parameter gradients accumulate into `g` (the whole gradient arena, laid out like
/// the parameters; with LoRA, the adapters' arena).
///
/// The MLP branch's half: `s.dres` goes from d(res3) to d(res2). The activation's
/// output is recomputed into `hidden`, multiplied into W_down's gradient, then
/// overwritten by its own gradient.
pub fn mlp_backward<const BF16: bool>(
    w: &BlockWeights,
    g: &mut [f32],
    a: &BlockActs,
    s: &mut Scratch,
    drop: Option<BlockDropout>,
    d: Dims,
) {
    let (n, c, at, f) = (d.bt(), d.c, w.at, w.family);
    let (res2, fch) = (&a.res2[..n * c], &a.fch);
    let mask = drop.map(|m| m.mlp_resid);
    let dout = branch_grad::<BF16>(&s.dres[..n * c], &mut s.dbranch, mask);
    let hidden = &mut s.hidden[..n * f.mlp_width];
    activation_of_saved::<BF16>(f, hidden, fch);
    let down = w.linear(at.mlp_down);
    let mut bufs = lora_bufs(a, &mut s.lora_x, &mut s.lora_du);
    match &w.lora {
        None => {
            let g = linear_grads(g, at.mlp_down);
            linear_backward_params::<BF16>(w.backend, g, dout, hidden, down.c, down.oc);
        }
        Some(l) => l.backward_params::<BF16>(Role::MlpDown, g, dout, hidden, &mut bufs),
    }
    linear_backward_input::<BF16>(hidden, dout, down);
    if let Some(l) = &w.lora {
        l.backward_input::<BF16>(Role::MlpDown, hidden, &mut bufs);
    }
    // d(pre-activation): in place for GELU (same width), into `dmlp_up` for SwiGLU.
    let dfch: &[f32] = match f.activation {
        Activation::Gelu => {
            gelu_backward_of_saved::<BF16>(hidden, fch);
            hidden
        }
        Activation::SwiGlu => {
            let dup = &mut s.dmlp_up[..n * f.mlp_up_width()];
            swiglu_backward_of_saved::<BF16>(dup, hidden, fch, f.mlp_width);
            dup
        }
    };
    let ln2 = a.ln2.load(&mut s.staging, n * c, |o| {
        w.norm_recompute::<BF16>(o, res2, &a.ln2_stats, at.ln_2)
    });
    let (dres, dln2) = (&mut s.dres[..n * c], &mut s.dinp[..n * c]);
    let bufs = lora_bufs(a, &mut s.lora_x, &mut s.lora_du);
    adapted_backward::<BF16>(w, Role::MlpUp, g, dln2, dfch, ln2, bufs);
    let ng = block_norm_grads(w, g, &mut s.norm_sink, at.ln_2);
    norm_backward(f, w.params, at.ln_2, ng, (dres, dln2), res2, &a.ln2_stats);
}

/// The attention branch's half of a block's backward ([`mlp_backward`]): `s.dres`
/// goes from d(res2) to d(x).
pub fn attention_branch_backward<const BF16: bool>(
    w: &BlockWeights,
    g: &mut [f32],
    x: &[f32],
    a: &BlockActs,
    s: &mut Scratch,
    drop: Option<BlockDropout>,
    d: Dims,
) {
    let (n, c, at, f) = (d.bt(), d.c, w.at, w.family);
    let (qkv_w, q_w) = (f.qkv_width(), f.q_width());
    let mask = drop.map(|m| m.attn_resid);
    let dout = branch_grad::<BF16>(&s.dres[..n * c], &mut s.dbranch, mask);
    let atty = a.atty.load(&mut s.staging, n * q_w, not_recomputed);
    let datty = &mut s.dinp[..n * q_w];
    let bufs = lora_bufs(a, &mut s.lora_x, &mut s.lora_du);
    adapted_backward::<BF16>(w, Role::AttnOut, g, datty, dout, atty, bufs);
    let qkv = a.qkv.load(&mut s.staging_wide, n * qkv_w, not_recomputed);
    let dqkv = &mut s.dqkv[..n * qkv_w];
    let lse = &a.att_lse[..d.b * d.nh * d.t];
    let probs = drop.map(|m| m.attn_probs);
    // Under autocast d(qkv) is the projection's operand: rounded as the attention's
    // backward finishes it, or after RoPE's and the q/k norm's backward.
    let after = w.rope.is_some() || f.qk_norm;
    attention_backward::<BF16>(dqkv, datty, qkv, atty, lse, d, probs, w.backend, !after);
    if let Some(table) = w.rope {
        rope_backward(dqkv, d, table, 0);
    }
    if f.qk_norm {
        let rstd = &a.qk_rstd[..n * (f.nh + f.kv)];
        let (q, k) = qk_norms(w);
        let raw = &a.qkv_raw[..n * qkv_w];
        let grads = match w.lora {
            None => split_two(g, at.q_norm, at.k_norm),
            Some(_) => s.norm_sink[..2 * f.hs].split_at_mut(f.hs),
        };
        qk_norm_backward(dqkv, grads, raw, rstd, d, q.weight, k.weight);
    }
    if BF16 && after {
        bf16::round_in_place(dqkv);
    }
    let ln1 = a.ln1.load(&mut s.staging, n * c, |o| {
        w.norm_recompute::<BF16>(o, x, &a.ln1_stats, at.ln_1)
    });
    let (dres, dln1) = (&mut s.dres[..n * c], &mut s.dinp[..n * c]);
    let bufs = lora_bufs(a, &mut s.lora_x, &mut s.lora_du);
    adapted_backward::<BF16>(w, Role::Qkv, g, dln1, dqkv, ln1, bufs);
    let ng = block_norm_grads(w, g, &mut s.norm_sink, at.ln_1);
    norm_backward(f, w.params, at.ln_1, ng, (dres, dln1), x, &a.ln1_stats);
}

/// The backward of linear layer `role` with its adapters, if any: `dinp` overwritten
/// with the input gradient; the parameter gradients accumulate into `g`: the
/// base's, or with LoRA (base frozen) the adapters'.
fn adapted_backward<const BF16: bool>(
    w: &BlockWeights,
    role: Role,
    g: &mut [f32],
    dinp: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    mut bufs: LoraBufs,
) {
    let spans = w.at.linear(role);
    let lin = w.linear(spans);
    match &w.lora {
        None => linear_backward::<BF16>(dinp, linear_grads(g, spans), dout, inp, lin),
        Some(l) => {
            l.backward_params::<BF16>(role, g, dout, inp, &mut bufs);
            linear_backward_input::<BF16>(dinp, dout, lin);
            l.backward_input::<BF16>(role, dinp, &mut bufs);
        }
    }
}

/// The adapters' buffers of block `a` and the shared scratch.
fn lora_bufs<'a>(a: &'a BlockActs, x: &'a mut [f32], du: &'a mut [f32]) -> LoraBufs<'a> {
    LoraBufs {
        u: &a.lora_u,
        x,
        du,
    }
}

/// Where a block's norm's parameter gradients go: the arena `g`, or with LoRA
/// (frozen base) the unread `sink`.
fn block_norm_grads<'a>(
    w: &BlockWeights,
    g: &'a mut [f32],
    sink: &'a mut [f32],
    n: NormSpans,
) -> NormGrads<'a> {
    match w.lora {
        None => norm_grads(g, n),
        Some(_) => sink_grads(sink, n),
    }
}

/// Parameter gradients of the frozen norm at `n`, into the unread `sink` (at least
/// twice its width).
pub fn sink_grads(sink: &mut [f32], n: NormSpans) -> NormGrads<'_> {
    let c = n.weight.len();
    let (dweight, rest) = sink.split_at_mut(c);
    NormGrads {
        dweight,
        dbias: &mut rest[..n.bias.len()],
    }
}

/// The gradient reaching a residual branch's output projection: `dres` itself, or
/// (with the branch's dropout, or under bf16 autocast) a copy in `dbranch` with the
/// mask applied and rounded to bf16.
fn branch_grad<'a, const BF16: bool>(
    dres: &'a [f32],
    dbranch: &'a mut [f32],
    mask: Option<Dropout>,
) -> &'a [f32] {
    if !BF16 && mask.is_none() {
        return dres;
    }
    let out = &mut dbranch[..dres.len()];
    match mask {
        // bf16 without dropout: the copy and the rounding in one pass.
        None => bf16::round_into(out, dres),
        Some(m) => {
            out.copy_from_slice(dres);
            dropout::apply(out, m, 0);
            if BF16 {
                bf16::round_in_place(out);
            }
        }
    }
    out
}

/// `out = act(fch)`, read straight from the saved pre-activation layer (f32 or bf16).
fn activation_of_saved<const BF16: bool>(f: &Family, out: &mut [f32], fch: &Saved) {
    let up = out.len() / f.mlp_width * f.mlp_up_width();
    match (f.activation, fch) {
        (Activation::Gelu, Saved::F32(v)) => gelu_forward::<BF16, _>(out, &v[..up]),
        (Activation::Gelu, Saved::Bf16(v)) => gelu_forward::<BF16, _>(out, &v[..up]),
        (Activation::SwiGlu, Saved::F32(v)) => {
            swiglu_forward::<BF16, _>(out, &v[..up], f.mlp_width)
        }
        (Activation::SwiGlu, Saved::Bf16(v)) => {
            swiglu_forward::<BF16, _>(out, &v[..up], f.mlp_width)
        }
        (_, Saved::Recomputed) => not_recomputed(out),
    }
}

/// `d = gelu'(fch) · d` in place, reading the saved pre-GELU layer (f32 or bf16).
fn gelu_backward_of_saved<const BF16: bool>(d: &mut [f32], fch: &Saved) {
    let n = d.len();
    match fch {
        Saved::F32(v) => gelu_backward::<BF16, _>(d, &v[..n]),
        Saved::Bf16(v) => gelu_backward::<BF16, _>(d, &v[..n]),
        Saved::Recomputed => not_recomputed(d),
    }
}

/// `dgate_up` from `dh` through SwiGLU, reading the saved gate and up (f32 or bf16).
fn swiglu_backward_of_saved<const BF16: bool>(dgu: &mut [f32], dh: &[f32], fch: &Saved, i: usize) {
    let n = dgu.len();
    match fch {
        Saved::F32(v) => swiglu_backward::<BF16, _>(dgu, dh, &v[..n], i),
        Saved::Bf16(v) => swiglu_backward::<BF16, _>(dgu, dh, &v[..n], i),
        Saved::Recomputed => not_recomputed(dgu),
    }
}

/// The recompute of activations that every precision keeps.
fn not_recomputed(_: &mut [f32]) {
    unreachable!("q/k/v, the attention output and the pre-activation layer are always kept")
}

/// A linear layer's gradient slices in the arena `g`.
fn linear_grads(g: &mut [f32], l: LinearSpans) -> LinearGrads<'_> {
    let (dweight, dbias) = split_two(g, l.weight, l.bias);
    LinearGrads { dweight, dbias }
}

/// A norm's gradient slices in the arena `g`.
pub fn norm_grads(g: &mut [f32], l: NormSpans) -> NormGrads<'_> {
    let (dweight, dbias) = split_two(g, l.weight, l.bias);
    NormGrads { dweight, dbias }
}

/// Two disjoint mutable sub-slices of one buffer (`second` may be empty).
pub fn split_two(buf: &mut [f32], first: Span, second: Span) -> (&mut [f32], &mut [f32]) {
    if second.is_empty() {
        return (&mut buf[first], &mut []);
    }
    assert!(
        first.end <= second.start,
        "spans must be ordered and disjoint"
    );
    let (lo, hi) = buf.split_at_mut(second.start);
    (&mut lo[first], &mut hi[..second.len()])
}
