//! GGUF judged by llama.cpp's own tools: hexq's files read back by gguf-py (every key and tensor) equal what
//! convert_hf_to_gguf.py (+ llama-quantize) wrote for the same checkpoint (tests/fixtures/gguf/, made by
//! scripts/make_gguf_reference.py), tensor data included; q4_0/q8_0 blocks equal gguf-py's reference
//! quantizers on random and adversarial tensors; llama.cpp itself loads and runs the files when a build is
//! given (LLAMA_CPP_DIR).

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
}

fn hexq(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_hexq"))
        .current_dir(root())
        .args(args)
        .output()
        .unwrap()
}

fn gguf_py() -> bool {
    let ok = Command::new("python3")
        .args(["-c", "import gguf"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !ok {
        assert!(
            std::env::var("HEXQ_REQUIRE_JUDGES").is_err(),
            "gguf (gguf-py) required but not importable"
        );
        eprintln!("SKIP: python gguf not importable");
    }
    ok
}

fn dump(p: &Path) -> Value {
    let o = Command::new("python3")
        .arg(root().join("scripts/make_gguf_reference.py"))
        .arg("--dump")
        .arg(p)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "gguf-py could not read {}: {}",
        p.display(),
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).unwrap()
}

#[test]
fn gguf_equals_llama_cpp_converter_and_quantizer_output() {
    if !gguf_py() {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    // (checkpoint, hexq args, reference): f16/q8_0 from the f32 fixture as convert_hf_to_gguf.py --outtype;
    // Q4_0 from the bf16 copy as convert --outtype bf16 + llama-quantize [--pure].
    for (model, args, reference) in [
        ("tests/fixtures/tiny-gemma4", vec!["--type", "f16"], "f16"),
        ("tests/fixtures/tiny-gemma4", vec!["--type", "q8_0"], "q8_0"),
        (
            "tests/fixtures/tiny-gemma4-bf16",
            vec!["--type", "q4_0"],
            "q4_0",
        ),
        (
            "tests/fixtures/tiny-gemma4-bf16",
            vec!["--type", "q4_0", "--pure"],
            "q4_0-pure",
        ),
    ] {
        let out = t.path().join(format!("{reference}.gguf"));
        let mut a = vec!["gguf", "--model", model, "--out", out.to_str().unwrap()];
        a.extend(args);
        let o = hexq(&a);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let ours = dump(&out);
        let want: Value = serde_json::from_slice(
            &std::fs::read(root().join(format!("tests/fixtures/gguf/reference.{reference}.json")))
                .unwrap(),
        )
        .unwrap();
        let (ok, wk) = (
            ours["keys"].as_array().unwrap(),
            want["keys"].as_array().unwrap(),
        );
        assert_eq!(ok.len(), wk.len(), "{reference}: key count");
        for (a, b) in ok.iter().zip(wk) {
            assert_eq!(a, b, "{reference}: metadata key differs");
        }
        let (ot, wt) = (
            ours["tensors"].as_array().unwrap(),
            want["tensors"].as_array().unwrap(),
        );
        assert_eq!(ot.len(), wt.len(), "{reference}: tensor count");
        for (a, b) in ot.iter().zip(wt) {
            assert_eq!(
                a, b,
                "{reference}: tensor (name, type, shape, data SHA256) differs"
            );
        }
        // The manifest beside it hashes the file.
        let m: Value = serde_json::from_slice(
            &std::fs::read(format!("{}.manifest.json", out.display())).unwrap(),
        )
        .unwrap();
        assert_eq!(
            m["sha256"].as_str().unwrap(),
            hexq_model::fsutil::sha256_file(&out).unwrap()
        );
    }
    // Refuses to overwrite; E2B-like rows (multiple of 256) without --pure name the q6_K gap.
    let out = t.path().join("f16.gguf");
    let o = hexq(&[
        "gguf",
        "--model",
        "tests/fixtures/tiny-gemma4",
        "--type",
        "f16",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("already exists"));
}

#[test]
fn q4_0_and_q8_0_blocks_equal_the_reference_quantizer() {
    if !gguf_py() {
        return;
    }
    use hexq_quantize::ggml;
    let t = tempfile::tempdir().unwrap();
    let mut rng: u64 = 0x9e3779b97f4a7c15;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng >> 11) as f64 / (1u64 << 53) as f64
    };
    let mut cases: Vec<(&str, Vec<f32>)> = Vec::new();
    let normal = |n: usize, s: f64, next: &mut dyn FnMut() -> f64| -> Vec<f32> {
        (0..n)
            .map(|_| {
                let (u, v) = (next().max(1e-12), next());
                ((-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos() * s) as f32
            })
            .collect()
    };
    cases.push(("normal", normal(32 * 256, 1.0, &mut next)));
    cases.push(("normal_small", normal(32 * 64, 1e-3, &mut next)));
    cases.push(("normal_large", normal(32 * 64, 1e4, &mut next)));
    cases.push((
        "uniform",
        (0..32 * 128).map(|_| (next() * 2.0 - 1.0) as f32).collect(),
    ));
    cases.push(("all_zero", vec![0.0; 32 * 4]));
    let mut outlier = normal(32 * 8, 0.02, &mut next);
    outlier[5] = 80.0;
    outlier[32 * 3 + 17] = -300.0;
    cases.push(("one_huge_outlier", outlier));
    let mut negmax = normal(32 * 8, 1.0, &mut next);
    for b in 0..8 {
        negmax[b * 32 + (b * 5) % 32] = -9.0;
    }
    cases.push(("negative_max", negmax));
    cases.push((
        "subnormal",
        (0..32 * 8)
            .map(|i| {
                f32::from_bits(1 + (i as u32 * 7919) % 0x7fffff)
                    * if i % 3 == 0 { -1.0 } else { 1.0 }
            })
            .collect(),
    ));
    cases.push((
        "tiny_normal_max",
        (0..32 * 8)
            .map(|i| 1.2e-38 * ((i % 11) as f32 - 5.0))
            .collect(),
    ));
    cases.push((
        "halfway",
        (0..32 * 8)
            .map(|i| ((i % 32) as f32 - 16.0) * 0.5)
            .collect(),
    ));
    cases.push((
        "equal_magnitudes",
        (0..32 * 4)
            .map(|i| if i % 2 == 0 { 3.0 } else { -3.0 })
            .collect(),
    ));
    cases.push((
        "integers",
        (0..32 * 8).map(|i| ((i * 37) % 17) as f32 - 8.0).collect(),
    ));
    for (name, x) in &cases {
        std::fs::write(
            t.path().join(format!("{name}.f32")),
            x.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<_>>(),
        )
        .unwrap();
        let (mut a, mut b) = (vec![], vec![]);
        ggml::quantize_q4_0(x, &mut a).unwrap();
        ggml::quantize_q8_0(x, &mut b).unwrap();
        std::fs::write(t.path().join(format!("{name}.q4_0")), a).unwrap();
        std::fs::write(t.path().join(format!("{name}.q8_0")), b).unwrap();
    }
    let o = Command::new("python3")
        .arg(root().join("tests/judges/ggml_quants.py"))
        .arg(t.path())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let r: Value = serde_json::from_slice(&o.stdout).unwrap();
    for (name, _) in &cases {
        assert_eq!(
            r[name]["q4_0"], true,
            "{name}: q4_0 differs from gguf-py: {}",
            r[name]
        );
        assert_eq!(
            r[name]["q8_0"], true,
            "{name}: q8_0 differs from gguf-py: {}",
            r[name]
        );
    }
    // NaN and infinities are refused with an error, not written.
    let mut bad = vec![0f32; 32];
    bad[3] = f32::NAN;
    assert!(ggml::quantize_q4_0(&bad, &mut vec![])
        .unwrap_err()
        .contains("non-finite"));
    bad[3] = f32::INFINITY;
    assert!(ggml::quantize_q8_0(&bad, &mut vec![])
        .unwrap_err()
        .contains("non-finite"));
}

/// llama.cpp's build directory (with bin/llama-simple), from $LLAMA_CPP_BUILD (.ci/run builds it from the
/// llama-cpp-python 0.3.36 sdist's vendored llama.cpp).
fn llama_build() -> Option<PathBuf> {
    match std::env::var("LLAMA_CPP_BUILD") {
        Ok(d) if Path::new(&d).join("bin/llama-simple").exists() => Some(PathBuf::from(d)),
        _ => {
            assert!(
                std::env::var("HEXQ_REQUIRE_JUDGES").is_err(),
                "LLAMA_CPP_BUILD must point at a llama.cpp build with bin/llama-simple"
            );
            eprintln!("SKIP: LLAMA_CPP_BUILD not set (a llama.cpp build with bin/llama-simple)");
            None
        }
    }
}

#[test]
fn llama_cpp_loads_hexq_gguf_and_decodes_like_the_float_reference() {
    let Some(build) = llama_build() else { return };
    let t = tempfile::tempdir().unwrap();
    let f16 = t.path().join("tiny-f16.gguf");
    let o = hexq(&[
        "gguf",
        "--model",
        "tests/fixtures/tiny-gemma4",
        "--type",
        "f16",
        "--out",
        f16.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // Prompts short enough that prompt + continuation stay inside the 16-token sliding window, where
    // llama.cpp's Gemma-4 is known to agree with transformers (reference-tools.md).
    for prompt in ["Hi", "ok", "no"] {
        let n = 4;
        let o = hexq(&[
            "run",
            "--prompt",
            prompt,
            "--max-tokens",
            &n.to_string(),
            "--json",
        ]);
        assert!(o.status.success());
        let g: Value = serde_json::from_slice(&o.stdout).unwrap();
        assert!(g["prompt_ids"].as_array().unwrap().len() + n <= 16);
        // llama-simple tokenizes with the special tokens parsed and adds <bos> itself.
        let text = format!("<|turn>user\n{prompt}<turn|>\n<|turn>model\n");
        let o = Command::new(build.join("bin/llama-simple"))
            .args(["-m", f16.to_str().unwrap(), "-n", &n.to_string(), &text])
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "llama.cpp failed to load/run: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let out = String::from_utf8_lossy(&o.stdout).to_string();
        let cont = out
            .split_once(&text)
            .map(|(_, c)| c.trim_end_matches('\n').to_string())
            .unwrap_or_default();
        // Greedy continuation, stop tokens included as llama-simple prints them.
        let ids: Vec<u32> = g["generated_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let tok = hexq_model::chat::Tokenizer::from_dir(&root().join("tests/fixtures/tiny-gemma4"))
            .unwrap();
        let want = tok.decode(&ids, false).unwrap();
        assert_eq!(
            cont, want,
            "{prompt:?}: llama.cpp continuation differs from the float reference"
        );
    }
}
