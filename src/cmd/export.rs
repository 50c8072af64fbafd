//! `hexq export`: one variant's artifacts — ONNX (+ external data), encodings, host-model/, manifest.

use super::{checkpoint_bytes, model_dir, progress, read_json};
use anyhow::Result;
use clap::ValueEnum;
use hexq_export::host::HostDType;
use hexq_export::onnx::WeightType;
use hexq_graph::{GraphOptions, Variant};
use hexq_model::Checkpoint;
use std::path::PathBuf;

#[derive(clap::Args, Clone)]
pub struct Args {
    /// Checkpoint directory (config.json + safetensors); default: the bundled tiny Gemma-4.
    #[arg(long)]
    pub model: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = Variant::DecodeWgqa)]
    pub variant: Variant,
    #[arg(long, default_value_t = 4096, value_parser = super::positive)]
    pub context: usize,
    #[arg(long, default_value_t = 128, value_parser = super::positive)]
    pub seq: usize,
    /// Encodings from `hexq quantize` (written beside the graph; required for --qdq and int8kv).
    #[arg(long)]
    pub encodings: Option<PathBuf>,
    /// QuantizeLinear/DequantizeLinear graph from the encodings (onnxruntime / QNN HTP input).
    #[arg(long)]
    pub qdq: bool,
    /// Float weight storage: f32, or f16 with a Cast in the graph.
    #[arg(long, value_enum, default_value_t = WeightType::F32)]
    pub weights: WeightType,
    /// host-model/ tensor storage.
    #[arg(long, value_enum, default_value_t = Host::Native)]
    pub host: Host,
    #[arg(long)]
    pub out: PathBuf,
    /// Replace an existing output directory.
    #[arg(long)]
    pub force: bool,
    #[arg(long)]
    pub json: bool,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Host {
    /// The checkpoint's own dtype (bf16 for Gemma), bytes copied.
    Native,
    /// int8 per row.
    Int8,
    /// int4 per row.
    Int4,
    /// No host-model/.
    None,
}

impl Args {
    pub fn new(model: Option<PathBuf>, variant: Variant, context: usize, out: PathBuf) -> Self {
        Args {
            model,
            variant,
            context,
            seq: 128,
            encodings: None,
            qdq: false,
            weights: WeightType::F32,
            host: Host::Native,
            out,
            force: false,
            json: false,
        }
    }
}

pub fn run(a: Args) -> Result<()> {
    super::check_seq(a.variant, a.context, a.seq)?;
    let dir = model_dir(a.model.clone())?;
    let mut ck = Checkpoint::open(&dir)?;
    let enc = match &a.encodings {
        Some(p) => Some((p.as_path(), read_json::<hexq_quantize::Encodings>(p)?)),
        None => None,
    };
    // GPTQ's rounded weights are what the QDQ graph and the QNN compile must carry.
    if let Some((p, e)) = &enc {
        hexq_quantize::rounding::open_overlay(&mut ck, e, p)?;
    }
    let ck = std::sync::Arc::new(ck);
    let staging = hexq_fsutil::AtomicDir::create(&a.out, a.force)?;
    let t0 = std::time::Instant::now();
    let pb = progress(checkpoint_bytes(&ck), "export");
    let tick = |n: u64| pb.inc(n);
    let manifest = hexq_export::export(
        &ck,
        &staging.tmp,
        &hexq_export::Options {
            variant: a.variant,
            graph: GraphOptions {
                context: a.context,
                seq: a.seq,
            },
            encodings: enc,
            qdq: a.qdq,
            weights: a.weights,
            host: match a.host {
                Host::Native => Some(HostDType::Native),
                Host::Int8 => Some(HostDType::Int8),
                Host::Int4 => Some(HostDType::Int4),
                Host::None => None,
            },
            progress: Some(&tick),
            calibration: None,
        },
    )?;
    pb.finish_and_clear();
    let dest = staging.commit()?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&manifest)?);
    } else {
        for f in manifest["files"].as_array().into_iter().flatten() {
            println!(
                "{:>14}  {}",
                f["bytes"],
                f["path"].as_str().unwrap_or_default()
            );
        }
        eprintln!("{} ({:.1}s)", dest.display(), t0.elapsed().as_secs_f64());
    }
    Ok(())
}
