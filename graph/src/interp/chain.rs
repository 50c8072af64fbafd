//! Chained runs (see [`Interpreter::run_chained`]): set s continues set p's sequence one position later, its
//! `past_*` inputs being p's `present_*` outputs, all inside one run of the decode graph.

use super::ops::eval;
use super::{Hook, Interpreter, Val};
use crate::ir::Node;
use candle_core::{DType as CD, Device, Tensor};
use hexq_model::error::{Error, Result};
use std::collections::HashMap;

/// The `past_*` → `present_*` carries of a chained run (see [`Interpreter::run_chained`]).
pub(crate) struct Chain<'a> {
    prev: &'a [Option<usize>],
    /// past input → (present output, the node writing it).
    pub(crate) carry: HashMap<String, (String, usize)>,
    /// present output → the last node reading it or its past (after which interior sets' copies go).
    last: HashMap<String, usize>,
}

impl<'a> Chain<'a> {
    pub(crate) fn of(it: &Interpreter, prev: &'a [Option<usize>]) -> Result<Self> {
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
                    msg: format!(
                        "cannot chain: {} is read before {present} is written",
                        vi.name
                    ),
                });
            }
            let last = rp.iter().chain(&rq).copied().max().unwrap_or(w).max(w);
            c.last.insert(present.clone(), last);
            c.carry.insert(vi.name.clone(), (present, w));
        }
        Ok(c)
    }

    /// Before node `k`: chained sets' copies of the pasts it reads whose presents are already written.
    pub(crate) fn fill(
        &self,
        k: usize,
        n: &Node,
        vals: &mut HashMap<String, Val>,
        hook: &mut dyn Hook,
    ) -> Result<()> {
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
    pub(crate) fn sequential(&self, k: usize, n: &Node) -> bool {
        n.inputs
            .iter()
            .any(|i| self.carry.get(i).is_some_and(|c| c.1 == k))
    }

    /// Node `k`, which writes a present that chained sets read from their predecessor: set by set in chain
    /// order. When the hook only observes, independent chains run in parallel and are observed afterwards
    /// (the hook changes nothing, so the order it sees them in cannot matter).
    pub(crate) fn run_node(
        &self,
        k: usize,
        n: &Node,
        out: &[usize],
        vals: &HashMap<String, Val>,
        hook: &mut dyn Hook,
    ) -> candle_core::Result<Vec<Tensor>> {
        let b = self.prev.len();
        let carried: Vec<usize> = (0..n.inputs.len())
            .filter(|&x| self.carry.get(&n.inputs[x]).is_some_and(|c| c.1 == k))
            .collect();
        let name = &n.outputs[0];
        if !hook.observes_only() {
            let mut per: Vec<Tensor> = Vec::with_capacity(b);
            for s in 0..b {
                let mut ins: Vec<Tensor> =
                    n.inputs.iter().map(|i| vals[i].get(s).clone()).collect();
                if let Some(p) = self.prev[s] {
                    for &x in &carried {
                        let t = per[p].clone();
                        ins[x] = hook.tensor(&n.inputs[x], &t).unwrap_or(t);
                    }
                }
                let r = eval(&n.op, &ins.iter().collect::<Vec<_>>(), out)?;
                per.push(hook.tensor(name, &r).unwrap_or(r));
            }
            return Ok(per);
        }
        use rayon::prelude::*;
        let mut chains: Vec<Vec<usize>> = Vec::new();
        let mut of = vec![0usize; b];
        for s in 0..b {
            match self.prev[s] {
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
        let done: Vec<Vec<(usize, Tensor)>> = chains
            .par_iter()
            .map(|c| {
                let mut done: Vec<(usize, Tensor)> = Vec::with_capacity(c.len());
                for &s in c {
                    let mut ins: Vec<&Tensor> = n.inputs.iter().map(|i| vals[i].get(s)).collect();
                    if self.prev[s].is_some() {
                        // Its predecessor is the chain's previous set.
                        for &x in &carried {
                            ins[x] = &done.last().unwrap().1;
                        }
                    }
                    let r = eval(&n.op, &ins, out)?;
                    done.push((s, r));
                }
                Ok(done)
            })
            .collect::<candle_core::Result<_>>()?;
        let mut per: Vec<Option<Tensor>> = vec![None; b];
        for (s, t) in done.into_iter().flatten() {
            per[s] = Some(t);
        }
        let per: Vec<Tensor> = per.into_iter().map(Option::unwrap).collect();
        let fed: Vec<Tensor> = self
            .prev
            .iter()
            .flatten()
            .map(|&p| per[p].clone())
            .collect();
        for &x in &carried {
            hook.tensors(&n.inputs[x], &fed);
        }
        hook.tensors(name, &per);
        Ok(per)
    }

    /// After node `k`: drop the presents of sets another set continued, once nothing reads them.
    pub(crate) fn release(
        &self,
        k: usize,
        prev: &[Option<usize>],
        vals: &mut HashMap<String, Val>,
    ) {
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
