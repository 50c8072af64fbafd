//! `hexq quantize`: AIMET-format encodings from calibration stats and the weights.

use super::{model_dir, read_json, write_json};
use anyhow::Result;
use clap::ValueEnum;
use hexq_graph::{GraphOptions, Variant};
use hexq_model::Checkpoint;
use std::path::PathBuf;

#[derive(clap::Args, Clone)]
pub struct Args {
    /// Checkpoint directory (config.json + safetensors); default: the bundled tiny Gemma-4.
    #[arg(long)]
    pub model: Option<PathBuf>,
    #[arg(long)]
    pub stats: PathBuf,
    #[arg(long, value_enum, default_value_t = Scheme::A16w8)]
    pub scheme: Scheme,
    /// int8 KV buffers (the decode_wgqa_int8kv variant).
    #[arg(long)]
    pub int8_kv: bool,
    /// Encode masked softmax inputs over the mask constant too (plain min-max, as aimet-onnx does by
    /// default) instead of from min(scores) - 32 up (README: "Calibration and A16W8").
    #[arg(long)]
    pub full_mask_range: bool,
    /// JSON overrides: {"rules": [{"pattern": "layers.*.mlp.*_proj.weight.T", "kind": "param", "bitwidth": 4}]}
    #[arg(long)]
    pub overrides: Option<PathBuf>,
    /// Encode even when the stats fail their guards (degenerate or never-exercised ranges).
    #[arg(long)]
    pub ignore_guards: bool,
    /// Replace an existing --out.
    #[arg(long)]
    pub force: bool,
    #[arg(long)]
    pub out: PathBuf,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Scheme {
    /// 16-bit activations (asymmetric min-max), 8-bit symmetric per-channel weights.
    A16w8,
}

impl Args {
    pub fn new(model: Option<PathBuf>, stats: PathBuf, int8_kv: bool, out: PathBuf) -> Self {
        Args {
            model,
            stats,
            scheme: Scheme::A16w8,
            int8_kv,
            full_mask_range: false,
            overrides: None,
            ignore_guards: false,
            force: false,
            out,
        }
    }
}

pub fn run(a: Args) -> Result<()> {
    super::refuse_existing(&a.out, a.force)?;
    let dir = model_dir(a.model)?;
    let ck = Checkpoint::open(&dir)?;
    let st: hexq_calibrate::Stats = read_json(&a.stats)?;
    // Ranges are data, not guards: a range that is not one is refused outright.
    for (name, r) in &st.tensors {
        if !(r.min.is_finite() && r.max.is_finite()) || r.min > r.max {
            anyhow::bail!(
                "{}: tensor {name:?}: range [{}, {}] is not a range (min ≤ max, both finite)",
                a.stats.display(),
                r.min,
                r.max
            );
        }
    }
    let problems = hexq_quantize::check_stats(&st);
    for p in &problems {
        eprintln!("WARNING: {}: {p}", a.stats.display());
    }
    if !problems.is_empty() && !a.ignore_guards {
        anyhow::bail!(
            "{}: {} guard(s) failed (first: {}); refusing to quantize (pass --ignore-guards to override)",
            a.stats.display(),
            problems.len(),
            problems[0]
        );
    }
    for (field, v) in [("context", st.context), ("seq", st.seq)] {
        if v == 0 {
            anyhow::bail!(
                "{}: stats field `{field}` is 0 (a calibration runs a graph of at least 1)",
                a.stats.display()
            );
        }
    }
    let v = Variant::parse(&st.variant).ok_or_else(|| {
        anyhow::anyhow!("{}: unknown variant {:?}", a.stats.display(), st.variant)
    })?;
    let go = GraphOptions {
        context: st.context,
        seq: st.seq,
    };
    super::check_context(&ck.config, st.context, &a.stats, "context")?;
    let g = hexq_graph::build(&ck.config, v, &go);
    let ov = match &a.overrides {
        Some(p) => hexq_quantize::Overrides::from_file(p)?,
        None => Default::default(),
    };
    let mut sch = hexq_quantize::Scheme::a16w8(a.int8_kv);
    if a.full_mask_range {
        sch.mask_floor = None;
    }
    let mut enc = hexq_quantize::encode(&ck, &g, &st, &sch, &ov)
        .map_err(|e| anyhow::anyhow!("{}: {e}", a.stats.display()))?;
    enc.hexq["context"] = st.context.into();
    enc.hexq["seq"] = st.seq.into();
    enc.hexq["variant"] = st.variant.clone().into();
    write_json(&a.out, &enc)?;
    eprintln!(
        "{}: {} activation + {} param encodings (a16w8{})",
        a.out.display(),
        enc.activation_encodings.len(),
        enc.param_encodings.len(),
        if a.int8_kv { ", int8 KV" } else { "" }
    );
    Ok(())
}
