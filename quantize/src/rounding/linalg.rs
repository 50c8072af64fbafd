//! The two factorizations GPTQ needs, in f64 on row-major `n × n` matrices: small exact routines (the
//! matrices are one layer's input width, ≤ 2^14) instead of a linear-algebra dependency.

use rayon::prelude::*;

/// Upper-triangular `V` with `H = V Vᵀ` (Cholesky taken from the last index backwards); `None` if `H` is
/// not positive definite. Row `i` of `V` is nonzero from column `i` on.
pub fn cholesky_upper_rev(h: &[f64], n: usize) -> Option<Vec<f64>> {
    let mut v = vec![0.0f64; n * n];
    for j in (0..n).rev() {
        let tail = |r: &[f64]| -> f64 { r[j + 1..n].iter().map(|x| x * x).sum() };
        let d = h[j * n + j] - tail(&v[j * n..j * n + n]);
        if d.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) {
            return None;
        }
        let d = d.sqrt();
        v[j * n + j] = d;
        let (head, rest) = v.split_at_mut(j * n);
        let vj = &rest[..n];
        head.par_chunks_mut(n).enumerate().for_each(|(i, vi)| {
            let dot: f64 = vi[j + 1..n]
                .iter()
                .zip(&vj[j + 1..n])
                .map(|(a, b)| a * b)
                .sum();
            vi[j] = (h[i * n + j] - dot) / d;
        });
    }
    Some(v)
}

/// `Uᵀ` (lower) for `U = V⁻¹` of an upper-triangular `V`: row `c` of the result is column `c` of `U`.
pub fn inverse_upper_transposed(v: &[f64], n: usize) -> Vec<f64> {
    let mut ut = vec![0.0f64; n * n];
    ut.par_chunks_mut(n).enumerate().for_each(|(c, col)| {
        // Back substitution of V·u = e_c: u_c = 1/V_cc, u_i = −(Σ_{k=i+1..=c} V_ik u_k) / V_ii.
        col[c] = 1.0 / v[c * n + c];
        for i in (0..c).rev() {
            let s: f64 = v[i * n + i + 1..i * n + c + 1]
                .iter()
                .zip(&col[i + 1..c + 1])
                .map(|(a, b)| a * b)
                .sum();
            col[i] = -s / v[i * n + i];
        }
    });
    ut
}

/// GPTQ's `Hinv`: the upper Cholesky factor `U` of `H⁻¹` (`H⁻¹ = UᵀU`; torch's
/// `cholesky(cholesky_inverse(cholesky(H)), upper=True)`), returned transposed (row `j` = column `j` of `U`).
/// From `H = V Vᵀ` with `V` upper: `H⁻¹ = V⁻ᵀ V⁻¹`, so `U = V⁻¹`.
pub fn gptq_hinv_transposed(h: &[f64], n: usize) -> Option<Vec<f64>> {
    cholesky_upper_rev(h, n).map(|v| inverse_upper_transposed(&v, n))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hinv_factor_times_h_is_identity() {
        let n = 37;
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
        let ut = gptq_hinv_transposed(&h, n).unwrap();
        let u = |i: usize, j: usize| ut[j * n + i];
        for i in 0..n {
            for j in 0..i {
                assert_eq!(u(i, j), 0.0, "U is upper triangular");
            }
        }
        // (UᵀU)·H = I.
        for i in 0..n {
            for j in 0..n {
                let mut s = 0.0;
                for k in 0..n {
                    let hinv_ik: f64 = (0..n).map(|m| u(m, i) * u(m, k)).sum();
                    s += hinv_ik * h[k * n + j];
                }
                let want = if i == j { 1.0 } else { 0.0 };
                assert!((s - want).abs() < 1e-9, "({i},{j}) = {s}");
            }
        }
        assert!(cholesky_upper_rev(&[0.0; 4], 2).is_none());
    }
}
