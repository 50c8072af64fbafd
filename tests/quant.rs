//! Calibration → A16W8 encodings → quantsim verify on the tiny fixture, and the guards.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod common;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
}

fn hexq(args: &[&str], envs: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_hexq"));
    c.current_dir(root()).args(args);
    for (k, v) in envs {
        c.env(k, v);
    }
    c.output().unwrap()
}

fn ok(o: &Output) {
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

const MODEL: &str = "tests/fixtures/tiny-gemma4";

fn calibrate(out: &Path, extra: &[&str], envs: &[(&str, &str)]) -> Output {
    let mut a = vec![
        "calibrate",
        "--model",
        MODEL,
        "--limit",
        "12",
        "--context",
        "128",
        "--decode-tokens",
        "4",
        "--out",
        out.to_str().unwrap(),
    ];
    a.extend(extra);
    hexq(&a, envs)
}

#[test]
fn calibrate_quantize_verify_on_the_tiny_model() {
    let t = tempfile::tempdir().unwrap();
    let st = t.path().join("stats.json");
    ok(&calibrate(&st, &[], &[]));
    let s: Value = serde_json::from_str(&std::fs::read_to_string(&st).unwrap()).unwrap();
    assert_eq!(s["chat_formatted"], true);
    assert_eq!(
        s["template_ids_seen"],
        serde_json::json!([105, 106, 107, 2364, 4368])
    );
    assert!(s["tensors"]["hidden_states"]["count"].as_u64().unwrap() > 0);
    assert_eq!(s["model_sha256"].as_str().unwrap().len(), 64);
    // Encodings, plain and int8-KV: `hexq quantize` on these stats with `extra` flags.
    let quantize = |extra: &[&str], name: &str| -> (std::path::PathBuf, Value) {
        let p = t.path().join(name);
        let (sp, pp) = (st.to_str().unwrap(), p.to_str().unwrap().to_string());
        let mut a = vec!["quantize", "--model", MODEL, "--stats", sp];
        a.extend(extra);
        a.extend(["--out", pp.as_str()]);
        ok(&hexq(&a, &[]));
        let v = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        (p, v)
    };
    let (enc, e) = quantize(&[], "enc.json");
    let a = &e["activation_encodings"]["hidden_states"][0];
    assert_eq!(a["bitwidth"], 16);
    assert_eq!(a["is_symmetric"], "False");
    let w = e["param_encodings"]["layers.0.self_attn.q_proj.weight.T"]
        .as_array()
        .unwrap();
    assert_eq!(w.len(), 64, "one encoding per output channel");
    assert!(w
        .iter()
        .all(|c| c["bitwidth"] == 8 && c["offset"] == -128 && c["is_symmetric"] == "True"));
    assert_eq!(
        e["activation_encodings"]["present_key_0"][0]["bitwidth"],
        16
    );
    // Masked softmax inputs: from min(scores) - 32 up (the mask's -1e4 saturates there), not from -1e4;
    // --full-mask-range gives plain min-max.
    let sm = &e["activation_encodings"]["layers.0.self_attn.scores_masked"][0];
    let smin = s["tensors"]["layers.0.self_attn.scores"]["min"]
        .as_f64()
        .unwrap();
    let lo = sm["min"].as_f64().unwrap();
    let step = sm["scale"].as_f64().unwrap();
    assert!(
        (lo - (smin - 32.0)).abs() <= step,
        "{sm} vs scores min {smin}"
    );
    assert!(step < 2e-3, "{sm}");
    assert_eq!(
        e["hexq"]["mask_floored"].as_object().unwrap().len(),
        s["tensors"]
            .as_object()
            .unwrap()
            .keys()
            .filter(|k| k.ends_with(".scores_masked"))
            .count()
    );
    let (_, ef) = quantize(&["--full-mask-range"], "encf.json");
    let smf = &ef["activation_encodings"]["layers.0.self_attn.scores_masked"][0];
    assert!(smf["min"].as_f64().unwrap() < -9999.0, "{smf}");
    let (_, e8) = quantize(&["--int8-kv"], "enc8.json");
    assert_eq!(
        e8["activation_encodings"]["present_key_0"][0]["bitwidth"],
        8
    );
    assert_eq!(e8["activation_encodings"]["past_value_4"][0]["bitwidth"], 8);
    // Overrides: W4 per-channel MLP weights, one tensor kept at 16 bits.
    let ov = t.path().join("ov.json");
    std::fs::write(&ov, r#"{"rules": [{"pattern": "layers.*.mlp.*_proj.weight.T", "kind": "param", "bitwidth": 4}]}"#).unwrap();
    let (_, e4) = quantize(&["--overrides", ov.to_str().unwrap()], "enc4.json");
    // A rule that matches no tensor (a misspelt pattern) is refused naming the file and the rule, and
    // applied with a warning under --allow-unmatched.
    let typo = t.path().join("typo.json");
    std::fs::write(&typo, r#"{"rules": [{"pattern": "layers.*.mlp.*_prj.weight.T", "kind": "param", "bitwidth": 4}]}"#).unwrap();
    let (sp, tp) = (st.to_str().unwrap(), typo.to_str().unwrap());
    let out = t.path().join("enc-typo.json");
    let o = hexq(
        &[
            "quantize",
            "--model",
            MODEL,
            "--stats",
            sp,
            "--overrides",
            tp,
            "--out",
            out.to_str().unwrap(),
        ],
        &[],
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("typo.json")
            && err.contains("_prj.weight.T")
            && err.contains("matches no tensor"),
        "{err}"
    );
    assert!(!out.exists(), "a refused overrides file writes nothing");
    let (_, et) = quantize(&["--overrides", tp, "--allow-unmatched"], "enc-typo2.json");
    assert_eq!(
        et["param_encodings"]["layers.2.mlp.down_proj.weight.T"][0]["bitwidth"],
        8
    );
    assert_eq!(
        e4["param_encodings"]["layers.2.mlp.down_proj.weight.T"][0]["bitwidth"],
        4
    );
    assert_eq!(
        e4["param_encodings"]["layers.2.self_attn.o_proj.weight.T"][0]["bitwidth"],
        8
    );
    // Verify: A16W8 tracks float closely on the tiny model (measured: cosine ≥ 0.98, top-1 ≥ 80 %).
    let (ep, sp) = (enc.to_str().unwrap(), st.to_str().unwrap());
    let verify = |extra: &[&str]| {
        let mut a = vec!["verify", "--model", MODEL, "--encodings", ep, "--stats", sp];
        a.extend(["--limit", "8", "--steps", "4", "--json"]);
        a.extend(extra);
        hexq(&a, &[])
    };
    let o = verify(&[]);
    ok(&o);
    // The batched engine (issue 20): one prompt at a time (--batch 1) and 3 side by side print the same
    // report, byte for byte, as the default batch (all 8 together).
    for batch in ["1", "3"] {
        let ob = verify(&["--batch", batch]);
        ok(&ob);
        assert!(
            ob.stdout == o.stdout,
            "--batch {batch} changed the verify report"
        );
    }
    let r: Value = serde_json::from_slice(&o.stdout).unwrap();
    // Without --stats (no coverage to observe) a prompt's inner positions skip the layers no KV depends on
    // (the tiny model's 5 KV-shared layers): every figure the same.
    let mut a = vec!["verify", "--model", MODEL, "--encodings", ep];
    a.extend(["--limit", "8", "--steps", "4", "--json"]);
    let os = hexq(&a, &[]);
    ok(&os);
    let mut rs: Value = serde_json::from_slice(&os.stdout).unwrap();
    assert!(rs["coverage_outside"].as_array().unwrap().is_empty());
    rs["coverage_outside"] = r["coverage_outside"].clone();
    assert_eq!(
        rs, r,
        "skipping the KV-free layers changed the verify figures"
    );
    assert_eq!(r["prompts"], 8);
    assert!(r["cosine_mean"].as_f64().unwrap() > 0.98, "{r}");
    assert!(r["top1_agreement"].as_f64().unwrap() >= 0.6, "{r}");
    assert_eq!(r["step_cosine_mean"].as_array().unwrap().len(), 4);
    assert_eq!(r["collapsed"], false);
    // Stats from another graph are refused.
    let stt = t.path().join("trunk.json");
    ok(&calibrate(
        &stt,
        &["--variant", "trunk", "--seq", "32"],
        &[],
    ));
    let mut sv: Value = serde_json::from_str(&std::fs::read_to_string(&stt).unwrap()).unwrap();
    sv["graph_sha256"] = "0".repeat(64).into();
    std::fs::write(&stt, sv.to_string()).unwrap();
    let o = hexq(
        &[
            "quantize",
            "--model",
            MODEL,
            "--stats",
            stt.to_str().unwrap(),
            "--out",
            t.path().join("x.json").to_str().unwrap(),
        ],
        &[],
    );
    assert!(
        !o.status.success() && String::from_utf8_lossy(&o.stderr).contains("re-run hexq calibrate")
    );
    assert!(!t.path().join("x.json").exists());
}

/// The batched engine (issue 20): one prompt at a time (--batch 1), 5 and 16 side by side, one thread or
/// all, and prompt tokens chained in one run (one or two prompts in flight, several positions each) — the
/// stats file byte-identical every time.
#[test]
fn calibration_is_byte_identical_across_runs_thread_counts_and_batch_sizes() {
    let t = tempfile::tempdir().unwrap();
    let a = t.path().join("a.json");
    ok(&calibrate(&a, &["--batch", "1"], &[]));
    let ba = std::fs::read(&a).unwrap();
    for (k, (args, env)) in [
        (&["--batch", "1"][..], &[][..]),
        (&["--batch", "5"][..], &[][..]),
        (
            &["--batch", "16", "--threads", "1"][..],
            &[("CANDLE_NUM_THREADS", "1")][..],
        ),
        (&["--batch", "16"][..], &[][..]),
        (&["--batch", "7", "--sequences", "1"][..], &[][..]),
        (&["--batch", "16", "--sequences", "2"][..], &[][..]),
    ]
    .into_iter()
    .enumerate()
    {
        let b = t.path().join(format!("b{k}.json"));
        ok(&calibrate(&b, args, env));
        assert_eq!(ba, std::fs::read(&b).unwrap(), "{args:?} {env:?}");
    }
}

/// Short rings for a long context (`hexq_graph::build::spanning`): at --context 1024 the prompts reach < 300
/// positions, so calibration runs the decode graph with rings of that length — the stats file is
/// byte-identical to running the full 1024-slot rings (`--full-rings`), names and element counts included,
/// on Gemma-4 (KV sharing, PLE) and Gemma-3. (The trained model: `tests/trained.rs`.)
#[test]
fn short_rings_give_the_full_rings_stats_byte_for_byte() {
    let t = tempfile::tempdir().unwrap();
    for (k, m) in [MODEL, "tests/fixtures/tiny-gemma3"]
        .into_iter()
        .enumerate()
    {
        let run = |name: &str, extra: &[&str]| {
            let p = t.path().join(name);
            let mut a = vec![
                "calibrate",
                "--model",
                m,
                "--limit",
                "12",
                "--context",
                "1024",
            ];
            a.extend(["--decode-tokens", "4", "--out", p.to_str().unwrap()]);
            a.extend(extra);
            ok(&hexq(&a, &[("HEXQ_PROFILE", "1")]));
            std::fs::read(&p).unwrap()
        };
        let short = run(&format!("{k}-short.json"), &[]);
        let full = run(&format!("{k}-full.json"), &["--full-rings"]);
        assert!(short == full, "{m}: short rings changed the stats");
        let s: Value = serde_json::from_slice(&short).unwrap();
        assert_eq!(s["context"], 1024);
        assert!(s["tensors"]
            .as_object()
            .unwrap()
            .keys()
            .any(|k| k.contains(".b1024")));
    }
}

/// Resumable calibration: a run stopped right after its second checkpoint (8 of 12 prompts) leaves
/// `<out>.partial.json` and no stats; the next run continues from it and writes stats byte-identical to an
/// uninterrupted run's, removing the partial file.
#[test]
fn interrupted_calibration_resumes_to_identical_stats() {
    let t = tempfile::tempdir().unwrap();
    let (whole, resumed) = (t.path().join("whole.json"), t.path().join("resumed.json"));
    let args = ["--batch", "4", "--checkpoint-every", "4"];
    ok(&calibrate(&whole, &args, &[]));
    let o = calibrate(&resumed, &args, &[("HEXQ_TEST_INTERRUPT_AFTER", "8")]);
    assert_eq!(o.status.code(), Some(130));
    let partial = t.path().join("resumed.json.partial.json");
    assert!(partial.exists() && !resumed.exists());
    let o = calibrate(&resumed, &args, &[]);
    ok(&o);
    assert!(String::from_utf8_lossy(&o.stderr).contains("8 of 12 prompts already observed"));
    assert_eq!(
        std::fs::read(&whole).unwrap(),
        std::fs::read(&resumed).unwrap()
    );
    assert!(!partial.exists());
}

#[test]
fn guards_refuse_raw_text_noise_and_mask_constants() {
    let t = tempfile::tempdir().unwrap();
    // Raw text (no chat template).
    let out = t.path().join("raw.json");
    let o = calibrate(&out, &["--dataset", "datasets/raw_text_sample.jsonl"], &[]);
    assert_eq!(o.status.code(), Some(1));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        e.contains("raw text, not chat-formatted") && e.contains("raw_text_sample.jsonl"),
        "{e}"
    );
    assert!(!out.exists());
    // Forced, it runs, but the stats say so and quantize refuses them.
    ok(&calibrate(
        &out,
        &[
            "--dataset",
            "datasets/raw_text_sample.jsonl",
            "--ignore-guards",
        ],
        &[],
    ));
    let o = hexq(
        &[
            "quantize",
            "--model",
            MODEL,
            "--stats",
            out.to_str().unwrap(),
            "--out",
            t.path().join("e.json").to_str().unwrap(),
        ],
        &[],
    );
    assert!(
        !o.status.success() && String::from_utf8_lossy(&o.stderr).contains("not chat-formatted")
    );
    // Random-noise embeddings.
    let out = t.path().join("noise.json");
    let o = calibrate(&out, &["--noise"], &[]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("random-noise"));
    // A -inf / f32::MIN mask constant in a range.
    let st = t.path().join("s.json");
    ok(&calibrate(&st, &[], &[]));
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&st).unwrap()).unwrap();
    v["tensors"]["layers.0.self_attn.scores_masked"]["min"] = serde_json::json!(-3.4028235e38);
    std::fs::write(&st, v.to_string()).unwrap();
    let o = hexq(
        &[
            "quantize",
            "--model",
            MODEL,
            "--stats",
            st.to_str().unwrap(),
            "--out",
            t.path().join("e.json").to_str().unwrap(),
        ],
        &[],
    );
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success()
            && e.contains("mask constant outside ±1e4")
            && e.contains("scores_masked"),
        "{e}"
    );
    // Degenerate range.
    v["tensors"]["layers.0.self_attn.scores_masked"]["min"] = serde_json::json!(-1.0);
    v["tensors"]["layers.1.mlp.gated"]["min"] = serde_json::json!(0.5);
    v["tensors"]["layers.1.mlp.gated"]["max"] = serde_json::json!(0.5);
    std::fs::write(&st, v.to_string()).unwrap();
    let o = hexq(
        &[
            "quantize",
            "--model",
            MODEL,
            "--stats",
            st.to_str().unwrap(),
            "--out",
            t.path().join("e.json").to_str().unwrap(),
        ],
        &[],
    );
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("degenerate range"));
    assert!(!t.path().join("e.json").exists());
}

#[test]
fn collapsed_quantsim_is_reported() {
    // Encodings squeezed to a tiny range on the residual stream: quantsim's final norm collapses and
    // verify fails loudly (the published noise-calibrated binary: final hidden norm 0.0000).
    let t = tempfile::tempdir().unwrap();
    let st = t.path().join("s.json");
    ok(&calibrate(&st, &[], &[]));
    let enc = t.path().join("e.json");
    ok(&hexq(
        &[
            "quantize",
            "--model",
            MODEL,
            "--stats",
            st.to_str().unwrap(),
            "--out",
            enc.to_str().unwrap(),
        ],
        &[],
    ));
    let mut e: Value = serde_json::from_str(&std::fs::read_to_string(&enc).unwrap()).unwrap();
    let tiny = serde_json::json!([{"bitwidth": 16, "dtype": "int", "is_symmetric": "False", "min": 0.0, "max": 1e-6, "offset": 0, "scale": 1.5e-11}]);
    e["activation_encodings"]["hidden_states"] = tiny;
    std::fs::write(&enc, e.to_string()).unwrap();
    let o = hexq(
        &[
            "verify",
            "--model",
            MODEL,
            "--encodings",
            enc.to_str().unwrap(),
            "--limit",
            "2",
            "--steps",
            "1",
        ],
        &[],
    );
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("collapsed"));
}

#[test]
fn encodings_match_aimet_within_one_lsb() {
    // Judge: aimet-onnx 2.42 (PyPI). .ci/run installs it and sets HEXQ_REQUIRE_JUDGES=1; elsewhere a
    // missing aimet skips with the reason printed.
    if !common::judge("aimet_onnx") {
        return;
    }
    use hexq_calibrate::{calibrate_with, Options, RangeObserver};
    use hexq_graph::{build, GraphOptions, Variant};
    use std::sync::Arc;
    let dir = root().join(MODEL);
    let ck = Arc::new(hexq_model::Checkpoint::open(&dir).unwrap());
    let tok = hexq_model::chat::Tokenizer::from_dir(&dir).unwrap();
    // MatMuls judged: (input activation, output activation, checkpoint weight).
    let mm = [
        (
            "layers.0.pre_feedforward_layernorm.out",
            "layers.0.mlp.up_proj",
            "layers.0.mlp.up_proj.weight",
        ),
        (
            "layers.4.input_layernorm.out",
            "layers.4.self_attn.q_proj",
            "layers.4.self_attn.q_proj.weight",
        ),
        (
            "layers.7.mlp.gated",
            "layers.7.mlp.down_proj",
            "layers.7.mlp.down_proj.weight",
        ),
    ];
    let obs = RangeObserver {
        capture: Arc::new(mm.iter().map(|m| m.0.to_string()).collect()),
        ..Default::default()
    };
    let o = Options {
        variant: Variant::DecodeWgqa,
        graph: GraphOptions {
            context: 128,
            seq: 128,
        },
        decode_tokens: 2,
        limit: Some(4),
        ignore_guards: false,
        noise: false,
        batch: 1,
        sequences: 0,
        checkpoint: None,
        checkpoint_every: 1,
        tokens_out: None,
        full_rings: false,
        bos_on_graph: false,
    };
    let pb = indicatif::ProgressBar::hidden();
    // AIMET's sequence: param encodings first, activations observed with the weights fake-quantized.
    let g = build(&ck.config, Variant::DecodeWgqa, &o.graph);
    let pe = hexq_quantize::calibration_params(&ck, &g, &Default::default()).unwrap();
    let hook = Box::new(hexq_quantize::quantsim::FakeQuant::from_params(&pe));
    let stats = calibrate_with(
        ck.clone(),
        &tok,
        &root().join("datasets/calibration.jsonl"),
        &o,
        &pb,
        obs.clone(),
        hexq_calibrate::Engine::Interp { params: Some(hook) },
        "int8_per_channel".into(),
    )
    .unwrap();
    let enc = hexq_quantize::encode(
        &ck,
        &g,
        &stats,
        &hexq_quantize::Scheme::a16w8(false),
        &Default::default(),
    )
    .unwrap();
    let cap = obs.captured.lock().unwrap().clone();
    if std::env::var("HEXQ_DEBUG_JUDGE").is_ok() {
        use hexq_graph::interp::Hook;
        let mut fq = hexq_quantize::quantsim::FakeQuant::from_params(&pe);
        let w =
            hexq_graph::interp::WeightSource::weight(ck.as_ref(), "layers.0.mlp.up_proj.weight")
                .unwrap();
        let wt = w.t().unwrap();
        let q = fq
            .tensor("layers.0.mlp.up_proj.weight.T", &wt)
            .expect("quantized");
        let xs = &cap["layers.0.pre_feedforward_layernorm.out"];
        let x =
            candle_core::Tensor::from_vec(xs.concat(), (xs.len(), 64), &candle_core::Device::Cpu)
                .unwrap();
        let y: Vec<f32> = x
            .matmul(&q)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let yf: Vec<f32> = x
            .matmul(&wt)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let mm = |v: &[f32]| {
            v.iter()
                .fold((f32::MAX, f32::MIN), |(a, b), &z| (a.min(z), b.max(z)))
        };
        eprintln!(
            "DEBUG ours x@qW {:?} x@W {:?} stats {:?}",
            mm(&y),
            mm(&yf),
            stats.tensors["layers.0.mlp.up_proj"]
        );
    }
    let cases: Vec<Value> = mm
        .iter()
        .map(|(x, y, w)| serde_json::json!({"x_name": x, "y_name": y, "w_tensor": format!("model.language_model.{w}"), "x": cap[*x]}))
        .collect();
    let t = tempfile::tempdir().unwrap();
    let cp = t.path().join("cases.json");
    std::fs::write(
        &cp,
        serde_json::json!({"model_dir": dir, "cases": cases}).to_string(),
    )
    .unwrap();
    let ap = t.path().join("aimet.json");
    let o = Command::new("python3")
        .arg(root().join("tests/judges/aimet_encodings.py"))
        .arg(&cp)
        .arg(&ap)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "aimet judge failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let a: Value = serde_json::from_str(&std::fs::read_to_string(&ap).unwrap()).unwrap();
    let within_lsb = |what: &str, ours: &hexq_quantize::Encoding, scale: f64, offset: f64| {
        // Same grid within one step: min and max agree to one LSB of either encoding.
        let (amin, amax) = (offset * scale, offset * scale + ours.qmax() * scale);
        let lsb = ours.scale.max(scale);
        assert!((ours.min - amin).abs() <= lsb * 1.0001 && (ours.max - amax).abs() <= lsb * 1.0001,
            "{what}: hexq [{}, {}] scale {} offset {} vs aimet [{amin}, {amax}] scale {scale} offset {offset}", ours.min, ours.max, ours.scale, ours.offset);
    };
    let mut checked = 0;
    for (x, y, w) in mm {
        let r = &a[y];
        let f = |v: &Value, k: &str, i: usize| v[k][i].as_f64().unwrap();
        let ours = &enc.param_encodings[&format!("{w}.T")];
        if std::env::var("HEXQ_DEBUG_JUDGE").is_ok() {
            let r8: Vec<f64> = ours
                .iter()
                .enumerate()
                .take(6)
                .map(|(c, e)| e.scale / f(&r["w"], "scale", c))
                .collect();
            eprintln!("DEBUG {w} scale ratios hexq/aimet {r8:?}");
        }

        within_lsb(
            &format!("{x} (input)"),
            &enc.activation_encodings[x][0],
            f(&r["x"], "scale", 0),
            f(&r["x"], "offset", 0),
        );
        // Outputs: AIMET observes y = x @ q(W) (activation quantizers in update-stats mode, params
        // quantize-dequantized — aimet_onnx.quantsim.compute_encodings); hexq calibrates with --params int8
        // (the default), the same.
        within_lsb(
            &format!("{y} (output)"),
            &enc.activation_encodings[y][0],
            f(&r["y"], "scale", 0),
            f(&r["y"], "offset", 0),
        );
        let ours = &enc.param_encodings[&format!("{w}.T")];
        assert_eq!(
            ours.len(),
            r["w"]["scale"].as_array().unwrap().len(),
            "{w}: channels"
        );
        for (c, e) in ours.iter().enumerate() {
            within_lsb(
                &format!("{w} channel {c}"),
                e,
                f(&r["w"], "scale", c),
                f(&r["w"], "offset", c),
            );
            // Weights must be on the same grid, not merely within a step at the ends.
            assert!(
                (e.scale / f(&r["w"], "scale", c) - 1.0).abs() < 1e-5,
                "{w} channel {c}: scale {} vs aimet {}",
                e.scale,
                f(&r["w"], "scale", c)
            );
            checked += 1;
        }
        assert_eq!(r["x"]["bw"], 16);
        assert_eq!(r["w"]["bw"], 8);
    }
    assert!(checked > 100);
}

/// A trunk calibrated on prompts shorter than one chunk never sees its past-KV inputs (the guards refuse to
/// encode them); `--kv-stats` takes those ranges from the decode graph's calibration of the same model.
#[test]
fn trunk_past_kv_ranges_come_from_the_decode_stats() {
    let t = tempfile::tempdir().unwrap();
    let m = "tests/fixtures/tiny-gemma4";
    let p = |n: &str| t.path().join(n).display().to_string();
    let (trunk, decode) = (p("trunk.json"), p("decode.json"));
    common::hexq_ok(&[
        "calibrate",
        "--model",
        m,
        "--variant",
        "trunk",
        "--limit",
        "2",
        "--context",
        "128",
        "--seq",
        "64",
        "--out",
        &trunk,
    ]);
    common::hexq_ok(&[
        "calibrate",
        "--model",
        m,
        "--limit",
        "2",
        "--context",
        "128",
        "--seq",
        "64",
        "--out",
        &decode,
    ]);
    let refused = common::hexq(&[
        "quantize",
        "--model",
        m,
        "--stats",
        &trunk,
        "--out",
        &p("a.json"),
    ]);
    assert_eq!(refused.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&refused.stderr).contains("past_key_0"));
    common::hexq_ok(&[
        "quantize",
        "--model",
        m,
        "--stats",
        &trunk,
        "--kv-stats",
        &decode,
        "--out",
        &p("b.json"),
    ]);
    let e: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(p("b.json")).unwrap()).unwrap();
    let d: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&decode).unwrap()).unwrap();
    let (enc, want) = (
        &e["activation_encodings"]["past_key_0"][0],
        &d["tensors"]["past_key_0"],
    );
    assert!(
        enc["max"].as_f64().unwrap() >= want["max"].as_f64().unwrap() * 0.99,
        "{enc} vs {want}"
    );
}

/// hexq's LPBQ (block scales compressed to 4-bit integers × one float per channel) against aimet-onnx 2.42's
/// own: the exported encoding (per-channel scale, per-block integer scales, in AIMET's order) and every
/// quantize-dequantized weight, for blocks of 32, 64 and 128 over heavy-tailed rows.
#[test]
fn lpbq_matches_aimet() {
    if !common::judge("aimet_onnx") {
        return;
    }
    for (block, seed) in [(32usize, 1u64), (64, 2), (128, 3)] {
        let t = tempfile::tempdir().unwrap();
        let (n_in, n_out) = (256usize, 8usize);
        let o = std::process::Command::new("python3")
            .arg(common::root().join("tests/judges/aimet_lpbq.py"))
            .args([
                t.path().to_str().unwrap(),
                &n_in.to_string(),
                &n_out.to_string(),
                &block.to_string(),
                &seed.to_string(),
            ])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let out = String::from_utf8_lossy(&o.stdout);
        let r: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
        let w: Vec<f32> = std::fs::read(t.path().join("w.f32"))
            .unwrap()
            .chunks(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let l = hexq_quantize::lpbq::encode(&w, n_in, block, 4, 4);
        let e = &r["encoding"];
        assert_eq!(e["enc_type"], "LPBQ");
        assert_eq!(e["block_size"].as_u64().unwrap() as usize, block);
        assert_eq!(
            (e["bw"].as_u64(), e["compressed_bw"].as_u64()),
            (Some(8), Some(4))
        );
        // AIMET's per_block_int_scale is [out, in / block] row-major: channel by channel, as hexq's.
        let nb = n_in / block;
        let ints: Vec<u64> = e["per_block_int_scale"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect();
        for c in 0..n_out {
            for b in 0..nb {
                assert_eq!(
                    l.int_scale[c * nb + b] as u64,
                    ints[c * nb + b],
                    "block {block}: channel {c} block {b}"
                );
            }
            let s = e["scale"][c].as_f64().unwrap();
            assert!(
                (l.channel_scale[c] as f64 / s - 1.0).abs() < 1e-6,
                "channel {c}: {} vs {s}",
                l.channel_scale[c]
            );
        }
        let mut q = w.clone();
        l.fake(&mut q, n_in);
        let want: Vec<f32> = r["wq"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect();
        // The value is the exported DequantizeLinear chain's (block scale int · f32(per-channel) in f32,
        // then × q: what onnxruntime and the device compute); AIMET's sim rounds int · per-channel · q once.
        // The integers are AIMET's, so the values differ by the block scale's extra rounding (½ ulp) plus the
        // product's (½ ulp): within 2 ulps (measured: 146 of 2048 weights 1 ulp apart at B = 32, 8 beyond 1).
        let ulp = |x: f32| (f32::from_bits(x.abs().to_bits() + 1) - x.abs()).max(f32::MIN_POSITIVE);
        let diff = q
            .iter()
            .zip(&want)
            .filter(|(a, b)| (**a - **b).abs() > 2.0 * ulp(**b))
            .count();
        assert_eq!(
            diff,
            0,
            "block {block}: {diff} of {} weights more than 2 ulps from AIMET's",
            q.len()
        );
    }
}

/// `quantize --scheme w4a16-lpbq`: every MatMul weight whose input dimension the block divides gets an LPBQ
/// entry in AIMET's 1.0.0 form (and no per-channel one), the rest stay per channel at 4 bits, an override
/// keeps its weights at 8 bits; verify accepts the file; the QDQ export (the DequantizeLinear chain) runs in
/// onnxruntime as quantsim does, compiles for v79 with every node on HTP, and the simulator tracks quantsim
/// (measured on the tiny model, 4 prompts × 4 steps, context 256: cosine 0.99977 / min 0.99949, top-1 4/4).
#[test]
fn w4a16_lpbq_scheme_encodes_validates_exports_and_compiles() {
    let t = tempfile::tempdir().unwrap();
    let p = |n: &str| t.path().join(n).display().to_string();
    common::hexq_ok(&[
        "calibrate",
        "--limit",
        "2",
        "--context",
        "64",
        "--out",
        &p("s.json"),
    ]);
    std::fs::write(
        p("ov.json"),
        r#"{"rules": [{"pattern": "layers.0.self_attn.*_proj.weight.T", "kind": "param", "bitwidth": 8}]}"#,
    )
    .unwrap();
    common::hexq_ok(&[
        "quantize",
        "--stats",
        &p("s.json"),
        "--scheme",
        "w4a16-lpbq",
        "--block",
        "32",
        "--overrides",
        &p("ov.json"),
        "--out",
        &p("l.json"),
    ]);
    let e: hexq_quantize::Encodings =
        serde_json::from_slice(&std::fs::read(p("l.json")).unwrap()).unwrap();
    assert_eq!(e.hexq["scheme"], "w4a16_lpbq32");
    assert!(!e.lpbq_encodings.is_empty());
    for (n, l) in &e.lpbq_encodings {
        assert!(!e.param_encodings.contains_key(n), "{n}");
        assert_eq!(
            (l.enc_type.as_str(), l.bw, l.compressed_bw, l.block_size),
            ("LPBQ", 8, 4, 32)
        );
        assert!(
            !n.starts_with("layers.0.self_attn"),
            "{n}: the override keeps it per channel"
        );
    }
    let q = e
        .param_encodings
        .iter()
        .find(|(n, _)| n.starts_with("layers.0.self_attn.q_proj"))
        .unwrap();
    assert_eq!(q.1[0].bitwidth, 8);
    let o = common::hexq_ok(&[
        "verify",
        "--encodings",
        &p("l.json"),
        "--limit",
        "2",
        "--steps",
        "2",
        "--json",
    ]);
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(r["cosine_mean"].as_f64().unwrap() > 0.5, "{r}");
    common::hexq_ok(&[
        "export",
        "--variant",
        "decode_wgqa",
        "--context",
        "64",
        "--encodings",
        &p("l.json"),
        "--qdq",
        "--out",
        &p("x"),
    ]);
    if !common::judge("onnxruntime") {
        return;
    }
    let rows = |o: std::process::Output, cand: &str| -> serde_json::Value {
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        v.as_array()
            .unwrap()
            .iter()
            .find(|r| r["candidate"] == cand && r["reference"] == "quantsim")
            .unwrap()["report"]
            .clone()
    };
    let r = rows(
        common::hexq_ok(&[
            "verify",
            "--backend",
            "ort",
            "--artifacts",
            &p("x"),
            "--limit",
            "4",
            "--steps",
            "2",
            "--json",
        ]),
        "ort",
    );
    // LPBQ's QDQ chain in onnxruntime computes quantsim's values exactly (the block scale's f32 product,
    // onnxruntime's sums): measured KL 0 on the tiny model and on the trained 270M (24 × 4).
    assert_eq!(r["top1_agreement"].as_f64(), Some(1.0), "{r}");
    assert!(r["cosine_min"].as_f64().unwrap() >= 0.9999999, "{r}");
    assert_eq!(r["kl_mean"].as_f64(), Some(0.0), "{r}");
    if !common::judge("onnxruntime_qnn") {
        return;
    }
    let o = common::hexq_ok(&[
        "compile",
        "--artifacts",
        &p("x"),
        "--target",
        "v79",
        "--json",
    ]);
    let c: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(c["nodes_off_htp"], 0, "{c}");
    let r = rows(
        common::hexq_ok(&[
            "verify",
            "--backend",
            "qnn",
            "--artifacts",
            &p("x"),
            "--targets",
            "v79",
            "--limit",
            "3",
            "--steps",
            "4",
            "--json",
        ]),
        "htp",
    );
    assert_eq!(r["top1_agreement"].as_f64(), Some(1.0), "{r}");
    assert!(r["cosine_mean"].as_f64().unwrap() >= 0.999, "{r}");
}

/// hexq's SeqMSE against aimet-onnx 2.42's `apply_seq_mse` on one MatMul: the same inputs, int4 per
/// channel and LPBQ blocks of 32 and 64; every channel's (block's) chosen scale equal.
#[test]
fn seqmse_matches_aimet_apply_seq_mse() {
    if !common::judge("aimet_onnx") {
        return;
    }
    let read = |p: &std::path::Path| -> Vec<f32> {
        std::fs::read(p)
            .unwrap()
            .chunks(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };
    for (mode, block, seed) in [("pc", 32usize, 1u64), ("lpbq", 32, 2), ("lpbq", 64, 3)] {
        let t = tempfile::tempdir().unwrap();
        let (n_in, n_out, rows) = (256usize, 16usize, 96usize);
        let o = std::process::Command::new("python3")
            .arg(common::root().join("tests/judges/aimet_seqmse.py"))
            .arg(t.path())
            .args([n_in, n_out].map(|v| v.to_string()))
            .args([
                mode.to_string(),
                block.to_string(),
                rows.to_string(),
                seed.to_string(),
            ])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let out = String::from_utf8_lossy(&o.stdout);
        let r: Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
        let e = &r["encoding"];
        let (w, x) = (read(&t.path().join("w.f32")), read(&t.path().join("x.f32")));
        let mut h = vec![0f64; n_in * n_in];
        for row in x.chunks(n_in) {
            for i in 0..n_in {
                for j in 0..n_in {
                    h[i * n_in + j] += row[i] as f64 * row[j] as f64;
                }
            }
        }
        let gram = hexq_calibrate::imatrix::Gram::from_full(n_in, &h, rows as u64);
        use hexq_quantize::rounding::seqmse;
        let scale = |c: usize| e["scale"][c].as_f64().unwrap();
        if mode == "pc" {
            let base: Vec<hexq_quantize::Encoding> = w
                .chunks(n_in)
                .map(|r| {
                    let (lo, hi) = hexq_model::weights::min_max(r);
                    hexq_quantize::Encoding::compute(4, lo as f64, hi as f64, true)
                })
                .collect();
            let ours = seqmse::per_channel(&w, n_in, &gram, &base);
            let moved = (0..n_out)
                .filter(|&c| (base[c].scale / scale(c) - 1.0).abs() > 1e-6)
                .count();
            assert!(
                moved > 0,
                "SeqMSE moved no channel off min-max: a weak case"
            );
            for c in 0..n_out {
                assert!(
                    (ours[c].scale / scale(c) - 1.0).abs() < 1e-6,
                    "channel {c}: {} vs aimet {}",
                    ours[c].scale,
                    scale(c)
                );
            }
        } else {
            let ours = seqmse::lpbq_blocks(&w, n_in, &gram, block, 4, 4);
            let nb = n_in / block;
            let ints: Vec<u32> = e["per_block_int_scale"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect();
            let minmax = hexq_quantize::lpbq::encode(&w, n_in, block, 4, 4);
            assert_ne!(
                minmax.int_scale, ints,
                "SeqMSE changed no block: a weak case"
            );
            for c in 0..n_out {
                assert!(
                    (ours.channel_scale[c] / scale(c) - 1.0).abs() < 1e-6,
                    "block {block} channel {c}: {} vs aimet {}",
                    ours.channel_scale[c],
                    scale(c)
                );
                assert_eq!(
                    ours.int_scale[c * nb..(c + 1) * nb],
                    ints[c * nb..(c + 1) * nb],
                    "block {block} channel {c}"
                );
            }
        }
    }
}

/// `quantize --rounding gptq` on the tiny model: the overlay holds every MatMul weight, each value on its
/// encoding's grid, with less output error on the calibration inputs than round-to-nearest; verify
/// and export read it (the export's source hashes name it); seqmse changes scales only.
#[test]
fn gptq_rounding_stays_on_the_encodings_grid_and_reaches_export() {
    let t = tempfile::tempdir().unwrap();
    let st = t.path().join("stats.json");
    ok(&calibrate(&st, &[], &[]));
    let q = |m: &str, out: &Path| {
        ok(&hexq(
            &[
                "quantize",
                "--stats",
                st.to_str().unwrap(),
                "--scheme",
                "w4a16-pc",
                "--rounding",
                m,
                "--rounding-limit",
                "8",
                "--out",
                out.to_str().unwrap(),
            ],
            &[],
        ))
    };
    let (rtn, gp, sm) = (
        t.path().join("rtn.json"),
        t.path().join("g.json"),
        t.path().join("s.json"),
    );
    q("rtn", &rtn);
    q("gptq", &gp);
    q("seqmse", &sm);
    assert!(
        !t.path().join("s.weights.safetensors").exists(),
        "seqmse writes no weights"
    );
    let enc = hexq_quantize::Encodings::from_file(&gp).unwrap();
    let re = hexq_quantize::Encodings::from_file(&rtn).unwrap();
    assert_eq!(enc.hexq["rounding"]["method"], "gptq");
    assert_eq!(
        enc.param_encodings, re.param_encodings,
        "gptq keeps the min-max scales"
    );
    let se = hexq_quantize::Encodings::from_file(&sm).unwrap();
    assert_ne!(
        se.param_encodings, re.param_encodings,
        "seqmse moves scales"
    );
    let base = hexq_model::Checkpoint::open(&root().join(MODEL)).unwrap();
    let mut ck = hexq_model::Checkpoint::open(&root().join(MODEL)).unwrap();
    hexq_quantize::rounding::open_overlay(&mut ck, &enc, &gp).unwrap();
    let g = hexq_graph::build(
        &ck.config,
        hexq_graph::Variant::DecodeWgqa,
        &hexq_graph::GraphOptions {
            context: 128,
            seq: 128,
        },
    );
    let targets = hexq_quantize::rounding::targets(&g);
    assert_eq!(
        enc.hexq["rounding"]["weights_rounded"].as_u64().unwrap() as usize,
        targets.len()
    );
    let (mut moved, mut total) = (0usize, 0usize);
    for (init, tensor) in &targets {
        let (w, r) = (base.f32(tensor).unwrap(), ck.f32(tensor).unwrap());
        let e = &enc.param_encodings[init];
        let n = w.len() / e.len();
        for (i, (a, b)) in w.iter().zip(&r).enumerate() {
            assert_eq!(e[i / n].fake_param(*b), *b, "{tensor}[{i}] is off its grid");
            moved += (e[i / n].fake_param(*a) != *b) as usize;
            total += 1;
        }
    }
    assert!(
        moved > total / 50,
        "gptq rounded {moved} of {total} weights away from nearest"
    );
    let v = hexq(
        &[
            "verify",
            "--encodings",
            gp.to_str().unwrap(),
            "--limit",
            "4",
            "--json",
        ],
        &[],
    );
    ok(&v);
    let out = t.path().join("exp");
    ok(&hexq(
        &[
            "export",
            "--encodings",
            gp.to_str().unwrap(),
            "--qdq",
            "--context",
            "128",
            "--out",
            out.to_str().unwrap(),
        ],
        &[],
    ));
    let m = std::fs::read_to_string(out.join("manifest.json")).unwrap();
    assert!(
        m.contains("g.weights.safetensors"),
        "the export's sources name the overlay"
    );
}

/// hexq's GPTQ against the reference `fasterquant` transcribed to numpy (tests/judges/gptq_reference.py) on a
/// fixed int4 per-row grid, with and without act-order and over several block sizes: the same integers.
#[test]
fn gptq_matches_the_reference_fasterquant() {
    if !common::judge("numpy") {
        return;
    }
    let (rows, n, t) = (32usize, 96usize, 300usize);
    let r = |i: usize, m: usize| ((i.wrapping_mul(2654435761) % m) as f64 / m as f64) - 0.5;
    let w: Vec<f32> = (0..rows * n).map(|i| r(i, 1009) as f32).collect();
    let x: Vec<f64> = (0..t * n)
        .map(|i| r(i, 997) * (1.0 + 4.0 * ((i % n) % 7 == 0) as u8 as f64) + 0.7 * r(i / n, 991))
        .collect();
    let mut h = vec![0f64; n * n];
    for s in 0..t {
        for i in 0..n {
            for j in 0..n {
                h[i * n + j] += x[s * n + i] * x[s * n + j];
            }
        }
    }
    // Input 5 never fires: a dead column.
    for j in 0..n {
        h[5 * n + j] = 0.0;
        h[j * n + 5] = 0.0;
    }
    let s: Vec<f64> = w
        .chunks(n)
        .map(|row| row.iter().fold(0f32, |a, v| a.max(v.abs())) as f64 / 7.3)
        .collect();
    let d = tempfile::tempdir().unwrap();
    let put = |name: &str, v: &[f64]| {
        std::fs::write(
            d.path().join(name),
            v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>(),
        )
        .unwrap()
    };
    put("w.f64", &w.iter().map(|&v| v as f64).collect::<Vec<_>>());
    put("h.f64", &h);
    put("s.f64", &s);
    let gram = hexq_calibrate::imatrix::Gram::from_full(n, &h, t as u64);
    for (block, act) in [(128usize, false), (32, false), (32, true)] {
        let o = Command::new("python3")
            .arg(root().join("tests/judges/gptq_reference.py"))
            .arg(d.path())
            .args([
                rows.to_string(),
                n.to_string(),
                block.to_string(),
                "0.01".into(),
                (act as u8).to_string(),
            ])
            .output()
            .unwrap();
        ok(&o);
        let want: Vec<f64> = std::fs::read(d.path().join("q.f64"))
            .unwrap()
            .chunks(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let grid =
            |c: usize, _: usize, v: f32| ((v as f64 / s[c]).round().clamp(-8.0, 7.0) * s[c]) as f32;
        let o = hexq_quantize::rounding::gptq::Options {
            block,
            damp: 0.01,
            act_order: act,
        };
        let q = hexq_quantize::rounding::gptq::gptq_gram(&w, n, &gram, &grid, &o).unwrap();
        let differ = (0..rows * n)
            .filter(|&i| (q[i] as f64 / s[i / n]).round() != (want[i] / s[i / n]).round())
            .count();
        assert_eq!(
            differ,
            0,
            "block {block} act_order {act}: {differ} of {} integers differ",
            rows * n
        );
    }
}
