//! Activation and scratch buffers, allocated once for the largest batch.
//!
//! Every buffer is sized for `(max_B, max_T)`; a pass over a smaller `(B, T)` uses the
//! leading `B·T·…` elements, which is the same row-major layout. Nothing is allocated
//! in the step loop.
//!
//! What a block keeps for backward depends on the precision ([`Saved`]): f32 runs keep
//! everything in f32; bf16 runs keep q/k/v, the attention output and the MLP's
//! pre-GELU layer in bf16 (they are bf16 matmul operands, rounded anyway) and do not
//! keep the layer-norm outputs at all: backward recomputes them from the block's input
//! and the saved statistics (bit-identical). The GELU output is never kept: backward
//! recomputes it from the pre-GELU layer. The residual stream, the layer-norm
//! statistics and all gradients are f32.
//!
//! With activation checkpointing each block keeps only its output, the next block's
//! input (`BlockActs::output_only`); one full [`BlockActs`] serves every block's
//! forward, and backward refills it by running the block's forward again from its
//! input. The arena then holds one block's activations instead of `n_layer`.

use super::config::{Dtype, ModelConfig};
use super::family::{Activation, NormKind};
use crate::kernels::bf16::{self, Bf16};

/// Where the arena's buffers come from: zeroed memory, or (for the memory plan,
/// [`Activations::num_bytes_for`]) empty buffers and a count of the bytes the real
/// ones would take. One constructor serves both, so the plan cannot drift from what
/// training allocates.
pub struct Alloc {
    count_only: bool,
    /// Bytes allocated (or counted) so far.
    pub bytes: usize,
}

impl Alloc {
    pub fn real() -> Alloc {
        Alloc {
            count_only: false,
            bytes: 0,
        }
    }

    pub fn counting() -> Alloc {
        Alloc {
            count_only: true,
            bytes: 0,
        }
    }

    fn buf<T: Clone>(&mut self, zero: T, n: usize) -> Vec<T> {
        self.bytes += n * std::mem::size_of::<T>();
        match self.count_only {
            true => Vec::new(),
            false => vec![zero; n],
        }
    }

    pub fn f32s(&mut self, n: usize) -> Vec<f32> {
        self.buf(0.0, n)
    }

    fn bf16s(&mut self, n: usize) -> Vec<Bf16> {
        self.buf(Bf16::default(), n)
    }

    fn u32s(&mut self, n: usize) -> Vec<u32> {
        self.buf(0, n)
    }
}

/// How an activation that backward needs gets there from forward.
pub enum Saved {
    /// Kept in f32, as computed (f32 runs).
    F32(Vec<f32>),
    /// Kept rounded to bf16, in two bytes (bf16 runs).
    Bf16(Vec<Bf16>),
    /// Not kept: backward recomputes it (the layer-norm outputs of bf16 runs).
    Recomputed,
}

impl Saved {
    /// `n` elements kept in `dtype`: f32, or bf16.
    fn kept(dtype: Dtype, n: usize, al: &mut Alloc) -> Saved {
        match dtype {
            Dtype::Float32 => Saved::F32(al.f32s(n)),
            Dtype::Bfloat16 => Saved::Bf16(al.bf16s(n)),
        }
    }

    /// `n` elements kept in f32 runs and recomputed in bf16 runs.
    fn kept_in_f32(dtype: Dtype, n: usize, al: &mut Alloc) -> Saved {
        match dtype {
            Dtype::Float32 => Saved::F32(al.f32s(n)),
            Dtype::Bfloat16 => Saved::Recomputed,
        }
    }

    /// Forward: `compute` writes the first `n` values into the buffer they are computed
    /// in — the kept f32 buffer itself, or `staging` — they are saved, and the f32
    /// values the next kernel reads are returned. `Bf16` rounds them in `staging`
    /// first, so the reader sees exactly what is kept.
    pub fn save<'a>(
        &'a mut self,
        staging: &'a mut [f32],
        n: usize,
        compute: impl FnOnce(&mut [f32]),
    ) -> &'a [f32] {
        match self {
            Saved::F32(kept) => {
                let out = &mut kept[..n];
                compute(out);
                out
            }
            Saved::Bf16(kept) => {
                let out = &mut staging[..n];
                compute(out);
                bf16::round_and_store(out, &mut kept[..n]);
                out
            }
            Saved::Recomputed => {
                let out = &mut staging[..n];
                compute(out);
                out
            }
        }
    }

    /// Backward: the first `n` saved values in f32 — the kept buffer, its bf16 values
    /// widened into `staging`, or the values `recompute` writes into `staging`.
    pub fn load<'a>(
        &'a self,
        staging: &'a mut [f32],
        n: usize,
        recompute: impl FnOnce(&mut [f32]),
    ) -> &'a [f32] {
        match self {
            Saved::F32(kept) => &kept[..n],
            Saved::Bf16(kept) => {
                bf16::load(&mut staging[..n], &kept[..n]);
                &staging[..n]
            }
            Saved::Recomputed => {
                recompute(&mut staging[..n]);
                &staging[..n]
            }
        }
    }

    fn num_bytes(&self) -> usize {
        match self {
            Saved::F32(v) => v.len() * 4,
            Saved::Bf16(v) => v.len() * 2,
            Saved::Recomputed => 0,
        }
    }
}

/// A norm's per-row statistics, (B, T) each, kept for backward: the mean (layer
/// norms; empty for RMS norms) and 1/std.
pub struct NormStats {
    pub mean: Vec<f32>,
    pub rstd: Vec<f32>,
}

impl NormStats {
    pub fn new(rows: usize) -> NormStats {
        NormStats::alloc(rows, NormKind::Layer, &mut Alloc::real())
    }

    fn alloc(rows: usize, kind: NormKind, al: &mut Alloc) -> NormStats {
        let means = match kind {
            NormKind::Layer => rows,
            NormKind::Rms => 0,
        };
        NormStats {
            mean: al.f32s(means),
            rstd: al.f32s(rows),
        }
    }

    /// The first `n` rows' mean (empty without) and 1/std, to write.
    pub fn rows_mut(&mut self, n: usize) -> (&mut [f32], &mut [f32]) {
        let m = n.min(self.mean.len());
        (&mut self.mean[..m], &mut self.rstd[..n])
    }

    /// The first `n` rows' mean (empty without) and 1/std.
    pub fn rows(&self, n: usize) -> (&[f32], &[f32]) {
        let m = n.min(self.mean.len());
        (&self.mean[..m], &self.rstd[..n])
    }

    fn num_bytes(&self) -> usize {
        (self.mean.len() + self.rstd.len()) * 4
    }
}

/// What one transformer block keeps from forward for backward. Widths: `W =
/// (NH + 2·KV)·HS` (GPT-2's 3C), `QW = NH·HS` (C), `U` the MLP's first projection
/// (GPT-2's 4C, SwiGLU's 2I).
pub struct BlockActs {
    /// (B, T, C) output of the first norm, and its statistics.
    pub ln1: Saved,
    pub ln1_stats: NormStats,
    /// (B, T, W) query, key, value as attention reads them (after RoPE and a q/k
    /// norm).
    pub qkv: Saved,
    /// Qwen3 only (else empty): (B, T, W) the projection before its q/k norm, and
    /// (B·T, NH + KV) the norm's 1/std per head.
    pub qkv_raw: Vec<f32>,
    pub qk_rstd: Vec<f32>,
    /// (B, T, QW) attention output (heads concatenated), (B, NH, T) its log-sum-exp.
    pub atty: Saved,
    pub att_lse: Vec<f32>,
    /// (B, T, C) residual stream after the attention branch.
    pub res2: Vec<f32>,
    /// (B, T, C) output of the second norm, and its statistics.
    pub ln2: Saved,
    pub ln2_stats: NormStats,
    /// (B, T, U) MLP hidden layer before its activation. The activation's output is
    /// not kept: forward writes it to [`Scratch::hidden`] and backward recomputes it
    /// (as llm.c does), saving 4C floats per token and layer for one more GELU per
    /// layer.
    pub fch: Saved,
    /// (B, T, C) the block's output: residual stream after the MLP branch.
    pub res3: Vec<f32>,
    /// LoRA only (else empty): each target's (B, T, r) adapter product `s·drop(x)·Aᵀ`,
    /// in equal segments, one per place the family has for an adapter
    /// ([`super::lora::Target::index`]).
    pub lora_u: Vec<f32>,
}

impl BlockActs {
    /// A block's activations for `b × t` rows, kept as runs of `dtype` keep them.
    pub fn new(cfg: &ModelConfig, b: usize, t: usize, dtype: Dtype) -> BlockActs {
        BlockActs::alloc(cfg, b, t, dtype, &mut Alloc::real())
    }

    fn alloc(cfg: &ModelConfig, b: usize, t: usize, dtype: Dtype, al: &mut Alloc) -> BlockActs {
        let f = cfg.family();
        let (bt, c, w) = (b * t, cfg.n_embd, f.qkv_width());
        let qk = |n: usize| if f.qk_norm { n } else { 0 };
        BlockActs {
            ln1: Saved::kept_in_f32(dtype, bt * c, al),
            ln1_stats: NormStats::alloc(bt, f.norm, al),
            qkv: Saved::kept(dtype, bt * w, al),
            qkv_raw: al.f32s(qk(bt * w)),
            qk_rstd: al.f32s(qk(bt * (f.nh + f.kv))),
            atty: Saved::kept(dtype, bt * f.q_width(), al),
            att_lse: al.f32s(b * cfg.n_head * t),
            res2: al.f32s(bt * c),
            ln2: Saved::kept_in_f32(dtype, bt * c, al),
            ln2_stats: NormStats::alloc(bt, f.norm, al),
            fch: Saved::kept(dtype, bt * f.mlp_up_width(), al),
            res3: al.f32s(bt * c),
            lora_u: Vec::new(),
        }
    }

    /// With activation checkpointing: only the block's output (B, T, C), the next
    /// block's input. Backward recomputes the rest into the arena's
    /// [`Activations::recompute`] from the block's own input.
    fn output_only(cfg: &ModelConfig, b: usize, t: usize, al: &mut Alloc) -> BlockActs {
        BlockActs {
            ln1: Saved::Recomputed,
            ln1_stats: NormStats::new(0),
            qkv: Saved::Recomputed,
            qkv_raw: Vec::new(),
            qk_rstd: Vec::new(),
            atty: Saved::Recomputed,
            att_lse: Vec::new(),
            res2: Vec::new(),
            ln2: Saved::Recomputed,
            ln2_stats: NormStats::new(0),
            fch: Saved::Recomputed,
            res3: al.f32s(b * t * cfg.n_embd),
            lora_u: Vec::new(),
        }
    }

    pub fn num_bytes(&self) -> usize {
        let saved = [&self.ln1, &self.qkv, &self.atty, &self.ln2, &self.fch];
        let f32s = [
            &self.qkv_raw,
            &self.qk_rstd,
            &self.att_lse,
            &self.res2,
            &self.res3,
            &self.lora_u,
        ];
        saved.iter().map(|s| s.num_bytes()).sum::<usize>()
            + f32s.iter().map(|v| v.len() * 4).sum::<usize>()
            + self.ln1_stats.num_bytes()
            + self.ln2_stats.num_bytes()
    }
}

/// f32 working buffers that all blocks share, each named for what it holds (widths
/// as in [`BlockActs`]; `I` the MLP's width after its activation).
pub struct Scratch {
    /// (B, T, I) the MLP's hidden layer: the activation's output in forward; in
    /// backward the recomputed output, then its gradient.
    pub hidden: Vec<f32>,
    /// (B, T, C) gradient of the residual stream.
    pub dres: Vec<f32>,
    /// (B, T, max(C, QW)) gradient of the input of the linear layer being
    /// differentiated: a norm's output (the classifier leaves d(final norm output)
    /// here) or the attention output.
    pub dinp: Vec<f32>,
    /// (B, T, C) a residual branch's output gradient as its projection multiplies it:
    /// dropout's mask applied and, in bf16 runs, rounded to bf16. Empty where that is
    /// the residual gradient itself (f32 without dropout).
    pub dbranch: Vec<f32>,
    /// (B, T, W) gradient of q, k and v.
    pub dqkv: Vec<f32>,
    /// SwiGLU only (else empty): (B, T, U) gradient of the stacked gate and up.
    pub dmlp_up: Vec<f32>,
    /// bf16 runs (empty in f32 ones): the f32 form of values not kept in f32 —
    /// (B, T, max(C, QW)) a norm's output or the attention output, computed here
    /// before it is saved, recomputed or widened here in backward ([`Saved`]).
    pub staging: Vec<f32>,
    /// bf16 runs: the same for (B, T, W) q/k/v and (B, T, U) pre-activation values.
    pub staging_wide: Vec<f32>,
    /// LoRA with dropout (else empty): (B, T, widest input) an adapter's dropped
    /// input, or in backward its masked input gradient.
    pub lora_x: Vec<f32>,
    /// LoRA on a linear layer of several parts (Llama's q/k/v, gate/up; else empty):
    /// (B, T, widest part) an adapter's product before it is added into its rows.
    pub lora_y: Vec<f32>,
    /// LoRA (else empty): (parts, B, T, r) the adapters' `du` of one linear layer,
    /// from their parameter gradients to their input gradients.
    pub lora_du: Vec<f32>,
    /// LoRA (else empty): (2·max(C, HS)) where the frozen norms' parameter gradients
    /// go, unread.
    pub norm_sink: Vec<f32>,
}

impl Scratch {
    /// Scratch for `b × t` rows of a run in `dtype`; without `backward`, only what a
    /// forward pass uses.
    pub fn new(cfg: &ModelConfig, bt: usize, dtype: Dtype, backward: bool) -> Scratch {
        Scratch::alloc(cfg, bt, dtype, backward, &mut Alloc::real())
    }

    fn alloc(
        cfg: &ModelConfig,
        bt: usize,
        dtype: Dtype,
        backward: bool,
        al: &mut Alloc,
    ) -> Scratch {
        let f = cfg.family();
        let (c, w, up) = (cfg.n_embd, f.qkv_width(), f.mlp_up_width());
        let wide_c = c.max(f.q_width());
        let swiglu = f.activation == Activation::SwiGlu;
        let bf16 = dtype == Dtype::Bfloat16;
        let mut z = |keep: bool, n: usize| al.f32s(if keep { n } else { 0 });
        Scratch {
            hidden: z(true, bt * f.mlp_width),
            dres: z(backward, bt * c),
            dinp: z(backward, bt * wide_c),
            dbranch: z(backward && (bf16 || cfg.dropout > 0.0), bt * c),
            dqkv: z(backward, bt * w),
            dmlp_up: z(backward && swiglu, bt * up),
            staging: z(bf16, bt * wide_c),
            staging_wide: z(bf16, bt * w.max(up)),
            lora_x: Vec::new(),
            lora_y: Vec::new(),
            lora_du: Vec::new(),
            norm_sink: Vec::new(),
        }
    }

    fn num_bytes(&self) -> usize {
        let bufs = [
            &self.hidden,
            &self.dres,
            &self.dinp,
            &self.dbranch,
            &self.dqkv,
            &self.dmlp_up,
            &self.staging,
            &self.staging_wide,
            &self.lora_x,
            &self.lora_y,
            &self.lora_du,
            &self.norm_sink,
        ];
        bufs.iter().map(|v| v.len() * 4).sum()
    }
}

/// All activations of a training forward pass, and the scratch that blocks share.
pub struct Activations {
    /// (B, T) the token ids of the current pass (backward needs them).
    pub inputs: Vec<u32>,
    /// (B, T, C) token + position embedding: the input of block 0.
    pub encoded: Vec<f32>,
    /// Each block's activations; with activation checkpointing only its output
    /// (`BlockActs::output_only`).
    pub blocks: Vec<BlockActs>,
    /// With activation checkpointing: one block's full activations, which every
    /// block's forward writes (its output then swapped into `blocks`) and backward
    /// rewrites by running the block's forward again. None without.
    pub recompute: Option<BlockActs>,
    /// (B, T, C) final layer norm output (rounded to bf16 in bf16 runs: it is the
    /// classifier's operand), with its statistics.
    pub lnf: Vec<f32>,
    pub lnf_stats: NormStats,
    /// (B, T) per-position loss.
    pub losses: Vec<f32>,
    /// (R, V) logits of one chunk of rows in the fused classifier.
    pub logits_chunk: Vec<f32>,
    pub scratch: Scratch,
}

/// Rows of the classifier chunk: enough that the `dwte` update (K = rows) runs near
/// the GEMM's peak, few enough that the chunk stays around 64 MB for GPT-2's
/// vocabulary (333 rows). Measured at 124M, B = 4, T = 256: 32 MB chunks (166 rows)
/// made the classifier ~20 % and the step ~10 % slower than 128 MB ones, and 256 MB
/// gained nothing more; 64 MB keeps the bf16 arena within 0.6× of the f32 one.
fn classifier_chunk_rows(cfg: &ModelConfig, rows: usize) -> usize {
    const BUDGET_FLOATS: usize = 16 << 20;
    (BUDGET_FLOATS / cfg.vocab_size).clamp(64, 1024).min(rows)
}

impl Activations {
    /// The arena for batches up to `max_b × max_t` of a run in `dtype`, keeping only
    /// each block's input with `checkpointing`.
    pub fn new(
        cfg: &ModelConfig,
        max_b: usize,
        max_t: usize,
        dtype: Dtype,
        checkpointing: bool,
    ) -> Activations {
        Activations::alloc(cfg, max_b, max_t, dtype, checkpointing, &mut Alloc::real())
    }

    fn alloc(
        cfg: &ModelConfig,
        max_b: usize,
        max_t: usize,
        dtype: Dtype,
        checkpointing: bool,
        al: &mut Alloc,
    ) -> Activations {
        let (bt, c) = (max_b * max_t, cfg.n_embd);
        let blocks = (0..cfg.n_layer)
            .map(|_| match checkpointing {
                true => BlockActs::output_only(cfg, max_b, max_t, al),
                false => BlockActs::alloc(cfg, max_b, max_t, dtype, al),
            })
            .collect();
        Activations {
            inputs: al.u32s(bt),
            encoded: al.f32s(bt * c),
            blocks,
            recompute: checkpointing.then(|| BlockActs::alloc(cfg, max_b, max_t, dtype, al)),
            lnf: al.f32s(bt * c),
            lnf_stats: NormStats::alloc(bt, cfg.family().norm, al),
            losses: al.f32s(bt),
            logits_chunk: al.f32s(classifier_chunk_rows(cfg, bt) * cfg.vocab_size),
            scratch: Scratch::alloc(cfg, bt, dtype, true, al),
        }
    }

    /// Bytes an arena for `(b, t)` holds, counted by the constructor itself without
    /// allocating anything.
    pub fn num_bytes_for(
        cfg: &ModelConfig,
        b: usize,
        t: usize,
        dtype: Dtype,
        checkpointing: bool,
    ) -> usize {
        let mut al = Alloc::counting();
        Activations::alloc(cfg, b, t, dtype, checkpointing, &mut al);
        al.bytes
    }

    /// Adds the buffers of LoRA adapters of rank `rank` (with input dropout when
    /// `dropout`) for the `max_bt` rows the arena was made for.
    pub fn add_lora(&mut self, cfg: &ModelConfig, max_bt: usize, rank: usize, dropout: bool) {
        self.add_lora_with(cfg, max_bt, rank, dropout, &mut Alloc::real());
    }

    /// Bytes [`Activations::add_lora`] adds to the arena of a `(b, t)` run (with
    /// `checkpointing` or not), counted by it without allocating anything.
    pub fn lora_bytes_for(
        cfg: &ModelConfig,
        b: usize,
        t: usize,
        checkpointing: bool,
        rank: usize,
        dropout: bool,
    ) -> usize {
        // An empty arena of the same shape: which blocks keep buffers is all it tells.
        let mut arena = Activations::alloc(
            cfg,
            b,
            t,
            Dtype::Float32,
            checkpointing,
            &mut Alloc::counting(),
        );
        let mut al = Alloc::counting();
        arena.add_lora_with(cfg, b * t, rank, dropout, &mut al);
        al.bytes
    }

    fn add_lora_with(
        &mut self,
        cfg: &ModelConfig,
        max_bt: usize,
        rank: usize,
        dropout: bool,
        al: &mut Alloc,
    ) {
        // With activation checkpointing only the block being recomputed keeps them.
        let kept = match self.recompute.as_mut() {
            Some(one) => std::slice::from_mut(one),
            None => &mut self.blocks[..],
        };
        let f = cfg.family();
        let places = f.lora_targets().count();
        for block in kept {
            block.lora_u = al.f32s(places * max_bt * rank);
        }
        let widest_in = f.linears.iter().map(|l| l.inp).max().unwrap_or(0);
        let parts = f.linears.iter().map(|l| l.parts.len()).max().unwrap_or(1);
        // A part narrower than its layer needs room for its product alone.
        let part_rows = (f.linears.iter())
            .filter(|l| l.parts.len() > 1)
            .flat_map(|l| l.parts.iter().map(|p| p.rows))
            .max()
            .unwrap_or(0);
        let s = &mut self.scratch;
        s.lora_du = al.f32s(parts * max_bt * rank);
        s.lora_x = al.f32s(if dropout { max_bt * widest_in } else { 0 });
        s.lora_y = al.f32s(max_bt * part_rows);
        s.norm_sink = al.f32s(2 * cfg.n_embd.max(f.hs));
    }

    /// Bytes held, all buffers together (4 per f32 and token id, 2 per bf16).
    pub fn num_bytes(&self) -> usize {
        let blocks: usize = self
            .blocks
            .iter()
            .chain(&self.recompute)
            .map(BlockActs::num_bytes)
            .sum();
        let f32s = [&self.encoded, &self.lnf, &self.losses, &self.logits_chunk];
        blocks
            + f32s.iter().map(|v| v.len() * 4).sum::<usize>()
            + self.lnf_stats.num_bytes()
            + self.scratch.num_bytes()
            + self.inputs.len() * 4
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attention_memory_grows_linearly_with_t() {
        // No (B, NH, T, T) buffer: quadrupling T must scale the arena by about 4,
        // not 16 (the classifier chunk is capped, so slightly less than 4).
        let cfg = ModelConfig::preset("gpt2").unwrap();
        let small = Activations::num_bytes_for(&cfg, 4, 256, Dtype::Float32, false) / 4;
        let large = Activations::num_bytes_for(&cfg, 4, 1024, Dtype::Float32, false) / 4;
        let ratio = large as f64 / small as f64;
        assert!(ratio <= 4.0, "T 256 → 1024 grew the arena {ratio:.2}×");
        // Exactly: per layer and token 12·C + 4 + NH floats (ln1 C+2, qkv 3C, atty C,
        // lse NH, res2 C, ln2 C+2, fch 4C, res3 C; the GELU output is recomputed);
        // outside the blocks per token: the input id, encoded, lnf + 2 statistics, the
        // loss (2C + 4), and the scratch: hidden 4C, dres C, dinp C, dqkv 3C (no
        // dropout, so no dbranch); and the classifier chunk (R·V).
        let (b, t, c) = (4, 1024, cfg.n_embd);
        let bt = b * t;
        let per_layer = bt * (12 * c + 4 + cfg.n_head);
        let rows = (16 << 20) / cfg.vocab_size;
        let rest = bt * (2 * c + 4) + bt * 9 * c + rows * cfg.vocab_size;
        assert_eq!(large, cfg.n_layer * per_layer + rest);
        println!(
            "activation arena, GPT-2 124M, B=4: T=256 {:.0} MiB, T=1024 {:.0} MiB",
            small as f64 * 4.0 / (1 << 20) as f64,
            large as f64 * 4.0 / (1 << 20) as f64
        );
    }

    #[test]
    fn counted_bytes_are_the_allocated_bytes() {
        let cfg = ModelConfig::tiny_for_tests(3, 0.1);
        for dtype in [Dtype::Float32, Dtype::Bfloat16] {
            for checkpointing in [false, true] {
                let real = Activations::new(&cfg, 3, 8, dtype, checkpointing).num_bytes();
                let counted = Activations::num_bytes_for(&cfg, 3, 8, dtype, checkpointing);
                assert_eq!(counted, real, "{dtype:?} checkpointing {checkpointing}");
            }
        }
    }

    #[test]
    fn bf16_arena_keeps_matmul_operands_in_two_bytes() {
        // GPT-2 124M at B=4, T=1024 (the target configuration).
        let cfg = ModelConfig::preset("gpt2").unwrap();
        let (b, t, c) = (4, 1024, cfg.n_embd);
        let f32_bytes = Activations::num_bytes_for(&cfg, b, t, Dtype::Float32, false);
        let bf16_bytes = Activations::num_bytes_for(&cfg, b, t, Dtype::Bfloat16, false);
        // Per layer and token, bf16 keeps atty (C), qkv (3C) and fch (4C) in two bytes
        // and ln1, ln2 (C each) not at all: 4·(12C + 4 + NH) → 4·(2C + 4 + NH) + 2·8C.
        // Outside the blocks it adds the f32 scratch: staging C, staging_wide 4C and
        // dbranch C (the rounded branch gradient).
        let bt = b * t;
        let per_layer_saved = bt * (4 * 10 * c - 2 * 8 * c);
        let scratch = bt * 4 * 6 * c;
        assert_eq!(
            f32_bytes - bf16_bytes,
            cfg.n_layer * per_layer_saved - scratch
        );
        let ratio = bf16_bytes as f64 / f32_bytes as f64;
        println!(
            "activation arena, GPT-2 124M, B=4, T=1024: float32 {f32_bytes} bytes, \
             bfloat16 {bf16_bytes} bytes ({ratio:.3}×)"
        );
        assert!(ratio <= 0.6, "bf16 arena is {ratio:.3}× the f32 one");
    }
}
