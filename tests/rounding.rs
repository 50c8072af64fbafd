//! Calibration-aware rounding on the trained Gemma-3 270M (issue 42), a small run of
//! docs/results/rounding.md's table: `hexq ablate --rounding` over every position of 6 held-out chat prompts,
//! the roundings' inputs from 32 calibration prompts; and the A16W8 build quantized with and without GPTQ
//! beside them. The figures the bounds hold are in the test's comment, measured with this very command.

mod common;

use serde_json::Value;

fn f(r: &Value, k: &str) -> f64 {
    r[k].as_f64().unwrap()
}

/// Measured (2026-12-07, AMD EPYC Zen 5; 6 prompts, 135 positions): see BOUNDS. Held: q4_0-g32's
/// imatrix below round to nearest; the best rounding at least halves round to nearest's KL on q4_0-g32 and
/// lpbq-b64 (the goal, met on the full table too); A16W8 no worse with GPTQ than without.
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
    let o = common::hexq_ok(&[
        "ablate",
        "--model",
        m,
        "--limit",
        "6",
        "--context",
        "256",
        "--schemes",
        "q4_0-g32,lpbq-b64",
        "--rounding",
        "rtn,imatrix,gptq,seqmse-gptq",
        "--calib-limit",
        "32",
        "--calib-decode-tokens",
        "4",
        "--encodings",
        &builds[0],
        "--encodings",
        &builds[1],
        "--json",
    ]);
    let r: Value = serde_json::from_slice(&o.stdout).unwrap();
    let rows = r["rows"].as_array().unwrap();
    let kl = |scheme: &str, rounding: &str| {
        let x = rows
            .iter()
            .find(|x| x["scheme"] == scheme && x["rounding"] == rounding)
            .unwrap_or_else(|| panic!("no row {scheme} {rounding}: {r}"));
        f(x, "kl_mean")
    };
    for x in rows {
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
    // The A16W8 builds carry their names as schemes; GPTQ's is no worse (a small tolerance for noise).
    let b = |s: &str| {
        rows.iter()
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
    ("q4_0-g32", "rtn", 0.6),
    ("q4_0-g32", "imatrix", 0.4),
    ("q4_0-g32", "gptq", 0.2),
    ("lpbq-b64", "rtn", 0.9),
    ("lpbq-b64", "gptq", 0.3),
    ("lpbq-b64", "seqmse-gptq", 0.2),
];
