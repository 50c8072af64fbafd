//! One run of the graph over a batch of input sets, some of them chained positions of one sequence.

use super::chain::Chain;
use super::ops::eval;
use super::profile::{profiling, record};
use super::{e, empty, Hook, Interpreter, Val, PAR_MIN};
use crate::ir::{Node, Op};
use candle_core::{DType as CD, Device, Tensor};
use hexq_model::error::{Error, Result};
use std::collections::HashMap;

type Vals = HashMap<String, Val>;

impl Interpreter {
    /// [`run_batch`] where some sets continue another set's sequence one position later: `prev[s] = Some(p)`
    /// (p < s) means set s gives no `past_*` inputs — each is set p's `present_*` (as the hook returned it),
    /// offered to the hook as set s's input. So a sequence advances several positions in one call and their
    /// weight MatMuls share one [`hexq_kernels::rowmm`] call, each position computed exactly as a call of its
    /// own would. The graph must write each `present_*` in the node that reads its `past_*` (the ring
    /// write), or later. The `present_*` outputs of sets that another set continues come back empty (freed
    /// early).
    ///
    /// `need[s] == false`: nobody reads set s's outputs other than its `present_*`, so the nodes those do
    /// not depend on are not run for it (nor shown to the hook) and its other outputs come back empty. Under
    /// KV sharing that is every layer after the last one writing K/V — the prefill saving Gemma 3n's and
    /// Gemma 4's KV sharing is for. Every other set's values are unchanged (the skipped nodes feed no KV).
    ///
    /// [`run_batch`]: Interpreter::run_batch
    pub fn run_chained(
        &self,
        mut inputs: Vec<HashMap<String, Tensor>>,
        prev: &[Option<usize>],
        need: Option<&[bool]>,
        hook: &mut dyn Hook,
    ) -> Result<Vec<HashMap<String, Tensor>>> {
        let g = &self.graph;
        let b = inputs.len();
        let chain = Chain::of(self, prev)?;
        let mut vals = self.input_vals(&mut inputs, prev, &chain, hook)?;
        for (k, n) in g.nodes.iter().enumerate() {
            let out_ty = &g.types[&n.outputs[0]];
            let t0 = std::time::Instant::now();
            chain.fill(k, n, &mut vals, hook)?;
            let v = if chain.sequential(k, n) {
                let per = chain
                    .run_node(k, n, &out_ty.shape, &vals, hook)
                    .map_err(|m| e(&g.name, &n.name, m))?;
                if profiling() {
                    record(n.op.onnx_name(), t0);
                }
                Val::Per(per)
            } else {
                // The sets this node runs for: all, or under `need` only those whose hidden state is read.
                let sets: Vec<usize> = match need.filter(|_| self.tail[k]) {
                    Some(nd) => (0..b).filter(|&s| nd[s]).collect(),
                    None => (0..b).collect(),
                };
                let v = self.node_val(k, n, &sets, b, &vals)?;
                if profiling() {
                    let op = if self.fast[k].is_some() {
                        "MatMul (weights, rowmm)"
                    } else {
                        n.op.onnx_name()
                    };
                    record(op, t0);
                }
                let t0 = std::time::Instant::now();
                let v = shown(v, &n.outputs[0], &sets, b, hook);
                if profiling() {
                    record(&format!("(hook) {}", n.op.onnx_name()), t0);
                }
                v
            };
            vals.insert(n.outputs[0].clone(), v);
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

    /// The graph inputs of every set (checked against the contract, as the hook returns them) and the
    /// initializers not run by the weight kernel.
    fn input_vals(
        &self,
        inputs: &mut [HashMap<String, Tensor>],
        prev: &[Option<usize>],
        chain: &Chain,
        hook: &mut dyn Hook,
    ) -> Result<Vals> {
        let g = &self.graph;
        let mut vals = Vals::new();
        for vi in &g.inputs {
            let mut per = Vec::with_capacity(inputs.len());
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
        Ok(vals)
    }

    /// Node `k`'s value for the sets `sets` (of `b`): a weight MatMul through the kernel over all their rows,
    /// a Transpose read only by MatMuls as a view, shared inputs once, else per set (in parallel when there
    /// is enough work to share: small tensors cost less than the hand-off).
    fn node_val(&self, k: usize, n: &Node, sets: &[usize], b: usize, vals: &Vals) -> Result<Val> {
        let g = &self.graph;
        let out = &g.types[&n.outputs[0]].shape;
        if sets.is_empty() {
            return Ok(Val::Per(vec![empty(); b]));
        }
        if let Some(w) = &self.fast[k] {
            let w = self.row_weight(w)?;
            return Ok(match &vals[&n.inputs[0]] {
                Val::One(x) => Val::One(self.fast_matmul(&[x], &w, out)?.remove(0)),
                Val::Per(xs) => Val::Per(self.fast_matmul(
                    &sets.iter().map(|&s| &xs[s]).collect::<Vec<_>>(),
                    &w,
                    out,
                )?),
            });
        }
        if let (true, Op::Transpose { perm }) = (self.view[k], &n.op) {
            let v = |t: &Tensor| t.permute(perm.as_slice());
            return Ok(match &vals[&n.inputs[0]] {
                Val::One(x) => Val::One(v(x)?),
                Val::Per(xs) => Val::Per(
                    sets.iter()
                        .map(|&s| v(&xs[s]))
                        .collect::<candle_core::Result<_>>()?,
                ),
            });
        }
        if n.inputs.iter().all(|i| matches!(vals[i], Val::One(_))) {
            let ins: Vec<&Tensor> = n.inputs.iter().map(|i| vals[i].get(0)).collect();
            return Ok(Val::One(
                eval(&n.op, &ins, out).map_err(|m| e(&g.name, &n.name, m))?,
            ));
        }
        use rayon::prelude::*;
        let one = |&s: &usize| {
            let ins: Vec<&Tensor> = n.inputs.iter().map(|i| vals[i].get(s)).collect();
            eval(&n.op, &ins, out).map_err(|m| e(&g.name, &n.name, m))
        };
        let work = out.iter().product::<usize>() * sets.len();
        let per: Vec<Tensor> = if sets.len() > 1 && work >= PAR_MIN {
            sets.par_iter().map(one).collect::<Result<_>>()?
        } else {
            sets.iter().map(one).collect::<Result<_>>()?
        };
        Ok(Val::Per(per))
    }
}

/// `v` after the hook has seen each set's tensor, as `b` separate runs would show it; back to one entry per
/// set, empty where skipped.
fn shown(v: Val, name: &str, sets: &[usize], b: usize, hook: &mut dyn Hook) -> Val {
    match v {
        _ if sets.is_empty() => v,
        Val::One(t) => {
            let mut r = None;
            for _ in 0..sets.len() {
                r = hook.tensor(name, &t).or(r);
            }
            Val::One(r.unwrap_or(t))
        }
        Val::Per(ts) => {
            let r = hook.tensors(name, &ts);
            let ts: Vec<Tensor> = ts.into_iter().zip(r).map(|(t, r)| r.unwrap_or(t)).collect();
            if sets.len() == b {
                return Val::Per(ts);
            }
            let mut per = vec![empty(); b];
            for (&s, t) in sets.iter().zip(ts) {
                per[s] = t;
            }
            Val::Per(per)
        }
    }
}
