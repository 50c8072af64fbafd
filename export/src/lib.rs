//! hexq-export: the artifacts a compiler or a runtime takes — ONNX graphs from the graph IR with weights as
//! external data (float, or QDQ from encodings), the encodings beside them, the vocab-sized tensors as host
//! files, the I/O contract, and a manifest hashing every file. GGUF lives in [`gguf`].
//!
//! One entry point: [`export`] writes everything for one variant into a (staging) directory.
//!
//! May import: model, graph, quantize (encodings), gguf, fsutil; never compile or eval.

pub mod gguf;
pub mod host;
pub mod onnx;
pub mod onnx_proto;
mod qdq;

use hexq_graph::{build, Graph, GraphOptions, Variant};
use hexq_model::{Checkpoint, Error, Result};
use hexq_quantize::Encodings;
use serde::Serialize;
use serde_json::json;
use std::collections::HashSet;
use std::path::Path;

pub struct Options<'a> {
    pub variant: Variant,
    pub graph: GraphOptions,
    pub encodings: Option<(&'a Path, Encodings)>,
    /// Write the QDQ graph (needs encodings).
    pub qdq: bool,
    pub weights: onnx::WeightType,
    /// host-model/ storage; None skips it.
    pub host: Option<host::HostDType>,
    pub progress: Option<&'a (dyn Fn(u64) + Sync)>,
    /// A calibration graph for onnxruntime: these params fake-quantized, every float tensor an output
    /// (see [`onnx::ExportOptions::calibration`]).
    pub calibration: Option<&'a std::collections::BTreeMap<String, Vec<hexq_quantize::Encoding>>>,
}

fn is_kv(n: &str) -> bool {
    ["past_key_", "past_value_", "present_key_", "present_value_"]
        .iter()
        .any(|p| n.starts_with(p))
}

/// Encodings must fit the graph: every name a tensor of it (of the right kind), every float tensor
/// covered, bitwidths AIMET/QNN accept, one scale per output channel, finite positive scales, and the KV
/// width the variant promises. With `partial` (verify's per-class studies) uncovered tensors are allowed and
/// counted instead: Ok(number of float tensors left without an encoding).
pub fn check_encodings(
    g: &Graph,
    e: &Encodings,
    int8kv: bool,
    file: &Path,
    partial: bool,
) -> Result<usize> {
    let bad = |m: String| Err(Error::file(file, m));
    let mut uncovered = 0;
    if let Some(h) = e.hexq.get("graph_sha256").and_then(|v| v.as_str()) {
        if h != g.content_hash() {
            return bad(format!(
                "encodings were computed for graph {} ({}), not this {} graph (check --context/--seq and the variant)",
                &h[..h.len().min(12)],
                e.hexq.get("graph").and_then(|v| v.as_str()).unwrap_or("?"),
                g.name
            ));
        }
    }
    let acts: HashSet<&str> = g
        .inputs
        .iter()
        .map(|v| v.name.as_str())
        .chain(g.nodes.iter().map(|n| n.outputs[0].as_str()))
        .filter(|n| g.types[*n].dtype.is_float())
        .collect();
    let params: HashSet<&str> = g
        .initializers
        .iter()
        .filter(|i| i.ty.dtype.is_float())
        .map(|i| i.name.as_str())
        .collect();
    for (kind, map, names, ok_bw) in [
        (
            "activation",
            &e.activation_encodings,
            &acts,
            &[8u32, 16][..],
        ),
        ("param", &e.param_encodings, &params, &[4u32, 8, 16][..]),
    ] {
        for (n, v) in map {
            if !names.contains(n.as_str()) {
                return bad(format!(
                    "{kind} encoding for {n:?}: the {} graph has no such {kind} tensor",
                    g.name
                ));
            }
            if v.is_empty() {
                return bad(format!("{kind} encoding for {n:?} is empty"));
            }
            for x in v {
                if !ok_bw.contains(&x.bitwidth) {
                    return bad(format!(
                        "{kind} encoding for {n:?}: bitwidth {} (QNN takes {:?})",
                        x.bitwidth, ok_bw
                    ));
                }
                if !(x.scale.is_finite() && x.scale > 0.0) {
                    return bad(format!("{kind} encoding for {n:?}: scale {}", x.scale));
                }
                let lim = 1i64 << x.bitwidth;
                if x.offset > 0 || x.offset <= -lim {
                    return bad(format!(
                        "{kind} encoding for {n:?}: offset {} outside [-{}, 0]",
                        x.offset,
                        lim - 1
                    ));
                }
            }
            if kind == "param" && v.len() > 1 {
                let c = *g.types[n.as_str()].shape.last().unwrap();
                if v.len() != c {
                    return bad(format!(
                        "param encoding for {n:?}: {} channels, the weight has {c} output channels",
                        v.len()
                    ));
                }
            }
            if kind == "activation" && is_kv(n) && int8kv != (v[0].bitwidth == 8) {
                return bad(format!(
                    "{n:?} is {}-bit: {}",
                    v[0].bitwidth,
                    if int8kv {
                        "the int8-KV variant needs 8-bit KV encodings (hexq quantize --int8-kv)"
                    } else {
                        "8-bit KV encodings belong to the decode_wgqa_int8kv variant"
                    }
                ));
            }
        }
        let covered =
            |n: &str| map.contains_key(n) || (kind == "param" && e.lpbq_encodings.contains_key(n));
        if let Some(missing) = names.iter().find(|n| !covered(n)) {
            if !partial {
                return bad(format!(
                    "no {kind} encoding for {missing:?} (every float tensor of {} needs one)",
                    g.name
                ));
            }
            uncovered += names.iter().filter(|n| !covered(n)).count();
        }
    }
    for (n, l) in &e.lpbq_encodings {
        let Some(t) = g
            .types
            .get(n.as_str())
            .filter(|_| params.contains(n.as_str()))
        else {
            return bad(format!(
                "LPBQ encoding for {n:?}: the {} graph has no such weight",
                g.name
            ));
        };
        let (inn, out) = (t.shape[0], *t.shape.last().unwrap());
        let levels = 1u32 << l.bw.saturating_sub(l.compressed_bw).min(16);
        let ok = l.block_size > 0
            && inn % l.block_size == 0
            && l.scale.len() == out
            && l.per_block_int_scale.len() == out * (inn / l.block_size)
            && l.scale.iter().all(|s| s.is_finite() && *s > 0.0)
            && l.per_block_int_scale
                .iter()
                .all(|&q| (1..=levels).contains(&q))
            && l.compressed_bw == 4
            && l.bw == 8;
        if !ok || e.param_encodings.contains_key(n) {
            return bad(format!(
                "LPBQ encoding for {n:?} does not fit the [{inn}, {out}] weight (block {}, {} channel scales, {} block scales, bw {}/{}; or it also has a param encoding)",
                l.block_size, l.scale.len(), l.per_block_int_scale.len(), l.compressed_bw, l.bw
            ));
        }
    }
    Ok(uncovered)
}

#[derive(Debug, Clone, Serialize)]
pub struct FileEntry {
    pub path: String,
    pub bytes: u64,
    pub sha256: String,
}

/// Every regular file under `dir` (relative paths, sorted), hashed; `skip` names are left out, and files in
/// `known` (relative path → SHA256 computed while writing them) are not read again.
pub fn hash_tree(
    dir: &Path,
    skip: &[&str],
    known: &std::collections::BTreeMap<String, String>,
) -> Result<Vec<FileEntry>> {
    fn walk(base: &Path, d: &Path, out: &mut Vec<std::path::PathBuf>) -> Result<()> {
        for e in std::fs::read_dir(d).map_err(|e| Error::io(d, e))? {
            let p = e.map_err(|e| Error::io(d, e))?.path();
            if p.is_dir() {
                walk(base, &p, out)?;
            } else {
                out.push(p.strip_prefix(base).unwrap().to_path_buf());
            }
        }
        Ok(())
    }
    let mut ps = Vec::new();
    walk(dir, dir, &mut ps)?;
    ps.sort();
    ps.retain(|p| !skip.contains(&p.to_string_lossy().as_ref()));
    let full: Vec<_> = ps.iter().map(|p| dir.join(p)).collect();
    let rel: Vec<String> = ps.iter().map(|p| p.to_string_lossy().to_string()).collect();
    let todo: Vec<_> = full
        .iter()
        .zip(&rel)
        .filter(|(_, r)| !known.contains_key(*r))
        .map(|(f, _)| f.clone())
        .collect();
    let mut fresh = hexq_fsutil::sha256_par(&todo, hexq_fsutil::sha256_file)?.into_iter();
    let hashes: Vec<String> = rel
        .iter()
        .map(|r| match known.get(r) {
            Some(h) => h.clone(),
            None => fresh.next().unwrap(),
        })
        .collect();
    ps.iter()
        .zip(full.iter().zip(hashes))
        .map(|(p, (f, sha256))| {
            Ok(FileEntry {
                path: p.to_string_lossy().to_string(),
                bytes: std::fs::metadata(f).map_err(|e| Error::io(f, e))?.len(),
                sha256,
            })
        })
        .collect()
}

/// Source checkpoint identity: SHA256 of config.json and of each safetensors file.
pub fn source_hashes(ck: &Checkpoint) -> Result<serde_json::Value> {
    let mut files = vec![ck.dir.join("config.json")];
    files.extend(ck.store.files.iter().cloned());
    let hashes = hexq_fsutil::sha256_par(&files, hexq_fsutil::sha256_file_cached)?;
    Ok(serde_json::Value::Object(
        files
            .iter()
            .zip(hashes)
            .map(|(f, h)| {
                (
                    f.file_name().unwrap().to_string_lossy().to_string(),
                    h.into(),
                )
            })
            .collect(),
    ))
}

/// A cheap source identity: config.json's SHA256, and per safetensors file its size and the SHA256 of its
/// header (every tensor's name, dtype, shape and offsets) — for manifests of commands that must not re-read
/// the whole checkpoint.
pub fn source_identity(ck: &Checkpoint) -> Result<serde_json::Value> {
    use sha2::{Digest, Sha256};
    use std::io::Read;
    let mut m = serde_json::Map::new();
    let cfg = ck.dir.join("config.json");
    m.insert("config.json".into(), hexq_fsutil::sha256_file(&cfg)?.into());
    for f in &ck.store.files {
        let mut h = std::fs::File::open(f).map_err(|e| Error::io(f, e))?;
        let mut n = [0u8; 8];
        h.read_exact(&mut n).map_err(|e| Error::io(f, e))?;
        let mut head = vec![0u8; u64::from_le_bytes(n) as usize];
        h.read_exact(&mut head).map_err(|e| Error::io(f, e))?;
        let bytes = std::fs::metadata(f).map_err(|e| Error::io(f, e))?.len();
        m.insert(
            f.file_name().unwrap().to_string_lossy().to_string(),
            json!({"bytes": bytes, "header_sha256": format!("{:x}", Sha256::digest(&head))}),
        );
    }
    Ok(serde_json::Value::Object(m))
}

/// The I/O contract of a graph as JSON (what a host loop or a compiler needs to bind buffers).
pub fn io_contract_json(g: &Graph, enc: Option<&Encodings>) -> serde_json::Value {
    let io = |v: &hexq_graph::ir::ValueInfo| {
        let mut o = json!({"name": v.name, "dtype": format!("{:?}", v.ty.dtype).to_lowercase(),
            "shape": v.ty.shape, "doc": v.doc});
        if let Some(e) = enc.and_then(|e| e.activation_encodings.get(&v.name)) {
            o["encoding"] =
                json!({"bitwidth": e[0].bitwidth, "scale": e[0].scale, "offset": e[0].offset});
        }
        o
    };
    json!({
        "graph": g.name,
        "graph_sha256": g.content_hash(),
        "inputs": g.inputs.iter().map(io).collect::<Vec<_>>(),
        "outputs": g.outputs.iter().map(io).collect::<Vec<_>>(),
        "kv_feedback": "after each call feed present_key_N/present_value_N back as past_key_N/past_value_N",
        "prefix": "position 0, when the prompt starts with host-model.json's prefix_token (BOS): no graph call — copy host-model/prefix.past_key_N / prefix.past_value_N ([1, Hkv, 1, d] f32) into entry 0 of the zeroed past_key_N / past_value_N buffers and take prefix.hidden_states as position 0's hidden state; the first graph call is at position 1",
        "host": "tokens → chat template → host-model embeddings (rows × row_multiplier) → graph → hidden_states @ embed_tokens^T → 30·tanh(x/30) → argmax; stop on 106 or 1",
    })
}

fn write_json(p: &Path, v: &impl Serialize) -> Result<()> {
    let mut s = serde_json::to_string_pretty(v).unwrap();
    s.push('\n');
    std::fs::write(p, s).map_err(|e| Error::io(p, e))
}

/// Write one variant's artifacts into `dir` (a staging directory the caller renames into place):
/// `<variant>.onnx` + `.data`, `<variant>.encodings.json`, `host-model/`, `io-contract.json`, `manifest.json`.
pub fn export(
    ck: &std::sync::Arc<Checkpoint>,
    dir: &Path,
    o: &Options,
) -> Result<serde_json::Value> {
    let (v, int8kv) = (o.variant, o.variant.int8_kv());
    let g = build(&ck.config, v, &o.graph);
    g.validate().map_err(|e| Error::Graph {
        graph: e.graph.clone(),
        msg: format!("node {:?}: {}", e.node, e.msg),
    })?;
    if int8kv && o.encodings.is_none() {
        return Err(Error::Usage(
            "decode_wgqa_int8kv is a quantized build: pass --encodings from `hexq quantize --int8-kv`".into(),
        ));
    }
    if o.qdq && o.encodings.is_none() {
        return Err(Error::Usage("--qdq needs --encodings".into()));
    }
    if let Some((p, e)) = &o.encodings {
        check_encodings(&g, e, int8kv, p, false)?;
    }
    let enc = o.encodings.as_ref().map(|(_, e)| e);
    // Three independent streams at once — the graph's weights, the host-model copy, the source hashes: each
    // is a chain of kernel copies and SHA256 that one core would run back to back, and from a cold cache
    // they share one read of the checkpoint.
    let noop = |_: u64| {};
    let (files, hm, src_hashes) = std::thread::scope(|sc| {
        let host = o.host.map(|h| {
            sc.spawn(move || {
                host::write_host_model(ck, &dir.join("host-model"), h, o.progress.unwrap_or(&noop))
            })
        });
        let src = sc.spawn(|| source_hashes(ck));
        let files = onnx::write_onnx(
            ck,
            &g,
            dir,
            &onnx::ExportOptions {
                stem: Some(o.variant.name().to_string()),
                weights: o.weights,
                qdq: if o.qdq { enc } else { None },
                progress: o.progress,
                calibration: o.calibration,
            },
        );
        let panicked = || Error::Usage("an export worker thread panicked".into());
        (
            files,
            host.map(|h| h.join().unwrap_or_else(|_| Err(panicked()))),
            src.join().unwrap_or_else(|_| Err(panicked())),
        )
    });
    let (files, src_hashes) = (files?, src_hashes?);
    let hm = hm.transpose()?;
    if let Some(e) = enc {
        write_json(&dir.join(format!("{}.encodings.json", o.variant)), e)?;
    }
    write_json(&dir.join("io-contract.json"), &io_contract_json(&g, enc))?;
    let mut known: std::collections::BTreeMap<String, String> = files
        .iter()
        .filter_map(|(f, h)| Some((f.clone(), h.clone()?)))
        .collect();
    if let Some(hm) = hm {
        for t in &hm.tensors {
            known.insert(format!("host-model/{}", t.file), t.sha256.clone());
            if let Some(s) = &t.scales {
                known.insert(format!("host-model/{}", s.file), s.sha256.clone());
            }
        }
    }
    let manifest = json!({
        "hexq_version": env!("CARGO_PKG_VERSION"),
        "variant": o.variant.name(),
        "graph": {"name": g.name, "sha256": g.content_hash(), "context": o.graph.context, "seq": o.graph.seq,
                  "onnx": files[0].0, "qdq": o.qdq, "weights": format!("{:?}", o.weights).to_lowercase(),
                  "calibration": o.calibration.is_some()},
        "encodings": enc.map(|e| e.hexq.clone()),
        "source": {"dir": hexq_fsutil::dir_name(&ck.dir), "sha256": src_hashes},
        "files": hash_tree(dir, &["manifest.json"], &known)?,
    });
    write_json(&dir.join("manifest.json"), &manifest)?;
    Ok(manifest)
}
