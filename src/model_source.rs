//! Where a model for evaluation, sampling or export comes from: a training run's
//! `out_dir`, or pretrained Hugging Face GPT-2 weights (`gpt2`, `gpt2-medium`, ...,
//! a model directory, a `.safetensors` file, or a Hub id; see [`crate::hf`]).

use crate::checkpoint::{checkpoint_path, interval_checkpoints, is_checkpoint_name, Checkpoint};
use crate::data::tokenizer::files::TOKENIZER_JSON;
use crate::data::{Meta, TokenDtype, Tokenizer, TokenizerFiles, TokenizerKind, GPT2_VOCAB_SIZE};
use crate::hf::Pretrained;
use crate::model::lora::{self, LoraLayout, LoraState};
use crate::model::{ModelConfig, ParamLayout};
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

/// Weights and tokenizer of a trained model, ready to build a `Gpt` from.
pub struct LoadedModel {
    pub config: ModelConfig,
    pub params: Vec<f32>,
    /// The description of the tokenizer the model was trained with.
    pub meta: Meta,
    /// That tokenizer (a model's own read from the run's folder, which training
    /// copies it into, and checked against `meta`'s hash).
    pub tokenizer: Tokenizer,
}

/// Loads the model named by `src`: a training run's `out_dir` (its best-val
/// `ckpt.safetensors`, else its newest interval checkpoint `ckpt-NNNNNN.safetensors`),
/// one of those checkpoint files itself, or pretrained weights (a Hugging Face model
/// directory with `config.json`, a `.safetensors` file, `gpt2`, `gpt2-medium`,
/// `gpt2-large`, `gpt2-xl` or another Hub id, resolved through the local Hugging Face
/// cache or a download).
pub fn load_model(src: &str) -> Result<LoadedModel> {
    if src == "scratch" || src == "resume" {
        bail!(
            "`{src}` names no model here; pass a training run's out_dir, a Hugging Face model \
             directory or .safetensors file, or a pretrained name such as gpt2"
        );
    }
    let path = Path::new(src);
    if path.is_dir() {
        if let Some(ckpt) = run_checkpoint(path)? {
            return load_checkpoint(&ckpt);
        }
        if !looks_like_hf_dir(path) {
            bail!(
                "{src} holds neither a training checkpoint ({} or ckpt-NNNNNN.safetensors) nor \
                 a Hugging Face model (config.json + model.safetensors); pass the out_dir of a \
                 training run or a model directory",
                checkpoint_path(path).display()
            );
        }
    }
    if path.is_file() && is_checkpoint_file(path) {
        return load_checkpoint(path);
    }
    load_pretrained(src)
}

/// [`load_model`], then with `adapter` (a PEFT LoRA adapter directory) merged into
/// its weights: adapters trained elsewhere evaluate, sample and export here.
pub fn load_model_with_adapter(src: &str, adapter: Option<&Path>) -> Result<LoadedModel> {
    let mut loaded = load_model(src)?;
    if let Some(dir) = adapter {
        let peft = crate::hf::adapter::read_adapter(dir, &loaded.config)?;
        for note in &peft.notes {
            crate::errln!("note: {note}");
        }
        let base = ParamLayout::new(&loaded.config);
        crate::hf::adapter::check_base(&peft, dir, src, &loaded.params, &base)?;
        let (layout, weights) = (&peft.layout, &peft.weights);
        lora::merge_into(&mut loaded.params, &base, layout, weights, &peft.config);
    }
    Ok(loaded)
}

/// A LoRA run's adapters, unmerged: the run's settings and base, the architecture,
/// and the adapter arena with its weights. `src` is a run's `out_dir` or a
/// checkpoint file; a full-model checkpoint is refused.
pub fn load_adapters(src: &str) -> Result<(LoraState, ModelConfig, LoraLayout, Vec<f32>)> {
    let path = Path::new(src);
    let file = match path.is_dir() {
        true => run_checkpoint(path)?,
        false => Some(path.to_path_buf()).filter(|p| is_checkpoint_file(p)),
    };
    let Some(file) = file else {
        bail!("{src} is neither a training run's out_dir nor a nanogpt checkpoint file");
    };
    let ckpt = Checkpoint::open_file(&file)?;
    let Some(state) = ckpt.state.lora.clone() else {
        bail!(
            "{} holds a whole model, not LoRA adapters (its run had lora_rank = 0); export it \
             without --adapter-only",
            file.display()
        );
    };
    let config = ckpt.state.model.clone();
    let layout = LoraLayout::new(&config, &state.config);
    let mut weights = vec![0.0; layout.params.len];
    ckpt.load_params(&layout.params, &mut weights)?;
    Ok((state, config, layout, weights))
}

/// The checkpoint of a run directory to evaluate or sample: the best-val one when
/// present (as nanoGPT's `ckpt.pt`), else the newest interval checkpoint.
fn run_checkpoint(dir: &Path) -> Result<Option<PathBuf>> {
    let best = checkpoint_path(dir);
    if best.exists() {
        return Ok(Some(best));
    }
    Ok(interval_checkpoints(dir)?.pop().map(|(_, p)| p))
}

fn load_checkpoint(file: &Path) -> Result<LoadedModel> {
    let ckpt = Checkpoint::open_file(file)?;
    let config = ckpt.state.model.clone();
    let layout = ParamLayout::new(&config);
    let params = match &ckpt.state.lora {
        None => {
            let mut params = vec![0.0; layout.len];
            ckpt.load_params(&layout, &mut params)?;
            params
        }
        Some(state) => merged_adapters(&ckpt, state, &config)?,
    };
    let meta: Meta = serde_json::from_value(ckpt.state.tokenizer.clone()).with_context(|| {
        format!(
            "the checkpoint {} has no valid tokenizer description",
            file.display()
        )
    })?;
    let dir = file.parent().unwrap_or(Path::new("."));
    let tokenizer = Tokenizer::from_meta(&meta, dir)
        .with_context(|| format!("cannot load the tokenizer of {}", file.display()))?;
    Ok(LoadedModel {
        config: ModelConfig {
            dropout: 0.0,
            ..config
        },
        params,
        meta,
        tokenizer,
    })
}

/// A LoRA checkpoint's model: its base (checked against the fingerprint the run
/// recorded) with its adapters merged in.
fn merged_adapters(ckpt: &Checkpoint, state: &LoraState, config: &ModelConfig) -> Result<Vec<f32>> {
    let mut params = load_lora_base(state, config)?;
    check_lora_base(state, &params, &ckpt.path().display().to_string())?;
    let adapters = LoraLayout::new(config, &state.config);
    let mut weights = vec![0.0; adapters.params.len];
    ckpt.load_params(&adapters.params, &mut weights)?;
    let base = ParamLayout::new(config);
    lora::merge_into(&mut params, &base, &adapters, &weights, &state.config);
    Ok(params)
}

/// The base weights a LoRA run adapts, laid out for `config`: the pretrained model
/// `state.base`, or GPT-2's initialisation from `state.base_seed` (`scratch`).
pub fn load_lora_base(state: &LoraState, config: &ModelConfig) -> Result<Vec<f32>> {
    let layout = ParamLayout::new(config);
    let mut params = vec![0.0; layout.len];
    if state.base == "scratch" {
        crate::model::init::init_gpt2(&mut params, &layout, config, state.base_seed);
        return Ok(params);
    }
    let pretrained = Pretrained::open(&state.base).with_context(|| {
        format!(
            "cannot load the LoRA base model {}; the adapters need the base they were trained on",
            state.base
        )
    })?;
    let found = pretrained.model_config(Some(config.block_size), 0.0)?;
    let shape = |c: &ModelConfig| {
        format!(
            "n_layer {}, n_head {}, n_embd {}, vocabulary {}, biases {}",
            c.n_layer, c.n_head, c.n_embd, c.vocab_size, c.bias
        )
    };
    if shape(&found) != shape(config) {
        bail!(
            "the LoRA base {} now holds another model ({}) than the one the adapters were \
             trained on ({}); restore the base they were trained on",
            state.base,
            shape(&found),
            shape(config)
        );
    }
    pretrained.load_params(&layout, config, &mut params)?;
    Ok(params)
}

/// Refuses a base whose weights are not those the adapters of `what` were trained on.
pub fn check_lora_base(state: &LoraState, params: &[f32], what: &str) -> Result<()> {
    let found = lora::fingerprint(params);
    if found != state.base_fingerprint {
        bail!(
            "{what} holds LoRA adapters trained on base {} with fingerprint {}, but that base now \
             has fingerprint {found}; restore the base weights the adapters were trained on",
            state.base,
            state.base_fingerprint
        );
    }
    Ok(())
}

/// Pretrained weights, with the whole position table (a Llama's up to
/// [`crate::hf::llama::DEFAULT_BLOCK`]), and their tokenizer: a GGUF file's own
/// (GPT-2's BPE for a `gpt2` file), else a folder's ([`pretrained_tokenizer`]).
fn load_pretrained(src: &str) -> Result<LoadedModel> {
    let pretrained = Pretrained::open(src)?;
    let gguf_tokenizer = pretrained.gguf().map(|g| g.tokenizer()).transpose()?;
    let (config, params) = pretrained.load(None, 0.0)?;
    let (meta, tokenizer) = match gguf_tokenizer {
        Some(t) if t.kind() == TokenizerKind::Gpt2 => (gpt2_meta(&pretrained.location), t),
        Some(t) => (t.meta(pretrained.location.display().to_string()), t),
        None => pretrained_tokenizer(&pretrained.location, &config)?,
    };
    Ok(LoadedModel {
        config,
        params,
        meta,
        tokenizer,
    })
}

/// The tokenizer of a model folder (or of the folder holding a lone weights file):
/// its own `tokenizer.json` (with `tokenizer_config.json`, the chat template and
/// `generation_config.json` beside it), except for a GPT-2 of GPT-2's vocabulary,
/// which keeps GPT-2's BPE (the same ids). A folder without one gets GPT-2's BPE as
/// before: its token files still evaluate, and `sample` and `chat` check the ids
/// they encode against the vocabulary.
fn pretrained_tokenizer(location: &Path, config: &ModelConfig) -> Result<(Meta, Tokenizer)> {
    let dir = match location.is_dir() {
        true => location,
        false => location.parent().unwrap_or(Path::new(".")),
    };
    let json = dir.join(TOKENIZER_JSON);
    let gpt2 = config.llama.is_none() && config.vocab_size == GPT2_VOCAB_SIZE;
    if gpt2 || !json.is_file() {
        return Ok((gpt2_meta(location), Tokenizer::gpt2()));
    }
    let tokenizer = Tokenizer::from_files(TokenizerFiles::read(dir)?)?;
    if tokenizer.vocab_size() > config.vocab_size {
        bail!(
            "{} has {} ids, more than the model's vocabulary of {} (config.json vocab_size): \
             the tokenizer belongs to another model",
            json.display(),
            tokenizer.vocab_size(),
            config.vocab_size
        );
    }
    Ok((tokenizer.meta(location.display().to_string()), tokenizer))
}

/// The tokenizer description of a pretrained GPT-2 (no token counts: no dataset).
pub fn gpt2_meta(location: &Path) -> Meta {
    Meta {
        tokenizer: TokenizerKind::Gpt2,
        vocab_size: GPT2_VOCAB_SIZE,
        dtype: TokenDtype::Uint16,
        train_tokens: 0,
        val_tokens: 0,
        chars: None,
        tokenizer_sha256: None,
        source: location.display().to_string(),
    }
}

fn looks_like_hf_dir(dir: &Path) -> bool {
    [
        "config.json",
        "model.safetensors",
        "model.safetensors.index.json",
        "pytorch_model.bin",
    ]
    .iter()
    .any(|f| dir.join(f).exists())
}

/// A nanogpt `ckpt.safetensors` (by its metadata tag), rather than HF weights.
fn is_checkpoint_file(path: &Path) -> bool {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    is_checkpoint_name(name) && Checkpoint::open_file(path).is_ok()
}
