//! Hugging Face safetensors weights into the engine's parameter arena.
//!
//! Accepted: `model.safetensors`, shards listed in `model.safetensors.index.json`,
//! or one `.safetensors` file; float32, float16, bfloat16 or float64.
//!
//! GPT-2: keys with or without the `transformer.` prefix (`GPT2LMHeadModel` and
//! `GPT2Model` files, the original `gpt2` upload). The attention-mask buffers
//! (`h.N.attn.bias`, `h.N.attn.masked_bias`) are skipped; `lm_head.weight`, if present,
//! must equal `wte.weight` (the engine ties them). HF stores linear layers as Conv1D
//! `[in, out]`; the arena holds `[out, in]`, so those four weights per layer are
//! transposed.
//!
//! The Llama families: the arena's tensors carry the HF names (the family's
//! description), in `nn.Linear`'s `[out, in]`, so each is read by its own name; a
//! tied model's stored `lm_head.weight` must equal the embedding, old files'
//! `rotary_emb.inv_freq` buffers are skipped.
//!
//! Pickle files are refused by name and never opened.

use super::config::{Gpt2Config, HfConfig};
use super::llama::LlamaHfConfig;
use crate::checkpoint::copy_f32;
use crate::model::{ModelConfig, ParamLayout};
use anyhow::{anyhow, bail, Context, Result};
use rayon::prelude::*;
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// The single-file weights of a model directory.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The index of sharded weights.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// PyTorch pickle files, which are refused.
const PICKLE_FILES: [&str; 2] = ["pytorch_model.bin", "pytorch_model.bin.index.json"];

/// The Conv1D weights (stored `[in, out]` by Hugging Face), by key suffix.
const CONV1D_SUFFIXES: [&str; 4] = [
    "attn.c_attn.weight",
    "attn.c_proj.weight",
    "mlp.c_fc.weight",
    "mlp.c_proj.weight",
];

/// Per-layer parameter names (after `h.N.`).
const LAYER_KEYS: [&str; 12] = [
    "ln_1.weight",
    "ln_1.bias",
    "attn.c_attn.weight",
    "attn.c_attn.bias",
    "attn.c_proj.weight",
    "attn.c_proj.bias",
    "ln_2.weight",
    "ln_2.bias",
    "mlp.c_fc.weight",
    "mlp.c_fc.bias",
    "mlp.c_proj.weight",
    "mlp.c_proj.bias",
];

/// Memory-mapped safetensors files and where each tensor lives.
pub struct WeightFiles {
    /// What the user pointed at (directory or file), for messages.
    origin: PathBuf,
    files: Vec<(PathBuf, memmap2::Mmap)>,
    /// Tensor name as stored → index into `files`.
    names: BTreeMap<String, usize>,
}

/// What a stored key means to the engine.
#[derive(Debug, PartialEq)]
enum Key {
    /// A parameter, by its name without `transformer.`.
    Param(String),
    LmHead,
    /// The causal-mask buffers older files carry.
    MaskBuffer,
    Unknown,
}

fn classify(name: &str, n_layer: usize) -> Key {
    let key = name.strip_prefix("transformer.").unwrap_or(name);
    match key {
        "wte.weight" | "wpe.weight" | "ln_f.weight" | "ln_f.bias" => Key::Param(key.into()),
        "lm_head.weight" => Key::LmHead,
        _ => {
            let Some(rest) = key.strip_prefix("h.") else {
                return Key::Unknown;
            };
            let Some((layer, sub)) = rest.split_once('.') else {
                return Key::Unknown;
            };
            let Ok(layer) = layer.parse::<usize>() else {
                return Key::Unknown;
            };
            if sub == "attn.bias" || sub == "attn.masked_bias" {
                Key::MaskBuffer
            } else if layer < n_layer && LAYER_KEYS.contains(&sub) {
                Key::Param(key.into())
            } else {
                Key::Unknown
            }
        }
    }
}

/// The message for a directory or file that holds only pickle weights.
pub fn pickle_refusal(what: &Path) -> anyhow::Error {
    let dir = if what.is_dir() {
        what.to_path_buf()
    } else {
        what.parent().map(Path::to_path_buf).unwrap_or_default()
    };
    let d = dir.display();
    anyhow!(
        "{} holds PyTorch pickle weights (pytorch_model.bin), which nanogpt does not read: loading a \
         pickle can run arbitrary code. Convert them once to safetensors with transformers:\n    \
         python3 -c \"from transformers import GPT2LMHeadModel; \
         GPT2LMHeadModel.from_pretrained('{d}').save_pretrained('{d}-safetensors')\"\n\
         and use {d}-safetensors; or download the safetensors files instead \
         (e.g. `huggingface-cli download gpt2 config.json model.safetensors`)",
        what.display()
    )
}

impl WeightFiles {
    /// The weights of a model directory: `model.safetensors`, or the shards of
    /// `model.safetensors.index.json`.
    pub fn open_dir(dir: &Path) -> Result<WeightFiles> {
        let single = dir.join(SINGLE_FILE);
        let index = dir.join(INDEX_FILE);
        if single.is_file() {
            let mut w = WeightFiles::empty(dir);
            w.add_file(&single)?;
            return Ok(w);
        }
        if index.is_file() {
            return WeightFiles::open_sharded(dir, &index);
        }
        if PICKLE_FILES.iter().any(|f| dir.join(f).exists()) {
            return Err(pickle_refusal(dir));
        }
        if crate::checkpoint::checkpoint_path(dir).exists() {
            let d = dir.display();
            bail!(
                "{d} is a nanogpt training run, not a Hugging Face model: continue it with \
                 init_from=resume out_dir={d}, or start a new run from its weights by exporting \
                 them first (nanogpt export --from {d} --to {d}-hf, then init_from={d}-hf)"
            );
        }
        let others = ["tf_model.h5", "flax_model.msgpack"];
        if let Some(f) = others.iter().find(|f| dir.join(f).exists()) {
            bail!(
                "{} has only {f} (TensorFlow/Flax weights), which nanogpt does not read; get the \
                 model's model.safetensors, or convert with transformers' \
                 from_pretrained(..., from_tf=True / from_flax=True).save_pretrained(...)",
                dir.display()
            );
        }
        bail!(
            "{} is not a Hugging Face model directory: it has no {SINGLE_FILE} (nor {INDEX_FILE} \
             with shards); a GPT-2 model directory holds config.json and {SINGLE_FILE}, e.g. from \
             `huggingface-cli download gpt2 config.json model.safetensors --local-dir {}`",
            dir.display(),
            dir.display()
        )
    }

    /// One `.safetensors` file.
    pub fn open_file(file: &Path) -> Result<WeightFiles> {
        let name = file
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let is_pickle = [".bin", ".pt", ".pth", ".ckpt", ".pkl"]
            .iter()
            .any(|e| name.ends_with(e));
        if is_pickle {
            return Err(pickle_refusal(file));
        }
        if !name.ends_with(".safetensors") {
            bail!(
                "{} is not a .safetensors file; pass a Hugging Face model directory, a .safetensors \
                 file, or a name such as gpt2",
                file.display()
            );
        }
        let mut w = WeightFiles::empty(file);
        w.add_file(file)?;
        Ok(w)
    }

    fn empty(origin: &Path) -> WeightFiles {
        WeightFiles {
            origin: origin.to_path_buf(),
            files: Vec::new(),
            names: BTreeMap::new(),
        }
    }

    fn open_sharded(dir: &Path, index: &Path) -> Result<WeightFiles> {
        #[derive(serde::Deserialize)]
        struct Index {
            weight_map: BTreeMap<String, String>,
        }
        let text = crate::fsutil::read_json(index, "safetensors index")?;
        let parsed: Index = serde_json::from_str(&text).with_context(|| {
            format!(
                "{} is not a valid safetensors index (no weight_map)",
                index.display()
            )
        })?;
        let mut w = WeightFiles::empty(dir);
        let mut shards: Vec<&String> = parsed.weight_map.values().collect();
        shards.sort();
        shards.dedup();
        for shard in shards {
            if shard.contains('/') || shard.contains('\\') || shard.starts_with('.') {
                bail!(
                    "{}: shard name {shard:?} is not a plain file name",
                    index.display()
                );
            }
            let path = dir.join(shard);
            if !path.is_file() {
                bail!(
                    "{} lists the shard {shard}, which is missing from {}; download the whole model \
                     (all model-*.safetensors files)",
                    index.display(),
                    dir.display()
                );
            }
            w.add_file(&path)?;
        }
        for (name, shard) in &parsed.weight_map {
            let found = w.names.get(name).map(|&i| &w.files[i].0);
            if found.map(|p| p.file_name()) != Some(Some(std::ffi::OsStr::new(shard))) {
                bail!(
                    "{} says tensor {name} is in {shard}, but it is not there; the download is \
                     incomplete or mixes two versions",
                    index.display()
                );
            }
        }
        Ok(w)
    }

    fn add_file(&mut self, path: &Path) -> Result<()> {
        let file = crate::fsutil::open_regular(path, "weights file")?;
        // SAFETY: the map is read-only and private; pretrained weights are not
        // rewritten while a run reads them (the same assumption every safetensors
        // loader makes).
        let map = unsafe { memmap2::Mmap::map(&file) }
            .with_context(|| format!("cannot read {}", path.display()))?;
        let st = SafeTensors::deserialize(&map).map_err(|e| damaged(path, e))?;
        let idx = self.files.len();
        for name in st.names() {
            if self.names.insert(name.clone(), idx).is_some() {
                bail!(
                    "tensor {name} appears in more than one weight file of {}",
                    self.origin.display()
                );
            }
        }
        drop(st);
        self.files.push((path.to_path_buf(), map));
        Ok(())
    }

    /// Reads a GPT-2 config off the tensor shapes, for a lone `.safetensors` file
    /// without `config.json`: vocabulary, positions, width and depth are in the
    /// shapes; the head count is not, and is taken as n_embd / 64 (every OpenAI
    /// GPT-2 has heads of 64), with a note.
    pub fn infer_config(&self) -> Result<HfConfig> {
        let origin = self.origin.display();
        let mut stored: HashMap<String, &str> = HashMap::new();
        for name in self.names.keys() {
            let key = name.strip_prefix("transformer.").unwrap_or(name);
            stored.insert(key.to_string(), name);
        }
        let shape_of = |key: &str| -> Result<Vec<usize>> {
            let name = stored.get(key).ok_or_else(|| {
                anyhow!("{origin} has no tensor {key} (nor transformer.{key}): not GPT-2 weights")
            })?;
            let (path, view) = self.view(name)?;
            let shape = view.shape().to_vec();
            if shape.len() != 2 {
                bail!(
                    "{}: {name} has shape {shape:?}, expected 2 dimensions",
                    path.display()
                );
            }
            Ok(shape)
        };
        let wte = shape_of("wte.weight")?;
        let wpe = shape_of("wpe.weight")?;
        let n_layer = (0..)
            .take_while(|i| stored.contains_key(&format!("h.{i}.ln_1.weight")))
            .count();
        let n_embd = wte[1];
        if !n_embd.is_multiple_of(64) {
            bail!(
                "{origin} has no config.json beside it, and its width n_embd = {n_embd} does not \
                 tell the head count; put the model's config.json next to the file"
            );
        }
        let n_head = n_embd / 64;
        crate::errln!(
            "note: {origin} has no config.json beside it; read the shape off the tensors \
             (vocab {}, n_positions {}, n_layer {n_layer}, n_embd {n_embd}) and assumed n_head = \
             {n_head} (heads of 64, as in every OpenAI GPT-2)",
            wte[0],
            wpe[0]
        );
        Ok(HfConfig::Gpt2(Gpt2Config::gpt2_shaped(
            wte[0], wpe[0], n_layer, n_head, n_embd,
        )))
    }

    /// Bytes in all the weight files together.
    pub fn stored_bytes(&self) -> u64 {
        self.files.iter().map(|(_, map)| map.len() as u64).sum()
    }

    fn view(&self, name: &str) -> Result<(&Path, TensorView<'_>)> {
        let &idx = self
            .names
            .get(name)
            .ok_or_else(|| anyhow!("{}: no tensor {name}", self.origin.display()))?;
        let (path, map) = &self.files[idx];
        let st = SafeTensors::deserialize(map).map_err(|e| damaged(path, e))?;
        let view = st.tensor(name).map_err(|e| damaged(path, e))?;
        Ok((path, view))
    }

    /// Drops the copied tensor `name`'s pages from memory (see
    /// [`crate::resident::release_mapped`]).
    fn release(&self, name: &str, view: &TensorView) {
        if let Some(&idx) = self.names.get(name) {
            crate::resident::release_mapped(&self.files[idx].1, view.data());
            #[cfg(test)]
            RELEASED.with(|n| n.set(n.get() + view.data().len()));
        }
    }

    /// Fills `params` (laid out by `layout` for `cfg`) from the files, after checking
    /// that they hold exactly a model of `hf`'s shape.
    pub fn load_into(
        &self,
        hf: &HfConfig,
        layout: &ParamLayout,
        cfg: &ModelConfig,
        params: &mut [f32],
    ) -> Result<()> {
        match hf {
            HfConfig::Gpt2(hf) => self.load_gpt2_into(hf, layout, cfg, params),
            HfConfig::Llama(hf) => self.load_llama_into(hf, layout, cfg, params),
        }
    }

    /// [`WeightFiles::load_into`] for a Llama-architecture model: every tensor of the
    /// layout by its name, the vocabulary's rows padded with zeros.
    fn load_llama_into(
        &self,
        hf: &LlamaHfConfig,
        layout: &ParamLayout,
        cfg: &ModelConfig,
        params: &mut [f32],
    ) -> Result<()> {
        let origin = self.origin.display();
        let (mut lm_head, mut unknown) = (None, Vec::new());
        for name in self.names.keys() {
            if layout.get(name).is_some() || name.ends_with(".rotary_emb.inv_freq") {
                continue;
            }
            match name.as_str() {
                "lm_head.weight" => lm_head = Some(name.as_str()),
                _ => unknown.push(name.as_str()),
            }
        }
        let kind = hf.model_type.name();
        if !unknown.is_empty() {
            let shown: Vec<_> = unknown.iter().take(6).copied().collect();
            bail!(
                "{origin} holds tensors that are not part of a {kind} language model with \
                 num_hidden_layers = {} (config.json): {}{}",
                cfg.n_layer,
                shown.join(", "),
                if unknown.len() > shown.len() {
                    ", ..."
                } else {
                    ""
                }
            );
        }
        let (v, c) = (cfg.vocab_size, cfg.n_embd);
        let vocab_tables = [layout.wte, layout.lm_head];
        for t in &layout.tensors {
            let name = t.name.as_str();
            if !self.names.contains_key(name) {
                bail!(
                    "{origin} has no tensor {name}, which this {kind} model (config.json) needs; \
                     the weights do not match config.json or are incomplete"
                );
            }
            let (path, view) = self.view(name)?;
            let dst = &mut params[t.range()];
            let vocab = vocab_tables
                .iter()
                .any(|s| !s.is_empty() && s.start == t.offset);
            let want = if vocab { vec![v, c] } else { t.shape.clone() };
            if view.shape() != want.as_slice() {
                bail!(
                    "{}: tensor {name} has shape {:?}, but config.json (vocab_size {v}, \
                     hidden_size {c}, ...) needs {want:?}",
                    path.display(),
                    view.shape()
                );
            }
            let n = want.iter().product();
            convert(&view, name, path, &mut dst[..n])?;
            dst[n..].fill(0.0);
            self.release(name, &view);
        }
        match hf.llama.tie_word_embeddings {
            true => self.check_lm_head(true, lm_head, layout, cfg, params),
            false => Ok(()), // lm_head is a tensor of the layout, read above
        }
    }

    /// [`WeightFiles::load_into`] for GPT-2.
    fn load_gpt2_into(
        &self,
        hf: &Gpt2Config,
        layout: &ParamLayout,
        cfg: &ModelConfig,
        params: &mut [f32],
    ) -> Result<()> {
        let origin = self.origin.display();
        // Stored names by parameter key, refusing duplicates and strangers.
        let mut by_key: HashMap<String, &str> = HashMap::new();
        let mut lm_head = None;
        let mut unknown = Vec::new();
        for name in self.names.keys() {
            match classify(name, hf.n_layer) {
                Key::Param(key) => {
                    if let Some(other) = by_key.insert(key.clone(), name) {
                        bail!("{origin} holds both {other} and {name}: which one is {key} is ambiguous");
                    }
                }
                Key::LmHead => lm_head = Some(name.as_str()),
                Key::MaskBuffer => {}
                Key::Unknown => unknown.push(name.as_str()),
            }
        }
        if !unknown.is_empty() {
            let shown: Vec<_> = unknown.iter().take(6).copied().collect();
            bail!(
                "{origin} holds tensors that are not part of a GPT-2 language model with n_layer = {} \
                 (config.json): {}{}; nanogpt loads GPT2LMHeadModel / GPT2Model weights",
                hf.n_layer,
                shown.join(", "),
                if unknown.len() > shown.len() { ", ..." } else { "" }
            );
        }
        let (v, c) = (cfg.vocab_size, cfg.n_embd);
        for t in &layout.tensors {
            let key = t.name.strip_prefix("transformer.").unwrap_or(&t.name);
            let name = by_key.get(key).ok_or_else(|| {
                anyhow!(
                    "{origin} has no tensor {key} (nor transformer.{key}), which a GPT-2 with \
                     n_layer = {}, bias needs; the weights do not match config.json or are incomplete",
                    hf.n_layer
                )
            })?;
            let (path, view) = self.view(name)?;
            let dst = &mut params[t.range()];
            let shape = view.shape().to_vec();
            let mismatch = |want: &[usize]| {
                anyhow!(
                    "{}: tensor {name} has shape {shape:?}, but config.json (vocab_size {}, n_positions {}, \
                     n_embd {}, n_layer {}) needs {want:?}",
                    path.display(),
                    hf.vocab_size,
                    hf.n_positions(),
                    hf.n_embd,
                    hf.n_layer
                )
            };
            if key == "wte.weight" {
                if shape != [v, c] {
                    return Err(mismatch(&[v, c]));
                }
                convert(&view, name, path, &mut dst[..v * c])?;
                dst[v * c..].fill(0.0);
            } else if key == "wpe.weight" {
                let want = [hf.n_positions(), c];
                if shape != want {
                    return Err(mismatch(&want));
                }
                convert(&view, name, path, dst)?;
            } else if CONV1D_SUFFIXES.iter().any(|s| key.ends_with(s)) {
                let (out, inp) = (t.shape[0], t.shape[1]);
                if shape != [inp, out] {
                    return Err(mismatch(&[inp, out]));
                }
                let mut tmp = vec![0.0f32; inp * out];
                convert(&view, name, path, &mut tmp)?;
                transpose(&tmp, inp, out, dst);
            } else {
                if shape != t.shape {
                    return Err(mismatch(&t.shape));
                }
                convert(&view, name, path, dst)?;
            }
            self.release(name, &view);
        }
        self.check_lm_head(hf.tie_word_embeddings, lm_head, layout, cfg, params)
    }

    /// A tied model's classifier is its token embedding: a stored `lm_head` (an
    /// arena tensor of its own only when untied) must agree.
    fn check_lm_head(
        &self,
        tied: bool,
        lm_head: Option<&str>,
        layout: &ParamLayout,
        cfg: &ModelConfig,
        params: &[f32],
    ) -> Result<()> {
        let (v, c) = (cfg.vocab_size, cfg.n_embd);
        let Some(name) = lm_head else {
            if !tied {
                bail!(
                    "{}: config.json sets tie_word_embeddings = false but there is no lm_head.weight; \
                     the model is incomplete",
                    self.origin.display()
                );
            }
            return Ok(());
        };
        let (path, view) = self.view(name)?;
        if view.shape() != [v, c] {
            bail!(
                "{}: {name} has shape {:?}, expected [{v}, {c}]",
                path.display(),
                view.shape()
            );
        }
        let mut head = vec![0.0f32; v * c];
        convert(&view, name, path, &mut head)?;
        self.release(name, &view);
        if head != params[layout.wte.start..layout.wte.start + v * c] {
            bail!(
                "{}: {name} differs from the token embedding (tie_word_embeddings = {tied}): \
                 a tied model's output layer is its token embedding, and this file holds another",
                path.display(),
            );
        }
        Ok(())
    }
}

fn damaged(path: &Path, err: impl std::fmt::Display) -> anyhow::Error {
    anyhow!(
        "{} is not a valid safetensors file ({err}); it may be truncated: download it again",
        path.display()
    )
}

/// Converts the leading `dst.len()` elements of `view` to f32.
pub(crate) fn convert(view: &TensorView, name: &str, path: &Path, dst: &mut [f32]) -> Result<()> {
    let bytes = &view.data()[..dst.len() * view.dtype().size()];
    match view.dtype() {
        Dtype::F32 => copy_f32(dst, bytes),
        Dtype::F16 => dst
            .par_iter_mut()
            .zip(bytes.par_chunks_exact(2))
            .for_each(|(d, b)| *d = f16_to_f32(u16::from_le_bytes([b[0], b[1]]))),
        Dtype::BF16 => dst
            .par_iter_mut()
            .zip(bytes.par_chunks_exact(2))
            .for_each(|(d, b)| *d = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16)),
        Dtype::F64 => {
            for (d, b) in dst.iter_mut().zip(bytes.chunks_exact(8)) {
                *d = f64::from_le_bytes(b.try_into().expect("8 bytes")) as f32;
            }
        }
        other => bail!(
            "{}: tensor {name} is {other:?}; nanogpt reads float32, float16, bfloat16 or float64 weights",
            path.display()
        ),
    }
    Ok(())
}

/// IEEE half to single precision (exact: every half is a single).
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h >> 15) as u32) << 31;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    let bits = match (exp, man) {
        (0, 0) => sign,
        (0, _) => {
            // Subnormal: man · 2^-24; shift the leading one into the implicit bit.
            let shift = man.leading_zeros() - 21;
            let m = (man << shift) & 0x3ff;
            sign | ((113 - shift) << 23) | (m << 13)
        }
        (0x1f, _) => sign | 0x7f80_0000 | (man << 13),
        _ => sign | ((exp + 112) << 23) | (man << 13),
    };
    f32::from_bits(bits)
}

/// `dst[o·inp + i] = src[i·out + o]`: `[inp, out]` to `[out, inp]`, in tiles.
pub fn transpose(src: &[f32], inp: usize, out: usize, dst: &mut [f32]) {
    const TILE: usize = 32;
    dst.par_chunks_mut(TILE * inp)
        .enumerate()
        .for_each(|(block, rows)| {
            let o0 = block * TILE;
            let n_rows = rows.len() / inp;
            for i0 in (0..inp).step_by(TILE) {
                for i in i0..(i0 + TILE).min(inp) {
                    let src_row = &src[i * out + o0..i * out + o0 + n_rows];
                    for (r, &x) in src_row.iter().enumerate() {
                        rows[r * inp + i] = x;
                    }
                }
            }
        });
}

#[cfg(test)]
thread_local! {
    /// Bytes of tensors whose pages [`WeightFiles::release`] dropped on this thread.
    pub(super) static RELEASED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_precision_converts_exactly() {
        let cases = [
            (0x3c00, 1.0f32),
            (0xc000, -2.0),
            (0x7bff, 65504.0),
            (0x0001, 2f32.powi(-24)),
            (0x0200, 2f32.powi(-15)),
            (0x03ff, 1023.0 * 2f32.powi(-24)),
            (0x0400, 2f32.powi(-14)),
            (0x8000, -0.0),
            (0x7c00, f32::INFINITY),
            (0x3555, 0.333_251_95),
        ];
        for (h, want) in cases {
            assert_eq!(f16_to_f32(h).to_bits(), want.to_bits(), "{h:#06x}");
        }
        assert!(f16_to_f32(0x7e00).is_nan());
    }

    #[test]
    fn transpose_swaps_axes() {
        let (inp, out) = (37, 70);
        let src: Vec<f32> = (0..inp * out).map(|x| x as f32).collect();
        let mut dst = vec![0.0; inp * out];
        transpose(&src, inp, out, &mut dst);
        for i in 0..inp {
            for o in 0..out {
                assert_eq!(dst[o * inp + i], src[i * out + o]);
            }
        }
    }

    #[test]
    fn keys_are_classified_with_or_without_prefix() {
        assert_eq!(
            classify("transformer.h.1.attn.c_attn.weight", 2),
            Key::Param("h.1.attn.c_attn.weight".into())
        );
        assert_eq!(classify("wte.weight", 2), Key::Param("wte.weight".into()));
        assert_eq!(classify("h.0.attn.bias", 2), Key::MaskBuffer);
        assert_eq!(
            classify("transformer.h.0.attn.masked_bias", 2),
            Key::MaskBuffer
        );
        assert_eq!(classify("lm_head.weight", 2), Key::LmHead);
        assert_eq!(classify("h.2.ln_1.weight", 2), Key::Unknown);
        assert_eq!(classify("score.weight", 2), Key::Unknown);
    }
}
