//! LoRA adapters as llama.cpp's GGUF adapter files (what its `convert_lora_to_gguf.py`
//! writes and `llama-cli --lora` reads): `general.type = "adapter"`,
//! `adapter.type = "lora"`, `adapter.lora.alpha`, the base's architecture, and for
//! each adapted weight `W` (`blk.N.attn_qkv.weight`, ...) the tensors
//! `W.lora_a` (PyTorch `[r, in]`) and `W.lora_b` (`[out, r]`), PEFT's shapes.
//! llama.cpp adds `alpha / r · B·A·x` to the layer's output, as nanogpt's LoRA does.
//! For a `llama` base (Llama, Mistral) the rows of q's and k's `B` are reordered as the
//! base's q and k rows are ([`super::llama`]): `B·A` is then the update of the
//! weight as the base file holds it. Adapter files of the Llama families are written
//! here, read for GPT-2 bases only.

use super::llama;
use super::model::PRODUCER_KEY;
use super::model::{check_destination, gguf_name, storage_type, Exported, OutType, GPT2};
use super::read::GgufFile;
use super::types::Value;
use super::write::{GgufWriter, TensorSpec};
use crate::model::family::{Family, Part};
use crate::model::lora::{LoraConfig, LoraLayout, LoraState};
use crate::model::ModelConfig;
use anyhow::{bail, Context, Result};
use std::path::Path;

/// The GGUF name of an adapter arena tensor (`transformer.h.0.attn.c_attn.lora_A.weight`
/// → `blk.0.attn_qkv.weight.lora_a`).
pub fn gguf_adapter_name(name: &str) -> Option<String> {
    let (module, kind) = match name.strip_suffix(".lora_A.weight") {
        Some(m) => (m, "lora_a"),
        None => (name.strip_suffix(".lora_B.weight")?, "lora_b"),
    };
    Some(format!(
        "{}.{kind}",
        gguf_name(&format!("{module}.weight"))?
    ))
}

/// The GGUF name of a Llama adapter arena tensor
/// (`model.layers.0.self_attn.q_proj.lora_A.weight` → `blk.0.attn_q.weight.lora_a`).
fn llama_adapter_name(name: &str) -> Option<String> {
    let (module, kind) = match name.strip_suffix(".lora_A.weight") {
        Some(m) => (m, "lora_a"),
        None => (name.strip_suffix(".lora_B.weight")?, "lora_b"),
    };
    Some(format!(
        "{}.{kind}",
        llama::gguf_name(&format!("{module}.weight"))?
    ))
}

/// Writes the adapters `weights` (laid out by `layout`) of a LoRA run with `state`
/// on a base of `model`'s architecture to the GGUF adapter file `dest`, atomically.
pub fn write_adapter(
    dest: &Path,
    model: &ModelConfig,
    state: &LoraState,
    layout: &LoraLayout,
    weights: &[f32],
    outtype: OutType,
    name: &str,
) -> Result<Exported> {
    check_destination(dest)?;
    let arch = model
        .llama
        .as_ref()
        .map_or(GPT2, |l| llama::arch_name(l.model_type));
    let s = |v: &str| Value::String(v.into());
    let metadata = vec![
        ("general.architecture".to_string(), s(arch)),
        ("general.type".to_string(), s("adapter")),
        ("general.name".to_string(), s(name)),
        (
            "general.file_type".to_string(),
            Value::U32(outtype.file_type()),
        ),
        ("general.quantization_version".to_string(), Value::U32(2)),
        (
            PRODUCER_KEY.to_string(),
            s(&format!("nanogpt {}", env!("CARGO_PKG_VERSION"))),
        ),
        ("adapter.type".to_string(), s("lora")),
        (
            "adapter.lora.alpha".to_string(),
            Value::F32(state.config.alpha),
        ),
    ];
    let file_name = |n: &str| match model.llama {
        None => gguf_adapter_name(n),
        Some(_) => llama_adapter_name(n),
    };
    let mut specs = Vec::new();
    for t in &layout.params.tensors {
        let name = file_name(&t.name).expect("adapter tensors have GGUF names");
        let ty = storage_type(&name, &t.shape, outtype);
        specs.push(TensorSpec::new(name, &t.shape, ty));
    }
    let mut w = GgufWriter::create(dest, &metadata, specs)?;
    for t in &layout.params.tensors {
        let data = &weights[t.range()];
        let base = t.name.replace(".lora_B.weight", ".weight");
        let heads = match (&model.llama, t.name.ends_with(".lora_B.weight")) {
            (Some(l), true) => llama::reordered_heads(&base, model, l),
            _ => None,
        };
        match heads {
            Some(heads) => w.write_f32(&llama::to_interleaved(data, heads, t.shape[1]))?,
            None => w.write_f32(data)?,
        }
    }
    w.finish()?;
    Ok(Exported {
        path: dest.to_path_buf(),
        bytes: std::fs::metadata(dest).map(|m| m.len()).unwrap_or(0),
        tensors: layout.params.tensors.len(),
        parameters: layout.params.tensors.iter().map(|t| t.numel()).sum(),
    })
}

/// Reads the GGUF LoRA adapter `path` for a base of architecture `model`: its
/// settings (the rank from its tensors, `alpha` from `adapter.lora.alpha`, where
/// absent or 0 llama.cpp's scale 1, i.e. alpha = rank; no dropout), the arena they
/// lay out, and the weights in it.
pub fn read_adapter(
    path: &Path,
    model: &ModelConfig,
) -> Result<(LoraConfig, LoraLayout, Vec<f32>)> {
    let file = GgufFile::open(path)?;
    let p = path.display();
    let get_str = |k: &str| file.get(k).and_then(Value::as_str);
    if get_str("general.type") != Some("adapter") || get_str("adapter.type") != Some("lora") {
        bail!("{p} is not a LoRA adapter (general.type \"adapter\", adapter.type \"lora\")");
    }
    match get_str("general.architecture") {
        Some(GPT2) => {}
        arch => bail!(
            "{p} adapts a `{}` model; this base is a gpt2",
            arch.unwrap_or("(unnamed)")
        ),
    }
    let mut targets = Vec::new();
    let mut rank = None;
    if model.llama.is_some() {
        bail!(
            "{p}: GGUF adapters are read for GPT-2 bases only; this base is a {} (use its \
             PEFT adapter folder)",
            model.family().model_type()
        );
    }
    // GGUF here is GPT-2's: its four linear layers, one part each.
    let gpt2 = Family::gpt2(1, 1, false);
    let parts: Vec<Part> = (gpt2.linears.iter())
        .flat_map(|l| l.parts.iter().copied())
        .collect();
    for t in &file.header.tensors {
        let target = parts.iter().find(|part| {
            (0..model.n_layer).any(|i| {
                let base = format!("transformer.h.{i}.{}.lora_A.weight", part.module);
                let a = gguf_adapter_name(&base).unwrap_or_default();
                t.name == a || t.name == a.replace(".lora_a", ".lora_b")
            })
        });
        let Some(target) = target else {
            bail!(
                "{p}: tensor {} is not a LoRA A/B of a GPT-2 block of {} layers (attn_qkv, \
                 attn_output, ffn_up, ffn_down)",
                t.name,
                model.n_layer
            );
        };
        if !targets.contains(&target.lora) {
            targets.push(target.lora);
        }
        if t.name.ends_with(".lora_a") {
            let r = t.dims.get(1).copied().unwrap_or(0) as usize;
            if rank.is_some_and(|have| have != r) {
                bail!("{p}: its adapters have different ranks; nanogpt uses one rank for all");
            }
            rank = Some(r);
        }
    }
    let Some(rank) = rank.filter(|&r| r > 0) else {
        bail!("{p} holds no LoRA tensors");
    };
    let alpha = match file.get("adapter.lora.alpha").and_then(Value::as_f64) {
        Some(a) if a > 0.0 => a as f32,
        _ => rank as f32,
    };
    let config = LoraConfig::new(rank, alpha, 0.0, &targets.join(","))
        .with_context(|| format!("{p}: unusable LoRA settings"))?;
    let layout = LoraLayout::new(model, &config);
    let mut weights = vec![0.0; layout.params.len];
    for t in &layout.params.tensors {
        let name = gguf_adapter_name(&t.name).expect("adapter tensors have GGUF names");
        let Some(info) = file.tensor(&name) else {
            bail!("{p}: tensor {name} is missing; every layer needs the same adapters");
        };
        if info.shape() != t.shape {
            bail!(
                "{p}: tensor {name} has shape {:?} but this base needs {:?}; the adapter was \
                 trained on another architecture",
                info.shape(),
                t.shape
            );
        }
        file.read_f32(info, &mut weights[t.range()])?;
    }
    Ok((config, layout, weights))
}
