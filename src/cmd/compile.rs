//! `hexq compile`: an export → a QNN HTP context binary for a target (the work is in the compile crate).

use anyhow::Result;
use hexq_compile::Toolchain;
use std::path::PathBuf;

#[derive(clap::Args, Clone)]
pub struct Args {
    /// A `hexq export` directory (QDQ for ort-qnn; float + encodings for qairt).
    #[arg(long)]
    pub artifacts: PathBuf,
    /// v79 (SM8750), v81 (SM8850), v75 (SM8650): compile-scripts/htp_targets.json.
    #[arg(long)]
    pub target: String,
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
            artifacts,
            target: target.into(),
            toolchain: Toolchain::OrtQnn,
            dry_run: false,
            calib_steps: 8,
            force: true,
            json: false,
        }
    }
}

pub fn run(a: Args) -> Result<()> {
    hexq_compile::compile(hexq_compile::Args {
        dir: a.artifacts,
        target: a.target,
        toolchain: a.toolchain,
        dry_run: a.dry_run,
        force: a.force,
        json: a.json,
        calib_steps: a.calib_steps,
    })
}
