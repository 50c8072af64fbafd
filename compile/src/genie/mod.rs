//! `hexq genie`: a Genie bundle directory from a shared prefill+decode build (`compile/shared.rs`) —
//! `genie_config.json`, `htp_backend_ext_config.json`, the context binary, the tokenizer and the host-side
//! embedding look-up tables Genie feeds the graph from.
//!
//! The config follows the two published references, both read, neither guessed:
//! - Genie's own validator (QAIRT `examples/Genie/Genie/src/Dialog.cpp`: per section the mandatory fields,
//!   the known keys and their JSON types) — mirrored by [`SCHEMA`] / [`validate`], which every bundle passes
//!   before it is written;
//! - Qualcomm's validated Gemma-4 E2B bundle (qualcomm/geniex-qairt-plugin
//!   `models/gemma4/bundle-templates/genie_config.e2b.json`, run token-for-token against Genie on v73): the
//!   Gemma-4 additions newer Genie (QAIRT ≥ 2.48) accepts — `kv-dim` per cache group, the `proportional`
//!   rope type with `partial-rotary-factor`, `local-positional-encoding`, `perlayer-embedding`.
//!
//! The model's settings come from the build itself: context and vocab from the manifest and config, RoPE per
//! layer type from the derived config, cache groups from the layer types (global `past_`, sliding `swa_`
//! with the window), stop tokens from hexq's runtime (106, 1), sampler from generation_config.json, and the
//! LUTs quantized with the graph inputs' own encodings (the template's warning: a LUT whose quant-param
//! differs from the export's input encoding gives garbage from the first token, silently).
//!
//! What Genie's QnnHtp engine expects of the graph I/O and where hexq's graphs differ is written to
//! `genie-io.json` ([`io_differences`]) and printed: the bundle is complete as a description of the build,
//! but Genie cannot drive hexq's graphs as they are (see README, *Genie bundle*).

use crate::error::{At, Error, Result};
mod schema;

use crate::TARGETS_JSON;
use hexq_fsutil::{sha256_file, AtomicDir};
use hexq_model::{AttnKind, ModelConfig};
pub use schema::{validate, Ty, SCHEMA};
use serde_json::{json, Map, Value};
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

pub struct GenieArgs {
    /// A shared prefill+decode build (`hexq compile --artifacts DECODE --artifacts TRUNK --out DIR`).
    pub dir: PathBuf,
    pub out: PathBuf,
    /// Which compiled target's binary to bundle (needed when the build holds several).
    pub target: Option<String>,
    pub force: bool,
}

fn read(p: &Path) -> Result<Value> {
    let s = std::fs::read_to_string(p).at(p)?;
    serde_json::from_str(&s).map_err(|e| Error::file(p, format!("invalid JSON: {e}")))
}

/// A graph input's encoding from the io-contract, as (scale, offset) with real = (q + offset)·scale.
fn input_encoding(io: &Value, name: &str, io_path: &Path) -> Result<Option<(f64, i64, u32)>> {
    let Some(t) = io["inputs"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|t| t["name"] == name)
    else {
        return Ok(None);
    };
    let e = &t["encoding"];
    match (e["scale"].as_f64(), e["offset"].as_i64(), e["bitwidth"].as_u64()) {
        (Some(s), Some(o), Some(b)) => Ok(Some((s, o, b as u32))),
        _ => Err(Error::file(io_path, format!("input {name} has no encoding (a Genie LUT needs the quantized build's input encoding)"))),
    }
}

/// The rope section Genie reads for one layer type. rope-dim = head_dim/2 (the number of cos/sin columns,
/// as in Qualcomm's bundles: 64 for Llama's 128-wide heads, 256 and 128 for Gemma-4's 512/256).
fn rope_json(cfg: &ModelConfig, kind: AttnKind) -> Value {
    let r = cfg.rope_for(kind);
    let mut v = json!({"type": "rope", "rope-dim": r.head_dim / 2, "rope-theta": r.theta});
    match r.rope_type.as_str() {
        "proportional" => {
            v["rope-scaling"] = json!({"rope-type": "proportional", "partial-rotary-factor": r.partial_rotary_factor})
        }
        "linear" => v["rope-scaling"] = json!({"rope-type": "linear", "factor": r.factor}),
        _ => {}
    }
    v
}

/// The genie_config.json for a build (pure: no files touched).
pub fn genie_config(
    cfg: &ModelConfig,
    context: usize,
    bin: &str,
    embed: (f64, i64, u32),
    ple: Option<(f64, i64, u32)>,
    generation: &Value,
) -> Value {
    let head = |k: AttnKind| cfg.layers.iter().find(|l| l.kind == k).map(|l| l.head_dim);
    let (full, sliding) = (head(AttnKind::Full), head(AttnKind::Sliding));
    let mut groups = Vec::new();
    if let Some(d) = full {
        groups.push(json!({"version": 1, "prefix": "past_", "kv-dim": d, "attention-mask-tensor-name": "attention_mask"}));
    }
    if let Some(d) = sliding {
        groups.push(json!({"version": 1, "prefix": "swa_", "kv-dim": d,
            "attention-mask-tensor-name": "swa_attention_mask",
            "longcontext": {"version": 1, "type": "sliding-window",
                "sliding-window": {"version": 1, "window-size": cfg.sliding_window}}}));
    }
    let mut model = json!({"version": 1, "type": "binary",
        "binary": {"version": 1, "ctx-bins": [bin]}});
    match (full, sliding) {
        (Some(_), Some(_)) => {
            model["positional-encoding"] = rope_json(cfg, AttnKind::Full);
            model["local-positional-encoding"] = rope_json(cfg, AttnKind::Sliding);
        }
        (Some(_), None) => model["positional-encoding"] = rope_json(cfg, AttnKind::Full),
        _ => model["positional-encoding"] = rope_json(cfg, AttnKind::Sliding),
    }
    let lut = |path: &str, size: usize, (scale, offset, bw): (f64, i64, u32)| {
        json!({"version": 1, "type": "lut", "lut-path": path, "size": size,
               "datatype": if bw == 8 { "ufixed8" } else { "ufixed16" },
               "quant-param": {"scale": scale, "offset": offset}})
    };
    // Sampler: the checkpoint's generation_config when it samples, else greedy (hexq's default).
    let g = |k: &str| generation.get(k).filter(|v| !v.is_null());
    let sampler = if g("do_sample") == Some(&json!(true)) {
        json!({"version": 1, "seed": 42,
               "temp": g("temperature").cloned().unwrap_or(json!(1.0)),
               "top-k": g("top_k").cloned().unwrap_or(json!(64)),
               "top-p": g("top_p").cloned().unwrap_or(json!(0.95))})
    } else {
        json!({"version": 1, "seed": 42, "temp": 0.0, "top-k": 1, "top-p": 1.0, "greedy": true})
    };
    let qnn = json!({"version": 1, "use-mmap": true, "spill-fill-bufsize": 0, "mmap-budget": 0,
        "poll": true, "cpu-mask": "0xe0", "kv-dim": sliding.or(full).unwrap_or(0),
        "allow-async-init": false});
    let mut dialog = json!({
        "version": 1,
        "type": "basic",
        "context": {"version": 1, "size": context, "n-vocab": cfg.vocab_size,
            "bos-token": cfg.bos_token_id, "eos-token": hexq_model::chat::STOP_IDS,
            "pad-token": cfg.pad_token_id},
        "sampler": sampler,
        "tokenizer": {"version": 1, "path": "tokenizer.json"},
        "engine": {"version": 1, "n-threads": 3,
            "backend": {"version": 1, "type": "QnnHtp", "QnnHtp": qnn,
                        "extensions": "htp_backend_ext_config.json"},
            "cache-groups": groups,
            "model": model},
        "embedding": lut(EMBED_LUT, cfg.hidden_size, embed),
    });
    if let Some(p) = ple {
        dialog["perlayer-embedding"] = lut(PLE_LUT, cfg.num_layers * cfg.ple_dim, p);
    }
    json!({ "dialog": dialog })
}

pub const EMBED_LUT: &str = "embedding_lut.bin";
pub const PLE_LUT: &str = "perlayer_embedding_lut.bin";

/// The HTP backend extension config Genie passes to QnnHtp (`extensions`): the device, burst performance,
/// shared-buffer memory, and weight sharing on (the binary holds two graphs over one set of weights).
pub fn backend_ext_config(target: &Value) -> Value {
    let mut device = json!({"dsp_arch": target["dsp_arch"],
        "cores": [{"core_id": 0, "perf_profile": "burst", "rpc_control_latency": 100}]});
    if !target["soc_model"].is_null() {
        device["soc_model"] = target["soc_model"].clone();
    }
    json!({"devices": [device], "memory": {"mem_type": "shared_buffer"},
           "context": {"weight_sharing_enabled": true}})
}

/// What Genie's QnnHtp engine (QAIRT Genie `qualla/engines/qnn-htp/nsp-model.cpp`) looks for in the graphs,
/// against what hexq's graph has, by name: one row per difference.
pub fn io_differences(io: &Value, cfg: &ModelConfig) -> Vec<Value> {
    let names: Vec<&str> = io["inputs"]
        .as_array()
        .into_iter()
        .flatten()
        .chain(io["outputs"].as_array().into_iter().flatten())
        .filter_map(|t| t["name"].as_str())
        .collect();
    let has = |n: &str| names.contains(&n);
    let mut d = Vec::new();
    let mut row = |genie: &str, hexq: &str, why: &str| {
        d.push(json!({"genie_expects": genie, "hexq_graph_has": hexq, "consequence": why}))
    };
    if !has("logits") {
        row("output `logits` [n_tokens, vocab] from the last graph (Genie samples from it)",
            "output `hidden_states` (after the final norm); lm_head and the softcap run on the host",
            "the vocab-sized lm_head (and for Gemma-4 the 30·tanh(x/30) softcap) must move into the graph");
    }
    if !has("attention_mask") {
        row("input `attention_mask` (and `swa_attention_mask` for the sliding cache group), filled by Genie per step",
            "no mask input: the causal / sliding mask is computed in-graph from `cache_position`",
            "mask inputs per cache group");
    }
    if !has("position_ids_cos") {
        row("inputs `position_ids_cos` / `position_ids_sin` ([n_tokens, rope-dim]) from Genie's RoPE tables",
            "inputs `position_ids` / `cache_position` (int32); RoPE computed in-graph",
            "RoPE cos/sin as inputs, one pair per rope type (global and local)");
    }
    if has("past_key_0") {
        row("KV as `past_key_N_in` (context − n_tokens entries) → `past_key_N_out` (the n_tokens new entries only); \
             Genie's KV manager writes them back; the sliding group's tensors named `swa_…`",
            "KV as `past_key_N` → `present_key_N`: the whole ring buffer in and out, the new entry written in-graph at \
             `cache_position % ring`; every layer named `past_…`",
            "new-entry-only KV outputs, `_in`/`_out` names, sliding layers renamed to the `swa_` prefix");
    }
    let kv_bits = io["inputs"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|t| t["name"] == "past_key_0")
        .and_then(|t| t["encoding"]["bitwidth"].as_u64());
    if kv_bits == Some(16) {
        row(
            "8-bit KV tensors (the engine's 16-bit KV support is disabled in the published source)",
            "16-bit KV (A16W8); `decode_wgqa_int8kv` / the trunk with int8 KV have 8-bit KV",
            "build from the int8-KV variants",
        );
    }
    if io.get("prefix").is_some() {
        row("every position, BOS included, run through the graph",
            "position 0 (BOS) served from host-model/prefix.* with no graph call; calibration starts at position 1",
            "BOS through the graph would hit activations outside the calibrated ranges (the attention sink)");
    }
    if cfg.ple_dim > 0 && has("per_layer_inputs") {
        row("the per-layer embedding fed from the `perlayer-embedding` LUT (tensor name per Genie's Gemma-4 engine)",
            "input `per_layer_inputs` [n_tokens, layers, ple_dim]",
            "name to be matched to Genie's Gemma-4 engine");
    }
    d
}

/// Quantize an f32 table (rows × multiplier) to a ufixed LUT with the graph input's encoding, streamed.
/// A host tensor's values from its stored dtype (host-model.json `dtype`): f32, or the checkpoint's bf16 /
/// f16 kept native. The int8/int4 host formats carry scales a LUT would have to fold in first.
fn host_value(dtype: &str, src: &Path) -> Result<(usize, fn(&[u8]) -> f32)> {
    Ok(match dtype {
        "f32" => (4, |c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        "bf16" => (2, |c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()),
        "f16" => (2, |c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()),
        d => {
            return Err(Error::file(
                src,
                format!("a {d} host tensor: Genie LUTs are made from f32, bf16 or f16 host models (export --host native)"),
            ))
        }
    })
}

fn write_lut(src: &Path, dtype: &str, mult: f32, enc: (f64, i64, u32), dst: &Path) -> Result<u64> {
    let (size, value) = host_value(dtype, src)?;
    let (scale, offset, bw) = enc;
    let e = hexq_quantize::Encoding {
        bitwidth: bw,
        dtype: "int".into(),
        is_symmetric: false,
        min: offset as f64 * scale,
        max: (offset as f64 + (2f64.powi(bw as i32) - 1.0)) * scale,
        offset,
        scale,
    };
    let mut r = BufReader::with_capacity(1 << 20, std::fs::File::open(src).at(src)?);
    let mut w = BufWriter::with_capacity(1 << 20, std::fs::File::create(dst).at(dst)?);
    let mut buf = vec![0u8; 1 << 20];
    let (mut n, mut carry) = (0u64, 0usize);
    loop {
        let k = r.read(&mut buf[carry..]).at(src)?;
        if k == 0 {
            if carry != 0 {
                return Err(Error::file(
                    src,
                    format!("length is not a whole number of {dtype} values"),
                ));
            }
            break;
        }
        let have = carry + k;
        let whole = have - have % size;
        for c in buf[..whole].chunks_exact(size) {
            let x = value(c) * mult;
            let q = e.quantize(x);
            if bw == 8 {
                w.write_all(&[q as u8]).at(dst)?;
            } else {
                w.write_all(&(q as u16).to_le_bytes()).at(dst)?;
            }
            n += 1;
        }
        buf.copy_within(whole..have, 0);
        carry = have - whole;
    }
    w.flush().at(dst)?;
    Ok(n)
}

/// One host-model tensor's file and row multiplier (host-model.json).
fn host_tensor(host: &Value, name: &str) -> Option<(String, String, f32, Vec<usize>)> {
    let t = host["tensors"]
        .as_array()?
        .iter()
        .find(|t| t["name"] == name)?;
    Some((
        t["file"].as_str()?.to_string(),
        t["dtype"].as_str().unwrap_or("f32").to_string(),
        t["row_multiplier"].as_f64().unwrap_or(1.0) as f32,
        t["shape"]
            .as_array()?
            .iter()
            .filter_map(|d| d.as_u64().map(|d| d as usize))
            .collect(),
    ))
}

/// The compiled entry of the build's manifest for `target` (or its only one).
fn pick_binary<'m>(m: &'m Value, mp: &Path, target: Option<&str>) -> Result<&'m Value> {
    let compiled: Vec<&Value> = m["compiled"].as_array().into_iter().flatten().collect();
    let avail: Vec<&str> = compiled
        .iter()
        .filter_map(|c| c["target"].as_str())
        .collect();
    let c = match target {
        Some(t) => compiled.iter().find(|c| c["target"] == t).ok_or_else(|| {
            Error::file(
                mp,
                format!("no binary for target {t} (compiled: {})", avail.join(", ")),
            )
        })?,
        None if compiled.len() == 1 => compiled[0],
        None => {
            return Err(Error::file(
                mp,
                format!(
                    "the build holds binaries for {}; pick one with --target",
                    avail.join(", ")
                ),
            ))
        }
    };
    Ok(c)
}

/// The embedding LUT (and Gemma-4's per-layer one) quantized with the graph inputs' encodings; what each
/// came from, for the manifest.
fn write_luts(
    stage: &AtomicDir,
    hm: &Path,
    host: &Value,
    embed: (f64, i64, u32),
    ple: Option<(f64, i64, u32)>,
) -> Result<Map<String, Value>> {
    let mut luts = Map::new();
    let (ef, ed, em, es) = host_tensor(host, "embed_tokens.weight")
        .ok_or_else(|| Error::file(&hm.join("host-model.json"), "no embed_tokens.weight"))?;
    let n = write_lut(&hm.join(&ef), &ed, em, embed, &stage.path(EMBED_LUT))?;
    if n as usize != es.iter().product::<usize>() {
        return Err(Error::file(
            &hm.join(&ef),
            format!("{n} values, shape {es:?}"),
        ));
    }
    luts.insert(
        EMBED_LUT.into(),
        json!({"from": ef, "row_multiplier": em, "shape": es, "encoding": embed_json(embed)}),
    );
    if let Some(p) = ple {
        let (pf, pd, pm, ps) =
            host_tensor(host, "embed_tokens_per_layer.weight").ok_or_else(|| {
                Error::file(
                    &hm.join("host-model.json"),
                    "no embed_tokens_per_layer.weight",
                )
            })?;
        write_lut(&hm.join(&pf), &pd, pm, p, &stage.path(PLE_LUT))?;
        luts.insert(
            PLE_LUT.into(),
            json!({"from": pf, "row_multiplier": pm, "shape": ps, "encoding": embed_json(p)}),
        );
    }
    Ok(luts)
}

/// Write the bundle; returns its manifest.
pub fn bundle(a: &GenieArgs) -> Result<Value> {
    let mp = a.dir.join("manifest.json");
    let m = read(&mp)?;
    if m["kind"] != "shared-context" {
        return Err(Error::file(
            &mp,
            format!(
                "not a shared prefill+decode build (kind {}); a Genie bundle is made from \
             `hexq compile --artifacts DECODE --artifacts TRUNK --target T --out DIR`",
                m["kind"]
            ),
        ));
    }
    let c = pick_binary(&m, &mp, a.target.as_deref())?;
    let target = c["target"].as_str().unwrap_or_default().to_string();
    let bin = c["bin"]
        .as_str()
        .ok_or_else(|| Error::file(&mp, "compiled entry without \"bin\""))?;
    let decode = m["variants"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_str())
        .find(|v| *v != "trunk")
        .ok_or_else(|| Error::file(&mp, "no decode variant"))?;
    let io_p = a.dir.join(format!("{decode}.io-contract.json"));
    let io = read(&io_p)?;
    let hm = a.dir.join("host-model");
    let cfg = ModelConfig::from_file(&hm.join("config.json"))
        .map_err(|e| Error::file(&hm.join("config.json"), format!("{e}")))?;
    let host = read(&hm.join("host-model.json"))?;
    let generation = read(&hm.join("generation_config.json")).unwrap_or(Value::Null);
    let context = m["graph"]["context"]
        .as_u64()
        .ok_or_else(|| Error::file(&mp, "no graph.context"))? as usize;
    let embed = input_encoding(&io, "inputs_embeds", &io_p)?
        .ok_or_else(|| Error::file(&io_p, "no inputs_embeds input"))?;
    let ple = input_encoding(&io, "per_layer_inputs", &io_p)?;
    let targets: Value =
        serde_json::from_str(TARGETS_JSON).at(Path::new("compile-scripts/htp_targets.json"))?;
    let gc = genie_config(&cfg, context, bin, embed, ple, &generation);
    let problems = validate(&gc);
    if !problems.is_empty() {
        return Err(Error::Usage(format!(
            "genie_config.json would not pass Genie's validation: {}",
            problems.join("; ")
        )));
    }
    let diffs = io_differences(&io, &cfg);

    let stage = AtomicDir::create(&a.out, a.force)?;
    let pb = crate::spinner(&format!(
        "writing the Genie bundle for {target} ({bin}, embedding LUTs)"
    ));
    let json_file = |name: &str, v: &Value| -> Result<()> {
        crate::error::fs::write(stage.path(name), crate::pretty(v) + "\n")
    };
    json_file("genie_config.json", &gc)?;
    json_file(
        "htp_backend_ext_config.json",
        &backend_ext_config(&targets[&target]),
    )?;
    json_file(
        "genie-io.json",
        &json!({
            "source": "QAIRT Genie qualla/engines/qnn-htp/nsp-model.cpp (tensor names) and Dialog.cpp (config)",
            "genie_can_drive_these_graphs": diffs.is_empty(),
            "differences": diffs,
        }),
    )?;
    // The binary: a hard link when the filesystem allows (it can be GBs), else a copy.
    let src_bin = a.dir.join(bin);
    if std::fs::hard_link(&src_bin, stage.path(bin)).is_err() {
        std::fs::copy(&src_bin, stage.path(bin)).at(&src_bin)?;
    }
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        crate::error::fs::copy(hm.join(f), stage.path(f))?;
    }
    let luts = write_luts(&stage, &hm, &host, embed, ple)?;
    pb.finish_and_clear();
    let mut files = Map::new();
    for f in hexq_fsutil::list_files(&stage.tmp)? {
        files.insert(f.clone(), json!(sha256_file(&stage.tmp.join(&f))?));
    }
    let manifest = json!({
        "kind": "genie-bundle",
        "hexq_version": env!("CARGO_PKG_VERSION"),
        "target": target,
        "source": {"dir": hexq_fsutil::dir_name(&a.dir), "manifest_sha256": sha256_file(&mp)?},
        "luts": luts,
        "genie_can_drive_these_graphs": diffs.is_empty(),
        "files_sha256": files,
    });
    json_file("manifest.json", &manifest)?;
    let sums: String = hexq_fsutil::list_files(&stage.tmp)?
        .iter()
        .map(|f| Ok(format!("{}  {f}\n", sha256_file(&stage.tmp.join(f))?)))
        .collect::<Result<_>>()?;
    crate::error::fs::write(stage.path("SHA256SUMS"), sums)?;
    stage.commit()?;
    Ok(manifest)
}

fn embed_json((scale, offset, bw): (f64, i64, u32)) -> Value {
    json!({"bitwidth": bw, "scale": scale, "offset": offset})
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A native bf16 host model (every E2B build: the checkpoint's dtype) gives the LUT its f32 copy gives.
    #[test]
    fn luts_from_bf16_and_f32_host_files_are_the_same_bytes() {
        let d = std::env::temp_dir().join(format!("hexq-lut-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let vals: Vec<half::bf16> = (0..3000)
            .map(|i| half::bf16::from_f32((i as f32 - 1500.0) / 97.0))
            .collect();
        let bf: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let f: Vec<u8> = vals.iter().flat_map(|v| v.to_f32().to_le_bytes()).collect();
        std::fs::write(d.join("a.bf16"), bf).unwrap();
        std::fs::write(d.join("a.f32"), f).unwrap();
        let enc = (0.01, -20000, 16);
        let n1 = write_lut(&d.join("a.bf16"), "bf16", 4.0, enc, &d.join("l1")).unwrap();
        let n2 = write_lut(&d.join("a.f32"), "f32", 4.0, enc, &d.join("l2")).unwrap();
        assert_eq!((n1, n2), (3000, 3000));
        assert_eq!(
            std::fs::read(d.join("l1")).unwrap(),
            std::fs::read(d.join("l2")).unwrap()
        );
        assert!(write_lut(&d.join("a.f32"), "int8", 1.0, enc, &d.join("l3")).is_err());
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// The key structure of Qualcomm's validated E2B bundle (geniex-qairt-plugin genie_config.e2b.json,
    /// values abridged) passes; unknown keys, missing fields, wrong types and versions are caught.
    #[test]
    fn validator_accepts_the_published_e2b_shape_and_catches_mistakes() {
        let e2b = json!({"dialog": {"version": 1, "type": "basic",
            "context": {"version": 1, "size": 4096, "n-vocab": 262144, "bos-token": 2, "eos-token": [1, 106], "pad-token": 0},
            "sampler": {"version": 1, "seed": 42, "temp": 0.8, "top-k": 40, "top-p": 0.95},
            "tokenizer": {"version": 1, "path": "tokenizer.json"},
            "engine": {"version": 1, "n-threads": 6,
                "backend": {"version": 1, "type": "QnnHtp", "QnnHtp": {"version": 1, "use-mmap": true,
                    "spill-fill-bufsize": 0, "mmap-budget": 40, "poll": true, "cpu-mask": "0xfc0", "kv-dim": 256,
                    "allow-async-init": true, "enable-graph-switching": true}, "extensions": "htp_backend_ext_config.json"},
                "cache-groups": [
                    {"version": 1, "prefix": "past_", "kv-dim": 512, "attention-mask-tensor-name": "attention_mask"},
                    {"version": 1, "prefix": "swa_", "kv-dim": 256, "attention-mask-tensor-name": "swa_attention_mask",
                     "longcontext": {"version": 1, "type": "sliding-window", "sliding-window": {"version": 1, "window-size": 512}}}],
                "model": {"version": 1, "type": "binary",
                    "positional-encoding": {"type": "rope", "rope-dim": 256, "rope-theta": 1000000.0,
                        "rope-scaling": {"rope-type": "proportional", "partial-rotary-factor": 0.25}},
                    "local-positional-encoding": {"type": "rope", "rope-dim": 128, "rope-theta": 10000.0},
                    "binary": {"version": 1, "ctx-bins": ["a_1_of_2.bin", "a_2_of_2.bin"]}}},
            "embedding": {"version": 1, "type": "lut", "lut-path": "e.bin", "size": 1536, "datatype": "ufixed16",
                "quant-param": {"scale": 0.0002, "offset": -43690}},
            "perlayer-embedding": {"version": 1, "type": "lut", "lut-path": "p.bin", "size": 8960, "datatype": "ufixed8",
                "quant-param": {"scale": 0.09, "offset": -136}}}});
        assert_eq!(validate(&e2b), Vec::<String>::new());
        let mut bad = e2b.clone();
        bad["dialog"]["context"]
            .as_object_mut()
            .unwrap()
            .remove("n-vocab");
        bad["dialog"]["engine"]["backend"]["QnnHtp"]["kv_dim"] = json!(1);
        bad["dialog"]["engine"]["model"]["binary"]["version"] = json!(2);
        bad["dialog"]["embedding"]["datatype"] = json!("int16");
        bad["dialog"]["engine"]["cache-groups"][1]["longcontext"]["sliding-window"]
            ["window-size"] = json!("512");
        let errs = validate(&bad);
        for want in [
            "dialog.context: missing field \"n-vocab\"",
            "dialog.engine.backend.QnnHtp: unknown key \"kv_dim\"",
            "dialog.engine.model.binary.version: unsupported version 2",
            "dialog.embedding.datatype: \"int16\" is not one of",
            "dialog.engine.cache-groups[].longcontext.sliding-window.window-size: expected Num",
        ] {
            assert!(
                errs.iter().any(|e| e.starts_with(want)),
                "{want} not in {errs:?}"
            );
        }
        assert_eq!(errs.len(), 5, "{errs:?}");
    }

    /// hexq's config for the E2B checkpoint config carries the model settings Qualcomm's validated E2B bundle
    /// does (genie_config.e2b.json): context size and vocab, BOS/EOS/pad, cache groups (global kv-dim 512,
    /// sliding 256 with window 512), RoPE per type (global 1e6 proportional 0.25 over rope-dim 256, local 1e4
    /// over 128), QnnHtp kv-dim 256, embedding size 1536, per-layer embedding size 35 × 256 = 8960.
    #[test]
    fn e2b_config_carries_the_published_e2b_bundle_settings() {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/e2b-config.json");
        let cfg = ModelConfig::from_file(&p).unwrap();
        let gen = json!({"do_sample": true, "top_k": 64, "top_p": 0.95, "temperature": 1.0});
        let g = genie_config(
            &cfg,
            4096,
            "b.bin",
            (0.0002, -43690, 16),
            Some((0.09, -136, 8)),
            &gen,
        );
        assert_eq!(validate(&g), Vec::<String>::new());
        let d = &g["dialog"];
        assert_eq!(
            d["context"],
            json!({"version": 1, "size": 4096, "n-vocab": 262144, "bos-token": 2,
            "eos-token": [106, 1], "pad-token": 0})
        );
        let e = &d["engine"];
        assert_eq!(e["backend"]["QnnHtp"]["kv-dim"], 256);
        assert_eq!(e["cache-groups"][0]["prefix"], "past_");
        assert_eq!(e["cache-groups"][0]["kv-dim"], 512);
        assert_eq!(e["cache-groups"][1]["prefix"], "swa_");
        assert_eq!(e["cache-groups"][1]["kv-dim"], 256);
        assert_eq!(
            e["cache-groups"][1]["longcontext"]["sliding-window"]["window-size"],
            512
        );
        assert_eq!(
            e["model"]["positional-encoding"],
            json!({"type": "rope", "rope-dim": 256,
            "rope-theta": 1000000.0, "rope-scaling": {"rope-type": "proportional", "partial-rotary-factor": 0.25}})
        );
        assert_eq!(
            e["model"]["local-positional-encoding"],
            json!({"type": "rope", "rope-dim": 128, "rope-theta": 10000.0})
        );
        assert_eq!(d["embedding"]["size"], 1536);
        assert_eq!(d["embedding"]["datatype"], "ufixed16");
        assert_eq!(d["perlayer-embedding"]["size"], 8960);
        assert_eq!(d["perlayer-embedding"]["datatype"], "ufixed8");
        assert_eq!(d["sampler"]["top-k"], 64);
    }
}
