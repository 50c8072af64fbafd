//! One file per subcommand: each has a `clap::Args` struct and a `run(args)`; `pipeline` calls the others
//! with those same structs. What more than one command needs lives here.

pub mod ablate;
pub mod build;
pub mod calibrate;
pub mod chat;
pub mod compile;
pub mod export;
pub mod genie;
pub mod gguf;
pub mod graph;
pub mod imatrix;
pub mod import;
pub mod inspect;
pub mod mmlu;
pub mod perplexity;
pub mod pipeline;
pub mod quantize;
pub mod rounding;
pub mod run;
pub mod serve;
pub mod synth;
pub mod verify;

use anyhow::Result;
use std::path::{Path, PathBuf};

/// Size rayon's pool (the weight multiplies): `n` threads, 0 = one per core. Set once per process.
pub fn set_threads(n: usize) {
    if n > 0 {
        let _ = rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global();
    }
}

/// A count that must be at least 1 (`--context`, `--seq`, `--limit`…): 0 is refused by clap (exit 2) before
/// it can reach a graph builder or an empty table.
pub fn positive(s: &str) -> std::result::Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// `--model`, or the bundled tiny Gemma-4 when none is given.
/// The one output policy: an existing `--out` is replaced only with `--force`.
pub fn refuse_existing(out: &Path, force: bool) -> Result<()> {
    if out.exists() && !force {
        anyhow::bail!(
            "{}: already exists (pass --force to replace it)",
            out.display()
        );
    }
    Ok(())
}

/// A graph context must fit the model's positions (a larger one would allocate KV and masks for positions
/// the model cannot address — and, from a bad file, abort on allocation).
pub fn check_context(
    cfg: &hexq_model::ModelConfig,
    context: usize,
    source: &Path,
    field: &str,
) -> Result<()> {
    if context > cfg.max_position_embeddings {
        anyhow::bail!(
            "{}: {field} {context} exceeds the model's max_position_embeddings {}",
            source.display(),
            cfg.max_position_embeddings
        );
    }
    Ok(())
}

/// A trunk graph of SEQ positions writes SEQ KV slots per call: more than the context holds is no graph.
pub fn check_seq(variant: hexq_graph::Variant, context: usize, seq: usize) -> Result<()> {
    if variant == hexq_graph::Variant::Trunk && seq > context {
        anyhow::bail!(
            "--seq {seq} exceeds --context {context}: a trunk chunk must fit the KV it writes"
        );
    }
    Ok(())
}

pub fn model_dir(m: Option<PathBuf>) -> Result<PathBuf> {
    match m {
        Some(p) => Ok(p),
        None => crate::bundled::tiny_gemma4_dir(),
    }
}

/// A byte-counting progress bar (exports, GGUF, synth).
pub fn progress(len: u64, msg: &str) -> indicatif::ProgressBar {
    bar(
        len,
        msg,
        "{msg} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
    )
}

/// A prompt-counting progress bar (calibrate, verify, ablate).
pub fn count_progress(msg: &str) -> indicatif::ProgressBar {
    bar(0, msg, "{msg} [{bar:40}] {pos}/{len} prompts, eta {eta}")
}

/// A position-counting progress bar with throughput (ablate: every position of every pass).
pub fn position_progress(msg: &str) -> indicatif::ProgressBar {
    bar(
        0,
        msg,
        "{msg} [{bar:40}] {pos}/{len} positions, {per_sec}, eta {eta}",
    )
}

fn bar(len: u64, msg: &str, template: &str) -> indicatif::ProgressBar {
    let pb = indicatif::ProgressBar::new(len);
    pb.set_style(
        indicatif::ProgressStyle::with_template(template)
            .expect("a valid template")
            .progress_chars("=> "),
    );
    pb.set_message(msg.to_string());
    pb
}

pub fn read_json<T: serde::de::DeserializeOwned>(p: &Path) -> Result<T> {
    let t = std::fs::read_to_string(p).map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?;
    serde_json::from_str(&t).map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))
}

pub fn write_json<T: serde::Serialize>(p: &Path, v: &T) -> Result<()> {
    let mut s = serde_json::to_string_pretty(v)?;
    s.push('\n');
    Ok(hexq_fsutil::write_atomic(p, s.as_bytes())?)
}

/// Bytes of every tensor in a checkpoint (what a streaming writer will read).
pub fn checkpoint_bytes(ck: &hexq_model::Checkpoint) -> u64 {
    ck.tensors
        .iter()
        .map(|(_, i)| (i.end - i.start) as u64)
        .sum()
}

/// Points fd 1 at stderr while alive: the QNN HTP simulator library prints a banner on stdout through C
/// stdio, which would corrupt `--json`; on drop C's buffers are flushed (to stderr) and fd 1 restored.
pub struct StdoutToStderr(i32);
impl StdoutToStderr {
    pub fn new() -> Self {
        use std::io::Write;
        let _ = std::io::stdout().flush();
        unsafe {
            let saved = libc::dup(1);
            libc::dup2(2, 1);
            StdoutToStderr(saved)
        }
    }
}
impl Drop for StdoutToStderr {
    fn drop(&mut self) {
        use std::io::Write;
        let _ = std::io::stdout().flush();
        unsafe {
            libc::fflush(std::ptr::null_mut());
            libc::dup2(self.0, 1);
            libc::close(self.0);
        }
    }
}
