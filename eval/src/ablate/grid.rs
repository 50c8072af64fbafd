//! The grids and the hooks that bake them into a checkpoint's decoder weights (kept as integers and scales
//! in the kernels' rows), with the SQNR each grid costs per tensor class.

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
pub(super) fn resolve(grid: Grid, cols: usize) -> Grid {
    match grid {
        Grid::Lpbq(b) if !cols.is_multiple_of(b) => Grid::PerChannel(4),
        g => g,
    }
}

/// Quantize→dequantize one row (one output channel) on a resolved grid, in place. Returns the row's scales,
/// one per `group` inputs (the last group may be short), and `group`: every value is exactly
/// `(integer) as f32 · scale` in f32 — what lets [`GridHook`] keep the grid as integer rows.
pub(super) fn row_grid(grid: Grid, row: &mut [f32]) -> (Vec<f32>, usize) {
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
pub(super) fn err_sums(a: &[f32], b: &[f32]) -> (f64, f64) {
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
pub(super) fn row_ints(row: &[f32], scale: &[f32], group: usize, q: &mut [i16]) -> bool {
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

pub(super) fn add_sqnr(sqnr: &Sqnr, class: &'static str, s: f64, n: f64, count: u64) {
    let mut m = sqnr.lock().unwrap();
    let e = m.entry(class).or_insert((0.0, 0.0, 0));
    e.0 += s;
    e.1 += n;
    e.2 += count;
}

/// A build as an ablation row: an encodings file (`hexq quantize`'s: A16W8, w4a16-lpbq, …) applied as
/// quantsim applies it — params baked once, activations fake-quantized as they are produced.
#[derive(Clone)]
pub struct Build {
    pub name: String,
    pub enc: hexq_quantize::Encodings,
    /// The checkpoint with the build's rounded weights overlaid (GPTQ encodings), when it has them.
    pub weights: Option<std::sync::Arc<hexq_model::Checkpoint>>,
}

impl Build {
    /// The activations' widest grid ("int16" for A16W8 and w4a16), for the table's activations column.
    pub(super) fn activations(&self) -> String {
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
pub(super) struct Measured {
    pub(super) inner: FakeQuant,
    pub(super) sqnr: Sqnr,
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
        let fits = group == w.inp
            || (group >= 16 && group.is_power_of_two() && w.inp.is_multiple_of(group));
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
