//! Token + position embedding (or the token embedding alone, where positions are
//! rotary and live in the attention).

use super::SharedMut;
use rayon::prelude::*;

/// `out[b,t,:] = wte[inp[b,t],:] + wpe[t,:]`, or `wte[inp[b,t],:]` with an empty `wpe`.
///
/// out: (B, T, C) written; inp: (B, T) token ids < Vp; wte: (Vp, C), f32 or (a bf16
/// decoder's copy) bf16, widened exactly; wpe: (≥T, C) or empty.
pub fn encoder_forward<E>(out: &mut [f32], inp: &[u32], wte: &[E], wpe: &[f32], t: usize, c: usize)
where
    E: Copy + Sync + Into<f32>,
{
    let _t = crate::profile::scope(crate::profile::Section::Encoder);
    assert_eq!(out.len(), inp.len() * c);
    out.par_chunks_mut(c).enumerate().for_each(|(row, o)| {
        let tok = inp[row] as usize;
        let e = &wte[tok * c..(tok + 1) * c];
        if wpe.is_empty() {
            return o.iter_mut().zip(e).for_each(|(o, &e)| *o = e.into());
        }
        let pos = row % t;
        let p = &wpe[pos * c..(pos + 1) * c];
        for ((o, &e), &p) in o.iter_mut().zip(e).zip(p) {
            *o = e.into() + p;
        }
    });
}

/// Accumulates `dwte[inp[b,t],:] += dout[b,t,:]` and `dwpe[t,:] += dout[b,t,:]` (no
/// position table where `dwpe` is empty).
///
/// Parallel over channel blocks, so rows that share a token never race.
pub fn encoder_backward(
    dwte: &mut [f32],
    dwpe: &mut [f32],
    dout: &[f32],
    inp: &[u32],
    t: usize,
    c: usize,
) {
    let _t = crate::profile::scope(crate::profile::Section::Encoder);
    assert_eq!(dout.len(), inp.len() * c);
    const BLOCK: usize = 64;
    let blocks = c.div_ceil(BLOCK);
    let (wte_len, wpe_len) = (dwte.len(), dwpe.len());
    let dwte_ptr = SharedMut::new(dwte);
    let dwpe_ptr = SharedMut::new(dwpe);
    (0..blocks).into_par_iter().for_each(|blk| {
        let lo = blk * BLOCK;
        let hi = (lo + BLOCK).min(c);
        for (row, &tok) in inp.iter().enumerate() {
            let (tok, pos) = (tok as usize, row % t);
            let d = &dout[row * c + lo..row * c + hi];
            if wpe_len == 0 {
                assert!((tok + 1) * c <= wte_len);
                // SAFETY: this task alone owns the channel columns [lo, hi) of dwte.
                let wte_row = unsafe { dwte_ptr.slice(tok * c + lo, hi - lo) };
                wte_row.iter_mut().zip(d).for_each(|(w, &g)| *w += g);
                continue;
            }
            assert!((tok + 1) * c <= wte_len && (pos + 1) * c <= wpe_len);
            // SAFETY: every task owns the channel columns [lo, hi) of both tables and
            // touches no other column, so no two tasks' slices overlap.
            let (wte_row, wpe_row) = unsafe {
                (
                    dwte_ptr.slice(tok * c + lo, hi - lo),
                    dwpe_ptr.slice(pos * c + lo, hi - lo),
                )
            };
            for ((w, p), &g) in wte_row.iter_mut().zip(wpe_row).zip(d) {
                *w += g;
                *p += g;
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::*;

    #[test]
    fn forward_adds_token_and_position_rows() {
        let (b, t, c, vp) = (2, 3, 4, 5);
        let wte = rand_vec(vp * c, 1);
        let wpe = rand_vec(t * c, 2);
        let inp = [4, 0, 4, 1, 2, 3];
        let mut out = vec![0.0; b * t * c];
        encoder_forward(&mut out, &inp, &wte, &wpe, t, c);
        for (row, &tok) in inp.iter().enumerate() {
            for ch in 0..c {
                let want = wte[tok as usize * c + ch] + wpe[(row % t) * c + ch];
                assert_eq!(out[row * c + ch], want);
            }
        }
    }

    /// A bf16 table gives its values widened exactly, with or without positions.
    #[test]
    fn a_bf16_table_reads_its_exact_values() {
        use crate::kernels::bf16::Bf16;
        let (t, c, vp) = (3, 5, 4);
        let wte16: Vec<Bf16> = rand_vec(vp * c, 4)
            .into_iter()
            .map(Bf16::from_f32)
            .collect();
        let wte: Vec<f32> = wte16.iter().map(|x| x.to_f32()).collect();
        let wpe = rand_vec(t * c, 5);
        let inp = [3u32, 1, 3, 0, 2, 2];
        for wpe in [&wpe[..], &[]] {
            let (mut got, mut want) = (vec![0.0; inp.len() * c], vec![1.0; inp.len() * c]);
            encoder_forward(&mut got, &inp, &wte16, wpe, t, c);
            encoder_forward(&mut want, &inp, &wte, wpe, t, c);
            assert_eq!(got, want, "positions: {}", !wpe.is_empty());
        }
    }

    #[test]
    fn backward_matches_finite_differences() {
        let (b, t, c, vp) = (2, 3, 70, 5);
        let wte = rand_vec(vp * c, 1);
        let wpe = rand_vec(t * c, 2);
        let inp = [4u32, 0, 4, 1, 4, 3];
        let w = rand_vec(b * t * c, 3);
        let loss = |wte: &[f64], wpe: &[f64]| -> f64 {
            let mut s = 0.0;
            for (row, &tok) in inp.iter().enumerate() {
                for ch in 0..c {
                    let x = wte[tok as usize * c + ch] + wpe[(row % t) * c + ch];
                    s += x * w[row * c + ch] as f64;
                }
            }
            s
        };
        let (wte64, wpe64) = (to_f64(&wte), to_f64(&wpe));
        let want_dwte = numeric_grad(|x| loss(x, &wpe64), &wte64, 1e-4);
        let want_dwpe = numeric_grad(|x| loss(&wte64, x), &wpe64, 1e-4);
        let mut dwte = vec![0.0; vp * c];
        let mut dwpe = vec![0.0; t * c];
        encoder_backward(&mut dwte, &mut dwpe, &w, &inp, t, c);
        assert_close("dwte", &dwte, &want_dwte, 1e-5, 1e-6);
        assert_close("dwpe", &dwpe, &want_dwpe, 1e-5, 1e-6);
        // Accumulates: a second call doubles the gradients.
        encoder_backward(&mut dwte, &mut dwpe, &w, &inp, t, c);
        let twice: Vec<f64> = want_dwte.iter().map(|g| 2.0 * g).collect();
        assert_close("dwte accumulated", &dwte, &twice, 1e-5, 1e-6);
    }
}
