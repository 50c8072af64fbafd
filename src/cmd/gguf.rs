//! `hexq gguf`: a GGUF llama.cpp loads, streamed from the safetensors, and its manifest.

use super::{checkpoint_bytes, model_dir, progress};
use anyhow::Result;
use hexq_export::gguf::{self, FileType};
use hexq_model::Checkpoint;
use serde_json::json;
use std::path::PathBuf;

#[derive(clap::Args, Clone)]
pub struct Args {
    /// Checkpoint directory (config.json + safetensors); default: the bundled tiny Gemma-4.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// File type (q4_0 = llama-quantize's Q4_0 mix: q6_K token embeddings, q4_0 elsewhere).
    #[arg(long = "type", value_enum, default_value_t = FileType::Q4_0)]
    pub ty: FileType,
    /// Every 2-D weight q4_0 (llama-quantize --pure).
    #[arg(long)]
    pub pure: bool,
    /// An importance matrix (hexq imatrix or llama-imatrix; GGUF or legacy .dat): q4_0 blocks quantized
    /// with its weights as `llama-quantize --imatrix` does.
    #[arg(long)]
    pub imatrix: Option<PathBuf>,
    /// `--rounding gptq`: q4_0 blocks keep ggml's scales, their integers chosen by GPTQ on the inputs of the
    /// chat decode loops (datasets/calibration.jsonl, --rounding-limit prompts, default 64).
    #[command(flatten)]
    pub rounding: super::rounding::Args,
    #[arg(long)]
    pub out: PathBuf,
    #[arg(long)]
    pub force: bool,
    #[arg(long)]
    pub json: bool,
}

impl Args {
    pub fn new(model: Option<PathBuf>, ty: FileType, pure: bool, out: PathBuf) -> Self {
        Args {
            model,
            ty,
            pure,
            imatrix: None,
            rounding: Default::default(),
            out,
            force: false,
            json: false,
        }
    }
}

pub fn run(a: Args) -> Result<()> {
    let out = &a.out;
    super::refuse_existing(out, a.force)?;
    let dir = model_dir(a.model.clone())?;
    let ck = Checkpoint::open(&dir)?;
    let pb = progress(checkpoint_bytes(&ck), "gguf");
    let t0 = std::time::Instant::now();
    let tick = |n: u64| pb.inc(n);
    let imp = match &a.imatrix {
        Some(p) => Some(gguf::Importance::read(p).map_err(|e| anyhow::anyhow!("{e}"))?),
        None => None,
    };
    let rounded = gptq_q4_0(&dir, &a)?;
    let (plan, sha) = gguf::write_gguf(
        &ck,
        out,
        a.ty,
        a.pure,
        imp.as_ref(),
        rounded.as_ref(),
        &tick,
    )?;
    pb.finish_and_clear();
    let mut types = std::collections::BTreeMap::new();
    for p in &plan {
        *types.entry(p.ty.name()).or_insert(0usize) += 1;
    }
    let m = json!({
        "hexq_version": env!("CARGO_PKG_VERSION"),
        "file": out.file_name().unwrap_or_default().to_string_lossy(),
        "bytes": std::fs::metadata(out)?.len(),
        "sha256": sha,
        "type": a.ty.name(), "pure": a.pure, "tensors": plan.len(), "tensor_types": types,
        "rounding": match &rounded {
            Some(r) => json!({"method": "gptq", "tensors": r.len(), "dataset_sha256": hexq_fsutil::sha256_file(&a.rounding.rounding_dataset)?,
                "prompts": a.rounding.rounding_limit.unwrap_or(64), "block": a.rounding.gptq.gptq_block, "damp": a.rounding.gptq.gptq_damp, "act_order": a.rounding.gptq.act_order}),
            None => serde_json::Value::Null,
        },
        "imatrix": match (&a.imatrix, &imp) {
            (Some(p), Some(i)) => json!({"file": i.file, "sha256": hexq_fsutil::sha256_file(p)?, "entries": i.weights.len()}),
            _ => serde_json::Value::Null,
        },
        // The source's identity without a second pass over 10 GB: config.json's SHA256 and each
        // safetensors file's size and header SHA256 (names, dtypes, shapes, offsets).
        "source": {"dir": hexq_fsutil::dir_name(&ck.dir), "identity": hexq_export::source_identity(&ck)?},
        // No wall time here: the same inputs write a byte-identical manifest (hexq build).
    });
    let mp = PathBuf::from(format!("{}.manifest.json", out.display()));
    hexq_fsutil::write_atomic(
        &mp,
        format!("{}\n", serde_json::to_string_pretty(&m)?).as_bytes(),
    )?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&m)?);
    } else {
        eprintln!(
            "{}: {} bytes, {} tensors {:?} ({:.1}s)",
            out.display(),
            m["bytes"],
            plan.len(),
            types,
            t0.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

/// GGUF name → the weight's values rounded by GPTQ onto its q4_0 blocks (scales by ggml's rule from the
/// checkpoint's values), for every decoder MatMul weight; None for `--rounding rtn`.
fn gptq_q4_0(
    dir: &std::path::Path,
    a: &Args,
) -> Result<Option<std::collections::HashMap<String, Vec<f32>>>> {
    use super::rounding::Method;
    use hexq_gguf::ggml::{q4_0_point, q4_0_scale};
    match a.rounding.rounding {
        Method::Rtn => return Ok(None),
        Method::Gptq => {}
        _ => anyhow::bail!("--rounding {}: q4_0's scales are ggml's rule; only gptq (the integers) applies to a GGUF", a.rounding.method().name()),
    }
    if a.imatrix.is_some() {
        anyhow::bail!(
            "--rounding gptq and --imatrix are two roundings of the same blocks: pick one"
        );
    }
    let ck = std::sync::Arc::new(Checkpoint::open(dir)?);
    let go = hexq_graph::GraphOptions {
        context: 512,
        seq: 128,
    };
    let g = hexq_graph::build(&ck.config, hexq_graph::Variant::DecodeWgqa, &go);
    let targets = hexq_quantize::rounding::targets(&g);
    let pass = super::rounding::Pass {
        context: 512,
        seq: 128,
        decode_tokens: 8,
        prompts: 64,
    };
    let go = a.rounding.gptq.options();
    let mut out = std::collections::HashMap::new();
    super::rounding::gather(&ck, &targets, &a.rounding, &pass, &mut |grams| {
        for (gram, inits) in hexq_quantize::rounding::by_input(grams) {
            let factors = hexq_quantize::rounding::gptq::Factors::default();
            for init in inits {
                let Some(t) = targets.get(&init) else {
                    continue;
                };
                let Some(gn) = hexq_model::names::gguf_name(t) else {
                    continue;
                };
                let w = ck.f32(t)?;
                let n = gram.n;
                if n % 32 != 0 || w.len() % n != 0 {
                    continue;
                }
                let scales: Vec<(f32, f32)> = w.chunks(32).map(q4_0_scale).collect();
                let nb = n / 32;
                let f = factors
                    .get(&gram, &go)
                    .map_err(|m| anyhow::anyhow!("{t}: {m}"))?;
                let r = hexq_quantize::rounding::gptq::gptq(
                    &w,
                    &f,
                    &|c, i, x| {
                        let (d, id) = scales[c * nb + i / 32];
                        q4_0_point(x, d, id)
                    },
                    &go,
                )
                .map_err(|m| anyhow::anyhow!("{t}: {m}"))?;
                out.insert(gn, r);
            }
        }
        Ok(())
    })?;
    Ok(Some(out))
}
