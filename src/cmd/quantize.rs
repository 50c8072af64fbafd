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
    /// Apply an overrides file even when some of its rules match no tensor of the graph (warned, not refused).
    #[arg(long)]
    pub allow_unmatched: bool,
    /// Past-KV ranges from another calibration of the same model (e.g. the decode graph's stats for a trunk
    /// whose prompts never filled a second chunk): each `past_key_*`/`past_value_*` range is widened to cover
    /// that file's.
    #[arg(long)]
    pub kv_stats: Option<PathBuf>,
    /// w4a16-lpbq: inputs per block (32, 64, 128; Qualcomm's Gemma recipe uses 64).
    #[arg(long, default_value_t = 64, value_parser = super::positive)]
    pub block: usize,
    /// Encode even when the stats fail their guards (degenerate or never-exercised ranges).
    #[arg(long)]
    pub ignore_guards: bool,
    #[command(flatten)]
    pub rounding: super::rounding::Args,
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
    /// 16-bit activations, 4-bit symmetric per-channel MatMul weights (the LPBQ baseline).
    W4a16Pc,
    /// 16-bit activations, MatMul weights on LPBQ grids (int4 blocks of --block inputs, 4-bit block scales ×
    /// one float per channel; aimet-onnx's arithmetic). Override rules (e.g. 8 bits) win per weight.
    W4a16Lpbq,
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
            allow_unmatched: false,
            kv_stats: None,
            block: 64,
            ignore_guards: false,
            rounding: Default::default(),
            force: false,
            out,
        }
    }
}

pub fn run(a: Args) -> Result<()> {
    super::refuse_existing(&a.out, a.force)?;
    let dir = model_dir(a.model)?;
    let ck = std::sync::Arc::new(Checkpoint::open(&dir)?);
    let mut st: hexq_calibrate::Stats = read_json(&a.stats)?;
    if let Some(p) = &a.kv_stats {
        let kv: hexq_calibrate::Stats = read_json(p)?;
        if kv.model_sha256 != st.model_sha256 {
            anyhow::bail!(
                "{}: calibrated on another model than {}",
                p.display(),
                a.stats.display()
            );
        }
        let mut n = 0;
        for (name, r) in st.tensors.iter_mut() {
            let is_kv = name.starts_with("past_key_") || name.starts_with("past_value_");
            if let (true, Some(k)) = (is_kv, kv.tensors.get(name)) {
                let seen = r.count > 0 && r.min < r.max;
                *r = match seen {
                    true => hexq_calibrate::Range {
                        min: r.min.min(k.min),
                        max: r.max.max(k.max),
                        count: r.count + k.count,
                    },
                    false => *k,
                };
                n += 1;
            }
        }
        if n == 0 {
            anyhow::bail!(
                "{}: no past_key_*/past_value_* ranges matching {}",
                p.display(),
                a.stats.display()
            );
        }
        eprintln!(
            "{}: {n} past-KV ranges from {}",
            a.stats.display(),
            p.display()
        );
    }
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
    if let (Some(p), false) = (&a.overrides, ov.unmatched(&g).is_empty()) {
        let bad: Vec<String> = ov
            .unmatched(&g)
            .iter()
            .map(|r| {
                format!(
                    "{:?} ({})",
                    r.pattern,
                    format!("{:?}", r.kind).to_lowercase()
                )
            })
            .collect();
        let msg = format!(
            "{}: rule {} matches no tensor of the {} graph",
            p.display(),
            bad.join(", "),
            v.name()
        );
        if !a.allow_unmatched {
            anyhow::bail!("{msg} (--allow-unmatched applies the file anyway)");
        }
        eprintln!("warning: {msg}");
    }
    let mut sch = match a.scheme {
        Scheme::A16w8 => hexq_quantize::Scheme::a16w8(a.int8_kv),
        Scheme::W4a16Pc => hexq_quantize::Scheme::w4a16(None),
        Scheme::W4a16Lpbq => hexq_quantize::Scheme::w4a16(Some(a.block)),
    };
    if a.int8_kv && a.scheme != Scheme::A16w8 {
        anyhow::bail!("--int8-kv goes with --scheme a16w8");
    }
    if a.full_mask_range {
        sch.mask_floor = None;
    }
    let mut enc = hexq_quantize::encode(&ck, &g, &st, &sch, &ov)
        .map_err(|e| anyhow::anyhow!("{}: {e}", a.stats.display()))?;
    enc.hexq["context"] = st.context.into();
    enc.hexq["seq"] = st.seq.into();
    enc.hexq["variant"] = st.variant.clone().into();
    super::rounding::apply(&ck, &g, &mut enc, &st, &a.rounding, &a.out)?;
    write_json(&a.out, &enc)?;
    eprintln!(
        "{}: {} activation + {} param{} encodings ({})",
        a.out.display(),
        enc.activation_encodings.len(),
        enc.param_encodings.len(),
        if enc.lpbq_encodings.is_empty() {
            String::new()
        } else {
            format!(" + {} LPBQ", enc.lpbq_encodings.len())
        },
        sch.name()
    );
    Ok(())
}
