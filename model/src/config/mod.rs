//! Gemma text configs — Gemma-4 and Gemma-3 — the raw `config.json` fields (as transformers 5.23/5.24 write
//! them) and the per-layer facts derived from them, the way `Gemma4TextConfig.__post_init__` /
//! `kv_sharing_modes` and `Gemma3TextConfig` derive them.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;

/// Attention type of one layer (`layer_types[i]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum AttnKind {
    #[serde(rename = "sliding_attention")]
    Sliding,
    #[serde(rename = "full_attention")]
    Full,
}

impl AttnKind {
    pub fn name(self) -> &'static str {
        match self {
            AttnKind::Sliding => "sliding_attention",
            AttnKind::Full => "full_attention",
        }
    }
}

/// RoPE of one layer type. `rotated` = number of frequencies that rotate; the remaining
/// `head_dim/2 - rotated` have inv_freq 0 (pass through) — "proportional" RoPE.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RopeSpec {
    pub rope_type: String,
    pub theta: f64,
    pub partial_rotary_factor: f64,
    pub factor: f64,
    pub head_dim: usize,
    pub rotated: usize,
}

impl RopeSpec {
    /// inv_freq in f32, computed as transformers does (f32 exponent, f32 pow).
    pub fn inv_freq(&self) -> Vec<f32> {
        let d = self.head_dim as f32;
        let mut f: Vec<f32> = (0..self.rotated)
            .map(|j| 1.0f32 / (self.theta as f32).powf((2 * j) as f32 / d))
            .collect();
        f.resize(self.head_dim / 2, 0.0);
        if self.factor != 1.0 {
            for v in &mut f {
                *v /= self.factor as f32;
            }
        }
        f
    }
}

/// Who holds the K/V a layer attends over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum KvMode {
    /// Computes and caches its own K/V.
    Own,
    /// Owns K/V that later layers reuse (transformers' "store").
    Store,
    /// Reads the K/V of `kv_source` (transformers' "reuse"); has no k/v projections.
    Reuse,
}

/// Everything the forward pass and the graph builders need about one decoder layer.
#[derive(Debug, Clone, Serialize)]
pub struct LayerSpec {
    pub index: usize,
    pub kind: AttnKind,
    pub head_dim: usize,
    pub num_kv_heads: usize,
    pub kv_mode: KvMode,
    /// Layer whose K/V this layer attends over (== index unless Reuse).
    pub kv_source: usize,
    /// Full layers with `attention_k_eq_v`: V is the raw k_proj output, no v_proj.
    pub k_eq_v: bool,
    pub mlp_width: usize,
    /// Sliding window for sliding layers, None for full.
    pub window: Option<usize>,
}

impl LayerSpec {
    pub fn owns_kv(&self) -> bool {
        self.kv_mode != KvMode::Reuse
    }
}

/// The text-decoder family. Gemma-3 differs from Gemma-4 in three places that matter to hexq: RMSNorm
/// scales by (1 + w), attention scores are scaled by query_pre_attn_scalar^-½, and there is no v_norm; it has
/// no per-layer embeddings, KV sharing or layer scalars either.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Arch {
    Gemma4,
    Gemma3,
}

/// An affine fold applied to a checkpoint tensor as it is read as f32: `(w + add) · mul`. Gemma-3's norms
/// read as 1 + w, its q_norm as (1 + w) · query_pre_attn_scalar^-½, so every later stage sees Gemma-4's
/// plain-w form and the scaling lives in a weight.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Fold {
    pub add: f32,
    pub mul: f32,
}

impl Fold {
    pub const IDENTITY: Fold = Fold { add: 0.0, mul: 1.0 };
    pub fn is_identity(&self) -> bool {
        *self == Fold::IDENTITY
    }
    pub fn apply(&self, v: &mut [f32]) {
        if !self.is_identity() {
            v.iter_mut().for_each(|x| *x = (*x + self.add) * self.mul);
        }
    }
}

/// Checkpoint layout: where the text decoder's tensors live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Layout {
    /// `Gemma{4,3}ForConditionalGeneration`: text config under `text_config`, tensors under `model.language_model.`.
    Multimodal,
    /// `Gemma{4,3}ForCausalLM`: top-level text config, tensors under `model.`.
    CausalLm,
}

/// The derived, validated text-decoder config.
#[derive(Debug, Clone, Serialize)]
pub struct ModelConfig {
    pub arch: Arch,
    pub layout: Layout,
    pub prefix: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub rms_norm_eps: f64,
    pub sliding_window: usize,
    pub final_logit_softcapping: Option<f64>,
    pub tie_word_embeddings: bool,
    /// Per-layer-embedding width P (0 = PLE disabled).
    pub ple_dim: usize,
    pub ple_vocab: usize,
    pub num_kv_shared_layers: usize,
    pub max_position_embeddings: usize,
    pub pad_token_id: u32,
    pub bos_token_id: u32,
    pub eos_token_ids: Vec<u32>,
    pub rope: BTreeMap<String, RopeSpec>,
    pub layers: Vec<LayerSpec>,
    /// Gemma-3: 1 (RMSNorm scales by 1 + w); Gemma-4: 0.
    pub norm_offset: f32,
    /// Attention score scaling, folded into q_norm: query_pre_attn_scalar^-½ (Gemma-3), 1 (Gemma-4).
    pub query_scale: f32,
    /// Whether values are RMS-normalised (weightless) before attention: Gemma-4 yes, Gemma-3 no.
    pub v_norm: bool,
    /// The text config object exactly as read (for writers that must reproduce it, e.g. GGUF metadata).
    #[serde(skip)]
    pub raw_text: Value,
    #[serde(skip)]
    pub raw: Value,
}

/// config.json's text-decoder fields, with transformers' `Gemma4TextConfig` defaults. A null counts as
/// absent (transformers writes nulls for unset options).
#[derive(Deserialize)]
struct TextFields {
    hidden_size: Option<usize>,
    intermediate_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    #[serde(default = "d::heads")]
    num_attention_heads: usize,
    #[serde(default = "d::kv_heads")]
    num_key_value_heads: usize,
    #[serde(default = "d::head_dim")]
    head_dim: usize,
    #[serde(default = "d::global_head_dim")]
    global_head_dim: usize,
    num_global_key_value_heads: Option<usize>,
    #[serde(default = "d::vocab")]
    vocab_size: usize,
    #[serde(default = "d::window")]
    sliding_window: usize,
    #[serde(default)]
    num_kv_shared_layers: usize,
    #[serde(default)]
    use_double_wide_mlp: bool,
    #[serde(default)]
    attention_k_eq_v: bool,
    #[serde(default = "d::ple_dim")]
    hidden_size_per_layer_input: usize,
    #[serde(default = "d::vocab")]
    vocab_size_per_layer_input: usize,
    final_logit_softcapping: Option<f64>,
    #[serde(default = "d::eps")]
    rms_norm_eps: f64,
    #[serde(default = "d::max_pos")]
    max_position_embeddings: usize,
    #[serde(default)]
    pad_token_id: u32,
    #[serde(default = "d::bos")]
    bos_token_id: u32,
    eos_token_id: Option<Value>,
    tie_word_embeddings: Option<bool>,
    layer_types: Option<Vec<Value>>,
    per_layer_config: Option<serde_json::Map<String, Value>>,
    rope_parameters: Option<BTreeMap<String, RopeFields>>,
    // Features hexq does not run, refused by name.
    #[serde(default)]
    enable_moe_block: bool,
    #[serde(default)]
    attention_bias: bool,
    use_bidirectional_attention: Option<Value>,
    attn_logit_softcapping: Option<f64>,
    #[serde(default = "d::act")]
    hidden_activation: String,
    // Gemma-3.
    query_pre_attn_scalar: Option<f64>,
    /// Older Gemma-3 configs: RoPE of full layers (rope_theta, rope_scaling) and of sliding ones.
    rope_theta: Option<f64>,
    rope_local_base_freq: Option<f64>,
    rope_scaling: Option<RopeFields>,
}

#[derive(Deserialize, Clone)]
struct RopeFields {
    #[serde(default = "d::rope_type", alias = "type")]
    rope_type: String,
    rope_theta: Option<f64>,
    #[serde(default = "d::one")]
    partial_rotary_factor: f64,
    #[serde(default = "d::one")]
    factor: f64,
}

/// Defaults (transformers' `Gemma4TextConfig.__init__`).
mod d {
    pub fn heads() -> usize {
        8
    }
    pub fn kv_heads() -> usize {
        4
    }
    pub fn head_dim() -> usize {
        256
    }
    pub fn global_head_dim() -> usize {
        512
    }
    pub fn vocab() -> usize {
        262_144
    }
    pub fn window() -> usize {
        512
    }
    pub fn ple_dim() -> usize {
        256
    }
    pub fn eps() -> f64 {
        1e-6
    }
    pub fn max_pos() -> usize {
        131_072
    }
    pub fn bos() -> u32 {
        2
    }
    pub fn act() -> String {
        "gelu_pytorch_tanh".into()
    }
    pub fn rope_type() -> String {
        "default".into()
    }
    pub fn one() -> f64 {
        1.0
    }
}

mod checks;
use checks::{check_dims, check_sizes};

fn strip_nulls(v: &mut Value) {
    if let Value::Object(o) = v {
        o.retain(|_, x| !x.is_null());
        o.values_mut().for_each(strip_nulls);
    }
}

/// Errors name config.json and the field as the user wrote it (`text_config.` prefix in the multimodal layout).
struct Fields<'a> {
    path: &'a Path,
    prefix: &'static str,
}

impl Fields<'_> {
    fn err(&self, field: &str, msg: impl Into<String>) -> Error {
        Error::config(self.path, &format!("{}{field}", self.prefix), msg)
    }
    fn parse(&self, tc: &Value) -> Result<TextFields> {
        let mut v = tc.clone();
        strip_nulls(&mut v);
        serde_path_to_error::deserialize(v).map_err(|e| {
            let field = e.path().to_string();
            self.err(&field, e.into_inner().to_string())
        })
    }
    fn required(&self, v: Option<usize>, field: &str) -> Result<usize> {
        v.ok_or_else(|| self.err(field, "missing"))
    }
}

impl ModelConfig {
    /// Read and validate `config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let raw: Value = serde_json::from_str(&text)
            .map_err(|e| Error::file(path, format!("invalid JSON: {e}")))?;
        Self::from_value(raw, path)
    }

    pub fn from_value(raw: Value, path: &Path) -> Result<Self> {
        if !raw.is_object() {
            return Err(Error::file(path, "config is not a JSON object"));
        }
        let (layout, tc) = match raw.get("text_config").filter(|v| !v.is_null()) {
            Some(tc) => (Layout::Multimodal, tc.clone()),
            None => (Layout::CausalLm, raw.clone()),
        };
        let arch = arch_of(&raw, &tc, path)?;
        let fl = Fields {
            path,
            prefix: if layout == Layout::Multimodal {
                "text_config."
            } else {
                ""
            },
        };
        let mut t = fl.parse(&tc)?;
        if arch == Arch::Gemma3 {
            gemma3_fields(&mut t);
        }
        refuse_unsupported(&fl, &t)?;
        let (hidden_size, intermediate_size, num_layers) = check_dims(&fl, &t)?;
        check_sizes(&fl, &t, hidden_size, intermediate_size, num_layers)?;
        let kinds = layer_kinds(&fl, &t, num_layers, arch)?;
        let (layer_hd, layer_kvh) = layer_heads(&fl, &t, &kinds)?;
        let rope = rope_specs(&fl, &t, &kinds, &layer_hd)?;
        let (modes, source) = kv_sharing(&fl, &t, &kinds)?;
        let layers = (0..num_layers)
            .map(|i| LayerSpec {
                index: i,
                kind: kinds[i],
                head_dim: layer_hd[i],
                num_kv_heads: layer_kvh[source[i]],
                kv_mode: modes[i],
                kv_source: source[i],
                k_eq_v: t.attention_k_eq_v && kinds[i] == AttnKind::Full,
                mlp_width: intermediate_size
                    * if t.use_double_wide_mlp && modes[i] == KvMode::Reuse {
                        2
                    } else {
                        1
                    },
                window: (kinds[i] == AttnKind::Sliding).then_some(t.sliding_window),
            })
            .collect();
        let eos_token_ids = match &t.eos_token_id {
            None => vec![1],
            Some(Value::Array(a)) => a
                .iter()
                .filter_map(|v| v.as_u64().map(|u| u as u32))
                .collect(),
            Some(v) => vec![v
                .as_u64()
                .ok_or_else(|| fl.err("eos_token_id", "not an integer"))?
                as u32],
        };
        let top_tie = raw.get("tie_word_embeddings").and_then(|v| v.as_bool());
        let ple_dim = t.hidden_size_per_layer_input;
        let (norm_offset, query_scale, v_norm) = match arch {
            Arch::Gemma4 => (0.0, 1.0, true),
            Arch::Gemma3 => {
                let q = t.query_pre_attn_scalar.unwrap_or(t.head_dim as f64);
                if q <= 0.0 {
                    return Err(fl.err("query_pre_attn_scalar", "must be positive"));
                }
                (1.0, q.powf(-0.5) as f32, false)
            }
        };
        Ok(ModelConfig {
            arch,
            layout,
            prefix: match layout {
                Layout::Multimodal => "model.language_model.".into(),
                Layout::CausalLm => "model.".into(),
            },
            vocab_size: t.vocab_size,
            hidden_size,
            intermediate_size,
            num_layers,
            num_heads: t.num_attention_heads,
            rms_norm_eps: t.rms_norm_eps,
            sliding_window: t.sliding_window,
            final_logit_softcapping: t.final_logit_softcapping,
            tie_word_embeddings: t.tie_word_embeddings.or(top_tie).unwrap_or(true),
            ple_dim,
            ple_vocab: if ple_dim > 0 {
                t.vocab_size_per_layer_input
            } else {
                0
            },
            num_kv_shared_layers: t.num_kv_shared_layers,
            max_position_embeddings: t.max_position_embeddings,
            pad_token_id: t.pad_token_id,
            bos_token_id: t.bos_token_id,
            eos_token_ids,
            rope,
            layers,
            norm_offset,
            query_scale,
            v_norm,
            raw_text: tc,
            raw,
        })
    }

    pub fn rope_for(&self, kind: AttnKind) -> &RopeSpec {
        &self.rope[kind.name()]
    }

    /// sqrt(hidden_size) as the embedding multiplier, rounded to the weight dtype (transformers casts it).
    pub fn embed_scale(&self, dt: crate::weights::DType) -> f32 {
        round_to(dt, (self.hidden_size as f64).sqrt() as f32)
    }
    pub fn ple_embed_scale(&self, dt: crate::weights::DType) -> f32 {
        round_to(dt, (self.ple_dim as f64).sqrt() as f32)
    }
}

/// Round an f32 through a storage dtype (what `tensor.to(weight.dtype)` does to a scalar).
pub fn round_to(dt: crate::weights::DType, x: f32) -> f32 {
    use crate::weights::DType;
    match dt {
        DType::F32 => x,
        DType::BF16 => half::bf16::from_f32(x).to_f32(),
        DType::F16 => half::f16::from_f32(x).to_f32(),
    }
}

/// The architecture named by `model_type` (the text config's, else the top level's).
fn arch_of(raw: &Value, tc: &Value, path: &Path) -> Result<Arch> {
    let ty = |o: &Value| {
        o.get("model_type")
            .and_then(|v| v.as_str())
            .unwrap_or("")
            .to_string()
    };
    let (model_type, top_type) = (ty(tc), ty(raw));
    for t in [&model_type, &top_type] {
        match t.as_str() {
            "gemma4_text" | "gemma4" => return Ok(Arch::Gemma4),
            "gemma3_text" | "gemma3" => return Ok(Arch::Gemma3),
            _ => {}
        }
    }
    let found = if model_type.is_empty() {
        top_type
    } else {
        model_type
    };
    let m = format!("expected gemma4 / gemma4_text / gemma3 / gemma3_text, found {found:?}");
    Err(Error::config(path, "model_type", m))
}

/// Features hexq does not run: refuse by field name rather than compute something else.
fn refuse_unsupported(fl: &Fields, t: &TextFields) -> Result<()> {
    if t.enable_moe_block {
        return Err(fl.err("enable_moe_block", "MoE Gemma-4 variants are not supported"));
    }
    if t.attention_bias {
        return Err(fl.err(
            "attention_bias",
            "attention biases are not supported (Gemma-4 has none)",
        ));
    }
    if let Some(b) = t
        .use_bidirectional_attention
        .as_ref()
        .filter(|b| **b != Value::Bool(false))
    {
        return Err(fl.err(
            "use_bidirectional_attention",
            format!("{b} is not supported: hexq runs the causal decoder"),
        ));
    }
    if let Some(c) = t.attn_logit_softcapping {
        let m = format!("{c} is not supported (hexq's attention has no logit softcap)");
        return Err(fl.err("attn_logit_softcapping", m));
    }
    if t.hidden_activation != "gelu_pytorch_tanh" {
        let act = &t.hidden_activation;
        return Err(fl.err(
            "hidden_activation",
            format!("{act:?} is not supported (expected gelu_pytorch_tanh)"),
        ));
    }
    Ok(())
}

/// layer_types: default 5 sliding : 1 full; Gemma-4 forces the last layer full (as transformers does).
fn layer_kinds(fl: &Fields, t: &TextFields, n: usize, arch: Arch) -> Result<Vec<AttnKind>> {
    let mut kinds: Vec<AttnKind> = match &t.layer_types {
        None => (0..n)
            .map(|i| {
                if (i + 1) % 6 == 0 {
                    AttnKind::Full
                } else {
                    AttnKind::Sliding
                }
            })
            .collect(),
        Some(a) => {
            if a.len() != n {
                let m = format!("has {} entries, num_hidden_layers is {n}", a.len());
                return Err(fl.err("layer_types", m));
            }
            a.iter()
                .enumerate()
                .map(|(i, t)| match t.as_str() {
                    Some("sliding_attention") => Ok(AttnKind::Sliding),
                    Some("full_attention") => Ok(AttnKind::Full),
                    _ => Err(fl.err(
                        &format!("layer_types[{i}]"),
                        format!("unknown layer type {t}"),
                    )),
                })
                .collect::<Result<_>>()?
        }
    };
    if arch == Arch::Gemma4 {
        *kinds.last_mut().expect("num_hidden_layers > 0") = AttnKind::Full;
    }
    Ok(kinds)
}

/// Per-layer head_dim and KV heads: full layers' from per_layer_config (5.23 on disk) or global_head_dim
/// (the kwarg form).
fn layer_heads(
    fl: &Fields,
    t: &TextFields,
    kinds: &[AttnKind],
) -> Result<(Vec<usize>, Vec<usize>)> {
    let n = kinds.len();
    let mut hd = vec![t.head_dim; n];
    let mut kvh = vec![t.num_key_value_heads; n];
    match &t.per_layer_config {
        Some(plc) => {
            for (k, v) in plc {
                let f = format!("per_layer_config.{k}");
                let i: usize = k
                    .parse()
                    .map_err(|_| fl.err(&f, "key is not a layer index"))?;
                if i >= n {
                    return Err(fl.err(&f, format!("layer index {i} >= num_hidden_layers {n}")));
                }
                let vo = v.as_object().ok_or_else(|| fl.err(&f, "not an object"))?;
                for (kk, vv) in vo {
                    match (kk.as_str(), vv.as_u64().map(|u| u as usize)) {
                        ("head_dim", Some(x)) => hd[i] = x,
                        ("num_key_value_heads", Some(x)) => kvh[i] = x,
                        _ => {
                            let m = format!("unsupported per-layer override {vv}");
                            return Err(fl.err(&format!("{f}.{kk}"), m));
                        }
                    }
                }
            }
        }
        None => {
            for i in (0..n).filter(|&i| kinds[i] == AttnKind::Full) {
                hd[i] = t.global_head_dim;
                if let (true, Some(g)) = (t.attention_k_eq_v, t.num_global_key_value_heads) {
                    kvh[i] = g;
                }
            }
        }
    }
    let hq = t.num_attention_heads;
    for i in 0..n {
        if kvh[i] == 0 || !hq.is_multiple_of(kvh[i]) {
            let m = format!(
                "layer {i}: {} KV heads do not divide {hq} query heads",
                kvh[i]
            );
            return Err(fl.err("per_layer_config", m));
        }
    }
    Ok((hd, kvh))
}

/// RoPE per layer type present: rope_parameters, or Gemma-4's defaults (default θ 1e4 sliding,
/// proportional θ 1e6 with ¼ rotated on full layers).
fn rope_specs(
    fl: &Fields,
    t: &TextFields,
    kinds: &[AttnKind],
    hd: &[usize],
) -> Result<BTreeMap<String, RopeSpec>> {
    let mut rope = BTreeMap::new();
    for kind in [AttnKind::Sliding, AttnKind::Full] {
        if !kinds.contains(&kind) {
            continue;
        }
        let f = format!("rope_parameters.{}", kind.name());
        let (rt, theta, prf, factor) = match t.rope_parameters.as_ref().map(|r| r.get(kind.name()))
        {
            Some(Some(o)) => {
                let theta = o
                    .rope_theta
                    .ok_or_else(|| fl.err(&f, "missing rope_theta"))?;
                (
                    o.rope_type.clone(),
                    theta,
                    o.partial_rotary_factor,
                    o.factor,
                )
            }
            Some(None) => return Err(fl.err(&f, "missing")),
            None => match kind {
                AttnKind::Sliding => ("default".into(), 10_000.0, 1.0, 1.0),
                AttnKind::Full => ("proportional".into(), 1_000_000.0, 0.25, 1.0),
            },
        };
        let of_kind: Vec<usize> = (0..kinds.len())
            .filter(|&i| kinds[i] == kind)
            .map(|i| hd[i])
            .collect();
        let d = of_kind[0];
        if of_kind.iter().any(|&x| x != d) {
            return Err(fl.err(
                "per_layer_config",
                format!("{} layers disagree on head_dim", kind.name()),
            ));
        }
        let rotated = match rt.as_str() {
            // linear: the default rotation, positions divided by `factor` (RopeSpec::inv_freq).
            "default" | "linear" => d / 2,
            "proportional" => ((prf * d as f64) as usize / 2).min(d / 2),
            other => {
                let m = format!("{other:?} is not supported (default, linear, proportional)");
                return Err(fl.err(&format!("{f}.rope_type"), m));
            }
        };
        let spec = RopeSpec {
            rope_type: rt,
            theta,
            partial_rotary_factor: prf,
            factor,
            head_dim: d,
            rotated,
        };
        rope.insert(kind.name().to_string(), spec);
    }
    Ok(rope)
}

/// KV sharing (Gemma4TextConfig.kv_sharing_modes): the last `num_kv_shared_layers` layers reuse the K/V of
/// the last earlier layer of their type. Returns each layer's mode and K/V source.
fn kv_sharing(
    fl: &Fields,
    t: &TextFields,
    kinds: &[AttnKind],
) -> Result<(Vec<KvMode>, Vec<usize>)> {
    let n = kinds.len();
    let first_shared = n - t.num_kv_shared_layers;
    let mut modes = vec![KvMode::Own; n];
    let mut source: Vec<usize> = (0..n).collect();
    if t.num_kv_shared_layers == 0 {
        return Ok((modes, source));
    }
    let mut store_of = BTreeMap::new();
    for kind in [AttnKind::Sliding, AttnKind::Full] {
        if !kinds.contains(&kind) {
            continue;
        }
        let s = (0..first_shared)
            .rev()
            .find(|&i| kinds[i] == kind)
            .ok_or_else(|| {
                let m = format!(
                    "no non-shared {} layer to provide the shared KV",
                    kind.name()
                );
                fl.err("num_kv_shared_layers", m)
            })?;
        modes[s] = KvMode::Store;
        store_of.insert(kind, s);
    }
    for i in first_shared..n {
        modes[i] = KvMode::Reuse;
        source[i] = store_of[&kinds[i]];
    }
    Ok((modes, source))
}

/// Gemma-3's fields in Gemma-4's terms: no per-layer embeddings, KV sharing, double-wide MLP or k = v; full
/// layers keep head_dim; RoPE from rope_parameters, or (older configs) rope_theta + rope_scaling for full
/// layers and rope_local_base_freq for sliding ones.
fn gemma3_fields(t: &mut TextFields) {
    t.hidden_size_per_layer_input = 0;
    t.num_kv_shared_layers = 0;
    t.use_double_wide_mlp = false;
    t.attention_k_eq_v = false;
    t.per_layer_config = None;
    t.global_head_dim = t.head_dim;
    if t.rope_parameters.is_none() {
        let plain = |theta: f64| RopeFields {
            rope_type: d::rope_type(),
            rope_theta: Some(theta),
            partial_rotary_factor: 1.0,
            factor: 1.0,
        };
        let mut full = t.rope_scaling.clone().unwrap_or(plain(0.0));
        full.rope_theta = Some(t.rope_theta.unwrap_or(1_000_000.0));
        let sliding = plain(t.rope_local_base_freq.unwrap_or(10_000.0));
        let m = [("full_attention", full), ("sliding_attention", sliding)];
        t.rope_parameters = Some(m.into_iter().map(|(k, v)| (k.to_string(), v)).collect());
    }
}
