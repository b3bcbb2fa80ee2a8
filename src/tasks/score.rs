//! Scoring multiple-choice questions with the KV-cached [`Decoder`]: a question's
//! context is fed once (one sequence), its choices continue copies of that cache
//! together (one sequence each, padded to the longest), and every continuation
//! token's log-probability is read from the row before it:
//!
//! ```text
//! prefix.feed(context (1, n))             → logits predicting every choice's token 0
//! forks.fork_from(prefix)                 (B = choices, each with the context cached)
//! forks.feed_all(choice[..M-1] (B, M-1))  → row (j, i) predicts choice j's token i+1
//! ```
//!
//! So a question of n context tokens and k choices of at most M tokens costs
//! n + k·(M−1) positions, where scoring each choice alone costs k·(n+M−1).
//!
//! A question longer than the model's block is scored as the harness scores it: each
//! choice on its own, in the window of its last `block_size + 1` tokens.

use super::Encoded;
use crate::model::decode::Decoder;
use crate::model::{ModelConfig, ParamLayout};
use crate::sample::log_prob;
use serde::{Deserialize, Serialize};

/// Questions scored and how many each metric got right; summed across ranks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Tally {
    pub questions: f64,
    pub acc: f64,
    pub acc_norm: f64,
    pub acc_bytes: f64,
    pub acc_token: f64,
}

impl Tally {
    /// Counts one question whose choices have log-likelihoods `lls`.
    pub fn add(&mut self, q: &Encoded, lls: &[f64]) {
        let right = |norm: &dyn Fn(usize) -> f64| {
            (first_argmax((0..lls.len()).map(|j| lls[j] / norm(j))) == q.label) as u8 as f64
        };
        self.questions += 1.0;
        self.acc += right(&|_| 1.0);
        self.acc_norm += right(&|j| q.chars[j] as f64);
        self.acc_bytes += right(&|j| q.bytes[j] as f64);
        self.acc_token += right(&|j| q.choices[j].len() as f64);
    }

    /// The counts as an array, for an all-reduce.
    pub fn to_array(self) -> [f64; 5] {
        [
            self.questions,
            self.acc,
            self.acc_norm,
            self.acc_bytes,
            self.acc_token,
        ]
    }

    pub fn from_array(a: [f64; 5]) -> Tally {
        Tally {
            questions: a[0],
            acc: a[1],
            acc_norm: a[2],
            acc_bytes: a[3],
            acc_token: a[4],
        }
    }
}

/// The index of the first largest value (`numpy.argmax`; NaN is never the largest).
fn first_argmax(values: impl Iterator<Item = f64>) -> usize {
    let mut best = (0, f64::NEG_INFINITY);
    for (i, v) in values.enumerate() {
        if v > best.1 || (i == 0 && !v.is_nan()) {
            best = (i, v);
        }
    }
    best.0
}

/// The decoders that score a set of questions, sized for the longest of them.
pub struct Scorer {
    /// One sequence: a question's context, or a long question's whole window.
    prefix: Decoder,
    /// One sequence per choice, continuing the context; `None` when every choice of
    /// every question is one token.
    forks: Option<Decoder>,
    block: usize,
    /// Tokens fed to `forks`, (B, M−1).
    fed: Vec<u32>,
}

impl Scorer {
    /// Decoders for `questions` on a model of `config`.
    pub fn new(config: &ModelConfig, questions: &[Encoded]) -> Scorer {
        let block = config.block_size;
        let (mut prefix_len, mut forks_len, mut width) = (1, 0, 1);
        for q in questions {
            let longest = q.choices.iter().map(Vec::len).max().unwrap_or(1);
            if fits(q, block) {
                prefix_len = prefix_len.max(q.context.len());
                if longest > 1 {
                    forks_len = forks_len.max(q.context.len() + longest - 1);
                    width = width.max(q.choices.len());
                }
            } else {
                prefix_len = block;
            }
        }
        Scorer {
            prefix: Decoder::new(config, 1, prefix_len),
            forks: (forks_len > 0).then(|| Decoder::new(config, width, forks_len)),
            block,
            fed: Vec::new(),
        }
    }

    /// The log-likelihood of each choice of `q` after its context: the sum of its
    /// tokens' log-probabilities.
    ///
    /// # Panics
    /// If `q` is longer than the questions the scorer was made for, or a choice has
    /// more tokens than the model's block.
    pub fn score(&mut self, params: &[f32], layout: &ParamLayout, q: &Encoded) -> Vec<f64> {
        if !fits(q, self.block) {
            return (0..q.choices.len())
                .map(|j| self.score_alone(params, layout, q, j))
                .collect();
        }
        let n = q.context.len();
        self.prefix.reset();
        let first = self.prefix.feed(params, layout, &q.context, n);
        let mut lls: Vec<f64> = q.choices.iter().map(|c| log_prob(first, c[0])).collect();
        let longest = q.choices.iter().map(Vec::len).max().unwrap_or(1);
        if longest == 1 {
            return lls;
        }
        let forks = self
            .forks
            .as_mut()
            .expect("a fork decoder for multi-token choices");
        let (width, p) = (forks.batch(), longest - 1);
        // Choice j's first M−1 tokens, padded with its last one; rows past the last
        // choice repeat choice 0. Padding comes after what is scored: causal
        // attention keeps it out.
        self.fed.clear();
        for j in 0..width {
            let c = q.choices.get(j).unwrap_or(&q.choices[0]);
            self.fed.extend((0..p).map(|i| c[i.min(c.len() - 1)]));
        }
        forks.fork_from(&self.prefix);
        forks.feed_all(params, layout, &self.fed, p, |row, logits| {
            let (j, i) = (row / p, row % p);
            if let Some(c) = q.choices.get(j).filter(|c| i + 1 < c.len()) {
                lls[j] += log_prob(logits, c[i + 1]);
            }
        });
        lls
    }

    /// Choice `j` scored alone in the harness's window: the last `block + 1`
    /// tokens of context and choice, less the last.
    fn score_alone(&mut self, params: &[f32], layout: &ParamLayout, q: &Encoded, j: usize) -> f64 {
        let choice = &q.choices[j];
        let m = choice.len();
        assert!(
            m <= self.block,
            "a choice of {m} tokens exceeds the block of {}",
            self.block
        );
        let whole: Vec<u32> = q.context.iter().chain(choice).copied().collect();
        let window = &whole[whole.len().saturating_sub(self.block + 1)..whole.len() - 1];
        let rows = window.len();
        let mut ll = 0.0;
        self.prefix.reset();
        self.prefix
            .feed_all(params, layout, window, rows, |row, logits| {
                // Row r predicts the window's token r + 1; the last m rows, the choice.
                if let Some(i) = (row + m).checked_sub(rows) {
                    ll += log_prob(logits, choice[i]);
                }
            });
        ll
    }
}

/// Whether every choice of `q` fits after the whole context in the block (the
/// last token is predicted, never fed).
fn fits(q: &Encoded, block: usize) -> bool {
    q.choices
        .iter()
        .all(|c| q.context.len() + c.len() - 1 <= block)
}

/// Scores `questions` (on this rank: its share of them) and counts what each metric
/// got right; `done(k)` after the k-th.
pub fn tally<'a>(
    scorer: &mut Scorer,
    params: &[f32],
    layout: &ParamLayout,
    questions: impl Iterator<Item = &'a Encoded>,
    mut done: impl FnMut(usize),
) -> Tally {
    let mut tally = Tally::default();
    for (k, q) in questions.enumerate() {
        let lls = scorer.score(params, layout, q);
        tally.add(q, &lls);
        done(k + 1);
    }
    tally
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::decode::tests::{random_gpt, small};

    fn question(context: Vec<u32>, choices: Vec<Vec<u32>>) -> Encoded {
        let k = choices.len();
        Encoded {
            context,
            chars: vec![1; k],
            bytes: vec![1; k],
            choices,
            label: 0,
        }
    }

    /// Each choice's sum of log-probabilities, from the training forward's logits
    /// over context + choice, one choice at a time (the harness's way).
    fn reference(gpt: &mut crate::model::Gpt, q: &Encoded) -> Vec<f64> {
        let v = gpt.config().vocab_size;
        let block = gpt.config().block_size;
        q.choices
            .iter()
            .map(|c| {
                let whole: Vec<u32> = q.context.iter().chain(c).copied().collect();
                let window = &whole[whole.len().saturating_sub(block + 1)..whole.len() - 1];
                let t = window.len();
                let logits = gpt.logits(window, 1, t);
                (0..c.len())
                    .map(|i| log_prob(&logits[(t - c.len() + i) * v..][..v], c[i]))
                    .sum()
            })
            .collect()
    }

    #[test]
    fn shared_context_scores_equal_choice_by_choice() {
        let mut gpt = random_gpt(small(true), 1, 11);
        let questions = vec![
            question(
                vec![1, 2, 3, 4, 5],
                vec![vec![6, 7, 8], vec![9], vec![10, 11], vec![12, 13, 14]],
            ),
            question(vec![7], vec![vec![3], vec![4]]),
            question(
                vec![3, 1, 4, 1, 5, 9, 2, 6],
                vec![vec![5, 3], vec![5, 8, 9, 7]],
            ),
            // 14 + 4 − 1 > 16: the long choice is scored in its own window.
            question((0..14).collect(), vec![vec![20, 21, 22, 23], vec![30]]),
        ];
        let mut scorer = Scorer::new(gpt.config(), &questions);
        for (i, q) in questions.iter().enumerate() {
            let got = scorer.score(&gpt.params, &gpt.layout, q);
            let want = reference(&mut gpt, q);
            for (g, w) in got.iter().zip(&want) {
                assert!(
                    (g - w).abs() < 1e-4 * (1.0 + w.abs()),
                    "question {i}: {got:?} vs {want:?}"
                );
            }
        }
    }

    #[test]
    fn metrics_pick_their_own_argmax() {
        let mut q = question(vec![1], vec![vec![1, 2, 3], vec![4]]);
        q.chars = vec![10, 1];
        q.bytes = vec![1, 10];
        let mut t = Tally::default();
        // Sums: choice 1 wins; per char: choice 0 (-0.3 vs -2); per byte: choice 1
        // (-3 vs -0.2); per token: choice 0 (-1 vs -2).
        t.add(&q, &[-3.0, -2.0]);
        assert_eq!(t.to_array(), [1.0, 0.0, 1.0, 0.0, 1.0]);
        // Ties go to the first.
        t.add(&q, &[-2.0, -2.0]);
        assert_eq!(t.acc, 1.0);
        assert_eq!(first_argmax([f64::NAN, 1.0].into_iter()), 1);
    }
}
