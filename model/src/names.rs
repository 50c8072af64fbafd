//! The one table of Gemma-4 text tensors: names (relative to the layout's prefix), shapes and roles.
//! Loader checks, `hexq synth`, `hexq inspect`, the exporters and the ablation classes all read it.

use crate::config::{Arch, Fold, KvMode, LayerSpec, ModelConfig};
use serde::Serialize;

/// What a tensor is for; decides host vs graph placement and ablation class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Vocab-sized token embedding (also the tied lm_head). Host-side.
    TokenEmbedding,
    /// Vocab-sized per-layer token embedding. Host-side.
    PleEmbedding,
    /// Untied lm_head (only when tie_word_embeddings is false). Host-side.
    LmHead,
    /// Attention projections q/k/v/o.
    Attention,
    /// gate/up/down.
    Mlp,
    /// Per-layer-input gate/projection and the model-level PLE projection.
    Ple,
    /// RMSNorm weights and layer scalars.
    Norm,
}

impl Role {
    pub fn is_vocab(self) -> bool {
        matches!(
            self,
            Role::TokenEmbedding | Role::PleEmbedding | Role::LmHead
        )
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct TensorSpec {
    /// Name relative to the text-model prefix, e.g. `layers.3.self_attn.q_proj.weight`.
    pub name: String,
    pub shape: Vec<usize>,
    pub role: Role,
    /// Layer index, for per-layer tensors.
    pub layer: Option<usize>,
}

impl TensorSpec {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

pub const EMBED: &str = "embed_tokens.weight";
pub const EMBED_PLE: &str = "embed_tokens_per_layer.weight";
pub const PLE_PROJ: &str = "per_layer_model_projection.weight";
pub const PLE_PROJ_NORM: &str = "per_layer_projection_norm.weight";
pub const FINAL_NORM: &str = "norm.weight";
/// Untied head, outside the model prefix.
pub const LM_HEAD: &str = "lm_head.weight";

/// Model-level tensors: (HF name relative to the prefix, GGUF name) — gguf-py's tensor map for GEMMA4.
pub const GLOBAL_TENSORS: [(&str, &str); 5] = [
    (EMBED, "token_embd.weight"),
    (EMBED_PLE, "per_layer_token_embd.weight"),
    (PLE_PROJ, "per_layer_model_proj.weight"),
    (PLE_PROJ_NORM, "per_layer_proj_norm.weight"),
    (FINAL_NORM, "output_norm.weight"),
];

/// The per-layer tensors (gguf-py's `MODEL_TENSOR`): every reader of a layer's weights names them
/// through this enum, and [`LAYER_TENSORS`] holds each one's facts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LayerTensor {
    InputNorm,
    PostAttnNorm,
    PreFfnNorm,
    PostFfnNorm,
    Q,
    QNorm,
    K,
    V,
    KNorm,
    O,
    Gate,
    Up,
    Down,
    PleGate,
    PleProj,
    PlePostNorm,
    Scalar,
}

/// When a layer has the tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Presence {
    Always,
    /// Layers that compute their own K/V (not KV-sharing readers).
    OwnsKv,
    /// Layers that own K/V with a separate value projection (not `attention_k_eq_v`).
    OwnsV,
    /// Models with per-layer embeddings.
    Ple,
    /// Gemma-4 only (the layer scalar).
    Gemma4,
}

/// One row of the table: the tensor's names, role, presence and shape rule.
pub struct LayerTensorDef {
    pub t: LayerTensor,
    /// Name under `layers.{i}.` (transformers' state_dict).
    pub hf: &'static str,
    /// Name under `blk.{i}.` (llama.cpp's converter).
    pub gguf: &'static str,
    pub role: Role,
    pub when: Presence,
    pub shape: fn(&ModelConfig, &LayerSpec) -> Vec<usize>,
}

use LayerTensor as L;
use Presence as P;

/// Every per-layer tensor, in checkpoint order.
#[rustfmt::skip]
pub const LAYER_TENSORS: [LayerTensorDef; 17] = [
    LayerTensorDef { t: L::InputNorm, hf: "input_layernorm.weight", gguf: "attn_norm.weight", role: Role::Norm, when: P::Always, shape: |c, _| vec![c.hidden_size] },
    LayerTensorDef { t: L::PostAttnNorm, hf: "post_attention_layernorm.weight", gguf: "post_attention_norm.weight", role: Role::Norm, when: P::Always, shape: |c, _| vec![c.hidden_size] },
    LayerTensorDef { t: L::PreFfnNorm, hf: "pre_feedforward_layernorm.weight", gguf: "ffn_norm.weight", role: Role::Norm, when: P::Always, shape: |c, _| vec![c.hidden_size] },
    LayerTensorDef { t: L::PostFfnNorm, hf: "post_feedforward_layernorm.weight", gguf: "post_ffw_norm.weight", role: Role::Norm, when: P::Always, shape: |c, _| vec![c.hidden_size] },
    LayerTensorDef { t: L::Q, hf: "self_attn.q_proj.weight", gguf: "attn_q.weight", role: Role::Attention, when: P::Always, shape: |c, l| vec![c.num_heads * l.head_dim, c.hidden_size] },
    LayerTensorDef { t: L::QNorm, hf: "self_attn.q_norm.weight", gguf: "attn_q_norm.weight", role: Role::Norm, when: P::Always, shape: |_, l| vec![l.head_dim] },
    LayerTensorDef { t: L::K, hf: "self_attn.k_proj.weight", gguf: "attn_k.weight", role: Role::Attention, when: P::OwnsKv, shape: |c, l| vec![l.num_kv_heads * l.head_dim, c.hidden_size] },
    LayerTensorDef { t: L::V, hf: "self_attn.v_proj.weight", gguf: "attn_v.weight", role: Role::Attention, when: P::OwnsV, shape: |c, l| vec![l.num_kv_heads * l.head_dim, c.hidden_size] },
    LayerTensorDef { t: L::KNorm, hf: "self_attn.k_norm.weight", gguf: "attn_k_norm.weight", role: Role::Norm, when: P::OwnsKv, shape: |_, l| vec![l.head_dim] },
    LayerTensorDef { t: L::O, hf: "self_attn.o_proj.weight", gguf: "attn_output.weight", role: Role::Attention, when: P::Always, shape: |c, l| vec![c.hidden_size, c.num_heads * l.head_dim] },
    LayerTensorDef { t: L::Gate, hf: "mlp.gate_proj.weight", gguf: "ffn_gate.weight", role: Role::Mlp, when: P::Always, shape: |c, l| vec![l.mlp_width, c.hidden_size] },
    LayerTensorDef { t: L::Up, hf: "mlp.up_proj.weight", gguf: "ffn_up.weight", role: Role::Mlp, when: P::Always, shape: |c, l| vec![l.mlp_width, c.hidden_size] },
    LayerTensorDef { t: L::Down, hf: "mlp.down_proj.weight", gguf: "ffn_down.weight", role: Role::Mlp, when: P::Always, shape: |c, l| vec![c.hidden_size, l.mlp_width] },
    LayerTensorDef { t: L::PleGate, hf: "per_layer_input_gate.weight", gguf: "inp_gate.weight", role: Role::Ple, when: P::Ple, shape: |c, _| vec![c.ple_dim, c.hidden_size] },
    LayerTensorDef { t: L::PleProj, hf: "per_layer_projection.weight", gguf: "proj.weight", role: Role::Ple, when: P::Ple, shape: |c, _| vec![c.hidden_size, c.ple_dim] },
    LayerTensorDef { t: L::PlePostNorm, hf: "post_per_layer_input_norm.weight", gguf: "post_norm.weight", role: Role::Norm, when: P::Ple, shape: |c, _| vec![c.hidden_size] },
    LayerTensorDef { t: L::Scalar, hf: "layer_scalar", gguf: "layer_output_scale.weight", role: Role::Norm, when: P::Gemma4, shape: |_, _| vec![1] },
];

impl LayerTensor {
    pub fn def(self) -> &'static LayerTensorDef {
        LAYER_TENSORS
            .iter()
            .find(|d| d.t == self)
            .expect("every LayerTensor has a row")
    }
    /// Checkpoint name relative to the prefix: `layers.{i}.<hf>`.
    pub fn name(self, i: usize) -> String {
        format!("layers.{i}.{}", self.def().hf)
    }
    /// The module path without `.weight` (graph node names: `layers.{i}.self_attn.q_proj`).
    pub fn module(self, i: usize) -> String {
        format!("layers.{i}.{}", self.def().hf.trim_end_matches(".weight"))
    }
    /// `layers.{i}.<hf>` → (i, tensor).
    pub fn parse(name: &str) -> Option<(usize, LayerTensor)> {
        let (i, t) = name.strip_prefix("layers.")?.split_once('.')?;
        let d = LAYER_TENSORS.iter().find(|d| d.hf == t)?;
        Some((i.parse().ok()?, d.t))
    }
    /// The RMSNorm whose output this projection reads (q/k/v: the input norm; gate/up: the pre-FFN norm).
    pub fn input_norm(self) -> Option<LayerTensor> {
        match self {
            L::Q | L::K | L::V => Some(L::InputNorm),
            L::Gate | L::Up => Some(L::PreFfnNorm),
            _ => None,
        }
    }
    /// Whether layer `l` of a model `c` has this tensor.
    pub fn present(self, c: &ModelConfig, l: &LayerSpec) -> bool {
        match self.def().when {
            Presence::Always => true,
            Presence::OwnsKv => l.kv_mode != KvMode::Reuse,
            Presence::OwnsV => l.kv_mode != KvMode::Reuse && !l.k_eq_v,
            Presence::Ple => c.ple_dim > 0,
            Presence::Gemma4 => c.arch == Arch::Gemma4,
        }
    }
}

/// How a checkpoint tensor (prefix-relative name) reads as f32 in Gemma-4's form: RMSNorm weights gain the
/// config's norm offset (Gemma-3: 1 + w), q_norm also carries the attention scaling (query_pre_attn_scalar^-½);
/// everything else reads as stored.
pub fn fold(c: &ModelConfig, name: &str) -> Fold {
    let norm = Fold {
        add: c.norm_offset,
        mul: 1.0,
    };
    if name == FINAL_NORM || name == PLE_PROJ_NORM {
        return norm;
    }
    match LayerTensor::parse(name).map(|(_, t)| t) {
        Some(LayerTensor::QNorm) => Fold {
            mul: c.query_scale,
            ..norm
        },
        Some(t) if t.def().role == Role::Norm && t != LayerTensor::Scalar => norm,
        _ => Fold::IDENTITY,
    }
}

/// Checkpoint tensor (prefix-relative) → GGUF name, from the two tables.
pub fn gguf_name(hf: &str) -> Option<String> {
    if let Some((_, g)) = GLOBAL_TENSORS.iter().find(|(h, _)| *h == hf) {
        return Some(g.to_string());
    }
    let (i, t) = LayerTensor::parse(hf)?;
    Some(format!("blk.{i}.{}", t.def().gguf))
}

/// Every tensor the text decoder reads, in checkpoint order (as transformers' state_dict lists them).
pub fn expected_tensors(c: &ModelConfig) -> Vec<TensorSpec> {
    let h = c.hidden_size;
    let mut v = Vec::new();
    let mut push = |name: String, shape: Vec<usize>, role: Role, layer: Option<usize>| {
        v.push(TensorSpec {
            name,
            shape,
            role,
            layer,
        })
    };
    push(
        EMBED.into(),
        vec![c.vocab_size, h],
        Role::TokenEmbedding,
        None,
    );
    if c.ple_dim > 0 {
        let lp = c.num_layers * c.ple_dim;
        push(
            EMBED_PLE.into(),
            vec![c.ple_vocab, lp],
            Role::PleEmbedding,
            None,
        );
        push(PLE_PROJ.into(), vec![lp, h], Role::Ple, None);
        push(PLE_PROJ_NORM.into(), vec![c.ple_dim], Role::Norm, None);
    }
    for l in &c.layers {
        for d in &LAYER_TENSORS {
            if d.t.present(c, l) {
                push(d.t.name(l.index), (d.shape)(c, l), d.role, Some(l.index));
            }
        }
    }
    push(FINAL_NORM.into(), vec![h], Role::Norm, None);
    if !c.tie_word_embeddings {
        // Lives outside the text prefix; the loader resolves it specially.
        push(LM_HEAD.into(), vec![c.vocab_size, h], Role::LmHead, None);
    }
    v
}

/// Parameter counts split the way `hexq inspect` reports them.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ParamCounts {
    pub decoder: usize,
    pub token_embedding: usize,
    pub per_layer_embedding: usize,
    pub lm_head_untied: usize,
    pub total: usize,
}

pub fn param_counts(c: &ModelConfig) -> ParamCounts {
    let mut p = ParamCounts::default();
    for t in expected_tensors(c) {
        let n = t.numel();
        match t.role {
            Role::TokenEmbedding => p.token_embedding += n,
            Role::PleEmbedding => p.per_layer_embedding += n,
            Role::LmHead => p.lm_head_untied += n,
            _ => p.decoder += n,
        }
        p.total += n;
    }
    p
}
