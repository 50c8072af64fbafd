//! onnxruntime's CPU Softmax (MLAS, the last axis) for one row, bit for bit on the machine it runs on:
//! row maximum; `e = exp(x − max)` by MLAS's polynomial (`MlasComputeSumExpF32KernelFma3`); the row sum in
//! MLAS's lanes; then `e · (1/sum)`. libm's exp and a division put 87 % of attention probabilities 1 ulp off
//! onnxruntime's, and each one near a 16-bit grid boundary flipped a quantization step in the exported graph.
//! Masked entries (x − max ≤ −88.38) give ~6e-39, not 0: a padded ring adds nothing a sum of order 1 can
//! hold, so rows still sum to the same bits whatever the ring length.

// The constants are MLAS's literals as its sources spell them (more digits than f32 holds): kept verbatim.
#![allow(clippy::excessive_precision, clippy::approx_constant)]

/// One row of onnxruntime's CPU Softmax over the last axis (the interpreter's `Softmax`).
///
/// onnxruntime picks its softmax kernel by the CPU, and so does this: on AVX-512F machines its sum of exps
/// runs in 16 lanes, else in 8 (the same exp either way: the polynomial by FMAs, 2^m built in the float's
/// bits) — so the exported graph's Softmax in onnxruntime on the same machine gives the same bits
/// (tests/judges/mlas_order.py; on a Zen 5 the 8-lane sum put 1695 of 3072 values 1 ulp or more off).
pub fn softmax_row(row: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") {
        // SAFETY: the features were just checked.
        return unsafe { softmax_row_avx512(row, out) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: the features were just checked.
        return unsafe { softmax_row_fma(row, out) };
    }
    softmax_row_with::<8>(row, out, f32::mul_add)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn softmax_row_fma(row: &[f32], out: &mut [f32]) {
    use std::arch::x86_64::*;
    softmax_row_with::<8>(row, out, |a, b, c| {
        _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(a), _mm_set_ss(b), _mm_set_ss(c)))
    })
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn softmax_row_avx512(row: &[f32], out: &mut [f32]) {
    use std::arch::x86_64::*;
    softmax_row_with::<16>(row, out, |a, b, c| {
        _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(a), _mm_set_ss(b), _mm_set_ss(c)))
    })
}

/// MLAS's `MlasExpConstants` (the sum-of-exp kernel's subset): lower clamp, rounding bias 1.5·2²³, 1/ln 2,
/// ln 2 split high/low, the polynomial (poly_5 = poly_6 = 1).
const EXP_LOWER: f32 = -88.3762626647949;
const EXP_BIAS: f32 = 12582912.0;
const EXP_LOG2_RECIP: f32 = 1.44269504088896341;
const EXP_LOG2_HIGH: f32 = -6.93145752e-1;
const EXP_LOG2_LOW: f32 = -1.42860677e-6;
const EXP_POLY: [f32; 6] = [
    f32::from_bits(0x3ab4a000), // 0x1.694000p-10
    f32::from_bits(0x3c092f6e), // 0x1.125edcp-7
    f32::from_bits(0x3d2aadad), // 0x1.555b5ap-5
    f32::from_bits(0x3e2aaa28), // 0x1.555450p-3
    f32::from_bits(0x3efffffb), // 0x1.fffff6p-2
    1.0,
];

/// MLAS's softmax over one row with the sum of exps in `L` lanes (element i into lane i mod L, in order), the
/// lanes folded as its kernels fold them: 16 → 8 by lane l + lane l+8, then ((0+1)+(2+3)) + ((4+5)+(6+7)).
#[inline(always)]
fn softmax_row_with<const L: usize>(
    row: &[f32],
    out: &mut [f32],
    fma: impl Fn(f32, f32, f32) -> f32,
) {
    let max = row.iter().copied().fold(f32::MIN, f32::max);
    let neg = -max;
    let mut lanes = [0f32; L];
    for (i, (&v, o)) in row.iter().zip(out.iter_mut()).enumerate() {
        let x = (v + neg).max(EXP_LOWER);
        let biased = fma(x, EXP_LOG2_RECIP, EXP_BIAS);
        let m = biased - EXP_BIAS;
        let x = fma(m, EXP_LOG2_HIGH, x);
        let x = fma(m, EXP_LOG2_LOW, x);
        let mut p = fma(EXP_POLY[0], x, EXP_POLY[1]);
        for &c in &EXP_POLY[2..] {
            p = fma(p, x, c);
        }
        p = fma(p, x, EXP_POLY[5]);
        let normal = (biased.to_bits() << 23).wrapping_add(0x3F80_0000);
        *o = p * f32::from_bits(normal);
        lanes[i % L] += *o;
    }
    let mut l = [0f32; 8];
    for (j, v) in l.iter_mut().enumerate() {
        *v = if L == 16 {
            lanes[j + 8] + lanes[j]
        } else {
            lanes[j]
        };
    }
    let sum = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
    let scale = 1.0 / sum;
    for o in out.iter_mut() {
        *o *= scale;
    }
}
