//! GPTQ (Frantar et al. 2022, the reference `gptq.py::GPTQ.fasterquant`), onto a grid whose scales are
//! fixed beforehand: the per-channel, LPBQ-block or q4_0-group encodings hexq exports, so only the integers
//! change and every consumer of the encodings reads the result unchanged.
//!
//! As the reference: dead inputs (Σx² = 0) get H_ii = 1 and their weights 0; optional act-order (inputs by
//! descending H_ii, the grid still indexed by each input's own column: static groups); damping
//! `damp · mean(diag H)`; `U` = upper Cholesky factor of H⁻¹; columns rounded in blocks of `block`, each
//! column's error `(w − q) / U_ii` fed into the columns after it inside the block, the block's errors into
//! the rest at once. H is Σxxᵀ (the reference's `2/N Σxxᵀ` differs by a factor that cancels).

use super::linalg::gptq_hinv_transposed;
use hexq_calibrate::imatrix::Gram;
use rayon::prelude::*;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Options {
    /// Columns per lazy-update block (the reference's `blocksize`, 128).
    pub block: usize,
    /// Damping as a fraction of the mean of diag H (the reference's `percdamp`, 0.01).
    pub damp: f64,
    /// Round inputs in order of descending H_ii (the reference's `actorder`).
    pub act_order: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            block: 128,
            damp: 0.01,
            act_order: false,
        }
    }
}

/// The rounded weights, `[out, in]` like `w`: every value `grid(row, col, x)` of some `x`.
/// `grid` maps a value of weight row `row`, input column `col` to its dequantized grid point.
pub fn gptq(
    w: &[f32],
    inputs: usize,
    gram: &Gram,
    grid: &(dyn Fn(usize, usize, f32) -> f32 + Sync),
    o: &Options,
) -> Result<Vec<f32>, String> {
    let n = inputs;
    if gram.n != n || !w.len().is_multiple_of(n) {
        return Err(format!(
            "the input statistics are {0}×{0}, the weight has {n} inputs",
            gram.n
        ));
    }
    let rows = w.len() / n;
    let mut h = gram.h.clone();
    let dead: Vec<bool> = (0..n).map(|i| h[i * n + i] == 0.0).collect();
    for (i, _) in dead.iter().enumerate().filter(|(_, d)| **d) {
        h[i * n + i] = 1.0;
    }
    let mut perm: Vec<usize> = (0..n).collect();
    if o.act_order {
        perm.sort_by(|&a, &b| h[b * n + b].total_cmp(&h[a * n + a]).then(a.cmp(&b)));
    }
    let mut hp = vec![0.0f64; n * n];
    hp.par_chunks_mut(n).enumerate().for_each(|(i, r)| {
        for (j, x) in r.iter_mut().enumerate() {
            *x = h[perm[i] * n + perm[j]];
        }
    });
    let damp = o.damp * (0..n).map(|i| hp[i * n + i]).sum::<f64>() / n as f64;
    for i in 0..n {
        hp[i * n + i] += damp;
    }
    let ut = gptq_hinv_transposed(&hp, n)
        .ok_or("the input statistics are not positive definite even after damping")?;
    drop(hp);
    // Wt[i] = column perm[i] of w: one input's weights over every output row, contiguous.
    let mut wt = vec![0.0f64; n * rows];
    wt.par_chunks_mut(rows).enumerate().for_each(|(i, r)| {
        let c = perm[i];
        if !dead[c] {
            for (k, x) in r.iter_mut().enumerate() {
                *x = w[k * n + c] as f64;
            }
        }
    });
    let mut q = vec![0.0f32; n * rows];
    let b = o.block.max(1);
    let mut err = vec![0.0f64; b * rows];
    for i1 in (0..n).step_by(b) {
        let i2 = (i1 + b).min(n);
        for i in i1..i2 {
            let d = ut[i * n + i];
            let col = perm[i];
            let (qi, ei) = (
                &mut q[i * rows..][..rows],
                &mut err[(i - i1) * rows..][..rows],
            );
            for (k, (qk, ek)) in qi.iter_mut().zip(ei.iter_mut()).enumerate() {
                let x = wt[i * rows + k];
                *qk = grid(k, col, x as f32);
                *ek = (x - *qk as f64) / d;
            }
            let ei = &err[(i - i1) * rows..][..rows];
            let (_, after) = wt.split_at_mut((i + 1) * rows);
            after[..(i2 - i - 1) * rows]
                .par_chunks_mut(rows)
                .enumerate()
                .for_each(|(jj, r)| {
                    let u = ut[(i + 1 + jj) * n + i];
                    r.iter_mut().zip(ei).for_each(|(x, e)| *x -= u * e);
                });
        }
        let errs = &err[..(i2 - i1) * rows];
        wt[i2 * rows..]
            .par_chunks_mut(rows)
            .enumerate()
            .for_each(|(jj, r)| {
                let uj = &ut[(i2 + jj) * n + i1..(i2 + jj) * n + i2];
                for (u, e) in uj.iter().zip(errs.chunks(rows)) {
                    r.iter_mut().zip(e).for_each(|(x, e)| *x -= u * e);
                }
            });
    }
    let mut out = vec![0.0f32; rows * n];
    out.par_chunks_mut(n).enumerate().for_each(|(k, r)| {
        for i in 0..n {
            r[perm[i]] = q[i * rows + k];
        }
    });
    Ok(out)
}

/// `Σ_rows (w − q)ᵀ H (w − q)`: the output error of rounding `w` to `q` on the calibration inputs
/// (`‖X(w − q)‖²`), both `[out, in]`.
pub fn output_error(w: &[f32], q: &[f32], gram: &Gram) -> f64 {
    let n = gram.n;
    w.par_chunks(n)
        .zip(q.par_chunks(n))
        .map(|(a, b)| {
            let d: Vec<f64> = a.iter().zip(b).map(|(x, y)| (*x - *y) as f64).collect();
            (0..n)
                .map(|i| {
                    d[i] * gram.h[i * n..i * n + n]
                        .iter()
                        .zip(&d)
                        .map(|(h, y)| h * y)
                        .sum::<f64>()
                })
                .sum::<f64>()
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn case(rows: usize, n: usize, t: usize) -> (Vec<f32>, Gram) {
        let r = |i: usize, m: usize| ((i * 2654435761usize % m) as f32 / m as f32) - 0.5;
        let w: Vec<f32> = (0..rows * n).map(|i| r(i, 1009)).collect();
        // Correlated inputs: x = base + a shared component, so H has strong off-diagonal terms.
        let x: Vec<f64> = (0..t * n)
            .map(|i| (r(i, 997) + 0.8 * r(i / n, 991) * (1.0 + (i % n) as f32 / n as f32)) as f64)
            .collect();
        let mut h = vec![0.0; n * n];
        for s in 0..t {
            for i in 0..n {
                for j in 0..n {
                    h[i * n + j] += x[s * n + i] * x[s * n + j];
                }
            }
        }
        (
            w,
            Gram {
                n,
                h,
                rows: t as u64,
            },
        )
    }

    #[test]
    fn gptq_stays_on_the_grid_and_beats_round_to_nearest() {
        let (rows, n) = (24, 64);
        let (w, g) = case(rows, n, 200);
        let s = 0.5 / 7.0;
        let grid = |_: usize, _: usize, x: f32| (x / s).round().clamp(-8.0, 7.0) * s;
        let rtn: Vec<f32> = w.iter().map(|&x| grid(0, 0, x)).collect();
        for act_order in [false, true] {
            for block in [128, 16, 5] {
                let o = Options {
                    block,
                    act_order,
                    ..Default::default()
                };
                let q = gptq(&w, n, &g, &grid, &o).unwrap();
                assert!(q.iter().all(|&v| grid(0, 0, v) == v), "on the grid");
                let (eg, er) = (output_error(&w, &q, &g), output_error(&w, &rtn, &g));
                assert!(
                    eg < 0.8 * er,
                    "act_order {act_order} block {block}: gptq {eg} vs rtn {er}"
                );
            }
        }
        // The block size only changes the order of float operations, not the algorithm.
        let a = gptq(
            &w,
            n,
            &g,
            &grid,
            &Options {
                block: 128,
                ..Default::default()
            },
        )
        .unwrap();
        let b = gptq(
            &w,
            n,
            &g,
            &grid,
            &Options {
                block: 7,
                ..Default::default()
            },
        )
        .unwrap();
        let same = a.iter().zip(&b).filter(|(x, y)| x == y).count();
        assert!(same as f64 > 0.99 * a.len() as f64, "{same} of {}", a.len());
    }
}
