//! `config.json` of a Hugging Face model, and what of it the engine can represent:
//! GPT-2's here ([`Gpt2Config`]), the Llama families' in [`super::llama`].

use super::llama::{llama_type, LlamaHfConfig, DEFAULT_BLOCK};
use crate::model::config::LAYER_NORM_EPS;
use crate::model::ModelConfig;
use anyhow::{bail, Context, Result};
use serde::Deserialize;
use std::path::Path;

/// A model's `config.json`, read as its `model_type` says.
#[derive(Clone, Debug, PartialEq)]
pub enum HfConfig {
    Gpt2(Gpt2Config),
    Llama(LlamaHfConfig),
}

impl HfConfig {
    /// Reads `config.json`: a Llama-architecture one is read and checked here, a
    /// GPT-2 one read (and checked by [`HfConfig::check`]).
    pub fn load(path: &Path) -> Result<HfConfig> {
        let text = crate::fsutil::read_json(path, "config.json").with_context(|| {
            format!(
                "cannot read {}: a Hugging Face model directory needs its config.json",
                path.display()
            )
        })?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid JSON", path.display()))?;
        match llama_type(&json) {
            Some(t) => Ok(HfConfig::Llama(LlamaHfConfig::read(&json, t, path)?)),
            None => Gpt2Config::parse(text.as_bytes())
                .map(HfConfig::Gpt2)
                .with_context(|| {
                    format!(
                        "{} is not a valid Hugging Face GPT-2 config.json",
                        path.display()
                    )
                }),
        }
    }

    /// Refuses what the engine cannot represent, naming the keys at fault.
    pub fn check(&self, path: &Path) -> Result<()> {
        match self {
            HfConfig::Gpt2(c) => c.check(path),
            HfConfig::Llama(_) => Ok(()), // checked as it was read
        }
    }

    /// The engine's config: this architecture with `block_size` positions and
    /// `dropout`. The pretrained position table is cropped to `block_size` (nanoGPT's
    /// `crop_block_size`), never extended; by default all of it (a Llama family's up
    /// to [`DEFAULT_BLOCK`]).
    pub fn model_config(
        &self,
        block_size: Option<usize>,
        dropout: f32,
        origin: &Path,
    ) -> Result<ModelConfig> {
        let (key, max, default) = self.position_table();
        let block_size = block_size.unwrap_or(default);
        if block_size > max {
            bail!(
                "block_size {block_size} is larger than the pretrained model's {key} {max} \
                 ({}); set block_size to at most {max}",
                origin.display()
            );
        }
        let cfg = match self {
            HfConfig::Gpt2(c) => {
                let sizes = (c.n_layer, c.n_head, c.n_embd);
                ModelConfig::gpt2(c.vocab_size, block_size, sizes, dropout)
            }
            HfConfig::Llama(c) => c.cropped_config(block_size, dropout, origin)?,
        };
        cfg.validate()
            .with_context(|| origin.display().to_string())?;
        Ok(cfg)
    }

    /// The pretrained position table: its key in config.json, its rows, and the
    /// block size a model gets by default.
    fn position_table(&self) -> (&'static str, usize, usize) {
        match self {
            HfConfig::Gpt2(c) => ("n_positions", c.n_positions(), c.n_positions()),
            HfConfig::Llama(c) => {
                let max = c.max_position_embeddings;
                ("max_position_embeddings", max, max.min(DEFAULT_BLOCK))
            }
        }
    }

    /// The vocabulary size.
    pub fn vocab_size(&self) -> usize {
        match self {
            HfConfig::Gpt2(c) => c.vocab_size,
            HfConfig::Llama(c) => c.vocab_size,
        }
    }

    /// Blocks of the pretrained model.
    pub fn n_layer(&self) -> usize {
        match self {
            HfConfig::Gpt2(c) => c.n_layer,
            HfConfig::Llama(c) => c.num_hidden_layers,
        }
    }

    /// Whether the classifier is the token embedding.
    pub fn tie_word_embeddings(&self) -> bool {
        match self {
            HfConfig::Gpt2(c) => c.tie_word_embeddings,
            HfConfig::Llama(c) => c.llama.tie_word_embeddings,
        }
    }
}

/// The activations that are GELU with the tanh approximation, the engine's GELU.
pub const GELU_TANH_NAMES: [&str; 2] = ["gelu_new", "gelu_pytorch_tanh"];

/// The `GPT2Config` keys the engine reads, with `transformers`' defaults for the
/// ones a file may leave out. Other keys (dropout rates, summary heads, token ids...)
/// are ignored.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct Gpt2Config {
    #[serde(default)]
    pub model_type: Option<String>,
    #[serde(default)]
    pub architectures: Option<Vec<String>>,
    #[serde(default = "d_vocab")]
    pub vocab_size: usize,
    /// Rows of the position table.
    #[serde(default)]
    pub n_positions: Option<usize>,
    /// What older files call `n_positions`.
    #[serde(default)]
    pub n_ctx: Option<usize>,
    #[serde(default = "d_n_embd")]
    pub n_embd: usize,
    #[serde(default = "d_n_layer")]
    pub n_layer: usize,
    #[serde(default = "d_n_head")]
    pub n_head: usize,
    /// Width of the MLP's hidden layer; `null` means 4 × n_embd.
    #[serde(default)]
    pub n_inner: Option<usize>,
    #[serde(default = "d_activation")]
    pub activation_function: String,
    #[serde(default = "d_eps")]
    pub layer_norm_epsilon: f64,
    #[serde(default = "d_true")]
    pub tie_word_embeddings: bool,
    #[serde(default = "d_true")]
    pub scale_attn_weights: bool,
    #[serde(default)]
    pub scale_attn_by_inverse_layer_idx: bool,
    #[serde(default)]
    pub add_cross_attention: bool,
}

fn d_vocab() -> usize {
    50257
}
fn d_n_embd() -> usize {
    768
}
fn d_n_layer() -> usize {
    12
}
fn d_n_head() -> usize {
    12
}
fn d_activation() -> String {
    "gelu_new".into()
}
fn d_eps() -> f64 {
    1e-5
}
fn d_true() -> bool {
    true
}

impl Gpt2Config {
    /// Reads the bytes of a `config.json` (not checked: see [`Gpt2Config::check`]).
    pub fn parse(bytes: &[u8]) -> Result<Gpt2Config> {
        Ok(serde_json::from_slice(bytes)?)
    }

    /// A GPT-2 config with the given shape and `transformers`' defaults otherwise.
    pub fn gpt2_shaped(
        vocab_size: usize,
        n_positions: usize,
        n_layer: usize,
        n_head: usize,
        n_embd: usize,
    ) -> Gpt2Config {
        Gpt2Config {
            model_type: Some("gpt2".into()),
            architectures: None,
            vocab_size,
            n_positions: Some(n_positions),
            n_ctx: None,
            n_embd,
            n_layer,
            n_head,
            n_inner: None,
            activation_function: d_activation(),
            layer_norm_epsilon: d_eps(),
            tie_word_embeddings: true,
            scale_attn_weights: true,
            scale_attn_by_inverse_layer_idx: false,
            add_cross_attention: false,
        }
    }

    /// Rows of the pretrained position table.
    pub fn n_positions(&self) -> usize {
        self.n_positions.or(self.n_ctx).unwrap_or(1024)
    }

    /// Refuses what the engine cannot represent; the message names every key at
    /// fault (`path` is the file, for the message).
    pub fn check(&self, path: &Path) -> Result<()> {
        let mut problems = Vec::new();
        if let Some(t) = self.model_type.as_deref().filter(|t| *t != "gpt2") {
            problems.push(format!(
                "model_type is \"{t}\": nanogpt loads the model types gpt2, llama, mistral, \
                 qwen2 and qwen3"
            ));
        }
        if !GELU_TANH_NAMES.contains(&self.activation_function.as_str()) {
            problems.push(format!(
                "activation_function is \"{}\": nanogpt's GPT-2 computes GELU with the tanh approximation \
                 (\"gelu_new\", as every OpenAI GPT-2), and has no other activation",
                self.activation_function
            ));
        }
        let eps = LAYER_NORM_EPS as f64;
        if ((self.layer_norm_epsilon - eps) / eps).abs() > 1e-6 {
            problems.push(format!(
                "layer_norm_epsilon is {:e}: the engine's layer norms use {eps:e}",
                self.layer_norm_epsilon
            ));
        }
        if let Some(inner) = self.n_inner.filter(|&n| n != 4 * self.n_embd) {
            problems.push(format!(
                "n_inner is {inner}: the engine's MLP is 4 × n_embd = {} wide",
                4 * self.n_embd
            ));
        }
        if !self.scale_attn_weights {
            problems.push(
                "scale_attn_weights is false: the engine always scales attention by 1/√head_size"
                    .into(),
            );
        }
        if self.scale_attn_by_inverse_layer_idx {
            problems.push("scale_attn_by_inverse_layer_idx is true: the engine does not scale attention by layer".into());
        }
        if self.add_cross_attention {
            problems.push("add_cross_attention is true: the engine has no cross-attention".into());
        }
        let sizes = [
            ("vocab_size", self.vocab_size),
            ("n_positions", self.n_positions()),
            ("n_layer", self.n_layer),
            ("n_head", self.n_head),
            ("n_embd", self.n_embd),
        ];
        for (key, value) in sizes {
            if value == 0 {
                problems.push(format!("{key} is 0"));
            }
        }
        if self.n_head > 0 && !self.n_embd.is_multiple_of(self.n_head) {
            problems.push(format!(
                "n_embd ({}) is not a multiple of n_head ({})",
                self.n_embd, self.n_head
            ));
        }
        if problems.is_empty() {
            return Ok(());
        }
        bail!(
            "{}: this model cannot be loaded: {}",
            path.display(),
            problems.join("; ")
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Gpt2Config {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn defaults_are_gpt2_124m() {
        let c = parse("{}");
        assert_eq!(
            (c.n_layer, c.n_head, c.n_embd, c.vocab_size),
            (12, 12, 768, 50257)
        );
        assert_eq!(c.n_positions(), 1024);
        assert!(c.check(Path::new("config.json")).is_ok());
        assert_eq!(parse(r#"{"n_ctx": 512}"#).n_positions(), 512);
        assert_eq!(
            parse(r#"{"n_ctx": 512, "n_positions": 256}"#).n_positions(),
            256
        );
    }

    #[test]
    fn refuses_what_the_engine_cannot_represent() {
        let c =
            parse(r#"{"activation_function": "relu", "layer_norm_epsilon": 1e-6, "n_inner": 100}"#);
        let err = c.check(Path::new("x/config.json")).unwrap_err().to_string();
        for want in [
            "x/config.json",
            "\"relu\"",
            "gelu_new",
            "layer_norm_epsilon",
            "n_inner is 100",
        ] {
            assert!(err.contains(want), "{want} not in: {err}");
        }
        let err = parse(r#"{"model_type": "bloom"}"#)
            .check(Path::new("c"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("\"bloom\"") && err.contains("qwen3"), "{err}");
    }

    /// A Llama-family config.json: `model_type`, a small model's sizes, and `extra`
    /// keys.
    fn llama(model_type: &str, extra: &str) -> HfConfig {
        let json = format!(
            r#"{{"model_type": "{model_type}", "vocab_size": 100, "hidden_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 96,
            "max_position_embeddings": 256{extra}}}"#
        );
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        let t = llama_type(&v).unwrap();
        HfConfig::Llama(LlamaHfConfig::read(&v, t, Path::new("m/config.json")).unwrap())
    }

    /// `c` asked for `block_size` positions is refused, the message naming each of
    /// `want`.
    fn assert_refused(c: &HfConfig, block_size: Option<usize>, want: &[&str]) {
        let err = c.model_config(block_size, 0.0, Path::new("m")).unwrap_err();
        let err = format!("{err:#}");
        for w in want {
            assert!(err.contains(w), "{w} not in {err}");
        }
    }

    #[test]
    fn crops_but_never_extends_the_position_table() {
        let c = HfConfig::Gpt2(parse(
            r#"{"n_positions": 64, "n_embd": 32, "n_head": 4, "n_layer": 1, "vocab_size": 99}"#,
        ));
        let m = c.model_config(Some(16), 0.1, Path::new("m")).unwrap();
        assert_eq!(
            (m.block_size, m.vocab_size, m.dropout, m.bias),
            (16, 99, 0.1, true)
        );
        assert_eq!(
            c.model_config(None, 0.0, Path::new("m"))
                .unwrap()
                .block_size,
            64
        );
        assert_refused(&c, Some(65), &["n_positions 64", "at most 64"]);
    }

    #[test]
    fn a_llama_family_block_is_checked_against_its_window_and_sizes() {
        let q3 = llama("qwen3", r#", "head_dim": 32"#);
        let cfg = q3.model_config(None, 0.0, Path::new("m")).unwrap();
        assert_eq!(
            (cfg.block_size, cfg.head_size(), cfg.kv_heads()),
            (256, 32, 4)
        );
        let mistral = llama("mistral", r#", "sliding_window": 128"#);
        assert_refused(
            &mistral,
            Some(256),
            &["sliding_window is 128", "at most 128"],
        );
        assert!(mistral.model_config(Some(128), 0.0, Path::new("m")).is_ok());
        let kv3 = llama("llama", r#", "num_key_value_heads": 3"#);
        assert_refused(&kv3, None, &["num_key_value_heads"]);
    }
}
