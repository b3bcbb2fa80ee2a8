//! Optional timing of the step by kernel family, for `nanogpt bench --profile`.
//!
//! Off unless [`enable`] is called; then each instrumented kernel adds its wall time
//! to a per-family total, less the time of any instrumented kernel it calls (which
//! goes to that kernel's family), so the totals add up to the time covered. When
//! off, a scope costs one relaxed atomic load.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

/// What a span of the step was spent on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Section {
    Encoder,
    LayerNorm,
    MatmulForward,
    MatmulBackward,
    Attention,
    AttentionBackward,
    /// GELU (GPT-2) or SwiGLU (the Llama families).
    Activation,
    Residual,
    Dropout,
    /// The classifier's products (logits, their input and weight gradients).
    Classifier,
    /// The softmax and cross-entropy over the logits, and their gradient.
    Loss,
    Rope,
    /// LoRA's adapter products (the frozen base's own are the linear rows).
    Lora,
    ZeroGrad,
    GradNorm,
    AdamW,
    Bf16Weights,
    Bf16Round,
}

const SECTIONS: [Section; 18] = [
    Section::Encoder,
    Section::LayerNorm,
    Section::MatmulForward,
    Section::MatmulBackward,
    Section::Attention,
    Section::AttentionBackward,
    Section::Activation,
    Section::Residual,
    Section::Dropout,
    Section::Classifier,
    Section::Loss,
    Section::Rope,
    Section::Lora,
    Section::ZeroGrad,
    Section::GradNorm,
    Section::AdamW,
    Section::Bf16Weights,
    Section::Bf16Round,
];

impl Section {
    pub fn name(self) -> &'static str {
        match self {
            Section::Encoder => "embedding",
            Section::LayerNorm => "layer norm",
            Section::MatmulForward => "linear forward",
            Section::MatmulBackward => "linear backward",
            Section::Attention => "attention forward",
            Section::AttentionBackward => "attention backward",
            Section::Activation => "gelu / swiglu",
            Section::Residual => "residual",
            Section::Dropout => "dropout",
            Section::Classifier => "classifier matmuls",
            Section::Loss => "softmax + cross-entropy",
            Section::Rope => "rope",
            Section::Lora => "lora adapters",
            Section::ZeroGrad => "zero grad",
            Section::GradNorm => "grad norm + clip",
            Section::AdamW => "adamw",
            Section::Bf16Weights => "bf16 weight copy",
            Section::Bf16Round => "bf16 rounding + widening",
        }
    }
}

static ENABLED: AtomicBool = AtomicBool::new(false);
static NANOS: [AtomicU64; SECTIONS.len()] = [const { AtomicU64::new(0) }; SECTIONS.len()];

/// Starts collecting (and clears earlier totals).
pub fn enable() {
    reset();
    ENABLED.store(true, Ordering::Relaxed);
}

pub fn reset() {
    NANOS.iter().for_each(|n| n.store(0, Ordering::Relaxed));
}

thread_local! {
    /// The section timing on this thread, if any: a nested scope's time is moved out
    /// of it, so each section reports its own time only and the rows add up.
    static CURRENT: Cell<Option<Section>> = const { Cell::new(None) };
}

/// Times the rest of the enclosing block as `section` (when enabled).
#[must_use]
pub fn scope(section: Section) -> Option<Scope> {
    ENABLED.load(Ordering::Relaxed).then(|| Scope {
        section,
        parent: CURRENT.with(|c| c.replace(Some(section))),
        start: Instant::now(),
    })
}

pub struct Scope {
    section: Section,
    parent: Option<Section>,
    start: Instant,
}

fn slot(section: Section) -> &'static AtomicU64 {
    let index = SECTIONS.iter().position(|&s| s == section).unwrap_or(0);
    &NANOS[index]
}

impl Drop for Scope {
    fn drop(&mut self) {
        let nanos = self.start.elapsed().as_nanos() as u64;
        slot(self.section).fetch_add(nanos, Ordering::Relaxed);
        if let Some(parent) = self.parent {
            // Wrapping: the parent's own drop adds at least this much back.
            slot(parent).fetch_sub(nanos, Ordering::Relaxed);
        }
        CURRENT.with(|c| c.set(self.parent));
    }
}

/// Seconds per section since [`enable`] / [`reset`], largest first.
pub fn totals() -> Vec<(&'static str, f64)> {
    let mut rows: Vec<_> = SECTIONS
        .iter()
        .zip(&NANOS)
        .map(|(s, n)| (s.name(), n.load(Ordering::Relaxed) as f64 / 1e9))
        .filter(|&(_, secs)| secs > 0.0)
        .collect();
    rows.sort_by(|a, b| b.1.total_cmp(&a.1));
    rows
}
