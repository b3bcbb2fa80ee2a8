//! Hugging Face models (GPT-2 and the Llama families) in and out: pretrained weights for fine-tuning,
//! evaluation and sampling, and export of a trained model back to a model directory
//! that `transformers` (and the tools built on its format) opens unchanged.
//!
//! - [`resolve`]: what `init_from = "gpt2"` (or a path, or a Hub id) names: a local
//!   directory or `.safetensors` file, the Hugging Face cache, or a download.
//! - [`config`]: `config.json`, checked against what the engine can represent.
//! - [`weights`]: safetensors (single file, sharded with an index) into the flat
//!   parameter arena: keys with or without `transformer.`, Conv1D `[in, out]`
//!   weights transposed, attention-mask buffers skipped, `lm_head` tied to `wte`,
//!   the vocabulary padded. Pickle (`pytorch_model.bin`) is refused, never read.
//! - [`export`](mod@export): the arena back to `config.json` + `model.safetensors` +
//!   `generation_config.json` (+ GPT-2's tokenizer files, from [`tokenizer_files`]).
//!
//! ```no_run
//! # fn main() -> anyhow::Result<()> {
//! let model = nanogpt::hf::Pretrained::open("gpt2")?; // dir, cache, or download
//! let (config, params) = model.load(Some(256), 0.0)?; // block_size cropped to 256
//! # Ok(()) }
//! ```

pub mod adapter;
pub mod config;
pub mod export;
pub mod llama;
pub mod peft_select;
pub mod resolve;
pub mod tokenizer_files;
pub mod weights;

pub use config::{Gpt2Config, HfConfig};
pub use export::{export, ExportSummary};
pub use resolve::Located;

use crate::gguf::GgufModel;
use crate::hub::HubEnv;
use crate::model::{ModelConfig, ParamLayout};
use anyhow::Result;
use std::path::{Path, PathBuf};
use weights::WeightFiles;

/// The architecture of a local `config.json`, named directly or as its model
/// directory, with `block_size` positions; None when `spec` is neither (a preset, a
/// Hub id, a weights file). For what needs only the shapes (`plan`, `bench`): no
/// weights are read, so a model can be planned before it is downloaded.
pub fn local_architecture(
    spec: &str,
    block_size: usize,
    dropout: f32,
) -> Option<Result<ModelConfig>> {
    let path = Path::new(spec);
    let file = match path.is_dir() {
        true => path.join("config.json"),
        false => path.to_path_buf(),
    };
    let is_json = file.extension().is_some_and(|e| e == "json");
    (is_json && file.is_file()).then(|| {
        let hf = HfConfig::load(&file)?;
        hf.check(&file)?;
        hf.model_config(Some(block_size), dropout, &file)
    })
}

/// A pretrained GPT-2 found and opened: its config read and checked, its weight
/// files indexed (tensors are read by [`Pretrained::load_params`]).
pub struct Pretrained {
    /// The model directory (or the `.safetensors` or `.gguf` file) the weights come
    /// from.
    pub location: PathBuf,
    pub config: HfConfig,
    weights: Weights,
}

/// Where the tensors are.
enum Weights {
    Safetensors(WeightFiles),
    /// A GGUF file (llama.cpp's), its architecture read from its metadata.
    Gguf(Box<GgufModel>),
}

impl Pretrained {
    /// Opens `spec` (see [`resolve::locate`]), with the Hub settings of the
    /// process environment (`HF_HUB_CACHE`, `HF_HOME`, `HF_HUB_OFFLINE`, ...).
    pub fn open(spec: &str) -> Result<Pretrained> {
        Self::open_with(spec, &HubEnv::from_process_env())
    }

    /// Opens `spec` with explicit Hub settings.
    pub fn open_with(spec: &str, env: &HubEnv) -> Result<Pretrained> {
        let located = resolve::locate(spec, env)?;
        match located {
            Located::Dir(dir) => Self::open_dir(&dir),
            Located::File(file) if crate::gguf::is_gguf(&file) => Self::open_gguf(&file),
            Located::File(file) => Self::open_file(&file),
        }
    }

    /// A Hugging Face model directory: `config.json` and `model.safetensors` (or
    /// shards listed in `model.safetensors.index.json`).
    pub fn open_dir(dir: &Path) -> Result<Pretrained> {
        let weights = WeightFiles::open_dir(dir)?;
        let config = HfConfig::load(&dir.join("config.json"))?;
        config.check(&dir.join("config.json"))?;
        Ok(Pretrained {
            location: dir.to_path_buf(),
            config,
            weights: Weights::Safetensors(weights),
        })
    }

    /// A lone `.safetensors` file; its config is the `config.json` beside it, or,
    /// without one, read off the tensor shapes (see [`weights::WeightFiles::infer_config`]).
    pub fn open_file(file: &Path) -> Result<Pretrained> {
        let weights = WeightFiles::open_file(file)?;
        let beside = file.with_file_name("config.json");
        let config = if beside.is_file() {
            let config = HfConfig::load(&beside)?;
            config.check(&beside)?;
            config
        } else {
            weights.infer_config()?
        };
        Ok(Pretrained {
            location: file.to_path_buf(),
            config,
            weights: Weights::Safetensors(weights),
        })
    }

    /// A GGUF file (llama.cpp's, Ollama's): the architecture from its metadata, the
    /// weights dequantized to f32 when loaded.
    pub fn open_gguf(file: &Path) -> Result<Pretrained> {
        let model = GgufModel::open(file)?;
        let c = &model.config;
        let config = match &c.llama {
            None => HfConfig::Gpt2(Gpt2Config::gpt2_shaped(
                c.vocab_size,
                c.block_size,
                c.n_layer,
                c.n_head,
                c.n_embd,
            )),
            Some(l) => {
                // The config.json an HF export writes: the file's context length
                // then travels with the runs made from it.
                let mut llama = l.clone();
                llama.source_config = Some(llama::config_json(c, l));
                HfConfig::Llama(llama::LlamaHfConfig {
                    model_type: l.model_type,
                    vocab_size: c.vocab_size,
                    hidden_size: c.n_embd,
                    num_hidden_layers: c.n_layer,
                    num_attention_heads: c.n_head,
                    max_position_embeddings: c.block_size,
                    llama,
                    sliding_window: None,
                })
            }
        };
        Ok(Pretrained {
            location: file.to_path_buf(),
            config,
            weights: Weights::Gguf(Box::new(model)),
        })
    }

    /// The GGUF file the weights come from, if they do.
    pub fn gguf(&self) -> Option<&GgufModel> {
        match &self.weights {
            Weights::Gguf(m) => Some(m),
            Weights::Safetensors(_) => None,
        }
    }

    /// The engine's config for this model: the pretrained architecture, the
    /// position table cropped to `block_size` (default: all of `n_positions`), and
    /// `dropout`.
    ///
    /// Checked against the weight files before anything is allocated: a config.json
    /// whose sizes the files cannot hold (each parameter takes at least 2 bytes) is
    /// refused, rather than sized from and found wrong after the allocation.
    pub fn model_config(&self, block_size: Option<usize>, dropout: f32) -> Result<ModelConfig> {
        let cfg = self
            .config
            .model_config(block_size, dropout, &self.location)?;
        let stored = match &self.weights {
            Weights::Safetensors(w) => w.stored_bytes(),
            // Checked tensor by tensor when the file was opened.
            Weights::Gguf(_) => return Ok(cfg),
        };
        if (cfg.num_params() as u64).saturating_mul(2) > stored {
            anyhow::bail!(
                "{}: config.json describes {} parameters but the weight files hold only {stored} \
                 bytes; config.json and the weights do not belong together: download the model again",
                self.location.display(),
                cfg.num_params()
            );
        }
        Ok(cfg)
    }

    /// Copies the weights into `params`, laid out by `layout` (built from
    /// [`Pretrained::model_config`]). Every tensor of the layout is written,
    /// padded vocabulary rows with zeros.
    pub fn load_params(
        &self,
        layout: &ParamLayout,
        cfg: &ModelConfig,
        params: &mut [f32],
    ) -> Result<()> {
        match &self.weights {
            Weights::Safetensors(w) => w.load_into(&self.config, layout, cfg, params),
            Weights::Gguf(m) => m.load_into(layout, cfg, params),
        }
    }

    /// The model config and a parameter arena filled with the weights.
    pub fn load(&self, block_size: Option<usize>, dropout: f32) -> Result<(ModelConfig, Vec<f32>)> {
        let cfg = self.model_config(block_size, dropout)?;
        let layout = ParamLayout::new(&cfg);
        let mut params = vec![0.0; layout.len];
        self.load_params(&layout, &cfg, &mut params)?;
        Ok((cfg, params))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Loading a model drops each tensor's pages of the mapped file once copied, so
    /// the model is held once (in its arena), not also as the file: every byte of
    /// every tensor is released, for GPT-2 and for each Llama family, tied or not.
    #[test]
    fn loading_releases_every_tensor_it_copied() {
        use crate::model::family::LlamaType;
        use crate::model::tests_llama::tiny_llama;
        use crate::model::ModelConfig;
        let gpt2 = ModelConfig {
            vocab_size: 61,
            block_size: 8,
            n_layer: 2,
            n_head: 2,
            n_embd: 16,
            bias: true,
            dropout: 0.0,
            llama: None,
        };
        let mut configs = vec![gpt2];
        for family in [LlamaType::Llama, LlamaType::Qwen2, LlamaType::Qwen3] {
            configs.extend([false, true].map(|tied| tiny_llama(family, tied, 0.0)));
        }
        for cfg in configs {
            let layout = crate::model::ParamLayout::new(&cfg);
            let params: Vec<f32> = (0..layout.len).map(|i| (i % 97) as f32 * 0.01).collect();
            let dir = tempfile::tempdir().unwrap();
            let out = dir.path().join("m");
            export::export(&params, &cfg, None, &out).unwrap();
            let file = std::fs::read(out.join("model.safetensors")).unwrap();
            let st = safetensors::SafeTensors::deserialize(&file).unwrap();
            let stored: usize = st.tensors().iter().map(|(_, v)| v.data().len()).sum();
            let before = weights::RELEASED.with(|n| n.get());
            let pretrained = Pretrained::open_dir(&out).unwrap();
            let (_, loaded) = pretrained.load(None, 0.0).unwrap();
            let released = weights::RELEASED.with(|n| n.get()) - before;
            let what = format!("{:?}", cfg.llama.as_ref().map(|l| l.model_type));
            assert_eq!(loaded.len(), params.len(), "{what}");
            assert_eq!(released, stored, "{what}: bytes released of those stored");
        }
    }
}
