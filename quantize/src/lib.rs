//! hexq-quantize: A16W8 encodings in the AIMET format QNN's converter takes as `--quantization_overrides`,
//! and the fake-quant hook quantsim runs with.
//!
//! The math is AIMET's min_max scheme, as implemented in libpymo (aimet `DlQuantization/quantization_utils.cpp`
//! `getComputedEncodings` and `TfEncodingAnalyzer::computeEncoding`, read for this crate):
//! - range widened to include 0: `min = min(min, 0)`, `max = max(max, 0)`, and `max >= min + 0.01`;
//! - asymmetric (activations, int16): `scale = (max - min) / (2^bw - 1)`, `offset = -round(-min / scale)`
//!   clamped to [-(2^bw-1), 0], then `min = offset·scale`, `max = min + (max_orig - min_orig)`;
//! - symmetric (weights, int8 per output channel): `offset = -ceil((2^bw-1)/2)` (= -128),
//!   `scale = max(max / 127, -min / 128)` — aimet-onnx 2.42's rule, checked against it channel by channel
//!   (libpymo's older `absmax / 127` differs by 128/127 where the largest magnitude is negative);
//!   `min = offset·scale`, `max = 127·scale`;
//! - quantize `q = clamp(round(x/scale) - offset, 0, 2^bw-1)`, dequantize `(q + offset)·scale` (QNN's
//!   convention: real = scale·(q + offset), offset ≤ 0).
//!
//! Gemma-4 has no biases, so no int32 bias encodings are emitted (the rule would be scale_act × scale_w).
//!
//! One deliberate departure from plain min-max, on by default (`Scheme::mask_floor`): a masked softmax input
//! (`scores + mask`, the mask holding NEG = -1e4) is encoded over `[min(scores) - 32, max]` instead of
//! `[-1e4, max]`. The quantizer saturates the masked slots to the floor, where each weighs at most e^-32
//! (≈1e-14, far under the int16 probability step), and the real scores get a step ~150× finer (0.0015
//! instead of 0.153 on the tiny model). With the full range a 1-step flip of a score moves its softmax weight
//! by 16 %: it was the largest quantization error of the graph and the amplifier of engine differences.

//!
//! The room: `lib.rs` (schemes, the encodings file, `encode`), `encoding.rs` (one encoding's arithmetic),
//! `overrides.rs`, `ties.rs` (shared encodings), `lpbq.rs`, `quantsim.rs` (the fake-quant hook).
//! May import: model, graph, kernels, calibrate (its stats).

mod encoding;
pub mod lpbq;
mod overrides;
pub mod quantsim;
pub mod rounding;
mod ties;

pub use encoding::{min_scale, round_half_away, Encoding};
pub use overrides::{glob, Kind, Overrides, Rule};
use ties::grid_source;
pub use ties::tie_groups;

use hexq_calibrate::Stats;
use hexq_graph::ir::{Graph, InitSource, Op};
use hexq_model::{Checkpoint, Error, Result};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

pub struct Scheme {
    pub act_bw: u32,
    pub weight_bw: u32,
    /// Other float constants (norm weights, scalars, tables): per-tensor asymmetric at this width.
    pub const_bw: u32,
    pub int8_kv: bool,
    /// MatMul weights on LPBQ grids of this block size (int4, 4-bit block scales) instead of per-channel
    /// `weight_bw`; a weight whose input dimension the block does not divide stays per channel (as
    /// aimet-onnx's `strict=False`), and an override rule matching a weight wins.
    pub lpbq_block: Option<usize>,
    /// Masked softmax inputs encoded over `[min(scores) - floor, max]` (module docs); None = plain min-max
    /// over the mask constant too (aimet-onnx's default behaviour).
    pub mask_floor: Option<f64>,
}

/// e^-32 ≈ 1.3e-14 per masked slot: negligible next to the int16 probability step even at 4096 slots.
pub const MASK_FLOOR: f64 = 32.0;

impl Scheme {
    pub fn a16w8(int8_kv: bool) -> Self {
        Scheme {
            act_bw: 16,
            weight_bw: 8,
            const_bw: 16,
            int8_kv,
            lpbq_block: None,
            mask_floor: Some(MASK_FLOOR),
        }
    }

    /// W4A16 as Qualcomm's Gemma recipe: int16 activations, int4 MatMul weights per channel (`block`
    /// None) or on LPBQ grids of `block`.
    pub fn w4a16(block: Option<usize>) -> Self {
        Scheme {
            weight_bw: 4,
            lpbq_block: block,
            ..Self::a16w8(false)
        }
    }

    pub fn name(&self) -> String {
        match (self.weight_bw, self.lpbq_block) {
            (4, Some(b)) => format!("w4a16_lpbq{b}"),
            (4, None) => "w4a16_pc".into(),
            (w, _) => format!(
                "a{}w{w}{}",
                self.act_bw,
                if self.int8_kv { "_int8kv" } else { "" }
            ),
        }
    }
}

/// Masked softmax inputs: `Add(scores, mask)` nodes whose output feeds a Softmax and one of whose inputs is
/// an in-graph mask (`mask.*`). Returns output → scores input.
pub fn masked_softmax_inputs(g: &Graph) -> BTreeMap<String, String> {
    let softmax_in: std::collections::HashSet<&str> = g
        .nodes
        .iter()
        .filter(|n| matches!(n.op, Op::Softmax { .. }))
        .map(|n| n.inputs[0].as_str())
        .collect();
    g.nodes
        .iter()
        .filter(|n| n.op == Op::Add && softmax_in.contains(n.outputs[0].as_str()))
        .filter_map(|n| {
            let (a, b) = (&n.inputs[0], &n.inputs[1]);
            match (a.starts_with("mask."), b.starts_with("mask.")) {
                (false, true) => Some((n.outputs[0].clone(), a.clone())),
                (true, false) => Some((n.outputs[0].clone(), b.clone())),
                _ => None,
            }
        })
        .collect()
}

/// The encodings file (AIMET 0.6.1 layout): activation and param encodings by tensor name.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Encodings {
    pub version: String,
    pub activation_encodings: BTreeMap<String, Vec<Encoding>>,
    pub param_encodings: BTreeMap<String, Vec<Encoding>>,
    /// MatMul weights on LPBQ grids (scheme w4a16-lpbq), in AIMET 1.0.0's entry form; such a weight has no
    /// `param_encodings` entry.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub lpbq_encodings: BTreeMap<String, lpbq::LpbqEncoding>,
    /// hexq provenance (ignored by QNN): scheme, hashes.
    #[serde(default)]
    pub hexq: serde_json::Value,
}

impl Encodings {
    pub fn from_file(p: &std::path::Path) -> Result<Self> {
        let t = std::fs::read_to_string(p).map_err(|e| Error::io(p, e))?;
        serde_json::from_str(&t).map_err(|e| Error::file(p, format!("invalid encodings: {e}")))
    }
}

/// Problems the guards report; `quantize` refuses them unless forced.
pub fn check_stats(stats: &Stats) -> Vec<String> {
    let mut w = Vec::new();
    if !stats.chat_formatted {
        w.push("the calibration set was not chat-formatted (raw text or noise)".into());
    }
    for (n, r) in &stats.tensors {
        let maskish = n.contains("mask") || n.contains("scores");
        if !r.min.is_finite()
            || !r.max.is_finite()
            || r.min <= -1e30
            || r.max >= 1e30
            || (maskish && r.min < -2e4)
        {
            w.push(format!(
                "{n}: range [{}, {}] holds a mask constant outside ±1e4 (-inf / f32::MIN destroy the int16 range of every tensor they reach; use NEG = -1e4)",
                r.min, r.max
            ));
        } else if r.min == r.max {
            w.push(format!(
                "{n}: degenerate range (min = max = {}); the calibration never exercised it",
                r.min
            ));
        }
    }
    w
}

/// The initializers that are a MatMul's second input: the weights AIMET has param quantizers on (its
/// other constants get activation quantizers, which pass values through while it calibrates).
pub fn matmul_weights(graph: &Graph) -> std::collections::HashSet<&str> {
    let inits: std::collections::HashSet<&str> =
        graph.initializers.iter().map(|i| i.name.as_str()).collect();
    graph
        .nodes
        .iter()
        .filter(|n| n.op == Op::MatMul)
        .filter_map(|n| n.inputs.get(1).map(|s| s.as_str()))
        .filter(|s| inits.contains(s))
        .collect()
}

/// The params fake-quantized while calibrating (`hexq calibrate --params int8`), AIMET's sequence: MatMul
/// weights quantize-dequantized on their A16W8 grid, every other constant passed through.
pub fn calibration_params(
    ck: &Checkpoint,
    graph: &Graph,
    ov: &Overrides,
) -> Result<BTreeMap<String, Vec<Encoding>>> {
    let mut pe = param_encodings(ck, graph, &Scheme::a16w8(false), ov)?;
    let mw = matmul_weights(graph);
    pe.retain(|k, _| mw.contains(k.as_str()));
    Ok(pe)
}

/// Param encodings only (they need no calibration): MatMul weights per output channel, symmetric; other
/// float constants per tensor, asymmetric.
pub fn param_encodings(
    ck: &Checkpoint,
    graph: &Graph,
    scheme: &Scheme,
    ov: &Overrides,
) -> Result<BTreeMap<String, Vec<Encoding>>> {
    let mut out = BTreeMap::new();
    // Params: MatMul weights per output channel (symmetric), other float constants per tensor (asymmetric).
    let matmul_weights = matmul_weights(graph);
    let inits: Vec<_> = graph
        .initializers
        .iter()
        .filter(|i| i.ty.dtype.is_float())
        .collect();
    let computed: Vec<Result<(String, Vec<Encoding>)>> = inits
        .par_iter()
        .map(|i| {
            let rule = ov.find(Kind::Param, &i.name);
            let nonfinite = |v: f32| Error::Encoding {
                tensor: i.name.clone(),
                msg: format!("non-finite value {v} in the weights"),
            };
            if matmul_weights.contains(i.name.as_str()) {
                if let InitSource::Weight {
                    tensor,
                    transpose: true,
                } = &i.source
                {
                    // Checkpoint layout [out, in]: one encoding per output channel = per row, each row's
                    // range read from the stored bytes (no f32 copy of the weight).
                    let bw = rule.map(|r| r.bitwidth).unwrap_or(scheme.weight_bw);
                    let ranges = row_ranges(ck, tensor)?;
                    if let Some(r) = ranges
                        .iter()
                        .position(|(l, h)| !l.is_finite() || !h.is_finite())
                    {
                        let mut row = Vec::new();
                        ck.rows_f32_into(ck.info(tensor)?, r, r + 1, &mut row);
                        return Err(nonfinite(
                            row.into_iter().find(|v| !v.is_finite()).unwrap_or(f32::NAN),
                        ));
                    }
                    let e = ranges
                        .iter()
                        .map(|&(lo, hi)| {
                            Encoding::compute(
                                bw,
                                lo as f64,
                                hi as f64,
                                rule.and_then(|r| r.symmetric).unwrap_or(true),
                            )
                        })
                        .collect();
                    return Ok((i.name.clone(), e));
                }
            }
            let vals: Vec<f32> = match &i.source {
                InitSource::F32(v) => v.clone(),
                InitSource::Weight { tensor, .. } => ck.f32(tensor)?,
                InitSource::I64(_) => unreachable!(),
            };
            let (lo, hi) = hexq_model::weights::min_max(&vals);
            if let Some(bad) = (!lo.is_finite() || !hi.is_finite())
                .then(|| vals.iter().find(|v| !v.is_finite()))
                .flatten()
            {
                return Err(nonfinite(*bad));
            }
            let bw = rule.map(|r| r.bitwidth).unwrap_or(scheme.const_bw);
            Ok((
                i.name.clone(),
                vec![Encoding::compute(
                    bw,
                    lo as f64,
                    hi as f64,
                    rule.and_then(|r| r.symmetric).unwrap_or(false),
                )],
            ))
        })
        .collect();
    for c in computed {
        let (n, e) = c?;
        out.insert(n, e);
    }
    Ok(out)
}

/// (min, max) of every row of a 2-D checkpoint weight, rows in parallel through a reused buffer. NaN
/// counts as +inf ([`hexq_model::weights::min_max`]).
fn row_ranges(ck: &Checkpoint, tensor: &str) -> Result<Vec<(f32, f32)>> {
    let info = ck.info(tensor)?;
    let rows = info.shape[0];
    const CH: usize = 16;
    let ranges: Vec<Vec<(f32, f32)>> = (0..rows.div_ceil(CH))
        .into_par_iter()
        .map_init(Vec::new, |buf, c| {
            let (r0, r1) = (c * CH, (c * CH + CH).min(rows));
            ck.rows_f32_into(info, r0, r1, buf);
            let cols = buf.len() / (r1 - r0);
            buf.chunks(cols).map(hexq_model::weights::min_max).collect()
        })
        .collect();
    Ok(ranges.concat())
}

/// LPBQ encodings of the MatMul weights whose input dimension `block` divides and that no override rule
/// names (aimet-onnx's `set_grouped_blockwise_quantization_for_weights(…, 4, 8, block)` with strict=False).
pub fn lpbq_encodings(
    ck: &Checkpoint,
    graph: &Graph,
    block: usize,
    ov: &Overrides,
) -> Result<BTreeMap<String, lpbq::LpbqEncoding>> {
    let mw = matmul_weights(graph);
    let out: Vec<Result<Option<(String, lpbq::LpbqEncoding)>>> = graph
        .initializers
        .par_iter()
        .filter(|i| mw.contains(i.name.as_str()) && ov.find(Kind::Param, &i.name).is_none())
        .map(|i| {
            let InitSource::Weight {
                tensor,
                transpose: true,
            } = &i.source
            else {
                return Ok(None);
            };
            // Checkpoint layout [out, in]: the view's shape is [in, out].
            let cols = i.ty.shape[0];
            if cols % block != 0 {
                return Ok(None);
            }
            let w = ck.f32(tensor)?;
            let l = lpbq::encode(&w, cols, block, 4, 4);
            Ok(Some((
                i.name.clone(),
                lpbq::LpbqEncoding::from_lpbq(&i.name, &l),
            )))
        })
        .collect();
    let mut m = BTreeMap::new();
    for r in out {
        if let Some((k, v)) = r? {
            m.insert(k, v);
        }
    }
    Ok(m)
}

/// Compute encodings for `graph` from calibration `stats` and the checkpoint's weights.
pub fn encode(
    ck: &Checkpoint,
    graph: &Graph,
    stats: &Stats,
    scheme: &Scheme,
    ov: &Overrides,
) -> Result<Encodings> {
    if stats.graph_sha256 != graph.content_hash() {
        return Err(Error::Graph {
            graph: graph.name.clone(),
            msg: format!(
                "the stats were calibrated on graph {} (variant {}), not on this one: re-run hexq calibrate",
                stats.graph_sha256.get(..12).unwrap_or(&stats.graph_sha256),
                stats.variant
            ),
        });
    }
    let mut enc = Encodings {
        version: "0.6.1".into(),
        ..Default::default()
    };
    let is_kv = |n: &str| {
        n.starts_with("past_key_")
            || n.starts_with("past_value_")
            || n.starts_with("present_key_")
            || n.starts_with("present_value_")
    };
    enc.param_encodings = param_encodings(ck, graph, scheme, ov)?;
    if let Some(block) = scheme.lpbq_block {
        enc.lpbq_encodings = lpbq_encodings(ck, graph, block, ov)?;
        for k in enc.lpbq_encodings.keys() {
            enc.param_encodings.remove(k);
        }
    }
    let ties = tie_groups(graph);
    // Activations: graph inputs and float node outputs. Three kinds, as aimet-onnx 2.x quantizes them:
    // - outputs of grid-preserving ops (Reshape, Transpose, Slice, Gather, …) carry their source's
    //   encoding (no requantization; AIMET has no quantizer there);
    // - members of a Concat/ScatterND tie group share one encoding over the union of their ranges
    //   (HTP needs equal input/output encodings on those ops), at the group output's bitwidth;
    // - everything else: its own range.
    let range = |n: &str| -> Result<(f64, f64)> {
        let r = stats.tensors.get(n).ok_or_else(|| Error::Encoding {
            tensor: n.to_string(),
            msg: "the stats have no range for this graph tensor".into(),
        })?;
        Ok((r.min as f64, r.max as f64))
    };
    let mut group_range: BTreeMap<&str, (f64, f64)> = BTreeMap::new();
    for (m, root) in &ties {
        let (lo, hi) = range(m)?;
        let e = group_range.entry(root.as_str()).or_insert((lo, hi));
        *e = (e.0.min(lo), e.1.max(hi));
    }
    let mut names: Vec<&str> = graph.inputs.iter().map(|v| v.name.as_str()).collect();
    names.extend(graph.nodes.iter().map(|n| n.outputs[0].as_str()));
    // HTP's MatMul takes a 16-bit *second* input only symmetric (aimet-onnx applies the same rule): the
    // effective source of every dynamic MatMul's second input (the KV groups) is encoded symmetric at 16 bits.
    let mut sym16: std::collections::HashSet<String> = std::collections::HashSet::new();
    for n in graph.nodes.iter().filter(|n| n.op == Op::MatMul) {
        let b = &n.inputs[1];
        if graph.is_initializer(b) {
            continue;
        }
        let src = grid_source(graph, b).unwrap_or_else(|| b.clone());
        sym16.insert(ties.get(&src).cloned().unwrap_or(src));
    }
    let spec = |n: &str| {
        let mut bw = if scheme.int8_kv && is_kv(n) {
            8
        } else {
            scheme.act_bw
        };
        let mut sym = bw == 16 && sym16.contains(n);
        if let Some(rule) = ov.find(Kind::Activation, n) {
            bw = rule.bitwidth;
            sym = rule.symmetric.unwrap_or(false);
        }
        (bw, sym)
    };
    let masked = match scheme.mask_floor {
        Some(_) => masked_softmax_inputs(graph),
        None => BTreeMap::new(),
    };
    let mut floors = serde_json::Map::new();
    let mut inherit = Vec::new();
    for n in names {
        if !graph.types[n].dtype.is_float() {
            continue;
        }
        let e = if let Some(root) = ties.get(n) {
            let (lo, hi) = group_range[root.as_str()];
            let (bw, sym) = spec(root);
            Encoding::compute(bw, lo, hi, sym)
        } else if let Some(src) = grid_source(graph, n) {
            inherit.push((n, src));
            continue;
        } else {
            let (mut lo, hi) = range(n)?;
            if let (Some(scores), Some(f)) = (masked.get(n), scheme.mask_floor) {
                let floor = range(scores)?.0 - f;
                if floor > lo {
                    lo = floor;
                    floors.insert(n.into(), floor.into());
                }
            }
            let (bw, sym) = spec(n);
            Encoding::compute(bw, lo, hi, sym)
        };
        enc.activation_encodings.insert(n.into(), vec![e]);
    }
    for (n, src) in inherit {
        let e = enc
            .activation_encodings
            .get(&src)
            .or_else(|| enc.param_encodings.get(&src))
            .filter(|e| e.len() == 1)
            .cloned();
        let e = match e {
            Some(e) => e,
            None => {
                let (lo, hi) = range(n)?;
                let (bw, sym) = spec(n);
                vec![Encoding::compute(bw, lo, hi, sym)]
            }
        };
        enc.activation_encodings.insert(n.into(), e);
    }
    enc.hexq = serde_json::json!({
        "scheme": scheme.name(),
        "graph": graph.name, "graph_sha256": stats.graph_sha256, "model_sha256": stats.model_sha256,
        "dataset_sha256": stats.dataset_sha256, "weights": "int8 symmetric per output channel (axis = output of the [in, out] MatMul weight)",
        "overrides": ov.rules,
        // Masked softmax inputs encoded from min(scores) - mask_floor up (module docs): tensor → floor.
        "mask_floor": scheme.mask_floor, "mask_floored": floors,
        // Shared encodings (member → group output), e.g. the KV write's past/new-row/present for HTP.
        "tie_groups": ties.iter().filter(|(m, r)| m != r).map(|(m, r)| (m.clone(), serde_json::Value::String(r.clone()))).collect::<serde_json::Map<_, _>>(),
    });
    Ok(enc)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn asymmetric_int16_hand_computed() {
        // [-1, 3]: scale = 4/65535, offset = -round(1/scale) = -16384, min = -16384·scale.
        let e = Encoding::compute(16, -1.0, 3.0, false);
        let s = 4.0 / 65535.0;
        assert!((e.scale - s).abs() < 1e-15);
        assert_eq!(e.offset, -16384);
        assert!((e.min - -16384.0 * s).abs() < 1e-12);
        assert!((e.max - (e.min + 4.0)).abs() < 1e-12);
        // Zero is exactly representable.
        assert_eq!(e.fake(0.0), 0.0);
        // All-positive range is widened to include 0: [2, 5] → [0, 5], offset 0.
        let e = Encoding::compute(16, 2.0, 5.0, false);
        assert_eq!(e.offset, 0);
        assert_eq!(e.min, 0.0);
        assert!((e.scale - 5.0 / 65535.0).abs() < 1e-15);
        // All-negative: [-4, -1] → [-4, 0], offset = round(-4/scale) = -65535.
        let e = Encoding::compute(16, -4.0, -1.0, false);
        assert_eq!(e.offset, -65535);
        // Degenerate range [0, 0] → 65535 steps of f32 eps (aimet-onnx 2.x's minimum scale).
        let e = Encoding::compute(16, 0.0, 0.0, false);
        assert!((e.scale - f32::EPSILON as f64).abs() < 1e-20 && e.min == 0.0);
        // The mask constant NEG = -1e4 is exactly representable on its own range.
        let e = Encoding::compute(16, -1e4, 0.0, false);
        assert_eq!(e.fake(-1e4), -1e4);
    }

    #[test]
    fn symmetric_int8_hand_computed() {
        // absmax 2.54 → scale 0.02, offset -128, range [-2.56, 2.54].
        let e = Encoding::compute(8, -1.0, 2.54, true);
        assert!((e.scale - 0.02).abs() < 1e-12);
        assert_eq!(e.offset, -128);
        assert!((e.min - -2.56).abs() < 1e-12 && (e.max - 2.54).abs() < 1e-12);
        assert!((e.fake(2.54) - 2.54).abs() < 1e-6);
        assert!((e.fake(-2.54) + 2.54).abs() < 1e-6);
        assert!((e.fake(100.0) - 2.54).abs() < 1e-6, "clamps at 127·scale");
        assert!(
            (e.fake(0.011) - 0.02).abs() < 1e-6,
            "rounds to nearest step"
        );
        // Negative-dominant channel: the -128 end covers it: scale = 2.56/128 = 0.02, not 2.56/127.
        let e = Encoding::compute(8, -2.56, 1.0, true);
        assert!((e.scale - 0.02).abs() < 1e-12);
        assert!((e.fake(-2.56) + 2.56).abs() < 1e-6);
        // 4-bit symmetric (W4 override): 7 positive steps, offset -8.
        let e = Encoding::compute(4, -0.7, 0.7, true);
        assert!((e.scale - 0.1).abs() < 1e-12);
        assert_eq!(e.offset, -8);
    }

    #[test]
    fn params_round_like_aimet_activations_like_onnx() {
        // Symmetric int8, scale 0.5: x/scale = -67.5 sits on a tie. AIMET adds the zero point first
        // (-67.5 + 128 = 60.5) and rounds half away → 61 (= -67 signed); ONNX rounds -67.5 half to even →
        // -68, + 128 = 60.
        let e = Encoding::compute(8, -64.0, 63.5, true);
        assert_eq!((e.scale, e.offset), (0.5, -128));
        assert_eq!(e.quantize_param(-33.75), 61);
        assert_eq!(e.quantize(-33.75), 60);
        assert_eq!(e.fake_param(-33.75), -33.5);
        // A weight of the tiny fixture (layers.0.mlp.up_proj, channel 124) where the two differ without an
        // exact tie: x/scale = 32.499992 in f32, but 32.499992 + 128 rounds (in f32) to 160.5 → 161.
        let e = Encoding {
            scale: 0.0022342384327203035,
            ..Encoding::compute(8, -0.28, 0.28, true)
        };
        assert_eq!(e.quantize_param(0.07261273) - 128, 33);
        assert_eq!(e.quantize(0.07261273) - 128, 32);
    }

    #[test]
    fn fake_quant_error_is_at_most_half_a_step_inside_the_range() {
        let e = Encoding::compute(16, -3.7, 11.2, false);
        for i in 0..1000 {
            let x = -3.7 + 14.9 * i as f64 / 999.0;
            assert!(((e.fake(x as f32) as f64) - x).abs() <= e.scale / 2.0 + 1e-6);
        }
    }

    #[test]
    fn glob_matches() {
        assert!(glob(
            "layers.*.mlp.*_proj.weight.T",
            "layers.3.mlp.up_proj.weight.T"
        ));
        assert!(!glob(
            "layers.*.mlp.*_proj.weight.T",
            "layers.3.self_attn.q_proj.weight.T"
        ));
        assert!(glob("present_*", "present_key_3"));
        assert!(glob("norm.out", "norm.out"));
    }
}
