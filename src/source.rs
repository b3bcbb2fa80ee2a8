//! Where a model for evaluation or sampling comes from: a training run's `out_dir`.

use crate::checkpoint::Checkpoint;
use crate::data::Meta;
use crate::model::{ModelConfig, ParamLayout};
use anyhow::{bail, Context, Result};
use std::path::Path;

/// Weights and tokenizer of a trained model, ready to build a `Gpt` from.
pub struct LoadedModel {
    pub config: ModelConfig,
    pub params: Vec<f32>,
    /// The tokenizer the model was trained with.
    pub meta: Meta,
}

/// Loads the model named by `src`: an `out_dir` holding `ckpt.safetensors`.
pub fn load_model(src: &str) -> Result<LoadedModel> {
    let dir = Path::new(src);
    if !dir.is_dir() {
        bail!("{src} is not a directory; pass the out_dir of a training run (it holds ckpt.safetensors)");
    }
    let ckpt = Checkpoint::open(dir)?;
    let config = ckpt.state.model.clone();
    let layout = ParamLayout::new(&config);
    let mut params = vec![0.0; layout.len];
    ckpt.load_params(&layout, &mut params)?;
    let meta: Meta = serde_json::from_value(ckpt.state.tokenizer.clone())
        .with_context(|| format!("the checkpoint in {src} has no valid tokenizer description"))?;
    Ok(LoadedModel {
        config: ModelConfig {
            dropout: 0.0,
            ..config
        },
        params,
        meta,
    })
}
