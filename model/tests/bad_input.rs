//! Every bad-input case gets an error naming the file, tensor or config field — never a panic.

use hexq_model::chat::Tokenizer;
use hexq_model::weights::SafetensorsStore;
use hexq_model::{Checkpoint, Model};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny-gemma4")
}

/// A scratch copy of the fixture.
fn scratch() -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(fixture()).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), d.path().join(e.file_name())).unwrap();
    }
    d
}

type Entry = (String, String, Vec<usize>, Vec<u8>);

/// The fixture's tensors as (name, dtype, shape, bytes).
fn entries() -> Vec<Entry> {
    let st = SafetensorsStore::open_dir(&fixture()).unwrap();
    st.infos()
        .map(|i| {
            (
                i.name.clone(),
                i.dtype.name().to_string(),
                i.shape.clone(),
                st.bytes(i).to_vec(),
            )
        })
        .collect()
}

fn write_st(path: &Path, ents: &[Entry]) {
    let mut hdr = serde_json::Map::new();
    let mut off = 0;
    for (n, dt, sh, b) in ents {
        hdr.insert(
            n.clone(),
            json!({"dtype": dt, "shape": sh, "data_offsets": [off, off + b.len()]}),
        );
        off += b.len();
    }
    let h = serde_json::to_vec(&Value::Object(hdr)).unwrap();
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    for e in ents {
        out.extend(&e.3);
    }
    std::fs::write(path, out).unwrap();
}

fn err_of(dir: &Path) -> String {
    match Checkpoint::open(dir) {
        Ok(_) => panic!("expected an error for {}", dir.display()),
        Err(e) => e.to_string(),
    }
}

const Q: &str = "model.language_model.layers.2.self_attn.q_proj.weight";

#[test]
fn missing_tensor_names_file_and_tensor() {
    let d = scratch();
    let ents: Vec<Entry> = entries().into_iter().filter(|e| e.0 != Q).collect();
    write_st(&d.path().join("model.safetensors"), &ents);
    let e = err_of(d.path());
    assert!(
        e.contains("model.safetensors") && e.contains(Q) && e.contains("missing"),
        "{e}"
    );
}

#[test]
fn wrong_shape_names_tensor_and_both_shapes() {
    let d = scratch();
    let mut ents = entries();
    let q4 = "model.language_model.layers.4.self_attn.q_proj.weight"; // [128, 64]: full layer, head_dim 32
    let q = ents.iter_mut().find(|e| e.0 == q4).unwrap();
    q.2 = vec![q.2[1], q.2[0]];
    write_st(&d.path().join("model.safetensors"), &ents);
    let e = err_of(d.path());
    assert!(
        e.contains(q4)
            && e.contains("[64, 128]")
            && e.contains("[128, 64]")
            && e.contains("model.safetensors"),
        "{e}"
    );
}

#[test]
fn wrong_dtype_names_tensor() {
    let d = scratch();
    let mut ents = entries();
    ents.iter_mut().find(|e| e.0 == Q).unwrap().1 = "I32".into();
    write_st(&d.path().join("model.safetensors"), &ents);
    let e = err_of(d.path());
    assert!(
        e.contains(Q) && e.contains("I32") && e.contains("model.safetensors"),
        "{e}"
    );
}

#[test]
fn byte_count_disagreeing_with_shape_is_rejected() {
    let d = scratch();
    let mut ents = entries();
    ents.iter_mut().find(|e| e.0 == Q).unwrap().1 = "BF16".into(); // same bytes, half the element size
    write_st(&d.path().join("model.safetensors"), &ents);
    let e = err_of(d.path());
    assert!(e.contains(Q) && e.contains("data_offsets"), "{e}");
}

/// A safetensors file with the given data_offsets over the given data area (the header as written).
fn write_raw(path: &Path, ents: &[Entry], offs: &[(usize, usize)], data: &[u8]) {
    let mut hdr = serde_json::Map::new();
    for ((n, dt, sh, _), (a, b)) in ents.iter().zip(offs) {
        hdr.insert(
            n.clone(),
            json!({"dtype": dt, "shape": sh, "data_offsets": [a, b]}),
        );
    }
    let h = serde_json::to_vec(&Value::Object(hdr)).unwrap();
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    out.extend(data);
    std::fs::write(path, out).unwrap();
}

/// The format's rule (the `safetensors` crate refuses the rest): tensors tile the data area back to back.
#[test]
fn overlapping_gapped_and_out_of_range_offsets_are_refused() {
    let d = scratch();
    let p = d.path().join("model.safetensors");
    let ents = entries();
    let mut offs = Vec::new();
    let mut data = Vec::new();
    for e in &ents {
        offs.push((data.len(), data.len() + e.3.len()));
        data.extend(&e.3);
    }
    let k = ents.iter().position(|e| e.0 == Q).unwrap();
    assert!(k > 0);
    // Q's bytes start 8 bytes inside the tensor before it (the file keeps its length: 8 bytes at the end).
    let mut o = offs.clone();
    o[k] = (o[k].0 - 8, o[k].1 - 8);
    write_raw(&p, &ents, &o, &data);
    let e = err_of(d.path());
    assert!(
        e.contains("model.safetensors") && e.contains(Q) && e.contains("overlaps"),
        "{e}"
    );
    // 16 unused bytes before Q.
    let mut o = offs.clone();
    for x in &mut o[k..] {
        *x = (x.0 + 16, x.1 + 16);
    }
    let mut gd = data[..offs[k].0].to_vec();
    gd.extend([0u8; 16]);
    gd.extend(&data[offs[k].0..]);
    write_raw(&p, &ents, &o, &gd);
    let e = err_of(d.path());
    assert!(
        e.contains("model.safetensors") && e.contains(Q) && e.contains("gap"),
        "{e}"
    );
    // The last tensor reaching past the end of the file.
    let mut o = offs.clone();
    let last = o.len() - 1;
    o[last] = (o[last].0 + 64, o[last].1 + 64);
    write_raw(&p, &ents, &o, &data);
    let e = err_of(d.path());
    assert!(
        e.contains("model.safetensors") && e.contains("truncated"),
        "{e}"
    );
    // Bytes after the last tensor.
    let mut td = data.clone();
    td.extend([0u8; 16]);
    write_raw(&p, &ents, &offs, &td);
    let e = err_of(d.path());
    assert!(
        e.contains("model.safetensors") && e.contains("after the last tensor"),
        "{e}"
    );
    // And the file as written back to back loads.
    write_raw(&p, &ents, &offs, &data);
    Checkpoint::open(d.path()).unwrap();
}

/// Every safetensors file hexq writes is one the reference loader reads: the shared header writer, and the
/// synth checkpoint.
#[test]
fn hexq_safetensors_read_back_by_the_reference_crate() {
    let t = tempfile::tempdir().unwrap();
    let out = t.path().join("synth");
    let opt = hexq_model::synth::SynthOptions {
        max_shard_bytes: 1 << 20, // shards and an index, as at E2B
        ..Default::default()
    };
    let bar = indicatif::ProgressBar::hidden();
    hexq_model::synth::synth(&fixture().join("config.json"), &out, &opt, &bar).unwrap();
    let t = &out;
    let mut n = 0;
    for e in std::fs::read_dir(t).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "safetensors") {
            let b = std::fs::read(&p).unwrap();
            let st = safetensors::SafeTensors::deserialize(&b).unwrap();
            n += st.len();
        }
    }
    assert!(n > 10, "{n} tensors");
}

#[test]
fn truncated_file_names_file() {
    let d = scratch();
    let p = d.path().join("model.safetensors");
    let b = std::fs::read(&p).unwrap();
    std::fs::write(&p, &b[..b.len() - 1000]).unwrap();
    let e = err_of(d.path());
    assert!(
        e.contains("model.safetensors") && e.contains("truncated"),
        "{e}"
    );
    std::fs::write(&p, &b[..4]).unwrap();
    let e = err_of(d.path());
    assert!(
        e.contains("model.safetensors") && e.contains("truncated"),
        "{e}"
    );
}

#[test]
fn corrupt_header_names_file() {
    let d = scratch();
    let p = d.path().join("model.safetensors");
    let mut b = std::fs::read(&p).unwrap();
    b[8] = b'#';
    std::fs::write(&p, &b).unwrap();
    let e = err_of(d.path());
    assert!(
        e.contains("model.safetensors") && e.contains("corrupt header"),
        "{e}"
    );
    // A header length pointing past the end of the file.
    b[..8].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
    std::fs::write(&p, &b).unwrap();
    let e = err_of(d.path());
    assert!(
        e.contains("model.safetensors") && e.contains("header length"),
        "{e}"
    );
}

#[test]
fn no_weights_at_all() {
    let d = scratch();
    std::fs::remove_file(d.path().join("model.safetensors")).unwrap();
    let e = err_of(d.path());
    assert!(e.contains("no model.safetensors"), "{e}");
}

fn edit_config(d: &Path, f: impl FnOnce(&mut Value)) {
    let p = d.join("config.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&p, serde_json::to_string(&v).unwrap()).unwrap();
}

#[test]
fn config_errors_name_the_field() {
    let cases: Vec<(&str, Box<dyn Fn(&mut Value)>)> = vec![
        (
            "text_config.hidden_size",
            Box::new(|v| {
                v["text_config"]
                    .as_object_mut()
                    .unwrap()
                    .remove("hidden_size");
            }),
        ),
        (
            "text_config.enable_moe_block",
            Box::new(|v| v["text_config"]["enable_moe_block"] = true.into()),
        ),
        (
            "text_config.hidden_activation",
            Box::new(|v| v["text_config"]["hidden_activation"] = "relu".into()),
        ),
        (
            "text_config.use_bidirectional_attention",
            Box::new(|v| v["text_config"]["use_bidirectional_attention"] = "all".into()),
        ),
        (
            "text_config.layer_types",
            Box::new(|v| {
                v["text_config"]["layer_types"]
                    .as_array_mut()
                    .unwrap()
                    .pop();
            }),
        ),
        (
            "text_config.layer_types[1]",
            Box::new(|v| v["text_config"]["layer_types"][1] = "chunked_attention".into()),
        ),
        (
            "text_config.num_key_value_heads",
            Box::new(|v| v["text_config"]["num_key_value_heads"] = 3.into()),
        ),
        (
            "text_config.rope_parameters.full_attention.rope_type",
            Box::new(|v| {
                v["text_config"]["rope_parameters"]["full_attention"]["rope_type"] = "yarn".into()
            }),
        ),
        (
            "text_config.per_layer_config.4.head_dim",
            Box::new(|v| v["text_config"]["per_layer_config"]["4"]["head_dim"] = "big".into()),
        ),
        (
            "model_type",
            Box::new(|v| {
                v["model_type"] = "llama".into();
                v["text_config"]["model_type"] = "llama".into();
            }),
        ),
    ];
    for (field, f) in cases {
        let d = scratch();
        edit_config(d.path(), f);
        let e = err_of(d.path());
        assert!(
            e.contains("config.json") && e.contains(&format!("`{field}`")),
            "{field}: {e}"
        );
    }
    // A config whose shapes disagree with the weights: the tensor is named.
    let d = scratch();
    edit_config(d.path(), |v| {
        v["text_config"]["intermediate_size"] = 96.into()
    });
    let e = err_of(d.path());
    assert!(
        e.contains("mlp.gate_proj.weight") && e.contains("shape"),
        "{e}"
    );
    // Not JSON.
    let d = scratch();
    std::fs::write(d.path().join("config.json"), "{ nope").unwrap();
    let e = err_of(d.path());
    assert!(
        e.contains("config.json") && e.contains("invalid JSON"),
        "{e}"
    );
}

#[test]
fn sharded_checkpoint_loads_and_bad_index_is_named() {
    let d = scratch();
    std::fs::remove_file(d.path().join("model.safetensors")).unwrap();
    let ents = entries();
    let third = ents.len() / 3;
    let mut map = serde_json::Map::new();
    for (k, part) in [&ents[..third], &ents[third..2 * third], &ents[2 * third..]]
        .iter()
        .enumerate()
    {
        let name = format!("model-{:05}-of-00003.safetensors", k + 1);
        write_st(&d.path().join(&name), part);
        for e in part.iter() {
            map.insert(e.0.clone(), name.clone().into());
        }
    }
    let idx = d.path().join("model.safetensors.index.json");
    std::fs::write(
        &idx,
        serde_json::to_string(&json!({"metadata": {}, "weight_map": map})).unwrap(),
    )
    .unwrap();
    let ck = Checkpoint::open(d.path()).unwrap();
    assert_eq!(ck.store.files.len(), 3);
    // Same logits as the single-file fixture.
    let a = Model::load(Arc::new(ck)).unwrap();
    let b = Model::load(Arc::new(Checkpoint::open(&fixture()).unwrap())).unwrap();
    let ids = [2u32, 105, 2364, 107, 300, 301];
    let la: Vec<f32> = a
        .forward(&ids, &mut Default::default())
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    let lb: Vec<f32> = b
        .forward(&ids, &mut Default::default())
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    assert_eq!(la, lb);
    // Index naming a tensor its shard lacks.
    map.insert(
        "model.language_model.ghost.weight".into(),
        "model-00001-of-00003.safetensors".into(),
    );
    std::fs::write(
        &idx,
        serde_json::to_string(&json!({"weight_map": map})).unwrap(),
    )
    .unwrap();
    let e = err_of(d.path());
    assert!(
        e.contains("model.safetensors.index.json") && e.contains("ghost"),
        "{e}"
    );
    // Index naming a shard that does not exist.
    map.remove("model.language_model.ghost.weight");
    map.insert(Q.into(), "model-00009-of-00009.safetensors".into());
    std::fs::write(
        &idx,
        serde_json::to_string(&json!({"weight_map": map})).unwrap(),
    )
    .unwrap();
    let e = err_of(d.path());
    assert!(e.contains("model-00009-of-00009.safetensors"), "{e}");
}

#[test]
fn tokenizer_errors_name_the_file() {
    let d = scratch();
    std::fs::remove_file(d.path().join("tokenizer.json")).unwrap();
    let e = Tokenizer::from_dir(d.path()).err().unwrap().to_string();
    assert!(
        e.contains("tokenizer.json") && e.contains("not found"),
        "{e}"
    );
    std::fs::write(d.path().join("tokenizer.json"), "[]").unwrap();
    let e = Tokenizer::from_dir(d.path()).err().unwrap().to_string();
    assert!(e.contains("tokenizer.json"), "{e}");
}

#[test]
fn out_of_range_token_is_an_error() {
    let m = Model::load(Arc::new(Checkpoint::open(&fixture()).unwrap())).unwrap();
    let e = m
        .forward(&[2, 999_999], &mut Default::default())
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("999999") && e.contains("vocab_size"), "{e}");
}

#[test]
fn vision_and_audio_tensors_are_ignored() {
    let st = SafetensorsStore::open_dir(&fixture()).unwrap();
    assert!(
        st.names().any(|n| n.starts_with("model.vision_tower.")),
        "fixture carries a vision tower"
    );
    let ck = Checkpoint::open(&fixture()).unwrap();
    assert!(ck
        .tensors
        .iter()
        .all(|(_, i)| i.name.starts_with("model.language_model.")));
}
