//! Backend `graph`: the IR interpreter driven exactly as a device would be — host lookups in, hidden state
//! out, KV buffers carried from `present_*` to `past_*` between calls; prompts through `trunk` in SEQ-token
//! chunks when a trunk graph is given, then one token per call through the decode graph.

use crate::Error;
use crate::{Backend, Result};
use candle_core::{DType as CD, Device, Tensor};
use hexq_graph::build::{past_key, past_value, present_key, present_value};
use hexq_graph::interp::{Hook, Interpreter, NoHook};
use hexq_graph::Graph;
use hexq_model::forward::{to_rows, Host};
use hexq_model::prefix::Prefix;
use std::collections::HashMap;

/// One sequence's state for batched decoding: its KV buffers (by past_* name) and next position.
pub struct Slot {
    pub kv: HashMap<String, Tensor>,
    pub pos: usize,
}

/// Positions per sequence for one [`GraphBackend::step_chain`] call: each sequence already given one
/// (`take[i]` = 1) gets more, round by round, up to `left[i]` tokens it has ready, until `budget` extra
/// positions are handed out — a lone long prompt gets them all.
pub fn spread(take: &mut [usize], left: &[usize], mut budget: usize) {
    while budget > 0 {
        let before = budget;
        for (t, &l) in take.iter_mut().zip(left) {
            if budget > 0 && *t > 0 && *t < l {
                *t += 1;
                budget -= 1;
            }
        }
        if budget == before {
            break;
        }
    }
}

/// A generator of N embedding values (replacing the token lookup).
pub type Noise = Box<dyn FnMut(usize) -> Vec<f32> + Send>;

pub struct GraphBackend {
    pub host: Host,
    pub decode: Interpreter,
    pub trunk: Option<Interpreter>,
    /// KV buffers by past_* name.
    kv: HashMap<String, Tensor>,
    pub pos: usize,
    pub context: usize,
    /// Final hidden state of the last position fed (for verification).
    pub last_hidden: Vec<f32>,
    pub hook: Option<Box<dyn Hook + Send>>,
    /// Position 0 (BOS) computed in f32 on the host, as exports ship it (hexq_model::prefix): the graphs —
    /// and calibration's observers — see positions 1.. only.
    pub prefix: Option<Prefix>,
    /// When set, replaces the host's embeddings by these values (calibration failure-mode demos).
    pub noise: Option<Noise>,
}

fn i64_tensor(v: Vec<i64>, shape: &[usize]) -> Result<Tensor> {
    Ok(Tensor::from_vec(v, shape, &Device::Cpu)?)
}

impl GraphBackend {
    pub fn new(
        host: Host,
        decode: Interpreter,
        trunk: Option<Interpreter>,
        context: usize,
    ) -> Result<Self> {
        if let Some(t) = &trunk {
            // trunk writes the same ring buffers decode reads: their KV inputs must agree.
            for vi in t
                .graph
                .inputs
                .iter()
                .filter(|v| v.name.starts_with("past_"))
            {
                let d = decode.graph.inputs.iter().find(|x| x.name == vi.name);
                if d.map(|d| &d.ty) != Some(&vi.ty) {
                    return Err(Error::Artifacts(format!(
                        "trunk input {} does not match the decode graph's KV layout",
                        vi.name
                    )));
                }
            }
        }
        let mut b = GraphBackend {
            host,
            decode,
            trunk,
            kv: HashMap::new(),
            pos: 0,
            context,
            last_hidden: vec![],
            hook: None,
            noise: None,
            prefix: None,
        };
        b.reset();
        Ok(b)
    }

    /// The usual set-up: the `decode` graph, plus a trunk sharing its weights when `trunk` (chunked prefill).
    pub fn for_model(
        ck: &std::sync::Arc<hexq_model::Checkpoint>,
        decode: hexq_graph::Variant,
        trunk: bool,
        o: &hexq_graph::GraphOptions,
    ) -> Result<Self> {
        use hexq_graph::{build, Variant};
        let d = Interpreter::new(build(&ck.config, decode, o), ck.clone())?;
        let t = if trunk {
            Some(
                Interpreter::new(build(&ck.config, Variant::Trunk, o), ck.clone())?
                    .sharing_weights_with(&d),
            )
        } else {
            None
        };
        let mut b = GraphBackend::new(Host::load(ck.clone())?, d, t, o.context)?;
        b.prefix = Some(Prefix::compute(ck)?);
        Ok(b)
    }

    /// Position 0 from the prefix when `ids` start with its token there: K/V into ring slot 0, no graph
    /// run. Returns position 0's hidden state.
    fn take_prefix(&mut self, ids: &[u32]) -> Result<Option<Vec<f32>>> {
        let Some(p) = self.prefix.as_ref() else {
            return Ok(None);
        };
        if self.pos != 0 || ids.first() != Some(&p.token) {
            return Ok(None);
        }
        for (name, heads, x) in p.entries() {
            if let Some(t) = self.kv.get_mut(&name) {
                let mut v = t.flatten_all()?.to_vec1::<f32>()?;
                hexq_model::prefix::write_slot0(&mut v, heads, x);
                *t = Tensor::from_vec(v, t.dims(), &Device::Cpu)?;
            }
        }
        self.pos = 1;
        Ok(Some(p.hidden.clone()))
    }

    /// Apply `hook` to the graphs' weights and constants once (see [`Interpreter::bake`]).
    pub fn bake(&mut self, hook: &mut dyn Hook) -> Result<()> {
        self.decode.bake(hook, true)?;
        if let Some(t) = &self.trunk {
            t.bake(hook, false)?;
        }
        Ok(())
    }

    fn run(
        &mut self,
        trunk: bool,
        mut ins: HashMap<String, Tensor>,
    ) -> Result<HashMap<String, Tensor>> {
        let interp = if trunk {
            self.trunk.as_ref().unwrap()
        } else {
            &self.decode
        };
        for vi in interp
            .graph
            .inputs
            .iter()
            .filter(|v| v.name.starts_with("past_"))
        {
            ins.insert(vi.name.clone(), self.kv[&vi.name].clone());
        }
        let mut no = NoHook;
        let hook: &mut dyn Hook = match self.hook.as_mut() {
            Some(h) => h.as_mut(),
            None => &mut no,
        };
        let mut out = interp.run(&ins, hook)?;
        for vi in interp
            .graph
            .inputs
            .iter()
            .filter(|v| v.name.starts_with("past_key_"))
        {
            let i: usize = vi.name["past_key_".len()..].parse().unwrap();
            self.kv
                .insert(past_key(i), out.remove(&present_key(i)).unwrap());
            self.kv
                .insert(past_value(i), out.remove(&present_value(i)).unwrap());
        }
        Ok(out)
    }

    fn host_inputs(&mut self, ids: &[u32], pad_to: usize) -> Result<HashMap<String, Tensor>> {
        let pos = self.pos;
        self.host_inputs_at(ids, pad_to, pos)
    }

    fn host_inputs_at(
        &mut self,
        ids: &[u32],
        pad_to: usize,
        at: usize,
    ) -> Result<HashMap<String, Tensor>> {
        let cfg = self.host.cfg.clone();
        let mut padded = ids.to_vec();
        padded.resize(pad_to, cfg.pad_token_id);
        let mut m = HashMap::new();
        let mut e = self.host.embed(&padded)?;
        let mut ple = self.host.ple_lookup(&padded)?;
        if let Some(f) = self.noise.as_mut() {
            e = Tensor::from_vec(f(e.elem_count()), e.dims(), &Device::Cpu)?;
            if let Some(p) = &ple {
                ple = Some(Tensor::from_vec(f(p.elem_count()), p.dims(), &Device::Cpu)?);
            }
        }
        m.insert(
            "inputs_embeds".into(),
            e.reshape((1, pad_to, cfg.hidden_size))?,
        );
        if let Some(p) = ple {
            m.insert(
                "per_layer_inputs".into(),
                p.reshape((1, pad_to, cfg.num_layers, cfg.ple_dim))?,
            );
        }
        // Padding positions continue the sequence (clamped to the RoPE table); their outputs are ignored.
        let pos: Vec<i64> = (0..pad_to)
            .map(|j| ((at + j).min(self.context - 1)) as i64)
            .collect();
        m.insert("position_ids".into(), i64_tensor(pos, &[1, pad_to])?);
        Ok(m)
    }

    fn check_room(&self, n: usize) -> Result<()> {
        if self.pos + n > self.context {
            return Err(Error::ContextFull(format!(
                " position {} + {n} tokens exceeds --context {}",
                self.pos, self.context
            )));
        }
        Ok(())
    }

    /// One token through the decode graph; returns the final hidden state `[H]`.
    pub fn step(&mut self, id: u32) -> Result<Vec<f32>> {
        self.check_room(1)?;
        if let Some(h) = self.take_prefix(&[id])? {
            return Ok(h);
        }
        let mut ins = self.host_inputs(&[id], 1)?;
        ins.insert(
            "cache_position".into(),
            i64_tensor(vec![self.pos as i64], &[1])?,
        );
        let out = self.run(false, ins)?;
        self.pos += 1;
        let h = out["hidden_states"]
            .flatten_all()?
            .to_dtype(CD::F32)?
            .to_vec1::<f32>()?;
        Ok(h)
    }

    /// Up to SEQ tokens through the trunk; returns the hidden states of the real tokens `[n][H]`.
    pub fn chunk(&mut self, ids: &[u32]) -> Result<Vec<Vec<f32>>> {
        let seq = self.trunk.as_ref().unwrap().graph.inputs[0].ty.shape[1];
        assert!(!ids.is_empty() && ids.len() <= seq);
        self.check_room(ids.len())?;
        if let Some(h) = self.take_prefix(ids)? {
            let mut out = vec![h];
            if ids.len() > 1 {
                out.extend(self.chunk(&ids[1..])?);
            }
            return Ok(out);
        }
        let mut ins = self.host_inputs(ids, seq)?;
        ins.insert(
            "valid_len".into(),
            i64_tensor(vec![ids.len() as i64], &[1])?,
        );
        let out = self.run(true, ins)?;
        self.pos += ids.len();
        let h = to_rows(&out["hidden_states"].squeeze(0)?)?;
        Ok(h[..ids.len()].to_vec())
    }

    /// Hidden states of every position of `ids` (trunk chunks if present, else decode steps).
    pub fn hidden(&mut self, ids: &[u32]) -> Result<Vec<Vec<f32>>> {
        let mut out = Vec::new();
        if let Some(t) = &self.trunk {
            let seq = t.graph.inputs[0].ty.shape[1];
            for c in ids.chunks(seq) {
                out.extend(self.chunk(c)?);
            }
        } else {
            for &id in ids {
                out.push(self.step(id)?);
            }
        }
        Ok(out)
    }

    /// A fresh sequence state for [`GraphBackend::step_batch`]: zeroed KV buffers at position 0.
    pub fn new_slot(&self) -> Slot {
        let kv = self
            .decode
            .graph
            .inputs
            .iter()
            .filter(|v| v.name.starts_with("past_"))
            .map(|vi| {
                let z = Tensor::zeros(vi.ty.shape.as_slice(), CD::F32, &Device::Cpu).unwrap();
                (vi.name.clone(), z)
            })
            .collect();
        Slot { kv, pos: 0 }
    }

    /// One decode step for several independent sequences at once: `ids[i]` at `slots[i]`'s position, one
    /// batched run of the decode graph (weights read once for all; see `Interpreter::run_batch`) — each
    /// sequence's hidden state and KV exactly what [`GraphBackend::step`] gives it alone. The hook sees every
    /// sequence's tensors. Returns the final hidden state per sequence.
    pub fn step_batch(&mut self, slots: &mut [&mut Slot], ids: &[u32]) -> Result<Vec<Vec<f32>>> {
        let runs: Vec<&[u32]> = ids.iter().map(std::slice::from_ref).collect();
        Ok(self
            .step_chain(slots, &runs)?
            .into_iter()
            .map(|mut h| h.pop().unwrap())
            .collect())
    }

    /// Several decode steps per sequence in one call: `runs[i]` fed to `slots[i]` one position after
    /// another, all positions of all sequences in one chained run of the decode graph (see
    /// `Interpreter::run_chained`: each position's KV feeds the next inside the call, the weight MatMuls
    /// take every position's row at once). Each step exactly what [`GraphBackend::step`] gives it. Returns
    /// the hidden state after every fed id, per sequence.
    pub fn step_chain(
        &mut self,
        slots: &mut [&mut Slot],
        runs: &[&[u32]],
    ) -> Result<Vec<Vec<Vec<f32>>>> {
        self.chain(slots, runs, None)
    }

    /// [`GraphBackend::step_chain`] where only some runs' last hidden state is read (`want[i]`): the other
    /// positions only write their KV, skipping every node no KV depends on (under KV sharing, the layers
    /// after the last one writing K/V — over half of Gemma-4 E2B's decoder; see `Interpreter::run_chained`).
    /// The KV and the wanted hidden states are the same values as [`GraphBackend::step_chain`]'s; a hook
    /// sees only the nodes run, so an observer wanting every position must use `step_chain`.
    pub fn step_chain_last(
        &mut self,
        slots: &mut [&mut Slot],
        runs: &[&[u32]],
        want: &[bool],
    ) -> Result<Vec<Option<Vec<f32>>>> {
        Ok(self
            .chain(slots, runs, Some(want))?
            .into_iter()
            .map(|mut h| h.pop())
            .collect())
    }

    fn chain(
        &mut self,
        slots: &mut [&mut Slot],
        runs: &[&[u32]],
        want: Option<&[bool]>,
    ) -> Result<Vec<Vec<Vec<f32>>>> {
        // Whether the hidden state after run i's position j is read.
        let read = |i: usize, j: usize| want.is_none_or(|w| w[i] && j + 1 == runs[i].len());
        let mut hidden: Vec<Vec<Vec<f32>>> =
            runs.iter().map(|r| Vec::with_capacity(r.len())).collect();
        let mut prev = Vec::new();
        let mut ins = Vec::new();
        // (sequence, is the last set of its run, its hidden state is read) per set.
        let mut sets = Vec::new();
        for (i, (slot, run)) in slots.iter_mut().zip(runs).enumerate() {
            if slot.pos + run.len() > self.context {
                return Err(Error::ContextFull(format!(
                    " position {} + {} tokens exceeds --context {}",
                    slot.pos,
                    run.len(),
                    self.context
                )));
            }
            let mut pos = slot.pos;
            let mut last = None;
            for (j, &id) in run.iter().enumerate() {
                if let Some(p) = self.prefix.as_ref().filter(|p| pos == 0 && p.token == id) {
                    for (name, heads, x) in p.entries() {
                        if let Some(t) = slot.kv.get_mut(&name) {
                            let mut v = t.flatten_all()?.to_vec1::<f32>()?;
                            hexq_model::prefix::write_slot0(&mut v, heads, x);
                            *t = Tensor::from_vec(v, t.dims(), &Device::Cpu)?;
                        }
                    }
                    pos = 1;
                    if read(i, j) {
                        hidden[i].push(p.hidden.clone());
                    }
                    continue;
                }
                let mut m = self.host_inputs_at(&[id], 1, pos)?;
                m.insert("cache_position".into(), i64_tensor(vec![pos as i64], &[1])?);
                if last.is_none() {
                    // Moved, not shared: the interpreter frees each buffer after its last use.
                    m.extend(slot.kv.drain());
                }
                prev.push(last);
                last = Some(ins.len());
                ins.push(m);
                sets.push((i, j + 1 == run.len(), read(i, j)));
                pos += 1;
            }
            slot.pos = pos;
        }
        if ins.is_empty() {
            return Ok(hidden);
        }
        let mut no = NoHook;
        let hook: &mut dyn Hook = match self.hook.as_mut() {
            Some(h) => h.as_mut(),
            None => &mut no,
        };
        let names: Vec<String> = self
            .decode
            .graph
            .inputs
            .iter()
            .filter(|v| v.name.starts_with("past_"))
            .map(|v| v.name.clone())
            .collect();
        let need: Vec<bool> = sets.iter().map(|s| s.2).collect();
        let outs = self
            .decode
            .run_chained(ins, &prev, want.map(|_| need.as_slice()), hook)?;
        for ((i, end, read), mut out) in sets.into_iter().zip(outs) {
            if end {
                for name in &names {
                    let present = name.replacen("past_", "present_", 1);
                    slots[i]
                        .kv
                        .insert(name.clone(), out.remove(&present).unwrap());
                }
            }
            if read {
                hidden[i].push(out["hidden_states"].flatten_all()?.to_vec1::<f32>()?);
            }
        }
        Ok(hidden)
    }

    pub fn logits(&self, h: &[f32]) -> Result<Vec<f32>> {
        let t = Tensor::from_vec(h.to_vec(), (1, h.len()), &Device::Cpu)?;
        Ok(to_rows(&self.host.lm_head(&t)?)?.pop().unwrap())
    }

    pub fn decode_graph(&self) -> &Graph {
        &self.decode.graph
    }
}

impl Backend for GraphBackend {
    fn name(&self) -> &str {
        "graph"
    }
    fn capacity(&self) -> Option<usize> {
        Some(self.context)
    }
    fn reset(&mut self) {
        self.kv.clear();
        for vi in self
            .decode
            .graph
            .inputs
            .iter()
            .filter(|v| v.name.starts_with("past_"))
        {
            self.kv.insert(
                vi.name.clone(),
                Tensor::zeros(vi.ty.shape.as_slice(), CD::F32, &Device::Cpu).unwrap(),
            );
        }
        self.pos = 0;
    }
    fn feed(&mut self, ids: &[u32]) -> Result<Vec<f32>> {
        let trunk = self.trunk.is_some();
        let h = crate::last_hidden(self, ids, trunk)?;
        self.last_hidden = h.clone();
        self.logits(&h)
    }
}

/// The LM head as rows of the batch-invariant kernel ([`hexq_kernels::rowmm`]): the logits of many hidden
/// states in one multiply (the head read once), each row's result independent of the others — greedy picks
/// and verify figures do not depend on how many prompts run side by side. Final softcap applied as the
/// host's head does.
pub struct Head {
    rows: hexq_kernels::RowWeight,
    cap: Option<f32>,
}

impl Head {
    pub fn of(ck: &hexq_model::Checkpoint) -> Result<Head> {
        use hexq_graph::interp::WeightSource;
        let cfg = &ck.config;
        let name = if cfg.tie_word_embeddings {
            hexq_model::names::EMBED
        } else {
            hexq_model::names::LM_HEAD
        };
        let rows = ck.rows(name)?;
        rows.pin(); // read whole on every greedy pick (see RowWeight::pin)
        Ok(Head {
            rows,
            cap: cfg.final_logit_softcapping.map(|c| c as f32),
        })
    }

    /// Logits of each hidden state.
    pub fn logits(&self, hs: &[&[f32]]) -> Vec<Vec<f32>> {
        if hs.is_empty() {
            return vec![];
        }
        let x: Vec<f32> = hs.iter().flat_map(|h| h.iter().copied()).collect();
        let y = self.rows.matmul(&x, hs.len());
        // Rows in parallel: the softcap is a libm tanh per vocabulary entry (262,144 per row at E2B).
        use rayon::prelude::*;
        y.par_chunks(self.rows.out)
            .map(|row| match self.cap {
                Some(c) => row.iter().map(|&v| (v / c).tanh() * c).collect(),
                None => row.to_vec(),
            })
            .collect()
    }
}
