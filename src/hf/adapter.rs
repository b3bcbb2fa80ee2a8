//! PEFT LoRA adapter directories, in and out: `adapter_config.json` and
//! `adapter_model.safetensors`, as `PeftModel.save_pretrained` writes them and
//! `PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained(BASE), DIR)` reads them.
//!
//! PEFT's tensors are named `base_model.model.{block}{i}.{module}.lora_A.weight` (A:
//! `[r, in]`) and `….lora_B.weight` (B: `[out, r]`), the same shapes as ours, with the
//! family's names: `transformer.h.0.attn.c_attn` for GPT-2,
//! `model.layers.0.self_attn.q_proj` for the Llama families. GPT-2's Conv1D
//! (`fan_in_fan_out = True`) only changes how PEFT merges, not the adapters. The scale is `lora_alpha / r` (rsLoRA, DoRA, per-module
//! ranks and trained biases are refused: nanogpt computes none of them). An adapter
//! is applied where PEFT applies it: the modules and layers its config selects
//! ([`super::peft_select`]), of those the file holds.

use super::export::{has_producer_mark, producer_metadata};
use super::peft_select::Selection;
use super::weights::convert;
use crate::fsutil::{
    check_destination, open_regular, read_json, write_atomic, write_bytes_atomic, OutputKind,
    Staged,
};
use crate::model::family::Family;
use crate::model::lora::{self, LoraConfig, LoraLayout, LoraState};
use crate::model::ModelConfig;
use anyhow::{bail, Context, Result};
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use serde_json::{json, Value};
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
    /// Whether some layer's targeted module has no adapter in PEFT's model (its
    /// config selects fewer layers than the arena spans): those adapters are zero, so
    /// that the merged model is PEFT's, but they cannot be trained further here.
    pub partial: bool,
    /// What to tell the user: tensors the file holds that PEFT does not apply.
    pub notes: Vec<String>,
    /// `base_model_name_or_path`, if the config names one.
    pub base_name: Option<String>,
    /// For an adapter nanogpt exported: [`lora::blocks_fingerprint`] of the base it
    /// was trained on.
    pub base_blocks: Option<String>,
}

/// The metadata key of the base's [`lora::blocks_fingerprint`] in the adapters nanogpt
/// exports.
pub const BASE_BLOCKS_KEY: &str = "nanogpt_base_blocks";

/// Reads the PEFT LoRA adapter in `dir` for a base of architecture `model`,
/// applied where PEFT applies it ([`Selection`]), or the GGUF adapter file `dir`
/// (see [`crate::gguf::adapter`]).
pub fn read_adapter(dir: &Path, model: &ModelConfig) -> Result<PeftAdapter> {
    if dir.is_file() && crate::gguf::is_gguf(dir) {
        let (config, layout, weights) = crate::gguf::adapter::read_adapter(dir, model)?;
        return Ok(PeftAdapter {
            config,
            layout,
            weights,
            partial: false,
            notes: Vec::new(),
            base_name: None,
            base_blocks: None,
        });
    }
    let cfg_path = dir.join(CONFIG_FILE);
    let text = read_json(&cfg_path, "adapter config").with_context(|| {
        format!(
            "cannot read {}; an adapter directory holds PEFT's {CONFIG_FILE} and {WEIGHTS_FILE}",
            cfg_path.display()
        )
    })?;
    let json: Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", cfg_path.display()))?;
    let settings = adapter_settings(&json, &cfg_path)?;
    let w_path = dir.join(WEIGHTS_FILE);
    let file = open_regular(&w_path, "adapter weights")
        .with_context(|| format!("cannot read {} (PEFT's adapter weights)", w_path.display()))?;
    // SAFETY: read-only private map of a regular file, dropped before returning.
    let map = unsafe { memmap2::Mmap::map(&file) }
        .with_context(|| format!("cannot read {}", w_path.display()))?;
    let tensors = SafeTensors::deserialize(&map)
        .with_context(|| format!("{} is not a safetensors file", w_path.display()))?;
    let base_blocks = SafeTensors::read_metadata(&map)
        .ok()
        .and_then(|(_, m)| m.metadata().clone())
        .and_then(|m| m.get(BASE_BLOCKS_KEY).cloned());
    let family = model.family();
    let held = held_adapters(&tensors, model, &family, &w_path)?;
    let (applied, mut notes) = applied_adapters(&json, &held, model, &family, &cfg_path)?;
    let targets: Vec<&str> = (family.lora_targets().enumerate())
        .filter(|&(k, _)| applied.iter().any(|&(_, u)| u == k))
        .map(|(_, t)| t.2)
        .collect();
    if targets.is_empty() {
        bail!(
            "{}: its target_modules select none of the LoRA tensors in {}, so PEFT applies \
             nothing; check target_modules (and layers_to_transform)",
            cfg_path.display(),
            w_path.display()
        );
    }
    let (rank, alpha, dropout) = settings;
    let config = LoraConfig::new(rank, alpha, dropout, &targets.join(","))
        .with_context(|| format!("{}: unusable LoRA settings", cfg_path.display()))?;
    config
        .check(model)
        .with_context(|| format!("{}: the adapter does not fit this base", w_path.display()))?;
    let layout = LoraLayout::new(model, &config);
    let mut weights = vec![0.0; layout.params.len];
    for t in &layout.params.tensors {
        let Some((layer, target)) = adapter_of(&family, &t.name) else {
            continue;
        };
        if !applied.contains(&(layer, target)) {
            continue; // PEFT has no adapter there: zero, the base as it is
        }
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
                "{}: tensor {key} has shape {:?} but this base needs {:?} (r = {rank}); the \
                 adapter was trained on another architecture, or its r is wrong",
                w_path.display(),
                view.shape(),
                t.shape
            );
        }
        let values = &mut weights[t.range()];
        convert(&view, &key, &w_path, values)?;
        if values.iter().any(|x| !x.is_finite()) {
            bail!(
                "{}: tensor {key} holds NaN or infinite values; the adapter is damaged (or its \
                 training diverged): use another copy",
                w_path.display()
            );
        }
    }
    let mut per_layer = vec![0usize; model.n_layer];
    for &(layer, _) in &applied {
        per_layer[layer] += 1;
    }
    let partial = per_layer.iter().any(|&n| n != targets.len());
    if partial {
        notes.push(format!(
            "{}: its config puts adapters on some layers only; they apply there alone, as in PEFT",
            cfg_path.display()
        ));
    }
    Ok(PeftAdapter {
        config,
        layout,
        weights,
        partial,
        notes,
        base_name: json
            .get("base_model_name_or_path")
            .and_then(Value::as_str)
            .map(str::to_string),
        base_blocks,
    })
}

/// Refuses to apply the adapter `peft` (read from `dir`) to the model `source`
/// (weights `params`, laid out by `layout`) when it is not the base the adapter was
/// trained on: nanogpt's adapters name their base by a fingerprint of its blocks;
/// for others, a `base_model_name_or_path` that names another model is a warning.
pub fn check_base(
    peft: &PeftAdapter,
    dir: &Path,
    source: &str,
    params: &[f32],
    layout: &crate::model::ParamLayout,
) -> Result<()> {
    if let Some(want) = &peft.base_blocks {
        let found = lora::blocks_fingerprint(params, layout);
        if &found != want {
            bail!(
                "{} holds LoRA adapters trained on another base than {source} (its blocks have \
                 fingerprint {found}, the adapters' base {want}{}); apply the adapter to the \
                 model it was trained on",
                dir.display(),
                peft.base_name
                    .as_ref()
                    .map(|n| format!(", named {n}"))
                    .unwrap_or_default()
            );
        }
        return Ok(());
    }
    let last = |s: &str| {
        s.trim_end_matches('/')
            .rsplit('/')
            .next()
            .unwrap_or_default()
            .to_lowercase()
    };
    if let Some(name) = &peft.base_name {
        if last(name) != last(source) {
            crate::errln!(
                "warning: {} was trained on {name} (its base_model_name_or_path), and is \
                 applied to {source}; if that is another model, what it computes is meaningless",
                dir.display()
            );
        }
    }
    Ok(())
}

/// A layer and one of its targets (the index among the family's
/// [`Family::lora_targets`]), which carry an adapter.
type Adapted = (usize, usize);

/// The module path of target `k` of `family` inside a block (`attn.c_attn`,
/// `self_attn.q_proj`, ...).
fn module_of(family: &Family, k: usize) -> &'static str {
    let (role, part, _) = family
        .lora_targets()
        .nth(k)
        .expect("a target of the family");
    family.linear(role).parts[part].module
}

/// The layer and target of an adapter tensor named like ours
/// (`transformer.h.{i}.{module}.lora_A.weight`, `model.layers.{i}.{module}...`).
fn adapter_of(family: &Family, name: &str) -> Option<Adapted> {
    let rest = name.strip_prefix(family.names().block)?;
    let (layer, rest) = rest.split_once('.')?;
    let module = rest
        .strip_suffix(".lora_A.weight")
        .or_else(|| rest.strip_suffix(".lora_B.weight"))?;
    let k = (0..family.lora_targets().count()).find(|&k| module_of(family, k) == module)?;
    Some((layer.parse().ok()?, k))
}

/// The (layer, target) pairs whose `A` and `B` the file holds; any other tensor, or a
/// layer the base lacks, is refused.
fn held_adapters(
    tensors: &SafeTensors,
    model: &ModelConfig,
    family: &Family,
    w_path: &Path,
) -> Result<Vec<Adapted>> {
    let mut halves: Vec<(usize, usize, bool)> = Vec::new();
    for name in tensors.names() {
        let found = name
            .strip_prefix(PREFIX)
            .and_then(|n| adapter_of(family, n));
        let Some((layer, target)) = found else {
            let names: Vec<&str> = family.lora_targets().map(|t| t.2).collect();
            bail!(
                "{}: tensor {name} is not a LoRA A/B of a {} block's {}",
                w_path.display(),
                family.model_type(),
                names.join(", ")
            );
        };
        if layer >= model.n_layer {
            bail!(
                "{}: tensor {name} adapts layer {layer}, but the base has {} layers; the \
                 adapter belongs to another model",
                w_path.display(),
                model.n_layer
            );
        }
        halves.push((layer, target, name.ends_with(".lora_A.weight")));
    }
    let mut held = Vec::new();
    for &(layer, target, is_a) in &halves {
        let other = halves.contains(&(layer, target, !is_a));
        if !other {
            bail!(
                "{}: layer {layer}'s {} has a lora_{} tensor but no lora_{}; the file is \
                 incomplete",
                w_path.display(),
                module_of(family, target),
                if is_a { "A" } else { "B" },
                if is_a { "B" } else { "A" }
            );
        }
        if is_a {
            held.push((layer, target));
        }
    }
    held.sort_unstable();
    Ok(held)
}

/// Of the adapters `held`, those PEFT applies under the config `json`, and a note
/// naming the ones it leaves out.
fn applied_adapters(
    json: &Value,
    held: &[Adapted],
    model: &ModelConfig,
    family: &Family,
    path: &Path,
) -> Result<(Vec<Adapted>, Vec<String>)> {
    let selection = Selection::read(json).with_context(|| format!("{}", path.display()))?;
    let block = family.names().block;
    let selected = |&(layer, t): &Adapted| {
        selection.selects(&format!("{block}{layer}.{}", module_of(family, t)), true)
    };
    let (applied, ignored): (Vec<_>, Vec<_>) = held.iter().partition(|a| selected(a));
    let mut notes = Vec::new();
    if !ignored.is_empty() {
        let names: Vec<String> = ignored
            .iter()
            .map(|(l, t)| format!("{block}{l}.{}", module_of(family, *t)))
            .collect();
        notes.push(format!(
            "{}: target_modules / layers_to_transform leave out the adapters of {}, which \
             the file holds: they are not applied (as PEFT does not apply them)",
            path.display(),
            names.join(", ")
        ));
    }
    debug_assert!(applied.iter().all(|&(l, _)| l < model.n_layer));
    Ok((applied, notes))
}

/// The rank, alpha and dropout of `adapter_config.json`, after refusing what nanogpt
/// does not compute.
fn adapter_settings(json: &Value, path: &Path) -> Result<(usize, f32, f32)> {
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
    let rank = match field("r") {
        None => bail!("{p}: r (the adapters' rank) is missing"),
        Some(v) => v
            .as_u64()
            .filter(|r| (1..=1 << 16).contains(r))
            .with_context(|| {
                format!("{p}: r must be the adapters' rank, a whole number from 1, got {v}")
            })?,
    };
    let number = |key: &str, default: f64| -> Result<f64> {
        match field(key) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .with_context(|| format!("{p}: {key} must be a number, got {v}")),
        }
    };
    let alpha = number("lora_alpha", 8.0)?;
    if !(alpha.is_finite() && alpha > 0.0) {
        bail!("{p}: lora_alpha must be a positive number, got {alpha}");
    }
    let dropout = number("lora_dropout", 0.0)?;
    if !(0.0..1.0).contains(&dropout) {
        bail!("{p}: lora_dropout must be in [0, 1), got {dropout}");
    }
    Ok((rank as usize, alpha as f32, dropout as f32))
}

/// An adapter export's folder: PEFT's two files, the config (what PEFT opens first) last.
pub const ADAPTER: OutputKind = OutputKind {
    what: "adapter export",
    files: &[WEIGHTS_FILE, CONFIG_FILE],
    last: CONFIG_FILE,
};

/// Writes the adapters `weights` (laid out by `layout`) of a run with `state` as a
/// PEFT adapter directory `dir`: new, empty, or a previous adapter export of ours
/// (anything else is refused), replaced whole. `state.base` is recorded as
/// `base_model_name_or_path`.
pub fn write_adapter(
    dir: &Path,
    state: &LoraState,
    layout: &LoraLayout,
    weights: &[f32],
) -> Result<Vec<String>> {
    check_destination(dir, &ADAPTER, "--to", |d| {
        has_producer_mark(&d.join(WEIGHTS_FILE))
    })?;
    let c = &state.config;
    let modules = &layout.targets;
    let config = json!({
        "peft_type": "LORA",
        "task_type": null,
        "base_model_name_or_path": (state.base != "scratch").then_some(&state.base),
        "r": c.rank,
        "lora_alpha": c.alpha,
        "lora_dropout": c.dropout,
        "target_modules": modules,
        "fan_in_fan_out": layout.fan_in_fan_out,
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
    let mut metadata = producer_metadata();
    if let Some(blocks) = &state.base_blocks {
        metadata.insert(BASE_BLOCKS_KEY.to_string(), blocks.clone());
    }
    let staged = Staged::begin(dir, &ADAPTER)?;
    let path = staged.dir().join(WEIGHTS_FILE);
    write_atomic(&path, |tmp| {
        crate::tensor_file::write(views, &metadata, tmp)
            .with_context(|| format!("cannot write {}", tmp.display()))
    })?;
    write_bytes_atomic(&staged.dir().join(CONFIG_FILE), text.as_bytes())?;
    staged.commit()?;
    Ok(vec![CONFIG_FILE.to_string(), WEIGHTS_FILE.to_string()])
}
