//! `hexq compile`: an export directory → QNN HTP context binaries per target, through one of two toolchains.
//!
//! - `ort-qnn` (default, PyPI only): onnxruntime-qnn's QNN HTP backend compiles the QDQ graph offline
//!   (compile-scripts/ort_qnn_compile.py, embedded here) into `<variant>_<target>.bin` + the EPContext
//!   `<variant>_<target>.onnx` that loads it; CPU fallback disabled, refused nodes listed on failure.
//! - `qairt` (QAIRT SDK ≥ 2.45 at `$QAIRT_DIR`): qnn-onnx-converter with hexq's encodings as
//!   `--quantization_overrides`, qnn-model-lib-generator, qnn-context-binary-generator with a per-target HTP
//!   backend-extension config. `--dry-run` writes the commands, configs and raw input list without an SDK.
//!
//! Per-target settings come from one table, compile-scripts/htp_targets.json (embedded). Outputs land in the
//! export directory atomically (temp dir, then rename), and are recorded in manifest.json and SHA256SUMS.
//!
//! May import: model, runtime (manifests, the raw-input run), quantize, fsutil; errors are this crate's own [`Error`].

mod error;
pub mod genie;
pub mod shared;

use error::At;
pub use error::{Error, Result};

use hexq_fsutil::{sha256_file, write_atomic};
use serde_json::{json, Value};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

pub const TARGETS_JSON: &str = include_str!("../../compile-scripts/htp_targets.json");
const ORT_QNN_SCRIPT: &str = include_str!("../../compile-scripts/ort_qnn_compile.py");

/// The table's row for a target (v75, v79, v81).
pub fn target(t: &str) -> Result<Value> {
    let tab: Value =
        serde_json::from_str(TARGETS_JSON).at(Path::new("compile-scripts/htp_targets.json"))?;
    tab.get(t)
        .filter(|_| !t.starts_with('_'))
        .cloned()
        .ok_or_else(|| {
            Error::Usage(format!(
                "unknown target {t:?}: compile-scripts/htp_targets.json has v75, v79, v81"
            ))
        })
}

/// How the binary is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum Toolchain {
    /// onnxruntime-qnn's QNN HTP backend (PyPI).
    OrtQnn,
    /// The QAIRT SDK at $QAIRT_DIR (or --dry-run without one).
    Qairt,
}

pub struct Args {
    pub dir: PathBuf,
    pub target: String,
    pub toolchain: Toolchain,
    pub dry_run: bool,
    pub force: bool,
    pub json: bool,
    /// qairt: decode steps of calibration input written for --input_list.
    pub calib_steps: usize,
}

fn manifest(dir: &Path) -> Result<Value> {
    Ok(hexq_runtime::ort::manifest(dir)?)
}

pub fn compile(a: Args) -> Result<()> {
    let t = target(&a.target)?;
    let m = manifest(&a.dir)?;
    let variant = m["variant"]
        .as_str()
        .ok_or_else(|| Error::file(&a.dir.join("manifest.json"), "no variant"))?
        .to_string();
    match a.toolchain {
        Toolchain::OrtQnn => ort_qnn(&a, &t, &m, &variant),
        Toolchain::Qairt => qairt(&a, &t, &m, &variant),
    }
}

fn ort_qnn(a: &Args, t: &Value, m: &Value, variant: &str) -> Result<()> {
    let mp = a.dir.join("manifest.json");
    if !m["graph"]["qdq"].as_bool().unwrap_or(false) {
        return Err(Error::file(&mp, format!("{variant} is a float graph; the ort-qnn toolchain compiles QDQ graphs (`hexq export --encodings F --qdq`)")));
    }
    let name = format!("{variant}_{}", a.target);
    let onnx = a.dir.join(format!("{variant}.onnx"));
    let (bin, ctx) = (
        a.dir.join(format!("{name}.bin")),
        a.dir.join(format!("{name}.onnx")),
    );
    if (bin.exists() || ctx.exists()) && !a.force && !a.dry_run {
        return Err(Error::file(&bin, "already compiled (--force replaces it)"));
    }
    let tmp = a.dir.join(format!(".compile-{name}.tmp"));
    let cmd = vec![
        "python3".to_string(),
        "-".into(),
        onnx.display().to_string(),
        tmp.display().to_string(),
        "--target".into(),
        a.target.clone(),
        "--name".into(),
        name.clone(),
        "--targets".into(),
        tmp.join("htp_targets.json").display().to_string(),
    ];
    if a.dry_run {
        let r = json!({"toolchain": "ort-qnn", "target": a.target, "command": cmd,
                       "script": "compile-scripts/ort_qnn_compile.py (on stdin)", "outputs": [bin, ctx]});
        println!("{}", pretty(&r));
        return Ok(());
    }
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).at(&tmp)?;
    }
    std::fs::create_dir_all(&tmp).at(&tmp)?;
    let guard = TmpDir(tmp.clone());
    std::fs::write(tmp.join("htp_targets.json"), TARGETS_JSON).at(&tmp)?;
    let pb = spinner(&format!(
        "compiling {variant} for {} (QNN HTP, ort-qnn)",
        a.target
    ));
    let rep = run_script(&cmd, &onnx);
    pb.finish_and_clear();
    let rep = rep?;
    check_report(&rep, t, &onnx, &tmp.join(format!("{name}.bin")), &a.target)?;
    let (soc, arch) = (
        t["soc"].as_str().unwrap_or_default(),
        t["htp_arch"].as_u64().unwrap_or(0),
    );
    // Bin first, then the EPContext graph that names it: a crash between leaves no graph pointing at nothing.
    std::fs::rename(tmp.join(format!("{name}.bin")), &bin).at(&bin)?;
    std::fs::rename(tmp.join(format!("{name}.onnx")), &ctx).at(&ctx)?;
    drop(guard);
    let entry = json!({
        "target": a.target, "toolchain": "ort-qnn", "soc": soc, "htp_arch": arch,
        "bin": bin.file_name().unwrap().to_string_lossy(), "onnx": ctx.file_name().unwrap().to_string_lossy(),
        "bin_sha256": sha256_file(&bin)?, "bin_bytes": crate::error::fs::len(&bin)?,
        "onnx_sha256": sha256_file(&ctx)?,
        "nodes": rep["nodes"], "nodes_off_htp": 0,
        "onnxruntime": rep["onnxruntime"], "options": rep["options"],
    });
    record(&a.dir, entry.clone())?;
    if a.json {
        println!("{}", pretty(&entry));
    } else {
        println!(
            "{} ({} bytes, {soc} arch {arch}, {} nodes on HTP, {}s) + {}",
            bin.display(),
            entry["bin_bytes"],
            rep["nodes"],
            rep["seconds"],
            ctx.display()
        );
    }
    Ok(())
}

/// A JSON value as pretty text (a `Value` always serializes: its keys are strings).
pub(crate) fn pretty(v: &Value) -> String {
    serde_json::to_string_pretty(v).expect("JSON values serialize")
}

/// Runs compile-scripts/ort_qnn_compile.py (fed on stdin) and returns its JSON report.
pub(crate) fn run_script(cmd: &[String], onnx: &Path) -> Result<Value> {
    let mut child = Command::new(&cmd[0])
        .args(&cmd[1..])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| {
            Error::tool(
                "python3",
                format!("{e} (the ort-qnn toolchain needs python3 with onnxruntime-qnn)"),
            )
        })?;
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().expect("stdin is piped");
        stdin
            .write_all(ORT_QNN_SCRIPT.as_bytes())
            .map_err(|e| Error::tool("python3", format!("writing the compile script: {e}")))?;
    }
    let mut err_pipe = child.stderr.take().expect("stderr is piped");
    let errs = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err_pipe.read_to_string(&mut s);
        s
    });
    let mut out = String::new();
    child
        .stdout
        .take()
        .expect("stdout is piped")
        .read_to_string(&mut out)
        .map_err(|e| Error::tool("python3", format!("reading its report: {e}")))?;
    let status = child
        .wait()
        .map_err(|e| Error::tool("python3", e.to_string()))?;
    let stderr = errs.join().unwrap_or_default();
    // The QNN libraries print a banner on stdout; the report is the JSON object that starts a line.
    let js = out
        .find("\n{")
        .map(|i| &out[i + 1..])
        .or_else(|| out.starts_with('{').then_some(&out[..]))
        .unwrap_or("");
    let mut rep: Value = serde_json::from_str(js).map_err(|_| {
        let errs: Vec<&str> = stderr.lines().filter(|l| !l.contains("[W:")).collect();
        Error::tool(
            "ort-qnn",
            format!(
                "compile of {} failed ({status}): {}",
                onnx.display(),
                errs.join("\n")
            ),
        )
    })?;
    if !status.success() {
        rep["ok"] = false.into();
    }
    if let Some(k) = rep["peak_rss_kib"].as_u64() {
        hexq_fsutil::rss::note_child(k);
    }
    Ok(rep)
}

/// The report must say every node ran on HTP and the binary embeds the target's SoC and arch.
fn check_report(rep: &Value, t: &Value, onnx: &Path, bin: &Path, target: &str) -> Result<()> {
    let off = rep["nodes_off_htp"].as_array();
    if rep["ok"] != true {
        let off: Vec<String> = off
            .into_iter()
            .flatten()
            .map(|n| {
                let reason = n["reason"].as_str().unwrap_or("refused by the QNN EP");
                format!(
                    "{} ({}): {reason}",
                    n["name"].as_str().unwrap_or("?"),
                    n["op"].as_str().unwrap_or("?")
                )
            })
            .collect();
        let reasons: Vec<&str> = rep["reasons"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|x| x.as_str())
            .collect();
        return Err(Error::file(
            onnx,
            format!(
                "compile for {target} failed: {}\nnodes off HTP ({}):\n  {}\nerrors:\n  {}",
                rep["error"].as_str().unwrap_or("?"),
                off.len(),
                off.join("\n  "),
                reasons.join("\n  ")
            ),
        ));
    }
    let (soc, arch) = (
        t["soc"].as_str().unwrap_or_default(),
        t["htp_arch"].as_u64().unwrap_or(0),
    );
    if rep["embedded_soc"] != soc || rep["embedded_arch"] != arch {
        return Err(Error::file(
            bin,
            format!(
                "the binary embeds soc {} arch {}, target {target} is {soc} arch {arch}",
                rep["embedded_soc"], rep["embedded_arch"]
            ),
        ));
    }
    if off.map(|v| !v.is_empty()).unwrap_or(true) {
        return Err(Error::file(
            onnx,
            format!("nodes off HTP: {}", rep["nodes_off_htp"]),
        ));
    }
    Ok(())
}

/// Add (or replace) a target's entry under manifest.json "compiled", and rewrite SHA256SUMS
/// (`sha256sum -c` format) over every file the manifest lists.
fn record(dir: &Path, entry: Value) -> Result<()> {
    let mut m = manifest(dir)?;
    let mut list: Vec<Value> = m["compiled"].as_array().cloned().unwrap_or_default();
    list.retain(|c| c["target"] != entry["target"] || c["toolchain"] != entry["toolchain"]);
    list.push(entry);
    list.sort_by_key(|c| c["target"].as_str().unwrap_or("").to_string());
    m["compiled"] = Value::Array(list);
    let mut sums = String::new();
    for f in m["files"].as_array().into_iter().flatten() {
        sums += &format!(
            "{}  {}\n",
            f["sha256"].as_str().unwrap_or(""),
            f["path"].as_str().unwrap_or("")
        );
    }
    for c in m["compiled"].as_array().into_iter().flatten() {
        for (h, p) in [("bin_sha256", "bin"), ("onnx_sha256", "onnx")] {
            if let (Some(h), Some(p)) = (c[h].as_str(), c[p].as_str()) {
                sums += &format!("{h}  {p}\n");
            }
        }
    }
    write_atomic(&dir.join("manifest.json"), pretty(&m).as_bytes())?;
    write_atomic(&dir.join("SHA256SUMS"), sums.as_bytes())?;
    Ok(())
}

/// Removes a temp dir unless disarmed by dropping after the renames (then it is empty and removed too).
struct TmpDir(PathBuf);
impl Drop for TmpDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub(crate) fn spinner(msg: &str) -> indicatif::ProgressBar {
    let pb = indicatif::ProgressBar::new_spinner();
    pb.set_message(msg.to_string());
    pb.enable_steady_tick(std::time::Duration::from_millis(200));
    pb
}

/// The qairt toolchain. Without `$QAIRT_DIR` only `--dry-run` is possible: it writes
/// `qairt-<variant>_<target>/` with commands.sh, the HTP configs, input_list.txt and the raw inputs.
fn qairt(a: &Args, t: &Value, m: &Value, variant: &str) -> Result<()> {
    let mp = a.dir.join("manifest.json");
    if m["graph"]["qdq"].as_bool().unwrap_or(false) {
        return Err(Error::file(&mp, format!("{variant} is a QDQ graph; the qairt toolchain converts the float graph with hexq's encodings as overrides (`hexq export --encodings F` without --qdq)")));
    }
    let enc = format!("{variant}.encodings.json");
    if !a.dir.join(&enc).exists() {
        return Err(Error::file(
            &a.dir,
            format!("no {enc} (export with --encodings)"),
        ));
    }
    let qairt_dir = std::env::var("QAIRT_DIR").ok();
    if qairt_dir.is_none() && !a.dry_run {
        return Err(Error::Usage("the qairt toolchain needs QAIRT_DIR (a QAIRT SDK ≥ 2.45); --dry-run writes the commands without one".to_string()));
    }
    let name = format!("{variant}_{}", a.target);
    let out = a.dir.join(format!("qairt-{name}"));
    let dir = hexq_fsutil::AtomicDir::create(&out, a.force)?;
    let (dsp, soc_model, vtcm, o) = (
        t["dsp_arch"].as_str().unwrap(),
        t["soc_model"].clone(),
        t["vtcm_mb"].as_u64().unwrap(),
        t["optimization_level"].as_u64().unwrap(),
    );
    let mut device = json!({"dsp_arch": dsp});
    if !soc_model.is_null() {
        device["soc_model"] = soc_model;
    }
    let ext = json!({
        "graphs": [{"graph_names": [variant], "vtcm_mb": vtcm, "O": o,
                    "fp16_relaxed_precision": t["fp16_relaxed_precision"].as_bool().unwrap_or(false) as u8}],
        "devices": [device],
    });
    crate::error::fs::write(
        dir.path(&format!("htp_backend_ext_{}.json", a.target)),
        pretty(&ext) + "\n",
    )?;
    // QAIRT_DIR is filled in by commands.sh (JSON has no variables).
    let cfg = json!({"backend_extensions": {
        "shared_library_path": "@QAIRT_DIR@/lib/x86_64-linux-clang/libQnnHtpNetRunExtensions.so",
        "config_file_path": format!("htp_backend_ext_{}.json", a.target)}});
    crate::error::fs::write(
        dir.path(&format!("htp_config_{}.json.in", a.target)),
        pretty(&cfg) + "\n",
    )?;
    // Raw calibration inputs: the float graph's own inputs on chat-formatted decode steps (onnxruntime CPU).
    let lines = raw_inputs(&a.dir, &dir.path("inputs"), a.calib_steps)?;
    std::fs::write(dir.path("input_list.txt"), lines.join("\n") + "\n")
        .at(&dir.path("input_list.txt"))?;
    let (ab, wb, bb) = (
        t["act_bitwidth"].as_u64().unwrap(),
        t["weights_bitwidth"].as_u64().unwrap(),
        t["bias_bitwidth"].as_u64().unwrap(),
    );
    let skel = format!("libQnnHtp{}Skel.so", dsp.to_uppercase());
    let sh = format!(
        r#"#!/usr/bin/env bash
# hexq compile --toolchain qairt: {variant} → {name}.bin for {target} ({soc}). Run from this directory.
set -euo pipefail
: "${{QAIRT_DIR:?set QAIRT_DIR to a QAIRT SDK (2.45 or newer)}}"
HERE="$(cd "$(dirname "$0")" && pwd)"
cd "$HERE"
# The target's skel must ship with the SDK (v81 is missing from older installs).
test -f "$QAIRT_DIR/lib/hexagon-{dsp}/unsigned/{skel}" || {{ echo "$QAIRT_DIR has no hexagon-{dsp}/unsigned/{skel}: this SDK cannot build for {target}" >&2; exit 1; }}
source "$QAIRT_DIR/bin/envsetup.sh"
sed "s#@QAIRT_DIR@#$QAIRT_DIR#g" htp_config_{target}.json.in > htp_config_{target}.json
mkdir -p build
"$QAIRT_DIR/bin/x86_64-linux-clang/qnn-onnx-converter" \
  --input_network ../{variant}.onnx \
  --output_path build/{variant}.cpp \
  --quantization_overrides ../{enc} \
  --input_list input_list.txt \
  --act_bitwidth {ab} --weights_bitwidth {wb} --bias_bitwidth {bb} \
  --use_per_channel_quantization
"$QAIRT_DIR/bin/x86_64-linux-clang/qnn-model-lib-generator" \
  -c build/{variant}.cpp -b build/{variant}.bin -o build/lib -t x86_64-linux-clang
"$QAIRT_DIR/bin/x86_64-linux-clang/qnn-context-binary-generator" \
  --backend "$QAIRT_DIR/lib/x86_64-linux-clang/libQnnHtp.so" \
  --model build/lib/x86_64-linux-clang/lib{variant}.so \
  --config_file htp_config_{target}.json \
  --binary_file {name} --output_dir .
strings {name}.bin | grep -o 'soc_type=[A-Z0-9]*;arch=[0-9]*' | head -1
"#,
        target = a.target,
        soc = t["soc"].as_str().unwrap(),
    );
    std::fs::write(dir.path("commands.sh"), &sh).at(&dir.path("commands.sh"))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(
            dir.path("commands.sh"),
            std::fs::Permissions::from_mode(0o755),
        )
        .at(&dir.path("commands.sh"))?;
    }
    let path = dir.commit()?;
    if a.dry_run {
        if a.json {
            println!(
                "{}",
                json!({"toolchain": "qairt", "target": a.target, "dir": path, "dry_run": true, "input_list_lines": lines.len()})
            );
        } else {
            println!(
                "{} (dry run: commands.sh, htp configs, input_list.txt with {} rows)",
                path.display(),
                lines.len()
            );
        }
        return Ok(());
    }
    let pb = spinner(&format!("compiling {variant} for {} (QAIRT)", a.target));
    let st = Command::new("bash")
        .arg(path.join("commands.sh"))
        .status()
        .map_err(|e| Error::tool("bash", e.to_string()))?;
    pb.finish_and_clear();
    if !st.success() {
        return Err(Error::file(&path.join("commands.sh"), format!("{st}")));
    }
    let bin = path.join(format!("{name}.bin"));
    let bytes = std::fs::read(&bin).at(&bin)?;
    let want = format!(
        "soc_type={};arch={}",
        t["soc"].as_str().unwrap(),
        t["htp_arch"]
    );
    if !bytes.windows(want.len()).any(|w| w == want.as_bytes()) {
        return Err(Error::file(&bin, format!("does not embed {want}")));
    }
    let final_bin = a.dir.join(format!("{name}.qairt.bin"));
    std::fs::rename(&bin, &final_bin).at(&final_bin)?;
    record(
        &a.dir,
        json!({"target": a.target, "toolchain": "qairt", "bin": final_bin.file_name().unwrap().to_string_lossy(),
               "bin_sha256": sha256_file(&final_bin)?, "bin_bytes": bytes.len()}),
    )?;
    println!("{}", final_bin.display());
    Ok(())
}

/// Run the float graph on onnxruntime CPU over chat-formatted decode steps and write each step's inputs as raw
/// little-endian files (f32, or int32 for index inputs) — the converter's --input_list rows.
fn raw_inputs(dir: &Path, out: &Path, steps: usize) -> Result<Vec<String>> {
    use hexq_runtime::Backend;
    let mut b =
        hexq_runtime::ort::OrtBackend::open(&[dir.to_path_buf()], 1, hexq_runtime::ort::Ep::Cpu)?;
    let tok = hexq_model::chat::Tokenizer::from_dir(&b.host.dir)?;
    let prompt = first_calibration_prompt()?;
    let ids = tok.encode_chat(&[hexq_model::chat::Message::user(&prompt)])?;
    b.capture = Some(Vec::new());
    b.reset();
    // `steps` graph runs (BOS at position 0 is the host prefix and runs no graph).
    for &id in &ids {
        if b.capture.as_ref().map_or(0, Vec::len) >= steps.max(1) {
            break;
        }
        b.feed(&[id])?;
    }
    let rows = b.capture.take().unwrap_or_default();
    let mut lines = Vec::new();
    for (i, row) in rows.iter().enumerate() {
        let d = out.join(i.to_string());
        std::fs::create_dir_all(&d).at(&d)?;
        let mut parts = Vec::new();
        for (n, bytes) in row {
            let f = d.join(format!("{n}.raw"));
            std::fs::write(&f, bytes).at(&f)?;
            parts.push(format!("{n}:=inputs/{i}/{n}.raw"));
        }
        lines.push(parts.join(" "));
    }
    Ok(lines)
}

fn first_calibration_prompt() -> Result<String> {
    let p = Path::new("datasets/calibration.jsonl");
    let s = std::fs::read_to_string(p)
        .unwrap_or_else(|_| include_str!("../../datasets/calibration.jsonl").to_string());
    let line = s.lines().next().ok_or_else(|| Error::file(p, "empty"))?;
    let v: Value = serde_json::from_str(line).at(p)?;
    Ok(v["prompt"]
        .as_str()
        .or_else(|| v["messages"][0]["content"].as_str())
        .or_else(|| v["text"].as_str())
        .unwrap_or("Hello")
        .to_string())
}
