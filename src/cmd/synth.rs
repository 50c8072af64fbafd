//! `hexq synth`: a random-weight bf16 checkpoint with the real names and shapes of a config.

use super::progress;
use anyhow::Result;
use serde_json::json;
use std::path::PathBuf;

#[derive(clap::Args, Clone)]
pub struct Args {
    /// A Gemma-4 config.json (e.g. ../shared/docs/e2b-config-inferred.json).
    #[arg(long)]
    pub config: PathBuf,
    #[arg(long)]
    pub out: PathBuf,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Largest shard in bytes (0 = a single file).
    #[arg(long, default_value_t = 4 << 30)]
    pub shard_bytes: u64,
    /// Replace an existing output directory.
    #[arg(long)]
    pub force: bool,
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: Args) -> Result<()> {
    let (config, out, as_json) = (a.config, a.out, a.json);
    let cfg = hexq_model::ModelConfig::from_file(&config)?;
    let total: u64 = hexq_model::names::expected_tensors(&cfg)
        .iter()
        .map(|t| t.numel() as u64 * 2)
        .sum();
    // Known up front: refuse before writing rather than fill the disk (an absurd hidden_size asks for PB).
    hexq_fsutil::ensure_space(&out, total)?;
    let pb = progress(total, "synth");
    let opt = hexq_model::synth::SynthOptions {
        seed: a.seed,
        max_shard_bytes: a.shard_bytes,
        force: a.force,
    };
    let t0 = std::time::Instant::now();
    let r = hexq_model::synth::synth(&config, &out, &opt, &pb)?;
    pb.finish_and_clear();
    let secs = t0.elapsed().as_secs_f64();
    if as_json {
        println!(
            "{}",
            serde_json::to_string_pretty(
                &json!({"dir": r.dir, "files": r.files, "tensors": r.tensors, "bytes": r.bytes, "seconds": secs})
            )?
        );
    } else {
        println!(
            "{}: {} tensors, {:.2} GiB bf16 in {} file(s), {:.1}s",
            r.dir.display(),
            r.tensors,
            r.bytes as f64 / (1u64 << 30) as f64,
            r.files.len(),
            secs
        );
    }
    Ok(())
}
