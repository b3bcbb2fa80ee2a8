//! Rotary position embeddings (RoPE) in Hugging Face's rotate-half layout (Llama,
//! Qwen, Mistral): channel `i` of a head is paired with channel `i + HS/2`, and the
//! pair of position `p` is turned by the angle `p · f_i`:
//!
//! ```text
//! out[i]        = x[i] · cos(p·f_i) − x[i + HS/2] · sin(p·f_i)      i < HS/2
//! out[i + HS/2] = x[i + HS/2] · cos(p·f_i) + x[i] · sin(p·f_i)
//! ```
//!
//! with the frequencies `f_i = θ^(−2i/HS)`, scaled as the model's `rope_type` says
//! ([`RopeScaling`]). The queries and keys of every head are turned; the values are
//! not. The backward pass turns the gradients by the opposite angle (a rotation's
//! transpose is its inverse).
//!
//! The frequencies and the table of cosines and sines are computed once
//! ([`RopeTable`]), in f32 with the operations in the order transformers uses, so
//! that the angles (`p · f_i` rounded to f32, which at position 8,000 already moves
//! by 5e-4 per ulp of `f_i`) are the ones its models see.

use super::Dims;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

/// How a model's rotary frequencies are scaled (its `rope_type`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RopeScaling {
    /// `default`: the frequencies `θ^(−2i/HS)` as they are.
    None,
    /// `linear`: every frequency divided by `factor` (positions interpolated).
    Linear { factor: f32 },
    /// `llama3` (Llama 3.1 and later): frequencies whose wavelength exceeds
    /// `original_max_position_embeddings / low_freq_factor` are divided by `factor`,
    /// those shorter than `… / high_freq_factor` kept, and those between
    /// interpolated smoothly.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position_embeddings: usize,
    },
}

/// A model's rotary embedding: the base `theta` and the scaling.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Rope {
    pub theta: f32,
    pub scaling: RopeScaling,
}

impl Rope {
    /// The `HS / 2` frequencies `f_i`, in f32, each operation rounded where
    /// transformers' `_compute_*_rope_parameters` round it (`HS` even).
    pub fn inv_freq(&self, hs: usize) -> Vec<f32> {
        assert!(
            hs >= 2 && hs.is_multiple_of(2),
            "RoPE needs an even head size, not {hs}"
        );
        let base = (0..hs / 2).map(|i| {
            let exponent = (2 * i) as f32 / hs as f32;
            // θ^e rounded once to f32 (transformers: an f32 `pow`, within an ulp).
            let power = (self.theta as f64).powf(exponent as f64) as f32;
            1.0 / power
        });
        match self.scaling {
            RopeScaling::None => base.collect(),
            RopeScaling::Linear { factor } => base.map(|f| f / factor).collect(),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position_embeddings: old,
            } => {
                let old = old as f32;
                let (low_wavelen, high_wavelen) = (old / low, old / high);
                let two_pi = std::f64::consts::TAU as f32;
                base.map(|f| {
                    let wavelen = (1.0 / f) * two_pi;
                    let scaled = if wavelen > low_wavelen { f / factor } else { f };
                    // Neither shorter than the high-frequency wavelength nor longer
                    // than the low one (finite values: the same as between them).
                    let medium = wavelen >= high_wavelen && wavelen <= low_wavelen;
                    if !medium {
                        return scaled;
                    }
                    let smooth = ((1.0 / wavelen) * old - low) / (high - low);
                    (1.0 - smooth) * scaled / factor + smooth * scaled
                })
                .collect()
            }
        }
    }
}

/// The cosines and sines of every (position, frequency) pair for heads of `HS`
/// channels, computed once for `positions` positions.
#[derive(Clone, Debug)]
pub struct RopeTable {
    half: usize,
    /// (positions, HS/2): `cos(p·f_i)` at `p·HS/2 + i`.
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    /// The table of `rope` for heads of `hs` channels at positions `0..positions`:
    /// the angle `p · f_i` rounded to f32 (as transformers forms it), its cosine and
    /// sine rounded once to f32.
    pub fn new(rope: &Rope, hs: usize, positions: usize) -> RopeTable {
        let inv_freq = rope.inv_freq(hs);
        let half = hs / 2;
        let mut cos = vec![0.0; positions * half];
        let mut sin = vec![0.0; positions * half];
        cos.par_chunks_mut(half)
            .zip(sin.par_chunks_mut(half))
            .enumerate()
            .for_each(|(p, (c, s))| {
                for ((c, s), &f) in c.iter_mut().zip(s).zip(&inv_freq) {
                    let angle = (p as f32 * f) as f64;
                    (*c, *s) = (angle.cos() as f32, angle.sin() as f32);
                }
            });
        RopeTable { half, cos, sin }
    }

    /// The positions the table holds.
    pub fn positions(&self) -> usize {
        self.cos.len() / self.half.max(1)
    }

    /// The head size the table is for.
    pub fn head_size(&self) -> usize {
        2 * self.half
    }

    /// `(cos, sin)` of position `p`, HS/2 each.
    fn at(&self, p: usize) -> (&[f32], &[f32]) {
        let r = p * self.half..(p + 1) * self.half;
        (&self.cos[r.clone()], &self.sin[r])
    }
}

/// Turns the queries and keys of `qkv` in place: row `t` of every sequence is at
/// position `pos0 + t` (`pos0 > 0` continues a sequence whose earlier positions are in
/// a key/value cache).
///
/// qkv: (B, T, (NH + 2·KV)·HS) as attention reads it; the values are left alone.
///
/// # Panics
/// If the table is for another head size or holds fewer than `pos0 + T` positions.
pub fn rope_forward(qkv: &mut [f32], d: Dims, table: &RopeTable, pos0: usize) {
    turn(qkv, d, table, pos0, 1.0);
}

/// Backward of [`rope_forward`], in place: `dqkv` holds the gradient of its output on
/// entry and that of its input on return (turned by the opposite angles); the values'
/// part passes through.
pub fn rope_backward(dqkv: &mut [f32], d: Dims, table: &RopeTable, pos0: usize) {
    turn(dqkv, d, table, pos0, -1.0);
}

/// Turns every query and key head of `x` by the angle of its position times `sign`
/// (1 or −1: sin(−a) = −sin(a), so the backward pass is exactly the transpose).
fn turn(x: &mut [f32], d: Dims, table: &RopeTable, pos0: usize, sign: f32) {
    let _t = crate::profile::scope(crate::profile::Section::Rope);
    let (w, hs) = (d.qkv_width(), d.hs);
    assert_eq!(
        table.head_size(),
        hs,
        "the RoPE table is for heads of another size"
    );
    assert_eq!(x.len(), d.bt() * w, "qkv must be (B, T, (NH + 2·KV)·HS)");
    assert!(
        pos0 + d.t <= table.positions(),
        "position {} beyond the RoPE table's {}",
        pos0 + d.t,
        table.positions()
    );
    let turned = (d.nh + d.kv) * hs;
    x.par_chunks_mut(w).enumerate().for_each(|(row, x)| {
        let (cos, sin) = table.at(pos0 + row % d.t);
        for head in x[..turned].chunks_exact_mut(hs) {
            let (lo, hi) = head.split_at_mut(hs / 2);
            for (((lo, hi), &c), &s) in lo.iter_mut().zip(hi).zip(cos).zip(sin) {
                let s = sign * s;
                // transformers: q·cos + rotate_half(q)·sin, rotate_half(q) = (−hi, lo).
                (*lo, *hi) = (*lo * c + -*hi * s, *hi * c + *lo * s);
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::*;

    const LLAMA3: RopeScaling = RopeScaling::Llama3 {
        factor: 32.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    };

    /// Turns `x` (f64) by the exact angles `p·f_i` with the frequencies in f64.
    fn reference(x: &[f64], d: Dims, freqs: &[f64], pos0: usize) -> Vec<f64> {
        let (w, hs, half) = (d.qkv_width(), d.hs, d.hs / 2);
        let mut out = x.to_vec();
        for row in 0..d.bt() {
            let p = (pos0 + row % d.t) as f64;
            for head in 0..d.nh + d.kv {
                let at = row * w + head * hs;
                for i in 0..half {
                    let (c, s) = ((p * freqs[i]).cos(), (p * freqs[i]).sin());
                    let (lo, hi) = (x[at + i], x[at + half + i]);
                    out[at + i] = lo * c - hi * s;
                    out[at + half + i] = hi * c + lo * s;
                }
            }
        }
        out
    }

    #[test]
    fn frequencies_follow_each_scaling() {
        let hs = 16;
        let plain = Rope {
            theta: 500_000.0,
            scaling: RopeScaling::None,
        };
        let f = plain.inv_freq(hs);
        for (i, &fi) in f.iter().enumerate() {
            let want = 500_000f64.powf(-((2 * i) as f64) / hs as f64);
            assert!(
                (fi as f64 - want).abs() <= 2e-7 * want,
                "{i}: {fi} vs {want}"
            );
        }
        let linear = Rope {
            scaling: RopeScaling::Linear { factor: 4.0 },
            ..plain
        };
        assert_eq!(
            linear.inv_freq(hs),
            f.iter().map(|f| f / 4.0).collect::<Vec<_>>()
        );
        // llama3: the wavelengths 2π/f of θ = 500,000 and HS = 16 span 6.3 to 6.1e5,
        // so every regime appears: kept below 8192 / 4, divided by 32 above 8192,
        // interpolated between.
        let scaled = Rope {
            scaling: LLAMA3,
            ..plain
        }
        .inv_freq(hs);
        let (mut kept, mut divided, mut between) = (0, 0, 0);
        for (&s, &fi) in scaled.iter().zip(&f) {
            let wavelen = std::f32::consts::TAU / fi;
            if wavelen < 2048.0 {
                assert_eq!(s, fi);
                kept += 1;
            } else if wavelen > 8192.0 {
                assert_eq!(s, fi / 32.0);
                divided += 1;
            } else {
                let smooth = (8192.0 / wavelen - 1.0) / 3.0;
                let want = (1.0 - smooth) * fi / 32.0 + smooth * fi;
                assert!((s - want).abs() <= 1e-6 * want, "{s} vs {want}");
                between += 1;
            }
        }
        assert!(
            kept > 0 && divided > 0 && between > 0,
            "{kept} {divided} {between}"
        );
    }

    #[test]
    fn turns_queries_and_keys_and_backward_is_the_transpose() {
        // 6 query heads over 2 key/value heads of 8 channels, at positions from 0 and
        // from 1000 (a cache's continuation).
        let d = Dims::new(2, 5, 0, 6).with_heads(2, 8);
        let rope = Rope {
            theta: 10_000.0,
            scaling: LLAMA3,
        };
        let table = RopeTable::new(&rope, d.hs, 1005);
        let freqs: Vec<f64> = rope.inv_freq(d.hs).iter().map(|&f| f as f64).collect();
        let n = d.bt() * d.qkv_width();
        let x = rand_vec(n, 1);
        let g = rand_vec(n, 2);
        for pos0 in [0, 1000] {
            let mut out = x.clone();
            rope_forward(&mut out, d, &table, pos0);
            // The f32 angle p·f_i differs from the exact one by up to half an ulp of
            // 1000 rad (3e-5).
            let want = reference(&to_f64(&x), d, &freqs, pos0);
            assert_close("out", &out, &want, 1e-5, 1e-4);
            let values = d.nh + d.kv;
            for row in 0..d.bt() {
                let v = &out[row * d.qkv_width() + values * d.hs..][..d.kv * d.hs];
                assert_eq!(v, &x[row * d.qkv_width() + values * d.hs..][..d.kv * d.hs]);
            }
            // The gradient of Σ out·g is the backward pass of g (the map is linear).
            let mut dx = g.clone();
            rope_backward(&mut dx, d, &table, pos0);
            let want = numeric_grad(
                |x| dot(&reference(x, d, &freqs, pos0), &g),
                &to_f64(&x),
                1e-5,
            );
            assert_close("dinp", &dx, &want, 1e-4, 1e-4);
            // Turning back undoes the turn.
            rope_backward(&mut out, d, &table, pos0);
            assert_close("round trip", &out, &to_f64(&x), 1e-5, 1e-6);
        }
    }

    #[test]
    #[should_panic(expected = "beyond the RoPE table")]
    fn positions_beyond_the_table_panic() {
        let d = Dims::new(1, 4, 8, 1);
        let rope = Rope {
            theta: 10_000.0,
            scaling: RopeScaling::None,
        };
        let table = RopeTable::new(&rope, 8, 6);
        rope_forward(&mut vec![0.0; d.bt() * d.qkv_width()], d, &table, 3);
    }

    #[test]
    fn matches_transformers() {
        let f = LlamaFixture::load();
        let d = f.dims("rope.dims");
        let ropes = [
            ("default", RopeScaling::None, 10_000.0),
            ("linear", RopeScaling::Linear { factor: 4.0 }, 10_000.0),
            ("llama3", LLAMA3, 500_000.0),
        ];
        for (name, scaling, theta) in ropes {
            let rope = Rope { theta, scaling };
            // The same frequencies, to the bit: the angles at position 1000 depend on
            // their last bits.
            assert_eq!(
                rope.inv_freq(d.hs),
                f.f32(&format!("rope.{name}.inv_freq")),
                "{name}"
            );
            let table = RopeTable::new(&rope, d.hs, 1000 + d.t);
            for pos0 in [0, 1000] {
                let key = format!("rope.{name}.{pos0}");
                let mut x = f.f32(&format!("{key}.qkv"));
                rope_forward(&mut x, d, &table, pos0);
                assert_close(
                    &format!("{key}.out"),
                    &x,
                    &f.f64(&format!("{key}.out")),
                    1e-5,
                    1e-6,
                );
                let mut dx = f.f32(&format!("{key}.dout"));
                rope_backward(&mut dx, d, &table, pos0);
                let want = f.f64(&format!("{key}.dqkv"));
                assert_close(&format!("{key}.dqkv"), &dx, &want, 1e-5, 1e-6);
            }
        }
    }
}
