//! Residual connections: `out = a + b`.

use rayon::prelude::*;

const CHUNK: usize = 4096;

/// `out = a + b`; any shape.
pub fn residual_forward(out: &mut [f32], a: &[f32], b: &[f32]) {
    let _t = crate::profile::scope(crate::profile::Section::Residual);
    assert!(out.len() == a.len() && a.len() == b.len());
    out.par_chunks_mut(CHUNK)
        .zip(a.par_chunks(CHUNK).zip(b.par_chunks(CHUNK)))
        .for_each(|(o, (a, b))| {
            for ((o, &a), &b) in o.iter_mut().zip(a).zip(b) {
                *o = a + b;
            }
        });
}

/// `x += y`, in place: the residual add done where the branch output already sits.
pub fn residual_add_inplace(x: &mut [f32], y: &[f32]) {
    let _t = crate::profile::scope(crate::profile::Section::Residual);
    assert_eq!(x.len(), y.len());
    x.par_chunks_mut(CHUNK)
        .zip(y.par_chunks(CHUNK))
        .for_each(|(x, y)| x.iter_mut().zip(y).for_each(|(x, &y)| *x += y));
}

/// Backward of `out = a + b`: both inputs receive `dout`, **accumulated**.
pub fn residual_backward(da: &mut [f32], db: &mut [f32], dout: &[f32]) {
    residual_add_inplace(da, dout);
    residual_add_inplace(db, dout);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::*;

    #[test]
    fn forward_and_backward() {
        let a = rand_vec(10_000, 1);
        let b = rand_vec(10_000, 2);
        let mut out = vec![0.0; a.len()];
        residual_forward(&mut out, &a, &b);
        assert!(out
            .iter()
            .zip(a.iter().zip(&b))
            .all(|(&o, (&a, &b))| o == a + b));
        let mut x = a.clone();
        residual_add_inplace(&mut x, &b);
        assert_eq!(x, out);
        let dout = rand_vec(10_000, 3);
        let (mut da, mut db) = (vec![1.0; a.len()], vec![0.0; a.len()]);
        residual_backward(&mut da, &mut db, &dout);
        assert!(da.iter().zip(&dout).all(|(&d, &g)| d == 1.0 + g));
        assert_eq!(db, dout);
    }
}
