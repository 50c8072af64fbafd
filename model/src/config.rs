//! Gemma-4 text config: the raw `config.json` fields (as transformers 5.23 writes them) and the per-layer
//! facts derived from them, the way `Gemma4TextConfig.__post_init__` / `kv_sharing_modes` derive them.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

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

/// Checkpoint layout: where the text decoder's tensors live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Layout {
    /// `Gemma4ForConditionalGeneration`: text config under `text_config`, tensors under `model.language_model.`.
    Multimodal,
    /// `Gemma4ForCausalLM`: top-level text config, tensors under `model.`.
    CausalLm,
}

/// The derived, validated text-decoder config.
#[derive(Debug, Clone, Serialize)]
pub struct ModelConfig {
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
    /// The text config object exactly as read (for writers that must reproduce it, e.g. GGUF metadata).
    #[serde(skip)]
    pub raw_text: Value,
    #[serde(skip)]
    pub raw: Value,
}

fn get<'a>(o: &'a Value, k: &str) -> Option<&'a Value> {
    o.get(k).filter(|v| !v.is_null())
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
        let p: PathBuf = path.to_path_buf();
        let cerr = |field: &str, msg: String| Error::config(&p, field, msg);
        if !raw.is_object() {
            return Err(Error::file(path, "config is not a JSON object"));
        }
        let (layout, tc) = match get(&raw, "text_config") {
            Some(tc) => (Layout::Multimodal, tc.clone()),
            None => (Layout::CausalLm, raw.clone()),
        };
        let model_type = get(&tc, "model_type")
            .and_then(|v| v.as_str())
            .unwrap_or("");
        let top_type = get(&raw, "model_type")
            .and_then(|v| v.as_str())
            .unwrap_or("");
        if !(model_type == "gemma4_text" || model_type == "gemma4" || top_type == "gemma4") {
            return Err(cerr(
                "model_type",
                format!(
                    "expected gemma4 / gemma4_text, found {:?}",
                    if model_type.is_empty() {
                        top_type
                    } else {
                        model_type
                    }
                ),
            ));
        }
        let fpre = if layout == Layout::Multimodal {
            "text_config."
        } else {
            ""
        };
        let name = |k: &str| format!("{fpre}{k}");
        let usize_req = |k: &str| -> Result<usize> {
            get(&tc, k)
                .ok_or_else(|| cerr(&name(k), "missing".into()))?
                .as_u64()
                .map(|u| u as usize)
                .ok_or_else(|| cerr(&name(k), "not a non-negative integer".into()))
        };
        let usize_or = |k: &str, d: usize| -> Result<usize> {
            match get(&tc, k) {
                None => Ok(d),
                Some(v) => v
                    .as_u64()
                    .map(|u| u as usize)
                    .ok_or_else(|| cerr(&name(k), "not a non-negative integer".into())),
            }
        };
        let f64_or = |k: &str, d: f64| -> Result<f64> {
            match get(&tc, k) {
                None => Ok(d),
                Some(v) => v
                    .as_f64()
                    .ok_or_else(|| cerr(&name(k), "not a number".into())),
            }
        };
        let bool_or = |k: &str, d: bool| -> Result<bool> {
            match get(&tc, k) {
                None => Ok(d),
                Some(v) => v
                    .as_bool()
                    .ok_or_else(|| cerr(&name(k), "not a boolean".into())),
            }
        };

        // Features hexq does not run: refuse by field name rather than compute something else.
        if bool_or("enable_moe_block", false)? {
            return Err(cerr(
                &name("enable_moe_block"),
                "MoE Gemma-4 variants are not supported".into(),
            ));
        }
        if bool_or("attention_bias", false)? {
            return Err(cerr(
                &name("attention_bias"),
                "attention biases are not supported (Gemma-4 has none)".into(),
            ));
        }
        if let Some(b) = get(&tc, "use_bidirectional_attention") {
            return Err(cerr(
                &name("use_bidirectional_attention"),
                format!("{b} is not supported: hexq runs the causal decoder"),
            ));
        }
        let act = get(&tc, "hidden_activation")
            .and_then(|v| v.as_str())
            .unwrap_or("gelu_pytorch_tanh");
        if act != "gelu_pytorch_tanh" {
            return Err(cerr(
                &name("hidden_activation"),
                format!("{act:?} is not supported (expected gelu_pytorch_tanh)"),
            ));
        }

        let hidden_size = usize_req("hidden_size")?;
        let intermediate_size = usize_req("intermediate_size")?;
        let num_layers = usize_req("num_hidden_layers")?;
        let num_heads = usize_or("num_attention_heads", 8)?;
        let num_kv_heads = usize_or("num_key_value_heads", 4)?;
        let head_dim = usize_or("head_dim", 256)?;
        let vocab_size = usize_or("vocab_size", 262_144)?;
        let sliding_window = usize_or("sliding_window", 512)?;
        let num_kv_shared_layers = usize_or("num_kv_shared_layers", 0)?;
        let double_wide = bool_or("use_double_wide_mlp", false)?;
        let k_eq_v = bool_or("attention_k_eq_v", false)?;
        let ple_dim = usize_or("hidden_size_per_layer_input", 256)?;
        let ple_vocab = usize_or("vocab_size_per_layer_input", 262_144)?;
        if num_layers == 0
            || hidden_size == 0
            || num_heads == 0
            || num_kv_heads == 0
            || head_dim == 0
        {
            return Err(cerr(
                &name("num_hidden_layers"),
                "dimensions must be positive".into(),
            ));
        }
        if num_heads % num_kv_heads != 0 {
            return Err(cerr(
                &name("num_key_value_heads"),
                format!("{num_kv_heads} does not divide num_attention_heads {num_heads}"),
            ));
        }
        if num_kv_shared_layers >= num_layers {
            return Err(cerr(
                &name("num_kv_shared_layers"),
                format!("{num_kv_shared_layers} >= num_hidden_layers {num_layers}"),
            ));
        }
        let softcap = match get(&tc, "final_logit_softcapping") {
            None => None,
            Some(v) => Some(
                v.as_f64()
                    .ok_or_else(|| cerr(&name("final_logit_softcapping"), "not a number".into()))?,
            ),
        };

        // layer_types: default 5 sliding : 1 full; the last layer is forced full (as transformers does).
        let mut kinds: Vec<AttnKind> = match get(&tc, "layer_types") {
            None => (0..num_layers)
                .map(|i| {
                    if (i + 1) % 6 == 0 {
                        AttnKind::Full
                    } else {
                        AttnKind::Sliding
                    }
                })
                .collect(),
            Some(v) => {
                let a = v
                    .as_array()
                    .ok_or_else(|| cerr(&name("layer_types"), "not a list".into()))?;
                if a.len() != num_layers {
                    return Err(cerr(
                        &name("layer_types"),
                        format!("has {} entries, num_hidden_layers is {num_layers}", a.len()),
                    ));
                }
                a.iter()
                    .enumerate()
                    .map(|(i, t)| match t.as_str() {
                        Some("sliding_attention") => Ok(AttnKind::Sliding),
                        Some("full_attention") => Ok(AttnKind::Full),
                        _ => Err(cerr(
                            &format!("{}[{i}]", name("layer_types")),
                            format!("unknown layer type {t}"),
                        )),
                    })
                    .collect::<Result<_>>()?
            }
        };
        *kinds.last_mut().unwrap() = AttnKind::Full;

        // Full layers' head_dim / kv heads: per_layer_config (5.23 on disk) or global_head_dim (kwarg form).
        let global_head_dim = usize_or("global_head_dim", 512)?;
        let num_global_kv =
            match get(&tc, "num_global_key_value_heads") {
                None => None,
                Some(v) => Some(v.as_u64().ok_or_else(|| {
                    cerr(&name("num_global_key_value_heads"), "not an integer".into())
                })? as usize),
            };
        let mut layer_hd = vec![head_dim; num_layers];
        let mut layer_kvh = vec![num_kv_heads; num_layers];
        match get(&tc, "per_layer_config") {
            Some(plc) => {
                let o = plc
                    .as_object()
                    .ok_or_else(|| cerr(&name("per_layer_config"), "not an object".into()))?;
                for (k, v) in o {
                    let f = format!("{}.{k}", name("per_layer_config"));
                    let i: usize = k
                        .parse()
                        .map_err(|_| cerr(&f, "key is not a layer index".into()))?;
                    if i >= num_layers {
                        return Err(cerr(
                            &f,
                            format!("layer index {i} >= num_hidden_layers {num_layers}"),
                        ));
                    }
                    let vo = v
                        .as_object()
                        .ok_or_else(|| cerr(&f, "not an object".into()))?;
                    for (kk, vv) in vo {
                        let n = vv.as_u64().map(|u| u as usize);
                        match (kk.as_str(), n) {
                            ("head_dim", Some(n)) => layer_hd[i] = n,
                            ("num_key_value_heads", Some(n)) => layer_kvh[i] = n,
                            _ => {
                                return Err(cerr(
                                    &format!("{f}.{kk}"),
                                    format!("unsupported per-layer override {vv}"),
                                ))
                            }
                        }
                    }
                }
            }
            None => {
                for i in 0..num_layers {
                    if kinds[i] == AttnKind::Full {
                        layer_hd[i] = global_head_dim;
                        if k_eq_v {
                            if let Some(n) = num_global_kv {
                                layer_kvh[i] = n;
                            }
                        }
                    }
                }
            }
        }
        for i in 0..num_layers {
            if layer_kvh[i] == 0 || num_heads % layer_kvh[i] != 0 {
                return Err(cerr(
                    &name("per_layer_config"),
                    format!(
                        "layer {i}: {} KV heads do not divide {num_heads} query heads",
                        layer_kvh[i]
                    ),
                ));
            }
        }

        // RoPE per layer type.
        let mut rope = BTreeMap::new();
        let rp = get(&tc, "rope_parameters");
        for kind in [AttnKind::Sliding, AttnKind::Full] {
            if !kinds.contains(&kind) {
                continue;
            }
            let f = format!("{}.{}", name("rope_parameters"), kind.name());
            let (rt, theta, prf, factor) = match rp.and_then(|r| get(r, kind.name())) {
                Some(o) => (
                    get(o, "rope_type")
                        .and_then(|v| v.as_str())
                        .unwrap_or("default")
                        .to_string(),
                    get(o, "rope_theta")
                        .and_then(|v| v.as_f64())
                        .ok_or_else(|| cerr(&f, "missing rope_theta".into()))?,
                    get(o, "partial_rotary_factor")
                        .and_then(|v| v.as_f64())
                        .unwrap_or(1.0),
                    get(o, "factor").and_then(|v| v.as_f64()).unwrap_or(1.0),
                ),
                None if rp.is_some() => return Err(cerr(&f, "missing".into())),
                None => match kind {
                    AttnKind::Sliding => ("default".into(), 10_000.0, 1.0, 1.0),
                    AttnKind::Full => ("proportional".into(), 1_000_000.0, 0.25, 1.0),
                },
            };
            let hd = (0..num_layers)
                .find(|&i| kinds[i] == kind)
                .map(|i| layer_hd[i])
                .unwrap();
            if (0..num_layers).any(|i| kinds[i] == kind && layer_hd[i] != hd) {
                return Err(cerr(
                    &name("per_layer_config"),
                    format!("{} layers disagree on head_dim", kind.name()),
                ));
            }
            let rotated = match rt.as_str() {
                "default" => hd / 2,
                "proportional" => ((prf * hd as f64) as usize / 2).min(hd / 2),
                other => {
                    return Err(cerr(
                        &format!("{f}.rope_type"),
                        format!("{other:?} is not supported (default, proportional)"),
                    ))
                }
            };
            rope.insert(
                kind.name().to_string(),
                RopeSpec {
                    rope_type: rt,
                    theta,
                    partial_rotary_factor: prf,
                    factor,
                    head_dim: hd,
                    rotated,
                },
            );
        }

        // KV sharing (Gemma4TextConfig.kv_sharing_modes).
        let first_shared = num_layers - num_kv_shared_layers;
        let mut modes = vec![KvMode::Own; num_layers];
        let mut source: Vec<usize> = (0..num_layers).collect();
        if num_kv_shared_layers > 0 {
            let mut store_of = BTreeMap::new();
            for kind in [AttnKind::Sliding, AttnKind::Full] {
                if !kinds.contains(&kind) {
                    continue;
                }
                let s = (0..first_shared)
                    .rev()
                    .find(|&i| kinds[i] == kind)
                    .ok_or_else(|| {
                        cerr(
                            &name("num_kv_shared_layers"),
                            format!(
                                "no non-shared {} layer to provide the shared KV",
                                kind.name()
                            ),
                        )
                    })?;
                modes[s] = KvMode::Store;
                store_of.insert(kind, s);
            }
            for i in first_shared..num_layers {
                modes[i] = KvMode::Reuse;
                source[i] = store_of[&kinds[i]];
            }
        }

        let layers = (0..num_layers)
            .map(|i| LayerSpec {
                index: i,
                kind: kinds[i],
                head_dim: layer_hd[i],
                num_kv_heads: if modes[i] == KvMode::Reuse {
                    layer_kvh[source[i]]
                } else {
                    layer_kvh[i]
                },
                kv_mode: modes[i],
                kv_source: source[i],
                k_eq_v: k_eq_v && kinds[i] == AttnKind::Full,
                mlp_width: intermediate_size
                    * if double_wide && modes[i] == KvMode::Reuse {
                        2
                    } else {
                        1
                    },
                window: (kinds[i] == AttnKind::Sliding).then_some(sliding_window),
            })
            .collect();

        let eos_token_ids = match get(&tc, "eos_token_id") {
            None => vec![1],
            Some(Value::Array(a)) => a
                .iter()
                .filter_map(|v| v.as_u64().map(|u| u as u32))
                .collect(),
            Some(v) => vec![v
                .as_u64()
                .ok_or_else(|| cerr(&name("eos_token_id"), "not an integer".into()))?
                as u32],
        };
        let tie = bool_or(
            "tie_word_embeddings",
            get(&raw, "tie_word_embeddings")
                .and_then(|v| v.as_bool())
                .unwrap_or(true),
        )?;

        Ok(ModelConfig {
            layout,
            prefix: if layout == Layout::Multimodal {
                "model.language_model.".into()
            } else {
                "model.".into()
            },
            vocab_size,
            hidden_size,
            intermediate_size,
            num_layers,
            num_heads,
            rms_norm_eps: f64_or("rms_norm_eps", 1e-6)?,
            sliding_window,
            final_logit_softcapping: softcap,
            tie_word_embeddings: tie,
            ple_dim,
            ple_vocab: if ple_dim > 0 { ple_vocab } else { 0 },
            num_kv_shared_layers,
            max_position_embeddings: usize_or("max_position_embeddings", 131_072)?,
            pad_token_id: usize_or("pad_token_id", 0)? as u32,
            bos_token_id: usize_or("bos_token_id", 2)? as u32,
            eos_token_ids,
            rope,
            layers,
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
