//! Model hyper-parameters: the shape of a GPT-2 or Llama-architecture network.

use super::family::{Family, LlamaConfig};
use anyhow::bail;
use serde::{Deserialize, Serialize};

/// The vocabulary is padded up to a multiple of this many rows so that the
/// classifier matmul has friendly sizes (50257 → 50304). Padded rows are never
/// trained and never receive probability.
pub const VOCAB_PAD_MULTIPLE: usize = 64;

/// Epsilon of every layer norm (GPT-2's; it lives with the family's description).
pub use super::family::LAYER_NORM_EPS;

/// Numeric precision of the matmuls (master weights are always f32).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    Float32,
    /// Matmul operands rounded to bf16 with f32 accumulation (autocast semantics).
    Bfloat16,
}

impl Dtype {
    pub const NAMES: [&'static str; 2] = ["float32", "bfloat16"];

    pub fn as_str(self) -> &'static str {
        match self {
            Dtype::Float32 => "float32",
            Dtype::Bfloat16 => "bfloat16",
        }
    }
}

/// The architecture of a model, with nanoGPT's key names: GPT-2, or with
/// [`ModelConfig::llama`] the Llama architecture (its family, [`ModelConfig::family`],
/// says what the blocks are made of).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// Real vocabulary size (V). The parameter arena holds `padded_vocab_size()` rows.
    pub vocab_size: usize,
    /// Maximum sequence length (rows of the position table).
    pub block_size: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_embd: usize,
    /// Biases in linear layers and layer norms (GPT-2 has them).
    pub bias: bool,
    /// Dropout probability applied where nanoGPT applies it (0 disables).
    pub dropout: f32,
    /// The Llama architecture's settings (`llama`, `mistral`, `qwen2`, `qwen3`); None
    /// for GPT-2, as in every checkpoint written before the Llama families.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub llama: Option<LlamaConfig>,
}

/// The most parameters a model may have (about 69 billion: 1.1 TB to train in
/// f32). Far beyond what a CPU trains, it keeps the size arithmetic from
/// overflowing on absurd settings, which are refused with a message instead.
pub const MAX_PARAMS: usize = 1 << 36;

/// The most layers a model may have (GPT-2 XL has 48).
pub const MAX_LAYERS: usize = 4096;

/// The preset names accepted by [`ModelConfig::preset`].
pub const PRESETS: [&str; 4] = ["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"];

impl ModelConfig {
    /// OpenAI's GPT-2 sizes: `gpt2` (124M), `gpt2-medium` (350M), `gpt2-large` (774M),
    /// `gpt2-xl` (1558M).
    pub fn preset(name: &str) -> Option<ModelConfig> {
        let (n_layer, n_head, n_embd) = match name {
            "gpt2" => (12, 12, 768),
            "gpt2-medium" => (24, 16, 1024),
            "gpt2-large" => (36, 20, 1280),
            "gpt2-xl" => (48, 25, 1600),
            _ => return None,
        };
        Some(ModelConfig::gpt2(
            50257,
            1024,
            (n_layer, n_head, n_embd),
            0.0,
        ))
    }

    /// The GPT-2 architecture (biases, no Llama settings) of `vocab_size` tokens,
    /// `block_size` positions, `(n_layer, n_head, n_embd)` and `dropout`: a preset's,
    /// or a pretrained model's as its Hugging Face or GGUF config describes it.
    pub fn gpt2(
        vocab_size: usize,
        block_size: usize,
        (n_layer, n_head, n_embd): (usize, usize, usize),
        dropout: f32,
    ) -> ModelConfig {
        ModelConfig {
            vocab_size,
            block_size,
            n_layer,
            n_head,
            n_embd,
            bias: true,
            dropout,
            llama: None,
        }
    }

    /// The model family's description, from which the layout and everything sized by
    /// it follow.
    pub fn family(&self) -> Family {
        match &self.llama {
            None => Family::gpt2(self.n_embd, self.n_head, self.bias),
            Some(l) => Family::llama(self.n_embd, self.n_head, l),
        }
    }

    /// Rows of the embedding table as stored: the vocabulary rounded up to
    /// [`VOCAB_PAD_MULTIPLE`].
    pub fn padded_vocab_size(&self) -> usize {
        self.vocab_size.div_ceil(VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE
    }

    /// Channels per attention head (HS: C / NH for GPT-2, `head_dim` for Llama).
    pub fn head_size(&self) -> usize {
        match &self.llama {
            None => self.n_embd / self.n_head,
            Some(l) => l.head_dim,
        }
    }

    /// The context the model was made for, as its exports record it: a Llama
    /// family's source `max_position_embeddings` (training may use a shorter block:
    /// the rotary positions go on), else the block size (GPT-2's learned positions).
    pub fn context_length(&self) -> usize {
        let source = self.llama.as_ref().and_then(|l| l.source_config.as_ref());
        source
            .and_then(|c| c.get("max_position_embeddings"))
            .and_then(serde_json::Value::as_u64)
            .map_or(self.block_size, |n| n as usize)
    }

    /// Key/value heads (KV: NH for GPT-2).
    pub fn kv_heads(&self) -> usize {
        self.llama.as_ref().map_or(self.n_head, |l| l.n_kv_head)
    }

    /// Checks that the shape can be built; the message names the offending key.
    pub fn validate(&self) -> anyhow::Result<()> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("block_size", self.block_size),
            ("n_layer", self.n_layer),
            ("n_head", self.n_head),
            ("n_embd", self.n_embd),
        ];
        for (key, value) in positive {
            if value == 0 {
                bail!("{key} must be at least 1");
            }
        }
        match &self.llama {
            None if !self.n_embd.is_multiple_of(self.n_head) => bail!(
                "n_embd ({}) must be divisible by n_head ({})",
                self.n_embd,
                self.n_head
            ),
            None => {}
            Some(l) => self.validate_llama(l)?,
        }
        if !(0.0..1.0).contains(&self.dropout) {
            bail!("dropout must be in [0, 1), got {}", self.dropout);
        }
        self.check_size()
    }

    /// The Llama architecture's own keys, named as config.json names them.
    fn validate_llama(&self, l: &LlamaConfig) -> anyhow::Result<()> {
        let positive = [
            ("num_key_value_heads", l.n_kv_head),
            ("head_dim", l.head_dim),
            ("intermediate_size", l.intermediate_size),
        ];
        for (key, value) in positive {
            if value == 0 {
                bail!("{key} must be at least 1");
            }
        }
        if !self.n_head.is_multiple_of(l.n_kv_head) {
            bail!(
                "num_attention_heads ({}) must be a multiple of num_key_value_heads ({})",
                self.n_head,
                l.n_kv_head
            );
        }
        if !l.head_dim.is_multiple_of(2) {
            bail!(
                "head_dim ({}) must be even: RoPE turns pairs of channels",
                l.head_dim
            );
        }
        if !(l.rms_norm_eps.is_finite() && l.rms_norm_eps > 0.0) {
            bail!("rms_norm_eps must be positive, got {}", l.rms_norm_eps);
        }
        if !(l.rope.theta.is_finite() && l.rope.theta > 0.0) {
            bail!("rope_theta must be positive, got {}", l.rope.theta);
        }
        Ok(())
    }

    /// Refuses shapes too large to hold (see [`MAX_PARAMS`]), naming the largest key.
    fn check_size(&self) -> anyhow::Result<()> {
        if self.n_layer > MAX_LAYERS {
            bail!(
                "n_layer {} is too large (at most {MAX_LAYERS})",
                self.n_layer
            );
        }
        if self.checked_arena_len().is_some_and(|n| n <= MAX_PARAMS) {
            return Ok(());
        }
        let sizes = [
            ("n_embd", self.n_embd),
            ("block_size", self.block_size),
            ("vocab_size", self.vocab_size),
        ];
        let (key, value) = sizes
            .iter()
            .max_by_key(|s| s.1)
            .copied()
            .unwrap_or_default();
        bail!(
            "the model is too large (more than {MAX_PARAMS} parameters); {key} = {value} is the \
             likely mistake"
        )
    }

    /// An upper bound of the parameter count, including padding, every bias and an
    /// untied classifier; `None` if it overflows.
    fn checked_arena_len(&self) -> Option<usize> {
        let c = self.n_embd;
        let (nh, kv, hs) = (self.n_head, self.kv_heads(), self.head_size());
        let qw = nh.checked_mul(hs)?;
        let qkv = nh.checked_add(kv.checked_mul(2)?)?.checked_mul(hs)?;
        let mlp = match &self.llama {
            None => c.checked_mul(4)?,
            Some(l) => l.intermediate_size.checked_mul(2)?,
        };
        // qkv + out + up + down weights, their biases, norms; generously.
        let weights = (qkv.checked_add(mlp)?.checked_add(mlp)?).checked_mul(c)?;
        let per_layer = weights
            .checked_add(qw.checked_mul(c)?)?
            .checked_add(qkv.checked_add(mlp)?.checked_add(8 * c + 2 * hs)?)?;
        let layers = per_layer.checked_mul(self.n_layer)?;
        let rows = self
            .vocab_size
            .checked_add(VOCAB_PAD_MULTIPLE)?
            .checked_mul(2)?
            .checked_add(self.block_size)?
            .checked_add(2)?;
        rows.checked_mul(c)?.checked_add(layers)
    }

    /// Number of trainable parameters with the real (unpadded) vocabulary, the tied
    /// classifier counted once, as GPT-2 and transformers count them (124,439,808 for
    /// `gpt2`).
    pub fn num_params(&self) -> usize {
        let f = self.family();
        let c = f.c;
        let norm = c * (1 + f.norm_bias as usize);
        let linears: usize = (f.linears.iter())
            .map(|l| l.out() * (l.inp + l.bias as usize))
            .sum();
        let per_layer = 2 * norm + linears + 2 * f.hs * f.qk_norm as usize;
        let positions = if f.rope.is_none() {
            self.block_size * c
        } else {
            0
        };
        let head = if f.tied { 0 } else { self.vocab_size * c };
        self.vocab_size * c + positions + self.n_layer * per_layer + norm + head
    }

    /// Training FLOPs per token for forward + backward: 6·N for the matmuls (N counting
    /// the classifier but no table that is only looked up: positions, an untied
    /// model's token embedding) plus 12·L·QW·T for attention (QW = NH·HS, GPT-2's C),
    /// as in the PaLM paper's appendix and nanoGPT's `estimate_mfu`.
    pub fn flops_per_token(&self, t: usize) -> f64 {
        let qw = self.n_head * self.head_size();
        6.0 * self.matmul_params() as f64 + 12.0 * (self.n_layer * qw * t) as f64
    }

    /// The parameters that take part in a matmul: [`ModelConfig::num_params`] without
    /// the tables that are only looked up (positions, an untied model's token
    /// embedding).
    pub fn matmul_params(&self) -> usize {
        let f = self.family();
        let mut n = self.num_params();
        if f.rope.is_none() {
            n -= self.block_size * self.n_embd;
        }
        if !f.tied {
            n -= self.vocab_size * self.n_embd;
        }
        n
    }
}

#[cfg(test)]
impl ModelConfig {
    /// The unit tests' tiny model: a vocabulary of 50, a context of 8, 2 heads of 8
    /// (C = 16), biases; `n_layer` blocks and `dropout` as the test needs.
    pub(crate) fn tiny_for_tests(n_layer: usize, dropout: f32) -> ModelConfig {
        ModelConfig {
            vocab_size: 50,
            block_size: 8,
            n_layer,
            n_head: 2,
            n_embd: 16,
            bias: true,
            dropout,
            llama: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_parameter_counts_match_openai() {
        assert_eq!(
            ModelConfig::preset("gpt2").unwrap().num_params(),
            124_439_808
        );
        assert_eq!(
            ModelConfig::preset("gpt2-medium").unwrap().num_params(),
            354_823_168
        );
        assert_eq!(
            ModelConfig::preset("gpt2-large").unwrap().num_params(),
            774_030_080
        );
        assert_eq!(
            ModelConfig::preset("gpt2-xl").unwrap().num_params(),
            1_557_611_200
        );
        assert!(ModelConfig::preset("gpt3").is_none());
    }

    #[test]
    fn vocabulary_is_padded_to_a_multiple_of_64() {
        let cfg = ModelConfig::preset("gpt2").unwrap();
        assert_eq!(cfg.padded_vocab_size(), 50304);
        let small = ModelConfig {
            vocab_size: 65,
            ..cfg
        };
        assert_eq!(small.padded_vocab_size(), 128);
    }

    #[test]
    fn validate_names_the_bad_key() {
        let mut cfg = ModelConfig::preset("gpt2").unwrap();
        cfg.n_head = 7;
        assert!(cfg.validate().unwrap_err().to_string().contains("n_head"));
        cfg.n_head = 12;
        cfg.n_layer = 0;
        assert!(cfg.validate().unwrap_err().to_string().contains("n_layer"));
    }

    #[test]
    fn absurd_sizes_are_refused_without_overflow() {
        let gpt2_xl = ModelConfig::preset("gpt2-xl").unwrap();
        assert!(gpt2_xl.validate().is_ok());
        let wide = ModelConfig {
            n_embd: 1 << 40,
            n_head: 1,
            ..gpt2_xl.clone()
        };
        let err = wide.validate().unwrap_err().to_string();
        assert!(err.contains("too large") && err.contains("n_embd"), "{err}");
        let deep = ModelConfig {
            n_layer: usize::MAX,
            ..gpt2_xl.clone()
        };
        assert!(deep.validate().unwrap_err().to_string().contains("n_layer"));
        let long = ModelConfig {
            block_size: usize::MAX - 8,
            ..gpt2_xl
        };
        assert!(long
            .validate()
            .unwrap_err()
            .to_string()
            .contains("block_size"));
    }
}
