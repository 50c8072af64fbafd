//! `hexq genie`: a Genie bundle (genie_config.json, HTP backend extension config, binary, tokenizer,
//! embedding LUTs) from a shared prefill+decode build (the work is in compile/src/genie.rs).

use anyhow::Result;
use std::path::PathBuf;

#[derive(clap::Args, Clone)]
pub struct Args {
    /// A shared build: `hexq compile --artifacts DECODE --artifacts TRUNK --target T --out DIR`.
    #[arg(long)]
    pub artifacts: PathBuf,
    /// The bundle directory to write (atomically).
    #[arg(long)]
    pub out: PathBuf,
    /// Which compiled target's binary to bundle (required when the build holds several).
    #[arg(long)]
    pub target: Option<String>,
    /// Replace an existing bundle directory.
    #[arg(long)]
    pub force: bool,
    /// Print the bundle manifest as JSON.
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: Args) -> Result<()> {
    let m = hexq_compile::genie::bundle(&hexq_compile::genie::GenieArgs {
        dir: a.artifacts,
        out: a.out.clone(),
        target: a.target,
        force: a.force,
    })?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&m)?);
        return Ok(());
    }
    let io: serde_json::Value =
        serde_json::from_slice(&std::fs::read(a.out.join("genie-io.json"))?)?;
    eprintln!(
        "{}: Genie bundle for {} ({} files)",
        a.out.display(),
        m["target"].as_str().unwrap_or(""),
        m["files_sha256"].as_object().map_or(0, |f| f.len())
    );
    let d = io["differences"].as_array().cloned().unwrap_or_default();
    if !d.is_empty() {
        eprintln!(
            "Genie cannot drive these graphs as exported — {} I/O differences (genie-io.json):",
            d.len()
        );
        for x in d {
            eprintln!(
                "  - Genie expects {}; hexq has {}",
                x["genie_expects"].as_str().unwrap_or(""),
                x["hexq_graph_has"].as_str().unwrap_or("")
            );
        }
    }
    Ok(())
}
