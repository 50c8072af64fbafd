//! Dequantizers, bit-identical to gguf-py's `gguf.quants.dequantize` (numpy, float32, no FMA): each block's
//! fp16 scales widened to f32, then the products in gguf-py's order — `d·q` (Q4_0, Q5_0), `q·d` (Q8_0),
//! `(d·sc)·q − dmin·m` (Q4_K), `(d·sc)·q` (Q6_K). Judged against gguf-py on random and adversarial blocks
//! and on every tensor of a real GGUF (tests/import.rs).

use crate::ggml::{GgmlError, GgmlType, QK, QK_K};
use half::{bf16, f16};

/// `bytes` of type `ty` as f32 values into `out` (cleared first).
pub fn dequantize_into(ty: GgmlType, bytes: &[u8], out: &mut Vec<f32>) -> Result<(), GgmlError> {
    let bb = ty.info().block_bytes;
    if !bytes.len().is_multiple_of(bb) {
        return Err(GgmlError::PartialBytes {
            bytes: bytes.len(),
            ty: ty.name(),
            block_bytes: bb,
        });
    }
    out.clear();
    out.reserve(bytes.len() / bb * ty.block());
    let blocks = bytes.chunks_exact(bb);
    match ty {
        GgmlType::F32 => out.extend(blocks.map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))),
        GgmlType::F16 => out.extend(blocks.map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())),
        GgmlType::BF16 => out.extend(blocks.map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())),
        GgmlType::Q4_0 => blocks.for_each(|b| q4_0(b, out)),
        GgmlType::Q5_0 => blocks.for_each(|b| q5_0(b, out)),
        GgmlType::Q8_0 => blocks.for_each(|b| q8_0(b, out)),
        GgmlType::Q4_K => blocks.for_each(|b| q4_k(b, out)),
        GgmlType::Q6_K => blocks.for_each(|b| q6_k(b, out)),
    }
    Ok(())
}

fn half_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// d (fp16), 16 bytes: value j in the low nibble of byte j, value 16+j in its high nibble; q − 8.
fn q4_0(b: &[u8], out: &mut Vec<f32>) {
    let d = half_at(b, 0);
    let qs = &b[2..18];
    out.extend(qs.iter().map(|&q| d * ((q & 0x0F) as i8 - 8) as f32));
    out.extend(qs.iter().map(|&q| d * ((q >> 4) as i8 - 8) as f32));
}

/// d (fp16), qh (32 high bits, little-endian), 16 bytes of low nibbles as q4_0; q − 16.
fn q5_0(b: &[u8], out: &mut Vec<f32>) {
    let d = half_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = &b[6..22];
    for j in 0..QK {
        let lo = if j < 16 {
            qs[j] & 0x0F
        } else {
            qs[j - 16] >> 4
        };
        let hi = ((qh >> j) & 1) as u8;
        out.push(d * ((lo | (hi << 4)) as i8 - 16) as f32);
    }
}

/// d (fp16), 32 int8 values.
fn q8_0(b: &[u8], out: &mut Vec<f32>) {
    let d = half_at(b, 0);
    out.extend(b[2..34].iter().map(|&q| q as i8 as f32 * d));
}

/// The 8 6-bit scales and mins packed in 12 bytes (ggml's `get_scale_min_k4`).
fn scale_min_k4(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let (mut sc, mut m) = ([0u8; 8], [0u8; 8]);
    for j in 0..4 {
        sc[j] = s[j] & 0x3F;
        m[j] = s[4 + j] & 0x3F;
        sc[4 + j] = (s[8 + j] & 0x0F) | ((s[j] >> 2) & 0x30);
        m[4 + j] = (s[8 + j] >> 4) | ((s[4 + j] >> 2) & 0x30);
    }
    (sc, m)
}

/// d, dmin (fp16), 12 bytes of scales/mins, 128 bytes: 8 sub-blocks of 32, sub-block 2j+k from the k-th
/// nibble of bytes 32j..32j+32.
fn q4_k(b: &[u8], out: &mut Vec<f32>) {
    let (d, dmin) = (half_at(b, 0), half_at(b, 2));
    let (sc, m) = scale_min_k4(&b[4..16]);
    let qs = &b[16..144];
    for sb in 0..8 {
        let (j, shift) = (sb / 2, 4 * (sb % 2));
        let (ds, dm) = (d * sc[sb] as f32, dmin * m[sb] as f32);
        out.extend(
            qs[32 * j..32 * j + 32]
                .iter()
                .map(|&q| ds * ((q >> shift) & 0x0F) as f32 - dm),
        );
    }
}

/// 128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 int8 scales, d (fp16); q − 32.
fn q6_k(b: &[u8], out: &mut Vec<f32>) {
    let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = half_at(b, 208);
    let start = out.len();
    out.resize(start + QK_K, 0.0);
    let y = &mut out[start..];
    for half in 0..2 {
        let (ql, qh) = (&ql[64 * half..], &qh[32 * half..]);
        for l in 0..32 {
            let q = [
                (ql[l] & 0x0F) | (qh[l] & 3) << 4,
                (ql[l + 32] & 0x0F) | ((qh[l] >> 2) & 3) << 4,
                (ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4,
                (ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4,
            ];
            for (r, &qr) in q.iter().enumerate() {
                let i = 128 * half + 32 * r + l;
                let ds = d * sc[i / 16] as i8 as f32;
                y[i] = ds * (qr as i8 - 32) as f32;
            }
        }
    }
}
