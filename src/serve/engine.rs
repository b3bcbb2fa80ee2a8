//! The model's thread: the one model in memory, one request at a time, in the order
//! they were queued. A request's prompts and their `n` samples are generated one
//! after another on one KV-cached decoder; each new token goes to the request's
//! event channel as soon as it is drawn, and a request whose channel has closed (its
//! client disconnected) stops at the next token.

use crate::data::Tokenizer;
use crate::kernels::bf16::Backend;
use crate::model::decode::Decoder;
use crate::model::{ModelConfig, ParamLayout};
use crate::sample::{LogSoftmax, Sampler, StopText, Stops};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::sync::Arc;
use tokio::sync::mpsc::{Receiver, UnboundedSender};

/// How tokens are drawn for one request (validated by the HTTP side).
#[derive(Clone, Debug, PartialEq)]
pub struct Sampling {
    /// 0: greedy.
    pub temperature: f32,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    /// Hugging Face's, over prompt and completion (1: off).
    pub repetition_penalty: f32,
    /// OpenAI's: subtracted from the logit of every token already generated, once
    /// (presence) or per occurrence (frequency).
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// Added to the logits of these tokens.
    pub logit_bias: Vec<(u32, f32)>,
    pub seed: u64,
}

/// What to generate for one request.
#[derive(Clone)]
pub struct Generation {
    /// Each prompt's tokens (non-empty, ids in the vocabulary, at most the block less
    /// `max_tokens`).
    pub prompts: Vec<Vec<u32>>,
    /// Samples per prompt: choice `i·n + s` is sample `s` of prompt `i`.
    pub n: usize,
    pub max_tokens: usize,
    pub sampling: Sampling,
    /// Strings that end a sample (not included in its text); end-of-text always does.
    pub stop: Vec<String>,
    /// Report each token's log-probability and this many most likely alternatives.
    pub logprobs: Option<usize>,
    /// Report the prompt's tokens (with their log-probabilities, when `logprobs`).
    pub echo: bool,
}

/// One request's generation, and where its events go.
pub struct Job {
    pub generation: Generation,
    pub events: UnboundedSender<Event>,
}

/// A token and what the model thought of it.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenInfo {
    pub id: u32,
    /// `log softmax` of the model's logits (before temperature or penalties); `None`
    /// for a prompt's first token, which nothing predicts.
    pub logprob: Option<f64>,
    /// The most likely tokens at this position, most likely first.
    pub top: Vec<(u32, f64)>,
}

/// Why a sample ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// At end-of-text or a stop string.
    Stop,
    /// After `max_tokens`.
    Length,
}

impl Finish {
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
        }
    }
}

/// What the model thread tells a request, in order: per choice, its prompt (with
/// `echo`), its tokens, its end.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    Prompt {
        choice: usize,
        tokens: Vec<TokenInfo>,
    },
    /// A new token, and the text that became final with it (empty while a character
    /// is incomplete or the text could still be the start of a stop string).
    Token {
        choice: usize,
        text: String,
        token: TokenInfo,
    },
    Done {
        choice: usize,
        /// Text held back until the end.
        text: String,
        finish: Finish,
        prompt_tokens: usize,
        completion_tokens: usize,
    },
}

/// The model, its tokenizer and the decoder every request runs on.
pub struct Engine {
    params: Vec<f32>,
    layout: ParamLayout,
    config: ModelConfig,
    tokenizer: Arc<Tokenizer>,
    decoder: Decoder,
    /// (V) a row of logits after the penalties and biases.
    adjusted: Vec<f32>,
}

impl Engine {
    /// An engine for a model whose matmuls read `params` (`bf16`: a bf16 copy, a
    /// prompt's products on that back-end).
    pub fn new(
        config: ModelConfig,
        mut params: Vec<f32>,
        tokenizer: Arc<Tokenizer>,
        bf16: Option<Backend>,
    ) -> Engine {
        let layout = ParamLayout::new(&config);
        let mut decoder = Decoder::new(&config, 1, config.block_size);
        // The engine's one decoder reads the copy: the f32 matrices are given back.
        if let Some(backend) = &bf16 {
            decoder = decoder.with_bf16_weights_releasing(&mut params, &layout, backend);
        }
        Engine {
            adjusted: vec![0.0; config.vocab_size],
            params,
            layout,
            config,
            tokenizer,
            decoder,
        }
    }

    /// Runs the queued jobs until every sender of `jobs` has gone.
    pub fn run(mut self, mut jobs: Receiver<Job>) {
        while let Some(job) = jobs.blocking_recv() {
            self.generate(&job);
        }
    }

    /// Every choice of `job`, stopping early when its client has gone.
    pub fn generate(&mut self, job: &Job) {
        let mut rng = ChaCha8Rng::seed_from_u64(job.generation.sampling.seed);
        for (i, prompt) in job.generation.prompts.iter().enumerate() {
            if job.events.is_closed() {
                return;
            }
            let first = self.prefill(job, i, prompt);
            for s in 0..job.generation.n {
                let choice = i * job.generation.n + s;
                if s > 0 {
                    self.decoder.truncate(prompt.len());
                }
                if let Err(generated) = self.sample(job, choice, prompt, &first, &mut rng) {
                    crate::errln!("client gone: stopped generating after {generated} token(s)");
                    return;
                }
            }
        }
    }

    /// Feeds the prompt (reporting its tokens with `echo`); returns the logits after it.
    fn prefill(&mut self, job: &Job, i: usize, prompt: &[u32]) -> Vec<f32> {
        self.decoder.reset();
        let (params, layout, p) = (&self.params, &self.layout, prompt.len());
        if !job.generation.echo {
            return self.decoder.feed(params, layout, prompt, p).to_vec();
        }
        let mut tokens: Vec<TokenInfo> = prompt
            .iter()
            .map(|&id| TokenInfo {
                id,
                logprob: None,
                top: Vec::new(),
            })
            .collect();
        let last = match job.generation.logprobs {
            None => self.decoder.feed(params, layout, prompt, p).to_vec(),
            Some(k) => self
                .decoder
                .feed_all(params, layout, prompt, p, |row, logits| {
                    if let Some(next) = tokens.get_mut(row + 1) {
                        let lsm = LogSoftmax::of(logits);
                        next.logprob = Some(lsm.at(logits, next.id));
                        next.top = top_logprobs(logits, &lsm, k);
                    }
                })
                .to_vec(),
        };
        for s in 0..job.generation.n {
            let tokens = tokens.clone();
            let _ = job.events.send(Event::Prompt {
                choice: i * job.generation.n + s,
                tokens,
            });
        }
        last
    }

    /// One sample after a prefilled prompt whose last logits are `first`; when the
    /// client has gone, stops and returns the tokens generated until then.
    fn sample(
        &mut self,
        job: &Job,
        choice: usize,
        prompt: &[u32],
        first: &[f32],
        rng: &mut ChaCha8Rng,
    ) -> Result<(), usize> {
        let s = &job.generation.sampling;
        let mut sampler = Sampler::new(self.config.vocab_size, s.temperature, s.top_k)
            .with_top_p(s.top_p)
            .with_repetition_penalty(s.repetition_penalty);
        let stops = Stops {
            eots: self.tokenizer.stops(),
            strings: job.generation.stop.clone(),
        };
        let tokenizer = Arc::clone(&self.tokenizer);
        let mut text = StopText::new(&tokenizer);
        let mut history = prompt.to_vec();
        let mut counts: Vec<(u32, u32)> = Vec::new();
        let mut logits = first.to_vec();
        let mut finish = Finish::Length;
        let mut generated = 0;
        while generated < job.generation.max_tokens {
            if job.events.is_closed() {
                return Err(generated);
            }
            self.adjust(&logits, s, &counts);
            let id = sampler.pick_after(&self.adjusted, &history, rng);
            generated += 1;
            history.push(id);
            match counts.iter_mut().find(|(t, _)| *t == id) {
                Some((_, c)) => *c += 1,
                None => counts.push((id, 1)),
            }
            let stopped = text.push(id, &stops);
            let token = match job.generation.logprobs {
                None => TokenInfo {
                    id,
                    logprob: None,
                    top: Vec::new(),
                },
                Some(k) => {
                    let lsm = LogSoftmax::of(&logits);
                    TokenInfo {
                        id,
                        logprob: Some(lsm.at(&logits, id)),
                        top: top_logprobs(&logits, &lsm, k),
                    }
                }
            };
            let delta = text.take_printable(&stops).to_string();
            let _ = job.events.send(Event::Token {
                choice,
                text: delta,
                token,
            });
            if stopped {
                finish = Finish::Stop;
                break;
            }
            if generated < job.generation.max_tokens {
                let (params, layout) = (&self.params, &self.layout);
                logits.copy_from_slice(self.decoder.feed(params, layout, &[id], 1));
            }
        }
        let _ = job.events.send(Event::Done {
            choice,
            text: text.finish(),
            finish,
            prompt_tokens: prompt.len(),
            completion_tokens: generated,
        });
        Ok(())
    }

    /// `adjusted` = the logits with the logit biases and OpenAI's presence and
    /// frequency penalties over the tokens generated so far (`counts`).
    fn adjust(&mut self, logits: &[f32], s: &Sampling, counts: &[(u32, u32)]) {
        self.adjusted.copy_from_slice(logits);
        for &(id, bias) in &s.logit_bias {
            self.adjusted[id as usize] += bias;
        }
        if s.presence_penalty != 0.0 || s.frequency_penalty != 0.0 {
            for &(id, count) in counts {
                self.adjusted[id as usize] -=
                    s.presence_penalty + s.frequency_penalty * count as f32;
            }
        }
    }
}

/// The `k` most likely tokens of a row of logits and their log-probabilities, most
/// likely first (ties by id).
pub fn top_logprobs(logits: &[f32], lsm: &LogSoftmax, k: usize) -> Vec<(u32, f64)> {
    if k == 0 {
        return Vec::new();
    }
    let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
    let order = |a: &u32, b: &u32| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    };
    let k = k.min(ids.len());
    if k < ids.len() {
        ids.select_nth_unstable_by(k - 1, order);
        ids.truncate(k);
    }
    ids.sort_unstable_by(order);
    ids.into_iter().map(|id| (id, lsm.at(logits, id))).collect()
}
