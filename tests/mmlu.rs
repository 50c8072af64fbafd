//! `hexq mmlu` (issue 44): the sample's questions answered alike by the cpu reference, hexq's graph
//! interpreter and onnxruntime on the bundled model; the report's fields; agreement between two runs; and a
//! data file that overlaps the calibration set, or is malformed, refused naming it.

mod common;

use serde_json::Value;

fn mmlu(extra: &[&str]) -> Value {
    let mut a = vec!["mmlu", "--data", "datasets/mmlu-sample.jsonl", "--json"];
    a.extend(extra);
    serde_json::from_slice(&common::hexq_ok(&a).stdout).unwrap()
}

#[test]
fn the_same_answers_on_cpu_graph_and_ort() {
    let t = tempfile::tempdir().unwrap();
    let cpu = mmlu(&["--backend", "cpu"]);
    let mut others = vec![mmlu(&["--backend", "graph", "--context", "256"])];
    // onnxruntime: its PyPI wheel's library (a missing judge skips this part, as elsewhere).
    if common::judge("onnxruntime") {
        let exp = t.path().join("exp");
        common::hexq_ok(&[
            "export",
            "--variant",
            "decode_wgqa",
            "--context",
            "256",
            "--out",
            exp.to_str().unwrap(),
        ]);
        others.push(mmlu(&[
            "--backend",
            "ort",
            "--artifacts",
            exp.to_str().unwrap(),
        ]));
    }
    assert_eq!(cpu["questions"], 24);
    assert_eq!(cpu["subjects"].as_array().unwrap().len(), 6);
    for r in &others {
        assert_eq!(r["answers"], cpu["answers"], "{} vs cpu", r["backend"]);
        assert_eq!(r["accuracy"], cpu["accuracy"]);
    }
    let se = cpu["accuracy_se"].as_f64().unwrap();
    assert!(se > 0.0 && se < 0.2, "{cpu}");
    // Agreement with a saved report: 100 % with itself.
    let saved = t.path().join("cpu.json");
    std::fs::write(&saved, cpu.to_string()).unwrap();
    let again = mmlu(&[
        "--backend",
        "graph",
        "--context",
        "256",
        "--compare",
        saved.to_str().unwrap(),
    ]);
    assert_eq!(again["agreement"], 1.0);
}

#[test]
fn overlapping_or_malformed_data_is_refused() {
    let t = tempfile::tempdir().unwrap();
    // A question taken from the calibration set itself.
    let cal = hexq_model::dataset::load_dataset(&common::root().join("datasets/calibration.jsonl"))
        .unwrap();
    let q = cal
        .iter()
        .flat_map(|r| r.messages.clone().unwrap_or_default())
        .map(|m| m.content)
        .find(|c| c.len() > 30)
        .unwrap();
    let p = t.path().join("leak.jsonl");
    let row = serde_json::json!({"question": q, "choices": ["a", "b", "c", "d"], "answer": "A"});
    std::fs::write(&p, format!("{row}\n")).unwrap();
    let e = common::hexq_err(&["mmlu", "--data", p.to_str().unwrap()]);
    assert!(e.contains("leak.jsonl") && e.contains("calibration"), "{e}");
    let p = t.path().join("bad_test.csv");
    std::fs::write(&p, "q,a,b,c,d\n").unwrap();
    let e = common::hexq_err(&["mmlu", "--data", p.to_str().unwrap()]);
    assert!(e.contains("bad_test.csv") && e.contains("line 1"), "{e}");
}
