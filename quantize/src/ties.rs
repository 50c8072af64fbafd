//! Tensors that must share one encoding (AIMET's and HTP's rules): Concat/ScatterND inputs and outputs,
//! grid-preserving ops' outputs and their sources, the KV groups.

use hexq_graph::ir::{Graph, Op};
use std::collections::BTreeMap;

/// Ops whose output is a rearrangement of (a subset of) input 0's values: `q(f(x)) = f(q(x))`, so the output
/// keeps the input's grid (aimet-onnx's grid-preserving ops among those the IR has).
fn grid_preserving(op: &Op) -> bool {
    matches!(
        op,
        Op::Reshape { .. }
            | Op::Transpose { .. }
            | Op::Slice { .. }
            | Op::Gather { .. }
            | Op::Unsqueeze { .. }
            | Op::Expand { .. }
    )
}

/// The tensor whose grid `name` inherits: follow grid-preserving producers back to their data input.
pub(crate) fn grid_source(g: &Graph, name: &str) -> Option<String> {
    let mut cur = name.to_string();
    let mut moved = false;
    while let Some(n) = g.nodes.iter().find(|n| n.outputs[0] == cur) {
        if !grid_preserving(&n.op) {
            break;
        }
        cur = n.inputs[0].clone();
        moved = true;
    }
    moved.then_some(cur)
}

/// aimet-onnx 2.x's encoding ties (`_propagate_output_encodings`): walking ops in reverse order, each
/// Concat/ScatterND (and the KV-write Where) claims the effective source of every float activation input that nothing else reads
/// (looking through grid-preserving producers, and recursively through tied producers) into its output's
/// group. Returns member → group output.
pub fn tie_groups(g: &Graph) -> BTreeMap<String, String> {
    use std::collections::{HashMap, HashSet};
    let mut consumers: HashMap<&str, usize> = HashMap::new();
    for n in &g.nodes {
        for i in &n.inputs {
            *consumers.entry(i.as_str()).or_default() += 1;
        }
    }
    let producer: HashMap<&str, usize> = g
        .nodes
        .iter()
        .enumerate()
        .map(|(k, n)| (n.outputs[0].as_str(), k))
        .collect();
    // Plus the KV write `present = Where(is_slot, new_row, past)`: HTP's select needs its value inputs and
    // output on one encoding (mismatched ones fail graph finalization, measured with onnxruntime-qnn 2.7),
    // which aimet-onnx does not tie by default.
    let tie = |n: &hexq_graph::ir::Node| {
        matches!(n.op, Op::Concat { .. } | Op::ScatterND)
            || (n.op == Op::Where && n.outputs[0].starts_with("present_"))
    };
    let mut out: BTreeMap<String, String> = BTreeMap::new();
    let mut visited: HashSet<usize> = HashSet::new();
    for (k, n) in g.nodes.iter().enumerate().rev() {
        if !tie(n) || visited.contains(&k) || !g.types[&n.outputs[0]].dtype.is_float() {
            continue;
        }
        let root = n.outputs[0].clone();
        let mut stack = vec![k];
        while let Some(op) = stack.pop() {
            if !visited.insert(op) {
                continue;
            }
            for inp in &g.nodes[op].inputs {
                if !g.types[inp].dtype.is_float() || g.is_initializer(inp) {
                    continue;
                }
                // The chain of grid-preserving producers back to the effective source may be tied only
                // if nothing outside the chain reads any of it.
                let mut chain = vec![inp.clone()];
                let mut cur = inp.clone();
                while let Some(&p) = producer.get(cur.as_str()) {
                    if !grid_preserving(&g.nodes[p].op) {
                        break;
                    }
                    cur = g.nodes[p].inputs[0].clone();
                    chain.push(cur.clone());
                }
                let reads: usize = chain
                    .iter()
                    .map(|t| consumers.get(t.as_str()).copied().unwrap_or(0))
                    .sum();
                if reads - (chain.len() - 1) > 1 || g.is_initializer(&cur) {
                    continue;
                }
                // A weight MatMul's output keeps its own (asymmetric) grid and the first grid-preserving op
                // after it requantizes into the group: with no norm between v_proj and the V group
                // (Gemma-3), tying would make v_proj a MatMul with a uint16 input and a symmetric int16
                // output, which onnxruntime-qnn does not fuse (its weight DequantizeLinear is left off HTP).
                let weight_matmul = producer.get(cur.as_str()).is_some_and(|&p| {
                    let n = &g.nodes[p];
                    n.op == Op::MatMul && g.is_initializer(&n.inputs[1])
                });
                if weight_matmul && chain.len() > 1 {
                    chain.pop();
                }
                for t in &chain {
                    out.entry(t.clone()).or_insert_with(|| root.clone());
                }
                if let Some(&p) = producer.get(inp.as_str()) {
                    if tie(&g.nodes[p]) {
                        stack.push(p);
                    }
                }
            }
        }
        out.entry(root.clone()).or_insert(root);
    }
    out
}
