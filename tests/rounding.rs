//! Calibration-aware rounding on the trained Gemma-3 270M (issue 42), a small run of
//! docs/results/rounding.md's table: `hexq ablate --rounding` over every position of 6 held-out chat prompts,
//! the roundings' inputs from 32 calibration prompts; and the A16W8 build quantized with and without GPTQ
//! beside them. The figures the bounds hold are in the test's comment, measured with this very command.

mod common;

use serde_json::Value;

fn f(r: &Value, k: &str) -> f64 {
    r[k].as_f64().unwrap()
}

/// Measured (2026-12-07, AMD EPYC Zen 5; 6 prompts, 135 positions), KL / top-1: q4_0-g32 rtn 0.4185 /
/// 69.6 %, imatrix 0.2175 / 82.2 %, gptq 0.1005 / 85.9 %; lpbq-b64 rtn 0.6645 / 56.3 %, gptq 0.1302 /
/// 86.7 %, seqmse-gptq 0.1197 / 90.4 %; A16W8 0.0082 → 0.0044 with GPTQ (top-1 98.5 % both). Held, with
/// margin (BOUNDS): q4_0-g32's imatrix below round to nearest; the best rounding at least halves round to
/// nearest's KL on q4_0-g32 and lpbq-b64 (the goal, met on the full table too); A16W8 no worse
/// with GPTQ than without.
#[test]
fn roundings_halve_the_4_bit_kl_on_the_trained_model() {
    let Some((_, dir)) = common::trained_gemma3() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let m = dir.to_str().unwrap();
    let p = |f: &str| tmp.path().join(f).to_str().unwrap().to_string();
    common::hexq_ok(&[
        "calibrate",
        "--model",
        m,
        "--limit",
        "16",
        "--context",
        "256",
        "--decode-tokens",
        "4",
        "--out",
        &p("st.json"),
    ]);
    for (out, rounding) in [("enc.json", "rtn"), ("gptq.json", "gptq")] {
        common::hexq_ok(&[
            "quantize",
            "--model",
            m,
            "--stats",
            &p("st.json"),
            "--rounding",
            rounding,
            "--out",
            &p(out),
        ]);
    }
    let builds = [
        format!("a16w8={}", p("enc.json")),
        format!("a16w8-gptq={}", p("gptq.json")),
    ];
    let ablate = |extra: &[&str]| -> Value {
        let mut a = vec![
            "ablate",
            "--model",
            m,
            "--limit",
            "6",
            "--context",
            "256",
            "--json",
        ];
        a.extend(extra);
        serde_json::from_slice(&common::hexq_ok(&a).stdout).unwrap()
    };
    let r = ablate(&[
        "--schemes",
        "q4_0-g32,lpbq-b64",
        "--rounding",
        "rtn,imatrix,gptq,seqmse-gptq",
        "--calib-limit",
        "32",
        "--calib-decode-tokens",
        "4",
    ]);
    let bd = ablate(&[
        "--schemes",
        "int8-pc",
        "--encodings",
        &builds[0],
        "--encodings",
        &builds[1],
    ]);
    let rows = r["rows"].as_array().unwrap();
    let kl = |scheme: &str, rounding: &str| {
        let x = rows
            .iter()
            .find(|x| x["scheme"] == scheme && x["rounding"] == rounding)
            .unwrap_or_else(|| panic!("no row {scheme} {rounding}: {r}"));
        f(x, "kl_mean")
    };
    for x in rows.iter().chain(bd["rows"].as_array().unwrap()) {
        eprintln!(
            "{} {} {}: top-1 {:.4} KL {:.4} cos {:.5}",
            x["scheme"],
            x["rounding"],
            x["head"],
            f(x, "top1_agreement"),
            f(x, "kl_mean"),
            f(x, "hidden_cosine_mean")
        );
    }
    // (scheme, rounding, KL ≤): the measured figures with margin.
    for (s, rd, bound) in BOUNDS {
        assert!(kl(s, rd) <= bound, "{s} {rd}: KL {} > {bound}", kl(s, rd));
    }
    assert!(kl("q4_0-g32", "imatrix") < kl("q4_0-g32", "rtn"));
    assert!(kl("q4_0-g32", "gptq") <= 0.5 * kl("q4_0-g32", "rtn"));
    assert!(kl("lpbq-b64", "seqmse-gptq") <= 0.5 * kl("lpbq-b64", "rtn"));
    // The A16W8 builds carry their names as schemes; GPTQ's is no worse.
    let b = |s: &str| {
        bd["rows"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["scheme"] == s)
            .map(|x| f(x, "kl_mean"))
            .unwrap()
    };
    assert!(
        b("a16w8-gptq") <= b("a16w8") * 1.05,
        "{} vs {}",
        b("a16w8-gptq"),
        b("a16w8")
    );
}

const BOUNDS: [(&str, &str, f64); 6] = [
    ("q4_0-g32", "rtn", 0.46),
    ("q4_0-g32", "imatrix", 0.25),
    ("q4_0-g32", "gptq", 0.13),
    ("lpbq-b64", "rtn", 0.72),
    ("lpbq-b64", "gptq", 0.16),
    ("lpbq-b64", "seqmse-gptq", 0.15),
];
