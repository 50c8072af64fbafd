//! CPU interpreter for the IR, f32 (ints as i64, bools as u8), on candle tensors. Used by tests, calibration
//! (an observer sees every tensor) and quantsim (a hook may replace any tensor, e.g. by its fake-quantized
//! copy). Weights are fetched lazily from a [`WeightSource`] and cached per initializer.

use crate::ir::{DType, Graph, GraphError, InitSource, Op};
use crate::rowmm::{self, RowWeight, Rows};
use candle_core::{DType as CD, Device, Tensor};
use hexq_model::checkpoint::Checkpoint;
use hexq_model::error::{Error, Result};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Supplies checkpoint tensors as f32 by prefix-relative name.
pub trait WeightSource: Send + Sync {
    fn weight(&self, name: &str) -> Result<Tensor>;
    /// A 2-D `[out, in]` weight as rows for [`rowmm`] in its stored dtype (bf16 kept as bf16); by default
    /// the f32 values.
    fn rows(&self, name: &str) -> Result<RowWeight> {
        let t = self.weight(name)?;
        let (out, inp) = t.dims2()?;
        Ok(RowWeight {
            out,
            inp,
            rows: Rows::F32(t.flatten_all()?.to_vec1()?),
        })
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
        let rows = if info.dtype == hexq_model::weights::DType::BF16 {
            let b = self.store.bytes(info);
            Rows::Bf16(
                b.chunks_exact(2)
                    .map(|c| u16::from_le_bytes([c[0], c[1]]))
                    .collect(),
            )
        } else {
            Rows::F32(self.f32(name)?)
        };
        // The copy is what runs read: drop the mapped pages, so the weight is not resident twice.
        self.store.release(info);
        Ok(RowWeight { out, inp, rows })
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
    /// [`rowmm`] on the weight's own rows (batch-invariant, bf16 kept).
    fast: Vec<Option<String>>,
    /// Weights consumed only by such MatMuls: never materialized as [in, out] tensors during a run (and not
    /// offered to run-time hooks: transform weights with [`Interpreter::bake`]).
    fast_only: std::collections::HashSet<String>,
    /// Per node: a Transpose read only by MatMuls, run as a strided view (no copy of a [ctx, d] KV buffer
    /// per step: the MatMul takes the transposed operand in place).
    view: Vec<bool>,
    /// Row weights by initializer name, shared like `weights`.
    rows: Arc<Mutex<HashMap<String, Arc<RowWeight>>>>,
}

/// Time per op type over all runs, printed at exit when HEXQ_PROFILE is set (where a run's time goes).
pub static PROFILE: Mutex<Option<HashMap<String, (f64, u64)>>> = Mutex::new(None);

fn profiling() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("HEXQ_PROFILE").is_some())
}

/// The profile as a table, slowest first.
pub fn profile_report() -> Option<String> {
    let p = PROFILE.lock().unwrap();
    let m = p.as_ref()?;
    let mut v: Vec<_> = m.iter().collect();
    v.sort_by(|a, b| b.1 .0.total_cmp(&a.1 .0));
    let total: f64 = v.iter().map(|x| x.1 .0).sum();
    let mut s = format!("| op | seconds | share | calls |\n|---|---|---|---|\n");
    for (k, (t, n)) in v {
        s += &format!(
            "| {k} | {t:.2} | {:.1} % | {n} |\n",
            100.0 * t / total.max(1e-12)
        );
    }
    Some(s)
}

fn record(op: &str, t0: std::time::Instant) {
    let mut p = PROFILE.lock().unwrap();
    let e = p
        .get_or_insert_with(HashMap::new)
        .entry(op.to_string())
        .or_insert((0.0, 0));
    e.0 += t0.elapsed().as_secs_f64();
    e.1 += 1;
}

/// Elements below which a batch's per-sequence work stays on one thread.
pub const PAR_MIN: usize = 1 << 16;

/// A value during a batched run: one tensor shared by every sequence (constants and what only they feed),
/// or one per sequence.
enum Val {
    One(Tensor),
    Per(Vec<Tensor>),
}

impl Val {
    fn get(&self, i: usize) -> &Tensor {
        match self {
            Val::One(t) => t,
            Val::Per(v) => &v[i],
        }
    }
}

fn e(graph: &str, node: &str, m: impl std::fmt::Display) -> Error {
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
        Ok(Interpreter {
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
                RowWeight {
                    out,
                    inp,
                    rows: Rows::F32(w.flatten_all()?.to_vec1()?),
                }
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
                self.src.rows(tensor)?
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
    /// rows in one [`rowmm`] call (weights read once per batch), other ops run per set, constants once. Each
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
        self.run_chained(inputs, &vec![None; n], hook)
    }

    /// [`run_batch`] where some sets continue another set's sequence one position later: `prev[s] = Some(p)`
    /// (p < s) means set s gives no `past_*` inputs — each is set p's `present_*` (as the hook returned it),
    /// offered to the hook as set s's input. So a sequence advances several positions in one call and their
    /// weight MatMuls share one [`rowmm`] call, each position computed exactly as a call of its own would.
    /// The graph must write each `present_*` in the node that reads its `past_*` (the ring write), or
    /// later. The `present_*` outputs of sets that another set continues come back empty (freed early).
    ///
    /// [`run_batch`]: Interpreter::run_batch
    pub fn run_chained(
        &self,
        mut inputs: Vec<HashMap<String, Tensor>>,
        prev: &[Option<usize>],
        hook: &mut dyn Hook,
    ) -> Result<Vec<HashMap<String, Tensor>>> {
        let g = &self.graph;
        let b = inputs.len();
        let chain = Chain::of(self, prev)?;
        let mut vals: HashMap<String, Val> = HashMap::new();
        for vi in &g.inputs {
            let mut per = Vec::with_capacity(b);
            for (s, inp) in inputs.iter_mut().enumerate() {
                if prev[s].is_some() && chain.carry.contains_key(&vi.name) {
                    per.push(Tensor::zeros(0, CD::F32, &Device::Cpu)?);
                    continue;
                }
                let t = inp.remove(&vi.name).ok_or_else(|| Error::Graph {
                    graph: g.name.clone(),
                    msg: format!("missing input {:?}", vi.name),
                })?;
                if t.dims() != vi.ty.shape.as_slice() {
                    return Err(Error::Graph {
                        graph: g.name.clone(),
                        msg: format!(
                            "input {:?} has shape {:?}, contract says {:?}",
                            vi.name,
                            t.dims(),
                            vi.ty.shape
                        ),
                    });
                }
                let want = if vi.ty.dtype.is_float() {
                    CD::F32
                } else {
                    CD::I64
                };
                let t = t.to_dtype(want)?;
                per.push(hook.tensor(&vi.name, &t).unwrap_or(t));
            }
            vals.insert(vi.name.clone(), Val::Per(per));
        }
        for init in g
            .initializers
            .iter()
            .filter(|i| !self.fast_only.contains(&i.name))
        {
            let t = self.init_value(&init.name)?;
            let t = hook.tensor(&init.name, &t).unwrap_or(t);
            vals.insert(init.name.clone(), Val::One(t));
        }
        for (k, n) in g.nodes.iter().enumerate() {
            let out_ty = &g.types[&n.outputs[0]];
            let name = &n.outputs[0];
            let t0 = std::time::Instant::now();
            chain.fill(k, n, &mut vals, hook)?;
            if chain.sequential(k, n) && hook.observes_only() {
                // Chains are independent: one per core, set by set inside each; observed afterwards (the
                // hook changes nothing, so the order it sees them in cannot matter).
                use rayon::prelude::*;
                let mut chains: Vec<Vec<usize>> = Vec::new();
                let mut of = vec![0usize; b];
                for s in 0..b {
                    match prev[s] {
                        Some(p) => {
                            of[s] = of[p];
                            chains[of[p]].push(s);
                        }
                        None => {
                            of[s] = chains.len();
                            chains.push(vec![s]);
                        }
                    }
                }
                let carried: Vec<usize> = (0..n.inputs.len())
                    .filter(|&x| chain.carry.get(&n.inputs[x]).is_some_and(|c| c.1 == k))
                    .collect();
                let done: Vec<Vec<(usize, Tensor)>> = chains
                    .par_iter()
                    .map(|c| {
                        let mut out: Vec<(usize, Tensor)> = Vec::with_capacity(c.len());
                        for &s in c {
                            let mut ins: Vec<&Tensor> = n.inputs.iter().map(|i| vals[i].get(s)).collect();
                            if prev[s].is_some() {
                                for &x in &carried {
                                    ins[x] = &out.last().unwrap().1;
                                }
                            }
                            let r = eval(&n.op, &ins, &out_ty.shape).map_err(|m| e(&g.name, &n.name, m))?;
                            out.push((s, r));
                        }
                        Ok(out)
                    })
                    .collect::<Result<_>>()?;
                let mut per: Vec<Option<Tensor>> = vec![None; b];
                for (s, t) in done.into_iter().flatten() {
                    per[s] = Some(t);
                }
                let per: Vec<Tensor> = per.into_iter().map(Option::unwrap).collect();
                let fed: Vec<Tensor> = prev.iter().flatten().map(|&p| per[p].clone()).collect();
                for &x in &carried {
                    hook.tensors(&n.inputs[x], &fed);
                }
                hook.tensors(name, &per);
                if profiling() {
                    record(n.op.onnx_name(), t0);
                }
                vals.insert(name.clone(), Val::Per(per));
                chain.release(k, prev, &mut vals);
                for f in &self.frees[k] {
                    vals.remove(f);
                }
                continue;
            }
            if chain.sequential(k, n) {
                // This node writes a present another set reads as its past: set by set, in chain order.
                let mut per: Vec<Tensor> = Vec::with_capacity(b);
                for s in 0..b {
                    let mut ins: Vec<Tensor> = n.inputs.iter().map(|i| vals[i].get(s).clone()).collect();
                    if let Some(p) = prev[s] {
                        for (slot, i) in n.inputs.iter().enumerate() {
                            if chain.carry.get(i).is_some_and(|c| c.1 == k) {
                                let t = per[p].clone();
                                ins[slot] = hook.tensor(i, &t).unwrap_or(t);
                            }
                        }
                    }
                    let r = eval(&n.op, &ins.iter().collect::<Vec<_>>(), &out_ty.shape)
                        .map_err(|m| e(&g.name, &n.name, m))?;
                    per.push(hook.tensor(name, &r).unwrap_or(r));
                }
                if profiling() {
                    record(n.op.onnx_name(), t0);
                }
                vals.insert(name.clone(), Val::Per(per));
                chain.release(k, prev, &mut vals);
                for f in &self.frees[k] {
                    vals.remove(f);
                }
                continue;
            }
            let v = if let Some(w) = &self.fast[k] {
                let w = self.row_weight(w)?;
                match &vals[&n.inputs[0]] {
                    Val::One(x) => Val::One(self.fast_matmul(&[x], &w, &out_ty.shape)?.remove(0)),
                    Val::Per(xs) => Val::Per(self.fast_matmul(
                        &xs.iter().collect::<Vec<_>>(),
                        &w,
                        &out_ty.shape,
                    )?),
                }
            } else if let (true, Op::Transpose { perm }) = (self.view[k], &n.op) {
                let v = |t: &Tensor| t.permute(perm.as_slice());
                match &vals[&n.inputs[0]] {
                    Val::One(x) => Val::One(v(x)?),
                    Val::Per(xs) => Val::Per(xs.iter().map(v).collect::<candle_core::Result<_>>()?),
                }
            } else if n.inputs.iter().all(|i| matches!(vals[i], Val::One(_))) {
                let ins: Vec<&Tensor> = n.inputs.iter().map(|i| vals[i].get(0)).collect();
                Val::One(eval(&n.op, &ins, &out_ty.shape).map_err(|m| e(&g.name, &n.name, m))?)
            } else {
                // The sequences' ops are independent: one per core when there is enough work to share (small
                // tensors cost less than the hand-off).
                use rayon::prelude::*;
                let one = |s: usize| {
                    let ins: Vec<&Tensor> = n.inputs.iter().map(|i| vals[i].get(s)).collect();
                    eval(&n.op, &ins, &out_ty.shape).map_err(|m| e(&g.name, &n.name, m))
                };
                let work = out_ty.shape.iter().product::<usize>() * b;
                let per: Vec<Tensor> = if b > 1 && work >= PAR_MIN {
                    (0..b).into_par_iter().map(one).collect::<Result<_>>()?
                } else {
                    (0..b).map(one).collect::<Result<_>>()?
                };
                Val::Per(per)
            };
            if profiling() {
                record(
                    if self.fast[k].is_some() {
                        "MatMul (weights, rowmm)"
                    } else {
                        n.op.onnx_name()
                    },
                    t0,
                );
            }
            let t0 = std::time::Instant::now();
            // The hook sees each set's tensor, as b separate runs would show it.
            let v = match v {
                Val::One(t) => {
                    let mut r = None;
                    for _ in 0..b {
                        r = hook.tensor(name, &t).or(r);
                    }
                    Val::One(r.unwrap_or(t))
                }
                Val::Per(ts) => {
                    let r = hook.tensors(name, &ts);
                    Val::Per(ts.into_iter().zip(r).map(|(t, r)| r.unwrap_or(t)).collect())
                }
            };
            if profiling() {
                record(&format!("(hook) {}", n.op.onnx_name()), t0);
            }
            vals.insert(name.clone(), v);
            chain.release(k, prev, &mut vals);
            for f in &self.frees[k] {
                vals.remove(f);
            }
        }
        Ok((0..b)
            .map(|s| {
                g.outputs
                    .iter()
                    .map(|o| (o.name.clone(), vals[&o.name].get(s).clone()))
                    .collect()
            })
            .collect())
    }

    /// `x · Wᵀ` for each x (shape `[.., in]`) through one [`rowmm::matmul`] over all their rows.
    fn fast_matmul(&self, xs: &[&Tensor], w: &RowWeight, out: &[usize]) -> Result<Vec<Tensor>> {
        let mut rows = Vec::new();
        let mut n = Vec::with_capacity(xs.len());
        for x in xs {
            let v: Vec<f32> = x.flatten_all()?.to_vec1()?;
            n.push(v.len() / w.inp);
            rows.extend(v);
        }
        let y = rowmm::matmul(&rows, rows.len() / w.inp, w);
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

/// The `past_*` → `present_*` carries of a chained run (see [`Interpreter::run_chained`]).
struct Chain<'a> {
    prev: &'a [Option<usize>],
    /// past input → (present output, the node writing it).
    carry: HashMap<String, (String, usize)>,
    /// present output → the last node reading it or its past (after which interior sets' copies go).
    last: HashMap<String, usize>,
}

impl<'a> Chain<'a> {
    fn of(it: &Interpreter, prev: &'a [Option<usize>]) -> Result<Self> {
        let g = &it.graph;
        let mut c = Chain {
            prev,
            carry: HashMap::new(),
            last: HashMap::new(),
        };
        for (s, p) in prev.iter().enumerate() {
            if p.is_some_and(|p| p >= s) {
                return Err(Error::Graph {
                    graph: g.name.clone(),
                    msg: format!("chained set {s} continues set {p:?}: must be an earlier set"),
                });
            }
        }
        if prev.iter().all(Option::is_none) {
            return Ok(c);
        }
        for vi in g.inputs.iter().filter(|v| v.name.starts_with("past_")) {
            let present = vi.name.replacen("past_", "present_", 1);
            let at = |name: &str| g.nodes.iter().position(|n| n.outputs[0] == name);
            let reads = |name: &str| {
                g.nodes
                    .iter()
                    .enumerate()
                    .filter(|(_, n)| n.inputs.iter().any(|i| i == name))
                    .map(|(k, _)| k)
                    .collect::<Vec<_>>()
            };
            let w = at(&present).ok_or_else(|| Error::Graph {
                graph: g.name.clone(),
                msg: format!("cannot chain: no node writes {present} for {}", vi.name),
            })?;
            let (rp, rq) = (reads(&vi.name), reads(&present));
            if rp.iter().any(|&k| k < w) || it.fast[w].is_some() || it.view[w] {
                return Err(Error::Graph {
                    graph: g.name.clone(),
                    msg: format!("cannot chain: {} is read before {present} is written", vi.name),
                });
            }
            let last = rp.iter().chain(&rq).copied().max().unwrap_or(w).max(w);
            c.last.insert(present.clone(), last);
            c.carry.insert(vi.name.clone(), (present, w));
        }
        Ok(c)
    }

    /// Before node `k`: chained sets' copies of the pasts it reads whose presents are already written.
    fn fill(&self, k: usize, n: &crate::ir::Node, vals: &mut HashMap<String, Val>, hook: &mut dyn Hook) -> Result<()> {
        for i in &n.inputs {
            let Some((present, w)) = self.carry.get(i) else {
                continue;
            };
            if *w >= k {
                continue;
            }
            for (s, p) in self.prev.iter().enumerate() {
                let Some(p) = *p else { continue };
                if vals[i].get(s).elem_count() > 0 {
                    continue;
                }
                let t = vals[present].get(p).clone();
                let t = hook.tensor(i, &t).unwrap_or(t);
                if let Some(Val::Per(v)) = vals.get_mut(i) {
                    v[s] = t;
                }
            }
        }
        Ok(())
    }

    /// Whether node `k` writes a present that a chained set reads from its predecessor.
    fn sequential(&self, k: usize, n: &crate::ir::Node) -> bool {
        n.inputs.iter().any(|i| self.carry.get(i).is_some_and(|c| c.1 == k))
    }

    /// After node `k`: drop the presents of sets another set continued, once nothing reads them.
    fn release(&self, k: usize, prev: &[Option<usize>], vals: &mut HashMap<String, Val>) {
        for (present, &last) in &self.last {
            if last != k {
                continue;
            }
            if let Some(Val::Per(v)) = vals.get_mut(present) {
                for p in prev.iter().flatten() {
                    v[*p] = Tensor::zeros(0, CD::F32, &Device::Cpu).unwrap();
                }
            }
        }
    }
}

fn bshape(t: &Tensor, shape: &[usize]) -> candle_core::Result<Tensor> {
    if t.dims() == shape {
        Ok(t.clone())
    } else {
        t.broadcast_as(shape)?.contiguous()
    }
}

fn i64s(t: &Tensor) -> candle_core::Result<Vec<i64>> {
    t.to_dtype(CD::I64)?.flatten_all()?.to_vec1::<i64>()
}

/// A possibly negative ONNX axis as an index.
fn axis(a: i64, rank: usize) -> usize {
    if a < 0 {
        (a + rank as i64) as usize
    } else {
        a as usize
    }
}

/// One op on candle tensors, with ONNX's semantics (shapes were checked by `infer` when the graph was built).
fn eval(op: &Op, x: &[&Tensor], out: &[usize]) -> candle_core::Result<Tensor> {
    Ok(match op {
        Op::MatMul => x[0].broadcast_matmul(x[1])?,
        Op::Add => x[0].broadcast_add(x[1])?,
        Op::Sub => x[0].broadcast_sub(x[1])?,
        Op::Mul => x[0].broadcast_mul(x[1])?,
        Op::Div => x[0].broadcast_div(x[1])?,
        Op::Pow => pow(x, out)?,
        Op::Sqrt => x[0].sqrt()?,
        Op::Reciprocal => x[0].recip()?,
        Op::Neg => x[0].neg()?,
        Op::Tanh => x[0].tanh()?,
        // 1/(1+e^-x), as onnxruntime computes it.
        Op::Sigmoid => (x[0].neg()?.exp()? + 1.0)?.recip()?,
        Op::Cos => x[0].cos()?,
        Op::Sin => x[0].sin()?,
        Op::Mod => python_mod(x, out)?,
        Op::ReduceMean { axes, keepdims } => {
            let r = x[0].rank();
            let mut ax: Vec<usize> = axes.iter().map(|&a| axis(a, r)).collect();
            ax.sort();
            let mut t = x[0].clone();
            for &a in ax.iter().rev() {
                t = t.mean_keepdim(a)?;
            }
            if *keepdims {
                t
            } else {
                t.reshape(out)?
            }
        }
        Op::Softmax { axis: a } => {
            let a = axis(*a, x[0].rank());
            let m = x[0].max_keepdim(a)?;
            let ex = x[0].broadcast_sub(&m)?.exp()?;
            ex.broadcast_div(&ex.sum_keepdim(a)?)?
        }
        Op::Reshape { .. } | Op::Unsqueeze { .. } => x[0].reshape(out)?,
        Op::Transpose { perm } => x[0].permute(perm.as_slice())?.contiguous()?,
        Op::Concat { axis: a } => Tensor::cat(x, axis(*a, x[0].rank()))?,
        Op::Slice { starts, ends, axes } => slice(x[0], starts, ends, axes)?,
        Op::Gather { axis: a } => gather(x[0], x[1], axis(*a, x[0].rank()), out)?,
        Op::ScatterND => scatter_nd(x[0], x[1], x[2])?,
        Op::Where => {
            if let Some(t) = where_slabs(x[0], x[1], x[2], out) {
                return t;
            }
            let c = bshape(x[0], out)?;
            c.where_cond(&bshape(x[1], out)?, &bshape(x[2], out)?)?
        }
        Op::Equal => x[0].broadcast_eq(x[1])?,
        Op::Less => x[0].broadcast_lt(x[1])?,
        Op::Greater => x[0].broadcast_gt(x[1])?,
        Op::Cast { to } => match to {
            DType::F32 | DType::F16 | DType::BF16 => x[0].to_dtype(CD::F32)?,
            DType::I32 | DType::I64 => x[0].to_dtype(CD::I64)?,
            DType::Bool => x[0].ne(&x[0].zeros_like()?)?,
        },
        Op::Expand { .. } => x[0].broadcast_as(out)?.contiguous()?,
    })
}

/// `Where` whose condition varies along one axis only (the ring write: `entry == slot` over the buffer
/// length) as slab copies: each slab along that axis comes whole from `x` or `y`, an operand of extent 1 on
/// that axis giving the same slab every time. The same values as the general broadcast select, at memcpy
/// speed (the general path indexes every element through broadcast strides). None when the pattern differs.
fn where_slabs(c: &Tensor, x: &Tensor, y: &Tensor, out: &[usize]) -> Option<candle_core::Result<Tensor>> {
    let r = out.len();
    if c.rank() > r || x.rank() != r || y.rank() != r || x.dtype() != CD::F32 || y.dtype() != CD::F32 {
        return None;
    }
    let cd: Vec<usize> = std::iter::repeat(1).take(r - c.rank()).chain(c.dims().iter().copied()).collect();
    let a = cd.iter().position(|&d| d > 1)?;
    if cd[a] != out[a] || cd.iter().enumerate().any(|(k, &d)| k != a && d != 1) {
        return None;
    }
    let fits = |t: &Tensor| {
        t.dims().iter().zip(out).enumerate().all(|(k, (&d, &o))| d == o || (k == a && d == 1))
    };
    if !fits(x) || !fits(y) {
        return None;
    }
    let cond: Vec<u8> = match c.flatten_all().and_then(|t| t.to_dtype(CD::U8)).and_then(|t| t.to_vec1()) {
        Ok(v) => v,
        Err(e) => return Some(Err(e)),
    };
    let (n, outer, inner) = (out[a], out[..a].iter().product::<usize>(), out[a + 1..].iter().product::<usize>());
    let r = with_f32(x, |xv| {
        with_f32(y, |yv| {
            let mut v = Vec::with_capacity(outer * n * inner);
            for o in 0..outer {
                for (i, &ci) in cond.iter().enumerate() {
                    let (src, t) = if ci != 0 { (xv, x) } else { (yv, y) };
                    let at = if t.dim(a).unwrap_or(0) == 1 { o * inner } else { (o * n + i) * inner };
                    v.extend_from_slice(&src[at..at + inner]);
                }
            }
            Tensor::from_vec(v, out, &Device::Cpu)
        })
    });
    Some(r.and_then(|r| r).and_then(|r| r))
}

/// `f` on an f32 tensor's values, read in place when contiguous.
pub fn with_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> candle_core::Result<R> {
    {
        let (st, layout) = t.storage_and_layout();
        if let (candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)), Some((a, b))) =
            (&*st, layout.contiguous_offsets())
        {
            return Ok(f(&v[a..b]));
        }
    }
    let v: Vec<f32> = t.flatten_all()?.to_vec1()?;
    Ok(f(&v))
}

fn pow(x: &[&Tensor], out: &[usize]) -> candle_core::Result<Tensor> {
    let a = bshape(x[0], out)?.flatten_all()?.to_vec1::<f32>()?;
    let b = bshape(&x[1].to_dtype(CD::F32)?, out)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    let v: Vec<f32> = a.iter().zip(&b).map(|(p, q)| p.powf(*q)).collect();
    Tensor::from_vec(v, out, &Device::Cpu)
}

/// ONNX Mod with fmod = 0: the result takes the divisor's sign (Python's `%`).
fn python_mod(x: &[&Tensor], out: &[usize]) -> candle_core::Result<Tensor> {
    let a = i64s(&bshape(x[0], out)?)?;
    let b = i64s(&bshape(x[1], out)?)?;
    let m = |p: i64, q: i64| p.rem_euclid(q) + if q < 0 && p.rem_euclid(q) != 0 { q } else { 0 };
    let v: Vec<i64> = a.iter().zip(&b).map(|(p, q)| m(*p, *q)).collect();
    Tensor::from_vec(v, out, &Device::Cpu)
}

fn slice(x: &Tensor, starts: &[i64], ends: &[i64], axes: &[i64]) -> candle_core::Result<Tensor> {
    let mut t = x.clone();
    for ((&st, &en), &ax) in starts.iter().zip(ends).zip(axes) {
        let a = axis(ax, t.rank());
        let d = t.dim(a)? as i64;
        let cl = |v: i64| if v < 0 { (v + d).max(0) } else { v.min(d) };
        let (s0, s1) = (cl(st), cl(en));
        t = t.narrow(a, s0 as usize, (s1 - s0).max(0) as usize)?;
    }
    t.contiguous()
}

fn gather(x: &Tensor, idx: &Tensor, a: usize, out: &[usize]) -> candle_core::Result<Tensor> {
    let d = x.dim(a)? as i64;
    let ix: Vec<i64> = i64s(idx)?
        .into_iter()
        .map(|i| if i < 0 { i + d } else { i })
        .collect();
    if let Some(bad) = ix.iter().find(|&&i| i < 0 || i >= d) {
        candle_core::bail!("Gather index {bad} out of range for axis of {d}");
    }
    let it = Tensor::from_vec(ix, idx.elem_count(), &Device::Cpu)?;
    x.index_select(&it, a)?.reshape(out)
}

fn scatter_nd(data: &Tensor, indices: &Tensor, updates: &Tensor) -> candle_core::Result<Tensor> {
    let data = data.contiguous()?;
    let shape = data.dims().to_vec();
    let idx = i64s(indices)?;
    let k = *indices.dims().last().expect("rank >= 1, checked by infer");
    let inner: usize = shape[k..].iter().product();
    let is_f = data.dtype() == CD::F32;
    let mut dv: Vec<f32> = if is_f {
        data.flatten_all()?.to_vec1()?
    } else {
        i64s(&data)?.into_iter().map(|v| v as f32).collect()
    };
    let uv: Vec<f32> = updates.to_dtype(CD::F32)?.flatten_all()?.to_vec1()?;
    let strides: Vec<usize> = (0..k).map(|i| shape[i + 1..].iter().product()).collect();
    for (r, ix) in idx.chunks(k).enumerate() {
        let mut off = 0;
        for (j, &v) in ix.iter().enumerate() {
            let dj = shape[j] as i64;
            let v = if v < 0 { v + dj } else { v };
            if v < 0 || v >= dj {
                candle_core::bail!("ScatterND index {v} out of range for dim {dj}");
            }
            off += v as usize * strides[j];
        }
        dv[off..off + inner].copy_from_slice(&uv[r * inner..(r + 1) * inner]);
    }
    let t = Tensor::from_vec(dv, shape.as_slice(), &Device::Cpu)?;
    if is_f {
        Ok(t)
    } else {
        t.to_dtype(CD::I64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The slab-copy Where (ring write, trunk ring select) equals candle's broadcast select.
    #[test]
    fn where_slabs_equals_the_broadcast_select() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let out = [1usize, 2, 5, 3];
        let y = Tensor::arange(0f32, 30., &dev)?.reshape(&out)?;
        let full_x = (Tensor::arange(0f32, 30., &dev)?.reshape(&out)? * -1.0)?;
        let row_x = Tensor::new(&[[[[7f32, 8., 9.]], [[4., 5., 6.]]]], &dev)?;
        let cond = Tensor::new(&[0u8, 0, 1, 0, 1], &dev)?.reshape((1, 1, 5, 1))?;
        for x in [&row_x, &full_x] {
            for (a, b) in [(x, &y), (&y, x)] {
                let fast = where_slabs(&cond, a, b, &out).expect("pattern")?;
                let c = bshape(&cond, &out)?;
                let slow = c.where_cond(&bshape(a, &out)?, &bshape(b, &out)?)?;
                let d = (fast - slow)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
                assert_eq!(d, 0.0);
            }
        }
        // A condition varying on two axes is not this pattern.
        let c2 = Tensor::ones((1, 2, 5, 1), CD::U8, &dev)?;
        assert!(where_slabs(&c2, &row_x, &y, &out).is_none());
        Ok(())
    }
}
