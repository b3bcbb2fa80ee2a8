//! `config.json` of a Llama-architecture model (`model_type` `llama`, `mistral`,
//! `qwen2`, `qwen3`), in both of transformers' spellings of RoPE:
//!
//! - transformers 4.x: `rope_theta` beside `rope_scaling` (`null`, or an object with
//!   `rope_type` — older files say `type` — and its parameters);
//! - transformers 5.x: `rope_parameters` (`rope_type`, `rope_theta` and the
//!   parameters together).
//!
//! Everything nanogpt computes differently is refused with the key named: a RoPE type
//! other than `default`, `linear` and `llama3`, partial rotary embeddings, an
//! activation other than SiLU, and a sliding window shorter than the block.

use crate::kernels::rope::{Rope, RopeScaling};
use crate::model::family::{LlamaConfig, LlamaType};
use crate::model::ModelConfig;
use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::path::Path;

/// A Llama-architecture `config.json`, read and checked.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaHfConfig {
    pub model_type: LlamaType,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub max_position_embeddings: usize,
    /// The shape and settings the engine keeps (with the file itself, for export).
    pub llama: LlamaConfig,
    /// A sliding window that applies (Mistral's `sliding_window`; Qwen's with
    /// `use_sliding_window`): refused for blocks longer than it.
    pub sliding_window: Option<usize>,
}

impl LlamaHfConfig {
    /// Reads a parsed `config.json` of `model_type` (one of [`LlamaType`]); `path`
    /// names the file in messages. Every problem is reported at once.
    pub fn read(json: &Value, model_type: LlamaType, path: &Path) -> Result<LlamaHfConfig> {
        let mut problems = Vec::new();
        let get = |key: &str| json.get(key).filter(|v| !v.is_null());
        let mut size = |key: &str, default: Option<usize>| -> usize {
            match get(key).map(|v| v.as_u64()) {
                Some(Some(n)) => n as usize,
                Some(None) => {
                    problems.push(format!("{key} must be a whole number"));
                    0
                }
                None => default.unwrap_or_else(|| {
                    problems.push(format!("{key} is missing"));
                    0
                }),
            }
        };
        let vocab_size = size("vocab_size", None);
        let hidden_size = size("hidden_size", None);
        let num_hidden_layers = size("num_hidden_layers", None);
        let num_attention_heads = size("num_attention_heads", None);
        let n_kv_head = size("num_key_value_heads", Some(num_attention_heads));
        let head_dim = size("head_dim", hidden_size.checked_div(num_attention_heads));
        let intermediate_size = size("intermediate_size", None);
        let max_position_embeddings = size("max_position_embeddings", Some(2048));
        let number = |key: &str, default: f64| get(key).and_then(Value::as_f64).unwrap_or(default);
        let flag = |key: &str, default: bool| get(key).and_then(Value::as_bool).unwrap_or(default);
        let rms_norm_eps = number("rms_norm_eps", 1e-6) as f32;
        let act = get("hidden_act").and_then(Value::as_str).unwrap_or("silu");
        if act != "silu" && act != "swish" {
            problems.push(format!(
                "hidden_act is \"{act}\": nanogpt's Llama MLP is SwiGLU (\"silu\")"
            ));
        }
        if get("pretraining_tp")
            .and_then(Value::as_u64)
            .is_some_and(|tp| tp != 1)
        {
            problems.push("pretraining_tp is not 1: unsupported".into());
        }
        let rope = match read_rope(json) {
            Ok(rope) => rope,
            Err(e) => {
                problems.push(format!("{e:#}"));
                Rope {
                    theta: 10_000.0,
                    scaling: RopeScaling::None,
                }
            }
        };
        // transformers' class defaults where a file leaves a key out.
        let attention_bias = flag("attention_bias", false);
        let (qkv_bias, o_bias, mlp_bias) = match model_type {
            LlamaType::Llama => (attention_bias, attention_bias, flag("mlp_bias", false)),
            LlamaType::Mistral => (false, false, false),
            LlamaType::Qwen2 => (true, false, false),
            LlamaType::Qwen3 => (attention_bias, attention_bias, false),
        };
        let sliding_window = match model_type {
            LlamaType::Mistral => get("sliding_window").and_then(Value::as_u64),
            LlamaType::Qwen2 | LlamaType::Qwen3 if flag("use_sliding_window", false) => {
                get("sliding_window").and_then(Value::as_u64)
            }
            _ => None,
        }
        .map(|w| w as usize);
        let sliding_layers = get("layer_types")
            .and_then(Value::as_array)
            .is_some_and(|t| t.iter().any(|t| t.as_str() == Some("sliding_attention")));
        if sliding_layers && sliding_window.is_none() {
            problems.push(
                "layer_types has sliding_attention layers: nanogpt attends to every earlier \
                 position in every layer"
                    .into(),
            );
        }
        if !problems.is_empty() {
            bail!(
                "{}: this {} model cannot be loaded: {}",
                path.display(),
                model_type.name(),
                problems.join("; ")
            );
        }
        let llama = LlamaConfig {
            model_type,
            n_kv_head,
            head_dim,
            intermediate_size,
            rms_norm_eps,
            rope,
            tie_word_embeddings: flag("tie_word_embeddings", false),
            qkv_bias,
            o_bias,
            mlp_bias,
            source_config: Some(json.clone()),
        };
        Ok(LlamaHfConfig {
            model_type,
            vocab_size,
            hidden_size,
            num_hidden_layers,
            num_attention_heads,
            max_position_embeddings,
            llama,
            sliding_window,
        })
    }

    /// The engine's config of `block_size` positions (no more than the position table
    /// holds: [`HfConfig::model_config`](super::HfConfig::model_config) checked that)
    /// and `dropout`; refused for blocks longer than a sliding window.
    pub(super) fn cropped_config(
        &self,
        block_size: usize,
        dropout: f32,
        origin: &Path,
    ) -> Result<ModelConfig> {
        if let Some(w) = self.sliding_window.filter(|&w| w < block_size) {
            bail!(
                "{}: sliding_window is {w}, shorter than block_size {block_size}: nanogpt attends \
                 to every earlier position, so it computes this model only for blocks of at most \
                 {w} positions; set block_size to at most {w}",
                origin.display()
            );
        }
        Ok(ModelConfig {
            vocab_size: self.vocab_size,
            block_size,
            n_layer: self.num_hidden_layers,
            n_head: self.num_attention_heads,
            n_embd: self.hidden_size,
            bias: false,
            dropout,
            llama: Some(self.llama.clone()),
        })
    }
}

/// The block size a model gets when none is given: its `max_position_embeddings`,
/// but no more than this (Llama 3.2's is 131,072; the buffers and the RoPE table are
/// sized by it).
pub const DEFAULT_BLOCK: usize = 4096;

/// The RoPE of a config.json in either spelling.
fn read_rope(json: &Value) -> Result<Rope> {
    let get = |key: &str| json.get(key).filter(|v| !v.is_null());
    if get("partial_rotary_factor")
        .and_then(Value::as_f64)
        .is_some_and(|f| f != 1.0)
    {
        bail!("partial_rotary_factor is not 1: nanogpt turns every channel of a head");
    }
    // 5.x: everything in rope_parameters; 4.x: rope_theta and rope_scaling.
    let (params, theta) = match get("rope_parameters") {
        Some(p) => (Some(p), p.get("rope_theta").and_then(Value::as_f64)),
        None => (
            get("rope_scaling"),
            get("rope_theta").and_then(Value::as_f64),
        ),
    };
    let theta = theta.unwrap_or(10_000.0) as f32;
    let Some(params) = params else {
        return Ok(Rope {
            theta,
            scaling: RopeScaling::None,
        });
    };
    if params
        .get("partial_rotary_factor")
        .and_then(Value::as_f64)
        .is_some_and(|f| f != 1.0)
    {
        bail!("partial_rotary_factor is not 1: nanogpt turns every channel of a head");
    }
    let kind = params
        .get("rope_type")
        .or_else(|| params.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let num = |key: &str| -> Result<f32> {
        let v = params.get(key).and_then(Value::as_f64);
        v.map(|v| v as f32)
            .with_context(|| format!("rope_type {kind} needs {key}"))
    };
    let scaling = match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear {
            factor: num("factor")?,
        },
        "llama3" => RopeScaling::Llama3 {
            factor: num("factor")?,
            low_freq_factor: num("low_freq_factor")?,
            high_freq_factor: num("high_freq_factor")?,
            original_max_position_embeddings: params
                .get("original_max_position_embeddings")
                .and_then(Value::as_u64)
                .or_else(|| json.get("max_position_embeddings").and_then(Value::as_u64))
                .context("rope_type llama3 needs original_max_position_embeddings")?
                as usize,
        },
        other => bail!(
            "rope_type is \"{other}\": nanogpt computes RoPE of type default, linear and llama3 \
             (a model trained with {other} scaling would compute other positions)"
        ),
    };
    Ok(Rope { theta, scaling })
}

/// The `config.json` of an export: the source's own (so RoPE keeps its spelling, and
/// token ids and everything nanogpt does not read stay), with the weights' dtype set
/// to float32; for a model made here, one in transformers 5's spelling.
pub fn config_json(cfg: &ModelConfig, l: &LlamaConfig) -> Value {
    if let Some(Value::Object(source)) = &l.source_config {
        let mut json = source.clone();
        let key = match json.contains_key("dtype") || json.contains_key("rope_parameters") {
            true => "dtype",
            false => "torch_dtype",
        };
        json.insert(key.into(), "float32".into());
        return Value::Object(json);
    }
    let mut rope = serde_json::json!({"rope_theta": l.rope.theta as f64});
    let params = match l.rope.scaling {
        RopeScaling::None => serde_json::json!({"rope_type": "default"}),
        RopeScaling::Linear { factor } => {
            serde_json::json!({"rope_type": "linear", "factor": factor as f64})
        }
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => serde_json::json!({
            "rope_type": "llama3",
            "factor": factor as f64,
            "low_freq_factor": low_freq_factor as f64,
            "high_freq_factor": high_freq_factor as f64,
            "original_max_position_embeddings": original_max_position_embeddings,
        }),
    };
    rope.as_object_mut()
        .expect("an object")
        .extend(params.as_object().expect("an object").clone());
    let t = l.model_type;
    let mut json = serde_json::json!({
        "architectures": [t.architecture()],
        "model_type": t.name(),
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.n_embd,
        "intermediate_size": l.intermediate_size,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": l.n_kv_head,
        "head_dim": l.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.block_size,
        "rms_norm_eps": l.rms_norm_eps as f64,
        "rope_parameters": rope,
        "tie_word_embeddings": l.tie_word_embeddings,
        "initializer_range": 0.02,
        "use_cache": true,
        "dtype": "float32",
    });
    let o = json.as_object_mut().expect("an object");
    match t {
        LlamaType::Llama => {
            o.insert("attention_bias".into(), l.qkv_bias.into());
            o.insert("mlp_bias".into(), l.mlp_bias.into());
        }
        LlamaType::Qwen3 => {
            o.insert("attention_bias".into(), l.qkv_bias.into());
        }
        LlamaType::Mistral => {
            o.insert("sliding_window".into(), Value::Null);
        }
        LlamaType::Qwen2 => {
            o.insert("use_sliding_window".into(), false.into());
        }
    }
    json
}

/// The `model_type` of a config.json if it is a Llama-architecture one.
pub fn llama_type(json: &Value) -> Option<LlamaType> {
    json.get("model_type")
        .and_then(Value::as_str)
        .and_then(LlamaType::parse)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(json: &str) -> Result<LlamaHfConfig> {
        let v: Value = serde_json::from_str(json).unwrap();
        let t = llama_type(&v).unwrap();
        LlamaHfConfig::read(&v, t, Path::new("m/config.json"))
    }

    const BASE: &str = r#""vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "intermediate_size": 96, "max_position_embeddings": 256"#;

    #[test]
    fn both_rope_spellings_read_the_same() {
        let v4 = read(&format!(
            r#"{{"model_type": "llama", {BASE}, "rope_theta": 500000.0, "rope_scaling":
            {{"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}}}"#
        ))
        .unwrap();
        let v5 = read(&format!(
            r#"{{"model_type": "llama", {BASE}, "rope_parameters":
            {{"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}}}}"#
        ))
        .unwrap();
        assert_eq!(v4.llama.rope, v5.llama.rope);
        assert_eq!(v4.llama.rope.theta, 500_000.0);
        // The oldest spelling: "type" instead of "rope_type".
        let old = read(&format!(
            r#"{{"model_type": "llama", {BASE}, "rope_scaling": {{"type": "linear", "factor": 2.0}}}}"#
        ))
        .unwrap();
        assert_eq!(old.llama.rope.scaling, RopeScaling::Linear { factor: 2.0 });
        assert_eq!(old.llama.rope.theta, 10_000.0);
    }

    #[test]
    fn defaults_and_families() {
        let q = read(&format!(
            r#"{{"model_type": "qwen2", {BASE}, "num_key_value_heads": 2}}"#
        ))
        .unwrap();
        assert!(q.llama.qkv_bias && !q.llama.o_bias && !q.llama.tie_word_embeddings);
        assert_eq!((q.llama.n_kv_head, q.llama.head_dim), (2, 16));
        let q3 = read(&format!(
            r#"{{"model_type": "qwen3", {BASE}, "head_dim": 32}}"#
        ))
        .unwrap();
        assert!(q3.llama.qk_norm() && !q3.llama.qkv_bias);
        assert_eq!(q3.llama.head_dim, 32);
    }

    #[test]
    fn refuses_what_the_engine_computes_otherwise() {
        let err = read(&format!(
            r#"{{"model_type": "llama", {BASE}, "hidden_act": "gelu",
            "rope_scaling": {{"rope_type": "yarn", "factor": 4.0}}}}"#
        ))
        .unwrap_err()
        .to_string();
        for want in ["m/config.json", "hidden_act", "\"yarn\""] {
            assert!(err.contains(want), "{want} not in {err}");
        }
    }
}
