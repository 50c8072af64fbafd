//! What each weight's input looked like during calibration, for the roundings that use it:
//! - **Σx² per input column** (`Sums::Squares`): llama.cpp's importance matrix — for every weight matrix
//!   llama-quantize weights (`blk.*`, as llama-imatrix collects by default), Σx² of each input column over
//!   every token the decode loops fed, and the token count (`IMatrixCollector::collect_imatrix` for a dense
//!   MUL_MAT). Unlike llama-imatrix, single-token decode calls count too (it skips batches under 16 tokens,
//!   which would drop every decode step — the inputs hexq calibrates on).
//! - **Σxxᵀ** (`Sums::Gram`): the Gram matrix of the input, `H/2` of GPTQ and the exact form of SeqMSE's
//!   loss (`‖X(w − q)‖² = (w − q)ᵀ Σxxᵀ (w − q)`), for the MatMul weights of a chosen set of layers (E2B's
//!   are ~1 GB a layer in f64, so a caller bounds memory by collecting a few layers a pass).
//!
//! Sums are kept in f64 so that the order parallel chains arrive in does not show in f32 results.

use candle_core::{DType as CD, Tensor};
use hexq_graph::ir::{Graph, InitSource, Op};
use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

/// One weighted MatMul: its initializer (the `[in, out]` view) and the checkpoint tensor behind it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fed {
    pub init: String,
    pub tensor: String,
}

/// Per-input accumulators for each graph tensor that feeds weighted MatMuls.
pub struct SquareSums {
    gram: bool,
    /// Activation (full-graph name) → its slot.
    slot: HashMap<String, usize>,
    /// Slot → the weights it feeds (q, k and v share one input).
    weights: Vec<Vec<Fed>>,
    /// Slot → (Σx² per column; rows seen).
    sums: Vec<Mutex<(Vec<f64>, u64)>>,
    /// Gram mode: slot → Σxxᵀ, made at the first rows.
    grams: Vec<Mutex<Option<Gram>>>,
    /// Gram mode: rows not yet added.
    pending: Vec<Mutex<Vec<f32>>>,
}

const GRAM_ROWS: usize = 512;

/// Columns per block of the upper-triangle product: bounds the f32 transient at 1024 × n.
const GRAM_COLS: usize = 1024;

/// `h += xᵀx` for the rows of `x` (`h.n` wide): the upper triangle only, one block of GRAM_COLS columns
/// at a time (`X[:, b]ᵀ X[:, b..]`) by the f32 GEMM, the sum in f64.
fn add_gram(h: &mut Gram, x: &[f32]) {
    let n = h.n;
    let rows = x.len() / n;
    if rows == 0 {
        return;
    }
    let Ok(t) = Tensor::from_slice(x, (rows, n), &candle_core::Device::Cpu) else {
        return;
    };
    for c0 in (0..n).step_by(GRAM_COLS) {
        let w = GRAM_COLS.min(n - c0);
        let g = t
            .narrow(1, c0, w)
            .and_then(|b| b.t())
            .and_then(|b| b.contiguous())
            .and_then(|b| {
                t.narrow(1, c0, n - c0)
                    .and_then(|r| r.contiguous())
                    .and_then(|r| b.matmul(&r))
            })
            .and_then(|g| g.flatten_all())
            .and_then(|g| g.to_vec1::<f32>());
        if let Ok(g) = g {
            h.add_block_f32(c0, w, &g);
        }
    }
}

impl SquareSums {
    /// Σx² for the MatMuls of `g` whose weight is a checkpoint tensor with a `blk.` GGUF name.
    pub fn for_graph(g: &Graph) -> Self {
        Self::build(g, false, &|t| {
            hexq_model::names::gguf_name(t).is_some_and(|n| n.starts_with("blk."))
        })
    }

    /// Σxxᵀ for the MatMuls of `g` whose checkpoint weight `keep` accepts (prefix-relative names).
    pub fn gram_for(g: &Graph, keep: &dyn Fn(&str) -> bool) -> Self {
        Self::build(g, true, keep)
    }

    fn build(g: &Graph, gram: bool, keep: &dyn Fn(&str) -> bool) -> Self {
        let inits: HashMap<&str, &str> = g
            .initializers
            .iter()
            .filter_map(|i| match &i.source {
                InitSource::Weight { tensor, .. } => Some((i.name.as_str(), tensor.as_str())),
                _ => None,
            })
            .collect();
        let mut s = SquareSums {
            gram,
            slot: HashMap::new(),
            weights: Vec::new(),
            sums: Vec::new(),
            grams: Vec::new(),
            pending: Vec::new(),
        };
        for n in g
            .nodes
            .iter()
            .filter(|n| n.op == Op::MatMul && n.inputs.len() == 2)
        {
            let Some(&w) = inits.get(n.inputs[1].as_str()).filter(|w| keep(w)) else {
                continue;
            };
            let k = *s.slot.entry(n.inputs[0].clone()).or_insert_with(|| {
                s.weights.push(Vec::new());
                s.sums.push(Mutex::new((Vec::new(), 0)));
                s.grams.push(Mutex::new(None));
                s.pending.push(Mutex::new(Vec::new()));
                s.weights.len() - 1
            });
            let fed = Fed {
                init: n.inputs[1].clone(),
                tensor: w.to_string(),
            };
            if !s.weights[k].contains(&fed) {
                s.weights[k].push(fed);
            }
        }
        s
    }

    pub fn watches(&self, name: &str) -> bool {
        self.slot.contains_key(name)
    }

    /// The weights that read each watched input (q, k, v share one), input by input.
    pub fn inputs(&self) -> impl Iterator<Item = &[Fed]> {
        self.weights.iter().map(|w| w.as_slice())
    }

    /// The weights watched, over all slots.
    pub fn fed(&self) -> impl Iterator<Item = &Fed> {
        self.weights.iter().flatten()
    }

    /// Add one tensor's rows (its last dimension is the input columns).
    pub fn add(&self, name: &str, t: &Tensor) {
        let Some(&k) = self.slot.get(name) else {
            return;
        };
        if t.dtype() != CD::F32 {
            return;
        }
        let cols = *t.dims().last().unwrap_or(&1);
        let rows = t.elem_count() / cols.max(1);
        if self.gram {
            // Rows are gathered and added as one XᵀX GEMM per GRAM_ROWS (a decode step brings a row or
            // a few; a rank-1 update per row was 95 % of the pass).
            let Ok(v) = t.flatten_all().and_then(|f| f.to_vec1::<f32>()) else {
                return;
            };
            let mut e = self.grams[k].lock().unwrap();
            let g = e.get_or_insert_with(|| Gram::zeros(cols, 0));
            if g.n != cols {
                return;
            }
            g.rows += rows as u64;
            let mut p = self.pending[k].lock().unwrap();
            p.extend_from_slice(&v);
            if p.len() >= GRAM_ROWS * cols {
                add_gram(g, &p);
                p.clear();
            }
            return;
        }
        let Ok(v) = t.flatten_all().and_then(|f| f.to_vec1::<f32>()) else {
            return;
        };
        let mut e = self.sums[k].lock().unwrap();
        if e.0.is_empty() {
            e.0 = vec![0.0; cols];
        }
        if e.0.len() != cols {
            return; // not the tensor this slot was built for
        }
        for row in v.chunks_exact(cols) {
            for (a, x) in e.0.iter_mut().zip(row) {
                *a += (*x as f64) * (*x as f64);
            }
        }
        e.1 += rows as u64;
    }

    /// Per GGUF weight name: (Σx² per column as f32, tokens). Weights whose input was never seen are left out.
    pub fn entries(&self) -> BTreeMap<String, (Vec<f32>, u64)> {
        let mut m = BTreeMap::new();
        for (k, ws) in self.weights.iter().enumerate() {
            let s: Vec<f32> = match self.gram {
                false => {
                    let e = self.sums[k].lock().unwrap();
                    if e.1 == 0 {
                        continue;
                    }
                    e.0.iter().map(|&x| x as f32).collect()
                }
                true => match &*self.grams[k].lock().unwrap() {
                    Some(g) if g.rows > 0 => (0..g.n).map(|i| g.diag(i) as f32).collect(),
                    _ => continue,
                },
            };
            let rows = match self.gram {
                false => self.sums[k].lock().unwrap().1,
                true => self.grams[k].lock().unwrap().as_ref().map_or(0, |g| g.rows),
            };
            for w in ws {
                if let Some(name) = hexq_model::names::gguf_name(&w.tensor) {
                    m.insert(name, (s.clone(), rows));
                }
            }
        }
        m
    }

    /// Σxxᵀ and the rows seen, per initializer fed; taken out of the collector (empty afterwards).
    pub fn take_grams(&self) -> BTreeMap<String, std::sync::Arc<Gram>> {
        let mut m = BTreeMap::new();
        for (k, ws) in self.weights.iter().enumerate() {
            let Some(mut g) = self.grams[k].lock().unwrap().take() else {
                continue;
            };
            let p = std::mem::take(&mut *self.pending[k].lock().unwrap());
            add_gram(&mut g, &p);
            if g.rows == 0 {
                continue;
            }
            let g = std::sync::Arc::new(g);
            for w in ws {
                m.insert(w.init.clone(), g.clone());
            }
        }
        m
    }
}

/// Σxxᵀ of one input over the calibration rows, symmetric, kept as its upper triangle (half the memory:
/// E2B's widest input, 12,288, is 0.6 GB so).
#[derive(Debug, Clone)]
pub struct Gram {
    pub n: usize,
    pub rows: u64,
    /// Row `i` holds columns `i..n`, from [`Gram::at`]`(i)`.
    upper: Vec<f64>,
}

impl Gram {
    /// From a full row-major `n × n` matrix (its upper triangle is read).
    pub fn from_full(n: usize, h: &[f64], rows: u64) -> Gram {
        let mut g = Gram::zeros(n, rows);
        for i in 0..n {
            let at = g.at(i);
            g.upper[at..at + n - i].copy_from_slice(&h[i * n + i..i * n + n]);
        }
        g
    }
    /// Bytes of an `n`-wide Gram.
    pub fn bytes(n: usize) -> u64 {
        (n * (n + 1) / 2 * 8) as u64
    }
    fn zeros(n: usize, rows: u64) -> Gram {
        Gram {
            n,
            rows,
            upper: vec![0.0; n * (n + 1) / 2],
        }
    }
    /// Where row `i` (columns `i..n`) starts.
    fn at(&self, i: usize) -> usize {
        // Σ_{r<i} (n − r).
        i * self.n - i * i.saturating_sub(1) / 2
    }
    /// Columns `i..n` of row `i`.
    pub fn upper_row(&self, i: usize) -> &[f64] {
        let at = self.at(i);
        &self.upper[at..at + self.n - i]
    }
    pub fn get(&self, i: usize, j: usize) -> f64 {
        let (a, b) = if i <= j { (i, j) } else { (j, i) };
        self.upper[self.at(a) + b - a]
    }
    pub fn diag(&self, i: usize) -> f64 {
        self.upper[self.at(i)]
    }
    /// Add rows `c0..c0 + w` of the upper triangle from `g` (`w × (n − c0)`, columns from `c0`).
    fn add_block_f32(&mut self, c0: usize, w: usize, g: &[f32]) {
        let (n, span) = (self.n, self.n - c0);
        for r in 0..w {
            let i = c0 + r;
            let at = self.at(i);
            self.upper[at..at + n - i]
                .iter_mut()
                .zip(&g[r * span + r..(r + 1) * span])
                .for_each(|(a, x)| *a += *x as f64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocked_upper_gram_is_xtx() {
        // Wider than one block of columns, with a ragged last block.
        let (rows, n) = (7usize, GRAM_COLS + 37);
        let x: Vec<f32> = (0..rows * n)
            .map(|i| ((i * 7919 % 211) as f32 / 211.0) - 0.5)
            .collect();
        let mut g = Gram::zeros(n, rows as u64);
        add_gram(&mut g, &x);
        for (i, j) in [
            (0, 0),
            (3, 900),
            (1000, 1030),
            (1030, 1060),
            (n - 1, n - 1),
            (5, n - 1),
        ] {
            let want: f64 = (0..rows)
                .map(|r| x[r * n + i] as f64 * x[r * n + j] as f64)
                .sum();
            assert!(
                (g.get(i, j) - want).abs() < 1e-4,
                "({i},{j}) {} vs {want}",
                g.get(i, j)
            );
            assert_eq!(g.get(i, j), g.get(j, i));
        }
    }
}
