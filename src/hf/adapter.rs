//! PEFT LoRA adapter directories, in and out: `adapter_config.json` and
//! `adapter_model.safetensors`, as `PeftModel.save_pretrained` writes them and
//! `PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained(BASE), DIR)` reads them.
//!
//! PEFT's tensors for GPT-2 are named `base_model.model.transformer.h.{i}.{module}.
//! lora_A.weight` (A: `[r, in]`) and `….lora_B.weight` (B: `[out, r]`), the same
//! shapes as ours: GPT-2's Conv1D (`fan_in_fan_out = True`) only changes how PEFT
//! merges, not the adapters. The scale is `lora_alpha / r` (rsLoRA, DoRA, per-module
//! ranks and trained biases are refused: nanogpt computes none of them).

use super::weights::convert;
use crate::fsutil::{write_atomic, write_bytes_atomic};
use crate::model::lora::{LoraConfig, LoraLayout, LoraState, Target, TARGETS};
use crate::model::ModelConfig;
use anyhow::{bail, Context, Result};
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::Path;

/// PEFT's prefix of a GPT2LMHeadModel's adapter keys.
pub const PREFIX: &str = "base_model.model.";
pub const CONFIG_FILE: &str = "adapter_config.json";
pub const WEIGHTS_FILE: &str = "adapter_model.safetensors";

/// A PEFT adapter read for a base of architecture `model`: its settings, the
/// arena they lay out, and the weights in it.
pub struct PeftAdapter {
    pub config: LoraConfig,
    pub layout: LoraLayout,
    pub weights: Vec<f32>,
}

/// Reads the PEFT LoRA adapter in `dir` (or the GGUF adapter file `dir`, see
/// [`crate::gguf::adapter`]) for a GPT-2 base of architecture `model`.
pub fn read_adapter(dir: &Path, model: &ModelConfig) -> Result<PeftAdapter> {
    if dir.is_file() && crate::gguf::is_gguf(dir) {
        let (config, layout, weights) = crate::gguf::adapter::read_adapter(dir, model)?;
        return Ok(PeftAdapter {
            config,
            layout,
            weights,
        });
    }
    let cfg_path = dir.join(CONFIG_FILE);
    let text = std::fs::read_to_string(&cfg_path).with_context(|| {
        format!(
            "cannot read {}; an adapter directory holds PEFT's {CONFIG_FILE} and {WEIGHTS_FILE}",
            cfg_path.display()
        )
    })?;
    let json: Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", cfg_path.display()))?;
    let w_path = dir.join(WEIGHTS_FILE);
    let bytes = std::fs::read(&w_path)
        .with_context(|| format!("cannot read {} (PEFT's adapter weights)", w_path.display()))?;
    let tensors = SafeTensors::deserialize(&bytes)
        .with_context(|| format!("{} is not a safetensors file", w_path.display()))?;
    let config = adapter_config(&json, &tensors, &cfg_path)?;
    let layout = LoraLayout::new(model, &config);
    let mut weights = vec![0.0; layout.params.len];
    for t in &layout.params.tensors {
        let key = format!("{PREFIX}{}", t.name);
        let view = tensors.tensor(&key).map_err(|_| {
            anyhow::anyhow!(
                "{}: tensor {key} is missing; the adapter does not fit this base ({} layers)",
                w_path.display(),
                model.n_layer
            )
        })?;
        if view.shape() != t.shape.as_slice() {
            bail!(
                "{}: tensor {key} has shape {:?} but this base needs {:?}; the adapter was \
                 trained on another architecture",
                w_path.display(),
                view.shape(),
                t.shape
            );
        }
        convert(&view, &key, &w_path, &mut weights[t.range()])?;
    }
    Ok(PeftAdapter {
        config,
        layout,
        weights,
    })
}

/// The settings of `adapter_config.json`; the targets are read off the tensors
/// (PEFT's `target_modules` may be a pattern).
fn adapter_config(json: &Value, tensors: &SafeTensors, path: &Path) -> Result<LoraConfig> {
    let p = path.display();
    let field = |k: &str| json.get(k).filter(|v| !v.is_null());
    if field("peft_type").and_then(Value::as_str) != Some("LORA") {
        bail!("{p}: not a LoRA adapter (peft_type must be \"LORA\")");
    }
    for (key, why) in [
        ("use_rslora", "rsLoRA scaling"),
        ("use_dora", "DoRA"),
        ("lora_bias", "trained adapter biases"),
    ] {
        if field(key).and_then(Value::as_bool) == Some(true) {
            bail!("{p}: {key} = true ({why}) is not supported; train the adapter without it");
        }
    }
    for key in ["rank_pattern", "alpha_pattern"] {
        if field(key)
            .and_then(Value::as_object)
            .is_some_and(|m| !m.is_empty())
        {
            bail!("{p}: {key} (per-module ranks or alphas) is not supported");
        }
    }
    if field("bias")
        .and_then(Value::as_str)
        .is_some_and(|b| b != "none")
    {
        bail!("{p}: bias must be \"none\" (nanogpt trains no biases with LoRA)");
    }
    if field("modules_to_save").is_some_and(|v| v.as_array().is_none_or(|a| !a.is_empty())) {
        bail!("{p}: modules_to_save is not supported (the base stays frozen)");
    }
    let rank = field("r").and_then(Value::as_u64).context("missing r")?;
    let alpha = field("lora_alpha").and_then(Value::as_f64).unwrap_or(8.0);
    let dropout = field("lora_dropout").and_then(Value::as_f64).unwrap_or(0.0);
    let mut targets: Vec<&str> = Vec::new();
    for name in tensors.names() {
        let module = TARGETS.into_iter().find(|t| {
            let of = |m: &str| name.ends_with(&format!(".{}.{m}.weight", t.module()));
            name.starts_with(PREFIX) && (of("lora_A") || of("lora_B"))
        });
        match module {
            Some(t) if !targets.contains(&t.key()) => targets.push(t.key()),
            Some(_) => {}
            None => bail!(
                "{}: tensor {name} is not a LoRA A/B of a GPT-2 block's c_attn, attn.c_proj, \
                 c_fc or mlp.c_proj",
                path.with_file_name(WEIGHTS_FILE).display()
            ),
        }
    }
    if targets.is_empty() {
        bail!("{p}: the adapter holds no LoRA tensors");
    }
    LoraConfig::new(
        rank as usize,
        alpha as f32,
        dropout as f32,
        &targets.join(","),
    )
    .with_context(|| format!("{p}: unusable LoRA settings"))
}

/// Writes the adapters `weights` (laid out by `layout`) of a run with `state` as a
/// PEFT adapter directory `dir` (created; files replaced atomically). `base` is
/// recorded as `base_model_name_or_path`.
pub fn write_adapter(
    dir: &Path,
    state: &LoraState,
    layout: &LoraLayout,
    weights: &[f32],
) -> Result<Vec<String>> {
    std::fs::create_dir_all(dir).with_context(|| {
        format!(
            "cannot create {}; check the path and permissions",
            dir.display()
        )
    })?;
    let c = &state.config;
    let modules: Vec<&str> = TARGETS
        .into_iter()
        .filter(|&t| c.targets(t))
        .map(Target::key)
        .collect();
    let config = json!({
        "peft_type": "LORA",
        "task_type": null,
        "base_model_name_or_path": (state.base != "scratch").then_some(&state.base),
        "r": c.rank,
        "lora_alpha": c.alpha,
        "lora_dropout": c.dropout,
        "target_modules": modules,
        "fan_in_fan_out": true,
        "bias": "none",
        "use_rslora": false,
        "use_dora": false,
        "init_lora_weights": true,
        "inference_mode": true,
        "modules_to_save": null,
        "layers_to_transform": null,
        "layers_pattern": null,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": null,
    });
    let mut text = serde_json::to_string_pretty(&config)?;
    text.push('\n');
    let bytes: &[u8] = bytemuck::cast_slice(weights);
    let mut views = Vec::new();
    for t in &layout.params.tensors {
        let data = &bytes[t.offset * 4..(t.offset + t.numel()) * 4];
        let view = TensorView::new(Dtype::F32, t.shape.clone(), data)?;
        views.push((format!("{PREFIX}{}", t.name), view));
    }
    let metadata = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    let path = dir.join(WEIGHTS_FILE);
    write_atomic(&path, |tmp| {
        crate::tensor_file::write(views, &metadata, tmp)
            .with_context(|| format!("cannot write {}", tmp.display()))
    })?;
    write_bytes_atomic(&dir.join(CONFIG_FILE), text.as_bytes())?;
    Ok(vec![CONFIG_FILE.to_string(), WEIGHTS_FILE.to_string()])
}
