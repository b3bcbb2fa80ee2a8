//! Optional timing of the step by kernel family, for `nanogpt bench --profile`.
//!
//! Off unless [`enable`] is called; then each instrumented kernel adds its wall time
//! to a per-family total. When off, a scope costs one relaxed atomic load.

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
    Gelu,
    Residual,
    Dropout,
    Classifier,
    ZeroGrad,
    GradNorm,
    AdamW,
    Bf16Weights,
}

const SECTIONS: [Section; 14] = [
    Section::Encoder,
    Section::LayerNorm,
    Section::MatmulForward,
    Section::MatmulBackward,
    Section::Attention,
    Section::AttentionBackward,
    Section::Gelu,
    Section::Residual,
    Section::Dropout,
    Section::Classifier,
    Section::ZeroGrad,
    Section::GradNorm,
    Section::AdamW,
    Section::Bf16Weights,
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
            Section::Gelu => "gelu",
            Section::Residual => "residual",
            Section::Dropout => "dropout",
            Section::Classifier => "classifier + loss",
            Section::ZeroGrad => "zero grad",
            Section::GradNorm => "grad norm + clip",
            Section::AdamW => "adamw",
            Section::Bf16Weights => "bf16 weight copy",
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

/// Times the rest of the enclosing block as `section` (when enabled).
#[must_use]
pub fn scope(section: Section) -> Option<Scope> {
    ENABLED.load(Ordering::Relaxed).then(|| Scope {
        section,
        start: Instant::now(),
    })
}

pub struct Scope {
    section: Section,
    start: Instant,
}

impl Drop for Scope {
    fn drop(&mut self) {
        let index = SECTIONS
            .iter()
            .position(|&s| s == self.section)
            .unwrap_or(0);
        NANOS[index].fetch_add(self.start.elapsed().as_nanos() as u64, Ordering::Relaxed);
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
