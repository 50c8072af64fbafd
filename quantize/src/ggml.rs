//! ggml block quantizers, bit-identical to llama.cpp's reference (`ggml/src/ggml-quants.c`,
//! `quantize_row_q4_0_ref` / `quantize_row_q8_0_ref`): f32 arithmetic in ggml's order, fp16 scales rounded
//! to nearest even (what F16C and ggml's software path do).
//!
//! - q4_0: blocks of 32; `max` = the value of largest magnitude (first one on ties), `d = max / -8`,
//!   `q = min(15, trunc(x·(1/d) + 8.5))`, value j in the low nibble of byte j, value 16+j in its high nibble;
//!   18 bytes per block (fp16 d, 16 bytes).
//! - q8_0: blocks of 32; `d = amax / 127`, `q = roundf(x·(1/d))` (half away from zero); 34 bytes per block.
//!
//! Non-finite input is refused (ggml would silently write garbage blocks).

use half::f16;

pub const QK: usize = 32;
pub const Q4_0_BYTES: usize = 18;
pub const Q8_0_BYTES: usize = 34;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q8_0,
}

impl GgmlType {
    /// ggml's type id (ggml.h `enum ggml_type`).
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q8_0 => 8,
            GgmlType::BF16 => 30,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::BF16 => "BF16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q8_0 => "Q8_0",
        }
    }
    /// Bytes for `n` values (n a multiple of the block size for block types).
    pub fn bytes(self, n: usize) -> usize {
        match self {
            GgmlType::F32 => n * 4,
            GgmlType::F16 | GgmlType::BF16 => n * 2,
            GgmlType::Q4_0 => n / QK * Q4_0_BYTES,
            GgmlType::Q8_0 => n / QK * Q8_0_BYTES,
        }
    }
    pub fn block(self) -> usize {
        match self {
            GgmlType::Q4_0 | GgmlType::Q8_0 => QK,
            _ => 1,
        }
    }
    /// Bits per weight.
    pub fn bpw(self) -> f64 {
        self.bytes(QK) as f64 * 8.0 / QK as f64
    }
}

/// C's float → int8_t on x86-64 (cvttss2si to int32, keep the low byte): in-range values truncate; NaN,
/// ±inf and out-of-int32 values become INT32_MIN, i.e. 0. Reached when a block's scale is so small that
/// 1/d overflows (subnormal blocks) — Rust's saturating `as` would write 15 or 0x80 there.
#[inline]
fn c_i8(v: f32) -> i8 {
    let i = if v.is_finite() && v.abs() < 2147483648.0 {
        v as i32
    } else {
        i32::MIN
    };
    i as i8
}

fn check_finite(x: &[f32]) -> Result<(), String> {
    match x.iter().position(|v| !v.is_finite()) {
        Some(i) => Err(format!("non-finite value {} at element {i}", x[i])),
        None => Ok(()),
    }
}

/// `quantize_row_q4_0_ref`.
pub fn quantize_q4_0(x: &[f32], out: &mut Vec<u8>) -> Result<(), String> {
    if x.len() % QK != 0 {
        return Err(format!(
            "{} values is not a multiple of the q4_0 block size {QK}",
            x.len()
        ));
    }
    let start = out.len();
    #[cfg(target_arch = "x86_64")]
    let finite = if std::arch::is_x86_feature_detected!("avx2") {
        // Same code, 8 lanes wide. No FMA: ggml's reference rounds x·id and + 8.5 separately.
        unsafe { q4_0_avx2(x, out) }
    } else {
        q4_0_blocks(x, out)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let finite = q4_0_blocks(x, out);
    if !finite {
        // The blocks pass flags NaN/inf as it goes; name the element and write nothing.
        out.truncate(start);
        check_finite(x)?;
    }
    Ok(())
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn q4_0_avx2(x: &[f32], out: &mut Vec<u8>) -> bool {
    q4_0_blocks(x, out)
}

/// The blocks of `x`; false (and garbage in `out`) if a value is NaN or infinite.
#[inline(always)]
fn q4_0_blocks(x: &[f32], out: &mut Vec<u8>) -> bool {
    for b in x.chunks_exact(QK) {
        // ggml keeps the first element of largest magnitude: a max over |v|, then the first v reaching it
        // (same result, but the max vectorizes). `bad` catches NaN/inf in the same pass.
        let mut bad = false;
        let amax = b.iter().fold(0f32, |a, v| {
            bad |= !(v.abs() <= f32::MAX);
            if v.abs() > a {
                v.abs()
            } else {
                a
            }
        });
        if bad {
            return false;
        }
        let max = b.iter().copied().find(|v| v.abs() == amax).unwrap_or(0.0);
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        let mut qs = [0u8; QK / 2];
        if id.is_finite() {
            // x·id ∈ [-8, 8], so x·id + 8.5 ∈ [0.5, 16.5]: C's truncation is a plain cast here (vectorizes).
            for j in 0..QK / 2 {
                let xi0 = ((b[j] * id + 8.5) as i32).min(15) as u8;
                let xi1 = ((b[QK / 2 + j] * id + 8.5) as i32).min(15) as u8;
                qs[j] = xi0 | (xi1 << 4);
            }
        } else {
            // 1/d overflowed (a block of subnormals): C's float → int8_t on x86-64, see `c_i8`.
            for j in 0..QK / 2 {
                let xi0 = c_i8(b[j] * id + 8.5).min(15) as u8;
                let xi1 = c_i8(b[QK / 2 + j] * id + 8.5).min(15) as u8;
                qs[j] = xi0 | ((xi1 as u32) << 4) as u8;
            }
        }
        out.extend_from_slice(&qs);
    }
    true
}

/// `quantize_row_q8_0_ref`.
pub fn quantize_q8_0(x: &[f32], out: &mut Vec<u8>) -> Result<(), String> {
    if x.len() % QK != 0 {
        return Err(format!(
            "{} values is not a multiple of the q8_0 block size {QK}",
            x.len()
        ));
    }
    check_finite(x)?;
    for b in x.chunks(QK) {
        let amax = b.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        for &v in b {
            out.push(c_i8((v * id).round()) as u8);
        }
    }
    Ok(())
}

/// Dequantize q4_0 (`dequantize_row_q4_0`).
pub fn dequantize_q4_0(b: &[u8]) -> Vec<f32> {
    let mut out = Vec::with_capacity(b.len() / Q4_0_BYTES * QK);
    for blk in b.chunks(Q4_0_BYTES) {
        let d = f16::from_le_bytes([blk[0], blk[1]]).to_f32();
        let mut v = [0f32; QK];
        for j in 0..QK / 2 {
            v[j] = ((blk[2 + j] & 0xF) as i32 - 8) as f32 * d;
            v[j + QK / 2] = ((blk[2 + j] >> 4) as i32 - 8) as f32 * d;
        }
        out.extend_from_slice(&v);
    }
    out
}

/// Dequantize q8_0.
pub fn dequantize_q8_0(b: &[u8]) -> Vec<f32> {
    let mut out = Vec::with_capacity(b.len() / Q8_0_BYTES * QK);
    for blk in b.chunks(Q8_0_BYTES) {
        let d = f16::from_le_bytes([blk[0], blk[1]]).to_f32();
        out.extend(blk[2..].iter().map(|&q| q as i8 as f32 * d));
    }
    out
}

/// Values in a ggml type (rayon over rows for the block types; `row` = ne0).
pub fn encode(t: GgmlType, x: &[f32], row: usize) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    encode_into(t, x, row, &mut out)?;
    Ok(out)
}

/// [`encode`] into a reused buffer (streaming writers call this per chunk: no fresh allocation, so no
/// zero-fill page faults per chunk).
pub fn encode_into(t: GgmlType, x: &[f32], row: usize, out: &mut Vec<u8>) -> Result<(), String> {
    use rayon::prelude::*;
    out.clear();
    match t {
        GgmlType::F32 => out.extend(x.iter().flat_map(|v| v.to_le_bytes())),
        GgmlType::F16 => out.extend(x.iter().flat_map(|v| f16::from_f32(*v).to_le_bytes())),
        GgmlType::BF16 => out.extend(
            x.iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()),
        ),
        GgmlType::Q4_0 | GgmlType::Q8_0 => {
            if row % QK != 0 {
                return Err(format!("row length {row} is not a multiple of {QK}"));
            }
            out.resize(t.bytes(x.len()), 0);
            let bs = t.bytes(QK);
            // 256 blocks per task.
            x.par_chunks(QK * 256)
                .zip(out.par_chunks_mut(bs * 256))
                .try_for_each(|(xs, os)| quantize_task(t, xs, os))?;
        }
    }
    Ok(())
}

/// [`encode_into`] for q4_0/q8_0 straight from little-endian bf16 bytes: each task widens its 256 blocks into a
/// cache-resident buffer and quantizes them, instead of a pass through a tensor-sized f32 buffer (bf16 → f32
/// is exact, so the blocks are the same bytes).
pub fn encode_bf16_into(
    t: GgmlType,
    b: &[u8],
    row: usize,
    out: &mut Vec<u8>,
) -> Result<(), String> {
    use rayon::prelude::*;
    if !matches!(t, GgmlType::Q4_0 | GgmlType::Q8_0) {
        return Err(format!(
            "encode_bf16_into: {} is not a block type",
            t.name()
        ));
    }
    if row % QK != 0 {
        return Err(format!("row length {row} is not a multiple of {QK}"));
    }
    let n = b.len() / 2;
    out.clear();
    out.resize(t.bytes(n), 0);
    let bs = t.bytes(QK);
    b.par_chunks(QK * 256 * 2)
        .zip(out.par_chunks_mut(bs * 256))
        .try_for_each(|(src, os)| {
            let mut xs = [0f32; QK * 256];
            let xs = &mut xs[..src.len() / 2];
            for (x, h) in xs.iter_mut().zip(src.chunks_exact(2)) {
                *x = f32::from_bits((u16::from_le_bytes([h[0], h[1]]) as u32) << 16);
            }
            quantize_task(t, xs, os)
        })
}

/// One rayon task of q4_0/q8_0 blocks into its slice of the output.
fn quantize_task(t: GgmlType, xs: &[f32], os: &mut [u8]) -> Result<(), String> {
    let mut tmp = Vec::with_capacity(os.len());
    if t == GgmlType::Q4_0 {
        quantize_q4_0(xs, &mut tmp)?;
    } else {
        quantize_q8_0(xs, &mut tmp)?;
    }
    os.copy_from_slice(&tmp);
    Ok(())
}

/// Little-endian storage bytes → f32 into a reused buffer.
pub fn to_f32_into(b: &[u8], bf16: bool, out: &mut Vec<f32>) {
    use rayon::prelude::*;
    let n = b.len() / if bf16 { 2 } else { 4 };
    out.resize(n, 0.0);
    if bf16 {
        out.par_chunks_mut(1 << 16)
            .zip(b.par_chunks(2 << 16))
            .for_each(|(o, s)| {
                for (v, c) in o.iter_mut().zip(s.chunks_exact(2)) {
                    *v = half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
                }
            });
    } else {
        out.par_chunks_mut(1 << 16)
            .zip(b.par_chunks(4 << 16))
            .for_each(|(o, s)| {
                for (v, c) in o.iter_mut().zip(s.chunks_exact(4)) {
                    *v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4_0_hand_block() {
        // max magnitude -8 → d = 1, q = trunc(x + 8.5): -8 → 0, 7 → 15, 0 → 8, 0.5 → 9 (trunc(9.0)).
        let mut x = [0f32; 32];
        x[0] = -8.0;
        x[1] = 7.0;
        x[2] = 0.5;
        x[16] = 3.0;
        let mut o = vec![];
        quantize_q4_0(&x, &mut o).unwrap();
        assert_eq!(o.len(), 18);
        assert_eq!(f16::from_le_bytes([o[0], o[1]]).to_f32(), 1.0);
        assert_eq!(o[2], 0 | (11 << 4));
        assert_eq!(o[3], 15 | (8 << 4));
        assert_eq!(o[4], 9 | (8 << 4));
        let d = dequantize_q4_0(&o);
        assert_eq!(d[0], -8.0);
        assert_eq!(d[16], 3.0);
        assert!(quantize_q4_0(&[f32::NAN; 32], &mut vec![]).is_err());
    }
}
