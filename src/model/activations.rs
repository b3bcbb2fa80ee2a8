//! Activation and gradient-scratch buffers, allocated once for the largest batch.
//!
//! Every buffer is sized for `(max_B, max_T)`; a pass over a smaller `(B, T)` uses the
//! leading `B·T·…` elements, which is the same row-major layout. Nothing is allocated
//! in the step loop.

use super::config::ModelConfig;

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
    /// (B, T, 4C) MLP hidden layer before and after GELU.
    pub fch: Vec<f32>,
    pub fch_gelu: Vec<f32>,
    /// (B, T, C) the block's output: residual stream after the MLP branch.
    pub res3: Vec<f32>,
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
    /// (B, T, 4C) gradient of the MLP hidden layer, reused for the (B, T, 3C) qkv gradient.
    pub d4c: Vec<f32>,
}

/// Rows of the classifier chunk: enough that the `dwte` update is compute-bound, few
/// enough that the chunk stays around 32 MB for GPT-2's vocabulary.
fn classifier_chunk_rows(cfg: &ModelConfig, rows: usize) -> usize {
    const BUDGET_FLOATS: usize = 8 << 20;
    (BUDGET_FLOATS / cfg.vocab_size).clamp(64, 1024).min(rows)
}

impl Activations {
    pub fn new(cfg: &ModelConfig, max_b: usize, max_t: usize) -> Activations {
        let (bt, c) = (max_b * max_t, cfg.n_embd);
        let z = |n: usize| vec![0.0f32; n];
        let layers = (0..cfg.n_layer)
            .map(|_| LayerActs {
                ln1: z(bt * c),
                ln1_mean: z(bt),
                ln1_rstd: z(bt),
                qkv: z(bt * 3 * c),
                atty: z(bt * c),
                att_lse: z(max_b * cfg.n_head * max_t),
                res2: z(bt * c),
                ln2: z(bt * c),
                ln2_mean: z(bt),
                ln2_rstd: z(bt),
                fch: z(bt * 4 * c),
                fch_gelu: z(bt * 4 * c),
                res3: z(bt * c),
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
        }
    }

    /// Floats an arena for `(b, t)` holds. The buffers are zero-filled by the
    /// allocator, so untouched pages cost no memory and this is cheap to ask.
    pub fn num_floats_for(cfg: &ModelConfig, b: usize, t: usize) -> usize {
        Activations::new(cfg, b, t).num_floats()
    }

    /// Floats held, all buffers together.
    pub fn num_floats(&self) -> usize {
        let layer = |l: &LayerActs| {
            [
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
                &l.fch_gelu,
                &l.res3,
            ]
            .iter()
            .map(|v| v.len())
            .sum::<usize>()
        };
        let own = [
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
        ];
        let layers: usize = self.layers.iter().map(layer).sum();
        layers + own.iter().map(|v| v.len()).sum::<usize>() + self.inputs.len()
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
        let small = Activations::num_floats_for(&cfg, 4, 256);
        let large = Activations::num_floats_for(&cfg, 4, 1024);
        let ratio = large as f64 / small as f64;
        assert!(ratio <= 4.0, "T 256 → 1024 grew the arena {ratio:.2}×");
        // Exactly: per layer and token 16·C + 4 + NH floats (ln1 C+2, qkv 3C, atty C,
        // lse NH, res2 C, ln2 C+2, fch 4C, gelu 4C, res3 C); outside the layers,
        // inputs, encoded/lnf/dres/dbtc (4C + 4 per token), d4c (4C per token), the classifier
        // chunk (R·V) and the last-position buffers (B·(V + C)).
        let (b, t, c) = (4, 1024, cfg.n_embd);
        let bt = b * t;
        let per_layer = bt * (16 * c + 4 + cfg.n_head);
        let rows = (8 << 20) / cfg.vocab_size;
        let rest = bt * (8 * c + 4) + rows * cfg.vocab_size + b * (cfg.vocab_size + c);
        assert_eq!(large, cfg.n_layer * per_layer + rest);
        println!(
            "activation arena, GPT-2 124M, B=4: T=256 {:.0} MiB, T=1024 {:.0} MiB",
            small as f64 * 4.0 / (1 << 20) as f64,
            large as f64 * 4.0 / (1 << 20) as f64
        );
    }
}
