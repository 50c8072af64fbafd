//! One context binary per target holding the prefill (trunk) and decode graphs with one copy of the weights —
//! what Qualcomm's own Gemma-4 recipe and the Genie bundles ship (weight sharing needs HTP v73+).
//!
//! Made with onnxruntime-qnn's EPContext weight sharing (`ep.share_ep_contexts`: sessions add their graphs
//! to one QNN context; identical static tensors are stored once; the last session, with
//! `ep.stop_share_ep_contexts`, writes the binary). Static tensors are shared only when name, data *and*
//! quantization agree, so the two exports must carry the same weight encodings: they do by construction —
//! `hexq quantize` derives every param encoding from the weights alone (min-max per channel, no calibration
//! data) — and `check_agree` refuses two exports whose param encodings differ anywhere (e.g. different
//! overrides), naming the tensor.
//!
//! Output: a directory of its own (`--out`): `prefill_decode_<target>.bin`, one EPContext graph per variant
//! per target (`trunk_<target>.onnx`, `decode_wgqa_<target>.onnx`) pointing at it, `host-model/` and both
//! encodings files copied from the exports, `manifest.json` (kind `shared-context`, the sources' manifest
//! hashes, per target the graphs the binary holds — their partition names read back from the binary) and
//! SHA256SUMS.

use crate::error::{At, Error, Result};
use crate::{run_script, target, TARGETS_JSON};
use hexq_fsutil::sha256_file;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

pub struct SharedArgs {
    /// Two export directories: a decode variant and the trunk (QDQ, same checkpoint and context).
    pub dirs: Vec<PathBuf>,
    pub out: PathBuf,
    pub targets: Vec<String>,
    pub force: bool,
    pub json: bool,
}

/// A source export: its manifest, variant and encodings.
struct Source {
    dir: PathBuf,
    manifest: Value,
    variant: String,
    enc: Value,
}

fn read(p: &Path) -> Result<Value> {
    let s = std::fs::read_to_string(p).at(p)?;
    serde_json::from_str(&s).map_err(|e| Error::file(p, format!("invalid JSON: {e}")))
}

fn source(dir: &Path) -> Result<Source> {
    let mp = dir.join("manifest.json");
    let manifest = read(&mp)?;
    let variant = manifest["variant"]
        .as_str()
        .ok_or_else(|| Error::file(&mp, "no \"variant\""))?
        .to_string();
    if manifest["graph"]["qdq"] != true {
        return Err(Error::file(&mp, format!("{variant} is a float graph; a shared binary is compiled from QDQ exports (`hexq export --encodings F --qdq`)")));
    }
    let enc = read(&dir.join(format!("{variant}.encodings.json")))?;
    Ok(Source {
        dir: dir.to_path_buf(),
        manifest,
        variant,
        enc,
    })
}

/// The two exports may share one binary: same checkpoint, same context, one trunk and one decode graph, and
/// identical encodings on every weight they both hold.
fn check_agree(a: &Source, b: &Source) -> Result<()> {
    let name = |s: &Source| s.dir.join("manifest.json").display().to_string();
    if a.manifest["source"]["sha256"] != b.manifest["source"]["sha256"] {
        return Err(Error::Usage(format!(
            "{} and {}: exported from different checkpoints",
            name(a),
            name(b)
        )));
    }
    if a.manifest["graph"]["context"] != b.manifest["graph"]["context"] {
        return Err(Error::Usage(format!(
            "{} and {}: different --context ({} vs {}): the graphs share the KV buffers",
            name(a),
            name(b),
            a.manifest["graph"]["context"],
            b.manifest["graph"]["context"]
        )));
    }
    let (pa, pb) = (&a.enc["param_encodings"], &b.enc["param_encodings"]);
    let (ma, mb) = (
        pa.as_object()
            .ok_or_else(|| Error::Usage(format!("{}: no param_encodings", name(a))))?,
        pb.as_object()
            .ok_or_else(|| Error::Usage(format!("{}: no param_encodings", name(b))))?,
    );
    for (k, v) in ma {
        if let Some(w) = mb.get(k) {
            if v != w {
                return Err(Error::Usage(format!("{} and {}: param encodings of {k} differ ({}.encodings.json vs {}.encodings.json): the weights could not be stored once — quantize both from the same checkpoint with the same overrides", name(a), name(b), a.variant, b.variant)));
            }
        }
    }
    Ok(())
}

fn copy_dir(src: &Path, dst: &Path) -> Result<()> {
    crate::error::fs::create_dir_all(dst)?;
    for e in std::fs::read_dir(src).at(src)? {
        let e = e.at(src)?;
        let p = e.path();
        if p.is_dir() {
            copy_dir(&p, &dst.join(e.file_name()))?;
        } else {
            std::fs::copy(&p, dst.join(e.file_name())).at(&p)?;
        }
    }
    Ok(())
}

/// Both graphs compiled into one weight-shared context binary for target `t`, checked (every node on HTP,
/// the target's arch embedded, both graphs in the binary): its `compiled` manifest entry.
fn compile_target(
    t: &str,
    decode: &Source,
    trunk: &Source,
    stage: &hexq_fsutil::AtomicDir,
) -> Result<Value> {
    let names = [decode, trunk].map(|s| format!("{}_{t}", s.variant));
    let bin = format!("prefill_decode_{t}");
    let mut cmd = vec!["python3".to_string(), "-".into()];
    for src in [decode, trunk] {
        cmd.push(
            src.dir
                .join(format!("{}.onnx", src.variant))
                .display()
                .to_string(),
        );
    }
    cmd.extend([
        stage.tmp.display().to_string(),
        "--target".into(),
        t.to_string(),
        "--names".into(),
        names.join(","),
        "--bin-name".into(),
        bin.clone(),
        "--targets".into(),
        stage.path("htp_targets.json").display().to_string(),
    ]);
    let pb = crate::spinner(&format!(
        "compiling {} + {} into one context binary for {t} (QNN HTP, ort-qnn, weight sharing)",
        decode.variant, trunk.variant
    ));
    let rep = run_script(&cmd, &decode.dir.join(format!("{}.onnx", decode.variant)));
    pb.finish_and_clear();
    let rep = rep?;
    if rep["ok"] != true {
        let g: Vec<String> = rep["graphs"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|g| format!("{}: {}", g["model"], g["nodes_off_htp"]))
            .collect();
        return Err(Error::Usage(format!(
            "shared compile for {t} failed: {}\n  {}",
            rep["error"].as_str().unwrap_or("?"),
            g.join("\n  ")
        )));
    }
    let tt = target(t)?;
    if rep["embedded_arch"] != tt["htp_arch"] {
        return Err(Error::Usage(format!(
            "{bin}.bin embeds arch {}, target {t} is {}",
            rep["embedded_arch"], tt["htp_arch"]
        )));
    }
    let mut graphs = Vec::new();
    for (g, src) in rep["graphs"]
        .as_array()
        .unwrap()
        .iter()
        .zip([decode, trunk])
    {
        if g["nodes_off_htp"].as_array().is_none_or(|v| !v.is_empty()) || g["in_binary"] != true {
            return Err(Error::Usage(format!(
                "{}: not wholly in {bin}.bin: {g}",
                src.variant
            )));
        }
        let onnx = g["onnx"].as_str().unwrap_or_default().to_string();
        graphs.push(json!({"variant": src.variant, "onnx": onnx, "onnx_sha256": sha256_file(&stage.path(&onnx))?,
                           "partition": g["partition"], "nodes": g["nodes"], "nodes_off_htp": 0}));
    }
    let bp = stage.path(&format!("{bin}.bin"));
    Ok(json!({
        "target": t, "toolchain": "ort-qnn", "soc": tt["soc"], "htp_arch": tt["htp_arch"],
        "bin": format!("{bin}.bin"), "bin_sha256": sha256_file(&bp)?, "bin_bytes": crate::error::fs::len(&bp)?,
        "graphs": graphs, "onnxruntime": rep["onnxruntime"], "options": rep["options"],
    }))
}

/// One line per binary: size, SoC, arch, the graphs it holds.
fn print_compiled(compiled: &[Value], out: &Path) {
    for c in compiled {
        println!(
            "{} ({} bytes, {} arch {}; graphs {}) in {}",
            c["bin"].as_str().unwrap_or_default(),
            c["bin_bytes"],
            c["soc"].as_str().unwrap_or_default(),
            c["htp_arch"],
            c["graphs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|g| g["variant"].as_str().unwrap_or_default())
                .collect::<Vec<_>>()
                .join(" + "),
            out.display()
        );
    }
}

pub fn compile_shared(a: SharedArgs) -> Result<()> {
    if a.dirs.len() != 2 {
        return Err(Error::Usage(format!(
            "a shared binary takes two exports (--artifacts DECODE --artifacts TRUNK), got {}",
            a.dirs.len()
        )));
    }
    let s: Vec<Source> = a.dirs.iter().map(|d| source(d)).collect::<Result<_>>()?;
    let (trunk, decode) = match (s[0].variant == "trunk", s[1].variant == "trunk") {
        (true, false) => (&s[0], &s[1]),
        (false, true) => (&s[1], &s[0]),
        _ => {
            return Err(Error::Usage(format!(
                "a shared binary holds one trunk and one decode graph; got {} and {}",
                s[0].variant, s[1].variant
            )))
        }
    };
    check_agree(decode, trunk)?;
    for t in &a.targets {
        target(t)?;
    }
    let stage = hexq_fsutil::AtomicDir::create(&a.out, a.force)?;
    // host-model/ when the exports have one (`--host none` builds run from a separate host copy).
    if decode.dir.join("host-model").is_dir() {
        copy_dir(&decode.dir.join("host-model"), &stage.path("host-model"))?;
    }
    for src in [decode, trunk] {
        for f in [
            format!("{}.encodings.json", src.variant),
            "io-contract.json".into(),
        ] {
            let dst = match f.as_str() {
                "io-contract.json" => format!("{}.io-contract.json", src.variant),
                _ => f.clone(),
            };
            crate::error::fs::copy(src.dir.join(&f), stage.path(&dst))?;
        }
    }
    crate::error::fs::write(stage.path("htp_targets.json"), TARGETS_JSON)?;
    let compiled: Vec<Value> = a
        .targets
        .iter()
        .map(|t| compile_target(t, decode, trunk, &stage))
        .collect::<Result<_>>()?;
    std::fs::remove_file(stage.path("htp_targets.json")).at(&stage.path("htp_targets.json"))?;
    let mut files = Vec::new();
    let mut sums = String::new();
    for rel in hexq_fsutil::list_files(&stage.tmp)? {
        let h = sha256_file(&stage.tmp.join(&rel))?;
        sums += &format!("{h}  {rel}\n");
        files.push(json!({"path": rel, "sha256": h}));
    }
    let sources: Vec<Value> = [decode, trunk]
        .iter()
        .map(|s| {
            Ok(
                json!({"variant": s.variant, "dir": hexq_fsutil::dir_name(&s.dir),
                      "manifest_sha256": sha256_file(&s.dir.join("manifest.json"))?}),
            )
        })
        .collect::<Result<_>>()?;
    let m = json!({
        "kind": "shared-context",
        "hexq_version": env!("CARGO_PKG_VERSION"),
        "variants": [decode.variant, trunk.variant],
        "graph": {"context": decode.manifest["graph"]["context"], "seq": trunk.manifest["graph"]["seq"], "qdq": true},
        "source": decode.manifest["source"],
        "sources": sources,
        "compiled": compiled,
        "files": files,
    });
    crate::error::fs::write(stage.path("manifest.json"), crate::pretty(&m) + "\n")?;
    sums += &format!(
        "{}  manifest.json\n",
        sha256_file(&stage.path("manifest.json"))?
    );
    crate::error::fs::write(stage.path("SHA256SUMS"), sums)?;
    let out = stage.commit()?;
    if a.json {
        println!("{}", crate::pretty(&m));
    } else {
        print_compiled(&compiled, &out);
    }
    Ok(())
}
