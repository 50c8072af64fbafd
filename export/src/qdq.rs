//! Encodings as ONNX sees them: AIMET's `real = scale·(q + offset)` as a storage type and zero point, and the
//! stored integers of a quantized param.

use crate::onnx_proto::elem;
use hexq_model::{Error, Result};
use hexq_quantize::Encoding;

/// Whether an encoding is stored signed: every symmetric grid (int8 weights; the 16-bit KV / second-MatMul-
/// input groups as int16, zero point 0 — what HTP's MatMul takes exactly; the same grid stored as uint16 with
/// zero point 32768 compiles, but HTP then tracks quantsim at cosine 0.998 instead of 0.99999 on the tiny model).
pub(crate) fn signed_storage(e: &Encoding) -> bool {
    e.is_symmetric
}

/// ONNX storage of an AIMET encoding: (element type, zero point).
pub fn onnx_qtype(e: &Encoding) -> Result<(i32, i64)> {
    let (signed, unsigned) = match e.bitwidth {
        1..=8 => (elem::INT8, elem::UINT8),
        9..=16 => (elem::INT16, elem::UINT16),
        b => {
            return Err(Error::Encoding {
                tensor: String::new(),
                msg: format!("bitwidth {b} has no ONNX QDQ type"),
            })
        }
    };
    Ok(if signed_storage(e) {
        (signed, -e.offset - (1i64 << (e.bitwidth - 1)))
    } else {
        (unsigned, -e.offset)
    })
}

/// Quantize param `x` on `e`'s grid into its storage integer ([`Encoding::quantize_param`]'s rounding).
pub(crate) fn quant_store(e: &Encoding, x: f32) -> i64 {
    let q = e.quantize_param(x);
    if signed_storage(e) {
        q - (1i64 << (e.bitwidth - 1))
    } else {
        q
    }
}

pub(crate) fn int_bytes(ty: i32, v: impl Iterator<Item = i64>) -> Vec<u8> {
    match ty {
        elem::UINT8 => v.map(|q| q as u8).collect(),
        elem::INT8 => v.map(|q| q as i8 as u8).collect(),
        elem::UINT16 => v.flat_map(|q| (q as u16).to_le_bytes()).collect(),
        elem::INT16 => v.flat_map(|q| (q as i16).to_le_bytes()).collect(),
        _ => unreachable!(),
    }
}
