//! The one table of Gemma-4 text tensors: names (relative to the layout's prefix), shapes and roles.
//! Loader checks, `hexq synth`, `hexq inspect`, the exporters and the ablation classes all read it.

use crate::config::{KvMode, ModelConfig};
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

pub fn layer(i: usize, t: &str) -> String {
    format!("layers.{i}.{t}")
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
        let i = Some(l.index);
        let (d, hq, hkv) = (l.head_dim, c.num_heads, l.num_kv_heads);
        for n in [
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ] {
            push(
                layer(l.index, &format!("{n}.weight")),
                vec![h],
                Role::Norm,
                i,
            );
        }
        push(
            layer(l.index, "self_attn.q_proj.weight"),
            vec![hq * d, h],
            Role::Attention,
            i,
        );
        push(
            layer(l.index, "self_attn.q_norm.weight"),
            vec![d],
            Role::Norm,
            i,
        );
        if l.kv_mode != KvMode::Reuse {
            push(
                layer(l.index, "self_attn.k_proj.weight"),
                vec![hkv * d, h],
                Role::Attention,
                i,
            );
            if !l.k_eq_v {
                push(
                    layer(l.index, "self_attn.v_proj.weight"),
                    vec![hkv * d, h],
                    Role::Attention,
                    i,
                );
            }
            push(
                layer(l.index, "self_attn.k_norm.weight"),
                vec![d],
                Role::Norm,
                i,
            );
        }
        push(
            layer(l.index, "self_attn.o_proj.weight"),
            vec![h, hq * d],
            Role::Attention,
            i,
        );
        push(
            layer(l.index, "mlp.gate_proj.weight"),
            vec![l.mlp_width, h],
            Role::Mlp,
            i,
        );
        push(
            layer(l.index, "mlp.up_proj.weight"),
            vec![l.mlp_width, h],
            Role::Mlp,
            i,
        );
        push(
            layer(l.index, "mlp.down_proj.weight"),
            vec![h, l.mlp_width],
            Role::Mlp,
            i,
        );
        if c.ple_dim > 0 {
            push(
                layer(l.index, "per_layer_input_gate.weight"),
                vec![c.ple_dim, h],
                Role::Ple,
                i,
            );
            push(
                layer(l.index, "per_layer_projection.weight"),
                vec![h, c.ple_dim],
                Role::Ple,
                i,
            );
            push(
                layer(l.index, "post_per_layer_input_norm.weight"),
                vec![h],
                Role::Norm,
                i,
            );
        }
        push(layer(l.index, "layer_scalar"), vec![1], Role::Norm, i);
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
