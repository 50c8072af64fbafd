//! The `hexq` binary end to end: inspect, run, synth; exit codes and JSON output.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn hexq(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_hexq"))
        .args(args)
        .output()
        .unwrap()
}

fn ok_json(args: &[&str]) -> Value {
    let o = hexq(args);
    assert!(
        o.status.success(),
        "hexq {args:?} failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).unwrap()
}

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-gemma4")
}

fn golden() -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture().join("../golden/golden.json")).unwrap())
        .unwrap()
}

#[test]
fn inspect_reports_config_counts_and_tensors() {
    let fx = fixture();
    let v = ok_json(&["inspect", fx.to_str().unwrap(), "--tensors", "--json"]);
    assert_eq!(v["config"]["num_layers"], 10);
    assert_eq!(v["config"]["layout"], "Multimodal");
    let p = &v["parameters"];
    assert_eq!(p["token_embedding"], 4608 * 64);
    assert_eq!(p["per_layer_embedding"], 4608 * 10 * 16);
    assert_eq!(
        p["total"].as_u64().unwrap(),
        p["decoder"].as_u64().unwrap()
            + p["token_embedding"].as_u64().unwrap()
            + p["per_layer_embedding"].as_u64().unwrap()
    );
    let n: u64 = v["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            t["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap())
                .product::<u64>()
        })
        .sum();
    assert_eq!(n, p["total"].as_u64().unwrap());
    // Human output too.
    let o = hexq(&["inspect", fx.to_str().unwrap()]);
    assert!(o.status.success());
    assert!(String::from_utf8_lossy(&o.stdout).contains("reuse L3"));
}

#[test]
fn run_json_gives_the_template_ids_and_transformers_greedy() {
    let g = golden();
    let fx = fixture();
    let v = ok_json(&[
        "run",
        "--model",
        fx.to_str().unwrap(),
        "--prompt",
        "What is the capital of France?",
        "--max-tokens",
        "8",
        "--json",
    ]);
    assert_eq!(v["prompt_ids"], g["chat"]["single"]["ids"]);
    assert_eq!(v["generated_ids"], g["sequences"]["chat"]["greedy8"]);
    assert_eq!(v["backend"], "cpu");
    assert!(v["decode_tokens_per_second"].as_f64().unwrap() > 0.0);
}

#[test]
fn run_defaults_to_the_bundled_model() {
    let g = golden();
    let tmp = tempfile::tempdir().unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_hexq"))
        .env("XDG_CACHE_HOME", tmp.path())
        .args([
            "run",
            "--prompt",
            "What is the capital of France?",
            "--max-tokens",
            "8",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["generated_ids"], g["sequences"]["chat"]["greedy8"]);
}

#[test]
fn synth_writes_what_inspect_reads_back() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("synth");
    let cfg = fixture().join("config.json");
    // Small shards to exercise the sharded path.
    let r = ok_json(&[
        "synth",
        "--config",
        cfg.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--shard-bytes",
        "400000",
        "--json",
    ]);
    assert!(r["files"].as_array().unwrap().len() > 1);
    assert!(out.join("model.safetensors.index.json").exists());
    let a = ok_json(&["inspect", out.to_str().unwrap(), "--tensors", "--json"]);
    let b = ok_json(&[
        "inspect",
        fixture().to_str().unwrap(),
        "--tensors",
        "--json",
    ]);
    assert_eq!(a["parameters"], b["parameters"]);
    let names = |v: &Value| -> Vec<(Value, Value)> {
        v["tensors"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| (t["name"].clone(), t["shape"].clone()))
            .collect()
    };
    assert_eq!(names(&a), names(&b));
    assert!(a["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .all(|t| t["dtype"] == "BF16"));
    // It runs.
    let v = ok_json(&[
        "run",
        "--model",
        out.to_str().unwrap(),
        "--prompt",
        "hi",
        "--max-tokens",
        "3",
        "--json",
    ]);
    assert_eq!(v["generated_ids"].as_array().unwrap().len(), 3);
    // Deterministic: same seed, same bytes.
    let out2 = tmp.path().join("synth2");
    ok_json(&[
        "synth",
        "--config",
        cfg.to_str().unwrap(),
        "--out",
        out2.to_str().unwrap(),
        "--shard-bytes",
        "400000",
        "--json",
    ]);
    for f in std::fs::read_dir(&out).unwrap() {
        let f = f.unwrap();
        assert_eq!(
            std::fs::read(f.path()).unwrap(),
            std::fs::read(out2.join(f.file_name())).unwrap(),
            "{:?}",
            f.file_name()
        );
    }
    // Refuses to overwrite without --force, and leaves the existing output intact.
    let o = hexq(&[
        "synth",
        "--config",
        cfg.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("already exists"));
    assert!(out.join("config.json").exists());
    // A bad config leaves nothing behind.
    let bad = tmp.path().join("bad.json");
    std::fs::write(&bad, r#"{"model_type": "gemma4_text", "hidden_size": 64}"#).unwrap();
    let out3 = tmp.path().join("synth3");
    let o = hexq(&[
        "synth",
        "--config",
        bad.to_str().unwrap(),
        "--out",
        out3.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("intermediate_size"));
    assert!(!out3.exists());
    let leftovers: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains(".tmp-"))
        .collect();
    assert!(leftovers.is_empty());
}

#[test]
fn usage_errors_exit_2_and_bad_model_exits_1() {
    assert_eq!(hexq(&["run"]).status.code(), Some(2));
    assert_eq!(hexq(&["frobnicate"]).status.code(), Some(2));
    assert!(hexq(&["--help"]).status.success());
    let o = hexq(&["inspect", "/nonexistent/model"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("/nonexistent/model"));
}

/// Sampling: a seed gives the same tokens run after run, and the same on the cpu and graph backends (their
/// logits agree to ~1e-6); temperature 0 is the greedy run; out-of-range values are usage errors.
#[test]
fn run_samples_deterministically_for_a_seed_across_backends() {
    let run = |backend: &str, extra: &[&str]| -> Vec<u64> {
        let mut a = vec![
            "run",
            "--backend",
            backend,
            "--prompt",
            "Tell me a story.",
            "--max-tokens",
            "12",
            "--json",
        ];
        a.extend_from_slice(extra);
        let o = hexq(&a);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        v["generated_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect()
    };
    let s = [
        "--temperature",
        "0.9",
        "--top-k",
        "40",
        "--top-p",
        "0.95",
        "--min-p",
        "0.02",
        "--repeat-penalty",
        "1.1",
        "--seed",
        "11",
    ];
    let a = run("cpu", &s);
    assert_eq!(a, run("cpu", &s));
    assert_eq!(a, run("graph", &s));
    let greedy = run("cpu", &[]);
    assert_eq!(greedy, run("cpu", &["--temperature", "0", "--seed", "99"]));
    let other = run("cpu", &["--temperature", "0.9", "--seed", "12"]);
    assert!(
        a != greedy || other != greedy,
        "sampling at 0.9 never left the greedy path"
    );
    for bad in [
        ["--temperature=-1", ""],
        ["--top-p", "0"],
        ["--min-p", "2"],
        ["--repeat-penalty", "0"],
    ] {
        let mut a = vec!["run", "--prompt", "x", bad[0]];
        if !bad[1].is_empty() {
            a.push(bad[1]);
        }
        let o = hexq(&a);
        assert_eq!(o.status.code(), Some(2), "{bad:?}");
        assert!(
            String::from_utf8_lossy(&o.stderr).contains(bad[0].split('=').next().unwrap()),
            "{bad:?}"
        );
    }
}

/// `hexq chat` over stdin, three turns on the bundled model: turns 2 and 3 feed only their own tokens (the
/// model turn's close, the new user turn, the generation prompt — not the conversation again), and every
/// turn's reply equals a fresh greedy run over the whole transcript so far.
#[test]
fn chat_keeps_the_kv_cache_across_turns() {
    use std::io::Write;
    let mut c = Command::new(env!("CARGO_BIN_EXE_hexq"))
        .args(["chat", "--max-tokens", "5", "--json"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    c.stdin
        .take()
        .unwrap()
        .write_all(b"Hello there\nWhat is two plus two?\nThanks, bye\n")
        .unwrap();
    let o = c.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    let turns = v["turns"].as_array().unwrap();
    assert_eq!(turns.len(), 3);
    let ids = |t: &Value, k: &str| -> Vec<u32> {
        t[k].as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    let dir = fixture();
    let ck = std::sync::Arc::new(hexq_model::Checkpoint::open(&dir).unwrap());
    let tok = hexq_model::chat::Tokenizer::from_dir(&dir).unwrap();
    let mut cpu = hexq_runtime::CpuBackend::new(hexq_model::Model::load(ck).unwrap());
    let mut transcript: Vec<u32> = Vec::new();
    for (k, t) in turns.iter().enumerate() {
        let (fed, gen) = (ids(t, "fed_ids"), ids(t, "generated_ids"));
        if k > 0 {
            // The previous model turn's close, then the new user turn: nothing already in the cache.
            assert_eq!(fed[0], hexq_model::chat::STOP_IDS[0], "turn {k}: {fed:?}");
            let user = tok
                .encode(["", "What is two plus two?", "Thanks, bye"][k])
                .unwrap();
            assert!(
                fed.windows(user.len()).any(|w| w == user.as_slice()),
                "turn {k}"
            );
            assert!(fed.len() < 40, "turn {k} fed {} ids", fed.len());
        }
        transcript.extend(&fed);
        let (fresh, _, _, _) = hexq_runtime::generate_ids(&mut cpu, &transcript, 5).unwrap();
        let fresh: Vec<u32> = fresh
            .into_iter()
            .take_while(|i| !hexq_model::chat::STOP_IDS.contains(i))
            .collect();
        assert_eq!(fresh, gen, "turn {k}: a fresh run over the transcript");
        transcript.extend(&gen);
    }
}
