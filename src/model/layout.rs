//! Where each named tensor lives inside the flat parameter arena.
//!
//! All parameters are one `Vec<f32>`; gradients and the AdamW moments are buffers of
//! the same length and the same layout. Tensors carry Hugging Face GPT-2 names, but
//! linear weights are stored `[out, in]` (PyTorch `nn.Linear`, as nanoGPT does), not
//! in HF's Conv1D `[in, out]` order; the HF import/export transposes.
//!
//! Order: `wte`, `wpe`, then every layer's tensors together (so a layer's gradients
//! are one contiguous range, ready for bucketed all-reduce), then `ln_f`.

use super::config::ModelConfig;
use crate::optim::DecayRanges;
use std::ops::{Index, IndexMut, Range};

/// One named tensor of the arena.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    pub shape: Vec<usize>,
    pub offset: usize,
}

impl TensorInfo {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.numel()
    }

    /// Weight decay applies to tensors of rank ≥ 2 (matmul weights, embeddings), never
    /// to biases or layer-norm gains, as in nanoGPT's `configure_optimizers`.
    pub fn decays(&self) -> bool {
        self.shape.len() >= 2
    }
}

/// Where one tensor lives in the arena: elements `start..end`. `Copy`, and it indexes
/// slices directly: `&params[span]`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Span {
    pub start: usize,
    pub end: usize,
}

impl Span {
    pub fn len(self) -> usize {
        self.end - self.start
    }

    pub fn is_empty(self) -> bool {
        self.end == self.start
    }

    pub fn range(self) -> Range<usize> {
        self.start..self.end
    }
}

impl From<Range<usize>> for Span {
    fn from(r: Range<usize>) -> Span {
        Span {
            start: r.start,
            end: r.end,
        }
    }
}

impl Index<Span> for [f32] {
    type Output = [f32];
    fn index(&self, s: Span) -> &[f32] {
        &self[s.start..s.end]
    }
}

impl IndexMut<Span> for [f32] {
    fn index_mut(&mut self, s: Span) -> &mut [f32] {
        &mut self[s.start..s.end]
    }
}

impl Index<Span> for Vec<f32> {
    type Output = [f32];
    fn index(&self, s: Span) -> &[f32] {
        &self[s.start..s.end]
    }
}

impl IndexMut<Span> for Vec<f32> {
    fn index_mut(&mut self, s: Span) -> &mut [f32] {
        &mut self[s.start..s.end]
    }
}

/// A linear layer's tensors: weight `[OC, C]` and bias `[OC]` (empty without biases).
#[derive(Clone, Copy, Debug, Default)]
pub struct LinearSpans {
    pub weight: Span,
    pub bias: Span,
    /// Input channels (C).
    pub c: usize,
    /// Output channels (OC).
    pub oc: usize,
}

/// A layer norm's tensors: weight and bias, `[C]` each (bias empty without biases).
#[derive(Clone, Copy, Debug, Default)]
pub struct NormSpans {
    pub weight: Span,
    pub bias: Span,
}

/// Where one transformer block's tensors live.
#[derive(Clone, Debug, Default)]
pub struct BlockLayout {
    pub ln_1: NormSpans,
    /// `[3C, C]`: query, key and value projections stacked.
    pub c_attn: LinearSpans,
    /// `[C, C]`
    pub attn_proj: LinearSpans,
    pub ln_2: NormSpans,
    /// `[4C, C]`
    pub c_fc: LinearSpans,
    /// `[C, 4C]`
    pub mlp_proj: LinearSpans,
    /// All of this block's tensors: one contiguous span of the arena.
    pub span: Span,
}

/// The named tensors of a model and where they live in the arena.
#[derive(Clone, Debug)]
pub struct ParamLayout {
    pub tensors: Vec<TensorInfo>,
    /// `[Vp, C]` token embedding, also the (tied) classifier.
    pub wte: Span,
    /// `[block_size, C]` position embedding.
    pub wpe: Span,
    pub layers: Vec<BlockLayout>,
    pub ln_f: NormSpans,
    /// Total floats in the arena.
    pub len: usize,
}

/// Offsets are rounded up to this many floats (64 bytes: one cache line).
const ALIGN: usize = 16;

struct Builder {
    tensors: Vec<TensorInfo>,
    len: usize,
}

impl Builder {
    fn push(&mut self, name: String, shape: Vec<usize>) -> Span {
        let offset = self.len.div_ceil(ALIGN) * ALIGN;
        let info = TensorInfo {
            name,
            shape,
            offset,
        };
        let span = Span::from(info.range());
        self.len = span.end;
        self.tensors.push(info);
        span
    }

    /// A bias of `n` floats, or an empty span when the model has no biases.
    fn bias(&mut self, bias: bool, name: String, n: usize) -> Span {
        match bias {
            true => self.push(name, vec![n]),
            false => Span::from(self.len..self.len),
        }
    }

    /// A linear layer `name` from `c` to `oc` channels.
    fn linear(&mut self, bias: bool, name: &str, c: usize, oc: usize) -> LinearSpans {
        LinearSpans {
            weight: self.push(format!("{name}.weight"), vec![oc, c]),
            bias: self.bias(bias, format!("{name}.bias"), oc),
            c,
            oc,
        }
    }

    /// A layer norm `name` over `c` channels.
    fn norm(&mut self, bias: bool, name: &str, c: usize) -> NormSpans {
        NormSpans {
            weight: self.push(format!("{name}.weight"), vec![c]),
            bias: self.bias(bias, format!("{name}.bias"), c),
        }
    }
}

impl ParamLayout {
    pub fn new(cfg: &ModelConfig) -> ParamLayout {
        let (c, bias) = (cfg.n_embd, cfg.bias);
        let mut b = Builder {
            tensors: Vec::new(),
            len: 0,
        };
        let wte = b.push(
            "transformer.wte.weight".into(),
            vec![cfg.padded_vocab_size(), c],
        );
        let wpe = b.push("transformer.wpe.weight".into(), vec![cfg.block_size, c]);
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            let p = |s: &str| format!("transformer.h.{i}.{s}");
            let start = b.len.div_ceil(ALIGN) * ALIGN;
            let mut l = BlockLayout {
                ln_1: b.norm(bias, &p("ln_1"), c),
                c_attn: b.linear(bias, &p("attn.c_attn"), c, 3 * c),
                attn_proj: b.linear(bias, &p("attn.c_proj"), c, c),
                ln_2: b.norm(bias, &p("ln_2"), c),
                c_fc: b.linear(bias, &p("mlp.c_fc"), c, 4 * c),
                mlp_proj: b.linear(bias, &p("mlp.c_proj"), 4 * c, c),
                span: Span::default(),
            };
            l.span = Span::from(start..b.len);
            layers.push(l);
        }
        let ln_f = b.norm(bias, "transformer.ln_f", c);
        ParamLayout {
            tensors: b.tensors,
            wte,
            wpe,
            layers,
            ln_f,
            len: b.len,
        }
    }

    pub fn get(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The arena as AdamW sees it: each tensor's range and whether it decays
    /// ([`TensorInfo::decays`]).
    pub fn decay_ranges(&self) -> DecayRanges {
        DecayRanges {
            len: self.len,
            tensors: self
                .tensors
                .iter()
                .map(|t| (t.range(), t.decays()))
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small(bias: bool) -> ModelConfig {
        ModelConfig {
            vocab_size: 100,
            block_size: 16,
            n_layer: 2,
            n_head: 4,
            n_embd: 64,
            bias,
            dropout: 0.0,
        }
    }

    #[test]
    fn tensors_do_not_overlap_and_fit_the_arena() {
        for bias in [true, false] {
            let layout = ParamLayout::new(&small(bias));
            let mut ranges: Vec<_> = layout.tensors.iter().map(|t| t.range()).collect();
            ranges.sort_by_key(|r| r.start);
            for pair in ranges.windows(2) {
                assert!(pair[0].end <= pair[1].start, "{pair:?} overlap");
            }
            assert_eq!(ranges.last().unwrap().end, layout.len);
            assert!(layout.tensors.iter().all(|t| t.offset % ALIGN == 0));
            let expected = if bias { 2 + 2 * 12 + 2 } else { 2 + 2 * 6 + 1 };
            assert_eq!(layout.tensors.len(), expected);
        }
    }

    #[test]
    fn real_parameters_match_the_config_count() {
        for bias in [true, false] {
            let cfg = small(bias);
            let layout = ParamLayout::new(&cfg);
            let stored: usize = layout.tensors.iter().map(|t| t.numel()).sum();
            let padding_rows = cfg.padded_vocab_size() - cfg.vocab_size;
            assert_eq!(stored - padding_rows * cfg.n_embd, cfg.num_params());
        }
    }

    #[test]
    fn weight_decay_follows_rank() {
        let layout = ParamLayout::new(&small(true));
        let decayed: Vec<_> = layout.tensors.iter().filter(|t| t.decays()).collect();
        assert!(decayed.iter().all(|t| t.name.ends_with("weight")));
        assert!(layout
            .get("transformer.h.1.ln_2.weight")
            .map(|t| !t.decays())
            .unwrap());
        assert!(layout.get("transformer.wte.weight").unwrap().decays());
        assert_eq!(decayed.len(), 2 + 2 * 4);
        let ranges = layout.decay_ranges();
        assert_eq!(ranges.len, layout.len);
        let want: Vec<_> = layout
            .tensors
            .iter()
            .map(|t| (t.range(), t.decays()))
            .collect();
        assert_eq!(ranges.tensors, want);
    }
}
