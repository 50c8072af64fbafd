//! The importance matrix gathered during calibration: for every weight matrix llama-quantize weights
//! (`blk.*`, as llama-imatrix collects by default), Σx² of each input column over every token the decode
//! loops fed, and the token count — llama.cpp's `IMatrixCollector::collect_imatrix` for a dense MUL_MAT.
//! The sums are kept in f64 (llama.cpp: f32) so that the order parallel chains arrive in does not show in
//! the f32 file; unlike llama-imatrix, single-token decode calls count too (it skips batches under 16
//! tokens, which would drop every decode step — the inputs hexq calibrates on).

use candle_core::{DType as CD, Tensor};
use hexq_graph::ir::{Graph, InitSource, Op};
use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

/// Σx² per input column and the rows seen, for each graph tensor that feeds a weighted MatMul.
pub struct SquareSums {
    /// Activation (full-graph name) → its slot.
    slot: HashMap<String, usize>,
    /// Slot → the GGUF names of the weights it feeds (q, k and v share one input).
    weights: Vec<Vec<String>>,
    sums: Vec<Mutex<(Vec<f64>, u64)>>,
}

impl SquareSums {
    /// The MatMuls of `g` whose weight is a checkpoint tensor with a `blk.` GGUF name.
    pub fn for_graph(g: &Graph) -> Self {
        let inits: HashMap<&str, &str> = g
            .initializers
            .iter()
            .filter_map(|i| match &i.source {
                InitSource::Weight { tensor, .. } => Some((i.name.as_str(), tensor.as_str())),
                _ => None,
            })
            .collect();
        let mut s = SquareSums {
            slot: HashMap::new(),
            weights: Vec::new(),
            sums: Vec::new(),
        };
        for n in g
            .nodes
            .iter()
            .filter(|n| n.op == Op::MatMul && n.inputs.len() == 2)
        {
            let Some(w) = inits.get(n.inputs[1].as_str()) else {
                continue;
            };
            let Some(name) = hexq_model::names::gguf_name(w).filter(|n| n.starts_with("blk."))
            else {
                continue;
            };
            let k = *s.slot.entry(n.inputs[0].clone()).or_insert_with(|| {
                s.weights.push(Vec::new());
                s.sums.push(Mutex::new((Vec::new(), 0)));
                s.weights.len() - 1
            });
            if !s.weights[k].contains(&name) {
                s.weights[k].push(name);
            }
        }
        s
    }

    pub fn watches(&self, name: &str) -> bool {
        self.slot.contains_key(name)
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
        e.1 += (v.len() / cols) as u64;
    }

    /// Per GGUF weight name: (Σx² per column as f32, tokens). Weights whose input was never seen are left out.
    pub fn entries(&self) -> BTreeMap<String, (Vec<f32>, u64)> {
        let mut m = BTreeMap::new();
        for (k, ws) in self.weights.iter().enumerate() {
            let e = self.sums[k].lock().unwrap();
            if e.1 == 0 {
                continue;
            }
            let s: Vec<f32> = e.0.iter().map(|&x| x as f32).collect();
            for w in ws {
                m.insert(w.clone(), (s.clone(), e.1));
            }
        }
        m
    }
}
