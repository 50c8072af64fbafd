//! onnxruntime's CPU Sigmoid (MLAS's logistic), bit for bit.

// The constants are MLAS's literals as its sources spell them (more digits than f32 holds): kept verbatim.
#![allow(clippy::excessive_precision, clippy::approx_constant)]

/// MLAS's logistic (onnxruntime's CPU Sigmoid: Eigen's rational approximation, `LogisticKernelFma3` on
/// AVX2 machines): clamp to ±18, p(x)/q(x²) by fused multiply-adds, + 0.5, clamp to [0, 1]. Not correctly
/// rounded (1 ulp off 1/(1+e^-x) on half the inputs, ~1e-8 absolute below −16) — but the exported QDQ graph
/// runs exactly this, so quantsim does too: a sigmoid 1 ulp apart was half of the quantization-step flips
/// between onnxruntime and quantsim on the trained model (README: "The fix: BOS on the host").
pub fn logistic(x: &[f32]) -> Vec<f32> {
    let mut y = vec![0f32; x.len()];
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: the features were just checked.
        unsafe { logistic_fma(x, &mut y) };
        return y;
    }
    for (o, &v) in y.iter_mut().zip(x) {
        *o = logistic1(v, f32::mul_add);
    }
    y
}

/// (α₉, α₇, α₅, α₃, α₁) and (β₁₀, β₈, β₆, β₄, β₂, β₀): MLAS's `MlasLogisticConstants`.
const LOGI_P: [f32; 5] = [
    4.37031012579801e-11,
    1.15627324459942e-07,
    6.08574864600143e-05,
    8.51377133304701e-03,
    2.48287947061529e-01,
];
const LOGI_Q: [f32; 6] = [
    6.10247389755681e-13,
    5.76102136993427e-09,
    6.29106785017040e-06,
    1.70198817374094e-03,
    1.16817656904453e-01,
    9.93151921023180e-01,
];

#[inline(always)]
fn logistic1(x: f32, fma: impl Fn(f32, f32, f32) -> f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    let v = x.clamp(-18.0, 18.0);
    let v2 = v * v;
    let mut p = fma(v2, LOGI_P[0], LOGI_P[1]);
    for &a in &LOGI_P[2..] {
        p = fma(p, v2, a);
    }
    p *= v;
    let mut q = fma(v2, LOGI_Q[0], LOGI_Q[1]);
    for &b in &LOGI_Q[2..] {
        q = fma(q, v2, b);
    }
    (p / q + 0.5).clamp(0.0, 1.0)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn logistic_fma(x: &[f32], y: &mut [f32]) {
    // The fused multiply-add is the instruction here (f32::mul_add without the target feature is a libm call).
    for (o, &v) in y.iter_mut().zip(x) {
        *o = logistic1(v, |a, b, c| {
            use std::arch::x86_64::*;
            _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(a), _mm_set_ss(b), _mm_set_ss(c)))
        });
    }
}

#[cfg(test)]
mod tests {
    /// MLAS's logistic bit for bit: inputs and outputs of onnxruntime 1.32's CPU Sigmoid (clamps at ±18, the
    /// output clamp at 0 and 1, ordinary values), both the FMA build and the scalar fallback.
    #[test]
    fn logistic_equals_onnxruntime() {
        let pairs: [(u32, u32); 24] = [
            (0xc1f00000, 0x00000000),
            (0xc1940000, 0x00000000),
            (0xc18f3333, 0x33000000),
            (0xc114cccd, 0x38bfb000),
            (0xc06ccccd, 0x3cc5a600),
            (0xbf800000, 0x3e89b2b1),
            (0xbdfbe76d, 0x3ef0469c),
            (0xb22bcc77, 0x3f000000),
            (0x00000000, 0x3f000000),
            (0x3649539c, 0x3f00000d),
            (0x3f000000, 0x3f1f597e),
            (0x3f9df3b6, 0x3f4646ce),
            (0x40200000, 0x3f6c948f),
            (0x40833333, 0x3f7bd39a),
            (0x40f8a3d7, 0x3f7fe458),
            (0x41300000, 0x3f7ffee8),
            (0x418c0000, 0x3f800000),
            (0x4191999a, 0x3f800000),
            (0x42200000, 0x3f800000),
            (0x3bc98c5f, 0x3f0064c6),
            (0xc118190b, 0x389c1000),
            (0xc149573d, 0x36680000),
            (0x3f0d64e4, 0x3f2279fc),
            (0xc0c40249, 0x3b0f0100),
        ];
        let x: Vec<f32> = pairs.iter().map(|p| f32::from_bits(p.0)).collect();
        let want: Vec<u32> = pairs.iter().map(|p| p.1).collect();
        let got: Vec<u32> = super::logistic(&x).iter().map(|v| v.to_bits()).collect();
        assert_eq!(got, want);
        let scalar: Vec<u32> = x
            .iter()
            .map(|&v| super::logistic1(v, f32::mul_add).to_bits())
            .collect();
        assert_eq!(scalar, want);
    }
}
