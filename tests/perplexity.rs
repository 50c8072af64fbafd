//! `hexq perplexity` against llama-perplexity on the trained Gemma-3 270M (issue 44): the same GGUF, the same
//! text, `-c 256`, 8 chunks. hexq's `llama` backend gives llama-perplexity's PPL and, against a base file
//! llama-perplexity wrote, its mean KLD and same-top; hexq's cpu float reference on the import gives the f32
//! GGUF's PPL; and llama-perplexity reads the base file hexq writes.

mod common;

use serde_json::Value;
use std::path::Path;
use std::process::Command;

/// The text: the held-out and calibration prompts' contents (hexq-authored, CC0), one after another.
fn text(dir: &Path) -> String {
    let mut s = Vec::new();
    for f in ["datasets/heldout.jsonl", "datasets/calibration.jsonl"] {
        for r in hexq_model::dataset::load_dataset(&common::root().join(f)).unwrap() {
            for m in r.messages.unwrap() {
                s.push(m.content);
            }
        }
    }
    let p = dir.join("text.txt");
    std::fs::write(&p, s.join("\n\n")).unwrap();
    p.display().to_string()
}

/// A number after `key` in llama-perplexity's output (stdout and stderr).
fn after(out: &str, key: &str) -> f64 {
    let i = out
        .rfind(key)
        .unwrap_or_else(|| panic!("no {key:?} in:\n{out}"))
        + key.len();
    out[i..]
        .trim_start_matches([' ', ':', '='])
        .split(|c: char| !(c.is_ascii_digit() || c == '.' || c == '-'))
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

fn llama_perplexity(build: &Path, args: &[&str], chunks: usize) -> String {
    let o = Command::new(build.join("bin/llama-perplexity"))
        .args(args)
        .args(["-c", "256", "--chunks", &chunks.to_string(), "-t", "2"])
        .output()
        .unwrap();
    let s = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(o.status.success(), "{s}");
    s
}

fn hexq_json(args: &[&str]) -> Value {
    let o = common::hexq_ok(args);
    serde_json::from_slice(&o.stdout).unwrap()
}

#[test]
fn perplexity_and_kld_equal_llama_perplexity_on_the_trained_model() {
    let Some(build) = common::llama_build() else {
        return;
    };
    if !build.join("bin/llama-perplexity").exists() {
        assert!(
            std::env::var("HEXQ_REQUIRE_JUDGES").is_err(),
            "llama-perplexity not built"
        );
        eprintln!("SKIP: llama-perplexity not built");
        return;
    }
    let Some((_, dir)) = common::trained_gemma3() else {
        return;
    };
    let t = tempfile::tempdir().unwrap();
    let p = |n: &str| t.path().join(n).display().to_string();
    let m = dir.to_str().unwrap();
    let txt = text(t.path());
    for (ty, out) in [("f32", "f32.gguf"), ("q4_0", "q4.gguf")] {
        common::hexq_ok(&[
            "gguf",
            "--model",
            m,
            "--type",
            ty,
            "--pure",
            "--out",
            &p(out),
        ]);
    }
    // PPL of the q4_0 file: llama-perplexity vs hexq's llama backend.
    let l = llama_perplexity(&build, &["-m", &p("q4.gguf"), "-f", &txt], 8);
    let want = after(&l, "Final estimate: PPL");
    let ours = |extra: &[&str]| {
        let mut a = vec!["perplexity", "--ctx", "256", "--json"];
        a.extend(extra);
        hexq_json(&a)
    };
    let h = ours(&[
        "--backend",
        "llama",
        "--gguf",
        &p("q4.gguf"),
        "--text",
        &txt,
        "--chunks",
        "8",
    ]);
    let got = h["ppl"].as_f64().unwrap();
    eprintln!("q4_0 PPL: llama-perplexity {want}, hexq --backend llama {got}");
    assert_eq!(h["count"], 8 * 127);
    // Measured: 28.7253 (printed to 4 places) vs 28.725315.
    assert!(((got - want) / want).abs() < 1e-5, "{got} vs {want}");
    // KLD against llama-perplexity's base of the f32 file.
    llama_perplexity(
        &build,
        &[
            "-m",
            &p("f32.gguf"),
            "-f",
            &txt,
            "--kl-divergence-base",
            &p("base.dat"),
        ],
        8,
    );
    let l = llama_perplexity(
        &build,
        &[
            "-m",
            &p("q4.gguf"),
            "--kl-divergence-base",
            &p("base.dat"),
            "--kl-divergence",
        ],
        8,
    );
    let (kld, top) = (after(&l, "Mean    KLD"), after(&l, "Same top p"));
    let h = ours(&[
        "--backend",
        "llama",
        "--gguf",
        &p("q4.gguf"),
        "--kl-base",
        &p("base.dat"),
    ]);
    let (hk, ht) = (
        h["kld_mean"].as_f64().unwrap(),
        h["same_top"].as_f64().unwrap(),
    );
    eprintln!(
        "q4_0 KLD: llama-perplexity {kld} same top {top} %, hexq {hk} / {:.3} %",
        100.0 * ht
    );
    // Measured: 0.434645 (6 places) vs 0.4346452; same top 70.768 % both.
    assert!(((hk - kld) / kld).abs() < 1e-5, "KLD {hk} vs {kld}");
    assert!((100.0 * ht - top).abs() < 0.01, "same top {ht} vs {top} %");
    // The float reference on the import against the f32 GGUF (the same weights, another engine), and the
    // base file hexq writes, which llama-perplexity reads.
    // 4 chunks: the reference runs one position at a time.
    let l = llama_perplexity(&build, &["-m", &p("f32.gguf"), "-f", &txt], 4);
    let want = after(&l, "Final estimate: PPL");
    let h = ours(&[
        "--chunks",
        "4",
        "--backend",
        "cpu",
        "--model",
        m,
        "--text",
        &txt,
        "--save-logits",
        &p("hexq-base.dat"),
    ]);
    let got = h["ppl"].as_f64().unwrap();
    eprintln!("f32 PPL: llama-perplexity {want}, hexq --backend cpu {got}");
    // Measured (8 chunks): 18.8485 vs 18.848898, 2e-5.
    assert!(((got - want) / want).abs() < 1e-4, "{got} vs {want}");
    let l = llama_perplexity(
        &build,
        &[
            "-m",
            &p("f32.gguf"),
            "--kl-divergence-base",
            &p("hexq-base.dat"),
            "--kl-divergence",
        ],
        4,
    );
    let self_kld = after(&l, "Mean    KLD");
    assert!(
        self_kld < 1e-3,
        "llama-perplexity reads hexq's base: KLD {self_kld} of f32 vs itself"
    );
}

/// On the bundled tiny model: the cpu reference and hexq's graph interpreter give the same PPL, the graph's
/// KLD against the cpu's base is 0, and the bad inputs are refused naming the file.
#[test]
fn backends_agree_and_bad_inputs_are_refused_on_the_tiny_model() {
    let t = tempfile::tempdir().unwrap();
    let p = |n: &str| t.path().join(n).display().to_string();
    let txt = text(t.path());
    let run = |extra: &[&str]| {
        let mut a = vec!["perplexity", "--ctx", "64", "--chunks", "3", "--json"];
        a.extend(extra);
        hexq_json(&a)
    };
    let cpu = run(&[
        "--backend",
        "cpu",
        "--text",
        &txt,
        "--save-logits",
        &p("base.dat"),
    ]);
    let graph = run(&["--backend", "graph", "--context", "64", "--text", &txt]);
    let (a, b) = (cpu["ppl"].as_f64().unwrap(), graph["ppl"].as_f64().unwrap());
    assert_eq!(cpu["count"], 3 * 31);
    assert!(((a - b) / a).abs() < 1e-4, "cpu {a} vs graph {b}");
    let k = run(&[
        "--backend",
        "graph",
        "--context",
        "64",
        "--kl-base",
        &p("base.dat"),
    ]);
    assert!(k["kld_mean"].as_f64().unwrap().abs() < 1e-4, "{k}");
    assert_eq!(k["same_top"], 1.0, "{k}");
    // A text shorter than two chunks, a file that is not a base, an existing --save-logits.
    std::fs::write(p("short.txt"), "the sea").unwrap();
    let e = common::hexq_err(&["perplexity", "--text", &p("short.txt"), "--ctx", "64"]);
    assert!(
        e.contains("short.txt") && e.contains("at least 128 tokens"),
        "{e}"
    );
    let e = common::hexq_err(&["perplexity", "--kl-base", &txt]);
    assert!(e.contains("text.txt") && e.contains("_logits_"), "{e}");
    let e = common::hexq_err(&[
        "perplexity",
        "--text",
        &txt,
        "--ctx",
        "64",
        "--save-logits",
        &p("base.dat"),
    ]);
    assert!(e.contains("already exists"), "{e}");
}
