//! `hexq calibrate`: activation ranges of a graph over chat-formatted decode loops.

use super::{count_progress, model_dir, progress, write_json};
use anyhow::Result;
use clap::ValueEnum;
use hexq_graph::{GraphOptions, Variant};
use hexq_model::chat::Tokenizer;
use hexq_model::Checkpoint;
type CalibrationParams = std::collections::BTreeMap<String, Vec<hexq_quantize::Encoding>>;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(clap::Args, Clone)]
pub struct Args {
    /// Checkpoint directory (config.json + safetensors); default: the bundled tiny Gemma-4.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// JSONL prompts (datasets/calibration.jsonl).
    #[arg(long, default_value = "datasets/calibration.jsonl")]
    pub dataset: PathBuf,
    /// The graph observed (decode_wgqa_int8kv observes decode_wgqa's graph).
    #[arg(long, value_enum, default_value_t = Variant::DecodeWgqa)]
    pub variant: Variant,
    /// Tokens generated (and observed) after each prompt.
    #[arg(long, default_value_t = 8)]
    pub decode_tokens: usize,
    /// Use only the first N prompts.
    #[arg(long, value_parser = super::positive)]
    pub limit: Option<usize>,
    #[arg(long, default_value_t = 4096, value_parser = super::positive)]
    pub context: usize,
    #[arg(long, default_value_t = 128, value_parser = super::positive)]
    pub seq: usize,
    /// Feed N(0,1) noise instead of token embeddings (the documented failure mode; refused unless --ignore-guards).
    #[arg(long)]
    pub noise: bool,
    /// Weights during calibration.
    #[arg(long, value_enum, default_value_t = Params::Int8)]
    pub params: Params,
    /// Param overrides (e.g. W4 MLP) applied to the weights during calibration, as `quantize` will.
    #[arg(long)]
    pub overrides: Option<PathBuf>,
    /// Where the forward passes run.
    #[arg(long, value_enum, default_value_t = Engine::Interp)]
    pub engine: Engine,
    /// Interpreter, decode graphs: decode steps per batched graph run (weights read once per batch) — prompts
    /// side by side, and consecutive tokens of a prompt chained in one run. The ranges are the same for every
    /// batch size.
    #[arg(long, default_value_t = 16, value_parser = super::positive)]
    pub batch: usize,
    /// Prompts in flight at once (default: --batch). Each holds a KV cache of --context positions, so at
    /// E2B size this is what bounds the memory; fewer prompts with longer chains keep the batch full.
    #[arg(long, default_value_t = 0)]
    pub sequences: usize,
    /// Batched decode calibration: every N prompts the stats so far go to `<out>.partial.json`; a run that
    /// finds that file (same model, graph, dataset and settings) continues from it. Removed at the end.
    #[arg(long, default_value_t = 64, value_parser = super::positive)]
    pub checkpoint_every: usize,
    /// Also write the id sequences the decode loops fed (prompt + generated), one JSON array per prompt — what a
    /// judge replays to calibrate on exactly the same tokens (scripts/bench_calibrate.sh).
    #[arg(long)]
    pub tokens_out: Option<PathBuf>,
    /// Worker threads for the weight multiplies (0 = one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Run the decode graph with rings of the full --context even when the prompts reach less far. By
    /// default the rings are as long as the longest prompt + decode steps reach, plus a never-written slot:
    /// the same ranges (a never-written slot's K/V, score and probability are the same values at any
    /// length), at a fraction of the cost. For proving that.
    #[arg(long)]
    pub full_rings: bool,
    /// Turn the guards' refusals (raw-text records, no chat-template tokens, noise) into warnings.
    #[arg(long)]
    pub ignore_guards: bool,
    /// Replace an existing --out.
    #[arg(long)]
    pub force: bool,
    #[arg(long)]
    pub out: PathBuf,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Params {
    /// Fake-quantized int8 per channel (AIMET's sequence: activation ranges observed in the param-quantized
    /// model).
    Int8,
    /// The float weights.
    Float,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Engine {
    /// hexq's graph interpreter.
    Interp,
    /// onnxruntime on the exported graph (a scratch export beside --out, removed after): the arithmetic
    /// aimet-onnx calibrates with, so the encodings match an AIMET QuantSim's to 1 LSB (needs libonnxruntime).
    Ort,
}

impl Args {
    /// Calibration of the decode graph on `limit` prompts of `dataset`, every other option at its default.
    pub fn new(
        model: Option<PathBuf>,
        dataset: PathBuf,
        limit: usize,
        context: usize,
        out: PathBuf,
    ) -> Self {
        Args {
            model,
            dataset,
            variant: Variant::DecodeWgqa,
            decode_tokens: 8,
            limit: Some(limit),
            context,
            seq: 128,
            noise: false,
            params: Params::Int8,
            overrides: None,
            engine: Engine::Interp,
            batch: 16,
            sequences: 0,
            checkpoint_every: 64,
            tokens_out: None,
            threads: 0,
            full_rings: false,
            ignore_guards: false,
            force: false,
            out,
        }
    }
}

pub fn run(a: Args) -> Result<()> {
    if a.engine == Engine::Ort && a.noise {
        anyhow::bail!("--noise replaces the interpreter's embeddings; use --engine interp");
    }
    super::refuse_existing(&a.out, a.force)?;
    let dir = model_dir(a.model.clone())?;
    let ck = Arc::new(Checkpoint::open(&dir)?);
    let tok = Tokenizer::from_dir(&dir)?;
    let o = hexq_calibrate::Options {
        variant: a.variant.graph(),
        graph: GraphOptions {
            context: a.context,
            seq: a.seq,
        },
        decode_tokens: a.decode_tokens,
        limit: a.limit,
        ignore_guards: a.ignore_guards,
        noise: a.noise,
        batch: a.batch,
        sequences: a.sequences,
        checkpoint: Some(partial_path(&a.out)),
        checkpoint_every: a.checkpoint_every,
        tokens_out: a.tokens_out.clone(),
        full_rings: a.full_rings,
        bos_on_graph: false,
    };
    super::set_threads(a.threads);
    let (pe, mode) = match a.params {
        Params::Float => (None, "float".to_string()),
        Params::Int8 => {
            let ov = match &a.overrides {
                Some(p) => hexq_quantize::Overrides::from_file(p)?,
                None => Default::default(),
            };
            let g = hexq_graph::build(&ck.config, o.variant, &o.graph);
            let mode = match a.overrides {
                Some(_) => "int8_per_channel+overrides",
                None => "int8_per_channel",
            };
            (
                Some(hexq_quantize::calibration_params(&ck, &g, &ov)?),
                mode.into(),
            )
        }
    };
    // The ort engine runs a scratch export of the variant; AtomicDir never committed = removed on every
    // exit path.
    let scratch;
    let mut ob;
    let eng = if a.engine == Engine::Ort {
        scratch = hexq_fsutil::AtomicDir::create(&a.out.with_extension("ort-graph"), true)?;
        ob = ort_engine(&ck, &o, pe.as_ref(), &scratch.tmp)?;
        hexq_calibrate::Engine::Ort(&mut ob)
    } else {
        hexq_calibrate::Engine::Interp {
            params: pe.as_ref().map(|p| {
                Box::new(hexq_quantize::quantsim::FakeQuant::from_params(p))
                    as Box<dyn hexq_graph::interp::Hook + Send>
            }),
        }
    };
    let pb = count_progress("calibrate");
    let st = hexq_calibrate::calibrate_with(
        ck.clone(),
        &tok,
        &a.dataset,
        &o,
        &pb,
        Default::default(),
        eng,
        mode,
    )?;
    pb.finish_and_clear();
    write_json(&a.out, &st)?;
    let _ = std::fs::remove_file(partial_path(&a.out));
    eprintln!(
        "{}: {} tensors from {} prompts ({} tokens observed, variant {})",
        a.out.display(),
        st.tensors.len(),
        st.prompts,
        st.tokens_observed,
        st.variant
    );
    Ok(())
}

/// Where a calibration's resumable progress lives: `<out>.partial.json` beside the stats.
fn partial_path(out: &std::path::Path) -> PathBuf {
    let mut s = out.as_os_str().to_owned();
    s.push(".partial.json");
    PathBuf::from(s)
}

/// onnxruntime on a scratch export of the variant in `dir`: calibration params baked into f32 weights,
/// every float tensor an output.
fn ort_engine(
    ck: &Arc<Checkpoint>,
    o: &hexq_calibrate::Options,
    params: Option<&CalibrationParams>,
    dir: &std::path::Path,
) -> Result<hexq_runtime::ort::OrtBackend> {
    let pb = progress(0, "export (ort engine)");
    hexq_export::export(
        ck,
        dir,
        &hexq_export::Options {
            variant: o.variant,
            graph: o.graph,
            encodings: None,
            qdq: false,
            weights: hexq_export::onnx::WeightType::F32,
            host: Some(hexq_export::host::HostDType::Native),
            progress: None,
            calibration: Some(params.unwrap_or(&Default::default())),
        },
    )?;
    pb.finish_and_clear();
    Ok(hexq_runtime::ort::OrtBackend::open(
        &[dir.to_path_buf()],
        0,
        hexq_runtime::ort::Ep::Cpu,
    )?)
}
