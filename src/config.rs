//! Training configuration: nanoGPT's key names, read from defaults, then a TOML
//! file, then `key=value` overrides from the command line.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};
use toml::{Table, Value};

use crate::kernels::bf16::Kernel;
use crate::model::Dtype;

/// The quick-start preset (`configs/train_shakespeare_char.toml`), built in so that
/// `nanogpt train` without arguments works from any directory.
pub const QUICK_START_TOML: &str = include_str!("../configs/train_shakespeare_char.toml");

/// The most activation floats a configuration may need (4 TiB of f32): beyond any
/// machine, and far from overflowing the size arithmetic.
const MAX_ACTIVATION_FLOATS: usize = 1 << 40;

/// nanoGPT settings that only mean something to PyTorch; named in the error.
const PYTORCH_ONLY_KEYS: [&str; 6] = [
    "device",
    "compile",
    "backend",
    "wandb_log",
    "wandb_project",
    "wandb_run_name",
];

/// Where the initial weights come from (the `init_from` key).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum InitFrom {
    /// Fresh GPT-2 initialisation.
    Scratch,
    /// The checkpoint in `out_dir`.
    Resume,
    /// Pretrained weights: a name such as `gpt2` or a Hugging Face model directory.
    Pretrained(String),
}

/// The highest `zero_stage` this build implements.
pub const MAX_ZERO_STAGE: u8 = 3;

/// Every setting of a training run. Keys and defaults follow nanoGPT's train.py
/// unless a field says otherwise; the vocabulary size comes from the dataset's
/// `meta.json`, not from here.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    // I/O
    pub out_dir: PathBuf,
    /// Evaluate every this many iterations; 0 never evaluates.
    pub eval_interval: u64,
    pub log_interval: u64,
    /// Batches per split in each evaluation.
    pub eval_iters: u64,
    /// Evaluate once and exit.
    pub eval_only: bool,
    /// Save a checkpoint at every evaluation, not only when val loss improves.
    pub always_save_checkpoint: bool,
    /// Also write `ckpt-NNNNNN.safetensors` every this many iterations (0: never),
    /// for resuming after a crash; `init_from = "resume"` takes the newest checkpoint.
    pub ckpt_interval: u64,
    /// How many of those interval checkpoints to keep (older ones are deleted once
    /// a newer one is safely written).
    pub keep_last: usize,
    /// Stop the run when this many optimizer steps in a row have a non-finite loss
    /// or gradient norm (each such step is skipped).
    pub max_nonfinite_steps: u64,
    /// `scratch`, `resume`, or pretrained weights (`gpt2`, `gpt2-medium`, ... or a
    /// directory); see [`TrainConfig::init`].
    pub init_from: String,
    // data
    /// A prepared directory, `data/<name>`, or the built-in `shakespeare_char` /
    /// `shakespeare`. Default `shakespeare_char`, the quick start (nanoGPT's is
    /// `openwebtext`, which is not available offline).
    pub dataset: String,
    /// Micro-steps per optimizer step. Default 1, suiting the quick start preset
    /// (nanoGPT's default is 40 = 5 × 8 GPUs; `configs/train_gpt2.toml` sets 48).
    pub gradient_accumulation_steps: usize,
    /// Sequences per micro-step.
    pub batch_size: usize,
    pub block_size: usize,
    // model
    pub n_layer: usize,
    pub n_head: usize,
    pub n_embd: usize,
    pub dropout: f32,
    /// Biases in linear layers and layer norms (nanoGPT's default: false).
    pub bias: bool,
    // AdamW
    pub learning_rate: f64,
    pub max_iters: u64,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    /// Clip gradients to this global norm; 0 disables clipping.
    pub grad_clip: f64,
    // learning-rate schedule: linear warmup, then cosine decay to `min_lr`
    pub decay_lr: bool,
    pub warmup_iters: u64,
    pub lr_decay_iters: u64,
    pub min_lr: f64,
    // system
    pub seed: u64,
    pub dtype: Dtype,
    /// The kernel of bf16's products: `auto` (the fastest this CPU offers, as
    /// measured: AMX, oneDNN, AVX512-BF16 but on Intel, the f32 GEMM), or `amx`,
    /// `avx512bf16`, `onednn`, `f32` to ask for one (falling back to `auto`'s where it
    /// cannot run, with a note). Kernels sum in different orders: checkpoints record it.
    pub bf16_kernel: String,
    /// Keep only each transformer block's input during forward and recompute the
    /// block's activations in backward: about one more forward pass of compute for
    /// one block's activations instead of every block's. Same losses bit for bit.
    pub activation_checkpointing: bool,
    /// Worker threads; 0 uses every core (with several ranks on a host, its share).
    pub threads: usize,
    // multi-node (MPI)
    /// 0: every rank keeps the whole AdamW state; 1: ZeRO-1, the AdamW state is
    /// sharded across ranks (reduce-scatter, local update, all-gather).
    pub zero_stage: u8,
    /// The gradient reduction's numbers on the wire (zero_stage 0 and 1):
    /// `bfloat16` rounds each rank's gradients to bf16 and each partial sum too,
    /// halving the bytes; the result is widened to f32 (docs/multinode.md).
    pub grad_reduce_dtype: Dtype,
    /// Abort the job when a collective waits this many seconds for another rank
    /// (stopped, hung or unreachable); 0 waits forever.
    pub collective_timeout_s: f64,
    /// End the job when a rank has not been heard from for this many seconds (a
    /// heartbeat over TCP between every rank and rank 0: a killed, stopped or
    /// unreachable rank, whatever it was doing); 0 turns the heartbeat's check off.
    pub heartbeat_timeout_s: f64,
    // LoRA (docs/finetune.md)
    /// Rank of the LoRA adapters; 0 (default) trains the whole model.
    pub lora_rank: usize,
    /// The adapters' output is scaled by `lora_alpha / lora_rank` (PEFT's default 8).
    pub lora_alpha: f64,
    /// Dropout on the adapters' input, in training.
    pub lora_dropout: f64,
    /// Comma-separated layers that get adapters: `c_attn`, `attn.c_proj`, `c_fc`,
    /// `mlp.c_proj`.
    pub lora_targets: String,
    /// A PEFT LoRA adapter directory to continue training: the base is `init_from`,
    /// the adapters' settings come from the directory. Empty: none.
    pub adapter: String,
    // multiple-choice accuracy during training (docs/evaluate.md)
    /// Tasks scored during training, each `KIND:PATH` (`hellaswag:FILE.jsonl`,
    /// `choice:FILE.jsonl`): their accuracies go to metrics.jsonl and loss.png.
    pub eval_tasks: Vec<String>,
    /// Score `eval_tasks` every this many iterations (and at the end); 0 (default):
    /// at every loss evaluation (`eval_interval`).
    pub eval_tasks_interval: u64,
    /// Score only the first this many questions of each task; 0 (default): all.
    pub eval_tasks_limit: u64,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            out_dir: PathBuf::from("out"),
            eval_interval: 2000,
            log_interval: 1,
            eval_iters: 200,
            eval_only: false,
            always_save_checkpoint: true,
            ckpt_interval: 0,
            keep_last: 2,
            max_nonfinite_steps: 5,
            init_from: "scratch".to_string(),
            dataset: "shakespeare_char".to_string(),
            gradient_accumulation_steps: 1,
            batch_size: 12,
            block_size: 1024,
            n_layer: 12,
            n_head: 12,
            n_embd: 768,
            dropout: 0.0,
            bias: false,
            learning_rate: 6e-4,
            max_iters: 600_000,
            weight_decay: 0.1,
            beta1: 0.9,
            beta2: 0.95,
            grad_clip: 1.0,
            decay_lr: true,
            warmup_iters: 2000,
            lr_decay_iters: 600_000,
            min_lr: 6e-5,
            seed: 1337,
            dtype: Dtype::Float32,
            bf16_kernel: "auto".to_string(),
            activation_checkpointing: false,
            threads: 0,
            zero_stage: 0,
            grad_reduce_dtype: Dtype::Float32,
            collective_timeout_s: 300.0,
            heartbeat_timeout_s: 10.0,
            lora_rank: 0,
            lora_alpha: 8.0,
            lora_dropout: 0.0,
            lora_targets: "c_attn".to_string(),
            adapter: String::new(),
            eval_tasks: Vec::new(),
            eval_tasks_interval: 0,
            eval_tasks_limit: 0,
        }
    }
}

impl TrainConfig {
    /// Defaults, then the TOML file at `path` (if any), then `key=value`
    /// overrides; the result is validated.
    pub fn load(path: Option<&Path>, overrides: &[String]) -> Result<TrainConfig> {
        match path {
            None => Self::parse("", "defaults", overrides),
            Some(path) => {
                let bytes =
                    crate::fsutil::read_limited(path, "config file", crate::fsutil::JSON_LIMIT)?;
                let text = String::from_utf8(bytes).map_err(|e| {
                    anyhow!(
                        "config file {} is not UTF-8 text (invalid byte at offset {}); save it \
                         as UTF-8",
                        path.display(),
                        e.utf8_error().valid_up_to()
                    )
                })?;
                Self::parse(&text, &path.display().to_string(), overrides)
            }
        }
    }

    /// The built-in quick start (the Shakespeare char model of nanoGPT's README),
    /// with `key=value` overrides applied.
    pub fn quick_start_with(overrides: &[String]) -> Result<TrainConfig> {
        Self::parse(
            QUICK_START_TOML,
            "built-in configs/train_shakespeare_char.toml",
            overrides,
        )
    }

    /// Defaults, then the TOML `text` (from `origin`, named in errors), then
    /// overrides; validated.
    pub fn parse(text: &str, origin: &str, overrides: &[String]) -> Result<TrainConfig> {
        let defaults = Table::try_from(TrainConfig::default())
            .context("internal error: the defaults do not serialise")?;
        let mut merged = defaults.clone();
        let file: Table = toml::from_str(text).map_err(|e| toml_syntax_error(origin, text, &e))?;
        for (key, value) in file {
            let checked = check_entry(&defaults, &key, value)
                .with_context(|| file_location(origin, text, &key))?;
            merged.insert(key, checked);
        }
        for raw in overrides {
            let (key, value) = parse_override(&defaults, raw)
                .with_context(|| format!("command-line override `{raw}`"))?;
            merged.insert(key, value);
        }
        let config: TrainConfig = Value::Table(merged)
            .try_into()
            .map_err(|e| anyhow!("{origin}: {}", e.message()))?;
        config
            .validate()
            .with_context(|| format!("invalid configuration ({origin} and overrides)"))?;
        Ok(config)
    }

    /// Checks values that are well-typed but impossible; the error names each key
    /// at fault and what it allows.
    pub fn validate(&self) -> Result<()> {
        let mut problems = Vec::new();
        self.check_sizes(&mut problems);
        self.check_optimizer(&mut problems);
        self.check_schedule(&mut problems);
        self.check_names(&mut problems);
        self.check_distributed(&mut problems);
        self.check_tasks(&mut problems);
        if let Err(e) = self.lora() {
            problems.push(e.to_string());
        }
        match problems.is_empty() {
            true => Ok(()),
            false => bail!(problems.join("; ")),
        }
    }

    fn check_sizes(&self, problems: &mut Vec<String>) {
        let sizes = [
            ("batch_size", self.batch_size),
            ("block_size", self.block_size),
            ("n_layer", self.n_layer),
            ("n_head", self.n_head),
            ("n_embd", self.n_embd),
            (
                "gradient_accumulation_steps",
                self.gradient_accumulation_steps,
            ),
            ("log_interval", self.log_interval as usize),
            ("keep_last", self.keep_last),
            ("max_nonfinite_steps", self.max_nonfinite_steps as usize),
        ];
        for (key, value) in sizes {
            if value == 0 {
                problems.push(format!("`{key}` must be at least 1, got 0"));
            }
        }
        if self.n_head > 0 && !self.n_embd.is_multiple_of(self.n_head) {
            problems.push(format!(
                "`n_embd` ({}) must be a multiple of `n_head` ({})",
                self.n_embd, self.n_head
            ));
        }
        if problems.is_empty() {
            self.check_magnitudes(problems);
        }
        if !(0.0..1.0).contains(&self.dropout) {
            problems.push(format!("`dropout` must be in [0, 1), got {}", self.dropout));
        }
        if self.eval_iters == 0 && (self.eval_interval > 0 || self.eval_only) {
            problems.push(
                "`eval_iters` must be at least 1 when evaluating (set `eval_interval = 0` \
                 to never evaluate)"
                    .to_string(),
            );
        }
    }

    /// The model this config trains from scratch, on a vocabulary of `vocab_size`.
    pub fn model_config(&self, vocab_size: usize) -> crate::model::ModelConfig {
        crate::model::ModelConfig {
            vocab_size,
            block_size: self.block_size,
            n_layer: self.n_layer,
            n_head: self.n_head,
            n_embd: self.n_embd,
            bias: self.bias,
            dropout: self.dropout,
            llama: None,
        }
    }

    /// Refuses sizes whose model or activations could not be held (and whose size
    /// arithmetic would overflow): a typo such as `n_embd = 76800000`.
    fn check_magnitudes(&self, problems: &mut Vec<String>) {
        let model = crate::model::ModelConfig {
            vocab_size: 1,
            block_size: self.block_size,
            n_layer: self.n_layer,
            n_head: self.n_head,
            n_embd: self.n_embd,
            bias: self.bias,
            dropout: 0.0,
            llama: None,
        };
        if let Err(e) = model.validate() {
            problems.push(format!("{e}; check `n_layer`, `n_embd` and `block_size`"));
            return;
        }
        // Floats of the largest activations: ~20 C-wide rows per token and layer, and
        // the attention matrix (B, NH, T, T) per layer.
        let (b, t, c, l) = (self.batch_size, self.block_size, self.n_embd, self.n_layer);
        let activations = b
            .checked_mul(t)
            .and_then(|bt| bt.checked_mul(c)?.checked_mul(l)?.checked_mul(20))
            .and_then(|rows| {
                let attention = b.checked_mul(self.n_head)?.checked_mul(t)?.checked_mul(t)?;
                rows.checked_add(attention.checked_mul(l)?.checked_mul(2)?)
            });
        let tokens = self.tokens_per_iter_checked();
        if activations.is_none_or(|a| a > MAX_ACTIVATION_FLOATS) || tokens.is_none() {
            problems.push(format!(
                "`batch_size` ({b}) × `block_size` ({t}) is too large for this model's \
                 activations (n_layer {l}, n_embd {c}); lower them"
            ));
        }
    }

    fn check_optimizer(&self, problems: &mut Vec<String>) {
        if !(self.learning_rate.is_finite() && self.learning_rate > 0.0) {
            problems.push(format!(
                "`learning_rate` must be a positive number, got {}",
                self.learning_rate
            ));
        }
        let non_negative = [
            ("weight_decay", self.weight_decay),
            ("grad_clip", self.grad_clip),
            ("min_lr", self.min_lr),
        ];
        for (key, value) in non_negative {
            if !(value.is_finite() && value >= 0.0) {
                problems.push(format!("`{key}` must be a number ≥ 0, got {value}"));
            }
        }
        for (key, value) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&value) {
                problems.push(format!("`{key}` must be in [0, 1), got {value}"));
            }
        }
    }

    fn check_schedule(&self, problems: &mut Vec<String>) {
        if !self.decay_lr {
            return;
        }
        if self.min_lr > self.learning_rate {
            problems.push(format!(
                "`min_lr` ({}) must not exceed `learning_rate` ({}) when `decay_lr` is true",
                self.min_lr, self.learning_rate
            ));
        }
        if self.warmup_iters > self.lr_decay_iters {
            problems.push(format!(
                "`warmup_iters` ({}) must not exceed `lr_decay_iters` ({}) when `decay_lr` \
                 is true",
                self.warmup_iters, self.lr_decay_iters
            ));
        }
    }

    fn check_names(&self, problems: &mut Vec<String>) {
        let names = [
            ("out_dir", self.out_dir.as_os_str().is_empty()),
            ("dataset", self.dataset.is_empty()),
            ("init_from", self.init_from.is_empty()),
        ];
        for (key, empty) in names {
            if empty {
                problems.push(format!("`{key}` must not be empty"));
            }
        }
        if Kernel::parse_request(&self.bf16_kernel).is_none() {
            problems.push(format!(
                "`bf16_kernel` must be one of {}, got \"{}\"",
                Kernel::REQUEST_NAMES.join(", "),
                self.bf16_kernel
            ));
        }
    }

    fn check_distributed(&self, problems: &mut Vec<String>) {
        if self.zero_stage > MAX_ZERO_STAGE {
            problems.push(format!(
                "`zero_stage` must be 0 (replicated), 1 (sharded AdamW moments), 2 (and \
                 gradients) or 3 (and parameters), got {}",
                self.zero_stage
            ));
        }
        if self.zero_stage >= 3 && (self.lora_rank > 0 || !self.adapter.is_empty()) {
            problems.push(
                "`zero_stage = 3` shards the whole model, not LoRA adapters: use \
                 zero_stage=2 (or lower) with LoRA"
                    .into(),
            );
        }
        if self.zero_stage >= 2 && self.grad_reduce_dtype == Dtype::Bfloat16 {
            problems.push(
                "`grad_reduce_dtype = \"bfloat16\"` works with zero_stage 0 and 1 (stages 2 and \
                 3 reduce straight from the gradients, with no send buffer to round into): use \
                 zero_stage=1 or grad_reduce_dtype=float32"
                    .into(),
            );
        }
        let t = self.collective_timeout_s;
        if !(t.is_finite() && t >= 0.0) {
            problems.push(format!(
                "`collective_timeout_s` must be a number of seconds ≥ 0 (0 = no timeout), got {t}"
            ));
        }
        let t = self.heartbeat_timeout_s;
        if !(t.is_finite() && (t == 0.0 || t >= 1.0)) {
            problems.push(format!(
                "`heartbeat_timeout_s` must be a number of seconds ≥ 1 (0 = no heartbeat check), \
                 got {t}"
            ));
        }
    }

    /// The kernel `bf16_kernel` asks for: None for `auto` (checked by `validate`).
    pub fn bf16_kernel_request(&self) -> Option<Kernel> {
        Kernel::parse_request(&self.bf16_kernel).flatten()
    }

    fn check_tasks(&self, problems: &mut Vec<String>) {
        if self.eval_tasks.is_empty() {
            return;
        }
        if let Err(e) = self.tasks() {
            problems.push(format!("{e:#}"));
        }
        if self.tasks_interval() == 0 {
            problems.push(
                "`eval_tasks` are set but never scored (`eval_tasks_interval` and \
                 `eval_interval` are 0): set eval_tasks_interval to how often to score them"
                    .into(),
            );
        }
        if self.zero_stage >= 3 {
            problems.push(
                "`eval_tasks` need the whole model on every rank, which `zero_stage = 3` \
                 shards: use zero_stage=2 (or lower), or score the checkpoints with \
                 `nanogpt eval --task`"
                    .into(),
            );
        }
    }

    /// The tasks of `eval_tasks`; an error names the key and the entry at fault.
    pub fn tasks(&self) -> Result<Vec<crate::tasks::TaskSpec>> {
        let mut specs: Vec<crate::tasks::TaskSpec> = Vec::new();
        for entry in &self.eval_tasks {
            let spec = crate::tasks::TaskSpec::parse(entry).context("`eval_tasks`")?;
            if specs.iter().any(|s| s.name() == spec.name()) {
                bail!(
                    "`eval_tasks`: two tasks would be reported as `{}`; give each file its \
                     own name",
                    spec.name()
                );
            }
            specs.push(spec);
        }
        Ok(specs)
    }

    /// How often `eval_tasks` are scored (iterations); 0: never.
    pub fn tasks_interval(&self) -> u64 {
        match self.eval_tasks_interval {
            0 => self.eval_interval,
            n => n,
        }
    }

    /// The LoRA settings (`lora_rank > 0`), or None for full training; an error
    /// names the `lora_*` key at fault.
    pub fn lora(&self) -> Result<Option<crate::model::lora::LoraConfig>> {
        if self.lora_rank == 0 {
            return Ok(None);
        }
        let (alpha, p) = (self.lora_alpha as f32, self.lora_dropout as f32);
        crate::model::lora::LoraConfig::new(self.lora_rank, alpha, p, &self.lora_targets).map(Some)
    }

    /// With `world_size` ranks: `gradient_accumulation_steps` counts the micro-steps
    /// of the whole job (nanoGPT's meaning), so every rank must get the same number.
    pub fn check_world_size(&self, world_size: usize) -> Result<()> {
        let a = self.gradient_accumulation_steps;
        if world_size > 1 && !a.is_multiple_of(world_size) {
            let lower = a / world_size * world_size;
            let upper = lower + world_size;
            let options = if lower > 0 {
                format!("{lower} or {upper}")
            } else {
                upper.to_string()
            };
            bail!(
                "`gradient_accumulation_steps` ({a}) is the number of micro-steps per optimizer \
                 step across all ranks and must be a multiple of the number of ranks \
                 ({world_size}); use {options}, or run on a number of ranks that divides {a}"
            );
        }
        Ok(())
    }

    /// `init_from` interpreted.
    pub fn init(&self) -> InitFrom {
        match self.init_from.as_str() {
            "scratch" => InitFrom::Scratch,
            "resume" => InitFrom::Resume,
            other => InitFrom::Pretrained(other.to_string()),
        }
    }

    /// Tokens per optimizer step on one process (nanoGPT prints this).
    pub fn tokens_per_iter(&self) -> usize {
        self.gradient_accumulation_steps * self.batch_size * self.block_size
    }

    fn tokens_per_iter_checked(&self) -> Option<usize> {
        self.gradient_accumulation_steps
            .checked_mul(self.batch_size)?
            .checked_mul(self.block_size)
    }

    /// Every valid key, sorted.
    pub fn keys() -> Vec<String> {
        Table::try_from(TrainConfig::default())
            .map(|t| t.keys().cloned().collect())
            .unwrap_or_default()
    }
}

/// A TOML syntax error on one line: "config.toml line 3 column 9: invalid TOML: ...".
fn toml_syntax_error(origin: &str, text: &str, err: &toml::de::Error) -> anyhow::Error {
    let place = match err.span() {
        Some(span) => {
            let before = &text.as_bytes()[..span.start.min(text.len())];
            let line = before.iter().filter(|&&b| b == b'\n').count() + 1;
            let line_start = before
                .iter()
                .rposition(|&b| b == b'\n')
                .map_or(0, |i| i + 1);
            let column = before.len() - line_start + 1;
            format!("{origin} line {line} column {column}")
        }
        None => origin.to_string(),
    };
    let message = err.message().trim().replace('\n', " ");
    anyhow!("{place}: invalid TOML: {message}; fix the syntax (key = value, strings in quotes)")
}

/// "config.toml line 3" for the line setting `key`, or just the origin.
fn file_location(origin: &str, text: &str, key: &str) -> String {
    let line = text.lines().position(|line| {
        let line = line.trim_start().trim_start_matches(['"', '\'']);
        line.strip_prefix(key).is_some_and(|rest| {
            rest.trim_start_matches(['"', '\''])
                .trim_start()
                .starts_with('=')
        })
    });
    match line {
        Some(n) => format!("{origin} line {}", n + 1),
        None => origin.to_string(),
    }
}

/// Checks one user-given `key = value` against the key's default; returns the
/// value in the key's type (an integer given for a float key becomes a float).
fn check_entry(defaults: &Table, key: &str, value: Value) -> Result<Value> {
    let Some(default) = defaults.get(key) else {
        return Err(unknown_key(defaults, key));
    };
    let value = match (default, value) {
        (Value::Integer(_), Value::Integer(i)) if i < 0 => {
            bail!("key `{key}` must be a non-negative integer, got {i}")
        }
        (Value::Float(_), Value::Integer(i)) => Value::Float(i as f64),
        // A list key given one string: a list of that one.
        (Value::Array(_), Value::String(s)) => Value::Array(vec![Value::String(s)]),
        (Value::Array(_), Value::Array(items)) => match items.iter().all(Value::is_str) {
            true => Value::Array(items),
            false => bail!(
                "key `{key}` expects a list of strings, e.g. [\"hellaswag:data/hellaswag_val.jsonl\"]"
            ),
        },
        (d, v) if std::mem::discriminant(d) == std::mem::discriminant(&v) => v,
        (d, v) => bail!(
            "key `{key}` expects {}, got {} {v}",
            type_name(d),
            v.type_str()
        ),
    };
    let names: &[&str] = match key {
        "dtype" | "grad_reduce_dtype" => &Dtype::NAMES,
        "bf16_kernel" => &Kernel::REQUEST_NAMES,
        _ => &[],
    };
    let name = value.as_str().unwrap_or_default();
    if !names.is_empty() && !names.contains(&name) {
        bail!(
            "key `{key}` must be one of {}, got \"{name}\"",
            names.join(", ")
        );
    }
    Ok(value)
}

fn type_name(value: &Value) -> &'static str {
    match value {
        Value::Integer(_) => "a non-negative integer",
        Value::Float(_) => "a number",
        Value::Boolean(_) => "true or false",
        Value::String(_) => "a string",
        Value::Array(_) => "a list of strings",
        _ => "a value of another type",
    }
}

/// Reads `key=value` (or nanoGPT's `--key=value`), typing the value after the
/// key's default: strings may be bare (`init_from=resume`), booleans may be
/// Python-style (`True`).
fn parse_override(defaults: &Table, raw: &str) -> Result<(String, Value)> {
    let Some((key, text)) = raw.trim_start_matches("--").split_once('=') else {
        bail!("expected key=value, e.g. max_iters=100");
    };
    let (key, text) = (key.trim(), text.trim());
    let Some(default) = defaults.get(key) else {
        return Err(unknown_key(defaults, key));
    };
    let value = match default {
        Value::String(_) => Value::String(unquote(text)),
        // `key=["a", "b"]`, `key=[]`, or one bare or quoted string.
        Value::Array(_) => match parse_toml_value(text) {
            Some(v @ Value::Array(_)) => v,
            _ => Value::String(unquote(text)),
        },
        Value::Boolean(_) => match text.to_ascii_lowercase().as_str() {
            "true" => Value::Boolean(true),
            "false" => Value::Boolean(false),
            _ => bail!("key `{key}` expects true or false, got `{text}`"),
        },
        Value::Float(_) => match parse_toml_value(text) {
            Some(v @ (Value::Float(_) | Value::Integer(_))) => v,
            _ => match text.parse::<f64>() {
                Ok(x) => Value::Float(x),
                Err(_) => bail!("key `{key}` expects a number, got `{text}`"),
            },
        },
        _ => match parse_toml_value(text) {
            Some(v @ Value::Integer(_)) => v,
            _ => bail!("key `{key}` expects {}, got `{text}`", type_name(default)),
        },
    };
    Ok((key.to_string(), check_entry(defaults, key, value)?))
}

fn parse_toml_value(text: &str) -> Option<Value> {
    let mut table: Table = toml::from_str(&format!("v = {text}")).ok()?;
    table.remove("v")
}

/// A TOML-quoted string's contents, or the text itself.
fn unquote(text: &str) -> String {
    match parse_toml_value(text) {
        Some(Value::String(s)) if text.starts_with(['"', '\'']) => s,
        _ => text.to_string(),
    }
}

fn unknown_key(defaults: &Table, key: &str) -> anyhow::Error {
    if PYTORCH_ONLY_KEYS.contains(&key) {
        return anyhow!(
            "key `{key}` is a PyTorch setting of nanoGPT with no meaning here; remove it"
        );
    }
    let closest = defaults
        .keys()
        .min_by_key(|valid| edit_distance(key, valid))
        .map(String::as_str)
        .unwrap_or_default();
    let all: Vec<&str> = defaults.keys().map(String::as_str).collect();
    anyhow!(
        "unknown key `{key}`; did you mean `{closest}`? (valid keys: {})",
        all.join(", ")
    )
}

/// Levenshtein distance between two short strings.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let substitute = diagonal + usize::from(ca != cb);
            diagonal = row[j + 1];
            row[j + 1] = substitute.min(row[j] + 1).min(row[j + 1] + 1);
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn overrides(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    fn err_of(text: &str, over: &[&str]) -> String {
        format!(
            "{:#}",
            TrainConfig::parse(text, "test.toml", &overrides(over)).unwrap_err()
        )
    }

    #[test]
    fn defaults_follow_nanogpt() {
        let c = TrainConfig::load(None, &[]).unwrap();
        assert_eq!(c, TrainConfig::default());
        assert_eq!(
            (c.batch_size, c.block_size, c.n_layer, c.n_embd),
            (12, 1024, 12, 768)
        );
        assert_eq!((c.learning_rate, c.min_lr, c.beta2), (6e-4, 6e-5, 0.95));
        assert_eq!((c.seed, c.gradient_accumulation_steps), (1337, 1));
        assert_eq!(c.tokens_per_iter(), 12 * 1024);
        assert_eq!(c.init(), InitFrom::Scratch);
    }

    #[test]
    fn every_preset_loads_and_validates() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs");
        let mut count = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "toml") {
                TrainConfig::load(Some(&path), &[])
                    .unwrap_or_else(|e| panic!("{}: {e:#}", path.display()));
                count += 1;
            }
        }
        assert!(count >= 3, "{count} presets");
    }

    #[test]
    fn presets_hold_nanogpt_values() {
        let q = TrainConfig::quick_start_with(&[]).unwrap();
        assert_eq!(
            (q.n_layer, q.n_head, q.n_embd, q.block_size, q.batch_size),
            (4, 4, 128, 64, 12)
        );
        assert_eq!(
            (q.max_iters, q.lr_decay_iters, q.eval_iters),
            (2000, 2000, 20)
        );
        assert_eq!((q.learning_rate, q.min_lr, q.beta2), (1e-3, 1e-4, 0.99));
        assert_eq!(q.dataset, "shakespeare_char");
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let gpt2 = TrainConfig::load(Some(&root.join("configs/train_gpt2.toml")), &[]).unwrap();
        assert_eq!(
            (gpt2.gradient_accumulation_steps, gpt2.max_iters),
            (48, 600_000)
        );
        assert_eq!(gpt2.tokens_per_iter(), 491_520);
        let ft =
            TrainConfig::load(Some(&root.join("configs/finetune_shakespeare.toml")), &[]).unwrap();
        assert_eq!(ft.init(), InitFrom::Pretrained("gpt2".into()));
        assert_eq!(
            (
                ft.learning_rate,
                ft.decay_lr,
                ft.gradient_accumulation_steps
            ),
            (3e-5, false, 36)
        );
        // The examples run unchanged on 1 to 4 ranks (hosts).
        for ranks in 1..=4 {
            gpt2.check_world_size(ranks).unwrap();
            ft.check_world_size(ranks).unwrap();
        }
    }

    #[test]
    fn overrides_accept_bare_strings_python_booleans_and_dashes() {
        let c = TrainConfig::parse(
            "max_iters = 5000\n",
            "t",
            &overrides(&[
                "max_iters=100",
                "init_from=resume",
                "--eval_only=True",
                "learning_rate=1e-3",
                "min_lr=.0001",
                "out_dir='out x'",
                "dtype=bfloat16",
                "dropout=0",
            ]),
        )
        .unwrap();
        assert_eq!(c.max_iters, 100);
        assert_eq!(c.init(), InitFrom::Resume);
        assert!(c.eval_only);
        assert_eq!((c.learning_rate, c.min_lr, c.dropout), (1e-3, 1e-4, 0.0));
        assert_eq!(c.out_dir, PathBuf::from("out x"));
        assert_eq!(c.dtype, Dtype::Bfloat16);
    }

    #[test]
    fn file_integer_for_float_key_is_accepted() {
        let c = TrainConfig::parse("learning_rate = 1\nmin_lr = 0", "t", &[]).unwrap();
        assert_eq!((c.learning_rate, c.min_lr), (1.0, 0.0));
    }

    #[test]
    fn unknown_key_suggests_closest() {
        let err = err_of("batch_size = 4\nmax_iter = 10\n", &[]);
        assert!(err.contains("test.toml line 2"), "{err}");
        assert!(
            err.contains("`max_iter`") && err.contains("did you mean `max_iters`"),
            "{err}"
        );
        let err = err_of("", &["lerning_rate=1"]);
        assert!(err.contains("did you mean `learning_rate`"), "{err}");
        let err = err_of("compile = true", &[]);
        assert!(
            err.contains("`compile`") && err.contains("PyTorch"),
            "{err}"
        );
    }

    #[test]
    fn wrong_types_name_key_type_and_value() {
        let err = err_of("max_iters = \"lots\"", &[]);
        assert!(err.contains("test.toml line 1"), "{err}");
        assert!(
            err.contains("`max_iters` expects a non-negative integer, got string \"lots\""),
            "{err}"
        );
        let err = err_of("", &["max_iters=abc"]);
        assert!(
            err.contains("max_iters=abc") && err.contains("got `abc`"),
            "{err}"
        );
        let err = err_of("", &["bias=yes"]);
        assert!(err.contains("`bias` expects true or false"), "{err}");
        let err = err_of("batch_size = -2", &[]);
        assert!(
            err.contains("`batch_size` must be a non-negative integer, got -2"),
            "{err}"
        );
        let err = err_of("", &["dtype=float16"]);
        assert!(
            err.contains("`dtype` must be one of float32, bfloat16"),
            "{err}"
        );
        let err = err_of("", &["bf16_kernel=tpu"]);
        assert!(
            err.contains("`bf16_kernel` must be one of auto, amx, avx512bf16, onednn, f32"),
            "{err}"
        );
        let f32 = TrainConfig::parse("bf16_kernel = \"f32\"", "t", &[]).unwrap();
        assert_eq!(f32.bf16_kernel_request(), Some(Kernel::F32));
        assert_eq!(TrainConfig::default().bf16_kernel_request(), None);
        let built = TrainConfig {
            bf16_kernel: "fast".into(),
            ..TrainConfig::default()
        };
        let err = built.validate().unwrap_err().to_string();
        assert!(err.contains("`bf16_kernel` must be one of"), "{err}");
        let err = err_of("", &["max_iters"]);
        assert!(err.contains("key=value"), "{err}");
    }

    #[test]
    fn toml_syntax_errors_name_file_and_line() {
        let err = err_of("batch_size = 4\nblock_size = = 3\n", &[]);
        assert!(
            err.contains("test.toml line 2 column 14: invalid TOML"),
            "{err}"
        );
        assert!(!err.contains('\n'), "one line: {err}");
    }

    #[test]
    fn impossible_values_are_refused_by_key() {
        let cases: [(&[&str], &str); 12] = [
            (&["batch_size=0"], "`batch_size` must be at least 1"),
            (
                &["n_embd=4000000000000", "n_head=1"],
                "the model is too large",
            ),
            (&["n_layer=100000"], "n_layer 100000 is too large"),
            (
                &["block_size=1000000", "batch_size=10000000"],
                "`batch_size` (10000000) × `block_size` (1000000) is too large",
            ),
            (
                &["n_embd=100", "n_head=12"],
                "`n_embd` (100) must be a multiple of `n_head` (12)",
            ),
            (&["dropout=1.0"], "`dropout` must be in [0, 1)"),
            (
                &["min_lr=1", "learning_rate=0.1"],
                "`min_lr` (1) must not exceed `learning_rate`",
            ),
            (
                &["warmup_iters=10", "lr_decay_iters=5"],
                "`warmup_iters` (10) must not exceed",
            ),
            (&["eval_iters=0"], "`eval_iters` must be at least 1"),
            (
                &["learning_rate=0"],
                "`learning_rate` must be a positive number",
            ),
            (&["beta2=1"], "`beta2` must be in [0, 1)"),
            (&["dataset=''"], "`dataset` must not be empty"),
        ];
        for (over, expected) in cases {
            let err = err_of("", over);
            assert!(err.contains(expected), "{over:?}: {err}");
        }
        // Off switches make the related checks moot.
        TrainConfig::parse("", "t", &overrides(&["eval_iters=0", "eval_interval=0"])).unwrap();
        TrainConfig::parse(
            "",
            "t",
            &overrides(&["decay_lr=False", "min_lr=1", "learning_rate=0.1"]),
        )
        .unwrap();
    }

    #[test]
    fn distributed_keys_are_checked() {
        let c = TrainConfig::parse("zero_stage = 1\ncollective_timeout_s = 20", "t", &[]).unwrap();
        assert_eq!((c.zero_stage, c.collective_timeout_s), (1, 20.0));
        assert!(err_of("", &["zero_stage=4"]).contains("`zero_stage` must be 0"));
        for stage in ["zero_stage=2", "zero_stage=3"] {
            assert!(
                TrainConfig::parse("", "t", &overrides(&[stage])).is_ok(),
                "{stage}"
            );
        }
        let bf16 = overrides(&["zero_stage=3", "dtype=bfloat16"]);
        assert!(
            TrainConfig::parse("", "t", &bf16).is_ok(),
            "bf16 at stage 3"
        );
        let wire = TrainConfig::parse("grad_reduce_dtype = \"bfloat16\"", "t", &[]).unwrap();
        assert_eq!(wire.grad_reduce_dtype, Dtype::Bfloat16);
        let wire = err_of("", &["zero_stage=2", "grad_reduce_dtype=bfloat16"]);
        assert!(
            wire.contains("use zero_stage=1 or grad_reduce_dtype=float32"),
            "{wire}"
        );
        let wire = err_of("", &["grad_reduce_dtype=float16"]);
        assert!(
            wire.contains("`grad_reduce_dtype` must be one of float32"),
            "{wire}"
        );
        let lora = err_of("", &["zero_stage=3", "lora_rank=4"]);
        assert!(lora.contains("not LoRA adapters"), "{lora}");
        assert!(TrainConfig::parse("", "t", &overrides(&["zero_stage=2", "lora_rank=4"])).is_ok());
        let err = err_of("", &["collective_timeout_s=-1"]);
        assert!(err.contains("`collective_timeout_s` must be"), "{err}");
        let err = err_of("", &["heartbeat_timeout_s=0.5"]);
        assert!(err.contains("`heartbeat_timeout_s` must be"), "{err}");
        let c =
            TrainConfig::parse("", "t", &overrides(&["gradient_accumulation_steps=5"])).unwrap();
        c.check_world_size(1).unwrap();
        c.check_world_size(5).unwrap();
        let err = c.check_world_size(2).unwrap_err().to_string();
        assert!(
            err.contains("multiple of the number of ranks (2)") && err.contains("use 4 or 6"),
            "{err}"
        );
        let err = c.check_world_size(8).unwrap_err().to_string();
        assert!(err.contains("use 8,"), "{err}");
    }

    #[test]
    fn eval_task_keys_are_checked() {
        let c = TrainConfig::parse(
            "eval_tasks = [\"hellaswag:h.jsonl\", \"choice:d/arc.jsonl\"]\neval_tasks_limit = 50",
            "t",
            &[],
        )
        .unwrap();
        let specs = c.tasks().unwrap();
        assert_eq!(specs.len(), 2);
        assert_eq!(
            (specs[1].name(), c.eval_tasks_limit),
            ("choice/arc".into(), 50)
        );
        assert_eq!(c.tasks_interval(), c.eval_interval);
        // On the command line: one bare spec, or a TOML list.
        let one = TrainConfig::parse("", "t", &overrides(&["eval_tasks=hellaswag:x.jsonl"]));
        assert_eq!(
            one.unwrap().eval_tasks,
            vec!["hellaswag:x.jsonl".to_string()]
        );
        let two = overrides(&[
            "eval_tasks=['choice:a.jsonl', 'choice:b.jsonl']",
            "eval_tasks_interval=7",
        ]);
        let two = TrainConfig::parse("", "t", &two).unwrap();
        assert_eq!((two.eval_tasks.len(), two.tasks_interval()), (2, 7));
        let cases: [(&[&str], &str); 6] = [
            (
                &["eval_tasks=mmlu:x.jsonl"],
                "`eval_tasks`: task `mmlu:x.jsonl` is not KIND:PATH",
            ),
            (
                &["eval_tasks=hellaswag:"],
                "names no file after `hellaswag:`",
            ),
            (
                &["eval_tasks=['choice:a/x.jsonl', 'choice:b/x.jsonl']"],
                "two tasks would be reported as `choice/x`",
            ),
            (
                &["eval_tasks=[1]"],
                "`eval_tasks` expects a list of strings",
            ),
            (
                &["eval_tasks=choice:x.jsonl", "eval_interval=0"],
                "never scored (`eval_tasks_interval` and `eval_interval` are 0)",
            ),
            (
                &["eval_tasks=choice:x.jsonl", "zero_stage=3"],
                "`eval_tasks` need the whole model on every rank",
            ),
        ];
        for (over, expected) in cases {
            let err = err_of("", over);
            assert!(
                err.contains(expected) && !err.contains('\n'),
                "{over:?}: {err}"
            );
        }
        let err = err_of("eval_tasks_limit = -1", &[]);
        assert!(
            err.contains("`eval_tasks_limit` must be a non-negative integer"),
            "{err}"
        );
        // With no tasks, the interval alone is fine.
        TrainConfig::parse(
            "",
            "t",
            &overrides(&["eval_interval=0", "eval_tasks_interval=0"]),
        )
        .unwrap();
    }

    #[test]
    fn edit_distance_counts_edits() {
        assert_eq!(edit_distance("max_iter", "max_iters"), 1);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("", "abc"), 3);
    }

    #[test]
    fn checkpoint_and_fault_keys_are_checked() {
        let cfg = TrainConfig::default();
        assert_eq!(
            (cfg.ckpt_interval, cfg.keep_last, cfg.max_nonfinite_steps),
            (0, 2, 5)
        );
        for key in ["keep_last", "max_nonfinite_steps"] {
            let err = TrainConfig::parse("", "test", &[format!("{key}=0")]).unwrap_err();
            assert!(
                format!("{err:#}").contains(&format!("`{key}` must be at least 1, got 0")),
                "{err:#}"
            );
        }
        let cfg = TrainConfig::parse("ckpt_interval = 500\nkeep_last = 3", "test", &[]).unwrap();
        assert_eq!((cfg.ckpt_interval, cfg.keep_last), (500, 3));
    }

    #[test]
    fn keys_list_every_field() {
        let keys = TrainConfig::keys();
        assert_eq!(keys.len(), 46);
        for key in [
            "gradient_accumulation_steps",
            "ckpt_interval",
            "keep_last",
            "max_nonfinite_steps",
            "heartbeat_timeout_s",
        ] {
            assert!(keys.contains(&key.to_string()), "{key}");
        }
    }
}
