//! Activation and gradient-scratch buffers, allocated once for the largest batch.
//!
//! Every buffer is sized for `(max_B, max_T)`; a pass over a smaller `(B, T)` uses the
//! leading `B·T·…` elements, which is the same row-major layout. Nothing is allocated
//! in the step loop.
//!
//! The GELU output is never kept: backward recomputes it from the pre-GELU layer.
//! With `dtype = "bfloat16"` q/k/v, the attention output and the MLP's pre-GELU layer
//! are kept in bf16 ([`HalfActs`]), and the layer-norm outputs are not kept at all:
//! backward recomputes them from the block's input and the saved statistics
//! (bit-identical, then rounded as forward rounded them). The f32 buffers they replace
//! are then empty. The residual stream, the layer-norm statistics and all gradients
//! stay f32.

use super::config::ModelConfig;
use crate::config::Dtype;
use crate::kernels::bf16::Bf16;

/// What one transformer block keeps from forward for backward.
pub struct LayerActs {
    /// (B, T, C) output of ln_1, with its per-row mean and 1/std (B, T).
    pub ln1: Vec<f32>,
    pub ln1_mean: Vec<f32>,
    pub ln1_rstd: Vec<f32>,
    /// (B, T, 3C) query, key, value.
    pub qkv: Vec<f32>,
    /// (B, T, C) attention output (heads concatenated), (B, NH, T) its log-sum-exp.
    pub atty: Vec<f32>,
    pub att_lse: Vec<f32>,
    /// (B, T, C) residual stream after the attention branch.
    pub res2: Vec<f32>,
    pub ln2: Vec<f32>,
    pub ln2_mean: Vec<f32>,
    pub ln2_rstd: Vec<f32>,
    /// (B, T, 4C) MLP hidden layer before GELU. The GELU output is not kept: forward
    /// writes it to scratch and backward recomputes it (as llm.c does), saving 4C
    /// floats per token and layer for one more GELU per layer.
    pub fch: Vec<f32>,
    /// (B, T, C) the block's output: residual stream after the MLP branch.
    pub res3: Vec<f32>,
    /// bf16 mode only: what replaces `qkv`, `atty` and `fch` (`ln1` and `ln2` are
    /// recomputed).
    pub half: Option<HalfActs>,
}

/// The bf16 activations of one block (`dtype = "bfloat16"`).
pub struct HalfActs {
    /// (B, T, 3C) query, key, value.
    pub qkv: Vec<Bf16>,
    /// (B, T, C) attention output.
    pub atty: Vec<Bf16>,
    /// (B, T, 4C) MLP hidden layer before GELU (its GELU is recomputed in backward).
    pub fch: Vec<Bf16>,
}

/// f32 scratch of the bf16 mode, shared by all blocks: the widened (exact f32) copies
/// of bf16 operands that the f32 GEMM reads, and bf16-rounded output gradients.
pub struct HalfScratch {
    /// (B, T, 4C): the GELU output in forward; pre-GELU values, then their gradient,
    /// in backward.
    pub wide4c: Vec<f32>,
    /// (B, T, C): a widened layer-norm or attention output in backward.
    pub wide: Vec<f32>,
    /// (B, T, C): a residual branch's output gradient rounded to bf16.
    pub dround: Vec<f32>,
}

/// All activations of a forward pass plus the scratch that backward reuses per layer.
pub struct Activations {
    /// (B, T) the token ids of the current pass (backward needs them).
    pub inputs: Vec<u32>,
    /// (B, T, C) token + position embedding: the input of block 0.
    pub encoded: Vec<f32>,
    pub layers: Vec<LayerActs>,
    /// (B, T, C) final layer norm output, with its statistics.
    pub lnf: Vec<f32>,
    pub lnf_mean: Vec<f32>,
    pub lnf_rstd: Vec<f32>,
    /// (B, T) per-position loss.
    pub losses: Vec<f32>,
    /// (R, V) logits of one chunk of rows in the fused classifier.
    pub logits_chunk: Vec<f32>,
    /// (B, V) logits of the last position, for sampling.
    pub last_logits: Vec<f32>,
    /// (B, C) the final layer norm's output at the last position (inference).
    pub last_x: Vec<f32>,
    /// Backward scratch: (B, T, C) gradient of the residual stream.
    pub dres: Vec<f32>,
    /// (B, T, C): the classifier's input gradient between forward and backward, then
    /// the gradient of a layer-norm output or of the attention output.
    pub dbtc: Vec<f32>,
    /// (B, T, C) residual-branch gradient after dropout (empty when dropout is off).
    pub dbranch: Vec<f32>,
    /// (B, T, 4C): the GELU output in forward (f32 mode); in backward the recomputed
    /// GELU output, then the MLP hidden layer's gradient, then the (B, T, 3C) qkv
    /// gradient.
    pub d4c: Vec<f32>,
    /// bf16 mode only.
    pub half: Option<HalfScratch>,
}

/// Rows of the classifier chunk: enough that the `dwte` update (K = rows) runs near
/// the GEMM's peak, few enough that the chunk stays around 64 MB for GPT-2's
/// vocabulary (333 rows). Measured at 124M, B = 4, T = 256: 32 MB chunks (166 rows)
/// made the classifier ~20 % and the step ~10 % slower than 128 MB ones, and 256 MB
/// gained nothing more; 64 MB keeps the bf16 arena within 0.6× of the f32 one.
fn classifier_chunk_rows(cfg: &ModelConfig, rows: usize) -> usize {
    const BUDGET_FLOATS: usize = 16 << 20;
    (BUDGET_FLOATS / cfg.vocab_size).clamp(64, 1024).min(rows)
}

impl Activations {
    pub fn new(cfg: &ModelConfig, max_b: usize, max_t: usize, dtype: Dtype) -> Activations {
        let (bt, c) = (max_b * max_t, cfg.n_embd);
        let bf16 = dtype == Dtype::Bfloat16;
        let z = |n: usize| vec![0.0f32; n];
        // Buffers the bf16 mode keeps in `half` instead.
        let f = |n: usize| if bf16 { vec![] } else { z(n) };
        let h = |n: usize| vec![Bf16::default(); n];
        let layers = (0..cfg.n_layer)
            .map(|_| LayerActs {
                ln1: f(bt * c),
                ln1_mean: z(bt),
                ln1_rstd: z(bt),
                qkv: f(bt * 3 * c),
                atty: f(bt * c),
                att_lse: z(max_b * cfg.n_head * max_t),
                res2: z(bt * c),
                ln2: f(bt * c),
                ln2_mean: z(bt),
                ln2_rstd: z(bt),
                fch: f(bt * 4 * c),
                res3: z(bt * c),
                half: bf16.then(|| HalfActs {
                    qkv: h(bt * 3 * c),
                    atty: h(bt * c),
                    fch: h(bt * 4 * c),
                }),
            })
            .collect();
        Activations {
            inputs: vec![0; bt],
            encoded: z(bt * c),
            layers,
            lnf: z(bt * c),
            lnf_mean: z(bt),
            lnf_rstd: z(bt),
            losses: z(bt),
            logits_chunk: z(classifier_chunk_rows(cfg, bt) * cfg.vocab_size),
            last_logits: z(max_b * cfg.vocab_size),
            last_x: z(max_b * c),
            dres: z(bt * c),
            dbtc: z(bt * c),
            dbranch: if cfg.dropout > 0.0 { z(bt * c) } else { vec![] },
            d4c: z(bt * 4 * c),
            half: bf16.then(|| HalfScratch {
                wide4c: z(bt * 4 * c),
                wide: z(bt * c),
                dround: z(bt * c),
            }),
        }
    }

    /// Bytes an arena for `(b, t)` holds. The buffers are zero-filled by the
    /// allocator, so untouched pages cost no memory and this is cheap to ask.
    pub fn num_bytes_for(cfg: &ModelConfig, b: usize, t: usize, dtype: Dtype) -> usize {
        Activations::new(cfg, b, t, dtype).num_bytes()
    }

    /// Bytes held, all buffers together (4 per f32 and token id, 2 per bf16).
    pub fn num_bytes(&self) -> usize {
        let f32s = |bufs: &[&Vec<f32>]| bufs.iter().map(|v| v.len() * 4).sum::<usize>();
        let bf16s = |bufs: &[&Vec<Bf16>]| bufs.iter().map(|v| v.len() * 2).sum::<usize>();
        let layer = |l: &LayerActs| {
            let half = l
                .half
                .as_ref()
                .map_or(0, |h| bf16s(&[&h.qkv, &h.atty, &h.fch]));
            half + f32s(&[
                &l.ln1,
                &l.ln1_mean,
                &l.ln1_rstd,
                &l.qkv,
                &l.atty,
                &l.att_lse,
                &l.res2,
                &l.ln2,
                &l.ln2_mean,
                &l.ln2_rstd,
                &l.fch,
                &l.res3,
            ])
        };
        let scratch = self
            .half
            .as_ref()
            .map_or(0, |h| f32s(&[&h.wide4c, &h.wide, &h.dround]));
        let own = f32s(&[
            &self.encoded,
            &self.lnf,
            &self.lnf_mean,
            &self.lnf_rstd,
            &self.losses,
            &self.logits_chunk,
            &self.last_logits,
            &self.last_x,
            &self.dres,
            &self.dbtc,
            &self.dbranch,
            &self.d4c,
        ]);
        let layers: usize = self.layers.iter().map(layer).sum();
        layers + own + scratch + self.inputs.len() * 4
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attention_memory_grows_linearly_with_t() {
        // No (B, NH, T, T) buffer: quadrupling T must scale the arena by about 4,
        // not 16 (the classifier chunk is capped, so slightly less than 4).
        let cfg = ModelConfig::preset("gpt2").unwrap();
        let small = Activations::num_bytes_for(&cfg, 4, 256, Dtype::Float32) / 4;
        let large = Activations::num_bytes_for(&cfg, 4, 1024, Dtype::Float32) / 4;
        let ratio = large as f64 / small as f64;
        assert!(ratio <= 4.0, "T 256 → 1024 grew the arena {ratio:.2}×");
        // Exactly: per layer and token 12·C + 4 + NH floats (ln1 C+2, qkv 3C, atty C,
        // lse NH, res2 C, ln2 C+2, fch 4C, res3 C; the GELU output is recomputed); outside the layers,
        // inputs, encoded/lnf/dres/dbtc (4C + 4 per token), d4c (4C per token), the classifier
        // chunk (R·V) and the last-position buffers (B·(V + C)).
        let (b, t, c) = (4, 1024, cfg.n_embd);
        let bt = b * t;
        let per_layer = bt * (12 * c + 4 + cfg.n_head);
        let rows = (16 << 20) / cfg.vocab_size;
        let rest = bt * (8 * c + 4) + rows * cfg.vocab_size + b * (cfg.vocab_size + c);
        assert_eq!(large, cfg.n_layer * per_layer + rest);
        println!(
            "activation arena, GPT-2 124M, B=4: T=256 {:.0} MiB, T=1024 {:.0} MiB",
            small as f64 * 4.0 / (1 << 20) as f64,
            large as f64 * 4.0 / (1 << 20) as f64
        );
    }

    #[test]
    fn bf16_arena_keeps_matmul_operands_in_two_bytes() {
        // GPT-2 124M at B=4, T=1024 (the target configuration).
        let cfg = ModelConfig::preset("gpt2").unwrap();
        let (b, t, c) = (4, 1024, cfg.n_embd);
        let f32_bytes = Activations::num_bytes_for(&cfg, b, t, Dtype::Float32);
        let bf16_bytes = Activations::num_bytes_for(&cfg, b, t, Dtype::Bfloat16);
        // Per layer and token, bf16 keeps atty (C), qkv (3C) and fch (4C) in two bytes
        // and ln1, ln2 (C each) not at all: 4·(12C + 4 + NH) → 4·(2C + 4 + NH) + 2·8C.
        // Outside the layers it adds the f32 scratch: wide4c 4C, wide C, dround C.
        let bt = b * t;
        let per_layer_saved = bt * (4 * 10 * c - 2 * 8 * c);
        let scratch = bt * 4 * 6 * c;
        assert_eq!(
            f32_bytes - bf16_bytes,
            cfg.n_layer * per_layer_saved - scratch
        );
        let ratio = bf16_bytes as f64 / f32_bytes as f64;
        println!(
            "activation arena, GPT-2 124M, B=4, T=1024: float32 {f32_bytes} bytes, \
             bfloat16 {bf16_bytes} bytes ({ratio:.3}×)"
        );
        assert!(ratio <= 0.6, "bf16 arena is {ratio:.3}× the f32 one");
    }
}
