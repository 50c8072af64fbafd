//! `hexq inspect`: config summary, per-layer facts, parameter counts, tensor list.

use super::model_dir;
use anyhow::Result;
use hexq_model::names::param_counts;
use hexq_model::Checkpoint;
use serde_json::json;
use std::path::PathBuf;

#[derive(clap::Args, Clone)]
pub struct Args {
    /// Checkpoint directory (config.json + safetensors); default: the bundled tiny Gemma-4.
    pub model: Option<PathBuf>,
    /// List every decoder tensor (name, dtype, shape, file).
    #[arg(long)]
    pub tensors: bool,
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: Args) -> Result<()> {
    let (tensors, as_json) = (a.tensors, a.json);
    let dir = model_dir(a.model)?;
    let ck = Checkpoint::open(&dir)?;
    let c = &ck.config;
    let pc = param_counts(c);
    let dtypes: std::collections::BTreeMap<&str, usize> =
        ck.tensors.iter().fold(Default::default(), |mut m, (_, i)| {
            *m.entry(i.dtype.name()).or_default() += 1;
            m
        });
    let bytes: u64 = ck
        .tensors
        .iter()
        .map(|(_, i)| (i.end - i.start) as u64)
        .sum();
    if as_json {
        let t: Vec<_> = ck
            .tensors
            .iter()
            .map(|(s, i)| json!({"name": i.name, "dtype": i.dtype.name(), "shape": i.shape, "role": s.role,
                                 "file": ck.store.file_of(i).file_name().map(|f| f.to_string_lossy().into_owned())}))
            .collect();
        let mut out = json!({"dir": dir, "config": c, "parameters": pc, "dtypes": dtypes, "bytes": bytes,
                             "files": ck.store.files});
        if tensors {
            out["tensors"] = json!(t);
        }
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!("{}", dir.display());
    println!(
        "  arch {:?} | layout {:?} (tensors under {:?})",
        c.arch, c.layout, c.prefix
    );
    println!(
        "  hidden {} | layers {} | q heads {} | vocab {} | eps {}",
        c.hidden_size, c.num_layers, c.num_heads, c.vocab_size, c.rms_norm_eps
    );
    println!(
        "  sliding window {} | softcap {:?} | tied head {} | PLE dim {} (vocab {})",
        c.sliding_window, c.final_logit_softcapping, c.tie_word_embeddings, c.ple_dim, c.ple_vocab
    );
    for (k, r) in &c.rope {
        println!(
            "  rope {k:<18} {} theta {} head_dim {} rotated {}/{} freqs",
            r.rope_type,
            r.theta,
            r.head_dim,
            r.rotated,
            r.head_dim / 2
        );
    }
    println!(
        "  KV-shared layers {}; files {}; dtypes {:?}; {:.2} GiB",
        c.num_kv_shared_layers,
        ck.store.files.len(),
        dtypes,
        bytes as f64 / (1u64 << 30) as f64
    );
    println!("  layer  type     head_dim kv_heads  kv            mlp");
    for l in &c.layers {
        let kv = match l.kv_mode {
            hexq_model::KvMode::Own => "own".to_string(),
            hexq_model::KvMode::Store => "store".to_string(),
            hexq_model::KvMode::Reuse => format!("reuse L{}", l.kv_source),
        };
        let kind = if l.kind == hexq_model::AttnKind::Sliding {
            "sliding"
        } else {
            "full"
        };
        println!(
            "  {:>5}  {:<8} {:>8} {:>8}  {:<13} {}",
            l.index, kind, l.head_dim, l.num_kv_heads, kv, l.mlp_width
        );
    }
    let g = |n: usize| format!("{n} ({:.3} B)", n as f64 / 1e9);
    println!(
        "  parameters: decoder {} | token embedding {} | per-layer embedding {} | total {}",
        g(pc.decoder),
        g(pc.token_embedding),
        g(pc.per_layer_embedding),
        g(pc.total)
    );
    if tensors {
        for (s, i) in &ck.tensors {
            let host = if s.role.is_vocab() { " (host)" } else { "" };
            println!("  {:<70} {:<5} {:?}{host}", i.name, i.dtype.name(), i.shape);
        }
    }
    Ok(())
}
