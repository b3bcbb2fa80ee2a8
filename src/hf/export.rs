//! The engine's parameters out to a Hugging Face model directory: `config.json`,
//! `model.safetensors` (HF key names, the real vocabulary only), and
//! `generation_config.json`; `AutoModelForCausalLM.from_pretrained` opens it and
//! computes the same logits.
//!
//! GPT-2: Conv1D `[in, out]` weights, no `lm_head` (it is tied), GPT-2's config, and
//! for GPT-2-tokenized models the tokenizer files. The Llama families: the arena's
//! tensors under their own names (`nn.Linear` order, an untied `lm_head` included),
//! and the source's `config.json` written back (the same spelling of RoPE, token ids
//! and everything else), or for a model made here one in transformers 5's spelling.
//! A model with its own tokenizer (any family) gets its tokenizer files copied:
//! `tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja` and the source's
//! `generation_config.json` (its list of end-of-turn ids), so that `AutoTokenizer`
//! and `apply_chat_template` work on the folder unchanged.
//!
//! The files are written into a temporary folder `.DIR.tmp-PID` beside `DIR` and
//! moved into place at once ([`Staged`]): a new `DIR` appears whole, a previous
//! export is replaced whole. An export stopped on the way (SIGTERM, SIGKILL) leaves
//! only its temporary folder, which the next export recognises as ours (its process
//! has ended) and removes. A folder that already holds files is refused unless it
//! is a previous export (whose files are replaced, others kept).

use super::tokenizer_files;
use super::weights::transpose;
use crate::data::tokenizer::files::{TokenizerFiles, GENERATION_CONFIG};
use crate::data::{Tokenizer, TokenizerKind, GPT2_EOT, GPT2_VOCAB_SIZE};
use crate::fsutil::{check_destination, write_atomic, write_bytes_atomic, OutputKind, Staged};
use crate::model::{ModelConfig, ParamLayout};
use anyhow::{Context, Result};
use safetensors::tensor::{Dtype, View};
use safetensors::SafeTensors;
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The files an export writes (besides the tokenizer's).
pub const MODEL_FILES: [&str; 3] = ["config.json", "model.safetensors", "generation_config.json"];

/// An export's folder: [`MODEL_FILES`] and GPT-2's or the model's own tokenizer
/// files, `config.json` (what marks a model folder for Hugging Face) last.
pub const EXPORT: OutputKind = OutputKind {
    what: "export",
    files: &[
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "vocab.json",
        "merges.txt",
        "tokenizer_config.json",
        "tokenizer.json",
        "chat_template.jinja",
    ],
    last: "config.json",
};
/// Marks our `model.safetensors` (metadata key `producer`).
const PRODUCER: &str = "nanogpt";

/// What was written.
#[derive(Clone, Debug)]
pub struct ExportSummary {
    pub dir: PathBuf,
    pub files: Vec<String>,
    /// Parameters written (real vocabulary, tied classifier counted once).
    pub parameters: usize,
}

/// One output tensor, produced when the writer asks for it.
struct Out<'a> {
    shape: Vec<usize>,
    data: Source<'a>,
}

enum Source<'a> {
    Slice(&'a [f32]),
    /// `[rows, cols]` in the arena, written as `[cols, rows]`.
    Transposed {
        src: &'a [f32],
        rows: usize,
        cols: usize,
    },
    Zeros,
}

impl View for Out<'_> {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        let owned = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
        match &self.data {
            Source::Slice(s) if cfg!(target_endian = "little") => {
                Cow::Borrowed(bytemuck::cast_slice(s))
            }
            Source::Slice(s) => Cow::Owned(owned(s)),
            Source::Transposed { src, rows, cols } => {
                let mut t = vec![0.0f32; rows * cols];
                transpose(src, *rows, *cols, &mut t);
                Cow::Owned(owned(&t))
            }
            Source::Zeros => Cow::Owned(vec![0u8; self.data_len()]),
        }
    }

    fn data_len(&self) -> usize {
        self.shape.iter().product::<usize>() * 4
    }
}

/// Writes the model (`params` laid out for `cfg`) to the Hugging Face directory
/// `dir`. `tokenizer` (the one the model was trained with) decides the token ids in
/// GPT-2's configs and which tokenizer files are written: GPT-2's, the model's own,
/// or none (a char vocabulary has no Hugging Face form).
pub fn export(
    params: &[f32],
    cfg: &ModelConfig,
    tokenizer: Option<&Tokenizer>,
    dir: &Path,
) -> Result<ExportSummary> {
    let layout = ParamLayout::of_params(cfg, params)?;
    let gpt2_tokens = tokenizer.map(Tokenizer::kind) == Some(TokenizerKind::Gpt2)
        && cfg.vocab_size >= GPT2_VOCAB_SIZE
        && cfg.llama.is_none();
    let own = tokenizer.and_then(Tokenizer::hf).map(|t| t.files());
    let mut names: Vec<&str> = MODEL_FILES.to_vec();
    if gpt2_tokens {
        names.extend(tokenizer_files::FILE_NAMES);
    }
    if let Some(files) = own {
        let copied = files.entries().into_iter().map(|(name, _)| name);
        names.extend(copied.filter(|name| *name != GENERATION_CONFIG));
    }
    check_destination(dir, &EXPORT, "--to", is_previous_export)?;
    let staged = Staged::begin(dir, &EXPORT)?;
    write_files(params, &layout, cfg, gpt2_tokens, staged.dir())?;
    if let Some(files) = own {
        write_tokenizer_files(files, staged.dir())?;
    }
    crate::fault::during_export();
    staged.commit()?;
    Ok(ExportSummary {
        dir: dir.to_path_buf(),
        files: names.iter().map(|s| s.to_string()).collect(),
        parameters: cfg.num_params(),
    })
}

/// Every file of the export into `dir` (the temporary folder).
fn write_files(
    params: &[f32],
    layout: &ParamLayout,
    cfg: &ModelConfig,
    gpt2_tokens: bool,
    dir: &Path,
) -> Result<()> {
    let tensors = match &cfg.llama {
        None => hf_tensors(params, layout, cfg),
        Some(_) => llama_tensors(params, layout, cfg),
    };
    let metadata = producer_metadata();
    write_atomic(&dir.join("model.safetensors"), |tmp| {
        crate::tensor_file::write(tensors, &metadata, tmp)
            .with_context(|| format!("cannot write {}", tmp.display()))
    })?;
    if let Some(l) = &cfg.llama {
        let config = super::llama::config_json(cfg, l);
        let tokens = |key: &str| config.get(key).cloned().unwrap_or(serde_json::Value::Null);
        let generation = serde_json::json!({
            "bos_token_id": tokens("bos_token_id"),
            "eos_token_id": tokens("eos_token_id"),
        });
        let text = |v: &serde_json::Value| {
            serde_json::to_string_pretty(v).expect("JSON values serialise") + "\n"
        };
        write_bytes_atomic(&dir.join("generation_config.json"), text(&generation))?;
        return write_bytes_atomic(&dir.join("config.json"), text(&config));
    }
    let eot = gpt2_tokens.then_some(GPT2_EOT);
    write_bytes_atomic(&dir.join("generation_config.json"), generation_config(eot))?;
    if gpt2_tokens {
        for (name, text) in tokenizer_files::gpt2_tokenizer_files(cfg.block_size)? {
            write_bytes_atomic(&dir.join(name), &text)?;
        }
    }
    write_bytes_atomic(&dir.join("config.json"), config_json(cfg, eot))
}

/// The model's own tokenizer files into `dir` (the temporary folder), the source's
/// `generation_config.json` in place of the one [`write_files`] made from the config
/// (it lists every end-of-turn id and the model's sampling defaults).
fn write_tokenizer_files(files: &TokenizerFiles, dir: &Path) -> Result<()> {
    for (name, bytes) in files.entries() {
        write_bytes_atomic(&dir.join(name), bytes)?;
    }
    Ok(())
}

/// A Llama-architecture model's tensors: each under its own name, in the arena's
/// (`nn.Linear`) order, the vocabulary tables cut to the real vocabulary.
fn llama_tensors<'a>(
    params: &'a [f32],
    layout: &ParamLayout,
    cfg: &ModelConfig,
) -> Vec<(String, Out<'a>)> {
    let (v, c) = (cfg.vocab_size, cfg.n_embd);
    let vocab = [layout.wte, layout.lm_head];
    let tensors = layout.tensors.iter().map(|t| {
        let is_vocab = vocab.iter().any(|s| !s.is_empty() && s.start == t.offset);
        let (range, shape) = match is_vocab {
            true => (t.offset..t.offset + v * c, vec![v, c]),
            false => (t.range(), t.shape.clone()),
        };
        (t.name.clone(), slice(&params[range], shape))
    });
    tensors.collect()
}

/// The tensors in Hugging Face's names and layout.
fn hf_tensors<'a>(
    params: &'a [f32],
    layout: &ParamLayout,
    cfg: &ModelConfig,
) -> Vec<(String, Out<'a>)> {
    let (v, c) = (cfg.vocab_size, cfg.n_embd);
    let mut out = Vec::new();
    let wte = &params[layout.wte.start..layout.wte.start + v * c];
    out.push(("transformer.wte.weight".to_string(), slice(wte, vec![v, c])));
    for t in &layout.tensors {
        if t.name == "transformer.wte.weight" {
            continue;
        }
        let src = &params[t.range()];
        let conv1d = t.shape.len() == 2 && t.name.contains(".h.");
        let tensor = if conv1d {
            let (rows, cols) = (t.shape[0], t.shape[1]);
            Out {
                shape: vec![cols, rows],
                data: Source::Transposed { src, rows, cols },
            }
        } else {
            slice(src, t.shape.clone())
        };
        out.push((t.name.clone(), tensor));
    }
    if !cfg.bias {
        // Trained without biases: zeros are exactly equivalent.
        let mut zeros = vec![("transformer.ln_f.bias".to_string(), c)];
        for i in 0..cfg.n_layer {
            for (name, n) in [
                ("ln_1.bias", c),
                ("attn.c_attn.bias", 3 * c),
                ("attn.c_proj.bias", c),
                ("ln_2.bias", c),
                ("mlp.c_fc.bias", 4 * c),
                ("mlp.c_proj.bias", c),
            ] {
                zeros.push((format!("transformer.h.{i}.{name}"), n));
            }
        }
        for (name, n) in zeros {
            out.push((
                name,
                Out {
                    shape: vec![n],
                    data: Source::Zeros,
                },
            ));
        }
    }
    out
}

fn slice(s: &[f32], shape: Vec<usize>) -> Out<'_> {
    Out {
        shape,
        data: Source::Slice(s),
    }
}

fn config_json(cfg: &ModelConfig, eot: Option<u32>) -> String {
    let json = serde_json::json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.block_size,
        "n_ctx": cfg.block_size,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": null,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": crate::model::config::LAYER_NORM_EPS as f64,
        "initializer_range": 0.02,
        // Dropout is a training setting, not part of the weights: GPT-2's defaults.
        "resid_pdrop": 0.1,
        "embd_pdrop": 0.1,
        "attn_pdrop": 0.1,
        "scale_attn_weights": true,
        "scale_attn_by_inverse_layer_idx": false,
        "reorder_and_upcast_attn": false,
        "tie_word_embeddings": true,
        "use_cache": true,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "torch_dtype": "float32",
    });
    serde_json::to_string_pretty(&json).expect("JSON values serialise") + "\n"
}

fn generation_config(eot: Option<u32>) -> String {
    let json = match eot {
        Some(id) => serde_json::json!({"bos_token_id": id, "eos_token_id": id}),
        None => serde_json::json!({}),
    };
    serde_json::to_string_pretty(&json).expect("JSON values serialise") + "\n"
}

/// `dir/model.safetensors` carries our producer mark.
fn is_previous_export(dir: &Path) -> bool {
    has_producer_mark(&dir.join("model.safetensors"))
}

/// Whether the safetensors file `path` carries our producer mark (metadata key
/// `producer`), as exports and adapter exports write it.
pub fn has_producer_mark(path: &Path) -> bool {
    let Ok(file) = crate::fsutil::open_regular(path, "safetensors file") else {
        return false;
    };
    // SAFETY: read-only private map, dropped before the file is replaced (by rename).
    let Ok(map) = (unsafe { memmap2::Mmap::map(&file) }) else {
        return false;
    };
    SafeTensors::read_metadata(&map)
        .ok()
        .and_then(|(_, m)| m.metadata().clone())
        .and_then(|m| m.get("producer").cloned())
        .is_some_and(|p| p.starts_with(PRODUCER))
}

/// The metadata of the safetensors files nanogpt writes for others: the format
/// PyTorch readers expect, and our producer mark.
pub fn producer_metadata() -> BTreeMap<String, String> {
    BTreeMap::from([
        ("format".to_string(), "pt".to_string()),
        (
            "producer".to_string(),
            format!("{PRODUCER} {}", env!("CARGO_PKG_VERSION")),
        ),
    ])
}
