//! `hexq gguf`: a GGUF llama.cpp loads, streamed from the safetensors, and its manifest.

use super::{checkpoint_bytes, model_dir, progress};
use anyhow::Result;
use hexq_export::gguf::{self, FileType};
use hexq_model::Checkpoint;
use serde_json::json;
use std::path::PathBuf;

#[derive(clap::Args, Clone)]
pub struct Args {
    /// Checkpoint directory (config.json + safetensors); default: the bundled tiny Gemma-4.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// File type (q4_0 = llama-quantize's Q4_0 mix: q6_K token embeddings, q4_0 elsewhere).
    #[arg(long = "type", value_enum, default_value_t = FileType::Q4_0)]
    pub ty: FileType,
    /// Every 2-D weight q4_0 (llama-quantize --pure).
    #[arg(long)]
    pub pure: bool,
    /// An importance matrix (hexq imatrix or llama-imatrix; GGUF or legacy .dat): q4_0 blocks quantized
    /// with its weights as `llama-quantize --imatrix` does.
    #[arg(long)]
    pub imatrix: Option<PathBuf>,
    #[arg(long)]
    pub out: PathBuf,
    #[arg(long)]
    pub force: bool,
    #[arg(long)]
    pub json: bool,
}

impl Args {
    pub fn new(model: Option<PathBuf>, ty: FileType, pure: bool, out: PathBuf) -> Self {
        Args {
            model,
            ty,
            pure,
            imatrix: None,
            out,
            force: false,
            json: false,
        }
    }
}

pub fn run(a: Args) -> Result<()> {
    let out = &a.out;
    super::refuse_existing(out, a.force)?;
    let dir = model_dir(a.model.clone())?;
    let ck = Checkpoint::open(&dir)?;
    let pb = progress(checkpoint_bytes(&ck), "gguf");
    let t0 = std::time::Instant::now();
    let tick = |n: u64| pb.inc(n);
    let imp = match &a.imatrix {
        Some(p) => Some(gguf::Importance::read(p).map_err(|e| anyhow::anyhow!("{e}"))?),
        None => None,
    };
    let (plan, sha) = gguf::write_gguf(&ck, out, a.ty, a.pure, imp.as_ref(), &tick)?;
    pb.finish_and_clear();
    let mut types = std::collections::BTreeMap::new();
    for p in &plan {
        *types.entry(p.ty.name()).or_insert(0usize) += 1;
    }
    let m = json!({
        "hexq_version": env!("CARGO_PKG_VERSION"),
        "file": out.file_name().unwrap_or_default().to_string_lossy(),
        "bytes": std::fs::metadata(out)?.len(),
        "sha256": sha,
        "type": a.ty.name(), "pure": a.pure, "tensors": plan.len(), "tensor_types": types,
        "imatrix": match (&a.imatrix, &imp) {
            (Some(p), Some(i)) => json!({"file": i.file, "sha256": hexq_fsutil::sha256_file(p)?, "entries": i.weights.len()}),
            _ => serde_json::Value::Null,
        },
        // The source's identity without a second pass over 10 GB: config.json's SHA256 and each
        // safetensors file's size and header SHA256 (names, dtypes, shapes, offsets).
        "source": {"dir": hexq_fsutil::dir_name(&ck.dir), "identity": hexq_export::source_identity(&ck)?},
        // No wall time here: the same inputs write a byte-identical manifest (hexq build).
    });
    let mp = PathBuf::from(format!("{}.manifest.json", out.display()));
    hexq_fsutil::write_atomic(
        &mp,
        format!("{}\n", serde_json::to_string_pretty(&m)?).as_bytes(),
    )?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&m)?);
    } else {
        eprintln!(
            "{}: {} bytes, {} tensors {:?} ({:.1}s)",
            out.display(),
            m["bytes"],
            plan.len(),
            types,
            t0.elapsed().as_secs_f64()
        );
    }
    Ok(())
}
