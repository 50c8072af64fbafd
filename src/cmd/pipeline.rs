//! `hexq pipeline`: the main job end to end, as the other commands run it, ending with a table of every
//! stage (ran / skipped and why / failed, seconds, output). Stages whose tool is not installed
//! (onnxruntime, onnxruntime-qnn) are skipped with the command that enables them, so the job passes on a
//! machine with only Rust and Python; a failed stage fails the job, and the stages that need its output are
//! skipped.

use super::{ablate, calibrate, compile, export, gguf, inspect, quantize, run, verify};
use anyhow::Result;
use hexq_export::gguf::FileType;
use hexq_graph::Variant;
use run::BackendKind;
use serde::Serialize;
use std::path::{Path, PathBuf};

#[derive(clap::Args, Clone)]
pub struct Args {
    /// Checkpoint directory (config.json + safetensors); default: the bundled tiny Gemma-4.
    #[arg(long)]
    pub model: Option<PathBuf>,
    #[arg(long, default_value = "out/pipeline")]
    pub out: PathBuf,
    /// Calibration prompts used (of datasets/calibration.jsonl).
    #[arg(long, default_value_t = 64, value_parser = super::positive)]
    pub calib_limit: usize,
    /// Held-out prompts verified.
    #[arg(long, default_value_t = 24, value_parser = super::positive)]
    pub verify_limit: usize,
    #[arg(long, default_value_t = 512, value_parser = super::positive)]
    pub context: usize,
    /// Print the stage table as JSON (on stdout, after the stages' own output).
    #[arg(long)]
    pub json: bool,
    /// Run the HTP simulator stages: auto = only for decoders up to 20 M weights (the simulator runs ~12 M
    /// weights/s, so a larger model costs minutes per token).
    #[arg(long, value_enum, default_value_t = Qnn::Auto)]
    pub qnn: Qnn,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Qnn {
    Auto,
    On,
    Off,
}

/// Decoder weights above which `--qnn auto` skips the HTP simulator.
const SIMULATOR_MAX_WEIGHTS: usize = 20_000_000;

/// Why the QNN stages do not run on this model under `--qnn`, if they do not.
fn qnn_off(a: &Args) -> Option<String> {
    let weights = super::model_dir(a.model.clone())
        .and_then(|d| Ok(hexq_model::ModelConfig::from_file(&d.join("config.json"))?))
        .map(|c| hexq_model::names::param_counts(&c).decoder)
        .unwrap_or(0);
    match a.qnn {
        Qnn::On => None,
        Qnn::Off => Some("--qnn off".into()),
        Qnn::Auto if weights > SIMULATOR_MAX_WEIGHTS => Some(format!(
            "{:.0} M decoder weights: the HTP simulator (~12 M weights/s) would take minutes per token; --qnn on runs it",
            weights as f64 / 1e6
        )),
        Qnn::Auto => None,
    }
}

const PROMPT: &str = "What is the capital of France?";
const ORT_HINT: &str =
    "python3 -m pip install onnxruntime (or set ORT_DYLIB_PATH to a libonnxruntime.so)";
const QNN_HINT: &str = "python3 -m pip install onnxruntime-qnn==2.7.0";

#[derive(Serialize)]
#[serde(rename_all = "lowercase", tag = "status", content = "reason")]
enum Status {
    Ran,
    Skipped(String),
    Failed(String),
}

#[derive(Serialize)]
struct Stage {
    stage: String,
    #[serde(flatten)]
    status: Status,
    seconds: f64,
    output: Option<PathBuf>,
}

/// The stages run so far; `stage` runs one unless a prerequisite is missing.
#[derive(Default)]
struct Stages(Vec<Stage>);

impl Stages {
    /// Run `f` as stage `name` writing `output`, unless `needs` names a reason not to (a missing tool, a
    /// failed stage upstream). Returns whether it ran and succeeded.
    fn stage(
        &mut self,
        name: &str,
        output: Option<&Path>,
        needs: Option<String>,
        f: impl FnOnce() -> Result<()>,
    ) -> bool {
        let t0 = std::time::Instant::now();
        let status = match needs {
            Some(why) => Status::Skipped(why),
            None => {
                eprintln!("== {name}");
                match f() {
                    Ok(()) => Status::Ran,
                    Err(e) => {
                        eprintln!("error: {name}: {e:#}");
                        Status::Failed(format!("{e:#}"))
                    }
                }
            }
        };
        let ok = matches!(status, Status::Ran);
        self.0.push(Stage {
            stage: name.into(),
            status,
            seconds: t0.elapsed().as_secs_f64(),
            output: output.filter(|_| ok).map(Path::to_path_buf),
        });
        ok
    }

    /// `None` if every named stage ran, else the reason to skip a stage that needs them.
    fn after(&self, names: &[&str]) -> Option<String> {
        let bad: Vec<&str> = names
            .iter()
            .copied()
            .filter(|n| {
                !self
                    .0
                    .iter()
                    .any(|s| s.stage == *n && matches!(s.status, Status::Ran))
            })
            .collect();
        (!bad.is_empty()).then(|| format!("needs {} (did not run)", bad.join(", ")))
    }

    fn table(&self) -> String {
        let mut s = String::from("| stage | status | seconds | output |\n|---|---|---|---|\n");
        for st in &self.0 {
            let status = match &st.status {
                Status::Ran => "ran".to_string(),
                Status::Skipped(w) => format!("skipped: {w}"),
                Status::Failed(e) => format!("FAILED: {}", e.lines().next().unwrap_or_default()),
            };
            let out = st
                .output
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or("-".into());
            s += &format!("| {} | {status} | {:.1} | {out} |\n", st.stage, st.seconds);
        }
        s
    }
}

/// Why a stage that needs onnxruntime (or onnxruntime-qnn) cannot run here, if it cannot.
fn missing_ort() -> Option<String> {
    hexq_runtime::ort::find_onnxruntime()
        .err()
        .map(|_| format!("onnxruntime not installed; enable with: {ORT_HINT}"))
}

fn missing_qnn() -> Option<String> {
    let ort = hexq_runtime::ort::find_onnxruntime().is_ok();
    let qnn = hexq_runtime::ort::find_qnn().is_ok();
    match (ort, qnn) {
        (true, true) => None,
        (true, false) => Some(format!(
            "onnxruntime-qnn not installed; enable with: {QNN_HINT}"
        )),
        _ => Some(format!(
            "onnxruntime and onnxruntime-qnn not installed; enable with: {QNN_HINT} onnxruntime"
        )),
    }
}

pub fn run(a: Args) -> Result<()> {
    std::fs::create_dir_all(&a.out).map_err(|e| anyhow::anyhow!("{}: {e}", a.out.display()))?;
    let mut s = Stages::default();
    quantized_builds(&a, &mut s);
    qdq_runs(&a, &mut s);
    host_formats(&a, &mut s);
    let failed =
        s.0.iter()
            .filter(|x| matches!(x.status, Status::Failed(_)))
            .count();
    if a.json {
        println!("{}", serde_json::to_string_pretty(&s.0)?);
    }
    eprintln!("\n{}", s.table());
    eprintln!("artifacts in {}", a.out.display());
    if failed > 0 {
        anyhow::bail!("{failed} pipeline stage(s) failed (see the table above)");
    }
    Ok(())
}

/// inspect, generate (cpu, graph), calibrate, A16W8 (+ int8 KV) encodings, quantsim verify, QDQ exports.
fn quantized_builds(a: &Args, s: &mut Stages) {
    let (m, out, ctx) = (&a.model, &a.out, a.context);
    let st = out.join("stats.decode_wgqa.json");
    let enc = out.join("decode_wgqa.encodings.json");
    let enc8 = out.join("decode_wgqa_int8kv.encodings.json");
    let ins = inspect::Args {
        model: m.clone(),
        tensors: false,
        json: false,
    };
    s.stage("inspect", None, None, || inspect::run(ins));
    for (name, b) in [
        ("run cpu", BackendKind::Cpu),
        ("run graph", BackendKind::Graph),
    ] {
        let mut r = run::Args::new(m.clone(), b, PROMPT, 16);
        r.b.context = ctx;
        s.stage(name, None, None, || run::run(r));
    }
    // The pipeline owns its --out directory: each stage replaces its output.
    let c = calibrate::Args {
        force: true,
        ..calibrate::Args::new(
            m.clone(),
            "datasets/calibration.jsonl".into(),
            a.calib_limit,
            ctx,
            st.clone(),
        )
    };
    s.stage("calibrate decode_wgqa", Some(&st), None, || {
        calibrate::run(c)
    });
    for (name, e, int8) in [
        ("quantize a16w8", &enc, false),
        ("quantize a16w8 int8-kv", &enc8, true),
    ] {
        let q = quantize::Args {
            force: true,
            ..quantize::Args::new(m.clone(), st.clone(), int8, e.clone())
        };
        s.stage(name, Some(e), s.after(&["calibrate decode_wgqa"]), || {
            quantize::run(q)
        });
    }
    for (name, e, q) in [
        ("verify a16w8", &enc, "quantize a16w8"),
        ("verify a16w8 int8-kv", &enc8, "quantize a16w8 int8-kv"),
    ] {
        let v = verify::Args {
            encodings: Some(e.clone()),
            stats: Some(st.clone()),
            ..verify::Args::new(
                m.clone(),
                "datasets/heldout.jsonl".into(),
                a.verify_limit,
                8,
            )
        };
        s.stage(name, None, s.after(&[q]), || verify::run(v));
    }
    for (v, e, q) in [
        (Variant::DecodeWgqa, &enc, "quantize a16w8"),
        (Variant::DecodeWgqaInt8kv, &enc8, "quantize a16w8 int8-kv"),
    ] {
        let dir = out.join(format!("{v}.qdq"));
        let x = export::Args {
            encodings: Some(e.clone()),
            qdq: true,
            force: true,
            ..export::Args::new(m.clone(), v, ctx, dir.clone())
        };
        s.stage(
            &format!("export {v} qdq"),
            Some(&dir),
            s.after(&[q]),
            || export::run(x),
        );
    }
    let dir = out.join("trunk");
    let x = export::Args {
        force: true,
        ..export::Args::new(m.clone(), Variant::Trunk, ctx, dir.clone())
    };
    s.stage("export trunk float", Some(&dir), None, || export::run(x));
}

/// The QDQ export in onnxruntime; compiled for v79 and v81 and run + verified on the HTP simulator.
fn qdq_runs(a: &Args, s: &mut Stages) {
    let (m, ctx) = (&a.model, a.context);
    let d = a.out.join("decode_wgqa.qdq");
    let exported = "export decode_wgqa qdq";
    let mut r = run::Args::new(m.clone(), BackendKind::Ort, PROMPT, 16);
    r.b.context = ctx;
    r.b.artifacts = vec![d.clone()];
    s.stage(
        "run ort (qdq decode_wgqa)",
        None,
        s.after(&[exported]).or_else(missing_ort),
        || run::run(r),
    );
    // The QDQ graph against hexq's quantsim on the held-out prompts (the issue-6 bars: same top-1,
    // cosine ≥ 0.9999), with quantsim vs float as the baseline.
    let v = verify::Args {
        backend: verify::Backend::Ort,
        artifacts: vec![d.clone()],
        ..verify::Args::new(
            m.clone(),
            "datasets/heldout.jsonl".into(),
            a.verify_limit,
            8,
        )
    };
    s.stage(
        "verify ort (qdq decode_wgqa vs quantsim)",
        None,
        s.after(&[exported]).or_else(missing_ort),
        || verify::run(v),
    );
    let mut compiled = vec![];
    for t in ["v79", "v81"] {
        let name = format!("compile decode_wgqa {t}");
        let bin = d.join(format!("decode_wgqa_{t}.bin"));
        let c = compile::Args::new(d.clone(), t);
        s.stage(
            &name,
            Some(&bin),
            s.after(&[exported])
                .or_else(|| qnn_off(a))
                .or_else(missing_qnn),
            || compile::run(c),
        );
        let mut r = run::Args::new(m.clone(), BackendKind::Qnn, PROMPT, 8);
        r.b.context = ctx;
        r.b.artifacts = vec![d.clone()];
        r.b.target = t.into();
        s.stage(
            &format!("run qnn {t} (HTP simulator)"),
            None,
            s.after(&[&name]),
            || run::run(r),
        );
        compiled.push(name);
    }
    let v = verify::Args {
        backend: verify::Backend::Qnn,
        artifacts: vec![d.clone()],
        ..verify::Args::new(m.clone(), "datasets/heldout.jsonl".into(), 4, 4)
    };
    let names: Vec<&str> = compiled.iter().map(String::as_str).collect();
    s.stage(
        "verify qnn v79,v81 (HTP simulator)",
        None,
        s.after(&names),
        || verify::run(v),
    );
}

/// GGUF q4_0 (--pure, the published 4-bit mix) and f16; the weight-grid ablation.
fn host_formats(a: &Args, s: &mut Stages) {
    let m = &a.model;
    // llama.cpp's gemma3 vocabulary comes from SentencePiece's tokenizer.model (the tiny Gemma-3 fixture
    // borrows Gemma-4's BPE tokenizer and has none).
    let dir = super::model_dir(m.clone()).ok();
    let arch = dir
        .as_ref()
        .and_then(|d| hexq_model::ModelConfig::from_file(&d.join("config.json")).ok())
        .map(|c| c.arch);
    let spm = dir
        .as_ref()
        .is_some_and(|d| d.join("tokenizer.model").is_file());
    let no_gguf = (arch == Some(hexq_model::config::Arch::Gemma3) && !spm).then(|| {
        "llama.cpp's gemma3 vocabulary is read from tokenizer.model, which this model lacks"
            .to_string()
    });
    for (name, ty, pure, file) in [
        (
            "gguf q4_0 --pure",
            FileType::Q4_0,
            true,
            "model-q4_0-pure.gguf",
        ),
        ("gguf f16", FileType::F16, false, "model-f16.gguf"),
    ] {
        let p = a.out.join(file);
        let g = gguf::Args {
            force: true,
            ..gguf::Args::new(m.clone(), ty, pure, p.clone())
        };
        s.stage(name, Some(&p), no_gguf.clone(), || gguf::run(g));
    }
    let svg = a.out.join("ablate.svg");
    // Random weights have no outlier channels: the bundled model's ablation imitates them; a real
    // checkpoint's is run as it is.
    let heavy = a.model.is_none();
    // A real checkpoint's builds beside the grids (perplexity and every position's figures for A16W8 and
    // its int8-KV variant); on heavy-tailed weights the encodings would describe other weights.
    let builds = [
        ("a16w8", "decode_wgqa.encodings.json"),
        ("a16w8-int8kv", "decode_wgqa_int8kv.encodings.json"),
    ]
    .into_iter()
    .map(|(n, f)| (n, a.out.join(f)))
    .filter(|(_, f)| !heavy && f.is_file())
    .map(|(n, f)| format!("{n}={}", f.display()))
    .collect();
    let ab = ablate::Args {
        heavy_tail: heavy,
        builds,
        plot: Some(svg.clone()),
        ..ablate::Args::new(
            m.clone(),
            "datasets/heldout.jsonl".into(),
            a.verify_limit,
            a.context,
        )
    };
    s.stage(
        if heavy {
            "ablate (heavy-tailed input channels)"
        } else {
            "ablate"
        },
        Some(&svg),
        None,
        || ablate::run(ab),
    );
}
