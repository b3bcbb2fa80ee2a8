//! Deterministic, seeded dropout whose mask is a pure function of (seed, index).
//!
//! Nothing is stored between forward and backward: the mask is regenerated from a
//! counter-based hash, so it is the same whatever the thread count or the order in
//! which elements are visited, and it costs no activation memory.

use rayon::prelude::*;

/// One dropout site for one pass: drop probability and a seed that the caller has
/// already made unique per (step, micro-step, layer, site).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Dropout {
    pub p: f32,
    pub seed: u64,
}

/// SplitMix64's finaliser: a bijective 64-bit mixer with good avalanche.
#[inline]
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Dropout {
    /// Derives the seed of a sub-site (a layer, a site within a layer, ...).
    pub fn derive(base: u64, part: u64) -> u64 {
        mix64(base ^ mix64(part.wrapping_add(0x9e37_79b9_7f4a_7c15)))
    }

    /// Whether element `index` is kept.
    #[inline]
    pub fn keep(&self, index: u64) -> bool {
        let r = mix64(
            self.seed
                .wrapping_add(index.wrapping_mul(0x9e37_79b9_7f4a_7c15)),
        );
        // Top 24 bits as a uniform in [0, 1).
        ((r >> 40) as f32) * (1.0 / (1u64 << 24) as f32) >= self.p
    }

    /// The factor applied to kept elements, `1 / (1 - p)`.
    #[inline]
    pub fn scale(&self) -> f32 {
        1.0 / (1.0 - self.p)
    }

    /// The mask value for element `index`: `0` or `1 / (1 - p)`.
    #[inline]
    pub fn factor(&self, index: u64) -> f32 {
        if self.keep(index) {
            self.scale()
        } else {
            0.0
        }
    }
}

const CHUNK: usize = 4096;

/// `x[i] *= mask(i)` in place, with `i` counted from `first_index`. Forward and backward
/// are the same operation (the mask is its own Jacobian), so this serves both.
pub fn apply(x: &mut [f32], mask: Dropout, first_index: u64) {
    let _t = crate::profile::scope(crate::profile::Section::Dropout);
    x.par_chunks_mut(CHUNK).enumerate().for_each(|(k, chunk)| {
        let base = first_index + (k * CHUNK) as u64;
        for (i, v) in chunk.iter_mut().enumerate() {
            *v *= mask.factor(base + i as u64);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_about_one_minus_p_and_scales() {
        let mask = Dropout { p: 0.3, seed: 42 };
        let mut x = vec![1.0f32; 200_000];
        apply(&mut x, mask, 0);
        let kept = x.iter().filter(|&&v| v != 0.0).count() as f64 / x.len() as f64;
        assert!((kept - 0.7).abs() < 0.005, "kept {kept}");
        let scale = 1.0 / 0.7;
        assert!(x.iter().all(|&v| v == 0.0 || (v - scale).abs() < 1e-6));
        let mean = x.iter().map(|&v| v as f64).sum::<f64>() / x.len() as f64;
        assert!((mean - 1.0).abs() < 0.01, "mean {mean}");
    }

    #[test]
    fn mask_depends_only_on_seed_and_index() {
        let mask = Dropout { p: 0.5, seed: 7 };
        let mut whole = vec![1.0f32; 10_000];
        apply(&mut whole, mask, 0);
        let mut tail = vec![1.0f32; 5_000];
        apply(&mut tail, mask, 5_000);
        assert_eq!(&whole[5_000..], &tail[..]);
        let other = Dropout { p: 0.5, seed: 8 };
        let mut y = vec![1.0f32; 10_000];
        apply(&mut y, other, 0);
        assert_ne!(whole, y);
    }

    #[test]
    fn zero_probability_is_identity() {
        let mask = Dropout { p: 0.0, seed: 1 };
        let mut x: Vec<f32> = (0..1000).map(|i| i as f32).collect();
        let before = x.clone();
        apply(&mut x, mask, 0);
        assert_eq!(x, before);
    }
}
