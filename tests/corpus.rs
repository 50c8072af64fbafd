//! Bad input never crashes hexq, never passes silently, never leaves a temp file: a corpus of bad inputs
//! across the commands (checkpoint files, configs, tokenizers, datasets, stats, encodings, GGUF, CLI values,
//! output paths). Each case asserts exit 1 or 2 (never 0, 101 = panic, 134 = abort), a message naming the
//! file or field at fault, and no `.tmp-` output left in the case's directory.

mod common;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::Command;

struct Case {
    name: String,
    args: Vec<String>,
    /// Substrings the error message must contain (file, field or value at fault).
    expect: Vec<String>,
}

fn fixture() -> PathBuf {
    common::root().join("tests/fixtures/tiny-gemma4")
}

/// A copy of the tiny checkpoint in `dir`, with `edit` applied to its parsed config.json.
fn model_with(dir: &Path, edit: impl Fn(&mut Value)) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    for f in std::fs::read_dir(fixture()).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), dir.join(f.file_name())).unwrap();
    }
    let p = dir.join("config.json");
    let mut c: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    edit(&mut c);
    std::fs::write(&p, serde_json::to_string_pretty(&c).unwrap()).unwrap();
    dir.to_path_buf()
}

fn s(v: &[&str]) -> Vec<String> {
    v.iter().map(|x| x.to_string()).collect()
}

fn leftovers(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.file_name().unwrap().to_string_lossy().contains(".tmp-") {
                out.push(p.clone());
            }
            if p.is_dir() {
                stack.push(p);
            }
        }
    }
    out
}

/// Config fields × bad values, each read by `inspect` (config parsing) and `run` (the whole load path).
fn config_cases(t: &Path, cases: &mut Vec<Case>) {
    let fields = [
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "vocab_size",
        "sliding_window",
        "max_position_embeddings",
    ];
    let values: [(&str, Value); 5] = [
        ("zero", json!(0)),
        ("negative", json!(-4)),
        ("string", json!("64")),
        ("float", json!(2.5)),
        ("huge", json!(1u64 << 40)),
    ];
    for f in fields {
        for (vn, v) in &values {
            // A window or position limit beyond any context is a legal (global) setting.
            if *vn == "huge" && (f == "sliding_window" || f == "max_position_embeddings") {
                continue;
            }
            let dir = model_with(&t.join(format!("cfg-{f}-{vn}")), |c| {
                c["text_config"][f] = v.clone();
            });
            // graph reads the config alone: no tensor shape stands between it and the widths.
            for cmd in ["inspect", "run", "graph"] {
                let mut args = vec![cmd.to_string()];
                match cmd {
                    "inspect" => args.push(dir.display().to_string()),
                    "graph" => args.extend(s(&["--model", &dir.display().to_string()])),
                    _ => args.extend(s(&[
                        "--model",
                        &dir.display().to_string(),
                        "--prompt",
                        "hi",
                        "--max-tokens",
                        "1",
                    ])),
                }
                cases.push(Case {
                    name: format!("config {f}={vn} ({cmd})"),
                    args,
                    expect: vec!["config.json".into(), f.into()],
                });
            }
        }
    }
}

fn case(cases: &mut Vec<Case>, name: &str, args: Vec<String>, expect: &[&str]) {
    cases.push(Case {
        name: name.into(),
        args,
        expect: s(expect),
    });
}

/// CLI numbers and closed value sets: clap refuses them (exit 2) naming the option.
fn cli_cases(t: &Path, cases: &mut Vec<Case>) {
    let out = t.join("cli-out").display().to_string();
    let m = fixture().display().to_string();
    let numeric: [(&str, &[&str]); 7] = [
        ("run", &["--prompt", "hi", "--max-tokens", "1"]),
        ("calibrate", &["--limit", "1"]),
        ("verify", &["--encodings", "x.json"]),
        ("graph", &["--variant", "decode_wgqa"]),
        ("export", &["--variant", "decode_wgqa"]),
        ("ablate", &["--limit", "1"]),
        ("pipeline", &[]),
    ];
    let opts: [(&str, &[&str]); 7] = [
        ("run", &["--context", "--max-tokens"]),
        ("calibrate", &["--context", "--seq", "--limit"]),
        ("verify", &["--limit", "--steps"]),
        ("graph", &["--context", "--seq"]),
        ("export", &["--context", "--seq"]),
        ("ablate", &["--limit"]),
        ("pipeline", &["--context"]),
    ];
    for ((cmd, base), (_, os)) in numeric.iter().zip(opts.iter()) {
        for o in *os {
            for bad in ["0", "-3", "abc", "1e9x", ""] {
                let mut a = s(&[cmd, "--model", &m]);
                a.extend(s(base));
                a.extend(s(&[o, bad, "--out", &out]));
                if *cmd == "run" || *cmd == "verify" || *cmd == "ablate" {
                    a.truncate(a.len() - 2);
                }
                // clap reads "-3" as an unknown flag and names it; every other value is named with its option.
                let want = if bad == "-3" {
                    "-3"
                } else {
                    o.trim_start_matches("--")
                };
                case(cases, &format!("{cmd} {o} {bad:?}"), a, &[want]);
            }
        }
    }
    let sets: [(&str, &str, &str, &[&str]); 9] = [
        ("graph", "--variant", "decode_gqa", &[]),
        ("export", "--variant", "prefill", &["--out", &out]),
        ("gguf", "--type", "q9_0", &["--out", &out]),
        ("compile", "--target", "v99", &["--artifacts", &out]),
        ("run", "--backend", "gpu", &["--prompt", "hi"]),
        ("verify", "--backend", "tpu", &[]),
        ("calibrate", "--engine", "onnx", &["--out", &out]),
        ("calibrate", "--params", "int4", &["--out", &out]),
        (
            "import",
            "--dtype",
            "f8",
            &["--gguf", "x.gguf", "--out", &out],
        ),
    ];
    for (cmd, o, v, rest) in sets {
        let mut a = s(&[cmd, o, v]);
        a.extend(s(rest));
        case(cases, &format!("{cmd} {o} {v}"), a, &[v]);
    }
}

/// Dataset files: empty, malformed, wrong shapes — for calibrate and verify.
fn dataset_cases(t: &Path, cases: &mut Vec<Case>) {
    let m = fixture().display().to_string();
    let (st, enc) = (t.join("ds-good-stats.json"), t.join("ds-good-enc.json"));
    common::hexq_ok(&[
        "calibrate",
        "--model",
        &m,
        "--limit",
        "2",
        "--context",
        "64",
        "--seq",
        "16",
        "--out",
        st.to_str().unwrap(),
    ]);
    common::hexq_ok(&[
        "quantize",
        "--model",
        &m,
        "--stats",
        st.to_str().unwrap(),
        "--out",
        enc.to_str().unwrap(),
    ]);
    let enc = enc.display().to_string();
    let bad: [(&str, &str); 9] = [
        ("empty", ""),
        ("blank-lines", "\n\n\n"),
        ("not-json", "hello world\n"),
        (
            "truncated",
            "{\"id\": \"a\", \"messages\": [{\"role\": \"user\"\n",
        ),
        ("no-messages", "{\"id\": \"a\"}\n"),
        ("empty-messages", "{\"id\": \"a\", \"messages\": []}\n"),
        (
            "bad-role",
            "{\"id\": \"a\", \"messages\": [{\"role\": \"robot\", \"content\": \"hi\"}]}\n",
        ),
        (
            "content-number",
            "{\"id\": \"a\", \"messages\": [{\"role\": \"user\", \"content\": 5}]}\n",
        ),
        ("array", "[1, 2, 3]\n"),
    ];
    for (n, text) in bad {
        let p = t.join(format!("ds-{n}.jsonl"));
        std::fs::write(&p, text).unwrap();
        let ps = p.display().to_string();
        let out = t.join(format!("ds-{n}-stats.json")).display().to_string();
        case(
            cases,
            &format!("dataset {n} (calibrate)"),
            s(&[
                "calibrate",
                "--model",
                &m,
                "--dataset",
                &ps,
                "--context",
                "64",
                "--out",
                &out,
            ]),
            &[&format!("ds-{n}.jsonl")],
        );
        case(
            cases,
            &format!("dataset {n} (verify)"),
            s(&[
                "verify",
                "--model",
                &m,
                "--dataset",
                &ps,
                "--encodings",
                &enc,
            ]),
            &[&format!("ds-{n}.jsonl")],
        );
    }
    for (n, p) in [
        ("missing", t.join("nope.jsonl")),
        ("directory", t.to_path_buf()),
    ] {
        let ps = p.display().to_string();
        let out = t.join(format!("ds-{n}-stats.json")).display().to_string();
        case(
            cases,
            &format!("dataset {n} (calibrate)"),
            s(&["calibrate", "--model", &m, "--dataset", &ps, "--out", &out]),
            &[&ps],
        );
    }
}

/// Stats files for `quantize`: malformed, inconsistent, or from another graph.
fn stats_cases(t: &Path, cases: &mut Vec<Case>) {
    let m = fixture().display().to_string();
    let good = t.join("good-stats.json");
    common::hexq_ok(&[
        "calibrate",
        "--model",
        &m,
        "--limit",
        "2",
        "--context",
        "64",
        "--seq",
        "16",
        "--out",
        good.to_str().unwrap(),
    ]);
    let g: Value = serde_json::from_str(&std::fs::read_to_string(&good).unwrap()).unwrap();
    let first = g["tensors"]
        .as_object()
        .map(|o| o.keys().next().unwrap().clone())
        .unwrap_or_default();
    let edits: Vec<(&str, Box<dyn Fn(&mut Value)>)> = vec![
        (
            "context-zero",
            Box::new(|v: &mut Value| v["context"] = json!(0)),
        ),
        ("seq-zero", Box::new(|v: &mut Value| v["seq"] = json!(0))),
        (
            "context-huge",
            Box::new(|v: &mut Value| v["context"] = json!(1u64 << 40)),
        ),
        (
            "variant-unknown",
            Box::new(|v: &mut Value| v["variant"] = json!("prefill_xl")),
        ),
        (
            "tensors-missing",
            Box::new(|v: &mut Value| {
                v.as_object_mut().unwrap().remove("tensors");
            }),
        ),
        (
            "tensors-empty",
            Box::new(|v: &mut Value| v["tensors"] = json!({})),
        ),
        ("min-gt-max", {
            let f = first.clone();
            Box::new(move |v: &mut Value| {
                v["tensors"][&f]["min"] = json!(5.0);
                v["tensors"][&f]["max"] = json!(-5.0);
            })
        }),
        ("min-string", {
            let f = first.clone();
            Box::new(move |v: &mut Value| v["tensors"][&f]["min"] = json!("low"))
        }),
    ];
    for (n, e) in edits {
        let mut v = g.clone();
        e(&mut v);
        let p = t.join(format!("stats-{n}.json"));
        std::fs::write(&p, serde_json::to_string(&v).unwrap()).unwrap();
        let out = t.join(format!("enc-{n}.json")).display().to_string();
        case(
            cases,
            &format!("stats {n}"),
            s(&[
                "quantize",
                "--model",
                &m,
                "--stats",
                p.to_str().unwrap(),
                "--out",
                &out,
            ]),
            &[&format!("stats-{n}.json")],
        );
    }
    for (n, text) in [
        ("empty", ""),
        ("not-json", "stats"),
        ("truncated", "{\"tensors\": {"),
        ("array", "[]"),
    ] {
        let p = t.join(format!("stats-{n}.json"));
        std::fs::write(&p, text).unwrap();
        let out = t.join(format!("enc-{n}.json")).display().to_string();
        case(
            cases,
            &format!("stats {n}"),
            s(&[
                "quantize",
                "--model",
                &m,
                "--stats",
                p.to_str().unwrap(),
                "--out",
                &out,
            ]),
            &[&format!("stats-{n}.json")],
        );
    }
}

/// A copy of the tiny checkpoint whose model.safetensors is `edit`ed as (header JSON, data bytes).
fn weights_with(dir: &Path, edit: impl Fn(&mut Value, &mut Vec<u8>)) -> PathBuf {
    let d = model_with(dir, |_| {});
    let p = d.join("model.safetensors");
    let b = std::fs::read(&p).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let mut h: Value = serde_json::from_slice(&b[8..8 + n]).unwrap();
    let mut data = b[8 + n..].to_vec();
    edit(&mut h, &mut data);
    let hb = serde_json::to_vec(&h).unwrap();
    let mut out = (hb.len() as u64).to_le_bytes().to_vec();
    out.extend(hb);
    out.extend(data);
    std::fs::write(&p, out).unwrap();
    d
}

/// Checkpoint files: safetensors layout and values, tokenizer files; GGUF inputs to `import`.
fn file_cases(t: &Path, cases: &mut Vec<Case>) {
    let first = |h: &Value| {
        h.as_object()
            .unwrap()
            .keys()
            .find(|k| *k != "__metadata__")
            .unwrap()
            .clone()
    };
    type Edit = Box<dyn Fn(&mut Value, &mut Vec<u8>)>;
    let edits: Vec<(&str, Edit, &str)> = vec![
        (
            "overlap",
            Box::new(move |h: &mut Value, _: &mut Vec<u8>| {
                let o = h.as_object_mut().unwrap();
                let ks: Vec<String> = o.keys().filter(|k| *k != "__metadata__").cloned().collect();
                let a = o[&ks[0]]["data_offsets"].clone();
                let len = a[1].as_u64().unwrap() - a[0].as_u64().unwrap();
                // second tensor shifted to start inside the first, same length
                let b0 = o[&ks[1]]["data_offsets"][0].as_u64().unwrap();
                let _ = b0;
                o.get_mut(&ks[1]).unwrap()["data_offsets"] = json!([
                    a[0].as_u64().unwrap() + 4,
                    a[0].as_u64().unwrap() + 4 + len.min(4)
                ]);
            }),
            "data_offsets",
        ),
        (
            "overlap-same-size",
            Box::new(move |h: &mut Value, _: &mut Vec<u8>| {
                let o = h.as_object_mut().unwrap();
                let mut ks: Vec<(u64, String)> = o
                    .iter()
                    .filter(|(k, _)| *k != "__metadata__")
                    .map(|(k, v)| (v["data_offsets"][0].as_u64().unwrap(), k.clone()))
                    .collect();
                ks.sort();
                // the second tensor by offset starts 4 bytes early, keeping its length
                let k = &ks[1].1;
                let a = o[k]["data_offsets"].clone();
                o.get_mut(k).unwrap()["data_offsets"] =
                    json!([a[0].as_u64().unwrap() - 4, a[1].as_u64().unwrap() - 4]);
            }),
            "overlaps",
        ),
        (
            "trailing-bytes",
            Box::new(move |_: &mut Value, d: &mut Vec<u8>| d.extend([0u8; 8])),
            "after the last tensor",
        ),
        (
            "past-end",
            Box::new(move |h: &mut Value, d: &mut Vec<u8>| {
                let k = first(h);
                h[&k]["data_offsets"] = json!([0, d.len() as u64 + 64]);
            }),
            "data_offsets",
        ),
        (
            "bad-dtype",
            Box::new(move |h: &mut Value, _: &mut Vec<u8>| {
                let k = first(h);
                h[&k]["dtype"] = json!("F12");
            }),
            "F12",
        ),
        (
            "shape-mismatch",
            Box::new(move |h: &mut Value, _: &mut Vec<u8>| {
                let k = first(h);
                h[&k]["shape"] = json!([3, 3]);
            }),
            "shape",
        ),
        (
            "missing-tensor",
            Box::new(move |h: &mut Value, d: &mut Vec<u8>| {
                let k = h
                    .as_object()
                    .unwrap()
                    .keys()
                    .find(|k| k.contains("layers.0.self_attn.q_proj"))
                    .unwrap()
                    .clone();
                // its bytes go too, the tensors after it move up: a well-formed file without it
                let o = h.as_object_mut().unwrap().remove(&k).unwrap();
                let (a, b) = (
                    o["data_offsets"][0].as_u64().unwrap(),
                    o["data_offsets"][1].as_u64().unwrap(),
                );
                d.drain(a as usize..b as usize);
                for (name, v) in h.as_object_mut().unwrap() {
                    if name == "__metadata__" {
                        continue;
                    }
                    for i in 0..2 {
                        let x = v["data_offsets"][i].as_u64().unwrap();
                        if x >= b {
                            v["data_offsets"][i] = json!(x - (b - a));
                        }
                    }
                }
            }),
            "q_proj",
        ),
        (
            "nan",
            Box::new(move |h: &mut Value, d: &mut Vec<u8>| {
                let k = h
                    .as_object()
                    .unwrap()
                    .keys()
                    .find(|k| k.contains("layers.1.mlp.up_proj"))
                    .unwrap()
                    .clone();
                let s = h[&k]["data_offsets"][0].as_u64().unwrap() as usize;
                d[s..s + 4].copy_from_slice(&f32::NAN.to_le_bytes());
            }),
            "up_proj",
        ),
        (
            "inf",
            Box::new(move |h: &mut Value, d: &mut Vec<u8>| {
                let k = h
                    .as_object()
                    .unwrap()
                    .keys()
                    .find(|k| k.contains("layers.2.self_attn.o_proj"))
                    .unwrap()
                    .clone();
                let s = h[&k]["data_offsets"][0].as_u64().unwrap() as usize;
                d[s + 8..s + 12].copy_from_slice(&f32::INFINITY.to_le_bytes());
            }),
            "o_proj",
        ),
        (
            "truncated-data",
            Box::new(move |_: &mut Value, d: &mut Vec<u8>| {
                let n = d.len() / 2;
                d.truncate(n);
            }),
            "model.safetensors",
        ),
    ];
    for (n, e, want) in edits {
        let d = weights_with(&t.join(format!("st-{n}")), e);
        let ds = d.display().to_string();
        case(
            cases,
            &format!("safetensors {n} (inspect)"),
            s(&["inspect", &ds]),
            &["model.safetensors", want],
        );
        case(
            cases,
            &format!("safetensors {n} (run)"),
            s(&["run", "--model", &ds, "--prompt", "hi", "--max-tokens", "1"]),
            &["model.safetensors", want],
        );
    }
    for (n, bytes) in [
        ("empty", vec![]),
        ("short-header", vec![1, 2, 3]),
        ("huge-header", (u64::MAX / 2).to_le_bytes().to_vec()),
        ("header-not-json", {
            let mut v = 5u64.to_le_bytes().to_vec();
            v.extend(b"hello");
            v
        }),
    ] {
        let d = model_with(&t.join(format!("stb-{n}")), |_| {});
        std::fs::write(d.join("model.safetensors"), bytes).unwrap();
        let ds = d.display().to_string();
        case(
            cases,
            &format!("safetensors {n} (inspect)"),
            s(&["inspect", &ds]),
            &["model.safetensors"],
        );
        case(
            cases,
            &format!("safetensors {n} (run)"),
            s(&["run", "--model", &ds, "--prompt", "hi", "--max-tokens", "1"]),
            &["model.safetensors"],
        );
    }
    for (f, text) in [
        ("tokenizer.json", "{not json"),
        ("tokenizer.json", ""),
        ("chat_template.jinja", "{% if %}"),
        ("config.json", "{\"text_config\": "),
    ] {
        let d = model_with(&t.join(format!("tok-{}-{}", f, text.len())), |_| {});
        std::fs::write(d.join(f), text).unwrap();
        let ds = d.display().to_string();
        case(
            cases,
            &format!("{f} {text:?} (run)"),
            s(&["run", "--model", &ds, "--prompt", "hi", "--max-tokens", "1"]),
            &[f],
        );
    }
    // A checkpoint without tokenizer.json exports nothing (the host could not tokenize).
    let d = model_with(&t.join("no-tokenizer"), |_| {});
    std::fs::remove_file(d.join("tokenizer.json")).unwrap();
    let out = t.join("no-tokenizer-export").display().to_string();
    case(
        cases,
        "no tokenizer.json (export)",
        s(&[
            "export",
            "--model",
            &d.display().to_string(),
            "--variant",
            "decode_wgqa",
            "--context",
            "64",
            "--out",
            &out,
        ]),
        &["tokenizer.json"],
    );
    // GGUF inputs to import.
    let good = {
        let mut v = b"GGUF".to_vec();
        v.extend(3u32.to_le_bytes());
        v.extend(0u64.to_le_bytes());
        v.extend(0u64.to_le_bytes());
        v
    };
    let mut bad_magic = good.clone();
    bad_magic[..4].copy_from_slice(b"GGML");
    let mut v1 = good.clone();
    v1[4..8].copy_from_slice(&1u32.to_le_bytes());
    let mut many = good.clone();
    many[8..16].copy_from_slice(&(u64::MAX / 4).to_le_bytes());
    let mut kv_many = good.clone();
    kv_many[16..24].copy_from_slice(&(1u64 << 40).to_le_bytes());
    for (n, b) in [
        ("empty", vec![]),
        ("bad-magic", bad_magic),
        ("version-1", v1),
        ("tensor-count", many),
        ("kv-count", kv_many),
        ("no-arch", good.clone()),
        ("truncated", good[..10].to_vec()),
    ] {
        let p = t.join(format!("gguf-{n}.gguf"));
        std::fs::write(&p, b).unwrap();
        let out = t.join(format!("gguf-{n}-out")).display().to_string();
        case(
            cases,
            &format!("gguf {n} (import)"),
            s(&["import", "--gguf", p.to_str().unwrap(), "--out", &out]),
            &[&format!("gguf-{n}.gguf")],
        );
    }
    let missing = t.join("nope.gguf").display().to_string();
    case(
        cases,
        "gguf missing (import)",
        s(&[
            "import",
            "--gguf",
            &missing,
            "--out",
            &t.join("o").display().to_string(),
        ]),
        &["nope.gguf"],
    );
}

/// Existing outputs are refused without --force, by every writer; unwritable destinations are named.
fn output_cases(t: &Path, cases: &mut Vec<Case>) {
    let m = fixture().display().to_string();
    let f = t.join("exists.json");
    std::fs::write(&f, "{}").unwrap();
    let d = t.join("exists-dir");
    std::fs::create_dir_all(&d).unwrap();
    let (fs, ds) = (f.display().to_string(), d.display().to_string());
    let st = t.join("ds-good-stats.json").display().to_string();
    for (n, a) in [
        (
            "calibrate",
            s(&[
                "calibrate",
                "--model",
                &m,
                "--limit",
                "1",
                "--context",
                "64",
                "--out",
                &fs,
            ]),
        ),
        (
            "quantize",
            s(&["quantize", "--model", &m, "--stats", &st, "--out", &fs]),
        ),
        (
            "gguf",
            s(&["gguf", "--model", &m, "--type", "f16", "--out", &fs]),
        ),
        (
            "export",
            s(&[
                "export",
                "--model",
                &m,
                "--variant",
                "decode_wgqa",
                "--context",
                "64",
                "--out",
                &ds,
            ]),
        ),
        (
            "synth",
            s(&[
                "synth",
                "--config",
                &format!("{m}/config.json"),
                "--out",
                &ds,
            ]),
        ),
        ("import", s(&["import", "--gguf", &fs, "--out", &ds])),
    ] {
        case(
            cases,
            &format!("{n} existing --out"),
            a,
            &["already exists", "--force"],
        );
    }
    let under_file = f.join("sub/out.json").display().to_string();
    for (n, a) in [
        (
            "calibrate",
            s(&[
                "calibrate",
                "--model",
                &m,
                "--limit",
                "1",
                "--context",
                "64",
                "--out",
                &under_file,
            ]),
        ),
        (
            "quantize",
            s(&[
                "quantize",
                "--model",
                &m,
                "--stats",
                &st,
                "--out",
                &under_file,
            ]),
        ),
        (
            "gguf",
            s(&["gguf", "--model", &m, "--type", "f16", "--out", &under_file]),
        ),
        (
            "export",
            s(&[
                "export",
                "--model",
                &m,
                "--variant",
                "decode_wgqa",
                "--context",
                "64",
                "--out",
                &under_file,
            ]),
        ),
    ] {
        case(
            cases,
            &format!("{n} --out under a file"),
            a,
            &["exists.json"],
        );
    }
}

/// Encodings read by `verify` and `export`: validated the same way (names, bitwidths, scales, offsets, KV
/// width, the graph they were made for).
fn encodings_cases(t: &Path, cases: &mut Vec<Case>) {
    let m = fixture().display().to_string();
    let good: Value =
        serde_json::from_str(&std::fs::read_to_string(t.join("ds-good-enc.json")).unwrap())
            .unwrap();
    let act = good["activation_encodings"]
        .as_object()
        .unwrap()
        .keys()
        .nth(3)
        .unwrap()
        .clone();
    type Edit = Box<dyn Fn(&mut Value)>;
    let a2 = act.clone();
    let a3 = act.clone();
    let a4 = act.clone();
    let a5 = act.clone();
    let a6 = act.clone();
    let edits: Vec<(&str, Edit, &str)> = vec![
        (
            "wrong-name",
            Box::new(move |v: &mut Value| {
                let e = v["activation_encodings"][&a2].clone();
                v["activation_encodings"]["no.such.tensor"] = e;
            }),
            "no.such.tensor",
        ),
        (
            "bitwidth-0",
            Box::new(move |v: &mut Value| v["activation_encodings"][&a3][0]["bitwidth"] = json!(0)),
            "bitwidth",
        ),
        (
            "bitwidth-99",
            Box::new(move |v: &mut Value| {
                v["activation_encodings"][&a4][0]["bitwidth"] = json!(99)
            }),
            "bitwidth",
        ),
        (
            "scale-negative",
            Box::new(move |v: &mut Value| v["activation_encodings"][&a5][0]["scale"] = json!(-0.5)),
            "scale",
        ),
        (
            "offset-positive",
            Box::new(move |v: &mut Value| v["activation_encodings"][&a6][0]["offset"] = json!(7)),
            "offset",
        ),
        (
            "empty-list",
            Box::new(move |v: &mut Value| v["activation_encodings"][&act] = json!([])),
            "empty",
        ),
        (
            "context-zero",
            Box::new(|v: &mut Value| v["hexq"]["context"] = json!(0)),
            "context",
        ),
        (
            "context-huge",
            Box::new(|v: &mut Value| v["hexq"]["context"] = json!(1u64 << 40)),
            "context",
        ),
        (
            "no-variant",
            Box::new(|v: &mut Value| {
                v["hexq"].as_object_mut().unwrap().remove("variant");
            }),
            "variant",
        ),
    ];
    for (n, e, want) in edits {
        let mut v = good.clone();
        e(&mut v);
        let p = t.join(format!("enc-bad-{n}.json"));
        std::fs::write(&p, serde_json::to_string(&v).unwrap()).unwrap();
        let ps = p.display().to_string();
        case(
            cases,
            &format!("encodings {n} (verify)"),
            s(&[
                "verify",
                "--model",
                &m,
                "--encodings",
                &ps,
                "--limit",
                "1",
                "--steps",
                "1",
            ]),
            &[&format!("enc-bad-{n}.json"), want],
        );
        if !n.starts_with("context") && n != "no-variant" {
            let out = t.join(format!("enc-bad-{n}-export")).display().to_string();
            case(
                cases,
                &format!("encodings {n} (export)"),
                s(&[
                    "export",
                    "--model",
                    &m,
                    "--variant",
                    "decode_wgqa",
                    "--context",
                    "64",
                    "--seq",
                    "16",
                    "--encodings",
                    &ps,
                    "--qdq",
                    "--out",
                    &out,
                ]),
                &[&format!("enc-bad-{n}.json"), want],
            );
        }
    }
    for (n, text) in [("empty", ""), ("not-json", "enc"), ("array", "[]")] {
        let p = t.join(format!("encin-{n}.json"));
        std::fs::write(&p, text).unwrap();
        let ps = p.display().to_string();
        case(
            cases,
            &format!("encodings {n} (verify)"),
            s(&["verify", "--model", &m, "--encodings", &ps]),
            &[&format!("encin-{n}.json")],
        );
    }
}

#[test]
fn every_bad_input_fails_cleanly() {
    let t = tempfile::tempdir().unwrap();
    let mut cases = Vec::new();
    config_cases(t.path(), &mut cases);
    cli_cases(t.path(), &mut cases);
    dataset_cases(t.path(), &mut cases);
    encodings_cases(t.path(), &mut cases);
    stats_cases(t.path(), &mut cases);
    file_cases(t.path(), &mut cases);
    output_cases(t.path(), &mut cases);
    let mut bad = Vec::new();
    if std::env::var_os("HEXQ_CORPUS_LIST").is_some() {
        for c in &cases {
            eprintln!("case: {}", c.name);
        }
    }
    for c in &cases {
        let o = Command::new(env!("CARGO_BIN_EXE_hexq"))
            .args(&c.args)
            .current_dir(common::root())
            .output()
            .unwrap();
        let code = o.status.code().unwrap_or(-1);
        let err = String::from_utf8_lossy(&o.stderr).to_string();
        let missing: Vec<&String> = c
            .expect
            .iter()
            .filter(|e| !err.contains(e.as_str()))
            .collect();
        let left = leftovers(t.path());
        if !(code == 1 || code == 2) || !missing.is_empty() || !left.is_empty() {
            bad.push(format!(
                "{}: exit {code}, missing {missing:?}, leftovers {left:?}: {}",
                c.name,
                err.lines().last().unwrap_or("")
            ));
            for l in left {
                let _ = std::fs::remove_dir_all(&l).or_else(|_| std::fs::remove_file(&l));
            }
        }
    }
    eprintln!("{} cases, {} bad", cases.len(), bad.len());
    assert!(
        bad.is_empty(),
        "{} of {} cases:\n{}",
        bad.len(),
        cases.len(),
        bad.join("\n")
    );
}

/// The smallest contexts and chunk lengths through every command that takes them: each either runs (exit
/// 0) or refuses naming the option (exit 1 or 2) — never a panic deep in a kernel. Contexts 0, 1, 2 and
/// SEQ − 1 (127: just below the default trunk chunk), chunk lengths 0, 1, 2 and the context + 1.
#[test]
fn small_contexts_and_seqs_never_panic() {
    let t = tempfile::tempdir().unwrap();
    let m = fixture().display().to_string();
    let enc = t.path().join("e.json");
    let st = t.path().join("st.json");
    let hexq = |args: &[String]| {
        Command::new(env!("CARGO_BIN_EXE_hexq"))
            .args(args)
            .current_dir(common::root())
            .output()
            .unwrap()
    };
    let o = hexq(&s(&[
        "calibrate",
        "--model",
        &m,
        "--limit",
        "1",
        "--context",
        "64",
        "--out",
        st.to_str().unwrap(),
    ]));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = hexq(&s(&[
        "quantize",
        "--model",
        &m,
        "--stats",
        st.to_str().unwrap(),
        "--out",
        enc.to_str().unwrap(),
    ]));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = |n: &str| t.path().join(n).display().to_string();
    let mut runs: Vec<Vec<String>> = Vec::new();
    for c in ["0", "1", "2", "127"] {
        let base: Vec<Vec<&str>> = vec![
            vec!["run", "--prompt", "hi", "--max-tokens", "2"],
            vec![
                "run",
                "--backend",
                "graph",
                "--prompt",
                "hi",
                "--max-tokens",
                "2",
            ],
            vec!["calibrate", "--limit", "1"],
            vec!["calibrate", "--variant", "trunk", "--limit", "1"],
            vec!["graph", "--variant", "decode_wgqa"],
            vec!["graph", "--variant", "trunk"],
            vec!["export", "--variant", "decode_wgqa"],
            vec!["export", "--variant", "trunk"],
            vec!["ablate", "--limit", "1", "--schemes", "int8-pc"],
            vec![
                "verify",
                "--limit",
                "1",
                "--encodings",
                enc.to_str().unwrap(),
            ],
        ];
        for (k, b) in base.iter().enumerate() {
            let mut a = s(b);
            a.extend(s(&["--model", &m, "--context", c]));
            if matches!(b[0], "calibrate" | "export") {
                a.extend(s(&["--out", &out(&format!("o-{c}-{k}"))]));
            }
            runs.push(a);
        }
        if c != "127" {
            runs.push(s(&[
                "pipeline",
                "--model",
                &m,
                "--context",
                c,
                "--out",
                &out(&format!("p-{c}")),
            ]));
        }
    }
    for q in ["0", "1", "2", "65"] {
        for b in [
            vec!["graph", "--variant", "trunk"],
            vec!["export", "--variant", "trunk", "--out"],
            vec!["calibrate", "--variant", "trunk", "--limit", "1", "--out"],
            vec![
                "run",
                "--backend",
                "graph",
                "--prompt",
                "hi",
                "--max-tokens",
                "2",
            ],
        ] {
            let mut a = s(&b);
            if b.last() == Some(&"--out") {
                a.push(out(&format!("q-{q}-{}", b[0])));
            }
            a.extend(s(&["--model", &m, "--context", "64", "--seq", q]));
            runs.push(a);
        }
    }
    let mut bad = Vec::new();
    let mut codes = std::collections::BTreeMap::new();
    for a in &runs {
        let o = hexq(a);
        let code = o.status.code().unwrap_or(-1);
        *codes.entry(code).or_insert(0) += 1;
        let err = String::from_utf8_lossy(&o.stderr);
        let named = err.contains("context") || err.contains("seq");
        if !(code == 0 || (code == 1 || code == 2) && named) {
            bad.push(format!(
                "hexq {}: exit {code}: {}",
                a.join(" "),
                err.lines().last().unwrap_or("")
            ));
        }
    }
    eprintln!("{} runs, by exit code: {codes:?}", runs.len());
    assert!(
        bad.is_empty(),
        "{} of {} runs:\n{}",
        bad.len(),
        runs.len(),
        bad.join("\n")
    );
}

/// Every backend stops at its capacity the same way: reason `context_full`, exit 0, the text kept.
#[test]
fn generation_reaching_the_context_stops_with_context_full() {
    let m = fixture().display().to_string();
    let o = Command::new(env!("CARGO_BIN_EXE_hexq"))
        .args([
            "run",
            "--model",
            &m,
            "--backend",
            "graph",
            "--context",
            "16",
            "--seq",
            "8",
            "--max-tokens",
            "40",
            "--prompt",
            "hi",
            "--json",
        ])
        .current_dir(common::root())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["stop_reason"], "context_full", "{v}");
}

/// Ctrl-C / a scheduler's SIGTERM mid-write: exit 130 / 143 and no temp output left (synth of the E2B
/// config writes ~10 GB, so it is mid-write once its temp directory exists; calibrate on the full dataset is
/// mid-run at 1.5 s).
#[test]
fn interrupted_writers_leave_nothing() {
    let t = tempfile::tempdir().unwrap();
    let m = fixture().display().to_string();
    let e2b = common::root()
        .join("tests/fixtures/e2b-config.json")
        .display()
        .to_string();
    let synth_out = t.path().join("synth").display().to_string();
    let stats_out = t.path().join("stats.json").display().to_string();
    for (sig, code, args) in [
        (
            "TERM",
            143,
            s(&["synth", "--config", &e2b, "--out", &synth_out]),
        ),
        (
            "INT",
            130,
            s(&[
                "calibrate",
                "--model",
                &m,
                "--context",
                "64",
                "--out",
                &stats_out,
            ]),
        ),
    ] {
        let child = Command::new(env!("CARGO_BIN_EXE_hexq"))
            .args(&args)
            .current_dir(common::root())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // Kill as soon as the temp output exists (synth) or after 1.5 s (calibrate writes at the end), so
        // the signal lands mid-write however fast the disk is and before a small disk could fill.
        let t0 = std::time::Instant::now();
        while t0.elapsed() < std::time::Duration::from_millis(1500)
            && std::fs::read_dir(t.path()).unwrap().next().is_none()
        {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
        let k = Command::new("kill")
            .args([format!("-{sig}"), child.id().to_string()])
            .status()
            .unwrap();
        assert!(k.success());
        let o = child.wait_with_output().unwrap();
        assert_eq!(
            o.status.code(),
            Some(code),
            "{args:?} after SIG{sig}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let left: Vec<_> = std::fs::read_dir(t.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert!(left.is_empty(), "{args:?} left {left:?}");
    }
}

/// A write that fails (here a file-size limit, as a full disk would) exits 1 naming the user's --out, not
/// the temp file behind it, and leaves nothing.
#[test]
fn failed_writes_name_the_output_and_leave_nothing() {
    let t = tempfile::tempdir().unwrap();
    let bin = env!("CARGO_BIN_EXE_hexq");
    let m = fixture().display().to_string();
    let e2b = common::root()
        .join("tests/fixtures/e2b-config.json")
        .display()
        .to_string();
    for (out, args) in [
        (
            "exp",
            vec![
                "export",
                "--model",
                &m,
                "--variant",
                "decode_wgqa",
                "--context",
                "64",
                "--out",
            ],
        ),
        (
            "f16.gguf",
            vec!["gguf", "--model", &m, "--type", "f16", "--out"],
        ),
        ("synth", vec!["synth", "--config", &e2b, "--out"]),
    ] {
        let o = t.path().join(out);
        let cmd = format!(
            "ulimit -f 2000; exec {bin} {} {}",
            args.join(" "),
            o.display()
        );
        let r = Command::new("sh")
            .args(["-c", &cmd])
            .current_dir(common::root())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&r.stderr);
        assert_eq!(r.status.code(), Some(1), "{out}: {err}");
        assert!(
            err.contains(&o.display().to_string()) && !err.contains(".tmp-"),
            "{out}: {err}"
        );
        let left: Vec<_> = std::fs::read_dir(t.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert!(left.is_empty(), "{out} left {left:?}");
    }
}
