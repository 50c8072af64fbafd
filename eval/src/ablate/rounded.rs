//! Calibration-aware roundings as ablation rows: each grid of [`Grid`] crossed with the roundings that
//! apply to it, and the tied embedding / LM head optionally quantized too.
//!
//! - `imatrix` (llama.cpp's, on the q4_0 rule's groups): each group's scale by ggml's importance-weighted
//!   search (`make_qx_quants` with `qw·sqrt(σ² + x²)`, [`hexq_gguf::weighted`]); the importance of an
//!   input column is its mean x² over the calibration inputs (the Gram's diagonal / rows, what
//!   `hexq imatrix` writes). At 32 it is `llama-quantize --imatrix`'s q4_0 exactly.
//! - `seqmse` (aimet-onnx's, on per-channel and LPBQ grids): [`hexq_quantize::rounding::seqmse`].
//! - `gptq` on every grid, the grid's scales fixed first (min-max, ggml's q4_0 rule, or SeqMSE's for
//!   `seqmse-gptq`): [`hexq_quantize::rounding::gptq`].
//!
//! The same functions `hexq quantize --rounding` and `hexq gguf --imatrix|--rounding gptq` run, so a row is
//! what those builds hold. The head is rounded to nearest in every row (its quantization is what the
//! `head` column isolates).

use super::grid::{err_sums, resolve, row_grid, Grid, Scheme};
use hexq_calibrate::imatrix::Gram;
use hexq_quantize::rounding::{gptq, seqmse};
use hexq_quantize::Encoding;
use std::collections::BTreeMap;
use std::sync::Arc;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rounding {
    Rtn,
    Imatrix,
    SeqMse,
    Gptq,
    SeqMseGptq,
}

impl Rounding {
    pub const ALL: [Rounding; 5] = [
        Rounding::Rtn,
        Rounding::Imatrix,
        Rounding::SeqMse,
        Rounding::Gptq,
        Rounding::SeqMseGptq,
    ];
    pub fn name(self) -> &'static str {
        match self {
            Rounding::Rtn => "rtn",
            Rounding::Imatrix => "imatrix",
            Rounding::SeqMse => "seqmse",
            Rounding::Gptq => "gptq",
            Rounding::SeqMseGptq => "seqmse-gptq",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.name() == s)
    }
    /// Whether the rounding is defined on `grid`: the importance matrix is llama.cpp's, for its group
    /// grids; SeqMSE is aimet's, for per-channel and LPBQ grids; GPTQ takes any fixed grid.
    pub fn applies(self, grid: Grid) -> bool {
        match self {
            Rounding::Rtn | Rounding::Gptq => true,
            Rounding::Imatrix => matches!(grid, Grid::Group(_)),
            Rounding::SeqMse | Rounding::SeqMseGptq => !matches!(grid, Grid::Group(_)),
        }
    }
}

/// The tied embedding / LM head in a row: float (the decoder alone quantized), at 8 bits (q8_0 beside the
/// q4_0 grids, as llama.cpp's default q4_0 file keeps a tied output of width 640; int8 per channel beside
/// the QNN grids), or on the row's own grid (llama-quantize `--pure`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Head {
    Float,
    Eight,
    Same,
}

impl Head {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "float" => Some(Head::Float),
            "8" | "int8" => Some(Head::Eight),
            "same" | "4" => Some(Head::Same),
            _ => None,
        }
    }
    /// The head's grid as the table names it.
    pub fn name(self, grid: Grid) -> String {
        match (self, grid) {
            (Head::Float, _) => "float".into(),
            (Head::Eight, Grid::Group(_)) => "q8_0".into(),
            (Head::Eight, _) => "int8-pc".into(),
            (Head::Same, _) => "same".into(),
        }
    }
}

/// One weights-only row: a grid, a rounding, a head.
#[derive(Debug, Clone)]
pub struct Cell {
    pub scheme: Scheme,
    pub rounding: Rounding,
    pub head: Head,
}

/// What the calibration-aware roundings read: each MatMul weight's input Σxxᵀ (checkpoint tensor →
/// Gram, from the chat-formatted decode loops) and GPTQ's options.
pub struct Inputs {
    pub grams: BTreeMap<String, Arc<Gram>>,
    pub gptq: gptq::Options,
    /// GPTQ's factor of each Gram, made once for every cell that rounds by GPTQ.
    pub factors: gptq::Factors,
}

/// Σx², Σ(x−q)², count per tensor class.
pub type ClassSums = BTreeMap<&'static str, (f64, f64, u64)>;

/// The decoder's MatMul weights on `sc`'s grid rounded by `r`: checkpoint tensor → `[out, in]` values,
/// each on its grid, and the error sums per class against the checkpoint's weights.
pub fn round_decoder(
    ck: &hexq_model::Checkpoint,
    sc: &Scheme,
    r: Rounding,
    inp: &Inputs,
    progress: &dyn Fn(&str),
) -> hexq_model::Result<(BTreeMap<String, Vec<f32>>, ClassSums)> {
    let (mut out, mut sums) = (BTreeMap::new(), ClassSums::new());
    for (tensor, gram) in &inp.grams {
        let class = super::class_of(tensor);
        if sc.mlp_only && class != "mlp" {
            continue;
        }
        progress(tensor);
        let n = ck.info(tensor)?.shape[1];
        let w = ck.f32(tensor)?;
        let q = round_one(&w, n, resolve(sc.grid, n), r, gram, inp).map_err(|msg| {
            hexq_model::Error::Encoding {
                tensor: tensor.clone(),
                msg,
            }
        })?;
        let (s, e) = err_sums(&w, &q);
        let c = sums.entry(class).or_insert((0.0, 0.0, 0));
        *c = (c.0 + s, c.1 + e, c.2 + w.len() as u64);
        out.insert(tensor.clone(), q);
    }
    Ok((out, sums))
}

/// One weight `w` (`[out, n]`) on a resolved grid by rounding `r`.
fn round_one(
    w: &[f32],
    n: usize,
    grid: Grid,
    r: Rounding,
    gram: &Arc<Gram>,
    inp: &Inputs,
) -> Result<Vec<f32>, String> {
    let with_gptq = matches!(r, Rounding::Gptq | Rounding::SeqMseGptq);
    let seq = matches!(r, Rounding::SeqMse | Rounding::SeqMseGptq);
    match grid {
        Grid::PerChannel(b) => {
            let base: Vec<Encoding> = w
                .chunks(n)
                .map(|row| {
                    let (lo, hi) = hexq_model::weights::min_max(row);
                    Encoding::compute(b, lo as f64, hi as f64, true)
                })
                .collect();
            let e = match seq {
                true => seqmse::per_channel(w, n, gram, &base),
                false => base,
            };
            let at = |c: usize, _: usize, x: f32| e[c].fake_param(x);
            on_grid(w, n, gram, inp, with_gptq, &at)
        }
        Grid::Lpbq(b) => {
            let l = match seq {
                true => seqmse::lpbq_blocks(w, n, gram, b, 4, 4),
                false => hexq_quantize::lpbq::encode(w, n, b, 4, 4),
            };
            let at = |c: usize, i: usize, x: f32| l.fake_one(c, i, x, n);
            on_grid(w, n, gram, inp, with_gptq, &at)
        }
        Grid::Group(g) if r == Rounding::Imatrix => Ok(imatrix_groups(w, n, g, gram)),
        Grid::Group(g) => {
            use hexq_gguf::ggml::{q4_0_point, q4_0_scale};
            let scales: Vec<(f32, f32)> = w
                .chunks(n)
                .flat_map(|row| row.chunks(g).map(q4_0_scale))
                .collect();
            let per = n.div_ceil(g);
            let at = |c: usize, i: usize, x: f32| {
                let (d, id) = scales[c * per + i / g];
                q4_0_point(x, d, id)
            };
            on_grid(w, n, gram, inp, with_gptq, &at)
        }
    }
}

/// Every value of `w` to its grid point (`at(row, col, x)`): by GPTQ, or to nearest.
fn on_grid(
    w: &[f32],
    n: usize,
    gram: &Arc<Gram>,
    inp: &Inputs,
    with_gptq: bool,
    at: &(dyn Fn(usize, usize, f32) -> f32 + Sync),
) -> Result<Vec<f32>, String> {
    if with_gptq {
        if gram.n != n {
            return Err(format!(
                "the input statistics are {0}×{0}, the weight has {n} inputs",
                gram.n
            ));
        }
        let f = inp.factors.get(gram, &inp.gptq)?;
        return gptq::gptq(w, &f, at, &inp.gptq);
    }
    Ok(w.iter()
        .enumerate()
        .map(|(k, &x)| at(k / n, k % n, x))
        .collect())
}

/// The q4_0 rule over groups of `g` with ggml's importance-weighted scale search (`quantize_row_q4_0_impl`
/// generalized from 32 to `g`), dequantized: each group's values `(L − 8)·fp16(d)`.
pub fn imatrix_groups(w: &[f32], n: usize, g: usize, gram: &Gram) -> Vec<f32> {
    use rayon::prelude::*;
    let rows = gram.rows.max(1) as f64;
    let qw: Vec<f32> = (0..n).map(|i| (gram.diag(i) / rows) as f32).collect();
    let mut out = w.to_vec();
    out.par_chunks_mut(n).for_each(|row| {
        let mut sum_x2 = 0f32;
        for &v in row.iter() {
            sum_x2 += v * v;
        }
        let sigma2 = sum_x2 / n as f32;
        let (mut l, mut wt) = (vec![0i8; g], vec![0f32; g]);
        for (xb, qb) in row.chunks_mut(g).zip(qw.chunks(g)) {
            for ((w, &x), &q) in wt.iter_mut().zip(xb.iter()).zip(qb) {
                *w = q * (sigma2 + x * x).sqrt();
            }
            let k = xb.len();
            let d = hexq_gguf::weighted::make_qx_quants(8, xb, &mut l[..k], &wt[..k]);
            let d = half::f16::from_f32(d).to_f32();
            for (x, &q) in xb.iter_mut().zip(&l) {
                *x = (q as i32 - 8) as f32 * d;
            }
        }
    });
    out
}

/// The tied embedding (and an untied LM head) on the head's grid for a row of `grid`, to nearest; None
/// for a float head. Also the error sums of the embedding table.
pub fn head_values(
    ck: &hexq_model::Checkpoint,
    grid: Grid,
    head: Head,
) -> hexq_model::Result<Option<(BTreeMap<String, Vec<f32>>, (f64, f64))>> {
    use hexq_model::names::{EMBED, LM_HEAD};
    use rayon::prelude::*;
    if head == Head::Float {
        return Ok(None);
    }
    let mut names = vec![EMBED];
    if !ck.config.tie_word_embeddings {
        names.push(LM_HEAD);
    }
    let mut out = BTreeMap::new();
    let mut sums = (0.0, 0.0);
    for name in names {
        let n = ck.info(name)?.shape[1];
        let w = ck.f32(name)?;
        let mut q = w.clone();
        let g = resolve(grid, n);
        q.par_chunks_mut(n).for_each(|row| match (head, g) {
            (Head::Eight, Grid::Group(_)) => q8_0_row(row),
            (Head::Eight, _) => {
                row_grid(Grid::PerChannel(8), row);
            }
            _ => {
                row_grid(g, row);
            }
        });
        if name == EMBED {
            sums = err_sums(&w, &q);
        }
        out.insert(name.to_string(), q);
    }
    Ok(Some((out, sums)))
}

/// ggml's q8_0 (`quantize_row_q8_0_ref`, then dequantized) on one row, in place; a short tail group (a
/// width not a multiple of 32) to nearest on its own absmax/127 as well.
fn q8_0_row(row: &mut [f32]) {
    let full = row.len() / 32 * 32;
    let mut b = Vec::new();
    if hexq_gguf::ggml::quantize_q8_0(&row[..full], &mut b).is_ok() {
        row[..full].copy_from_slice(&hexq_gguf::ggml::dequantize_q8_0(&b));
    }
    let tail = &mut row[full..];
    let amax = tail.iter().fold(0f32, |a, v| a.max(v.abs()));
    let d = half::f16::from_f32(amax / 127.0).to_f32();
    if d > 0.0 {
        tail.iter_mut()
            .for_each(|x| *x = (*x / d).round().clamp(-127.0, 127.0) * d);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// At 32, the generalized importance-weighted groups are hexq_gguf's q4_0 (itself bit-identical to
    /// `llama-quantize --imatrix`, tests/gguf.rs) dequantized, bit for bit.
    #[test]
    fn imatrix_groups_at_32_are_llama_quantize_q4_0() {
        let (rows, n) = (6, 128);
        let mut s = 11u64;
        let mut rnd = || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        let w: Vec<f32> = (0..rows * n).map(|_| rnd() * 0.1).collect();
        let mut h = vec![0f64; n * n];
        for i in 0..n {
            h[i * n + i] = (1.0 + 10.0 * rnd().abs() as f64).powi(2) * 7.0;
        }
        let gram = Gram::from_full(n, &h, 7);
        let got = imatrix_groups(&w, n, 32, &gram);
        let qw: Vec<f32> = (0..n).map(|i| (gram.diag(i) / 7.0) as f32).collect();
        for (r, row) in w.chunks(n).enumerate() {
            let mut b = Vec::new();
            hexq_gguf::weighted::q4_0_row(row, &qw, &mut b);
            let want = hexq_gguf::ggml::dequantize_q4_0(&b);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got[r * n..(r + 1) * n]), bits(&want), "row {r}");
        }
    }
}
