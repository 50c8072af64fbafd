//! `hexq build --recipe recipes/<name>.toml --out DIR`: rebuild an artifact set — calibrate → quantize →
//! export → compile (per target, optionally one weight-shared prefill+decode binary) and GGUF files — from
//! one file that names every choice. The stages are the other commands, run with their own Args.
//!
//! Resumable: each stage's inputs (its recipe settings, the hexq version, the files it reads — the
//! checkpoint's, the dataset, upstream outputs — by SHA256) hash to a key stamped in `DIR/.stamps/` with its
//! outputs' hashes when it finishes; a stage whose key and outputs are unchanged is not redone. Every tool
//! hexq drives writes the same bytes for the same inputs (QNN context binaries included, measured), so two
//! runs write byte-identical outputs and an identical `build-manifest.json` (no times or run state in it).

use super::{calibrate, compile, export, gguf, model_dir, quantize};
use anyhow::{anyhow, bail, Context, Result};
use hexq_fsutil::write_atomic;
use hexq_graph::Variant;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

#[derive(clap::Args, Clone)]
pub struct Args {
    /// The recipe (TOML; recipes/ has one per published artifact set).
    #[arg(long)]
    pub recipe: PathBuf,
    /// Checkpoint directory; overrides the recipe's `model`.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Build directory (created, or resumed).
    #[arg(long)]
    pub out: PathBuf,
    /// Print the stage table as JSON on stdout.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Recipe {
    pub name: String,
    #[serde(default)]
    pub description: String,
    /// Checkpoint directory (relative to the working directory); `--model` overrides; none = bundled tiny.
    pub model: Option<PathBuf>,
    pub graph: GraphCfg,
    pub calibration: Option<Calibration>,
    #[serde(default, rename = "artifact")]
    pub artifacts: Vec<Artifact>,
    #[serde(default)]
    pub host: HostCfg,
    pub compile: Option<CompileCfg>,
    #[serde(default)]
    pub gguf: Vec<GgufCfg>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GraphCfg {
    pub context: usize,
    #[serde(default = "seq128")]
    pub seq: usize,
}
fn seq128() -> usize {
    128
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Calibration {
    pub dataset: PathBuf,
    pub limit: usize,
    #[serde(default = "eight")]
    pub decode_tokens: usize,
}
fn eight() -> usize {
    8
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Artifact {
    /// decode_wgqa, decode_wgqa_int8kv, trunk (A16W8 QDQ exports).
    pub variant: String,
    #[serde(default = "a16w8")]
    pub scheme: String,
    /// quantize --overrides (JSON rules by glob).
    pub overrides: Option<PathBuf>,
}
fn a16w8() -> String {
    "a16w8".into()
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostCfg {
    /// native (the checkpoint's dtype), int8, int4.
    #[serde(default)]
    pub dtype: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompileCfg {
    pub targets: Vec<String>,
    /// One weight-shared context binary per target for decode_wgqa + trunk (their own binaries too).
    #[serde(default)]
    pub shared: bool,
    /// A Genie bundle per target from the shared binary (`hexq genie`): `genie/<target>/`.
    #[serde(default)]
    pub genie: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GgufCfg {
    #[serde(rename = "type")]
    pub ty: String,
    #[serde(default)]
    pub pure: bool,
}

/// Read and check a recipe: every value a stage will need is validated before any stage runs.
pub fn load(p: &Path) -> Result<(Recipe, String)> {
    let text = std::fs::read_to_string(p).with_context(|| format!("{}", p.display()))?;
    let r: Recipe = toml::from_str(&text).map_err(|e| anyhow!("{}: {e}", p.display()))?;
    for a in &r.artifacts {
        let v: Variant = clap::ValueEnum::from_str(&a.variant, false).map_err(|_| {
            anyhow!(
                "{}: artifact variant {:?}: one of decode_wgqa, decode_wgqa_int8kv, trunk",
                p.display(),
                a.variant
            )
        })?;
        if !matches!(
            v,
            Variant::DecodeWgqa | Variant::DecodeWgqaInt8kv | Variant::Trunk
        ) {
            bail!(
                "{}: artifact variant {}: recipes build decode_wgqa, decode_wgqa_int8kv and trunk",
                p.display(),
                a.variant
            );
        }
        if a.scheme != "a16w8" {
            bail!(
                "{}: artifact {}: scheme {:?} (this hexq encodes a16w8)",
                p.display(),
                a.variant,
                a.scheme
            );
        }
    }
    if !r.artifacts.is_empty() && r.calibration.is_none() {
        bail!("{}: artifacts need a [calibration] section", p.display());
    }
    if let Some(c) = &r.compile {
        for t in &c.targets {
            hexq_compile::target(t).map_err(|e| anyhow!("{}: {e}", p.display()))?;
        }
        let has = |v: &str| r.artifacts.iter().any(|a| a.variant == v);
        if c.shared && !(has("trunk") && has("decode_wgqa")) {
            bail!(
                "{}: compile.shared needs a decode_wgqa and a trunk artifact",
                p.display()
            );
        }
        if c.genie && !c.shared {
            bail!(
                "{}: compile.genie bundles the shared binary: set compile.shared = true",
                p.display()
            );
        }
    }
    for g in &r.gguf {
        let _: hexq_export::gguf::FileType =
            clap::ValueEnum::from_str(&g.ty, true).map_err(|_| {
                anyhow!(
                    "{}: gguf type {:?}: f32, f16, bf16, q8_0, q4_0",
                    p.display(),
                    g.ty
                )
            })?;
    }
    if let Some(d) = &r.host.dtype {
        let _: export::Host = clap::ValueEnum::from_str(d, true).map_err(|_| {
            anyhow!(
                "{}: host.dtype {d:?}: native, int8, int4, none",
                p.display()
            )
        })?;
    }
    if r.graph.context == 0 || r.graph.seq == 0 {
        bail!(
            "{}: graph.context and graph.seq must be at least 1",
            p.display()
        );
    }
    if r.artifacts.iter().any(|a| a.variant == "trunk") && r.graph.seq > r.graph.context {
        bail!(
            "{}: graph.seq {} exceeds graph.context {}: a trunk chunk must fit the KV it writes",
            p.display(),
            r.graph.seq,
            r.graph.context
        );
    }
    if let Some(c) = r
        .calibration
        .as_ref()
        .filter(|c| r.graph.context < c.decode_tokens + 2)
    {
        bail!(
            "{}: graph.context {} leaves no room for a prompt beside calibration.decode_tokens {}",
            p.display(),
            r.graph.context,
            c.decode_tokens
        );
    }
    Ok((r, text))
}

/// One stage: what it reads (files by hash, settings by value) and what it writes (the files downstream
/// stages read), relative to the build directory.
struct Stage {
    name: String,
    settings: Value,
    reads: Vec<PathBuf>,
    writes: Vec<String>,
    run: Box<dyn FnOnce() -> Result<()>>,
}

#[derive(Serialize, Deserialize)]
struct Stamp {
    key: String,
    outputs: Vec<(String, String)>,
}

fn hash_path(p: &Path) -> Result<String> {
    if p.is_dir() {
        let mut s = String::new();
        for f in hexq_fsutil::list_files(p)? {
            s += &format!("{}  {f}\n", hexq_fsutil::sha256_file_cached(&p.join(&f))?);
        }
        Ok(hexq_fsutil::sha256_bytes(s.as_bytes()))
    } else {
        hexq_fsutil::sha256_file_cached(p).with_context(|| format!("hashing {}", p.display()))
    }
}

pub fn run(a: Args) -> Result<()> {
    let (r, text) = load(&a.recipe)?;
    let model = model_dir(a.model.clone().or(r.model.clone()))?;
    let out = a.out.clone();
    std::fs::create_dir_all(out.join(".stamps")).with_context(|| format!("{}", out.display()))?;
    let weights: Vec<PathBuf> = std::fs::read_dir(&model)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.extension()
                .is_some_and(|x| x == "safetensors" || x == "json" || x == "model")
        })
        .collect();
    let plan = Plan {
        r: &r,
        out: &out,
        m: Some(model.clone()),
        weights,
    };
    let host: export::Host = match &r.host.dtype {
        Some(d) => clap::ValueEnum::from_str(d, true).map_err(|e| anyhow!("{e}"))?,
        None => export::Host::Native,
    };
    let mut stages = plan.calibrate_stages();
    for art in &r.artifacts {
        stages.extend(plan.artifact_stages(art, host)?);
    }
    if let Some(c) = r.compile.as_ref().filter(|c| c.shared) {
        stages.extend(plan.shared_stages(c)?);
    }
    for g in &r.gguf {
        stages.push(plan.gguf_stage(g)?);
    }
    std::fs::create_dir_all(out.join("stats"))?;
    let (table, manifest_stages) = run_stages(stages, &out, &model)?;
    let mut tools = json!({"hexq": env!("CARGO_PKG_VERSION")});
    if r.compile.is_some() {
        tools["onnxruntime-qnn"] = python_version("onnxruntime_qnn").into();
        tools["onnxruntime"] = python_version("onnxruntime").into();
    }
    let manifest = json!({
        "recipe": {"path": hexq_fsutil::dir_name(&a.recipe), "sha256": hexq_fsutil::sha256_bytes(text.as_bytes()), "parsed": r, "text": text},
        "model": hexq_fsutil::dir_name(&model),
        "tools": tools,
        // Every tool above writes the same bytes for the same inputs (two runs compared by SHA256, QNN
        // context binaries included): nothing here is excluded as nondeterministic.
        "nondeterministic": [],
        "stages": manifest_stages,
    });
    write_atomic(
        &out.join("build-manifest.json"),
        (serde_json::to_string_pretty(&manifest)? + "\n").as_bytes(),
    )?;
    report(a.json, &table, &out)
}

/// What every stage of one build shares: the recipe, the build directory, the checkpoint and its files.
struct Plan<'a> {
    r: &'a Recipe,
    out: &'a Path,
    m: Option<PathBuf>,
    weights: Vec<PathBuf>,
}

impl Plan<'_> {
    /// Calibration: the decode graph's stats serve both decode variants; the trunk has its own, its past-KV
    /// ranges completed from the decode graph's (quantize --kv-stats).
    fn calibrate_stages(&self) -> Vec<Stage> {
        let (r, out, m, ctx) = (self.r, self.out, &self.m, self.r.graph.context);
        let has = |v: &str| r.artifacts.iter().any(|x| x.variant == v);
        let mut stages = Vec::new();
        let decode_needed = has("decode_wgqa") || has("decode_wgqa_int8kv") || has("trunk");
        for (v, needed) in [
            (Variant::DecodeWgqa, decode_needed),
            (Variant::Trunk, has("trunk")),
        ] {
            let (Some(c), true) = (&r.calibration, needed) else {
                continue;
            };
            let st = format!("stats/{v}.json");
            let mut ca =
                calibrate::Args::new(m.clone(), c.dataset.clone(), c.limit, ctx, out.join(&st));
            ca.variant = v;
            ca.seq = r.graph.seq;
            ca.decode_tokens = c.decode_tokens;
            ca.force = true;
            let mut reads = self.weights.clone();
            reads.push(c.dataset.clone());
            stages.push(Stage {
                name: format!("calibrate {v}"),
                settings: json!({"limit": c.limit, "decode_tokens": c.decode_tokens, "context": ctx, "seq": r.graph.seq}),
                reads,
                writes: vec![st],
                run: Box::new(move || calibrate::run(ca)),
            });
        }
        stages
    }

    /// One artifact: quantize, export (QDQ), and a compile per target.
    fn artifact_stages(&self, art: &Artifact, host: export::Host) -> Result<Vec<Stage>> {
        let (r, out, m, ctx) = (self.r, self.out, &self.m, self.r.graph.context);
        let mut stages = Vec::new();
        let v: Variant =
            clap::ValueEnum::from_str(&art.variant, false).map_err(|e| anyhow!("{e}"))?;
        let stats = if v == Variant::Trunk {
            "stats/trunk.json"
        } else {
            "stats/decode_wgqa.json"
        };
        let enc = format!("encodings/{v}.encodings.json");
        let mut qa = quantize::Args::new(
            m.clone(),
            out.join(stats),
            v == Variant::DecodeWgqaInt8kv,
            out.join(&enc),
        );
        qa.overrides = art.overrides.clone();
        qa.force = true;
        let mut reads = self.weights.clone();
        reads.push(out.join(stats));
        if v == Variant::Trunk {
            qa.kv_stats = Some(out.join("stats/decode_wgqa.json"));
            reads.push(out.join("stats/decode_wgqa.json"));
        }
        reads.extend(art.overrides.clone());
        std::fs::create_dir_all(out.join("encodings"))?;
        stages.push(Stage {
            name: format!("quantize {v}"),
            settings: json!({"scheme": art.scheme, "int8_kv": v == Variant::DecodeWgqaInt8kv}),
            reads,
            writes: vec![enc.clone()],
            run: Box::new(move || quantize::run(qa)),
        });
        let dir = format!("export/{v}");
        let mut xa = export::Args::new(m.clone(), v, ctx, out.join(&dir));
        xa.seq = r.graph.seq;
        xa.encodings = Some(out.join(&enc));
        xa.qdq = true;
        xa.host = host;
        xa.force = true;
        let mut reads = self.weights.clone();
        reads.push(out.join(&enc));
        stages.push(Stage {
                name: format!("export {v}"),
                settings: json!({"context": ctx, "seq": r.graph.seq, "qdq": true, "host": r.host.dtype}),
                reads,
                // What later stages read (compile rewrites manifest.json beside them).
                writes: vec![format!("{dir}/{v}.onnx"), format!("{dir}/{v}.data"), format!("{dir}/host-model")],
                run: Box::new(move || export::run(xa)),
            });
        for t in r.compile.iter().flat_map(|c| c.targets.clone()) {
            let ca = compile::Args::new(out.join(&dir), &t);
            stages.push(Stage {
                name: format!("compile {v} {t}"),
                settings: json!({"toolchain": "ort-qnn"}),
                reads: vec![
                    out.join(format!("{dir}/{v}.onnx")),
                    out.join(format!("{dir}/{v}.data")),
                ],
                writes: vec![format!("{dir}/{v}_{t}.bin"), format!("{dir}/{v}_{t}.onnx")],
                run: Box::new(move || compile::run(ca)),
            });
        }
        Ok(stages)
    }

    /// One weight-shared prefill+decode binary for the targets, and Genie bundles from it.
    fn shared_stages(&self, c: &CompileCfg) -> Result<Vec<Stage>> {
        let out = self.out;
        let mut stages = Vec::new();
        let (d, t) = (out.join("export/decode_wgqa"), out.join("export/trunk"));
        let ca = compile::Args {
            artifacts: vec![d.clone(), t.clone()],
            out: Some(out.join("prefill_decode")),
            ..compile::Args::new(d.clone(), &c.targets.join(","))
        };
        let mut writes: Vec<String> = c
            .targets
            .iter()
            .map(|t| format!("prefill_decode/prefill_decode_{t}.bin"))
            .collect();
        writes.push("prefill_decode/manifest.json".into());
        stages.push(Stage {
            name: format!("compile shared decode_wgqa+trunk {}", c.targets.join(",")),
            settings: json!({"toolchain": "ort-qnn", "targets": c.targets}),
            reads: vec![
                d.join("decode_wgqa.onnx"),
                d.join("decode_wgqa.data"),
                t.join("trunk.onnx"),
                t.join("trunk.data"),
            ],
            writes,
            run: Box::new(move || compile::run(ca)),
        });
        for t in c.targets.iter().filter(|_| c.genie) {
            let ga = hexq_compile::genie::GenieArgs {
                dir: out.join("prefill_decode"),
                out: out.join(format!("genie/{t}")),
                target: Some(t.clone()),
                force: true,
            };
            std::fs::create_dir_all(out.join("genie"))?;
            stages.push(Stage {
                name: format!("genie {t}"),
                settings: json!({}),
                // The shared manifest holds every input's hash (binary, graphs, sources).
                reads: vec![out.join("prefill_decode/manifest.json")],
                writes: vec![
                    format!("genie/{t}/genie_config.json"),
                    format!("genie/{t}/SHA256SUMS"),
                ],
                run: Box::new(move || Ok(hexq_compile::genie::bundle(&ga).map(|_| ())?)),
            });
        }
        Ok(stages)
    }

    /// One GGUF file.
    fn gguf_stage(&self, g: &GgufCfg) -> Result<Stage> {
        let (out, m) = (self.out, &self.m);
        let ty: hexq_export::gguf::FileType =
            clap::ValueEnum::from_str(&g.ty, true).map_err(|e| anyhow!("{e}"))?;
        let f = format!(
            "gguf/model-{}{}.gguf",
            g.ty.to_lowercase(),
            if g.pure { "-pure" } else { "" }
        );
        std::fs::create_dir_all(out.join("gguf"))?;
        let mut ga = gguf::Args::new(m.clone(), ty, g.pure, out.join(&f));
        ga.force = true;
        Ok(Stage {
            name: format!("gguf {}{}", g.ty, if g.pure { " --pure" } else { "" }),
            settings: json!({"type": g.ty, "pure": g.pure}),
            reads: self.weights.clone(),
            writes: vec![f],
            run: Box::new(move || gguf::run(ga)),
        })
    }
}

/// A stage's input as keys and manifests name it, independent of where the build, the checkpoint or the
/// working directory are: relative to the build directory (`out/…` there), `model/…` for the checkpoint's
/// files, else as the recipe gives it (a dataset path relative to the working directory).
fn named(p: &Path, out: &Path, model: &Path) -> String {
    let rel = |base: &Path, tag: &str| {
        p.strip_prefix(base)
            .ok()
            .map(|r| format!("{tag}/{}", r.display()))
    };
    rel(out, "out")
        .or_else(|| rel(model, "model"))
        .unwrap_or_else(|| p.display().to_string())
}

/// Each stage run unless its stamp says its inputs and outputs are unchanged: the status table and the
/// manifest's stage entries.
fn run_stages(stages: Vec<Stage>, out: &Path, model: &Path) -> Result<(Vec<Value>, Vec<Value>)> {
    let n = stages.len();
    let mut table = Vec::new();
    let mut manifest_stages = Vec::new();
    let mut seen = std::collections::HashMap::new();
    let mut saved = 0u64;
    for (k, s) in stages.into_iter().enumerate() {
        let mut h = String::new();
        h += &format!(
            "hexq {}\nstage {}\nsettings {}\n",
            env!("CARGO_PKG_VERSION"),
            s.name,
            s.settings
        );
        for p in &s.reads {
            h += &format!("{}  {}\n", hash_path(p)?, named(p, out, model));
        }
        let key = hexq_fsutil::sha256_bytes(h.as_bytes());
        let stamp_p = out
            .join(".stamps")
            .join(format!("{}.json", s.name.replace([' ', ',', '+'], "_")));
        let stamp: Option<Stamp> = std::fs::read(&stamp_p)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok());
        let current = |w: &[String]| -> Result<Vec<(String, String)>> {
            w.iter()
                .map(|f| Ok((f.clone(), hash_path(&out.join(f))?)))
                .collect()
        };
        let fresh = match &stamp {
            Some(st) if st.key == key => {
                s.writes.iter().all(|f| out.join(f).exists()) && current(&s.writes)? == st.outputs
            }
            _ => false,
        };
        let t0 = std::time::Instant::now();
        hexq_fsutil::rss::reset();
        let status = if fresh {
            eprintln!("[{}/{n}] {}: up to date", k + 1, s.name);
            hexq_fsutil::link_identical(&build_files(out)?, &mut seen)?;
            "reused"
        } else {
            eprintln!("[{}/{n}] {}", k + 1, s.name);
            let _ = std::fs::remove_file(&stamp_p);
            // The stages' own reports go to stderr: stdout carries only the build's (--json).
            let quiet = super::StdoutToStderr::new();
            let r = (s.run)().with_context(|| format!("stage {}", s.name));
            drop(quiet);
            r?;
            // After every stage, not once at the end: at E2B size the copies would not fit the disk.
            saved += hexq_fsutil::link_identical(&build_files(out)?, &mut seen)?;
            let outputs = current(&s.writes)?;
            write_atomic(
                &stamp_p,
                &serde_json::to_vec_pretty(&Stamp {
                    key: key.clone(),
                    outputs,
                })?,
            )?;
            "ran"
        };
        let outputs = current(&s.writes)?;
        let peak = (status == "ran")
            .then(hexq_fsutil::rss::peak_kib)
            .flatten()
            .map(|k| (k as f64 / 1024.0).round());
        table.push(json!({"stage": s.name, "status": status, "seconds": (t0.elapsed().as_secs_f64() * 10.0).round() / 10.0, "peak_rss_mib": peak}));
        manifest_stages.push(json!({"stage": s.name, "settings": s.settings, "inputs_key": key,
            "inputs": s.reads.iter().map(|p| Ok(json!({"path": named(p, out, model), "sha256": hash_path(p)?}))).collect::<Result<Vec<_>>>()?,
            "outputs": outputs.iter().map(|(p, h)| json!({"path": p, "sha256": h})).collect::<Vec<_>>()}));
    }
    if saved > 0 {
        eprintln!(
            "{:.2} GB of identical outputs stored once (hard links)",
            saved as f64 / 1e9
        );
    }
    Ok((table, manifest_stages))
}

/// Every file of the build directory but the stamps.
fn build_files(out: &Path) -> Result<Vec<PathBuf>> {
    Ok(hexq_fsutil::list_files(out)?
        .into_iter()
        .filter(|f| !f.starts_with(".stamps"))
        .map(|f| out.join(f))
        .collect())
}

/// The stage table: JSON on stdout, or markdown on stderr.
fn report(json: bool, table: &[Value], out: &Path) -> Result<()> {
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(
                &json!({"stages": table, "out": out.display().to_string()})
            )?
        );
    } else {
        eprintln!("\n| stage | status | seconds | peak RSS (MiB) |\n|---|---|---|---|");
        for t in table {
            eprintln!(
                "| {} | {} | {} | {} |",
                t["stage"].as_str().unwrap_or(""),
                t["status"].as_str().unwrap_or(""),
                t["seconds"],
                t["peak_rss_mib"]
                    .as_f64()
                    .map_or("–".into(), |m| m.to_string())
            );
        }
        eprintln!("{} (build-manifest.json)", out.display());
    }
    Ok(())
}

fn python_version(module: &str) -> String {
    std::process::Command::new("python3")
        .args([
            "-c",
            &format!(
                "import importlib.metadata as m; print(m.version('{}'))",
                module.replace('_', "-")
            ),
        ])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "not installed".into())
}
