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

mod ctx;
mod layer;
mod masks;

use crate::ir::{Builder, DType, Graph, Op, NEG};
use ctx::Ctx;
use hexq_model::config::{AttnKind, KvMode, LayerSpec, ModelConfig};
use hexq_model::names;
use serde::Serialize;
use std::collections::HashMap;

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

/// A shorter-ring stand-in for a decode graph (see [`spanning`]).
pub struct Span {
    pub options: GraphOptions,
    /// The tensors whose name carries the buffer length (e.g. `mask.b80.causal`) or whose size depends on
    /// it: name here → (the full graph's name, elements there, elements here).
    pub tensors: HashMap<String, (String, usize, usize)>,
}

/// For decode runs that write at most `positions` positions (0 .. positions − 1): the shortest context
/// (rounded up to 16) whose graph computes the same value *sets* as `o`'s on those runs, with the renaming
/// back to `o`'s tensor names — None when no shorter one does. Why this is exact: a ring slot never written
/// holds zeros and is masked, so its key, score (q·0 + NEG), probability (exactly 0) and value are the same
/// in every such slot; each ring keeps at least one (`positions` < its length), rings that would wrap keep
/// their length, and the graphs must match node for node (ops, wiring up to the renaming; e.g.
/// `decode_full` grows window masks only past the window). So every tensor's min/max is unchanged, and every
/// output is the same up to adding exact zeros (`tests/quant.rs` holds the stats byte-identical). The ring
/// write, attention and KV observers then cost `positions` instead of `context` per step.
pub fn spanning(cfg: &ModelConfig, v: Variant, o: &GraphOptions, positions: usize) -> Option<Span> {
    let need = (positions + 1).div_ceil(16) * 16;
    let w = cfg.sliding_window.min(o.context);
    let mut full: Option<Graph> = None;
    for c in [need, need.max(w)] {
        if c >= o.context {
            break;
        }
        let s = GraphOptions { context: c, ..*o };
        // Every ring keeps a never-written slot, or its length.
        if !cfg.layers.iter().all(|l| {
            let (a, b) = (kv_len(cfg, l, v, o), kv_len(cfg, l, v, &s));
            a == b || b > positions
        }) {
            continue;
        }
        let f = full.get_or_insert_with(|| build(cfg, v, o));
        let g = build(cfg, v, &s);
        if let Some(m) = renaming(&g, f) {
            let n = |g: &Graph, t: &str| g.types.get(t).map_or(0, |t| t.shape.iter().product());
            let tensors = m
                .into_iter()
                .map(|(x, y)| {
                    let (a, b) = (n(f, &y), n(&g, &x));
                    (x, (y, a, b))
                })
                .filter(|(x, (y, a, b))| x != y || a != b)
                .collect();
            return Some(Span {
                options: s,
                tensors,
            });
        }
    }
    None
}

/// `a`'s names → `b`'s, when the two graphs match node for node up to that renaming.
fn renaming(a: &Graph, b: &Graph) -> Option<HashMap<String, String>> {
    let (ai, bi) = (&a.initializers, &b.initializers);
    if a.inputs.len() != b.inputs.len() || ai.len() != bi.len() || a.nodes.len() != b.nodes.len() {
        return None;
    }
    let mut m: HashMap<String, String> = HashMap::new();
    for (x, y) in a.inputs.iter().zip(&b.inputs) {
        if x.name != y.name {
            return None;
        }
        m.insert(x.name.clone(), y.name.clone());
    }
    for (x, y) in ai.iter().zip(bi) {
        m.insert(x.name.clone(), y.name.clone());
    }
    for (x, y) in a.nodes.iter().zip(&b.nodes) {
        let wired = std::mem::discriminant(&x.op) == std::mem::discriminant(&y.op)
            && x.inputs.len() == y.inputs.len()
            && x.outputs.len() == y.outputs.len()
            && x.inputs
                .iter()
                .zip(&y.inputs)
                .all(|(p, q)| m.get(p) == Some(q));
        if !wired {
            return None;
        }
        for (p, q) in x.outputs.iter().zip(&y.outputs) {
            if m.insert(p.clone(), q.clone()).is_some() {
                return None;
            }
        }
    }
    Some(m)
}

/// Build one variant for a config.
pub fn build(cfg: &ModelConfig, v: Variant, o: &GraphOptions) -> Graph {
    let v = v.graph();
    let mut c = inputs(cfg, v, o);
    rope_tables(&mut c);
    let h0 = "inputs_embeds".to_string();
    c.ple =
        c.b.g
            .types
            .contains_key("per_layer_inputs")
            .then(|| ple_inputs(&mut c, &h0));
    let mut h = h0;
    for l in &cfg.layers {
        h = layer::layer(&mut c, l, &h);
    }
    let hsz = cfg.hidden_size;
    let hn = c.rms_norm(&h, Some((names::FINAL_NORM, hsz)), "norm");
    let out = c.reshape(&hn, &[1, c.s as i64, hsz as i64], "hidden_states");
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

/// The graph inputs (the I/O contract) and the builder state around them.
fn inputs<'a>(cfg: &'a ModelConfig, v: Variant, o: &'a GraphOptions) -> Ctx<'a> {
    let s = if v == Variant::Trunk { o.seq } else { 1 };
    let mut b = Builder::new(v.name());
    let (hsz, l_n, p_dim) = (cfg.hidden_size, cfg.num_layers, cfg.ple_dim);
    b.input(
        "inputs_embeds",
        DType::F32,
        &[1, s, hsz],
        "token embedding rows × sqrt(hidden_size), looked up on the host",
    );
    if p_dim > 0 {
        b.input(
            "per_layer_inputs",
            DType::F32,
            &[1, s, l_n, p_dim],
            "per-layer token embedding rows × sqrt(P) as [.., layer, P], looked up on the host",
        );
    }
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
    for l in cfg.layers.iter().filter(|l| l.kv_mode != KvMode::Reuse) {
        let len = kv_len(cfg, l, v, o);
        let shape = [1, l.num_kv_heads, len, l.head_dim];
        let kind = if l.kind == AttnKind::Sliding {
            "sliding"
        } else {
            "full"
        };
        let i = l.index;
        b.input(&past_key(i), DType::F32, &shape, &format!("layer {i} ({kind}) keys after k_norm + RoPE, ring of {len} entries; zeros before the first token"));
        b.input(
            &past_value(i),
            DType::F32,
            &shape,
            &format!("layer {i} ({kind}) values after v_norm, ring of {len} entries"),
        );
    }
    let pos64 = b.node(Op::Cast { to: DType::I64 }, &[&pos_ids], "pos.i64");
    let neg = b.const_f32("mask.neg", &[1], vec![NEG]);
    let zero = b.const_f32("mask.zero", &[1], vec![0.0]);
    Ctx {
        b,
        cfg,
        o,
        v,
        s,
        pos64,
        cache_pos,
        valid_len,
        neg,
        zero,
        masks: Default::default(),
        rope: Default::default(),
        ple: None,
        kv: Default::default(),
    }
}

/// RoPE: cos/sin tables over [0, context) per attention kind, gathered by position_ids.
fn rope_tables(c: &mut Ctx) {
    let (cfg, ctx_len, s) = (c.cfg, c.o.context, c.s as i64);
    for (kind_name, r) in &cfg.rope {
        let inv = r.inv_freq();
        let d = r.head_dim;
        let (mut ct, mut st) = (
            Vec::with_capacity(ctx_len * d),
            Vec::with_capacity(ctx_len * d),
        );
        for p in 0..ctx_len {
            for _ in 0..2 {
                for &f in &inv {
                    let a = p as f32 * f;
                    ct.push(a.cos());
                    st.push(a.sin());
                }
            }
        }
        let (tag, kind) = match kind_name.as_str() {
            "sliding_attention" => ("sliding", AttnKind::Sliding),
            _ => ("full", AttnKind::Full),
        };
        let ctab =
            c.b.const_f32(&format!("rope.{tag}.cos_table"), &[ctx_len, d], ct);
        let stab =
            c.b.const_f32(&format!("rope.{tag}.sin_table"), &[ctx_len, d], st);
        let cg = c.n(
            Op::Gather { axis: 0 },
            &[&ctab, "position_ids"],
            &format!("rope.{tag}.cos_rows"),
        );
        let sg = c.n(
            Op::Gather { axis: 0 },
            &[&stab, "position_ids"],
            &format!("rope.{tag}.sin_rows"),
        );
        let cr = c.reshape(&cg, &[1, 1, s, d as i64], &format!("rope.{tag}.cos"));
        let sr = c.reshape(&sg, &[1, 1, s, d as i64], &format!("rope.{tag}.sin"));
        c.rope.insert(kind, (cr, sr));
    }
}

/// Per-layer inputs: context projection of the scaled embedding, normed, combined with the lookup.
fn ple_inputs(c: &mut Ctx, h0: &str) -> String {
    let (hsz, l_n, p_dim, s) = (
        c.cfg.hidden_size,
        c.cfg.num_layers,
        c.cfg.ple_dim,
        c.s as i64,
    );
    let pr = c.linear(h0, names::PLE_PROJ, l_n * p_dim, hsz, "ple.proj");
    let sc = c.f("ple.proj_scale", (hsz as f32).powf(-0.5));
    let pr = c.n(Op::Mul, &[&pr, &sc], "ple.proj_scaled");
    let pr = c.reshape(&pr, &[1, s, l_n as i64, p_dim as i64], "ple.proj_4d");
    let pr = c.rms_norm(&pr, Some((names::PLE_PROJ_NORM, p_dim)), "ple.proj_norm");
    let sum = c.n(Op::Add, &[&pr, "per_layer_inputs"], "ple.sum");
    let sc2 = c.f("ple.combine_scale", 0.5f32.sqrt());
    c.n(Op::Mul, &[&sum, &sc2], "ple.inputs")
}
