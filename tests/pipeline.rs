//! `hexq pipeline` on a bare machine: Python without any pip package (a `python3` on PATH that runs the real
//! interpreter with `-S`, so site-packages — where pip installs — is never imported), no ORT_DYLIB_PATH, no
//! llama.cpp. The job must exit 0, skip the onnxruntime and QNN stages with the command that enables them,
//! and write every other stage's output.

mod common;
use common::root;
use serde_json::Value;
use std::process::Command;

#[test]
fn pipeline_passes_without_python_packages() {
    let tmp = tempfile::tempdir().unwrap();
    let bin = tmp.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    let real = String::from_utf8(
        Command::new("python3")
            .args(["-c", "import sys; print(sys.executable)"])
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap();
    let shim = bin.join("python3");
    std::fs::write(
        &shim,
        format!("#!/bin/sh\nexec {} -S \"$@\"\n", real.trim()),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&shim, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = tmp.path().join("out");
    let o = Command::new(env!("CARGO_BIN_EXE_hexq"))
        .current_dir(root())
        .env("PATH", format!("{}:/usr/bin:/bin", bin.display()))
        .env_remove("ORT_DYLIB_PATH")
        .env_remove("HEXQ_QNN_EP_LIB")
        .env_remove("HEXQ_QNN_BACKEND")
        .env_remove("LLAMA_CPP_BUILD")
        .args([
            "pipeline",
            "--calib-limit",
            "8",
            "--verify-limit",
            "4",
            "--json",
            "--out",
        ])
        .arg(&out)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.success(),
        "pipeline failed on the bare machine:\n{err}"
    );
    // The stage table is the last JSON document on stdout (the stages print their own tables first).
    let stdout = String::from_utf8_lossy(&o.stdout);
    let table: Vec<Value> =
        serde_json::from_str(&stdout[stdout.rfind("\n[").map_or(0, |i| i + 1)..]).unwrap();
    let status = |name: &str| {
        let s = table
            .iter()
            .find(|s| s["stage"] == name)
            .unwrap_or_else(|| panic!("no stage {name}"));
        (
            s["status"].as_str().unwrap().to_string(),
            s["reason"].as_str().unwrap_or("").to_string(),
        )
    };
    for ran in [
        "inspect",
        "run cpu",
        "run graph",
        "calibrate decode_wgqa",
        "quantize a16w8",
        "verify a16w8",
        "export decode_wgqa qdq",
        "export trunk float",
        "gguf q4_0 --pure",
        "gguf f16",
        "ablate (heavy-tailed input channels)",
    ] {
        assert_eq!(status(ran).0, "ran", "{ran}");
    }
    let (st, why) = status("run ort (qdq decode_wgqa)");
    assert_eq!(st, "skipped");
    assert!(why.contains("python3 -m pip install onnxruntime"), "{why}");
    for qnn in ["compile decode_wgqa v79", "compile decode_wgqa v81"] {
        let (st, why) = status(qnn);
        assert_eq!(st, "skipped", "{qnn}");
        assert!(why.contains("pip install onnx"), "{why}");
    }
    assert_eq!(status("run qnn v79 (HTP simulator)").0, "skipped");
    assert_eq!(status("verify qnn v79,v81 (HTP simulator)").0, "skipped");
    assert!(!table.iter().any(|s| s["status"] == "failed"));
    // The human-readable table on stderr carries the same skip lines.
    assert!(err.contains("| run ort (qdq decode_wgqa) | skipped: onnxruntime not installed; enable with: python3 -m pip install onnxruntime"), "{err}");
    for f in [
        "stats.decode_wgqa.json",
        "decode_wgqa.encodings.json",
        "decode_wgqa.qdq/decode_wgqa.onnx",
        "trunk/trunk.onnx",
        "model-q4_0-pure.gguf",
        "model-f16.gguf",
        "ablate.svg",
    ] {
        assert!(out.join(f).exists(), "{f} missing");
    }
}
