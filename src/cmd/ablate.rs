//! `hexq ablate`: weights-only grids (and whole builds' encodings) vs float, side by side (table, JSON/CSV,
//! SVG plot).

use super::{model_dir, position_progress};
use anyhow::Result;
use hexq_eval::ablate::{ablate, Build, Cell, Head, Rounding, Scheme};
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
    /// Comma list of roundings, each crossed with every grid it applies to: rtn (every grid), imatrix
    /// (llama.cpp's importance-weighted q4_0 scales; q4_0-g*), seqmse (aimet-onnx's; per-channel and
    /// lpbq), gptq (every grid), seqmse-gptq. All but rtn read the inputs each weight sees on the
    /// --calib-dataset decode loops.
    #[arg(long, value_delimiter = ',', value_parser = parse_rounding, default_value = "rtn")]
    pub rounding: Vec<Rounding>,
    /// Comma list: the tied embedding / LM head in each weights-only row — float (the decoder alone), 8
    /// (q8_0 beside q4_0 grids, as llama.cpp's default q4_0 file; int8 per channel beside the QNN grids),
    /// same (the row's own grid, llama-quantize --pure).
    #[arg(long, value_delimiter = ',', value_parser = parse_head, default_value = "float")]
    pub head: Vec<Head>,
    /// Chat prompts whose decode loops give the roundings their inputs (disjoint from --dataset).
    #[arg(long, default_value = "datasets/calibration.jsonl")]
    pub calib_dataset: PathBuf,
    #[arg(long, default_value_t = 128, value_parser = super::positive)]
    pub calib_limit: usize,
    /// Tokens generated greedily (and observed) after each calibration prompt.
    #[arg(long, default_value_t = 8)]
    pub calib_decode_tokens: usize,
    /// GPTQ's options; ablate keeps every layer's Gram matrix, gathered in as many passes as the memory
    /// budget takes.
    #[command(flatten)]
    pub gptq: super::rounding::GptqArgs,
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

fn parse_rounding(s: &str) -> Result<Rounding, String> {
    Rounding::parse(s.trim())
        .ok_or_else(|| format!("unknown rounding {s:?} (rtn, imatrix, seqmse, gptq, seqmse-gptq)"))
}

fn parse_head(s: &str) -> Result<Head, String> {
    Head::parse(s.trim()).ok_or_else(|| format!("unknown head {s:?} (float, 8, same)"))
}

pub const ALL_SCHEMES: &str = "int8-pc,int4-pc,q4_0-g32,g64,g128,int4-pc-mlp-only,lpbq-b64";

impl Args {
    pub fn new(model: Option<PathBuf>, dataset: PathBuf, limit: usize, context: usize) -> Self {
        Args {
            model,
            schemes: ALL_SCHEMES.split(',').filter_map(Scheme::parse).collect(),
            builds: vec![],
            rounding: vec![Rounding::Rtn],
            head: vec![Head::Float],
            calib_dataset: "datasets/calibration.jsonl".into(),
            calib_limit: 128,
            calib_decode_tokens: 8,
            gptq: Default::default(),
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
    let cells = cells(&a);
    anyhow::ensure!(
        a.builds.is_empty() || a.rounding == [Rounding::Rtn],
        "--rounding crosses the weights-only grids; a build's rounding is its encodings file's (`hexq quantize --rounding`)"
    );
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
        !cells.is_empty() || !builds.is_empty(),
        "nothing to compare: --schemes none and no --encodings"
    );
    super::set_threads(a.threads);
    let o = GraphOptions {
        context: a.context,
        seq: 128,
    };
    let inputs = match cells.iter().any(|c| c.rounding != Rounding::Rtn) {
        true => Some(inputs(&ck, &a)?),
        false => None,
    };
    let pb = position_progress("ablate");
    let rep = ablate(
        &ck,
        &seqs,
        &cells,
        &builds,
        a.heavy_tail,
        inputs.as_ref(),
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

/// Every (grid, rounding, head) the flags cross: roundings only on the grids they apply to; a head "same"
/// beside int8-pc is its "8".
fn cells(a: &Args) -> Vec<Cell> {
    let mut out = Vec::new();
    for sc in a.schemes.iter().filter(|s| s.name != "none") {
        for &r in a.rounding.iter().filter(|r| r.applies(sc.grid)) {
            for &h in &a.head {
                let dup = h == Head::Same
                    && sc.grid == hexq_eval::ablate::Grid::PerChannel(8)
                    && a.head.contains(&Head::Eight);
                if !dup {
                    out.push(Cell {
                        scheme: sc.clone(),
                        rounding: r,
                        head: h,
                    });
                }
            }
        }
    }
    out
}

/// The roundings' inputs: each decoder MatMul weight's input Σxxᵀ on the chat-formatted decode loops of
/// --calib-dataset (float model, as `hexq quantize --rounding` gathers them).
fn inputs(ck: &Arc<Checkpoint>, a: &Args) -> Result<hexq_eval::ablate::Inputs> {
    use hexq_quantize::rounding;
    let g = hexq_graph::build(
        &ck.config,
        hexq_graph::Variant::DecodeWgqa,
        &GraphOptions {
            context: a.context,
            seq: 128,
        },
    );
    let targets = rounding::targets(&g);
    let ra = super::rounding::Args {
        rounding_dataset: a.calib_dataset.clone(),
        rounding_limit: Some(a.calib_limit),
        gptq: a.gptq.clone(),
        ..Default::default()
    };
    let pass = super::rounding::Pass {
        context: a.context,
        seq: 128,
        decode_tokens: a.calib_decode_tokens,
        prompts: a.calib_limit,
    };
    let mut grams = std::collections::BTreeMap::new();
    super::rounding::gather(ck, &targets, &ra, &pass, &mut |got| {
        for (init, gram) in got {
            if let Some(t) = targets.get(&init) {
                grams.insert(t.clone(), gram);
            }
        }
        Ok(())
    })?;
    Ok(hexq_eval::ablate::Inputs {
        grams,
        gptq: a.gptq.options(),
        factors: Default::default(),
    })
}
