//! GELU, GPT-2's tanh approximation: `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`.

use rayon::prelude::*;

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const COEF: f32 = 0.044_715;
const CHUNK: usize = 4096;

#[inline]
fn gelu(x: f32) -> f32 {
    let u = SQRT_2_OVER_PI * (x + COEF * x * x * x);
    0.5 * x * (1.0 + u.tanh())
}

#[inline]
fn gelu_grad(x: f32) -> f32 {
    let u = SQRT_2_OVER_PI * (x + COEF * x * x * x);
    let th = u.tanh();
    let du = SQRT_2_OVER_PI * (1.0 + 3.0 * COEF * x * x);
    0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * du
}

/// `out = gelu(inp)`, element-wise; any shape.
pub fn gelu_forward(out: &mut [f32], inp: &[f32]) {
    assert_eq!(out.len(), inp.len());
    out.par_chunks_mut(CHUNK)
        .zip(inp.par_chunks(CHUNK))
        .for_each(|(o, x)| o.iter_mut().zip(x).for_each(|(o, &x)| *o = gelu(x)));
}

/// In place: `d` holds `dout` on entry and `dinp = gelu'(inp) · dout` on return.
pub fn gelu_backward(d: &mut [f32], inp: &[f32]) {
    assert_eq!(d.len(), inp.len());
    d.par_chunks_mut(CHUNK)
        .zip(inp.par_chunks(CHUNK))
        .for_each(|(d, x)| d.iter_mut().zip(x).for_each(|(d, &x)| *d *= gelu_grad(x)));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::*;

    fn reference(x: &[f64]) -> Vec<f64> {
        let s = (2.0 / std::f64::consts::PI).sqrt();
        x.iter()
            .map(|&x| 0.5 * x * (1.0 + (s * (x + 0.044715 * x * x * x)).tanh()))
            .collect()
    }

    #[test]
    fn matches_reference_and_finite_differences() {
        let x: Vec<f32> = rand_vec(5000, 1).iter().map(|v| 4.0 * v).collect();
        let g = rand_vec(5000, 2);
        let x64 = to_f64(&x);
        let mut out = vec![0.0; x.len()];
        gelu_forward(&mut out, &x);
        assert_close("out", &out, &reference(&x64), 1e-6, 1e-6);
        let mut dx = g.clone();
        gelu_backward(&mut dx, &x);
        let want = numeric_grad(|v| dot(&reference(v), &g), &x64[..200], 1e-5);
        assert_close("dinp", &dx[..200], &want, 1e-5, 1e-6);
        // Element-wise: check the rest against per-element differences.
        let per_elem: Vec<f64> = x64
            .iter()
            .zip(&g)
            .map(|(&x, &g)| {
                let f = |v: f64| reference(&[v])[0];
                (f(x + 1e-6) - f(x - 1e-6)) / 2e-6 * g as f64
            })
            .collect();
        assert_close("dinp (all)", &dx, &per_elem, 1e-5, 1e-6);
    }
}
