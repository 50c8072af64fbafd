//! Weight-grid ablation: the same model with its decoder weights on different grids (weights only,
//! activations float), side by side against float — the per-channel vs group-wise comparison the published
//! 4-bit build rests on (granularity, not bit-width, decides accuracy). Rows may also be whole builds
//! ([`Build`]: an encodings file's params *and* activations, as `hexq verify` runs them), so A16W8 and
//! w4a16 sit in the same table as the weights-only grids, every figure over the same positions.
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
use hexq_kernels::RowWeight;
use hexq_model::names::{LayerTensor, Role};
use hexq_quantize::quantsim::FakeQuant;
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
    /// Bits per weight including scales (per-channel scales f32 as QNN stores them, group scales fp16), on the
    /// grid the weight resolves to.
    pub fn bpw(&self, in_features: usize) -> f64 {
        match resolve(self.grid, in_features) {
            Grid::PerChannel(b) => b as f64 + 32.0 / in_features as f64,
            Grid::Group(g) => 4.0 + 16.0 / g as f64,
            // int4 weights, an 8-bit container per block scale, an f32 per channel.
            Grid::Lpbq(b) => 4.0 + 8.0 / b as f64 + 32.0 / in_features as f64,
        }
    }
}

/// q4_0's rule on one group, in place (ggml-quants.c `quantize_row_q4_0_ref` then `dequantize_row_q4_0`, the
/// same f32 operations without a block buffer: the bake runs it on 1.9 G weights at E2B; tested equal to
/// hexq_gguf's ggml mirror): d = (value of largest magnitude) / -8, q = min(15, trunc(x/d + 8.5)), d in fp16.
/// Returns the fp16 d as f32: every value is exactly `(q − 8) as f32 · d`.
fn q4_group(x: &mut [f32]) -> f32 {
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
    dh
}

/// The grid a weight with `cols` inputs gets. As aimet-onnx's set_grouped_blockwise_quantization_for_weights
/// (strict=False): a weight whose input dimension the block does not divide keeps the per-channel int4 grid.
fn resolve(grid: Grid, cols: usize) -> Grid {
    match grid {
        Grid::Lpbq(b) if cols % b != 0 => Grid::PerChannel(4),
        g => g,
    }
}

/// Quantize→dequantize one row (one output channel) on a resolved grid, in place. Returns the row's scales,
/// one per `group` inputs (the last group may be short), and `group`: every value is exactly
/// `(integer) as f32 · scale` in f32 — what lets [`GridHook`] keep the grid as integer rows.
fn row_grid(grid: Grid, row: &mut [f32]) -> (Vec<f32>, usize) {
    match grid {
        Grid::PerChannel(b) => {
            // The range always holds 0 (AIMET's rule); min/max are exact in any order.
            let (lo, hi) = hexq_model::weights::min_max(row);
            let e = Encoding::compute(b, lo.min(0.0) as f64, hi.max(0.0) as f64, true);
            e.fake_params(row);
            (vec![e.scale as f32], row.len())
        }
        Grid::Group(g) => (row.chunks_mut(g).map(q4_group).collect(), g),
        Grid::Lpbq(b) => {
            let l = hexq_quantize::lpbq::encode(row, row.len(), b, 4, 4);
            l.fake(row, row.len());
            let s = l
                .int_scale
                .iter()
                .map(|&i| (i as f64 * l.channel_scale[0]) as f32)
                .collect();
            (s, b)
        }
    }
}

/// Quantize→dequantize rows of an [out, in] matrix (row = one output channel, contiguous inputs).
pub fn apply_grid(grid: Grid, w: &mut [f32], cols: usize) {
    use rayon::prelude::*;
    let grid = resolve(grid, cols);
    w.par_chunks_mut(cols).for_each(|row| {
        row_grid(grid, row);
    });
}

/// (Σa², Σ(a−b)²) in f64: signal and error energy of a gridded row `b` against its source `a`, in 8 lanes
/// (independent sums the compiler keeps in vector registers; one running sum was a latency chain).
fn err_sums(a: &[f32], b: &[f32]) -> (f64, f64) {
    const L: usize = 8;
    let (mut s, mut n) = ([0f64; L], [0f64; L]);
    let (ca, cb) = (a.chunks_exact(L), b.chunks_exact(L));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..L {
            let (x, d) = (x[l] as f64, (x[l] - y[l]) as f64);
            s[l] += x * x;
            n[l] += d * d;
        }
    }
    for (l, (x, y)) in ra.iter().zip(rb).enumerate() {
        let (x, d) = (*x as f64, (x - y) as f64);
        s[l] += x * x;
        n[l] += d * d;
    }
    (s.iter().sum(), n.iter().sum())
}

/// A gridded row's integers: `q[k] as f32 · scale[k / group] == row[k]` for every k, or false. Group by
/// group, every element checked (no early exit), so the loop vectorizes.
fn row_ints(row: &[f32], scale: &[f32], group: usize, q: &mut [i16]) -> bool {
    let mut ok = true;
    for ((q, row), &s) in q.chunks_mut(group).zip(row.chunks(group)).zip(scale) {
        if s == 0.0 {
            ok &= row.iter().all(|&v| v == 0.0);
            q.fill(0);
            continue;
        }
        // Times the reciprocal, not a division per weight (a fifth of the bake): a gridded value is q·s with
        // |q| ≤ 255, so v·(1/s) is within a few ulps of q and rounds to it — and `i * s == v` checks it anyway.
        let inv = 1.0 / s;
        for (d, &v) in q.iter_mut().zip(row) {
            // Nearest integer by the 1.5·2²³ trick (exact for |x| < 2²²; a libm call otherwise on baseline
            // x86-64): a value off the grid fails the check below whatever this gives.
            const R: f32 = 12_582_912.0;
            let i = (v * inv + R) - R;
            ok &= i.abs() <= 255.0 && i * s == v;
            *d = i.clamp(-255.0, 255.0) as i16;
        }
    }
    ok
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

impl GridHook {
    /// The grid (if any) this weight gets under the scheme.
    fn grid_for(&self, name: &str) -> Option<Grid> {
        let sc = self.scheme.as_ref()?;
        (!(sc.mlp_only && class_of(name) != "mlp")).then_some(sc.grid)
    }

    fn add_sqnr(&self, class: &'static str, s: f64, n: f64, count: u64) {
        add_sqnr(&self.sqnr, class, s, n, count)
    }
}

fn add_sqnr(sqnr: &Sqnr, class: &'static str, s: f64, n: f64, count: u64) {
    let mut m = sqnr.lock().unwrap();
    let e = m.entry(class).or_insert((0.0, 0.0, 0));
    e.0 += s;
    e.1 += n;
    e.2 += count;
}

/// A build as an ablation row: an encodings file (`hexq quantize`'s: A16W8, w4a16-lpbq, …) applied as
/// quantsim applies it — params baked once, activations fake-quantized as they are produced.
#[derive(Debug, Clone)]
pub struct Build {
    pub name: String,
    pub enc: hexq_quantize::Encodings,
}

impl Build {
    /// The activations' widest grid ("int16" for A16W8 and w4a16), for the table's activations column.
    fn activations(&self) -> String {
        let bw = self
            .enc
            .activation_encodings
            .values()
            .flatten()
            .map(|e| e.bitwidth)
            .max();
        bw.map_or("float".into(), |b| format!("int{b}"))
    }
}

/// Quantsim's param bake with the weight SQNR measured on the way (MatMul weights, per class).
struct Measured {
    inner: hexq_quantize::quantsim::FakeQuant,
    sqnr: Sqnr,
}

impl Hook for Measured {
    fn weight_rows(&mut self, name: &str, w: &RowWeight) -> Option<RowWeight> {
        use rayon::prelude::*;
        let r = self.inner.weight_rows(name, w)?;
        let per: Vec<(f64, f64)> = (0..w.out)
            .into_par_iter()
            .map_init(
                || (Vec::new(), Vec::new()),
                |(ba, bb), j| err_sums(w.row(j, ba), r.row(j, bb)),
            )
            .collect();
        let (s, n) = per.iter().fold((0.0, 0.0), |a, b| (a.0 + b.0, a.1 + b.1));
        add_sqnr(&self.sqnr, class_of(name), s, n, (w.out * w.inp) as u64);
        Some(r)
    }
    fn tensor(&mut self, name: &str, t: &Tensor) -> Option<Tensor> {
        let r = self.inner.tensor(name, t)?;
        if t.dims().len() == 2 && name.ends_with(".weight.T") {
            let a: Vec<f32> = t.flatten_all().ok()?.to_vec1().ok()?;
            let b: Vec<f32> = r.flatten_all().ok()?.to_vec1().ok()?;
            let (s, n) = err_sums(&a, &b);
            add_sqnr(&self.sqnr, class_of(name), s, n, a.len() as u64);
        }
        Some(r)
    }
}

impl Hook for GridHook {
    /// A MatMul weight's rows on the grid, kept as integers and per-group scales (`RowWeight::ints_with`, exactly the
    /// gridded f32 values; 2 bytes a weight instead of 4 — what lets an E2B decoder sit in memory per scheme).
    /// Heavy-tail scaling first, then the grid; f32 rows when a grid's values are not integer × scale.
    fn weight_rows(&mut self, name: &str, w: &RowWeight) -> Option<RowWeight> {
        use rayon::prelude::*;
        let grid = self.grid_for(name).map(|g| resolve(g, w.inp));
        let heavy = self.heavy_tail.then(|| norm_of(name)).flatten();
        if grid.is_none() && heavy.is_none() {
            return None;
        }
        let hs = heavy.map(|(l, norm)| heavy_scales(seed_for(l, norm), w.inp));
        // Row j as f32 (heavy-tail scaled) into `row`, using `buf` for the widening.
        let source = |j: usize, buf: &mut Vec<f32>, row: &mut Vec<f32>| {
            row.clear();
            row.extend_from_slice(w.row(j, buf));
            if let Some(s) = &hs {
                row.iter_mut().zip(s).for_each(|(x, s)| *x *= s);
            }
        };
        let f32_rows = |grid: Option<Grid>| {
            let mut f = hexq_kernels::zeroed::<f32>(w.out * w.inp);
            f.par_chunks_mut(w.inp).enumerate().for_each_init(
                || (Vec::new(), Vec::new()),
                |(buf, row), (j, dst)| {
                    source(j, buf, row);
                    if let Some(g) = grid {
                        row_grid(g, row);
                    }
                    dst.copy_from_slice(row);
                },
            );
            Some(RowWeight::f32(w.out, w.inp, f))
        };
        let Some(g) = grid else {
            return f32_rows(None);
        };
        // Each row gridded and stored as its integers straight into rowmm's form (`RowWeight::ints_with`: no
        // two-byte copy of the weight first — at E2B 3.8 GB of fresh pages a scheme): (scales, Σx², Σ(x−q)²,
        // integers exact) per row.
        let group = match g {
            Grid::PerChannel(_) => w.inp,
            Grid::Group(n) => n,
            Grid::Lpbq(b) => b,
        };
        // rowmm's groups: the whole row, or a power of two ≥ 16 dividing it.
        let fits = group == w.inp || (group >= 16 && group.is_power_of_two() && w.inp % group == 0);
        let per: Vec<Mutex<(Vec<f32>, f64, f64, bool)>> =
            (0..w.out).map(|_| Default::default()).collect();
        let grid_row = |j: usize, q: Option<&mut [i16]>, buf: &mut Vec<f32>| {
            let mut row = Vec::with_capacity(w.inp);
            source(j, buf, &mut row);
            buf.clear();
            buf.extend_from_slice(&row);
            let (sc, _) = row_grid(g, &mut row);
            let (ss, nn) = err_sums(buf, &row);
            let ok = q.is_some_and(|q| row_ints(&row, &sc, group, q));
            *per[j].lock().unwrap() = (sc, ss, nn, ok);
        };
        let mut rows = if fits {
            Some(RowWeight::ints_with(
                w.out,
                w.inp,
                Vec::new(),
                group,
                |j, q, buf| grid_row(j, Some(q), buf),
            ))
        } else {
            (0..w.out)
                .into_par_iter()
                .for_each_init(Vec::new, |buf, j| grid_row(j, None, buf));
            None
        };
        let per: Vec<(Vec<f32>, f64, f64, bool)> =
            per.into_iter().map(|m| m.into_inner().unwrap()).collect();
        let (ss, nn) = per
            .iter()
            .fold((0f64, 0f64), |(a, b), r| (a + r.1, b + r.2));
        self.add_sqnr(class_of(name), ss, nn, (w.out * w.inp) as u64);
        match &mut rows {
            Some(r) if per.iter().all(|r| r.3) => {
                r.set_scales(per.into_iter().flat_map(|r| r.0).collect());
            }
            // A grid whose values are not integer × scale (none of today's): f32 rows, gridded again.
            _ => return f32_rows(Some(g)),
        }
        rows
    }

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
                let (s, n) = err_sums(&before, &w);
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
    /// "float" (a weights-only grid) or a build's activation grid ("int16").
    pub activations: String,
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

use crate::verify::cos;

/// Float's figures at one position, kept for every scheme's comparison.
struct FloatAt {
    logits: Vec<f32>,
    /// log Σ exp(logits), f64.
    lse: f64,
    hidden: Vec<f32>,
}

/// One scheme's figures at one position against float.
#[derive(Clone, Copy, Default)]
struct At {
    agree: bool,
    kl: f64,
    cos: f64,
    /// −log p(next token), when there is one.
    nll: Option<f64>,
}

fn lse(v: &[f32]) -> f64 {
    let m = v.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    v.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln() + m
}

/// Every position of every sequence through `b` (teacher-forced decode steps, continuous batching: `batch`
/// positions per chained run of the decode graph, a finished sequence's place taken by the next), logits by
/// the batched head; `each(seq, pos, hidden, logits)` in parallel as rows come out. Each position's values
/// are what one sequence alone gives (`step_chain` and [`hexq_runtime::graph::Head`] are exact per row).
fn teacher_forced(
    b: &mut hexq_runtime::graph::GraphBackend,
    head: &hexq_runtime::graph::Head,
    seqs: &[Vec<u32>],
    batch: usize,
    pb: &indicatif::ProgressBar,
    each: &(dyn Fn(usize, usize, &[f32], &[f32]) + Sync),
) -> hexq_model::Result<()> {
    use rayon::prelude::*;
    // (sequence, next position, slot)
    let mut jobs: Vec<(usize, usize, hexq_runtime::graph::Slot)> = Vec::new();
    let mut next = 0;
    loop {
        while jobs.len() < batch && next < seqs.len() {
            if !seqs[next].is_empty() {
                jobs.push((next, 0, b.new_slot()));
            }
            next += 1;
        }
        if jobs.is_empty() {
            return Ok(());
        }
        let mut take = vec![1usize; jobs.len()];
        let left: Vec<usize> = jobs.iter().map(|j| seqs[j.0].len() - j.1).collect();
        hexq_runtime::graph::spread(&mut take, &left, batch.saturating_sub(jobs.len()));
        let runs: Vec<&[u32]> = jobs
            .iter()
            .zip(&take)
            .map(|(j, &t)| &seqs[j.0][j.1..j.1 + t])
            .collect();
        let mut slots: Vec<&mut hexq_runtime::graph::Slot> =
            jobs.iter_mut().map(|j| &mut j.2).collect();
        let hs = b.step_chain(&mut slots, &runs)?;
        // (sequence, position, hidden) per row, in order.
        let rows: Vec<(usize, usize, &[f32])> = jobs
            .iter()
            .zip(&hs)
            .flat_map(|(j, h)| {
                h.iter()
                    .enumerate()
                    .map(move |(k, h)| (j.0, j.1 + k, h.as_slice()))
            })
            .collect();
        let hrefs: Vec<&[f32]> = rows.iter().map(|r| r.2).collect();
        let ls = head.logits(&hrefs);
        rows.par_iter()
            .zip(ls.par_iter())
            .for_each(|(&(s, p, h), l)| each(s, p, h, l));
        pb.inc(rows.len() as u64);
        for (j, t) in jobs.iter_mut().zip(&take) {
            j.1 += t;
        }
        jobs.retain(|j| j.1 < seqs[j.0].len());
    }
}

/// Run every scheme over the token sequences (teacher-forced, all positions) against float: one batched
/// pass of the decode graph for float (its logits kept), then one per scheme scored on the fly.
pub fn ablate(
    ck: &std::sync::Arc<hexq_model::Checkpoint>,
    seqs: &[Vec<u32>],
    schemes: &[Scheme],
    builds: &[Build],
    heavy_tail: bool,
    o: &hexq_graph::GraphOptions,
    batch: usize,
    pb: &indicatif::ProgressBar,
) -> hexq_model::Result<Report> {
    use hexq_graph::Variant;
    use hexq_runtime::graph::GraphBackend;
    let batch = batch.max(1);
    if heavy_tail && !builds.is_empty() {
        return Err(hexq_model::Error::Usage(
            "--heavy-tail changes the weights; an encodings file describes the checkpoint's own (drop one)"
                .into(),
        ));
    }
    // Rings as long as the sequences reach (the same figures; see `build::spanning`), hooks under the full
    // graph's names.
    let reach = seqs.iter().map(|s| s.len()).max().unwrap_or(0);
    let span = hexq_graph::build::spanning(&ck.config, Variant::DecodeWgqa, o, reach);
    let go = span.as_ref().map_or(*o, |s| s.options);
    let names: Arc<std::collections::HashMap<String, String>> = Arc::new(
        span.map(|s| s.tensors.into_iter().map(|(k, v)| (k, v.0)).collect())
            .unwrap_or_default(),
    );
    let head = hexq_runtime::graph::Head::of(ck)?;
    let positions: usize = seqs.iter().map(|s| s.len()).sum();
    pb.set_length(((schemes.len() + builds.len() + 1) * positions) as u64);
    let profile = std::env::var_os("HEXQ_PROFILE").is_some();
    let clock = std::time::Instant::now();
    let lap = |what: &str| {
        if profile {
            eprintln!(
                "ablate: {what} done at {:.1} s",
                clock.elapsed().as_secs_f64()
            );
        }
    };
    let backend = |scheme: Option<Scheme>| -> hexq_model::Result<(GraphBackend, Sqnr)> {
        let sqnr: Sqnr = Default::default();
        let mut b = GraphBackend::for_model(ck, Variant::DecodeWgqa, false, &go)?;
        lap("load");
        if scheme.is_some() || heavy_tail {
            b.bake(&mut hexq_graph::interp::Renamed {
                inner: Box::new(GridHook {
                    scheme,
                    heavy_tail,
                    sqnr: sqnr.clone(),
                }),
                names: names.clone(),
            })?;
            lap("bake");
        }
        Ok((b, sqnr))
    };
    let build_backend = |bd: &Build| -> hexq_model::Result<(GraphBackend, Sqnr)> {
        let sqnr: Sqnr = Default::default();
        let mut b = GraphBackend::for_model(ck, Variant::DecodeWgqa, false, &go)?;
        lap("load");
        b.bake(&mut hexq_graph::interp::Renamed {
            inner: Box::new(Measured {
                inner: FakeQuant::params_of(&bd.enc),
                sqnr: sqnr.clone(),
            }),
            names: names.clone(),
        })?;
        b.hook = Some(Box::new(hexq_graph::interp::Renamed {
            inner: Box::new(FakeQuant::activations(&bd.enc).on_grid(&b.decode.graph, &names)),
            names: names.clone(),
        }));
        lap("bake");
        Ok((b, sqnr))
    };
    // Float: logits, log-sum-exp and hidden state at every position.
    let slots: Vec<Vec<Mutex<Option<FloatAt>>>> = seqs
        .iter()
        .map(|s| s.iter().map(|_| Mutex::new(None)).collect())
        .collect();
    {
        let (mut b, _) = backend(None)?;
        teacher_forced(&mut b, &head, seqs, batch, pb, &|s, p, h, l| {
            *slots[s][p].lock().unwrap() = Some(FloatAt {
                logits: l.to_vec(),
                lse: lse(l),
                hidden: h.to_vec(),
            });
        })?;
    }
    lap("float pass");
    let float: Vec<Vec<FloatAt>> = slots
        .into_iter()
        .map(|v| {
            v.into_iter()
                .map(|m| m.into_inner().unwrap().unwrap())
                .collect()
        })
        .collect();
    let ppl = |nll: &mut dyn Iterator<Item = f64>| {
        let (mut sum, mut n) = (0f64, 0usize);
        for x in nll {
            sum += x;
            n += 1;
        }
        (sum / n.max(1) as f64).exp()
    };
    let next_nll = |s: usize, p: usize, l: &[f32], z: f64| {
        seqs[s].get(p + 1).map(|&t| z - l[t as usize] as f64)
    };
    let float_perplexity = ppl(&mut seqs.iter().enumerate().flat_map(|(s, ids)| {
        let float = &float;
        (0..ids.len()).filter_map(move |p| next_nll(s, p, &float[s][p].logits, float[s][p].lse))
    }));
    let mut rows = Vec::new();
    /// One row's source: a weight grid or a whole build.
    enum Cand<'a> {
        Grid(&'a Scheme),
        Build(&'a Build),
    }
    let cands = schemes
        .iter()
        .map(Cand::Grid)
        .chain(builds.iter().map(Cand::Build));
    for cand in cands {
        let (name, (mut b, sq)) = match cand {
            Cand::Grid(sc) => (&sc.name, backend(Some(sc.clone()))?),
            Cand::Build(bd) => (&bd.name, build_backend(bd)?),
        };
        let at: Vec<Vec<Mutex<At>>> = seqs
            .iter()
            .map(|s| s.iter().map(|_| Mutex::new(At::default())).collect())
            .collect();
        teacher_forced(&mut b, &head, seqs, batch, pb, &|s, p, h, l| {
            let f = &float[s][p];
            let zq = lse(l);
            let kl = f
                .logits
                .iter()
                .zip(l)
                .map(|(&a, &b)| {
                    let la = a as f64 - f.lse;
                    la.exp() * (la - (b as f64 - zq))
                })
                .sum::<f64>();
            *at[s][p].lock().unwrap() = At {
                agree: hexq_model::forward::argmax(&f.logits) == hexq_model::forward::argmax(l),
                kl,
                cos: cos(&f.hidden, h),
                nll: next_nll(s, p, l, zq),
            };
        })?;
        drop(b);
        lap(name);
        let at: Vec<At> = at
            .into_iter()
            .flatten()
            .map(|m| m.into_inner().unwrap())
            .collect();
        let n = positions.max(1) as f64;
        let mut sqnr: BTreeMap<String, f64> = sq
            .lock()
            .unwrap()
            .iter()
            .map(|(k, (s, n, _))| (k.to_string(), sqnr_db(*s, *n)))
            .collect();
        // A grid also on the (host-side) embedding table, for its SQNR; a build keeps it in float.
        let (bits_per_weight, decoder_mib, activations) = match cand {
            Cand::Grid(sc) => {
                sqnr.insert("embeddings".into(), embedding_sqnr(ck, sc.grid)?);
                lap("embedding SQNR");
                let (b, m) = accounting(ck, |spec| {
                    (!(sc.mlp_only && spec.role != Role::Mlp)).then(|| sc.bpw(spec.shape[1]))
                });
                (b, m, "float".to_string())
            }
            Cand::Build(bd) => {
                let (b, m) = accounting(ck, |spec| build_bpw(&bd.enc, spec));
                (b, m, bd.activations())
            }
        };
        rows.push(Row {
            scheme: name.clone(),
            activations,
            bits_per_weight,
            decoder_mib,
            sqnr_db: sqnr,
            top1_agreement: at.iter().filter(|a| a.agree).count() as f64 / n,
            kl_mean: at.iter().map(|a| a.kl).sum::<f64>() / n,
            perplexity: ppl(&mut at.iter().filter_map(|a| a.nll)),
            hidden_cosine_mean: at.iter().map(|a| a.cos).sum::<f64>() / n,
        });
    }
    Ok(Report {
        model: ck.dir.display().to_string(),
        heavy_tail,
        prompts: seqs.len(),
        positions,
        float_perplexity,
        rows,
    })
}

/// Embeddings (host-side tables; SQNR only — the accuracy columns quantize the decoder), in row blocks so
/// an E2B table never sits in f32 whole.
fn embedding_sqnr(ck: &hexq_model::Checkpoint, grid: Grid) -> hexq_model::Result<f64> {
    use hexq_graph::interp::WeightSource;
    use rayon::prelude::*;
    let e = ck.rows(hexq_model::names::EMBED)?;
    let grid = resolve(grid, e.inp);
    // Per-row sums collected, then added in row order: rayon's reduce tree follows its work splitting, which
    // moved the last digits from run to run.
    let per: Vec<(f64, f64)> = (0..e.out)
        .into_par_iter()
        .map_init(
            || (Vec::new(), Vec::new()),
            |(buf, row), j| {
                row.clear();
                row.extend_from_slice(e.row(j, buf));
                row_grid(grid, row);
                err_sums(e.row(j, buf), row)
            },
        )
        .collect();
    let (s, n) = per.iter().fold((0.0, 0.0), |a, b| (a.0 + b.0, a.1 + b.1));
    Ok(sqnr_db(s, n))
}

/// (bits per quantized weight, decoder MiB) from the tensor table: 2-D weights at `bpw`'s bits/weight when
/// it quantizes them, the rest bf16; host-side vocab tables excluded.
fn accounting(
    ck: &hexq_model::Checkpoint,
    bpw: impl Fn(&hexq_model::names::TensorSpec) -> Option<f64>,
) -> (f64, f64) {
    let (mut bits, mut params, mut bytes) = (0f64, 0f64, 0f64);
    for (spec, _) in &ck.tensors {
        if spec.role.is_vocab() {
            continue;
        }
        let n = spec.numel() as f64;
        if let Some(b) = (spec.shape.len() == 2).then(|| bpw(spec)).flatten() {
            bits += b * n;
            params += n;
            bytes += b * n / 8.0;
        } else {
            bytes += 2.0 * n;
        }
    }
    (bits / params.max(1.0), bytes / (1u64 << 20) as f64)
}

/// A MatMul weight's bits/weight under an encodings file: LPBQ (int4 + the block's scale in 8 bits + an f32 per
/// channel), per-channel or per-tensor (bits + an f32 per channel); None when the file leaves it float.
fn build_bpw(enc: &hexq_quantize::Encodings, spec: &hexq_model::names::TensorSpec) -> Option<f64> {
    let name = format!("{}.T", spec.name);
    let n = spec.numel() as f64;
    if let Some(l) = enc.lpbq_encodings.get(&name) {
        // The block's scale integer (bw − compressed_bw = 4 bits) sits in an 8-bit container, as in the
        // exported uint8 DequantizeLinear chain and [`Scheme::bpw`].
        return Some(
            l.compressed_bw as f64 + 8.0 / l.block_size as f64 + 32.0 * l.scale.len() as f64 / n,
        );
    }
    let e = enc.param_encodings.get(&name)?;
    Some(e.first()?.bitwidth as f64 + 32.0 * e.len() as f64 / n)
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
        // The activations column only when a build sits beside the weights-only grids.
        let acts = self.rows.iter().any(|r| r.activations != "float");
        let mut s = format!(
            "{}ablation{} — {} prompts, {} positions; float perplexity {:.3}\n\n| scheme |{} bits/weight | decoder MiB | {} | top-1 vs float | KL mean | perplexity | hidden cos |\n|---|{}---|---|{}---|---|---|---|\n",
            if acts { "" } else { "weights-only " },
            if self.heavy_tail { " (heavy-tailed input channels)" } else { "" },
            self.prompts,
            self.positions,
            self.float_perplexity,
            if acts { " activations |" } else { "" },
            classes.iter().map(|c| format!("SQNR {c} dB")).collect::<Vec<_>>().join(" | "),
            if acts { "---|" } else { "" },
            "---|".repeat(classes.len())
        );
        for r in &self.rows {
            s += &format!(
                "| {} |{} {:.3} | {:.2} | {} | {:.1} % | {:.4} | {:.3} | {:.5} |\n",
                r.scheme,
                if acts {
                    format!(" {} |", r.activations)
                } else {
                    String::new()
                },
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
        let mut s = String::from("scheme,activations,bits_per_weight,decoder_mib,sqnr_attention_db,sqnr_mlp_db,sqnr_embeddings_db,top1_agreement,kl_mean,perplexity,hidden_cosine_mean\n");
        for r in &self.rows {
            let g = |k: &str| {
                r.sqnr_db
                    .get(k)
                    .map(|v| format!("{v:.3}"))
                    .unwrap_or_default()
            };
            s += &format!(
                "{},{},{:.4},{:.3},{},{},{},{:.5},{:.6},{:.5},{:.6}\n",
                r.scheme,
                r.activations,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The in-place q4_0 group equals ggml's quantize_row_q4_0_ref → dequantize (hexq_gguf's mirror, itself
    /// tested bit-identical to gguf-py) bit for bit: random groups, an all-zero one, a negative extreme, ties.
    #[test]
    fn q4_group_equals_ggml() {
        let mut s = 7u64;
        let mut rnd = || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.2
        };
        let mut groups: Vec<Vec<f32>> = (0..2000)
            .map(|_| (0..32).map(|_| rnd()).collect())
            .collect();
        groups.push(vec![0.0; 32]);
        groups.push(
            (0..32)
                .map(|k| if k == 3 { -1.0 } else { k as f32 / 64.0 })
                .collect(),
        );
        groups.push((0..32).map(|k| (k as f32 - 16.0) / 8.0).collect());
        for g in groups {
            let mut b = Vec::new();
            hexq_gguf::ggml::quantize_q4_0(&g, &mut b).unwrap();
            let want = hexq_gguf::ggml::dequantize_q4_0(&b);
            let mut got = g.clone();
            let d = q4_group(&mut got);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{g:?}");
            assert_eq!(d, f16::from_le_bytes([b[0], b[1]]).to_f32());
        }
    }
}
