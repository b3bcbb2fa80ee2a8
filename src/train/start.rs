//! Where a run starts: the dataset opened and checked, `out_dir` made ready, the
//! model and optimizer built from scratch, resumed from a checkpoint or loaded from
//! pretrained weights, and with several ranks, rank 0's start copied to every rank.

use crate::checkpoint::{self, Checkpoint, CheckpointState, DatasetRecord};
use crate::config::{InitFrom, TrainConfig};
use crate::data::{self, Meta, Split, TokenFile, Tokenizer};
use crate::dist::{Collective, DataParallel};
use crate::fsutil::DirLock;
use crate::kernels::bf16::{Backend, Kernel};
use crate::model::lora::LoraState;
use crate::model::{Gpt, ModelConfig};
use crate::model_source::{check_lora_base, load_lora_base};
use crate::optim::{AdamW, AdamWConfig};
use crate::plan;
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::fmt::Display;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Everything a run starts with besides its config and its ranks.
pub struct Start {
    pub data: Dataset,
    pub state: TrainState,
    /// Gradient reduction and sharded optimizer state, with more than one rank.
    pub dp: Option<DataParallel>,
    /// Rank 0's lock on `out_dir`, held while the run lasts.
    pub out_dir_lock: Option<DirLock>,
    /// Rank 0, a fresh run: the final-state checkpoints of finished earlier runs in
    /// `out_dir`, to delete once this run wrote its first checkpoint.
    pub replace_at_first_save: Vec<PathBuf>,
}

/// The dataset of a run, checked against the config.
pub struct Dataset {
    /// The tokenizer and the split sizes (`meta.json`).
    pub meta: Meta,
    /// The tokenizer itself (a model's own from the dataset folder, checked against
    /// `meta`'s hash).
    pub tokenizer: Tokenizer,
    pub train: TokenFile,
    pub val: TokenFile,
    /// Loss masks of instruction data (`train.mask`, `val.mask`), if prepared with them.
    pub masks: Masks,
    /// The folder the files are in.
    pub dir: PathBuf,
    /// What checkpoints record of it.
    pub record: DatasetRecord,
}

/// The loss masks of the two splits: both or neither.
#[derive(Default)]
pub struct Masks {
    pub train: Option<data::TokenMask>,
    pub val: Option<data::TokenMask>,
}

/// The model and optimizer a run starts from, and how far the run has come.
pub struct TrainState {
    /// The model, in the config's dtype (master weights in f32).
    pub model: Gpt,
    /// The optimizer; with `zero_stage` ≥ 1 on several ranks, this rank's shard.
    pub opt: AdamW,
    /// The first iteration to train: 0, or the checkpoint's when resuming.
    pub iter_num: u64,
    /// The best val loss so far: infinite before the first evaluation.
    pub best_val_loss: f32,
}

impl Start {
    /// Opens the data and prepares `out_dir`, then builds or loads the model on rank
    /// 0 and starts every other rank from its weights (one process: just builds it).
    /// Its bf16 products run on `backend`.
    pub fn new(cfg: &TrainConfig, comm: &dyn Collective, backend: &Backend) -> Result<Start> {
        cfg.check_world_size(comm.world_size())?;
        comm.set_timeout(Duration::from_secs_f64(cfg.collective_timeout_s));
        crate::dist::heartbeat::set_timeout(Duration::from_secs_f64(cfg.heartbeat_timeout_s));
        let root = comm.rank() == 0;
        // Rank 0 prepares a built-in dataset first, so ranks sharing its directory
        // find it ready (ranks on other hosts prepare their own copy).
        if !root {
            comm.barrier_patient();
        }
        let data = Dataset::open(cfg)?;
        if root {
            check_memory(cfg, comm, backend)?;
        }
        let (mut out_dir_lock, mut replace) = (None, Vec::new());
        if root {
            let (lock, finished) = prepare_out_dir(cfg)?;
            (out_dir_lock, replace) = (Some(lock), finished);
            comm.barrier_patient();
        }
        // Every rank must read the same data with the same binary as rank 0.
        crate::dist::preflight::check_same_inputs(comm, &data.dir)?;
        let mut start = if comm.world_size() == 1 {
            let state = TrainState::build(cfg, &data, backend)?;
            Start {
                data,
                state,
                dp: None,
                out_dir_lock: None,
                replace_at_first_save: Vec::new(),
            }
        } else {
            start_distributed(cfg, data, comm, backend)?
        };
        start.out_dir_lock = out_dir_lock;
        start.replace_at_first_save = replace;
        // Master weights and optimizer state stay f32; with bfloat16 the model makes
        // its bf16 weight copy here and after every optimizer step. A LoRA base kept
        // as a rounded copy is then held once: its f32 linears are given back (the
        // merged weights that tasks and the closing sample need are loaded again:
        // `Trainer::merged_params`).
        let model = &mut start.state.model;
        model.set_activation_checkpointing(cfg.activation_checkpointing);
        model.set_micro_steps(cfg.gradient_accumulation_steps / comm.world_size());
        model.release_frozen_linears();
        model.set_dtype(cfg.dtype, backend);
        Ok(start)
    }
}

/// Prints the memory plan of the run and refuses one that would not fit in this
/// host's available memory, before anything sized by the model is allocated.
fn check_memory(cfg: &TrainConfig, comm: &dyn Collective, backend: &Backend) -> Result<()> {
    let (w, local) = (comm.world_size(), comm.local_size());
    let (_, memory, refused) = plan::check_run(cfg, w, local, backend)?;
    for line in memory.summary() {
        crate::outln!("{line}");
    }
    match refused {
        Some(msg) => bail!(msg),
        None => Ok(()),
    }
}

impl Dataset {
    /// The dataset of `cfg` and its two splits, checked against the config.
    fn open(cfg: &TrainConfig) -> Result<Dataset> {
        let data_dir = data::find_or_prepare_dataset(&cfg.dataset)?;
        for note in crate::fsutil::finish_interrupted(&data_dir, &data::DATASET)? {
            crate::errln!("note: {note}");
        }
        let meta = Meta::load(&data_dir)?;
        let tokenizer = Tokenizer::from_meta(&meta, &data_dir)?;
        let train = TokenFile::open_split(&data_dir, Split::Train, &meta)?;
        let val = TokenFile::open_split(&data_dir, Split::Val, &meta)?;
        for file in [&train, &val] {
            file.check_block_size(cfg.block_size)?;
            file.check_vocab(meta.vocab_size)?;
        }
        let masks = open_masks(&data_dir, &train, &val)?;
        let record = DatasetRecord {
            folder: cfg.dataset.clone(),
            train_tokens: train.len() as u64,
            val_tokens: val.len() as u64,
            train_fingerprint: format!("{:016x}", train.fingerprint()?),
            val_fingerprint: format!("{:016x}", val.fingerprint()?),
        };
        Ok(Dataset {
            meta,
            tokenizer,
            train,
            val,
            masks,
            dir: data_dir,
            record,
        })
    }
}

/// The masks beside the token files; one without the other is refused.
fn open_masks(dir: &Path, train: &TokenFile, val: &TokenFile) -> Result<Masks> {
    let open = |split: Split, file: &TokenFile| {
        data::TokenMask::open_beside(&dir.join(split.file_name()), file.len())
    };
    let masks = Masks {
        train: open(Split::Train, train)?,
        val: open(Split::Val, val)?,
    };
    if masks.train.is_some() != masks.val.is_some() {
        bail!(
            "{} has a mask for only one of train.bin and val.bin; prepare the dataset again",
            dir.display()
        );
    }
    for (mask, what) in [
        (&masks.train, "nothing would be trained"),
        (&masks.val, "no val loss could be computed"),
    ] {
        if let Some(mask) = mask.as_ref().filter(|m| m.trained() == 0) {
            bail!(
                "{} trains no token (every byte is 0), so {what}; prepare the dataset \
                 again from examples with responses",
                mask.path().display()
            );
        }
    }
    Ok(masks)
}

/// What rank 0 tells the others before sending the weights.
#[derive(Serialize, Deserialize)]
struct StartHeader {
    model: ModelConfig,
    adam: AdamWConfig,
    iter_num: u64,
    /// None: no evaluation yet (infinite).
    best_val_loss: Option<f32>,
    adam_step: u64,
    /// LoRA: the adapters and the base's identity (the base follows the header).
    #[serde(default)]
    lora: Option<LoraState>,
}

/// Several ranks: rank 0 builds or loads the model (any `init_from`); every rank
/// then holds its weights (and AdamW state), checked by checksum.
fn start_distributed(
    cfg: &TrainConfig,
    data: Dataset,
    comm: &dyn Collective,
    backend: &Backend,
) -> Result<Start> {
    let built = match comm.rank() {
        0 => Some(TrainState::build(cfg, &data, backend)?),
        _ => None,
    };
    let mut bytes = Vec::new();
    if let Some(state) = &built {
        let best = state.best_val_loss;
        bytes = serde_json::to_vec(&StartHeader {
            model: state.model.config().clone(),
            adam: state.opt.config,
            iter_num: state.iter_num,
            best_val_loss: best.is_finite().then_some(best),
            adam_step: state.opt.step,
            lora: state.model.frozen().map(|f| f.state.clone()),
        })?;
    }
    comm.broadcast_bytes(&mut bytes, 0);
    let header: StartHeader =
        serde_json::from_slice(&bytes).context("internal error: bad start header from rank 0")?;
    let (mut model, root_opt) = match built {
        Some(state) => (state.model, Some(state.opt)),
        None => (
            Gpt::new(header.model.clone(), cfg.batch_size, cfg.block_size)?,
            None,
        ),
    };
    if let Some(lora) = &header.lora {
        model = share_lora_base(model, lora, comm, cfg.seed)?;
    }
    let mut dp = DataParallel::new(comm, &model, cfg.zero_stage);
    dp.reduce_in(cfg.grad_reduce_dtype);
    let moments = header.adam_step > 0;
    let opt = dp.start(
        comm,
        &mut model,
        root_opt,
        header.adam,
        header.adam_step,
        moments,
        header.iter_num,
    )?;
    dp.calibrate(comm, &model);
    let state = TrainState {
        model,
        opt,
        iter_num: header.iter_num,
        best_val_loss: header.best_val_loss.unwrap_or(f32::INFINITY),
    };
    Ok(Start {
        data,
        state,
        dp: Some(dp),
        out_dir_lock: None,
        replace_at_first_save: Vec::new(),
    })
}

/// LoRA on several ranks: rank 0's frozen base to every rank, which then holds the
/// same adapted model (the adapters themselves follow with the trained weights).
fn share_lora_base(
    mut model: Gpt,
    lora: &LoraState,
    comm: &dyn Collective,
    seed: u64,
) -> Result<Gpt> {
    if comm.rank() == 0 {
        comm.broadcast(model.base_params_mut(), 0);
        return Ok(model);
    }
    comm.broadcast(&mut model.params, 0);
    let model = model.with_lora(lora.config.clone(), (&lora.base, lora.base_seed), seed);
    let found = &model.frozen().expect("adapted").state.base_fingerprint;
    if *found != lora.base_fingerprint {
        bail!(
            "rank {}: the LoRA base received from rank 0 has fingerprint {found}, not {}",
            comm.rank(),
            lora.base_fingerprint
        );
    }
    Ok(model)
}

/// Creates `out_dir` and locks it for this run (held until the run ends; under MPI by
/// rank 0, for the whole job); returns the lock and, for a fresh run, the final-state
/// checkpoints of finished earlier runs that it replaces.
fn prepare_out_dir(cfg: &TrainConfig) -> Result<(DirLock, Vec<PathBuf>)> {
    let dir = &cfg.out_dir;
    if dir.symlink_metadata().is_ok() && !dir.exists() {
        let target = std::fs::read_link(dir).unwrap_or_default();
        bail!(
            "out_dir {} is a symbolic link to {}, which does not exist; create that folder, \
             remove the link, or choose another out_dir",
            dir.display(),
            target.display()
        );
    }
    if dir.exists() && !dir.is_dir() {
        bail!(
            "out_dir {} is a file, not a directory; choose another out_dir",
            dir.display()
        );
    }
    let made = crate::fsutil::create_dir_all_noting(dir).with_context(|| {
        format!(
            "cannot create out_dir {}; check permissions or choose another out_dir",
            dir.display()
        )
    })?;
    // A run refused from here on removes the folder it created.
    let lock = DirLock::acquire(dir, "out_dir", "a training run")?.created_here(made);
    let replace = match cfg.init() {
        InitFrom::Resume => Vec::new(),
        _ => check_fresh_start(dir)?,
    };
    Ok((lock, replace))
}

/// A run that does not resume, in an `out_dir` with an earlier run's checkpoints.
/// Its best-val checkpoint is replaced at the first save, as in nanoGPT (a warning
/// says so); its interval checkpoints would outrank the new run's when resuming, so
/// they are refused rather than silently deleted. The exception is the final state of
/// a finished run (it resumes past that run's `max_iters`; every run ends with one):
/// like `ckpt.safetensors`, it is replaced, deleted at this run's first checkpoint
/// (a warning says so), so that the quick start can be run again. Returns those.
fn check_fresh_start(dir: &Path) -> Result<Vec<PathBuf>> {
    let (finished, old): (Vec<_>, Vec<_>) = checkpoint::interval_checkpoints(dir)?
        .into_iter()
        .partition(|(_, path)| is_final_state(path));
    if let Some((iter, path)) = old.last() {
        bail!(
            "out_dir {} holds {} interval checkpoint(s) of an earlier run (the newest, {}, \
             resumes at iteration {iter}); continue that run with init_from=resume, or \
             choose another out_dir, or delete them to start over",
            dir.display(),
            old.len(),
            path.display()
        );
    }
    let best = checkpoint::checkpoint_path(dir);
    if best.exists() {
        crate::errln!(
            "warning: {} belongs to an earlier run and will be replaced at this run's first \
             checkpoint; stop now and use init_from=resume or another out_dir to keep it",
            best.display()
        );
    }
    for (_, path) in &finished {
        crate::errln!(
            "warning: {} is the final state of an earlier run and will be deleted at this \
             run's first checkpoint; stop now and use init_from=resume (with a larger \
             max_iters) or another out_dir to keep it",
            path.display()
        );
    }
    Ok(finished.into_iter().map(|(_, p)| p).collect())
}

/// Whether the checkpoint at `path` is a finished run's final state: it resumes past
/// the `max_iters` of the run that wrote it.
fn is_final_state(path: &Path) -> bool {
    let Ok(ckpt) = Checkpoint::open_file(path) else {
        return false;
    };
    let max_iters = ckpt.state.train_config.get("max_iters");
    max_iters
        .and_then(serde_json::Value::as_u64)
        .is_some_and(|max| ckpt.state.iter_num > max)
}

impl TrainState {
    /// The model and optimizer of `cfg.init_from`: new, resumed or pretrained (a
    /// resume says when its bf16 products ran on another kernel than `backend`).
    fn build(cfg: &TrainConfig, data: &Dataset, backend: &Backend) -> Result<TrainState> {
        let meta = &data.meta;
        let adam_cfg = AdamWConfig {
            beta1: cfg.beta1 as f32,
            beta2: cfg.beta2 as f32,
            eps: 1e-8,
            weight_decay: cfg.weight_decay as f32,
        };
        let (model, base) = match cfg.init() {
            InitFrom::Scratch => (new_model(cfg, meta)?, "scratch".to_string()),
            InitFrom::Resume => return resume(cfg, data, adam_cfg, backend),
            InitFrom::Pretrained(name) => (load_pretrained(cfg, data, &name)?, name),
        };
        note_unused_lora_keys(cfg);
        // LoRA: the loaded model becomes the frozen base of new adapters, or of a
        // PEFT adapter's.
        let model = match cfg.lora()? {
            _ if !cfg.adapter.is_empty() => with_peft_adapter(cfg, model, &base)?,
            None => model,
            Some(lora) => {
                lora.check(model.config())?;
                lora.check_fits(model.config())?;
                model.with_lora(lora, (&base, cfg.seed), cfg.seed)
            }
        };
        let opt = AdamW::new(&model.layout.decay_ranges(), adam_cfg);
        Ok(TrainState {
            model,
            opt,
            iter_num: 0,
            best_val_loss: f32::INFINITY,
        })
    }
}

/// `lora_alpha`, `lora_dropout` and `lora_targets` set without `lora_rank` (or an
/// `adapter`) do nothing: one note says so.
fn note_unused_lora_keys(cfg: &TrainConfig) {
    if cfg.lora_rank > 0 || !cfg.adapter.is_empty() {
        return;
    }
    let d = TrainConfig::default();
    let set: Vec<&str> = [
        ("lora_alpha", cfg.lora_alpha != d.lora_alpha),
        ("lora_dropout", cfg.lora_dropout != d.lora_dropout),
        ("lora_targets", cfg.lora_targets != d.lora_targets),
    ]
    .into_iter()
    .filter(|(_, set)| *set)
    .map(|(key, _)| key)
    .collect();
    if !set.is_empty() {
        crate::errln!(
            "note: ignoring {}: lora_rank = 0 trains the whole model (set lora_rank to train \
             adapters)",
            set.join(", ")
        );
    }
}

/// `model` as the base of the PEFT adapter `cfg.adapter`, whose settings win over
/// the config's `lora_*` keys (a note says so).
fn with_peft_adapter(cfg: &TrainConfig, model: Gpt, base: &str) -> Result<Gpt> {
    let dir = Path::new(&cfg.adapter);
    let peft = crate::hf::adapter::read_adapter(dir, model.config())
        .with_context(|| format!("adapter={}: cannot load the LoRA adapter", cfg.adapter))?;
    for note in &peft.notes {
        crate::errln!("note: {note}");
    }
    crate::hf::adapter::check_base(&peft, dir, base, &model.params, &model.layout)?;
    if peft.partial {
        bail!(
            "adapter={}: its config puts adapters on some layers only (layers_to_transform \
             or per-layer target_modules); nanogpt trains the same adapters on every layer, so \
             it can evaluate, sample and export this adapter, but not train it further",
            cfg.adapter
        );
    }
    if cfg.lora()?.is_some_and(|ours| ours != peft.config) {
        crate::errln!(
            "note: the adapter's settings come from {}: ignoring the config's lora_* keys",
            dir.display()
        );
    }
    let mut model = model.with_lora(peft.config, (base, cfg.seed), cfg.seed);
    model.params.copy_from_slice(&peft.weights);
    Ok(model)
}

/// A model of the config's architecture with GPT-2's initialisation.
fn new_model(cfg: &TrainConfig, meta: &Meta) -> Result<Gpt> {
    let model_cfg = cfg.model_config(meta.vocab_size);
    let mut model = Gpt::new(model_cfg, cfg.batch_size, cfg.block_size)?;
    model.init_gpt2(cfg.seed);
    Ok(model)
}

/// The newest checkpoint in `out_dir`: weights, AdamW moments and progress.
fn resume(
    cfg: &TrainConfig,
    data: &Dataset,
    adam_cfg: AdamWConfig,
    backend: &Backend,
) -> Result<TrainState> {
    let meta = &data.meta;
    let latest = Checkpoint::open_latest(&cfg.out_dir)?;
    for note in &latest.notes {
        crate::errln!("note: {note}");
    }
    // Kept, under a name this run never writes: the run would replace it otherwise.
    for (path, error) in &latest.damaged {
        let aside = checkpoint::move_aside(path)?;
        crate::errln!(
            "note: skipping a damaged checkpoint, moved aside to {} (kept for you to inspect or \
             restore): {error}",
            aside.display()
        );
    }
    let ckpt = latest.checkpoint;
    let state = &ckpt.state;
    crate::outln!(
        "resuming from {} at iteration {}",
        ckpt.path().display(),
        state.iter_num
    );
    check_resume_compatible(cfg, meta, state)?;
    crate::dist::heartbeat::checkpoint_written(ckpt.path(), state.iter_num);
    check_same_tokenizer(ckpt.path(), cfg, meta, state)?;
    note_other_data(ckpt.path(), &data.record, state);
    if let Some(note) = other_kernel(cfg, backend, state) {
        crate::errln!("note: {}: {note}", ckpt.path().display());
    }
    if let Some(note) = other_switches(&state.ab_switches, &crate::tuning::get().changed()) {
        crate::errln!("note: {}: {note}", ckpt.path().display());
    }
    if state.iter_num > cfg.max_iters && !cfg.eval_only {
        crate::outln!(
            "{} resumes at iteration {}, past max_iters = {}: the run is complete, nothing \
             to train (raise max_iters to train it further, or set eval_only=True to \
             evaluate it)",
            ckpt.path().display(),
            state.iter_num,
            cfg.max_iters
        );
    }
    note_ignored_architecture(cfg, &ckpt.path().display(), &state.model);
    note_resume_settings(cfg, ckpt.path(), state);
    let model_cfg = ModelConfig {
        dropout: cfg.dropout,
        ..state.model.clone()
    };
    let mut model = Gpt::new(model_cfg, cfg.batch_size, cfg.block_size)?;
    note_ignored_lora(cfg, state.lora.as_ref());
    if let Some(lora) = &state.lora {
        // The adapters' base, loaded again and checked to be the one they were trained on.
        model.params = load_lora_base(lora, model.config())?;
        let what = format!("cannot resume from {}: it", ckpt.path().display());
        check_lora_base(lora, &model.params, &what)?;
        model = model.with_lora(lora.config.clone(), (&lora.base, lora.base_seed), cfg.seed);
    }
    ckpt.load_params(&model.layout, &mut model.params)?;
    let mut opt = AdamW::new(&model.layout.decay_ranges(), adam_cfg);
    if ckpt.load_moments(&model.layout, &mut opt.m, &mut opt.v)? {
        opt.step = state.adam_step;
    }
    Ok(TrainState {
        model,
        opt,
        iter_num: state.iter_num,
        best_val_loss: state.best_val_loss,
    })
}

/// Settings a resumed run ignores or that make it differ from the run it continues:
/// `adapter` (the checkpoint's adapters continue), and a `dtype` other than the
/// checkpoint's run's (training goes on in the new one, so the losses from here on
/// differ from an uninterrupted run's).
fn note_resume_settings(cfg: &TrainConfig, path: &Path, state: &CheckpointState) {
    if !cfg.adapter.is_empty() {
        crate::errln!(
            "note: ignoring adapter={}: resuming continues the training in {}",
            cfg.adapter,
            path.display()
        );
    }
    let then = state.train_config.get("dtype").and_then(|d| d.as_str());
    if let Some(then) = then.filter(|&d| d != cfg.dtype.as_str()) {
        crate::errln!(
            "note: dtype = {} here, {then} in the run {} continues: training goes on in {}, \
             so the losses from here on differ from an uninterrupted run's",
            cfg.dtype.as_str(),
            path.display(),
            cfg.dtype.as_str()
        );
    }
}

/// Why a bfloat16 resume will not repeat the checkpoint's bits, if it will not: the
/// checkpoint's bf16 products ran on another kernel than `backend`'s (each sums in
/// its own order). None in f32, for the same kernel, and for older checkpoints that
/// record none.
fn other_kernel(cfg: &TrainConfig, backend: &Backend, state: &CheckpointState) -> Option<String> {
    let then = state.bf16_kernel.as_deref()?;
    let now = backend.kernel().name();
    if cfg.dtype != crate::model::Dtype::Bfloat16 || then == now {
        return None;
    }
    let fix = match Kernel::from_name(then).is_some_and(|k| backend.offer().usable(k)) {
        true => format!("bf16_kernel = \"{then}\" runs them on its kernel again"),
        false => format!("{then} cannot run here"),
    };
    Some(format!(
        "its bf16 products ran on {then}, this run's run on {now}, which sums in another \
         order: the losses continue close to, not bit-identical with, an unbroken run's \
         ({fix})"
    ))
}

/// What a resume says when the A/B switches set ([`crate::tuning`]) are not the
/// checkpoint's (`then`, `now`: `NAME=VALUE` each), if they are not.
fn other_switches(then: &[String], now: &[String]) -> Option<String> {
    let list = |s: &[String]| match s.is_empty() {
        true => "none".to_string(),
        false => s.join(" "),
    };
    (then != now).then(|| {
        format!(
            "it was trained with the A/B switches {}, this run has {}",
            list(then),
            list(now)
        )
    })
}

/// A resumed run continues the checkpoint's training, LoRA or full: one note names
/// the `lora_*` keys of the config that it ignores.
fn note_ignored_lora(cfg: &TrainConfig, ckpt: Option<&LoraState>) {
    let ours = cfg.lora().ok().flatten();
    let theirs = ckpt.map(|s| &s.config);
    if ours.as_ref() != theirs {
        let has = match theirs {
            None => "full training, no adapters".to_string(),
            Some(l) => format!(
                "lora_rank = {}, lora_alpha = {}, lora_dropout = {}, lora_targets = {}",
                l.rank,
                l.alpha,
                l.dropout,
                l.targets.join(",")
            ),
        };
        crate::errln!("note: resuming continues the checkpoint's training ({has}): ignoring the config's lora_* keys");
    }
}

/// The data and the window length must fit the checkpoint's model.
fn check_resume_compatible(cfg: &TrainConfig, meta: &Meta, state: &CheckpointState) -> Result<()> {
    let m = &state.model;
    let out = cfg.out_dir.display();
    if meta.vocab_size != m.vocab_size {
        bail!(
            "cannot resume from {out}: the checkpoint's vocabulary has {} tokens but the dataset's \
             meta.json says {}; resume on the dataset the run was trained on",
            m.vocab_size,
            meta.vocab_size
        );
    }
    if cfg.block_size > m.block_size {
        bail!(
            "cannot resume from {out}: block_size {} is longer than the checkpoint's {}; use block_size <= {}",
            cfg.block_size,
            m.block_size,
            m.block_size
        );
    }
    Ok(())
}

/// The dataset's tokenizer must be the checkpoint's: the same ids must mean the same
/// text (a char dataset of another text has another vocabulary, often of the same
/// size, and resuming on it would silently train the old weights on a new mapping; a
/// model's tokenizer is known by the SHA-256 of its tokenizer.json).
fn check_same_tokenizer(
    path: &Path,
    cfg: &TrainConfig,
    meta: &Meta,
    state: &CheckpointState,
) -> Result<()> {
    let theirs: Meta = serde_json::from_value(state.tokenizer.clone())
        .with_context(|| format!("{} has no valid tokenizer description", path.display()))?;
    let dataset = format!("dataset {}", cfg.dataset);
    let difference = theirs.tokenizer_difference(meta, "the checkpoint", &dataset);
    match difference {
        None => Ok(()),
        Some(what) => bail!(
            "cannot resume from {}: {what}, so the same token ids would mean other text; \
             resume on the data the run was trained on, or start again with init_from=scratch",
            path.display()
        ),
    }
}

/// Continuing a run on other data (with the same tokenizer) is legitimate, but worth
/// a line: it may be a mistake. Checkpoints of older versions record no dataset.
fn note_other_data(path: &Path, now: &DatasetRecord, state: &CheckpointState) {
    let Some(then) = &state.dataset else {
        crate::errln!(
            "note: {} records no dataset (an older version wrote it): cannot check that \
             the data is the one it was trained on",
            path.display()
        );
        return;
    };
    let same = (
        &then.train_fingerprint,
        &then.val_fingerprint,
        then.train_tokens,
    ) == (
        &now.train_fingerprint,
        &now.val_fingerprint,
        now.train_tokens,
    ) && then.val_tokens == now.val_tokens;
    if !same {
        crate::errln!(
            "warning: dataset {} ({} + {} tokens) is not the data {} was trained on ({}, {} + \
             {} tokens); continuing on it, since the tokenizer is the same",
            now.folder,
            now.train_tokens,
            now.val_tokens,
            path.display(),
            then.folder,
            then.train_tokens,
            then.val_tokens
        );
    }
}

/// The pretrained model `name` (see [`crate::hf`]) for fine-tuning: its architecture
/// wins over the config's, `block_size` crops the position table, `dropout`
/// applies. The dataset must be GPT-2 tokens for a GPT-2, and ids within the
/// model's embeddings for the Llama families.
fn load_pretrained(cfg: &TrainConfig, data: &Dataset, name: &str) -> Result<Gpt> {
    let meta = &data.meta;
    let pretrained = crate::hf::Pretrained::open(name)
        .with_context(|| format!("init_from={name}: cannot load the pretrained model"))?;
    if let Some(gguf) = pretrained.gguf() {
        gguf.tokenizer()
            .with_context(|| format!("init_from={name}: cannot fine-tune it"))?;
    }
    let model_cfg = pretrained.model_config(Some(cfg.block_size), cfg.dropout)?;
    if model_cfg.llama.is_some() && meta.vocab_size > model_cfg.vocab_size {
        check_ids_fit(cfg, data, name, model_cfg.vocab_size)?;
    }
    let gpt2 = model_cfg.llama.is_none();
    if gpt2
        && (meta.tokenizer != data::TokenizerKind::Gpt2 || meta.vocab_size > model_cfg.vocab_size)
    {
        bail!(
            "init_from={name} is a GPT-2 with {} tokens, but dataset {} holds {} tokens (vocabulary {}); \
             fine-tuning needs text prepared with GPT-2's tokenizer: `nanogpt prepare SOURCE --out DIR \
             --tokenizer gpt2`, then dataset=DIR",
            model_cfg.vocab_size,
            cfg.dataset,
            meta.tokenizer,
            meta.vocab_size
        );
    }
    note_ignored_architecture(cfg, &pretrained.location.display(), &model_cfg);
    let (b, t) = (cfg.batch_size, cfg.block_size);
    let mut model = Gpt::new(model_cfg.clone(), b, t)?;
    pretrained.load_params(&model.layout, &model_cfg, &mut model.params)?;
    Ok(model)
}

/// A tokenizer may list more tokens than its model has embeddings (the added tokens
/// of a tokenizer converted from GGUF, or a multimodal model's): what must fit are the
/// ids the dataset holds. Refuses the first id past the model's `rows`, or notes that
/// all fit; windows read later are checked against `rows`.
fn check_ids_fit(cfg: &TrainConfig, data: &Dataset, name: &str, rows: usize) -> Result<()> {
    for file in [&data.train, &data.val] {
        if let Some((position, id)) = file.first_outside(rows)? {
            bail!(
                "init_from={name} has {rows} token embeddings, but {} holds token id {id} at \
                 position {position} (dataset {} was tokenized with {} tokens); prepare the \
                 text with the model's own tokenizer: `nanogpt prepare SOURCE --out DIR \
                 --tokenizer {name}`, then dataset=DIR",
                file.path().display(),
                cfg.dataset,
                data.meta.vocab_size
            );
        }
        file.check_vocab(rows)?;
    }
    crate::errln!(
        "note: dataset {} was tokenized with {} tokens, more than the {rows} embeddings of \
         init_from={name}; every id it holds is below {rows}, so it trains",
        cfg.dataset,
        data.meta.vocab_size
    );
    Ok(())
}

/// As in nanoGPT, the architecture of the model a run resumes or fine-tunes wins
/// over the config's: one note names the keys the config sets otherwise.
fn note_ignored_architecture(cfg: &TrainConfig, source: &dyn Display, model: &ModelConfig) {
    let sizes = [
        ("n_layer", cfg.n_layer, model.n_layer),
        ("n_head", cfg.n_head, model.n_head),
        ("n_embd", cfg.n_embd, model.n_embd),
    ];
    let mut ignored: Vec<String> = sizes
        .iter()
        .filter(|(_, ours, theirs)| ours != theirs)
        .map(|(key, ours, theirs)| format!("{key} = {ours} (it has {theirs})"))
        .collect();
    if cfg.bias != model.bias && model.llama.is_none() {
        let has = if model.bias { "biases" } else { "none" };
        ignored.push(format!("bias = {} (it has {has})", cfg.bias));
    }
    if !ignored.is_empty() {
        crate::errln!(
            "note: the architecture comes from {source}: ignoring {} from the config",
            ignored.join(", ")
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::bf16::backend::Offer;
    use crate::model::Dtype;

    fn state(bf16_kernel: Option<&str>) -> CheckpointState {
        CheckpointState {
            model: ModelConfig::preset("gpt2").expect("preset"),
            train_config: serde_json::json!({}),
            iter_num: 1,
            best_val_loss: 1.0,
            adam_step: 1,
            tokenizer: serde_json::json!({}),
            world_size: 1,
            lora: None,
            dataset: None,
            bf16_kernel: bf16_kernel.map(String::from),
            ab_switches: Vec::new(),
        }
    }

    #[test]
    fn a_resume_on_another_bf16_kernel_says_so() {
        let bf16 = TrainConfig {
            dtype: Dtype::Bfloat16,
            ..TrainConfig::default()
        };
        let f32 = TrainConfig::default();
        // A CPU with AVX512-BF16 (AMD: the kernel is the default), no AMX.
        let offer = Offer {
            avx512_bf16: true,
            avx512: true,
            ..Offer::none()
        };
        let avx = Backend::choose(None, offer);
        assert_eq!(avx.kernel(), Kernel::Avx512Bf16);
        let note = |cfg: &TrainConfig, k| other_kernel(cfg, &avx, &state(k));
        assert_eq!(note(&bf16, Some("avx512bf16")), None, "same kernel");
        assert_eq!(note(&bf16, None), None, "an older checkpoint records none");
        assert_eq!(note(&f32, Some("amx")), None, "f32 runs no bf16 products");
        let usable = note(&bf16, Some("f32")).expect("another kernel");
        assert!(
            usable.contains("ran on f32, this run's run on avx512bf16"),
            "{usable}"
        );
        assert!(usable.contains("bf16_kernel = \"f32\""), "{usable}");
        let gone = note(&bf16, Some("amx")).expect("another kernel");
        assert!(gone.contains("amx cannot run here"), "{gone}");
    }

    #[test]
    fn a_resume_with_other_ab_switches_says_so() {
        let ring = vec!["NANOGPT_RING_REDUCE=0".to_string()];
        assert_eq!(other_switches(&[], &[]), None);
        assert_eq!(other_switches(&ring, &ring), None);
        let note = other_switches(&ring, &[]).expect("they differ");
        assert_eq!(
            note,
            "it was trained with the A/B switches NANOGPT_RING_REDUCE=0, this run has none"
        );
    }
}
