//! `hexq verify`: quantsim vs float on held-out prompts, or (`--backend qnn`) compiled binaries on the HTP
//! simulator vs float and quantsim.

use super::{count_progress, model_dir, read_json, StdoutToStderr};
use anyhow::Result;
use clap::ValueEnum;
use hexq_graph::{GraphOptions, Variant};
use hexq_model::chat::Tokenizer;
use hexq_model::Checkpoint;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(clap::Args, Clone)]
pub struct Args {
    /// Checkpoint directory (config.json + safetensors); default: the bundled tiny Gemma-4.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// quantsim: hexq's quantsim from --encodings; qnn: the compiled binaries of --artifacts on QNN HTP.
    #[arg(long, value_enum, default_value_t = Backend::Quantsim)]
    pub backend: Backend,
    /// Encodings from `hexq quantize` (the quantsim backend).
    #[arg(long, required_if_eq("backend", "quantsim"))]
    pub encodings: Option<PathBuf>,
    /// qnn backend: `hexq export --qdq` directories compiled by `hexq compile`.
    #[arg(long)]
    pub artifacts: Vec<PathBuf>,
    /// qnn backend: comma list of targets.
    #[arg(long, default_value = "v79,v81")]
    pub targets: String,
    /// Calibration stats: report held-out tensors outside their calibrated range.
    #[arg(long)]
    pub stats: Option<PathBuf>,
    #[arg(long, default_value = "datasets/heldout.jsonl")]
    pub dataset: PathBuf,
    #[arg(long, value_parser = super::positive)]
    pub limit: Option<usize>,
    /// Greedy decode steps compared token by token.
    #[arg(long, default_value_t = 8, value_parser = super::positive)]
    pub steps: usize,
    /// Quantsim, decode graphs: held-out prompts run side by side through float and quantsim, one batched
    /// graph run per step (weights read once per batch). The figures are the same for every batch size.
    #[arg(long, default_value_t = 16, value_parser = super::positive)]
    pub batch: usize,
    /// Worker threads for the weight multiplies (0 = one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    #[arg(long)]
    pub json: bool,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    /// hexq's quantsim (the graph interpreter with fake quantization).
    Quantsim,
    /// Compiled context binaries on QNN HTP (the simulator on x86-64).
    Qnn,
    /// QDQ exports in onnxruntime's CPU EP.
    Ort,
}

impl Args {
    pub fn new(model: Option<PathBuf>, dataset: PathBuf, limit: usize, steps: usize) -> Self {
        Args {
            model,
            backend: Backend::Quantsim,
            encodings: None,
            artifacts: vec![],
            targets: "v79,v81".into(),
            stats: None,
            dataset,
            limit: Some(limit),
            steps,
            batch: 16,
            threads: 0,
            json: false,
        }
    }
}

pub fn run(a: Args) -> Result<()> {
    match a.backend {
        Backend::Qnn | Backend::Ort => exports(a),
        Backend::Quantsim => quantsim(a),
    }
}

fn load(a: &Args) -> Result<(Arc<Checkpoint>, Tokenizer, Vec<hexq_model::dataset::Record>)> {
    let dir = model_dir(a.model.clone())?;
    let ck = Arc::new(Checkpoint::open(&dir)?);
    let tok = Tokenizer::from_dir(&dir)?;
    let mut recs = hexq_model::dataset::load_dataset(&a.dataset)?;
    if let Some(n) = a.limit {
        recs.truncate(n);
    }
    Ok((ck, tok, recs))
}

fn exports(a: Args) -> Result<()> {
    use hexq_runtime::ort::Ep;
    if a.artifacts.is_empty() {
        anyhow::bail!("--backend qnn/ort needs --artifacts DIR (a `hexq export --qdq` output; for qnn compiled by `hexq compile`)");
    }
    let (ck, tok, recs) = load(&a)?;
    let eps: Vec<Ep> = match a.backend {
        Backend::Ort => vec![Ep::Cpu],
        _ => a
            .targets
            .split(',')
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .map(|t| Ep::Qnn { target: t.into() })
            .collect(),
    };
    let quiet = StdoutToStderr::new();
    let (arts, steps) = (&a.artifacts, a.steps);
    let rows =
        hexq_eval::qnn::verify_exports(&ck, &tok, &recs, arts, &eps, steps, &count_progress)?;
    drop(quiet);
    if a.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        print!("{}", hexq_eval::qnn::markdown(&rows));
    }
    Ok(())
}

fn quantsim(a: Args) -> Result<()> {
    let encodings = a
        .encodings
        .clone()
        .ok_or_else(|| anyhow::anyhow!("verify needs --encodings F.json (from `hexq quantize`)"))?;
    let (ck, tok, recs) = load(&a)?;
    let enc: hexq_quantize::Encodings = read_json(&encodings)?;
    let st: Option<hexq_calibrate::Stats> = a.stats.as_deref().map(read_json).transpose()?;
    let v = enc.hexq["variant"]
        .as_str()
        .and_then(Variant::parse)
        .ok_or_else(|| anyhow::anyhow!("{}: no hexq.variant", encodings.display()))?;
    let o = GraphOptions {
        context: enc.hexq["context"].as_u64().unwrap_or(4096) as usize,
        seq: enc.hexq["seq"].as_u64().unwrap_or(128) as usize,
    };
    if o.context == 0 || o.seq == 0 {
        anyhow::bail!(
            "{}: hexq.context and hexq.seq must be positive",
            encodings.display()
        );
    }
    super::check_context(&ck.config, o.context, &encodings, "hexq.context")?;
    // The same validation `export` applies: names, kinds, bitwidths, scales, offsets, KV width.
    let g = hexq_graph::build(&ck.config, v, &o);
    // quantize --int8-kv keeps the decode_wgqa graph and marks the scheme.
    let int8kv =
        v == Variant::DecodeWgqaInt8kv || enc.hexq["scheme"].as_str() == Some("a16w8_int8kv");
    let float = hexq_export::check_encodings(&g, &enc, int8kv, &encodings, true)?;
    if float > 0 {
        eprintln!(
            "WARNING: {}: {float} float tensors have no encoding and stay float in quantsim",
            encodings.display()
        );
    }
    drop(g);
    super::set_threads(a.threads);
    let qck = match enc.hexq["rounding"]["weights"].is_string() {
        true => {
            let mut q = Checkpoint::open(&ck.dir)?;
            hexq_quantize::rounding::open_overlay(&mut q, &enc, &encodings)?;
            Arc::new(q)
        }
        false => ck.clone(),
    };
    let pb = count_progress("verify");
    let r = hexq_eval::verify::verify(
        ck,
        &qck,
        &tok,
        &recs,
        &enc,
        st.as_ref(),
        v,
        &o,
        a.steps,
        a.batch,
        &pb,
    )?;
    pb.finish_and_clear();
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        print!("{}", hexq_eval::verify::markdown(&r, st.is_some()));
    }
    if r.collapsed {
        anyhow::bail!("quantsim's final hidden norm collapsed to {:.3} of float (< 10 %): these encodings would produce noise", r.norm_ratio_min);
    }
    Ok(())
}
