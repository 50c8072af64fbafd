//! The reference forward against transformers (float32 goldens): Gemma-4 (5.23, scripts/make_fixture.py) and
//! Gemma-3 (5.24, scripts/make_fixture_gemma3.py).

use hexq_model::chat::{Message, Tokenizer};
use hexq_model::forward::{argmax, to_rows};
use hexq_model::weights::SafetensorsStore;
use hexq_model::{Checkpoint, KvCache, Model};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// (checkpoint, its goldens) for each architecture.
const FIXTURES: [(&str, &str); 2] = [("tiny-gemma4", "golden"), ("tiny-gemma3", "golden-gemma3")];

fn golden() -> (Value, SafetensorsStore) {
    golden_of("golden")
}

fn golden_of(dir: &str) -> (Value, SafetensorsStore) {
    let g: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join(dir).join("golden.json")).unwrap(),
    )
    .unwrap();
    let st =
        SafetensorsStore::open_files(&[fixtures().join(dir).join("golden.safetensors")]).unwrap();
    (g, st)
}

fn load(dir: &str) -> Model {
    Model::load(Arc::new(Checkpoint::open(&fixtures().join(dir)).unwrap())).unwrap()
}

fn ids_of(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// max |a-b| / max |b| over a flat pair.
fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let d = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    let m = b.iter().map(|y| y.abs()).fold(0f32, f32::max);
    d / m
}

fn greedy(m: &Model, ids: &[u32], n: usize, cached: bool) -> Vec<u32> {
    let mut out = Vec::new();
    if cached {
        let mut cache = KvCache::new(m.cfg.num_layers);
        let l = to_rows(&m.forward(ids, &mut cache).unwrap()).unwrap();
        let mut next = argmax(l.last().unwrap());
        out.push(next);
        while out.len() < n {
            let l = to_rows(&m.forward(&[next], &mut cache).unwrap()).unwrap();
            next = argmax(&l[0]);
            out.push(next);
        }
    } else {
        let mut all = ids.to_vec();
        while out.len() < n {
            let mut cache = KvCache::new(m.cfg.num_layers);
            let l = to_rows(&m.forward(&all, &mut cache).unwrap()).unwrap();
            let next = argmax(l.last().unwrap());
            out.push(next);
            all.push(next);
        }
    }
    out
}

#[test]
fn logits_and_every_hidden_state_match_transformers() {
    for (fx, gd) in FIXTURES {
        let (g, st) = golden_of(gd);
        let m = load(fx);
        for (name, s) in g["sequences"].as_object().unwrap() {
            check_sequence(&m, &st, name, s, fx);
        }
    }
}

/// Logits and every hidden state of one golden sequence within 1e-4 relative.
fn check_sequence(m: &Model, st: &SafetensorsStore, name: &str, s: &Value, fx: &str) {
    {
        let ids = ids_of(&s["ids"]);
        let mut cache = KvCache::new(m.cfg.num_layers);
        let (logits, trace) = m.forward_traced(&ids, &mut cache).unwrap();
        let gl = st.to_f32(st.get(&format!("{name}.logits")).unwrap());
        let ours: Vec<f32> = logits.flatten_all().unwrap().to_vec1().unwrap();
        let e = rel_err(&ours, &gl);
        assert!(e <= 1e-4, "{fx} {name}: logits rel err {e}");
        let gh = st.get(&format!("{name}.hidden")).unwrap();
        let gh_v = st.to_f32(gh);
        assert_eq!(gh.shape[0], trace.len(), "{name}: number of hidden states");
        let per = gh.shape[1] * gh.shape[2];
        for (i, t) in trace.iter().enumerate() {
            let ours: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
            let e = rel_err(&ours, &gh_v[i * per..(i + 1) * per]);
            assert!(e <= 1e-4, "{fx} {name}: hidden state {i} rel err {e}");
        }
    }
}

#[test]
fn greedy_matches_transformers_cached_and_uncached() {
    for (fx, gd) in FIXTURES {
        let (g, _) = golden_of(gd);
        let m = load(fx);
        for (name, s) in g["sequences"].as_object().unwrap() {
            let ids = ids_of(&s["ids"]);
            let want = ids_of(&s["greedy8"]);
            assert_eq!(
                greedy(&m, &ids, 8, true),
                want,
                "{fx} {name}: cached greedy"
            );
            assert_eq!(
                greedy(&m, &ids, 8, false),
                want,
                "{fx} {name}: uncached greedy"
            );
        }
    }
}

#[test]
fn cached_decode_equals_uncached_at_every_position_past_the_window() {
    // Feed the 40-token sequence one token at a time (window is 16): each step's logits equal the
    // full-sequence forward's row at that position.
    let (g, _) = golden();
    let m = load("tiny-gemma4");
    let ids = ids_of(&g["sequences"]["long"]["ids"]);
    assert!(ids.len() > m.cfg.sliding_window);
    let mut c = KvCache::new(m.cfg.num_layers);
    let full = to_rows(&m.forward(&ids, &mut c).unwrap()).unwrap();
    let mut c = KvCache::new(m.cfg.num_layers);
    for (p, &id) in ids.iter().enumerate() {
        let step = to_rows(&m.forward(&[id], &mut c).unwrap()).unwrap();
        let e = rel_err(&step[0], &full[p]);
        assert!(e <= 1e-5, "position {p}: rel err {e}");
    }
}

#[test]
fn bf16_checkpoint_loads_and_tracks_float() {
    // transformers re-saved the same weights as bf16. (1) hexq reads bf16 exactly: it equals transformers
    // running those bf16 weights upcast to f32 (1e-4). (2) Against the f32 model the only error is weight
    // rounding (2^-9 relative per weight), amplified by 10 random layers: measured 5.6e-2 ("short") and
    // 1.04e-1 ("long") of max|logit|; bound 1.5e-1, and >= 80 % next-token top-1 agreement.
    let (g, st) = golden();
    let m = load("tiny-gemma4-bf16");
    for (name, s) in g["sequences"].as_object().unwrap() {
        let ids = ids_of(&s["ids"]);
        let mut cache = KvCache::new(m.cfg.num_layers);
        let ours = to_rows(&m.forward(&ids, &mut cache).unwrap()).unwrap();
        let flat: Vec<f32> = ours.concat();
        let exact = st.to_f32(st.get(&format!("{name}.logits_bf16_weights")).unwrap());
        let e = rel_err(&flat, &exact);
        assert!(
            e <= 1e-4,
            "{name}: bf16 weights vs transformers on the same bf16 weights: rel err {e}"
        );
        let gl = st.to_f32(st.get(&format!("{name}.logits")).unwrap());
        let e = rel_err(&flat, &gl);
        assert!(e <= 1.5e-1, "{name}: bf16 vs f32 logits rel err {e}");
        let v = m.cfg.vocab_size;
        let agree = ours
            .iter()
            .enumerate()
            .filter(|(p, r)| argmax(r) == argmax(&gl[p * v..(p + 1) * v]))
            .count();
        assert!(
            agree * 10 >= ours.len() * 8,
            "{name}: bf16 top-1 agreement {agree}/{}",
            ours.len()
        );
    }
}

#[test]
fn config_derivation_matches_transformers() {
    let (g, _) = golden();
    let ck = Checkpoint::open(&fixtures().join("tiny-gemma4")).unwrap();
    let modes: Vec<Value> = ck
        .config
        .layers
        .iter()
        .map(|l| match l.kv_mode {
            hexq_model::KvMode::Own => Value::Null,
            hexq_model::KvMode::Store => "store".into(),
            hexq_model::KvMode::Reuse => "reuse".into(),
        })
        .collect();
    assert_eq!(Value::Array(modes), g["kv_sharing_modes"]);
    let hd: Vec<Value> = ck
        .config
        .layers
        .iter()
        .map(|l| (l.head_dim as u64).into())
        .collect();
    assert_eq!(Value::Array(hd), g["head_dims"]);
    let lt: Vec<Value> = ck
        .config
        .layers
        .iter()
        .map(|l| l.kind.name().into())
        .collect();
    assert_eq!(Value::Array(lt), g["layer_types"]);
    // Reuse layers read the last owner of their own type; double-wide MLP only there.
    for l in &ck.config.layers {
        if l.kv_mode == hexq_model::KvMode::Reuse {
            let src = &ck.config.layers[l.kv_source];
            assert_eq!(src.kind, l.kind);
            assert_eq!(src.kv_mode, hexq_model::KvMode::Store);
            assert_eq!(l.mlp_width, 2 * ck.config.intermediate_size);
        } else {
            assert_eq!(l.mlp_width, ck.config.intermediate_size);
        }
    }
}

#[test]
fn chat_template_is_byte_exact_with_transformers() {
    let (g, _) = golden();
    let tok = Tokenizer::from_dir(&fixtures().join("tiny-gemma4")).unwrap();
    for (name, c) in g["chat"].as_object().unwrap() {
        let msgs: Vec<Message> = serde_json::from_value(c["messages"].clone()).unwrap();
        assert_eq!(
            tok.render_chat(&msgs, true).unwrap(),
            c["text"].as_str().unwrap(),
            "{name}: rendered text"
        );
        assert_eq!(
            tok.encode_chat(&msgs).unwrap(),
            ids_of(&c["ids"]),
            "{name}: ids"
        );
    }
    // The contract of the published builds.
    let p = tok.encode("Hi there").unwrap();
    let mut want = vec![2, 105, 2364, 107];
    want.extend(&p);
    want.extend([106, 107, 105, 4368, 107]);
    assert_eq!(tok.encode_prompt("Hi there").unwrap(), want);
}
