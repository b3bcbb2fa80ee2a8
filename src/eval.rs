//! `nanogpt eval`: the mean next-token cross-entropy of a model over a token file.
//!
//! Deterministic and exhaustive: window `k` has inputs `tokens[k·T .. k·T+T]` and
//! targets `tokens[k·T+1 .. k·T+T+1]` for every `k` whose window fits, so every token
//! after the first is predicted exactly once (a tail that fills no window is dropped).

use crate::data::{eval_window_count, eval_window_offsets, fill_batch};
use crate::model::Gpt;
use anyhow::{bail, Result};
use serde::Serialize;

/// The result of an evaluation.
#[derive(Clone, Copy, Debug, Serialize, PartialEq)]
pub struct EvalReport {
    /// Mean cross-entropy per predicted token, in nats.
    pub loss: f64,
    pub perplexity: f64,
    /// Tokens predicted.
    pub tokens: usize,
}

/// Evaluates `model` (built for batches up to `batch_size × block_size`) on `tokens`.
pub fn evaluate_tokens(
    model: &mut Gpt,
    tokens: &[u32],
    block_size: usize,
    batch_size: usize,
    on_batch: impl FnMut(usize, usize),
) -> Result<EvalReport> {
    evaluate_masked_tokens(model, tokens, None, block_size, batch_size, on_batch)
}

/// [`evaluate_tokens`] with a loss mask (one byte per token, 1 = scored, as
/// `train.mask` / `val.mask` hold): the mean over the scored targets only, as
/// training's val loss of instruction data is. Windows without a scored target are
/// skipped; none at all is an error.
pub fn evaluate_masked_tokens(
    model: &mut Gpt,
    tokens: &[u32],
    mask: Option<&[u8]>,
    block_size: usize,
    batch_size: usize,
    mut on_batch: impl FnMut(usize, usize),
) -> Result<EvalReport> {
    let windows = eval_window_count(tokens.len(), block_size);
    if windows == 0 {
        bail!(
            "{} tokens are too few for one window of {block_size} (+1 target); use a smaller --block-size",
            tokens.len()
        );
    }
    if let Some(mask) = mask {
        assert_eq!(mask.len(), tokens.len(), "one mask byte per token");
    }
    model.set_training(false);
    let mut inputs = vec![0u32; batch_size * block_size];
    let mut targets = vec![0i32; batch_size * block_size];
    let (mut total, mut count) = (0.0f64, 0usize);
    for start in (0..windows).step_by(batch_size) {
        let b = batch_size.min(windows - start);
        let offsets = eval_window_offsets(start..start + b, block_size);
        let (x, y) = (
            &mut inputs[..b * block_size],
            &mut targets[..b * block_size],
        );
        fill_batch(tokens, &offsets, block_size, x, y)?;
        let mut kept = b * block_size;
        if let Some(mask) = mask {
            kept = 0;
            for (&offset, row) in offsets.iter().zip(y.chunks_exact_mut(block_size)) {
                for (j, target) in row.iter_mut().enumerate() {
                    match mask[offset + 1 + j] {
                        0 => *target = -1,
                        _ => kept += 1,
                    }
                }
            }
        }
        if kept > 0 {
            // The batch mean over its scored targets, times their number: their sum.
            total += model.forward(x, y, b, block_size) as f64 * kept as f64;
            count += kept;
        }
        on_batch(start + b, windows);
    }
    if count == 0 {
        bail!(
            "no window of {block_size} tokens holds a trained token (the mask is 0 \
             everywhere they predict); nothing to evaluate"
        );
    }
    let loss = total / count as f64;
    Ok(EvalReport {
        loss,
        perplexity: loss.exp(),
        tokens: count,
    })
}

/// Evaluates `model` (built for batches of at least `1 × block_size`) on instruction
/// examples, each on its own (no packing): the mean cross-entropy over every trained
/// token (`mask` 1: the responses and their end-of-text), each token weighing the same.
///
/// An example of `n` tokens predicts tokens `1..n`. One longer than `block_size + 1`
/// is cut into consecutive windows as [`evaluate_tokens`] cuts a file: window `k`
/// reads `k·T .. k·T+T` and predicts the tokens one further, with no context from
/// the window before, so every trained token is still scored exactly once.
pub fn evaluate_examples(
    model: &mut Gpt,
    examples: &[(Vec<u32>, Vec<u8>)],
    block_size: usize,
    mut on_example: impl FnMut(usize, usize),
) -> Result<EvalReport> {
    model.set_training(false);
    let mut targets = Vec::with_capacity(block_size);
    let (mut total, mut count) = (0.0f64, 0usize);
    for (i, (tokens, mask)) in examples.iter().enumerate() {
        assert_eq!(tokens.len(), mask.len(), "one mask byte per token");
        for start in (0..tokens.len().saturating_sub(1)).step_by(block_size) {
            let t = block_size.min(tokens.len() - 1 - start);
            targets.clear();
            targets.extend((start + 1..start + 1 + t).map(|j| match mask[j] {
                0 => -1,
                _ => tokens[j] as i32,
            }));
            let kept = targets.iter().filter(|&&x| x >= 0).count();
            if kept == 0 {
                continue;
            }
            let mean = model.forward(&tokens[start..start + t], &targets, 1, t) as f64;
            total += mean * kept as f64;
            count += kept;
        }
        on_example(i + 1, examples.len());
    }
    if count == 0 {
        bail!("the examples have no response tokens to evaluate");
    }
    let loss = total / count as f64;
    Ok(EvalReport {
        loss,
        perplexity: loss.exp(),
        tokens: count,
    })
}
