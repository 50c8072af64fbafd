//! The BOS prefix: position 0 of every prompt is `<bos>`, and under causal attention its K/V (and hidden
//! state) are the same for every prompt. hexq computes them once, in f32 on the host, and writes them into
//! the device's KV buffers; device graphs — and their calibration — start at position 1.
//!
//! Why: on a trained Gemma the BOS position is the attention sink, and its residual stream is ~10× larger
//! than any other position's (gemma-3-270m: max |residual| 41,944 at BOS vs ≤ 3,380 elsewhere). Observed
//! by calibration, that one position sets every residual tensor's int16 grid ~10× coarser than the rest of
//! the sequence needs. Qualcomm's and Genie's pipelines likewise keep per-prompt constants off the device.

use crate::config::KvMode;
use crate::forward::{KvCache, Model};
use crate::Result;

/// K and V of one KV-owning layer at position 0: [Hkv · head_dim] each (after k_norm + RoPE, v_norm).
#[derive(Clone, Debug, PartialEq)]
pub struct PrefixKv {
    pub layer: usize,
    pub heads: usize,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Prefix {
    /// The token the prefix stands for (config's bos_token_id).
    pub token: u32,
    pub kv: Vec<PrefixKv>,
    /// Final (normed) hidden state at position 0 `[H]`.
    pub hidden: Vec<f32>,
}

/// host-model/ tensor names of the prefix (the K/V ones name the graph input they are written into).
pub fn host_name(input: &str) -> String {
    format!("prefix.{input}")
}
pub const HIDDEN: &str = "prefix.hidden_states";

impl Prefix {
    /// (host-model name, shape, values) of every prefix tensor, in a fixed order.
    pub fn tensors(&self) -> Vec<(String, Vec<usize>, &[f32])> {
        let mut v = Vec::new();
        for p in &self.kv {
            let shape = vec![1, p.heads, 1, p.k.len() / p.heads];
            v.push((
                host_name(&format!("past_key_{}", p.layer)),
                shape.clone(),
                &p.k[..],
            ));
            v.push((
                host_name(&format!("past_value_{}", p.layer)),
                shape,
                &p.v[..],
            ));
        }
        v.push((
            HIDDEN.to_string(),
            vec![1, self.hidden.len()],
            &self.hidden[..],
        ));
        v
    }

    /// BOS through the f32 reference forward, one layer in memory at a time.
    pub fn compute(ck: &std::sync::Arc<crate::Checkpoint>) -> Result<Self> {
        Self::from_model(&Model::streamed(ck.clone())?)
    }

    pub fn from_model(m: &Model) -> Result<Self> {
        let token = m.cfg.bos_token_id;
        let mut cache = KvCache::new(m.cfg.num_layers);
        let h0 = m.embed(&[token])?;
        let ple = m.ple_lookup(&[token])?;
        let h = m.trunk(&h0, ple.as_ref(), &mut cache, None)?;
        let mut kv = Vec::new();
        for l in m.cfg.layers.iter().filter(|l| l.kv_mode != KvMode::Reuse) {
            let (k, v) = cache.layer(l.index).expect("owning layer wrote its KV");
            kv.push(PrefixKv {
                layer: l.index,
                heads: l.num_kv_heads,
                k: k.flatten_all()?.to_vec1()?,
                v: v.flatten_all()?.to_vec1()?,
            });
        }
        Ok(Prefix {
            token,
            kv,
            hidden: h.flatten_all()?.to_vec1()?,
        })
    }

    /// (`past_*` input name, KV heads, values [Hkv · d]) of every K and V the prefix writes.
    pub fn entries(&self) -> impl Iterator<Item = (String, usize, &[f32])> {
        self.kv.iter().flat_map(|p| {
            [
                (format!("past_key_{}", p.layer), p.heads, &p.k[..]),
                (format!("past_value_{}", p.layer), p.heads, &p.v[..]),
            ]
        })
    }
}

/// Write `x` = [Hkv · d] at position 0 — ring slot 0 — of a KV buffer laid out as the graphs' `past_*`
/// inputs, [1, Hkv, len, d] row-major.
pub fn write_slot0(buf: &mut [f32], heads: usize, x: &[f32]) {
    let d = x.len() / heads;
    let len = buf.len() / x.len();
    for (j, row) in x.chunks(d).enumerate() {
        buf[j * len * d..j * len * d + d].copy_from_slice(row);
    }
}
