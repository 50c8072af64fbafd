//! `hexq ablate` on the bundled model: every grid reported side by side, and on heavy-tailed input channels
//! group-wise q4_0 (g32) beats int4 per-channel on KL and top-1 — the published 4-bit build's finding.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
}

/// `hexq ARGS` from the repository root (the bundled model, the datasets), its JSON on stdout.
fn hexq_json(args: &[&str]) -> Value {
    let o = Command::new(env!("CARGO_BIN_EXE_hexq"))
        .current_dir(root())
        .args(args)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

#[test]
fn ablation_table_and_granularity_finding() {
    let t = tempfile::tempdir().unwrap();
    let svg = t.path().join("ablate.svg");
    let run = |extra: &[&str]| -> Value {
        let mut a = vec!["ablate", "--limit", "16", "--json"];
        a.extend(extra);
        hexq_json(&a)
    };
    let plain = run(&[]);
    let heavy = run(&["--heavy-tail", "--plot", svg.to_str().unwrap()]);
    let row = |r: &Value, s: &str| {
        r["rows"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["scheme"] == s)
            .unwrap()
            .clone()
    };
    for r in [&plain, &heavy] {
        let names: Vec<&str> = r["rows"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x["scheme"].as_str().unwrap())
            .collect();
        assert_eq!(
            names,
            [
                "int8-pc",
                "int4-pc",
                "q4_0-g32",
                "g64",
                "g128",
                "int4-pc-mlp-only",
                "lpbq-b64"
            ]
        );
        assert!((row(r, "q4_0-g32")["bits_per_weight"].as_f64().unwrap() - 4.5).abs() < 1e-9);
        assert!((row(r, "g128")["bits_per_weight"].as_f64().unwrap() - 4.125).abs() < 1e-9);
        // LPBQ-64 sits between per-channel int4 and a group grid: block scales, no fp16 per block.
        let (lp, pc) = (row(r, "lpbq-b64"), row(r, "int4-pc"));
        assert!(
            lp["bits_per_weight"].as_f64().unwrap()
                < row(r, "int8-pc")["bits_per_weight"].as_f64().unwrap()
        );
        assert!(
            lp["sqnr_db"]["mlp"].as_f64() > pc["sqnr_db"]["mlp"].as_f64(),
            "{lp} vs {pc}"
        );
        let s8 = row(r, "int8-pc")["sqnr_db"]["mlp"].as_f64().unwrap();
        let s4 = row(r, "int4-pc")["sqnr_db"]["mlp"].as_f64().unwrap();
        assert!(s8 > s4 + 15.0, "8-bit SQNR {s8} vs 4-bit {s4}");
        assert!(row(r, "int4-pc-mlp-only")["sqnr_db"]
            .get("attention")
            .is_none());
    }
    // The heavy-tail transform preserves the float function.
    let (pf, hf) = (
        plain["float_perplexity"].as_f64().unwrap(),
        heavy["float_perplexity"].as_f64().unwrap(),
    );
    assert!((pf - hf).abs() / pf < 1e-3, "{pf} vs {hf}");
    let (g32, pc) = (row(&heavy, "q4_0-g32"), row(&heavy, "int4-pc"));
    assert!(
        g32["kl_mean"].as_f64() < pc["kl_mean"].as_f64(),
        "g32 {g32} vs int4-pc {pc}"
    );
    assert!(
        g32["top1_agreement"].as_f64() > pc["top1_agreement"].as_f64(),
        "g32 {g32} vs int4-pc {pc}"
    );
    assert!(g32["sqnr_db"]["mlp"].as_f64() > pc["sqnr_db"]["mlp"].as_f64());
    let s = std::fs::read_to_string(&svg).unwrap();
    assert!(s.starts_with("<svg") && s.contains("q4_0-g32"));
}

/// The batched passes are batch-invariant: one position per run and 64 per run print the same report.
#[test]
fn ablation_report_does_not_depend_on_the_batch() {
    let run = |batch: &str| {
        let o = Command::new(env!("CARGO_BIN_EXE_hexq"))
            .current_dir(root())
            .args([
                "ablate",
                "--limit",
                "4",
                "--schemes",
                "int4-pc,q4_0-g32,lpbq-b64",
                "--json",
                "--batch",
                batch,
            ])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        o.stdout
    };
    assert_eq!(run("1"), run("64"));
}

/// Whole builds as rows (`--encodings NAME=FILE`): an encodings file's weights alone give exactly the
/// matching grid's row (int8 per channel; LPBQ-64), every figure, bits and bytes included — so the builds'
/// rows and the grids' are measured alike; with the activations too (A16W8) the row says int16 and adds error.
#[test]
fn builds_sit_beside_the_grids() {
    let t = tempfile::tempdir().unwrap();
    let p = |f: &str| t.path().join(f).to_str().unwrap().to_string();
    let hexq = |args: &[&str]| {
        let o = Command::new(env!("CARGO_BIN_EXE_hexq"))
            .current_dir(root())
            .args(args)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        o.stdout
    };
    hexq(&["calibrate", "--limit", "4", "--out", &p("s.json")]);
    hexq(&[
        "quantize",
        "--stats",
        &p("s.json"),
        "--out",
        &p("a16w8.json"),
    ]);
    hexq(&[
        "quantize",
        "--stats",
        &p("s.json"),
        "--scheme",
        "w4a16-lpbq",
        "--block",
        "64",
        "--out",
        &p("lpbq.json"),
    ]);
    // Weights only: the MatMul weights' param (and LPBQ) encodings, no activations.
    for f in ["a16w8", "lpbq"] {
        let mut e: Value =
            serde_json::from_slice(&std::fs::read(p(&format!("{f}.json"))).unwrap()).unwrap();
        e["activation_encodings"] = serde_json::json!({});
        let params = e["param_encodings"].as_object_mut().unwrap();
        params.retain(|k, _| k.ends_with(".weight.T"));
        std::fs::write(p(&format!("{f}-w.json")), e.to_string()).unwrap();
    }
    let out = hexq(&[
        "ablate",
        "--limit",
        "4",
        "--schemes",
        "int8-pc,lpbq-b64",
        "--encodings",
        &format!("w8={}", p("a16w8-w.json")),
        "--encodings",
        &format!("w4={}", p("lpbq-w.json")),
        "--encodings",
        &format!("a16w8={}", p("a16w8.json")),
        "--json",
    ]);
    let r: Value = serde_json::from_slice(&out).unwrap();
    let row = |s: &str| {
        r["rows"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["scheme"] == s)
            .unwrap()
            .clone()
    };
    for (grid, build) in [("int8-pc", "w8"), ("lpbq-b64", "w4")] {
        let (g, b) = (row(grid), row(build));
        for k in [
            "bits_per_weight",
            "decoder_mib",
            "top1_agreement",
            "kl_mean",
            "perplexity",
            "hidden_cosine_mean",
        ] {
            assert_eq!(g[k], b[k], "{grid} vs {build}: {k}");
        }
        // SQNR: the same errors, summed in another order.
        let (sg, sb) = (
            g["sqnr_db"]["mlp"].as_f64().unwrap(),
            b["sqnr_db"]["mlp"].as_f64().unwrap(),
        );
        assert!((sg - sb).abs() < 1e-9 * sg.abs(), "{sg} vs {sb}");
        assert_eq!(b["activations"], "float");
    }
    let (a, w) = (row("a16w8"), row("w8"));
    assert_eq!(a["activations"], "int16");
    assert!(a["kl_mean"].as_f64() > w["kl_mean"].as_f64(), "{a} vs {w}");
    // Bad input names the problem.
    let o = Command::new(env!("CARGO_BIN_EXE_hexq"))
        .current_dir(root())
        .args(["ablate", "--schemes", "none", "--encodings", "x"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("NAME=FILE"));
}

/// `--rounding` crosses each grid with the roundings that apply to it (imatrix on q4_0 groups, SeqMSE on
/// per-channel and LPBQ, GPTQ everywhere) and `--head` with the head's grid; every row names its scheme,
/// rounding and head, and a to-nearest row with a float head is the plain run's row exactly.
#[test]
fn rounding_and_head_cross_the_grids() {
    let run = |extra: &[&str]| -> Value {
        let mut a = vec!["ablate", "--limit", "2", "--calib-limit", "2", "--json"];
        a.extend(extra);
        hexq_json(&a)
    };
    let plain = run(&["--schemes", "q4_0-g32"]);
    let r = run(&[
        "--schemes",
        "q4_0-g32,lpbq-b32",
        "--rounding",
        "rtn,imatrix,seqmse,gptq",
        "--head",
        "float,8",
    ]);
    let got: Vec<(String, String, String)> = r["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| {
            let s = |k: &str| x[k].as_str().unwrap().to_string();
            (s("scheme"), s("rounding"), s("head"))
        })
        .collect();
    let want: Vec<(String, String, String)> = [
        ("q4_0-g32", "rtn", "float"),
        ("q4_0-g32", "rtn", "q8_0"),
        ("q4_0-g32", "imatrix", "float"),
        ("q4_0-g32", "imatrix", "q8_0"),
        ("q4_0-g32", "gptq", "float"),
        ("q4_0-g32", "gptq", "q8_0"),
        ("lpbq-b32", "rtn", "float"),
        ("lpbq-b32", "rtn", "int8-pc"),
        ("lpbq-b32", "seqmse", "float"),
        ("lpbq-b32", "seqmse", "int8-pc"),
        ("lpbq-b32", "gptq", "float"),
        ("lpbq-b32", "gptq", "int8-pc"),
    ]
    .iter()
    .map(|(a, b, c)| (a.to_string(), b.to_string(), c.to_string()))
    .collect();
    assert_eq!(got, want);
    let rows = r["rows"].as_array().unwrap();
    assert_eq!(rows[0], plain["rows"][0]);
    for x in rows {
        let kl = x["kl_mean"].as_f64().unwrap();
        assert!(kl.is_finite() && kl > 0.0, "{x}");
        // The head at 8 bits: the embedding table's SQNR is an 8-bit grid's (~45 dB), not 4-bit's (~21).
        let e = x["sqnr_db"]["embeddings"].as_f64().unwrap();
        assert!((x["head"] == "float") == (e < 30.0), "{x}");
    }
    // A rounding that does not apply to any grid asked for is refused as nothing to compare.
    let o = Command::new(env!("CARGO_BIN_EXE_hexq"))
        .current_dir(root())
        .args([
            "ablate",
            "--schemes",
            "q4_0-g32",
            "--rounding",
            "seqmse",
            "--limit",
            "1",
        ])
        .output()
        .unwrap();
    assert_eq!(
        o.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}
