//! `hexq quantize --rounding …`: the calibration pass that gathers each weight's input Gram matrix (the
//! same chat-formatted decode loops as `calibrate`, float weights), then SeqMSE / GPTQ on the encodings'
//! grids. At E2B a layer's Σxxᵀ is ~1 GB in f64, so layers are gathered in groups under `--rounding-mem-gib`,
//! one calibration pass per group.

use anyhow::Result;
use clap::ValueEnum;
use hexq_graph::{GraphOptions, Variant};
use hexq_model::chat::Tokenizer;
use hexq_model::Checkpoint;
use hexq_quantize::rounding::{self, gptq, Rounding};
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Method {
    /// Round to nearest on the min-max grid (no calibration pass).
    Rtn,
    /// aimet-onnx's Sequential MSE: each channel's (LPBQ block's) scale from 20 candidates by output MSE.
    Seqmse,
    /// GPTQ: the min-max scales kept, integers chosen column by column with the error fed forward.
    Gptq,
    /// SeqMSE's scales, then GPTQ's integers on them.
    SeqmseGptq,
}

#[derive(clap::Args, Clone)]
pub struct Args {
    /// How MatMul weights are rounded onto their grids.
    #[arg(long, value_enum, default_value_t = Method::Rtn)]
    pub rounding: Method,
    /// Chat prompts whose decode loops give the inputs each weight sees.
    #[arg(long, default_value = "datasets/calibration.jsonl")]
    pub rounding_dataset: PathBuf,
    /// Use only the first N prompts (default: as many as the stats were calibrated on).
    #[arg(long, value_parser = super::positive)]
    pub rounding_limit: Option<usize>,
    #[command(flatten)]
    pub gptq: GptqArgs,
}

/// GPTQ's options and the Gram pass's memory: shared by `quantize`, `gguf` and `ablate`.
#[derive(clap::Args, Clone)]
pub struct GptqArgs {
    /// GPTQ: columns per lazy-update block.
    #[arg(long, default_value_t = 128, value_parser = super::positive)]
    pub gptq_block: usize,
    /// GPTQ: damping, a fraction of the mean of diag H.
    #[arg(long, default_value_t = 0.01)]
    pub gptq_damp: f64,
    /// GPTQ: round inputs in order of descending Σx² (static groups).
    #[arg(long)]
    pub act_order: bool,
    /// Memory for the Gram matrices of one pass (f64); layers beyond it take further passes.
    #[arg(long, default_value_t = 6.0)]
    pub rounding_mem_gib: f64,
}

impl Default for Args {
    fn default() -> Self {
        Args {
            rounding: Method::Rtn,
            rounding_dataset: "datasets/calibration.jsonl".into(),
            rounding_limit: None,
            gptq: GptqArgs::default(),
        }
    }
}

impl Default for GptqArgs {
    fn default() -> Self {
        GptqArgs {
            gptq_block: 128,
            gptq_damp: 0.01,
            act_order: false,
            rounding_mem_gib: 6.0,
        }
    }
}

impl GptqArgs {
    pub fn options(&self) -> gptq::Options {
        gptq::Options {
            block: self.gptq_block,
            damp: self.gptq_damp,
            act_order: self.act_order,
        }
    }
}

impl Args {
    pub fn method(&self) -> Rounding {
        let o = self.gptq.options();
        match self.rounding {
            Method::Rtn => Rounding::Rtn,
            Method::Seqmse => Rounding::SeqMse,
            Method::Gptq => Rounding::Gptq(o),
            Method::SeqmseGptq => Rounding::SeqMseGptq(o),
        }
    }
}

/// The layer index of a prefix-relative tensor name (`layers.7.mlp…` → 7).
fn layer_of(t: &str) -> usize {
    t.strip_prefix("layers.")
        .and_then(|r| r.split('.').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(usize::MAX)
}

/// Calibration settings of the input pass: the stats' own (context, seq, decode tokens, prompts).
pub struct Pass {
    pub context: usize,
    pub seq: usize,
    pub decode_tokens: usize,
    pub prompts: usize,
}

/// The Gram matrices of the inputs of the MatMul weights `targets` (initializer → checkpoint tensor),
/// gathered on the chat decode loops in layer groups that fit `a.rounding_mem_gib`; `each` gets every
/// group's (initializer → Σxxᵀ) in turn.
pub fn gather(
    ck: &Arc<Checkpoint>,
    targets: &std::collections::BTreeMap<String, String>,
    a: &Args,
    pass: &Pass,
    each: &mut dyn FnMut(
        std::collections::BTreeMap<String, Arc<hexq_calibrate::imatrix::Gram>>,
    ) -> Result<()>,
) -> Result<hexq_calibrate::Options> {
    let tok = Tokenizer::from_dir(&ck.dir)?;
    let dg = hexq_graph::build(
        &ck.config,
        Variant::DecodeWgqa,
        &GraphOptions {
            context: pass.context,
            seq: pass.seq,
        },
    );
    let wanted = |t: &str| targets.values().any(|x| x == t);
    // Bytes of each layer's Gram matrices: one per input its weights read (q, k, v share one).
    let mut per_layer: std::collections::BTreeMap<usize, u64> = Default::default();
    for fed in hexq_calibrate::imatrix::SquareSums::gram_for(&dg, &wanted).inputs() {
        let n = ck.info(&fed[0].tensor)?.shape[1];
        *per_layer.entry(layer_of(&fed[0].tensor)).or_default() +=
            hexq_calibrate::imatrix::Gram::bytes(n);
    }
    // Layers in groups whose Gram matrices fit the budget.
    let budget = (a.gptq.rounding_mem_gib * (1u64 << 30) as f64) as u64;
    let mut groups: Vec<Vec<usize>> = vec![vec![]];
    let mut used = 0u64;
    for (l, bytes) in per_layer {
        if used + bytes > budget && !groups.last().unwrap().is_empty() {
            groups.push(vec![]);
            used = 0;
        }
        groups.last_mut().unwrap().push(l);
        used += bytes;
    }
    let o = hexq_calibrate::Options {
        variant: Variant::DecodeWgqa,
        graph: GraphOptions {
            context: pass.context,
            seq: pass.seq,
        },
        decode_tokens: pass.decode_tokens,
        limit: Some(a.rounding_limit.unwrap_or(pass.prompts)),
        ignore_guards: false,
        noise: false,
        batch: 16,
        sequences: 0,
        checkpoint: None,
        checkpoint_every: usize::MAX,
        tokens_out: None,
        full_rings: false,
        bos_on_graph: true,
    };
    for (gi, layers) in groups.iter().enumerate() {
        let sq = Arc::new(hexq_calibrate::imatrix::SquareSums::gram_for(&dg, &|t| {
            layers.contains(&layer_of(t)) && wanted(t)
        }));
        let obs = hexq_calibrate::RangeObserver {
            squares: Some(sq.clone()),
            ..Default::default()
        };
        let pb = super::count_progress(&format!("inputs, pass {}/{}", gi + 1, groups.len()));
        let t0 = std::time::Instant::now();
        hexq_calibrate::calibrate_with(
            ck.clone(),
            &tok,
            &a.rounding_dataset,
            &o,
            &pb,
            obs,
            hexq_calibrate::Engine::Interp { params: None },
            "float".into(),
        )?;
        pb.finish_and_clear();
        let t1 = std::time::Instant::now();
        each(sq.take_grams())?;
        // One line per pass, so a log shows where the time goes (the bars are drawn on terminals only).
        let ls: Vec<usize> = layers
            .iter()
            .copied()
            .filter(|&l| l != usize::MAX)
            .collect();
        eprintln!(
            "rounding pass {}/{} (layers {}–{}{}): inputs {:.1} s, rounding {:.1} s",
            gi + 1,
            groups.len(),
            ls.first().copied().unwrap_or(0),
            ls.last().copied().unwrap_or(0),
            if ls.len() < layers.len() {
                " and the tensors outside layers"
            } else {
                ""
            },
            (t1 - t0).as_secs_f64(),
            t1.elapsed().as_secs_f64()
        );
    }
    Ok(o)
}

/// Round the weights of `g` by `a`, updating `enc`; GPTQ's weights written beside `out`.
pub fn apply(
    ck: &Arc<Checkpoint>,
    g: &hexq_graph::ir::Graph,
    enc: &mut hexq_quantize::Encodings,
    st: &hexq_calibrate::Stats,
    a: &Args,
    out: &Path,
) -> Result<()> {
    let r = a.method();
    if !r.needs_inputs() {
        return Ok(());
    }
    let targets = rounding::targets(g);
    let pass = Pass {
        context: st.context,
        seq: st.seq,
        decode_tokens: st.decode_tokens,
        prompts: st.prompts,
    };
    let gptq = matches!(r, Rounding::Gptq(_) | Rounding::SeqMseGptq(_));
    let p = rounding::overlay_path(out);
    let mut ov = match gptq {
        true => Some(rounding::OverlayWriter::new(&p)?),
        false => None,
    };
    let o = gather(ck, &targets, a, &pass, &mut |grams| {
        let pb = super::count_progress(r.name());
        pb.set_length(grams.len() as u64);
        rounding::apply(
            ck,
            g,
            enc,
            grams,
            &r,
            &|w| {
                pb.set_message(w.to_string());
                pb.inc(1);
            },
            &mut |t, v| match ov.as_mut() {
                Some(ov) => ov.put(t, &v),
                None => Ok(()),
            },
        )?;
        pb.finish_and_clear();
        Ok(())
    })?;
    let mut meta = serde_json::json!({
        "method": r.name(),
        "dataset": a.rounding_dataset.file_name().map(|f| f.to_string_lossy().to_string()),
        "dataset_sha256": hexq_fsutil::sha256_file(&a.rounding_dataset)?,
        "prompts": o.limit, "decode_tokens": o.decode_tokens,
        "inputs": "float model, chat-formatted decode loops",
    });
    if matches!(r, Rounding::SeqMse | Rounding::SeqMseGptq(_)) {
        meta["seqmse"] = serde_json::json!({"candidates": rounding::seqmse::CANDIDATES, "loss": "mse", "as": "aimet-onnx 2.42 apply_seq_mse"});
    }
    if let (Rounding::Gptq(go) | Rounding::SeqMseGptq(go), Some(ov)) = (r, ov) {
        let count = ov.len();
        let sha = ov.finish(ck)?;
        meta["gptq"] =
            serde_json::json!({"block": go.block, "damp": go.damp, "act_order": go.act_order});
        meta["weights"] = p.file_name().unwrap().to_string_lossy().to_string().into();
        meta["weights_sha256"] = sha.into();
        meta["weights_rounded"] = count.into();
    }
    enc.hexq["rounding"] = meta;
    Ok(())
}
