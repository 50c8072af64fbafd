//! The graph IR: what is calibrated, quantized, exported and compiled.
//!
//! It lives in the model crate because every later stage consumes it and data flows one way
//! (model → calibrate → quantize → export → runtime): the calibrator observes its tensors, the quantizer
//! annotates them by name, the ONNX exporter writes it node for node, the runtime interprets it. Putting it in
//! export would make calibrate depend on export.
//!
//! Named tensors with static shapes and dtypes; nodes in topological order; every op maps 1:1 to an ONNX
//! operator at [`OPSET`] and to an op QNN's converter places on HTP. Weights are initializers that *refer* to a
//! checkpoint tensor (name + transform), so building a 10 GB model's graph costs no weight memory.

use serde::Serialize;
use std::collections::{BTreeMap, HashMap, HashSet};

/// ONNX opset the IR's ops are defined at (21: int16 QuantizeLinear/DequantizeLinear for the QDQ export).
pub const OPSET: i64 = 21;
/// The finite mask constant. -inf or f32::MIN would blow the int16 range of every tensor they reach.
pub const NEG: f32 = -1.0e4;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum DType {
    F32,
    F16,
    BF16,
    I32,
    I64,
    Bool,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::I64 => 8,
            DType::Bool => 1,
        }
    }
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TensorType {
    pub dtype: DType,
    pub shape: Vec<usize>,
}

impl TensorType {
    pub fn new(dtype: DType, shape: &[usize]) -> Self {
        TensorType {
            dtype,
            shape: shape.to_vec(),
        }
    }
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn bytes(&self) -> usize {
        self.numel() * self.dtype.size()
    }
}

/// The ops. Attributes follow the ONNX operator of the same name.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub enum Op {
    MatMul,
    Add,
    Sub,
    Mul,
    Div,
    Pow,
    Sqrt,
    Reciprocal,
    Neg,
    Tanh,
    Sigmoid,
    Cos,
    Sin,
    /// Integer Mod with fmod=0 (result has the divisor's sign).
    Mod,
    ReduceMean {
        axes: Vec<i64>,
        keepdims: bool,
    },
    Softmax {
        axis: i64,
    },
    /// Target shape as an attribute here; exported as a constant shape input.
    Reshape {
        shape: Vec<i64>,
    },
    Transpose {
        perm: Vec<usize>,
    },
    Concat {
        axis: i64,
    },
    /// Static slice; exported with constant starts/ends/axes inputs.
    Slice {
        starts: Vec<i64>,
        ends: Vec<i64>,
        axes: Vec<i64>,
    },
    Gather {
        axis: i64,
    },
    ScatterND,
    Where,
    Equal,
    Less,
    Greater,
    Cast {
        to: DType,
    },
    /// Only in the naive decode_full baseline (KV repeated per query head).
    Expand {
        shape: Vec<i64>,
    },
    Unsqueeze {
        axes: Vec<i64>,
    },
}

impl Op {
    pub fn onnx_name(&self) -> &'static str {
        match self {
            Op::MatMul => "MatMul",
            Op::Add => "Add",
            Op::Sub => "Sub",
            Op::Mul => "Mul",
            Op::Div => "Div",
            Op::Pow => "Pow",
            Op::Sqrt => "Sqrt",
            Op::Reciprocal => "Reciprocal",
            Op::Neg => "Neg",
            Op::Tanh => "Tanh",
            Op::Sigmoid => "Sigmoid",
            Op::Cos => "Cos",
            Op::Sin => "Sin",
            Op::Mod => "Mod",
            Op::ReduceMean { .. } => "ReduceMean",
            Op::Softmax { .. } => "Softmax",
            Op::Reshape { .. } => "Reshape",
            Op::Transpose { .. } => "Transpose",
            Op::Concat { .. } => "Concat",
            Op::Slice { .. } => "Slice",
            Op::Gather { .. } => "Gather",
            Op::ScatterND => "ScatterND",
            Op::Where => "Where",
            Op::Equal => "Equal",
            Op::Less => "Less",
            Op::Greater => "Greater",
            Op::Cast { .. } => "Cast",
            Op::Expand { .. } => "Expand",
            Op::Unsqueeze { .. } => "Unsqueeze",
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Node {
    pub name: String,
    pub op: Op,
    pub inputs: Vec<String>,
    pub outputs: Vec<String>,
}

/// Where an initializer's values come from.
#[derive(Debug, Clone, Serialize)]
pub enum InitSource {
    /// A checkpoint tensor (prefix-relative name), optionally transposed (2-D: `[out, in]` → `[in, out]` for MatMul).
    Weight {
        tensor: String,
        transpose: bool,
    },
    /// Small constant computed at build time (masks' constants, RoPE tables, scalars).
    F32(Vec<f32>),
    I64(Vec<i64>),
}

#[derive(Debug, Clone, Serialize)]
pub struct Initializer {
    pub name: String,
    pub ty: TensorType,
    pub source: InitSource,
}

#[derive(Debug, Clone, Serialize)]
pub struct ValueInfo {
    pub name: String,
    pub ty: TensorType,
    /// What it means (the I/O contract).
    pub doc: String,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Graph {
    pub name: String,
    pub inputs: Vec<ValueInfo>,
    pub outputs: Vec<ValueInfo>,
    pub initializers: Vec<Initializer>,
    pub nodes: Vec<Node>,
    /// Type of every tensor (inputs, initializers, node outputs).
    pub types: BTreeMap<String, TensorType>,
}

#[derive(Debug, thiserror::Error, PartialEq)]
#[error("graph {graph}: node {node:?}: {msg}")]
pub struct GraphError {
    pub graph: String,
    pub node: String,
    pub msg: String,
}

/// Broadcast two shapes numpy-style.
pub fn broadcast(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let n = a.len().max(b.len());
    let mut out = vec![0; n];
    for i in 0..n {
        let x = if i + a.len() >= n {
            a[i + a.len() - n]
        } else {
            1
        };
        let y = if i + b.len() >= n {
            b[i + b.len() - n]
        } else {
            1
        };
        out[i] = if x == y || y == 1 {
            x
        } else if x == 1 {
            y
        } else {
            return None;
        };
    }
    Some(out)
}

pub(crate) fn norm_axis(axis: i64, rank: usize) -> Option<usize> {
    let a = if axis < 0 { axis + rank as i64 } else { axis };
    (a >= 0 && (a as usize) < rank).then_some(a as usize)
}

pub use crate::infer::{infer, InferError};

impl Graph {
    /// Check the graph: unique names, every input defined before use (topological order, hence no cycle),
    /// every recorded type equal to what shape inference derives, outputs produced.
    pub fn validate(&self) -> Result<(), GraphError> {
        let err = |node: &str, msg: String| GraphError {
            graph: self.name.clone(),
            node: node.to_string(),
            msg,
        };
        let mut defined: HashMap<&str, TensorType> = HashMap::new();
        for v in &self.inputs {
            if defined.insert(&v.name, v.ty.clone()).is_some() {
                return Err(err(&v.name, "duplicate graph input".into()));
            }
        }
        for i in &self.initializers {
            if defined.insert(&i.name, i.ty.clone()).is_some() {
                return Err(err(&i.name, "initializer name already defined".into()));
            }
            let n = match &i.source {
                InitSource::F32(v) => Some(v.len()),
                InitSource::I64(v) => Some(v.len()),
                InitSource::Weight { .. } => None,
            };
            if let Some(n) = n {
                if n != i.ty.numel() {
                    return Err(err(
                        &i.name,
                        format!(
                            "constant has {n} values, shape {:?} needs {}",
                            i.ty.shape,
                            i.ty.numel()
                        ),
                    ));
                }
            }
        }
        let mut names = HashSet::new();
        for n in &self.nodes {
            if !names.insert(&n.name) {
                return Err(err(&n.name, "duplicate node name".into()));
            }
            let mut ins = Vec::new();
            for i in &n.inputs {
                match defined.get(i.as_str()) {
                    Some(t) => ins.push(t.clone()),
                    None => {
                        let later = self.nodes.iter().any(|m| m.outputs.contains(i));
                        let why = if later {
                            "is produced later (cycle or nodes out of topological order)"
                        } else {
                            "is not defined"
                        };
                        return Err(err(&n.name, format!("input {i:?} {why}")));
                    }
                }
            }
            let refs: Vec<&TensorType> = ins.iter().collect();
            let t = infer(&n.op, &refs).map_err(|m| err(&n.name, m.to_string()))?;
            if n.outputs.len() != 1 {
                return Err(err(
                    &n.name,
                    format!("{} outputs; IR ops have one", n.outputs.len()),
                ));
            }
            let o = &n.outputs[0];
            if let Some(rec) = self.types.get(o) {
                if *rec != t {
                    return Err(err(
                        &n.name,
                        format!(
                            "output {o:?} recorded as {:?} {:?}, inferred {:?} {:?}",
                            rec.dtype, rec.shape, t.dtype, t.shape
                        ),
                    ));
                }
            }
            if defined.insert(o, t).is_some() {
                return Err(err(&n.name, format!("output {o:?} already defined")));
            }
        }
        for o in &self.outputs {
            match defined.get(o.name.as_str()) {
                None => return Err(err(&o.name, "graph output is never produced".into())),
                Some(t) if *t != o.ty => {
                    return Err(err(
                        &o.name,
                        format!(
                            "graph output declared {:?} {:?}, computed {:?} {:?}",
                            o.ty.dtype, o.ty.shape, t.dtype, t.shape
                        ),
                    ))
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Histogram of op types.
    pub fn op_histogram(&self) -> BTreeMap<&'static str, usize> {
        let mut h = BTreeMap::new();
        for n in &self.nodes {
            *h.entry(n.op.onnx_name()).or_default() += 1;
        }
        h
    }

    pub fn count(&self, name: &str) -> usize {
        self.nodes
            .iter()
            .filter(|n| n.op.onnx_name() == name)
            .count()
    }

    /// SHA256 over the graph's structure and constants (weights by reference): identifies what was calibrated.
    pub fn content_hash(&self) -> String {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        let mut put = |s: &str| {
            h.update(s.as_bytes());
            h.update([0]);
        };
        put(&self.name);
        for v in self.inputs.iter().chain(&self.outputs) {
            put(&format!("io {} {:?} {:?}", v.name, v.ty.dtype, v.ty.shape));
        }
        for i in &self.initializers {
            match &i.source {
                InitSource::Weight { tensor, transpose } => put(&format!(
                    "w {} {tensor} {transpose} {:?}",
                    i.name, i.ty.shape
                )),
                InitSource::F32(v) => {
                    put(&format!("f {} {:?}", i.name, i.ty.shape));
                    let b: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                    put(&format!("{:x}", Sha256::digest(&b)));
                }
                InitSource::I64(v) => put(&format!("i {} {:?} {v:?}", i.name, i.ty.shape)),
            }
        }
        for n in &self.nodes {
            put(&format!(
                "n {} {:?} {:?} {:?}",
                n.name, n.op, n.inputs, n.outputs
            ));
        }
        format!("{:x}", h.finalize())
    }

    pub fn is_initializer(&self, name: &str) -> bool {
        self.initializers.iter().any(|i| i.name == name)
    }

    pub fn ty(&self, name: &str) -> Option<&TensorType> {
        self.types.get(name)
    }
}

/// Builds a graph node by node with shape inference at every step, so a builder bug fails where it happens.
pub struct Builder {
    pub g: Graph,
    counter: HashMap<String, usize>,
}

impl Builder {
    pub fn new(name: &str) -> Self {
        Builder {
            g: Graph {
                name: name.into(),
                ..Default::default()
            },
            counter: HashMap::new(),
        }
    }

    fn fresh(&mut self, base: &str) -> String {
        let c = self.counter.entry(base.to_string()).or_default();
        *c += 1;
        if *c == 1 {
            base.to_string()
        } else {
            format!("{base}_{}", *c - 1)
        }
    }

    pub fn input(&mut self, name: &str, dtype: DType, shape: &[usize], doc: &str) -> String {
        let ty = TensorType::new(dtype, shape);
        self.g.types.insert(name.into(), ty.clone());
        self.g.inputs.push(ValueInfo {
            name: name.into(),
            ty,
            doc: doc.into(),
        });
        name.into()
    }

    pub fn output(&mut self, name: &str, doc: &str) {
        let ty = self.g.types[name].clone();
        self.g.outputs.push(ValueInfo {
            name: name.into(),
            ty,
            doc: doc.into(),
        });
    }

    pub fn weight(&mut self, tensor: &str, shape: &[usize], transpose: bool) -> String {
        let name = if transpose {
            format!("{tensor}.T")
        } else {
            tensor.to_string()
        };
        if self.g.types.contains_key(&name) {
            return name;
        }
        let s = if transpose {
            vec![shape[1], shape[0]]
        } else {
            shape.to_vec()
        };
        let ty = TensorType::new(DType::F32, &s);
        self.g.types.insert(name.clone(), ty.clone());
        self.g.initializers.push(Initializer {
            name: name.clone(),
            ty,
            source: InitSource::Weight {
                tensor: tensor.into(),
                transpose,
            },
        });
        name
    }

    pub fn const_f32(&mut self, name: &str, shape: &[usize], v: Vec<f32>) -> String {
        let name = self.fresh(name);
        let ty = TensorType::new(DType::F32, shape);
        self.g.types.insert(name.clone(), ty.clone());
        self.g.initializers.push(Initializer {
            name: name.clone(),
            ty,
            source: InitSource::F32(v),
        });
        name
    }

    pub fn const_i64(&mut self, name: &str, shape: &[usize], v: Vec<i64>) -> String {
        let name = self.fresh(name);
        let ty = TensorType::new(DType::I64, shape);
        self.g.types.insert(name.clone(), ty.clone());
        self.g.initializers.push(Initializer {
            name: name.clone(),
            ty,
            source: InitSource::I64(v),
        });
        name
    }

    /// Add a node; returns its output name (`out` made unique). Panics with the node name on a shape error:
    /// builders are code, a failure here is a bug in hexq, not in the user's input.
    pub fn node(&mut self, op: Op, inputs: &[&str], out: &str) -> String {
        let out = self.fresh(out);
        let ins: Vec<&TensorType> = inputs
            .iter()
            .map(|i| {
                self.g
                    .types
                    .get(*i)
                    .unwrap_or_else(|| panic!("node {out}: unknown input {i}"))
            })
            .collect();
        let t =
            infer(&op, &ins).unwrap_or_else(|e| panic!("graph {}: node {out}: {e}", self.g.name));
        self.g.types.insert(out.clone(), t);
        self.g.nodes.push(Node {
            name: out.clone(),
            op,
            inputs: inputs.iter().map(|s| s.to_string()).collect(),
            outputs: vec![out.clone()],
        });
        out
    }

    pub fn finish(self) -> Graph {
        self.g
    }
}
