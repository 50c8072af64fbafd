//! Deployable graphs (decode_wgqa, decode_full, trunk) driven by the host loop against the reference forward.

use hexq_graph::ir::{Builder, DType, InitSource, Op};
use hexq_graph::{build, GraphOptions, Variant};
use hexq_model::forward::{argmax, to_rows};
use hexq_model::{Checkpoint, KvCache, Model, ModelConfig};
use hexq_runtime::graph::GraphBackend;
use hexq_runtime::Backend;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn ckpt() -> Arc<Checkpoint> {
    Arc::new(Checkpoint::open(&fixtures().join("tiny-gemma4")).unwrap())
}

fn golden() -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixtures().join("golden/golden.json")).unwrap())
        .unwrap()
}

fn ids_of(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    let d = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    d / b.iter().map(|y| y.abs()).fold(0f32, f32::max)
}

fn backend(ck: &Arc<Checkpoint>, decode: Variant, trunk: bool, o: GraphOptions) -> GraphBackend {
    GraphBackend::for_model(ck, decode, trunk, &o).unwrap()
}

/// Reference logits at every position of `ids`.
fn reference(ck: &Arc<Checkpoint>, ids: &[u32]) -> Vec<Vec<f32>> {
    let m = Model::load(ck.clone()).unwrap();
    to_rows(&m.forward(ids, &mut KvCache::new(m.cfg.num_layers)).unwrap()).unwrap()
}

fn check_positions(b: &mut GraphBackend, ck: &Arc<Checkpoint>, ids: &[u32], what: &str) {
    let want = reference(ck, ids);
    b.reset();
    let hid = b.hidden(ids).unwrap();
    assert_eq!(hid.len(), ids.len());
    for (p, h) in hid.iter().enumerate() {
        let e = rel_err(&b.logits(h).unwrap(), &want[p]);
        assert!(e <= 1e-4, "{what}: position {p}: rel err {e}");
    }
}

#[test]
fn decode_wgqa_matches_reference_at_every_position_through_the_ring_wrap() {
    let ck = ckpt();
    let g = golden();
    let o = GraphOptions {
        context: 256,
        seq: 128,
    };
    let mut b = backend(&ck, Variant::DecodeWgqa, false, o);
    // 40 tokens: the 16-entry sliding rings wrap twice.
    let long = ids_of(&g["sequences"]["long"]["ids"]);
    assert!(long.len() > 2 * ck.config.sliding_window);
    check_positions(&mut b, &ck, &long, "decode_wgqa long");
    // Greedy continuations equal transformers' (prompt + 8 > window for "chat" too).
    for (name, s) in g["sequences"].as_object().unwrap() {
        let (got, _, _, _) = hexq_runtime::generate_ids(&mut b, &ids_of(&s["ids"]), 8).unwrap();
        assert_eq!(got, ids_of(&s["greedy8"]), "{name}");
    }
}

#[test]
fn decode_full_matches_reference() {
    let ck = ckpt();
    let o = GraphOptions {
        context: 64,
        seq: 128,
    };
    let mut b = backend(&ck, Variant::DecodeFull, false, o);
    let long = ids_of(&golden()["sequences"]["long"]["ids"]);
    check_positions(&mut b, &ck, &long, "decode_full");
}

#[test]
fn trunk_chunks_then_decode_match_reference_past_seq_128() {
    let ck = ckpt();
    let o = GraphOptions {
        context: 512,
        seq: 128,
    };
    let mut b = backend(&ck, Variant::DecodeWgqa, true, o);
    // 300-token prompt: chunks of 128, 128, 44, then decode steps.
    let mut ids = vec![2u32];
    ids.extend((0..299).map(|i| 300 + (i * 37 % 4000) as u32));
    let want = reference(&ck, &ids);
    b.reset();
    let hid = b.hidden(&ids[..280]).unwrap();
    for p in 280..ids.len() {
        let h = b.step(ids[p]).unwrap();
        let e = rel_err(&b.logits(&h).unwrap(), &want[p]);
        assert!(e <= 1e-4, "decode after trunk, position {p}: rel err {e}");
    }
    for (p, h) in hid.iter().enumerate() {
        let e = rel_err(&b.logits(h).unwrap(), &want[p]);
        assert!(e <= 1e-4, "trunk position {p}: rel err {e}");
    }
    // A single short chat prompt through trunk + decode gives transformers' greedy tokens.
    let g = golden();
    let s = &g["sequences"]["chat"];
    let (got, _, _, _) = hexq_runtime::generate_ids(&mut b, &ids_of(&s["ids"]), 8).unwrap();
    assert_eq!(got, ids_of(&s["greedy8"]));
    let _ = argmax(&[0.0]);
}

#[test]
fn broadcast_gqa_has_no_expand_and_the_baseline_does() {
    let cfg = ckpt().config.clone();
    let o = GraphOptions::default();
    let w = build(&cfg, Variant::DecodeWgqa, &o);
    let f = build(&cfg, Variant::DecodeFull, &o);
    let t = build(&cfg, Variant::Trunk, &o);
    assert_eq!(w.count("Expand"), 0);
    assert_eq!(t.count("Expand"), 0);
    assert!(f.count("Expand") > 0);
    for g in [&w, &f, &t] {
        g.validate().unwrap();
        // No vocab-sized tensor anywhere in a graph.
        for (n, ty) in &g.types {
            assert!(
                !ty.shape.contains(&cfg.vocab_size),
                "{}: {n} has a vocab-sized dim {:?}",
                g.name,
                ty.shape
            );
        }
        // Index inputs are int32.
        for vi in &g.inputs {
            if vi.name.contains("position") || vi.name == "valid_len" {
                assert_eq!(vi.ty.dtype, DType::I32);
            }
        }
        // The finite mask constant, never -inf / f32::MIN.
        for i in &g.initializers {
            if let InitSource::F32(v) = &i.source {
                assert!(
                    v.iter().all(|x| x.is_finite() && *x >= -1e4),
                    "{}: {}",
                    g.name,
                    i.name
                );
            }
        }
    }
}

#[test]
fn e2b_graphs_build_from_the_config_alone() {
    // No checkpoint at all: weights are references, so building allocates no weight memory.
    let cfg = ModelConfig::from_file(&fixtures().join("e2b-config.json")).unwrap();
    let o = GraphOptions::default();
    for v in [Variant::DecodeWgqa, Variant::DecodeFull, Variant::Trunk] {
        let g = build(&cfg, v, &o);
        g.validate().unwrap();
        let const_bytes: usize = g
            .initializers
            .iter()
            .filter(|i| !matches!(i.source, InitSource::Weight { .. }))
            .map(|i| i.ty.bytes())
            .sum();
        let weight_bytes: usize = g
            .initializers
            .iter()
            .filter(|i| matches!(i.source, InitSource::Weight { .. }))
            .map(|i| i.ty.numel() * 2)
            .sum();
        // Only the RoPE tables (4096 positions × (256 + 512) × cos/sin) and scalars are materialised.
        assert!(
            const_bytes < 30 << 20,
            "{}: {const_bytes} bytes of constants",
            g.name
        );
        assert!(
            weight_bytes > 3 << 30,
            "{}: decoder weights are referenced ({weight_bytes} bf16 bytes)",
            g.name
        );
        if v != Variant::DecodeFull {
            assert_eq!(g.count("Expand"), 0);
        }
    }
}

#[test]
fn validator_names_the_node() {
    let mk = || {
        let mut b = Builder::new("t");
        let x = b.input("x", DType::F32, &[2, 3], "");
        let y = b.node(Op::Tanh, &[&x], "y");
        b.output(&y, "");
        b.finish()
    };
    assert!(mk().validate().is_ok());
    let mut g = mk();
    g.nodes[0].inputs[0] = "nope".into();
    let e = g.validate().unwrap_err();
    assert!(
        e.node == "y" && e.msg.contains("\"nope\" is not defined"),
        "{e}"
    );
    // Shape mismatch: an Add of [2,3] and [4].
    let mut g = mk();
    g.types.insert(
        "c".into(),
        hexq_graph::ir::TensorType::new(DType::F32, &[4]),
    );
    g.initializers.push(hexq_graph::ir::Initializer {
        name: "c".into(),
        ty: hexq_graph::ir::TensorType::new(DType::F32, &[4]),
        source: InitSource::F32(vec![0.0; 4]),
    });
    g.nodes.push(hexq_graph::ir::Node {
        name: "z".into(),
        op: Op::Add,
        inputs: vec!["y".into(), "c".into()],
        outputs: vec!["z".into()],
    });
    let e = g.validate().unwrap_err();
    assert!(e.node == "z" && e.msg.contains("do not broadcast"), "{e}");
    // Cycle / out of order: a node reading an output produced after it.
    let mut g = mk();
    g.nodes.insert(
        0,
        hexq_graph::ir::Node {
            name: "w".into(),
            op: Op::Neg,
            inputs: vec!["y".into()],
            outputs: vec!["w".into()],
        },
    );
    let e = g.validate().unwrap_err();
    assert!(e.node == "w" && e.msg.contains("produced later"), "{e}");
    // Recorded type disagreeing with inference.
    let mut g = mk();
    g.types.insert(
        "y".into(),
        hexq_graph::ir::TensorType::new(DType::F32, &[3, 2]),
    );
    let e = g.validate().unwrap_err();
    assert!(e.node == "y" && e.msg.contains("inferred"), "{e}");
    // Output never produced.
    let mut g = mk();
    g.outputs[0].name = "ghost".into();
    let e = g.validate().unwrap_err();
    assert!(e.node == "ghost", "{e}");
    // Duplicate node.
    let mut g = mk();
    let n = g.nodes[0].clone();
    g.nodes.push(n);
    assert!(g.validate().unwrap_err().msg.contains("duplicate"));
}

#[test]
fn backend_trait_generation_equals_cpu_backend() {
    let ck = ckpt();
    let o = GraphOptions {
        context: 128,
        seq: 32,
    };
    let mut gb = backend(&ck, Variant::DecodeWgqa, true, o);
    let mut cpu = hexq_runtime::CpuBackend::new(Model::load(ck.clone()).unwrap());
    let tok = hexq_model::chat::Tokenizer::from_dir(&fixtures().join("tiny-gemma4")).unwrap();
    let msgs = [hexq_model::chat::Message::user(
        "Write a short poem about the sea.",
    )];
    let a = hexq_runtime::generate(&mut gb, &tok, &msgs, 24).unwrap();
    let b = hexq_runtime::generate(&mut cpu, &tok, &msgs, 24).unwrap();
    assert_eq!(a.generated_ids, b.generated_ids);
}

#[test]
fn io_contract_doc_is_generated_from_the_graphs() {
    let cfg = ModelConfig::from_file(&fixtures().join("e2b-config.json")).unwrap();
    let doc =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/io-contract.md"))
            .unwrap();
    for v in [Variant::DecodeWgqa, Variant::DecodeFull, Variant::Trunk] {
        let md =
            hexq_graph::report::io_contract_markdown(&build(&cfg, v, &GraphOptions::default()));
        assert!(
            doc.contains(&md),
            "docs/io-contract.md is stale for {}: regenerate with hexq graph --io-contract",
            v.name()
        );
    }
}

#[test]
fn cli_graph_summary_and_run_backend_graph() {
    let exe = env!("CARGO_BIN_EXE_hexq");
    let cfg = fixtures().join("e2b-config.json");
    let o = std::process::Command::new(exe)
        .args([
            "graph",
            "--model",
            cfg.to_str().unwrap(),
            "--variant",
            "decode-wgqa",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let s: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(s["expand_nodes"], 0);
    // 12 sliding rings of 512×256 + 3 full buffers of 4096×512, K and V: 62.9 MB in f32.
    assert_eq!(
        s["kv_read_per_call"]["bytes_f32"],
        2 * (12 * 512 * 256 + 3 * 4096 * 512) * 4
    );
    let g = golden();
    let fx = fixtures().join("tiny-gemma4");
    let o = std::process::Command::new(exe)
        .args([
            "run",
            "--backend",
            "graph",
            "--model",
            fx.to_str().unwrap(),
            "--prompt",
            "What is the capital of France?",
            "--max-tokens",
            "8",
            "--context",
            "256",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["generated_ids"], g["sequences"]["chat"]["greedy8"]);
    assert_eq!(v["backend"], "graph");
}

/// Gemma-3 (no v_norm, 1 + w norms, query_pre_attn_scalar, linear RoPE, a sliding last layer): decode_wgqa
/// through the ring wrap, decode_full, and trunk chunks then decode, each against the reference at every
/// position; greedy equal to transformers'.
#[test]
fn gemma3_graphs_match_reference() {
    let ck = Arc::new(Checkpoint::open(&fixtures().join("tiny-gemma3")).unwrap());
    let g: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("golden-gemma3/golden.json")).unwrap(),
    )
    .unwrap();
    let o = GraphOptions {
        context: 64,
        seq: 16,
    };
    let long = ids_of(&g["sequences"]["long"]["ids"]);
    let mut b = backend(&ck, Variant::DecodeWgqa, false, o);
    check_positions(&mut b, &ck, &long, "gemma3 decode_wgqa long");
    for (name, s) in g["sequences"].as_object().unwrap() {
        let (got, _, _, _) = hexq_runtime::generate_ids(&mut b, &ids_of(&s["ids"]), 8).unwrap();
        assert_eq!(got, ids_of(&s["greedy8"]), "gemma3 {name}");
    }
    let mut b = backend(&ck, Variant::DecodeFull, false, o);
    check_positions(&mut b, &ck, &long, "gemma3 decode_full");
    // Trunk of 16 over a 40-token prompt: chunks 16 + 16 + 8.
    let mut b = backend(&ck, Variant::DecodeWgqa, true, o);
    check_positions(&mut b, &ck, &long, "gemma3 trunk");
}

/// Position 0 on the host (`hexq_model::prefix`): with the BOS K/V written into ring slot 0 and its hidden
/// state taken from the f32 reference, every position equals a run that sends BOS through the graph — decode
/// and trunk, Gemma-4 (KV sharing, PLE) and Gemma-3 — so the graphs, calibration and exports may start at 1.
#[test]
fn bos_prefix_equals_running_bos_through_the_graph() {
    for (fixture, ids) in [
        ("tiny-gemma4", ids_of(&golden()["sequences"]["long"]["ids"])),
        (
            "tiny-gemma3",
            ids_of(
                &serde_json::from_str::<Value>(
                    &std::fs::read_to_string(fixtures().join("golden-gemma3/golden.json")).unwrap(),
                )
                .unwrap()["sequences"]["long"]["ids"],
            ),
        ),
    ] {
        let ck = Arc::new(Checkpoint::open(&fixtures().join(fixture)).unwrap());
        assert_eq!(
            ids[0], ck.config.bos_token_id,
            "{fixture}: sequences start with BOS"
        );
        let o = GraphOptions {
            context: 64,
            seq: 16,
        };
        for trunk in [false, true] {
            let mut with = backend(&ck, Variant::DecodeWgqa, trunk, o);
            let mut without = backend(&ck, Variant::DecodeWgqa, trunk, o);
            without.prefix = None;
            let (a, b) = (with.hidden(&ids).unwrap(), without.hidden(&ids).unwrap());
            assert_eq!(with.pos, ids.len());
            for (p, (x, y)) in a.iter().zip(&b).enumerate() {
                let e = rel_err(x, y);
                assert!(
                    e <= 1e-5,
                    "{fixture} trunk={trunk} position {p}: rel err {e}"
                );
            }
        }
    }
}
