//! The builder's state while lowering one variant, and the primitives every block is made of (linear,
//! RMSNorm, gelu-tanh, RoPE, integer mod), each spelled in ops QNN HTP runs.

use super::masks::Masks;
use super::{GraphOptions, Variant};
use crate::ir::{Builder, Op};
use hexq_model::config::{AttnKind, ModelConfig};
use std::collections::BTreeMap;

pub(super) struct Ctx<'a> {
    pub b: Builder,
    pub cfg: &'a ModelConfig,
    pub o: &'a GraphOptions,
    pub v: Variant,
    /// Tokens per call (SEQ for the trunk, 1 for decode).
    pub s: usize,
    pub pos64: String,
    pub cache_pos: Option<String>,
    pub valid_len: Option<String>,
    pub neg: String,
    pub zero: String,
    /// Masks per (buffer length, window, tiling), shared by the layers that use them.
    pub masks: BTreeMap<(usize, Option<usize>, usize), Masks>,
    /// (cos, sin) rows for this call's positions, per attention kind.
    pub rope: BTreeMap<AttnKind, (String, String)>,
    /// The combined per-layer inputs [1, S, L, P], when the model has them.
    pub ple: Option<String>,
    /// KV-owning layer → the (keys, values) its readers attend over.
    pub kv: BTreeMap<usize, (String, String)>,
}

impl Ctx<'_> {
    pub fn f(&mut self, name: &str, x: f32) -> String {
        self.b.const_f32(name, &[1], vec![x])
    }
    pub fn i(&mut self, name: &str, x: i64) -> String {
        self.b.const_i64(name, &[1], vec![x])
    }
    pub fn n(&mut self, op: Op, ins: &[&str], out: &str) -> String {
        self.b.node(op, ins, out)
    }
    pub fn reshape(&mut self, x: &str, shape: &[i64], out: &str) -> String {
        let shape = shape.to_vec();
        self.n(Op::Reshape { shape }, &[x], out)
    }
    pub fn transpose(&mut self, x: &str, perm: &[usize], out: &str) -> String {
        let perm = perm.to_vec();
        self.n(Op::Transpose { perm }, &[x], out)
    }
    pub fn slice(&mut self, x: &str, start: i64, end: i64, axis: i64, out: &str) -> String {
        let op = Op::Slice {
            starts: vec![start],
            ends: vec![end],
            axes: vec![axis],
        };
        self.n(op, &[x], out)
    }

    /// x @ W^T for a checkpoint weight W [out, in].
    pub fn linear(&mut self, x: &str, w: &str, out_dim: usize, in_dim: usize, out: &str) -> String {
        let wt = self.b.weight(w, &[out_dim, in_dim], true);
        self.n(Op::MatMul, &[x, &wt], out)
    }

    /// RMSNorm over the last axis: x · (mean(x²) + eps)^-½ [· w].
    pub fn rms_norm(&mut self, x: &str, w: Option<(&str, usize)>, p: &str) -> String {
        let sq = self.n(Op::Mul, &[x, x], &format!("{p}.sq"));
        let mean = Op::ReduceMean {
            axes: vec![-1],
            keepdims: true,
        };
        let ms = self.n(mean, &[&sq], &format!("{p}.ms"));
        let eps = self.f(&format!("{p}.eps"), self.cfg.rms_norm_eps as f32);
        let a = self.n(Op::Add, &[&ms, &eps], &format!("{p}.ms_eps"));
        let r = self.n(Op::Sqrt, &[&a], &format!("{p}.rms"));
        // 1/rms as Div(1, rms): QNN HTP's 16-bit Reciprocal returns max(rms)/rms (off by the input's range;
        // measured on the simulator, compile-scripts/README.md), its Div is exact to a step.
        let one = self.f(&format!("{p}.one"), 1.0);
        let inv = self.n(Op::Div, &[&one, &r], &format!("{p}.inv_rms"));
        let y = self.n(Op::Mul, &[x, &inv], &format!("{p}.normed"));
        match w {
            Some((wn, d)) => {
                let wi = self.b.weight(wn, &[d], false);
                self.n(Op::Mul, &[&y, &wi], &format!("{p}.out"))
            }
            None => y,
        }
    }

    /// gelu with the tanh approximation, from primitives every backend has:
    /// 0.5·x·(1 + tanh(u)) = x·sigmoid(2u), u = √(2/π)·(x + 0.044715·x³). The sigmoid form: fewer ops, and
    /// QNN HTP's 16-bit Tanh inside the trunk's chain returned wrong rows on the simulator (compile-scripts/README.md).
    pub fn gelu_tanh(&mut self, x: &str, p: &str) -> String {
        let x2 = self.n(Op::Mul, &[x, x], &format!("{p}.x2"));
        let x3 = self.n(Op::Mul, &[&x2, x], &format!("{p}.x3"));
        let c1 = self.f(&format!("{p}.c044715"), 0.044715);
        let t = self.n(Op::Mul, &[&x3, &c1], &format!("{p}.cx3"));
        let u = self.n(Op::Add, &[x, &t], &format!("{p}.u"));
        let c2 = self.f(
            &format!("{p}.two_sqrt_2_over_pi"),
            (2.0 * (2.0f64 / std::f64::consts::PI).sqrt()) as f32,
        );
        let u2 = self.n(Op::Mul, &[&u, &c2], &format!("{p}.inner2"));
        let sg = self.n(Op::Sigmoid, &[&u2], &format!("{p}.sigmoid"));
        self.n(Op::Mul, &[x, &sg], &format!("{p}.out"))
    }

    /// x·cos + rotate_half(x)·sin, x [1, heads, S, d], cos/sin [1, 1, S, d].
    pub fn rope(&mut self, x: &str, cos: &str, sin: &str, d: usize, p: &str) -> String {
        let h = d as i64 / 2;
        let x1 = self.slice(x, 0, h, -1, &format!("{p}.x1"));
        let x2 = self.slice(x, h, d as i64, -1, &format!("{p}.x2"));
        let nx2 = self.n(Op::Neg, &[&x2], &format!("{p}.neg_x2"));
        let rot = self.n(Op::Concat { axis: -1 }, &[&nx2, &x1], &format!("{p}.rot"));
        let a = self.n(Op::Mul, &[x, cos], &format!("{p}.xcos"));
        let b = self.n(Op::Mul, &[&rot, sin], &format!("{p}.rotsin"));
        self.n(Op::Add, &[&a, &b], &format!("{p}.out"))
    }

    /// Python's `a mod n` (result in [0, n)) for int64 tensors, from Div/Mul/Sub/Where: QNN's HTP backend
    /// fails to finalize integer `Mod` (measured with onnxruntime-qnn 2.7 / QNN 2.51), while these compile.
    pub fn imod(&mut self, a: &str, n: &str, name: &str) -> String {
        let q = self.n(Op::Div, &[a, n], &format!("{name}.div"));
        let qn = self.n(Op::Mul, &[&q, n], &format!("{name}.mul"));
        let r = self.n(Op::Sub, &[a, &qn], &format!("{name}.rem"));
        let z = self.i(&format!("{name}.zero"), 0);
        let neg = self.n(Op::Less, &[&r, &z], &format!("{name}.neg"));
        let rn = self.n(Op::Add, &[&r, n], &format!("{name}.wrapped"));
        self.n(Op::Where, &[&neg, &rn, &r], name)
    }
}
