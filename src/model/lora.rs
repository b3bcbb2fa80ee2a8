//! LoRA: low-rank adapters on the block's linear layers, trained while the base
//! model stays frozen.
//!
//! ```text
//! out = x · Wᵀ + b  +  s · B · A · drop(x)ᵀ        s = lora_alpha / lora_rank
//! A: (r, in), Kaiming-uniform (a = √5: U(±1/√in)), B: (out, r), zeros
//! ```
//!
//! The adapters are parameters of their own arena ([`LoraLayout`]): a
//! [`ParamLayout`] whose tensors are every targeted layer's `A` and `B`, block by
//! block, so AdamW, clipping, checkpoints and the data-parallel all-reduce run on
//! them unchanged. The frozen base ([`Frozen`]) has no gradient or moment buffers.
//!
//! One target's forward and backward, for `N` rows (`x`: (N, in), `u`: (N, r)):
//!
//! ```text
//! forward    xd = drop(x);  u = s · xd · Aᵀ;  out += u · Bᵀ       (u kept)
//! backward   du = s · dout · B;  dB += doutᵀ · u;  dA += duᵀ · xd;  dx += drop(du · A)
//! ```
//!
//! Under bf16 autocast the matmul operands (`xd`, `u`, `du`, `A`, `B`, `dout`) hold
//! bf16 values, products accumulate in f32, as everywhere else in the block.

use super::config::{Dtype, ModelConfig};
use super::layout::{BlockLayout, LinearSpans, ParamLayout, Span, TensorInfo};
use crate::kernels::bf16::gemm::product;
use crate::kernels::bf16::{self, Backend};
use crate::kernels::dropout::{self, Dropout};
use crate::kernels::mat::Mat;
use anyhow::{bail, Result};
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

/// A linear layer of the block that can carry an adapter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// `attn.c_attn`, (3C, C)
    CAttn = 0,
    /// `attn.c_proj`, (C, C)
    AttnProj = 1,
    /// `mlp.c_fc`, (4C, C)
    CFc = 2,
    /// `mlp.c_proj`, (C, 4C)
    MlpProj = 3,
}

/// Every target, in block order.
pub const TARGETS: [Target; 4] = [
    Target::CAttn,
    Target::AttnProj,
    Target::CFc,
    Target::MlpProj,
];

impl Target {
    /// The name `lora_targets` uses.
    pub fn key(self) -> &'static str {
        ["c_attn", "attn.c_proj", "c_fc", "mlp.c_proj"][self as usize]
    }

    /// The module's path inside a Hugging Face GPT-2 block (`transformer.h.{i}.…`).
    pub fn module(self) -> &'static str {
        ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"][self as usize]
    }

    /// The base linear layer this target adapts.
    pub fn linear(self, at: &BlockLayout) -> LinearSpans {
        match self {
            Target::CAttn => at.c_attn,
            Target::AttnProj => at.attn_proj,
            Target::CFc => at.c_fc,
            Target::MlpProj => at.mlp_proj,
        }
    }

    /// A target from its `lora_targets` name (or its module path, `mlp.c_fc`, ...).
    pub fn parse(name: &str) -> Option<Target> {
        TARGETS
            .into_iter()
            .find(|t| t.key() == name || t.module() == name)
    }
}

/// The adapter settings of a run (config keys `lora_rank`, `lora_alpha`,
/// `lora_dropout`, `lora_targets`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LoraConfig {
    /// r ≥ 1.
    pub rank: usize,
    pub alpha: f32,
    /// Dropout on the adapter's input, in training.
    pub dropout: f32,
    /// Target names ([`Target::key`]), in block order, no repeats.
    pub targets: Vec<String>,
}

impl LoraConfig {
    /// The settings of `lora_rank`, ... with `targets` a comma-separated list;
    /// errors name the key at fault.
    pub fn new(rank: usize, alpha: f32, dropout: f32, targets: &str) -> Result<LoraConfig> {
        if rank == 0 {
            bail!("`lora_rank` must be at least 1 to use LoRA (0 turns it off)");
        }
        if !(alpha.is_finite() && alpha > 0.0) {
            bail!("`lora_alpha` must be a positive number, got {alpha}");
        }
        if !(0.0..1.0).contains(&dropout) {
            bail!("`lora_dropout` must be in [0, 1), got {dropout}");
        }
        let mut picked = [false; 4];
        for name in targets.split(',').map(str::trim) {
            match Target::parse(name) {
                Some(t) => picked[t as usize] = true,
                None => bail!(
                    "`lora_targets` names unknown layer `{name}`; use a comma-separated list of \
                     c_attn, attn.c_proj, c_fc, mlp.c_proj"
                ),
            }
        }
        let targets = TARGETS
            .into_iter()
            .filter(|t| picked[*t as usize])
            .map(|t| t.key().to_string())
            .collect();
        Ok(LoraConfig {
            rank,
            alpha,
            dropout,
            targets,
        })
    }

    /// Refuses a rank above the features of the layers it adapts (`n_embd`: every
    /// target maps C features to a multiple of C or back), where a low-rank update
    /// is no longer low-rank.
    pub fn check_fits(&self, model: &ModelConfig) -> Result<()> {
        if self.rank > model.n_embd {
            bail!(
                "`lora_rank` = {} is more than the {} features of the layers it adapts \
                 (n_embd = {}): a rank above that only costs memory; use lora_rank <= {}",
                self.rank,
                model.n_embd,
                model.n_embd,
                model.n_embd
            );
        }
        Ok(())
    }

    /// `alpha / rank`, the factor of the adapter's output.
    pub fn scale(&self) -> f32 {
        self.alpha / self.rank as f32
    }

    /// Whether `t` carries an adapter.
    pub fn targets(&self, t: Target) -> bool {
        self.targets.iter().any(|k| k == t.key())
    }
}

/// What a LoRA checkpoint records beside its adapters: their settings and the
/// identity of the base they adapt.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LoraState {
    pub config: LoraConfig,
    /// The base: a pretrained name or path (as `init_from` gave it), or `scratch`
    /// (GPT-2's initialisation from `base_seed`).
    pub base: String,
    pub base_seed: u64,
    /// [`fingerprint`] of the base weights as the model holds them.
    pub base_fingerprint: String,
    /// [`blocks_fingerprint`] of the base (absent in checkpoints of older versions):
    /// what an exported adapter records to name its base.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_blocks: Option<String>,
}

/// Where one adapter's `A` (r, in) and `B` (out, r) live in the adapter arena.
#[derive(Clone, Copy, Debug)]
pub struct AdapterSpans {
    pub a: Span,
    pub b: Span,
    /// Input features (the base layer's C).
    pub inp: usize,
    /// Output features (the base layer's OC).
    pub out: usize,
    pub rank: usize,
}

/// One block's adapters, indexed by [`Target`].
pub type BlockAdapters = [Option<AdapterSpans>; 4];

/// The adapter arena: a [`ParamLayout`] of every `A` and `B` (named like PEFT's
/// tensors without its `base_model.model.` prefix, e.g.
/// `transformer.h.0.attn.c_attn.lora_A.weight`), block by block, and where each
/// block's adapters are.
#[derive(Clone, Debug)]
pub struct LoraLayout {
    /// The arena; `layers[l].span` covers block l's adapters (its gradient bucket),
    /// the embedding and `ln_f` spans are empty.
    pub params: ParamLayout,
    pub blocks: Vec<BlockAdapters>,
    /// The gradient buckets of the arena, in backward's order (the last block
    /// first); they tile `0..len`.
    pub buckets: Vec<std::ops::Range<usize>>,
}

/// Offsets are rounded up to this many floats, as in the base arena.
const ALIGN: usize = 16;

impl LoraLayout {
    pub fn new(model: &ModelConfig, lora: &LoraConfig) -> LoraLayout {
        let base = ParamLayout::new(model);
        let (mut tensors, mut len) = (Vec::new(), 0usize);
        let mut push = |name: String, shape: Vec<usize>| {
            let offset = len.div_ceil(ALIGN) * ALIGN;
            let info = TensorInfo {
                name,
                shape,
                offset,
            };
            len = offset + info.numel();
            let span = Span::from(info.range());
            tensors.push(info);
            span
        };
        let mut layers = Vec::new();
        let mut blocks = Vec::new();
        for (i, at) in base.layers.iter().enumerate() {
            let mut adapters: BlockAdapters = [None; 4];
            let mut span: Option<Span> = None;
            for t in TARGETS.into_iter().filter(|&t| lora.targets(t)) {
                let (lin, r) = (t.linear(at), lora.rank);
                let name = |m: &str| format!("transformer.h.{i}.{}.{m}.weight", t.module());
                let a = push(name("lora_A"), vec![r, lin.c]);
                let b = push(name("lora_B"), vec![lin.oc, r]);
                let start = span.map_or(a.start, |s| s.start);
                span = Some(Span::from(start..b.end));
                adapters[t as usize] = Some(AdapterSpans {
                    a,
                    b,
                    inp: lin.c,
                    out: lin.oc,
                    rank: r,
                });
            }
            layers.push(BlockLayout {
                span: span.unwrap_or_default(),
                ..BlockLayout::default()
            });
            blocks.push(adapters);
        }
        let empty = Span::from(len..len);
        let params = ParamLayout {
            tensors,
            wte: empty,
            wpe: empty,
            layers,
            ln_f: Default::default(),
            len,
        };
        let mut hi = params.len;
        let mut buckets = Vec::new();
        for l in (0..blocks.len()).rev() {
            let lo = match l {
                0 => 0,
                _ => params.layers[l].span.start,
            };
            buckets.push(lo..hi);
            hi = lo;
        }
        LoraLayout {
            params,
            blocks,
            buckets,
        }
    }
}

/// PEFT's initialisation: every `A` Kaiming-uniform with a = √5, i.e. uniform in
/// ±1/√in, every `B` zero (so the adapted model starts as the base).
pub fn init_adapters(params: &mut [f32], layout: &LoraLayout, seed: u64) {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ 0x4c6f_5241);
    for spans in layout.blocks.iter().flatten().flatten() {
        let bound = 1.0 / (spans.inp as f32).sqrt();
        for p in &mut params[spans.a] {
            *p = rng.gen_range(-bound..bound);
        }
        params[spans.b].fill(0.0);
    }
}

/// The frozen base model of a LoRA run: its parameters (and their bf16 copy, made
/// once), and the adapters' settings and places.
pub struct Frozen {
    pub layout: ParamLayout,
    pub params: Vec<f32>,
    /// bf16 runs where the model keeps a rounded copy ([`Backend::keeps_bf16_copy`]):
    /// `params` rounded, the matmuls' operand. Empty otherwise.
    pub params_bf16: Vec<f32>,
    /// The adapters' settings and the base's identity.
    pub state: LoraState,
    pub adapters: LoraLayout,
}

impl Frozen {
    /// Makes (or drops) the bf16 copy of the base for `dtype` on `backend`, where the
    /// model keeps one ([`Backend::keeps_bf16_copy`]; the base's weights are never lent).
    pub fn set_dtype(&mut self, dtype: Dtype, backend: &Backend) {
        let bf16 = dtype == Dtype::Bfloat16;
        let mut copy = vec![0.0; backend.bf16_copy_len(bf16, false, self.params.len())];
        if !copy.is_empty() {
            bf16::round_into(&mut copy, &self.params);
        }
        self.params_bf16 = copy;
    }

    /// The base weights with every adapter merged in: `W += s · B · A` (the model
    /// the adapted one computes, without dropout).
    pub fn merged(&self, adapters: &[f32]) -> Vec<f32> {
        let mut params = self.params.clone();
        merge_into(
            &mut params,
            &self.layout,
            &self.adapters,
            adapters,
            &self.state.config,
        );
        params
    }
}

/// `W += s · B · A` for every adapter of `lora` (weights `adapters`) into the base
/// arena `params` (laid out by `base`, weights `[out, in]`). The product is formed
/// in f64 and rounded once.
pub fn merge_into(
    params: &mut [f32],
    base: &ParamLayout,
    lora: &LoraLayout,
    adapters: &[f32],
    config: &LoraConfig,
) {
    let s = config.scale() as f64;
    for (at, block) in base.layers.iter().zip(&lora.blocks) {
        for t in TARGETS {
            let Some(sp) = block[t as usize] else {
                continue;
            };
            let (a, b) = (&adapters[sp.a], &adapters[sp.b]);
            let w = &mut params[t.linear(at).weight];
            for o in 0..sp.out {
                for i in 0..sp.inp {
                    let d: f64 = (0..sp.rank)
                        .map(|k| b[o * sp.rank + k] as f64 * a[k * sp.inp + i] as f64)
                        .sum();
                    let cell = &mut w[o * sp.inp + i];
                    *cell = (*cell as f64 + s * d) as f32;
                }
            }
        }
    }
}

/// A fingerprint of the base weights (FNV-1a over their bytes, in 64-bit words):
/// resuming refuses a base whose fingerprint differs.
pub fn fingerprint(params: &[f32]) -> String {
    use rayon::prelude::*;
    let parts: Vec<u64> = params
        .par_chunks(1 << 16)
        .map(|chunk| {
            chunk.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| {
                (h ^ x.to_bits() as u64).wrapping_mul(0x0000_0100_0000_01b3)
            })
        })
        .collect();
    let h = parts.iter().fold(params.len() as u64, |h, &p| {
        (h ^ p).wrapping_mul(0x0000_0100_0000_01b3)
    });
    format!("fnv64:{h:016x}")
}

/// [`fingerprint`] of the base's transformer blocks alone (what the adapters sit
/// on): unlike the whole arena's, it does not depend on the context length a run
/// cropped the position table to, so an exported adapter can name its base by it.
pub fn blocks_fingerprint(params: &[f32], layout: &ParamLayout) -> String {
    match (layout.layers.first(), layout.layers.last()) {
        (Some(first), Some(last)) => fingerprint(&params[first.span.start..last.span.end]),
        _ => fingerprint(&[]),
    }
}

/// One block's adapters as its forward and backward read them.
#[derive(Clone, Copy)]
pub struct BlockLora<'a> {
    /// The adapter arena's matmul operand: the f32 adapters or their bf16 copy.
    pub weights: &'a [f32],
    pub at: &'a BlockAdapters,
    pub scale: f32,
    /// The input dropout of this pass (training with `lora_dropout > 0`): its
    /// probability and the pass's seed.
    pub dropout: Option<(f32, u64)>,
    pub layer: usize,
    /// The kernel of the bf16 products.
    pub backend: &'a Backend,
}

/// What an adapter's backward reads and works in.
pub struct LoraBufs<'a> {
    /// (N, r) kept by forward: `s · drop(x) · Aᵀ` (a segment of `BlockActs::lora_u`).
    pub u: &'a [f32],
    /// (N, in) scratch for `drop(x)` and `drop(du · A)` (with dropout only).
    pub x: &'a mut [f32],
    /// (N, r) scratch: `du`, from [`BlockLora::backward_params`] to
    /// [`BlockLora::backward_input`].
    pub du: &'a mut [f32],
}

/// Target `t`'s segment of a block's `lora_u` (empty without LoRA).
pub fn u_segment(lora_u: &[f32], t: Target) -> &[f32] {
    let seg = lora_u.len() / 4;
    &lora_u[t as usize * seg..(t as usize + 1) * seg]
}

/// [`u_segment`], to write.
pub fn u_segment_mut(lora_u: &mut [f32], t: Target) -> &mut [f32] {
    let seg = lora_u.len() / 4;
    &mut lora_u[t as usize * seg..(t as usize + 1) * seg]
}

/// Salt of the adapters' dropout seeds (disjoint from the model's dropout sites).
const DROPOUT_SALT: u64 = 0x4c6f_5241_6472_6f70;

impl<'a> BlockLora<'a> {
    fn spans(&self, t: Target) -> Option<AdapterSpans> {
        self.at[t as usize]
    }

    fn mask(&self, t: Target) -> Option<Dropout> {
        self.dropout.map(|(p, seed)| Dropout {
            p,
            seed: Dropout::derive(seed ^ DROPOUT_SALT, self.layer as u64 * 4 + t as u64),
        })
    }

    /// `out += s · drop(x) · Aᵀ · Bᵀ` for target `t` (nothing if it has no adapter);
    /// `u` keeps `s · drop(x) · Aᵀ` ([`u_segment_mut`]), `scratch` is
    /// `Scratch::lora_x`. out: (N, out); x: (N, in).
    pub fn forward<const BF16: bool>(
        &self,
        t: Target,
        out: &mut [f32],
        x: &[f32],
        u: &mut [f32],
        scratch: &mut [f32],
    ) {
        let Some(sp) = self.spans(t) else { return };
        let n = x.len() / sp.inp;
        let xd = self.dropped::<BF16>(t, x, scratch);
        let u = &mut u[..n * sp.rank];
        let a = Mat::new(&self.weights[sp.a], sp.rank, sp.inp);
        product::<BF16>(self.backend, u, Mat::new(xd, n, sp.inp), a.t(), false);
        scale_and_round::<BF16>(u, self.scale);
        let b = Mat::new(&self.weights[sp.b], sp.out, sp.rank);
        product::<BF16>(self.backend, out, Mat::new(u, n, sp.rank), b.t(), true);
    }

    /// The parameter half of the backward of target `t`: `dB += doutᵀ · u`,
    /// `dA += duᵀ · drop(x)`, with `du = s · dout · B` left in `bufs.du` for
    /// [`BlockLora::backward_input`]. `g` is the adapter gradient arena.
    pub fn backward_params<const BF16: bool>(
        &self,
        t: Target,
        g: &mut [f32],
        dout: &[f32],
        x: &[f32],
        bufs: &mut LoraBufs,
    ) {
        let Some(sp) = self.spans(t) else { return };
        let n = x.len() / sp.inp;
        let (dout, u) = (Mat::new(dout, n, sp.out), &bufs.u[..n * sp.rank]);
        let du = &mut bufs.du[..n * sp.rank];
        let b = Mat::new(&self.weights[sp.b], sp.out, sp.rank);
        product::<BF16>(self.backend, du, dout, b, false);
        scale_and_round::<BF16>(du, self.scale);
        product::<BF16>(
            self.backend,
            &mut g[sp.b],
            dout.t(),
            Mat::new(u, n, sp.rank),
            true,
        );
        let xd = self.dropped::<BF16>(t, x, &mut *bufs.x);
        let du = Mat::new(du, n, sp.rank);
        product::<BF16>(
            self.backend,
            &mut g[sp.a],
            du.t(),
            Mat::new(xd, n, sp.inp),
            true,
        );
    }

    /// The input half: `dx += drop(du · A)`, `du` from [`BlockLora::backward_params`].
    /// dx: (N, in).
    pub fn backward_input<const BF16: bool>(&self, t: Target, dx: &mut [f32], bufs: &mut LoraBufs) {
        let Some(sp) = self.spans(t) else { return };
        let n = dx.len() / sp.inp;
        let du = Mat::new(&bufs.du[..n * sp.rank], n, sp.rank);
        let a = Mat::new(&self.weights[sp.a], sp.rank, sp.inp);
        match self.mask(t) {
            None => product::<BF16>(self.backend, dx, du, a, true),
            Some(mask) => {
                let tmp = &mut bufs.x[..n * sp.inp];
                product::<BF16>(self.backend, tmp, du, a, false);
                dropout::apply(tmp, mask, 0);
                dx.iter_mut().zip(tmp.iter()).for_each(|(d, v)| *d += v);
            }
        }
    }

    /// `drop(x)`: `x` itself without dropout, else the masked copy in `scratch`
    /// (rounded to bf16 under autocast).
    fn dropped<'b, const BF16: bool>(
        &self,
        t: Target,
        x: &'b [f32],
        scratch: &'b mut [f32],
    ) -> &'b [f32] {
        let Some(mask) = self.mask(t) else { return x };
        let xd = &mut scratch[..x.len()];
        xd.copy_from_slice(x);
        dropout::apply(xd, mask, 0);
        if BF16 {
            bf16::round_in_place(xd);
        }
        xd
    }
}

/// `v *= s`, then rounded to bf16 under autocast (it is the next matmul's operand).
fn scale_and_round<const BF16: bool>(v: &mut [f32], s: f32) {
    v.iter_mut().for_each(|x| *x *= s);
    if BF16 {
        bf16::round_in_place(v);
    }
}
