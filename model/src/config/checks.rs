//! The config's sizes checked before anything is sized by them: every dimension positive, the heads
//! consistent, and no width beyond what a graph or buffer can hold.

use super::{Fields, TextFields};
use crate::Result;

/// (hidden_size, intermediate_size, num_hidden_layers), each dimension positive and the heads consistent.
pub(super) fn check_dims(fl: &Fields, t: &TextFields) -> Result<(usize, usize, usize)> {
    let hidden = fl.required(t.hidden_size, "hidden_size")?;
    let inter = fl.required(t.intermediate_size, "intermediate_size")?;
    let layers = fl.required(t.num_hidden_layers, "num_hidden_layers")?;
    for (field, v) in [
        ("num_hidden_layers", layers),
        ("hidden_size", hidden),
        ("intermediate_size", inter),
        ("vocab_size", t.vocab_size),
        ("num_attention_heads", t.num_attention_heads),
        ("num_key_value_heads", t.num_key_value_heads),
        ("head_dim", t.head_dim),
        ("sliding_window", t.sliding_window),
        ("max_position_embeddings", t.max_position_embeddings),
    ] {
        if v == 0 {
            return Err(fl.err(field, "must be positive"));
        }
    }
    let (hq, hkv) = (t.num_attention_heads, t.num_key_value_heads);
    if hq % hkv != 0 {
        return Err(fl.err(
            "num_key_value_heads",
            format!("{hkv} does not divide num_attention_heads {hq}"),
        ));
    }
    if t.num_kv_shared_layers >= layers {
        let n = t.num_kv_shared_layers;
        return Err(fl.err(
            "num_kv_shared_layers",
            format!("{n} >= num_hidden_layers {layers}"),
        ));
    }
    Ok((hidden, inter, layers))
}

/// Widths no tensor library allocates (ONNX and QNN dimensions are 32-bit; hexq indexes rows by usize but
/// builds graphs from the config alone): refused before any table, graph or buffer is sized by them.
const MAX_DIM: usize = 1 << 24;
/// The decoder's bf16 bytes, estimated from the widths, above which nothing here could hold the weights.
const MAX_WEIGHT_BYTES: u128 = 1 << 40;

/// Every width at most [`MAX_DIM`], and the weights those widths imply at most [`MAX_WEIGHT_BYTES`] (naming
/// the field whose tensors carry most of them).
pub(super) fn check_sizes(
    fl: &Fields,
    t: &TextFields,
    hidden: usize,
    inter: usize,
    layers: usize,
) -> Result<()> {
    let dims = [
        ("hidden_size", hidden),
        ("intermediate_size", inter),
        ("num_hidden_layers", layers),
        ("num_attention_heads", t.num_attention_heads),
        ("num_key_value_heads", t.num_key_value_heads),
        ("head_dim", t.head_dim),
        ("global_head_dim", t.global_head_dim),
        ("vocab_size", t.vocab_size),
        ("hidden_size_per_layer_input", t.hidden_size_per_layer_input),
        ("vocab_size_per_layer_input", t.vocab_size_per_layer_input),
    ];
    for (field, v) in dims {
        if v > MAX_DIM {
            return Err(fl.err(
                field,
                format!("{v} exceeds {MAX_DIM}: no graph or buffer of that width can be allocated"),
            ));
        }
    }
    let (h, l) = (hidden as u128, layers as u128);
    let hd = t.head_dim.max(t.global_head_dim) as u128;
    let per = [
        ("vocab_size", t.vocab_size as u128 * h),
        ("intermediate_size", l * 3 * h * inter as u128 * 2),
        (
            "num_attention_heads",
            l * 2 * h * hd * t.num_attention_heads as u128,
        ),
        (
            "num_key_value_heads",
            l * 2 * h * hd * t.num_key_value_heads as u128,
        ),
        (
            "vocab_size_per_layer_input",
            t.vocab_size_per_layer_input as u128 * l * t.hidden_size_per_layer_input as u128,
        ),
    ];
    let bytes: u128 = per.iter().map(|(_, n)| 2 * n).sum();
    if bytes > MAX_WEIGHT_BYTES {
        let (field, _) = per.iter().max_by_key(|(_, n)| *n).expect("five terms");
        return Err(fl.err(
            field,
            format!(
                "the config implies about {:.1} TiB of bf16 weights (hidden_size {hidden}, {layers} layers): more \
                 than can be allocated",
                bytes as f64 / (1u64 << 40) as f64
            ),
        ));
    }
    Ok(())
}
