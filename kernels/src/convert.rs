//! bf16 → f32 widening (exact: bf16 is f32's top half), as `half` does it: a signalling NaN comes out quiet.

/// `s` (little-endian bf16 bytes) widened into `o` (`o.len()` values).
pub fn bf16_to_f32(s: &[u8], o: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2.
        return unsafe { bf16_avx2(s, o) };
    }
    bf16_lanes(s, o)
}

/// `s` widened into `out`, resized to the values `s` holds.
pub fn bf16_to_f32_into(s: &[u8], out: &mut Vec<f32>) {
    out.resize(s.len() / 2, 0.0);
    bf16_to_f32(s, out)
}

/// Compiled for AVX2: calibration's per-row ranges and the bake widen every weight (1.9 G values at E2B);
/// the baseline build kept it one value at a time.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn bf16_avx2(s: &[u8], o: &mut [f32]) {
    bf16_lanes(s, o)
}

#[inline(always)]
fn bf16_lanes(s: &[u8], o: &mut [f32]) {
    for (v, b) in o.iter_mut().zip(s.chunks_exact(2)) {
        let h = u16::from_le_bytes([b[0], b[1]]);
        let h = if h & 0x7fff > 0x7f80 { h | 0x40 } else { h };
        *v = f32::from_bits((h as u32) << 16);
    }
}
