//! Where each named tensor lives inside the flat parameter arena.
//!
//! All parameters are one `Vec<f32>`; gradients and the AdamW moments are buffers of
//! the same length and the same layout. Tensors carry their Hugging Face names (the
//! model family's, [`Family::names`](super::family::Family::names)), and linear
//! weights are stored `[out, in]` (PyTorch `nn.Linear`, as nanoGPT does), also for
//! GPT-2, whose HF files hold Conv1D `[in, out]`: the HF import/export transposes.
//! A linear layer made of several HF tensors (Llama's q/k/v, gate/up) holds them one
//! after another, so that one matmul runs it.
//!
//! Order: `wte`, `wpe` (learned positions only), then every layer's tensors together
//! (so a layer's gradients are one contiguous range, ready for bucketed all-reduce),
//! then the final norm and an untied `lm_head`.

use super::config::ModelConfig;
use super::family::{Linear, Role};
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
    /// The norm before attention (GPT-2's `ln_1`, Llama's `input_layernorm`).
    pub ln_1: NormSpans,
    /// `[(NH + 2·KV)·HS, C]`: query, key and value projections stacked (GPT-2's
    /// `c_attn`; Llama's `q_proj`, `k_proj`, `v_proj`, one after another).
    pub qkv: LinearSpans,
    /// Qwen3's q and k norms, `[HS]` each (empty otherwise).
    pub q_norm: Span,
    pub k_norm: Span,
    /// `[C, NH·HS]` the attention's output projection.
    pub attn_out: LinearSpans,
    /// The norm before the MLP (GPT-2's `ln_2`, Llama's `post_attention_layernorm`).
    pub ln_2: NormSpans,
    /// `[4C, C]` (GPT-2's `c_fc`), or `[2I, C]`: Llama's `gate_proj` then `up_proj`.
    pub mlp_up: LinearSpans,
    /// `[C, 4C]` or `[C, I]`: the MLP's output projection.
    pub mlp_down: LinearSpans,
    /// All of this block's tensors: one contiguous span of the arena.
    pub span: Span,
}

impl BlockLayout {
    /// The linear layer of `role`.
    pub fn linear(&self, role: Role) -> LinearSpans {
        match role {
            Role::Qkv => self.qkv,
            Role::AttnOut => self.attn_out,
            Role::MlpUp => self.mlp_up,
            Role::MlpDown => self.mlp_down,
        }
    }

    /// The four linear layers, in [`ROLES`](super::family::ROLES) order.
    pub fn linears(&self) -> [LinearSpans; 4] {
        [self.qkv, self.attn_out, self.mlp_up, self.mlp_down]
    }
}

/// The named tensors of a model and where they live in the arena.
#[derive(Clone, Debug)]
pub struct ParamLayout {
    pub tensors: Vec<TensorInfo>,
    /// `[Vp, C]` token embedding, also the classifier when it is tied.
    pub wte: Span,
    /// `[block_size, C]` position embedding; empty where positions are rotary.
    pub wpe: Span,
    pub layers: Vec<BlockLayout>,
    /// The final norm (GPT-2's `ln_f`, Llama's `model.norm`).
    pub ln_f: NormSpans,
    /// `[Vp, C]` the classifier when it is not tied to `wte`; empty otherwise.
    pub lm_head: Span,
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
    /// A tensor at the next aligned offset.
    fn push(&mut self, name: String, shape: Vec<usize>) -> Span {
        self.len = self.len.div_ceil(ALIGN) * ALIGN;
        self.push_next(name, shape)
    }

    /// A tensor right after the last one (the parts of one linear layer).
    fn push_next(&mut self, name: String, shape: Vec<usize>) -> Span {
        let info = TensorInfo {
            name,
            shape,
            offset: self.len,
        };
        let span = Span::from(info.range());
        self.len = span.end;
        self.tensors.push(info);
        span
    }

    /// A linear layer of block `prefix`: its parts' weights `[rows, in]` one after
    /// another, then (with biases) their biases likewise; one span each.
    fn linear(&mut self, prefix: &str, l: &Linear) -> LinearSpans {
        let mut stacked = |suffix: &str, shape: &dyn Fn(usize) -> Vec<usize>| {
            let mut span: Option<Span> = None;
            for p in &l.parts {
                let name = format!("{prefix}{}.{suffix}", p.module);
                let part = match span {
                    None => self.push(name, shape(p.rows)),
                    Some(_) => self.push_next(name, shape(p.rows)),
                };
                span = Some(Span::from(span.map_or(part.start, |s| s.start)..part.end));
            }
            span.unwrap_or_default()
        };
        let weight = stacked("weight", &|rows| vec![rows, l.inp]);
        let bias = match l.bias {
            true => stacked("bias", &|rows| vec![rows]),
            false => Span::from(weight.end..weight.end),
        };
        LinearSpans {
            weight,
            bias,
            c: l.inp,
            oc: l.out(),
        }
    }

    /// A norm `name` over `c` channels, with a bias or not.
    fn norm(&mut self, bias: bool, name: &str, c: usize) -> NormSpans {
        let weight = self.push(format!("{name}.weight"), vec![c]);
        let bias = match bias {
            true => self.push(format!("{name}.bias"), vec![c]),
            false => Span::from(self.len..self.len),
        };
        NormSpans { weight, bias }
    }
}

impl ParamLayout {
    /// [`ParamLayout::new`] for the writers of a model's `params`, which must hold
    /// exactly its parameters (else an internal error).
    pub fn of_params(cfg: &ModelConfig, params: &[f32]) -> anyhow::Result<ParamLayout> {
        let layout = ParamLayout::new(cfg);
        anyhow::ensure!(
            params.len() == layout.len,
            "internal error: {} parameters for a layout of {}",
            params.len(),
            layout.len
        );
        Ok(layout)
    }

    /// The layout of `cfg`'s family ([`ModelConfig::family`]): the embeddings, then
    /// every block's tensors together (so a block's gradients are one contiguous
    /// range), then the final norm and an untied classifier.
    pub fn new(cfg: &ModelConfig) -> ParamLayout {
        let f = cfg.family();
        let (c, names) = (f.c, f.names());
        let mut b = Builder {
            tensors: Vec::new(),
            len: 0,
        };
        let wte = b.push(names.wte.into(), vec![cfg.padded_vocab_size(), c]);
        let wpe = match f.rope {
            None => b.push(names.wpe.into(), vec![cfg.block_size, c]),
            Some(_) => Span::from(b.len..b.len),
        };
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            let p = format!("{}{i}.", names.block);
            let start = b.len.div_ceil(ALIGN) * ALIGN;
            let ln_1 = b.norm(f.norm_bias, &format!("{p}{}", names.norm_1), c);
            let qkv = b.linear(&p, f.linear(Role::Qkv));
            let (q_norm, k_norm) = match f.qk_norm {
                true => (
                    b.push(format!("{p}{}.weight", names.q_norm), vec![f.hs]),
                    b.push(format!("{p}{}.weight", names.k_norm), vec![f.hs]),
                ),
                false => (Span::from(b.len..b.len), Span::from(b.len..b.len)),
            };
            let mut l = BlockLayout {
                ln_1,
                qkv,
                q_norm,
                k_norm,
                attn_out: b.linear(&p, f.linear(Role::AttnOut)),
                ln_2: b.norm(f.norm_bias, &format!("{p}{}", names.norm_2), c),
                mlp_up: b.linear(&p, f.linear(Role::MlpUp)),
                mlp_down: b.linear(&p, f.linear(Role::MlpDown)),
                span: Span::default(),
            };
            l.span = Span::from(start..b.len);
            layers.push(l);
        }
        let ln_f = b.norm(f.norm_bias, names.norm_f, c);
        let lm_head = match f.tied {
            true => Span::from(b.len..b.len),
            false => b.push(names.lm_head.into(), vec![cfg.padded_vocab_size(), c]),
        };
        ParamLayout {
            tensors: b.tensors,
            wte,
            wpe,
            layers,
            ln_f,
            lm_head,
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

    /// The classifier's weights: `lm_head`, or `wte` when they are tied.
    pub fn classifier(&self) -> Span {
        match self.lm_head.is_empty() {
            true => self.wte,
            false => self.lm_head,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The model tests' tiny GPT-2, without dropout.
    fn small(bias: bool) -> ModelConfig {
        crate::model::tests::tiny(bias, 0.0)
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
