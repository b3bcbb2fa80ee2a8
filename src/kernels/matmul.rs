//! Linear layers: f32 on the f32 GEMM, bf16 autocast on the back-end's bf16 kernel
//! ([`product`]).
//!
//! Weights are `(OC, C)` (PyTorch `nn.Linear` order): `out = inp · weightᵀ + bias`.

use super::bf16::gemm::{matmul_bf16_packed, product, WeightPacks};
use super::bf16::Backend;
use super::mat::Mat;
use rayon::prelude::*;

/// A linear layer's parameters: `weight` (OC, C) and `bias` (OC), or no bias (empty).
#[derive(Clone, Copy)]
pub struct Linear<'a> {
    pub weight: &'a [f32],
    pub bias: &'a [f32],
    /// Input channels (C).
    pub c: usize,
    /// Output channels (OC).
    pub oc: usize,
    /// bf16 on AMX or AVX512-BF16: `weight` packed beforehand (once per optimizer
    /// step) for the forward and input-gradient products, which then read the packs
    /// instead of packing `weight` per call: the same bits. None: packed per call.
    pub packs: Option<&'a WeightPacks>,
    /// The kernel of the bf16 products (unused in f32).
    pub backend: &'a Backend,
}

/// Where a linear layer's parameter gradients accumulate: `dweight` (OC, C) and
/// `dbias` (OC), or no bias (empty).
pub struct LinearGrads<'a> {
    pub dweight: &'a mut [f32],
    pub dbias: &'a mut [f32],
}

/// `out = inp · weightᵀ + bias`. With `BF16`, `inp` and `weight` hold bf16 values and
/// the product runs on the back-end's bf16 kernel (f32 accumulation, f32 bias and
/// output).
///
/// out: (N, OC) written; inp: (N, C).
pub fn linear_forward<const BF16: bool>(out: &mut [f32], inp: &[f32], w: Linear) {
    let _t = crate::profile::scope(crate::profile::Section::MatmulForward);
    let n = inp.len() / w.c;
    assert_eq!(out.len(), n * w.oc, "linear_forward: out must be (N, OC)");
    if !w.bias.is_empty() {
        out.par_chunks_mut(w.oc)
            .for_each(|row| row.copy_from_slice(w.bias));
    }
    let (weight, x) = (Mat::new(w.weight, w.oc, w.c), Mat::new(inp, n, w.c));
    let acc = !w.bias.is_empty();
    match w.packs.filter(|_| BF16) {
        Some(p) => matmul_bf16_packed(w.backend, out, x, weight.t(), &p.t, acc),
        None => product::<BF16>(w.backend, out, x, weight.t(), acc),
    }
}

/// Backward of [`linear_forward`]: `dinp = dout · weight` (**overwritten**),
/// `dweight += doutᵀ · inp` and `dbias += Σ_rows dout` (accumulated). With `BF16`,
/// `dout`, `inp` and `weight` hold bf16 values; the gradients are f32.
pub fn linear_backward<const BF16: bool>(
    dinp: &mut [f32],
    g: LinearGrads,
    dout: &[f32],
    inp: &[f32],
    w: Linear,
) {
    linear_backward_input::<BF16>(dinp, dout, w);
    linear_backward_params::<BF16>(w.backend, g, dout, inp, w.c, w.oc);
}

/// The parameter half of [`linear_backward`]: `dweight += doutᵀ · inp` and
/// `dbias += Σ_rows dout`. With [`linear_backward_input`] it lets a caller reuse
/// `inp`'s buffer for `dinp` (the MLP recomputes its GELU output into the buffer that
/// then receives the GELU's gradient).
///
/// dout: (N, OC); inp: (N, C).
pub fn linear_backward_params<const BF16: bool>(
    backend: &Backend,
    g: LinearGrads,
    dout: &[f32],
    inp: &[f32],
    c: usize,
    oc: usize,
) {
    let _t = crate::profile::scope(crate::profile::Section::MatmulBackward);
    let n = inp.len() / c;
    let (dout, inp) = (Mat::new(dout, n, oc), Mat::new(inp, n, c));
    product::<BF16>(backend, g.dweight, dout.t(), inp, true);
    if !g.dbias.is_empty() {
        bias_backward(g.dbias, dout.data, oc);
    }
}

/// The input half of [`linear_backward`]: `dinp = dout · weight` (**overwritten**).
///
/// dinp: (N, C); dout: (N, OC).
pub fn linear_backward_input<const BF16: bool>(dinp: &mut [f32], dout: &[f32], w: Linear) {
    let _t = crate::profile::scope(crate::profile::Section::MatmulBackward);
    let n = dinp.len() / w.c;
    let (weight, dy) = (Mat::new(w.weight, w.oc, w.c), Mat::new(dout, n, w.oc));
    match w.packs.filter(|_| BF16) {
        Some(p) => matmul_bf16_packed(w.backend, dinp, dy, weight, &p.n, false),
        None => product::<BF16>(w.backend, dinp, dy, weight, false),
    }
}

/// `dbias[o] += Σ_rows dout[row, o]`, parallel over column blocks.
fn bias_backward(dbias: &mut [f32], dout: &[f32], oc: usize) {
    const BLOCK: usize = 64;
    dbias
        .par_chunks_mut(BLOCK)
        .enumerate()
        .for_each(|(blk, db)| {
            let cols = blk * BLOCK..blk * BLOCK + db.len();
            for row in dout.chunks_exact(oc) {
                for (d, &g) in db.iter_mut().zip(&row[cols.clone()]) {
                    *d += g;
                }
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::*;
    use std::sync::LazyLock;

    fn reference(x: &[f64], w: &[f64], b: &[f64], c: usize, oc: usize) -> Vec<f64> {
        let n = x.len() / c;
        let mut out = vec![0.0; n * oc];
        for r in 0..n {
            for o in 0..oc {
                let dot: f64 = (0..c).map(|i| x[r * c + i] * w[o * c + i]).sum();
                out[r * oc + o] = dot + b.get(o).copied().unwrap_or(0.0);
            }
        }
        out
    }

    /// A linear layer of `weight` (OC, C) and `bias` (OC or empty) on the f32 GEMM.
    fn portable<'a>(weight: &'a [f32], bias: &'a [f32], c: usize, oc: usize) -> Linear<'a> {
        static PORTABLE: LazyLock<Backend> = LazyLock::new(Backend::portable);
        Linear {
            weight,
            bias,
            c,
            oc,
            packs: None,
            backend: &PORTABLE,
        }
    }

    fn check(n: usize, c: usize, oc: usize, with_bias: bool) {
        let x = rand_vec(n * c, 1);
        let w = rand_vec(oc * c, 2);
        let b = if with_bias { rand_vec(oc, 3) } else { vec![] };
        let g = rand_vec(n * oc, 4);
        let (x64, w64, b64) = (to_f64(&x), to_f64(&w), to_f64(&b));

        let lin = portable(&w, &b, c, oc);
        let mut out = vec![f32::NAN; n * oc];
        linear_forward::<false>(&mut out, &x, lin);
        assert_close("out", &out, &reference(&x64, &w64, &b64, c, oc), 1e-5, 1e-5);

        let mut dx = vec![f32::NAN; n * c];
        let prior_dw = rand_vec(oc * c, 5);
        let mut dw = prior_dw.clone();
        let mut db = vec![0.5; b.len()];
        let grads = LinearGrads {
            dweight: &mut dw,
            dbias: &mut db,
        };
        linear_backward::<false>(&mut dx, grads, &g, &x, lin);

        let loss = |x: &[f64], w: &[f64], b: &[f64]| dot(&reference(x, w, b, c, oc), &g);
        let want_dx = numeric_grad(|v| loss(v, &w64, &b64), &x64, 1e-4);
        assert_close("dinp", &dx, &want_dx, 1e-4, 1e-5);
        let mut want_dw = numeric_grad(|v| loss(&x64, v, &b64), &w64, 1e-4);
        for (d, &p) in want_dw.iter_mut().zip(&prior_dw) {
            *d += p as f64;
        }
        assert_close("dweight", &dw, &want_dw, 1e-4, 1e-5);
        if with_bias {
            let mut want_db = numeric_grad(|v| loss(&x64, &w64, v), &b64, 1e-4);
            want_db.iter_mut().for_each(|d| *d += 0.5);
            assert_close("dbias", &db, &want_db, 1e-4, 1e-5);
        }
    }

    #[test]
    fn matches_reference_and_finite_differences() {
        check(5, 8, 12, true);
        check(7, 33, 65, true);
        check(3, 16, 4, false);
    }

    #[test]
    fn backward_halves_equal_the_whole() {
        let (n, c, oc) = (9, 20, 14);
        let (x, w, g) = (rand_vec(n * c, 1), rand_vec(oc * c, 2), rand_vec(n * oc, 3));
        let (mut dx, mut dw, mut db) = (vec![0.0; n * c], rand_vec(oc * c, 4), vec![0.5; oc]);
        let (mut dx2, mut dw2, mut db2) = (vec![f32::NAN; n * c], dw.clone(), db.clone());
        let bias = vec![0.0; oc];
        let lin = portable(&w, &bias, c, oc);
        let grads = |dweight, dbias| LinearGrads { dweight, dbias };
        linear_backward::<false>(&mut dx, grads(&mut dw, &mut db), &g, &x, lin);
        linear_backward_params::<false>(lin.backend, grads(&mut dw2, &mut db2), &g, &x, c, oc);
        linear_backward_input::<false>(&mut dx2, &g, lin);
        assert_eq!((dx, dw, db), (dx2, dw2, db2));
    }

    #[test]
    fn large_product_matches_reference() {
        // Big enough that gemm packs and splits across threads.
        let (n, c, oc) = (96, 128, 200);
        let x = rand_vec(n * c, 7);
        let w = rand_vec(oc * c, 8);
        let b = rand_vec(oc, 9);
        let mut out = vec![0.0; n * oc];
        let lin = portable(&w, &b, c, oc);
        linear_forward::<false>(&mut out, &x, lin);
        let want = reference(&to_f64(&x), &to_f64(&w), &to_f64(&b), c, oc);
        assert_close("out", &out, &want, 1e-5, 1e-4);
    }

    #[test]
    fn bf16_operands_give_the_bf16_gemm_result() {
        // Products of bf16 values are exact in f32, so the f32 GEMM over bf16-rounded
        // operands differs from an exact bf16 GEMM with f32 accumulation only by the
        // f32 summation order. The reference sums the exact products in f64.
        use crate::kernels::bf16::round;
        let (n, c, oc) = (64, 96, 80);
        let r = |v: Vec<f32>| -> Vec<f32> { v.into_iter().map(round).collect() };
        let (x, w, g) = (
            r(rand_vec(n * c, 1)),
            r(rand_vec(oc * c, 2)),
            r(rand_vec(n * oc, 3)),
        );
        let mut out = vec![0.0; n * oc];
        let lin = portable(&w, &[], c, oc);
        linear_forward::<false>(&mut out, &x, lin);
        let want = reference(&to_f64(&x), &to_f64(&w), &[], c, oc);
        assert_close("out", &out, &want, 1e-6, 1e-6);
        let (mut dx, mut dw) = (vec![0.0; n * c], vec![0.0; oc * c]);
        let grads = LinearGrads {
            dweight: &mut dw,
            dbias: &mut [],
        };
        linear_backward::<false>(&mut dx, grads, &g, &x, lin);
        let (x64, w64, g64) = (to_f64(&x), to_f64(&w), to_f64(&g));
        let want_dx: Vec<f64> = (0..n * c)
            .map(|e| {
                (0..oc)
                    .map(|o| g64[e / c * oc + o] * w64[o * c + e % c])
                    .sum()
            })
            .collect();
        let want_dw: Vec<f64> = (0..oc * c)
            .map(|e| {
                (0..n)
                    .map(|i| g64[i * oc + e / c] * x64[i * c + e % c])
                    .sum()
            })
            .collect();
        assert_close("dinp", &dx, &want_dx, 1e-6, 1e-6);
        assert_close("dweight", &dw, &want_dw, 1e-6, 1e-6);
    }
}
