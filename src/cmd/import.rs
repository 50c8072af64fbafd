//! `hexq import`: a GGUF into a Hugging Face-layout checkpoint (config, safetensors, tokenizer, template).

use super::progress;
use anyhow::Result;
use clap::ValueEnum;
use hexq_import::OutDType;
use std::path::PathBuf;

#[derive(clap::Args, Clone)]
pub struct Args {
    /// The GGUF to import (architecture gemma3; SentencePiece vocabulary).
    #[arg(long)]
    pub gguf: PathBuf,
    /// Output checkpoint directory (built in a temporary directory, renamed when complete).
    #[arg(long)]
    pub out: PathBuf,
    /// Weight storage.
    #[arg(long, value_enum, default_value_t = Weights::F32)]
    pub dtype: Weights,
    /// Replace an existing output directory.
    #[arg(long)]
    pub force: bool,
    #[arg(long)]
    pub json: bool,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Weights {
    /// f32: the dequantized values exactly (what transformers loads from the GGUF).
    F32,
    /// bf16: half the size; norms and weights rounded.
    Bf16,
}

pub fn run(a: Args) -> Result<()> {
    let staging = hexq_fsutil::AtomicDir::create(&a.out, a.force)?;
    let len = std::fs::metadata(&a.gguf).map(|m| m.len()).unwrap_or(0);
    let pb = progress(len, "import");
    let t0 = std::time::Instant::now();
    let dt = match a.dtype {
        Weights::F32 => OutDType::F32,
        Weights::Bf16 => OutDType::Bf16,
    };
    let r = hexq_import::import(&a.gguf, &staging.tmp, dt, &|n| pb.inc(n))?;
    pb.finish_and_clear();
    let dest = staging.commit()?;
    let secs = t0.elapsed().as_secs_f64();
    if a.json {
        let files: Vec<_> = r
            .files
            .iter()
            .map(|(f, b, h)| serde_json::json!({"path": f, "bytes": b, "sha256": h}))
            .collect();
        let v = serde_json::json!({"dir": dest, "architecture": r.arch, "tensors": r.tensors, "files": files, "seconds": secs});
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        for (f, b, _) in &r.files {
            println!("{b:>14}  {f}");
        }
        eprintln!(
            "{}: {} {} tensors ({secs:.1}s)",
            dest.display(),
            r.arch,
            r.tensors
        );
    }
    Ok(())
}
