//! `hexq compile`: an export → a QNN HTP context binary for a target (the work is in the compile crate).

use anyhow::Result;
use hexq_compile::Toolchain;
use std::path::PathBuf;

#[derive(clap::Args, Clone)]
pub struct Args {
    /// A `hexq export` directory (QDQ for ort-qnn; float + encodings for qairt). Twice — a decode export
    /// and a trunk export — with --out: one context binary per target holding both graphs, weights stored
    /// once (ort-qnn).
    #[arg(long, required = true)]
    pub artifacts: Vec<PathBuf>,
    /// v79 (SM8750), v81 (SM8850), v75 (SM8650): compile-scripts/htp_targets.json. A shared compile takes a
    /// comma-separated list (v79,v81).
    #[arg(long)]
    pub target: String,
    /// The shared build's directory (two --artifacts); a single export is compiled in place.
    #[arg(long)]
    pub out: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = Toolchain::OrtQnn)]
    pub toolchain: Toolchain,
    /// Write (qairt) or print (ort-qnn) what would run, without running it.
    #[arg(long)]
    pub dry_run: bool,
    /// qairt: decode steps of raw calibration inputs for --input_list.
    #[arg(long, default_value_t = 8)]
    pub calib_steps: usize,
    /// Replace an existing binary for the target.
    #[arg(long)]
    pub force: bool,
    #[arg(long)]
    pub json: bool,
}

impl Args {
    pub fn new(artifacts: PathBuf, target: &str) -> Self {
        Args {
            artifacts: vec![artifacts],
            target: target.into(),
            out: None,
            toolchain: Toolchain::OrtQnn,
            dry_run: false,
            calib_steps: 8,
            force: true,
            json: false,
        }
    }
}

pub fn run(a: Args) -> Result<()> {
    let targets: Vec<String> = a.target.split(',').map(|t| t.trim().to_string()).collect();
    match (a.artifacts.len(), &a.out) {
        (1, None) => {}
        (2, Some(out)) => {
            if a.toolchain != Toolchain::OrtQnn || a.dry_run {
                anyhow::bail!("a shared prefill+decode binary is compiled with --toolchain ort-qnn (no --dry-run)");
            }
            return Ok(hexq_compile::shared::compile_shared(
                hexq_compile::shared::SharedArgs {
                    dirs: a.artifacts,
                    out: out.clone(),
                    targets,
                    force: a.force,
                    json: a.json,
                },
            )?);
        }
        (2, None) => anyhow::bail!(
            "two --artifacts compile into one shared binary: give its directory with --out"
        ),
        (1, Some(_)) => anyhow::bail!(
            "--out is for a shared compile of two exports (a single export is compiled in place)"
        ),
        (n, _) => anyhow::bail!(
            "--artifacts given {n} times: one export, or a decode and a trunk export with --out"
        ),
    }
    if targets.len() != 1 {
        anyhow::bail!(
            "--target {}: one target per single-export compile",
            a.target
        );
    }
    Ok(hexq_compile::compile(hexq_compile::Args {
        dir: a.artifacts[0].clone(),
        target: a.target,
        toolchain: a.toolchain,
        dry_run: a.dry_run,
        force: a.force,
        json: a.json,
        calib_steps: a.calib_steps,
    })?)
}
