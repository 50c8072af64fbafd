//! One tensor's (or channel's) encoding: AIMET's min-max rule, the quantize/dequantize arithmetic of AIMET
//! (params) and ONNX (activations), and the vectorized fake-quant quantsim runs.

use serde::{Deserialize, Serialize};

/// aimet-onnx 2.x's smallest scale (`common/quantsim.py::_get_minimum_scale`): the largest s ≤ f32 eps with
/// the grid still covering ±0.005 — so a range narrower than `steps·s` is widened to it (0.0078 at 16 bits;
/// libpymo's older MIN_RANGE of 0.01 differs, which the whole-graph AIMET judge caught on the norms' eps).
pub fn min_scale(steps: f64) -> f64 {
    (f32::EPSILON as f64).min(0.01 / steps)
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Encoding {
    pub bitwidth: u32,
    pub dtype: String,
    #[serde(serialize_with = "ser_bool_str", deserialize_with = "de_bool_str")]
    pub is_symmetric: bool,
    pub max: f64,
    pub min: f64,
    pub offset: i64,
    pub scale: f64,
}

fn ser_bool_str<S: serde::Serializer>(b: &bool, s: S) -> std::result::Result<S::Ok, S::Error> {
    // AIMET writes "True"/"False" strings in encodings 0.6.1.
    s.serialize_str(if *b { "True" } else { "False" })
}
fn de_bool_str<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<bool, D::Error> {
    let v = serde_json::Value::deserialize(d)?;
    Ok(matches!(v.as_str(), Some("True") | Some("true")) || v.as_bool() == Some(true))
}

impl Encoding {
    /// AIMET min-max encoding for an observed range.
    pub fn compute(bw: u32, min: f64, max: f64, symmetric: bool) -> Encoding {
        let new_min = min.min(0.0);
        let steps = 2f64.powi(bw as i32) - 1.0;
        let new_max = max.max(0.0).max(new_min + steps * min_scale(steps));
        if symmetric {
            // aimet-onnx 2.x: the grid [-128, 127]·scale must cover both ends, so the negative side gets its
            // 128 steps: scale = max(-min/128, max/127) (libpymo's older absmax/127 differs by 128/127 on
            // channels whose largest magnitude is negative — measured against aimet-onnx 2.42).
            let pos = (steps / 2.0).floor();
            let neg = (steps / 2.0).ceil();
            let scale = (new_max / pos).max(-new_min / neg);
            let offset = -neg;
            Encoding {
                bitwidth: bw,
                dtype: "int".into(),
                is_symmetric: true,
                min: offset * scale,
                max: scale * pos,
                offset: offset as i64,
                scale,
            }
        } else {
            let scale = (new_max - new_min) / steps;
            let offset = if new_min < 0.0 && new_max > 0.0 {
                -(-new_min / scale).round().clamp(0.0, steps)
            } else {
                (new_min / scale).round()
            };
            let emin = scale * offset;
            Encoding {
                bitwidth: bw,
                dtype: "int".into(),
                is_symmetric: false,
                min: emin,
                max: new_max - new_min + emin,
                offset: offset as i64,
                scale,
            }
        }
    }

    pub fn qmax(&self) -> f64 {
        2f64.powi(self.bitwidth as i32) - 1.0
    }

    /// quantize → dequantize, with ONNX QuantizeLinear/DequantizeLinear's arithmetic exactly: f32 scale,
    /// `x / scale` in f32, round half to even, saturate, `(q − zero_point)·scale` in f32 — so hexq's quantsim
    /// and the exported QDQ graph agree bit for bit on every tensor (an f64 division or half-away rounding
    /// moves values that sit on a rounding boundary by one step, and a deep int16 graph amplifies that).
    #[inline]
    pub fn fake(&self, x: f32) -> f32 {
        self.dequantize(self.quantize(x))
    }

    /// `(q − zero_point)·scale` in f32 (DequantizeLinear's arithmetic) for an unsigned-grid integer.
    #[inline]
    pub fn dequantize(&self, q: i64) -> f32 {
        (q as f32 - (-self.offset) as f32) * self.scale as f32
    }

    /// The integer on the unsigned grid `[0, 2^bw − 1]` (ONNX's arithmetic, see [`Encoding::fake`]).
    #[inline]
    pub fn quantize(&self, x: f32) -> i64 {
        let zp = -self.offset as f32;
        ((x / self.scale as f32).round_ties_even() + zp).clamp(0.0, self.qmax() as f32) as i64
    }

    /// [`Encoding::fake`] over a slice, into `dst` (cleared first): the same f32 operations in a loop the
    /// compiler vectorizes — on baseline x86-64 `round_ties_even` is a libm call per element, and quantsim
    /// fake-quantizes every activation of every position (verify at E2B: ~1/3 of its time was this).
    pub fn fake_into(&self, src: &[f32], dst: &mut Vec<f32>) {
        #[target_feature(enable = "avx512f")]
        #[cfg(target_arch = "x86_64")]
        unsafe fn wide(e: &Encoding, src: &[f32], dst: &mut [f32]) {
            each(e, src, dst)
        }
        #[target_feature(enable = "avx2")]
        #[cfg(target_arch = "x86_64")]
        unsafe fn avx2(e: &Encoding, src: &[f32], dst: &mut [f32]) {
            each(e, src, dst)
        }
        #[inline(always)]
        fn each(e: &Encoding, src: &[f32], dst: &mut [f32]) {
            let (s, zp, qmax) = (e.scale as f32, -e.offset as f32, e.qmax() as f32);
            for (d, &x) in dst.iter_mut().zip(src) {
                // max/min instead of clamp: NaN → 0, as `quantize`'s `as i64` gives; the clamped value is
                // an integer in [0, qmax], so it equals `quantize`'s `q as f32`.
                let q = ((x / s).round_ties_even() + zp).max(0.0).min(qmax);
                *d = (q - zp) * s;
            }
        }
        dst.clear();
        dst.resize(src.len(), 0.0);
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F.
            return unsafe { wide(self, src, dst) };
        }
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (and so SSE4.1's roundps for round_ties_even).
            return unsafe { avx2(self, src, dst) };
        }
        each(self, src, dst)
    }

    /// [`Encoding::fake_param`] over a slice in place, in a loop the compiler vectorizes (the integer stays
    /// an f32: clamped to [0, qmax] it is exact, so `(q − zp)·scale` is the same product; NaN → 0 as the
    /// `as i64` in `quantize_param` gives). Ablate grids every weight of an E2B decoder per scheme with it.
    pub fn fake_params(&self, xs: &mut [f32]) {
        #[target_feature(enable = "avx2")]
        #[cfg(target_arch = "x86_64")]
        unsafe fn avx2(e: &Encoding, xs: &mut [f32]) {
            each(e, xs)
        }
        #[inline(always)]
        fn each(e: &Encoding, xs: &mut [f32]) {
            let (s, zp, qmax) = (e.scale as f32, -e.offset as f32, e.qmax() as f32);
            for x in xs.iter_mut() {
                let q = round_half_away(*x / s + zp).max(0.0).min(qmax);
                *x = (q - zp) * s;
            }
        }
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2.
            return unsafe { avx2(self, xs) };
        }
        each(self, xs)
    }

    /// [`Encoding::fake`] for params, on [`Encoding::quantize_param`]'s integer.
    #[inline]
    pub fn fake_param(&self, x: f32) -> f32 {
        self.dequantize(self.quantize_param(x))
    }

    /// The integer a param (weight, constant) is stored as: AIMET's arithmetic (libpymo, measured against
    /// aimet-onnx 2.42's quantize_dequantize: 0 of 522 240 weights differ), `round_half_away(x / scale −
    /// offset)` in f32 — the zero point is added *before* rounding, which moves the f32 rounding point, so 6
    /// of those weights land one step from ONNX's `round_half_even(x / scale) + zp`. One weight a step off
    /// moves int16 activation ranges downstream by tens of LSB, so params follow the tool the encodings
    /// are judged by (and that QAIRT's flow quantizes with); activations keep ONNX's rule.
    #[inline]
    pub fn quantize_param(&self, x: f32) -> i64 {
        let zp = -self.offset as f32;
        round_half_away(x / self.scale as f32 + zp).clamp(0.0, self.qmax() as f32) as i64
    }
}

/// `f32::round` (half away from zero) without the libm call it becomes on baseline x86-64 (no SSE4.1), so
/// loops over weights vectorize: truncate, then step away from zero when the dropped fraction is ≥ ½ (the
/// fraction `v − trunc(v)` is exact below 2^23; above it every f32 is an integer already).
#[inline]
pub fn round_half_away(v: f32) -> f32 {
    if !(v.abs() < 8_388_608.0) {
        return v; // integers, inf, NaN
    }
    let t = v as i32 as f32;
    let f = v - t;
    if f >= 0.5 {
        t + 1.0
    } else if f <= -0.5 {
        t - 1.0
    } else {
        t.copysign(v)
    }
}

#[cfg(test)]
mod round_tests {
    /// The vectorized fake-quant equals `fake` bit for bit (ties, NaN, infinities, zeros, far outside).
    #[test]
    fn fake_into_equals_fake_bit_for_bit() {
        // (fake_params against fake_param on the same values, below.)
        for (bw, lo, hi, sym) in [
            (16, -3.1, 7.9, false),
            (16, -1e4, 2.5, false),
            (8, -0.3, 0.4, true),
        ] {
            let e = super::Encoding::compute(bw, lo, hi, sym);
            let s = e.scale as f32;
            let x: Vec<f32> = (0..5000)
                .map(|i| ((i * 7919 % 4999) as f32 - 2499.5) * 4.3e-3)
                .chain((0..300).map(|k| (k as f32 - 150.0 + 0.5) * s)) // ties
                .chain([
                    f32::NAN,
                    f32::INFINITY,
                    -f32::INFINITY,
                    0.0,
                    -0.0,
                    1e30,
                    -1e30,
                    -1e4,
                ])
                .collect();
            let mut got = Vec::new();
            e.fake_into(&x, &mut got);
            for (g, &v) in got.iter().zip(&x) {
                assert_eq!(g.to_bits(), e.fake(v).to_bits(), "{v}");
            }
            let mut params = x.clone();
            e.fake_params(&mut params);
            for (g, &v) in params.iter().zip(&x) {
                assert_eq!(g.to_bits(), e.fake_param(v).to_bits(), "param {v}");
            }
        }
    }

    /// Bit-identical to `f32::round` on halves, near-halves, signs, zeros, large and non-finite values.
    #[test]
    fn round_half_away_is_f32_round() {
        let mut v = vec![
            0.0f32,
            -0.0,
            0.5,
            -0.5,
            1.5,
            -1.5,
            2.5,
            -2.5,
            0.49999997,
            -0.49999997,
            8388607.5,
            -8388607.5,
            8388608.0,
            1e20,
            -1e20,
            f32::INFINITY,
            f32::NEG_INFINITY,
            127.5,
            -128.5,
            254.99998,
        ];
        let mut s = 1u64;
        for _ in 0..100_000 {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            v.push(f32::from_bits((s >> 32) as u32));
            v.push(((s >> 40) as f32 / 65536.0 - 128.0) * 2.0);
        }
        for x in v {
            let (a, b) = (super::round_half_away(x), x.round());
            assert!(
                a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                "{x}: {a} vs {b}"
            );
        }
    }
}
