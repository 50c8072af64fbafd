//! GPTQ (Frantar et al. 2022, the reference `gptq.py::GPTQ.fasterquant`), onto a grid whose scales are
//! fixed beforehand: the per-channel, LPBQ-block or q4_0-group encodings hexq exports, so only the integers
//! change and every consumer of the encodings reads the result unchanged.
//!
//! As the reference: dead inputs (Σx² = 0) get H_ii = 1 and their weights 0; optional act-order (inputs by
//! descending H_ii, the grid still indexed by each input's own column: static groups); damping
//! `damp · mean(diag H)`; `U` = upper Cholesky factor of H⁻¹; columns rounded in blocks of `block`, each
//! column's error `(w − q) / U_ii` fed into the columns after it inside the block, the block's errors into
//! the rest at once. H is Σxxᵀ (the reference's `2/N Σxxᵀ` differs by a factor that cancels).

use super::linalg::{cholesky_upper_rev, dots, transpose_in_place};
use hexq_calibrate::imatrix::Gram;
use rayon::prelude::*;
use std::sync::Arc;

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

/// GPTQ's factor of one Gram matrix: the input order, which inputs are dead, and `Vᵀ` for the damped,
/// permuted `H = V Vᵀ` (`V` upper). Weights that share an input (q, k, v; gate, up) share it.
pub struct Factor {
    n: usize,
    perm: Vec<usize>,
    dead: Vec<bool>,
    /// Row `j` = column `j` of `V`: nonzero on `0..=j`.
    vt: Vec<f64>,
}

impl Factor {
    pub fn new(gram: &Gram, o: &Options) -> Result<Factor, String> {
        let n = gram.n;
        let dead: Vec<bool> = (0..n).map(|i| gram.diag(i) == 0.0).collect();
        let diag = |i: usize| if dead[i] { 1.0 } else { gram.diag(i) };
        let mut perm: Vec<usize> = (0..n).collect();
        if o.act_order {
            perm.sort_by(|&a, &b| diag(b).total_cmp(&diag(a)).then(a.cmp(&b)));
        }
        let mut hp = vec![0.0f64; n * n];
        hp.par_chunks_mut(n).enumerate().for_each(|(i, r)| {
            for (j, x) in r.iter_mut().enumerate() {
                *x = if i == j {
                    diag(perm[i])
                } else {
                    gram.get(perm[i], perm[j])
                };
            }
        });
        let damp = o.damp * (0..n).map(|i| hp[i * n + i]).sum::<f64>() / n as f64;
        for i in 0..n {
            hp[i * n + i] += damp;
        }
        if !cholesky_upper_rev(&mut hp, n) {
            return Err("the input statistics are not positive definite even after damping".into());
        }
        transpose_in_place(&mut hp, n);
        Ok(Factor {
            n,
            perm,
            dead,
            vt: hp,
        })
    }
}

/// Factors by Gram matrix (the same `Arc` for weights that share an input), made once each.
#[derive(Default)]
pub struct Factors {
    map: std::sync::Mutex<Vec<(Arc<Gram>, Arc<Factor>)>>,
}

impl Factors {
    /// The factor of `g` under `o`, from the cache when `g` was seen (the options are the same for a
    /// cache's life: one cache per run).
    pub fn get(&self, g: &Arc<Gram>, o: &Options) -> Result<Arc<Factor>, String> {
        if let Some((_, f)) = self
            .map
            .lock()
            .unwrap()
            .iter()
            .find(|(k, _)| Arc::ptr_eq(k, g))
        {
            return Ok(f.clone());
        }
        let f = Arc::new(Factor::new(g, o)?);
        self.map.lock().unwrap().push((g.clone(), f.clone()));
        Ok(f)
    }
    /// Forget every factor (their memory is a Gram's again).
    pub fn clear(&self) {
        self.map.lock().unwrap().clear();
    }
}

/// The rounded weights, `[out, in]` like `w`: every value `grid(row, col, x)` of some `x`.
/// `grid` maps a value of weight row `row`, input column `col` to its dequantized grid point.
///
/// In the form that needs no inverse (GPTQ is Babai's nearest-plane rounding on `H = V Vᵀ`; Chen et al.
/// 2025): with `d = w − q` on the inputs already rounded, input `j` takes
/// `q_j = grid(w_j + Σ_{i<j} V_ij d_i / V_jj)`, which is exactly the reference's `w_j` after its error
/// feedback through `U = V⁻¹` (the upper factor of `H⁻¹`). Rows are independent; the sums over inputs
/// before each block of `block` run as one tiled product, the rest inside the block.
pub fn gptq(
    w: &[f32],
    f: &Factor,
    grid: &(dyn Fn(usize, usize, f32) -> f32 + Sync),
    o: &Options,
) -> Result<Vec<f32>, String> {
    let n = f.n;
    if !w.len().is_multiple_of(n) {
        return Err(format!(
            "the input statistics are {n}×{n}, the weight is not a multiple of {n} wide"
        ));
    }
    let rows = w.len() / n;
    let (perm, vt) = (&f.perm, &f.vt);
    let b = o.block.max(1);
    // Row k of the weight in the factor's input order (dead inputs 0, as the reference), f64.
    let wp: Vec<f64> = (0..rows * n)
        .into_par_iter()
        .map(|x| {
            let c = perm[x % n];
            if f.dead[c] {
                0.0
            } else {
                w[x / n * n + c] as f64
            }
        })
        .collect();
    let mut d = vec![0.0f64; rows * n];
    let mut q = vec![0.0f32; rows * n];
    // Rows in tiles: each tile's rows go through every block in order.
    const RT: usize = 32;
    d.par_chunks_mut(RT * n)
        .zip(q.par_chunks_mut(RT * n))
        .enumerate()
        .for_each(|(t, (dt, qt))| {
            let r = dt.len() / n;
            let mut acc = vec![0.0f64; b * r];
            for i1 in (0..n).step_by(b) {
                let i2 = (i1 + b).min(n);
                acc.iter_mut().for_each(|x| *x = 0.0);
                if i1 > 0 {
                    // acc[j][k] = Σ_{i<i1} V_ij d_ki, in chunks of CH inputs (a fixed order).
                    const CH: usize = 256;
                    for p0 in (0..i1).step_by(CH) {
                        let p1 = (p0 + CH).min(i1);
                        let dr = &*dt;
                        dots(
                            i2 - i1,
                            &|j| &vt[(i1 + j) * n + p0..(i1 + j) * n + p1],
                            r,
                            &|k| &dr[k * n + p0..k * n + p1],
                            &mut |j, k, v| acc[j * r + k] += v,
                        );
                    }
                }
                for k in 0..r {
                    let row = t * RT + k;
                    for j in i1..i2 {
                        let vj = &vt[j * n..j * n + j + 1];
                        let dk = &dt[k * n..k * n + j];
                        let inner: f64 = vj[i1..j].iter().zip(&dk[i1..j]).map(|(a, b)| a * b).sum();
                        let x = wp[row * n + j] + (acc[(j - i1) * r + k] + inner) / vj[j];
                        let g = grid(row, perm[j], x as f32);
                        dt[k * n + j] = wp[row * n + j] - g as f64;
                        qt[k * n + j] = g;
                    }
                }
            }
        });
    let mut out = vec![0.0f32; rows * n];
    out.par_chunks_mut(n).enumerate().for_each(|(k, r)| {
        for i in 0..n {
            r[perm[i]] = q[k * n + i];
        }
    });
    Ok(out)
}

/// [`gptq`] of one weight with its own factor of `gram` (`inputs` wide).
pub fn gptq_gram(
    w: &[f32],
    inputs: usize,
    gram: &Gram,
    grid: &(dyn Fn(usize, usize, f32) -> f32 + Sync),
    o: &Options,
) -> Result<Vec<f32>, String> {
    if gram.n != inputs {
        return Err(format!(
            "the input statistics are {0}×{0}, the weight has {inputs} inputs",
            gram.n
        ));
    }
    gptq(w, &Factor::new(gram, o)?, grid, o)
}

/// `Σ_rows (w − q)ᵀ H (w − q)`: the output error of rounding `w` to `q` on the calibration inputs
/// (`‖X(w − q)‖²`), both `[out, in]`.
pub fn output_error(w: &[f32], q: &[f32], gram: &Gram) -> f64 {
    let n = gram.n;
    w.par_chunks(n)
        .zip(q.par_chunks(n))
        .map(|(a, b)| {
            let d: Vec<f64> = a.iter().zip(b).map(|(x, y)| (*x - *y) as f64).collect();
            // dᵀHd over the upper triangle: the diagonal once, the rest twice.
            (0..n)
                .map(|i| {
                    let r = gram.upper_row(i);
                    let off: f64 = r[1..].iter().zip(&d[i + 1..]).map(|(h, y)| h * y).sum();
                    d[i] * (r[0] * d[i] + 2.0 * off)
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
        (w, Gram::from_full(n, &h, t as u64))
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
                let q = gptq_gram(&w, n, &g, &grid, &o).unwrap();
                assert!(q.iter().all(|&v| grid(0, 0, v) == v), "on the grid");
                let (eg, er) = (output_error(&w, &q, &g), output_error(&w, &rtn, &g));
                assert!(
                    eg < 0.8 * er,
                    "act_order {act_order} block {block}: gptq {eg} vs rtn {er}"
                );
            }
        }
        // The block size only changes the order of float operations, not the algorithm.
        let a = gptq_gram(
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
        let b = gptq_gram(
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
