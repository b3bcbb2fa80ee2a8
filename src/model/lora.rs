//! LoRA: low-rank adapters on the block's linear layers (on any of the Hugging Face
//! tensors a layer is made of: GPT-2's `c_attn`, Llama's `q_proj`, ...), trained while
//! the base model stays frozen.
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
use super::family::{known_lora_targets, Family, Role};
use super::layout::{BlockLayout, ParamLayout, Span, TensorInfo};
use super::packs::Packs;
use crate::kernels::bf16::gemm::product;
use crate::kernels::bf16::{self, Backend};
use crate::kernels::dropout::{self, Dropout};
use crate::kernels::mat::Mat;
use anyhow::{bail, Result};
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use std::ops::Range;

/// A place for an adapter: part `part` of the block's linear layer `role` (one
/// Hugging Face tensor: GPT-2's `c_attn`, Llama's `q_proj`, ...), and its `index`
/// among the family's targets ([`Family::lora_targets`]), which orders them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Target {
    pub role: Role,
    pub part: usize,
    pub index: usize,
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
    /// Target names (`lora_targets`: GPT-2's `c_attn`, ..., Llama's `q_proj`, ...), in
    /// the families' block order, no repeats.
    pub targets: Vec<String>,
}

impl LoraConfig {
    /// The settings of `lora_rank`, ... with `targets` a comma-separated list of
    /// target names or module paths; errors name the key at fault. Which names a
    /// model has is checked against its family ([`LoraConfig::check`]).
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
        let known = known_lora_targets();
        let mut picked = vec![false; known.len()];
        for name in targets.split(',').map(str::trim) {
            match known
                .iter()
                .position(|p| p.lora == name || p.module == name)
            {
                Some(k) => picked[k] = true,
                None => {
                    let names: Vec<&str> = known.iter().map(|p| p.lora).collect();
                    bail!(
                        "`lora_targets` names unknown layer `{name}`; use a comma-separated list \
                         of {} (GPT-2), or {} (Llama, Qwen, Mistral)",
                        names[..4].join(", "),
                        names[4..].join(", ")
                    )
                }
            }
        }
        let targets = (known.iter().zip(&picked))
            .filter(|(_, &p)| p)
            .map(|(t, _)| t.lora.to_string())
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

    /// The targets in `family`, in its block order. GPT-2's names stand for the
    /// layers in the same place of any family (`c_attn`: the q, k and v projections;
    /// `attn.c_proj`: the attention's output; `c_fc`: the MLP's first projection, both
    /// of SwiGLU's; `mlp.c_proj`: the MLP's last), so the default `c_attn` adapts
    /// every model's attention inputs. An error names a target the family does not
    /// have, and the ones it has.
    pub fn resolve(&self, family: &Family) -> Result<Vec<Target>> {
        let all: Vec<(Role, usize, &str)> = family.lora_targets().collect();
        let gpt2 = Family::gpt2(1, 1, false);
        let mut roles = Vec::new();
        let mut named = Vec::new();
        for name in &self.targets {
            if all.iter().any(|t| t.2 == name) {
                named.push(name.as_str());
            } else if let Some((role, _)) = gpt2.lora_target(name) {
                roles.push(role);
            } else {
                let names: Vec<&str> = all.iter().map(|t| t.2).collect();
                bail!(
                    "`lora_targets` names `{name}`, which a {} model does not have; its layers \
                     are {}",
                    family.model_type(),
                    names.join(", ")
                );
            }
        }
        let picked =
            |&(role, _, name): &(Role, usize, &str)| named.contains(&name) || roles.contains(&role);
        let found = (all.iter().enumerate())
            .filter(|(_, t)| picked(t))
            .map(|(index, &(role, part, _))| Target { role, part, index });
        Ok(found.collect())
    }

    /// Checks that every target is a layer of `model`'s family.
    pub fn check(&self, model: &ModelConfig) -> Result<()> {
        self.resolve(&model.family()).map(|_| ())
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

/// Where one adapter's `A` (r, in) and `B` (rows, r) live in the adapter arena, and
/// which output rows of its linear layer it adds to.
#[derive(Clone, Copy, Debug)]
pub struct AdapterSpans {
    pub target: Target,
    pub a: Span,
    pub b: Span,
    /// Input features (the base layer's C).
    pub inp: usize,
    /// The part's first output row in the linear layer, and its rows.
    pub row0: usize,
    pub out: usize,
    /// Output rows of the whole linear layer (OC).
    pub oc: usize,
    pub rank: usize,
}

/// One block's adapters, indexed by [`Target::index`] (None: no adapter there).
pub type BlockAdapters = Vec<Option<AdapterSpans>>;

/// The adapter arena: a [`ParamLayout`] of every `A` and `B` (named like PEFT's
/// tensors without its `base_model.model.` prefix, e.g.
/// `transformer.h.0.attn.c_attn.lora_A.weight`,
/// `model.layers.0.self_attn.q_proj.lora_A.weight`), block by block, and where each
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
    /// The adapted layers are GPT-2's Conv1D (PEFT's `fan_in_fan_out`).
    pub fan_in_fan_out: bool,
    /// The adapted layers' target names in the model's family, in block order
    /// (PEFT's `target_modules`).
    pub targets: Vec<&'static str>,
}

/// Offsets are rounded up to this many floats, as in the base arena.
const ALIGN: usize = 16;

impl LoraLayout {
    /// The adapters of `lora` on a model of `model`'s architecture.
    ///
    /// # Panics
    /// If a target is not a layer of the model's family ([`LoraConfig::check`] says
    /// so with a message).
    pub fn new(model: &ModelConfig, lora: &LoraConfig) -> LoraLayout {
        let family = model.family();
        let targets = lora
            .resolve(&family)
            .unwrap_or_else(|e| panic!("unchecked LoRA targets: {e:#}"));
        let (base, names) = (ParamLayout::new(model), family.names());
        let n_targets = family.lora_targets().count();
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
            let mut adapters: BlockAdapters = vec![None; n_targets];
            let mut span: Option<Span> = None;
            for &t in &targets {
                let linear = family.linear(t.role);
                let part = linear.parts[t.part];
                let (lin, r) = (at.linear(t.role), lora.rank);
                let module = format!("{}{i}.{}", names.block, part.module);
                let a = push(format!("{module}.lora_A.weight"), vec![r, lin.c]);
                let b = push(format!("{module}.lora_B.weight"), vec![part.rows, r]);
                let start = span.map_or(a.start, |s| s.start);
                span = Some(Span::from(start..b.end));
                adapters[t.index] = Some(AdapterSpans {
                    target: t,
                    a,
                    b,
                    inp: lin.c,
                    row0: linear.row_offset(t.part),
                    out: part.rows,
                    oc: lin.oc,
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
            lm_head: empty,
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
            fan_in_fan_out: family.conv1d(),
            targets: (targets.iter())
                .map(|t| family.linear(t.role).parts[t.part].lora)
                .collect(),
        }
    }

    /// Adapters per block the family has places for (the segments of
    /// `BlockActs::lora_u`).
    pub fn places(&self) -> usize {
        self.blocks.first().map_or(0, Vec::len)
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
    /// Whether the blocks' linear weights of `params` are given back where the bf16
    /// copy or the packs hold them ([`Frozen::release_linears`]): they then read as
    /// zeros.
    release: bool,
    /// Whether packs hold the blocks' linear weights for the products
    /// ([`Frozen::pack_into`]).
    packed: bool,
}

impl Frozen {
    /// The frozen base `params` (laid out by `layout`) of `adapters`, in f32.
    pub fn new(
        layout: ParamLayout,
        params: Vec<f32>,
        state: LoraState,
        adapters: LoraLayout,
    ) -> Frozen {
        Frozen {
            layout,
            params,
            params_bf16: Vec::new(),
            state,
            adapters,
            release: false,
            packed: false,
        }
    }

    /// Makes (or drops) the bf16 copy of the base for `dtype` on `backend`, where the
    /// model keeps one ([`Backend::keeps_bf16_copy`]; the base's weights are never lent),
    /// and forgets any packs ([`Frozen::pack_into`] packs again). After
    /// [`Frozen::release_linears`], each f32 linear is given back as soon as its copy
    /// is made: the base is never held twice.
    ///
    /// # Panics
    /// Once the f32 linears are given back: the weights to round are gone.
    pub fn set_dtype(&mut self, dtype: Dtype, backend: &Backend) {
        assert!(
            !self.released(),
            "the frozen base's f32 linears were released"
        );
        self.packed = false;
        let bf16 = dtype == Dtype::Bfloat16;
        let mut copy = vec![0.0; backend.bf16_copy_len(bf16, false, self.params.len())];
        if copy.is_empty() {
            self.params_bf16 = copy;
            return;
        }
        let mut at = 0;
        if self.release {
            for linear in linear_weights(&self.layout) {
                bf16::round_into(&mut copy[at..linear.end], &self.params[at..linear.end]);
                at = linear.end;
                crate::resident::release(&mut self.params, linear);
            }
        }
        bf16::round_into(&mut copy[at..], &self.params[at..]);
        self.params_bf16 = copy;
    }

    /// Packs the base into `packs` (made for this model) for the products that read
    /// packs (AMX, AVX512-BF16), rounding: `wte`, then block by block. After
    /// [`Frozen::release_linears`], each block's f32 linears are given back as soon
    /// as they are packed, where the packs hold them ([`Packs::has_linears`]): the
    /// base is never held twice.
    ///
    /// # Panics
    /// Once the f32 linears are given back: the weights to pack are gone.
    pub fn pack_into(&mut self, packs: &mut Packs, config: &ModelConfig) {
        assert!(
            !self.released(),
            "the frozen base's f32 linears were released"
        );
        self.packed = packs.has_linears();
        let release = self.released();
        let classifier = self.layout.classifier().start;
        packs.pack_range(
            classifier..classifier + 1,
            &self.params,
            &self.layout,
            config,
        );
        for at in &self.layout.layers {
            let start = at.span.start;
            packs.pack_range(start..start + 1, &self.params, &self.layout, config);
            if release {
                for s in at.linears() {
                    crate::resident::release(&mut self.params, s.weight.range());
                }
            }
        }
    }

    /// Whether a bf16 run on `backend` gives the base's f32 linears back after
    /// [`Frozen::release_linears`]: where its products read a rounded copy or packs
    /// of them ([`Frozen::released`] then says so of the model itself).
    pub fn gives_back_linears(bf16: bool, backend: &Backend) -> bool {
        let packed = backend.packs_weights(bf16, false) && Packs::linears_pay(None, false, true);
        backend.keeps_bf16_copy(bf16, false) || packed
    }

    /// Gives back the memory of the blocks' f32 linear weights wherever something
    /// else holds them for the products in a bf16 run: a rounded copy (the f32 GEMM,
    /// oneDNN) or the packs (AMX, AVX512-BF16). Now if the copy or the packs exist,
    /// else as [`Frozen::set_dtype`] or [`Frozen::pack_into`] makes them. Nothing in
    /// such a run reads them again, so the base is held once, rounded, with only its
    /// embeddings, norms and biases also in f32. The weights for [`Frozen::merged`]
    /// must then come from the base's source again ([`Frozen::released`]). In f32,
    /// and with `NANOGPT_BF16_PACKS=0` (the products then read the f32 base),
    /// nothing is given back. Returns the bytes given back now.
    pub fn release_linears(&mut self) -> usize {
        let now = !self.release && self.held_elsewhere();
        self.release = true;
        if !now {
            return 0;
        }
        for linear in linear_weights(&self.layout) {
            crate::resident::release(&mut self.params, linear);
        }
        4 * Frozen::linears_len(&self.layout)
    }

    /// Whether the f32 linears were given back ([`Frozen::release_linears`]): asked
    /// for, and a copy or the packs hold them.
    pub fn released(&self) -> bool {
        self.release && self.held_elsewhere()
    }

    /// Whether the products read the blocks' linear weights from somewhere other
    /// than `params`: the rounded copy or the packs.
    fn held_elsewhere(&self) -> bool {
        !self.params_bf16.is_empty() || self.packed
    }

    /// Floats of the f32 linears [`Frozen::release_linears`] gives back in a model
    /// laid out by `layout`.
    pub fn linears_len(layout: &ParamLayout) -> usize {
        linear_weights(layout).iter().map(|r| r.len()).sum()
    }

    /// The base weights with every adapter merged in: `W += s · B · A` (the model
    /// the adapted one computes, without dropout).
    ///
    /// # Panics
    /// After [`Frozen::release_linears`]: merge into the base loaded again instead
    /// ([`merge_into`]).
    pub fn merged(&self, adapters: &[f32]) -> Vec<f32> {
        assert!(
            !self.released(),
            "the frozen base's f32 linears were released"
        );
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

/// The blocks' linear weights of a model laid out by `layout`, in arena order.
fn linear_weights(layout: &ParamLayout) -> Vec<Range<usize>> {
    let mut linears: Vec<_> = (layout.layers.iter())
        .flat_map(|l| l.linears().map(|s| s.weight.range()))
        .collect();
    linears.sort_by_key(|r| r.start);
    linears
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
        for sp in block.iter().flatten() {
            let (a, b) = (&adapters[sp.a], &adapters[sp.b]);
            let w = &mut params[at.linear(sp.target.role).weight];
            for o in 0..sp.out {
                for i in 0..sp.inp {
                    let d: f64 = (0..sp.rank)
                        .map(|k| b[o * sp.rank + k] as f64 * a[k * sp.inp + i] as f64)
                        .sum();
                    let cell = &mut w[(sp.row0 + o) * sp.inp + i];
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
    /// (places, N, r) kept by forward: each target's `s · drop(x) · Aᵀ`
    /// (`BlockActs::lora_u`, one segment per [`Target::index`]).
    pub u: &'a [f32],
    /// (N, in) scratch for `drop(x)` and `drop(du · A)` (with dropout only).
    pub x: &'a mut [f32],
    /// (parts, N, r) scratch: each part's `du`, from [`BlockLora::backward_params`]
    /// to [`BlockLora::backward_input`].
    pub du: &'a mut [f32],
}

/// Target `index`'s segment of a block's `lora_u` of `places` segments.
fn u_segment(lora_u: &[f32], index: usize, places: usize) -> &[f32] {
    let seg = lora_u.len() / places.max(1);
    &lora_u[index * seg..(index + 1) * seg]
}

/// [`u_segment`], to write.
fn u_segment_mut(lora_u: &mut [f32], index: usize, places: usize) -> &mut [f32] {
    let seg = lora_u.len() / places.max(1);
    &mut lora_u[index * seg..(index + 1) * seg]
}

/// Salt of the adapters' dropout seeds (disjoint from the model's dropout sites).
const DROPOUT_SALT: u64 = 0x4c6f_5241_6472_6f70;

impl<'a> BlockLora<'a> {
    /// The adapters on the parts of linear layer `role`, in part order.
    fn of(&self, role: Role) -> impl Iterator<Item = AdapterSpans> + 'a {
        let at: &'a BlockAdapters = self.at;
        at.iter()
            .flatten()
            .filter(move |sp| sp.target.role == role)
            .copied()
    }

    /// Whether the linear layer `role` carries any adapter.
    pub fn adapts(&self, role: Role) -> bool {
        self.of(role).next().is_some()
    }

    fn mask(&self, t: Target) -> Option<Dropout> {
        let site = (self.layer * self.at.len() + t.index) as u64;
        self.dropout.map(|(p, seed)| Dropout {
            p,
            seed: Dropout::derive(seed ^ DROPOUT_SALT, site),
        })
    }

    /// `out[:, rows] += s · drop(x) · Aᵀ · Bᵀ` for every adapter on the parts of
    /// `role`, each into its part's rows of the output; `lora_u` keeps each
    /// `s · drop(x) · Aᵀ`, `scratch` is `Scratch::lora_x` and `part_out`
    /// `Scratch::lora_y` (a part's product before it joins a layer of several parts).
    /// out: (N, OC); x: (N, in).
    pub fn forward<const BF16: bool>(
        &self,
        role: Role,
        out: &mut [f32],
        x: &[f32],
        lora_u: &mut [f32],
        (scratch, part_out): (&mut [f32], &mut [f32]),
    ) {
        let _t = crate::profile::scope(crate::profile::Section::Lora);
        for sp in self.of(role) {
            let n = x.len() / sp.inp;
            let xd = self.dropped::<BF16>(sp.target, x, scratch);
            let u = &mut u_segment_mut(lora_u, sp.target.index, self.at.len())[..n * sp.rank];
            let a = Mat::new(&self.weights[sp.a], sp.rank, sp.inp);
            product::<BF16>(self.backend, u, Mat::new(xd, n, sp.inp), a.t(), false);
            scale_and_round::<BF16>(u, self.scale);
            let b = Mat::new(&self.weights[sp.b], sp.out, sp.rank);
            let u = Mat::new(u, n, sp.rank);
            if sp.out == sp.oc {
                product::<BF16>(self.backend, out, u, b.t(), true);
                continue;
            }
            let y = &mut part_out[..n * sp.out];
            product::<BF16>(self.backend, y, u, b.t(), false);
            for (row, y) in out.chunks_exact_mut(sp.oc).zip(y.chunks_exact(sp.out)) {
                let dst = &mut row[sp.row0..sp.row0 + sp.out];
                dst.iter_mut().zip(y).for_each(|(o, v)| *o += v);
            }
        }
    }

    /// The parameter half of the backward of the adapters on `role`: `dB += doutᵀ · u`,
    /// `dA += duᵀ · drop(x)`, with each part's `du = s · dout · B` (its rows of `dout`)
    /// left in `bufs.du` for [`BlockLora::backward_input`]. `g` is the adapter
    /// gradient arena; dout: (N, OC).
    pub fn backward_params<const BF16: bool>(
        &self,
        role: Role,
        g: &mut [f32],
        dout: &[f32],
        x: &[f32],
        bufs: &mut LoraBufs,
    ) {
        let _t = crate::profile::scope(crate::profile::Section::Lora);
        for (k, sp) in self.of(role).enumerate() {
            let n = x.len() / sp.inp;
            let dout = Mat::new(dout, n, sp.oc).columns(sp.row0, sp.row0 + sp.out);
            let u = &u_segment(bufs.u, sp.target.index, self.at.len())[..n * sp.rank];
            let du = &mut bufs.du[k * n * sp.rank..(k + 1) * n * sp.rank];
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
            let xd = self.dropped::<BF16>(sp.target, x, &mut *bufs.x);
            let du = Mat::new(du, n, sp.rank);
            product::<BF16>(
                self.backend,
                &mut g[sp.a],
                du.t(),
                Mat::new(xd, n, sp.inp),
                true,
            );
        }
    }

    /// The input half: `dx += drop(du · A)` for each adapter on `role`, `du` from
    /// [`BlockLora::backward_params`]. dx: (N, in).
    pub fn backward_input<const BF16: bool>(
        &self,
        role: Role,
        dx: &mut [f32],
        bufs: &mut LoraBufs,
    ) {
        let _t = crate::profile::scope(crate::profile::Section::Lora);
        for (k, sp) in self.of(role).enumerate() {
            let n = dx.len() / sp.inp;
            let du = &bufs.du[k * n * sp.rank..(k + 1) * n * sp.rank];
            let du = Mat::new(du, n, sp.rank);
            let a = Mat::new(&self.weights[sp.a], sp.rank, sp.inp);
            match self.mask(sp.target) {
                None => product::<BF16>(self.backend, dx, du, a, true),
                Some(mask) => {
                    let tmp = &mut bufs.x[..n * sp.inp];
                    product::<BF16>(self.backend, tmp, du, a, false);
                    dropout::apply(tmp, mask, 0);
                    dx.iter_mut().zip(tmp.iter()).for_each(|(d, v)| *d += v);
                }
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
