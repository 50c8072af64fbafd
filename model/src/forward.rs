//! Reference forward of the Gemma-4 text decoder in candle, f32 compute — the float truth every other stage
//! (graphs, quantsim, exported ONNX, compiled binaries) is measured against.
//!
//! Split as the device graphs are split:
//! host: [`Model::embed`], [`Model::ple_lookup`] (vocab-sized lookups) and [`Model::lm_head`] (tied head +
//! softcap); device: [`Model::trunk`] (PLE projection, all decoder layers, final norm).

use crate::checkpoint::Checkpoint;
use crate::config::{AttnKind, KvMode, LayerSpec, ModelConfig};
use crate::error::Result;
use crate::names::{self, LayerTensor as LT};
use candle_core::{DType as CDType, Device, Tensor, D};
use std::sync::Arc;

struct LayerW {
    spec: LayerSpec,
    input_ln: Tensor,
    post_attn_ln: Tensor,
    pre_ff_ln: Tensor,
    post_ff_ln: Tensor,
    q: Tensor,
    q_norm: Tensor,
    k: Option<Tensor>,
    v: Option<Tensor>,
    k_norm: Option<Tensor>,
    o: Tensor,
    gate: Tensor,
    up: Tensor,
    down: Tensor,
    ple_gate: Option<Tensor>,
    ple_proj: Option<Tensor>,
    ple_post_ln: Option<Tensor>,
    scalar: f32,
}

/// KV cache of the reference forward: every owning layer keeps all positions ([Hkv, T, d]); the sliding
/// window is applied by the mask, as transformers' mask does.
#[derive(Default, Clone)]
pub struct KvCache {
    kv: Vec<Option<(Tensor, Tensor)>>,
    pub len: usize,
}

impl KvCache {
    pub fn new(num_layers: usize) -> Self {
        KvCache {
            kv: vec![None; num_layers],
            len: 0,
        }
    }
    /// K and V of an owning layer, [Hkv, T, d] each.
    pub fn layer(&self, i: usize) -> Option<&(Tensor, Tensor)> {
        self.kv.get(i)?.as_ref()
    }
}

/// Per-position hidden states of one trunk call: `[h0, out_0, …, out_{L-1}, final_normed]`, each [S, H].
pub type Trace = Vec<Tensor>;

/// The host side of every backend: vocab-sized lookups from the mmap and the tied lm_head + softcap.
pub struct Host {
    pub ckpt: Arc<Checkpoint>,
    pub cfg: ModelConfig,
    dev: Device,
    /// [V, H] f32, the tied (or untied) head, made when first used.
    head: std::sync::OnceLock<Tensor>,
    embed_scale: f32,
    ple_scale: f32,
}

impl Host {
    /// Lookups read rows from the mmap; the [V, H] f32 head (1.6 GB at E2B size) is made on the first
    /// [`Host::lm_head`] call, so backends that never ask for logits (calibration's greedy picks use the
    /// head's own rows) do not pay for it.
    pub fn load(ckpt: Arc<Checkpoint>) -> Result<Self> {
        let dev = Device::Cpu;
        let cfg = ckpt.config.clone();
        let embed_dt = ckpt.info(names::EMBED)?.dtype;
        let ple_dt = if cfg.ple_dim > 0 {
            ckpt.info(names::EMBED_PLE)?.dtype
        } else {
            embed_dt
        };
        Ok(Host {
            embed_scale: cfg.embed_scale(embed_dt),
            ple_scale: cfg.ple_embed_scale(ple_dt),
            head: std::sync::OnceLock::new(),
            cfg,
            dev,
            ckpt,
        })
    }

    fn head(&self) -> Result<&Tensor> {
        if let Some(h) = self.head.get() {
            return Ok(h);
        }
        let name = if self.cfg.tie_word_embeddings {
            names::EMBED
        } else {
            names::LM_HEAD
        };
        let hi = self.ckpt.info(name)?;
        let t = Tensor::from_vec(self.ckpt.store.to_f32(hi), hi.shape.as_slice(), &self.dev)?;
        // A racing thread may have set it first: same values either way.
        Ok(self.head.get_or_init(|| t))
    }

    fn check_ids(&self, ids: &[u32]) -> Result<()> {
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= self.cfg.vocab_size) {
            return Err(crate::Error::Token {
                id: bad,
                field: "vocab_size",
                limit: self.cfg.vocab_size,
            });
        }
        Ok(())
    }

    /// Scaled token embeddings [S, H] (rows read from the mmap).
    pub fn embed(&self, ids: &[u32]) -> Result<Tensor> {
        self.check_ids(ids)?;
        let info = self.ckpt.info(names::EMBED)?;
        let h = self.cfg.hidden_size;
        let mut out = Vec::with_capacity(ids.len() * h);
        for &id in ids {
            out.extend(
                self.ckpt
                    .store
                    .rows_f32(info, id as usize, id as usize + 1)
                    .iter()
                    .map(|v| v * self.embed_scale),
            );
        }
        Ok(Tensor::from_vec(out, (ids.len(), h), &self.dev)?)
    }

    /// Scaled per-layer token embeddings [S, L, P], or None when PLE is off.
    pub fn ple_lookup(&self, ids: &[u32]) -> Result<Option<Tensor>> {
        if self.cfg.ple_dim == 0 {
            return Ok(None);
        }
        self.check_ids(ids)?;
        let info = self.ckpt.info(names::EMBED_PLE)?;
        let (l, p) = (self.cfg.num_layers, self.cfg.ple_dim);
        let mut out = Vec::with_capacity(ids.len() * l * p);
        for &id in ids {
            let id = id as usize;
            if id >= self.cfg.ple_vocab {
                return Err(crate::Error::Token {
                    id: id as u32,
                    field: "vocab_size_per_layer_input",
                    limit: self.cfg.ple_vocab,
                });
            }
            out.extend(
                self.ckpt
                    .store
                    .rows_f32(info, id, id + 1)
                    .iter()
                    .map(|v| v * self.ple_scale),
            );
        }
        Ok(Some(Tensor::from_vec(out, (ids.len(), l, p), &self.dev)?))
    }

    /// logits [S, V] = h @ E^T, then softcap c·tanh(x/c) when configured.
    pub fn lm_head(&self, h: &Tensor) -> Result<Tensor> {
        let head = self.head()?;
        let logits = mm_t(h, head)?;
        Ok(match self.cfg.final_logit_softcapping {
            Some(cap) => ((logits / cap)?.tanh()? * cap)?,
            None => logits,
        })
    }
}

pub struct Model {
    pub ckpt: Arc<Checkpoint>,
    pub cfg: ModelConfig,
    pub host: Host,
    dev: Device,
    layers: Vec<LayerW>,
    ple_model_proj: Option<Tensor>,
    ple_proj_norm: Option<Tensor>,
    final_norm: Tensor,
    inv_freq: std::collections::BTreeMap<String, Vec<f32>>,
}

/// One layer's weights as f32 tensors; `release` drops their mapped pages once read (streamed forwards).
fn load_layer(ckpt: &Checkpoint, l: &LayerSpec, release: bool) -> Result<LayerW> {
    let cfg = &ckpt.config;
    let t = |name: &str| -> Result<Tensor> {
        let info = ckpt.info(name)?;
        let v = ckpt.f32(name)?;
        if release {
            ckpt.store.release(info);
        }
        Ok(Tensor::from_vec(v, info.shape.as_slice(), &Device::Cpu)?)
    };
    let opt = |name: &str, cond: bool| -> Result<Option<Tensor>> {
        if cond {
            t(name).map(Some)
        } else {
            Ok(None)
        }
    };
    let (i, ple) = (l.index, cfg.ple_dim > 0);
    let own = l.kv_mode != KvMode::Reuse;
    Ok(LayerW {
        spec: l.clone(),
        input_ln: t(&LT::InputNorm.name(i))?,
        post_attn_ln: t(&LT::PostAttnNorm.name(i))?,
        pre_ff_ln: t(&LT::PreFfnNorm.name(i))?,
        post_ff_ln: t(&LT::PostFfnNorm.name(i))?,
        q: t(&LT::Q.name(i))?,
        q_norm: t(&LT::QNorm.name(i))?,
        k: opt(&LT::K.name(i), own)?,
        v: opt(&LT::V.name(i), own && !l.k_eq_v)?,
        k_norm: opt(&LT::KNorm.name(i), own)?,
        o: t(&LT::O.name(i))?,
        gate: t(&LT::Gate.name(i))?,
        up: t(&LT::Up.name(i))?,
        down: t(&LT::Down.name(i))?,
        ple_gate: opt(&LT::PleGate.name(i), ple)?,
        ple_proj: opt(&LT::PleProj.name(i), ple)?,
        ple_post_ln: opt(&LT::PlePostNorm.name(i), ple)?,
        scalar: match LT::Scalar.present(cfg, l) {
            true => ckpt.f32(&LT::Scalar.name(i))?[0],
            false => 1.0,
        },
    })
}

pub fn mm_t(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    // x [.., in] @ w[out, in]^T
    x.broadcast_matmul(&w.t()?)
}

pub fn rms_norm(x: &Tensor, w: Option<&Tensor>, eps: f64) -> candle_core::Result<Tensor> {
    let ms = (x.sqr()?.mean_keepdim(D::Minus1)? + eps)?;
    let y = x.broadcast_mul(&ms.powf(-0.5)?)?;
    match w {
        Some(w) => y.broadcast_mul(w),
        None => Ok(y),
    }
}

fn softmax_last(x: &Tensor) -> candle_core::Result<Tensor> {
    let m = x.max_keepdim(D::Minus1)?;
    let e = x.broadcast_sub(&m)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
}

fn rotate_half(x: &Tensor) -> candle_core::Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    let x1 = x.narrow(D::Minus1, 0, d / 2)?;
    let x2 = x.narrow(D::Minus1, d / 2, d / 2)?;
    Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)
}

impl Model {
    /// Load the decoder weights as f32 (embedding lookups stay in the mmap).
    pub fn load(ckpt: Arc<Checkpoint>) -> Result<Self> {
        let mut m = Self::streamed(ckpt)?;
        m.layers = (m.cfg.layers.iter())
            .map(|l| load_layer(&m.ckpt, l, false))
            .collect::<Result<_>>()?;
        m.host = Host::load(m.ckpt.clone())?;
        Ok(m)
    }

    /// The decoder without its layers in memory: [`Self::trunk`] reads each layer's weights when it reaches
    /// it and drops them after (peak memory one layer, not the model) — for one-off forwards such as the
    /// BOS prefix at export time.
    pub fn streamed(ckpt: Arc<Checkpoint>) -> Result<Self> {
        let dev = Device::Cpu;
        let cfg = ckpt.config.clone();
        let t = |name: &str| -> Result<Tensor> {
            let info = ckpt.info(name)?;
            Ok(Tensor::from_vec(
                ckpt.f32(name)?,
                info.shape.as_slice(),
                &dev,
            )?)
        };
        let ple = cfg.ple_dim > 0;
        Ok(Model {
            ple_model_proj: if ple { Some(t(names::PLE_PROJ)?) } else { None },
            ple_proj_norm: if ple {
                Some(t(names::PLE_PROJ_NORM)?)
            } else {
                None
            },
            final_norm: t(names::FINAL_NORM)?,
            inv_freq: cfg
                .rope
                .iter()
                .map(|(k, r)| (k.clone(), r.inv_freq()))
                .collect(),
            host: Host::load(ckpt.clone())?,
            layers: vec![],
            cfg,
            dev,
            ckpt,
        })
    }

    pub fn device(&self) -> &Device {
        &self.dev
    }

    pub fn embed(&self, ids: &[u32]) -> Result<Tensor> {
        self.host.embed(ids)
    }
    pub fn ple_lookup(&self, ids: &[u32]) -> Result<Option<Tensor>> {
        self.host.ple_lookup(ids)
    }
    pub fn lm_head(&self, h: &Tensor) -> Result<Tensor> {
        self.host.lm_head(h)
    }

    fn rope(&self, kind: AttnKind, pos0: usize, s: usize) -> candle_core::Result<(Tensor, Tensor)> {
        let inv = &self.inv_freq[kind.name()];
        let half = inv.len();
        let mut cos = Vec::with_capacity(s * half * 2);
        let mut sin = Vec::with_capacity(s * half * 2);
        for p in pos0..pos0 + s {
            let pf = p as f32;
            for _ in 0..2 {
                for &f in inv {
                    let a = pf * f;
                    cos.push(a.cos());
                    sin.push(a.sin());
                }
            }
        }
        Ok((
            Tensor::from_vec(cos, (s, 2 * half), &self.dev)?,
            Tensor::from_vec(sin, (s, 2 * half), &self.dev)?,
        ))
    }

    fn mask(
        &self,
        window: Option<usize>,
        pos0: usize,
        s: usize,
        t: usize,
    ) -> candle_core::Result<Tensor> {
        let mut m = vec![0f32; s * t];
        for qi in 0..s {
            let q = pos0 + qi;
            for k in 0..t {
                let ok = k <= q && window.is_none_or(|w| k + w > q);
                if !ok {
                    m[qi * t + k] = f32::NEG_INFINITY;
                }
            }
        }
        Tensor::from_vec(m, (s, t), &self.dev)
    }

    /// Device trunk: scaled embeddings [S, H] (+ PLE lookups [S, L, P]) at positions cache.len.. → final-normed
    /// hidden states [S, H]. Appends K/V to `cache`. With `trace`, records every layer's output.
    pub fn trunk(
        &self,
        h0: &Tensor,
        ple_tok: Option<&Tensor>,
        cache: &mut KvCache,
        mut trace: Option<&mut Trace>,
    ) -> Result<Tensor> {
        let c = &self.cfg;
        let s = h0.dim(0)?;
        let pos0 = cache.len;
        if cache.kv.len() != c.num_layers {
            *cache = KvCache::new(c.num_layers);
        }
        let eps = c.rms_norm_eps;
        // PLE: context projection of the scaled embedding, normed, combined with the token part.
        let ple = match (&self.ple_model_proj, ple_tok) {
            (Some(w), Some(tok)) => {
                let proj = (mm_t(h0, w)? * (c.hidden_size as f64).powf(-0.5))?.reshape((
                    s,
                    c.num_layers,
                    c.ple_dim,
                ))?;
                let proj = rms_norm(&proj, self.ple_proj_norm.as_ref(), eps)?;
                Some(((proj + tok)? * 2f64.powf(-0.5))?)
            }
            (Some(_), None) => {
                return Err(crate::Error::Usage(
                    "model has per-layer embeddings: trunk needs ple_tok".into(),
                ))
            }
            _ => None,
        };
        let mut ropes = std::collections::BTreeMap::new();
        let mut masks = std::collections::BTreeMap::new();
        for k in [AttnKind::Sliding, AttnKind::Full] {
            if c.rope.contains_key(k.name()) {
                ropes.insert(k, self.rope(k, pos0, s)?);
                let w = if k == AttnKind::Sliding {
                    Some(c.sliding_window)
                } else {
                    None
                };
                masks.insert(k, self.mask(w, pos0, s, pos0 + s)?);
            }
        }
        if let Some(t) = trace.as_deref_mut() {
            t.push(h0.clone());
        }
        let mut h = h0.clone();
        let hq = c.num_heads;
        for spec in &c.layers {
            let streamed;
            let lw = match self.layers.get(spec.index) {
                Some(w) => w,
                None => {
                    streamed = load_layer(&self.ckpt, spec, true)?;
                    &streamed
                }
            };
            let l = &lw.spec;
            let d = l.head_dim;
            let (cos, sin) = &ropes[&l.kind];
            let apply_rope = |x: &Tensor| -> candle_core::Result<Tensor> {
                // x [Hx, S, d]
                x.broadcast_mul(cos)? + rotate_half(x)?.broadcast_mul(sin)?
            };
            // Attention block.
            let x = rms_norm(&h, Some(&lw.input_ln), eps)?;
            let q = mm_t(&x, &lw.q)?.reshape((s, hq, d))?;
            let q = rms_norm(&q, Some(&lw.q_norm), eps)?
                .transpose(0, 1)?
                .contiguous()?;
            let q = apply_rope(&q)?;
            if l.kv_mode != KvMode::Reuse {
                let hkv = l.num_kv_heads;
                let kraw = mm_t(&x, lw.k.as_ref().unwrap())?.reshape((s, hkv, d))?;
                let vraw = match &lw.v {
                    Some(v) => mm_t(&x, v)?.reshape((s, hkv, d))?,
                    None => kraw.clone(),
                };
                let k = rms_norm(&kraw, lw.k_norm.as_ref(), eps)?
                    .transpose(0, 1)?
                    .contiguous()?;
                let k = apply_rope(&k)?;
                let v = match self.cfg.v_norm {
                    true => rms_norm(&vraw, None, eps)?,
                    false => vraw,
                };
                let v = v.transpose(0, 1)?.contiguous()?;
                let slot = &mut cache.kv[l.index];
                *slot = Some(match slot.take() {
                    None => (k, v),
                    Some((pk, pv)) => (Tensor::cat(&[&pk, &k], 1)?, Tensor::cat(&[&pv, &v], 1)?),
                });
            }
            let (k, v) = cache.kv[l.kv_source]
                .as_ref()
                .expect("KV source layer runs before its readers");
            let hkv = k.dim(0)?;
            let g = hq / hkv;
            let t = k.dim(1)?;
            // GQA: query heads j*G..(j+1)*G read KV head j.
            let qg = q.reshape((hkv, g * s, d))?;
            let scores = qg.matmul(&k.t()?)?.reshape((hq, s, t))?;
            let scores = scores.broadcast_add(&masks[&l.kind])?;
            let p = softmax_last(&scores)?;
            let a = p.reshape((hkv, g * s, t))?.matmul(v)?.reshape((hq, s, d))?;
            let a = a.transpose(0, 1)?.contiguous()?.reshape((s, hq * d))?;
            let a = mm_t(&a, &lw.o)?;
            h = (h + rms_norm(&a, Some(&lw.post_attn_ln), eps)?)?;
            // MLP block.
            let x = rms_norm(&h, Some(&lw.pre_ff_ln), eps)?;
            let m = mm_t(
                &(mm_t(&x, &lw.gate)?.gelu()? * mm_t(&x, &lw.up)?)?,
                &lw.down,
            )?;
            h = (h + rms_norm(&m, Some(&lw.post_ff_ln), eps)?)?;
            // Per-layer input.
            if let (Some(gw), Some(pw), Some(ple)) = (&lw.ple_gate, &lw.ple_proj, &ple) {
                let pi = ple.narrow(1, l.index, 1)?.squeeze(1)?;
                let gte = (mm_t(&h, gw)?.gelu()? * pi)?;
                let gte = mm_t(&gte, pw)?;
                h = (h + rms_norm(&gte, lw.ple_post_ln.as_ref(), eps)?)?;
            }
            if lw.scalar != 1.0 {
                h = (h * lw.scalar as f64)?;
            }
            if let Some(t) = trace.as_deref_mut() {
                t.push(h.clone());
            }
        }
        cache.len += s;
        let out = rms_norm(&h, Some(&self.final_norm), eps)?;
        if let Some(t) = trace {
            t.push(out.clone());
        }
        Ok(out)
    }

    /// Full forward: ids at positions cache.len.. → logits [S, V].
    pub fn forward(&self, ids: &[u32], cache: &mut KvCache) -> Result<Tensor> {
        let h0 = self.embed(ids)?;
        let ple = self.ple_lookup(ids)?;
        let h = self.trunk(&h0, ple.as_ref(), cache, None)?;
        self.lm_head(&h)
    }

    pub fn forward_traced(&self, ids: &[u32], cache: &mut KvCache) -> Result<(Tensor, Trace)> {
        let h0 = self.embed(ids)?;
        let ple = self.ple_lookup(ids)?;
        let mut tr = Vec::new();
        let h = self.trunk(&h0, ple.as_ref(), cache, Some(&mut tr))?;
        Ok((self.lm_head(&h)?, tr))
    }
}

/// Index of the largest value (first on ties, as torch.argmax).
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

pub fn to_rows(t: &Tensor) -> Result<Vec<Vec<f32>>> {
    Ok(t.to_dtype(CDType::F32)?.to_vec2::<f32>()?)
}
