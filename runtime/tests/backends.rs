//! The runtime on its own, so it can be checked on another architecture (scripts/aarch64.sh runs this file
//! under qemu-aarch64): the chat template's ids and greedy generation against transformers' goldens, the
//! graph backend against the cpu reference, the seeded sampler's stream (the same ids on every platform),
//! and — given an export directory in HEXQ_TEST_EXPORT and onnxruntime in ORT_DYLIB_PATH — the ort backend.

use hexq_model::chat::{Message, Tokenizer};
use hexq_model::{Checkpoint, Model};
use hexq_runtime::sample::{Sampler, Sampling};
use hexq_runtime::{generate_ids, Backend, CpuBackend};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

fn golden() -> Value {
    serde_json::from_slice(&std::fs::read(fixtures().join("golden/golden.json")).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn tiny() -> Arc<Checkpoint> {
    Arc::new(Checkpoint::open(&fixtures().join("tiny-gemma4")).unwrap())
}

/// Greedy ids up to 8 tokens (generation stops at 106/1; the golden runs on).
fn greedy8(b: &mut dyn Backend, prompt: &[u32]) -> Vec<u32> {
    generate_ids(b, prompt, 8).unwrap().0
}

#[test]
fn chat_template_ids_equal_transformers() {
    let tok = Tokenizer::from_dir(&fixtures().join("tiny-gemma4")).unwrap();
    for (name, c) in golden()["chat"].as_object().unwrap() {
        let msgs: Vec<Message> = serde_json::from_value(c["messages"].clone()).unwrap();
        assert_eq!(tok.encode_chat(&msgs).unwrap(), ids(&c["ids"]), "{name}");
    }
}

#[test]
fn cpu_and_graph_greedy_equal_transformers() {
    let ck = tiny();
    let mut cpu = CpuBackend::new(Model::load(ck.clone()).unwrap());
    let o = hexq_graph::GraphOptions {
        context: 256,
        seq: 16,
    };
    let mut graph = hexq_runtime::graph::GraphBackend::for_model(
        &ck,
        hexq_graph::Variant::DecodeWgqa,
        true,
        &o,
    )
    .unwrap();
    for (name, s) in golden()["sequences"].as_object().unwrap() {
        let want = ids(&s["greedy8"]);
        let got = greedy8(&mut cpu, &ids(&s["ids"]));
        assert_eq!(got, want[..got.len()], "cpu {name}");
        assert_eq!(greedy8(&mut graph, &ids(&s["ids"])), got, "graph {name}");
    }
}

/// A seeded draw from fixed logits: the stream recorded on x86-64 must come out the same on any platform
/// (splitmix64 draws; the f32 arithmetic is IEEE, and the margins here are far from any rounding tie).
#[test]
fn seeded_sampler_stream_is_the_same_everywhere() {
    let logits: Vec<f32> = (0..512)
        .map(|i| ((i * 37 % 101) as f32 / 10.0).sin() * 4.0)
        .collect();
    let cfg = Sampling {
        temperature: 0.9,
        top_k: 40,
        top_p: 0.95,
        min_p: 0.02,
        repeat_penalty: 1.1,
        seed: 42,
        ..Default::default()
    };
    let mut s = Sampler::new(cfg);
    let mut hist = vec![1u32, 2, 3];
    let mut out = Vec::new();
    for _ in 0..16 {
        let t = s.next(&logits, &hist);
        hist.push(t);
        out.push(t);
    }
    assert_eq!(out, RECORDED, "{out:?}");
}

const RECORDED: [u32; 16] = [
    226, 54, 185, 488, 126, 287, 84, 85, 257, 428, 458, 24, 125, 327, 388, 286,
];

#[test]
fn ort_backend_equals_cpu_on_an_export() {
    let dir = std::env::var_os("HEXQ_TEST_EXPORT");
    let (Some(dir), true) = (dir, std::env::var_os("ORT_DYLIB_PATH").is_some()) else {
        assert!(
            std::env::var_os("HEXQ_REQUIRE_ORT_EXPORT").is_none(),
            "HEXQ_TEST_EXPORT and ORT_DYLIB_PATH required"
        );
        eprintln!(
            "SKIP: set HEXQ_TEST_EXPORT (a `hexq export` dir of the tiny model) and ORT_DYLIB_PATH"
        );
        return;
    };
    let mut ort =
        hexq_runtime::ort::OrtBackend::open(&[PathBuf::from(dir)], 0, hexq_runtime::ort::Ep::Cpu)
            .unwrap();
    let mut cpu = CpuBackend::new(Model::load(tiny()).unwrap());
    for (name, s) in golden()["sequences"].as_object().unwrap() {
        let p = ids(&s["ids"]);
        if ort.capacity().is_some_and(|c| p.len() + 8 > c) {
            continue;
        }
        assert_eq!(greedy8(&mut ort, &p), greedy8(&mut cpu, &p), "ort {name}");
    }
}
