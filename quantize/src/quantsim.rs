//! Quantsim: an interpreter hook that replaces every encoded tensor by its quantize→dequantize copy —
//! activations as they are produced, params as they are loaded (per output channel for MatMul weights).

use crate::Encodings;
use candle_core::{Device, Tensor};
use hexq_graph::interp::Hook;
use hexq_kernels::RowWeight;
use std::collections::HashMap;
use std::sync::Arc;

#[derive(Clone)]
pub struct FakeQuant {
    enc: Arc<HashMap<String, Vec<crate::Encoding>>>,
    /// LPBQ weights (their [in, out] view names), quantized with aimet-onnx's LPBQ arithmetic.
    lpbq: Arc<HashMap<String, crate::lpbq::Lpbq>>,
    /// Params round ties half away from zero, activations half to even ([`crate::Encoding::quantize_param`]).
    params: bool,
    /// Tensors already on their grid (see [`FakeQuant::on_grid`]): left as they are.
    on_grid: Arc<std::collections::HashSet<String>>,
}

impl FakeQuant {
    /// Only the activation encodings (params are baked into the weights once instead).
    pub fn activations(e: &Encodings) -> Self {
        FakeQuant {
            enc: Arc::new(
                e.activation_encodings
                    .iter()
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect(),
            ),
            lpbq: Arc::default(),
            params: false,
            on_grid: Arc::default(),
        }
    }

    /// Every param of an encodings file: per-channel / per-tensor ones and the LPBQ weights.
    pub fn params_of(e: &Encodings) -> Self {
        FakeQuant {
            lpbq: Arc::new(
                e.lpbq_encodings
                    .iter()
                    .map(|(k, v)| (k.clone(), v.to_lpbq()))
                    .collect(),
            ),
            ..Self::from_params(&e.param_encodings)
        }
    }

    /// Only these (param) encodings: the weights as AIMET's calibration sees them.
    pub fn from_params(p: &std::collections::BTreeMap<String, Vec<crate::Encoding>>) -> Self {
        FakeQuant {
            enc: Arc::new(p.iter().map(|(k, v)| (k.clone(), v.clone())).collect()),
            lpbq: Arc::default(),
            params: true,
            on_grid: Arc::default(),
        }
    }

    /// Leave alone the outputs of value-preserving nodes of `g` (Transpose, Reshape, Slice) whose one
    /// activation encoding is bit for bit their input's: the input was fake-quantized on that grid, and
    /// fake-quant is idempotent there — x = m·s (|m| < 2^16) gives x/s within 2^-7 of m, so it re-rounds to
    /// m and back to x (test below). Spares the hook a copy of every transposed K view per step. `full`
    /// maps `g`'s names to the encodings' (a short-ring graph's, see `hexq_graph::build::spanning`).
    pub fn on_grid(mut self, g: &hexq_graph::ir::Graph, full: &HashMap<String, String>) -> Self {
        use hexq_graph::ir::Op;
        let name = |n: &String| full.get(n).unwrap_or(n).clone();
        let one = |n: &String| match self.enc.get(&name(n)).map(Vec::as_slice) {
            Some([e]) if (1e-30..=1e30).contains(&e.scale) && e.bitwidth <= 16 => Some(e),
            _ => None,
        };
        let set = g
            .nodes
            .iter()
            .filter(|n| {
                matches!(
                    n.op,
                    Op::Transpose { .. } | Op::Reshape { .. } | Op::Slice { .. }
                )
            })
            .filter(|n| {
                let (i, o) = (one(&n.inputs[0]), one(&n.outputs[0]));
                i.is_some() && i == o
            })
            .map(|n| name(&n.outputs[0]))
            .collect();
        self.on_grid = Arc::new(set);
        self
    }

    fn fake(&self, e: &crate::Encoding, x: f32) -> f32 {
        if self.params {
            e.fake_param(x)
        } else {
            e.fake(x)
        }
    }
}

/// `dst[i] = quantize_param(row[i]) − zp`, [`crate::Encoding::quantize_param`]'s arithmetic in a loop the
/// compiler vectorizes (AVX-512 or AVX2 where the CPU has it): the bake of an E2B decoder is 1.9 G of these.
fn param_ints(en: &crate::Encoding, row: &[f32], dst: &mut [i16]) {
    #[target_feature(enable = "avx512f")]
    #[cfg(target_arch = "x86_64")]
    unsafe fn wide(en: &crate::Encoding, row: &[f32], dst: &mut [i16]) {
        ints(en, row, dst)
    }
    /// [`ints`] in intrinsics: the compiler kept the saturating casts and the rounding's branches scalar
    /// (7 cycles an element; the E2B bake was 5 s of it). Same operations: `x / s + zp`, truncate, step by
    /// the fraction, sign of zero from `v`; |v| ≥ 2^23, inf and NaN pass; clamp; NaN → 0; minus `z`.
    #[target_feature(enable = "avx2")]
    #[cfg(target_arch = "x86_64")]
    unsafe fn avx2(en: &crate::Encoding, row: &[f32], dst: &mut [i16]) {
        use std::arch::x86_64::*;
        let (s, zp, qmax) = (en.scale as f32, -en.offset as f32, en.qmax() as f32);
        let z = -en.offset as i32;
        let n = row.len().min(dst.len());
        if !(qmax <= 32767.0 && (0..=32767).contains(&z)) {
            return ints(en, row, dst); // results past i16's range: the scalar wrap
        }
        let (vs, vzp, vq) = (_mm256_set1_ps(s), _mm256_set1_ps(zp), _mm256_set1_ps(qmax));
        let (half, one, zero) = (
            _mm256_set1_ps(0.5),
            _mm256_set1_ps(1.0),
            _mm256_setzero_ps(),
        );
        let (sign, big) = (_mm256_set1_ps(-0.0), _mm256_set1_ps(8_388_608.0));
        let vz = _mm256_set1_epi32(z);
        let n8 = n / 8 * 8;
        for i in (0..n8).step_by(8) {
            let v = _mm256_add_ps(_mm256_div_ps(_mm256_loadu_ps(row.as_ptr().add(i)), vs), vzp);
            let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(v);
            let f = _mm256_sub_ps(v, t);
            let same = _mm256_or_ps(_mm256_andnot_ps(sign, t), _mm256_and_ps(sign, v));
            let r = _mm256_blendv_ps(
                same,
                _mm256_sub_ps(t, one),
                _mm256_cmp_ps::<_CMP_LE_OQ>(f, _mm256_sub_ps(zero, half)),
            );
            let r = _mm256_blendv_ps(
                r,
                _mm256_add_ps(t, one),
                _mm256_cmp_ps::<_CMP_GE_OQ>(f, half),
            );
            let small = _mm256_cmp_ps::<_CMP_LT_OQ>(_mm256_andnot_ps(sign, v), big);
            let r = _mm256_blendv_ps(v, r, small);
            let r = _mm256_blendv_ps(r, zero, _mm256_cmp_ps::<_CMP_LT_OQ>(r, zero));
            let r = _mm256_blendv_ps(r, vq, _mm256_cmp_ps::<_CMP_GT_OQ>(r, vq));
            let r = _mm256_and_ps(r, _mm256_cmp_ps::<_CMP_ORD_Q>(r, r)); // NaN → 0
            let q = _mm256_sub_epi32(_mm256_cvttps_epi32(r), vz);
            let p = _mm256_permute4x64_epi64::<0b1000>(_mm256_packs_epi32(q, q));
            _mm_storeu_si128(
                dst.as_mut_ptr().add(i) as *mut __m128i,
                _mm256_castsi256_si128(p),
            );
        }
        ints(en, &row[n8..n], &mut dst[n8..n])
    }
    #[inline(always)]
    fn ints(en: &crate::Encoding, row: &[f32], dst: &mut [i16]) {
        let (s, zp, qmax) = (en.scale as f32, -en.offset as f32, en.qmax() as f32);
        let z = -en.offset as i32;
        for (d, &x) in dst.iter_mut().zip(row) {
            // Clamped to [0, qmax] first, so the i32 cast is exact (NaN → 0, as the i64 cast gives).
            let v = crate::round_half_away(x / s + zp).clamp(0.0, qmax);
            *d = (v as i32 - z) as i16;
        }
    }
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F.
        return unsafe { wide(en, row, dst) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2.
        return unsafe { avx2(en, row, dst) };
    }
    ints(en, row, dst)
}

impl Hook for FakeQuant {
    /// Per-channel (or per-tensor) params of ≤ 8 bits on a MatMul weight's rows, kept as integers: row j is
    /// `(q − zp) · scale_j`, which is exactly [`crate::Encoding::fake_param`]'s f32 value.
    fn weight_rows(&mut self, name: &str, w: &RowWeight) -> Option<RowWeight> {
        let e = self.enc.get(name)?;
        if !self.params || self.lpbq.contains_key(name) || !(e.len() == w.out || e.len() == 1) {
            return None;
        }
        if e.iter().any(|x| x.bitwidth > 8) {
            return None;
        }
        if w.is_ints() {
            return None;
        }
        // Rows in parallel (one weight is up to 400 M values at E2B; bake hands weights over one at a time),
        // straight into the stored form.
        let scale = (0..w.out)
            .map(|j| e[if e.len() == 1 { 0 } else { j }].scale as f32)
            .collect();
        Some(RowWeight::ints_with(
            w.out,
            w.inp,
            scale,
            w.inp,
            |j, dst, buf| param_ints(&e[if e.len() == 1 { 0 } else { j }], w.row(j, buf), dst),
        ))
    }

    fn tensor(&mut self, name: &str, t: &Tensor) -> Option<Tensor> {
        self.quant(name, t)
    }

    /// A batch's tensors in parallel: each replacement is a function of its name and values alone.
    fn tensors(&mut self, name: &str, ts: &[Tensor]) -> Vec<Option<Tensor>> {
        use rayon::prelude::*;
        let work: usize = ts.iter().map(|t| t.elem_count()).sum();
        if ts.len() < 2 || work < hexq_graph::interp::PAR_MIN || !self.enc.contains_key(name) {
            return ts.iter().map(|t| self.quant(name, t)).collect();
        }
        let me = &*self;
        ts.par_iter().map(|t| me.quant(name, t)).collect()
    }
}

impl FakeQuant {
    /// [`Hook::tensor`]'s replacement, by reference (no state changes).
    fn quant(&self, name: &str, t: &Tensor) -> Option<Tensor> {
        if self.on_grid.contains(name) {
            return None;
        }
        if let Some(l) = self.lpbq.get(name) {
            // [in, out] view of an [out, in] weight: quantize the rows, transpose back.
            let w = t.t().ok()?.contiguous().ok()?;
            let (out, cols) = w.dims2().ok()?;
            let mut v: Vec<f32> = w.flatten_all().ok()?.to_vec1().ok()?;
            l.fake(&mut v, cols);
            return Tensor::from_vec(v, (out, cols), &Device::Cpu)
                .ok()?
                .t()
                .ok();
        }
        let e = self.enc.get(name)?;
        if t.dtype() != candle_core::DType::F32 {
            return None;
        }
        let dims = t.dims().to_vec();
        if e.len() == 1 && !self.params {
            let mut q = Vec::new();
            hexq_graph::interp::with_f32(t, |v| e[0].fake_into(v, &mut q)).ok()?;
            return Tensor::from_vec(q, dims.as_slice(), &Device::Cpu).ok();
        }
        if e.len() == 1 {
            let q: Vec<f32> = hexq_graph::interp::with_f32(t, |v| {
                v.iter().map(|&x| self.fake(&e[0], x)).collect()
            })
            .ok()?;
            return Tensor::from_vec(q, dims.as_slice(), &Device::Cpu).ok();
        }
        // Per-channel MatMul weight seen as the [in, out] view of an [out, in] tensor: channel = last axis.
        let out = *dims.last()?;
        if out != e.len() {
            return None;
        }
        let w = t.t().ok()?.contiguous().ok()?; // [out, in] rows
        let me = self;
        let v: Vec<f32> = w.flatten_all().ok()?.to_vec1().ok()?;
        let cols = v.len() / out;
        let q: Vec<f32> = v
            .chunks(cols)
            .zip(e.iter())
            .flat_map(|(row, en)| row.iter().map(move |&x| me.fake(en, x)))
            .collect();
        Tensor::from_vec(q, (out, cols), &Device::Cpu)
            .ok()?
            .t()
            .ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What [`FakeQuant::on_grid`] rests on: a fake-quantized value fake-quantizes to itself, bit for bit
    /// (8- and 16-bit, symmetric and not, tiny to large scales, values far outside the range).
    #[test]
    fn fake_quant_is_idempotent_on_its_grid() {
        let xs: Vec<f32> = (0..200_003)
            .map(|i| ((i as f32 * 0.618034).fract() - 0.5) * 3.0 * (1.0 + (i % 7) as f32))
            .chain([
                0.0,
                -0.0,
                f32::NAN,
                f32::INFINITY,
                -f32::INFINITY,
                1e30,
                -1e30,
            ])
            .collect();
        for bw in [8, 16] {
            for (lo, hi, sym) in [
                (-1.0, 1.0, false),
                (-0.3, 7.9, false),
                (-1e-4, 2.5e-4, true),
                (-3.2e3, 1.0e4, false),
                (-20.0, 20.0, true),
                (0.0, 1e-20, false),
            ] {
                let e = crate::Encoding::compute(bw, lo, hi, sym);
                let xs: Vec<f32> = xs.iter().map(|x| x * (hi - lo) as f32).collect();
                let (mut once, mut twice) = (Vec::new(), Vec::new());
                e.fake_into(&xs, &mut once);
                e.fake_into(&once, &mut twice);
                for (a, b) in once.iter().zip(&twice) {
                    assert_eq!(a.to_bits(), b.to_bits(), "{e:?}: {a} → {b}");
                }
            }
        }
    }

    /// The vectorized bake equals `quantize_param − zp` element for element (halves, NaN, infinities).
    #[test]
    fn param_ints_equal_quantize_param() {
        for (lo, hi, sym) in [(-0.31, 0.47, true), (-0.2, 0.9, false)] {
            let en = crate::Encoding::compute(8, lo, hi, sym);
            let row: Vec<f32> = (0..4000)
                .map(|i| ((i * 7919 % 3999) as f32 - 1999.5) * 3.1e-4)
                .chain([f32::NAN, f32::INFINITY, -f32::INFINITY, 0.0, -0.0])
                .chain((0..256).map(|k| (k as f32 - 128.0 + 0.5) * en.scale as f32))
                .collect();
            let mut got = vec![0i16; row.len()];
            param_ints(&en, &row, &mut got);
            for (g, &x) in got.iter().zip(&row) {
                assert_eq!(*g as i64, en.quantize_param(x) + en.offset, "{x}");
            }
        }
    }
}
