//! Genie's config validator as one table: per section the mandatory fields, known keys and JSON types,
//! and the enumerated values (QAIRT `examples/Genie/Genie/src/Dialog.cpp`, with the Gemma-4 keys newer Genie
//! accepts from Qualcomm's validated E2B bundle).

use serde_json::{json, Value};

/// JSON type of a field, as Genie's `JSON_ENFORCE_*` macros check it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Ty {
    Num,
    Str,
    Bool,
    Obj,
    Arr,
    NumOrArr,
}

/// Genie's config schema for the sections a hexq bundle writes: (section path, mandatory fields, known keys
/// with their types). From Genie's Dialog.cpp validators; the keys marked "≥ 2.48" are the Gemma-4 ones
/// Qualcomm's validated E2B bundle uses and that older Genie rejects as unknown.
pub const SCHEMA: &[(&str, &[&str], &[(&str, Ty)])] = &[
    (
        "dialog",
        &["version", "type", "context", "tokenizer", "engine"],
        &[
            ("version", Ty::Num),
            ("type", Ty::Str),
            ("context", Ty::Obj),
            ("sampler", Ty::Obj),
            ("tokenizer", Ty::Obj),
            ("engine", Ty::Obj),
            ("embedding", Ty::Obj),
            ("max-num-tokens", Ty::Num),
            ("perlayer-embedding", Ty::Obj), // ≥ 2.48
        ],
    ),
    (
        "dialog.context",
        &["version", "bos-token", "eos-token", "size", "n-vocab"],
        &[
            ("version", Ty::Num),
            ("bos-token", Ty::Num),
            ("eos-token", Ty::NumOrArr),
            ("eot-token", Ty::Num),
            ("size", Ty::Num),
            ("n-vocab", Ty::Num),
            ("pad-token", Ty::Num),
            ("n-embd", Ty::Num),
        ],
    ),
    (
        "dialog.sampler",
        &["version"],
        &[
            ("version", Ty::Num),
            ("seed", Ty::Num),
            ("temp", Ty::Num),
            ("top-k", Ty::Num),
            ("top-p", Ty::Num),
            ("greedy", Ty::Bool),
        ],
    ),
    (
        "dialog.tokenizer",
        &["version", "path"],
        &[("version", Ty::Num), ("path", Ty::Str)],
    ),
    (
        "dialog.embedding",
        &["version", "size"],
        &[
            ("version", Ty::Num),
            ("size", Ty::Num),
            ("type", Ty::Str),
            ("datatype", Ty::Str),
            ("lut-path", Ty::Str),
            ("quant-param", Ty::Obj),
        ],
    ),
    (
        "dialog.perlayer-embedding",
        &["version", "size"],
        &[
            ("version", Ty::Num),
            ("size", Ty::Num),
            ("type", Ty::Str),
            ("datatype", Ty::Str),
            ("lut-path", Ty::Str),
            ("quant-param", Ty::Obj),
        ],
    ),
    (
        "dialog.engine",
        &["version", "backend", "model", "n-threads"],
        &[
            ("version", Ty::Num),
            ("backend", Ty::Obj),
            ("model", Ty::Obj),
            ("n-threads", Ty::Num),
            ("cache-groups", Ty::Arr),
            ("longcontext", Ty::Obj),
        ],
    ),
    (
        "dialog.engine.backend",
        &["version", "type"],
        &[
            ("version", Ty::Num),
            ("type", Ty::Str),
            ("extensions", Ty::Str),
            ("QnnHtp", Ty::Obj),
        ],
    ),
    (
        "dialog.engine.backend.QnnHtp",
        &[
            "version",
            "spill-fill-bufsize",
            "mmap-budget",
            "use-mmap",
            "cpu-mask",
            "poll",
        ],
        &[
            ("version", Ty::Num),
            ("spill-fill-bufsize", Ty::Num),
            ("data-alignment-size", Ty::Num),
            ("mmap-budget", Ty::Num),
            ("use-mmap", Ty::Bool),
            ("pos-id-dim", Ty::Num),
            ("cpu-mask", Ty::Str),
            ("poll", Ty::Bool),
            ("kv-dim", Ty::Num),
            ("kv-update-method", Ty::Str),
            ("allow-async-init", Ty::Bool),
            ("rope-theta", Ty::Num),
            ("enable-graph-switching", Ty::Bool),
            ("shared-engine", Ty::Bool),
        ],
    ),
    (
        "dialog.engine.cache-groups[]",
        &["version", "prefix"],
        &[
            ("version", Ty::Num),
            ("prefix", Ty::Str),
            ("attention-mask-tensor-name", Ty::Str),
            ("cache-index-tensor-name", Ty::Str),
            ("longcontext", Ty::Obj),
            ("kv-dim", Ty::Num), // ≥ 2.48
        ],
    ),
    (
        "dialog.engine.cache-groups[].longcontext",
        &["version", "type"],
        &[
            ("version", Ty::Num),
            ("type", Ty::Str),
            ("reserved-tokens", Ty::Num),
            ("sliding-window", Ty::Obj),
        ],
    ),
    (
        "dialog.engine.cache-groups[].longcontext.sliding-window",
        &["version", "window-size"],
        &[("version", Ty::Num), ("window-size", Ty::Num)],
    ),
    (
        "dialog.engine.model",
        &["version", "type"],
        &[
            ("version", Ty::Num),
            ("type", Ty::Str),
            ("binary", Ty::Obj),
            ("positional-encoding", Ty::Obj),
            ("local-positional-encoding", Ty::Obj), // ≥ 2.48
        ],
    ),
    (
        "dialog.engine.model.binary",
        &["version", "ctx-bins"],
        &[("version", Ty::Num), ("ctx-bins", Ty::Arr)],
    ),
    (
        "dialog.engine.model.positional-encoding",
        &["type"],
        &[
            ("type", Ty::Str),
            ("rope-dim", Ty::Num),
            ("rope-theta", Ty::Num),
            ("rope-scaling", Ty::Obj),
        ],
    ),
    (
        "dialog.engine.model.local-positional-encoding",
        &["type"],
        &[
            ("type", Ty::Str),
            ("rope-dim", Ty::Num),
            ("rope-theta", Ty::Num),
            ("rope-scaling", Ty::Obj),
        ],
    ),
    (
        "dialog.engine.model.positional-encoding.rope-scaling",
        &["rope-type"],
        &[
            ("rope-type", Ty::Str),
            ("factor", Ty::Num),
            ("low-freq-factor", Ty::Num),
            ("high-freq-factor", Ty::Num),
            ("original-max-position-embeddings", Ty::Num),
            ("partial-rotary-factor", Ty::Num), // ≥ 2.48
        ],
    ),
];

/// Values Genie accepts for the enumerated string fields (Dialog.cpp; `proportional` from the E2B bundle).
const ENUMS: &[(&str, &[&str])] = &[
    ("dialog.type", &["basic"]),
    (
        "dialog.engine.backend.type",
        &["QnnHtp", "QnnGpu", "QnnGenAiTransformer"],
    ),
    ("dialog.engine.model.type", &["binary", "library"]),
    ("dialog.embedding.type", &["lut", "callback"]),
    (
        "dialog.embedding.datatype",
        &[
            "float32", "native", "ufixed8", "ufixed16", "sfixed8", "sfixed16",
        ],
    ),
    ("dialog.perlayer-embedding.type", &["lut", "callback"]),
    (
        "dialog.perlayer-embedding.datatype",
        &[
            "float32", "native", "ufixed8", "ufixed16", "sfixed8", "sfixed16",
        ],
    ),
    (
        "dialog.engine.model.positional-encoding.type",
        &["rope", "absolute", "alibi"],
    ),
    (
        "dialog.engine.model.local-positional-encoding.type",
        &["rope"],
    ),
    (
        "dialog.engine.model.positional-encoding.rope-scaling.rope-type",
        &["llama3", "default", "longrope", "proportional"],
    ),
    (
        "dialog.engine.cache-groups[].longcontext.type",
        &["keydiff", "sliding-window"],
    ),
];

fn ty_ok(v: &Value, t: Ty) -> bool {
    match t {
        Ty::Num => v.is_number(),
        Ty::Str => v.is_string(),
        Ty::Bool => v.is_boolean(),
        Ty::Obj => v.is_object(),
        Ty::Arr => v.is_array(),
        Ty::NumOrArr => v.is_number() || v.is_array(),
    }
}

/// Check a genie_config.json against [`SCHEMA`] and `ENUMS` the way Genie does: every mandatory field
/// present, no unknown key, each value of its type, `version` = 1, a `lut` embedding has a `lut-path`.
/// Returns every problem found, each naming the JSON path.
pub fn validate(cfg: &Value) -> Vec<String> {
    let mut errs = Vec::new();
    let Some(dialog) = cfg.get("dialog") else {
        return vec!["missing \"dialog\"".into()];
    };
    if let Some(o) = cfg.as_object() {
        for k in o.keys().filter(|k| *k != "dialog") {
            errs.push(format!("unknown top-level key {k:?}"));
        }
    }
    walk("dialog", dialog, &mut errs);
    errs
}

fn walk(path: &str, v: &Value, errs: &mut Vec<String>) {
    let Some((_, mandatory, keys)) = SCHEMA.iter().find(|(p, _, _)| *p == path) else {
        return; // a leaf object Genie passes through (quant-param)
    };
    let Some(o) = v.as_object() else {
        errs.push(format!("{path}: not an object"));
        return;
    };
    for m in *mandatory {
        if !o.contains_key(*m) {
            errs.push(format!("{path}: missing field {m:?}"));
        }
    }
    for (k, x) in o {
        let Some((_, t)) = keys.iter().find(|(n, _)| n == k) else {
            errs.push(format!("{path}: unknown key {k:?}"));
            continue;
        };
        let p = format!("{path}.{k}");
        if !ty_ok(x, *t) {
            errs.push(format!("{p}: expected {t:?}, got {x}"));
            continue;
        }
        if k == "version" && x.as_i64() != Some(1) {
            errs.push(format!("{p}: unsupported version {x}"));
        }
        if let Some((_, allowed)) = ENUMS.iter().find(|(e, _)| *e == p) {
            if !allowed.contains(&x.as_str().unwrap_or("")) {
                errs.push(format!("{p}: {x} is not one of {allowed:?}"));
            }
        }
        match x {
            Value::Object(_) => walk(&p, x, errs),
            Value::Array(a) if SCHEMA.iter().any(|(s, _, _)| *s == format!("{p}[]")) => {
                for e in a {
                    walk(&format!("{p}[]"), e, errs);
                }
            }
            Value::Array(a) if k == "ctx-bins" && !a.iter().all(|e| e.is_string()) => {
                errs.push(format!("{p}: ctx-bins must be an array of strings"));
            }
            _ => {}
        }
    }
    if path.ends_with("embedding")
        && (o.get("type") == Some(&json!("lut"))) != o.contains_key("lut-path")
    {
        errs.push(format!("{path}: lut-path goes with type lut"));
    }
}
