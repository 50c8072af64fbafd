//! config.json from a GGUF's metadata, as transformers' GGUF loader derives it (its `gguf_config_mapping`
//! plus llama.cpp's hard-coded Gemma-3 facts: sliding layers 5 of every 6, local RoPE base 1e4,
//! query_pre_attn_scalar = head_dim).

use crate::{Error, Result};
use hexq_gguf::{GgufFile, Value};
use serde_json::json;

fn req<'a>(g: &'a GgufFile, key: &str) -> Result<&'a Value> {
    g.get(key)
        .ok_or_else(|| Error::gguf(g, format!("metadata key {key} is missing")))
}

fn u(g: &GgufFile, key: &str) -> Result<u64> {
    req(g, key)?
        .as_u64()
        .ok_or_else(|| Error::gguf(g, format!("{key} is not an unsigned integer")))
}

fn f(g: &GgufFile, key: &str) -> Result<f64> {
    req(g, key)?
        .as_f64()
        .ok_or_else(|| Error::gguf(g, format!("{key} is not a number")))
}

/// Gemma3ForCausalLM's config.json for a `gemma3` GGUF.
pub fn gemma3(g: &GgufFile) -> Result<serde_json::Value> {
    let a = "gemma3";
    let layers = u(g, &format!("{a}.block_count"))? as usize;
    let head_dim = u(g, &format!("{a}.attention.key_length"))?;
    let vocab = req(g, "tokenizer.ggml.tokens")?
        .as_array()
        .map(|t| t.len())
        .ok_or_else(|| Error::gguf(g, "tokenizer.ggml.tokens is not an array"))?;
    let layer_types: Vec<&str> = (0..layers)
        .map(|i| {
            if (i + 1) % 6 == 0 {
                "full_attention"
            } else {
                "sliding_attention"
            }
        })
        .collect();
    let mut full =
        json!({"rope_type": "default", "rope_theta": f(g, &format!("{a}.rope.freq_base"))?});
    if let Some(t) = g
        .get(&format!("{a}.rope.scaling.type"))
        .and_then(Value::as_str)
    {
        if t != "none" {
            full["rope_type"] = t.into();
            full["factor"] = f(g, &format!("{a}.rope.scaling.factor"))?.into();
        }
    }
    let softcap = g
        .get(&format!("{a}.final_logit_softcapping"))
        .and_then(Value::as_f64);
    let id = |k: &str, d: u64| {
        g.get(&format!("tokenizer.ggml.{k}"))
            .and_then(Value::as_u64)
            .unwrap_or(d)
    };
    Ok(json!({
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": u(g, &format!("{a}.embedding_length"))?,
        "intermediate_size": u(g, &format!("{a}.feed_forward_length"))?,
        "num_hidden_layers": layers,
        "num_attention_heads": u(g, &format!("{a}.attention.head_count"))?,
        "num_key_value_heads": u(g, &format!("{a}.attention.head_count_kv"))?,
        "head_dim": head_dim,
        "query_pre_attn_scalar": head_dim,
        "rms_norm_eps": f(g, &format!("{a}.attention.layer_norm_rms_epsilon"))?,
        "sliding_window": u(g, &format!("{a}.attention.sliding_window"))?,
        "layer_types": layer_types,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": full,
        },
        "max_position_embeddings": u(g, &format!("{a}.context_length"))?,
        "vocab_size": vocab,
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": softcap,
        "attn_logit_softcapping": null,
        "tie_word_embeddings": g.tensor("output.weight").is_none(),
        "bos_token_id": id("bos_token_id", 2),
        "eos_token_id": id("eos_token_id", 1),
        "pad_token_id": id("padding_token_id", 0),
        "use_bidirectional_attention": false,
        "dtype": "float32",
    }))
}
