//! Training checkpoints: one safetensors file holding the parameters, the AdamW
//! moments and (in its metadata) the JSON run state, written atomically.
//!
//! Keeping the state inside the same file as the tensors means a checkpoint is
//! replaced by a single rename: a crash leaves either the old checkpoint or the new
//! one, never a mix. `ckpt.json` beside it is a human-readable copy of the state.

use crate::model::{ModelConfig, ParamLayout, TensorInfo};
use anyhow::{bail, Context, Result};
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

/// Tag in the safetensors metadata that marks our checkpoints.
const FORMAT: &str = "nanogpt-checkpoint-v1";
const M_PREFIX: &str = "optimizer.m.";
const V_PREFIX: &str = "optimizer.v.";

/// Everything about a run that is not a tensor.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CheckpointState {
    pub model: ModelConfig,
    /// The training configuration the run used (free-form so this module does not
    /// depend on the config's type).
    pub train_config: serde_json::Value,
    /// The next iteration to run: resuming starts here.
    pub iter_num: u64,
    pub best_val_loss: f32,
    /// AdamW updates taken (its bias-correction step).
    pub adam_step: u64,
    /// The dataset's tokenizer description (`meta.json`).
    pub tokenizer: serde_json::Value,
    /// Ranks that trained it (informative: checkpoints are world-size independent).
    pub world_size: usize,
}

/// Paths of the checkpoint files in an output directory.
pub fn checkpoint_path(out_dir: &Path) -> PathBuf {
    out_dir.join("ckpt.safetensors")
}

/// Writes `params` (and the AdamW moments when given) with `state`, atomically.
pub fn save(
    out_dir: &Path,
    state: &CheckpointState,
    layout: &ParamLayout,
    params: &[f32],
    moments: Option<(&[f32], &[f32])>,
) -> Result<()> {
    let mut views: Vec<(String, TensorView)> = Vec::new();
    for t in &layout.tensors {
        let view = |buf| f32_view(buf, t);
        views.push((t.name.clone(), view(params)?));
        if let Some((m, v)) = moments {
            views.push((format!("{M_PREFIX}{}", t.name), view(m)?));
            views.push((format!("{V_PREFIX}{}", t.name), view(v)?));
        }
    }
    let state_json = serde_json::to_string(state)?;
    let metadata = HashMap::from([
        ("format".to_string(), FORMAT.to_string()),
        ("state".to_string(), state_json),
    ]);
    let dest = checkpoint_path(out_dir);
    write_atomic(&dest, |tmp| {
        safetensors::serialize_to_file(views, &Some(metadata), tmp)
            .with_context(|| format!("cannot write {}", tmp.display()))
    })?;
    let pretty = serde_json::to_string_pretty(state)?;
    write_atomic(&out_dir.join("ckpt.json"), |tmp| {
        std::fs::write(tmp, pretty).with_context(|| format!("cannot write {}", tmp.display()))
    })
}

fn f32_view<'a>(buf: &'a [f32], t: &TensorInfo) -> Result<TensorView<'a>> {
    let bytes: &[u8] = bytemuck::cast_slice(&buf[t.range()]);
    Ok(TensorView::new(Dtype::F32, t.shape.clone(), bytes)?)
}

/// Writes `dest` through `write(tmp)` on a temporary file in the same directory,
/// then fsyncs it, renames it into place and fsyncs the directory. On failure the
/// previous `dest` is untouched and the temporary file removed.
pub fn write_atomic(dest: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let dir = dest.parent().unwrap_or(Path::new("."));
    let name = dest.file_name().context("destination has no file name")?;
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let result = write(&tmp).and_then(|()| {
        File::open(&tmp)
            .and_then(|f| f.sync_all())
            .with_context(|| format!("cannot sync {} to disk", tmp.display()))?;
        std::fs::rename(&tmp, dest)
            .with_context(|| format!("cannot move {} into place", dest.display()))?;
        // The rename is durable only once the directory entry is on disk.
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    });
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.with_context(|| {
        format!(
            "{} was not written; any previous copy is intact",
            dest.display()
        )
    })
}

/// An opened checkpoint, memory-mapped: read the state, then copy tensors out.
pub struct Checkpoint {
    path: PathBuf,
    bytes: Bytes,
    pub state: CheckpointState,
}

/// The bytes of a checkpoint file: mapped from disk, or held (for tests and fuzzing).
enum Bytes {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl std::ops::Deref for Bytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Mapped(map) => map,
            Bytes::Owned(vec) => vec,
        }
    }
}

impl Checkpoint {
    /// Opens `out_dir/ckpt.safetensors` and reads its state.
    pub fn open(out_dir: &Path) -> Result<Checkpoint> {
        let path = checkpoint_path(out_dir);
        let file = File::open(&path).with_context(|| {
            format!(
                "no checkpoint at {}: start a run with init_from=scratch first, or set out_dir to the run to resume",
                path.display()
            )
        })?;
        // SAFETY: the map is read-only and private to this process; checkpoints are
        // replaced by rename, never rewritten in place, so the mapped file does not
        // change under us.
        let map = unsafe { memmap2::Mmap::map(&file) }
            .with_context(|| format!("cannot read {}", path.display()))?;
        Self::from_bytes(path, Bytes::Mapped(map))
    }

    /// A checkpoint from the bytes of a file (`path` names it in messages): the
    /// state is read and checked against the tensor bytes the file holds.
    pub fn from_vec(path: PathBuf, bytes: Vec<u8>) -> Result<Checkpoint> {
        Self::from_bytes(path, Bytes::Owned(bytes))
    }

    fn from_bytes(path: PathBuf, bytes: Bytes) -> Result<Checkpoint> {
        let state = read_state(&path, &bytes)?;
        Ok(Checkpoint { path, bytes, state })
    }

    /// Copies the parameters into `params` (laid out by `layout`).
    pub fn load_params(&self, layout: &ParamLayout, params: &mut [f32]) -> Result<()> {
        self.load_into(layout, "", params)
    }

    /// Copies the AdamW moments, if the checkpoint has them; `Ok(false)` if not.
    pub fn load_moments(&self, layout: &ParamLayout, m: &mut [f32], v: &mut [f32]) -> Result<bool> {
        let tensors = self.tensors()?;
        let first = format!("{M_PREFIX}{}", layout.tensors[0].name);
        if tensors.tensor(&first).is_err() {
            return Ok(false);
        }
        self.load_into(layout, M_PREFIX, m)?;
        self.load_into(layout, V_PREFIX, v)?;
        Ok(true)
    }

    fn tensors(&self) -> Result<SafeTensors<'_>> {
        SafeTensors::deserialize(&self.bytes).map_err(|e| damaged(&self.path, e))
    }

    fn load_into(&self, layout: &ParamLayout, prefix: &str, dst: &mut [f32]) -> Result<()> {
        let tensors = self.tensors()?;
        for t in &layout.tensors {
            let name = format!("{prefix}{}", t.name);
            let view = tensors.tensor(&name).map_err(|_| {
                anyhow::anyhow!(
                    "{} has no tensor {name}: it was written for a different model; use a matching config or another out_dir",
                    self.path.display()
                )
            })?;
            if view.dtype() != Dtype::F32 || view.shape() != t.shape.as_slice() {
                bail!(
                    "{}: tensor {name} is {:?} {:?} but the model needs F32 {:?}; the checkpoint's shapes disagree with the config (n_layer, n_embd, vocab_size...)",
                    self.path.display(),
                    view.dtype(),
                    view.shape(),
                    t.shape
                );
            }
            copy_f32(&mut dst[t.range()], view.data());
        }
        Ok(())
    }
}

/// The run state in a checkpoint's safetensors metadata, checked: a nanogpt
/// checkpoint, a possible model, and enough bytes for its parameters (so that a
/// damaged state cannot make the loader allocate an absurd arena).
fn read_state(path: &Path, bytes: &[u8]) -> Result<CheckpointState> {
    let (_, header) = SafeTensors::read_metadata(bytes).map_err(|e| damaged(path, e))?;
    let meta = header.metadata().clone().unwrap_or_default();
    if meta.get("format").map(String::as_str) != Some(FORMAT) {
        bail!(
            "{} is a safetensors file but not a nanogpt checkpoint (to fine-tune a Hugging Face model, use init_from=<its directory>)",
            path.display()
        );
    }
    let state: CheckpointState = meta
        .get("state")
        .context("missing run state")
        .and_then(|s| Ok(serde_json::from_str(s)?))
        .map_err(|e| damaged(path, e))?;
    state.model.validate().map_err(|e| {
        damaged(
            path,
            format!("its run state describes an impossible model: {e}"),
        )
    })?;
    let floats: usize = ParamLayout::new(&state.model)
        .tensors
        .iter()
        .map(|t| t.shape.iter().product::<usize>())
        .sum();
    if floats.saturating_mul(4) > bytes.len() {
        return Err(damaged(
            path,
            format!(
                "{} bytes, too few for the {floats} parameters its run state describes",
                bytes.len()
            ),
        ));
    }
    Ok(state)
}

/// Little-endian f32 bytes into floats (the bytes may be unaligned).
pub fn copy_f32(dst: &mut [f32], bytes: &[u8]) {
    match bytemuck::try_cast_slice::<u8, f32>(bytes) {
        Ok(src) if cfg!(target_endian = "little") => dst.copy_from_slice(src),
        _ => {
            for (d, b) in dst.iter_mut().zip(bytes.chunks_exact(4)) {
                *d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
    }
}

fn damaged(path: &Path, err: impl std::fmt::Display) -> anyhow::Error {
    anyhow::anyhow!(
        "{} is damaged or truncated ({err}); resume from another copy or start again with init_from=scratch",
        path.display()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setup() -> (ModelConfig, ParamLayout, CheckpointState) {
        let cfg = ModelConfig {
            vocab_size: 30,
            block_size: 8,
            n_layer: 2,
            n_head: 2,
            n_embd: 8,
            bias: true,
            dropout: 0.0,
        };
        let layout = ParamLayout::new(&cfg);
        let state = CheckpointState {
            model: cfg.clone(),
            train_config: serde_json::json!({"learning_rate": 1e-3}),
            iter_num: 250,
            best_val_loss: 1.5,
            adam_step: 250,
            tokenizer: serde_json::json!({"tokenizer": "char"}),
            world_size: 1,
        };
        (cfg, layout, state)
    }

    fn temp_dir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("nanogpt-ckpt-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn round_trips_parameters_moments_and_state() {
        let (_, layout, state) = setup();
        let dir = temp_dir("roundtrip");
        let params: Vec<f32> = (0..layout.len).map(|i| i as f32 * 0.5).collect();
        let m: Vec<f32> = params.iter().map(|p| -p).collect();
        let v: Vec<f32> = params.iter().map(|p| p * p).collect();
        save(&dir, &state, &layout, &params, Some((&m, &v))).unwrap();
        let ckpt = Checkpoint::open(&dir).unwrap();
        assert_eq!(ckpt.state, state);
        let mut p2 = vec![0.0; layout.len];
        ckpt.load_params(&layout, &mut p2).unwrap();
        let (mut m2, mut v2) = (vec![0.0; layout.len], vec![0.0; layout.len]);
        assert!(ckpt.load_moments(&layout, &mut m2, &mut v2).unwrap());
        // Alignment gaps between tensors are not stored; compare tensor by tensor.
        for t in &layout.tensors {
            assert_eq!(p2[t.range()], params[t.range()]);
            assert_eq!(m2[t.range()], m[t.range()]);
            assert_eq!(v2[t.range()], v[t.range()]);
        }
        let json: CheckpointState =
            serde_json::from_str(&std::fs::read_to_string(dir.join("ckpt.json")).unwrap()).unwrap();
        assert_eq!(json, state);
        let leftovers: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().contains(".tmp"))
            .collect();
        assert!(leftovers.is_empty(), "temporary files left behind");
    }

    #[test]
    fn without_moments_loads_params_only() {
        let (_, layout, state) = setup();
        let dir = temp_dir("nomoments");
        let params = vec![1.0; layout.len];
        save(&dir, &state, &layout, &params, None).unwrap();
        let ckpt = Checkpoint::open(&dir).unwrap();
        let (mut m, mut v) = (vec![0.0; layout.len], vec![0.0; layout.len]);
        assert!(!ckpt.load_moments(&layout, &mut m, &mut v).unwrap());
    }

    #[test]
    fn clear_errors_for_missing_truncated_and_mismatched_files() {
        let (cfg, layout, state) = setup();
        let dir = temp_dir("errors");
        let err = Checkpoint::open(&dir).err().unwrap().to_string();
        assert!(
            err.contains("no checkpoint at") && err.contains("init_from=scratch"),
            "{err}"
        );

        save(&dir, &state, &layout, &vec![0.0; layout.len], None).unwrap();
        let path = checkpoint_path(&dir);
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
        let err = match Checkpoint::open(&dir) {
            Err(e) => e.to_string(),
            Ok(c) => c
                .load_params(&layout, &mut vec![0.0; layout.len])
                .unwrap_err()
                .to_string(),
        };
        assert!(err.contains("damaged or truncated"), "{err}");

        save(&dir, &state, &layout, &vec![0.0; layout.len], None).unwrap();
        let wider = ModelConfig { n_embd: 16, ..cfg };
        let other = ParamLayout::new(&wider);
        let err = Checkpoint::open(&dir)
            .unwrap()
            .load_params(&other, &mut vec![0.0; other.len])
            .unwrap_err()
            .to_string();
        assert!(err.contains("shapes disagree"), "{err}");
    }

    #[test]
    fn a_failed_write_keeps_the_previous_file() {
        let dir = temp_dir("failed");
        let dest = dir.join("x.bin");
        std::fs::write(&dest, b"old").unwrap();
        let err = write_atomic(&dest, |tmp| {
            std::fs::write(tmp, b"partial")?;
            bail!("disk full")
        })
        .unwrap_err();
        assert!(format!("{err:#}").contains("previous copy is intact"));
        assert_eq!(std::fs::read(&dest).unwrap(), b"old");
        assert_eq!(
            std::fs::read_dir(&dir).unwrap().count(),
            1,
            "temporary file removed"
        );
    }
}
