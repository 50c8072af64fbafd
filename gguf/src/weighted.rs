//! The importance-weighted quantizers: ggml-quants.c's `quantize_row_*_impl` paths taken when
//! `llama-quantize --imatrix` supplies `quant_weights` (the imatrix's mean x² per input column), bit for bit.
//! Without weights llama.cpp uses the `_ref` quantizers ([`crate::ggml`]).

use crate::ggml::{check_finite, nearest_int, GgmlError, GgmlType, Result};
use half::f16;

const QK: usize = 32;

/// `make_qx_quants(n, nmax, x, L, rmse_type = 1, qw)`: the scale whose levels `L` (0..2·nmax−1) minimise
/// the qw-weighted error, searched over 19 candidate inverse scales around −nmax/max.
pub fn make_qx_quants(nmax: i32, x: &[f32], l_out: &mut [i8], qw: &[f32]) -> f32 {
    let (mut max, mut amax) = (0f32, 0f32);
    for &v in x {
        let ax = v.abs();
        if ax > amax {
            amax = ax;
            max = v;
        }
    }
    if amax < 1e-15 {
        l_out.fill(0);
        return 0.0;
    }
    let sums = |iscale: f32| {
        let (mut sumlx, mut suml2) = (0f32, 0f32);
        for (&v, &w) in x.iter().zip(qw) {
            let l = nearest_int(iscale * v).clamp(-nmax, nmax - 1) as f32;
            sumlx += w * v * l;
            suml2 += w * l * l;
        }
        (sumlx, suml2)
    };
    let levels = |iscale: f32, l_out: &mut [i8]| {
        for (o, &v) in l_out.iter_mut().zip(x) {
            *o = (nearest_int(iscale * v).clamp(-nmax, nmax - 1) + nmax) as i8;
        }
    };
    let iscale = -(nmax as f32) / max;
    levels(iscale, l_out);
    let (sumlx, suml2) = sums(iscale);
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9i32..=9 {
        if is == 0 {
            continue;
        }
        let iscale = -(nmax as f32 + 0.1f32 * is as f32) / max;
        let (sumlx, suml2) = sums(iscale);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            levels(iscale, l_out);
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// `quantize_row_q4_0_impl` on one row: each element weighted by qw·sqrt(σ² + x²) (σ² the row's mean
/// square), each block's scale from [`make_qx_quants`] with nmax 8.
pub fn q4_0_row(x: &[f32], qw: &[f32], out: &mut Vec<u8>) {
    let mut sum_x2 = 0f32;
    for &v in x {
        sum_x2 += v * v;
    }
    let sigma2 = sum_x2 / x.len() as f32;
    let (mut w, mut l) = ([0f32; QK], [0i8; QK]);
    for (xb, qb) in x.chunks_exact(QK).zip(qw.chunks_exact(QK)) {
        for j in 0..QK {
            w[j] = qb[j] * (sigma2 + xb[j] * xb[j]).sqrt();
        }
        let d = make_qx_quants(8, xb, &mut l, &w);
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        for j in 0..QK / 2 {
            out.push(l[j] as u8 | ((l[j + 16] as u8) << 4));
        }
    }
}

/// Rows of `row` values in type `t` with importance weights `qw` (one per column), as `ggml_quantize_chunk`
/// does with an imatrix: q4_0 through [`q4_0_row`]; q8_0 ignores the weights in ggml too.
pub fn encode_weighted_into(
    t: GgmlType,
    x: &[f32],
    row: usize,
    qw: &[f32],
    out: &mut Vec<u8>,
) -> Result<()> {
    use rayon::prelude::*;
    if qw.len() != row {
        return Err(GgmlError::RowLength {
            row: qw.len(),
            block: row,
        });
    }
    match t {
        GgmlType::Q4_0 => {
            if !row.is_multiple_of(QK) || !x.len().is_multiple_of(row) {
                return Err(GgmlError::RowLength { row, block: QK });
            }
            check_finite(x)?;
            let rb = t.bytes(row);
            out.clear();
            out.resize(t.bytes(x.len()), 0);
            x.par_chunks(row)
                .zip(out.par_chunks_mut(rb))
                .for_each(|(xr, o)| {
                    let mut v = Vec::with_capacity(rb);
                    q4_0_row(xr, qw, &mut v);
                    o.copy_from_slice(&v);
                });
            Ok(())
        }
        GgmlType::Q8_0 | GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
            crate::ggml::encode_into(t, x, row, out)
        }
        _ => Err(GgmlError::NoQuantizer(t.name())),
    }
}

#[cfg(test)]
mod tests {
    /// Uniform weights on a block: the weighted search can only do as well as or better than the
    /// reference's single scale at minimising the plain squared error it then weighs.
    #[test]
    fn weighted_q4_0_never_loses_to_the_reference_on_its_own_loss() {
        let x: Vec<f32> = (0..256)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0)
            .collect();
        let qw = vec![1.0f32; 256];
        let mut a = Vec::new();
        super::q4_0_row(&x, &qw, &mut a);
        let mut b = Vec::new();
        crate::ggml::quantize_q4_0(&x, &mut b).unwrap();
        let (da, db) = (
            crate::ggml::dequantize_q4_0(&a),
            crate::ggml::dequantize_q4_0(&b),
        );
        let sigma2: f32 = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
        let loss = |d: &[f32]| -> f64 {
            x.iter()
                .zip(d)
                .map(|(v, q)| ((sigma2 + v * v).sqrt() * (v - q) * (v - q)) as f64)
                .sum()
        };
        assert!(
            loss(&da) <= loss(&db) * 1.0001,
            "{} vs {}",
            loss(&da),
            loss(&db)
        );
    }
}
