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
use std::ops::Range;

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

/// Ranges of one transformer block's tensors. Bias ranges are empty without biases.
#[derive(Clone, Debug, Default)]
pub struct LayerRanges {
    pub ln_1_w: Range<usize>,
    pub ln_1_b: Range<usize>,
    /// `[3C, C]`: query, key and value projections stacked.
    pub c_attn_w: Range<usize>,
    pub c_attn_b: Range<usize>,
    /// `[C, C]`
    pub attn_proj_w: Range<usize>,
    pub attn_proj_b: Range<usize>,
    pub ln_2_w: Range<usize>,
    pub ln_2_b: Range<usize>,
    /// `[4C, C]`
    pub c_fc_w: Range<usize>,
    pub c_fc_b: Range<usize>,
    /// `[C, 4C]`
    pub mlp_proj_w: Range<usize>,
    pub mlp_proj_b: Range<usize>,
    /// All of this layer's tensors: one contiguous span of the arena.
    pub span: Range<usize>,
}

/// The named tensors of a model and where they live in the arena.
#[derive(Clone, Debug)]
pub struct ParamLayout {
    pub tensors: Vec<TensorInfo>,
    /// `[Vp, C]` token embedding, also the (tied) classifier.
    pub wte: Range<usize>,
    /// `[block_size, C]` position embedding.
    pub wpe: Range<usize>,
    pub layers: Vec<LayerRanges>,
    pub ln_f_w: Range<usize>,
    pub ln_f_b: Range<usize>,
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
    fn push(&mut self, name: String, shape: Vec<usize>) -> Range<usize> {
        let offset = self.len.div_ceil(ALIGN) * ALIGN;
        let info = TensorInfo {
            name,
            shape,
            offset,
        };
        let range = info.range();
        self.len = range.end;
        self.tensors.push(info);
        range
    }

    /// A bias of `n` floats, or an empty range when the model has no biases.
    fn bias(&mut self, bias: bool, name: String, n: usize) -> Range<usize> {
        if bias {
            self.push(name, vec![n])
        } else {
            self.len..self.len
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
            let mut l = LayerRanges {
                ln_1_w: b.push(p("ln_1.weight"), vec![c]),
                ln_1_b: b.bias(bias, p("ln_1.bias"), c),
                c_attn_w: b.push(p("attn.c_attn.weight"), vec![3 * c, c]),
                c_attn_b: b.bias(bias, p("attn.c_attn.bias"), 3 * c),
                attn_proj_w: b.push(p("attn.c_proj.weight"), vec![c, c]),
                attn_proj_b: b.bias(bias, p("attn.c_proj.bias"), c),
                ln_2_w: b.push(p("ln_2.weight"), vec![c]),
                ln_2_b: b.bias(bias, p("ln_2.bias"), c),
                c_fc_w: b.push(p("mlp.c_fc.weight"), vec![4 * c, c]),
                c_fc_b: b.bias(bias, p("mlp.c_fc.bias"), 4 * c),
                mlp_proj_w: b.push(p("mlp.c_proj.weight"), vec![c, 4 * c]),
                mlp_proj_b: b.bias(bias, p("mlp.c_proj.bias"), c),
                span: 0..0,
            };
            l.span = start..b.len;
            layers.push(l);
        }
        let ln_f_w = b.push("transformer.ln_f.weight".into(), vec![c]);
        let ln_f_b = b.bias(bias, "transformer.ln_f.bias".into(), c);
        ParamLayout {
            tensors: b.tensors,
            wte,
            wpe,
            layers,
            ln_f_w,
            ln_f_b,
            len: b.len,
        }
    }

    pub fn get(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
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
    }
}
