//! `hexq ablate`: weights-only grids (and whole builds' encodings) vs float, side by side (table, JSON/CSV,
//! SVG plot).

use super::{model_dir, position_progress};
use anyhow::Result;
use hexq_eval::ablate::{ablate, Build, Scheme};
use hexq_graph::GraphOptions;
use hexq_model::chat::Tokenizer;
use hexq_model::Checkpoint;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(clap::Args, Clone)]
pub struct Args {
    /// Checkpoint directory (config.json + safetensors); default: the bundled tiny Gemma-4.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Comma list of int8-pc, int4-pc, int4-pc-mlp-only, q4_0-g32, g64, g128, lpbq-b32, lpbq-b64, lpbq-b128.
    #[arg(
        long,
        value_delimiter = ',',
        value_parser = parse_scheme,
        default_value = ALL_SCHEMES
    )]
    pub schemes: Vec<Scheme>,
    /// A whole build as a row, NAME=FILE (repeatable): an encodings file from `hexq quantize` (A16W8,
    /// w4a16-lpbq, …) applied as `hexq verify` applies it — params and activations — over the same positions
    /// as the weights-only grids. `--schemes none` leaves only these rows.
    #[arg(long = "encodings", value_name = "NAME=FILE")]
    pub builds: Vec<String>,
    #[arg(long, default_value = "datasets/heldout.jsonl")]
    pub dataset: PathBuf,
    #[arg(long, default_value_t = 24, value_parser = super::positive)]
    pub limit: usize,
    /// Heavy-tailed input-channel scales folded into the weights (function-preserving; see README).
    #[arg(long)]
    pub heavy_tail: bool,
    #[arg(long, default_value_t = 512, value_parser = super::positive)]
    pub context: usize,
    /// Positions per batched run of the decode graph (weights read once per batch). The figures are the
    /// same for every batch size.
    #[arg(long, default_value_t = 16, value_parser = super::positive)]
    pub batch: usize,
    /// Worker threads for the weight multiplies (0 = one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    #[arg(long)]
    pub json: bool,
    #[arg(long)]
    pub csv: bool,
    /// Write the accuracy-vs-bits plot here (SVG).
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

fn parse_scheme(s: &str) -> Result<Scheme, String> {
    if s.trim() == "none" {
        // Filtered out in `run` (`--schemes none`: only the --encodings rows).
        return Ok(Scheme {
            name: "none".into(),
            grid: hexq_eval::ablate::Grid::PerChannel(8),
            mlp_only: false,
        });
    }
    Scheme::parse(s.trim()).ok_or_else(|| {
        format!("unknown scheme {s:?} (int8-pc, int4-pc, int4-pc-mlp-only, q4_0-g32, g64, g128, lpbq-b32, lpbq-b64, lpbq-b128)")
    })
}

pub const ALL_SCHEMES: &str = "int8-pc,int4-pc,q4_0-g32,g64,g128,int4-pc-mlp-only,lpbq-b64";

impl Args {
    pub fn new(model: Option<PathBuf>, dataset: PathBuf, limit: usize, context: usize) -> Self {
        Args {
            model,
            schemes: ALL_SCHEMES.split(',').filter_map(Scheme::parse).collect(),
            builds: vec![],
            dataset,
            limit,
            heavy_tail: false,
            context,
            batch: 16,
            threads: 0,
            json: false,
            csv: false,
            plot: None,
        }
    }
}

pub fn run(a: Args) -> Result<()> {
    let dir = model_dir(a.model.clone())?;
    let ck = Arc::new(Checkpoint::open(&dir)?);
    let tok = Tokenizer::from_dir(&dir)?;
    let recs = hexq_model::dataset::load_dataset(&a.dataset)?;
    let mut seqs = Vec::new();
    for r in recs.iter().take(a.limit) {
        let ids = match &r.messages {
            Some(m) => tok.encode_chat(m)?,
            None => anyhow::bail!(
                "{}: record {} is not chat-formatted",
                a.dataset.display(),
                r.id
            ),
        };
        seqs.push(ids.into_iter().take(a.context).collect::<Vec<u32>>());
    }
    let schemes: Vec<Scheme> = a
        .schemes
        .iter()
        .filter(|s| s.name != "none")
        .cloned()
        .collect();
    let mut builds = Vec::new();
    for b in &a.builds {
        let (name, file) = b
            .split_once('=')
            .filter(|(n, f)| !n.is_empty() && !f.is_empty())
            .ok_or_else(|| anyhow::anyhow!("--encodings {b:?}: expected NAME=FILE"))?;
        let enc = hexq_quantize::Encodings::from_file(std::path::Path::new(file))?;
        // GPTQ's rounded weights (SQNR is then measured against them, not the checkpoint's).
        let weights = match enc.hexq["rounding"]["weights"].is_string() {
            true => {
                let mut q = hexq_model::Checkpoint::open(&ck.dir)?;
                hexq_quantize::rounding::open_overlay(&mut q, &enc, std::path::Path::new(file))?;
                Some(std::sync::Arc::new(q))
            }
            false => None,
        };
        builds.push(Build {
            name: name.into(),
            enc,
            weights,
        });
    }
    anyhow::ensure!(
        !schemes.is_empty() || !builds.is_empty(),
        "nothing to compare: --schemes none and no --encodings"
    );
    super::set_threads(a.threads);
    let pb = position_progress("ablate");
    let o = GraphOptions {
        context: a.context,
        seq: 128,
    };
    let rep = ablate(
        &ck,
        &seqs,
        &schemes,
        &builds,
        a.heavy_tail,
        &o,
        a.batch,
        &pb,
    )?;
    pb.finish_and_clear();
    if let Some(p) = &a.plot {
        hexq_fsutil::write_atomic(p, rep.svg().as_bytes())?;
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&rep)?);
    } else if a.csv {
        print!("{}", rep.csv());
    } else {
        print!("{}", rep.markdown());
    }
    Ok(())
}
