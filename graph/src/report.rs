//! Graph summaries (`hexq graph`) and the I/O contract document generated from the graphs themselves.

use crate::ir::{Graph, InitSource};
use serde::Serialize;
use std::collections::BTreeMap;

#[derive(Debug, Clone, Serialize)]
pub struct KvTraffic {
    /// Elements of all past_* buffers (what one step reads).
    pub elements: usize,
    pub bytes_f32: usize,
    /// With int16 KV (A16 activations) and int8 KV (the int8-KV variant).
    pub bytes_int16: usize,
    pub bytes_int8: usize,
    pub buffers: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub name: String,
    pub nodes: usize,
    pub ops: BTreeMap<&'static str, usize>,
    pub expand_nodes: usize,
    pub inputs: Vec<(String, String, Vec<usize>)>,
    pub outputs: Vec<(String, String, Vec<usize>)>,
    pub weight_initializers: usize,
    pub weight_parameters: usize,
    pub constant_bytes: usize,
    pub kv_read_per_call: KvTraffic,
}

pub fn kv_traffic(g: &Graph) -> KvTraffic {
    let kv: Vec<_> = g
        .inputs
        .iter()
        .filter(|v| v.name.starts_with("past_"))
        .collect();
    let elements: usize = kv.iter().map(|v| v.ty.numel()).sum();
    KvTraffic {
        elements,
        bytes_f32: elements * 4,
        bytes_int16: elements * 2,
        bytes_int8: elements,
        buffers: kv.len(),
    }
}

pub fn summary(g: &Graph) -> Summary {
    let io = |v: &crate::ir::ValueInfo| {
        (
            v.name.clone(),
            format!("{:?}", v.ty.dtype),
            v.ty.shape.clone(),
        )
    };
    let w: Vec<_> = g
        .initializers
        .iter()
        .filter(|i| matches!(i.source, InitSource::Weight { .. }))
        .collect();
    Summary {
        name: g.name.clone(),
        nodes: g.nodes.len(),
        ops: g.op_histogram(),
        expand_nodes: g.count("Expand"),
        inputs: g.inputs.iter().map(io).collect(),
        outputs: g.outputs.iter().map(io).collect(),
        weight_initializers: w.len(),
        weight_parameters: w.iter().map(|i| i.ty.numel()).sum(),
        constant_bytes: g
            .initializers
            .iter()
            .filter(|i| !matches!(i.source, InitSource::Weight { .. }))
            .map(|i| i.ty.bytes())
            .sum(),
        kv_read_per_call: kv_traffic(g),
    }
}

/// Markdown table of a graph's inputs and outputs: name, dtype, shape, meaning.
pub fn io_contract_markdown(g: &Graph) -> String {
    let mut s = format!(
        "### `{}`\n\n| direction | name | dtype | shape | meaning |\n|---|---|---|---|---|\n",
        g.name
    );
    // Collapse the per-layer KV rows into one line per buffer shape to keep the table readable.
    for (dir, list) in [("in", &g.inputs), ("out", &g.outputs)] {
        let mut kv: BTreeMap<(String, Vec<usize>), Vec<String>> = BTreeMap::new();
        for v in list.iter() {
            let kvname = ["past_key_", "past_value_", "present_key_", "present_value_"]
                .iter()
                .find(|p| v.name.starts_with(**p));
            match kvname {
                Some(p) => kv
                    .entry((p.to_string(), v.ty.shape.clone()))
                    .or_default()
                    .push(v.name[p.len()..].to_string()),
                None => {
                    s += &format!(
                        "| {dir} | `{}` | {:?} | {:?} | {} |\n",
                        v.name, v.ty.dtype, v.ty.shape, v.doc
                    )
                }
            }
        }
        for ((p, shape), layers) in kv {
            let meaning = match p.as_str() {
                "past_key_" => "keys after k_norm + RoPE, ring buffer (slot = position % length); zeros at start",
                "past_value_" => "values after v_norm, ring buffer",
                "present_key_" => "the key buffer with this call's entries written; feed back as past_key_N",
                _ => "the value buffer with this call's entries written; feed back as past_value_N",
            };
            s += &format!(
                "| {dir} | `{p}N`, N ∈ {{{}}} | F32 | {:?} | {meaning} |\n",
                layers.join(", "),
                shape
            );
        }
    }
    s
}
