//! `hexq graph`: build a deployable graph from the config alone and summarise it.

use super::model_dir;
use anyhow::Result;
use hexq_graph::Variant;
use std::path::PathBuf;

#[derive(clap::Args, Clone)]
pub struct Args {
    /// Checkpoint directory, or a bare config.json (graphs need no weights).
    /// Checkpoint directory (config.json + safetensors); default: the bundled tiny Gemma-4.
    #[arg(long)]
    pub model: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = Variant::DecodeWgqa)]
    pub variant: Variant,
    #[arg(long, default_value_t = 4096, value_parser = super::positive)]
    pub context: usize,
    #[arg(long, default_value_t = 128, value_parser = super::positive)]
    pub seq: usize,
    /// Print the I/O contract as Markdown instead.
    #[arg(long)]
    pub io_contract: bool,
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: Args) -> Result<()> {
    let (variant, context, seq, io_contract, as_json) =
        (a.variant, a.context, a.seq, a.io_contract, a.json);
    use hexq_graph::{build, report, GraphOptions};
    let p = model_dir(a.model)?;
    let cfg = if p.is_file() {
        hexq_model::ModelConfig::from_file(&p)?
    } else {
        hexq_model::ModelConfig::from_file(&p.join("config.json"))?
    };
    if context == 0 || seq == 0 {
        anyhow::bail!("--context and --seq must be positive");
    }
    super::check_seq(variant, context, seq)?;
    let g = build(&cfg, variant, &GraphOptions { context, seq });
    g.validate().map_err(|e| anyhow::anyhow!("{e}"))?;
    if io_contract {
        print!("{}", report::io_contract_markdown(&g));
        return Ok(());
    }
    let s = report::summary(&g);
    if as_json {
        println!("{}", serde_json::to_string_pretty(&s)?);
        return Ok(());
    }
    println!("graph {} (context {context}{}) — {} nodes, {} weight initializers ({:.3} B parameters), {:.1} MiB constants",
        s.name, if variant.is_trunk() { format!(", SEQ {seq}") } else { String::new() }, s.nodes, s.weight_initializers,
        s.weight_parameters as f64 / 1e9, s.constant_bytes as f64 / (1u64 << 20) as f64);
    println!("inputs:");
    for (n, d, sh) in &s.inputs {
        println!("  {n:<24} {d:<4} {sh:?}");
    }
    println!("outputs:");
    for (n, d, sh) in &s.outputs {
        println!("  {n:<24} {d:<4} {sh:?}");
    }
    let ops: Vec<String> = s.ops.iter().map(|(k, v)| format!("{k} {v}")).collect();
    println!("ops: {}", ops.join(", "));
    println!("Expand nodes: {}", s.expand_nodes);
    let k = &s.kv_read_per_call;
    let mb = |b: usize| b as f64 / 1e6;
    println!(
        "KV read per call: {} buffers, {} elements = {:.1} MB f32 / {:.1} MB int16 / {:.1} MB int8",
        k.buffers,
        k.elements,
        mb(k.bytes_f32),
        mb(k.bytes_int16),
        mb(k.bytes_int8)
    );
    Ok(())
}
