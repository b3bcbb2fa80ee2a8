//! Incremental decoding with a key/value cache, for generation.
//!
//! [`Gpt::logits`](super::Gpt::logits) recomputes every position on each call; a
//! [`Decoder`] keeps each layer's keys and values instead, so a new token costs one row
//! through the matmuls plus attention over the cached positions:
//!
//! ```text
//! feed(tokens (B, p)):  x = wte[tokens] (+ wpe[len..len+p])            (B·p, C)
//!   for each block:  the training block (block.rs), attending through the cache:
//!                    q, k turned to positions len..len+p (RoPE families), append
//!                    this layer's new keys and values, attend to K, V[0..=pos]
//!   logits = norm_f(x[last new row]) · Wᵀ   (kernels::gemv; W: wte or lm_head)
//! ```
//!
//! It runs the same block and kernels as the training forward, in f32, without dropout,
//! except that a decoding step's few rows take every matmul on the GEMV (which streams
//! each weight once) and a prompt's attention reads the cache;
//! [`Decoder::with_bf16_weights`] reads the weight matrices (the linears, the token
//! embedding, the classifier) in bf16 instead: the steps' rows and the classifier on
//! the GEMV, a prompt's rows on the bf16 GEMM that training uses.

use super::activations::{BlockActs, NormStats, Scratch};
use super::block::{block_forward, norm_forward, runs_on_the_gemv, Attend, BlockWeights};
use super::config::{Dtype, ModelConfig};
use super::family::Family;
use super::layout::ParamLayout;
use crate::kernels::attention::{cached_attention, KvCache};
use crate::kernels::bf16::{self, Backend, Bf16};
use crate::kernels::classifier::{classifier_logits, Classifier};
use crate::kernels::encoder::encoder_forward;
use crate::kernels::gemv::{gemv, Weights};
use crate::kernels::rope::RopeTable;
use crate::kernels::Dims;
use rayon::prelude::*;

/// Rows whose logits [`Decoder::feed_all`] computes at a time: (64, V) floats, 13 MB
/// for GPT-2's vocabulary.
pub const ALL_ROWS_CHUNK: usize = 64;

/// Sizes fixed when the decoder is built.
#[derive(Clone, Copy, Debug)]
struct Shape {
    /// Sequences decoded together (B).
    b: usize,
    /// Positions the cache holds per sequence.
    max_len: usize,
    c: usize,
    nh: usize,
    /// Key/value heads (KV) and their size.
    kv: usize,
    hs: usize,
    /// Real vocabulary (V) and stored rows of `wte` (Vp).
    v: usize,
    vp: usize,
    n_layer: usize,
}

impl Shape {
    /// Floats of one layer's key (or value) cache: (B, KV, max_len, HS).
    fn cache_floats(&self) -> usize {
        self.b * self.kv * self.max_len * self.hs
    }
}

/// A KV-cached forward pass over `B` sequences that advance together.
///
/// Owns its caches and buffers (all allocated in [`Decoder::new`], sized for the
/// largest prefill, `B·max_len` rows; [`Decoder::feed`] allocates nothing of its own)
/// and borrows the parameters only per call, so one set of weights can serve several
/// decoders.
pub struct Decoder {
    shape: Shape,
    /// What the blocks are made of, and their rotary table for `max_len` positions.
    family: Family,
    rope: Option<RopeTable>,
    /// Positions cached per sequence.
    len: usize,
    /// Keys of every layer: (L, B, KV, max_len, HS), so each head's keys are contiguous.
    keys: Vec<f32>,
    /// Values, laid out like `keys`.
    values: Vec<f32>,
    /// (n, C) the new rows' residual stream: a block's input, then its output (swapped
    /// in from `acts.res3`).
    x: Vec<f32>,
    /// One block's activations, reused by every block.
    acts: BlockActs,
    scratch: Scratch,
    /// (B, NH, max_len) attention scores of one query row per (sequence, head).
    scores: Vec<f32>,
    /// (B, C) the last new row of each sequence, and its final layer norm.
    last: Vec<f32>,
    lnf: Vec<f32>,
    lnf_stats: NormStats,
    /// (B, V) logits of the last new position.
    logits: Vec<f32>,
    /// With bf16 weights: the parameters rounded to bf16 (laid out like them), whose
    /// matmul weights and `wte` every matmul reads ([`Decoder::with_bf16_weights`]).
    weights_bf16: Option<Vec<Bf16>>,
    /// The kernel of a bf16 prompt's products.
    backend: Backend,
}

thread_local! {
    /// bf16 weight copies made by [`Decoder::with_bf16_weights`] on this thread.
    static BF16_COPIES: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// How many bf16 weight copies this thread has made so far: a session that keeps its
/// decoder (`nanogpt chat`) makes one, however many replies it generates (tested).
pub fn bf16_copies_on_this_thread() -> usize {
    BF16_COPIES.with(|n| n.get())
}

/// A bf16 copy of parameters, built in order, piece by piece.
struct Bf16Copy(Vec<Bf16>);

impl Bf16Copy {
    fn with_capacity(len: usize) -> Bf16Copy {
        // Fresh memory, faulted in when first written: a fault per 2 MiB page where
        // the kernel allows, instead of per 4 KiB (decoding steps read the copy
        // 0.4–1.4 ms faster per 124M token), so the advice comes before any write.
        let mut w = Vec::with_capacity(len);
        crate::resident::prefer_huge_pages(w.spare_capacity_mut());
        Bf16Copy(w)
    }

    /// Appends `src` rounded to bf16.
    fn push(&mut self, src: &[f32]) {
        let at = self.0.len();
        // The first writes, and so the faults, on every thread.
        let w = &mut self.0;
        w.par_extend(rayon::iter::repeat_n(Bf16::default(), src.len()));
        bf16::store(&mut w[at..], src);
    }

    fn finish(self) -> Vec<Bf16> {
        BF16_COPIES.with(|n| n.set(n.get() + 1));
        self.0
    }
}

impl Decoder {
    /// A cache for `batch` sequences of up to `max_len` (≤ block_size) positions.
    ///
    /// # Panics
    /// If the config is invalid, `batch` or `max_len` is 0, or `max_len > block_size`.
    pub fn new(config: &ModelConfig, batch: usize, max_len: usize) -> Decoder {
        config.validate().expect("a valid model config");
        assert!(
            batch > 0 && max_len > 0 && max_len <= config.block_size,
            "decoder shape {batch}×{max_len} must be at least 1×1 with length ≤ block_size ({})",
            config.block_size
        );
        let shape = Shape {
            b: batch,
            max_len,
            c: config.n_embd,
            nh: config.n_head,
            kv: config.kv_heads(),
            hs: config.head_size(),
            v: config.vocab_size,
            vp: config.padded_vocab_size(),
            n_layer: config.n_layer,
        };
        let (rows, c) = (batch * max_len, shape.c);
        let cache = shape.n_layer * shape.cache_floats();
        let family = config.family();
        let rope = super::rope_table(&family, max_len);
        Decoder {
            shape,
            family,
            rope,
            len: 0,
            keys: vec![0.0; cache],
            values: vec![0.0; cache],
            x: vec![0.0; rows * c],
            acts: BlockActs::new(config, batch, max_len, Dtype::Float32),
            scratch: Scratch::new(config, rows, Dtype::Float32, false),
            scores: vec![0.0; batch * shape.nh * max_len],
            last: vec![0.0; batch * c],
            lnf: vec![0.0; batch * c],
            lnf_stats: NormStats::new(batch),
            logits: vec![0.0; batch * shape.v],
            weights_bf16: None,
            backend: Backend::portable(),
        }
    }

    /// Decodes with the weight matrices (the linears, the token embedding and the
    /// classifier) rounded to bf16: a copy of `params` in bf16 is made here, once,
    /// and [`Decoder::feed`] streams half the bytes per token. Feeds of up to 8 rows
    /// (decoding steps) and the classifier run the GEMV on the bf16 weights with f32
    /// activations (weight-only bf16); longer feeds (a prompt) run the blocks' linears
    /// on the bf16 GEMM of `dtype = "bfloat16"` training
    /// ([`bf16::gemm::matmul_bf16_wt`] on `backend`'s kernel, activations rounded to
    /// bf16 as operands). The token lookup reads the bf16 table, widened exactly.
    /// Layer norms, biases, learned positions, softmax, the residual stream and
    /// accumulation stay f32. `feed` must then be given the same `params`.
    pub fn with_bf16_weights(self, params: &[f32], backend: &Backend) -> Decoder {
        self.with_bf16_copy(Decoder::bf16_copy(params), backend)
    }

    /// [`Decoder::with_bf16_weights`] for `params` that serve this decoder alone (a
    /// chat session, the server): see [`Decoder::bf16_copy_releasing`].
    pub fn with_bf16_weights_releasing(
        self,
        params: &mut [f32],
        layout: &ParamLayout,
        backend: &Backend,
    ) -> Decoder {
        self.with_bf16_copy(Decoder::bf16_copy_releasing(params, layout), backend)
    }

    /// The bf16 copy of `params` that [`Decoder::with_bf16_weights`] makes, to hand
    /// to decoders made later ([`Decoder::with_bf16_copy`]) as a model loaded in
    /// bf16 would be.
    pub fn bf16_copy(params: &[f32]) -> Vec<Bf16> {
        let mut copy = Bf16Copy::with_capacity(params.len());
        copy.push(params);
        copy.finish()
    }

    /// [`Decoder::bf16_copy`], giving back the memory of the f32 weights that no
    /// decoder reading the copy reads: the weight matrices (the blocks' linears, the
    /// token embedding, an untied classifier), each released
    /// ([`crate::resident::release`]) as soon as it is copied. The model is then held
    /// once, in bf16, with only its norms, biases and learned positions also in f32,
    /// not in f32 and bf16 both; the peak while copying is the f32 model and one
    /// matrix more. Afterwards those weights of `params` read as zeros, so `params`
    /// can serve only decoders that read this copy.
    pub fn bf16_copy_releasing(params: &mut [f32], layout: &ParamLayout) -> Vec<Bf16> {
        assert_eq!(params.len(), layout.len, "params do not match the layout");
        let mut matrices: Vec<_> = layout
            .layers
            .iter()
            .flat_map(|l| l.linears().map(|s| s.weight.range()))
            .chain([layout.wte.range(), layout.lm_head.range()])
            .filter(|r| !r.is_empty())
            .collect();
        matrices.sort_by_key(|r| r.start);
        let mut copy = Bf16Copy::with_capacity(params.len());
        let mut at = 0;
        for r in matrices {
            copy.push(&params[at..r.start]);
            copy.push(&params[r.clone()]);
            at = r.end;
            crate::resident::release(params, r);
        }
        copy.push(&params[at..]);
        copy.finish()
    }

    /// [`Decoder::with_bf16_weights`] with a copy made beforehand by
    /// [`Decoder::bf16_copy`] of the `params` that `feed` will be given, its prompts'
    /// products on `backend`'s kernel.
    pub fn with_bf16_copy(mut self, weights: Vec<Bf16>, backend: &Backend) -> Decoder {
        self.weights_bf16 = Some(weights);
        self.backend = *backend;
        self
    }

    /// Gives back the bf16 copy ([`Decoder::with_bf16_copy`]), leaving the decoder
    /// on f32 weights.
    pub fn take_bf16_copy(&mut self) -> Option<Vec<Bf16>> {
        self.weights_bf16.take()
    }

    /// Whether the matmuls read a bf16 copy of the weights.
    pub fn reads_bf16_weights(&self) -> bool {
        self.weights_bf16.is_some()
    }

    /// Feeds `p` new tokens per sequence and returns the logits of the last new
    /// position, (B, V) over the real vocabulary.
    ///
    /// tokens: (B, p) row-major, ids < Vp. Their keys and values are appended to the
    /// cache, and each attends causally to every cached position up to its own
    /// (including the new ones before it). `p > 1` prefills a prompt in one pass
    /// (`B·p` rows through each matmul); `p = 1` is a decoding step.
    ///
    /// # Panics
    /// If the shapes disagree with the decoder or the parameters, a token id is not in
    /// the padded vocabulary, or the cache would exceed `max_len` positions.
    pub fn feed(
        &mut self,
        params: &[f32],
        layout: &ParamLayout,
        tokens: &[u32],
        p: usize,
    ) -> &[f32] {
        self.advance(params, layout, tokens, p);
        self.final_logits(params, layout, p)
    }

    /// [`Decoder::feed`], handing also every new row's logits to `each(row, logits)`
    /// first, rows in order (`row = seq·p + i` for the `i`-th new token of sequence
    /// `seq`; logits (V)): what scoring a text needs, where `feed` gives only the
    /// last row's. The rows go through `ln_f` and the classifier ([`ALL_ROWS_CHUNK`]
    /// at a time, so the (B·p, V) matrix never exists whole; this allocates those
    /// chunks' buffers): the GEMM on the f32 weights, or with bf16 weights the GEMV
    /// on the copy that [`Decoder::feed`]'s last rows run (the same bits for them).
    pub fn feed_all(
        &mut self,
        params: &[f32],
        layout: &ParamLayout,
        tokens: &[u32],
        p: usize,
        mut each: impl FnMut(usize, &[f32]),
    ) -> &[f32] {
        self.advance(params, layout, tokens, p);
        let (n, c, v) = (self.shape.b * p, self.shape.c, self.shape.v);
        let chunk = ALL_ROWS_CHUNK.min(n);
        let mut normed = vec![0.0; chunk * c];
        let mut stats = NormStats::new(chunk);
        let mut logits = vec![0.0; chunk * v];
        let cls = layout.classifier();
        let weights = cls.start..cls.start + v * c;
        for (k, rows) in self.x[..n * c].chunks(chunk * c).enumerate() {
            let m = rows.len() / c;
            let out = &mut normed[..m * c];
            norm_forward::<false>(&self.family, params, layout.ln_f, out, &mut stats, rows);
            let (out, normed) = (&mut logits[..m * v], &normed[..m * c]);
            match &self.weights_bf16 {
                Some(w16) => gemv(out, normed, Weights::Bf16(&w16[weights.clone()]), c, false),
                None => {
                    let cls = Classifier {
                        wte: &params[weights.clone()],
                        packs: None,
                        c,
                        v,
                        backend: &self.backend,
                    };
                    classifier_logits(out, normed, cls);
                }
            }
            for (i, row) in logits[..m * v].chunks_exact(v).enumerate() {
                let at = k * chunk + i;
                each(at, row);
                if at % p == p - 1 {
                    self.logits[at / p * v..][..v].copy_from_slice(row);
                }
            }
        }
        &self.logits
    }

    /// Continues `prefix`'s one sequence in each of this decoder's B: its cached
    /// positions are copied into every sequence's cache, so that what is fed next
    /// (B different continuations) attends to the same prefix, computed once.
    ///
    /// # Panics
    /// If `prefix` does not decode one sequence of the same model, or holds more
    /// positions than this decoder.
    pub fn fork_from(&mut self, prefix: &Decoder) {
        let (s, from) = (self.shape, prefix.shape);
        assert!(
            from.b == 1 && (from.c, from.kv, from.hs, from.n_layer) == (s.c, s.kv, s.hs, s.n_layer),
            "fork_from needs a one-sequence decoder of the same model"
        );
        assert!(
            prefix.len <= s.max_len,
            "the prefix is longer than the decoder"
        );
        let used = prefix.len * s.hs;
        let (src_head, dst_head) = (from.max_len * s.hs, s.max_len * s.hs);
        for (dst, src) in [
            (&mut self.keys, &prefix.keys),
            (&mut self.values, &prefix.values),
        ] {
            // (L, 1, KV, from.max_len, HS) into (L, B, KV, max_len, HS).
            for l in 0..s.n_layer {
                for seq in 0..s.b {
                    for h in 0..s.kv {
                        let at = ((l * s.b + seq) * s.kv + h) * dst_head;
                        let from = (l * s.kv + h) * src_head;
                        dst[at..at + used].copy_from_slice(&src[from..from + used]);
                    }
                }
            }
        }
        self.len = prefix.len;
    }

    /// Forgets every cached position from `len` on: what is fed next continues the
    /// first `len` positions.
    ///
    /// # Panics
    /// If fewer than `len` positions are cached.
    pub fn truncate(&mut self, len: usize) {
        assert!(len <= self.len, "only {} positions are cached", self.len);
        self.len = len;
    }

    /// The transformer blocks over `p` new tokens per sequence: appends their keys
    /// and values to the cache and leaves their output rows in `x`.
    ///
    /// A decoding step (its products on the GEMV) runs on one of the pool's threads,
    /// not the caller's: for a small model it is a few hundred short parallel
    /// products, and from outside the pool each would hand its work over and wait to
    /// be woken (SmolLM2-135M: 5-20 % of the step). From inside, the thread works on
    /// them itself. A prompt's products are long enough not to care, and stay on the
    /// caller's thread with its per-thread buffers (`matmul_bf16_wt`'s widened
    /// weight), which every pool thread would otherwise come to hold a copy of.
    fn advance(&mut self, params: &[f32], layout: &ParamLayout, tokens: &[u32], p: usize) {
        self.check(params, layout, tokens, p);
        if runs_on_the_gemv(self.shape.b * p) {
            rayon::scope(|_| self.run_blocks(params, layout, tokens, p));
        } else {
            self.run_blocks(params, layout, tokens, p);
        }
    }

    /// [`Decoder::advance`] on the calling thread (inputs checked).
    fn run_blocks(&mut self, params: &[f32], layout: &ParamLayout, tokens: &[u32], p: usize) {
        let s = self.shape;
        let (n, c, start) = (s.b * p, s.c, self.len);
        let d = Dims::new(s.b, p, c, s.nh).with_heads(s.kv, s.hs);
        // Learned positions from `start` on (none where positions are rotary).
        let wpe = &params[layout.wpe];
        let wpe = &wpe[(start * c).min(wpe.len())..];
        let x = &mut self.x[..n * c];
        match &self.weights_bf16 {
            Some(w16) => encoder_forward(x, tokens, &w16[layout.wte.range()], wpe, p, c),
            None => encoder_forward(x, tokens, &params[layout.wte], wpe, p, c),
        }
        let per_layer = s.cache_floats();
        let caches = self
            .keys
            .chunks_exact_mut(per_layer)
            .zip(self.values.chunks_exact_mut(per_layer));
        for (at, (keys, values)) in layout.layers.iter().zip(caches) {
            let scores = &mut self.scores;
            let mut attend = |out: &mut [f32], qkv: &[f32]| {
                let cache = KvCache {
                    keys: &mut *keys,
                    values: &mut *values,
                    max_len: s.max_len,
                };
                cached_attention(out, qkv, cache, scores, d, start)
            };
            let w = BlockWeights {
                family: &self.family,
                rope: self.rope.as_ref(),
                params,
                matmul: params,
                at,
                lora: None,
                matmul_bf16: self.weights_bf16.as_deref(),
                decoding: true,
                packs: None,
                backend: &self.backend,
            };
            let (x, a) = (&self.x[..n * c], &mut self.acts);
            block_forward::<false>(
                &w,
                x,
                a,
                &mut self.scratch,
                Attend::Cache {
                    start,
                    attend: &mut attend,
                },
                None,
                d,
            );
            std::mem::swap(&mut self.x, &mut self.acts.res3);
        }
        self.len += p;
    }

    /// ln_f and the classifier on the last new row of each sequence: returns (B, V).
    fn final_logits(&mut self, params: &[f32], layout: &ParamLayout, new: usize) -> &[f32] {
        let _t = crate::profile::scope(crate::profile::Section::Classifier);
        let (c, v) = (self.shape.c, self.shape.v);
        for (seq, row) in self.last.chunks_exact_mut(c).enumerate() {
            let at = (seq * new + new - 1) * c;
            row.copy_from_slice(&self.x[at..at + c]);
        }
        let (out, x) = (&mut self.lnf, &self.last);
        norm_forward::<false>(
            &self.family,
            params,
            layout.ln_f,
            out,
            &mut self.lnf_stats,
            x,
        );
        // One row per sequence against 50257 × 768 weights: a matrix-vector product,
        // bound by streaming the classifier (see kernels::gemv).
        let cls = layout.classifier();
        let rows = cls.start..cls.start + v * c;
        let wte = match &self.weights_bf16 {
            Some(w16) => Weights::Bf16(&w16[rows]),
            None => Weights::F32(&params[rows]),
        };
        gemv(&mut self.logits, &self.lnf, wte, c, false);
        &self.logits
    }

    /// Positions cached per sequence.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Positions the cache can hold per sequence.
    pub fn max_len(&self) -> usize {
        self.shape.max_len
    }

    /// Sequences decoded together (B).
    pub fn batch(&self) -> usize {
        self.shape.b
    }

    /// Forgets every cached position (the buffers are kept).
    pub fn reset(&mut self) {
        self.len = 0;
    }

    fn check(&self, params: &[f32], layout: &ParamLayout, tokens: &[u32], p: usize) {
        let s = self.shape;
        assert_eq!(params.len(), layout.len, "params do not match the layout");
        if let Some(w16) = &self.weights_bf16 {
            assert_eq!(w16.len(), params.len(), "params are not the bf16 copy's");
        }
        assert!(
            layout.layers.len() == s.n_layer && layout.wte.len() == s.vp * s.c,
            "the layout is not this decoder's model"
        );
        assert!(
            p > 0 && tokens.len() == s.b * p,
            "tokens must be (B, p) with p ≥ 1"
        );
        assert!(
            self.len + p <= s.max_len,
            "{} cached + {p} new positions exceed the decoder's {}",
            self.len,
            s.max_len
        );
        assert!(
            tokens.iter().all(|&t| (t as usize) < s.vp),
            "token id beyond the vocabulary"
        );
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::kernels::bf16::gemm::bf16_weight_packs_on_this_thread;
    use crate::kernels::bf16::Kernel;

    /// This machine's bf16 back-end, as `sample` picks it without a request.
    fn here() -> Backend {
        Backend::detect(None)
    }
    use crate::kernels::testutil::rand_vec;
    use crate::model::Gpt;

    pub(crate) fn small(bias: bool) -> ModelConfig {
        ModelConfig {
            vocab_size: 53,
            block_size: 16,
            n_layer: 2,
            n_head: 4,
            n_embd: 32,
            bias,
            dropout: 0.0,
            llama: None,
        }
    }

    /// A model with uniform random weights (padded vocabulary rows 0), whose buffers
    /// fit `max_b` sequences of a whole block.
    pub(crate) fn random_gpt(cfg: ModelConfig, max_b: usize, seed: u64) -> Gpt {
        let t = cfg.block_size;
        let mut gpt = Gpt::new(cfg, max_b, t).unwrap();
        let real = gpt.config().vocab_size * gpt.config().n_embd;
        let pad = real..gpt.layout.wte.end;
        let noise = rand_vec(gpt.params.len(), seed);
        for (i, (p, n)) in gpt.params.iter_mut().zip(noise).enumerate() {
            *p = if pad.contains(&i) { 0.0 } else { 0.3 * n };
        }
        gpt.set_training(false);
        gpt
    }

    fn tokens(n: usize, v: usize, salt: usize) -> Vec<u32> {
        (0..n)
            .map(|i| ((i * 17 + salt * 5 + 3) % v) as u32)
            .collect()
    }

    /// Asserts `|got - want| ≤ 1e-5 · (1 + |want|)` element-wise.
    fn assert_close(what: &str, got: &[f32], want: &[f32]) {
        assert_eq!(got.len(), want.len(), "{what}: length");
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                "{what}: logit {i} is {g}, recomputed {w}"
            );
        }
    }

    /// The logits of the last position of each of the `b` sequences of `x` (B, T),
    /// recomputed over the whole sequences by the training forward.
    fn last_logits(gpt: &mut Gpt, x: &[u32], b: usize, t: usize) -> Vec<f32> {
        let v = gpt.config().vocab_size;
        let all = gpt.logits(x, b, t);
        let rows = all.chunks_exact(v).skip(t - 1).step_by(t);
        rows.flatten().copied().collect()
    }

    /// (B, T) rows of `seqs` cut to their first `t` tokens.
    fn prefix(seqs: &[Vec<u32>], t: usize) -> Vec<u32> {
        seqs.iter().flat_map(|s| s[..t].iter().copied()).collect()
    }

    fn check_against_recompute(bias: bool) {
        let (b, prompt) = (2, 5);
        let mut gpt = random_gpt(small(bias), b, 3);
        let (v, block) = (gpt.config().vocab_size, gpt.config().block_size);
        let seqs: Vec<Vec<u32>> = (0..b).map(|i| tokens(block, v, i)).collect();
        let mut dec = Decoder::new(gpt.config(), b, block);
        let got = dec.feed(&gpt.params, &gpt.layout, &prefix(&seqs, prompt), prompt);
        let got = got.to_vec();
        let want = last_logits(&mut gpt, &prefix(&seqs, prompt), b, prompt);
        assert_close("prefill", &got, &want);
        for t in prompt + 1..=block {
            let step: Vec<u32> = seqs.iter().map(|s| s[t - 1]).collect();
            let got = dec.feed(&gpt.params, &gpt.layout, &step, 1).to_vec();
            assert_eq!(dec.len(), t);
            let want = last_logits(&mut gpt, &prefix(&seqs, t), b, t);
            assert_close(&format!("step to length {t}"), &got, &want);
        }
    }

    #[test]
    fn prefill_then_steps_match_full_recompute() {
        check_against_recompute(true);
    }

    #[test]
    fn prefill_then_steps_match_full_recompute_without_bias() {
        check_against_recompute(false);
    }

    #[test]
    fn chunked_prefill_equals_one_pass() {
        let gpt = random_gpt(small(true), 1, 4);
        let seq = tokens(12, gpt.config().vocab_size, 1);
        let mut whole = Decoder::new(gpt.config(), 1, 16);
        let want = whole.feed(&gpt.params, &gpt.layout, &seq, 12).to_vec();
        let mut chunked = Decoder::new(gpt.config(), 1, 16);
        for range in [0..3, 3..8, 8..9, 9..12] {
            let p = range.len();
            chunked.feed(&gpt.params, &gpt.layout, &seq[range], p);
        }
        assert_eq!(chunked.len(), 12);
        assert_close("chunked", &chunked.logits, &want);
        // The caches agree too, so what follows agrees.
        let a = whole.feed(&gpt.params, &gpt.layout, &[7], 1).to_vec();
        let b = chunked.feed(&gpt.params, &gpt.layout, &[7], 1).to_vec();
        assert_close("next step", &b, &a);
    }

    #[test]
    fn batch_of_three_equals_three_separate_runs() {
        let gpt = random_gpt(small(false), 1, 5);
        let v = gpt.config().vocab_size;
        let seqs: Vec<Vec<u32>> = (0..3).map(|i| tokens(10, v, 7 * i)).collect();
        let (prompt, total) = (4, 10);
        let mut batch = Decoder::new(gpt.config(), 3, total);
        let mut singles: Vec<Decoder> = (0..3)
            .map(|_| Decoder::new(gpt.config(), 1, total))
            .collect();
        let mut fed = prompt;
        let mut got = batch
            .feed(&gpt.params, &gpt.layout, &prefix(&seqs, prompt), prompt)
            .to_vec();
        loop {
            for (i, (single, seq)) in singles.iter_mut().zip(&seqs).enumerate() {
                let new = if fed == prompt {
                    &seq[..prompt]
                } else {
                    &seq[fed - 1..fed]
                };
                let want = single.feed(&gpt.params, &gpt.layout, new, new.len());
                assert_close(
                    &format!("sequence {i} at length {fed}"),
                    &got[i * v..(i + 1) * v],
                    want,
                );
            }
            if fed == total {
                break;
            }
            fed += 1;
            let step: Vec<u32> = seqs.iter().map(|s| s[fed - 1]).collect();
            got = batch.feed(&gpt.params, &gpt.layout, &step, 1).to_vec();
        }
    }

    /// Every new row's logits, as the training forward computes them over the whole
    /// sequences, and after a cached prefix as well; the returned last rows are
    /// `feed`'s.
    #[test]
    fn feed_all_gives_every_rows_logits() {
        let (b, t) = (2, 11);
        let mut gpt = random_gpt(small(true), b, 8);
        let v = gpt.config().vocab_size;
        let seqs: Vec<Vec<u32>> = (0..b).map(|i| tokens(t, v, 3 * i)).collect();
        let want = gpt.logits(&prefix(&seqs, t), b, t);
        let mut dec = Decoder::new(gpt.config(), b, t);
        dec.feed(&gpt.params, &gpt.layout, &prefix(&seqs, 4), 4);
        let rest: Vec<u32> = seqs.iter().flat_map(|s| s[4..].iter().copied()).collect();
        let mut got = vec![f32::NAN; b * (t - 4) * v];
        let last = dec.feed_all(&gpt.params, &gpt.layout, &rest, t - 4, |row, logits| {
            got[row * v..(row + 1) * v].copy_from_slice(logits);
        });
        let last = last.to_vec();
        for seq in 0..b {
            for i in 0..t - 4 {
                let row = &got[(seq * (t - 4) + i) * v..][..v];
                let full = &want[(seq * t + 4 + i) * v..][..v];
                assert_close(&format!("sequence {seq} position {}", 4 + i), row, full);
            }
            assert_close(
                "last row",
                &last[seq * v..][..v],
                &want[(seq * t + t - 1) * v..][..v],
            );
        }
    }

    /// The Llama families (RMSNorm, RoPE, 4 query heads over 2 key/value heads, Qwen2's
    /// biases, Qwen3's q/k norm; tied and untied heads) through the decoder: a prompt's
    /// last rows from `feed`, then every row from `feed_all` and its last rows, equal
    /// the training forward's logits. `feed_all` once applied GPT-2's layer norm and
    /// `wte` to every family.
    #[test]
    fn llama_families_decode_as_the_training_forward_computes() {
        use crate::model::family::LlamaType;
        use crate::model::tests_llama::tiny_llama;
        for family in [LlamaType::Llama, LlamaType::Qwen2, LlamaType::Qwen3] {
            for tied in [false, true] {
                let what = format!("{family:?}, tied {tied}");
                let cfg = tiny_llama(family, tied, 0.0);
                let (b, t, head) = (2, cfg.block_size, 3);
                let mut gpt = random_gpt(cfg, b, 21);
                let v = gpt.config().vocab_size;
                let seqs: Vec<Vec<u32>> = (0..b).map(|i| tokens(t, v, 2 * i + 1)).collect();
                let want = gpt.logits(&prefix(&seqs, t), b, t);
                let row_of = |seq: usize, pos: usize| &want[(seq * t + pos) * v..][..v];
                let mut dec = Decoder::new(gpt.config(), b, t);
                let first = dec.feed(&gpt.params, &gpt.layout, &prefix(&seqs, head), head);
                for seq in 0..b {
                    let got = &first[seq * v..][..v];
                    assert_close(&format!("{what}: prompt {seq}"), got, row_of(seq, head - 1));
                }
                let rest: Vec<u32> = seqs.iter().flat_map(|s| s[head..].to_vec()).collect();
                let p = t - head;
                let mut got = vec![f32::NAN; b * p * v];
                let last = dec.feed_all(&gpt.params, &gpt.layout, &rest, p, |row, logits| {
                    got[row * v..(row + 1) * v].copy_from_slice(logits);
                });
                let last = last.to_vec();
                for seq in 0..b {
                    for i in 0..p {
                        let row = &got[(seq * p + i) * v..][..v];
                        let at = format!("{what}: sequence {seq} position {}", head + i);
                        assert_close(&at, row, row_of(seq, head + i));
                    }
                    let at = format!("{what}: last row of {seq}");
                    assert_close(&at, &last[seq * v..][..v], row_of(seq, t - 1));
                }
            }
        }
    }

    /// Three continuations of one prefix, forked from a one-sequence decoder, give
    /// what three whole sequences give; truncating returns to the prefix. GPT-2, and
    /// a Llama with 4 query heads over 2 key/value heads and over one (the cache
    /// holds KV heads: forking once indexed it by query heads).
    #[test]
    fn forked_continuations_match_whole_sequences() {
        use crate::model::family::LlamaType;
        use crate::model::tests_llama::tiny_llama;
        let llama = |kv: usize| {
            let mut cfg = tiny_llama(LlamaType::Llama, true, 0.0);
            cfg.block_size = 12;
            cfg.llama.as_mut().unwrap().n_kv_head = kv;
            cfg
        };
        for cfg in [small(false), llama(2), llama(1)] {
            let what = format!("{} KV heads", cfg.kv_heads());
            let mut gpt = random_gpt(cfg, 3, 9);
            let v = gpt.config().vocab_size;
            let head = tokens(5, v, 1);
            let tails: Vec<Vec<u32>> = (0..3).map(|i| tokens(4, v, 10 + i)).collect();
            let mut prefix_dec = Decoder::new(gpt.config(), 1, 8);
            prefix_dec.feed(&gpt.params, &gpt.layout, &head, 5);
            let mut forks = Decoder::new(gpt.config(), 3, 12);
            for round in 0..2 {
                forks.fork_from(&prefix_dec);
                assert_eq!(forks.len(), 5);
                let fed: Vec<u32> = tails.iter().flatten().copied().collect();
                let got = forks.feed(&gpt.params, &gpt.layout, &fed, 4).to_vec();
                let whole: Vec<Vec<u32>> = tails.iter().map(|t| [&head[..], t].concat()).collect();
                let want = last_logits(&mut gpt, &prefix(&whole, 9), 3, 9);
                assert_close(&format!("{what}, round {round}"), &got, &want);
                forks.truncate(2);
                assert_eq!(forks.len(), 2);
            }
        }
    }

    #[test]
    fn reset_starts_over() {
        let gpt = random_gpt(small(true), 1, 6);
        let seq = tokens(6, gpt.config().vocab_size, 2);
        let mut dec = Decoder::new(gpt.config(), 1, 8);
        assert!(dec.is_empty());
        let first = dec.feed(&gpt.params, &gpt.layout, &seq, 6).to_vec();
        dec.reset();
        assert_eq!(dec.len(), 0);
        let again = dec.feed(&gpt.params, &gpt.layout, &seq, 6);
        assert_eq!(again, &first[..], "same input, same buffers: identical");
        assert_eq!((dec.len(), dec.max_len(), dec.batch()), (6, 8, 1));
    }

    /// With bf16 weights, the GEMV's rows (a prompt of up to 8 rows, the steps, and
    /// every row `feed_all` scores) give the f32 decoder's logits on the same
    /// parameters with every weight matrix (the linears and the token embedding,
    /// lookup and classifier alike) rounded to bf16: weight-only bf16. `feed_all`'s
    /// last rows are the bits `feed` gives.
    #[test]
    fn bf16_weights_decode_the_rounded_model() {
        let gpt = random_gpt(small(true), 2, 7);
        let (layout, params) = (&gpt.layout, &gpt.params);
        let mut rounded = params.clone();
        let matmuls = layout.layers.iter().flat_map(|l| {
            let ls = l.linears();
            ls.map(|s| s.weight)
        });
        for span in matmuls.chain([layout.wte]) {
            bf16::round_in_place(&mut rounded[span]);
        }
        let v = gpt.config().vocab_size;
        let seq = tokens(2 * 9, v, 3);
        let new = || Decoder::new(gpt.config(), 2, 9);
        let mut half = new().with_bf16_weights(params, &here());
        let (mut exact, mut full) = (new(), new());
        let (prompt, rest) = seq.split_at(2 * 4);
        let got = half.feed(params, layout, prompt, 4).to_vec();
        assert_close("prefill", &got, exact.feed(&rounded, layout, prompt, 4));
        let unrounded = full.feed(params, layout, prompt, 4);
        let moved = got.iter().zip(unrounded).map(|(a, b)| (a - b).abs());
        let moved = moved.fold(0.0f32, f32::max);
        assert!(
            moved > 1e-4,
            "rounding the weights moves the logits ({moved}) past the tolerance"
        );
        let (steps, scored) = rest.split_at(2 * 2);
        for step in steps.chunks_exact(2) {
            let got = half.feed(params, layout, step, 1).to_vec();
            assert_close("step", &got, exact.feed(&rounded, layout, step, 1));
        }
        // The last 3 positions of each sequence, scored row by row, and fed.
        let mut fed = Decoder::new(gpt.config(), 2, 9).with_bf16_weights(params, &here());
        fed.feed(params, layout, prompt, 4);
        for step in steps.chunks_exact(2) {
            fed.feed(params, layout, step, 1);
        }
        let (mut got, mut want) = (Vec::new(), Vec::new());
        let last = half.feed_all(params, layout, scored, 3, |_, row| {
            got.extend_from_slice(row)
        });
        let last = last.to_vec();
        exact.feed_all(&rounded, layout, scored, 3, |_, row| {
            want.extend_from_slice(row)
        });
        assert_close("scored rows", &got, &want);
        for seq in 0..2 {
            let row = &got[(seq * 3 + 2) * v..][..v];
            assert_eq!(&last[seq * v..][..v], row, "feed_all's last row of {seq}");
        }
        assert_eq!(
            fed.feed(params, layout, scored, 3),
            &last[..],
            "feed's last rows"
        );
    }

    /// A bf16 decoder on parameters whose f32 matrices it released gives the same
    /// bits as one on the whole parameters, prompt (the bf16 GEMM), steps (the GEMV)
    /// and every row's scoring logits alike: nothing it runs reads what was given
    /// back, which reads as zeros; nothing else changed. GPT-2 at a width whose
    /// weights span whole pages (given back to the system), and the Llama families,
    /// tied and untied, at widths inside a page (zeroed by hand).
    #[test]
    fn a_bf16_decoder_reads_nothing_it_released() {
        use crate::model::family::LlamaType;
        use crate::model::tests_llama::tiny_llama;
        let mut configs = vec![("gpt-2".to_string(), medium())];
        for family in [LlamaType::Llama, LlamaType::Qwen2, LlamaType::Qwen3] {
            for tied in [false, true] {
                configs.push((
                    format!("{family:?}, tied {tied}"),
                    tiny_llama(family, tied, 0.0),
                ));
            }
        }
        for (what, cfg) in configs {
            let gpt = random_gpt(cfg, 2, 12);
            let (layout, t) = (&gpt.layout, gpt.config().block_size);
            let seqs = tokens(2 * t, gpt.config().vocab_size, 4);
            let (prompt, rest) = (prefix(&[seqs[..t].to_vec(), seqs[t..].to_vec()], 5), 5);
            let run = |params: &mut Vec<f32>, release: bool| {
                let dec = Decoder::new(gpt.config(), 2, t);
                let mut dec = match release {
                    true => dec.with_bf16_weights_releasing(params, layout, &here()),
                    false => dec.with_bf16_weights(params, &here()),
                };
                let mut logits = dec.feed(params, layout, &prompt, 5).to_vec();
                for i in rest..t - 1 {
                    let step = [seqs[i], seqs[t + i]];
                    logits.extend_from_slice(dec.feed(params, layout, &step, 1));
                }
                let last = [seqs[t - 1], seqs[2 * t - 1]];
                dec.feed_all(params, layout, &last, 1, |_, row| {
                    logits.extend_from_slice(row)
                });
                logits
            };
            let mut kept = gpt.params.clone();
            let mut released = gpt.params.clone();
            let want = run(&mut kept, false);
            let got = run(&mut released, true);
            assert!(want.iter().all(|x| x.is_finite()), "{what}");
            let same = got
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{what}: logits differ from the unreleased decoder's");
            assert_eq!(kept, gpt.params, "{what}: the plain copy changes nothing");
            let mut zeroed = gpt.params.clone();
            for l in &layout.layers {
                for s in l.linears() {
                    zeroed[s.weight.range()].fill(0.0);
                }
            }
            zeroed[layout.wte.range()].fill(0.0);
            zeroed[layout.lm_head.range()].fill(0.0);
            assert!(zeroed != gpt.params, "{what}");
            assert_eq!(
                released, zeroed,
                "{what}: exactly the matrices are released"
            );
        }
    }

    /// Large enough that each linear product of a 2 × 16 prompt (32 rows) has the
    /// 2^20 multiply-adds that send it to the AMX or AVX512-BF16 kernel.
    fn medium() -> ModelConfig {
        ModelConfig {
            n_embd: 256,
            block_size: 32,
            ..small(true)
        }
    }

    /// The bf16 decoder's logits after a (2, 16) prompt, its products on `backend`.
    fn bf16_prompt_logits(gpt: &Gpt, backend: &Backend, prompt: &[u32]) -> Vec<f32> {
        let dec = Decoder::new(gpt.config(), 2, 32);
        let mut dec = dec.with_bf16_weights(&gpt.params, backend);
        dec.feed(&gpt.params, &gpt.layout, prompt, 16).to_vec()
    }

    /// A prompt of more than 8 rows runs every linear product on the bf16 GEMM that
    /// training picks here (AMX or AVX512-BF16: packs of the bf16 weights, counted),
    /// never on weights widened to f32; the steps after it stay on the GEMV.
    #[test]
    fn a_bf16_prompt_runs_the_bf16_gemm_and_steps_the_gemv() {
        let gpt = random_gpt(medium(), 2, 8);
        let prompt = tokens(2 * 16, gpt.config().vocab_size, 1);
        let per_prompt = 4 * gpt.config().n_layer;
        for kernel in [Kernel::Amx, Kernel::Avx512Bf16] {
            let Some(backend) = Backend::with_kernel(kernel) else {
                eprintln!("{kernel:?} prompt not tested: not usable on this CPU");
                continue;
            };
            on_a_pool_of_its_own(|| {
                let dec = Decoder::new(gpt.config(), 2, 32);
                let mut dec = dec.with_bf16_weights(&gpt.params, &backend);
                let (params, layout) = (&gpt.params, &gpt.layout);
                let packs = bf16_weight_packs_on_this_thread();
                dec.feed(params, layout, &prompt, 16);
                let prompt_packs = bf16_weight_packs_on_this_thread() - packs;
                assert_eq!(
                    prompt_packs, per_prompt,
                    "{kernel:?}: products on bf16 packs"
                );
                dec.feed(params, layout, &prompt[..2], 1);
                let step_packs = bf16_weight_packs_on_this_thread() - packs - per_prompt;
                assert_eq!(step_packs, 0, "{kernel:?}: a step packed a weight");
            });
        }
    }

    /// Runs `f` on a worker of a new pool: [`Decoder::feed`] then runs on the thread
    /// that counts (`*_on_this_thread`), and no other test's work can join it there.
    fn on_a_pool_of_its_own<R: Send>(f: impl FnOnce() -> R + Send) -> R {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build();
        pool.expect("a thread pool for the test").install(f)
    }

    /// Decoding steps stream every weight once on the GEMV, in f32 and bf16 alike:
    /// one product per linear layer and the classifier's; a prompt's linear layers
    /// run on the GEMM (only its classifier row on the GEMV).
    #[test]
    fn steps_run_every_linear_layer_on_the_gemv() {
        use crate::kernels::gemv::gemv_calls_on_this_thread as calls;
        let gpt = random_gpt(small(true), 2, 4);
        let (params, layout) = (&gpt.params, &gpt.layout);
        let per_step = 4 * gpt.config().n_layer + 1;
        let prompt = tokens(2 * 12, gpt.config().vocab_size, 5);
        for bf16 in [false, true] {
            let mut dec = Decoder::new(gpt.config(), 2, 16);
            if bf16 {
                dec = dec.with_bf16_weights(params, &here());
            }
            on_a_pool_of_its_own(|| {
                let before = calls();
                dec.feed(params, layout, &prompt, 12);
                assert_eq!(calls() - before, 1, "bf16 {bf16}: a prompt on the GEMV");
                dec.feed(params, layout, &prompt[..2], 1);
                assert_eq!(calls() - before - 1, per_step, "bf16 {bf16}: a step");
            });
        }
    }

    /// A bf16 prompt's logits (activations rounded to bf16 as matmul operands, bf16
    /// weights, f32 accumulation; logits here within ±2.1), against:
    /// - the f32 decoder on the rounded weights, activations not rounded: bit for bit
    ///   the f32 GEMM path's summation order, so any difference is the activations'
    ///   rounding (1.8e-3 to 3.1e-3 · (1 + |logit|) over seeds 9–14), bound 0.01;
    /// - the training model's bf16 forward on the same tokens, which rounds the same
    ///   operands plus q, k, v and the attention probabilities, and reads the final
    ///   layer norm rounded (3.5e-3 to 5.3e-3 measured), bound 0.02;
    /// - on AMX and AVX512-BF16, the f32 GEMM path (`bf16_kernel = f32`): the
    ///   same values summed in another order, which can move an activation across a
    ///   bf16 rounding boundary, one bf16 ulp (measured 3e-7 to 9.8e-4), bound 3e-3.
    #[test]
    fn bf16_prompt_logits_match_the_references() {
        let mut gpt = random_gpt(medium(), 2, 9);
        bf16::round_in_place(&mut gpt.params[gpt.layout.wte]);
        let prompt = tokens(2 * 16, gpt.config().vocab_size, 2);
        let on_f32 = Backend::with_kernel(Kernel::F32).expect("the f32 GEMM runs everywhere");
        let f32_gemm = bf16_prompt_logits(&gpt, &on_f32, &prompt);
        let close = |what: &str, got: &[f32], want: &[f32], tol: f32| {
            let worst = got
                .iter()
                .zip(want)
                .map(|(g, w)| (g - w).abs() / (1.0 + w.abs()));
            let worst = worst.fold(0.0f32, f32::max);
            eprintln!("{what}: worst {worst:e} (bound {tol:e})");
            assert!(worst <= tol, "{what}: {worst} > {tol}");
            worst
        };
        for kernel in [Kernel::Amx, Kernel::Avx512Bf16] {
            if let Some(backend) = Backend::with_kernel(kernel) {
                let got = bf16_prompt_logits(&gpt, &backend, &prompt);
                close(&format!("{kernel:?} vs f32 GEMM"), &got, &f32_gemm, 3e-3);
            }
        }
        let mut rounded = gpt.params.clone();
        let matmuls = gpt.layout.layers.iter().flat_map(|l| {
            let ls = l.linears();
            ls.map(|s| s.weight)
        });
        for span in matmuls {
            bf16::round_in_place(&mut rounded[span]);
        }
        let mut f32_dec = Decoder::new(gpt.config(), 2, 32);
        let weight_only = f32_dec.feed(&rounded, &gpt.layout, &prompt, 16).to_vec();
        let apart = close("vs weights only", &f32_gemm, &weight_only, 0.01);
        assert!(apart > 1e-4, "the activations were not rounded ({apart})");
        gpt.set_dtype(Dtype::Bfloat16, &here());
        let training = last_logits(&mut gpt, &prompt, 2, 16);
        close("vs the training bf16 forward", &f32_gemm, &training, 0.02);
    }

    #[test]
    #[should_panic(expected = "exceed the decoder")]
    fn feeding_past_max_len_panics() {
        let gpt = random_gpt(small(true), 1, 6);
        let mut dec = Decoder::new(gpt.config(), 1, 4);
        dec.feed(&gpt.params, &gpt.layout, &[1, 2, 3], 3);
        dec.feed(&gpt.params, &gpt.layout, &[4, 5], 2);
    }
}
