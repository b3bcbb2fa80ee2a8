//! A model family, described once: what a block is made of (norms, positions,
//! attention heads, MLP, head) and what each tensor is called, in the arena and in
//! Hugging Face's files. The parameter layout, the initialisation, the bf16 packs,
//! the LoRA targets, the HF import/export tables, the memory plan and ZeRO's
//! buckets all follow from a [`Family`]; adding a family means a description here
//! (and any kernel it lacks), not edits in ten files.
//!
//! Two families are described: GPT-2 (`model_type` `gpt2`: learned positions, layer
//! norms, GELU, Conv1D weights in HF's files, a tied head) and the Llama architecture
//! (`llama`, `mistral`, `qwen2`, `qwen3`: RoPE, RMSNorm, SwiGLU, grouped-query
//! attention, `nn.Linear` weights, tied or untied head), whose variants differ in
//! biases and Qwen3's q/k norm ([`LlamaConfig`]).
//!
//! Every block has four linear layers in this order ([`Role`]), each possibly several
//! Hugging Face tensors stacked along its output rows ([`Part`]): the arena holds the
//! parts one after another with no gap, so one matmul runs the whole layer while each
//! part keeps its own name (and LoRA adapter).

use crate::kernels::rope::Rope;
use serde::{Deserialize, Serialize};

/// Epsilon of every layer norm of GPT-2 (PyTorch's and Hugging Face GPT-2's default).
pub const LAYER_NORM_EPS: f32 = 1e-5;

/// The Llama-architecture model types (`model_type` in config.json).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LlamaType {
    /// Llama 2 and 3.x, SmolLM2, TinyLlama.
    Llama,
    /// Mistral without a sliding window shorter than the block: Llama.
    Mistral,
    /// Qwen2 and Qwen2.5: biases on q, k and v.
    Qwen2,
    /// Qwen3: a per-head RMSNorm on q and k before RoPE, head_dim of its own.
    Qwen3,
}

impl LlamaType {
    /// The `model_type` string.
    pub fn name(self) -> &'static str {
        match self {
            LlamaType::Llama => "llama",
            LlamaType::Mistral => "mistral",
            LlamaType::Qwen2 => "qwen2",
            LlamaType::Qwen3 => "qwen3",
        }
    }

    /// The model type of a `model_type` string, if it is one of these.
    pub fn parse(name: &str) -> Option<LlamaType> {
        [
            LlamaType::Llama,
            LlamaType::Mistral,
            LlamaType::Qwen2,
            LlamaType::Qwen3,
        ]
        .into_iter()
        .find(|t| t.name() == name)
    }

    /// Transformers' class for it (`architectures` in config.json).
    pub fn architecture(self) -> &'static str {
        match self {
            LlamaType::Llama => "LlamaForCausalLM",
            LlamaType::Mistral => "MistralForCausalLM",
            LlamaType::Qwen2 => "Qwen2ForCausalLM",
            LlamaType::Qwen3 => "Qwen3ForCausalLM",
        }
    }
}

/// What a Llama-architecture model adds to [`ModelConfig`](super::ModelConfig)'s
/// shape (`n_embd` is `hidden_size`, `n_head` `num_attention_heads`, `n_layer`
/// `num_hidden_layers`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LlamaConfig {
    pub model_type: LlamaType,
    /// `num_key_value_heads`.
    pub n_kv_head: usize,
    /// Channels per head (`head_dim`, often `hidden_size / num_attention_heads`).
    pub head_dim: usize,
    /// The MLP's hidden width (`intermediate_size`).
    pub intermediate_size: usize,
    pub rms_norm_eps: f32,
    pub rope: Rope,
    /// The classifier is the token embedding (else a `lm_head` of its own).
    pub tie_word_embeddings: bool,
    /// Biases on q, k and v (Qwen2; Llama's `attention_bias`).
    pub qkv_bias: bool,
    /// A bias on the attention's output projection (Llama's `attention_bias`).
    pub o_bias: bool,
    /// Biases on the MLP's three projections (Llama's `mlp_bias`).
    pub mlp_bias: bool,
    /// The source's `config.json`, kept so that an export writes it back in the
    /// same spelling (RoPE's, token ids, everything nanogpt does not read); None for
    /// a model made here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_config: Option<serde_json::Value>,
}

impl LlamaConfig {
    /// Qwen3's q/k norm.
    pub fn qk_norm(&self) -> bool {
        self.model_type == LlamaType::Qwen3
    }
}

/// The four linear layers of a block, in arena and block order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Queries, keys and values: `(NH + 2·KV)·HS` from `C`.
    Qkv = 0,
    /// The attention's output projection: `C` from `NH·HS`.
    AttnOut = 1,
    /// The MLP's first projection: GELU's `4C`, or SwiGLU's gate and up (`2I`).
    MlpUp = 2,
    /// The MLP's last projection: `C` from the hidden width.
    MlpDown = 3,
}

/// The roles in block order.
pub const ROLES: [Role; 4] = [Role::Qkv, Role::AttnOut, Role::MlpUp, Role::MlpDown];

/// A normalisation layer's kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormKind {
    /// `(x − mean)·rstd·w (+ b)` (GPT-2).
    Layer,
    /// `x·rstd·w`, no mean, no bias (Llama).
    Rms,
}

/// The MLP's activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// GELU, tanh approximation, on one `4C` projection (GPT-2).
    Gelu,
    /// `silu(gate) · up` on two stacked projections of `I` (Llama).
    SwiGlu,
}

/// One Hugging Face tensor of a linear layer: its module path inside a block, the
/// output rows it holds, and its LoRA target name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Part {
    /// Inside a block, e.g. `self_attn.q_proj` or `attn.c_attn`.
    pub module: &'static str,
    pub rows: usize,
    /// The name `lora_targets` gives it (`q_proj`, `c_attn`, ...).
    pub lora: &'static str,
}

/// A block's linear layer: its input width, its parts and whether they have biases.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Linear {
    pub role: Role,
    pub inp: usize,
    pub parts: Vec<Part>,
    pub bias: bool,
}

impl Linear {
    /// Output rows, all parts together.
    pub fn out(&self) -> usize {
        self.parts.iter().map(|p| p.rows).sum()
    }

    /// Part `k`'s first output row.
    pub fn row_offset(&self, k: usize) -> usize {
        self.parts[..k].iter().map(|p| p.rows).sum()
    }
}

/// A model family's description (see the [module docs](self)), made from a
/// [`ModelConfig`](super::ModelConfig) by [`ModelConfig::family`](super::ModelConfig::family).
#[derive(Clone, Debug, PartialEq)]
pub struct Family {
    /// `gpt2`, or the Llama type.
    pub llama: Option<LlamaType>,
    /// Channels of the residual stream (C).
    pub c: usize,
    /// Query heads (NH), key/value heads (KV) and their size (HS).
    pub nh: usize,
    pub kv: usize,
    pub hs: usize,
    pub norm: NormKind,
    pub norm_eps: f32,
    /// Biases in the layer norms (GPT-2 with `bias`).
    pub norm_bias: bool,
    /// Rotary positions; None: a learned position table (`wpe`).
    pub rope: Option<Rope>,
    /// Qwen3's per-head RMSNorm of q and k (weights of HS).
    pub qk_norm: bool,
    pub activation: Activation,
    /// The MLP's width after its activation (GELU's 4C, SwiGLU's I).
    pub mlp_width: usize,
    /// The classifier is the token embedding.
    pub tied: bool,
    /// The four linear layers, in [`ROLES`] order.
    pub linears: [Linear; 4],
}

/// The names of the tensors outside the blocks, and the blocks' prefix.
#[derive(Clone, Copy, Debug)]
pub struct Names {
    pub wte: &'static str,
    /// Empty where positions are rotary.
    pub wpe: &'static str,
    /// Tensor names of block `i` start with this and `{i}.`.
    pub block: &'static str,
    /// The block's two norms, inside a block.
    pub norm_1: &'static str,
    pub norm_2: &'static str,
    /// Qwen3's q and k norms, inside a block.
    pub q_norm: &'static str,
    pub k_norm: &'static str,
    /// The final norm (its `.weight`, `.bias`).
    pub norm_f: &'static str,
    /// The untied classifier.
    pub lm_head: &'static str,
}

const GPT2_NAMES: Names = Names {
    wte: "transformer.wte.weight",
    wpe: "transformer.wpe.weight",
    block: "transformer.h.",
    norm_1: "ln_1",
    norm_2: "ln_2",
    q_norm: "",
    k_norm: "",
    norm_f: "transformer.ln_f",
    lm_head: "lm_head.weight",
};

const LLAMA_NAMES: Names = Names {
    wte: "model.embed_tokens.weight",
    wpe: "",
    block: "model.layers.",
    norm_1: "input_layernorm",
    norm_2: "post_attention_layernorm",
    q_norm: "self_attn.q_norm",
    k_norm: "self_attn.k_norm",
    norm_f: "model.norm",
    lm_head: "lm_head.weight",
};

impl Family {
    /// GPT-2 of width `c` in `nh` heads, with biases or not.
    pub fn gpt2(c: usize, nh: usize, bias: bool) -> Family {
        let part = |module, rows, lora| Part { module, rows, lora };
        let linear = |role, inp, p: Part| Linear {
            role,
            inp,
            parts: vec![p],
            bias,
        };
        Family {
            llama: None,
            c,
            nh,
            kv: nh,
            hs: c.checked_div(nh).unwrap_or(0),
            norm: NormKind::Layer,
            norm_eps: LAYER_NORM_EPS,
            norm_bias: bias,
            rope: None,
            qk_norm: false,
            activation: Activation::Gelu,
            mlp_width: 4 * c,
            tied: true,
            linears: [
                linear(Role::Qkv, c, part("attn.c_attn", 3 * c, "c_attn")),
                linear(Role::AttnOut, c, part("attn.c_proj", c, "attn.c_proj")),
                linear(Role::MlpUp, c, part("mlp.c_fc", 4 * c, "c_fc")),
                linear(Role::MlpDown, 4 * c, part("mlp.c_proj", c, "mlp.c_proj")),
            ],
        }
    }

    /// The Llama architecture of width `c` in `nh` query heads, with `l`'s settings.
    pub fn llama(c: usize, nh: usize, l: &LlamaConfig) -> Family {
        let (kv, hs, i) = (l.n_kv_head, l.head_dim, l.intermediate_size);
        let biases = [l.qkv_bias, l.o_bias, l.mlp_bias];
        Family {
            llama: Some(l.model_type),
            c,
            nh,
            kv,
            hs,
            norm: NormKind::Rms,
            norm_eps: l.rms_norm_eps,
            norm_bias: false,
            rope: Some(l.rope),
            qk_norm: l.qk_norm(),
            activation: Activation::SwiGlu,
            mlp_width: i,
            tied: l.tie_word_embeddings,
            linears: llama_linears(c, (nh, kv, hs), i, biases),
        }
    }

    /// The tensor names of this family.
    pub fn names(&self) -> Names {
        match self.llama {
            None => GPT2_NAMES,
            Some(_) => LLAMA_NAMES,
        }
    }

    /// The `model_type` string.
    pub fn model_type(&self) -> &'static str {
        self.llama.map_or("gpt2", LlamaType::name)
    }

    /// Whether Hugging Face stores the blocks' linear weights `[in, out]` (GPT-2's
    /// Conv1D) rather than `[out, in]` (`nn.Linear`, the arena's order).
    pub fn conv1d(&self) -> bool {
        self.llama.is_none()
    }

    /// The linear layer of `role`.
    pub fn linear(&self, role: Role) -> &Linear {
        &self.linears[role as usize]
    }

    /// Every LoRA target name of a block, in block order: `(role, part index, name)`.
    pub fn lora_targets(&self) -> impl Iterator<Item = (Role, usize, &'static str)> + '_ {
        self.linears.iter().flat_map(|l| {
            l.parts
                .iter()
                .enumerate()
                .map(move |(k, p)| (l.role, k, p.lora))
        })
    }

    /// A LoRA target by its `lora_targets` name or its module path.
    pub fn lora_target(&self, name: &str) -> Option<(Role, usize)> {
        self.linears.iter().find_map(|l| {
            let k = l
                .parts
                .iter()
                .position(|p| p.lora == name || p.module == name)?;
            Some((l.role, k))
        })
    }

    /// The query (and attention output) width, `NH·HS`.
    pub fn q_width(&self) -> usize {
        self.nh * self.hs
    }

    /// Width of a row of queries, keys and values, `(NH + 2·KV)·HS`.
    pub fn qkv_width(&self) -> usize {
        (self.nh + 2 * self.kv) * self.hs
    }

    /// Width of the MLP's first projection's output: `4C` (GELU) or `2I` (SwiGLU).
    pub fn mlp_up_width(&self) -> usize {
        self.linear(Role::MlpUp).out()
    }
}

/// The Llama architecture's linear layers: width `c`, heads `(NH, KV, HS)`, MLP width
/// `i`, biases on q/k/v, on o and on the MLP.
fn llama_linears(c: usize, heads: (usize, usize, usize), i: usize, bias: [bool; 3]) -> [Linear; 4] {
    let (nh, kv, hs) = heads;
    let part = |module, rows, lora| Part { module, rows, lora };
    let linear = |role, inp, parts, bias| Linear {
        role,
        inp,
        parts,
        bias,
    };
    [
        linear(
            Role::Qkv,
            c,
            vec![
                part("self_attn.q_proj", nh * hs, "q_proj"),
                part("self_attn.k_proj", kv * hs, "k_proj"),
                part("self_attn.v_proj", kv * hs, "v_proj"),
            ],
            bias[0],
        ),
        linear(
            Role::AttnOut,
            nh * hs,
            vec![part("self_attn.o_proj", c, "o_proj")],
            bias[1],
        ),
        linear(
            Role::MlpUp,
            c,
            vec![
                part("mlp.gate_proj", i, "gate_proj"),
                part("mlp.up_proj", i, "up_proj"),
            ],
            bias[2],
        ),
        linear(
            Role::MlpDown,
            i,
            vec![part("mlp.down_proj", c, "down_proj")],
            bias[2],
        ),
    ]
}

/// Every LoRA target of every family, GPT-2's then Llama's, each in block order:
/// the names (and module paths) a `lora_targets` list may hold.
pub fn known_lora_targets() -> Vec<Part> {
    let gpt2 = Family::gpt2(1, 1, false).linears;
    let llama = llama_linears(1, (1, 1, 2), 1, [false; 3]);
    gpt2.iter()
        .chain(&llama)
        .flat_map(|l| l.parts.iter().copied())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::rope::RopeScaling;

    fn qwen3() -> LlamaConfig {
        LlamaConfig {
            model_type: LlamaType::Qwen3,
            n_kv_head: 8,
            head_dim: 128,
            intermediate_size: 3072,
            rms_norm_eps: 1e-6,
            rope: Rope {
                theta: 1e6,
                scaling: RopeScaling::None,
            },
            tie_word_embeddings: true,
            qkv_bias: false,
            o_bias: false,
            mlp_bias: false,
            source_config: None,
        }
    }

    #[test]
    fn qwen3_heads_are_wider_than_hidden_over_heads() {
        // Qwen3-0.6B: hidden 1024, 16 heads of 128, 8 key/value heads.
        let f = Family::llama(1024, 16, &qwen3());
        assert_eq!((f.q_width(), f.qkv_width()), (2048, 4096));
        assert_eq!(f.linear(Role::AttnOut).inp, 2048);
        assert_eq!(f.linear(Role::Qkv).row_offset(2), 2048 + 1024);
        assert_eq!(f.mlp_up_width(), 6144);
        assert!(f.qk_norm && f.rope.is_some() && !f.conv1d());
        let targets: Vec<_> = f.lora_targets().map(|t| t.2).collect();
        assert_eq!(
            targets,
            [
                "q_proj",
                "k_proj",
                "v_proj",
                "o_proj",
                "gate_proj",
                "up_proj",
                "down_proj"
            ]
        );
        assert_eq!(f.lora_target("v_proj"), Some((Role::Qkv, 2)));
        assert_eq!(f.lora_target("mlp.up_proj"), Some((Role::MlpUp, 1)));
        assert_eq!(f.lora_target("c_attn"), None);
    }

    #[test]
    fn gpt2_is_one_part_per_linear() {
        let f = Family::gpt2(768, 12, true);
        assert_eq!(
            (f.kv, f.hs, f.qkv_width(), f.mlp_width),
            (12, 64, 2304, 3072)
        );
        assert!(f.linears.iter().all(|l| l.parts.len() == 1 && l.bias));
        assert_eq!(f.lora_target("attn.c_proj"), Some((Role::AttnOut, 0)));
        assert_eq!(f.lora_target("mlp.c_fc"), Some((Role::MlpUp, 0)));
        assert!(f.tied && f.conv1d() && f.rope.is_none());
    }
}
