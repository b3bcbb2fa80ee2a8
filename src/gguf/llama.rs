//! The Llama families (`llama`, `mistral`, `qwen2`, `qwen3`) as llama.cpp holds them
//! in a GGUF file: tensor names, the q/k row order, the architecture's metadata; for
//! export from a parameter arena and import into one.
//!
//! | nanogpt (Hugging Face name) | GGUF |
//! |---|---|
//! | `model.embed_tokens.weight` | `token_embd.weight` |
//! | `model.layers.N.input_layernorm.weight` | `blk.N.attn_norm.weight` |
//! | `model.layers.N.self_attn.{q,k,v}_proj.*` | `blk.N.attn_{q,k,v}.*` |
//! | `model.layers.N.self_attn.{q,k}_norm.weight` (Qwen3) | `blk.N.attn_{q,k}_norm.weight` |
//! | `model.layers.N.self_attn.o_proj.*` | `blk.N.attn_output.*` |
//! | `model.layers.N.post_attention_layernorm.weight` | `blk.N.ffn_norm.weight` |
//! | `model.layers.N.mlp.{gate,up,down}_proj.*` | `blk.N.ffn_{gate,up,down}.*` |
//! | `model.norm.weight` | `output_norm.weight` |
//! | `lm_head.weight` (untied only) | `output.weight` |
//!
//! Linear weights are `[out, in]` on both sides. llama.cpp's `llama` architecture
//! (Mistral's too) turns pairs of adjacent channels (`x[2i]`, `x[2i+1]`), where
//! transformers turns `x[i]` with `x[i + HS/2]`; its converter reorders the rows of
//! q and k (weights and biases) within each head to match ([`to_interleaved`]), and an
//! import undoes it ([`from_interleaved`]). Qwen2 and Qwen3 turn channels as
//! transformers does: nothing is reordered. Llama 3's RoPE scaling travels as the
//! tensor `rope_freqs.weight` (one divisor per frequency), linear scaling as
//! `{arch}.rope.scaling.*`.

use super::read::GgufFile;
use super::types::Value;
use crate::kernels::rope::{Rope, RopeScaling};
use crate::model::family::{LlamaConfig, LlamaType};
use crate::model::ModelConfig;
use anyhow::{bail, Context, Result};

/// The tensor holding Llama 3's RoPE divisors.
pub const ROPE_FREQS: &str = "rope_freqs.weight";

/// llama.cpp's architecture name of a Llama type (Mistral is `llama` there).
pub fn arch_name(t: LlamaType) -> &'static str {
    match t {
        LlamaType::Llama | LlamaType::Mistral => "llama",
        LlamaType::Qwen2 => "qwen2",
        LlamaType::Qwen3 => "qwen3",
    }
}

/// The Llama type of a llama.cpp architecture name nanogpt loads.
pub fn parse_arch(arch: &str) -> Option<LlamaType> {
    match arch {
        "llama" => Some(LlamaType::Llama),
        "qwen2" => Some(LlamaType::Qwen2),
        "qwen3" => Some(LlamaType::Qwen3),
        _ => None,
    }
}

/// Whether llama.cpp turns adjacent channel pairs for this type (its q/k rows are
/// then reordered).
pub fn interleaved(t: LlamaType) -> bool {
    arch_name(t) == "llama"
}

/// llama.cpp's name of the arena tensor `name` (a Hugging Face Llama name).
pub fn gguf_name(name: &str) -> Option<String> {
    match name {
        "model.embed_tokens.weight" => return Some("token_embd.weight".into()),
        "model.norm.weight" => return Some("output_norm.weight".into()),
        "lm_head.weight" => return Some("output.weight".into()),
        _ => {}
    }
    let rest = name.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let (module, kind) = rest.rsplit_once('.')?;
    let part = match module {
        "input_layernorm" => "attn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "self_attn.o_proj" => "attn_output",
        "post_attention_layernorm" => "ffn_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        _ => return None,
    };
    Some(format!(
        "blk.{}.{part}.{kind}",
        layer.parse::<usize>().ok()?
    ))
}

/// The heads whose rows of `name` llama.cpp reorders in an `interleaved` model: the
/// query heads for q, the key/value heads for k; `None` for every other tensor.
pub fn reordered_heads(name: &str, cfg: &ModelConfig, l: &LlamaConfig) -> Option<usize> {
    if !interleaved(l.model_type) {
        return None;
    }
    let module = name.rsplit_once('.')?.0;
    match module.rsplit_once('.')?.1 {
        "q_proj" => Some(cfg.n_head),
        "k_proj" => Some(l.n_kv_head),
        _ => None,
    }
}

/// Reorders the rows of `src` (`heads` heads of HS rows, each row `cols` long) from
/// transformers' order (row `j·HS/2 + i` of a head is the `j`-th of pair `i`) to
/// llama.cpp's (that row at `2i + j`).
pub fn to_interleaved(src: &[f32], heads: usize, cols: usize) -> Vec<f32> {
    reorder(src, heads, cols, |hs, r| {
        let half = hs / 2;
        (r % half) * 2 + r / half
    })
}

/// The inverse of [`to_interleaved`].
pub fn from_interleaved(src: &[f32], heads: usize, cols: usize) -> Vec<f32> {
    reorder(src, heads, cols, |hs, r| (r % 2) * (hs / 2) + r / 2)
}

/// `out[head, to(HS, r)] = src[head, r]`, rows of `cols`.
fn reorder(src: &[f32], heads: usize, cols: usize, to: impl Fn(usize, usize) -> usize) -> Vec<f32> {
    let hs = src.len() / cols / heads;
    let mut out = vec![0.0; src.len()];
    for h in 0..heads {
        for r in 0..hs {
            let from = (h * hs + r) * cols;
            let dest = (h * hs + to(hs, r)) * cols;
            out[dest..dest + cols].copy_from_slice(&src[from..from + cols]);
        }
    }
    out
}

/// Llama 3's RoPE divisors, one per frequency (`HS/2`), as llama.cpp's converter
/// computes `rope_freqs.weight`; `None` for other scalings.
pub fn rope_divisors(rope: &Rope, hs: usize) -> Option<Vec<f32>> {
    let RopeScaling::Llama3 {
        factor,
        low_freq_factor: low,
        high_freq_factor: high,
        original_max_position_embeddings: old,
    } = rope.scaling
    else {
        return None;
    };
    let old = old as f64;
    let (low_wavelen, high_wavelen) = (old / low as f64, old / high as f64);
    let divisors = (0..hs / 2).map(|i| {
        let freq = 1.0 / (rope.theta as f64).powf((2 * i) as f64 / hs as f64);
        let wavelen = std::f64::consts::TAU / freq;
        if wavelen < high_wavelen {
            1.0
        } else if wavelen > low_wavelen {
            factor
        } else {
            let smooth = ((old / wavelen - low as f64) / (high - low) as f64) as f32;
            1.0 / ((1.0 - smooth) / factor + smooth)
        }
    });
    Some(divisors.collect())
}

/// The architecture's metadata (`{arch}.*`): shape, norm, RoPE and vocabulary size.
pub fn metadata(cfg: &ModelConfig, l: &LlamaConfig) -> Result<Vec<(String, Value)>> {
    let arch = arch_name(l.model_type);
    if matches!(l.rope.scaling, RopeScaling::Llama3 { .. }) && !interleaved(l.model_type) {
        bail!(
            "this {} model uses Llama 3's RoPE scaling, which llama.cpp applies to its `llama` \
             architecture only; export it to a Hugging Face folder (--to DIR) instead",
            l.model_type.name()
        );
    }
    let n = |v: usize| Value::U32(v as u32);
    let mut m = vec![
        ("context_length", n(cfg.context_length())),
        ("embedding_length", n(cfg.n_embd)),
        ("block_count", n(cfg.n_layer)),
        ("feed_forward_length", n(l.intermediate_size)),
        ("attention.head_count", n(cfg.n_head)),
        ("attention.head_count_kv", n(l.n_kv_head)),
        (
            "attention.layer_norm_rms_epsilon",
            Value::F32(l.rms_norm_eps),
        ),
        ("rope.freq_base", Value::F32(l.rope.theta)),
        ("rope.dimension_count", n(l.head_dim)),
        ("vocab_size", n(cfg.vocab_size)),
    ];
    if l.head_dim * cfg.n_head != cfg.n_embd {
        m.push(("attention.key_length", n(l.head_dim)));
        m.push(("attention.value_length", n(l.head_dim)));
    }
    if let RopeScaling::Linear { factor } = l.rope.scaling {
        m.push(("rope.scaling.type", Value::String("linear".into())));
        m.push(("rope.scaling.factor", Value::F32(factor)));
    }
    Ok(m.into_iter()
        .map(|(k, v)| (format!("{arch}.{k}"), v))
        .collect())
}

/// A Llama-architecture GGUF's shape and settings, read and checked: the engine's
/// config, its block size the file's context length.
pub fn read_config(file: &GgufFile, arch: &str, t: LlamaType) -> Result<ModelConfig> {
    let p = file.path().display();
    let key = |k: &str| format!("{arch}.{k}");
    let count = |k: &str, default: Option<usize>| -> Result<usize> {
        let full = key(k);
        let Some(v) = file.get(&full) else {
            return default.with_context(|| format!("{p} has no {full}"));
        };
        v.as_u64()
            .filter(|&n| n > 0 && n < 1 << 32)
            .map(|n| n as usize)
            .with_context(|| format!("{p}: {full} is {v:?}, not a positive count"))
    };
    let number = |k: &str| file.get(&key(k)).and_then(Value::as_f64);
    let (n_layer, n_head, n_embd) = (
        count("block_count", None)?,
        count("attention.head_count", None)?,
        count("embedding_length", None)?,
    );
    let context = count("context_length", None)?;
    let n_kv_head = count("attention.head_count_kv", Some(n_head))?;
    let head_dim = count("attention.key_length", Some(n_embd / n_head))?;
    for (k, want) in [
        ("attention.value_length", head_dim),
        ("rope.dimension_count", head_dim),
    ] {
        let found = count(k, Some(want))?;
        if found != want {
            bail!(
                "{p}: {} is {found}, not the head size {want}: nanogpt computes attention \
                 with equal key and value sizes and turns every channel of a head",
                key(k)
            );
        }
    }
    let eps = number("attention.layer_norm_rms_epsilon")
        .with_context(|| format!("{p} has no {}", key("attention.layer_norm_rms_epsilon")))?;
    let theta = number("rope.freq_base").unwrap_or(10_000.0) as f32;
    let rope = Rope {
        theta,
        scaling: read_scaling(file, arch, t, theta, head_dim)?,
    };
    let has = |name: &str| file.tensor(name).is_some();
    let qkv_bias = has("blk.0.attn_q.bias");
    if t == LlamaType::Qwen2 && !qkv_bias {
        bail!("{p} is a qwen2 model without blk.0.attn_q.bias: Qwen2 has biases on q, k and v");
    }
    let vocab_size = file.embedding_vocab(n_embd, &key("embedding_length"))?;
    let llama = LlamaConfig {
        model_type: t,
        n_kv_head,
        head_dim,
        intermediate_size: count("feed_forward_length", None)?,
        rms_norm_eps: eps as f32,
        rope,
        tie_word_embeddings: !has("output.weight"),
        qkv_bias,
        o_bias: has("blk.0.attn_output.bias"),
        mlp_bias: has("blk.0.ffn_up.bias"),
        source_config: None,
    };
    let cfg = ModelConfig {
        vocab_size,
        block_size: context,
        n_layer,
        n_head,
        n_embd,
        bias: false,
        dropout: 0.0,
        llama: Some(llama),
    };
    cfg.validate().with_context(|| format!("{p}"))?;
    Ok(cfg)
}

/// The RoPE scaling of a file: `{arch}.rope.scaling.type` (none or linear), or
/// Llama 3's as `rope_freqs.weight` holds it.
fn read_scaling(
    file: &GgufFile,
    arch: &str,
    t: LlamaType,
    theta: f32,
    hs: usize,
) -> Result<RopeScaling> {
    let p = file.path().display();
    let key = format!("{arch}.rope.scaling.type");
    let scaling = match file.get(&key).and_then(Value::as_str) {
        None | Some("none") => RopeScaling::None,
        Some("linear") => {
            let factor = file
                .get(&format!("{arch}.rope.scaling.factor"))
                .and_then(Value::as_f64)
                .with_context(|| {
                    format!("{p}: linear RoPE scaling without {arch}.rope.scaling.factor")
                })?;
            RopeScaling::Linear {
                factor: factor as f32,
            }
        }
        Some(other) => bail!(
            "{p}: {key} is `{other}`; nanogpt computes RoPE without scaling, linear, or Llama 3's"
        ),
    };
    let Some(info) = file.tensor(ROPE_FREQS) else {
        return Ok(scaling);
    };
    if scaling != RopeScaling::None || !interleaved(t) {
        bail!(
            "{p}: {ROPE_FREQS} in a {arch} model with {key} set: nanogpt cannot compute that RoPE"
        );
    }
    let divisors = file.tensor_f32(info)?;
    llama3_of(&divisors, theta, hs).with_context(|| {
        format!(
            "{p}: {ROPE_FREQS} holds RoPE divisors that are not Llama 3's scaling (factor, \
             low_freq_factor 1, high_freq_factor 4, original context 8192): nanogpt cannot \
             compute that RoPE"
        )
    })
}

/// Llama 3's scaling whose divisors are `divisors` (those of Llama 3.1 and 3.2:
/// low/high frequency factors 1 and 4, original context 8192; the factor is the
/// largest divisor), if they are.
fn llama3_of(divisors: &[f32], theta: f32, hs: usize) -> Option<RopeScaling> {
    let factor = divisors.iter().copied().fold(1.0f32, f32::max);
    let scaling = RopeScaling::Llama3 {
        factor,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    };
    let want = rope_divisors(&Rope { theta, scaling }, hs)?;
    let same = want.len() == divisors.len()
        && want
            .iter()
            .zip(divisors)
            .all(|(a, b)| (a - b).abs() <= 1e-6 * a.abs());
    same.then_some(scaling)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interleaving_round_trips_and_pairs_halves() {
        // 2 heads of HS 4, rows of 1: HF order [a0 a1 b0 b1] per head (pairs a_i, b_i).
        let src: Vec<f32> = (0..8).map(|x| x as f32).collect();
        let inter = to_interleaved(&src, 2, 1);
        assert_eq!(inter, [0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0]);
        assert_eq!(from_interleaved(&inter, 2, 1), src);
        let wide: Vec<f32> = (0..48).map(|x| x as f32).collect();
        assert_eq!(from_interleaved(&to_interleaved(&wide, 2, 3), 2, 3), wide);
    }

    #[test]
    fn llama3_divisors_are_recognised() {
        let rope = Rope {
            theta: 500_000.0,
            scaling: RopeScaling::Llama3 {
                factor: 32.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192,
            },
        };
        let d = rope_divisors(&rope, 64).unwrap();
        assert_eq!(d.len(), 32);
        assert_eq!((d[0], d[31]), (1.0, 32.0));
        assert!(d.iter().any(|&x| x > 1.0 && x < 32.0));
        assert_eq!(llama3_of(&d, 500_000.0, 64), Some(rope.scaling));
        let mut other = d.clone();
        other[20] *= 1.5;
        assert_eq!(llama3_of(&other, 500_000.0, 64), None);
    }

    #[test]
    fn names_map_both_ways_of_the_table() {
        for (hf, gguf) in [
            ("model.layers.3.self_attn.q_proj.bias", "blk.3.attn_q.bias"),
            (
                "model.layers.0.self_attn.k_norm.weight",
                "blk.0.attn_k_norm.weight",
            ),
            (
                "model.layers.1.mlp.gate_proj.weight",
                "blk.1.ffn_gate.weight",
            ),
            (
                "model.layers.1.post_attention_layernorm.weight",
                "blk.1.ffn_norm.weight",
            ),
            ("lm_head.weight", "output.weight"),
        ] {
            assert_eq!(gguf_name(hf).as_deref(), Some(gguf));
        }
        assert_eq!(gguf_name("model.layers.x.mlp.up_proj.weight"), None);
    }
}
