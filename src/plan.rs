//! The memory plan of a training run: the peak resident memory each rank will need,
//! part by part, against the memory this host has available.
//!
//! Every size comes from the function the allocation itself uses — the parameter
//! layout (weights, gradients, bf16 copy), the gradient plan of [`crate::dist`]
//! (optimizer shard, communication buffers), the activation arena's own constructor
//! counting instead of allocating — so the plan cannot drift from what training
//! allocates; the unit tests compare each part with the buffers a real run holds.
//! With LoRA the trained arena is the adapters' ([`LoraLayout`]) and the frozen base,
//! which has no gradients or moments, a part of its own.
//! What no buffer accounts for (the program, thread stacks, GEMM packing, data
//! batches) is a measured constant, [`BASELINE_BYTES`].

use crate::checkpoint::Checkpoint;
use crate::config::{InitFrom, TrainConfig};
use crate::data::{self, Meta};
use crate::dist::{ring_scratch_len, save_buffer_len, GradPlan, Reduce, RINGS_IN_FLIGHT};
use crate::kernels::bf16::Backend;
use crate::model::activations::Activations;
use crate::model::lora::{Frozen, LoraConfig, LoraLayout};
use crate::model::packs::Packs;
use crate::model::{grad_buckets_of, Dtype, ModelConfig, ParamLayout};
use anyhow::Result;
use serde::Serialize;

/// Resident memory of a training process besides its buffers: the binary and its
/// libraries, thread stacks, the GEMM's packing buffers, batches, evaluation and logs.
/// Measured as the peak RSS of `train` on a 1-layer, 32-wide model (24.4 MB; `bench`
/// of the same model: 7.8 MB); see docs/PERFORMANCE.md.
pub const BASELINE_BYTES: u64 = 24 << 20;

/// The settings that decide a rank's memory.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanInput {
    pub model: ModelConfig,
    pub batch_size: usize,
    pub block_size: usize,
    pub dtype: Dtype,
    pub activation_checkpointing: bool,
    pub zero_stage: u8,
    pub world_size: usize,
    /// Ranks sharing this host's memory.
    pub ranks_per_host: usize,
    /// LoRA: the adapters trained on the frozen model. None: full training.
    pub lora: Option<LoraConfig>,
    /// Micro-steps per optimizer step on each rank.
    pub micro_steps: usize,
    /// The gradients' values on the wire (`grad_reduce_dtype`).
    pub grad_reduce_dtype: Dtype,
    /// The kernel of the bf16 products: whether the model packs its weights or keeps
    /// a rounded copy.
    pub backend: Backend,
}

impl PlanInput {
    /// The run of `cfg` with `model` on `world_size` ranks, `ranks_per_host` per host,
    /// its bf16 products on `backend`.
    pub fn of(
        cfg: &TrainConfig,
        model: ModelConfig,
        world_size: usize,
        ranks_per_host: usize,
        backend: &Backend,
    ) -> PlanInput {
        PlanInput {
            batch_size: cfg.batch_size,
            block_size: cfg.block_size,
            dtype: cfg.dtype,
            activation_checkpointing: cfg.activation_checkpointing,
            zero_stage: cfg.zero_stage,
            world_size,
            ranks_per_host: ranks_per_host.max(1),
            lora: lora_of(cfg, &model),
            micro_steps: cfg.gradient_accumulation_steps / world_size.max(1),
            grad_reduce_dtype: cfg.grad_reduce_dtype,
            backend: *backend,
            model,
        }
    }
}

/// The adapters a run of `cfg` trains, found as `train` finds them: the newest
/// checkpoint's when resuming, a PEFT `adapter`'s own settings, else the `lora_*`
/// keys. Errors are left to `train` (and [`model_of`]) to report; a run whose
/// adapter cannot be read is planned as full training, which over-estimates.
fn lora_of(cfg: &TrainConfig, model: &ModelConfig) -> Option<LoraConfig> {
    match cfg.init() {
        InitFrom::Resume => {
            let latest = Checkpoint::open_latest(&cfg.out_dir).ok()?;
            latest.checkpoint.state.lora.map(|l| l.config)
        }
        _ if !cfg.adapter.is_empty() => {
            let dir = std::path::Path::new(&cfg.adapter);
            crate::hf::adapter::read_adapter(dir, model)
                .ok()
                .map(|a| a.config)
        }
        _ => cfg.lora().ok().flatten().filter(|l| l.check(model).is_ok()),
    }
}

/// One part of a rank's memory.
#[derive(Clone, Debug, Serialize)]
pub struct Part {
    pub name: &'static str,
    pub bytes: u64,
}

/// The peak memory of one rank.
#[derive(Clone, Debug, Serialize)]
pub struct RankPlan {
    pub rank: usize,
    pub parts: Vec<Part>,
    pub peak_rss_mb: f64,
}

impl RankPlan {
    pub fn bytes(&self) -> u64 {
        self.parts.iter().map(|p| p.bytes).sum()
    }

    pub fn part(&self, name: &str) -> u64 {
        self.parts
            .iter()
            .find(|p| p.name == name)
            .map_or(0, |p| p.bytes)
    }
}

// Names of the parts, as printed.

/// The trained weights: the whole model, or with LoRA the adapters.
pub const WEIGHTS: &str = "weights";
/// LoRA: the base model's weights, without gradients or moments (in bf16 where the
/// model keeps a rounded copy, without the linears that copy holds).
pub const FROZEN: &str = "frozen base weights";
/// The bf16 copies of the trained weights and (LoRA) of the frozen base.
pub const BF16_COPY: &str = "bf16 weight copy";
/// bf16 on AMX or AVX512-BF16 (not ZeRO-3): `wte` and the linear weights packed for
/// the products, once per optimizer step (with LoRA the frozen base's).
pub const PACKS: &str = "packed bf16 weights";
pub const GRADIENTS: &str = "gradients";
pub const MOMENTS: &str = "optimizer moments";
pub const ACTIVATIONS: &str = "activations";
pub const COMM: &str = "communication buffers";
/// ZeRO-3: the weights a pass holds whole at once beyond this rank's pieces (the
/// embeddings and `ln_f` for the whole pass, two blocks at a time: see
/// `GradPlan::gathered_len` and `gathered_beyond_own`). Their gradients, held
/// whole, are [`GRADIENTS`].
pub const GATHERED: &str = "gathered layers";
pub const GATHER: &str = "checkpoint gather";
/// The buffers of the gradient reductions in flight: our rings' scratch (from 3
/// ranks), or with `NANOGPT_RING_REDUCE=0` at ZeRO-3 the MPI library's, on the
/// ranks that reduce whole buckets for others ([`reduction_buffers_len`]).
pub const MPI_REDUCE: &str = "reduction buffers";
pub const BASELINE: &str = "program, threads, data";

/// The peak memory of `rank` in the run `p`.
pub fn rank_plan(p: &PlanInput, rank: usize) -> RankPlan {
    let layout = ParamLayout::new(&p.model);
    // The trained arena and its gradient buckets: the model's, or the adapters' with
    // the model frozen beside them.
    let (trained, frozen, buckets) = match &p.lora {
        None => (layout.clone(), 0, grad_buckets_of(&layout)),
        Some(lora) => {
            let adapters = LoraLayout::new(&p.model, lora);
            (adapters.params, layout.len, adapters.buckets)
        }
    };
    let len = trained.len;
    let f32s = |n: usize| n as u64 * 4;
    let (w, stage) = (p.world_size, p.zero_stage);
    let grad_plan = (w > 1).then(|| GradPlan::new(&buckets, len, w, rank, stage));
    let state_len = grad_plan.as_ref().map_or(len, |g| match stage {
        0 => len,
        _ => g.shard_len,
    });
    let ring = crate::dist::ring_reduce();
    let kind = Reduce::of_stage(stage, p.grad_reduce_dtype);
    let comm = grad_plan
        .as_ref()
        .map_or(0, |g| g.send_len_for(kind, ring) + g.recv_len);
    // ZeRO-3: each rank keeps its shard of the weights; a pass holds the embeddings
    // and ln_f (first and last buckets) and two blocks at a time (one computed, the
    // next arriving or the previous reducing), weights and gradients alike. The
    // buckets a pass leaves whole for the next (the last two blocks from forward to
    // backward; the first block, ln_f and the embeddings from backward to the next
    // micro-step or the update) are among those: no more is whole at once. The
    // embeddings' gradient, whole through a backward anyway, stays whole from one
    // micro-step to the next (reduced in the last only): counted the same.
    // The bf16 copy (bf16 mode) is made per bucket as it arrives, released with it:
    // the embeddings, ln_f and the one block computed with.
    let sharded = grad_plan.as_ref().filter(|_| stage >= 3);
    let (weights, grads, gathered, copy_len) = match sharded {
        None => (len, len, 0, len),
        Some(g) => (
            g.shard_len,
            g.gathered_len(),
            gathered_beyond_own(g, ring),
            g.copied_len(),
        ),
    };
    let mpi_reduce = grad_plan
        .as_ref()
        .map_or(0, |g| reduction_buffers_len(g, ring));
    let bf16 = p.dtype == Dtype::Bfloat16;
    let packs = match p.backend.packs_weights(bf16, sharded.is_some()) {
        true => {
            let (ckpt, frozen) = (p.activation_checkpointing, p.lora.is_some());
            let linears = Packs::linears_pay(Some(p.micro_steps), ckpt, frozen);
            Packs::bytes_for(&layout, &p.model, linears)
        }
        false => 0,
    };
    // ZeRO 1-3: rank 0 receives a checkpoint's sharded tensors one at a time into a
    // buffer of the largest tensor's size while it writes the file; at stage 3 no
    // layer is gathered and no gradient held then, so the save adds to the step's
    // peak only what that buffer exceeds them by (nothing: the embeddings' bucket
    // holds the largest tensor). (The quick start's closing sample, without a config
    // file, gathers the whole weights on rank 0 after the run: `len - weights` floats
    // more at stage 3, after the moments are freed: see `closing_gather_fits`.)
    let released = match sharded {
        Some(_) => (grads + gathered + mpi_reduce).min(len),
        None => 0,
    };
    let gather = save_buffer_len(&trained, stage, w, rank).saturating_sub(released);
    let (b, t, ckpt) = (p.batch_size, p.block_size, p.activation_checkpointing);
    let lora_acts = p.lora.as_ref().map_or(0, |l| {
        Activations::lora_bytes_for(&p.model, b, t, ckpt, l.rank, l.dropout > 0.0)
    });
    let acts = Activations::num_bytes_for(&p.model, b, t, p.dtype, ckpt) + lora_acts;
    // LoRA: the base's bf16 copy, where the model keeps one, or its packs replace its
    // f32 linears (`Frozen::release_linears`).
    let frozen_copy = p.backend.bf16_copy_len(bf16, false, frozen);
    let frozen_released = match p.lora.is_some() && Frozen::gives_back_linears(bf16, &p.backend) {
        true => Frozen::linears_len(&layout),
        false => 0,
    };
    let parts = vec![
        Part {
            name: WEIGHTS,
            bytes: f32s(weights),
        },
        Part {
            name: FROZEN,
            bytes: f32s(frozen - frozen_released),
        },
        Part {
            name: BF16_COPY,
            bytes: f32s(p.backend.bf16_copy_len(bf16, sharded.is_some(), copy_len) + frozen_copy),
        },
        Part {
            name: PACKS,
            bytes: packs as u64,
        },
        Part {
            name: GRADIENTS,
            bytes: f32s(grads),
        },
        Part {
            name: MOMENTS,
            bytes: f32s(2 * state_len),
        },
        Part {
            name: ACTIVATIONS,
            bytes: acts as u64,
        },
        Part {
            name: COMM,
            bytes: f32s(comm),
        },
        Part {
            name: GATHERED,
            bytes: f32s(gathered),
        },
        Part {
            name: MPI_REDUCE,
            bytes: f32s(mpi_reduce),
        },
        Part {
            name: GATHER,
            bytes: f32s(gather),
        },
        Part {
            name: BASELINE,
            bytes: BASELINE_BYTES,
        },
    ];
    let mut plan = RankPlan {
        rank,
        parts,
        peak_rss_mb: 0.0,
    };
    plan.peak_rss_mb = plan.bytes() as f64 / 1e6;
    plan
}

/// ZeRO-3: what a pass holds whole at once ([`GradPlan::gathered_len`]): its
/// buckets, the first and last (`ln_f`, the embeddings), and how many of the largest
/// block between them.
struct Held {
    first: usize,
    last: usize,
    block: Option<usize>,
    blocks: usize,
}

fn held(g: &GradPlan) -> Held {
    let n = g.buckets.len();
    let len = |b: usize| g.buckets[b].arena.len();
    let (first, last) = (0, n - 1);
    // The first of the largest, as `gathered_len` counts it.
    let block = (1..last).rev().max_by_key(|&b| len(b));
    let ends = len(first) + len(last);
    let blocks = block.map_or(0, |b| (g.gathered_len() - ends) / len(b).max(1));
    Held {
        first,
        last,
        block,
        blocks,
    }
}

/// ZeRO-3: floats of the weights a pass holds beyond this rank's pieces (which
/// [`WEIGHTS`] counts): the buckets of [`GradPlan::gathered_len`] but this rank's
/// piece of each (between passes `params` keeps [`GradPlan::piece`] of every bucket
/// resident and releases the rest), plus, with MPI's all-gather
/// (`NANOGPT_RING_REDUCE=0`, not `ring`), one piece more: the copy of this rank's
/// piece of the bucket arriving, which `MPI_Iallgatherv` sends from
/// (`Collective::start_all_gather_in_place`) while the block before it computes
/// (our ring gathers in place).
fn gathered_beyond_own(g: &GradPlan, ring: bool) -> usize {
    let own = |b: usize| g.piece(b, g.rank).len();
    let h = held(g);
    let block_own = h.block.map_or(0, own);
    let own_held = own(h.first) + own(h.last) + h.blocks * block_own;
    let send_copy = if ring { 0 } else { block_own };
    g.gathered_len() - own_held + send_copy
}

/// Halves of its scratch that a rank receives whole buckets into in the MPI
/// library's non-blocking reduce-scatter (Open MPI's `libnbc`, the default for
/// `MPI_Ireduce_scatter`, which ZeRO-3's `Sharded` starts per bucket): the buckets
/// are summed up a binomial tree onto rank 0, then scattered. A rank receives in
/// round `r` (r = 1, 2, … while 2^(r-1) < W) when `rank` is a multiple of 2^r and a
/// peer `rank + 2^(r-1)` exists, and stops at the first round in which it sends;
/// the library allocates two bucket-sized halves and alternates between them.
pub fn nbc_reduce_halves(rank: usize, world_size: usize) -> usize {
    let mut halves = 0;
    let mut r = 1;
    while 1usize << (r - 1) < world_size {
        if !rank.is_multiple_of(1 << r) {
            break;
        }
        if rank + (1 << (r - 1)) < world_size {
            halves += 1;
        }
        r += 1;
    }
    halves.min(2)
}

/// Floats of the gradient reductions' own buffers at this rank's peak. With our
/// `ring`: each ring's scratch ([`ring_scratch_len`] of the pieces it reduces:
/// equal blocks at stage 1, the bucket's counts at stages 0, 2 and 3), for the
/// [`RINGS_IN_FLIGHT`] largest at stages 0-2 and as `in_flight_peak` says at
/// stage 3. Without it, Open MPI's reduction buffers at stage 3
/// ([`nbc_reduce_halves`] of each bucket; the stage 0-2 ones are not counted).
pub fn reduction_buffers_len(g: &GradPlan, ring: bool) -> usize {
    let w = g.world_size;
    let ring_scratch = |b: usize| {
        let bucket = &g.buckets[b];
        match g.zero_stage {
            1 => ring_scratch_len(&vec![bucket.recv.len(); w]),
            _ => ring_scratch_len(&bucket.counts),
        }
    };
    match (g.zero_stage, ring) {
        (0..=2, true) => {
            let mut sizes: Vec<usize> = (0..g.buckets.len()).map(ring_scratch).collect();
            sizes.sort_unstable_by(|a, b| b.cmp(a));
            sizes.iter().take(RINGS_IN_FLIGHT).sum()
        }
        (0..=2, false) => 0,
        (_, true) => in_flight_peak(g, ring_scratch),
        (_, false) => {
            let halves = nbc_reduce_halves(g.rank, w);
            in_flight_peak(g, |b| halves * g.buckets[b].arena.len())
        }
    }
}

/// ZeRO-3: what reductions in flight holding `buffers(b)` floats for bucket `b`
/// add at this rank's peak. Mid-backward two block reductions are in flight; at its
/// end the embeddings' reduction and the first block's are, while the blocks'
/// weights and the other gradients are already released: that end is the higher
/// peak where the buffers of the embeddings are large. The part is what the higher
/// of the two adds to the mid-backward peak the other parts count.
fn in_flight_peak(g: &GradPlan, buffers: impl Fn(usize) -> usize) -> usize {
    let h = held(g);
    let len = |b: usize| g.buckets[b].arena.len();
    let (block, block_own) = h
        .block
        .map_or((0, 0), |b| (len(b), g.piece(b, g.rank).len()));
    let block_buffers = h.block.map_or(0, &buffers);
    let mid = 2 * block_buffers;
    // Mid-backward minus its end, without the reductions' buffers: the two blocks'
    // weights beyond this rank's pieces and the arriving one's send copy, `ln_f`'s
    // and one block's gradients.
    let released = 2 * (block - block_own) + block_own + len(h.first) + block;
    let end = (buffers(h.last) + block_buffers).saturating_sub(released);
    mid.max(end)
}

/// ZeRO-3: whether the quick start's closing sample fits in rank 0's plan. After
/// the run rank 0 gathers the whole weights (`Trainer::gather_final_weights`), the
/// trained arena less its pieces, having freed its moments; the gathered layers,
/// their gradients and MPI's reduction buffers are released by then. True up to 3
/// ranks (the moments, `2·len/W`, cover `len − len/W`); beyond, the plan does not
/// count the difference.
pub fn closing_gather_fits(plan: &RankPlan, trained_len: usize) -> bool {
    let rest = (trained_len as u64 * 4).saturating_sub(plan.part(WEIGHTS));
    let freed = [MOMENTS, GRADIENTS, GATHERED, MPI_REDUCE].map(|p| plan.part(p));
    rest <= freed.iter().sum()
}

/// The architecture a run of `cfg` trains, found as `train` finds it: the config's
/// (vocabulary from the dataset's meta.json), the newest checkpoint's when resuming,
/// the pretrained model's when fine-tuning. Nothing is allocated by its size.
pub fn model_of(cfg: &TrainConfig) -> Result<ModelConfig> {
    match cfg.init() {
        InitFrom::Scratch => {
            let dir = data::find_or_prepare_dataset(&cfg.dataset)?;
            let meta = Meta::load(&dir)?;
            Ok(cfg.model_config(meta.vocab_size))
        }
        InitFrom::Resume => {
            let latest = Checkpoint::open_latest(&cfg.out_dir)?;
            Ok(latest.checkpoint.state.model.clone())
        }
        InitFrom::Pretrained(name) => match ModelConfig::preset(&name) {
            Some(preset) => Ok(ModelConfig {
                block_size: cfg.block_size.min(preset.block_size),
                dropout: cfg.dropout,
                ..preset
            }),
            // A model directory's config.json (or the file itself) is enough to plan.
            None => match crate::hf::local_architecture(&name, cfg.block_size, cfg.dropout) {
                Some(arch) => arch,
                None => crate::hf::Pretrained::open(&name)?
                    .model_config(Some(cfg.block_size), cfg.dropout),
            },
        },
    }
}

/// Memory this process may use, and where the figure comes from.
#[derive(Clone, Debug, Serialize)]
pub struct Available {
    pub bytes: u64,
    pub source: String,
}

/// `MemAvailable` of /proc/meminfo, or this process's cgroup (v2 or v1) memory
/// limit where that is lower; `NANOGPT_MEMORY_LIMIT_MB` overrides both (for tests,
/// and for users who want a tighter limit). None if nothing says.
pub fn available() -> Result<Option<Available>> {
    let limit = crate::tuning::env::get().memory_limit_mb.clone();
    if let Some(mb) = limit.map_err(anyhow::Error::msg)? {
        return Ok(Some(Available {
            bytes: mb * 1_000_000,
            source: crate::tuning::env::MEMORY_LIMIT_MB.to_string(),
        }));
    }
    let mem = mem_available().map(|bytes| Available {
        bytes,
        source: "MemAvailable".into(),
    });
    let cgroup = cgroup_limit().map(|(bytes, file)| Available {
        bytes,
        source: format!("cgroup limit {file}"),
    });
    Ok(match (mem, cgroup) {
        (Some(m), Some(c)) => Some(if c.bytes < m.bytes { c } else { m }),
        (m, c) => m.or(c),
    })
}

fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// The memory limit of this process's cgroup (v2 `memory.max`, v1
/// `memory.limit_in_bytes`) and its file, if one is set.
fn cgroup_limit() -> Option<(u64, String)> {
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let mut files = Vec::new();
    for line in own.lines() {
        let mut f = line.splitn(3, ':');
        let (_, controllers, path) = (f.next()?, f.next()?, f.next()?);
        if controllers.is_empty() {
            files.push(format!("/sys/fs/cgroup{path}/memory.max"));
        } else if controllers.split(',').any(|c| c == "memory") {
            files.push(format!("/sys/fs/cgroup/memory{path}/memory.limit_in_bytes"));
        }
    }
    files.push("/sys/fs/cgroup/memory.max".into());
    files.push("/sys/fs/cgroup/memory/memory.limit_in_bytes".into());
    files.into_iter().find_map(|file| {
        let text = std::fs::read_to_string(&file).ok()?;
        let bytes: u64 = text.trim().parse().ok()?;
        // v1 reports "no limit" as a huge number.
        (bytes < 1 << 60).then_some((bytes, file))
    })
}

/// The plan of a run: every rank's peak (rank 0 and, when they differ, the others),
/// the host's share and what is available.
#[derive(Clone, Debug, Serialize)]
pub struct MemoryPlan {
    pub world_size: usize,
    pub ranks_per_host: usize,
    pub ranks: Vec<RankPlan>,
    /// The most any host needs: its ranks' peaks together (rank 0's host).
    pub host_peak_mb: f64,
    pub available: Option<Available>,
    pub fits: bool,
}

impl MemoryPlan {
    pub fn new(p: &PlanInput, available: Option<Available>) -> MemoryPlan {
        let ranks = rank_plans(p);
        let host = host_bytes(p, &ranks);
        MemoryPlan {
            world_size: p.world_size,
            ranks_per_host: p.ranks_per_host,
            host_peak_mb: host as f64 / 1e6,
            fits: available.as_ref().is_none_or(|a| host <= a.bytes),
            ranks,
            available,
        }
    }

    /// Lines for the user: each part of rank 0's peak, and the verdict.
    pub fn summary(&self) -> Vec<String> {
        let mb = |b: u64| b as f64 / 1e6;
        let r0 = &self.ranks[0];
        let parts: Vec<String> = r0
            .parts
            .iter()
            .filter(|p| p.bytes > 0)
            .map(|p| format!("{} {:.0}", p.name, mb(p.bytes)))
            .collect();
        let mut lines = vec![format!(
            "memory plan: {:.0} MB peak per rank (rank 0: {} MB)",
            r0.peak_rss_mb,
            parts.join(" + ")
        )];
        if self.ranks_per_host > 1 || self.world_size > 1 {
            lines.push(format!(
                "memory plan: {} rank(s) per host need {:.0} MB together",
                self.ranks_per_host, self.host_peak_mb
            ));
        }
        lines.push(match &self.available {
            Some(a) => format!(
                "memory available: {:.0} MB ({}){}",
                mb(a.bytes),
                a.source,
                if self.fits {
                    ""
                } else {
                    ": the run does not fit"
                }
            ),
            None => "memory available: unknown (no /proc/meminfo or cgroup limit)".into(),
        });
        lines
    }
}

/// Rank 0's plan and, with several ranks, the largest of the others' (they differ
/// by the last rank's shorter pieces and, at ZeRO-3, by the ranks that reduce for
/// others: [`nbc_reduce_halves`] is largest first at ranks 2 and 4).
fn rank_plans(p: &PlanInput) -> Vec<RankPlan> {
    let w = p.world_size;
    let mut others: Vec<usize> = [1, 2, 4, w.saturating_sub(1)]
        .into_iter()
        .filter(|&r| r >= 1 && r < w)
        .collect();
    others.dedup();
    let other = others
        .into_iter()
        .map(|r| rank_plan(p, r))
        .max_by_key(|r| (r.bytes(), std::cmp::Reverse(r.rank)));
    std::iter::once(rank_plan(p, 0)).chain(other).collect()
}

fn host_bytes(p: &PlanInput, ranks: &[RankPlan]) -> u64 {
    let others = ranks.get(1).unwrap_or(&ranks[0]).bytes();
    ranks[0].bytes() + (p.ranks_per_host as u64 - 1) * others
}

/// Settings that change memory, with a rough cost (relative step time or risk) for
/// ordering the suggestions: cheapest first.
fn variants(p: &PlanInput, grad_accum: usize) -> Vec<(f64, PlanInput, Vec<String>)> {
    let mut out = Vec::new();
    let stages: Vec<u8> = match p.world_size {
        1 => vec![p.zero_stage],
        _ => (p.zero_stage..=crate::config::MAX_ZERO_STAGE).collect(),
    };
    let ckpts = match p.activation_checkpointing {
        true => vec![true],
        false => vec![false, true],
    };
    // bf16 shrinks the activations but adds a copy of the weights: with LoRA of the
    // frozen base (of its embeddings where a rounded copy replaces its f32 linears),
    // so f32 can be what fits.
    let dtypes = match (p.dtype, &p.lora) {
        (Dtype::Bfloat16, None) => vec![Dtype::Bfloat16],
        (Dtype::Bfloat16, Some(_)) => vec![Dtype::Bfloat16, Dtype::Float32],
        (Dtype::Float32, _) => vec![Dtype::Float32, Dtype::Bfloat16],
    };
    let mut batches = vec![p.batch_size];
    while *batches.last().unwrap() > 1 {
        let b = batches.last().unwrap().div_ceil(2);
        batches.push(b);
    }
    for &stage in &stages {
        for &ckpt in &ckpts {
            for &dtype in &dtypes {
                // ZeRO-3 shards the whole model, not LoRA adapters (config validation).
                if stage >= 3 && p.lora.is_some() {
                    continue;
                }
                for (halvings, &b) in batches.iter().enumerate() {
                    let mut changes = Vec::new();
                    let mut cost = 1.0;
                    if stage != p.zero_stage {
                        changes.push(format!("zero_stage={stage}"));
                        cost *= 1.0 + 0.02 * f64::from(stage - p.zero_stage);
                    }
                    if ckpt != p.activation_checkpointing {
                        changes.push("activation_checkpointing=true".into());
                        cost *= 1.33;
                    }
                    if dtype != p.dtype {
                        changes.push(match dtype {
                            Dtype::Bfloat16 => "dtype=bfloat16".into(),
                            Dtype::Float32 => "dtype=float32".into(),
                        });
                        cost *= 1.2;
                    }
                    if b != p.batch_size {
                        // The same tokens per step: more micro-steps of fewer rows.
                        let factor = 1 << halvings;
                        changes.push(format!(
                            "batch_size={b} gradient_accumulation_steps={}",
                            grad_accum * factor
                        ));
                        cost *= 1.0 + 0.05 * halvings as f64;
                    }
                    if changes.is_empty() {
                        continue;
                    }
                    let q = PlanInput {
                        batch_size: b,
                        dtype,
                        activation_checkpointing: ckpt,
                        zero_stage: stage,
                        micro_steps: p.micro_steps << halvings,
                        ..p.clone()
                    };
                    out.push((cost, q, changes));
                }
            }
        }
    }
    out.sort_by(|a, b| a.0.total_cmp(&b.0));
    out
}

/// Up to `n` of the cheapest changes of settings (as `key=value` words) under which
/// the run fits in `available` bytes, cheapest first.
/// Each combination of keys appears once, with its cheapest values that fit.
pub fn cheapest_fits(p: &PlanInput, grad_accum: usize, available: u64, n: usize) -> Vec<String> {
    let mut seen = Vec::new();
    variants(p, grad_accum)
        .into_iter()
        .filter(|(_, q, _)| host_bytes(q, &rank_plans(q)) <= available)
        .filter(|(_, _, changes)| {
            let keys: Vec<String> = changes
                .iter()
                .filter_map(|c| c.split('=').next())
                .map(String::from)
                .collect();
            let new = !seen.contains(&keys);
            seen.push(keys);
            new
        })
        .take(n)
        .map(|(_, q, changes)| {
            let peak = rank_plan(&q, 0).peak_rss_mb;
            format!("{} ({peak:.0} MB per rank)", changes.join(" "))
        })
        .collect()
}

/// The plan of a run of `cfg` on `world_size` ranks, `ranks_per_host` per host, its
/// bf16 products on `backend`, against this host's available memory, and its refusal
/// when it does not fit: what `train` checks before it allocates, and `doctor` reports.
pub fn check_run(
    cfg: &TrainConfig,
    world_size: usize,
    ranks_per_host: usize,
    backend: &Backend,
) -> Result<(PlanInput, MemoryPlan, Option<String>)> {
    let model = model_of(cfg)?;
    let input = PlanInput::of(cfg, model, world_size, ranks_per_host, backend);
    let memory = MemoryPlan::new(&input, available()?);
    let refused = refusal(&memory, &input, cfg.gradient_accumulation_steps);
    Ok((input, memory, refused))
}

/// The refusal of a run that does not fit, naming the cheapest settings that do.
pub fn refusal(plan: &MemoryPlan, p: &PlanInput, grad_accum: usize) -> Option<String> {
    let available = plan.available.as_ref()?;
    if plan.fits {
        return None;
    }
    let fixes = cheapest_fits(p, grad_accum, available.bytes, 3);
    let advice = match (fixes.is_empty(), &p.lora) {
        (true, None) => "no combination of zero_stage, activation_checkpointing, dtype and a \
                         smaller batch_size fits: use more ranks (hosts) or a smaller model"
            .to_string(),
        // Every rank holds the whole frozen base: more ranks only help on more hosts.
        (true, Some(_)) => format!(
            "no combination of zero_stage, activation_checkpointing, dtype and a smaller \
             batch_size fits: every rank holds the whole frozen base model, so use a smaller \
             base model{}",
            match p.ranks_per_host {
                1 => " or a host with more memory",
                _ => ", fewer ranks per host or hosts with more memory",
            }
        ),
        (false, _) => format!("cheapest settings that fit: {}", fixes.join("; or ")),
    };
    Some(format!(
        "the run needs {:.0} MB per host but {:.0} MB are available ({}); {advice} \
         (see `nanogpt plan`)",
        plan.host_peak_mb,
        available.bytes as f64 / 1e6,
        available.source
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dist::{Bucket, DataParallel};
    use crate::model::family::LlamaType;
    use crate::model::tests_llama::tiny_llama;
    use crate::model::Gpt;
    use crate::optim::AdamW;

    fn tiny() -> ModelConfig {
        ModelConfig::tiny_for_tests(3, 0.1)
    }

    fn input(dtype: Dtype, ckpt: bool, stage: u8, w: usize) -> PlanInput {
        PlanInput {
            model: tiny(),
            batch_size: 3,
            block_size: 8,
            dtype,
            activation_checkpointing: ckpt,
            zero_stage: stage,
            world_size: w,
            ranks_per_host: 1,
            lora: None,
            micro_steps: 2,
            grad_reduce_dtype: Dtype::Float32,
            backend: Backend::detect(None),
        }
    }

    #[test]
    fn linear_packs_are_planned_where_a_step_reads_them_more_than_once() {
        // One micro-step without recompute packs the linear weights per product
        // (no packs held); two micro-steps or checkpointing pack them once per step.
        // Llama's linears have shapes of their own (grouped K/V, SwiGLU's width).
        for model in [tiny(), tiny_llama(LlamaType::Qwen2, false, 0.1)] {
            for ckpt in [false, true] {
                for micro_steps in [1, 2] {
                    let p = PlanInput {
                        model: model.clone(),
                        micro_steps,
                        ..input(Dtype::Bfloat16, ckpt, 0, 1)
                    };
                    let plan = rank_plan(&p, 0);
                    let mut gpt = Gpt::new(model.clone(), 3, 8).unwrap();
                    gpt.set_activation_checkpointing(ckpt);
                    gpt.set_micro_steps(micro_steps);
                    gpt.set_dtype(Dtype::Bfloat16, &Backend::detect(None));
                    let case = format!("checkpointing {ckpt}, {micro_steps} micro-steps");
                    assert_eq!(plan.part(PACKS), gpt.packs_bytes() as u64, "{case}");
                    let layout = ParamLayout::new(&model);
                    let wte_only = Packs::bytes_for(&layout, &model, false) as u64;
                    let linears = micro_steps > 1 || ckpt;
                    let here = Backend::detect(None);
                    if here.reads_packs() && Packs::linears_pay(None, false, false) {
                        assert_eq!(plan.part(PACKS) > wte_only, linears, "{case}");
                    }
                }
            }
        }
    }

    #[test]
    fn plan_parts_are_the_allocated_buffers() {
        for dtype in [Dtype::Float32, Dtype::Bfloat16] {
            for ckpt in [false, true] {
                let p = input(dtype, ckpt, 0, 1);
                let plan = rank_plan(&p, 0);
                let mut gpt = Gpt::new(tiny(), 3, 8).unwrap();
                gpt.set_activation_checkpointing(ckpt);
                gpt.set_dtype(dtype, &Backend::detect(None));
                let opt = AdamW::new(&gpt.layout.decay_ranges(), Default::default());
                let bytes = |n: usize| n as u64 * 4;
                assert_eq!(plan.part(WEIGHTS), bytes(gpt.params.len()));
                assert_eq!(plan.part(GRADIENTS), bytes(gpt.grads.len()));
                assert_eq!(plan.part(MOMENTS), bytes(opt.m.len() + opt.v.len()));
                assert_eq!(plan.part(BF16_COPY), gpt.bf16_copy_bytes() as u64);
                assert_eq!(plan.part(PACKS), gpt.packs_bytes() as u64);
                assert_eq!(plan.part(ACTIVATIONS), gpt.activation_bytes() as u64);
                assert_eq!(plan.part(COMM) + plan.part(GATHER), 0);
            }
        }
    }

    #[test]
    fn lora_plan_parts_are_the_allocated_buffers() {
        let models = [
            (tiny(), "c_attn,mlp.c_proj"),
            (
                tiny_llama(LlamaType::Qwen2, false, 0.1),
                "q_proj,v_proj,down_proj",
            ),
        ];
        for ((model, targets), dtype) in models
            .iter()
            .flat_map(|m| [Dtype::Float32, Dtype::Bfloat16].map(|d| (m, d)))
        {
            for ckpt in [false, true] {
                for dropout in [0.0, 0.1] {
                    let lora = LoraConfig::new(3, 8.0, dropout, targets).unwrap();
                    let p = PlanInput {
                        model: model.clone(),
                        lora: Some(lora.clone()),
                        ..input(dtype, ckpt, 0, 1)
                    };
                    let plan = rank_plan(&p, 0);
                    let mut gpt = Gpt::new(model.clone(), 3, 8).unwrap();
                    gpt.set_activation_checkpointing(ckpt);
                    let backend = Backend::detect(None);
                    gpt.set_dtype(dtype, &backend);
                    let mut gpt = gpt.with_lora(lora, ("test", 0), 1);
                    // As `train` holds the base: a bf16 copy or the packs replace its
                    // f32 linears.
                    let released = gpt.release_frozen_linears() as u64;
                    let bf16 = dtype == Dtype::Bfloat16;
                    assert_eq!(released > 0, Frozen::gives_back_linears(bf16, &backend));
                    let opt = AdamW::new(&gpt.layout.decay_ranges(), Default::default());
                    let frozen = gpt.frozen().unwrap();
                    let bytes = |n: usize| n as u64 * 4;
                    let case =
                        format!("{targets} {dtype:?} checkpointing {ckpt} dropout {dropout}");
                    assert_eq!(plan.part(WEIGHTS), bytes(gpt.params.len()), "{case}");
                    let resident = bytes(frozen.params.len()) - released;
                    assert_eq!(plan.part(FROZEN), resident, "{case}");
                    assert_eq!(plan.part(GRADIENTS), bytes(gpt.grads.len()), "{case}");
                    let moments = bytes(opt.m.len() + opt.v.len());
                    assert_eq!(plan.part(MOMENTS), moments, "{case}");
                    // The frozen base's bf16 copy and the adapters' (the trained
                    // arena's, as for the full model).
                    let bf16 = gpt.bf16_copy_bytes() as u64;
                    assert_eq!(plan.part(BF16_COPY), bf16, "{case}");
                    assert_eq!(plan.part(PACKS), gpt.packs_bytes() as u64, "{case}");
                    let acts = gpt.activation_bytes() as u64;
                    assert_eq!(plan.part(ACTIVATIONS), acts, "{case}");
                    assert_eq!(plan.part(COMM) + plan.part(GATHER), 0);
                    assert!(plan.part(WEIGHTS) < plan.part(FROZEN), "{case}");
                }
            }
        }
    }

    /// A rank of a collective run that only answers who it is: the buffers
    /// DataParallel allocates need nothing more.
    struct Ranks(usize, usize);
    impl crate::dist::Collective for Ranks {
        fn rank(&self) -> usize {
            self.0
        }
        fn world_size(&self) -> usize {
            self.1
        }
        fn local_size(&self) -> usize {
            1
        }
        crate::dist::quiet_collective_methods!();
        fn reduce_scatter_pieces(&self, _: &[f32], _: &mut [f32], _: &[usize]) {}
        fn all_gather_pieces(&self, _: &[f32], _: &mut [f32], _: &[usize]) {}
    }

    /// What a ZeRO-3 pass holds whole at once: the embeddings and ln_f for the pass,
    /// two blocks (one computed with, the next arriving or the previous reducing:
    /// the Lender test in model/mod.rs checks the order of the hooks, the deferred
    /// collective's test in dist/parallel.rs how many blocks are whole at once).
    fn in_use(gpt: &Gpt) -> usize {
        let l = &gpt.layout;
        let emb = l.layers[0].span.start;
        let ln_f = l.len - l.layers.last().unwrap().span.end;
        emb + ln_f + 2 * block(gpt)
    }

    /// What a ZeRO-3 pass holds of the weights beyond the pieces `plan.rank` keeps
    /// (`DataParallel::release_params` keeps `plan.piece`): `in_use` less its pieces
    /// of the embeddings, `ln_f` and the two blocks, plus, with MPI's all-gather
    /// (not our ring, which gathers in place), the copy of its piece of the
    /// arriving block that `start_all_gather_in_place` sends from.
    fn beyond_own(gpt: &Gpt, plan: &GradPlan) -> usize {
        let n = plan.buckets.len();
        let own = |b: usize| plan.piece(b, plan.rank).len();
        let send_copy = if crate::dist::ring_reduce() {
            0
        } else {
            own(1)
        };
        // Buckets: ln_f, the blocks from the last, the embeddings; blocks are alike.
        in_use(gpt) - own(0) - own(n - 1) - 2 * own(1) + send_copy
    }

    /// Floats of one block's bucket.
    fn block(gpt: &Gpt) -> usize {
        let l = &gpt.layout;
        l.layers[1].span.start - l.layers[0].span.start
    }

    #[test]
    fn sharded_plans_match_the_data_parallel_buffers() {
        // Full training, and LoRA whose trained arena is the adapters'.
        let lora = LoraConfig::new(2, 4.0, 0.0, "c_attn,c_fc").unwrap();
        for lora in [None, Some(lora)] {
            let mut gpt = Gpt::new(tiny(), 3, 8).unwrap();
            if let Some(l) = &lora {
                gpt = gpt.with_lora(l.clone(), ("test", 0), 1);
            }
            // The buffers DataParallel allocates on each rank of a 3-rank run.
            for stage in [0u8, 1, 2, 3] {
                if stage == 3 && lora.is_some() {
                    continue; // refused by the config
                }
                for rank in 0..3 {
                    let dp = DataParallel::new(&Ranks(rank, 3), &gpt, stage);
                    let p = PlanInput {
                        lora: lora.clone(),
                        ..input(Dtype::Float32, false, stage, 3)
                    };
                    let plan = rank_plan(&p, rank);
                    let case = format!("stage {stage} rank {rank} lora {}", lora.is_some());
                    let (send, recv) = dp.buffer_lens();
                    assert_eq!(plan.part(COMM), (send + recv) as u64 * 4, "{case}");
                    if stage <= 1 {
                        // bf16 on the wire: a send buffer at stage 0 too.
                        let mut dp = DataParallel::new(&Ranks(rank, 3), &gpt, stage);
                        dp.reduce_in(Dtype::Bfloat16);
                        let p = PlanInput {
                            grad_reduce_dtype: Dtype::Bfloat16,
                            backend: Backend::detect(None),
                            ..p.clone()
                        };
                        let (send, recv) = dp.buffer_lens();
                        let comm = rank_plan(&p, rank).part(COMM);
                        assert_eq!(comm, (send + recv) as u64 * 4, "{case} bf16");
                    }
                    let state = match stage {
                        0 => gpt.layout.len,
                        _ => dp.plan.shard_len,
                    };
                    assert_eq!(plan.part(MOMENTS), state as u64 * 8, "{case}");
                    // A checkpoint's save: rank 0 receives one tensor at a time into
                    // a buffer of the largest's size (its weights at stage 3 are
                    // released then, and hold more than that).
                    let largest = gpt.layout.tensors.iter().map(|t| t.numel()).max();
                    let gather = match (stage, rank) {
                        (1 | 2, 0) => largest.unwrap(),
                        _ => 0,
                    };
                    assert_eq!(plan.part(GATHER), gather as u64 * 4, "{case}");
                    let buffer = save_buffer_len(&gpt.layout, stage, 3, rank);
                    assert_eq!(
                        buffer,
                        if rank == 0 && stage > 0 {
                            largest.unwrap()
                        } else {
                            0
                        }
                    );
                    assert!(buffer <= 2 * in_use(&gpt), "{case}");
                    let (weights, in_use) = match stage {
                        3 => (dp.plan.shard_len, in_use(&gpt)),
                        _ => (gpt.params.len(), 0),
                    };
                    assert_eq!(plan.part(WEIGHTS), weights as u64 * 4, "{case}");
                    // Beyond this rank's pieces (kept by `release_others`, counted
                    // in the weights), plus the arriving block's send copy.
                    let gathered = match stage {
                        3 => beyond_own(&gpt, &dp.plan),
                        _ => 0,
                    };
                    assert_eq!(plan.part(GATHERED), gathered as u64 * 4, "{case}");
                    let grads = if stage == 3 { in_use } else { gpt.grads.len() };
                    assert_eq!(plan.part(GRADIENTS), grads as u64 * 4, "{case}");
                    // bf16: the copy of what a pass holds, but the block arriving.
                    let p = PlanInput {
                        lora: lora.clone(),
                        ..input(Dtype::Bfloat16, false, stage, 3)
                    };
                    // Kept whole where the products read no packs; per range with
                    // lent weights (stage 3) on every kernel.
                    let copy = match stage {
                        3 => in_use - block(&gpt),
                        _ => Backend::detect(None).bf16_copy_len(true, false, gpt.params.len()),
                    };
                    let frozen = lora.as_ref().map_or(0, |_| ParamLayout::new(&tiny()).len);
                    let frozen = Backend::detect(None).bf16_copy_len(true, false, frozen);
                    let copy = (copy + frozen) as u64 * 4;
                    assert_eq!(rank_plan(&p, rank).part(BF16_COPY), copy, "{case}");
                    if stage == 3 {
                        assert_eq!(rank_plan(&p, rank).part(PACKS), 0, "{case}");
                    }
                }
            }
        }
    }

    /// Open MPI's binomial reduction onto rank 0: which ranks receive whole buckets,
    /// into how many halves of their scratch (worked out by hand from the rounds).
    #[test]
    fn the_ranks_that_reduce_for_others() {
        let table: [&[usize]; 8] = [
            &[0],
            &[1, 0],
            &[2, 0, 0],
            &[2, 0, 1, 0],
            &[2, 0, 1, 0, 0],
            &[2, 0, 1, 0, 1, 0],
            &[2, 0, 1, 0, 2, 0, 0],
            &[2, 0, 1, 0, 2, 0, 1, 0],
        ];
        for (w, halves) in table.iter().enumerate() {
            let got: Vec<usize> = (0..=w).map(|r| nbc_reduce_halves(r, w + 1)).collect();
            assert_eq!(&got[..], *halves, "{} ranks", w + 1);
        }
    }

    /// The plan of a measured ZeRO-3 run (docs/PERFORMANCE.md, "plan vs measured")
    /// part by part: the gathered weights beyond each rank's pieces, and rank 0's
    /// share of MPI's reduction (the embeddings' and a block's, twice each, less what
    /// the end of backward has released).
    #[test]
    fn stage_3_parts_of_the_xl_width_run() {
        let model = ModelConfig {
            vocab_size: 50257,
            block_size: 1024,
            n_layer: 12,
            n_head: 25,
            n_embd: 1600,
            bias: true,
            dropout: 0.0,
            llama: None,
        };
        let layout = ParamLayout::new(&model);
        let buckets = grad_buckets_of(&layout);
        let p = PlanInput {
            model,
            batch_size: 1,
            block_size: 1024,
            dtype: Dtype::Float32,
            activation_checkpointing: true,
            zero_stage: 3,
            world_size: 3,
            ranks_per_host: 3,
            lora: None,
            micro_steps: 1,
            grad_reduce_dtype: Dtype::Float32,
            backend: Backend::detect(None),
        };
        let (n, len) = (buckets.len(), |b: usize| buckets[b].len());
        let (emb, ln_f, block) = (len(n - 1), len(0), len(1));
        for rank in 0..3 {
            let g = GradPlan::new(&buckets, layout.len, 3, rank, 3);
            let plan = rank_plan(&p, rank);
            let own = |b: usize| g.piece(b, rank).len();
            // Our ring gathers in place: no copy of the arriving block's piece.
            let beyond = emb - own(n - 1) + ln_f - own(0) + 2 * (block - own(1));
            assert_eq!(plan.part(GATHERED), beyond as u64 * 4, "rank {rank}");
            let mpi = match rank {
                0 => 2 * (emb + block) - (3 * block - own(1) + ln_f),
                _ => 0,
            };
            assert_eq!(reduction_buffers_len(&g, false), mpi, "rank {rank}");
            // Our ring: two rings in flight mid-backward, one scratch piece each.
            let ring = 2 * g.buckets[1].counts[0];
            assert_eq!(plan.part(MPI_REDUCE), ring as u64 * 4, "rank {rank}");
        }
        // 575 MB on rank 0: what it measured above rank 1 (4,517 vs 3,934 MB).
        let g = GradPlan::new(&buckets, layout.len, 3, 0, 3);
        let mpi = reduction_buffers_len(&g, false) as f64 * 4.0 / 1e6;
        assert!((560.0..590.0).contains(&mpi), "{mpi}");
    }

    /// ZeRO 0, 1 and 2 with our rings: two rings in flight, each with a scratch
    /// piece of its bucket per reduce-scatter round but the last (the two largest
    /// buckets: the embeddings' and a block's); none on 2 ranks (the one round lands
    /// in the result), two pieces each from 4 ranks. The same numbers the
    /// allocation uses (`ring_scratch_len` of what the ring reduces).
    #[test]
    fn ring_scratch_is_the_two_largest_buckets_pieces() {
        // A vocabulary large enough for the embeddings to outweigh a block.
        let model = ModelConfig {
            vocab_size: 500,
            ..tiny()
        };
        let layout = ParamLayout::new(&model);
        let buckets = grad_buckets_of(&layout);
        for stage in [0u8, 1, 2] {
            for (w, per_ring) in [(2, 0), (3, 1), (4, 2), (8, 2)] {
                let g = GradPlan::new(&buckets, layout.len, w, 0, stage);
                let piece = |b: &Bucket| b.counts.iter().copied().max().unwrap();
                let mut pieces: Vec<usize> = g.buckets.iter().map(piece).collect();
                pieces.sort_unstable();
                let two_largest = pieces[pieces.len() - 1] + pieces[pieces.len() - 2];
                assert!(pieces[pieces.len() - 1] > pieces[pieces.len() - 2]);
                let want = per_ring * two_largest;
                assert_eq!(reduction_buffers_len(&g, true), want, "stage {stage} w {w}");
                assert_eq!(reduction_buffers_len(&g, false), 0);
                let p = PlanInput {
                    model: model.clone(),
                    ..input(Dtype::Float32, false, stage, w)
                };
                assert_eq!(rank_plan(&p, 0).part(MPI_REDUCE), want as u64 * 4);
            }
        }
    }

    /// ZeRO-0's f32 ring all-reduce reads the gradients themselves: its
    /// communication buffers are the receive buffer alone (one arena), where bf16
    /// on the wire, or MPI's all-reduce, also needs the send buffer (two arenas).
    #[test]
    fn zero_0_needs_a_send_buffer_only_for_bf16_on_the_wire() {
        let p = input(Dtype::Float32, false, 0, 2);
        let len = ParamLayout::new(&p.model).len as u64 * 4;
        assert!(
            crate::dist::ring_reduce(),
            "the default, unless the environment says"
        );
        assert_eq!(rank_plan(&p, 0).part(COMM), len);
        let bf16 = PlanInput {
            grad_reduce_dtype: Dtype::Bfloat16,
            backend: Backend::detect(None),
            ..p
        };
        assert_eq!(rank_plan(&bf16, 0).part(COMM), 2 * len);
        let g = GradPlan::new(&[0..10, 10..25], 25, 2, 0, 0);
        assert_eq!(g.send_len_for(Reduce::AllReduce, true), 0);
        assert_eq!(g.send_len_for(Reduce::AllReduce, false), 25);
        assert_eq!(g.send_len_for(Reduce::AllReduceBf16, true), 25);
    }

    /// The quick start's closing sample at ZeRO-3: the whole weights on rank 0 fit
    /// where its moments and the pass's layers were, up to 3 ranks (the plan does
    /// not count it), not on 8 for gpt2-xl.
    #[test]
    fn the_closing_gather_fits_up_to_three_ranks() {
        for model in [tiny(), ModelConfig::preset("gpt2-xl").unwrap()] {
            let len = ParamLayout::new(&model).len;
            for w in [2, 3, 8] {
                let p = PlanInput {
                    model: model.clone(),
                    batch_size: 1,
                    block_size: 8,
                    dtype: Dtype::Float32,
                    activation_checkpointing: true,
                    zero_stage: 3,
                    world_size: w,
                    ranks_per_host: 1,
                    lora: None,
                    micro_steps: 1,
                    grad_reduce_dtype: Dtype::Float32,
                    backend: Backend::detect(None),
                };
                let fits = closing_gather_fits(&rank_plan(&p, 0), len);
                // (A pass of 3 layers holds most of the model: that always fits.)
                let deep = model.n_layer > 3;
                assert_eq!(fits, w <= 3 || !deep, "{} layers, {w} ranks", model.n_layer);
            }
        }
    }

    /// gpt2-large on 2 ranks: saving a checkpoint costs rank 0 one tensor (the token
    /// embedding, 257 MB), not the whole moments and weights (7.1 GB before).
    #[test]
    fn the_checkpoint_gather_is_one_tensor_not_the_model() {
        let model = ModelConfig::preset("gpt2-large").unwrap();
        let wte = ParamLayout::new(&model).tensors[0].numel();
        assert_eq!(wte, model.padded_vocab_size() * 1280);
        for stage in 1..=3 {
            let p = PlanInput {
                model: model.clone(),
                batch_size: 1,
                block_size: 1024,
                dtype: Dtype::Float32,
                activation_checkpointing: true,
                zero_stage: stage,
                world_size: 2,
                ranks_per_host: 2,
                lora: None,
                micro_steps: 1,
                grad_reduce_dtype: Dtype::Float32,
                backend: Backend::detect(None),
            };
            let gather = rank_plan(&p, 0).part(GATHER);
            assert_eq!(
                gather,
                if stage < 3 { wte as u64 * 4 } else { 0 },
                "{stage}"
            );
            assert_eq!(rank_plan(&p, 1).part(GATHER), 0);
        }
    }

    #[test]
    fn lora_refusals_suggest_float32_and_name_the_frozen_base() {
        // bf16 LoRA holds a second copy of the base's embeddings (its rounded copy
        // replaces the f32 linears), or with packs of the whole base: on a short
        // batch, dropping it is what fits, and the refusal says so.
        let p = PlanInput {
            model: ModelConfig::preset("gpt2").unwrap(),
            batch_size: 1,
            block_size: 256,
            dtype: Dtype::Bfloat16,
            activation_checkpointing: false,
            zero_stage: 0,
            world_size: 1,
            ranks_per_host: 1,
            lora: Some(LoraConfig::new(8, 16.0, 0.0, "c_attn").unwrap()),
            micro_steps: 1,
            grad_reduce_dtype: Dtype::Float32,
            backend: Backend::detect(None),
        };
        let bf16 = rank_plan(&p, 0).bytes();
        let f32 = PlanInput {
            dtype: Dtype::Float32,
            ..p.clone()
        };
        let f32 = rank_plan(&f32, 0).bytes();
        assert!(f32 + 50_000_000 < bf16, "{f32} vs {bf16}");
        let limit = (f32 + bf16) / 2;
        let available = |bytes| {
            Some(Available {
                bytes,
                source: "test".into(),
            })
        };
        let msg = refusal(&MemoryPlan::new(&p, available(limit)), &p, 1).unwrap();
        assert!(
            msg.contains("cheapest settings that fit: dtype=float32"),
            "{msg}"
        );
        let msg = refusal(&MemoryPlan::new(&p, available(1)), &p, 1).unwrap();
        assert!(
            msg.contains("every rank holds the whole frozen base"),
            "{msg}"
        );
    }

    #[test]
    fn checkpointing_and_sharding_shrink_the_plan_and_suggestions_fit() {
        let gpt2 = ModelConfig::preset("gpt2").unwrap();
        let p = PlanInput {
            model: gpt2,
            batch_size: 8,
            block_size: 1024,
            dtype: Dtype::Float32,
            activation_checkpointing: false,
            zero_stage: 0,
            world_size: 2,
            ranks_per_host: 1,
            lora: None,
            micro_steps: 1,
            grad_reduce_dtype: Dtype::Float32,
            backend: Backend::detect(None),
        };
        let full = rank_plan(&p, 0).bytes();
        let ckpt = rank_plan(
            &PlanInput {
                activation_checkpointing: true,
                ..p.clone()
            },
            0,
        )
        .bytes();
        assert!(ckpt + 2_500_000_000 < full, "{ckpt} vs {full}");
        let limit = (full + ckpt) / 2;
        let available = Some(Available {
            bytes: limit,
            source: "test".into(),
        });
        let plan = MemoryPlan::new(&p, available);
        assert!(!plan.fits);
        let msg = refusal(&plan, &p, 2).unwrap();
        // Sharding the moments (cheapest) is not enough here; each suggestion fits.
        assert!(msg.contains("cheapest settings that fit:"), "{msg}");
        for fix in cheapest_fits(&p, 2, limit, 3) {
            let mb: f64 = fix
                .rsplit('(')
                .next()
                .unwrap()
                .split(' ')
                .next()
                .unwrap()
                .parse()
                .unwrap();
            assert!(mb * 1e6 <= limit as f64 + 1e6, "{fix}");
        }
        assert!(
            cheapest_fits(&p, 2, 1, 3).is_empty(),
            "nothing fits in 1 byte"
        );
        assert!(
            refusal(&MemoryPlan::new(&p, None), &p, 2).is_none(),
            "unknown: no refusal"
        );
    }
}
