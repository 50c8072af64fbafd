//! ONNX export judged by the real tools: onnx.checker (full_check) and onnxruntime with a numpy host loop,
//! against the transformers goldens (tests/judges/ort_graphs.py).

use serde_json::Value;
use std::process::Command;

mod common;
use common::{calibrate_quantize, hexq, hexq_ok, judge, root};

fn judges_available() -> bool {
    judge("onnx, onnxruntime, safetensors")
}

#[test]
fn exported_graphs_pass_the_checker_and_onnxruntime_matches_transformers() {
    if !judges_available() {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let exp = t.path().join("exp");
    std::fs::create_dir(&exp).unwrap();
    for (v, d) in [("decode-wgqa", "d"), ("trunk", "t")] {
        let out = t.path().join(d);
        // context 64 ≥ prompt + 8; SEQ 16 so the 40-token golden sequence takes three trunk chunks.
        let o = hexq(&[
            "export",
            "--model",
            "tests/fixtures/tiny-gemma4",
            "--variant",
            v,
            "--context",
            "64",
            "--seq",
            "16",
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        for f in std::fs::read_dir(&out).unwrap() {
            let f = f.unwrap();
            if f.path().is_dir() {
                continue;
            }
            std::fs::copy(f.path(), exp.join(f.file_name())).unwrap();
        }
    }
    let o = Command::new("python3")
        .arg(root().join("tests/judges/ort_graphs.py"))
        .arg(&exp)
        .arg(root().join("tests/fixtures/tiny-gemma4"))
        .arg(root().join("tests/fixtures/golden"))
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "judge failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let r: Value = serde_json::from_slice(&o.stdout).unwrap();
    for g in ["decode_wgqa", "trunk"] {
        assert_eq!(r["checker"][g]["ok"], true);
        assert_eq!(
            r["checker"][g]["expand_nodes"], 0,
            "{g}: Expand counted by onnx"
        );
        assert_eq!(r["checker"][g]["int32_index_inputs"], true);
        assert_eq!(
            r["checker"][g]["vocab_dims"],
            serde_json::json!([]),
            "{g}: a vocab-sized tensor in the graph"
        );
    }
    // Every position of all three sequences (the 40-token one wraps the 16-entry rings twice).
    assert!(r["decode"]["max_rel_err"].as_f64().unwrap() <= 1e-4, "{r}");
    assert!(r["trunk"]["max_rel_err"].as_f64().unwrap() <= 1e-4, "{r}");
    for s in ["short", "long", "chat"] {
        assert_eq!(
            r["decode"][s]["equal"], true,
            "{s}: onnxruntime greedy != transformers: {r}"
        );
    }
}

#[test]
fn export_is_deterministic_atomic_and_refuses_to_overwrite() {
    let t = tempfile::tempdir().unwrap();
    let a = t.path().join("a");
    let b = t.path().join("b");
    for d in [&a, &b] {
        let o = hexq(&[
            "export",
            "--model",
            "tests/fixtures/tiny-gemma4",
            "--variant",
            "decode-wgqa",
            "--context",
            "64",
            "--out",
            d.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    for f in ["decode_wgqa.onnx", "decode_wgqa.data"] {
        assert_eq!(
            std::fs::read(a.join(f)).unwrap(),
            std::fs::read(b.join(f)).unwrap(),
            "{f} differs between runs"
        );
    }
    let o = hexq(&[
        "export",
        "--model",
        "tests/fixtures/tiny-gemma4",
        "--variant",
        "decode-wgqa",
        "--out",
        a.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("already exists"));
    // A failing export (bad model) leaves no directory and no temp dir behind.
    let c = t.path().join("c");
    let o = hexq(&[
        "export",
        "--model",
        "/nonexistent",
        "--out",
        c.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(!c.exists());
    assert!(std::fs::read_dir(t.path()).unwrap().all(|e| !e
        .unwrap()
        .file_name()
        .to_string_lossy()
        .contains(".tmp-")));
}

#[test]
fn qdq_export_in_onnxruntime_matches_hexq_quantsim() {
    if !judges_available() {
        return;
    }
    use hexq_graph::{GraphOptions, Variant};
    use std::sync::Arc;
    let t = tempfile::tempdir().unwrap();
    let (_, enc_path, enc8_path) = calibrate_quantize(t.path(), 16, 128, 4);
    let dir = root().join("tests/fixtures/tiny-gemma4");
    let ck = Arc::new(hexq_model::Checkpoint::open(&dir).unwrap());
    let tok = hexq_model::chat::Tokenizer::from_dir(&dir).unwrap();
    let recs = hexq_model::dataset::load_dataset(&root().join("datasets/heldout.jsonl")).unwrap();
    let go = GraphOptions {
        context: 128,
        seq: 16,
    };
    for (variant, ep) in [
        ("decode_wgqa", &enc_path),
        ("decode_wgqa_int8kv", &enc8_path),
    ] {
        let out = t.path().join(variant);
        let o = hexq(&[
            "export",
            "--model",
            "tests/fixtures/tiny-gemma4",
            "--variant",
            variant,
            "--context",
            "128",
            "--seq",
            "16",
            "--encodings",
            ep.to_str().unwrap(),
            "--qdq",
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let enc: hexq_quantize::Encodings =
            serde_json::from_slice(&std::fs::read(ep).unwrap()).unwrap();
        let mut q = hexq_eval::verify::quantsim(&ck, &enc, Variant::DecodeWgqa, &go).unwrap();
        // Every held-out prompt (prefill token by token through decode, ring wrapping past 16 tokens).
        let mut prompts = Vec::new();
        for r in &recs {
            let ids: Vec<u32> = tok.encode_chat(r.messages.as_ref().unwrap()).unwrap();
            let ids: Vec<u32> = ids.into_iter().take(48).collect(); // > 16: wraps the rings
            hexq_runtime::Backend::reset(&mut q);
            let hs: Vec<Vec<f32>> = ids.iter().map(|&i| q.step(i).unwrap()).collect();
            let top1 = hexq_model::forward::argmax(&q.logits(hs.last().unwrap()).unwrap());
            prompts.push(serde_json::json!({"id": r.id, "ids": ids, "hidden": hs, "top1": top1}));
        }
        let cases = t.path().join(format!("{variant}.cases.json"));
        let keep = std::env::var("HEXQ_KEEP").ok();
        std::fs::write(
            &cases,
            serde_json::to_vec(&serde_json::json!({"variant": variant, "prompts": prompts}))
                .unwrap(),
        )
        .unwrap();
        let step0 = t.path().join(format!("{variant}.step0.json"));
        // The second token, through the graph at position 0 (the first, BOS, is the host prefix: no graph run).
        let first = prompts[0]["ids"][1].as_u64().unwrap() as u32;
        std::fs::write(
            &step0,
            serde_json::to_vec(&quantsim_step0(&ck, &enc, first)).unwrap(),
        )
        .unwrap();
        let o = Command::new("python3")
            .arg(root().join("tests/judges/ort_qdq.py"))
            .arg(&out)
            .arg(&cases)
            .arg(&step0)
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "judge failed: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let r: Value = serde_json::from_slice(&o.stdout).unwrap();
        if let Some(k) = &keep {
            std::fs::write(format!("{k}.{variant}.json"), &o.stdout).unwrap();
            let _ = Command::new("cp")
                .args(["-r", t.path().to_str().unwrap(), &format!("{k}.dir")])
                .status();
        }
        let summary = serde_json::json!({"variant": variant, "n": r["n"], "top1_equal": r["top1_equal"],
            "cos_min": r["cos_min"], "cos_mean": r["cos_mean"], "step0": r["step0"], "qdq_ops": r["qdq_ops"], "types": r["zero_point_types"]});
        eprintln!("{summary}");
        assert!(
            r["qdq_ops"]["QuantizeLinear"].as_u64().unwrap() > 1000,
            "{summary}"
        );
        assert_eq!(r["n"].as_u64().unwrap() as usize, recs.len());
        // Same arithmetic, tensor by tensor: quantsim sums and squashes as onnxruntime's CPU EP (MLAS's MatMul
        // orders, logistic and softmax; Eigen's mean — graph/src/rowmm.rs, dot.rs, ops.rs), so on one
        // decode call every encoded tensor is identical, element for element (measured: 1072 of 1072, both
        // variants; before, 5–6 origins one quantization step apart from sum orders and MLAS's Sigmoid).
        let s0 = &r["step0"];
        assert_eq!(
            s0["tensors"].as_u64().unwrap() as usize,
            enc.activation_encodings.len(),
            "{summary}"
        );
        assert_eq!(s0["origins"].as_u64(), Some(0), "{summary}");
        assert_eq!(s0["differing_elements"].as_u64(), Some(0), "{summary}");
        assert_eq!(s0["identical_tensors"], s0["tensors"], "{summary}");
        // Whole prompts, every position: the issue's bar (top-1 equal, cosine ≥ 0.9999), met exactly on
        // both graphs (measured: 119/119, cosine 1.0).
        let n = r["n"].as_f64().unwrap();
        let (top1, cos_mean, cos_min) = (
            r["top1_equal"].as_f64().unwrap(),
            r["cos_mean"].as_f64().unwrap(),
            r["cos_min"].as_f64().unwrap(),
        );
        assert_eq!(top1, n, "{summary}");
        assert!(cos_mean >= 0.9999999 && cos_min >= 0.9999999, "{summary}");
    }
}

/// Every tensor of hexq's quantsim on one decode call (token `id` at position 0, empty KV), post fake-quant.
fn quantsim_step0(
    ck: &std::sync::Arc<hexq_model::Checkpoint>,
    enc: &hexq_quantize::Encodings,
    id: u32,
) -> serde_json::Map<String, Value> {
    use hexq_graph::interp::Hook;
    use std::sync::{Arc, Mutex};
    struct Rec(
        hexq_quantize::quantsim::FakeQuant,
        Arc<Mutex<serde_json::Map<String, Value>>>,
    );
    impl Hook for Rec {
        fn tensor(&mut self, n: &str, t: &candle_core::Tensor) -> Option<candle_core::Tensor> {
            let r = self.0.tensor(n, t);
            let v = r.as_ref().unwrap_or(t);
            if let Ok(x) = v.flatten_all().and_then(|v| v.to_vec1::<f32>()) {
                self.1
                    .lock()
                    .unwrap()
                    .insert(n.into(), serde_json::json!(x));
            }
            r
        }
    }
    let go = hexq_graph::GraphOptions {
        context: 128,
        seq: 16,
    };
    let mut q = hexq_eval::verify::quantsim(ck, enc, hexq_graph::Variant::DecodeWgqa, &go).unwrap();
    let m = Arc::new(Mutex::new(serde_json::Map::new()));
    q.hook = Some(Box::new(Rec(
        hexq_quantize::quantsim::FakeQuant::activations(enc),
        m.clone(),
    )));
    q.step(id).unwrap();
    let out = m.lock().unwrap().clone();
    out
}

fn export_ok(args: &[&str]) {
    let mut a = vec!["export", "--model", "tests/fixtures/tiny-gemma4"];
    a.extend(args);
    let o = hexq(&a);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn ort_backend_matches_the_interpreter_through_ring_wraps_and_trunk_chunks() {
    if !judges_available() {
        return;
    }
    use hexq_graph::{GraphOptions, Variant};
    use std::sync::Arc;
    let t = tempfile::tempdir().unwrap();
    let (d, tr) = (t.path().join("d"), t.path().join("t"));
    export_ok(&[
        "--context",
        "64",
        "--seq",
        "16",
        "--out",
        d.to_str().unwrap(),
    ]);
    export_ok(&[
        "--variant",
        "trunk",
        "--context",
        "64",
        "--seq",
        "16",
        "--out",
        tr.to_str().unwrap(),
    ]);
    let ck =
        Arc::new(hexq_model::Checkpoint::open(&root().join("tests/fixtures/tiny-gemma4")).unwrap());
    let go = GraphOptions {
        context: 64,
        seq: 16,
    };
    let gold: Value = serde_json::from_slice(
        &std::fs::read(root().join("tests/fixtures/golden/golden.json")).unwrap(),
    )
    .unwrap();
    for with_trunk in [false, true] {
        let dirs = if with_trunk {
            vec![d.clone(), tr.clone()]
        } else {
            vec![d.clone()]
        };
        let mut o =
            hexq_runtime::ort::OrtBackend::open(&dirs, 1, hexq_runtime::ort::Ep::Cpu).unwrap();
        let mut g =
            hexq_runtime::graph::GraphBackend::for_model(&ck, Variant::DecodeWgqa, with_trunk, &go)
                .unwrap();
        for (name, s) in gold["sequences"].as_object().unwrap() {
            let ids: Vec<u32> = s["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect();
            hexq_runtime::Backend::reset(&mut o);
            hexq_runtime::Backend::reset(&mut g);
            let (ho, hg) = (o.hidden(&ids).unwrap(), g.hidden(&ids).unwrap());
            for (p, (a, b)) in ho.iter().zip(&hg).enumerate() {
                let m = b.iter().fold(0f32, |m, x| m.max(x.abs()));
                let e = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
                assert!(
                    e / m <= 1e-4,
                    "{name} pos {p} (trunk {with_trunk}): rel err {}",
                    e / m
                );
            }
            // Greedy continuation (the 40-token sequence wraps the 16-entry rings twice).
            let (a, _, _, _) = hexq_runtime::generate_ids(&mut o, &ids, 8).unwrap();
            let (b, _, _, _) = hexq_runtime::generate_ids(&mut g, &ids, 8).unwrap();
            assert_eq!(
                a, b,
                "{name}: ort greedy != interpreter (trunk {with_trunk})"
            );
        }
        assert_eq!(o.sessions_created, 1 + with_trunk as usize);
    }
}

#[test]
fn artifacts_manifest_host_model_and_determinism() {
    let t = tempfile::tempdir().unwrap();
    let a = t.path().join("a");
    export_ok(&[
        "--context",
        "64",
        "--host",
        "int4",
        "--weights",
        "f16",
        "--out",
        a.to_str().unwrap(),
    ]);
    // manifest: every file but itself, sizes and SHA256 right; the source checkpoint hashed.
    let m: Value =
        serde_json::from_slice(&std::fs::read(a.join("manifest.json")).unwrap()).unwrap();
    let files = m["files"].as_array().unwrap();
    let mut listed: Vec<String> = files
        .iter()
        .map(|f| f["path"].as_str().unwrap().to_string())
        .collect();
    for f in files {
        let p = a.join(f["path"].as_str().unwrap());
        assert_eq!(
            std::fs::metadata(&p).unwrap().len(),
            f["bytes"].as_u64().unwrap()
        );
        assert_eq!(
            hexq_fsutil::sha256_file(&p).unwrap(),
            f["sha256"].as_str().unwrap()
        );
    }
    listed.sort();
    for want in [
        "decode_wgqa.onnx",
        "decode_wgqa.data",
        "io-contract.json",
        "host-model/host-model.json",
        "host-model/embed_tokens_weight.int4",
        "host-model/embed_tokens_weight.int4.scales",
        "host-model/embed_tokens_per_layer_weight.int4",
        "host-model/norm_weight.f32",
        "host-model/tokenizer.json",
        "host-model/config.json",
    ] {
        assert!(
            listed.iter().any(|l| l == want),
            "{want} not in manifest: {listed:?}"
        );
    }
    assert!(
        m["source"]["sha256"]["model.safetensors"]
            .as_str()
            .unwrap()
            .len()
            == 64
    );
    assert_eq!(m["graph"]["weights"], "f16");
    // int4 rows dequantize within half a step of the checkpoint's values.
    let h = hexq_runtime::host::HostFiles::open(&a.join("host-model")).unwrap();
    let ck = hexq_model::Checkpoint::open(&root().join("tests/fixtures/tiny-gemma4")).unwrap();
    let e = ck.f32("embed_tokens.weight").unwrap();
    let hs = ck.config.hidden_size;
    for r in [0usize, 2, 106, 4000] {
        let want = &e[r * hs..(r + 1) * hs];
        let amax = want.iter().fold(0f32, |m, x| m.max(x.abs()));
        let got = h.embed.raw_row(r);
        for (x, y) in got.iter().zip(want) {
            assert!(
                (x - y).abs() <= amax / 7.0 / 2.0 + 1e-6,
                "row {r}: {x} vs {y}"
            );
        }
    }
    // Re-running the same command gives byte-identical files.
    let keep = t.path().join("keep");
    std::fs::rename(&a, &keep).unwrap();
    export_ok(&[
        "--context",
        "64",
        "--host",
        "int4",
        "--weights",
        "f16",
        "--out",
        a.to_str().unwrap(),
    ]);
    for f in files {
        let p = f["path"].as_str().unwrap();
        assert_eq!(
            std::fs::read(a.join(p)).unwrap(),
            std::fs::read(keep.join(p)).unwrap(),
            "{p} differs"
        );
    }
}

#[test]
fn bad_encodings_and_disk_errors_fail_cleanly() {
    let t = tempfile::tempdir().unwrap();
    let (_, enc, _) = calibrate_quantize(t.path(), 4, 64, 2);
    let e: Value = serde_json::from_slice(&std::fs::read(&enc).unwrap()).unwrap();
    let cases: Vec<(&str, Box<dyn Fn(&mut Value)>, &str)> = vec![
        (
            "missing",
            Box::new(|e: &mut Value| {
                let v = e["activation_encodings"]["hidden_states"].clone();
                e["activation_encodings"]["no_such_tensor"] = v;
            }),
            "no such activation tensor",
        ),
        (
            "bitwidth",
            Box::new(|e: &mut Value| {
                e["activation_encodings"]["hidden_states"][0]["bitwidth"] = 12.into();
            }),
            "bitwidth 12",
        ),
        (
            "uncovered",
            Box::new(|e: &mut Value| {
                e["activation_encodings"]
                    .as_object_mut()
                    .unwrap()
                    .remove("hidden_states");
            }),
            "no activation encoding for \"hidden_states\"",
        ),
        (
            "channels",
            Box::new(|e: &mut Value| {
                let pe = e["param_encodings"].as_object_mut().unwrap();
                let k = pe
                    .keys()
                    .find(|k| k.ends_with("up_proj.weight.T"))
                    .unwrap()
                    .clone();
                pe[&k].as_array_mut().unwrap().pop();
            }),
            "output channels",
        ),
        ("int8kv", Box::new(|_: &mut Value| {}), "needs 8-bit KV"),
    ];
    for (name, f, msg) in cases {
        let mut bad = e.clone();
        f(&mut bad);
        let p = t.path().join(format!("{name}.json"));
        std::fs::write(&p, serde_json::to_vec(&bad).unwrap()).unwrap();
        let out = t.path().join(format!("out-{name}"));
        let variant = if name == "int8kv" {
            "decode_wgqa_int8kv"
        } else {
            "decode_wgqa"
        };
        let o = hexq(&[
            "export",
            "--model",
            "tests/fixtures/tiny-gemma4",
            "--variant",
            variant,
            "--context",
            "64",
            "--encodings",
            p.to_str().unwrap(),
            "--qdq",
            "--out",
            out.to_str().unwrap(),
        ]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{name}: {err}");
        assert!(
            err.contains(msg) && err.contains(p.to_str().unwrap()),
            "{name}: {err}"
        );
        assert!(!out.exists(), "{name}: partial output left");
    }
    // A disk error mid-write (file-size limit: the kernel fails the write with EFBIG): clear error naming
    // the file, nothing left behind.
    let out = t.path().join("full");
    let o = Command::new("sh")
        .current_dir(root())
        .args(["-c", &format!("ulimit -f 64; exec {} export --model tests/fixtures/tiny-gemma4 --context 64 --out {}",
                              env!("CARGO_BIN_EXE_hexq"), out.display())])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("File too large") && err.contains(".data"),
        "{err}"
    );
    assert!(std::fs::read_dir(t.path()).unwrap().all(|e| !e
        .unwrap()
        .file_name()
        .to_string_lossy()
        .starts_with(".full")));
    assert!(!out.exists());
}

#[test]
fn encodings_match_aimet_quantsim_on_the_exported_onnx() {
    // Judge: aimet-onnx 2.42 (PyPI; .ci/run installs it). Elsewhere a missing aimet skips with the reason.
    if !judge("aimet_onnx") {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let m = "tests/fixtures/tiny-gemma4";
    let exp = t.path().join("exp");
    // Prompt tokens only (no greedy continuation), so both sides see exactly the same token sequences.
    // hexq calibrated twice: on onnxruntime (`--engine ort`, AIMET's engine and arithmetic) and on its
    // interpreter (the default, `enc_interp`).
    let (_, enc_interp, _) = calibrate_quantize(t.path(), 6, 128, 0);
    let (st, enc) = (
        t.path().join("stats_ort.json"),
        t.path().join("enc_ort.json"),
    );
    hexq_ok(&[
        "calibrate",
        "--model",
        m,
        "--limit",
        "6",
        "--context",
        "128",
        "--seq",
        "16",
        "--decode-tokens",
        "0",
        "--engine",
        "ort",
        "--out",
        st.to_str().unwrap(),
    ]);
    hexq_ok(&[
        "quantize",
        "--model",
        m,
        "--stats",
        st.to_str().unwrap(),
        "--out",
        enc.to_str().unwrap(),
    ]);
    // The scratch export the ort engine ran is gone; a refused run leaves nothing either.
    assert!(!t.path().join("stats_ort.ort-graph").exists());
    let bad = t.path().join("bad.json");
    let o = hexq(&[
        "calibrate",
        "--model",
        m,
        "--limit",
        "1",
        "--engine",
        "ort",
        "--noise",
        "--force",
        "--out",
        bad.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--noise"));
    assert!(!bad.exists() && !t.path().join("bad.ort-graph").exists());
    export_ok(&[
        "--context",
        "128",
        "--seq",
        "16",
        "--out",
        exp.to_str().unwrap(),
    ]);
    let tok = hexq_model::chat::Tokenizer::from_dir(&root().join(m)).unwrap();
    let recs =
        hexq_model::dataset::load_dataset(&root().join("datasets/calibration.jsonl")).unwrap();
    let seqs: Vec<Vec<u32>> = recs[..6]
        .iter()
        .map(|r| {
            tok.encode_chat(r.messages.as_ref().unwrap())
                .unwrap()
                .into_iter()
                .take(127)
                .collect()
        })
        .collect();
    let tj = t.path().join("tokens.json");
    std::fs::write(&tj, serde_json::to_vec(&seqs).unwrap()).unwrap();
    let rep = t.path().join("aimet.json");
    let o = Command::new("python3")
        .arg(root().join("tests/judges/aimet_graph.py"))
        .args([&exp, &enc, &tj, &rep, &st, &enc_interp])
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "judge failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let r: Value = serde_json::from_slice(&std::fs::read(&rep).unwrap()).unwrap();
    if let Ok(k) = std::env::var("HEXQ_KEEP") {
        std::fs::copy(&rep, k).unwrap();
    }
    let (p, a) = (&r["params"], &r["activations"]);
    // hexq's one deliberate difference: the KV write's inputs share present_*'s encoding (HTP's select needs
    // it; AIMET does not tie Where) — past_key, past_value, the new K row (k_rope.out) and V row (v_norm.normed,
    // and its v_t view) of the 5 KV-owning layers.
    assert_eq!(
        r["kv_write_tied_not_compared"].as_array().unwrap().len(),
        25,
        "{r}"
    );
    // And the masked softmax inputs, which hexq encodes from min(scores) - 32 up: one per layer.
    assert_eq!(
        r["mask_floored_not_compared"].as_array().unwrap().len(),
        10,
        "{r}"
    );
    eprintln!("params {p}\nactivations {a}");
    // AIMET given hexq's observed range of every activation (and the weights) instead of its own forward
    // passes: its encoding rules alone — placement, ties, symmetry, minimum scale, rounding — against hexq's.
    // Every encoding within 1 LSB.
    let s = &r["same_ranges"];
    eprintln!(
        "same ranges: {} of {} within 1 LSB (activations {}, params {})",
        s["within_1_lsb"], s["compared"], s["activations"], s["params"]
    );
    assert_eq!(
        s["activations_without_hexq_range"],
        serde_json::json!([]),
        "{s}"
    );
    assert_eq!(s["bitwidth_mismatch"], serde_json::json!([]), "{s}");
    assert_eq!(s["aimet_only"], serde_json::json!([]), "{s}");
    assert!(s["activations"]["compared"].as_u64().unwrap() >= 880, "{s}");
    assert_eq!(s["params"]["compared"], p["compared"], "{s}");
    assert_eq!(s["within_1_lsb"], s["compared"], "{s}");
    assert_eq!(r["bitwidth_mismatch"], serde_json::json!([]), "{r}");
    assert_eq!(r["aimet_only"], serde_json::json!([]), "{r}");
    // Parameters (per-channel int8 MatMul weights, 16-bit constants) depend on the weights alone: every
    // one within 1 LSB.
    assert!(p["compared"].as_u64().unwrap() >= 300, "{p}");
    assert_eq!(p["within_1_lsb"], p["compared"], "{p}");
    // Activations, hexq calibrated on onnxruntime: the same structure (which tensors have quantizers, tie
    // groups over Concat/ScatterND, symmetric 16-bit KV for the MatMuls' second inputs, the minimum scale)
    // and the same forward arithmetic as AIMET's — every encoding within 1 LSB (measured: max 7e-12).
    assert!(a["compared"].as_u64().unwrap() >= 900 - 20, "{a}");
    assert_eq!(a["symmetric_mismatch"], serde_json::json!([]), "{a}");
    // The KV buffers written this call (present_*, read by the score/value MatMuls): 5 owners × K, V.
    assert!(a["symmetric_both"].as_u64().unwrap() >= 10, "{a}");
    assert_eq!(a["within_1_lsb"], a["compared"], "{a}");
    // hexq's interpreter (candle's f32 sums, libm's transcendentals) against the same AIMET forward: ranges
    // agree to ~1e-7, but a zero point whose -min/scale sits near .5 can round to the neighbouring
    // integer, putting both ends one step (plus the 1e-7 of the range) apart. Measured: 889 of 892 within
    // 1 LSB, max 1.024.
    let i = &r["other"]["activations"];
    eprintln!("interpreter-calibrated encodings vs AIMET: {i}");
    assert_eq!(r["other"]["params"]["within_1_lsb"], p["compared"], "{i}");
    assert!(i["max_lsb"].as_f64().unwrap() <= 1.1, "{i}");
    assert!(
        i["within_1_lsb"].as_f64().unwrap() >= 0.99 * i["compared"].as_f64().unwrap(),
        "{i}"
    );
}

/// Quantsim sums and squashes as onnxruntime's CPU EP does (the exported QDQ graph's decode steps): the
/// weight kernel's order equals MLAS's one-row MatMul, the interpreter's Sigmoid MLAS's logistic and its
/// Softmax MLAS's (exp polynomial, 8-lane sum, reciprocal), its ReduceMean Eigen's (8 lanes),
/// bit for bit, on onnxruntime's own outputs (tests/judges/mlas_order.py).
#[test]
fn quantsim_arithmetic_is_onnxruntimes() {
    if !judge("onnx, onnxruntime, numpy") {
        return;
    }
    let o = Command::new("python3")
        .arg(root().join("tests/judges/mlas_order.py"))
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "judge failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let r: Value = serde_json::from_slice(&o.stdout).unwrap();
    let f = |v: &Value| -> Vec<f32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|b| f32::from_bits(b.as_u64().unwrap() as u32))
            .collect()
    };
    use hexq_kernels::RowWeight;
    for c in r["matmul"].as_array().unwrap() {
        let (k, n) = (
            c["k"].as_u64().unwrap() as usize,
            c["n"].as_u64().unwrap() as usize,
        );
        let (a, b, want) = (f(&c["a"]), f(&c["b"]), f(&c["y"]));
        // onnxruntime's B is [K, N]; the weight kernel keeps [out, in] rows.
        let rows: Vec<f32> = (0..n * k).map(|i| b[(i % k) * n + i / k]).collect();
        let w = RowWeight::f32(n, k, rows);
        // Two rows at once: each computes what onnxruntime's one-row kernel does.
        let two: Vec<f32> = a.iter().chain(&a).copied().collect();
        let got = w.matmul(&two, 2);
        for r in 0..2 {
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&got[r * n..(r + 1) * n]),
                bits(&want),
                "MatMul K={k} N={n} row {r}"
            );
        }
    }
    let (x, want) = (f(&r["sigmoid"]["x"]), f(&r["sigmoid"]["y"]));
    let got = hexq_kernels::logistic(&x);
    let off = got
        .iter()
        .zip(&want)
        .filter(|(g, w)| g.to_bits() != w.to_bits())
        .count();
    assert_eq!(
        off,
        0,
        "Sigmoid: {off} of {} values differ from onnxruntime {}",
        x.len(),
        r["onnxruntime"]
    );
    for c in r["softmax"].as_array().unwrap() {
        let d = c["d"].as_u64().unwrap() as usize;
        let (x, want) = (f(&c["x"]), f(&c["y"]));
        let mut got = vec![0f32; x.len()];
        for (row, o) in x.chunks_exact(d).zip(got.chunks_exact_mut(d)) {
            hexq_kernels::softmax_row(row, o);
        }
        let off = got
            .iter()
            .zip(&want)
            .filter(|(g, w)| g.to_bits() != w.to_bits())
            .count();
        assert_eq!(
            off,
            0,
            "Softmax over {d}: {off} of {} values differ",
            x.len()
        );
    }
    for c in r["attention"].as_array().unwrap() {
        let u = |key: &str| c[key].as_u64().unwrap() as usize;
        let (m, k, n) = (u("m"), u("k"), u("n"));
        let (a, b, want) = (f(&c["a"]), f(&c["b"]), f(&c["y"]));
        for h in 0..2 {
            let (ah, bh) = (
                &a[h * m * k..(h + 1) * m * k],
                &b[h * k * n..(h + 1) * k * n],
            );
            let wh: Vec<u32> = want[h * m * n..(h + 1) * m * n]
                .iter()
                .map(|v| v.to_bits())
                .collect();
            let got: Vec<u32> = hexq_kernels::matmul_slices(ah, bh, (m, k, n), false)
                .iter()
                .map(|v| v.to_bits())
                .collect();
            assert_eq!(got, wh, "attention MatMul m={m} k={k} n={n} (b as [k, n])");
            // The same product with b read as a key ring ([n, k] rows).
            let keys: Vec<f32> = (0..n * k).map(|i| bh[(i % k) * n + i / k]).collect();
            let got: Vec<u32> = hexq_kernels::matmul_slices(ah, &keys, (m, k, n), true)
                .iter()
                .map(|v| v.to_bits())
                .collect();
            if n >= k {
                assert_eq!(got, wh, "attention MatMul m={m} k={k} n={n} (keys)");
            }
        }
    }
    for c in r["mean"].as_array().unwrap() {
        let d = c["d"].as_u64().unwrap() as usize;
        let (x, want) = (f(&c["x"]), f(&c["y"]));
        let got: Vec<f32> = x.chunks_exact(d).map(hexq_kernels::mean_row).collect();
        let off = got
            .iter()
            .zip(&want)
            .filter(|(g, w)| g.to_bits() != w.to_bits())
            .count();
        assert_eq!(
            off,
            0,
            "ReduceMean over {d}: {off} of {} rows differ",
            got.len()
        );
    }
}
