//! Training checkpoints: one safetensors file holding the parameters, the AdamW
//! moments and (in its metadata) the JSON run state, written atomically.
//!
//! Keeping the state inside the same file as the tensors means a checkpoint is
//! replaced by a single rename: a crash leaves either the old checkpoint or the new
//! one, never a mix. `ckpt.json` beside it is a human-readable copy of the state.

use crate::fsutil::{temp_target, write_atomic, write_bytes_atomic};
use crate::model::{ModelConfig, ParamLayout, TensorInfo};
use anyhow::{bail, Context, Result};
use safetensors::tensor::Dtype;
use safetensors::SafeTensors;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
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
    /// Infinite before the first evaluation (JSON has no infinity: written as null).
    #[serde(deserialize_with = "f32_or_infinity")]
    pub best_val_loss: f32,
    /// AdamW updates taken (its bias-correction step).
    pub adam_step: u64,
    /// The dataset's tokenizer description (`meta.json`).
    pub tokenizer: serde_json::Value,
    /// Ranks that trained it (informative: checkpoints are world-size independent).
    pub world_size: usize,
    /// LoRA runs: the adapters' settings and the base they adapt (the tensors are
    /// then the adapters and their moments only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<crate::model::lora::LoraState>,
    /// The data it was trained on (absent in checkpoints of older versions).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dataset: Option<DatasetRecord>,
    /// bfloat16 runs: the kernel their bf16 products ran on (`Kernel::name`: `amx`,
    /// `avx512bf16`, `onednn`, `f32`). Kernels sum in different orders, so a resume
    /// on another one continues with other bits; absent in f32 runs and in
    /// checkpoints of older versions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bf16_kernel: Option<String>,
    /// The A/B switches the run had set (`NAME=VALUE`, [`crate::tuning`]): some
    /// change summation orders (`NANOGPT_RING_REDUCE=0`). Empty (absent) in most.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ab_switches: Vec<String>,
}

/// Which data a checkpoint was trained on, to tell a resume on other data.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DatasetRecord {
    /// The dataset folder as the config named it (informative).
    pub folder: String,
    pub train_tokens: u64,
    pub val_tokens: u64,
    /// [`crate::data::TokenFile::fingerprint`] of `train.bin` and of `val.bin`, in hex.
    pub train_fingerprint: String,
    pub val_fingerprint: String,
}

/// An `f32` that JSON wrote as `null` because it was infinite (serde_json writes
/// non-finite floats as null).
fn f32_or_infinity<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f32, D::Error> {
    Ok(Option::<f32>::deserialize(d)?.unwrap_or(f32::INFINITY))
}

/// The best-val (or `always_save_checkpoint`) checkpoint of an output directory.
pub fn checkpoint_path(out_dir: &Path) -> PathBuf {
    out_dir.join("ckpt.safetensors")
}

/// The interval (or signal) checkpoint that resumes at iteration `iter`:
/// `ckpt-000500.safetensors`.
pub fn interval_path(out_dir: &Path, iter: u64) -> PathBuf {
    out_dir.join(format!("ckpt-{iter:06}.safetensors"))
}

/// The iteration in an interval checkpoint's file name.
fn interval_iter(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("ckpt-")?.strip_suffix(".safetensors")?;
    match digits.bytes().all(|b| b.is_ascii_digit()) {
        true => digits.parse().ok(),
        false => None,
    }
}

/// Whether `name` is a checkpoint's file name: `ckpt.safetensors` or an interval
/// checkpoint's `ckpt-NNNNNN.safetensors`.
pub fn is_checkpoint_name(name: &str) -> bool {
    name == "ckpt.safetensors" || interval_iter(name).is_some()
}

/// The interval checkpoints in `out_dir`, oldest first.
pub fn interval_checkpoints(out_dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let mut found = Vec::new();
    let entries =
        std::fs::read_dir(out_dir).with_context(|| format!("cannot list {}", out_dir.display()))?;
    for entry in entries.flatten() {
        let name = entry.file_name();
        if let Some(iter) = name.to_str().and_then(interval_iter) {
            found.push((iter, entry.path()));
        }
    }
    found.sort();
    Ok(found)
}

/// Whether `out_dir` holds a checkpoint for `init_from=resume` to start from:
/// `ckpt.safetensors` or an interval checkpoint ([`Checkpoint::open_latest`] picks
/// among them).
fn holds_checkpoint(out_dir: &Path) -> bool {
    let dir = match out_dir.as_os_str().is_empty() {
        true => Path::new("."),
        false => out_dir,
    };
    checkpoint_path(dir).exists() || interval_checkpoints(dir).is_ok_and(|c| !c.is_empty())
}

/// Deletes all but the newest `keep` interval checkpoints (and their `.json`
/// copies); returns the deleted checkpoints. Call only once the newest is in place.
pub fn prune_interval_checkpoints(out_dir: &Path, keep: usize) -> Result<Vec<PathBuf>> {
    let all = interval_checkpoints(out_dir)?;
    let old = &all[..all.len().saturating_sub(keep)];
    for (_, path) in old {
        std::fs::remove_file(path)
            .with_context(|| format!("cannot delete the old checkpoint {}", path.display()))?;
        let _ = std::fs::remove_file(path.with_extension("json"));
    }
    Ok(old.iter().map(|(_, p)| p.clone()).collect())
}

/// Temporary checkpoint files (`.ckpt-000400.safetensors.tmp-PID`, named as
/// [`crate::fsutil`] names them) that an interrupted write left in `out_dir`; they are
/// never loaded.
pub fn leftover_temp_files(out_dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(out_dir) else {
        return Vec::new();
    };
    let mut found: Vec<PathBuf> = entries
        .flatten()
        .filter(|e| {
            let name = e.file_name();
            temp_target(&name.to_string_lossy()).is_some_and(is_checkpoint_name)
        })
        .map(|e| e.path())
        .collect();
    found.sort();
    found
}

/// AdamW's moments, each in layout order, as a checkpoint holds them.
#[derive(Clone, Copy, Debug)]
pub struct Moments<'a> {
    /// The first moments.
    pub m: &'a [f32],
    /// The second moments.
    pub v: &'a [f32],
}

/// Writes `params` (and the AdamW moments when given) with `state`, atomically, to
/// `out_dir/ckpt.safetensors`.
pub fn save(
    out_dir: &Path,
    state: &CheckpointState,
    layout: &ParamLayout,
    params: &[f32],
    moments: Option<Moments<'_>>,
) -> Result<()> {
    save_to(&checkpoint_path(out_dir), state, layout, params, moments)
}

/// Writes the checkpoint `dest` (and its state as `dest` with extension `.json`),
/// each atomically, from whole arrays held by this process. Refuses non-finite
/// parameters or moments: a checkpoint must always be worth resuming from.
pub fn save_to(
    dest: &Path,
    state: &CheckpointState,
    layout: &ParamLayout,
    params: &[f32],
    moments: Option<Moments<'_>>,
) -> Result<()> {
    let mut source = Held {
        layout,
        params,
        moments,
    };
    save_streamed(dest, state, layout, moments.is_some(), &mut source)
}

/// Which array of the training state a checkpoint tensor holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Array {
    Params,
    /// AdamW's first moments.
    M,
    /// AdamW's second moments.
    V,
}

impl Array {
    fn prefix(self) -> &'static str {
        match self {
            Array::Params => "",
            Array::M => M_PREFIX,
            Array::V => V_PREFIX,
        }
    }

    fn what(self) -> &'static str {
        match self {
            Array::Params => "parameters",
            Array::M => "AdamW first moments",
            Array::V => "AdamW second moments",
        }
    }
}

/// One tensor of a checkpoint file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    pub array: Array,
    /// Its index in the layout's `tensors`.
    pub tensor: usize,
}

/// The tensors of a checkpoint of `layout` (with the AdamW moments when `moments`)
/// in the order the file stores their bytes: safetensors' order, by name (every
/// tensor is F32). Every rank of a run computes the same order.
pub fn file_order(layout: &ParamLayout, moments: bool) -> Vec<Entry> {
    let arrays: &[Array] = match moments {
        true => &[Array::Params, Array::M, Array::V],
        false => &[Array::Params],
    };
    let mut named: Vec<(String, Entry)> = arrays
        .iter()
        .flat_map(|&array| {
            layout.tensors.iter().enumerate().map(move |(tensor, t)| {
                let name = format!("{}{}", array.prefix(), t.name);
                (name, Entry { array, tensor })
            })
        })
        .collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named.into_iter().map(|(_, e)| e).collect()
}

/// Where the values of a checkpoint's tensors come from while it is written: called
/// once per [`Entry`], in [`file_order`], on every rank of a run (it may be a
/// collective); `Some` with the tensor's values on the rank that writes the file.
pub trait TensorSource {
    fn fetch(&mut self, entry: Entry) -> Option<&[f32]>;
}

/// A [`TensorSource`] of whole arrays in memory.
struct Held<'a> {
    layout: &'a ParamLayout,
    params: &'a [f32],
    moments: Option<Moments<'a>>,
}

impl TensorSource for Held<'_> {
    fn fetch(&mut self, entry: Entry) -> Option<&[f32]> {
        let range = self.layout.tensors[entry.tensor].range();
        let array = match (entry.array, self.moments) {
            (Array::Params, _) => self.params,
            (Array::M, Some(moments)) => moments.m,
            (Array::V, Some(moments)) => moments.v,
            (_, None) => return None,
        };
        Some(&array[range])
    }
}

/// Writes the checkpoint `dest` (and its state as `dest` with extension `.json`),
/// each atomically, one tensor at a time as `source` delivers them: the writer never
/// holds more than one tensor beyond what `source` holds. `source` is asked for
/// every tensor of [`file_order`] even when the write fails early, so that ranks
/// gathering the tensors for it stay in step. Refuses non-finite parameters or
/// moments (the previous file is kept): a checkpoint must always be worth resuming
/// from. The bytes are those [`crate::tensor_file::write`] writes.
pub fn save_streamed(
    dest: &Path,
    state: &CheckpointState,
    layout: &ParamLayout,
    moments: bool,
    source: &mut dyn TensorSource,
) -> Result<()> {
    let order = file_order(layout, moments);
    let state_json = serde_json::to_string(state)?;
    let metadata = BTreeMap::from([
        ("format".to_string(), FORMAT.to_string()),
        ("state".to_string(), state_json),
    ]);
    let header = header_bytes(layout, &order, &metadata)?;
    let not_saved = || {
        let dir = dest.parent().unwrap_or(Path::new("."));
        let then = match holds_checkpoint(dir) {
            true => "then continue with init_from=resume",
            false => "then start the run again: it has no checkpoint to resume from yet",
        };
        format!(
            "the checkpoint of iteration {} was not saved (free disk space or fix the \
             permissions of {}, {then})",
            state.iter_num,
            dir.display()
        )
    };
    let (mut fetched, mut non_finite) = (0, None::<Entry>);
    let written = write_atomic(dest, |tmp| {
        let cannot = || format!("cannot write {}", tmp.display());
        let file = File::create(tmp).with_context(cannot)?;
        let mut out = BufWriter::with_capacity(1 << 20, file);
        out.write_all(&header).with_context(cannot)?;
        for &entry in &order {
            fetched += 1;
            let values = source
                .fetch(entry)
                .expect("the writing rank receives every tensor");
            // The first non-finite tensor in (array, layout) order is the one named.
            if !all_finite(values) && non_finite.is_none_or(|e| key(entry) < key(e)) {
                non_finite = Some(entry);
            }
            if non_finite.is_none() {
                out.write_all(bytemuck::cast_slice(values))
                    .with_context(cannot)?;
            }
        }
        if non_finite.is_some() {
            bail!("non-finite values"); // the temporary file is removed; reported below
        }
        out.into_inner()
            .map_err(|e| e.into_error())
            .with_context(cannot)?;
        crate::fault::during_checkpoint(state.iter_num, tmp);
        Ok(())
    });
    for &entry in &order[fetched..] {
        source.fetch(entry);
    }
    if let Some(e) = non_finite {
        bail!(
            "refusing to write {} for iteration {}: the {} of {} hold NaN or infinite \
             values (the previous checkpoint is kept); lower learning_rate or set grad_clip, \
             then resume from the previous checkpoint",
            dest.display(),
            state.iter_num,
            e.array.what(),
            layout.tensors[e.tensor].name
        );
    }
    written.with_context(not_saved)?;
    let pretty = serde_json::to_string_pretty(state)?;
    write_bytes_atomic(&dest.with_extension("json"), pretty).with_context(not_saved)
}

/// Orders the tensors as the old whole-array check named them: parameters, then
/// first and second moments, each in layout order.
fn key(e: Entry) -> (Array, usize) {
    (e.array, e.tensor)
}

/// The first bytes of a checkpoint file with the tensors `order` and `metadata`:
/// the header's length and the header, as the safetensors crate writes them (it
/// lays out the data; nothing of the tensors' values is needed).
fn header_bytes(
    layout: &ParamLayout,
    order: &[Entry],
    metadata: &BTreeMap<String, String>,
) -> Result<Vec<u8>> {
    let shapes: Vec<_> = order
        .iter()
        .map(|e| {
            let t = &layout.tensors[e.tensor];
            (format!("{}{}", e.array.prefix(), t.name), ShapeOnly(t))
        })
        .collect();
    let bytes = crate::tensor_file::prefix(&shapes, metadata)
        .map_err(|e| anyhow::anyhow!("cannot lay out the checkpoint: {e}"))?;
    // The header's offsets follow `order`, as `file_order` promises.
    debug_assert!(header_order_is(&bytes, order, layout));
    Ok(bytes)
}

/// A tensor's dtype and shape for [`header_bytes`], without its values.
struct ShapeOnly<'a>(&'a TensorInfo);

impl safetensors::View for ShapeOnly<'_> {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }
    fn shape(&self) -> &[usize] {
        &self.0.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&[])
    }
    fn data_len(&self) -> usize {
        self.0.numel() * 4
    }
}

/// Whether the header in `bytes` places the tensors one after the other in `order`.
fn header_order_is(bytes: &[u8], order: &[Entry], layout: &ParamLayout) -> bool {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let Ok(header) = serde_json::from_slice::<serde_json::Value>(&bytes[8..8 + n]) else {
        return false;
    };
    let mut at = 0u64;
    order.iter().all(|e| {
        let t = &layout.tensors[e.tensor];
        let name = format!("{}{}", e.array.prefix(), t.name);
        let end = at + t.numel() as u64 * 4;
        let ok = header[name.as_str()]["data_offsets"] == serde_json::json!([at, end]);
        at = end;
        ok
    })
}

fn all_finite(values: &[f32]) -> bool {
    values.iter().all(|x| x.is_finite())
}

/// An opened checkpoint, memory-mapped: read the state, then copy tensors out.
pub struct Checkpoint {
    path: PathBuf,
    bytes: Bytes,
    pub state: CheckpointState,
}

/// The checkpoint [`Checkpoint::open_latest`] chose, with what it noticed.
pub struct Latest {
    pub checkpoint: Checkpoint,
    /// Lines for the user: leftover temporary files.
    pub notes: Vec<String>,
    /// Checkpoints skipped as damaged, with what is wrong with each.
    pub damaged: Vec<(PathBuf, String)>,
}

/// Moves the damaged checkpoint `path` (and its `.json`) aside, to
/// `NAME.damaged.safetensors` (`-2`, `-3`, ... if taken): a name no run reads or
/// writes, so that the run that skipped it does not replace it. Returns the new path.
pub fn move_aside(path: &Path) -> Result<PathBuf> {
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let free = |ext: &str| {
        (1..)
            .map(|k| match k {
                1 => path.with_file_name(format!("{stem}.damaged.{ext}")),
                k => path.with_file_name(format!("{stem}.damaged-{k}.{ext}")),
            })
            .find(|p| p.symlink_metadata().is_err())
            .expect("some name is free")
    };
    let aside = free("safetensors");
    std::fs::rename(path, &aside).with_context(|| {
        format!(
            "cannot move the damaged checkpoint {} aside to {}; move it yourself (or delete it) \
             and run again",
            path.display(),
            aside.display()
        )
    })?;
    let json = path.with_extension("json");
    if json.exists() {
        let json_aside = aside.with_extension("json");
        let _ = std::fs::rename(&json, json_aside);
    }
    Ok(aside)
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
        if !path.exists() {
            return Err(no_checkpoint(out_dir));
        }
        Checkpoint::open_file(&path)
    }

    /// The checkpoint to resume from: of `ckpt.safetensors` and the interval
    /// checkpoints `ckpt-NNNNNN.safetensors`, the complete one with the highest
    /// `iter_num`. Damaged ones are skipped (with a note); temporary files of
    /// interrupted writes are never read (a note names them).
    pub fn open_latest(out_dir: &Path) -> Result<Latest> {
        let mut candidates: Vec<PathBuf> = match out_dir.is_dir() {
            true => interval_checkpoints(out_dir)?
                .into_iter()
                .map(|(_, p)| p)
                .collect(),
            false => Vec::new(),
        };
        let best = checkpoint_path(out_dir);
        if best.exists() {
            candidates.push(best);
        }
        let notes: Vec<String> = leftover_temp_files(out_dir)
            .iter()
            .map(|p| {
                format!(
                    "ignoring {}, left by an interrupted checkpoint write (safe to delete)",
                    p.display()
                )
            })
            .collect();
        let mut chosen: Option<Checkpoint> = None;
        let mut damaged = Vec::new();
        for path in candidates {
            match Checkpoint::open_file(&path).map_err(|e| (path.clone(), format!("{e:#}"))) {
                // Ties: the interval checkpoint (listed first) is kept.
                Ok(c)
                    if chosen
                        .as_ref()
                        .is_none_or(|b| c.state.iter_num > b.state.iter_num) =>
                {
                    chosen = Some(c)
                }
                Ok(_) => {}
                Err(e) => damaged.push(e),
            }
        }
        let Some(checkpoint) = chosen else {
            match damaged.is_empty() {
                true => return Err(no_checkpoint(out_dir)),
                false => {
                    let errors: Vec<String> = damaged.into_iter().map(|(_, e)| e).collect();
                    bail!(
                        "no usable checkpoint in {}: {}",
                        out_dir.display(),
                        errors.join("; ")
                    )
                }
            }
        };
        Ok(Latest {
            checkpoint,
            notes,
            damaged,
        })
    }

    /// Opens one checkpoint file and reads its state.
    pub fn open_file(path: &Path) -> Result<Checkpoint> {
        let path = path.to_path_buf();
        let file = crate::fsutil::open_regular(&path, "checkpoint")?;
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

    /// The file this checkpoint was read from.
    pub fn path(&self) -> &Path {
        &self.path
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
            let values = &mut dst[t.range()];
            copy_f32(values, view.data());
            if let Bytes::Mapped(map) = &self.bytes {
                crate::resident::release_mapped(map, view.data());
            }
            // Second moments are squares: a negative one would be a NaN step.
            let nonnegative = prefix == V_PREFIX;
            if values
                .iter()
                .any(|x| !x.is_finite() || (nonnegative && *x < 0.0))
            {
                let what = match nonnegative {
                    true => "negative, NaN or infinite values",
                    false => "NaN or infinite values",
                };
                bail!(
                    "{}: tensor {name} holds {what}, which no run writes; the file was \
                     edited or damaged: restore it, resume from another checkpoint, or start \
                     again with init_from=scratch",
                    self.path.display()
                );
            }
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
    check_state(&state).map_err(|e| {
        anyhow::anyhow!(
            "{}: its run state is not one a run could have written: {e}; the file was edited \
             or damaged: restore it, resume from another checkpoint, or start again with \
             init_from=scratch",
            path.display()
        )
    })?;
    // A LoRA checkpoint holds the adapters only (their base is loaded apart).
    let layout = match &state.lora {
        None => ParamLayout::new(&state.model),
        Some(l) => crate::model::lora::LoraLayout::new(&state.model, &l.config).params,
    };
    let floats: usize = layout
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

/// The most iterations a run state may count (AdamW's bias correction takes its
/// step as an `i32` exponent); far beyond any real run.
pub const MAX_ITERATIONS: u64 = i32::MAX as u64;

/// Refuses a run state that no run writes (hand-edited or hostile), naming the field:
/// a counter that would wrap, an AdamW step ahead of the iterations, a best loss that
/// is not a loss, no ranks, a tokenizer that does not fit the model.
fn check_state(state: &CheckpointState) -> Result<()> {
    if state.iter_num > MAX_ITERATIONS {
        bail!(
            "iter_num = {} is beyond any run (at most {MAX_ITERATIONS})",
            state.iter_num
        );
    }
    if state.adam_step > state.iter_num {
        bail!(
            "adam_step = {} is more than iter_num = {} (at most one AdamW step per iteration)",
            state.adam_step,
            state.iter_num
        );
    }
    let best = state.best_val_loss;
    if best.is_nan() || best < 0.0 || best == f32::NEG_INFINITY {
        bail!("best_val_loss = {best} is not a loss (a finite number >= 0, or null)");
    }
    if state.world_size == 0 || state.world_size > 1 << 20 {
        bail!(
            "world_size = {} is not a number of ranks (1 or more)",
            state.world_size
        );
    }
    if !state.train_config.is_object() {
        bail!("train_config is not a JSON object");
    }
    let meta: crate::data::Meta = serde_json::from_value(state.tokenizer.clone())
        .map_err(|e| anyhow::anyhow!("tokenizer is not a dataset description ({e})"))?;
    meta.check()
        .map_err(|e| anyhow::anyhow!("tokenizer: {e}"))?;
    // A Llama-family model's own tokenizer may list tokens past its embeddings (see
    // `train::start`'s check of the ids); a GPT-2's dataset never does.
    if state.model.llama.is_none() && meta.vocab_size > state.model.vocab_size {
        bail!(
            "tokenizer has {} tokens, more than the model's vocab_size {}",
            meta.vocab_size,
            state.model.vocab_size
        );
    }
    Ok(())
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

fn no_checkpoint(out_dir: &Path) -> anyhow::Error {
    anyhow::anyhow!(
        "no checkpoint at {}: start a run with init_from=scratch first, or set out_dir to the run to resume",
        checkpoint_path(out_dir).display()
    )
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
            llama: None,
        };
        let layout = ParamLayout::new(&cfg);
        let state = CheckpointState {
            model: cfg.clone(),
            train_config: serde_json::json!({"learning_rate": 1e-3}),
            iter_num: 250,
            best_val_loss: 1.5,
            adam_step: 250,
            dataset: None,
            tokenizer: serde_json::json!({
                "tokenizer": "char",
                "vocab_size": 30,
                "train_tokens": 1000,
                "val_tokens": 100,
                "chars": "ABCDEFGHIJKLMNOPQRSTUVWXYZabcd",
            }),
            world_size: 1,
            lora: None,
            bf16_kernel: Some("amx".into()),
            ab_switches: vec!["NANOGPT_RING_REDUCE=0".into()],
        };
        (cfg, layout, state)
    }

    #[test]
    fn round_trips_parameters_moments_and_state() {
        let (_, layout, state) = setup();
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let params: Vec<f32> = (0..layout.len).map(|i| i as f32 * 0.5).collect();
        let m: Vec<f32> = params.iter().map(|p| -p).collect();
        let v: Vec<f32> = params.iter().map(|p| p * p).collect();
        save(
            dir,
            &state,
            &layout,
            &params,
            Some(Moments { m: &m, v: &v }),
        )
        .unwrap();
        let ckpt = Checkpoint::open(dir).unwrap();
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
        let leftovers: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().contains(".tmp"))
            .collect();
        assert!(leftovers.is_empty(), "temporary files left behind");
    }

    /// The streamed writer lays the file out as the safetensors crate does: the same
    /// header (up to the order of the metadata's two keys, which the crate leaves to
    /// a hash map) and the same tensor bytes.
    #[test]
    fn the_streamed_file_is_what_safetensors_writes() {
        let (_, layout, state) = setup();
        let tmp = tempfile::tempdir().unwrap();
        let params: Vec<f32> = (0..layout.len).map(|i| (i as f32).sin()).collect();
        let m: Vec<f32> = params.iter().map(|p| p * 0.5).collect();
        let v: Vec<f32> = params.iter().map(|p| p * p).collect();
        for moments in [None, Some(Moments { m: &m, v: &v })] {
            save(tmp.path(), &state, &layout, &params, moments).unwrap();
            let ours = std::fs::read(checkpoint_path(tmp.path())).unwrap();
            let mut views = Vec::new();
            for t in &layout.tensors {
                let view = |buf: &[f32]| {
                    let bytes: Vec<u8> = bytemuck::cast_slice(&buf[t.range()]).to_vec();
                    safetensors::tensor::TensorView::new(Dtype::F32, t.shape.clone(), bytes.leak())
                        .unwrap()
                };
                views.push((t.name.clone(), view(&params)));
                if let Some(Moments { m, v }) = moments {
                    views.push((format!("{M_PREFIX}{}", t.name), view(m)));
                    views.push((format!("{V_PREFIX}{}", t.name), view(v)));
                }
            }
            let metadata = std::collections::HashMap::from([
                ("format".to_string(), FORMAT.to_string()),
                ("state".to_string(), serde_json::to_string(&state).unwrap()),
            ]);
            let theirs = safetensors::serialize(views, &Some(metadata)).unwrap();
            assert_eq!(ours.len(), theirs.len());
            assert_eq!(ours[..8], theirs[..8], "header length");
            let n = 8 + u64::from_le_bytes(ours[..8].try_into().unwrap()) as usize;
            let header = |b: &[u8]| serde_json::from_slice::<serde_json::Value>(&b[8..n]).unwrap();
            assert_eq!(header(&ours), header(&theirs));
            assert!(ours[n..] == theirs[n..], "tensor bytes");
        }
    }

    #[test]
    fn without_moments_loads_params_only() {
        let (_, layout, state) = setup();
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let params = vec![1.0; layout.len];
        save(dir, &state, &layout, &params, None).unwrap();
        let ckpt = Checkpoint::open(dir).unwrap();
        let (mut m, mut v) = (vec![0.0; layout.len], vec![0.0; layout.len]);
        assert!(!ckpt.load_moments(&layout, &mut m, &mut v).unwrap());
    }

    #[test]
    fn clear_errors_for_missing_truncated_and_mismatched_files() {
        let (cfg, layout, state) = setup();
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let err = Checkpoint::open(dir).err().unwrap().to_string();
        assert!(
            err.contains("no checkpoint at") && err.contains("init_from=scratch"),
            "{err}"
        );

        save(dir, &state, &layout, &vec![0.0; layout.len], None).unwrap();
        let path = checkpoint_path(dir);
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
        let err = match Checkpoint::open(dir) {
            Err(e) => e.to_string(),
            Ok(c) => c
                .load_params(&layout, &mut vec![0.0; layout.len])
                .unwrap_err()
                .to_string(),
        };
        assert!(err.contains("damaged or truncated"), "{err}");

        save(dir, &state, &layout, &vec![0.0; layout.len], None).unwrap();
        let wider = ModelConfig { n_embd: 16, ..cfg };
        let other = ParamLayout::new(&wider);
        let err = Checkpoint::open(dir)
            .unwrap()
            .load_params(&other, &mut vec![0.0; other.len])
            .unwrap_err()
            .to_string();
        assert!(err.contains("shapes disagree"), "{err}");
    }

    #[test]
    fn refuses_non_finite_values_and_keeps_the_previous_file() {
        let (_, layout, state) = setup();
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let params = vec![0.5; layout.len];
        save(dir, &state, &layout, &params, None).unwrap();
        let before = std::fs::read(checkpoint_path(dir)).unwrap();
        let t = &layout.tensors[1];
        let mut bad = params.clone();
        bad[t.range().start] = f32::INFINITY;
        let err = save(dir, &state, &layout, &bad, None).unwrap_err();
        assert!(
            err.to_string().contains(&format!(
                "for iteration 250: the parameters of {} hold NaN or infinite values",
                t.name
            )),
            "{err}"
        );
        let mut v = vec![0.0; layout.len];
        v[t.range().end - 1] = f32::NAN;
        let moments = Some(Moments { m: &params, v: &v });
        let err = save(dir, &state, &layout, &params, moments).unwrap_err();
        assert!(
            err.to_string().contains("the AdamW second moments of"),
            "{err}"
        );
        assert_eq!(std::fs::read(checkpoint_path(dir)).unwrap(), before);
    }

    #[test]
    fn the_latest_complete_checkpoint_is_chosen_and_old_ones_pruned() {
        let (_, layout, mut state) = setup();
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let params = vec![0.25; layout.len];
        for iter in [100, 200, 300] {
            (state.iter_num, state.adam_step) = (iter, iter);
            save_to(&interval_path(dir, iter), &state, &layout, &params, None).unwrap();
        }
        (state.iter_num, state.adam_step) = (250, 250);
        save(dir, &state, &layout, &params, None).unwrap();
        // The newest is damaged (truncated), and a write was interrupted.
        let newest = interval_path(dir, 300);
        let bytes = std::fs::read(&newest).unwrap();
        std::fs::write(&newest, &bytes[..bytes.len() - 10]).unwrap();
        std::fs::write(dir.join(".ckpt-000400.safetensors.tmp-1"), b"partial").unwrap();
        let latest = Checkpoint::open_latest(dir).unwrap();
        assert_eq!(latest.checkpoint.state.iter_num, 250);
        assert_eq!(latest.checkpoint.path(), checkpoint_path(dir));
        assert_eq!(latest.notes.len(), 1, "{:?}", latest.notes);
        assert!(latest.notes[0].contains(".ckpt-000400.safetensors.tmp-1"));
        assert_eq!(latest.damaged.len(), 1);
        assert_eq!(latest.damaged[0].0, newest);
        assert!(latest.damaged[0].1.contains("damaged or truncated"));
        // Moved aside, under a name no run reads or writes.
        let aside = move_aside(&newest).unwrap();
        assert_eq!(aside, dir.join("ckpt-000300.damaged.safetensors"));
        assert!(dir.join("ckpt-000300.damaged.json").exists() && !newest.exists());
        std::fs::write(&newest, b"damaged again").unwrap();
        let again = move_aside(&newest).unwrap();
        assert_eq!(again, dir.join("ckpt-000300.damaged-2.safetensors"));
        assert!(Checkpoint::open_latest(dir).unwrap().damaged.is_empty());
        std::fs::remove_file(checkpoint_path(dir)).unwrap();
        let latest = Checkpoint::open_latest(dir).unwrap();
        assert_eq!(latest.checkpoint.path(), interval_path(dir, 200));

        let removed = prune_interval_checkpoints(dir, 1).unwrap();
        assert_eq!(removed, [interval_path(dir, 100)]);
        assert!(!dir.join("ckpt-000100.json").exists());
        assert!(dir.join("ckpt-000200.json").exists());
        assert_eq!(interval_iter("ckpt-1234567.safetensors"), Some(1_234_567));
        assert_eq!(interval_iter("ckpt-12a.safetensors"), None);
        assert_eq!(interval_iter("ckpt.safetensors"), None);
    }
}
