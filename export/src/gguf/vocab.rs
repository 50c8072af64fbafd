//! The tokenizer keys, as llama.cpp's converter writes them per architecture: `gemma4` (a BPE
//! tokenizer.json, `LlamaHfVocab`) and `gemma3` (SentencePiece's tokenizer.model,
//! `_set_vocab_sentencepiece`), then gguf-py's `SpecialVocab` (special ids, add_*_token, chat template).

use super::Val;
use hexq_model::spm::{piece_type as pt, ModelProto};
use hexq_model::{Checkpoint, Error, Result};

/// The tokenizer keys, as gguf.LlamaHfVocab + SpecialVocab produce them from tokenizer.json.
pub(super) fn gemma4(ck: &Checkpoint, kv: &mut Vec<(String, Val)>) -> Result<()> {
    let p = ck.dir.join("tokenizer.json");
    let t: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).map_err(|e| Error::io(&p, e))?)
            .map_err(|e| Error::file(&p, format!("invalid JSON: {e}")))?;
    let model = &t["model"];
    if model["type"] != "BPE" {
        return Err(Error::file(
            &p,
            "llama.cpp's gemma4 tokenizer needs a BPE tokenizer.json",
        ));
    }
    let vocab = model["vocab"]
        .as_object()
        .ok_or_else(|| Error::file(&p, "model.vocab missing"))?;
    let mut toks: Vec<(u64, String)> = vocab
        .iter()
        .map(|(k, v)| (v.as_u64().unwrap_or(0), k.clone()))
        .collect();
    let mut specials = std::collections::HashMap::new();
    for a in t["added_tokens"].as_array().into_iter().flatten() {
        let id = a["id"].as_u64().unwrap_or(0);
        let c = a["content"].as_str().unwrap_or("").to_string();
        specials.insert(id, a["special"].as_bool().unwrap_or(false));
        if !toks.iter().any(|(i, _)| *i == id) {
            toks.push((id, c));
        }
    }
    toks.sort();
    let n = toks.len();
    if toks.iter().enumerate().any(|(k, (i, _))| *i as usize != k) {
        return Err(Error::file(&p, "token ids are not contiguous"));
    }
    if n != ck.config.vocab_size {
        return Err(Error::file(
            &p,
            format!("{n} tokens, config vocab_size {}", ck.config.vocab_size),
        ));
    }
    let visible = [
        "<|channel>",
        "<channel|>",
        "<|tool_call>",
        "<tool_call|>",
        "<|tool_response>",
        "<tool_response|>",
        "<|\"|>",
    ];
    let types: Vec<i32> = toks
        .iter()
        .map(|(i, s)| {
            if visible.contains(&s.as_str()) {
                4 // USER_DEFINED
            } else if let Some(&sp) = specials.get(i) {
                if sp {
                    3
                } else {
                    4
                } // CONTROL / USER_DEFINED
            } else if s.len() == 6 && s.starts_with("<0x") && s.ends_with('>') {
                6 // BYTE
            } else {
                1 // NORMAL
            }
        })
        .collect();
    kv.push(("tokenizer.ggml.model".into(), Val::Str("gemma4".into())));
    kv.push((
        "tokenizer.ggml.tokens".into(),
        Val::ArrStr(toks.into_iter().map(|(_, s)| s).collect()),
    ));
    kv.push((
        "tokenizer.ggml.scores".into(),
        Val::ArrF32(vec![-1000.0; n]),
    ));
    kv.push(("tokenizer.ggml.token_type".into(), Val::ArrI32(types)));
    let merges: Vec<String> = model["merges"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|m| match m {
            serde_json::Value::Array(a) => a
                .iter()
                .map(|x| x.as_str().unwrap_or(""))
                .collect::<Vec<_>>()
                .join(" "),
            v => v.as_str().unwrap_or("").to_string(),
        })
        .collect();
    kv.push(("tokenizer.ggml.merges".into(), Val::ArrStr(merges)));
    // Special ids: tokenizer_config.json's tokens, resolved in the vocabulary (SpecialVocab).
    let tc_path = ck.dir.join("tokenizer_config.json");
    let tc: serde_json::Value = std::fs::read_to_string(&tc_path)
        .ok()
        .and_then(|s| serde_json::from_str(&s).ok())
        .unwrap_or_default();
    let lookup = |key: &str| -> Option<u32> {
        let s = tc[key].as_str().or_else(|| tc[key]["content"].as_str())?;
        vocab
            .get(s)
            .and_then(|v| v.as_u64())
            .map(|v| v as u32)
            .or_else(|| {
                t["added_tokens"]
                    .as_array()?
                    .iter()
                    .find(|a| a["content"] == s)
                    .and_then(|a| a["id"].as_u64())
                    .map(|v| v as u32)
            })
    };
    for (k, name) in [
        ("bos_token", "bos"),
        ("eos_token", "eos"),
        ("unk_token", "unknown"),
        ("pad_token", "padding"),
        ("mask_token", "mask"),
    ] {
        if let Some(id) = lookup(k) {
            kv.push((format!("tokenizer.ggml.{name}_token_id"), Val::U32(id)));
        }
    }
    let tmpl = ck.dir.join("chat_template.jinja");
    let template = if tmpl.exists() {
        Some(std::fs::read_to_string(&tmpl).map_err(|e| Error::io(&tmpl, e))?)
    } else {
        tc["chat_template"].as_str().map(|s| s.to_string())
    };
    if let Some(s) = template {
        kv.push(("tokenizer.chat_template".into(), Val::Str(s)));
    }
    kv.push(("tokenizer.ggml.add_space_prefix".into(), Val::Bool(false)));
    kv.push(("tokenizer.ggml.add_bos_token".into(), Val::Bool(true)));
    Ok(())
}

/// `_create_vocab_sentencepiece`: tokenizer.model's pieces (cut or padded to vocab_size, `[PADi]`), then
/// added_tokens.json, then tokenizer_config.json's `added_tokens_decoder` (control if special or special-
/// looking, else user-defined with "▁" respelled as spaces; score -1000).
pub(super) fn gemma3(ck: &Checkpoint, kv: &mut Vec<(String, Val)>) -> Result<()> {
    let p = ck.dir.join("tokenizer.model");
    if !p.is_file() {
        let m = "llama.cpp's gemma3 vocabulary is read from tokenizer.model (SentencePiece), which this \
                 checkpoint lacks (`hexq import` writes one)";
        return Err(Error::file(&p, m));
    }
    let m = ModelProto::read(&p)?;
    let n = ck.config.vocab_size;
    let mut tokens: Vec<String> = (0..n).map(|i| format!("[PAD{i}]")).collect();
    let mut scores = vec![-10000.0f32; n];
    let mut types = vec![pt::UNUSED; n];
    for i in 0..m.pieces.len().min(n) {
        let (t, s, ty) = m.piece(i);
        tokens[i] = t.to_string();
        scores[i] = s;
        // SentencePiece's Is* tests: user-defined pieces read as NORMAL here.
        types[i] = match ty {
            pt::UNKNOWN | pt::CONTROL | pt::UNUSED | pt::BYTE => ty,
            _ => pt::NORMAL,
        };
    }
    let added = ck.dir.join("added_tokens.json");
    if added.is_file() {
        let a = read_json(&added)?;
        for (k, v) in a.as_object().into_iter().flatten() {
            match v.as_u64().map(|i| i as usize) {
                Some(i) if i < n => {
                    (tokens[i], scores[i], types[i]) = (k.clone(), -1000.0, pt::USER_DEFINED)
                }
                _ => {}
            }
        }
    }
    let tc = tokenizer_config(ck)?;
    for (id, d) in tc["added_tokens_decoder"].as_object().into_iter().flatten() {
        let (Ok(i), Some(c)) = (id.parse::<usize>(), d["content"].as_str()) else {
            continue;
        };
        if i >= n {
            continue;
        }
        let special = d["special"].as_bool().unwrap_or(false) || looks_special(c);
        (tokens[i], types[i]) = match special {
            true => (c.to_string(), pt::CONTROL),
            false => (c.replace('\u{2581}', " "), pt::USER_DEFINED),
        };
        scores[i] = -1000.0;
    }
    kv.push(("tokenizer.ggml.model".into(), Val::Str("llama".into())));
    kv.push(("tokenizer.ggml.pre".into(), Val::Str("default".into())));
    kv.push(("tokenizer.ggml.tokens".into(), Val::ArrStr(tokens)));
    kv.push(("tokenizer.ggml.scores".into(), Val::ArrF32(scores)));
    kv.push(("tokenizer.ggml.token_type".into(), Val::ArrI32(types)));
    special_vocab(ck, &tc, kv)?;
    kv.push(("tokenizer.ggml.add_space_prefix".into(), Val::Bool(false)));
    Ok(())
}

/// The converter's `does_token_look_special` (tokens some models mark as not special but are).
fn looks_special(t: &str) -> bool {
    ["<pad>", "<mask>", "<2mass>", "[@BOS@]"].contains(&t)
        || (t.starts_with("<|") && t.ends_with("|>"))
        || (t.starts_with("<\u{ff5c}") && t.ends_with("\u{ff5c}>"))
        || (t.starts_with("<unused") && t.ends_with('>'))
}

fn read_json(p: &std::path::Path) -> Result<serde_json::Value> {
    let s = std::fs::read_to_string(p).map_err(|e| Error::io(p, e))?;
    serde_json::from_str(&s).map_err(|e| Error::file(p, format!("invalid JSON: {e}")))
}

fn tokenizer_config(ck: &Checkpoint) -> Result<serde_json::Value> {
    let p = ck.dir.join("tokenizer_config.json");
    match p.is_file() {
        true => read_json(&p),
        false => Ok(serde_json::Value::Null),
    }
}

const SPECIAL_TYPES: [&str; 7] = ["bos", "eos", "unk", "sep", "pad", "cls", "mask"];

/// gguf-py's `SpecialVocab` for the files hexq and the Gemma repos carry: special ids (tokenizer_config's
/// `<typ>_token` looked up in tokenizer.json's added tokens, then config.json's `<typ>_token_id`);
/// add_bos/eos/sep from a TemplateProcessing post-processor, then tokenizer_config's `add_<typ>_token`;
/// the chat template (tokenizer_config's, else chat_template.jinja).
fn special_vocab(
    ck: &Checkpoint,
    tc: &serde_json::Value,
    kv: &mut Vec<(String, Val)>,
) -> Result<()> {
    let tj_path = ck.dir.join("tokenizer.json");
    let tj = match tj_path.is_file() {
        true => read_json(&tj_path)?,
        false => serde_json::Value::Null,
    };
    let content = |typ: &str| -> Option<String> {
        let e = &tc[format!("{typ}_token")];
        e.as_str()
            .or_else(|| e["content"].as_str())
            .map(str::to_string)
    };
    let added = tj["added_tokens"].as_array().cloned().unwrap_or_default();
    let n = ck.config.vocab_size as u64;
    let mut ids: Vec<(&str, u64)> = Vec::new();
    for typ in SPECIAL_TYPES {
        let id = content(typ).and_then(|c| {
            added
                .iter()
                .find(|a| a["content"] == c.as_str())
                .and_then(|a| a["id"].as_u64())
        });
        if let Some(id) = id.filter(|&i| i < n) {
            ids.push((typ, id));
        }
    }
    for typ in SPECIAL_TYPES {
        let id = ck.config.raw_text[format!("{typ}_token_id")].as_u64();
        if let Some(id) = id.filter(|&i| i < n && !ids.iter().any(|(t, _)| *t == typ)) {
            ids.push((typ, id));
        }
    }
    let name = |t: &str| match t {
        "unk" => "unknown".to_string(),
        "pad" => "padding".to_string(),
        t => t.to_string(),
    };
    for (t, id) in ids {
        kv.push((
            format!("tokenizer.ggml.{}_token_id", name(t)),
            Val::U32(id as u32),
        ));
    }
    for (t, v) in add_special(
        &tj["post_processor"],
        content("bos"),
        content("eos"),
        content("sep"),
        tc,
    ) {
        kv.push((format!("tokenizer.ggml.add_{t}_token"), Val::Bool(v)));
    }
    let jinja = ck.dir.join("chat_template.jinja");
    let template = match tc["chat_template"].as_str() {
        Some(s) => Some(s.to_string()),
        None if jinja.is_file() => {
            Some(std::fs::read_to_string(&jinja).map_err(|e| Error::io(&jinja, e))?)
        }
        None => None,
    };
    if let Some(s) = template {
        kv.push(("tokenizer.chat_template".into(), Val::Str(s)));
    }
    Ok(())
}

/// add_<typ>_token in SpecialVocab's order: a TemplateProcessing's leading special (bos) and trailing
/// special (eos) of `single`, its `pair` separator (sep), then tokenizer_config's flags for the rest.
fn add_special(
    post: &serde_json::Value,
    bos: Option<String>,
    eos: Option<String>,
    sep: Option<String>,
    tc: &serde_json::Value,
) -> Vec<(&'static str, bool)> {
    let mut out: Vec<(&'static str, bool)> = Vec::new();
    let procs = match post["type"].as_str() {
        Some("Sequence") => post["processors"].as_array().cloned().unwrap_or_default(),
        _ => vec![post.clone()],
    };
    let special = |v: &serde_json::Value| v["SpecialToken"]["id"].as_str().map(str::to_string);
    for p in procs.iter().filter(|p| p["type"] == "TemplateProcessing") {
        let single = p["single"].as_array().cloned().unwrap_or_default();
        let pair = p["pair"].as_array().cloned().unwrap_or_default();
        let (mut first, mut last) = (None, None);
        if single.len() > 1 {
            first = special(&single[0]);
            if let Some(f) = &first {
                out.push(("bos", Some(f) == bos.as_ref()));
            }
            last = special(&single[single.len() - 1]);
            if let Some(l) = &last {
                out.push(("eos", Some(l) == eos.as_ref()));
            }
        }
        let start = usize::from(first.is_some() && pair.first().and_then(special) == first);
        let stop = match last.is_some() && pair.last().and_then(special) == last {
            true => pair.len().saturating_sub(1),
            false => pair.len(),
        };
        let mid = pair.get(start..stop).unwrap_or(&[]);
        let seq = |v: Option<&serde_json::Value>| {
            v.and_then(|v| v["Sequence"]["id"].as_str().map(str::to_string))
        };
        let ab =
            seq(mid.first()).as_deref() == Some("A") && seq(mid.last()).as_deref() == Some("B");
        if mid.len() > 2 && ab {
            let inner = &mid[1..mid.len() - 1];
            let is_sep = |v: &serde_json::Value| {
                special(v).is_some_and(|s| Some(&s) == sep.as_ref() || Some(&s) == eos.as_ref())
            };
            let add_sep =
                (is_sep(&inner[0]) && last.is_none()) || (inner.len() == 2 && is_sep(&inner[1]));
            out.push(("sep", add_sep));
        }
    }
    for typ in SPECIAL_TYPES {
        if let Some(b) = tc[format!("add_{typ}_token")].as_bool() {
            if !out.iter().any(|(t, _)| *t == typ) {
                out.push((typ, b));
            }
        }
    }
    out
}
