//! The bf16 weights packed once per optimizer step for the kernels that read packs
//! (AMX and AVX512-BF16, [`Backend::packs_weights`]): the classifier's `wte` and every linear
//! layer's weight, each in the two orientations its products read ([`WeightPacks`]:
//! `x · Wᵀ` forward, `dy · W` input gradient; the weight gradient reads no weight).
//! They are made right where the weights change (the fused AdamW step, a sync, a
//! bucket's arrival) and read by every micro-step, evaluation and recompute until the
//! next change, instead of packing each weight twice per pass. The kernels that
//! read packs round while packing, so a model that packs keeps no bf16 weight copy:
//! the packs are made from the f32 weights ("the copy" below is whatever the
//! matmuls read, [`Backend::keeps_bf16_copy`]).
//!
//! Staleness is owned here: each bucket's packs (`wte`'s, each block's) carry a flag
//! that says they hold the current bf16 copy. Packing sets it; [`Packs::mark_stale`]
//! clears them all when the copy is owed (the weights are still arriving); reading
//! a stale bucket's packs panics, so a product can never read a weight older than
//! the copy. Whatever changes the weights refreshes the copy, and the copy's
//! refreshes are the only places that pack (src/model/mod.rs).

use super::layout::{ParamLayout, Span};
use super::ModelConfig;
use crate::kernels::bf16::gemm::WeightPacks;
#[cfg(doc)]
use crate::kernels::bf16::Backend;
use std::ops::Range;

/// The packs of one model (or, with LoRA, of its frozen base).
pub struct Packs {
    wte: WeightPacks,
    layers: Vec<LayerPacks>,
    /// Whether each bucket's packs hold the current bf16 copy: `wte`'s, then each
    /// block's.
    fresh: Vec<bool>,
}

/// One block's four linear weights packed: (the weight's span, its packs).
#[derive(Default)]
pub struct LayerPacks {
    linears: [(Span, WeightPacks); 4],
}

impl LayerPacks {
    /// The packs of the linear weight at `weight`, if this block has it.
    pub fn of(&self, weight: Span) -> Option<&WeightPacks> {
        let found = self.linears.iter().find(|(at, _)| *at == weight);
        found.map(|(_, packs)| packs)
    }
}

impl Packs {
    /// Whether the linear weights are worth packing once per refresh of the bf16
    /// copy, not only `wte` (whose products with k = V need the pack to run on
    /// AVX512-BF16 at all): when more than one forward reads each weight between
    /// refreshes — several micro-steps per optimizer step (`micro_steps`, `None`
    /// when not training, e.g. evaluation), activation checkpointing's recompute, or
    /// a frozen LoRA base, never refreshed. With one forward per step, packing per
    /// call packs each weight as often (once per product) and holds nothing, where
    /// the packs hold 4 bytes per linear weight (340 MB at GPT-2 124M).
    /// `NANOGPT_BF16_PACKS=0` never packs them, to compare (the same bits).
    pub fn linears_pay(micro_steps: Option<usize>, checkpointing: bool, frozen: bool) -> bool {
        let on = crate::tuning::get().bf16_pack_linears;
        on && (micro_steps.is_none_or(|m| m > 1) || checkpointing || frozen)
    }

    /// Empty packs for a model of `n_layer` blocks, with its `linears` or `wte`'s
    /// only ([`Packs::linears_pay`]), stale until packed.
    pub fn new(n_layer: usize, linears: bool) -> Packs {
        let n_layer = if linears { n_layer } else { 0 };
        Packs {
            wte: WeightPacks::default(),
            layers: (0..n_layer).map(|_| LayerPacks::default()).collect(),
            fresh: vec![false; 1 + n_layer],
        }
    }

    /// Bytes the packs of a model of `config` laid out by `layout` hold once made
    /// (the memory plan's line; [`Packs::bytes`] measures the same): `wte`'s, and with
    /// `linears` each block's linear weights in the shapes its family gives them.
    pub fn bytes_for(layout: &ParamLayout, config: &ModelConfig, linears: bool) -> usize {
        let (c, v) = (config.n_embd, config.vocab_size);
        let blocks = layout.layers.iter().filter(|_| linears);
        let weights = blocks.flat_map(|at| at.linears());
        let block_bytes: usize = weights.map(|s| WeightPacks::bytes_for(s.oc, s.c)).sum();
        WeightPacks::bytes_for(v, c) + block_bytes
    }

    /// Whether the linear weights are packed ([`Packs::linears_pay`]).
    pub fn has_linears(&self) -> bool {
        !self.layers.is_empty()
    }

    /// Bytes these packs hold.
    pub fn bytes(&self) -> usize {
        let blocks = self.layers.iter().flat_map(|l| &l.linears);
        self.wte.bytes() + blocks.map(|(_, p)| p.bytes()).sum::<usize>()
    }

    /// The bf16 copy (`copy`, laid out by `layout`) is being refreshed: no pack
    /// holds it until packed again.
    pub fn mark_stale(&mut self) {
        self.fresh.fill(false);
    }

    /// Packs, rounding, from `copy` (the weights the matmuls read: f32 or rounded,
    /// laid out by `layout`), the weights whose bucket
    /// starts in `range` (the whole bucket of each is in `copy` already): `wte` when
    /// `range` holds its start, each block whose first tensor it holds.
    pub fn pack_range(
        &mut self,
        range: Range<usize>,
        copy: &[f32],
        layout: &ParamLayout,
        config: &ModelConfig,
    ) {
        let classifier = layout.classifier();
        if range.contains(&classifier.start) {
            let (v, c) = (config.vocab_size, config.n_embd);
            self.wte.pack(&copy[classifier], v, c);
            self.fresh[0] = true;
        }
        let blocks = layout.layers.iter().zip(&mut self.layers).enumerate();
        for (l, (at, packs)) in blocks.filter(|(_, (at, _))| range.contains(&at.span.start)) {
            let spans = at.linears();
            for (s, (span, p)) in spans.iter().zip(&mut packs.linears) {
                p.pack(&copy[s.weight], s.oc, s.c);
                *span = s.weight;
            }
            self.fresh[1 + l] = true;
        }
    }

    /// [`Packs::pack_range`] over the whole `copy`.
    pub fn pack_all(&mut self, copy: &[f32], layout: &ParamLayout, config: &ModelConfig) {
        self.pack_range(0..copy.len(), copy, layout, config);
    }

    /// The classifier's `wte` packs; panics if stale.
    pub fn wte(&self) -> &WeightPacks {
        assert!(self.fresh[0], "stale wte packs read: the bf16 copy changed");
        &self.wte
    }

    /// Block `l`'s packs (None with `NANOGPT_BF16_PACKS=0`); panics if stale.
    pub fn layer(&self, l: usize) -> Option<&LayerPacks> {
        let packs = self.layers.get(l)?;
        assert!(
            self.fresh[1 + l],
            "stale packs of block {l} read: the bf16 copy changed"
        );
        Some(packs)
    }
}
