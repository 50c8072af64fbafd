//! LPBQ (low-power blockwise quantization), as aimet-onnx 2.42 computes it (`aimet_onnx/lpbq_utils.py`,
//! `qc_quantize_op.py::LPBQScaleQuantizer`, read for this module): a weight [out, in] gets one symmetric
//! `bw`-bit encoding per block of `block` inputs of each output channel (AIMET's min-max rule, as per
//! channel), then the block scales of each channel are themselves quantized —
//! `per_channel = max_b(scale_b) / 2^scale_bits`, `int_b = clip(round(scale_b / per_channel), 1,
//! 2^scale_bits)`, `scale'_b = int_b · per_channel` — so the hardware stores `bw`-bit weights, small
//! integer block scales and one float per channel ("decompressed" bit width = bw + scale_bits: 4 + 4 = 8 for
//! Qualcomm's w4a16 recipe). Weights are then quantized on `scale'_b` with AIMET's param arithmetic.

use crate::Encoding;

/// One LPBQ weight in AIMET's 1.0.0 encodings entry form (what aimet-onnx 2.42 exports and QNN's
/// converter reads): `bw` is the decompressed width, `scale` the per-channel float, `offset` −2^(bw−1).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LpbqEncoding {
    pub name: String,
    pub enc_type: String,
    pub dtype: String,
    pub is_sym: bool,
    pub bw: u32,
    pub compressed_bw: u32,
    pub block_size: usize,
    pub scale: Vec<f64>,
    pub offset: Vec<i64>,
    /// [out, in / block_size] row-major.
    pub per_block_int_scale: Vec<u32>,
}

impl LpbqEncoding {
    pub fn from_lpbq(name: &str, l: &Lpbq) -> Self {
        let bw = l.bw + l.scale_bits;
        LpbqEncoding {
            name: name.into(),
            enc_type: "LPBQ".into(),
            dtype: "INT".into(),
            is_sym: true,
            bw,
            compressed_bw: l.bw,
            block_size: l.block,
            scale: l.channel_scale.clone(),
            offset: vec![-(1i64 << (bw - 1)); l.channel_scale.len()],
            per_block_int_scale: l.int_scale.clone(),
        }
    }
    pub fn to_lpbq(&self) -> Lpbq {
        Lpbq {
            bw: self.compressed_bw,
            scale_bits: self.bw - self.compressed_bw,
            block: self.block_size,
            channel_scale: self.scale.clone(),
            int_scale: self.per_block_int_scale.clone(),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Lpbq {
    pub bw: u32,
    pub scale_bits: u32,
    pub block: usize,
    /// Per output channel: the float scale of the block scales.
    pub channel_scale: Vec<f64>,
    /// [out, in / block]: each block's integer scale in 1..=2^scale_bits.
    pub int_scale: Vec<u32>,
}

/// AIMET's blockwise encodings, then the scale compression (`lpbq_utils._compress_encoding_scales`, in f64
/// as numpy computes it on libpymo's double scales). `w` is [out, in] row-major; `in` must divide by `block`.
pub fn encode(w: &[f32], cols: usize, block: usize, bw: u32, scale_bits: u32) -> Lpbq {
    assert!(
        cols.is_multiple_of(block),
        "{cols} inputs are not a multiple of block {block}"
    );
    from_block_scales(
        &block_scales(w, cols, block, bw),
        cols / block,
        block,
        bw,
        scale_bits,
    )
}

/// AIMET's blockwise min-max scale of every block of `block` inputs of each row of `w` ([out, in]), row-major.
pub fn block_scales(w: &[f32], cols: usize, block: usize, bw: u32) -> Vec<f64> {
    w.chunks(cols)
        .flat_map(|row| row.chunks(block))
        .map(|b| {
            let (lo, hi) = b
                .iter()
                .fold((0f32, 0f32), |(a, c), &x| (a.min(x), c.max(x)));
            Encoding::compute(bw, lo as f64, hi as f64, true).scale
        })
        .collect()
}

/// The scale compression of blockwise scales ([out, nb] row-major): per channel `max / 2^scale_bits`, each
/// block's integer `clip(round_half_even(scale / per), 1, 2^scale_bits)`.
pub fn from_block_scales(
    scales: &[f64],
    nb: usize,
    block: usize,
    bw: u32,
    scale_bits: u32,
) -> Lpbq {
    let levels = 2f64.powi(scale_bits as i32);
    let mut channel_scale = Vec::with_capacity(scales.len() / nb);
    let mut int_scale = Vec::with_capacity(scales.len());
    for row in scales.chunks(nb) {
        let per = row.iter().fold(0f64, |a, &s| a.max(s)) / levels;
        channel_scale.push(per);
        // numpy's round is half to even.
        int_scale.extend(
            row.iter()
                .map(|s| (s / per).round_ties_even().clamp(1.0, levels) as u32),
        );
    }
    Lpbq {
        bw,
        scale_bits,
        block,
        channel_scale,
        int_scale,
    }
}

impl Lpbq {
    /// The encoding of block `b` of channel `c` after compression (`scale'_b = int_b · per_channel`).
    pub fn block_encoding(&self, c: usize, b: usize, nb: usize) -> Encoding {
        let scale = self.int_scale[c * nb + b] as f64 * self.channel_scale[c];
        let pos = 2f64.powi(self.bw as i32 - 1) - 1.0;
        let neg = 2f64.powi(self.bw as i32 - 1);
        Encoding {
            bitwidth: self.bw,
            dtype: "int".into(),
            is_symmetric: true,
            min: -neg * scale,
            max: pos * scale,
            offset: -neg as i64,
            scale,
        }
    }

    /// Quantize→dequantize `w` [out, in] in place on the compressed block grids, with aimet-onnx's LPBQ
    /// arithmetic (measured against its QuantizationSimModel: the same integers; values within 2 ulps): the integer from
    /// `round(x / scale)` in f64 (`scale = int · per_channel` in f64), the value `q · (int · f32(per_channel))`
    /// in f32 — the exported DequantizeLinear chain's product, bit for bit.
    pub fn fake(&self, w: &mut [f32], cols: usize) {
        // Compiled for AVX2 where the CPU has it: `round_ties_even` on f64 is then one instruction instead
        // of a libm call per weight (ablate bakes 1.9 G of these per LPBQ grid at E2B).
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2")]
        unsafe fn avx2(l: &Lpbq, w: &mut [f32], cols: usize) {
            l.fake_body(w, cols)
        }
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2.
            return unsafe { avx2(self, w, cols) };
        }
        self.fake_body(w, cols)
    }

    /// One weight's grid point: row `c`, input `col` (the arithmetic of [`Self::fake`]).
    pub fn fake_one(&self, c: usize, col: usize, x: f32, cols: usize) -> f32 {
        let nb = cols / self.block;
        let b = col / self.block;
        let s = self.int_scale[c * nb + b] as f64 * self.channel_scale[c];
        let s32 = self.int_scale[c * nb + b] as f32 * self.channel_scale[c] as f32;
        let h = 2f64.powi(self.bw as i32 - 1);
        (x as f64 / s).round_ties_even().clamp(-h, h - 1.0) as f32 * s32
    }

    #[inline(always)]
    fn fake_body(&self, w: &mut [f32], cols: usize) {
        let nb = cols / self.block;
        let (lo, hi) = (
            -(2f64.powi(self.bw as i32 - 1)),
            2f64.powi(self.bw as i32 - 1) - 1.0,
        );
        for (c, row) in w.chunks_mut(cols).enumerate() {
            for (b, blk) in row.chunks_mut(self.block).enumerate() {
                let s = self.int_scale[c * nb + b] as f64 * self.channel_scale[c];
                // The value as the exported chain dequantizes it: block scale = int · f32(per-channel) in
                // f32 (DequantizeLinear), then q · block scale — the same as f32(s) when the per-channel
                // scale is an f32 value, and what onnxruntime computes when it is not.
                let s32 = self.int_scale[c * nb + b] as f32 * self.channel_scale[c] as f32;
                for x in blk.iter_mut() {
                    let q = (*x as f64 / s).round_ties_even().clamp(lo, hi);
                    *x = q as f32 * s32;
                }
            }
        }
    }

    /// Bits per weight as stored: bw-bit weights, one int scale per block in a byte, one f32 per channel.
    pub fn bits_per_weight(&self, cols: usize) -> f64 {
        self.bw as f64 + 8.0 / self.block as f64 + 32.0 / cols as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_computed_block_scales() {
        // One channel, two blocks of 4: absmax 7 and 0.7 → scales 1.0 and 0.1 (max/7) ; per = 1/16;
        // int = round(16) = 16 and round(1.6) = 2 → 0.125; weights on a 0.125 grid in block 2.
        let w = [7.0, -1.0, 2.0, 3.0, 0.7, 0.1, -0.3, 0.2];
        let l = encode(&w, 8, 4, 4, 4);
        assert_eq!(l.channel_scale, vec![1.0 / 16.0]);
        assert_eq!(l.int_scale, vec![16, 2]);
        let mut q = w;
        l.fake(&mut q, 8);
        assert_eq!(q, [7.0, -1.0, 2.0, 3.0, 0.75, 0.125, -0.25, 0.25]);
    }
}
