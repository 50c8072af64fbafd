//! CPU interpreter for the IR, f32 (ints as i64, bools as u8), on candle tensors. Used by tests, calibration
//! (an observer sees every tensor) and quantsim (a hook may replace any tensor, e.g. by its fake-quantized
//! copy). Weights are fetched lazily from a [`WeightSource`] and cached per initializer.
//!
//! The room: `mod.rs` (sources, hooks, the interpreter and its weight caches), `run.rs` (one batched or
//! chained run), `chain.rs` (positions of one sequence in one call), `ops.rs` (each op on candle tensors,
//! the arithmetic itself in `hexq-kernels`), `profile.rs` (HEXQ_PROFILE).

mod chain;
mod ops;
mod profile;
mod run;

use crate::ir::{Graph, GraphError, InitSource, Op};
use candle_core::{DType as CD, Device, Tensor};
pub use hexq_kernels::RowWeight;
use hexq_model::checkpoint::Checkpoint;
use hexq_model::error::{Error, Result};
pub use ops::with_f32;
pub use profile::profile_report;
use profile::profiling;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Supplies checkpoint tensors as f32 by prefix-relative name.
pub trait WeightSource: Send + Sync {
    fn weight(&self, name: &str) -> Result<Tensor>;
    /// A 2-D `[out, in]` weight as rows for [`hexq_kernels::rowmm`] in its stored dtype (bf16 kept as bf16); by default
    /// the f32 values.
    fn rows(&self, name: &str) -> Result<RowWeight> {
        let t = self.weight(name)?;
        let (out, inp) = t.dims2()?;
        Ok(RowWeight::f32(out, inp, t.flatten_all()?.to_vec1()?))
    }
}

impl WeightSource for Checkpoint {
    fn weight(&self, name: &str) -> Result<Tensor> {
        let info = self.info(name)?;
        Ok(Tensor::from_vec(
            self.f32(name)?,
            info.shape.as_slice(),
            &Device::Cpu,
        )?)
    }
    fn rows(&self, name: &str) -> Result<RowWeight> {
        let info = self.info(name)?;
        let (out, inp) = match info.shape.as_slice() {
            [o, i] => (*o, *i),
            s => {
                return Err(Error::Graph {
                    graph: String::new(),
                    msg: format!("{name}: {s:?} is not a 2-D weight"),
                })
            }
        };
        if info.dtype == hexq_model::weights::DType::BF16 {
            // Read in place from the mapping (the page cache's copy; nothing allocated or faulted in fresh).
            let (map, range) = self.store.mapped(info);
            return Ok(RowWeight::bf16_mapped(out, inp, map, range.start));
        }
        let rows = RowWeight::f32(out, inp, self.f32(name)?);
        // The copy is what runs read: drop the mapped pages, so the weight is not resident twice.
        self.store.release(info);
        Ok(rows)
    }
}

/// Called for every graph input, initializer and node output; may return a replacement (fake-quant).
pub trait Hook {
    fn tensor(&mut self, _name: &str, _t: &Tensor) -> Option<Tensor> {
        None
    }
    /// One tensor per sequence of a batched run (see [`Interpreter::run_batch`]); by default [`Hook::tensor`]
    /// on each in order. A hook that only observes may look at them in parallel.
    fn tensors(&mut self, name: &str, ts: &[Tensor]) -> Vec<Option<Tensor>> {
        ts.iter().map(|t| self.tensor(name, t)).collect()
    }
    /// A MatMul weight as its `[out, in]` rows, when [`Interpreter::bake`] transforms it: the replacement
    /// rows, or None to be offered the `[in, out]` tensor through [`Hook::tensor`] instead. (Lets a
    /// quantizer keep integers rather than an f32 copy.)
    fn weight_rows(&mut self, _name: &str, _w: &RowWeight) -> Option<RowWeight> {
        None
    }
    /// True when the hook never replaces a tensor nor cares in which order it sees them (an observer of
    /// order-free statistics): lets chained runs compute independent chains in parallel.
    fn observes_only(&self) -> bool {
        false
    }
}

pub struct NoHook;
impl Hook for NoHook {}

/// A hook that sees another graph's names: a shorter-ring stand-in's tensors
/// ([`crate::build::Span`]) offered under the full graph's, so its encodings and observers apply.
pub struct Renamed {
    pub inner: Box<dyn Hook + Send>,
    pub names: Arc<HashMap<String, String>>,
}

impl Renamed {
    fn name<'a>(&'a self, n: &'a str) -> &'a str {
        self.names.get(n).map_or(n, String::as_str)
    }
}

impl Hook for Renamed {
    fn tensor(&mut self, name: &str, t: &Tensor) -> Option<Tensor> {
        let n = self.name(name).to_string();
        self.inner.tensor(&n, t)
    }
    fn tensors(&mut self, name: &str, ts: &[Tensor]) -> Vec<Option<Tensor>> {
        let n = self.name(name).to_string();
        self.inner.tensors(&n, ts)
    }
    fn weight_rows(&mut self, name: &str, w: &RowWeight) -> Option<RowWeight> {
        let n = self.name(name).to_string();
        self.inner.weight_rows(&n, w)
    }
    fn observes_only(&self) -> bool {
        self.inner.observes_only()
    }
}

pub struct Interpreter {
    pub graph: Graph,
    src: Arc<dyn WeightSource>,
    /// Constant initializers of this graph, built on first use.
    cache: Mutex<HashMap<String, Tensor>>,
    /// Checkpoint weights by initializer name, shared by the interpreters of one model (decode + trunk
    /// hold one copy).
    weights: Arc<Mutex<HashMap<String, Tensor>>>,
    /// For each node, the values whose last use it is (freed after it runs).
    frees: Vec<Vec<String>>,
    /// Per node: the weight initializer when the node is `MatMul(x, Wᵀ)` of a checkpoint weight — run by
    /// [`hexq_kernels::rowmm`] on the weight's own rows (batch-invariant, bf16 kept).
    pub(crate) fast: Vec<Option<String>>,
    /// Weights consumed only by such MatMuls: never materialized as [in, out] tensors during a run (and not
    /// offered to run-time hooks: transform weights with [`Interpreter::bake`]).
    fast_only: std::collections::HashSet<String>,
    /// Per node: a Transpose read only by MatMuls, run as a strided view (no copy of a [ctx, d] KV buffer
    /// per step: the MatMul takes the transposed operand in place).
    pub(crate) view: Vec<bool>,
    /// Row weights by initializer name, shared like `weights`.
    rows: Arc<Mutex<HashMap<String, Arc<RowWeight>>>>,
    /// Per node: no `present_*` output depends on it (under KV sharing, the layers after the last one that
    /// writes K/V): a position whose hidden state nobody reads skips it ([`Interpreter::run_chained`]'s
    /// `need`).
    tail: Vec<bool>,
}

/// Elements below which a batch's per-sequence work stays on one thread.
pub const PAR_MIN: usize = 1 << 16;

/// A value during a batched run: one tensor shared by every sequence (constants and what only they feed),
/// or one per sequence.
pub(crate) enum Val {
    One(Tensor),
    Per(Vec<Tensor>),
}

impl Val {
    pub(crate) fn get(&self, i: usize) -> &Tensor {
        match self {
            Val::One(t) => t,
            Val::Per(v) => &v[i],
        }
    }
}

/// A skipped set's value (see [`Interpreter::run_chained`]'s `need`).
pub(super) fn empty() -> Tensor {
    Tensor::zeros(0, CD::F32, &Device::Cpu).unwrap()
}

pub(super) fn e(graph: &str, node: &str, m: impl std::fmt::Display) -> Error {
    Error::Graph {
        graph: graph.into(),
        msg: format!("interpreter: node {node:?}: {m}"),
    }
}

impl From<GraphError> for Error {
    fn from(g: GraphError) -> Self {
        Error::Graph {
            graph: g.graph.clone(),
            msg: format!("node {:?}: {}", g.node, g.msg),
        }
    }
}

impl Interpreter {
    pub fn new(graph: Graph, src: Arc<dyn WeightSource>) -> Result<Self> {
        graph.validate()?;
        let mut last: HashMap<&str, usize> = HashMap::new();
        for (k, n) in graph.nodes.iter().enumerate() {
            for i in &n.inputs {
                last.insert(i, k);
            }
        }
        let outs: std::collections::HashSet<&str> =
            graph.outputs.iter().map(|o| o.name.as_str()).collect();
        let mut frees = vec![Vec::new(); graph.nodes.len()];
        for (name, k) in last {
            if !outs.contains(name) && !graph.initializers.iter().any(|i| i.name == name) {
                frees[k].push(name.to_string());
            }
        }
        let transposed = |name: &str| {
            graph.initializers.iter().any(|i| {
                i.name == name
                    && matches!(
                        &i.source,
                        InitSource::Weight {
                            transpose: true,
                            ..
                        }
                    )
            })
        };
        let fast: Vec<Option<String>> = graph
            .nodes
            .iter()
            .map(|n| {
                (matches!(n.op, Op::MatMul) && transposed(&n.inputs[1]))
                    .then(|| n.inputs[1].clone())
            })
            .collect();
        let fast_only = graph
            .initializers
            .iter()
            .map(|i| i.name.clone())
            .filter(|name| {
                let uses: Vec<usize> = (0..graph.nodes.len())
                    .filter(|&k| graph.nodes[k].inputs.iter().any(|x| x == name))
                    .collect();
                !uses.is_empty()
                    && uses
                        .iter()
                        .all(|&k| fast[k].as_deref() == Some(name.as_str()))
                    && !graph.nodes.iter().any(|n| n.inputs[0] == *name)
            })
            .collect();
        let view = graph
            .nodes
            .iter()
            .map(|n| {
                matches!(n.op, Op::Transpose { .. })
                    && !graph.outputs.iter().any(|o| o.name == n.outputs[0])
                    && graph
                        .nodes
                        .iter()
                        .filter(|m| m.inputs.contains(&n.outputs[0]))
                        .all(|m| matches!(m.op, Op::MatMul))
            })
            .collect();
        let mut kv: std::collections::HashSet<&str> = graph
            .outputs
            .iter()
            .filter(|o| o.name.starts_with("present_"))
            .map(|o| o.name.as_str())
            .collect();
        let mut tail = vec![true; graph.nodes.len()];
        for (k, n) in graph.nodes.iter().enumerate().rev() {
            if n.outputs.iter().any(|o| kv.contains(o.as_str())) {
                tail[k] = false;
                kv.extend(n.inputs.iter().map(String::as_str));
            }
        }
        Ok(Interpreter {
            tail,
            graph,
            src,
            cache: Mutex::new(HashMap::new()),
            weights: Default::default(),
            frees,
            view,
            fast,
            fast_only,
            rows: Default::default(),
        })
    }

    /// Share the weight cache of another interpreter over the same checkpoint.
    pub fn sharing_weights_with(mut self, other: &Interpreter) -> Self {
        self.weights = other.weights.clone();
        self.rows = other.rows.clone();
        self
    }

    /// The rows of a MatMul weight: from the (baked) [in, out] tensor when one exists, else straight from
    /// the checkpoint in its dtype.
    fn row_weight(&self, name: &str) -> Result<Arc<RowWeight>> {
        if let Some(r) = self.rows.lock().unwrap().get(name) {
            return Ok(r.clone());
        }
        let baked = self.weights.lock().unwrap().get(name).cloned();
        let r = match baked {
            Some(t) => {
                let w = t.t()?.contiguous()?;
                let (out, inp) = w.dims2()?;
                RowWeight::f32(out, inp, w.flatten_all()?.to_vec1()?)
            }
            None => {
                let Some(InitSource::Weight { tensor, .. }) = self
                    .graph
                    .initializers
                    .iter()
                    .find(|i| i.name == name)
                    .map(|i| &i.source)
                else {
                    unreachable!("fast MatMul weights are checkpoint weights")
                };
                let r = self.src.rows(tensor)?;
                static TOLD: std::sync::Once = std::sync::Once::new();
                if !r.pin() && profiling() {
                    TOLD.call_once(|| {
                        eprintln!("{name}: mlock refused (RLIMIT_MEMLOCK); mapped weights may be reclaimed between calls")
                    });
                }
                r
            }
        };
        let r = Arc::new(r);
        self.rows
            .lock()
            .unwrap()
            .insert(name.to_string(), r.clone());
        if self.fast_only.contains(name) {
            // The rows are the copy the runs use: drop the [in, out] tensor (half the memory).
            self.weights.lock().unwrap().remove(name);
        }
        Ok(r)
    }

    fn init_value(&self, name: &str) -> Result<Tensor> {
        if let Some(t) = self.cache.lock().unwrap().get(name) {
            return Ok(t.clone());
        }
        if let Some(t) = self.weights.lock().unwrap().get(name) {
            return Ok(t.clone());
        }
        let init = self
            .graph
            .initializers
            .iter()
            .find(|i| i.name == name)
            .unwrap();
        let dev = Device::Cpu;
        let t = match &init.source {
            InitSource::F32(v) => Tensor::from_vec(v.clone(), init.ty.shape.as_slice(), &dev)?,
            InitSource::I64(v) => Tensor::from_vec(v.clone(), init.ty.shape.as_slice(), &dev)?,
            InitSource::Weight { tensor, transpose } => {
                let w = self.src.weight(tensor)?;
                // A transposed *view* of the [out, in] weight: the same memory layout the reference
                // forward multiplies with (and half the memory of a transposed copy).
                let w = if *transpose {
                    w.t()?
                } else {
                    w.reshape(init.ty.shape.as_slice())?
                };
                self.weights
                    .lock()
                    .unwrap()
                    .insert(name.to_string(), w.clone());
                return Ok(w);
            }
        };
        self.cache
            .lock()
            .unwrap()
            .insert(name.to_string(), t.clone());
        Ok(t)
    }

    /// Replace initializer values once by what `hook` makes of them (e.g. fake-quantized weights), so a
    /// transformation of the weights is not redone on every call. `weights: false` leaves checkpoint weights
    /// alone (for a second interpreter sharing an already-baked weight cache).
    pub fn bake(&self, hook: &mut dyn Hook, weights: bool) -> Result<()> {
        for init in &self.graph.initializers {
            let is_weight = matches!(init.source, InitSource::Weight { .. });
            if is_weight && !weights {
                continue;
            }
            if let (true, InitSource::Weight { tensor, .. }) =
                (self.fast_only.contains(&init.name), &init.source)
            {
                let src = self.src.rows(tensor)?;
                if let Some(r) = hook.weight_rows(&init.name, &src) {
                    self.weights.lock().unwrap().remove(&init.name);
                    self.rows
                        .lock()
                        .unwrap()
                        .insert(init.name.clone(), Arc::new(r));
                    continue;
                }
            }
            let t = self.init_value(&init.name)?;
            if let Some(r) = hook.tensor(&init.name, &t) {
                let map = if is_weight {
                    &*self.weights
                } else {
                    &self.cache
                };
                map.lock().unwrap().insert(init.name.clone(), r);
                self.rows.lock().unwrap().remove(&init.name);
            }
        }
        Ok(())
    }

    /// Run the graph. `inputs` by name (f32 tensors; int inputs as i64 or u32/i32-valued f32 are not accepted:
    /// pass i64). Returns the graph outputs by name.
    pub fn run(
        &self,
        inputs: &HashMap<String, Tensor>,
        hook: &mut dyn Hook,
    ) -> Result<HashMap<String, Tensor>> {
        Ok(self.run_batch(vec![inputs.clone()], hook)?.pop().unwrap())
    }

    /// Run the graph for several independent input sets at once: every weight MatMul multiplies all of their
    /// rows in one [`hexq_kernels::rowmm`] call (weights read once per batch), other ops run per set, constants once. Each
    /// set's outputs — and every tensor the hook sees, once per set — are bit for bit what [`run`] gives it
    /// alone.
    ///
    /// The inputs are taken by value so a large one (a KV buffer) is freed after its last use in the graph.
    ///
    /// [`run`]: Interpreter::run
    pub fn run_batch(
        &self,
        inputs: Vec<HashMap<String, Tensor>>,
        hook: &mut dyn Hook,
    ) -> Result<Vec<HashMap<String, Tensor>>> {
        let n = inputs.len();
        self.run_chained(inputs, &vec![None; n], None, hook)
    }

    /// `x · Wᵀ` for each x (shape `[.., in]`) through one [`RowWeight::matmul`] over all their rows.
    fn fast_matmul(&self, xs: &[&Tensor], w: &RowWeight, out: &[usize]) -> Result<Vec<Tensor>> {
        let mut rows = Vec::new();
        let mut n = Vec::with_capacity(xs.len());
        for x in xs {
            let v: Vec<f32> = x.flatten_all()?.to_vec1()?;
            n.push(v.len() / w.inp);
            rows.extend(v);
        }
        let y = w.matmul(&rows, rows.len() / w.inp);
        let mut off = 0;
        n.iter()
            .map(|&r| {
                let t = Tensor::from_vec(
                    y[off * w.out..(off + r) * w.out].to_vec(),
                    out,
                    &Device::Cpu,
                )?;
                off += r;
                Ok(t)
            })
            .collect()
    }
}
