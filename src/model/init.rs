//! Initialisation from scratch: GPT-2's as nanoGPT does it, the Llama families' as
//! transformers does.

use super::config::ModelConfig;
use super::layout::ParamLayout;
use crate::kernels::dropout::mix64;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};
use rayon::prelude::*;

/// Floats drawn from one RNG stream; streams are independent, so init is parallel and
/// still a pure function of the seed.
const STREAM: usize = 1 << 20;

/// Fills `params`: weights and embeddings ~ N(0, 0.02²), biases 0, norm gains 1; for
/// GPT-2 (nanoGPT's initialisation) the two residual projections (`attn.c_proj`,
/// `mlp.c_proj`) ~ N(0, (0.02/√(2·n_layer))²), for the Llama families none scaled
/// (transformers' `initializer_range` 0.02). The padded vocabulary rows of `wte` (and
/// an untied `lm_head`) are 0: they are never used.
pub fn init_gpt2(params: &mut [f32], layout: &ParamLayout, cfg: &ModelConfig, seed: u64) {
    params.fill(0.0);
    let gpt2 = cfg.llama.is_none();
    let residual_std = 0.02 / (2.0 * cfg.n_layer as f32).sqrt();
    let vocab_rows = [layout.wte.start, layout.lm_head.start];
    for (index, tensor) in layout.tensors.iter().enumerate() {
        let name = tensor.name.as_str();
        let mut range = tensor.range();
        let std = if gpt2 && name.ends_with("c_proj.weight") {
            residual_std
        } else if name.ends_with(".bias") {
            continue;
        } else if tensor.shape.len() == 1 {
            // A norm's gain (GPT-2's ln_*, Llama's *_norm / *_layernorm weights).
            params[range].fill(1.0);
            continue;
        } else {
            0.02
        };
        if tensor.numel() > 0 && vocab_rows.contains(&tensor.offset) {
            range.end = range.start + cfg.vocab_size * cfg.n_embd;
        }
        let normal = Normal::new(0.0f32, std).expect("a positive standard deviation");
        let tensor_seed = mix64(seed ^ mix64(index as u64 + 1));
        params[range]
            .par_chunks_mut(STREAM)
            .enumerate()
            .for_each(|(k, chunk)| {
                let mut rng = ChaCha8Rng::seed_from_u64(mix64(tensor_seed.wrapping_add(k as u64)));
                chunk.iter_mut().for_each(|p| *p = normal.sample(&mut rng));
            });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(x: &[f32]) -> (f64, f64) {
        let n = x.len() as f64;
        let mean = x.iter().map(|&v| v as f64).sum::<f64>() / n;
        let var = x.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
        (mean, var.sqrt())
    }

    #[test]
    fn follows_nanogpt_statistics() {
        let cfg = ModelConfig {
            vocab_size: 1000,
            block_size: 64,
            n_layer: 8,
            n_head: 4,
            n_embd: 128,
            bias: true,
            dropout: 0.0,
            llama: None,
        };
        let layout = ParamLayout::new(&cfg);
        let mut params = vec![f32::NAN; layout.len];
        init_gpt2(&mut params, &layout, &cfg, 42);
        let get = |name: &str| &params[layout.get(name).unwrap().range()];
        let (m, s) = stats(get("transformer.h.3.attn.c_attn.weight"));
        assert!(m.abs() < 2e-3 && (s - 0.02).abs() < 5e-4, "c_attn {m} {s}");
        let (_, s) = stats(get("transformer.h.3.mlp.c_proj.weight"));
        assert!((s - 0.02 / 4.0).abs() < 2e-4, "mlp.c_proj std {s}");
        let (_, s) = stats(get("transformer.h.0.attn.c_proj.weight"));
        assert!((s - 0.005).abs() < 2e-4, "attn.c_proj std {s}");
        assert!(get("transformer.h.0.attn.c_attn.bias")
            .iter()
            .all(|&b| b == 0.0));
        assert!(get("transformer.ln_f.weight").iter().all(|&w| w == 1.0));
        let wte = get("transformer.wte.weight");
        assert!(wte[1000 * 128..].iter().all(|&w| w == 0.0), "padding rows");
        let (_, s) = stats(&wte[..1000 * 128]);
        assert!((s - 0.02).abs() < 5e-4);
        assert!(params.iter().all(|p| p.is_finite()));

        let mut again = vec![0.0; layout.len];
        init_gpt2(&mut again, &layout, &cfg, 42);
        assert_eq!(params, again, "same seed, same weights");
        init_gpt2(&mut again, &layout, &cfg, 43);
        assert_ne!(params, again);
    }
}
