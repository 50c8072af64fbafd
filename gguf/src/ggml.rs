//! ggml block quantizers, bit-identical to llama.cpp's reference (`ggml/src/ggml-quants.c`,
//! `quantize_row_q4_0_ref` / `quantize_row_q8_0_ref`): f32 arithmetic in ggml's order, fp16 scales rounded
//! to nearest even (what F16C and ggml's software path do).
//!
//! - q4_0: blocks of 32; `max` = the value of largest magnitude (first one on ties), `d = max / -8`,
//!   `q = min(15, trunc(x·(1/d) + 8.5))`, value j in the low nibble of byte j, value 16+j in its high nibble;
//!   18 bytes per block (fp16 d, 16 bytes).
//! - q8_0: blocks of 32; `d = amax / 127`, `q = roundf(x·(1/d))` (half away from zero); 34 bytes per block.
//! - q6_K (`quantize_row_q6_K_ref`, llama-quantize's token-embedding type): super-blocks of 256 = 16
//!   sub-blocks of 16, each scaled by `make_qx_quants(16, 32, …, rmse_type 1)` (a weighted least-squares
//!   search over 19 candidate grids), the 16 scales quantized to int8 under one fp16 `d`, then every value
//!   re-quantized to 6 bits; 210 bytes per block (`ql[128]`, `qh[64]`, `scales[16]`, `d`). `nearest_int` is ggml's
//!   float trick (+12582912, round half to even), and ggml-base is compiled without FMA, so every product
//!   and sum here is a separately rounded f32 in ggml's order (judged against libggml-base itself).
//!
//! Non-finite input is refused (ggml would silently write garbage blocks).

use half::f16;

pub const QK: usize = 32;
pub const Q4_0_BYTES: usize = 18;
pub const Q8_0_BYTES: usize = 34;
pub const Q5_0_BYTES: usize = 22;
pub const Q4_K_BYTES: usize = 144;
pub const QK_K: usize = 256;
pub const Q6_K_BYTES: usize = 210;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(non_camel_case_types)] // ggml's names
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q5_0,
    Q8_0,
    Q4_K,
    Q6_K,
}

/// One ggml type's facts (gguf-py's `GGML_QUANT_SIZES` + ggml.h's ids): values per block, bytes per block.
pub struct GgmlTypeInfo {
    pub ty: GgmlType,
    pub name: &'static str,
    /// ggml.h `enum ggml_type`.
    pub id: u32,
    pub block: usize,
    pub block_bytes: usize,
}

#[rustfmt::skip]
pub const GGML_TYPES: [GgmlTypeInfo; 8] = [
    GgmlTypeInfo { ty: GgmlType::F32, name: "F32", id: 0, block: 1, block_bytes: 4 },
    GgmlTypeInfo { ty: GgmlType::F16, name: "F16", id: 1, block: 1, block_bytes: 2 },
    GgmlTypeInfo { ty: GgmlType::Q4_0, name: "Q4_0", id: 2, block: QK, block_bytes: Q4_0_BYTES },
    GgmlTypeInfo { ty: GgmlType::Q5_0, name: "Q5_0", id: 6, block: QK, block_bytes: Q5_0_BYTES },
    GgmlTypeInfo { ty: GgmlType::Q8_0, name: "Q8_0", id: 8, block: QK, block_bytes: Q8_0_BYTES },
    GgmlTypeInfo { ty: GgmlType::Q4_K, name: "Q4_K", id: 12, block: QK_K, block_bytes: Q4_K_BYTES },
    GgmlTypeInfo { ty: GgmlType::Q6_K, name: "Q6_K", id: 14, block: QK_K, block_bytes: Q6_K_BYTES },
    GgmlTypeInfo { ty: GgmlType::BF16, name: "BF16", id: 30, block: 1, block_bytes: 2 },
];

impl GgmlType {
    pub fn info(self) -> &'static GgmlTypeInfo {
        GGML_TYPES
            .iter()
            .find(|t| t.ty == self)
            .expect("every GgmlType has a row")
    }
    pub fn from_id(id: u32) -> Option<Self> {
        GGML_TYPES.iter().find(|t| t.id == id).map(|t| t.ty)
    }
    /// ggml's type id (ggml.h `enum ggml_type`).
    pub fn id(self) -> u32 {
        self.info().id
    }
    pub fn name(self) -> &'static str {
        self.info().name
    }
    /// Bytes for `n` values (n a multiple of the block size for block types).
    pub fn bytes(self, n: usize) -> usize {
        n / self.block() * self.info().block_bytes
    }
    pub fn block(self) -> usize {
        self.info().block
    }
    pub fn is_block(self) -> bool {
        self.block() > 1
    }
    /// Bits per weight.
    pub fn bpw(self) -> f64 {
        self.bytes(QK_K) as f64 * 8.0 / QK_K as f64
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

/// Why a block quantizer refused its input (the caller adds the tensor's name).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GgmlError {
    #[error("{len} values is not a multiple of the {ty} block size {block}")]
    PartialBlock {
        len: usize,
        ty: &'static str,
        block: usize,
    },
    #[error("row length {row} is not a multiple of {block}")]
    RowLength { row: usize, block: usize },
    #[error("non-finite value {value} at element {index}")]
    NonFinite { value: f32, index: usize },
    #[error("{0} is not a block type")]
    NotBlockType(&'static str),
    #[error("hexq has no {0} quantizer (it reads {0}, it does not write it)")]
    NoQuantizer(&'static str),
    #[error("{bytes} bytes is not a whole number of {ty} blocks ({block_bytes} bytes each)")]
    PartialBytes {
        bytes: usize,
        ty: &'static str,
        block_bytes: usize,
    },
}

pub(crate) type Result<T> = std::result::Result<T, GgmlError>;

/// `x` must be whole blocks of `block` values.
fn check_blocks(x: &[f32], block: usize, ty: &'static str) -> Result<()> {
    match x.len() % block {
        0 => Ok(()),
        _ => Err(GgmlError::PartialBlock {
            len: x.len(),
            ty,
            block,
        }),
    }
}

pub(crate) fn check_finite(x: &[f32]) -> Result<()> {
    match x.iter().position(|v| !v.is_finite()) {
        Some(index) => Err(GgmlError::NonFinite {
            value: x[index],
            index,
        }),
        None => Ok(()),
    }
}

/// `quantize_row_q4_0_ref`.
pub fn quantize_q4_0(x: &[f32], out: &mut Vec<u8>) -> Result<()> {
    check_blocks(x, QK, "q4_0")?;
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

/// A q4_0 block's scale as ggml computes it (`quantize_row_q4_0_ref`): `d` from the first value of largest
/// magnitude, `id = 1/d`.
pub fn q4_0_scale(block: &[f32]) -> (f32, f32) {
    let amax = block.iter().fold(0f32, |a, v| a.max(v.abs()));
    let max = block
        .iter()
        .copied()
        .find(|v| v.abs() == amax)
        .unwrap_or(0.0);
    let d = max / -8.0;
    (d, if d != 0.0 { 1.0 / d } else { 0.0 })
}

/// The value llama.cpp dequantizes `v` to in a block of scale `(d, id)`: the integer ggml's reference takes
/// (clamped to 0..=15 both ways, for values a rounding moved past the block's range), times the stored f16 `d`.
pub fn q4_0_point(v: f32, d: f32, id: f32) -> f32 {
    let q = ((v * id + 8.5) as i32).clamp(0, 15);
    (q - 8) as f32 * f16::from_f32(d).to_f32()
}

/// q4_0 blocks with each block's scale from `src` (the original weights, ggml's rule) and the integers of
/// `x`, whose values a calibration-aware rounding put on those grids ([`q4_0_point`]).
pub fn quantize_q4_0_on(x: &[f32], src: &[f32], out: &mut Vec<u8>) -> Result<()> {
    check_blocks(x, QK, "q4_0")?;
    check_finite(src)?;
    for (b, s) in x.chunks_exact(QK).zip(src.chunks_exact(QK)) {
        let (d, id) = q4_0_scale(s);
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        let q = |v: f32| ((v * id + 8.5) as i32).clamp(0, 15) as u8;
        for j in 0..QK / 2 {
            out.push(q(b[j]) | (q(b[QK / 2 + j]) << 4));
        }
    }
    Ok(())
}

/// `quantize_row_q8_0_ref`.
pub fn quantize_q8_0(x: &[f32], out: &mut Vec<u8>) -> Result<()> {
    check_blocks(x, QK, "q8_0")?;
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

/// ggml's `nearest_int`: the float is added to 1.5·2^23, which rounds it to an integer (half to even), and the
/// integer is read back from the mantissa bits. Out-of-range input (ggml only asserts in debug builds) gives
/// the same bits here as there.
#[inline(always)]
pub(crate) fn nearest_int(f: f32) -> i32 {
    let v = f + 12582912.0f32;
    (v.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// `make_qx_quants(16, 32, x, L, rmse_type = 1, NULL)`: the sub-block scale and its levels `L` (0..63) — the
/// weighted search with weights x² (what rmse_type 1 uses without quant weights). The straight port, kept as
/// the reference the 16-lane version is tested against.
#[cfg(test)]
fn make_qx_quants_16(x: &[f32], l_out: &mut [i8]) -> f32 {
    let w: Vec<f32> = x.iter().map(|v| v * v).collect();
    crate::weighted::make_qx_quants(32, x, l_out, &w)
}

/// [`make_qx_quants_16`] on the 16 sub-blocks of a q6_K super-block at once, one sub-block per SIMD lane:
/// each lane runs exactly the scalar sequence (same products, sums in the same order, same candidate test),
/// so the result is the same bits — checked against the scalar function in the tests.
#[inline(always)]
fn make_qx_quants_16x16(b: &[f32], l_out: &mut [i8; QK_K], scales: &mut [f32; 16]) {
    const NMAX: i32 = 32;
    // xt[i][k] = element i of sub-block k.
    let mut xt = [[0f32; 16]; 16];
    for k in 0..16 {
        for i in 0..16 {
            xt[i][k] = b[16 * k + i];
        }
    }
    let (mut max, mut amax) = ([0f32; 16], [0f32; 16]);
    for row in &xt {
        for k in 0..16 {
            let ax = row[k].abs();
            if ax > amax[k] {
                amax[k] = ax;
                max[k] = row[k];
            }
        }
    }
    let sums = |iscale: &[f32; 16]| {
        let (mut sumlx, mut suml2) = ([0f32; 16], [0f32; 16]);
        for row in &xt {
            for k in 0..16 {
                let v = row[k];
                let l = nearest_int(iscale[k] * v).clamp(-NMAX, NMAX - 1) as f32;
                let w = v * v;
                sumlx[k] += w * v * l;
                suml2[k] += w * l * l;
            }
        }
        (sumlx, suml2)
    };
    let mut iscale = [0f32; 16];
    for k in 0..16 {
        iscale[k] = -(NMAX as f32) / max[k];
    }
    let (sumlx, suml2) = sums(&iscale);
    let mut best_is = iscale;
    let (mut scale, mut best) = ([0f32; 16], [0f32; 16]);
    for k in 0..16 {
        scale[k] = if suml2[k] != 0.0 {
            sumlx[k] / suml2[k]
        } else {
            0.0
        };
        best[k] = scale[k] * sumlx[k];
    }
    for is in -9i32..=9 {
        if is == 0 {
            continue;
        }
        for k in 0..16 {
            iscale[k] = -(NMAX as f32 + 0.1f32 * is as f32) / max[k];
        }
        let (sumlx, suml2) = sums(&iscale);
        for k in 0..16 {
            if suml2[k] > 0.0 && sumlx[k] * sumlx[k] > best[k] * suml2[k] {
                best_is[k] = iscale[k];
                scale[k] = sumlx[k] / suml2[k];
                best[k] = scale[k] * sumlx[k];
            }
        }
    }
    for k in 0..16 {
        let zero = amax[k] < 1e-15;
        scales[k] = if zero { 0.0 } else { scale[k] };
        for i in 0..16 {
            l_out[16 * k + i] = if zero {
                0
            } else {
                (nearest_int(best_is[k] * xt[i][k]).clamp(-NMAX, NMAX - 1) + NMAX) as i8
            };
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn make_qx_quants_16x16_avx2(b: &[f32], l_out: &mut [i8; QK_K], scales: &mut [f32; 16]) {
    make_qx_quants_16x16(b, l_out, scales)
}

/// `quantize_row_q6_K_ref`.
pub fn quantize_q6_k(x: &[f32], out: &mut Vec<u8>) -> Result<()> {
    check_blocks(x, QK_K, "q6_K")?;
    check_finite(x)?;
    #[cfg(target_arch = "x86_64")]
    let avx2 = std::arch::is_x86_feature_detected!("avx2");
    for b in x.chunks_exact(QK_K) {
        let mut l = [0i8; QK_K];
        let mut scales = [0f32; QK_K / 16];
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            // No FMA in this function either: lanes, not a different arithmetic.
            unsafe { make_qx_quants_16x16_avx2(b, &mut l, &mut scales) }
        } else {
            make_qx_quants_16x16(b, &mut l, &mut scales)
        }
        #[cfg(not(target_arch = "x86_64"))]
        make_qx_quants_16x16(b, &mut l, &mut scales);
        let (mut max_scale, mut max_abs_scale) = (0f32, 0f32);
        for &s in &scales {
            if s.abs() > max_abs_scale {
                max_abs_scale = s.abs();
                max_scale = s;
            }
        }
        if max_abs_scale < 1e-15 {
            out.extend_from_slice(&[0u8; Q6_K_BYTES]);
            continue;
        }
        let iscale = -128f32 / max_scale;
        let d = f16::from_f32(1.0 / iscale);
        let mut sc = [0i8; QK_K / 16];
        for ib in 0..QK_K / 16 {
            sc[ib] = nearest_int(iscale * scales[ib]).min(127) as i8;
        }
        for j in 0..QK_K / 16 {
            let dj = d.to_f32() * sc[j] as f32;
            if dj == 0.0 {
                continue;
            }
            for ii in 0..16 {
                let q = nearest_int(b[16 * j + ii] / dj).clamp(-32, 31);
                l[16 * j + ii] = (q + 32) as i8;
            }
        }
        let (mut ql, mut qh) = ([0u8; QK_K / 2], [0u8; QK_K / 4]);
        let l = l.map(|v| v as u8);
        for (h, j) in (0..QK_K).step_by(128).enumerate() {
            let (ql, qh) = (&mut ql[64 * h..64 * h + 64], &mut qh[32 * h..32 * h + 32]);
            for i in 0..32 {
                let (q1, q2, q3, q4) = (l[j + i], l[j + i + 32], l[j + i + 64], l[j + i + 96]);
                ql[i] = (q1 & 0xF) | ((q3 & 0xF) << 4);
                ql[i + 32] = (q2 & 0xF) | ((q4 & 0xF) << 4);
                qh[i] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6);
            }
        }
        out.extend_from_slice(&ql);
        out.extend_from_slice(&qh);
        out.extend(sc.iter().map(|&v| v as u8));
        out.extend_from_slice(&d.to_le_bytes());
    }
    Ok(())
}

/// Dequantize q6_K (`dequantize_row_q6_K`).
pub fn dequantize_q6_k(b: &[u8]) -> Vec<f32> {
    let mut out = Vec::with_capacity(b.len() / Q6_K_BYTES * QK_K);
    for blk in b.chunks(Q6_K_BYTES) {
        let (ql, qh, sc) = (&blk[..128], &blk[128..192], &blk[192..208]);
        let d = f16::from_le_bytes([blk[208], blk[209]]).to_f32();
        let mut v = [0f32; QK_K];
        for h in 0..2 {
            let (ql, qh) = (&ql[64 * h..], &qh[32 * h..]);
            for i in 0..32 {
                let q = [
                    (ql[i] & 0xF) | ((qh[i] & 3) << 4),
                    (ql[i + 32] & 0xF) | (((qh[i] >> 2) & 3) << 4),
                    (ql[i] >> 4) | (((qh[i] >> 4) & 3) << 4),
                    (ql[i + 32] >> 4) | (((qh[i] >> 6) & 3) << 4),
                ];
                for (k, &qk) in q.iter().enumerate() {
                    let idx = 128 * h + i + 32 * k;
                    v[idx] = d * sc[idx / 16] as i8 as f32 * (qk as i32 - 32) as f32;
                }
            }
        }
        out.extend_from_slice(&v);
    }
    out
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
pub fn encode(t: GgmlType, x: &[f32], row: usize) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    encode_into(t, x, row, &mut out)?;
    Ok(out)
}

/// [`encode`] into a reused buffer (streaming writers call this per chunk: no fresh allocation, so no
/// zero-fill page faults per chunk).
pub fn encode_into(t: GgmlType, x: &[f32], row: usize, out: &mut Vec<u8>) -> Result<()> {
    use rayon::prelude::*;
    out.clear();
    match t {
        GgmlType::F32 => out.extend(x.iter().flat_map(|v| v.to_le_bytes())),
        GgmlType::F16 => out.extend(x.iter().flat_map(|v| f16::from_f32(*v).to_le_bytes())),
        GgmlType::BF16 => out.extend(
            x.iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()),
        ),
        GgmlType::Q4_0 | GgmlType::Q8_0 | GgmlType::Q6_K => {
            let blk = t.block();
            if !row.is_multiple_of(blk) {
                return Err(GgmlError::RowLength { row, block: blk });
            }
            out.resize(t.bytes(x.len()), 0);
            // 8192 values per task.
            x.par_chunks(TASK)
                .zip(out.par_chunks_mut(t.bytes(TASK)))
                .try_for_each(|(xs, os)| quantize_task(t, xs, os))?;
        }
        // Read (imported) only: hexq writes no Q5_0 or Q4_K.
        GgmlType::Q5_0 | GgmlType::Q4_K => return Err(GgmlError::NoQuantizer(t.name())),
    }
    Ok(())
}

/// [`encode_into`] for q4_0/q8_0 straight from little-endian bf16 bytes: each task widens its 256 blocks into a
/// cache-resident buffer and quantizes them, instead of a pass through a tensor-sized f32 buffer (bf16 → f32
/// is exact, so the blocks are the same bytes).
pub fn encode_bf16_into(t: GgmlType, b: &[u8], row: usize, out: &mut Vec<u8>) -> Result<()> {
    use rayon::prelude::*;
    if !t.is_block() {
        return Err(GgmlError::NotBlockType(t.name()));
    }
    let blk = t.block();
    if !row.is_multiple_of(blk) {
        return Err(GgmlError::RowLength { row, block: blk });
    }
    let n = b.len() / 2;
    out.clear();
    out.resize(t.bytes(n), 0);
    b.par_chunks(TASK * 2)
        .zip(out.par_chunks_mut(t.bytes(TASK)))
        .try_for_each(|(src, os)| {
            let mut xs = [0f32; TASK];
            let xs = &mut xs[..src.len() / 2];
            for (x, h) in xs.iter_mut().zip(src.chunks_exact(2)) {
                *x = f32::from_bits((u16::from_le_bytes([h[0], h[1]]) as u32) << 16);
            }
            quantize_task(t, xs, os)
        })
}

/// Values per rayon task (a multiple of every block size).
const TASK: usize = 8192;

/// One rayon task of blocks into its slice of the output.
fn quantize_task(t: GgmlType, xs: &[f32], os: &mut [u8]) -> Result<()> {
    let mut tmp = Vec::with_capacity(os.len());
    match t {
        GgmlType::Q4_0 => quantize_q4_0(xs, &mut tmp)?,
        GgmlType::Q8_0 => quantize_q8_0(xs, &mut tmp)?,
        GgmlType::Q6_K => quantize_q6_k(xs, &mut tmp)?,
        _ => unreachable!("quantize_task: {} is not a block type", t.name()),
    }
    os.copy_from_slice(&tmp);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q6_k_lanes_equal_the_scalar_make_qx_quants() {
        let mut rng: u32 = 12345;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 17;
            rng ^= rng << 5;
            rng as f32 / u32::MAX as f32 - 0.5
        };
        for case in 0..200 {
            let mut b: Vec<f32> = (0..QK_K)
                .map(|i| next() * 10f32.powi((i / 16 + case) as i32 % 9 - 4))
                .collect();
            if case % 7 == 0 {
                b[16..32].fill(0.0);
            }
            if case % 5 == 0 {
                b[40] = -1e3;
            }
            let (mut l, mut s) = ([0i8; QK_K], [0f32; 16]);
            make_qx_quants_16x16(&b, &mut l, &mut s);
            for k in 0..16 {
                let mut lk = [0i8; 16];
                let sk = make_qx_quants_16(&b[16 * k..16 * k + 16], &mut lk);
                assert_eq!(sk.to_bits(), s[k].to_bits(), "case {case} sub-block {k}");
                assert_eq!(
                    &lk[..],
                    &l[16 * k..16 * k + 16],
                    "case {case} sub-block {k}"
                );
            }
        }
    }

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
        assert_eq!(o[2], 11 << 4);
        assert_eq!(o[3], 15 | (8 << 4));
        assert_eq!(o[4], 9 | (8 << 4));
        let d = dequantize_q4_0(&o);
        assert_eq!(d[0], -8.0);
        assert_eq!(d[16], 3.0);
        assert!(quantize_q4_0(&[f32::NAN; 32], &mut vec![]).is_err());
    }
}
