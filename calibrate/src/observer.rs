//! The range observer: min/max (+ count) of every float tensor the graph computes, merged order-free.

use crate::Range;
use candle_core::{DType as CD, Tensor};
use hexq_graph::interp::Hook;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};

/// Observer hook: min/max of every float graph input and node output (initializers are weights/constants:
/// their encodings come from their values, not from calibration).
#[derive(Clone, Default)]
pub struct RangeObserver {
    pub skip: Arc<HashSet<String>>,
    pub ranges: Arc<Mutex<BTreeMap<String, Range>>>,
    /// Tensors whose every value is also kept (for independent judges of the encodings).
    pub capture: Arc<HashSet<String>>,
    pub captured: Arc<Mutex<BTreeMap<String, Vec<Vec<f32>>>>>,
    /// Observing a shorter-ring graph for the full one ([`hexq_graph::build::Span::tensors`]): recorded
    /// under the full graph's names with its element counts.
    pub span: Arc<HashMap<String, (String, usize, usize)>>,
    /// The importance matrix (`hexq imatrix`): Σx² of every weighted MatMul's input, beside the ranges.
    pub squares: Option<Arc<crate::imatrix::SquareSums>>,
}

impl RangeObserver {
    /// The full graph's name for `name` and the element count a tensor of `n` elements stands for.
    fn full<'a>(&'a self, name: &'a str, n: usize) -> (&'a str, u64) {
        match self.span.get(name) {
            Some((full, a, b)) if *b > 0 => (full, (n / b * a) as u64),
            Some((full, _, _)) => (full, n as u64),
            None => (name, n as u64),
        }
    }
}

impl Hook for RangeObserver {
    fn observes_only(&self) -> bool {
        self.capture.is_empty()
    }

    /// A batch's tensors scanned in parallel, merged once (min/max/count merge order-free: the same ranges).
    fn tensors(&mut self, name: &str, ts: &[Tensor]) -> Vec<Option<Tensor>> {
        use rayon::prelude::*;
        let work: usize = ts.iter().map(|t| t.elem_count()).sum();
        if ts.len() < 2
            || work < hexq_graph::interp::PAR_MIN
            || self.skip.contains(self.full(name, 0).0)
            || !self.capture.is_empty()
        {
            return ts.iter().map(|t| self.tensor(name, t)).collect();
        }
        if let Some(sq) = self
            .squares
            .as_ref()
            .filter(|q| q.watches(self.full(name, 0).0))
        {
            let full = self.full(name, 0).0;
            ts.par_iter().for_each(|t| sq.add(full, t));
        }
        let me = &*self;
        let rs: Vec<Range> = ts
            .par_iter()
            .filter(|t| t.dtype() == CD::F32)
            .filter_map(|t| {
                min_max(t).map(|(min, max)| Range {
                    min,
                    max,
                    count: me.full(name, t.elem_count()).1,
                })
            })
            .collect();
        let name = self.full(name, 0).0;
        let mut m = self.ranges.lock().unwrap();
        for r in rs {
            m.entry(name.to_string())
                .and_modify(|e| e.merge(&r))
                .or_insert(r);
        }
        vec![None; ts.len()]
    }

    fn tensor(&mut self, name: &str, t: &Tensor) -> Option<Tensor> {
        let (name, count) = self.full(name, t.elem_count());
        if t.dtype() != CD::F32 || self.skip.contains(name) {
            return None;
        }
        if let Some(sq) = &self.squares {
            sq.add(name, t);
        }
        if self.capture.contains(name) {
            let v: Vec<f32> = t.flatten_all().ok()?.to_vec1().ok()?;
            self.captured
                .lock()
                .unwrap()
                .entry(name.to_string())
                .or_default()
                .push(v);
        }
        let (lo, hi) = min_max(t)?;
        let r = Range {
            min: lo,
            max: hi,
            count,
        };
        self.ranges
            .lock()
            .unwrap()
            .entry(name.to_string())
            .and_modify(|e| e.merge(&r))
            .or_insert(r);
        None
    }
}

/// Min and max of an f32 tensor, read in place when contiguous (a KV buffer is not copied to be scanned).
/// NaN would poison min/max silently; it counts as +inf, an infinite range that is visible.
fn min_max(t: &Tensor) -> Option<(f32, f32)> {
    {
        // A permuted view of a dense block (the transposed KV ring a score MatMul reads) holds the same
        // values as the block: min/max are order-free, so scan the block instead of copying the view.
        let (st, layout) = t.storage_and_layout();
        if let candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)) = &*st {
            let mut ds: Vec<(usize, usize)> = layout
                .stride()
                .iter()
                .copied()
                .zip(layout.dims().iter().copied())
                .filter(|&(_, d)| d > 1)
                .collect();
            ds.sort_by_key(|a| std::cmp::Reverse(a.0));
            let mut want = 1;
            let dense = ds.iter().rev().all(|&(s, d)| {
                let ok = s == want;
                want *= d;
                ok
            });
            let (a, n) = (layout.start_offset(), t.elem_count());
            if dense && a + n <= v.len() {
                return Some(hexq_model::weights::min_max(&v[a..a + n]));
            }
        }
    }
    hexq_graph::interp::with_f32(t, hexq_model::weights::min_max).ok()
}
