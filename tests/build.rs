//! `hexq build --recipe`: byte-identical outputs and manifest when run twice, and resumption that redoes only
//! the stages downstream of a changed input.

mod common;

use serde_json::Value;

fn statuses(o: &std::process::Output) -> Vec<(String, String)> {
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    v["stages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["stage"].as_str().unwrap().to_string(),
                s["status"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

#[test]
fn tiny_recipe_is_deterministic_and_resumes_downstream_of_a_changed_dataset() {
    let t = tempfile::tempdir().unwrap();
    // recipes/tiny.toml, reading a copy of the calibration set this test may change.
    let data = t.path().join("calibration.jsonl");
    std::fs::copy(common::root().join("datasets/calibration.jsonl"), &data).unwrap();
    let mut text = std::fs::read_to_string(common::root().join("recipes/tiny.toml"))
        .unwrap()
        .replace("datasets/calibration.jsonl", data.to_str().unwrap());
    let qnn = common::judge("onnxruntime_qnn");
    if !qnn {
        text = text.split("[compile]").next().unwrap().to_string()
            + "[[gguf]]\ntype = \"q4_0\"\npure = true\n";
    }
    let recipe = t.path().join("tiny.toml");
    std::fs::write(&recipe, &text).unwrap();
    let out = t.path().join("build");
    let build = || {
        common::hexq_ok(&[
            "build",
            "--recipe",
            recipe.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--json",
        ])
    };
    let first = statuses(&build());
    assert!(first.iter().all(|(_, s)| s == "ran"), "{first:?}");
    if qnn {
        assert!(first.iter().any(|(n, _)| n.starts_with("compile shared")));
        // The shared binary holds both graphs: their partition names are read back from the binary.
        let m: Value = serde_json::from_slice(
            &std::fs::read(out.join("prefill_decode/manifest.json")).unwrap(),
        )
        .unwrap();
        for c in m["compiled"].as_array().unwrap() {
            let g: Vec<&str> = c["graphs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|g| g["variant"].as_str().unwrap())
                .collect();
            assert_eq!(g, ["decode_wgqa", "trunk"], "{c}");
        }
        genie_bundle_is_valid_and_matches_its_snapshot(&out);
    }
    let manifest = std::fs::read(out.join("build-manifest.json")).unwrap();
    // Twice: nothing redone, the manifest byte-identical.
    let second = statuses(&build());
    assert!(second.iter().all(|(_, s)| s == "reused"), "{second:?}");
    assert_eq!(
        std::fs::read(out.join("build-manifest.json")).unwrap(),
        manifest
    );
    // A changed calibration prompt: calibration and everything downstream of it run again; the GGUF (which
    // reads only the checkpoint) does not.
    let d = std::fs::read_to_string(&data).unwrap();
    std::fs::write(
        &data,
        d.replacen("\"content\": \"", "\"content\": \"Briefly: ", 1),
    )
    .unwrap();
    let third = statuses(&build());
    for (n, s) in &third {
        let downstream = !n.starts_with("gguf");
        assert_eq!(
            s,
            if downstream { "ran" } else { "reused" },
            "{n}: {third:?}"
        );
    }
    assert_ne!(
        std::fs::read(out.join("build-manifest.json")).unwrap(),
        manifest
    );
}

#[test]
fn bad_recipes_are_refused_naming_the_file_and_field() {
    let t = tempfile::tempdir().unwrap();
    for (body, want) in [
        (
            "name = \"x\"\n[graph]\ncontext = 64\n[[artifact]]\nvariant = \"decode_full\"\n",
            "decode_full",
        ),
        (
            "name = \"x\"\n[graph]\ncontext = 64\n[[artifact]]\nvariant = \"decode_wgqa\"\n",
            "[calibration]",
        ),
        (
            "name = \"x\"\n[graph]\ncontext = 64\n[compile]\ntargets = [\"v99\"]\n",
            "v99",
        ),
        (
            "name = \"x\"\n[graph]\ncontext = 64\nsurprise = 1\n",
            "surprise",
        ),
        (
            "name = \"x\"\n[graph]\ncontext = 64\n[[gguf]]\ntype = \"q3_k\"\n",
            "q3_k",
        ),
    ] {
        let p = t.path().join("r.toml");
        std::fs::write(&p, body).unwrap();
        let out = t.path().join("out");
        let o = common::hexq(&[
            "build",
            "--recipe",
            p.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{body}: {err}");
        assert!(
            err.contains("r.toml") && err.contains(want),
            "{body}: {err}"
        );
        assert!(!out.exists(), "{body}: a refused recipe creates nothing");
    }
}

/// A shared binary stores each weight once, so the two exports must encode every weight alike: a decode
/// export with 4-bit MLP weights next to an 8-bit trunk is refused before any compile, naming the tensor. And
/// on x86-64, where onnxruntime-qnn's simulator cannot load a weight-shared context, `run` says so.
#[test]
fn shared_compile_refuses_disagreeing_weights_and_x86_refuses_to_load_it() {
    let t = tempfile::tempdir().unwrap();
    let p = |n: &str| t.path().join(n).display().to_string();
    let (m, ctx) = ("tests/fixtures/tiny-gemma4", "128");
    for (v, st) in [("decode_wgqa", "d.json"), ("trunk", "t.json")] {
        common::hexq_ok(&[
            "calibrate",
            "--model",
            m,
            "--variant",
            v,
            "--limit",
            "2",
            "--context",
            ctx,
            "--seq",
            "32",
            "--out",
            &p(st),
        ]);
    }
    let ov = t.path().join("w4.json");
    std::fs::write(
        &ov,
        r#"{"rules": [{"pattern": "layers.*.mlp.*_proj.weight.T", "kind": "param", "bitwidth": 4}]}"#,
    )
    .unwrap();
    common::hexq_ok(&[
        "quantize",
        "--model",
        m,
        "--stats",
        &p("d.json"),
        "--overrides",
        ov.to_str().unwrap(),
        "--out",
        &p("d.enc"),
    ]);
    common::hexq_ok(&[
        "quantize",
        "--model",
        m,
        "--stats",
        &p("t.json"),
        "--kv-stats",
        &p("d.json"),
        "--out",
        &p("t.enc"),
    ]);
    common::hexq_ok(&[
        "export",
        "--model",
        m,
        "--variant",
        "decode_wgqa",
        "--context",
        ctx,
        "--encodings",
        &p("d.enc"),
        "--qdq",
        "--out",
        &p("dq"),
    ]);
    common::hexq_ok(&[
        "export",
        "--model",
        m,
        "--variant",
        "trunk",
        "--context",
        ctx,
        "--seq",
        "32",
        "--encodings",
        &p("t.enc"),
        "--qdq",
        "--out",
        &p("tq"),
    ]);
    let o = common::hexq(&[
        "compile",
        "--artifacts",
        &p("dq"),
        "--artifacts",
        &p("tq"),
        "--target",
        "v79",
        "--out",
        &p("shared"),
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("param encodings of layers.") && err.contains("_proj.weight"),
        "{err}"
    );
    assert!(!t.path().join("shared").exists());
    // A shared build on x86-64: refused with the reason (a hand-made manifest is enough to reach the check).
    if cfg!(target_arch = "x86_64") {
        let b = t.path().join("b");
        std::fs::create_dir_all(&b).unwrap();
        std::fs::write(
            b.join("manifest.json"),
            r#"{"kind": "shared-context", "compiled": [{"target": "v79", "bin": "prefill_decode_v79.bin", "graphs": []}]}"#,
        )
        .unwrap();
        let o = common::hexq(&[
            "run",
            "--backend",
            "qnn",
            "--artifacts",
            b.to_str().unwrap(),
            "--target",
            "v79",
            "--prompt",
            "hi",
        ]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{err}");
        assert!(
            err.contains("aarch64") && err.contains("per-graph binaries"),
            "{err}"
        );
    }
}

/// The recipe's Genie bundle (compile.genie): genie_config.json passes Genie's schema and equals the committed
/// snapshot (HEXQ_UPDATE_SNAPSHOTS=1 rewrites it); the LUT holds exactly the graph input's quantization of
/// the host embedding rows; every file is in SHA256SUMS; bad inputs are refused naming the file.
fn genie_bundle_is_valid_and_matches_its_snapshot(out: &std::path::Path) {
    let b = out.join("genie/v79");
    let cfg: Value =
        serde_json::from_slice(&std::fs::read(b.join("genie_config.json")).unwrap()).unwrap();
    assert_eq!(hexq_compile::genie::validate(&cfg), Vec::<String>::new());
    let snap = common::root().join("tests/snapshots/genie_config.tiny-v79.json");
    let text = std::fs::read_to_string(b.join("genie_config.json")).unwrap();
    if std::env::var_os("HEXQ_UPDATE_SNAPSHOTS").is_some() {
        std::fs::write(&snap, &text).unwrap();
    }
    assert_eq!(
        text,
        std::fs::read_to_string(&snap).unwrap(),
        "genie_config.json differs from {}",
        snap.display()
    );
    let ext: Value =
        serde_json::from_slice(&std::fs::read(b.join("htp_backend_ext_config.json")).unwrap())
            .unwrap();
    assert_eq!(ext["devices"][0]["dsp_arch"], "v79");
    assert_eq!(ext["context"]["weight_sharing_enabled"], true);
    // LUT = quantize(row × multiplier) with inputs_embeds' encoding, value for value.
    let hm = out.join("prefill_decode/host-model");
    let host: Value =
        serde_json::from_slice(&std::fs::read(hm.join("host-model.json")).unwrap()).unwrap();
    let t = host["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "embed_tokens.weight")
        .unwrap();
    let rows = std::fs::read(hm.join(t["file"].as_str().unwrap())).unwrap();
    let mult = t["row_multiplier"].as_f64().unwrap() as f32;
    let lut = std::fs::read(b.join("embedding_lut.bin")).unwrap();
    let q = &cfg["dialog"]["embedding"]["quant-param"];
    let (scale, offset) = (q["scale"].as_f64().unwrap(), q["offset"].as_i64().unwrap());
    assert_eq!(lut.len() * 2, rows.len());
    for (x, l) in rows.chunks_exact(4).zip(lut.chunks_exact(2)).step_by(7) {
        let x = f32::from_le_bytes(x.try_into().unwrap()) * mult;
        let l = u16::from_le_bytes(l.try_into().unwrap()) as i64;
        let want =
            ((x / scale as f32).round_ties_even() - offset as f32).clamp(0.0, 65535.0) as i64;
        assert_eq!(l, want, "{x}");
        assert!(
            ((l + offset) as f64 * scale - x as f64).abs() <= scale * 0.5001 + 1e-6
                || l == 0
                || l == 65535
        );
    }
    let sums = std::fs::read_to_string(b.join("SHA256SUMS")).unwrap();
    for f in [
        "genie_config.json",
        "htp_backend_ext_config.json",
        "prefill_decode_v79.bin",
        "tokenizer.json",
        "embedding_lut.bin",
        "perlayer_embedding_lut.bin",
        "genie-io.json",
        "manifest.json",
    ] {
        assert!(sums.contains(&format!("  {f}\n")), "{f} not in SHA256SUMS");
    }
    let io: Value =
        serde_json::from_slice(&std::fs::read(b.join("genie-io.json")).unwrap()).unwrap();
    assert_eq!(io["genie_can_drive_these_graphs"], false);
    assert!(io["differences"]
        .as_array()
        .unwrap()
        .iter()
        .any(|d| d["genie_expects"].as_str().unwrap().contains("logits")));
    // Not a shared build; a build with two targets and no --target.
    let e = common::hexq_err(&[
        "genie",
        "--artifacts",
        out.join("export/decode_wgqa").to_str().unwrap(),
        "--out",
        out.join("g-bad").to_str().unwrap(),
    ]);
    assert!(
        e.contains("export/decode_wgqa/manifest.json: not a shared prefill+decode build"),
        "{e}"
    );
    let e = common::hexq_err(&[
        "genie",
        "--artifacts",
        out.join("prefill_decode").to_str().unwrap(),
        "--out",
        out.join("g-bad").to_str().unwrap(),
    ]);
    assert!(e.contains("pick one with --target"), "{e}");
    assert!(!out.join("g-bad").exists());
}

/// Every file under `dir` (relative path → bytes' SHA256).
fn tree(dir: &std::path::Path) -> std::collections::BTreeMap<String, String> {
    let mut m = std::collections::BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().filter_map(|e| e.ok()) {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let rel = p.strip_prefix(dir).unwrap().display().to_string();
                m.insert(rel, hexq_fsutil::sha256_file(&p).unwrap());
            }
        }
    }
    m
}

/// `hexq build --recipe recipes/tiny.toml` into two directories of different names and depths, with different
/// TMPDIRs: every file identical (QNN binaries, EPContext graphs, manifests, stamps). Then the first build,
/// moved, is recognised as up to date: every stage reused.
#[test]
fn tiny_recipe_gives_the_same_bytes_in_any_directory_and_survives_a_move() {
    if !common::judge("onnxruntime_qnn") {
        return; // (judge() printed the SKIP; HEXQ_REQUIRE_JUDGES makes it a failure)
    }
    let t = tempfile::tempdir().unwrap();
    let build = |out: &std::path::Path, tmp: &std::path::Path| {
        std::fs::create_dir_all(tmp).unwrap();
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_hexq"))
            .current_dir(common::root())
            .env("TMPDIR", tmp)
            .args(["build", "--recipe", "recipes/tiny.toml", "--out"])
            .arg(out)
            .arg("--json")
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        statuses(&o)
    };
    let (a, b) = (t.path().join("a"), t.path().join("x/y/z/another-name"));
    build(&a, &t.path().join("tmp1"));
    build(&b, &t.path().join("deeper/tmp2"));
    let (ta, tb) = (tree(&a), tree(&b));
    assert!(ta.len() > 20, "{ta:?}");
    let differ: Vec<&String> = ta
        .keys()
        .filter(|k| ta.get(*k) != tb.get(*k))
        .chain(tb.keys().filter(|k| !ta.contains_key(*k)))
        .collect();
    assert!(
        differ.is_empty(),
        "{} of {} files differ: {differ:?}",
        differ.len(),
        ta.len()
    );
    let moved = t.path().join("moved/here");
    std::fs::create_dir_all(moved.parent().unwrap()).unwrap();
    std::fs::rename(&a, &moved).unwrap();
    let again = build(&moved, &t.path().join("tmp3"));
    assert!(again.iter().all(|(_, s)| s == "reused"), "{again:?}");
    assert_eq!(tree(&moved), ta, "a reused build is unchanged");
}
