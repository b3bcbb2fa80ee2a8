//! The Llama families through the whole model: gradients against finite differences
//! (every variant: biases, q/k norm, untied head, 3:1 groups, llama3 RoPE, dropout),
//! activation checkpointing, LoRA on the parts of stacked layers, and the layout the
//! family description makes. (The numbers against transformers are in tests/llama.rs.)

use super::family::{LlamaConfig, LlamaType, Role};
use super::lora::LoraConfig;
use super::tests::{batch, check_finite_differences, random_model, with_adapters};
use super::*;
use crate::kernels::rope::{Rope, RopeScaling};
use crate::kernels::testutil::rand_vec;

/// A tiny model of `t`: C 16 over 4 heads of 6 (HS != C / NH) sharing 2 key/value
/// heads, MLP 20, llama3 RoPE; Qwen2's q/k/v biases, Qwen3's q/k norm, and an untied
/// head unless `tied`.
pub(crate) fn tiny_llama(t: LlamaType, tied: bool, dropout: f32) -> ModelConfig {
    ModelConfig {
        vocab_size: 37,
        block_size: 8,
        n_layer: 2,
        n_head: 4,
        n_embd: 16,
        bias: false,
        dropout,
        llama: Some(LlamaConfig {
            model_type: t,
            n_kv_head: 2,
            head_dim: 6,
            intermediate_size: 20,
            rms_norm_eps: 1e-5,
            rope: Rope {
                theta: 500_000.0,
                scaling: RopeScaling::Llama3 {
                    factor: 8.0,
                    low_freq_factor: 1.0,
                    high_freq_factor: 4.0,
                    original_max_position_embeddings: 64,
                },
            },
            tie_word_embeddings: tied,
            qkv_bias: t == LlamaType::Qwen2,
            o_bias: false,
            mlp_bias: false,
            source_config: None,
        }),
    }
}

const TYPES: [LlamaType; 3] = [LlamaType::Llama, LlamaType::Qwen2, LlamaType::Qwen3];

/// Norm gains and biases away from 1 and 0, so every path carries signal.
fn perturbed(cfg: ModelConfig, b: usize, t: usize) -> Gpt {
    let mut gpt = random_model(cfg, b, t, 11);
    let noise = rand_vec(gpt.params.len(), 12);
    for tensor in gpt.layout.tensors.clone() {
        if tensor.shape.len() == 1 && !tensor.name.ends_with(".bias") {
            for i in tensor.range() {
                gpt.params[i] = 1.0 + 0.3 * noise[i];
            }
        }
    }
    gpt
}

#[test]
fn layout_holds_the_hugging_face_tensors_with_stacked_parts() {
    let cfg = tiny_llama(LlamaType::Qwen3, false, 0.0);
    let layout = ParamLayout::new(&cfg);
    let names: Vec<&str> = layout.tensors.iter().map(|t| t.name.as_str()).collect();
    for want in [
        "model.embed_tokens.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.0.self_attn.k_norm.weight",
        "model.layers.1.self_attn.o_proj.weight",
        "model.layers.1.post_attention_layernorm.weight",
        "model.layers.1.mlp.gate_proj.weight",
        "model.layers.1.mlp.up_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.norm.weight",
        "lm_head.weight",
    ] {
        assert!(names.contains(&want), "{want} missing from {names:?}");
    }
    assert!(layout.wpe.is_empty() && !layout.lm_head.is_empty());
    assert_eq!(layout.classifier(), layout.lm_head);
    // q, k and v one after another: one matmul of (NH + 2·KV)·HS = 48 rows.
    let at = &layout.layers[0];
    let (q, v) = (
        layout
            .get("model.layers.0.self_attn.q_proj.weight")
            .unwrap(),
        layout
            .get("model.layers.0.self_attn.v_proj.weight")
            .unwrap(),
    );
    assert_eq!(
        (at.qkv.weight.start, at.qkv.weight.end),
        (q.offset, v.range().end)
    );
    assert_eq!((at.qkv.oc, at.qkv.c, at.attn_out.c), (48, 16, 24));
    assert_eq!((at.mlp_up.oc, at.mlp_down.c), (40, 20));
    // Every parameter once; the count transformers gives (untied: both tables).
    let stored: usize = layout.tensors.iter().map(|t| t.numel()).sum();
    let padding = 2 * (cfg.padded_vocab_size() - cfg.vocab_size) * cfg.n_embd;
    assert_eq!(stored - padding, cfg.num_params());
    let tied = tiny_llama(LlamaType::Llama, true, 0.0);
    assert!(ParamLayout::new(&tied).lm_head.is_empty());
    assert_eq!(
        tied.num_params() + 37 * 16,
        tiny_llama(LlamaType::Llama, false, 0.0).num_params()
    );
}

#[test]
fn backward_matches_finite_differences() {
    let (b, t) = (2, 5);
    for (ty, tied, dropout) in [
        (LlamaType::Llama, true, 0.0),
        (LlamaType::Qwen2, false, 0.0),
        (LlamaType::Qwen3, false, 0.0),
        (LlamaType::Llama, false, 0.2),
    ] {
        let cfg = tiny_llama(ty, tied, dropout);
        let mut gpt = perturbed(cfg, b, t);
        let (x, y) = batch(b, t, gpt.config().vocab_size);
        let v = gpt.config().vocab_size * gpt.config().n_embd;
        let vocab = [gpt.layout.wte.start, gpt.layout.lm_head.start];
        let real_rows = move |_: &Gpt, tensor: &TensorInfo| match vocab.contains(&tensor.offset) {
            true => tensor.offset..tensor.offset + v,
            false => tensor.range(),
        };
        let (_, checked) = check_finite_differences(&mut gpt, (&x, &y, b, t), 5, real_rows);
        assert!(checked > 100, "{ty:?}: only {checked} gradients checked");
    }
}

#[test]
fn activation_checkpointing_is_bit_identical() {
    for ty in TYPES {
        let run = |checkpointing: bool, dtype: Dtype| {
            let (b, t) = (2, 8);
            let mut gpt = perturbed(tiny_llama(ty, false, 0.1), b, t);
            gpt.set_activation_checkpointing(checkpointing);
            gpt.set_dtype(dtype, &crate::kernels::bf16::Backend::detect(None));
            gpt.set_dropout_seed(3);
            let (x, y) = batch(b, t, 37);
            gpt.zero_grad();
            let loss = gpt.forward(&x, &y, b, t);
            gpt.backward();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            (loss.to_bits(), bits(&gpt.grads))
        };
        for dtype in [Dtype::Float32, Dtype::Bfloat16] {
            assert_eq!(run(true, dtype), run(false, dtype), "{ty:?} {dtype:?}");
        }
    }
}

/// A random base with adapters on `targets`, `B` made non-zero.
fn adapted(cfg: ModelConfig, targets: &str, lora_dropout: f32, b: usize, t: usize) -> Gpt {
    with_adapters(perturbed(cfg, b, t), targets, lora_dropout)
}

const ALL: &str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj";

#[test]
fn adapters_on_every_part_match_finite_differences() {
    let (b, t) = (2, 5);
    for (targets, lora_dropout) in [(ALL, 0.0), ("k_proj,up_proj", 0.3)] {
        let mut gpt = adapted(
            tiny_llama(LlamaType::Qwen3, false, 0.0),
            targets,
            lora_dropout,
            b,
            t,
        );
        let (x, y) = batch(b, t, 37);
        let whole = |_: &Gpt, tensor: &TensorInfo| tensor.range();
        let (_, checked) = check_finite_differences(&mut gpt, (&x, &y, b, t), 3, whole);
        assert!(
            checked > 40,
            "{targets}: too few gradients checked ({checked})"
        );
    }
}

#[test]
fn the_adapted_model_equals_its_merge() {
    let (b, t) = (2, 6);
    let mut gpt = adapted(tiny_llama(LlamaType::Llama, true, 0.0), ALL, 0.0, b, t);
    let (x, _) = batch(b, t, 37);
    gpt.set_training(false);
    let adapted_logits = gpt.logits(&x, b, t);
    let merged = gpt.merged_params().into_owned();
    let cfg = gpt.config().clone();
    let mut plain = Gpt::from_params(cfg, merged, b, t).unwrap();
    plain.set_training(false);
    let merged_logits = plain.logits(&x, b, t);
    for (a, m) in adapted_logits.iter().zip(&merged_logits) {
        assert!((a - m).abs() <= 1e-5 * (1.0 + m.abs()), "{a} vs {m}");
    }
    assert_ne!(adapted_logits, {
        let mut base = perturbed(tiny_llama(LlamaType::Llama, true, 0.0), b, t);
        base.set_training(false);
        base.logits(&x, b, t)
    });
}

#[test]
fn gpt2_names_stand_for_the_layers_in_the_same_place() {
    let family = tiny_llama(LlamaType::Llama, true, 0.0).family();
    let lora = LoraConfig::new(4, 8.0, 0.0, "c_attn,mlp.c_proj").unwrap();
    let targets: Vec<(Role, usize)> = (lora.resolve(&family).unwrap().iter())
        .map(|t| (t.role, t.part))
        .collect();
    let want = [
        (Role::Qkv, 0),
        (Role::Qkv, 1),
        (Role::Qkv, 2),
        (Role::MlpDown, 0),
    ];
    assert_eq!(targets, want);
    let gpt2 = ModelConfig::tiny_for_tests(1, 0.0);
    let err = LoraConfig::new(4, 8.0, 0.0, "q_proj")
        .unwrap()
        .check(&gpt2)
        .unwrap_err();
    assert!(
        err.to_string().contains("gpt2 model does not have"),
        "{err}"
    );
}
