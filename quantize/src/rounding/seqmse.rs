//! Sequential MSE as aimet-onnx 2.42 does it (`aimet_onnx/sequential_mse/seq_mse.py`, read for this
//! module): for each weight, `num_candidates` (20) encodings from the min-max one — candidate k's range is
//! `[min · k/20, max · k/20]` (in f32, as numpy computes it), its encoding recomputed by the min-max rule —
//! and per output channel the candidate with the least `Σ_tokens (x·w − x·q_k(w))²` (torch `mse_loss`
//! summed over tokens, inputs symmetric: `symqt`). With LPBQ, block grouping is off during the search (every
//! block its own float scale and candidates, the loss per channel and block over that block's inputs), and
//! the chosen block scales are compressed to LPBQ afterwards.
//!
//! The loss is evaluated exactly from the inputs' Gram matrix: `Σ_t (x_t·δ)² = δᵀ(Σ x xᵀ)δ`.
//! One departure: aimet feeds each layer the outputs of the layers before it with their weights already
//! quantized; hexq's inputs are the float model's, gathered in one calibration pass (no pass per layer).

use crate::lpbq::{self, Lpbq};
use crate::Encoding;
use candle_core::{Device, Tensor};
use hexq_calibrate::imatrix::Gram;

pub const CANDIDATES: usize = 20;

/// `δ_r ᵀ H δ_r` for every row `r` of `d` ([rows, n]); `h` is [n, n] f32.
fn row_losses(d: Vec<f32>, rows: usize, n: usize, h: &Tensor) -> Vec<f32> {
    let dt = Tensor::from_vec(d, (rows, n), &Device::Cpu).expect("shape");
    let hd = dt.matmul(h).expect("matmul");
    (hd * &dt)
        .and_then(|p| p.sum(1))
        .and_then(|s| s.to_vec1())
        .expect("sum")
}

/// aimet's candidate `k` (0-based) of an encoding's range, in f32.
fn candidate(e: &Encoding, k: usize, bw: u32) -> Encoding {
    let nc = CANDIDATES as f32;
    let f = (k + 1) as f32;
    let lo = (e.min as f32) / nc * f;
    let hi = (e.max as f32) / nc * f;
    Encoding::compute(bw, lo as f64, hi as f64, e.is_symmetric)
}

/// Per-channel encodings of `w` ([out, in]) chosen from `base` (one per row).
pub fn per_channel(w: &[f32], n: usize, gram: &Gram, base: &[Encoding]) -> Vec<Encoding> {
    let rows = w.len() / n;
    let h = gram_f32(gram, 0, n);
    let mut best: Vec<(f32, Encoding)> = base.iter().map(|e| (f32::INFINITY, e.clone())).collect();
    for k in 0..CANDIDATES {
        let cands: Vec<Encoding> = base.iter().map(|e| candidate(e, k, e.bitwidth)).collect();
        let d: Vec<f32> = w
            .chunks(n)
            .zip(&cands)
            .flat_map(|(row, e)| row.iter().map(move |&x| x - e.fake_param(x)))
            .collect();
        for ((b, l), e) in best.iter_mut().zip(row_losses(d, rows, n, &h)).zip(cands) {
            // torch's min(0) keeps the first of equal losses.
            if l < b.0 {
                *b = (l, e);
            }
        }
    }
    best.into_iter().map(|(_, e)| e).collect()
}

/// LPBQ of `w` ([out, in]) with every block's scale chosen by SeqMSE before the compression.
pub fn lpbq_blocks(
    w: &[f32],
    n: usize,
    gram: &Gram,
    block: usize,
    bw: u32,
    scale_bits: u32,
) -> Lpbq {
    let rows = w.len() / n;
    let nb = n / block;
    let base = lpbq::block_scales(w, n, block, bw);
    let h = 2f64.powi(bw as i32 - 1);
    let enc = |s: f64| Encoding {
        bitwidth: bw,
        dtype: "int".into(),
        is_symmetric: true,
        min: -h * s,
        max: (h - 1.0) * s,
        offset: -h as i64,
        scale: s,
    };
    let mut chosen = vec![(f32::INFINITY, 0f64); rows * nb];
    for b in 0..nb {
        let hb = gram_f32(gram, b * block, block);
        for k in 0..CANDIDATES {
            let cands: Vec<Encoding> = (0..rows)
                .map(|r| candidate(&enc(base[r * nb + b]), k, bw))
                .collect();
            let d: Vec<f32> = (0..rows)
                .flat_map(|r| {
                    let e = &cands[r];
                    w[r * n + b * block..r * n + (b + 1) * block]
                        .iter()
                        .map(move |&x| x - e.fake_param(x))
                })
                .collect();
            for (r, l) in row_losses(d, rows, block, &hb).into_iter().enumerate() {
                if l < chosen[r * nb + b].0 {
                    chosen[r * nb + b] = (l, cands[r].scale);
                }
            }
        }
    }
    let scales: Vec<f64> = chosen.into_iter().map(|(_, s)| s).collect();
    lpbq::from_block_scales(&scales, nb, block, bw, scale_bits)
}

/// The `len × len` diagonal block of `gram` from index `at`, as an f32 tensor.
fn gram_f32(gram: &Gram, at: usize, len: usize) -> Tensor {
    let v: Vec<f32> = (at..at + len)
        .flat_map(|i| (at..at + len).map(move |j| gram.get(i, j) as f32))
        .collect();
    Tensor::from_vec(v, (len, len), &Device::Cpu).expect("shape")
}
