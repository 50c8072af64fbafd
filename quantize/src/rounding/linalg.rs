//! The factorization GPTQ needs, in f64 on row-major `n × n` matrices (one layer's input width, ≤ 2^14):
//! a blocked Cholesky whose products run through one tiled dot kernel.
//!
//! Why by hand rather than a linear-algebra crate: every value here decides which integer a weight gets,
//! and hexq promises the same bytes on any machine. The kernel keeps one fixed order of additions and no
//! fused multiply-add, so an AVX2 machine, an AVX-512 one and the baseline build (and aarch64) give the
//! same bits; the AVX2 path only vectorizes lanes whose sequence of operations is already fixed.

use rayon::prelude::*;

/// Lanes of one accumulator: four independent sums, each adding in the order of its own indices.
const L: usize = 4;

/// `out[r][s] = Σ_p a[r][p] · b[s][p]` for two rows of `a` and four of `b` over the same length: the
/// register tile every product here is made of. The sum runs lane-wise over `p` in steps of 4, then the
/// lanes `(l0 + l1) + (l2 + l3)`, then the tail in order.
#[inline(always)]
fn tile_2x4(a: [&[f64]; 2], b: [&[f64]; 4]) -> [[f64; 4]; 2] {
    let len = a[0].len();
    let mut acc = [[[0.0f64; L]; 4]; 2];
    let full = len / L * L;
    let mut p = 0;
    while p < full {
        for (r, ar) in a.iter().enumerate() {
            let x: [f64; L] = ar[p..p + L].try_into().unwrap();
            for (s, bs) in b.iter().enumerate() {
                let y: [f64; L] = bs[p..p + L].try_into().unwrap();
                for l in 0..L {
                    acc[r][s][l] += x[l] * y[l];
                }
            }
        }
        p += L;
    }
    let mut out = [[0.0f64; 4]; 2];
    for r in 0..2 {
        for s in 0..4 {
            let v = &acc[r][s];
            let mut t = (v[0] + v[1]) + (v[2] + v[3]);
            for q in full..len {
                t += a[r][q] * b[s][q];
            }
            out[r][s] = t;
        }
    }
    out
}

/// [`tile_2x4`] in AVX2 registers, one `__m256d` per lane group: `mul` then `add`, as the portable loop.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn tile_2x4_avx2(a: [&[f64]; 2], b: [&[f64]; 4]) -> [[f64; 4]; 2] {
    use std::arch::x86_64::*;
    let len = a[0].len();
    assert!(a.iter().chain(b.iter()).all(|r| r.len() == len));
    let full = len / L * L;
    let mut acc = [[_mm256_setzero_pd(); 4]; 2];
    let (pa, pb) = (a.map(|r| r.as_ptr()), b.map(|r| r.as_ptr()));
    let mut p = 0;
    while p < full {
        // SAFETY: p + 4 <= len for every row (checked above).
        let x = [_mm256_loadu_pd(pa[0].add(p)), _mm256_loadu_pd(pa[1].add(p))];
        for s in 0..4 {
            let y = _mm256_loadu_pd(pb[s].add(p));
            acc[0][s] = _mm256_add_pd(acc[0][s], _mm256_mul_pd(x[0], y));
            acc[1][s] = _mm256_add_pd(acc[1][s], _mm256_mul_pd(x[1], y));
        }
        p += L;
    }
    let mut out = [[0.0f64; 4]; 2];
    for r in 0..2 {
        for s in 0..4 {
            let mut v = [0.0f64; L];
            _mm256_storeu_pd(v.as_mut_ptr(), acc[r][s]);
            let mut t = (v[0] + v[1]) + (v[2] + v[3]);
            for q in full..len {
                t += a[r][q] * b[s][q];
            }
            out[r][s] = t;
        }
    }
    out
}

/// The tile, on the widest vectors the machine has (the same bits on every path: no FMA, fixed order).
fn tile(a: [&[f64]; 2], b: [&[f64]; 4]) -> [[f64; 4]; 2] {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2, checked just above.
        return unsafe { tile_2x4_avx2(a, b) };
    }
    tile_2x4(a, b)
}

/// `out[r][s] = Σ_p a_r[p] · b_s[p]` for every `r < ra`, `s < sb`, where `a_r = a(r)`, `b_s = b(s)` are
/// equally long slices: tiles of 2 × 4, the edges padded with the first row (results dropped).
pub fn dots<'a>(
    ra: usize,
    a: &(dyn Fn(usize) -> &'a [f64] + Sync),
    sb: usize,
    b: &(dyn Fn(usize) -> &'a [f64] + Sync),
    out: &mut dyn FnMut(usize, usize, f64),
) {
    for r0 in (0..ra).step_by(2) {
        let ar = [a(r0), a((r0 + 1).min(ra - 1))];
        for s0 in (0..sb).step_by(4) {
            let bs = [0, 1, 2, 3].map(|k| b((s0 + k).min(sb - 1)));
            let t = tile(ar, bs);
            for (dr, row) in t.iter().enumerate().take(ra - r0) {
                for (ds, v) in row.iter().enumerate().take(sb - s0) {
                    out(r0 + dr, s0 + ds, *v);
                }
            }
        }
    }
}

/// Rows of a block of the factorization: the panel width and the row tile of the trailing update.
const NB: usize = 128;
const TILE: usize = 64;

/// Upper-triangular `V` with `H = V Vᵀ` (Cholesky taken from the last index backwards), in place of `h`;
/// `false` if `H` is not positive definite. Row `i` of `V` is nonzero from column `i` on.
///
/// Blocked from the bottom-right corner: factor the diagonal block, solve the panel above it, subtract
/// the panel's products from the rows and columns not yet factored (upper triangle only), move up a block.
pub fn cholesky_upper_rev(h: &mut [f64], n: usize) -> bool {
    let blocks = n.div_ceil(NB);
    for kb in (0..blocks).rev() {
        let (k0, k1) = (kb * NB, ((kb + 1) * NB).min(n));
        let w = k1 - k0;
        // The diagonal block, unblocked (it has every update from the blocks after it).
        let mut d = vec![0.0f64; w * w];
        for i in 0..w {
            d[i * w..i * w + w].copy_from_slice(&h[(k0 + i) * n + k0..(k0 + i) * n + k1]);
        }
        for j in (0..w).rev() {
            let tail: f64 = d[j * w + j + 1..j * w + w].iter().map(|x| x * x).sum();
            let piv = d[j * w + j] - tail;
            if piv.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) {
                return false;
            }
            let piv = piv.sqrt();
            d[j * w + j] = piv;
            for i in 0..j {
                let dot: f64 = (j + 1..w).map(|q| d[i * w + q] * d[j * w + q]).sum();
                d[i * w + j] = (d[i * w + j] - dot) / piv;
            }
        }
        for i in 0..w {
            h[(k0 + i) * n + k0..(k0 + i) * n + k1].copy_from_slice(&d[i * w..i * w + w]);
        }
        if k0 == 0 {
            break;
        }
        // The panel above: row i solves x · V_kkᵀ = h[i][k0..k1] by back substitution.
        h[..k0 * n].par_chunks_mut(n).for_each(|row| {
            let x = &mut row[k0..k1];
            for j in (0..w).rev() {
                let dot: f64 = (j + 1..w).map(|q| x[q] * d[j * w + q]).sum();
                x[j] = (x[j] - dot) / d[j * w + j];
            }
        });
        // The trailing update h[i][j] -= panel_i · panel_j for i ≤ j < k0, in tiles of TILE rows.
        let panel: Vec<f64> = (0..k0)
            .flat_map(|i| h[i * n + k0..i * n + k1].iter().copied())
            .collect();
        let pr = |i: usize| &panel[i * w..i * w + w];
        h[..k0 * n]
            .par_chunks_mut(TILE * n)
            .enumerate()
            .for_each(|(ti, rows)| {
                let i0 = ti * TILE;
                let ri = rows.len() / n;
                for j0 in (i0..k0).step_by(TILE) {
                    let rj = TILE.min(k0 - j0);
                    dots(ri, &|r| pr(i0 + r), rj, &|s| pr(j0 + s), &mut |r, s, v| {
                        if j0 + s >= i0 + r {
                            rows[r * n + j0 + s] -= v;
                        }
                    });
                }
            });
    }
    // The strict lower triangle held H; V is upper.
    h.par_chunks_mut(n).enumerate().for_each(|(i, r)| {
        r[..i].iter_mut().for_each(|x| *x = 0.0);
    });
    true
}

/// Transpose a row-major `n × n` matrix in place, tile by tile (no second n² buffer: at E2B's widest
/// input that is 1.2 GB).
pub fn transpose_in_place(v: &mut [f64], n: usize) {
    for i0 in (0..n).step_by(TILE) {
        for j0 in (i0..n).step_by(TILE) {
            for i in i0..(i0 + TILE).min(n) {
                for j in j0.max(i + 1)..(j0 + TILE).min(n) {
                    v.swap(i * n + j, j * n + i);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spd(n: usize) -> Vec<f64> {
        // H = AᵀA + I: symmetric positive definite.
        let a: Vec<f64> = (0..n * n)
            .map(|i| ((i * 7919 % 113) as f64 / 113.0) - 0.5)
            .collect();
        let mut h = vec![0.0; n * n];
        for i in 0..n {
            for j in 0..n {
                h[i * n + j] = (0..n).map(|k| a[k * n + i] * a[k * n + j]).sum::<f64>()
                    + if i == j { 1.0 } else { 0.0 };
            }
        }
        h
    }

    #[test]
    fn blocked_factor_times_its_transpose_is_h() {
        // Sizes across the block edges: inside one block, one past it, several blocks and a ragged tail.
        for n in [37, 129, 300] {
            let h = spd(n);
            let mut v = h.clone();
            assert!(cholesky_upper_rev(&mut v, n));
            for i in 0..n {
                for j in 0..i {
                    assert_eq!(v[i * n + j], 0.0, "V is upper triangular");
                }
            }
            let scale = h.iter().fold(0f64, |m, x| m.max(x.abs()));
            for i in 0..n {
                for j in 0..n {
                    let s: f64 = (0..n).map(|k| v[i * n + k] * v[j * n + k]).sum();
                    assert!((s - h[i * n + j]).abs() < 1e-10 * scale, "n {n} ({i},{j})");
                }
            }
            let mut t = v.clone();
            transpose_in_place(&mut t, n);
            assert!((0..n * n).all(|k| t[k] == v[(k % n) * n + k / n]));
        }
        assert!(!cholesky_upper_rev(&mut [0.0; 4], 2));
    }

    #[test]
    fn the_tile_is_the_same_on_every_path() {
        let r: Vec<f64> = (0..6 * 203).map(|i| ((i * 31 % 97) as f64).sin()).collect();
        let row = |i: usize| &r[i * 203..i * 203 + 203];
        let a = [row(0), row(1)];
        let b = [row(2), row(3), row(4), row(5)];
        let want = tile_2x4(a, b);
        assert_eq!(
            tile(a, b),
            want,
            "the dispatched kernel gives the portable bits"
        );
        for (i, ai) in a.iter().enumerate() {
            for (s, bs) in b.iter().enumerate() {
                let naive: f64 = ai.iter().zip(*bs).map(|(x, y)| x * y).sum();
                assert!((naive - want[i][s]).abs() < 1e-12 * naive.abs().max(1.0));
            }
        }
    }
}
