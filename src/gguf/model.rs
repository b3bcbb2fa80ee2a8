//! nanogpt's GPT-2 as llama.cpp holds it in a GGUF file: tensor names and layouts,
//! the architecture's metadata, and the tokenizer; written from a parameter arena
//! (export) and read into one (import).
//!
//! llama.cpp's `gpt2` (the names of its gguf-py `constants.py`, the layouts of its
//! `convert_hf_to_gguf.py`):
//!
//! | nanogpt (Hugging Face name) | GGUF | GGUF dims (row length first) |
//! |---|---|---|
//! | `transformer.wte.weight` | `token_embd.weight` | `[C, V]` |
//! | `transformer.wpe.weight` | `position_embd.weight` | `[C, T]` |
//! | `transformer.h.N.ln_1.{weight,bias}` | `blk.N.attn_norm.*` | `[C]` |
//! | `transformer.h.N.attn.c_attn.*` | `blk.N.attn_qkv.*` | `[C, 3C]`, `[3C]` |
//! | `transformer.h.N.attn.c_proj.*` | `blk.N.attn_output.*` | `[C, C]`, `[C]` |
//! | `transformer.h.N.ln_2.*` | `blk.N.ffn_norm.*` | `[C]` |
//! | `transformer.h.N.mlp.c_fc.*` | `blk.N.ffn_up.*` | `[C, 4C]`, `[4C]` |
//! | `transformer.h.N.mlp.c_proj.*` | `blk.N.ffn_down.*` | `[4C, C]`, `[C]` |
//! | `transformer.ln_f.*` | `output_norm.*` | `[C]` |
//!
//! Linear weights are `[out, in]` in PyTorch's order on both sides (the converter
//! transposes Hugging Face's Conv1D weights; nanogpt's arena already holds them so),
//! so tensors stream from the arena unchanged. The classifier is tied to
//! `token_embd.weight`: no `output.weight` is written (llama.cpp and transformers
//! then tie it too). The real vocabulary's rows are written, not the arena's padding.

use super::llama;
use super::quants;
use super::read::GgufFile;
use super::types::{GgmlType, Value};
use super::vocab::{self, Recognised};
use super::write::{GgufWriter, TensorSpec};
use crate::data::{Tokenizer, TokenizerKind, GPT2_VOCAB_SIZE};
use crate::model::config::LAYER_NORM_EPS;
use crate::model::family::LlamaConfig;
use crate::model::{ModelConfig, ParamLayout};
use anyhow::{bail, Context, Result};
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

/// The architecture name of GPT-2 in GGUF files.
pub const GPT2: &str = "gpt2";
/// Marks the files nanogpt writes (a later export may replace them).
pub const PRODUCER_KEY: &str = "nanogpt.producer";

/// llama.cpp's name of the arena tensor `name` (a Hugging Face GPT-2 name).
pub fn gguf_name(name: &str) -> Option<String> {
    let name = name.strip_prefix("transformer.")?;
    let (module, kind) = name.rsplit_once('.')?;
    let gguf = match module {
        "wte" => "token_embd".to_string(),
        "wpe" => "position_embd".to_string(),
        "ln_f" => "output_norm".to_string(),
        _ => {
            let (layer, part) = module.strip_prefix("h.")?.split_once('.')?;
            let part = match part {
                "ln_1" => "attn_norm",
                "attn.c_attn" => "attn_qkv",
                "attn.c_proj" => "attn_output",
                "ln_2" => "ffn_norm",
                "mlp.c_fc" => "ffn_up",
                "mlp.c_proj" => "ffn_down",
                _ => return None,
            };
            format!("blk.{}.{part}", layer.parse::<usize>().ok()?)
        }
    };
    Some(format!("{gguf}.{kind}"))
}

/// How the weights are stored (`--outtype`, as llama.cpp's converter names them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutType {
    F32,
    F16,
    Bf16,
    Q8_0,
}

impl OutType {
    pub const NAMES: [&'static str; 4] = ["f32", "f16", "bf16", "q8_0"];

    /// The type of the 2-D weights.
    pub fn weight_type(self) -> GgmlType {
        match self {
            OutType::F32 => GgmlType::F32,
            OutType::F16 => GgmlType::F16,
            OutType::Bf16 => GgmlType::BF16,
            OutType::Q8_0 => GgmlType::Q8_0,
        }
    }

    /// `general.file_type` (llama.cpp's `llama_ftype`).
    pub fn file_type(self) -> u32 {
        match self {
            OutType::F32 => 0,
            OutType::F16 => 1,
            OutType::Q8_0 => 7,
            OutType::Bf16 => 32,
        }
    }
}

impl FromStr for OutType {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<OutType> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "f32" => OutType::F32,
            "f16" => OutType::F16,
            "bf16" => OutType::Bf16,
            "q8_0" => OutType::Q8_0,
            other => bail!(
                "unknown --outtype `{other}`: use one of {}",
                OutType::NAMES.join(", ")
            ),
        })
    }
}

impl fmt::Display for OutType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let i = [OutType::F32, OutType::F16, OutType::Bf16, OutType::Q8_0]
            .iter()
            .position(|t| t == self)
            .unwrap_or(0);
        f.write_str(OutType::NAMES[i])
    }
}

/// The type tensor `name` of PyTorch shape `shape` is stored as: 1-D tensors, norms
/// and the position table in F32, as llama.cpp's converter keeps them; other
/// weights in `outtype`, or F16 where a row is not a whole number of Q8_0 blocks
/// (the converter's fallback).
pub fn storage_type(name: &str, shape: &[usize], outtype: OutType) -> GgmlType {
    if shape.len() < 2 || name.ends_with("_norm.weight") || name.starts_with("position_embd.") {
        return GgmlType::F32;
    }
    let ty = outtype.weight_type();
    let (block, _) = ty.block();
    match shape[shape.len() - 1].is_multiple_of(block) {
        true => ty,
        false => GgmlType::F16,
    }
}

/// What an export is asked to write besides the weights.
pub struct ExportOptions<'a> {
    pub outtype: OutType,
    /// `general.name`.
    pub name: &'a str,
    /// The tokenizer the model's ids belong to.
    pub tokenizer: &'a Tokenizer,
    /// A Jinja chat template (`tokenizer.chat_template`), where the model has one
    /// (for a model's own tokenizer: where its files have none).
    pub chat_template: Option<&'a str>,
}

/// What was written.
#[derive(Clone, Debug)]
pub struct Exported {
    pub path: PathBuf,
    pub bytes: u64,
    pub tensors: usize,
    /// Parameters written (real vocabulary, tied classifier counted once).
    pub parameters: usize,
}

/// Writes the model `params` (laid out for `cfg`: GPT-2 or a Llama family) to the
/// GGUF file `dest`, atomically; a file there that nanogpt did not write is refused.
pub fn export(
    params: &[f32],
    cfg: &ModelConfig,
    opts: &ExportOptions,
    dest: &Path,
) -> Result<Exported> {
    let layout = ParamLayout::of_params(cfg, params)?;
    check_destination(dest)?;
    let (metadata, tensors) = match &cfg.llama {
        None => (metadata(cfg, opts)?, tensors(params, &layout, cfg)),
        Some(l) => (
            llama_metadata(cfg, l, opts)?,
            llama_tensors(params, &layout, cfg, l),
        ),
    };
    let specs: Vec<TensorSpec> = tensors
        .iter()
        .map(|(name, shape, _)| {
            TensorSpec::new(name, shape, storage_type(name, shape, opts.outtype))
        })
        .collect();
    for (spec, (_, _, data)) in specs.iter().zip(&tensors) {
        check_values(spec, data)?;
    }
    let mut w = GgufWriter::create(dest, &metadata, specs)?;
    let zeros = vec![0.0f32; 4 * cfg.n_embd];
    for (_, shape, data) in &tensors {
        match data {
            Data::Slice(s) => w.write_f32(s)?,
            Data::Zeros(n) => w.write_f32(&zeros[..*n])?,
            Data::Owned(v) => w.write_f32(v)?,
            Data::Interleave(s, heads) => {
                let cols = shape.get(1).copied().unwrap_or(1);
                w.write_f32(&llama::to_interleaved(s, *heads, cols))?
            }
        }
    }
    crate::fault::during_export();
    w.finish()?;
    let bytes = std::fs::metadata(dest).map(|m| m.len()).unwrap_or(0);
    Ok(Exported {
        path: dest.to_path_buf(),
        bytes,
        tensors: tensors.len(),
        parameters: cfg.num_params(),
    })
}

/// A tensor's values: a slice of the arena, zeros (the biases of a model trained
/// without them, which llama.cpp's GPT-2 requires), values made for the file, or a
/// slice whose rows llama.cpp holds in another order (q and k of `llama`: the heads).
enum Data<'a> {
    Slice(&'a [f32]),
    Zeros(usize),
    Owned(Vec<f32>),
    Interleave(&'a [f32], usize),
}

impl Data<'_> {
    fn values(&self) -> &[f32] {
        match self {
            Data::Slice(s) | Data::Interleave(s, _) => s,
            Data::Zeros(_) => &[],
            Data::Owned(v) => v,
        }
    }
}

/// Every tensor of the file in order: (GGUF name, PyTorch shape, data).
fn tensors<'a>(
    params: &'a [f32],
    layout: &ParamLayout,
    cfg: &ModelConfig,
) -> Vec<(String, Vec<usize>, Data<'a>)> {
    let (v, c) = (cfg.vocab_size, cfg.n_embd);
    let mut out = Vec::new();
    for t in &layout.tensors {
        let name = gguf_name(&t.name).expect("every GPT-2 tensor has a GGUF name");
        let (shape, data) = match t.name == "transformer.wte.weight" {
            true => (vec![v, c], &params[t.offset..t.offset + v * c]),
            false => (t.shape.clone(), &params[t.range()]),
        };
        out.push((name, shape, Data::Slice(data)));
        let bias_follows = t.name.ends_with(".weight") && !cfg.bias && t.name.contains(".h.")
            || (t.name == "transformer.ln_f.weight" && !cfg.bias);
        if bias_follows {
            let n = t.shape[0];
            let bias = gguf_name(&t.name.replace(".weight", ".bias")).expect("a bias name");
            out.push((bias, vec![n], Data::Zeros(n)));
        }
    }
    out
}

/// A Llama family's tensors in order (see [`llama`]): Llama 3's RoPE divisors
/// first, then the arena's, the vocabulary's real rows only, q and k reordered for
/// llama.cpp's `llama`.
fn llama_tensors<'a>(
    params: &'a [f32],
    layout: &ParamLayout,
    cfg: &ModelConfig,
    l: &LlamaConfig,
) -> Vec<(String, Vec<usize>, Data<'a>)> {
    let (v, c) = (cfg.vocab_size, cfg.n_embd);
    let mut out = Vec::new();
    if let Some(divisors) = llama::rope_divisors(&l.rope, l.head_dim) {
        out.push((
            llama::ROPE_FREQS.to_string(),
            vec![divisors.len()],
            Data::Owned(divisors),
        ));
    }
    for t in &layout.tensors {
        let name = llama::gguf_name(&t.name).expect("every Llama tensor has a GGUF name");
        let vocab_rows = t.name == "model.embed_tokens.weight" || t.name == "lm_head.weight";
        let (shape, data) = match vocab_rows {
            true => (vec![v, c], &params[t.offset..t.offset + v * c]),
            false => (t.shape.clone(), &params[t.range()]),
        };
        let data = match llama::reordered_heads(&t.name, cfg, l) {
            Some(heads) => Data::Interleave(data, heads),
            None => Data::Slice(data),
        };
        out.push((name, shape, data));
    }
    out
}

/// Refuses values the storage type would silently turn into other numbers: NaN or
/// infinity anywhere, magnitudes beyond f16's range in F16 or Q8_0 (whose scales
/// are f16).
fn check_values(spec: &TensorSpec, data: &Data) -> Result<()> {
    let values = data.values();
    if values.iter().any(|x| !x.is_finite()) {
        bail!(
            "tensor {} holds NaN or infinite values; the model is broken: export an earlier \
             checkpoint",
            spec.name
        );
    }
    let max = values.iter().fold(0f32, |m, x| m.max(x.abs()));
    let limit = match spec.ty {
        GgmlType::F16 => 65504.0,
        GgmlType::Q8_0 => 65504.0 * 127.0,
        _ => f32::INFINITY,
    };
    if max > limit {
        bail!(
            "tensor {} has values up to {max:e}, beyond what {} stores (f16 scales); export with \
             --outtype bf16 or f32",
            spec.name,
            spec.ty
        );
    }
    Ok(())
}

/// The general keys, in the order [`written_by_nanogpt`] recognises.
fn general(arch: &str, opts: &ExportOptions) -> Vec<(String, Value)> {
    let s = |v: &str| Value::String(v.into());
    vec![
        ("general.architecture".into(), s(arch)),
        ("general.type".into(), s("model")),
        ("general.name".into(), s(opts.name)),
        (
            "general.file_type".into(),
            Value::U32(opts.outtype.file_type()),
        ),
        ("general.quantization_version".into(), Value::U32(2)),
        (
            PRODUCER_KEY.into(),
            s(&format!("nanogpt {}", env!("CARGO_PKG_VERSION"))),
        ),
    ]
}

/// A Llama family's metadata: general keys, the architecture's, the tokenizer's
/// (the model's own: a byte-level BPE) and its chat template.
fn llama_metadata(
    cfg: &ModelConfig,
    l: &LlamaConfig,
    opts: &ExportOptions,
) -> Result<Vec<(String, Value)>> {
    let mut m = general(llama::arch_name(l.model_type), opts);
    m.extend(llama::metadata(cfg, l)?);
    let Some(tok) = opts.tokenizer.hf() else {
        bail!(
            "the model's ids are of a {} tokenizer, not of a model's own tokenizer.json, which \
             a GGUF {} model must carry; export it to a Hugging Face folder (--to DIR) instead",
            opts.tokenizer.kind(),
            l.model_type.name()
        );
    };
    m.extend(vocab::hf_metadata(tok, cfg.vocab_size)?);
    let has_template = m.iter().any(|(k, _)| k == vocab::CHAT_TEMPLATE);
    if let (Some(template), false) = (opts.chat_template, has_template) {
        m.push((vocab::CHAT_TEMPLATE.into(), Value::String(template.into())));
    }
    Ok(m)
}

/// The file's metadata: general keys, the architecture's, the tokenizer's.
fn metadata(cfg: &ModelConfig, opts: &ExportOptions) -> Result<Vec<(String, Value)>> {
    let s = |v: &str| Value::String(v.into());
    let n = |v: usize| Value::U32(v as u32);
    let mut m = general(GPT2, opts);
    m.extend([
        ("gpt2.context_length".into(), n(cfg.block_size)),
        ("gpt2.embedding_length".into(), n(cfg.n_embd)),
        ("gpt2.feed_forward_length".into(), n(4 * cfg.n_embd)),
        ("gpt2.block_count".into(), n(cfg.n_layer)),
        ("gpt2.attention.head_count".into(), n(cfg.n_head)),
        (
            "gpt2.attention.layer_norm_epsilon".into(),
            Value::F32(LAYER_NORM_EPS),
        ),
    ]);
    match opts.tokenizer.kind() {
        TokenizerKind::Gpt2 if cfg.vocab_size >= GPT2_VOCAB_SIZE => {
            m.extend(vocab::gpt2_metadata(cfg.vocab_size)?)
        }
        kind => bail!(
            "the model uses a {kind} tokenizer of {} tokens, which llama.cpp has no tokenizer \
             for: a GGUF file must carry its tokenizer; export it to a Hugging Face folder \
             instead (--to DIR), or train on GPT-2 tokens (`nanogpt prepare --tokenizer gpt2`)",
            cfg.vocab_size
        ),
    }
    if let Some(template) = opts.chat_template {
        m.push((vocab::CHAT_TEMPLATE.into(), s(template)));
    }
    Ok(m)
}

/// A new path, or a GGUF file nanogpt wrote (replaced); anything else is refused.
pub(crate) fn check_destination(dest: &Path) -> Result<()> {
    if dest.is_dir() {
        bail!(
            "{} is a folder; give the path of the .gguf file to write",
            dest.display()
        );
    }
    if dest.is_symlink() && !dest.exists() {
        bail!(
            "{} is a symbolic link to nothing; remove the link or choose another --to",
            dest.display()
        );
    }
    if !dest.exists() {
        return Ok(());
    }
    if !GgufFile::open(dest).is_ok_and(|f| written_by_nanogpt(&f)) {
        bail!(
            "{} already exists and is not a GGUF file that nanogpt wrote; choose another --to \
             (nothing was written)",
            dest.display()
        );
    }
    Ok(())
}

/// Whether `file` is as nanogpt writes a file: [`PRODUCER_KEY`] right after
/// `general.file_type` and `general.quantization_version` (the fourth to sixth keys,
/// as [`metadata`] and the adapter writer put them), and tensors of the types
/// nanogpt writes. The mark alone is not enough: `llama-quantize` copies every key of
/// its input, ours included, into the user's new file, and re-sets those two keys at
/// the end.
fn written_by_nanogpt(file: &GgufFile) -> bool {
    let keys: Vec<&str> = file
        .header
        .metadata
        .iter()
        .map(|(k, _)| k.as_str())
        .collect();
    keys.get(3..6)
        == Some(&[
            "general.file_type",
            "general.quantization_version",
            PRODUCER_KEY,
        ])
        && file
            .header
            .tensors
            .iter()
            .all(|t| t.ty.is_some_and(quants::can_quantize))
}

/// A GPT-2 in a GGUF file, checked to be one nanogpt represents, for loading.
pub struct GgufModel {
    pub file: GgufFile,
    /// The architecture, with the whole position table (`block_size` is
    /// `gpt2.context_length`).
    pub config: ModelConfig,
}

impl GgufModel {
    /// Opens `path` and checks its architecture, shape and tensors (names, shapes,
    /// types nanogpt reads), naming the file and what it cannot load.
    pub fn open(path: &Path) -> Result<GgufModel> {
        let file = GgufFile::open(path)?;
        let p = path.display();
        let arch = file
            .get("general.architecture")
            .and_then(Value::as_str)
            .with_context(|| format!("{p} has no general.architecture: it is not a model file"))?;
        if file.get("general.type").and_then(Value::as_str) == Some("adapter") {
            bail!("{p} is a LoRA adapter, not a model; load its base model instead");
        }
        if let Some(t) = llama::parse_arch(arch) {
            let config = llama::read_config(&file, arch, t)?;
            let model = GgufModel { file, config };
            model.check_tensors()?;
            return Ok(model);
        }
        if arch != GPT2 {
            bail!(
                "{p}: general.architecture is `{arch}`; nanogpt loads GGUF models of \
                 architecture gpt2, llama, qwen2 and qwen3"
            );
        }
        let count = |key: &str| -> Result<usize> {
            let full = format!("{GPT2}.{key}");
            let v = file
                .get(&full)
                .with_context(|| format!("{p} has no {full}"))?;
            v.as_u64()
                .filter(|&n| n > 0 && n < 1 << 32)
                .map(|n| n as usize)
                .with_context(|| format!("{p}: {full} is {v:?}, not a positive count"))
        };
        let (n_layer, n_head, n_embd) = (
            count("block_count")?,
            count("attention.head_count")?,
            count("embedding_length")?,
        );
        let block_size = count("context_length")?;
        let n_inner = count("feed_forward_length")?;
        if n_inner != 4 * n_embd {
            bail!(
                "{p}: gpt2.feed_forward_length is {n_inner}; nanogpt's GPT-2 MLP is 4 × \
                 embedding_length = {} wide",
                4 * n_embd
            );
        }
        let eps = file
            .get("gpt2.attention.layer_norm_epsilon")
            .and_then(Value::as_f64)
            .unwrap_or(LAYER_NORM_EPS as f64);
        let want = LAYER_NORM_EPS as f64;
        if ((eps - want) / want).abs() > 1e-6 {
            bail!(
                "{p}: gpt2.attention.layer_norm_epsilon is {eps:e}; nanogpt's layer norms use \
                 {want:e}"
            );
        }
        let vocab_size = file.embedding_vocab(n_embd, "gpt2.embedding_length")?;
        let config = ModelConfig::gpt2(vocab_size, block_size, (n_layer, n_head, n_embd), 0.0);
        config.validate().with_context(|| format!("{p}"))?;
        let model = GgufModel { file, config };
        model.check_tensors()?;
        Ok(model)
    }

    /// The file's name of the arena tensor `name`.
    fn file_name(&self, name: &str) -> String {
        match self.config.llama {
            None => gguf_name(name),
            Some(_) => llama::gguf_name(name),
        }
        .expect("every arena tensor has a GGUF name")
    }

    /// The shape the file holds the arena tensor `t` in: the vocabulary's real rows.
    fn file_shape(&self, t: &crate::model::layout::TensorInfo) -> Vec<usize> {
        let cfg = &self.config;
        let names = cfg.family().names();
        match t.name == names.wte || t.name == names.lm_head {
            true => vec![cfg.vocab_size, cfg.n_embd],
            false => t.shape.clone(),
        }
    }

    /// Every tensor the model needs is there with its shape and a readable type; a
    /// Llama file holds nothing else.
    fn check_tensors(&self) -> Result<()> {
        let cfg = &self.config;
        let layout = ParamLayout::new(cfg);
        let p = self.file.path().display();
        let kind = cfg.family().model_type();
        for t in &layout.tensors {
            let name = self.file_name(&t.name);
            let want = self.file_shape(t);
            let Some(info) = self.file.tensor(&name) else {
                bail!(
                    "{p} has no tensor {name}, which a {kind} of {} layers needs",
                    cfg.n_layer
                );
            };
            if info.shape() != want {
                bail!(
                    "{p}: tensor {name} has shape {:?}, but the model's metadata needs {want:?}",
                    info.shape()
                );
            }
            if !info.ty.is_some_and(|t| t.can_dequantize()) {
                // The same message as reading it gives.
                self.file.tensor_f32(info)?;
            }
        }
        if cfg.llama.is_some() {
            let known: std::collections::HashSet<String> = layout
                .tensors
                .iter()
                .map(|t| self.file_name(&t.name))
                .chain([llama::ROPE_FREQS.to_string()])
                .collect();
            if let Some(t) = self
                .file
                .header
                .tensors
                .iter()
                .find(|t| !known.contains(&t.name))
            {
                bail!(
                    "{p} holds tensor {}, which nanogpt's {kind} has no place for; nanogpt \
                     cannot load this model",
                    t.name
                );
            }
        }
        Ok(())
    }

    /// Bytes of tensor data the file holds (for the size check of a config).
    pub fn stored_bytes(&self) -> u64 {
        self.file
            .header
            .tensors
            .iter()
            .filter_map(|t| t.n_bytes())
            .sum()
    }

    /// Fills `params` (laid out by `layout` for `cfg`, whose position table may be
    /// cropped) with the dequantized weights; padded vocabulary rows are zero, and
    /// the q/k rows of a `llama` file go back to transformers' order.
    pub fn load_into(
        &self,
        layout: &ParamLayout,
        cfg: &ModelConfig,
        params: &mut [f32],
    ) -> Result<()> {
        for t in &layout.tensors {
            let name = self.file_name(&t.name);
            let info = self
                .file
                .tensor(&name)
                .with_context(|| format!("{} has no tensor {name}", self.file.path().display()))?;
            let dst = &mut params[t.range()];
            let real = self.file_shape(t).iter().product::<usize>();
            match (t.name.as_str(), &cfg.llama) {
                ("transformer.wpe.weight", _) => {
                    let all = self.file.tensor_f32(info)?;
                    dst.copy_from_slice(&all[..dst.len()]);
                }
                (name, Some(l)) if llama::reordered_heads(name, cfg, l).is_some() => {
                    let heads = llama::reordered_heads(name, cfg, l).unwrap_or(1);
                    let cols = t.shape.get(1).copied().unwrap_or(1);
                    let stored = self.file.tensor_f32(info)?;
                    dst.copy_from_slice(&llama::from_interleaved(&stored, heads, cols));
                }
                _ => {
                    self.file.read_f32(info, &mut dst[..real])?;
                    dst[real..].fill(0.0);
                }
            }
        }
        match cfg.llama {
            None => self.check_output_head(layout, cfg, params),
            Some(_) => Ok(()),
        }
    }

    /// A stored `output.weight` must be (a copy of) the token embedding, which the
    /// engine ties the classifier to: identical, or a copy quantized differently
    /// (older converters wrote one, and llama-quantize gives it its own type),
    /// which is said.
    fn check_output_head(
        &self,
        layout: &ParamLayout,
        cfg: &ModelConfig,
        params: &[f32],
    ) -> Result<()> {
        let Some(info) = self.file.tensor("output.weight") else {
            return Ok(());
        };
        let p = self.file.path().display();
        let real = cfg.vocab_size * cfg.n_embd;
        if info.shape() != [cfg.vocab_size, cfg.n_embd] {
            bail!(
                "{p}: output.weight has shape {:?}, expected [{}, {}]",
                info.shape(),
                cfg.vocab_size,
                cfg.n_embd
            );
        }
        let head = self.file.tensor_f32(info)?;
        let embd = &params[layout.wte.start..layout.wte.start + real];
        let (mut diff, mut norm) = (0f64, 0f64);
        for (a, b) in head.iter().zip(embd) {
            diff += ((a - b) as f64).powi(2);
            norm += (*b as f64).powi(2);
        }
        let rel = (diff / norm.max(f64::MIN_POSITIVE)).sqrt();
        if rel == 0.0 {
            return Ok(());
        }
        if rel > 0.05 {
            bail!(
                "{p}: output.weight is not the token embedding (relative difference {rel:.3}): \
                 nanogpt's GPT-2 ties the classifier to token_embd.weight, as GPT-2 does, and \
                 cannot represent a separate output layer"
            );
        }
        crate::errln!(
            "note: {p} stores output.weight ({}) as a copy of token_embd.weight ({}) that differs \
             by {:.2} % (quantized differently); nanogpt ties the classifier to token_embd.weight, \
             as GPT-2 does",
            info.type_name(),
            self.file
                .tensor("token_embd.weight")
                .map(|t| t.type_name())
                .unwrap_or_default(),
            100.0 * rel
        );
        Ok(())
    }

    /// The tokenizer of the model's ids: GPT-2's BPE when a `gpt2` file carries
    /// exactly GPT-2's vocabulary; for the Llama families, the byte-level BPE the file
    /// carries, built from its metadata (with its chat template and stop tokens).
    pub fn tokenizer(&self) -> Result<Tokenizer> {
        let p = self.file.path().display();
        if self.config.llama.is_some() {
            let files = vocab::hf_files(&self.file.header, &p.to_string())?;
            return Tokenizer::from_files(files);
        }
        match vocab::recognise(&self.file.header)? {
            Recognised::Gpt2 => Ok(Tokenizer::gpt2()),
            Recognised::Missing => bail!(
                "{p} carries no tokenizer (tokenizer.ggml.model); nanogpt needs the model's \
                 tokenizer to encode text for it"
            ),
            Recognised::Other {
                model,
                pre,
                n_tokens,
            } => bail!(
                "{p} carries a `{model}` tokenizer (pre-tokenizer `{pre}`, {n_tokens} tokens) \
                 that is not GPT-2's; this version of nanogpt encodes text for GPT-2's \
                 vocabulary only in gpt2 models"
            ),
        }
    }

    /// The chat template the file carries.
    pub fn chat_template(&self) -> Option<&str> {
        self.file.get(vocab::CHAT_TEMPLATE).and_then(Value::as_str)
    }
}
