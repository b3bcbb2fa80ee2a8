//! Text generation with the semantics of nanoGPT's `sample.py` / `GPT.generate`, over
//! the KV-cached [`Decoder`].
//!
//! Each step: the model sees the last `block_size` tokens of each sequence; the logits
//! of its last position get the repetition penalty (off by default), are divided by
//! the temperature, cut to the `top_k` largest, turned into probabilities by a softmax
//! over the real vocabulary, cut to the nucleus `top_p` (off by default), and one
//! token is drawn from them: the order of Hugging Face's `generate`.

use crate::data::Tokenizer;
use crate::kernels::bf16::Backend;
use crate::model::decode::Decoder;
use crate::model::{ModelConfig, ParamLayout};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Generation settings; the defaults are those of nanoGPT's `sample.py`.
#[derive(Clone, Debug, PartialEq)]
pub struct SampleOptions {
    /// Sequences generated together, as one batch (B).
    pub num_samples: usize,
    /// Tokens generated per sequence.
    pub max_new_tokens: usize,
    /// Divides the logits: < 1 sharpens, > 1 flattens. `0` means greedy decoding
    /// (always the most likely token, the first one on ties); must not be negative.
    pub temperature: f32,
    /// Keep only the `k` most likely tokens (with every token tied with the k-th).
    /// `None`, `Some(0)` and `Some(k ≥ V)` keep the whole vocabulary.
    pub top_k: Option<usize>,
    /// Seeds the sampling RNG: the same seed gives the same samples.
    pub seed: u64,
    /// Nucleus sampling: keep the most likely tokens whose probabilities add up to at
    /// least `p` (Hugging Face's `top_p`). `None` or `Some(1.0)` keeps all.
    pub top_p: Option<f32>,
    /// Hugging Face's `repetition_penalty`: the logit of every token already in the
    /// sequence (prompt included) is divided by it when positive, multiplied when
    /// negative. `1.0` is off.
    pub repetition_penalty: f32,
    /// Read the matmul weights in bf16 (rounded once per call to [`generate`], or once
    /// per kept decoder with [`generate_in`]), a prompt's products on this back-end:
    /// half the bytes per token; see [`Decoder::with_bf16_weights`]. None: f32.
    pub bf16_weights: Option<Backend>,
}

impl Default for SampleOptions {
    fn default() -> Self {
        SampleOptions {
            num_samples: 10,
            max_new_tokens: 500,
            temperature: 0.8,
            top_k: Some(200),
            seed: 1337,
            top_p: None,
            repetition_penalty: 1.0,
            bf16_weights: None,
        }
    }
}

/// Generates `max_new_tokens` tokens after `prompt` for each of `num_samples`
/// sequences, decoded together as one batch. Returns the new ids per sample (without
/// the prompt); `on_token(sample, id)` also receives each id as it is drawn (steps in
/// order, samples in order within a step), so a caller can stream text.
///
/// The model sees at most the last `block_size` tokens, as in nanoGPT: a prompt that
/// is longer is cropped, and once a sequence outgrows the block the window slides.
///
/// # Panics
/// If `prompt` is empty or holds an id outside the padded vocabulary, if the
/// temperature is negative or not finite, or if `params` does not match `layout`.
pub fn generate(
    params: &[f32],
    layout: &ParamLayout,
    config: &ModelConfig,
    prompt: &[u32],
    opts: &SampleOptions,
    mut on_token: impl FnMut(usize, u32),
) -> Vec<Vec<u32>> {
    generate_until(
        Held::Shared(params),
        layout,
        config,
        prompt,
        opts,
        |i, t| {
            on_token(i, t);
            false
        },
    )
}

/// The weights a generation reads: shared with other readers, or its own (`nanogpt
/// sample`'s), whose f32 matrices a bf16 decoder gives back as its copy is made
/// ([`Decoder::bf16_copy_releasing`]): they read as zeros afterwards.
pub enum Held<'a> {
    Shared(&'a [f32]),
    Own(&'a mut [f32]),
}

/// [`generate`] on `held` weights, where a sequence stops early when
/// `on_token(sample, id)` returns true for it (that token is kept as its last);
/// generation ends when every sequence has stopped or has `max_new_tokens`. Stopped
/// sequences are still decoded with the batch, but their draws are dropped and not
/// reported.
pub fn generate_until(
    held: Held,
    layout: &ParamLayout,
    config: &ModelConfig,
    prompt: &[u32],
    opts: &SampleOptions,
    on_token: impl FnMut(usize, u32) -> bool,
) -> Vec<Vec<u32>> {
    let Some(mut dec) = decoder_for_prompt(config, prompt, opts) else {
        return vec![Vec::new(); opts.num_samples];
    };
    let params: &[f32] = match (held, &opts.bf16_weights) {
        (Held::Shared(params), Some(backend)) => {
            dec = dec.with_bf16_weights(params, backend);
            params
        }
        (Held::Own(params), Some(backend)) => {
            dec = dec.with_bf16_weights_releasing(params, layout, backend);
            params
        }
        (Held::Shared(params), None) => params,
        (Held::Own(params), None) => params,
    };
    generate_in(&mut dec, params, layout, config, prompt, opts, on_token)
}

/// The f32 decoder a generation from `prompt` needs; None where it generates
/// nothing (no samples or no new tokens).
fn decoder_for_prompt(
    config: &ModelConfig,
    prompt: &[u32],
    opts: &SampleOptions,
) -> Option<Decoder> {
    assert!(!prompt.is_empty(), "generation needs a non-empty prompt");
    let nothing = opts.num_samples == 0 || opts.max_new_tokens == 0;
    (!nothing).then(|| decoder_for(config, prompt.len(), opts))
}

/// The positions a generation of `opts` from a `prompt_len`-token prompt feeds at
/// most: the prompt and all but the last new token, cropped to the block. Needs
/// `max_new_tokens` ≥ 1.
fn longest_context(prompt_len: usize, opts: &SampleOptions, config: &ModelConfig) -> usize {
    (prompt_len + opts.max_new_tokens - 1).min(config.block_size)
}

/// A decoder (on f32 weights) with room for a generation of `opts` from a
/// `prompt_len`-token prompt: the one [`generate_until`] makes. Needs
/// `num_samples` and `max_new_tokens` ≥ 1.
pub fn decoder_for(config: &ModelConfig, prompt_len: usize, opts: &SampleOptions) -> Decoder {
    let longest = longest_context(prompt_len, opts, config);
    Decoder::new(config, opts.num_samples, longest)
}

/// [`generate_until`] on a decoder the caller keeps from one call to the next (a chat
/// session), so that its caches and its bf16 weight copy are made once, not per call.
/// Whatever it had cached is forgotten first.
///
/// # Panics
/// As [`generate_until`]; also if `dec` does not decode `num_samples` sequences, is
/// shorter than the prompt and the new tokens (cropped to the block) need, or reads
/// bf16 weights when `opts` does not ask for them (or the reverse).
pub fn generate_in(
    dec: &mut Decoder,
    params: &[f32],
    layout: &ParamLayout,
    config: &ModelConfig,
    prompt: &[u32],
    opts: &SampleOptions,
    mut on_token: impl FnMut(usize, u32) -> bool,
) -> Vec<Vec<u32>> {
    assert!(!prompt.is_empty(), "generation needs a non-empty prompt");
    let b = opts.num_samples;
    if b == 0 || opts.max_new_tokens == 0 {
        return vec![Vec::new(); b];
    }
    let block = config.block_size;
    let longest = longest_context(prompt.len(), opts, config);
    assert!(
        dec.batch() == b && dec.max_len() >= longest,
        "the decoder holds {}×{} positions, generation needs {b}×{longest}",
        dec.batch(),
        dec.max_len()
    );
    assert_eq!(
        dec.reads_bf16_weights(),
        opts.bf16_weights.is_some(),
        "the decoder's weight precision is not the options'"
    );
    // A cache left by an earlier call must not be mistaken for this prompt's.
    dec.reset();
    let mut sampler = Sampler::new(config.vocab_size, opts.temperature, opts.top_k)
        .with_top_p(opts.top_p)
        .with_repetition_penalty(opts.repetition_penalty);
    let mut rng = ChaCha8Rng::seed_from_u64(opts.seed);
    let total = prompt.len() + opts.max_new_tokens;
    let mut seqs: Vec<Vec<u32>> = (0..b)
        .map(|_| {
            let mut s = Vec::with_capacity(total);
            s.extend_from_slice(prompt);
            s
        })
        .collect();
    let mut window = Vec::with_capacity(b * block);
    // Where each sequence stopped (its length then), if it did.
    let mut stopped: Vec<Option<usize>> = vec![None; b];
    for _ in 0..opts.max_new_tokens {
        let logits = next_logits(dec, params, layout, &seqs, block, &mut window);
        for (i, (row, seq)) in logits
            .chunks_exact(config.vocab_size)
            .zip(&mut seqs)
            .enumerate()
        {
            let token = sampler.pick_after(row, seq, &mut rng);
            seq.push(token);
            if stopped[i].is_none() && on_token(i, token) {
                stopped[i] = Some(seq.len());
            }
        }
        if stopped.iter().all(Option::is_some) {
            break;
        }
    }
    seqs.into_iter()
        .zip(stopped)
        .map(|(s, end)| s[prompt.len()..end.unwrap_or(s.len())].to_vec())
        .collect()
}

/// Logits (B, V) after the last `block_size` tokens of every sequence (all of the
/// same length), feeding the decoder only what it has not seen when it can.
///
/// While the sequences fit in the block, the window starts at position 0 and only the
/// newest token is fed. Once they outgrow it, the window slides by one token per step,
/// which shifts every cached position (position embeddings are absolute), so the cache
/// is reset and the whole window re-prefilled: like nanoGPT, which recomputes the
/// whole context every step, each token past the block costs a forward over
/// `block_size` rows instead of one.
fn next_logits<'a>(
    dec: &'a mut Decoder,
    params: &[f32],
    layout: &ParamLayout,
    seqs: &[Vec<u32>],
    block: usize,
    window: &mut Vec<u32>,
) -> &'a [f32] {
    let n = seqs[0].len();
    let cached = dec.len();
    if cached > 0 && cached + 1 == n && n <= block {
        window.clear();
        window.extend(seqs.iter().map(|s| s[n - 1]));
        return dec.feed(params, layout, window, 1);
    }
    let start = n.saturating_sub(block);
    window.clear();
    window.extend(seqs.iter().flat_map(|s| s[start..].iter().copied()));
    dec.reset();
    dec.feed(params, layout, window, n - start)
}

/// Draws one token from a row of logits: temperature, top-k, softmax, sampling.
///
/// Holds a scratch row, so drawing allocates nothing.
pub struct Sampler {
    temperature: f32,
    /// Tokens kept by top-k; `None` keeps all.
    top_k: Option<usize>,
    /// Nucleus mass kept by top-p; `None` keeps all.
    top_p: Option<f32>,
    /// 1.0: no repetition penalty.
    repetition_penalty: f32,
    /// (V) the logits sorted partially for top-k, then the unnormalised probabilities.
    scratch: Vec<f32>,
    /// (V) the logits after the repetition penalty (used only with one).
    penalized: Vec<f32>,
    /// (V) token ids, sorted by probability for top-p.
    order: Vec<u32>,
}

impl Sampler {
    /// A sampler over a vocabulary of `v` tokens; see [`SampleOptions`] for the meaning
    /// of `temperature` and `top_k`.
    pub fn new(v: usize, temperature: f32, top_k: Option<usize>) -> Sampler {
        assert!(
            temperature >= 0.0 && temperature.is_finite(),
            "temperature must be finite and ≥ 0, got {temperature}"
        );
        Sampler {
            temperature,
            top_k: top_k.filter(|&k| k > 0 && k < v),
            top_p: None,
            repetition_penalty: 1.0,
            scratch: vec![0.0; v],
            penalized: Vec::new(),
            order: Vec::new(),
        }
    }

    /// Nucleus sampling (see [`SampleOptions::top_p`]).
    ///
    /// # Panics
    /// If `p` is not in `(0, 1]`.
    pub fn with_top_p(mut self, p: Option<f32>) -> Sampler {
        if let Some(p) = p {
            assert!(p > 0.0 && p <= 1.0, "top_p must be in (0, 1], got {p}");
        }
        self.top_p = p.filter(|&p| p < 1.0);
        if self.top_p.is_some() {
            self.order = Vec::with_capacity(self.scratch.len());
        }
        self
    }

    /// Hugging Face's repetition penalty (see [`SampleOptions::repetition_penalty`]).
    ///
    /// # Panics
    /// If `penalty` is not finite and positive.
    pub fn with_repetition_penalty(mut self, penalty: f32) -> Sampler {
        assert!(
            penalty > 0.0 && penalty.is_finite(),
            "repetition penalty must be positive, got {penalty}"
        );
        self.repetition_penalty = penalty;
        if penalty != 1.0 {
            self.penalized = vec![0.0; self.scratch.len()];
        }
        self
    }

    /// [`Sampler::pick`] after the repetition penalty for the tokens of `history`.
    pub fn pick_after(&mut self, logits: &[f32], history: &[u32], rng: &mut impl Rng) -> u32 {
        if self.repetition_penalty == 1.0 {
            return self.pick(logits, rng);
        }
        let mut penalized = std::mem::take(&mut self.penalized);
        penalized.copy_from_slice(logits);
        apply_repetition_penalty(&mut penalized, history, self.repetition_penalty);
        let token = self.pick(&penalized, rng);
        self.penalized = penalized;
        token
    }

    /// The token drawn from `logits` (V): the argmax when the temperature is 0, else a
    /// draw from `softmax(logits / temperature)` restricted to the top-k tokens.
    pub fn pick(&mut self, logits: &[f32], rng: &mut impl Rng) -> u32 {
        assert_eq!(logits.len(), self.scratch.len(), "logits must be (V)");
        if self.temperature == 0.0 {
            return argmax(logits) as u32;
        }
        let threshold = self.top_k_threshold(logits);
        let max = logits.iter().fold(f32::NEG_INFINITY, |m, &l| m.max(l));
        // softmax(l / T) = softmax((l − max) / T): subtracting first keeps tiny
        // temperatures from overflowing to inf.
        let inv_t = 1.0 / self.temperature;
        let mut sum = 0.0f64;
        for (p, &l) in self.scratch.iter_mut().zip(logits) {
            *p = if l >= threshold {
                ((l - max) * inv_t).exp()
            } else {
                0.0
            };
            sum += *p as f64;
        }
        if let Some(p) = self.top_p {
            sum = top_p_filter(&mut self.scratch, sum, p, &mut self.order);
        }
        draw(&self.scratch, sum, rng) as u32
    }

    /// The smallest logit kept by top-k (the k-th largest value, so ties with it are
    /// kept too, like torch's `topk` threshold), or -inf when nothing is cut.
    fn top_k_threshold(&mut self, logits: &[f32]) -> f32 {
        let Some(k) = self.top_k else {
            return f32::NEG_INFINITY;
        };
        self.scratch.copy_from_slice(logits);
        let (_, kth, _) = self
            .scratch
            .select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
        *kth
    }
}

/// `log softmax(logits)[target]`, the sum of exponentials in f64.
pub fn log_prob(logits: &[f32], target: u32) -> f64 {
    LogSoftmax::of(logits).at(logits, target)
}

/// What `log softmax` of a row of logits needs: its largest logit and the log of
/// the sum of `exp(logit − max)` (in f64). Every log-probability of the row is
/// computed from the same two numbers, so equal logits give equal log-probabilities
/// to the last bit (lm-evaluation-harness compares them with `==`).
#[derive(Clone, Copy, Debug)]
pub struct LogSoftmax {
    max: f32,
    log_sum: f64,
}

impl LogSoftmax {
    pub fn of(logits: &[f32]) -> LogSoftmax {
        let max = logits.iter().fold(f32::NEG_INFINITY, |m, &l| m.max(l));
        let sum: f64 = logits.iter().map(|&l| ((l - max).exp()) as f64).sum();
        LogSoftmax {
            max,
            log_sum: sum.ln(),
        }
    }

    /// `log softmax(logits)[id]` for the row this was made of.
    pub fn at(&self, logits: &[f32], id: u32) -> f64 {
        (logits[id as usize] - self.max) as f64 - self.log_sum
    }
}

/// Hugging Face's repetition penalty, in place: the logit of each distinct token of
/// `history` is divided by `penalty` when positive, multiplied by it otherwise.
/// Ids outside `logits` are skipped.
pub fn apply_repetition_penalty(logits: &mut [f32], history: &[u32], penalty: f32) {
    let mut distinct: Vec<u32> = history
        .iter()
        .copied()
        .filter(|&id| (id as usize) < logits.len())
        .collect();
    distinct.sort_unstable();
    distinct.dedup();
    for id in distinct {
        let l = &mut logits[id as usize];
        *l = if *l > 0.0 { *l / penalty } else { *l * penalty };
    }
}

/// Nucleus filter over unnormalised `weights` (sum `sum`), as Hugging Face's
/// `TopPLogitsWarper`: with the tokens sorted by ascending probability, those whose
/// cumulative probability is at most `1 − p` are removed (zeroed); the most likely
/// token always stays. Returns the sum of the weights kept. `order` is scratch.
pub fn top_p_filter(weights: &mut [f32], sum: f64, p: f32, order: &mut Vec<u32>) -> f64 {
    order.clear();
    order.extend((0..weights.len() as u32).filter(|&i| weights[i as usize] > 0.0));
    // Ascending by weight; equal weights by id, so the cut is deterministic.
    order.sort_unstable_by(|&a, &b| {
        weights[a as usize]
            .total_cmp(&weights[b as usize])
            .then(b.cmp(&a))
    });
    let limit = 1.0 - p as f64;
    let mut cumulative = 0.0f64;
    for &i in &order[..order.len().saturating_sub(1)] {
        cumulative += weights[i as usize] as f64 / sum;
        if cumulative > limit {
            break;
        }
        weights[i as usize] = 0.0;
    }
    // Summed again in index order, as `draw` accumulates.
    weights.iter().map(|&w| w as f64).sum()
}

/// Index of the largest value; the first one on ties.
fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best
}

/// Index drawn with probability `weights[i] / sum` (`sum` = Σ weights, accumulated in
/// f64 in index order).
fn draw(weights: &[f32], sum: f64, rng: &mut impl Rng) -> usize {
    let u = rng.gen::<f64>() * sum;
    let mut acc = 0.0f64;
    let mut last_nonzero = 0;
    for (i, &w) in weights.iter().enumerate() {
        if w > 0.0 {
            acc += w as f64;
            last_nonzero = i;
            if u < acc {
                return i;
            }
        }
    }
    // Only reachable through rounding when u lands on the very end of the range.
    last_nonzero
}

/// Where samples end early: at an end-of-text id (a model may have several: Llama 3
/// Instruct ends turns with `<|eot_id|>`), and at any of the stop strings.
#[derive(Clone, Debug, Default)]
pub struct Stops {
    pub eots: Vec<u32>,
    pub strings: Vec<String>,
}

/// The text of one sample as it is generated, cut at its first stop.
pub struct StopText<'a> {
    decoder: crate::data::StreamDecoder<'a>,
    text: String,
    /// Bytes of `text` already handed out by [`StopText::take_printable`].
    printed: usize,
    stopped: bool,
}

impl<'a> StopText<'a> {
    pub fn new(tokenizer: &'a Tokenizer) -> StopText<'a> {
        StopText {
            decoder: tokenizer.stream_decoder(),
            text: String::new(),
            printed: 0,
            stopped: false,
        }
    }

    /// Adds a token; true when the sample stops here (end-of-text, which adds no
    /// text, or a stop string, which is cut off with what follows it).
    pub fn push(&mut self, token: u32, stops: &Stops) -> bool {
        if self.stopped {
            return true;
        }
        if stops.eots.contains(&token) {
            self.stopped = true;
            return true;
        }
        let before = self.text.len();
        self.text.push_str(&self.decoder.push(token));
        for stop in &stops.strings {
            // A stop string may end inside this token's text, or start before it.
            let from = floor_char_boundary(&self.text, before.saturating_sub(stop.len() - 1));
            if let Some(at) = self.text[from..].find(stop.as_str()) {
                self.text.truncate(from + at);
                self.stopped = true;
            }
        }
        self.stopped
    }

    /// The text not yet handed out that cannot be the start of a stop string.
    pub fn take_printable(&mut self, stops: &Stops) -> &str {
        let mut end = self.text.len();
        if !self.stopped {
            for stop in &stops.strings {
                let held = (1..stop.len())
                    .rev()
                    .find(|&k| self.text.ends_with(&stop[..floor_char_boundary(stop, k)]))
                    .map_or(0, |k| floor_char_boundary(stop, k));
                end = end.min(self.text.len() - held);
            }
        }
        let end = end.max(self.printed);
        let out = &self.text[self.printed..end];
        self.printed = end;
        out
    }

    /// What is left to print at the end (the held-back text of an unstopped sample).
    pub fn finish(mut self) -> String {
        let mut rest = self.text.split_off(self.printed.min(self.text.len()));
        if !self.stopped {
            rest.push_str(&self.decoder.finish());
        }
        rest
    }

    /// The text so far (without a stop string), printed or not.
    pub fn whole(&self) -> String {
        self.text.clone()
    }

    /// The whole text of the sample.
    pub fn finish_all(mut self) -> String {
        self.printed = 0;
        self.finish()
    }
}

/// The largest char boundary of `s` at or below `i`.
fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stop_run(text: &str, stops: &Stops) -> (String, bool, String) {
        let t = Tokenizer::char_level("abcdefgh\u{3}".chars()).unwrap();
        let mut st = StopText::new(&t);
        let (mut streamed, mut stopped) = (String::new(), false);
        for id in t.encode(text).unwrap() {
            stopped = st.push(id, stops);
            streamed.push_str(st.take_printable(stops));
            if stopped {
                break;
            }
        }
        let all = format!("{streamed}{}", st.finish());
        (streamed, stopped, all)
    }

    #[test]
    fn stop_strings_are_cut_and_never_streamed() {
        let stops = Stops {
            eots: vec![0],
            strings: vec!["cde".into(), "hh".into()],
        };
        // "cd" is held back until "e" shows it is the stop.
        assert_eq!(
            stop_run("abcdefg", &stops),
            ("ab".into(), true, "ab".into())
        );
        // Held back, then released when it turns out not to be the stop.
        let (streamed, stopped, all) = stop_run("abcdbh", &stops);
        assert_eq!(
            (streamed.as_str(), stopped, all.as_str()),
            ("abcdb", false, "abcdbh")
        );
        assert_eq!(stop_run("ahhb", &stops).2, "a");
        // End-of-text (id 0) stops and prints nothing.
        assert_eq!(
            stop_run("ab\u{3}cd", &stops),
            ("ab".into(), true, "ab".into())
        );
    }

    use crate::model::decode::tests::{random_gpt, small};
    use crate::model::Gpt;

    fn opts(temperature: f32, top_k: Option<usize>, seed: u64) -> SampleOptions {
        SampleOptions {
            num_samples: 3,
            max_new_tokens: 12,
            temperature,
            top_k,
            seed,
            ..SampleOptions::default()
        }
    }

    fn run(gpt: &Gpt, prompt: &[u32], o: &SampleOptions) -> Vec<Vec<u32>> {
        generate(&gpt.params, &gpt.layout, gpt.config(), prompt, o, |_, _| {})
    }

    #[test]
    fn a_kept_decoder_samples_as_a_fresh_one() {
        let mut gpt = random_gpt(small(true), 1, 13);
        // Sharper than random weights' flat distributions, so that draws depend on
        // the whole context.
        gpt.params.iter_mut().for_each(|p| *p *= 4.0);
        let (params, layout, cfg) = (&gpt.params, &gpt.layout, gpt.config());
        let o = opts(1.0, None, 5);
        let mut dec = Decoder::new(cfg, 3, cfg.block_size);
        let first = generate_in(&mut dec, params, layout, cfg, &[1, 2], &o, |_, _| false);
        assert_eq!(first, run(&gpt, &[1, 2], &o));
        // The decoder now caches 13 positions: a prompt of 14 must not be read as one
        // new token after them.
        assert_eq!(dec.len(), 13);
        let prompt: Vec<u32> = (20..34).collect();
        let o = SampleOptions {
            max_new_tokens: 2,
            ..o
        };
        let second = generate_in(&mut dec, params, layout, cfg, &prompt, &o, |_, _| false);
        assert_eq!(second, run(&gpt, &prompt, &o));
    }

    #[test]
    fn defaults_are_nanogpts() {
        let d = SampleOptions::default();
        assert_eq!((d.num_samples, d.max_new_tokens, d.seed), (10, 500, 1337));
        assert_eq!((d.temperature, d.top_k), (0.8, Some(200)));
    }

    #[test]
    fn same_seed_same_samples_other_seed_other_samples() {
        let gpt = random_gpt(small(true), 1, 11);
        let prompt = [1, 2, 3];
        let a = run(&gpt, &prompt, &opts(1.0, None, 42));
        assert_eq!(a.len(), 3);
        assert!(a.iter().all(|s| s.len() == 12));
        assert_eq!(a, run(&gpt, &prompt, &opts(1.0, None, 42)));
        assert_ne!(a, run(&gpt, &prompt, &opts(1.0, None, 43)));
        assert_ne!(a[0], a[1], "samples in one batch differ");
    }

    #[test]
    fn callback_streams_every_token_in_order() {
        let gpt = random_gpt(small(false), 1, 12);
        let o = opts(0.8, Some(10), 7);
        let mut streamed = vec![Vec::new(); 3];
        let mut order = Vec::new();
        let out = generate(&gpt.params, &gpt.layout, gpt.config(), &[5], &o, |i, t| {
            streamed[i].push(t);
            order.push(i);
        });
        assert_eq!(streamed, out);
        let want: Vec<usize> = (0..12).flat_map(|_| 0..3).collect();
        assert_eq!(
            order, want,
            "steps in order, samples in order within a step"
        );
    }

    #[test]
    fn top_k_one_and_tiny_temperature_are_greedy() {
        let gpt = random_gpt(small(true), 1, 13);
        let prompt = [4, 8, 15, 16];
        let greedy = run(&gpt, &prompt, &opts(0.0, None, 1));
        assert!(
            greedy.iter().all(|s| s == &greedy[0]),
            "greedy ignores the RNG"
        );
        assert_eq!(greedy, run(&gpt, &prompt, &opts(0.8, Some(1), 2)));
        assert_eq!(greedy, run(&gpt, &prompt, &opts(1e-6, None, 3)));
        assert_eq!(greedy, run(&gpt, &prompt, &opts(1e-30, Some(5), 4)));
    }

    /// Greedy decoding past block_size against a reference that recomputes
    /// `Gpt::logits` on the cropped context (the last block_size tokens) each step.
    #[test]
    fn greedy_past_the_block_matches_full_recompute() {
        let mut gpt = random_gpt(small(true), 1, 14);
        let (block, v) = (gpt.config().block_size, gpt.config().vocab_size);
        let prompt: Vec<u32> = (0..5).map(|i| (i * 7 % v) as u32).collect();
        let mut o = opts(0.0, None, 0);
        o.num_samples = 2;
        o.max_new_tokens = 2 * block + 3;
        let got = run(&gpt, &prompt, &o);

        let mut seq = prompt.clone();
        for _ in 0..o.max_new_tokens {
            let ctx = &seq[seq.len().saturating_sub(block)..];
            let logits = gpt.logits(ctx, 1, ctx.len());
            seq.push(argmax(&logits[logits.len() - v..]) as u32);
        }
        assert_eq!(got[0], seq[prompt.len()..]);
        assert_eq!(got[1], got[0]);
    }

    /// Weights a generation owns draw the same samples as shared ones, in both
    /// precisions; in bf16 their f32 matrices are given back, in f32 nothing is.
    #[test]
    fn owned_weights_sample_as_shared_ones() {
        use crate::kernels::bf16::Backend;
        let mut gpt = random_gpt(small(true), 1, 16);
        gpt.params.iter_mut().for_each(|p| *p *= 4.0);
        let (layout, cfg) = (&gpt.layout, gpt.config());
        let prompt: Vec<u32> = (0..4).map(|i| (i * 11 % 53) as u32).collect();
        for bf16 in [None, Some(Backend::detect(None))] {
            let o = SampleOptions {
                bf16_weights: bf16,
                ..opts(0.9, Some(20), 5)
            };
            let want = generate(&gpt.params, layout, cfg, &prompt, &o, |_, _| {});
            let mut own = gpt.params.clone();
            let held = Held::Own(&mut own);
            let got = generate_until(held, layout, cfg, &prompt, &o, |_, _| false);
            assert_eq!(got, want, "bf16: {}", bf16.is_some());
            let wte = &own[layout.wte.range()];
            match bf16 {
                Some(_) => assert!(wte.iter().all(|&x| x == 0.0), "given back"),
                None => assert_eq!(own, gpt.params, "untouched"),
            }
        }
    }

    #[test]
    fn a_prompt_longer_than_the_block_is_cropped() {
        let gpt = random_gpt(small(false), 1, 15);
        let block = gpt.config().block_size;
        let tail: Vec<u32> = (0..block as u32).map(|i| i * 3 % 53).collect();
        let long: Vec<u32> = [vec![9; 5], tail.clone()].concat();
        let o = opts(0.9, Some(20), 8);
        assert_eq!(run(&gpt, &long, &o), run(&gpt, &tail, &o));
    }

    /// Empirical frequencies over many draws from fixed logits.
    fn frequencies(logits: &[f32], temperature: f32, top_k: Option<usize>) -> Vec<f64> {
        let draws = 100_000;
        let mut sampler = Sampler::new(logits.len(), temperature, top_k);
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let mut counts = vec![0usize; logits.len()];
        for _ in 0..draws {
            counts[sampler.pick(logits, &mut rng) as usize] += 1;
        }
        counts.iter().map(|&n| n as f64 / draws as f64).collect()
    }

    fn softmax(logits: &[f64]) -> Vec<f64> {
        let e: Vec<f64> = logits.iter().map(|l| l.exp()).collect();
        let s: f64 = e.iter().sum();
        e.iter().map(|x| x / s).collect()
    }

    fn assert_freqs(got: &[f64], want: &[f64]) {
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            // 100k draws: the standard error is below 0.0016.
            assert!(
                (g - w).abs() < 0.01,
                "token {i}: frequency {g}, probability {w}"
            );
        }
    }

    #[test]
    fn draws_follow_the_softmax() {
        let logits = [1.0f32, 2.0, 0.5, -1.0, 1.5];
        let t = 0.8;
        let want = softmax(&logits.map(|l| l as f64 / t as f64));
        assert_freqs(&frequencies(&logits, t, None), &want);
        // k ≥ V keeps everything.
        assert_freqs(&frequencies(&logits, t, Some(9)), &want);
    }

    #[test]
    fn top_k_renormalises_over_the_kept_tokens() {
        let logits = [1.0f32, 2.0, 0.5, -1.0, 1.5];
        let kept = softmax(&[2.0, 1.5, 1.0]);
        let want = [kept[2], kept[0], 0.0, 0.0, kept[1]];
        let got = frequencies(&logits, 1.0, Some(3));
        assert_freqs(&got, &want);
        assert_eq!((got[2], got[3]), (0.0, 0.0), "cut tokens are never drawn");
    }

    #[test]
    fn top_k_keeps_ties_with_the_kth_value() {
        let logits = [3.0f32, 1.0, 3.0, 0.0];
        let got = frequencies(&logits, 1.0, Some(1));
        assert_freqs(&got, &[0.5, 0.0, 0.5, 0.0]);
    }

    #[test]
    fn top_p_removes_the_tail_up_to_one_minus_p() {
        // Probabilities 0.5, 0.3, 0.15, 0.05 (as weights summing to 2).
        let base = [1.0f32, 0.6, 0.3, 0.1];
        let mut order = Vec::new();
        // Ascending cumulative: 0.05, 0.20, 0.50, 1.00. p = 0.75 removes those ≤ 0.25.
        let mut w = base;
        let kept = top_p_filter(&mut w, 2.0, 0.75, &mut order);
        assert_eq!(w, [1.0, 0.6, 0.0, 0.0]);
        assert!((kept - 1.6).abs() < 1e-6);
        // p = 0.9 removes only the 0.05 token; p = 0.3 keeps only the most likely.
        let mut w = base;
        top_p_filter(&mut w, 2.0, 0.9, &mut order);
        assert_eq!(w, [1.0, 0.6, 0.3, 0.0]);
        let mut w = base;
        top_p_filter(&mut w, 2.0, 0.3, &mut order);
        assert_eq!(w, [1.0, 0.0, 0.0, 0.0]);
        // Zero weights (cut by top-k) stay out of the count.
        let mut w = [0.0f32, 0.6, 0.3, 0.1];
        top_p_filter(&mut w, 1.0, 0.65, &mut order);
        assert_eq!(w, [0.0, 0.6, 0.3, 0.0]);
    }

    #[test]
    fn top_p_draws_renormalise_over_the_nucleus() {
        let probs = [0.5f64, 0.3, 0.15, 0.05];
        let logits = probs.map(|p| p.ln() as f32);
        let draws = 100_000;
        let mut sampler = Sampler::new(4, 1.0, None).with_top_p(Some(0.75));
        let mut rng = ChaCha8Rng::seed_from_u64(9);
        let mut counts = [0usize; 4];
        for _ in 0..draws {
            counts[sampler.pick(&logits, &mut rng) as usize] += 1;
        }
        let got = counts.map(|n| n as f64 / draws as f64);
        assert_freqs(&got, &[0.625, 0.375, 0.0, 0.0]);
        assert_eq!((counts[2], counts[3]), (0, 0));
    }

    #[test]
    fn repetition_penalty_divides_positive_and_multiplies_negative_logits() {
        let mut logits = [2.0f32, -1.0, 0.5, 3.0, 0.0];
        // Token 1 twice: penalised once; id 9 is outside the vocabulary.
        apply_repetition_penalty(&mut logits, &[0, 1, 1, 4, 9], 2.0);
        assert_eq!(logits, [1.0, -2.0, 0.5, 3.0, 0.0]);
        // Greedy: token 0 (logit 2) loses to token 3 (logit 1.5) once penalised.
        let mut s = Sampler::new(4, 0.0, None).with_repetition_penalty(1.5);
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        assert_eq!(s.pick_after(&[2.0, 0.0, 0.0, 1.5], &[], &mut rng), 0);
        assert_eq!(s.pick_after(&[2.0, 0.0, 0.0, 1.5], &[0], &mut rng), 3);
    }

    #[test]
    fn generation_stops_where_the_callback_says() {
        let gpt = random_gpt(small(true), 1, 16);
        let o = opts(1.0, None, 3);
        let full = run(&gpt, &[1, 2], &o);
        let mut calls = [0usize; 3];
        let cut = generate_until(
            Held::Shared(&gpt.params),
            &gpt.layout,
            gpt.config(),
            &[1, 2],
            &o,
            |i, _| {
                calls[i] += 1;
                calls[i] == 2 + i
            },
        );
        for i in 0..3 {
            assert_eq!(cut[i], full[i][..2 + i], "sample {i}");
            assert_eq!(calls[i], 2 + i, "no tokens reported after the stop");
        }
    }

    #[test]
    fn argmax_takes_the_first_maximum() {
        assert_eq!(argmax(&[0.5, 2.0, -1.0, 2.0]), 1);
        let mut s = Sampler::new(4, 0.0, None);
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        assert_eq!(s.pick(&[0.5, 2.0, -1.0, 2.0], &mut rng), 1);
    }

    /// Speed of greedy decoding for a GPT-2 124M-shaped model with random weights.
    /// `cargo test --release -- --ignored --nocapture decode_speed` (threads from
    /// RAYON_NUM_THREADS).
    #[test]
    #[ignore = "benchmark: needs a release build and ~1 GB"]
    fn decode_speed_gpt2_124m() {
        let cfg = ModelConfig::preset("gpt2").unwrap();
        let mut gpt = Gpt::new(cfg, 1, 1).unwrap();
        gpt.init_gpt2(1);
        let (steps, prompt) = (64, 16);
        let mut dec = Decoder::new(gpt.config(), 1, prompt + steps);
        let tokens: Vec<u32> = (0..prompt as u32).map(|i| i * 1000 + 7).collect();
        let mut next = argmax(dec.feed(&gpt.params, &gpt.layout, &tokens, prompt)) as u32;
        let start = std::time::Instant::now();
        for _ in 0..steps {
            next = argmax(dec.feed(&gpt.params, &gpt.layout, &[next], 1)) as u32;
        }
        let secs = start.elapsed().as_secs_f64();
        println!(
            "greedy decoding, gpt2 124M, batch 1, {} threads: {:.1} tokens/s",
            rayon::current_num_threads(),
            steps as f64 / secs
        );
        assert!(secs > 0.0 && (next as usize) < gpt.config().vocab_size);
    }
}
