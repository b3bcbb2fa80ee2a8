//! One transformer block, forward and backward, written once for both precisions
//! (`BF16`: bf16 autocast) and run by training, evaluation and decoding alike.
//!
//! ```text
//! res2 = x    + drop(attn(ln_1(x) · W_attnᵀ) · W_projᵀ)           (B, T, C)
//! res3 = res2 + drop(gelu(ln_2(res2) · W_fcᵀ) · W_projᵀ)
//! ```
//!
//! Under bf16 autocast every matmul operand holds bf16 values: the weights come from
//! the bf16 copy, and each activation feeding a matmul is rounded (the layer-norm
//! outputs and the GELU output by their kernels, q/k/v, the attention output and the
//! pre-GELU layer when they are saved), as is each matmul's output gradient.
//! Accumulation, layer norm, softmax, GELU and the residual stream stay f32.

use super::activations::{BlockActs, Saved, Scratch};
use super::config::LAYER_NORM_EPS;
use super::layout::{BlockLayout, LinearSpans, NormSpans, Span};
use super::lora::{u_segment, u_segment_mut, BlockLora, LoraBufs, Target};
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
use crate::kernels::Dims;

/// A block's parameters as the kernels read them.
#[derive(Clone, Copy)]
pub struct BlockWeights<'a> {
    /// The f32 master parameters: biases and layer-norm parameters come from here.
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

    fn norm(&self, n: NormSpans) -> Norm<'a> {
        norm_of(self.params, n)
    }

    /// `out = inp · Wᵀ + bias` for linear layer `l`: [`linear_forward`]; when
    /// `decoding`, the GEMV for a few rows (decoding steps: f32 activations against
    /// the f32 weights or `matmul_bf16`'s), and with `matmul_bf16` for more (a
    /// prompt) the bf16 GEMM on the bf16 weights ([`matmul_bf16_wt`]: activations
    /// rounded to bf16 as operands, the training step's kernel). out: (N, OC);
    /// inp: (N, C).
    fn forward<const BF16: bool>(&self, out: &mut [f32], inp: &[f32], l: LinearSpans) {
        let few = self.decoding && inp.len() / l.c <= GEMV_MAX_ROWS;
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
}

/// Rows up to which [`BlockWeights::forward`] runs a decoder's linear layers on the GEMV.
const GEMV_MAX_ROWS: usize = 8;

/// A layer norm's parameters in the arena `params`.
pub fn norm_of(params: &[f32], n: NormSpans) -> Norm<'_> {
    Norm {
        weight: &params[n.weight],
        bias: &params[n.bias],
        eps: LAYER_NORM_EPS,
    }
}

/// How a block's queries reach their keys and values.
pub enum Attend<'a> {
    /// Causally over the pass's own positions (training, evaluation); the
    /// log-sum-exp backward needs goes to the block's activations.
    Causal,
    /// Through a key/value cache (decoding): the function appends the new positions'
    /// keys and values, `(out, qkv)`, to its cache and writes each new query's
    /// attention over everything cached up to it into `out`.
    Cache(&'a mut dyn FnMut(&mut [f32], &[f32])),
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
    let (n, c, at) = (d.bt(), d.c, w.at);
    let (m1, r1) = a.ln1_stats.rows_mut(n);
    let ln1 = a.ln1.save(&mut s.staging, n * c, |o| {
        layernorm_forward::<BF16>(o, m1, r1, x, w.norm(at.ln_1))
    });
    let qkv = a.qkv.save(&mut s.staging_wide, n * 3 * c, |o| {
        w.forward::<BF16>(o, ln1, at.c_attn);
        if let Some(l) = &w.lora {
            let u = u_segment_mut(&mut a.lora_u, Target::CAttn);
            l.forward::<BF16>(Target::CAttn, o, ln1, u, &mut s.lora_x);
        }
    });
    let lse = &mut a.att_lse[..d.b * d.nh * d.t];
    let atty = a.atty.save(&mut s.staging, n * c, |o| match attend {
        Attend::Causal => {
            let probs = drop.map(|m| m.attn_probs);
            attention_forward::<BF16>(o, lse, qkv, d, probs, w.backend)
        }
        Attend::Cache(attend) => attend(o, qkv),
    });
    let res2 = &mut a.res2[..n * c];
    w.forward::<BF16>(res2, atty, at.attn_proj);
    if let Some(l) = &w.lora {
        let u = u_segment_mut(&mut a.lora_u, Target::AttnProj);
        l.forward::<BF16>(Target::AttnProj, res2, atty, u, &mut s.lora_x);
    }
    if let Some(m) = drop {
        dropout::apply(res2, m.attn_resid, 0);
    }
    residual_add_inplace(res2, x);

    let (m2, r2) = a.ln2_stats.rows_mut(n);
    let ln2 = a.ln2.save(&mut s.staging, n * c, |o| {
        layernorm_forward::<BF16>(o, m2, r2, res2, w.norm(at.ln_2))
    });
    let fch = a.fch.save(&mut s.staging_wide, n * 4 * c, |o| {
        w.forward::<BF16>(o, ln2, at.c_fc);
        if let Some(l) = &w.lora {
            let u = u_segment_mut(&mut a.lora_u, Target::CFc);
            l.forward::<BF16>(Target::CFc, o, ln2, u, &mut s.lora_x);
        }
    });
    let hidden = &mut s.hidden[..n * 4 * c];
    gelu_forward::<BF16, f32>(hidden, fch);
    let res3 = &mut a.res3[..n * c];
    w.forward::<BF16>(res3, hidden, at.mlp_proj);
    if let Some(l) = &w.lora {
        let u = u_segment_mut(&mut a.lora_u, Target::MlpProj);
        l.forward::<BF16>(Target::MlpProj, res3, hidden, u, &mut s.lora_x);
    }
    if let Some(m) = drop {
        dropout::apply(res3, m.mlp_resid, 0);
    }
    residual_add_inplace(res3, res2);
}

/// One block backward is [`block_forward`] in reverse: [`mlp_backward`], then
/// [`attention_branch_backward`]; between the two, a caller may move communication
/// on. On entry `s.dres` holds d(block output); on return, d(block input `x`).
/// Parameter gradients accumulate into `g` (the whole gradient arena, laid out like
/// the parameters; with LoRA, the adapters' arena).
///
/// The MLP branch's half: `s.dres` goes from d(res3) to d(res2). The GELU output is
/// recomputed into `hidden`, multiplied into W_proj's gradient, then overwritten by
/// its own gradient.
pub fn mlp_backward<const BF16: bool>(
    w: &BlockWeights,
    g: &mut [f32],
    a: &BlockActs,
    s: &mut Scratch,
    drop: Option<BlockDropout>,
    d: Dims,
) {
    let (n, c, at) = (d.bt(), d.c, w.at);
    let (res2, fch) = (&a.res2[..n * c], &a.fch);
    let mask = drop.map(|m| m.mlp_resid);
    let dout = branch_grad::<BF16>(&s.dres[..n * c], &mut s.dbranch, mask);
    let hidden = &mut s.hidden[..n * 4 * c];
    gelu_of_saved::<BF16>(hidden, fch);
    let proj = w.linear(at.mlp_proj);
    let mut bufs = lora_bufs(a, Target::MlpProj, &mut s.lora_x, &mut s.lora_du);
    match &w.lora {
        None => {
            let g = linear_grads(g, at.mlp_proj);
            linear_backward_params::<BF16>(w.backend, g, dout, hidden, proj.c, proj.oc);
        }
        Some(l) => l.backward_params::<BF16>(Target::MlpProj, g, dout, hidden, &mut bufs),
    }
    linear_backward_input::<BF16>(hidden, dout, proj);
    if let Some(l) = &w.lora {
        l.backward_input::<BF16>(Target::MlpProj, hidden, &mut bufs);
    }
    gelu_backward_of_saved::<BF16>(hidden, fch);
    let (m2, r2) = a.ln2_stats.rows(n);
    let ln2 = a.ln2.load(&mut s.staging, n * c, |o| {
        layernorm_recompute::<BF16>(o, res2, m2, r2, w.norm(at.ln_2))
    });
    let (dres, dln2) = (&mut s.dres[..n * c], &mut s.dinp[..n * c]);
    let bufs = lora_bufs(a, Target::CFc, &mut s.lora_x, &mut s.lora_du);
    adapted_backward::<BF16>(w, Target::CFc, g, dln2, hidden, ln2, bufs);
    let ln_w = w.norm(at.ln_2).weight;
    let ng = block_norm_grads(w, g, &mut s.norm_sink, at.ln_2);
    layernorm_backward(dres, ng, dln2, res2, ln_w, m2, r2);
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
    let (n, c, at) = (d.bt(), d.c, w.at);
    let mask = drop.map(|m| m.attn_resid);
    let dout = branch_grad::<BF16>(&s.dres[..n * c], &mut s.dbranch, mask);
    let atty = a.atty.load(&mut s.staging, n * c, not_recomputed);
    let datty = &mut s.dinp[..n * c];
    let bufs = lora_bufs(a, Target::AttnProj, &mut s.lora_x, &mut s.lora_du);
    adapted_backward::<BF16>(w, Target::AttnProj, g, datty, dout, atty, bufs);
    let qkv = a.qkv.load(&mut s.staging_wide, n * 3 * c, not_recomputed);
    let dqkv = &mut s.dqkv[..n * 3 * c];
    let lse = &a.att_lse[..d.b * d.nh * d.t];
    let probs = drop.map(|m| m.attn_probs);
    attention_backward::<BF16>(dqkv, datty, qkv, atty, lse, d, probs, w.backend);
    let (m1, r1) = a.ln1_stats.rows(n);
    let ln1 = a.ln1.load(&mut s.staging, n * c, |o| {
        layernorm_recompute::<BF16>(o, x, m1, r1, w.norm(at.ln_1))
    });
    let (dres, dln1) = (&mut s.dres[..n * c], &mut s.dinp[..n * c]);
    let bufs = lora_bufs(a, Target::CAttn, &mut s.lora_x, &mut s.lora_du);
    adapted_backward::<BF16>(w, Target::CAttn, g, dln1, dqkv, ln1, bufs);
    let ln_w = w.norm(at.ln_1).weight;
    let ng = block_norm_grads(w, g, &mut s.norm_sink, at.ln_1);
    layernorm_backward(dres, ng, dln1, x, ln_w, m1, r1);
}

/// The backward of linear layer `t` with its adapter, if any: `dinp` overwritten
/// with the input gradient; the parameter gradients accumulate into `g`: the
/// base's, or with LoRA (base frozen) the adapter's.
fn adapted_backward<const BF16: bool>(
    w: &BlockWeights,
    t: Target,
    g: &mut [f32],
    dinp: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    mut bufs: LoraBufs,
) {
    let spans = t.linear(w.at);
    let lin = w.linear(spans);
    match &w.lora {
        None => linear_backward::<BF16>(dinp, linear_grads(g, spans), dout, inp, lin),
        Some(l) => {
            l.backward_params::<BF16>(t, g, dout, inp, &mut bufs);
            linear_backward_input::<BF16>(dinp, dout, lin);
            l.backward_input::<BF16>(t, dinp, &mut bufs);
        }
    }
}

/// Target `t`'s adapter buffers in block `a` and the shared scratch.
fn lora_bufs<'a>(a: &'a BlockActs, t: Target, x: &'a mut [f32], du: &'a mut [f32]) -> LoraBufs<'a> {
    LoraBufs {
        u: u_segment(&a.lora_u, t),
        x,
        du,
    }
}

/// Where a block's layer norm's parameter gradients go: the arena `g`, or with
/// LoRA (frozen base) the unread `sink`.
fn block_norm_grads<'a>(
    w: &BlockWeights,
    g: &'a mut [f32],
    sink: &'a mut [f32],
    n: NormSpans,
) -> NormGrads<'a> {
    match w.lora {
        None => norm_grads(g, n),
        Some(_) => sink_grads(sink, !n.bias.is_empty()),
    }
}

/// Parameter gradients of a frozen layer norm, into the unread `sink` (2C).
pub fn sink_grads(sink: &mut [f32], bias: bool) -> NormGrads<'_> {
    let (dweight, dbias) = sink.split_at_mut(sink.len() / 2);
    NormGrads {
        dweight,
        dbias: if bias { dbias } else { &mut [] },
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

/// `out = gelu(fch)`, read straight from the saved pre-GELU layer (f32 or bf16).
fn gelu_of_saved<const BF16: bool>(out: &mut [f32], fch: &Saved) {
    let n = out.len();
    match fch {
        Saved::F32(v) => gelu_forward::<BF16, _>(out, &v[..n]),
        Saved::Bf16(v) => gelu_forward::<BF16, _>(out, &v[..n]),
        Saved::Recomputed => not_recomputed(out),
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

/// The recompute of activations that every precision keeps.
fn not_recomputed(_: &mut [f32]) {
    unreachable!("q/k/v, the attention output and the pre-GELU layer are always kept")
}

/// A linear layer's gradient slices in the arena `g`.
fn linear_grads(g: &mut [f32], l: LinearSpans) -> LinearGrads<'_> {
    let (dweight, dbias) = split_two(g, l.weight, l.bias);
    LinearGrads { dweight, dbias }
}

/// A layer norm's gradient slices in the arena `g`.
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
