//! One decoder layer: attention (with the KV write for owning layers), MLP, per-layer input, layer scalar.
//! Names of weights and of the nodes that read them come from the tensor table ([`LT`]).

use super::ctx::Ctx;
use super::{kv_len, past_key, past_value, present_key, present_value, Variant};
use crate::ir::Op;
use hexq_model::config::{AttnKind, KvMode, LayerSpec};
use hexq_model::names::LayerTensor as LT;

/// `h` after layer `l`.
pub(super) fn layer(c: &mut Ctx, l: &LayerSpec, h: &str) -> String {
    let i = l.index;
    let p = format!("layers.{i}");
    let a = attention(c, l, h);
    let h = c.n(Op::Add, &[h, &a], &format!("{p}.attn_residual"));
    let dn = mlp(c, l, &h);
    let mut h = c.n(Op::Add, &[&h, &dn], &format!("{p}.mlp_residual"));
    if c.ple.is_some() {
        let pp = per_layer_input(c, l, &h);
        h = c.n(Op::Add, &[&h, &pp], &format!("{p}.per_layer_residual"));
    }
    if !LT::Scalar.present(c.cfg, l) {
        return h;
    }
    let sc = c.b.weight(&LT::Scalar.name(i), &[1], false);
    c.n(Op::Mul, &[&h, &sc], &format!("{p}.out"))
}

fn window(c: &Ctx, l: &LayerSpec) -> Option<usize> {
    (l.kind == AttnKind::Sliding).then_some(c.cfg.sliding_window)
}

/// Queries grouped per KV head: [1, Hq, S, d] viewed as [1, Hkv, G*S, d]; softmax over the owner's keys.
fn attention(c: &mut Ctx, l: &LayerSpec, h: &str) -> String {
    let (i, d, s) = (l.index, l.head_dim, c.s as i64);
    let (hsz, hq) = (c.cfg.hidden_size, c.cfg.num_heads);
    let p = format!("layers.{i}");
    let src = c.cfg.layers[l.kv_source].clone();
    let (hkv, g) = (src.num_kv_heads, hq / src.num_kv_heads);
    let (cos, sin) = c.rope[&l.kind].clone();
    let x = c.rms_norm(
        h,
        Some((&LT::InputNorm.name(i), hsz)),
        &LT::InputNorm.module(i),
    );
    let q = c.linear(&x, &LT::Q.name(i), hq * d, hsz, &LT::Q.module(i));
    let q = c.reshape(
        &q,
        &[1, s, hq as i64, d as i64],
        &format!("{p}.self_attn.q_heads"),
    );
    let q = c.rms_norm(&q, Some((&LT::QNorm.name(i), d)), &LT::QNorm.module(i));
    let q = c.transpose(&q, &[0, 2, 1, 3], &format!("{p}.self_attn.q_t"));
    let q = c.rope(&q, &cos, &sin, d, &format!("{p}.self_attn.q_rope"));
    if l.kv_mode != KvMode::Reuse {
        let kv = keys_values(c, l, &x);
        c.kv.insert(i, kv);
    }
    let (ak, av) = c.kv[&l.kv_source].clone();
    let len = kv_len(c.cfg, &src, c.v, c.o);
    let m = c.masks(len, window(c, l), g);
    let kt = c.transpose(&ak, &[0, 1, 3, 2], &format!("{p}.self_attn.keys_t"));
    let expand = c.v == Variant::DecodeFull && g > 1;
    let scores = if expand {
        scores_expanded(c, l, &q, &kt, hkv, g)
    } else {
        let qg = c.reshape(
            &q,
            &[1, hkv as i64, (g as i64 * s), d as i64],
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
    let a = if expand {
        attend_expanded(c, l, &pr, &av, hkv, g)
    } else {
        c.n(Op::MatMul, &[&pr, &av], &format!("{p}.self_attn.attn"))
    };
    let a = c.reshape(
        &a,
        &[1, hq as i64, s, d as i64],
        &format!("{p}.self_attn.attn_heads"),
    );
    let a = c.transpose(&a, &[0, 2, 1, 3], &format!("{p}.self_attn.attn_t"));
    let a = c.reshape(
        &a,
        &[1, s, (hq * d) as i64],
        &format!("{p}.self_attn.attn_flat"),
    );
    let a = c.linear(&a, &LT::O.name(i), hsz, hq * d, &LT::O.module(i));
    c.rms_norm(
        &a,
        Some((&LT::PostAttnNorm.name(i), hsz)),
        &LT::PostAttnNorm.module(i),
    )
}

/// An owning layer's new K (k_norm + RoPE) and V (v_norm), written into its buffer; returns what the layer
/// and its readers attend over (trunk: [past ring, chunk]; decode: the updated buffer).
fn keys_values(c: &mut Ctx, l: &LayerSpec, x: &str) -> (String, String) {
    let (i, d, s, hsz) = (l.index, l.head_dim, c.s as i64, c.cfg.hidden_size);
    let (hkv, g) = (l.num_kv_heads, c.cfg.num_heads / l.num_kv_heads);
    let p = format!("layers.{i}");
    let (cos, sin) = c.rope[&l.kind].clone();
    let k = c.linear(x, &LT::K.name(i), hkv * d, hsz, &LT::K.module(i));
    let k = c.reshape(
        &k,
        &[1, s, hkv as i64, d as i64],
        &format!("{p}.self_attn.k_heads"),
    );
    let vraw = if l.k_eq_v {
        k.clone()
    } else {
        let vv = c.linear(x, &LT::V.name(i), hkv * d, hsz, &LT::V.module(i));
        c.reshape(
            &vv,
            &[1, s, hkv as i64, d as i64],
            &format!("{p}.self_attn.v_heads"),
        )
    };
    let k = c.rms_norm(&k, Some((&LT::KNorm.name(i), d)), &LT::KNorm.module(i));
    let k = c.transpose(&k, &[0, 2, 1, 3], &format!("{p}.self_attn.k_t"));
    let k = c.rope(&k, &cos, &sin, d, &format!("{p}.self_attn.k_rope"));
    // Gemma-4 RMS-normalises values (no weight); Gemma-3 does not.
    let vv = match c.cfg.v_norm {
        true => c.rms_norm(&vraw, None, &format!("{p}.self_attn.v_norm")),
        false => vraw,
    };
    let vv = c.transpose(&vv, &[0, 2, 1, 3], &format!("{p}.self_attn.v_t"));
    let len = kv_len(c.cfg, l, c.v, c.o);
    let m = c.masks(len, window(c, l), g);
    let (pk, pv) = (past_key(i), past_value(i));
    let (att_k, att_v, pres_k, pres_v) = if c.v == Variant::Trunk {
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
    (att_k, att_v)
}

/// decode_full's naive scores: KV repeated per query head (Expand), queries one head each.
fn scores_expanded(c: &mut Ctx, l: &LayerSpec, q: &str, kt: &str, hkv: usize, g: usize) -> String {
    let (p, d, s, hq) = (
        format!("layers.{}", l.index),
        l.head_dim as i64,
        c.s as i64,
        c.cfg.num_heads as i64,
    );
    let t = c.b.g.types[kt].shape[3] as i64;
    let ku = c.n(
        Op::Unsqueeze { axes: vec![2] },
        &[kt],
        &format!("{p}.self_attn.keys_u"),
    );
    let rep = Op::Expand {
        shape: vec![1, hkv as i64, g as i64, d, t],
    };
    let ke = c.n(rep, &[&ku], &format!("{p}.self_attn.keys_rep"));
    let ke = c.reshape(&ke, &[1, hq, d, t], &format!("{p}.self_attn.keys_heads"));
    let qh = c.reshape(q, &[1, hq, s, d], &format!("{p}.self_attn.q_heads_full"));
    c.n(Op::MatMul, &[&qh, &ke], &format!("{p}.self_attn.scores"))
}

/// decode_full's naive weighted sum over values repeated per query head.
fn attend_expanded(c: &mut Ctx, l: &LayerSpec, pr: &str, av: &str, hkv: usize, g: usize) -> String {
    let (p, d, hq) = (
        format!("layers.{}", l.index),
        l.head_dim as i64,
        c.cfg.num_heads as i64,
    );
    let t = c.b.g.types[av].shape[2] as i64;
    let vu = c.n(
        Op::Unsqueeze { axes: vec![2] },
        &[av],
        &format!("{p}.self_attn.values_u"),
    );
    let rep = Op::Expand {
        shape: vec![1, hkv as i64, g as i64, t, d],
    };
    let ve = c.n(rep, &[&vu], &format!("{p}.self_attn.values_rep"));
    let ve = c.reshape(&ve, &[1, hq, t, d], &format!("{p}.self_attn.values_heads"));
    c.n(Op::MatMul, &[pr, &ve], &format!("{p}.self_attn.attn"))
}

/// gelu-tanh gated MLP between its pre and post norms.
fn mlp(c: &mut Ctx, l: &LayerSpec, h: &str) -> String {
    let (i, hsz, w) = (l.index, c.cfg.hidden_size, l.mlp_width);
    let x = c.rms_norm(
        h,
        Some((&LT::PreFfnNorm.name(i), hsz)),
        &LT::PreFfnNorm.module(i),
    );
    let gt = c.linear(&x, &LT::Gate.name(i), w, hsz, &LT::Gate.module(i));
    let gt = c.gelu_tanh(&gt, &format!("layers.{i}.mlp.act"));
    let up = c.linear(&x, &LT::Up.name(i), w, hsz, &LT::Up.module(i));
    let gu = c.n(Op::Mul, &[&gt, &up], &format!("layers.{i}.mlp.gated"));
    let dn = c.linear(&gu, &LT::Down.name(i), hsz, w, &LT::Down.module(i));
    c.rms_norm(
        &dn,
        Some((&LT::PostFfnNorm.name(i), hsz)),
        &LT::PostFfnNorm.module(i),
    )
}

/// This layer's slice of the per-layer inputs, gated by the hidden state and projected back.
fn per_layer_input(c: &mut Ctx, l: &LayerSpec, h: &str) -> String {
    let (i, hsz, pd, s) = (l.index, c.cfg.hidden_size, c.cfg.ple_dim, c.s as i64);
    let p = format!("layers.{i}");
    let ple = c.ple.clone().expect("per_layer_input needs PLE");
    let pi = c.slice(
        &ple,
        i as i64,
        i as i64 + 1,
        2,
        &format!("{p}.per_layer_input_4d"),
    );
    let pi = c.reshape(&pi, &[1, s, pd as i64], &format!("{p}.per_layer_input"));
    let gg = c.linear(h, &LT::PleGate.name(i), pd, hsz, &LT::PleGate.module(i));
    let gg = c.gelu_tanh(&gg, &format!("{p}.per_layer_act"));
    let gg = c.n(Op::Mul, &[&gg, &pi], &format!("{p}.per_layer_gated"));
    let pp = c.linear(&gg, &LT::PleProj.name(i), hsz, pd, &LT::PleProj.module(i));
    c.rms_norm(
        &pp,
        Some((&LT::PlePostNorm.name(i), hsz)),
        &LT::PlePostNorm.module(i),
    )
}
