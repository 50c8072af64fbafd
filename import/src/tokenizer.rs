//! tokenizer.json, tokenizer_config.json, the chat template and tokenizer.model from a GGUF's SentencePiece
//! vocabulary. tokenizer.json is built
//! the way transformers' GGUF loader builds Gemma's (`gguf_tokenizer_mapping.gemma_tokenizer` +
//! `generate_merges` + `add_gguf_special_tokens`, transformers 5.24): a byte-fallback BPE whose merges are
//! recovered from the vocabulary, best-first in file order; spaces-only tokens respelled with "▁"; control
//! tokens added as special, user-defined ones as plain added tokens. Judged by token ids equal to
//! transformers' tokenizer loaded from the same GGUF (tests/import.rs). tokenizer.model carries the pieces,
//! scores and types as the Gemma repos' SentencePiece model does, and tokenizer_config.json the
//! `added_tokens_decoder`, so llama.cpp's converter rebuilds the GGUF's vocabulary from the import.

use crate::{Error, Result};
use hexq_gguf::{GgufFile, Value};
use serde_json::json;
use std::collections::HashMap;

/// Gemma-3's chat template (the -it models' format: system text folded into the first user turn, roles
/// alternating, `<start_of_turn>role\n… <end_of_turn>\n`). Its ids are Gemma-4's: 105, 106, 2364, 4368, 107.
pub const GEMMA3_CHAT_TEMPLATE: &str = include_str!("../gemma3_chat_template.jinja");

/// Python's `str.isspace` (Unicode White_Space plus the ASCII separators 0x1C–0x1F).
fn py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

fn strings(g: &GgufFile, key: &str) -> Result<Vec<String>> {
    let a = g
        .get(key)
        .and_then(Value::as_array)
        .ok_or_else(|| Error::gguf(g, format!("{key} is missing or not an array")))?;
    a.iter()
        .map(|v| v.as_str().map(str::to_string))
        .collect::<Option<_>>()
        .ok_or_else(|| Error::gguf(g, format!("{key} holds a non-string")))
}

/// `generate_merges(vocab, vocab_scores)`: every split of every token into two vocabulary pieces, sorted by
/// (score, len(left), len(right)) best-first, ties in vocabulary order.
fn merges(tokens: &[String], vocab: &HashMap<&str, usize>) -> Vec<(String, String)> {
    // dict(zip(...)) keeps a repeated token at its first position with its last value.
    let mut seen = HashMap::new();
    let mut order: Vec<&str> = Vec::new();
    for (i, t) in tokens.iter().enumerate() {
        if seen.insert(t.as_str(), -(i as i64)).is_none() {
            order.push(t);
        }
    }
    let mut all: Vec<(&str, &str, i64)> = Vec::new();
    for t in order {
        let score = seen[t];
        let mut local: Vec<(&str, &str, i64)> = t
            .char_indices()
            .skip(1)
            .map(|(k, _)| (&t[..k], &t[k..]))
            .filter(|(l, r)| vocab.contains_key(l) && vocab.contains_key(r))
            .map(|(l, r)| (l, r, score))
            .collect();
        local.sort_by_key(|(l, r, _)| (vocab[l], vocab[r]));
        all.extend(local);
    }
    // sorted(..., key=(score, len(l), len(r)), reverse=True) is stable: a descending stable sort.
    let clen = |s: &str| s.chars().count();
    all.sort_by_key(|a| std::cmp::Reverse((a.2, clen(a.0), clen(a.1))));
    all.into_iter()
        .map(|(l, r, _)| (l.to_string(), r.to_string()))
        .collect()
}

fn added(id: usize, content: &str, special: bool) -> serde_json::Value {
    json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false,
           "normalized": false, "special": special})
}

pub struct Files {
    pub tokenizer_json: String,
    pub tokenizer_config: String,
    pub chat_template: String,
    /// tokenizer.model (SentencePiece ModelProto bytes).
    pub spm: Vec<u8>,
}

/// Gemma's tokenizer.json around a vocabulary: the byte-fallback BPE with the "▁" normalizer, split on spaces,
/// and the decoder that undoes them (Gemma-3 and Gemma-4 share it).
fn gemma_bpe(
    added_tokens: Vec<serde_json::Value>,
    post: serde_json::Value,
    unk: &str,
    vmap: serde_json::Map<String, serde_json::Value>,
    merges: serde_json::Value,
) -> serde_json::Value {
    json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added_tokens,
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"},
        "pre_tokenizer": {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": false},
        "post_processor": post,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {"type": "BPE", "dropout": null, "unk_token": unk, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                  "vocab": vmap, "merges": merges},
    })
}

/// The tokenizer files a GGUF's vocabulary describes: `llama` (SentencePiece: Gemma-3) or `gemma4` (BPE).
pub fn files(g: &GgufFile) -> Result<Files> {
    let model = g
        .get("tokenizer.ggml.model")
        .and_then(Value::as_str)
        .unwrap_or("");
    match model {
        "llama" => spm_files(g),
        "gemma4" => gemma4_files(g),
        _ => Err(Error::gguf(g, format!("tokenizer.ggml.model {model:?}: hexq rebuilds SentencePiece (\"llama\") and Gemma-4 BPE (\"gemma4\") vocabularies"))),
    }
}

/// Gemma-4's tokenizer.json from the keys llama.cpp's converter writes (`LlamaHfVocab`: the BPE vocabulary
/// in id order, its merges, token types; export/src/gguf/vocab.rs writes the same): the byte-fallback BPE
/// with Gemma's "▁" normalizer and decoder, control tokens (type 3) added as special, user-defined ones
/// (type 4) as plain added tokens; the chat template from `tokenizer.chat_template`.
fn gemma4_files(g: &GgufFile) -> Result<Files> {
    let tokens = strings(g, "tokenizer.ggml.tokens")?;
    let types: Vec<u64> = match g.get("tokenizer.ggml.token_type").and_then(Value::as_array) {
        Some(a) => a.iter().map(|v| v.as_u64().unwrap_or(1)).collect(),
        None => vec![1; tokens.len()],
    };
    let merges: Vec<serde_json::Value> = strings(g, "tokenizer.ggml.merges")?
        .iter()
        .map(|m| match m.split_once(' ') {
            Some((l, r)) => Ok(json!([l, r])),
            None => Err(Error::gguf(
                g,
                format!("tokenizer.ggml.merges: {m:?} is not two pieces"),
            )),
        })
        .collect::<Result<_>>()?;
    let name = |k: &str| {
        g.get(&format!("tokenizer.ggml.{k}_token_id"))
            .and_then(Value::as_u64)
            .and_then(|i| tokens.get(i as usize).cloned())
    };
    let (bos, eos) = (
        name("bos").unwrap_or("<bos>".into()),
        name("eos").unwrap_or("<eos>".into()),
    );
    let unk = name("unknown").unwrap_or("<unk>".into());
    let vmap: serde_json::Map<_, _> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i.into()))
        .collect();
    let added_tokens: Vec<_> = types
        .iter()
        .enumerate()
        .filter(|(_, t)| matches!(t, 3 | 4))
        .map(|(i, &t)| added(i, &tokens[i], t == 3))
        .collect();
    let post = json!({"type": "TemplateProcessing", "single": [{"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}], "special_tokens": {}});
    let tj = gemma_bpe(added_tokens, post, &unk, vmap, json!(merges));
    let template = g
        .get("tokenizer.chat_template")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let tc = json!({"bos_token": bos, "eos_token": eos, "unk_token": unk});
    let text = |v: &serde_json::Value| {
        serde_json::to_string_pretty(v)
            .map(|s| s + "\n")
            .expect("JSON")
    };
    Ok(Files {
        tokenizer_json: text(&tj),
        tokenizer_config: text(&tc),
        chat_template: template,
        spm: Vec::new(),
    })
}

/// The tokenizer files for a GGUF with a `llama` (SentencePiece) vocabulary.
fn spm_files(g: &GgufFile) -> Result<Files> {
    let raw = strings(g, "tokenizer.ggml.tokens")?;
    let types: Vec<u64> = match g.get("tokenizer.ggml.token_type").and_then(Value::as_array) {
        Some(a) => a.iter().map(|v| v.as_u64().unwrap_or(1)).collect(),
        None => vec![1; raw.len()],
    };
    // A token of two or more spaces is stored as spaces; GemmaTokenizer looks it up as "▁"s.
    let tokens: Vec<String> = raw
        .iter()
        .map(|t| match t.contains(' ') && t.chars().all(py_space) {
            true => "\u{2581}".repeat(t.chars().count()),
            false => t.clone(),
        })
        .collect();
    let vocab: HashMap<&str, usize> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.as_str(), i))
        .collect();
    let merges = merges(&tokens, &vocab);
    let id_of = |k: &str, d: usize| {
        g.get(&format!("tokenizer.ggml.{k}"))
            .and_then(Value::as_u64)
            .map_or(d, |v| v as usize)
    };
    let name = |i: usize| tokens.get(i).cloned().unwrap_or_default();
    let (bos, eos, unk, pad) = (
        name(id_of("bos_token_id", 2)),
        name(id_of("eos_token_id", 1)),
        name(id_of("unknown_token_id", 3)),
        name(id_of("padding_token_id", 0)),
    );
    // Added tokens: GemmaTokenizer's own specials, the file's control tokens (special) and user-defined
    // ones (plain), in id order.
    let mut special: Vec<(usize, bool)> = Vec::new();
    for t in [&pad, &eos, &bos, &unk, "<mask>"] {
        if let Some(&i) = vocab.get(t) {
            special.push((i, true));
        }
    }
    for (i, ty) in types.iter().enumerate() {
        match ty {
            3 => special.push((i, true)),
            4 => special.push((i, false)),
            _ => {}
        }
    }
    special.sort();
    special.dedup_by_key(|(i, _)| *i);
    let added_tokens: Vec<_> = special
        .iter()
        .map(|&(i, s)| added(i, &tokens[i], s))
        .collect();
    let mut vmap = serde_json::Map::new();
    for (t, i) in tokens.iter().enumerate().map(|(i, t)| (t, i)) {
        vmap.insert(t.clone(), (*vocab.get(t.as_str()).unwrap_or(&i)).into());
    }
    let add_bos = g
        .get("tokenizer.ggml.add_bos_token")
        .map(|v| *v == Value::Bool(true))
        .unwrap_or(true);
    let post = match add_bos {
        true => json!({"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos.clone(): {"id": bos, "ids": [id_of("bos_token_id", 2)], "tokens": [bos]}}}),
        false => serde_json::Value::Null,
    };
    let tj = gemma_bpe(added_tokens, post, &unk, vmap, json!(merges));
    let decoder: serde_json::Map<_, _> = special
        .iter()
        .map(|&(i, s)| {
            let mut a = added(i, &tokens[i], s);
            a.as_object_mut().unwrap().remove("id");
            (i.to_string(), a)
        })
        .collect();
    let tc = json!({
        "backend": "tokenizers", "tokenizer_class": "GemmaTokenizer", "added_tokens_decoder": decoder,
        "bos_token": bos, "eos_token": eos, "unk_token": unk, "pad_token": pad, "mask_token": "<mask>",
        "add_bos_token": add_bos, "add_eos_token": false,
        "chat_template": GEMMA3_CHAT_TEMPLATE,
    });
    let text = |v: &serde_json::Value| {
        serde_json::to_string_pretty(v)
            .map(|s| s + "\n")
            .expect("JSON")
    };
    let scores: Vec<f32> = match g.get("tokenizer.ggml.scores").and_then(Value::as_array) {
        Some(a) => a.iter().map(|v| v.as_f64().unwrap_or(0.0) as f32).collect(),
        None => vec![0.0; tokens.len()],
    };
    let unk_id = id_of("unknown_token_id", 3);
    let pieces = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let ty = match i == unk_id {
                true => hexq_model::spm::piece_type::UNKNOWN,
                false => types[i] as i32,
            };
            (t.clone(), scores.get(i).copied().unwrap_or(0.0), ty)
        })
        .collect();
    let ids = [
        unk_id,
        id_of("bos_token_id", 2),
        id_of("eos_token_id", 1),
        id_of("padding_token_id", 0),
    ];
    let spm = hexq_model::spm::ModelProto::gemma(pieces, ids.map(|i| i as i32));
    Ok(Files {
        tokenizer_json: text(&tj),
        tokenizer_config: text(&tc),
        chat_template: GEMMA3_CHAT_TEMPLATE.to_string(),
        spm: spm.to_bytes(),
    })
}
