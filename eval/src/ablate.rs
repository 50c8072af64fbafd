//! Weight-grid ablation: the same model with its decoder weights on different grids (weights only,
//! activations float), side by side against float — the per-channel vs group-wise comparison the published
//! 4-bit build rests on (granularity, not bit-width, decides accuracy).
//!
//! Grids (all symmetric): `int8-pc` / `int4-pc` per output channel (AIMET's rule, [`hexq_quantize::Encoding`]);
//! `q4_0-g32` ggml's q4_0 exactly ([`hexq_gguf::ggml`]); `g64` / `g128` the same q4_0 rule over 64/128-wide
//! groups; `int4-pc-mlp-only` int4 per channel on the MLP, attention float; `lpbq-b32` / `b64` / `b128`
//! Qualcomm's w4a16 weight grid (LPBQ, aimet-onnx's arithmetic exactly: [`hexq_quantize::lpbq`]).
//!
//! `heavy_tail`: random checkpoints lack the outlier input channels real LLMs have, so every grid looks
//! alike on them. This option gives the inputs of q/k/v and gate/up heavy-tailed per-channel scales s_j
//! (log-normal, σ = 1: a few channels 20× and more) *without changing the float function*: W·diag(s) with the
//! preceding RMSNorm weight divided by s (x·w/s feeds W·s). Float stays float; the grids now face outliers.

use candle_core::{Device, Tensor};
use half::f16;
use hexq_graph::interp::Hook;
use hexq_model::names::{LayerTensor, Role};
use hexq_quantize::Encoding;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Grid {
    PerChannel(u32),
    /// q4_0's rule over groups of this size along the input dimension.
    Group(usize),
    /// LPBQ (aimet-onnx's, [`hexq_quantize::lpbq`]): int4 blocks of this size along the input dimension,
    /// block scales as 4-bit integers × one float per output channel.
    Lpbq(usize),
}

#[derive(Debug, Clone)]
pub struct Scheme {
    pub name: String,
    pub grid: Grid,
    pub mlp_only: bool,
}

impl Scheme {
    pub fn parse(s: &str) -> Option<Self> {
        let (grid, mlp_only) = match s {
            "int8-pc" => (Grid::PerChannel(8), false),
            "int4-pc" => (Grid::PerChannel(4), false),
            "int4-pc-mlp-only" => (Grid::PerChannel(4), true),
            "q4_0-g32" | "g32" => (Grid::Group(32), false),
            "g64" => (Grid::Group(64), false),
            "g128" => (Grid::Group(128), false),
            "lpbq-b32" => (Grid::Lpbq(32), false),
            "lpbq-b64" => (Grid::Lpbq(64), false),
            "lpbq-b128" => (Grid::Lpbq(128), false),
            _ => return None,
        };
        Some(Scheme {
            name: s.into(),
            grid,
            mlp_only,
        })
    }
    /// Bits per weight including scales (per-channel scales f32 as QNN stores them, group scales fp16).
    pub fn bpw(&self, in_features: usize) -> f64 {
        match self.grid {
            Grid::PerChannel(b) => b as f64 + 32.0 / in_features as f64,
            Grid::Group(g) => 4.0 + 16.0 / g as f64,
            // int4 weights, an 8-bit container per block scale, an f32 per channel.
            Grid::Lpbq(b) => 4.0 + 8.0 / b as f64 + 32.0 / in_features as f64,
        }
    }
}

/// q4_0's rule on one group: d = (value of largest magnitude) / -8, q = min(15, trunc(x/d + 8.5)), d in fp16.
fn q4_group(x: &mut [f32]) {
    if x.len() == 32 {
        let mut b = Vec::with_capacity(18);
        hexq_gguf::ggml::quantize_q4_0(x, &mut b).expect("finite weights");
        x.copy_from_slice(&hexq_gguf::ggml::dequantize_q4_0(&b));
        return;
    }
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x.iter() {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let dh = f16::from_f32(d).to_f32();
    for v in x.iter_mut() {
        let q = ((*v * id + 8.5) as i32).clamp(0, 15);
        *v = (q - 8) as f32 * dh;
    }
}

/// Quantize→dequantize rows of an [out, in] matrix (row = one output channel, contiguous inputs).
pub fn apply_grid(grid: Grid, w: &mut [f32], cols: usize) {
    use rayon::prelude::*;
    // As aimet-onnx's set_grouped_blockwise_quantization_for_weights (strict=False): a weight whose input
    // dimension the block does not divide keeps the per-channel int4 grid.
    let grid = match grid {
        Grid::Lpbq(b) if cols % b != 0 => Grid::PerChannel(4),
        g => g,
    };
    if let Grid::Lpbq(b) = grid {
        w.par_chunks_mut(cols).for_each(|row| {
            hexq_quantize::lpbq::encode(row, cols, b, 4, 4).fake(row, cols);
        });
        return;
    }
    w.par_chunks_mut(cols).for_each(|row| match grid {
        Grid::PerChannel(b) => {
            let (lo, hi) = row
                .iter()
                .fold((0f32, 0f32), |(a, c), &x| (a.min(x), c.max(x)));
            let e = Encoding::compute(b, lo as f64, hi as f64, true);
            row.iter_mut().for_each(|x| *x = e.fake_param(*x));
        }
        Grid::Group(g) => row.chunks_mut(g).for_each(q4_group),
        Grid::Lpbq(_) => unreachable!(),
    });
}

/// A MatMul weight's class (its view name `….weight.T` or the checkpoint name), from the tensor table.
pub fn class_of(name: &str) -> &'static str {
    let role = LayerTensor::parse(name.trim_end_matches(".T")).map(|(_, t)| t.def().role);
    if role == Some(Role::Attention) {
        "attention"
    } else if role == Some(Role::Mlp) {
        "mlp"
    } else if name.contains("embed") {
        "embeddings"
    } else {
        "per_layer_input"
    }
}

/// Σx², Σ(x−q)² per tensor class.
pub type Sqnr = Arc<Mutex<BTreeMap<&'static str, (f64, f64, u64)>>>;

pub fn sqnr_db(s: f64, n: f64) -> f64 {
    if n == 0.0 {
        f64::INFINITY
    } else {
        10.0 * (s / n).log10()
    }
}

/// Log-normal σ of the synthetic input-channel scales: ~1 channel in 40 beyond 7× (2σ), a few beyond 20×.
pub const HEAVY_SIGMA: f64 = 1.0;

/// Deterministic heavy-tailed input-channel scales for one norm (log-normal, σ = HEAVY_SIGMA).
pub fn heavy_scales(seed: u64, n: usize) -> Vec<f32> {
    let mut x = seed ^ 0x9e3779b97f4a7c15;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        ((x >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    (0..n)
        .map(|_| {
            let (u, v) = (next(), next());
            let z = (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos();
            (HEAVY_SIGMA * z).exp() as f32
        })
        .collect()
}

/// The bake-time hook: heavy-tail transform (optional), then the grid on 2-D MatMul weights.
pub struct GridHook {
    pub scheme: Option<Scheme>,
    pub heavy_tail: bool,
    pub sqnr: Sqnr,
}

/// MatMul weight (as its [in, out] view "….weight.T") → (layer, the RMSNorm that feeds it).
fn norm_of(name: &str) -> Option<(usize, LayerTensor)> {
    let (i, t) = LayerTensor::parse(name.strip_suffix(".T")?)?;
    Some((i, t.input_norm()?))
}

fn seed_for(layer: usize, norm: LayerTensor) -> u64 {
    layer as u64 * 1000 + if norm == LayerTensor::InputNorm { 1 } else { 2 }
}

impl Hook for GridHook {
    fn tensor(&mut self, name: &str, t: &Tensor) -> Option<Tensor> {
        let dims = t.dims().to_vec();
        if self.heavy_tail && dims.len() == 1 {
            // The norm weights that feed scaled inputs: w / s.
            let (i, norm) = LayerTensor::parse(name)?;
            if norm != LayerTensor::InputNorm && norm != LayerTensor::PreFfnNorm {
                return None;
            }
            let s = heavy_scales(seed_for(i, norm), dims[0]);
            let v: Vec<f32> = t.to_vec1().ok()?;
            let v: Vec<f32> = v.iter().zip(&s).map(|(w, s)| w / s).collect();
            return Tensor::from_vec(v, dims.as_slice(), &Device::Cpu).ok();
        }
        if dims.len() != 2 || !name.ends_with(".weight.T") {
            return None;
        }
        // [in, out] view → [out, in] rows.
        let mut w: Vec<f32> = t
            .t()
            .ok()?
            .contiguous()
            .ok()?
            .flatten_all()
            .ok()?
            .to_vec1()
            .ok()?;
        let (inn, out) = (dims[0], dims[1]);
        let mut changed = false;
        if self.heavy_tail {
            if let Some((l, norm)) = norm_of(name) {
                let s = heavy_scales(seed_for(l, norm), inn);
                w.chunks_mut(inn)
                    .for_each(|row| row.iter_mut().zip(&s).for_each(|(x, s)| *x *= s));
                changed = true;
            }
        }
        if let Some(sc) = &self.scheme {
            let class = class_of(name);
            if !(sc.mlp_only && class != "mlp") {
                let before = w.clone();
                apply_grid(sc.grid, &mut w, inn);
                let (s, n) = before.iter().zip(&w).fold((0f64, 0f64), |(s, n), (a, b)| {
                    (s + (*a as f64).powi(2), n + ((a - b) as f64).powi(2))
                });
                let mut m = self.sqnr.lock().unwrap();
                let e = m.entry(class).or_insert((0.0, 0.0, 0));
                e.0 += s;
                e.1 += n;
                e.2 += before.len() as u64;
                changed = true;
            }
        }
        if !changed {
            return None;
        }
        Tensor::from_vec(w, (out, inn), &Device::Cpu).ok()?.t().ok()
    }
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct Row {
    pub scheme: String,
    pub bits_per_weight: f64,
    /// Decoder weights (quantized at their grid, the rest bf16), MiB; host-side embeddings excluded.
    pub decoder_mib: f64,
    pub sqnr_db: BTreeMap<String, f64>,
    pub top1_agreement: f64,
    pub kl_mean: f64,
    pub perplexity: f64,
    pub hidden_cosine_mean: f64,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct Report {
    pub model: String,
    pub heavy_tail: bool,
    pub prompts: usize,
    pub positions: usize,
    pub float_perplexity: f64,
    pub rows: Vec<Row>,
}

fn log_softmax(v: &[f32]) -> Vec<f64> {
    let m = v.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let z = v.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln() + m;
    v.iter().map(|&x| x as f64 - z).collect()
}

use crate::verify::cos;

/// Run every scheme over the token sequences (teacher-forced, all positions) against float.
pub fn ablate(
    ck: &std::sync::Arc<hexq_model::Checkpoint>,
    seqs: &[Vec<u32>],
    schemes: &[Scheme],
    heavy_tail: bool,
    o: &hexq_graph::GraphOptions,
    pb: &indicatif::ProgressBar,
) -> hexq_model::Result<Report> {
    use hexq_graph::Variant;
    use hexq_runtime::graph::GraphBackend;
    let run = |scheme: Option<Scheme>| -> hexq_model::Result<(Vec<Vec<Vec<f32>>>, Vec<Vec<Vec<f32>>>, Sqnr)> {
        let sqnr: Sqnr = Default::default();
        let mut b = GraphBackend::for_model(ck, Variant::DecodeWgqa, true, o)?;
        b.bake(&mut GridHook { scheme, heavy_tail, sqnr: sqnr.clone() })?;
        let (mut hs, mut ls) = (Vec::new(), Vec::new());
        for ids in seqs {
            hexq_runtime::Backend::reset(&mut b);
            let h = b.hidden(ids)?;
            let l = h.iter().map(|x| b.logits(x)).collect::<hexq_runtime::Result<Vec<_>>>()?;
            hs.push(h);
            ls.push(l);
        }
        pb.inc(1);
        Ok((hs, ls, sqnr))
    };
    let ppl = |ls: &[Vec<Vec<f32>>]| {
        let (mut nll, mut n) = (0f64, 0usize);
        for (l, ids) in ls.iter().zip(seqs) {
            for p in 0..ids.len().saturating_sub(1) {
                nll -= log_softmax(&l[p])[ids[p + 1] as usize];
                n += 1;
            }
        }
        (nll / n.max(1) as f64).exp()
    };
    let (fh, fl, _) = run(None)?;
    let positions: usize = seqs.iter().map(|s| s.len()).sum();
    // Parameter accounting from the tensor table.
    let mut rows = Vec::new();
    for sc in schemes {
        let (qh, ql, sq) = run(Some(sc.clone()))?;
        let (mut agree, mut kl, mut cs) = (0usize, 0f64, 0f64);
        for s in 0..seqs.len() {
            for p in 0..seqs[s].len() {
                let (a, b) = (&fl[s][p], &ql[s][p]);
                agree +=
                    (hexq_model::forward::argmax(a) == hexq_model::forward::argmax(b)) as usize;
                let (la, lb) = (log_softmax(a), log_softmax(b));
                kl += la
                    .iter()
                    .zip(&lb)
                    .map(|(x, y)| x.exp() * (x - y))
                    .sum::<f64>();
                cs += cos(&fh[s][p], &qh[s][p]);
            }
        }
        let mut sqnr: BTreeMap<String, f64> = sq
            .lock()
            .unwrap()
            .iter()
            .map(|(k, (s, n, _))| (k.to_string(), sqnr_db(*s, *n)))
            .collect();
        // Embeddings (host-side tables; SQNR only — the accuracy columns quantize the decoder).
        let e = ck.f32(hexq_model::names::EMBED)?;
        let mut q = e.clone();
        apply_grid(sc.grid, &mut q, ck.config.hidden_size);
        let (s, n) = e.iter().zip(&q).fold((0f64, 0f64), |(s, n), (a, b)| {
            (s + (*a as f64).powi(2), n + ((a - b) as f64).powi(2))
        });
        sqnr.insert("embeddings".into(), sqnr_db(s, n));
        let (mut bits, mut params) = (0f64, 0f64);
        let mut bytes = 0f64;
        for (spec, _) in &ck.tensors {
            if spec.role.is_vocab() {
                continue;
            }
            let n = spec.numel() as f64;
            let quantized = spec.shape.len() == 2
                && !(sc.mlp_only && spec.role != hexq_model::names::Role::Mlp);
            if quantized {
                let b = sc.bpw(spec.shape[1]);
                bits += b * n;
                params += n;
                bytes += b * n / 8.0;
            } else {
                bytes += 2.0 * n;
            }
        }
        rows.push(Row {
            scheme: sc.name.clone(),
            bits_per_weight: bits / params.max(1.0),
            decoder_mib: bytes / (1u64 << 20) as f64,
            sqnr_db: sqnr,
            top1_agreement: agree as f64 / positions as f64,
            kl_mean: kl / positions as f64,
            perplexity: ppl(&ql),
            hidden_cosine_mean: cs / positions as f64,
        });
    }
    Ok(Report {
        model: ck.dir.display().to_string(),
        heavy_tail,
        prompts: seqs.len(),
        positions,
        float_perplexity: ppl(&fl),
        rows,
    })
}

impl Report {
    pub fn markdown(&self) -> String {
        let classes: Vec<String> = {
            let mut c: Vec<String> = self
                .rows
                .iter()
                .flat_map(|r| r.sqnr_db.keys().cloned())
                .collect();
            c.sort();
            c.dedup();
            c
        };
        let mut s = format!(
            "weights-only ablation{} — {} prompts, {} positions; float perplexity {:.3}\n\n| scheme | bits/weight | decoder MiB | {} | top-1 vs float | KL mean | perplexity | hidden cos |\n|---|---|---|{}---|---|---|---|\n",
            if self.heavy_tail { " (heavy-tailed input channels)" } else { "" },
            self.prompts,
            self.positions,
            self.float_perplexity,
            classes.iter().map(|c| format!("SQNR {c} dB")).collect::<Vec<_>>().join(" | "),
            "---|".repeat(classes.len())
        );
        for r in &self.rows {
            s += &format!(
                "| {} | {:.3} | {:.2} | {} | {:.1} % | {:.4} | {:.3} | {:.5} |\n",
                r.scheme,
                r.bits_per_weight,
                r.decoder_mib,
                classes
                    .iter()
                    .map(|c| r
                        .sqnr_db
                        .get(c)
                        .map(|v| format!("{v:.1}"))
                        .unwrap_or("–".into()))
                    .collect::<Vec<_>>()
                    .join(" | "),
                100.0 * r.top1_agreement,
                r.kl_mean,
                r.perplexity,
                r.hidden_cosine_mean
            );
        }
        s
    }

    pub fn csv(&self) -> String {
        let mut s = String::from("scheme,bits_per_weight,decoder_mib,sqnr_attention_db,sqnr_mlp_db,sqnr_embeddings_db,top1_agreement,kl_mean,perplexity,hidden_cosine_mean\n");
        for r in &self.rows {
            let g = |k: &str| {
                r.sqnr_db
                    .get(k)
                    .map(|v| format!("{v:.3}"))
                    .unwrap_or_default()
            };
            s += &format!(
                "{},{:.4},{:.3},{},{},{},{:.5},{:.6},{:.5},{:.6}\n",
                r.scheme,
                r.bits_per_weight,
                r.decoder_mib,
                g("attention"),
                g("mlp"),
                g("embeddings"),
                r.top1_agreement,
                r.kl_mean,
                r.perplexity,
                r.hidden_cosine_mean
            );
        }
        s
    }

    /// Accuracy vs bits/weight as a small SVG (top-1 agreement, and KL on a second axis).
    pub fn svg(&self) -> String {
        let (w, h, m) = (640.0, 400.0, 60.0);
        let xs: Vec<f64> = self.rows.iter().map(|r| r.bits_per_weight).collect();
        let (x0, x1) = (
            xs.iter().cloned().fold(f64::INFINITY, f64::min) - 0.25,
            xs.iter().cloned().fold(0f64, f64::max) + 0.25,
        );
        let kmax = self.rows.iter().map(|r| r.kl_mean).fold(1e-9, f64::max) * 1.1;
        let px = |x: f64| m + (x - x0) / (x1 - x0) * (w - 2.0 * m);
        let py = |y: f64| h - m - y * (h - 2.0 * m);
        let mut s = format!("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n");
        s += &format!("<line x1=\"{m}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>\n<line x1=\"{m}\" y1=\"{m}\" x2=\"{m}\" y2=\"{}\" stroke=\"black\"/>\n", h - m, w - m, h - m, h - m);
        s += &format!(
            "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">bits per weight</text>\n",
            w / 2.0,
            h - 20.0
        );
        s += &format!("<text x=\"15\" y=\"{}\" transform=\"rotate(-90 15 {})\" text-anchor=\"middle\" fill=\"#1f77b4\">top-1 agreement vs float (●)</text>\n", h / 2.0, h / 2.0);
        s += &format!("<text x=\"{}\" y=\"{}\" transform=\"rotate(90 {} {})\" text-anchor=\"middle\" fill=\"#d62728\">KL mean (▲, max {kmax:.3})</text>\n", w - 15.0, h / 2.0, w - 15.0, h / 2.0);
        for t in [0.0, 0.25, 0.5, 0.75, 1.0] {
            s += &format!(
                "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{:.0}%</text>\n",
                m - 5.0,
                py(t) + 4.0,
                t * 100.0
            );
        }
        for r in &self.rows {
            let (x, y, k) = (
                px(r.bits_per_weight),
                py(r.top1_agreement),
                py(r.kl_mean / kmax),
            );
            s += &format!("<circle cx=\"{x:.1}\" cy=\"{y:.1}\" r=\"5\" fill=\"#1f77b4\"/>\n<path d=\"M{:.1},{:.1} l5,9 l-10,0 z\" fill=\"#d62728\"/>\n", x, k - 6.0);
            s += &format!("<text x=\"{x:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>\n<text x=\"{x:.1}\" y=\"{:.1}\" text-anchor=\"middle\" fill=\"#555\">{:.2}</text>\n", y - 10.0, r.scheme, h - m + 15.0, r.bits_per_weight);
        }
        s + "</svg>\n"
    }
}
