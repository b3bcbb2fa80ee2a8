//! Residual connections: `x = x + branch(x)`. Backward needs no kernel: the
//! residual stream's gradient reaches both summands unchanged, and the branch's
//! contribution is accumulated into it by the layer norm's backward.

use rayon::prelude::*;

const CHUNK: usize = 4096;

/// `x += y`, in place: the residual add done where the branch output already sits.
pub fn residual_add_inplace(x: &mut [f32], y: &[f32]) {
    let _t = crate::profile::scope(crate::profile::Section::Residual);
    assert_eq!(x.len(), y.len());
    x.par_chunks_mut(CHUNK)
        .zip(y.par_chunks(CHUNK))
        .for_each(|(x, y)| x.iter_mut().zip(y).for_each(|(x, &y)| *x += y));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::*;

    #[test]
    fn adds_in_place() {
        let (a, b) = (rand_vec(10_000, 1), rand_vec(10_000, 2));
        let mut x = a.clone();
        residual_add_inplace(&mut x, &b);
        assert!(x
            .iter()
            .zip(a.iter().zip(&b))
            .all(|(&x, (&a, &b))| x == a + b));
    }
}
