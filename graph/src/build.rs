//! Lower a Gemma-4 config into the deployable graphs (the I/O contract is docs/io-contract.md).
//!
//! Only the config is read: weights enter as lazy initializers, so building the E2B graphs allocates no
//! weight memory. The vocab-sized tensors never enter a graph: the host looks up `inputs_embeds` and
//! `per_layer_inputs` and applies the tied lm_head + softcap to `hidden_states`.
//!
//! - `decode_wgqa`: one token; sliding layers keep a ring of `sliding_window` entries, full layers one of
//!   `context`; the write slot is `cache_position % len` in-graph (a Where select); masks in-graph with NEG;
//!   GQA by grouping query heads per KV head so MatMul broadcasts — no Expand, no KV copies.
//! - `decode_full`: the naive baseline: every buffer `context` long, KV expanded per query head.
//! - `trunk`: SEQ tokens (padded; `valid_len` says how many are real) after the same ring buffers; attends
//!   over past ring + the chunk, writes the chunk into the rings (Gather/Where, no duplicate-index scatter),
//!   so prompts longer than SEQ run as consecutive chunks.

use crate::ir::{Builder, DType, Graph, Op, NEG};
use hexq_model::config::{AttnKind, KvMode, LayerSpec, ModelConfig};
use hexq_model::names::{self, LayerTensor as LT};
use serde::Serialize;

/// The deployable variants: every command takes these names (dashes accepted for underscores).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum Variant {
    /// One token per call, ring-buffer KV, broadcast GQA (no Expand).
    #[cfg_attr(feature = "clap", value(name = "decode_wgqa", alias = "decode-wgqa"))]
    DecodeWgqa,
    /// decode_wgqa's graph with int8 KV encodings (a quantized build only).
    #[cfg_attr(
        feature = "clap",
        value(name = "decode_wgqa_int8kv", alias = "decode-wgqa-int8kv")
    )]
    DecodeWgqaInt8kv,
    /// The naive baseline: every buffer `context` long, KV expanded per query head.
    #[cfg_attr(feature = "clap", value(name = "decode_full", alias = "decode-full"))]
    DecodeFull,
    /// SEQ-token prefill chunks over the same KV buffers.
    #[cfg_attr(feature = "clap", value(name = "trunk"))]
    Trunk,
}

impl Variant {
    pub const ALL: [Variant; 4] = [
        Variant::DecodeWgqa,
        Variant::DecodeWgqaInt8kv,
        Variant::DecodeFull,
        Variant::Trunk,
    ];
    pub fn name(self) -> &'static str {
        match self {
            Variant::DecodeWgqa => "decode_wgqa",
            Variant::DecodeWgqaInt8kv => "decode_wgqa_int8kv",
            Variant::DecodeFull => "decode_full",
            Variant::Trunk => "trunk",
        }
    }
    /// A name as the CLI, stats, encodings and manifests write it (`decode-wgqa` too).
    pub fn parse(s: &str) -> Option<Self> {
        let s = s.replace('-', "_");
        Variant::ALL.into_iter().find(|v| v.name() == s)
    }
    /// The graph this variant runs: int8 KV is decode_wgqa's graph with other encodings.
    pub fn graph(self) -> Variant {
        match self {
            Variant::DecodeWgqaInt8kv => Variant::DecodeWgqa,
            v => v,
        }
    }
    pub fn int8_kv(self) -> bool {
        self == Variant::DecodeWgqaInt8kv
    }
    pub fn is_trunk(self) -> bool {
        self == Variant::Trunk
    }
    /// The decode graph a host loop pairs with this variant (a trunk prefills for decode_wgqa).
    pub fn decode(self) -> Variant {
        match self {
            Variant::Trunk => Variant::DecodeWgqa,
            v => v.graph(),
        }
    }
}

impl std::fmt::Display for Variant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, Clone, Copy, Serialize)]
pub struct GraphOptions {
    /// Length of the full-attention buffers (and the largest position the RoPE tables cover).
    pub context: usize,
    /// Tokens per trunk call.
    pub seq: usize,
}

impl Default for GraphOptions {
    fn default() -> Self {
        GraphOptions {
            context: 4096,
            seq: 128,
        }
    }
}

/// KV buffer length of an owning layer in a variant.
pub fn kv_len(cfg: &ModelConfig, l: &LayerSpec, v: Variant, o: &GraphOptions) -> usize {
    match (v, l.kind) {
        (Variant::DecodeFull, _) | (_, AttnKind::Full) => o.context,
        (_, AttnKind::Sliding) => cfg.sliding_window.min(o.context),
    }
}

pub fn past_key(i: usize) -> String {
    format!("past_key_{i}")
}
pub fn past_value(i: usize) -> String {
    format!("past_value_{i}")
}
pub fn present_key(i: usize) -> String {
    format!("present_key_{i}")
}
pub fn present_value(i: usize) -> String {
    format!("present_value_{i}")
}

/// Mask and ring-write tensors for one (buffer length, window) pair, shared by the layers that use it.
#[derive(Clone)]
struct Masks {
    /// decode: which buffer entry is this call's write slot, [1, 1, B, 1] bool.
    slot: Option<String>,
    /// decode: [B] additive mask over the buffer; trunk: [G*S, B+S] over past ring + chunk.
    mask: String,
    /// trunk: chunk index to gather for every ring slot [B], and whether the slot gets a new entry [B, 1].
    write_idx: Option<String>,
    write_has: Option<String>,
}

struct Ctx<'a> {
    b: Builder,
    cfg: &'a ModelConfig,
    v: Variant,
    s: usize,
    pos64: String,
    cache_pos: Option<String>,
    valid_len: Option<String>,
    neg: String,
    zero: String,
    masks: std::collections::BTreeMap<(usize, Option<usize>, usize), Masks>,
}

impl Ctx<'_> {
    fn f(&mut self, name: &str, x: f32) -> String {
        self.b.const_f32(name, &[1], vec![x])
    }
    fn i(&mut self, name: &str, x: i64) -> String {
        self.b.const_i64(name, &[1], vec![x])
    }
    fn n(&mut self, op: Op, ins: &[&str], out: &str) -> String {
        self.b.node(op, ins, out)
    }

    /// x @ W^T for a checkpoint weight W [out, in].
    fn linear(&mut self, x: &str, w: &str, out_dim: usize, in_dim: usize, out: &str) -> String {
        let wt = self.b.weight(w, &[out_dim, in_dim], true);
        self.n(Op::MatMul, &[x, &wt], out)
    }

    /// RMSNorm over the last axis: x · (mean(x²) + eps)^-½ [· w].
    fn rms_norm(&mut self, x: &str, w: Option<(&str, usize)>, p: &str) -> String {
        let sq = self.n(Op::Mul, &[x, x], &format!("{p}.sq"));
        let ms = self.n(
            Op::ReduceMean {
                axes: vec![-1],
                keepdims: true,
            },
            &[&sq],
            &format!("{p}.ms"),
        );
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
    fn gelu_tanh(&mut self, x: &str, p: &str) -> String {
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
    fn rope(&mut self, x: &str, cos: &str, sin: &str, d: usize, p: &str) -> String {
        let h = d as i64 / 2;
        let x1 = self.n(
            Op::Slice {
                starts: vec![0],
                ends: vec![h],
                axes: vec![-1],
            },
            &[x],
            &format!("{p}.x1"),
        );
        let x2 = self.n(
            Op::Slice {
                starts: vec![h],
                ends: vec![d as i64],
                axes: vec![-1],
            },
            &[x],
            &format!("{p}.x2"),
        );
        let nx2 = self.n(Op::Neg, &[&x2], &format!("{p}.neg_x2"));
        let rot = self.n(Op::Concat { axis: -1 }, &[&nx2, &x1], &format!("{p}.rot"));
        let a = self.n(Op::Mul, &[x, cos], &format!("{p}.xcos"));
        let b = self.n(Op::Mul, &[&rot, sin], &format!("{p}.rotsin"));
        self.n(Op::Add, &[&a, &b], &format!("{p}.out"))
    }
}

impl Ctx<'_> {
    /// Python's `a mod n` (result in [0, n)) for int64 tensors, from Div/Mul/Sub/Where: QNN's HTP backend
    /// fails to finalize integer `Mod` (measured with onnxruntime-qnn 2.7 / QNN 2.51), while these compile.
    fn imod(&mut self, a: &str, n: &str, name: &str) -> String {
        let q = self.n(Op::Div, &[a, n], &format!("{name}.div"));
        let qn = self.n(Op::Mul, &[&q, n], &format!("{name}.mul"));
        let r = self.n(Op::Sub, &[a, &qn], &format!("{name}.rem"));
        let z = self.i(&format!("{name}.zero"), 0);
        let neg = self.n(Op::Less, &[&r, &z], &format!("{name}.neg"));
        let rn = self.n(Op::Add, &[&r, n], &format!("{name}.wrapped"));
        self.n(Op::Where, &[&neg, &rn, &r], name)
    }

    /// Masks for a buffer of `len` entries read by layers with `window` (None = full attention), `g` query
    /// heads per KV head (trunk masks are tiled G times so they add to [G*S, T] scores without broadcasting
    /// a 5-D tensor).
    fn masks(&mut self, len: usize, window: Option<usize>, g: usize) -> Masks {
        let key = (len, window, if self.v == Variant::Trunk { g } else { 1 });
        if let Some(m) = self.masks.get(&key) {
            return m.clone();
        }
        let tag = match window {
            Some(w) => format!("b{len}_w{w}"),
            None => format!("b{len}"),
        };
        let iota = self.b.const_i64(
            &format!("mask.{tag}.slot_idx"),
            &[len],
            (0..len as i64).collect(),
        );
        let blen = self.i(&format!("mask.{tag}.len"), len as i64);
        let (neg, zero) = (self.neg.clone(), self.zero.clone());
        let m = if let Some(cp) = self.cache_pos.clone() {
            // decode: slot = cache_position % len. Slot i is valid iff written (i <= p); with a window shorter
            // than the buffer (decode_full's sliding layers) also i > p - W. Slot i == position i there.
            let p = self.n(
                Op::Cast { to: DType::I64 },
                &[&cp],
                &format!("mask.{tag}.p"),
            );
            let slot = self.imod(&p, &blen, &format!("kv.{tag}.slot"));
            // The ring write is a select, not a ScatterND: Where(entry == slot, new row, past) broadcasts the
            // row over the buffer. QNN's HTP backend fails to finalize ScatterND on int16 KV (measured with
            // onnxruntime-qnn 2.7 / QNN 2.51, issue 8), and Where is what the trunk's ring write uses already.
            let is_slot = self.n(Op::Equal, &[&iota, &slot], &format!("kv.{tag}.is_slot"));
            let slot = self.n(
                Op::Reshape {
                    shape: vec![1, 1, len as i64, 1],
                },
                &[&is_slot],
                &format!("kv.{tag}.is_slot4"),
            );
            let future = self.n(Op::Greater, &[&iota, &p], &format!("mask.{tag}.unwritten"));
            let mut mask = self.n(
                Op::Where,
                &[&future, &neg, &zero],
                &format!("mask.{tag}.causal"),
            );
            if let Some(w) = window.filter(|&w| w < len) {
                let w1 = self.i(&format!("mask.{tag}.w_minus_1"), w as i64 - 1);
                let lo = self.n(Op::Sub, &[&p, &w1], &format!("mask.{tag}.lo"));
                let old = self.n(
                    Op::Less,
                    &[&iota, &lo],
                    &format!("mask.{tag}.outside_window"),
                );
                mask = self.n(
                    Op::Where,
                    &[&old, &neg, &mask],
                    &format!("mask.{tag}.window"),
                );
            }
            Masks {
                slot: Some(slot),
                mask,
                write_idx: None,
                write_has: None,
            }
        } else {
            let s = self.s as i64;
            let vl = self.n(
                Op::Cast { to: DType::I64 },
                &[&self.valid_len.clone().unwrap()],
                &format!("mask.{tag}.valid_len"),
            );
            let pos64 = self.pos64.clone();
            let p0 = self.n(
                Op::Slice {
                    starts: vec![0],
                    ends: vec![1],
                    axes: vec![1],
                },
                &[&pos64],
                &format!("mask.{tag}.p0"),
            );
            let p0 = self.n(
                Op::Reshape { shape: vec![1] },
                &[&p0],
                &format!("mask.{tag}.p0_flat"),
            );
            let one = self.i(&format!("mask.{tag}.one"), 1);
            let zero_i = self.i(&format!("mask.{tag}.zero_i"), 0);
            // Past slot i holds position prev - ((prev - i) mod len), prev = p0 - 1; negative = never written.
            let prev = self.n(Op::Sub, &[&p0, &one], &format!("mask.{tag}.prev"));
            let d = self.n(
                Op::Sub,
                &[&prev, &iota],
                &format!("mask.{tag}.prev_minus_slot"),
            );
            let age = self.imod(&d, &blen, &format!("mask.{tag}.past_age"));
            let ppos = self.n(Op::Sub, &[&prev, &age], &format!("mask.{tag}.past_pos"));
            let pinv = self.n(
                Op::Less,
                &[&ppos, &zero_i],
                &format!("mask.{tag}.past_unwritten"),
            );
            // Chunk key j: position p0 + j, invalid past valid_len.
            let cpos = self.n(
                Op::Reshape { shape: vec![s] },
                &[&pos64],
                &format!("mask.{tag}.chunk_pos"),
            );
            let cidx = self.b.const_i64(
                &format!("mask.{tag}.chunk_idx"),
                &[self.s],
                (0..s).collect(),
            );
            let vl1 = self.n(Op::Sub, &[&vl, &one], &format!("mask.{tag}.last_idx"));
            let cinv = self.n(
                Op::Greater,
                &[&cidx, &vl1],
                &format!("mask.{tag}.chunk_padding"),
            );
            let kpos = self.n(
                Op::Concat { axis: 0 },
                &[&ppos, &cpos],
                &format!("mask.{tag}.key_pos"),
            ); // [T]
            let kinv = self.n(
                Op::Concat { axis: 0 },
                &[&pinv, &cinv],
                &format!("mask.{tag}.key_invalid"),
            );
            let q = self.n(
                Op::Reshape { shape: vec![s, 1] },
                &[&pos64],
                &format!("mask.{tag}.query_pos"),
            ); // [S,1]
            let fut = self.n(Op::Greater, &[&kpos, &q], &format!("mask.{tag}.future")); // [S,T]
            let mut mask = self.n(
                Op::Where,
                &[&fut, &neg, &zero],
                &format!("mask.{tag}.causal"),
            );
            if let Some(w) = window {
                let w1 = self.i(&format!("mask.{tag}.w_minus_1"), w as i64 - 1);
                let lo = self.n(Op::Sub, &[&q, &w1], &format!("mask.{tag}.lo"));
                let old = self.n(
                    Op::Less,
                    &[&kpos, &lo],
                    &format!("mask.{tag}.outside_window"),
                );
                mask = self.n(
                    Op::Where,
                    &[&old, &neg, &mask],
                    &format!("mask.{tag}.window"),
                );
            }
            mask = self.n(
                Op::Where,
                &[&kinv, &neg, &mask],
                &format!("mask.{tag}.valid"),
            );
            if key.2 > 1 {
                let reps: Vec<&str> = std::iter::repeat_n(mask.as_str(), key.2).collect();
                let reps: Vec<String> = reps.iter().map(|x| x.to_string()).collect();
                let refs: Vec<&str> = reps.iter().map(|x| x.as_str()).collect();
                mask = self.n(
                    Op::Concat { axis: 0 },
                    &refs,
                    &format!("mask.{tag}.g{}", key.2),
                );
            }
            // Ring write: slot i takes the newest chunk position ≡ i (mod len), if any:
            // last = p0 + valid_len - 1; pos = last - ((last - i) mod len); j = pos - p0; new iff j >= 0.
            let last = self.n(Op::Add, &[&p0, &vl1], &format!("kv.{tag}.last_pos"));
            let d2 = self.n(
                Op::Sub,
                &[&last, &iota],
                &format!("kv.{tag}.last_minus_slot"),
            );
            let age2 = self.imod(&d2, &blen, &format!("kv.{tag}.age"));
            let npos = self.n(Op::Sub, &[&last, &age2], &format!("kv.{tag}.new_pos"));
            let j = self.n(Op::Sub, &[&npos, &p0], &format!("kv.{tag}.chunk_j"));
            let has = self.n(Op::Less, &[&j, &zero_i], &format!("kv.{tag}.keeps_past"));
            let jc = self.n(
                Op::Where,
                &[&has, &zero_i, &j],
                &format!("kv.{tag}.gather_idx"),
            );
            let has2 = self.n(
                Op::Reshape {
                    shape: vec![len as i64, 1],
                },
                &[&has],
                &format!("kv.{tag}.keeps_past_col"),
            );
            Masks {
                slot: None,
                mask,
                write_idx: Some(jc),
                write_has: Some(has2),
            }
        };
        self.masks.insert(key, m.clone());
        m
    }
}

/// Build one variant for a config.
pub fn build(cfg: &ModelConfig, v: Variant, o: &GraphOptions) -> Graph {
    let v = v.graph();
    let s = if v == Variant::Trunk { o.seq } else { 1 };
    let mut b = Builder::new(v.name());
    let (hsz, l_n, p_dim, hq) = (cfg.hidden_size, cfg.num_layers, cfg.ple_dim, cfg.num_heads);

    // ---- inputs (the I/O contract)
    let h0 = b.input(
        "inputs_embeds",
        DType::F32,
        &[1, s, hsz],
        "token embedding rows × sqrt(hidden_size), looked up on the host",
    );
    let ple_tok = (p_dim > 0).then(|| {
        b.input(
            "per_layer_inputs",
            DType::F32,
            &[1, s, l_n, p_dim],
            "per-layer token embedding rows × sqrt(P) as [.., layer, P], looked up on the host",
        )
    });
    let pos_ids = b.input(
        "position_ids",
        DType::I32,
        &[1, s],
        "absolute position of each token (RoPE)",
    );
    let (cache_pos, valid_len) = if v == Variant::Trunk {
        (None, Some(b.input("valid_len", DType::I32, &[1], "number of real tokens in this chunk (1..=SEQ); the rest is padding whose outputs are ignored")))
    } else {
        (Some(b.input("cache_position", DType::I32, &[1], "position being written (= position_ids); the ring slot cache_position % buffer length is computed in-graph")), None)
    };
    let owners: Vec<LayerSpec> = cfg
        .layers
        .iter()
        .filter(|l| l.kv_mode != KvMode::Reuse)
        .cloned()
        .collect();
    for l in &owners {
        let len = kv_len(cfg, l, v, o);
        let shape = [1, l.num_kv_heads, len, l.head_dim];
        let kind = if l.kind == AttnKind::Sliding {
            "sliding"
        } else {
            "full"
        };
        b.input(&past_key(l.index), DType::F32, &shape, &format!("layer {} ({kind}) keys after k_norm + RoPE, ring of {len} entries; zeros before the first token", l.index));
        b.input(
            &past_value(l.index),
            DType::F32,
            &shape,
            &format!(
                "layer {} ({kind}) values after v_norm, ring of {len} entries",
                l.index
            ),
        );
    }
    let pos64 = b.node(Op::Cast { to: DType::I64 }, &[&pos_ids], "pos.i64");
    let neg = b.const_f32("mask.neg", &[1], vec![NEG]);
    let zero = b.const_f32("mask.zero", &[1], vec![0.0]);
    let mut c = Ctx {
        b,
        cfg,
        v,
        s,
        pos64,
        cache_pos,
        valid_len,
        neg,
        zero,
        masks: Default::default(),
    };

    // ---- RoPE: cos/sin tables over [0, context), gathered by position_ids.
    let mut rope = std::collections::BTreeMap::new();
    for (kind_name, r) in &cfg.rope {
        let inv = r.inv_freq();
        let d = r.head_dim;
        let (mut ct, mut st) = (
            Vec::with_capacity(o.context * d),
            Vec::with_capacity(o.context * d),
        );
        for p in 0..o.context {
            for _ in 0..2 {
                for &f in &inv {
                    let a = p as f32 * f;
                    ct.push(a.cos());
                    st.push(a.sin());
                }
            }
        }
        let tag = if kind_name == "sliding_attention" {
            "sliding"
        } else {
            "full"
        };
        let ctab =
            c.b.const_f32(&format!("rope.{tag}.cos_table"), &[o.context, d], ct);
        let stab =
            c.b.const_f32(&format!("rope.{tag}.sin_table"), &[o.context, d], st);
        let cg = c.n(
            Op::Gather { axis: 0 },
            &[&ctab, &pos_ids],
            &format!("rope.{tag}.cos_rows"),
        );
        let sg = c.n(
            Op::Gather { axis: 0 },
            &[&stab, &pos_ids],
            &format!("rope.{tag}.sin_rows"),
        );
        let cr = c.n(
            Op::Reshape {
                shape: vec![1, 1, s as i64, d as i64],
            },
            &[&cg],
            &format!("rope.{tag}.cos"),
        );
        let sr = c.n(
            Op::Reshape {
                shape: vec![1, 1, s as i64, d as i64],
            },
            &[&sg],
            &format!("rope.{tag}.sin"),
        );
        rope.insert(
            if tag == "sliding" {
                AttnKind::Sliding
            } else {
                AttnKind::Full
            },
            (cr, sr),
        );
    }

    // ---- per-layer inputs: context projection of the scaled embedding, normed, combined with the lookup.
    let ple = ple_tok.map(|tok| {
        let pr = c.linear(&h0, names::PLE_PROJ, l_n * p_dim, hsz, "ple.proj");
        let sc = c.f("ple.proj_scale", (hsz as f32).powf(-0.5));
        let pr = c.n(Op::Mul, &[&pr, &sc], "ple.proj_scaled");
        let pr = c.n(
            Op::Reshape {
                shape: vec![1, s as i64, l_n as i64, p_dim as i64],
            },
            &[&pr],
            "ple.proj_4d",
        );
        let pr = c.rms_norm(&pr, Some((names::PLE_PROJ_NORM, p_dim)), "ple.proj_norm");
        let sum = c.n(Op::Add, &[&pr, &tok], "ple.sum");
        let sc2 = c.f("ple.combine_scale", 0.5f32.sqrt());
        c.n(Op::Mul, &[&sum, &sc2], "ple.inputs")
    });

    // ---- decoder layers
    let mut h = h0.clone();
    let mut kv: std::collections::BTreeMap<usize, (String, String)> = Default::default(); // owner -> (K, V) attended over
    for l in &cfg.layers {
        let i = l.index;
        let p = format!("layers.{i}");
        let d = l.head_dim;
        let src = &cfg.layers[l.kv_source];
        let hkv = src.num_kv_heads;
        let g = hq / hkv;
        let (cos, sin) = rope[&l.kind].clone();
        let x = c.rms_norm(
            &h,
            Some((&LT::InputNorm.name(i), hsz)),
            &LT::InputNorm.module(i),
        );
        // Queries grouped per KV head: [1, Hq, S, d] viewed as [1, Hkv, G*S, d].
        let q = c.linear(&x, &LT::Q.name(i), hq * d, hsz, &LT::Q.module(i));
        let q = c.n(
            Op::Reshape {
                shape: vec![1, s as i64, hq as i64, d as i64],
            },
            &[&q],
            &format!("{p}.self_attn.q_heads"),
        );
        let q = c.rms_norm(&q, Some((&LT::QNorm.name(i), d)), &LT::QNorm.module(i));
        let q = c.n(
            Op::Transpose {
                perm: vec![0, 2, 1, 3],
            },
            &[&q],
            &format!("{p}.self_attn.q_t"),
        );
        let q = c.rope(&q, &cos, &sin, d, &format!("{p}.self_attn.q_rope"));
        if l.kv_mode != KvMode::Reuse {
            let k = c.linear(&x, &LT::K.name(i), hkv * d, hsz, &LT::K.module(i));
            let k = c.n(
                Op::Reshape {
                    shape: vec![1, s as i64, hkv as i64, d as i64],
                },
                &[&k],
                &format!("{p}.self_attn.k_heads"),
            );
            let vraw = if l.k_eq_v {
                k.clone()
            } else {
                let vv = c.linear(&x, &LT::V.name(i), hkv * d, hsz, &LT::V.module(i));
                c.n(
                    Op::Reshape {
                        shape: vec![1, s as i64, hkv as i64, d as i64],
                    },
                    &[&vv],
                    &format!("{p}.self_attn.v_heads"),
                )
            };
            let k = c.rms_norm(&k, Some((&LT::KNorm.name(i), d)), &LT::KNorm.module(i));
            let k = c.n(
                Op::Transpose {
                    perm: vec![0, 2, 1, 3],
                },
                &[&k],
                &format!("{p}.self_attn.k_t"),
            );
            let k = c.rope(&k, &cos, &sin, d, &format!("{p}.self_attn.k_rope"));
            let vv = c.rms_norm(&vraw, None, &format!("{p}.self_attn.v_norm"));
            let vv = c.n(
                Op::Transpose {
                    perm: vec![0, 2, 1, 3],
                },
                &[&vv],
                &format!("{p}.self_attn.v_t"),
            );
            let len = kv_len(cfg, l, v, o);
            let window = if l.kind == AttnKind::Sliding {
                Some(cfg.sliding_window)
            } else {
                None
            };
            let m = c.masks(len, window, g);
            let (pk, pv) = (past_key(i), past_value(i));
            let (att_k, att_v, pres_k, pres_v) = if v == Variant::Trunk {
                // Attend over [past ring, chunk]; write the chunk into the ring.
                let ak = c.n(
                    Op::Concat { axis: 2 },
                    &[&pk, &k],
                    &format!("{p}.self_attn.keys"),
                );
                let av = c.n(
                    Op::Concat { axis: 2 },
                    &[&pv, &vv],
                    &format!("{p}.self_attn.values"),
                );
                let (wi, wh) = (m.write_idx.clone().unwrap(), m.write_has.clone().unwrap());
                let gk = c.n(
                    Op::Gather { axis: 2 },
                    &[&k, &wi],
                    &format!("{p}.kv.k_ring_rows"),
                );
                let gv = c.n(
                    Op::Gather { axis: 2 },
                    &[&vv, &wi],
                    &format!("{p}.kv.v_ring_rows"),
                );
                let nk = c.n(Op::Where, &[&wh, &pk, &gk], &present_key(i));
                let nv = c.n(Op::Where, &[&wh, &pv, &gv], &present_value(i));
                (ak, av, nk, nv)
            } else {
                // Write the new row at the slot for every KV head: a select over the buffer.
                let slot = m.slot.clone().unwrap();
                let nk = c.n(Op::Where, &[&slot, &k, &pk], &present_key(i));
                let nv = c.n(Op::Where, &[&slot, &vv, &pv], &present_value(i));
                (nk.clone(), nv.clone(), nk, nv)
            };
            c.b.output(
                &pres_k,
                &format!("updated keys of layer {i} (feed back as {pk})"),
            );
            c.b.output(
                &pres_v,
                &format!("updated values of layer {i} (feed back as {pv})"),
            );
            kv.insert(i, (att_k, att_v));
        }
        let (ak, av) = kv[&l.kv_source].clone();
        let len = kv_len(cfg, src, v, o);
        let window = if l.kind == AttnKind::Sliding {
            Some(cfg.sliding_window)
        } else {
            None
        };
        let m = c.masks(len, window, g);
        let kt = c.n(
            Op::Transpose {
                perm: vec![0, 1, 3, 2],
            },
            &[&ak],
            &format!("{p}.self_attn.keys_t"),
        );
        let scores = if v == Variant::DecodeFull && g > 1 {
            // Naive: repeat KV per query head (Expand), queries one head each.
            let t = c.b.g.types[&kt].shape[3];
            let ku = c.n(
                Op::Unsqueeze { axes: vec![2] },
                &[&kt],
                &format!("{p}.self_attn.keys_u"),
            );
            let ke = c.n(
                Op::Expand {
                    shape: vec![1, hkv as i64, g as i64, d as i64, t as i64],
                },
                &[&ku],
                &format!("{p}.self_attn.keys_rep"),
            );
            let ke = c.n(
                Op::Reshape {
                    shape: vec![1, hq as i64, d as i64, t as i64],
                },
                &[&ke],
                &format!("{p}.self_attn.keys_heads"),
            );
            let qh = c.n(
                Op::Reshape {
                    shape: vec![1, hq as i64, s as i64, d as i64],
                },
                &[&q],
                &format!("{p}.self_attn.q_heads_full"),
            );
            c.n(Op::MatMul, &[&qh, &ke], &format!("{p}.self_attn.scores"))
        } else {
            let qg = c.n(
                Op::Reshape {
                    shape: vec![1, hkv as i64, (g * s) as i64, d as i64],
                },
                &[&q],
                &format!("{p}.self_attn.q_grouped"),
            );
            c.n(Op::MatMul, &[&qg, &kt], &format!("{p}.self_attn.scores"))
        };
        let sm = c.n(
            Op::Add,
            &[&scores, &m.mask],
            &format!("{p}.self_attn.scores_masked"),
        );
        let pr = c.n(
            Op::Softmax { axis: -1 },
            &[&sm],
            &format!("{p}.self_attn.probs"),
        );
        let a = if v == Variant::DecodeFull && g > 1 {
            let t = c.b.g.types[&av].shape[2];
            let vu = c.n(
                Op::Unsqueeze { axes: vec![2] },
                &[&av],
                &format!("{p}.self_attn.values_u"),
            );
            let ve = c.n(
                Op::Expand {
                    shape: vec![1, hkv as i64, g as i64, t as i64, d as i64],
                },
                &[&vu],
                &format!("{p}.self_attn.values_rep"),
            );
            let ve = c.n(
                Op::Reshape {
                    shape: vec![1, hq as i64, t as i64, d as i64],
                },
                &[&ve],
                &format!("{p}.self_attn.values_heads"),
            );
            c.n(Op::MatMul, &[&pr, &ve], &format!("{p}.self_attn.attn"))
        } else {
            c.n(Op::MatMul, &[&pr, &av], &format!("{p}.self_attn.attn"))
        };
        let a = c.n(
            Op::Reshape {
                shape: vec![1, hq as i64, s as i64, d as i64],
            },
            &[&a],
            &format!("{p}.self_attn.attn_heads"),
        );
        let a = c.n(
            Op::Transpose {
                perm: vec![0, 2, 1, 3],
            },
            &[&a],
            &format!("{p}.self_attn.attn_t"),
        );
        let a = c.n(
            Op::Reshape {
                shape: vec![1, s as i64, (hq * d) as i64],
            },
            &[&a],
            &format!("{p}.self_attn.attn_flat"),
        );
        let a = c.linear(&a, &LT::O.name(i), hsz, hq * d, &LT::O.module(i));
        let a = c.rms_norm(
            &a,
            Some((&LT::PostAttnNorm.name(i), hsz)),
            &LT::PostAttnNorm.module(i),
        );
        h = c.n(Op::Add, &[&h, &a], &format!("{p}.attn_residual"));
        // MLP
        let x = c.rms_norm(
            &h,
            Some((&LT::PreFfnNorm.name(i), hsz)),
            &LT::PreFfnNorm.module(i),
        );
        let gt = c.linear(&x, &LT::Gate.name(i), l.mlp_width, hsz, &LT::Gate.module(i));
        let gt = c.gelu_tanh(&gt, &format!("{p}.mlp.act"));
        let up = c.linear(&x, &LT::Up.name(i), l.mlp_width, hsz, &LT::Up.module(i));
        let gu = c.n(Op::Mul, &[&gt, &up], &format!("{p}.mlp.gated"));
        let dn = c.linear(
            &gu,
            &LT::Down.name(i),
            hsz,
            l.mlp_width,
            &LT::Down.module(i),
        );
        let dn = c.rms_norm(
            &dn,
            Some((&LT::PostFfnNorm.name(i), hsz)),
            &LT::PostFfnNorm.module(i),
        );
        h = c.n(Op::Add, &[&h, &dn], &format!("{p}.mlp_residual"));
        // Per-layer input
        if let Some(ple) = &ple {
            let pi = c.n(
                Op::Slice {
                    starts: vec![i as i64],
                    ends: vec![i as i64 + 1],
                    axes: vec![2],
                },
                &[ple],
                &format!("{p}.per_layer_input_4d"),
            );
            let pi = c.n(
                Op::Reshape {
                    shape: vec![1, s as i64, p_dim as i64],
                },
                &[&pi],
                &format!("{p}.per_layer_input"),
            );
            let gg = c.linear(&h, &LT::PleGate.name(i), p_dim, hsz, &LT::PleGate.module(i));
            let gg = c.gelu_tanh(&gg, &format!("{p}.per_layer_act"));
            let gg = c.n(Op::Mul, &[&gg, &pi], &format!("{p}.per_layer_gated"));
            let pp = c.linear(
                &gg,
                &LT::PleProj.name(i),
                hsz,
                p_dim,
                &LT::PleProj.module(i),
            );
            let pp = c.rms_norm(
                &pp,
                Some((&LT::PlePostNorm.name(i), hsz)),
                &LT::PlePostNorm.module(i),
            );
            h = c.n(Op::Add, &[&h, &pp], &format!("{p}.per_layer_residual"));
        }
        let sc = c.b.weight(&LT::Scalar.name(i), &[1], false);
        h = c.n(Op::Mul, &[&h, &sc], &format!("{p}.out"));
    }
    let hn = c.rms_norm(&h, Some((names::FINAL_NORM, hsz)), "norm");
    let out = c.n(
        Op::Reshape {
            shape: vec![1, s as i64, hsz as i64],
        },
        &[&hn],
        "hidden_states",
    );
    c.b.output(
        &out,
        "final hidden state after the final norm, before the host's tied lm_head + softcap",
    );
    // Outputs: hidden first, then presents in layer order.
    let mut g = c.b.finish();
    let hid = g.outputs.pop().unwrap();
    g.outputs.insert(0, hid);
    g
}
