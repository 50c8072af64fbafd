//! `hexq` — the command line over the pipeline crates (model, calibrate, quantize, export, runtime).

mod bundled;
mod compile;

use anyhow::Result;
use clap::{Parser, Subcommand, ValueEnum};
use hexq_model::chat::{Message, Tokenizer};
use hexq_model::names::param_counts;
use hexq_model::{Checkpoint, Model};
use serde_json::json;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Parser)]
#[command(
    name = "hexq",
    version,
    about = "Gemma-4 → Qualcomm Hexagon NPU: load, calibrate, quantize, export, compile, run, verify"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Summarise a checkpoint: config, per-layer facts, parameter counts, tensors.
    Inspect {
        /// Checkpoint directory (config.json + safetensors); default: the bundled tiny Gemma-4.
        model: Option<PathBuf>,
        /// List every decoder tensor (name, dtype, shape, file).
        #[arg(long)]
        tensors: bool,
        #[arg(long)]
        json: bool,
    },
    /// Generate greedily from a chat-formatted prompt.
    Run(RunArgs),
    /// Build a deployable graph and summarise it (I/O, op histogram, Expand count, KV bytes per step).
    Graph {
        /// Checkpoint directory, or a bare config.json (graphs need no weights).
        #[arg(long)]
        model: Option<PathBuf>,
        #[arg(long, value_enum, default_value_t = VariantArg::DecodeWgqa)]
        variant: VariantArg,
        #[arg(long, default_value_t = 4096)]
        context: usize,
        #[arg(long, default_value_t = 128)]
        seq: usize,
        /// Print the I/O contract as Markdown instead.
        #[arg(long)]
        io_contract: bool,
        #[arg(long)]
        json: bool,
    },
    /// Record activation ranges of a graph on chat-formatted decode loops.
    Calibrate {
        #[arg(long)]
        model: Option<PathBuf>,
        /// JSONL prompts (datasets/calibration.jsonl).
        #[arg(long, default_value = "datasets/calibration.jsonl")]
        dataset: PathBuf,
        #[arg(long, value_enum, default_value_t = VariantArg::DecodeWgqa)]
        variant: VariantArg,
        /// Tokens generated (and observed) after each prompt.
        #[arg(long, default_value_t = 8)]
        decode_tokens: usize,
        /// Use only the first N prompts.
        #[arg(long)]
        limit: Option<usize>,
        #[arg(long, default_value_t = 4096)]
        context: usize,
        #[arg(long, default_value_t = 128)]
        seq: usize,
        /// Feed N(0,1) noise instead of token embeddings (the documented failure mode; refused unless --force).
        #[arg(long)]
        noise: bool,
        /// Weights during calibration: `int8` = fake-quantized int8 per channel (AIMET's sequence: activation
        /// ranges observed in the param-quantized model), `float` = the float weights.
        #[arg(long, default_value = "int8")]
        params: String,
        /// Param overrides (e.g. W4 MLP) applied to the weights during calibration, as `quantize` will.
        #[arg(long)]
        overrides: Option<PathBuf>,
        /// Where the forward passes run: `interp` = hexq's graph interpreter; `ort` = onnxruntime on the
        /// exported graph (a scratch export beside --out, removed after): the arithmetic aimet-onnx
        /// calibrates with, so the encodings match an AIMET QuantSim's to 1 LSB (needs libonnxruntime).
        #[arg(long, default_value = "interp")]
        engine: String,
        /// Turn the guards' refusals into warnings.
        #[arg(long)]
        force: bool,
        #[arg(long)]
        out: PathBuf,
    },
    /// Compute A16W8 encodings (AIMET/QNN format) from calibration stats and the weights.
    Quantize {
        #[arg(long)]
        model: Option<PathBuf>,
        #[arg(long)]
        stats: PathBuf,
        #[arg(long, default_value = "a16w8")]
        scheme: String,
        /// int8 KV buffers (the decode_wgqa_int8kv variant).
        #[arg(long)]
        int8_kv: bool,
        /// Encode masked softmax inputs over the mask constant too (plain min-max, as aimet-onnx does by
        /// default) instead of from min(scores) - 32 up (README: "Calibration and A16W8").
        #[arg(long)]
        full_mask_range: bool,
        /// JSON overrides: {"rules": [{"pattern": "layers.*.mlp.*_proj.weight.T", "kind": "param", "bitwidth": 4}]}
        #[arg(long)]
        overrides: Option<PathBuf>,
        #[arg(long)]
        force: bool,
        #[arg(long)]
        out: PathBuf,
    },
    /// Quantsim vs float on held-out prompts: top-1, hidden cosine, KL, token-exact greedy, per-step cosine.
    Verify {
        #[arg(long)]
        model: Option<PathBuf>,
        /// quantsim: hexq's quantsim (--encodings) vs float. qnn: the compiled binaries of --artifacts on the
        /// QNN HTP simulator vs float and vs hexq's quantsim, per --targets.
        #[arg(long, default_value = "quantsim", value_parser = ["quantsim", "qnn"])]
        backend: String,
        #[arg(long, required_if_eq("backend", "quantsim"))]
        encodings: Option<PathBuf>,
        /// qnn: export directories compiled by `hexq compile` (decode variants and/or trunk), each verified.
        #[arg(long)]
        artifacts: Vec<PathBuf>,
        /// qnn: comma list of targets.
        #[arg(long, default_value = "v79,v81")]
        targets: String,
        /// Calibration stats, for the coverage report.
        #[arg(long)]
        stats: Option<PathBuf>,
        #[arg(long, default_value = "datasets/heldout.jsonl")]
        dataset: PathBuf,
        #[arg(long)]
        limit: Option<usize>,
        /// Greedy decode steps compared token by token.
        #[arg(long, default_value_t = 8)]
        steps: usize,
        #[arg(long)]
        json: bool,
    },
    /// The main job end to end on a model (default: the bundled tiny Gemma-4): inspect, generate, calibrate
    /// decode_wgqa on chat-formatted decode loops, A16W8 (+ int8-KV) encodings, quantsim verify on held-out.
    Pipeline {
        #[arg(long)]
        model: Option<PathBuf>,
        #[arg(long, default_value = "out/pipeline")]
        out: PathBuf,
        /// Calibration prompts used (of datasets/calibration.jsonl).
        #[arg(long, default_value_t = 64)]
        calib_limit: usize,
        /// Held-out prompts verified.
        #[arg(long, default_value_t = 24)]
        verify_limit: usize,
        #[arg(long, default_value_t = 512)]
        context: usize,
    },
    /// Export one variant's artifacts: <variant>.onnx + .data (float, or QDQ with --qdq), the encodings beside
    /// it, host-model/ (vocab tensors + tokenizer), io-contract.json, manifest.json (sizes, SHA256s).
    Export {
        #[arg(long)]
        model: Option<PathBuf>,
        /// decode_wgqa | decode_wgqa_int8kv | decode_full | trunk (dashes accepted).
        #[arg(long, default_value = "decode_wgqa")]
        variant: String,
        #[arg(long, default_value_t = 4096)]
        context: usize,
        #[arg(long, default_value_t = 128)]
        seq: usize,
        /// Encodings from `hexq quantize` (written beside the graph; required for --qdq and int8kv).
        #[arg(long)]
        encodings: Option<PathBuf>,
        /// QuantizeLinear/DequantizeLinear graph from the encodings (onnxruntime / QNN HTP input).
        #[arg(long)]
        qdq: bool,
        /// Float weight storage: f32, or f16 with a Cast in the graph.
        #[arg(long, default_value = "f32", value_parser = ["f32", "f16"])]
        weights: String,
        /// host-model/ tensor storage: native (the checkpoint dtype, bf16 for Gemma), int8 or int4 per row.
        #[arg(long, default_value = "native", value_parser = ["native", "int8", "int4", "none"])]
        host: String,
        #[arg(long)]
        out: PathBuf,
        /// Replace an existing output directory.
        #[arg(long)]
        force: bool,
        #[arg(long)]
        json: bool,
    },
    /// Write a GGUF llama.cpp loads (gemma4 architecture, metadata as its converter writes it), streamed from
    /// the safetensors; q4_0/q8_0/q6_K blocks bit-identical to ggml's reference quantizers.
    Gguf {
        #[arg(long)]
        model: Option<PathBuf>,
        /// f32 | f16 | bf16 | q8_0 | q4_0 (llama-quantize's Q4_0 mix: q6_K token embeddings, q4_0 elsewhere).
        #[arg(long = "type", default_value = "q4_0", value_parser = ["f32", "f16", "bf16", "q8_0", "q4_0"])]
        ty: String,
        /// Every 2-D weight q4_0 (llama-quantize --pure).
        #[arg(long)]
        pure: bool,
        #[arg(long)]
        out: PathBuf,
        #[arg(long)]
        force: bool,
        #[arg(long)]
        json: bool,
    },
    /// Weights-only grid ablation vs float: bits/weight, size, SQNR per tensor class, top-1, KL, perplexity,
    /// hidden cosine — Markdown table (or --json/--csv), and an SVG of accuracy vs bits/weight.
    Ablate {
        #[arg(long)]
        model: Option<PathBuf>,
        /// Comma list of int8-pc, int4-pc, int4-pc-mlp-only, q4_0-g32, g64, g128.
        #[arg(
            long,
            default_value = "int8-pc,int4-pc,q4_0-g32,g64,g128,int4-pc-mlp-only"
        )]
        schemes: String,
        #[arg(long, default_value = "datasets/heldout.jsonl")]
        dataset: PathBuf,
        #[arg(long, default_value_t = 24)]
        limit: usize,
        /// Heavy-tailed input-channel scales folded into the weights (function-preserving; see README).
        #[arg(long)]
        heavy_tail: bool,
        #[arg(long, default_value_t = 512)]
        context: usize,
        #[arg(long)]
        json: bool,
        #[arg(long)]
        csv: bool,
        /// Write the accuracy-vs-bits plot here (SVG).
        #[arg(long)]
        plot: Option<PathBuf>,
    },
    /// Compile an export to a QNN HTP context binary for a target: `<variant>_<target>.bin` + its EPContext
    /// `.onnx` in the export dir, recorded in manifest.json and SHA256SUMS; the embedded SoC/arch is checked.
    Compile {
        /// A `hexq export` directory (QDQ for ort-qnn; float + encodings for qairt).
        #[arg(long)]
        artifacts: PathBuf,
        /// v79 (SM8750), v81 (SM8850), v75 (SM8650): compile-scripts/htp_targets.json.
        #[arg(long)]
        target: String,
        /// ort-qnn: onnxruntime-qnn's QNN HTP backend (PyPI); qairt: the QAIRT SDK at $QAIRT_DIR.
        #[arg(long, default_value = "ort-qnn", value_parser = ["ort-qnn", "qairt"])]
        toolchain: String,
        /// Write (qairt) or print (ort-qnn) what would run, without running it.
        #[arg(long)]
        dry_run: bool,
        /// qairt: decode steps of raw calibration inputs for --input_list.
        #[arg(long, default_value_t = 8)]
        calib_steps: usize,
        /// Replace an existing binary for the target.
        #[arg(long)]
        force: bool,
        #[arg(long)]
        json: bool,
    },
    /// Write a random-weight bf16 checkpoint with the real names and shapes of a config (streamed).
    Synth {
        /// A Gemma-4 config.json (e.g. ../shared/docs/e2b-config-inferred.json).
        #[arg(long)]
        config: PathBuf,
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Largest shard in bytes (0 = a single file).
        #[arg(long, default_value_t = 4 << 30)]
        shard_bytes: u64,
        /// Replace an existing output directory.
        #[arg(long)]
        force: bool,
        #[arg(long)]
        json: bool,
    },
}

#[derive(clap::Args)]
struct RunArgs {
    /// Checkpoint directory; default: the bundled tiny Gemma-4 (cpu, graph).
    #[arg(long)]
    model: Option<PathBuf>,
    #[arg(long)]
    prompt: String,
    /// Optional system turn before the prompt.
    #[arg(long)]
    system: Option<String>,
    #[arg(long, default_value_t = 32)]
    max_tokens: usize,
    #[arg(long, value_enum, default_value_t = BackendKind::Cpu)]
    backend: BackendKind,
    /// Graph backend: full-attention buffer length (max context).
    #[arg(long, default_value_t = 4096)]
    context: usize,
    /// Graph backend: trunk chunk length (0 = no trunk, prompt token by token through decode).
    #[arg(long, default_value_t = 128)]
    seq: usize,
    /// ort/qnn backends: `hexq export` directories (one decode variant, optionally a trunk); the host side
    /// comes from their host-model/.
    #[arg(long)]
    artifacts: Vec<PathBuf>,
    /// ort/llama backends: threads (0 = the runtime's default).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// qnn backend: the HTP target whose compiled binary runs (v79, v81, v75).
    #[arg(long, default_value = "v79")]
    target: String,
    /// llama backend: the GGUF to run (llama.cpp from $LLAMA_CPP_BUILD); tokenizer and chat template from --model.
    #[arg(long)]
    gguf: Option<PathBuf>,
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Copy, ValueEnum)]
enum BackendKind {
    /// The f32 reference forward (candle).
    Cpu,
    /// The IR interpreter over decode_wgqa (prompt through trunk in SEQ chunks).
    Graph,
    /// Exported ONNX (float or QDQ) in onnxruntime, host side from host-model/ (--artifacts).
    Ort,
    /// A GGUF in llama.cpp (--gguf; LLAMA_CPP_BUILD = its build directory).
    Llama,
    /// The compiled context binary on QNN HTP (--artifacts, --target; the HTP simulator on x86-64).
    Qnn,
}

#[derive(Clone, Copy, ValueEnum, PartialEq)]
enum VariantArg {
    DecodeWgqa,
    DecodeFull,
    Trunk,
}

impl VariantArg {
    fn v(self) -> hexq_model::graph::Variant {
        match self {
            VariantArg::DecodeWgqa => hexq_model::graph::Variant::DecodeWgqa,
            VariantArg::DecodeFull => hexq_model::graph::Variant::DecodeFull,
            VariantArg::Trunk => hexq_model::graph::Variant::Trunk,
        }
    }
}

fn model_dir(m: Option<PathBuf>) -> Result<PathBuf> {
    match m {
        Some(p) => Ok(p),
        None => bundled::tiny_gemma4_dir(),
    }
}

fn progress(len: u64, msg: &str) -> indicatif::ProgressBar {
    let pb = indicatif::ProgressBar::new(len);
    pb.set_style(
        indicatif::ProgressStyle::with_template(
            "{msg} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
        .unwrap()
        .progress_chars("=> "),
    );
    pb.set_message(msg.to_string());
    pb
}

fn inspect(model: Option<PathBuf>, tensors: bool, as_json: bool) -> Result<()> {
    let dir = model_dir(model)?;
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
        "  layout           {:?} (tensors under {:?})",
        c.layout, c.prefix
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

#[allow(clippy::too_many_arguments)]
/// Points fd 1 at stderr while alive: the QNN HTP simulator library prints a banner on stdout through C
/// stdio, which would corrupt `--json`; on drop C's buffers are flushed (to stderr) and fd 1 restored.
struct StdoutToStderr(i32);
impl StdoutToStderr {
    fn new() -> Self {
        use std::io::Write;
        let _ = std::io::stdout().flush();
        unsafe {
            let saved = libc::dup(1);
            libc::dup2(2, 1);
            StdoutToStderr(saved)
        }
    }
}
impl Drop for StdoutToStderr {
    fn drop(&mut self) {
        use std::io::Write;
        let _ = std::io::stdout().flush();
        unsafe {
            libc::fflush(std::ptr::null_mut());
            libc::dup2(self.0, 1);
            libc::close(self.0);
        }
    }
}

fn run(a: RunArgs) -> Result<()> {
    use hexq_runtime::ort::Ep;
    let quiet = matches!(a.backend, BackendKind::Qnn).then(StdoutToStderr::new);
    let (mut b, tok): (Box<dyn hexq_runtime::Backend>, Tokenizer) = match a.backend {
        BackendKind::Cpu | BackendKind::Graph => {
            let dir = model_dir(a.model)?;
            let ck = Arc::new(Checkpoint::open(&dir)?);
            let tok = Tokenizer::from_dir(&dir)?;
            let b: Box<dyn hexq_runtime::Backend> = if matches!(a.backend, BackendKind::Cpu) {
                Box::new(hexq_runtime::CpuBackend::new(Model::load(ck)?))
            } else {
                use hexq_model::graph::{GraphOptions, Variant};
                let o = GraphOptions {
                    context: a.context,
                    seq: a.seq.max(1),
                };
                Box::new(hexq_runtime::graph::GraphBackend::for_model(
                    &ck,
                    Variant::DecodeWgqa,
                    a.seq > 0,
                    &o,
                )?)
            };
            (b, tok)
        }
        BackendKind::Ort => {
            if a.artifacts.is_empty() {
                anyhow::bail!("--backend ort needs --artifacts DIR (a `hexq export` output)");
            }
            let b = hexq_runtime::ort::OrtBackend::open(&a.artifacts, a.threads, Ep::Cpu)?;
            let tok = Tokenizer::from_dir(&b.host.dir)?;
            (Box::new(b), tok)
        }
        BackendKind::Qnn => {
            if a.artifacts.is_empty() {
                anyhow::bail!("--backend qnn needs --artifacts DIR (a `hexq export --qdq` output compiled by `hexq compile`)");
            }
            let b = hexq_runtime::ort::OrtBackend::open(
                &a.artifacts,
                a.threads,
                Ep::Qnn {
                    target: a.target.clone(),
                },
            )?;
            let tok = Tokenizer::from_dir(&b.host.dir)?;
            (Box::new(b), tok)
        }
        BackendKind::Llama => {
            let g = a
                .gguf
                .clone()
                .ok_or_else(|| anyhow::anyhow!("--backend llama needs --gguf F.gguf"))?;
            let tok = Tokenizer::from_dir(&model_dir(a.model.clone())?)?;
            let b = hexq_runtime::llama::LlamaBackend::open(&g, a.context, a.threads)?;
            (Box::new(b), tok)
        }
    };
    let (system, prompt, max_tokens, as_json) = (a.system, a.prompt, a.max_tokens, a.json);
    let mut msgs = Vec::new();
    if let Some(s) = system {
        msgs.push(Message {
            role: "system".into(),
            content: s,
        });
    }
    msgs.push(Message::user(&prompt));
    let g = hexq_runtime::generate(b.as_mut(), &tok, &msgs, max_tokens)?;
    drop(b);
    drop(quiet);
    if as_json {
        println!("{}", serde_json::to_string_pretty(&g)?);
    } else {
        println!("{}", g.text);
        eprintln!(
            "[{}] prompt {} tokens, generated {} ({}), prefill {:.3}s, decode {:.2} tok/s",
            g.backend,
            g.prompt_ids.len(),
            g.generated_ids.len(),
            g.stop_reason,
            g.prefill_seconds,
            g.decode_tokens_per_second
        );
    }
    Ok(())
}

fn graph(
    model: Option<PathBuf>,
    variant: VariantArg,
    context: usize,
    seq: usize,
    io_contract: bool,
    as_json: bool,
) -> Result<()> {
    use hexq_model::graph::{build, report, GraphOptions};
    let p = model_dir(model)?;
    let cfg = if p.is_file() {
        hexq_model::ModelConfig::from_file(&p)?
    } else {
        hexq_model::ModelConfig::from_file(&p.join("config.json"))?
    };
    if context == 0 || seq == 0 {
        anyhow::bail!("--context and --seq must be positive");
    }
    let g = build(&cfg, variant.v(), &GraphOptions { context, seq });
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
        s.name, if variant == VariantArg::Trunk { format!(", SEQ {seq}") } else { String::new() }, s.nodes, s.weight_initializers,
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

fn read_json<T: serde::de::DeserializeOwned>(p: &std::path::Path) -> Result<T> {
    let t = std::fs::read_to_string(p).map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?;
    serde_json::from_str(&t).map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))
}

fn write_json<T: serde::Serialize>(p: &std::path::Path, v: &T) -> Result<()> {
    let mut s = serde_json::to_string_pretty(v)?;
    s.push('\n');
    Ok(hexq_model::fsutil::write_atomic(p, s.as_bytes())?)
}

fn count_progress(msg: &str) -> indicatif::ProgressBar {
    let pb = indicatif::ProgressBar::new(0);
    pb.set_style(
        indicatif::ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} prompts, eta {eta}")
            .unwrap()
            .progress_chars("=> "),
    );
    pb.set_message(msg.to_string());
    pb
}

#[allow(clippy::too_many_arguments)]
fn calibrate(
    model: Option<PathBuf>,
    dataset: PathBuf,
    variant: VariantArg,
    decode_tokens: usize,
    limit: Option<usize>,
    context: usize,
    seq: usize,
    noise: bool,
    params: String,
    overrides: Option<PathBuf>,
    engine: String,
    force: bool,
    out: PathBuf,
) -> Result<()> {
    if !["interp", "ort"].contains(&engine.as_str()) {
        anyhow::bail!("--engine {engine:?}: expected interp or ort");
    }
    if engine == "ort" && noise {
        anyhow::bail!("--noise replaces the interpreter's embeddings; use --engine interp");
    }
    let dir = model_dir(model)?;
    let ck = Arc::new(Checkpoint::open(&dir)?);
    let tok = Tokenizer::from_dir(&dir)?;
    let o = hexq_calibrate::Options {
        variant: variant.v(),
        graph: hexq_model::graph::GraphOptions { context, seq },
        decode_tokens,
        limit,
        force,
        noise,
    };
    let (pe, mode) = match params.as_str() {
        "float" => (None, "float".to_string()),
        "int8" => {
            let ov = match &overrides {
                Some(p) => hexq_quantize::Overrides::from_file(p)?,
                None => Default::default(),
            };
            let g = hexq_model::graph::build(&ck.config, variant.v(), &o.graph);
            (
                Some(hexq_quantize::calibration_params(&ck, &g, &ov)?),
                if overrides.is_some() {
                    "int8_per_channel+overrides".into()
                } else {
                    "int8_per_channel".into()
                },
            )
        }
        other => anyhow::bail!("--params {other:?}: expected int8 or float"),
    };
    // The ort engine runs a scratch export of the variant (calibration params baked into f32 weights, every
    // float tensor an output); AtomicDir never committed = removed on every exit path.
    let scratch;
    let mut ob;
    let eng = if engine == "ort" {
        scratch = hexq_model::fsutil::AtomicDir::create(&out.with_extension("ort-graph"), true)?;
        let pb = progress(0, "export (ort engine)");
        hexq_export::export(
            &ck,
            &scratch.tmp,
            &hexq_export::Options {
                variant: variant.v().name().into(),
                graph: o.graph.clone(),
                encodings: None,
                qdq: false,
                weights: hexq_export::onnx::WeightType::F32,
                host: Some(hexq_export::host::HostDType::Native),
                command: std::env::args().collect(),
                progress: None,
                calibration: Some(pe.as_ref().unwrap_or(&Default::default())),
            },
        )?;
        pb.finish_and_clear();
        ob = hexq_runtime::ort::OrtBackend::open(
            std::slice::from_ref(&scratch.tmp),
            0,
            hexq_runtime::ort::Ep::Cpu,
        )?;
        hexq_calibrate::Engine::Ort(&mut ob)
    } else {
        hexq_calibrate::Engine::Interp {
            params: pe.as_ref().map(|p| {
                Box::new(hexq_quantize::quantsim::FakeQuant::from_params(p))
                    as Box<dyn hexq_model::graph::interp::Hook + Send>
            }),
        }
    };
    let pb = count_progress("calibrate");
    let st = hexq_calibrate::calibrate_with(
        ck.clone(),
        &tok,
        &dataset,
        &o,
        &pb,
        Default::default(),
        eng,
        mode,
    )?;
    pb.finish_and_clear();
    write_json(&out, &st)?;
    eprintln!(
        "{}: {} tensors from {} prompts ({} tokens observed, variant {})",
        out.display(),
        st.tensors.len(),
        st.prompts,
        st.tokens_observed,
        st.variant
    );
    Ok(())
}

fn quantize(
    model: Option<PathBuf>,
    stats: PathBuf,
    scheme: String,
    int8_kv: bool,
    full_mask_range: bool,
    overrides: Option<PathBuf>,
    force: bool,
    out: PathBuf,
) -> Result<()> {
    if scheme != "a16w8" {
        anyhow::bail!("--scheme {scheme:?}: only a16w8 is implemented");
    }
    let dir = model_dir(model)?;
    let ck = Checkpoint::open(&dir)?;
    let st: hexq_calibrate::Stats = read_json(&stats)?;
    let problems = hexq_quantize::check_stats(&st);
    for p in &problems {
        eprintln!("WARNING: {}: {p}", stats.display());
    }
    if !problems.is_empty() && !force {
        anyhow::bail!(
            "{}: {} guard(s) failed (first: {}); refusing to quantize (pass --force to override)",
            stats.display(),
            problems.len(),
            problems[0]
        );
    }
    let v = hexq_model::graph::Variant::parse(&st.variant)
        .ok_or_else(|| anyhow::anyhow!("{}: unknown variant {:?}", stats.display(), st.variant))?;
    let g = hexq_model::graph::build(
        &ck.config,
        v,
        &hexq_model::graph::GraphOptions {
            context: st.context,
            seq: st.seq,
        },
    );
    let ov = match overrides {
        Some(p) => hexq_quantize::Overrides::from_file(&p)?,
        None => Default::default(),
    };
    let mut sch = hexq_quantize::Scheme::a16w8(int8_kv);
    if full_mask_range {
        sch.mask_floor = None;
    }
    let mut enc = hexq_quantize::encode(&ck, &g, &st, &sch, &ov)?;
    enc.hexq["context"] = st.context.into();
    enc.hexq["seq"] = st.seq.into();
    enc.hexq["variant"] = st.variant.clone().into();
    write_json(&out, &enc)?;
    eprintln!(
        "{}: {} activation + {} param encodings ({}{})",
        out.display(),
        enc.activation_encodings.len(),
        enc.param_encodings.len(),
        scheme,
        if int8_kv { ", int8 KV" } else { "" }
    );
    Ok(())
}

#[allow(clippy::too_many_arguments)]
/// `hexq verify --backend qnn`: per export dir × target, HTP-simulated vs float, vs hexq's quantsim, and
/// quantsim vs float as the baseline — the offline answer to "will the device match quantsim?".
fn verify_qnn(
    model: Option<PathBuf>,
    artifacts: Vec<PathBuf>,
    targets: String,
    dataset: PathBuf,
    limit: Option<usize>,
    steps: usize,
    as_json: bool,
) -> Result<()> {
    use hexq_model::graph::{GraphOptions, Variant};
    use hexq_quantize::verify::{backend, compare, compare_many, quantsim};
    use hexq_runtime::ort::{manifest, Ep, OrtBackend};
    if artifacts.is_empty() {
        anyhow::bail!("--backend qnn needs --artifacts DIR (compiled by `hexq compile`)");
    }
    let dir = model_dir(model)?;
    let ck = Arc::new(Checkpoint::open(&dir)?);
    let tok = Tokenizer::from_dir(&dir)?;
    let mut recs = hexq_calibrate::load_dataset(&dataset)?;
    if let Some(n) = limit {
        recs.truncate(n);
    }
    let quiet = StdoutToStderr::new();
    let mut rows = Vec::new();
    for a in &artifacts {
        let m = manifest(a)?;
        let vname = m["variant"].as_str().unwrap_or_default().to_string();
        // decode_wgqa_int8kv is decode_wgqa's graph with int8 KV encodings.
        let v = Variant::parse(vname.trim_end_matches("_int8kv"))
            .ok_or_else(|| anyhow::anyhow!("{}: unknown variant {vname:?}", a.display()))?;
        let o = GraphOptions {
            context: m["graph"]["context"].as_u64().unwrap_or(4096) as usize,
            seq: m["graph"]["seq"].as_u64().unwrap_or(128) as usize,
        };
        let encp = a.join(format!("{vname}.encodings.json"));
        let enc: hexq_quantize::Encodings = read_json(&encp)?;
        let st = if v == Variant::Trunk { 0 } else { steps };
        let mut float = backend(&ck, v, &o)?;
        let mut qs = quantsim(&ck, &enc, v, &o)?;
        let pb = count_progress(&format!("{vname}: quantsim vs float"));
        let r = compare(&vname, &mut float, &mut qs, &tok, &recs, o.context, st, &pb)?;
        pb.finish_and_clear();
        rows.push(json!({"variant": vname, "target": "-", "candidate": "quantsim", "reference": "float", "report": r}));
        for t in targets.split(',').map(str::trim).filter(|t| !t.is_empty()) {
            let mut htp = OrtBackend::open(&[a.clone()], 1, Ep::Qnn { target: t.into() })?;
            // HTP runs once against both references (decode steps follow float's greedy tokens).
            let pb = count_progress(&format!("{vname} {t}: HTP vs float and quantsim"));
            let rs = compare_many(
                &vname,
                &mut [&mut float, &mut qs],
                &mut htp,
                &tok,
                &recs,
                o.context,
                st,
                &pb,
            )?;
            pb.finish_and_clear();
            for (refname, r) in ["float", "quantsim"].into_iter().zip(rs) {
                rows.push(json!({"variant": vname, "target": t, "candidate": "htp", "reference": refname,
                                 "contexts_created": htp.sessions_created, "kv_buffers_allocated": htp.kv_buffers_allocated,
                                 "report": r}));
            }
        }
    }
    drop(quiet);
    if as_json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    println!("| variant | target | candidate vs reference | top-1 | hidden cos mean / min | KL mean / max | greedy exact | decode cos per step (mean) |");
    println!("|---|---|---|---|---|---|---|---|");
    for r in &rows {
        let p = &r["report"];
        let tr: Vec<String> = p["step_cosine_mean"]
            .as_array()
            .map(|v| {
                v.iter()
                    .map(|c| format!("{:.4}", c.as_f64().unwrap_or(0.0)))
                    .collect()
            })
            .unwrap_or_default();
        println!(
            "| {} | {} | {} vs {} | {:.1} % | {:.5} / {:.5} | {:.2e} / {:.2e} | {} | {} |",
            r["variant"].as_str().unwrap_or(""),
            r["target"].as_str().unwrap_or(""),
            r["candidate"].as_str().unwrap_or(""),
            r["reference"].as_str().unwrap_or(""),
            100.0 * p["top1_agreement"].as_f64().unwrap_or(0.0),
            p["cosine_mean"].as_f64().unwrap_or(0.0),
            p["cosine_min"].as_f64().unwrap_or(0.0),
            p["kl_mean"].as_f64().unwrap_or(0.0),
            p["kl_max"].as_f64().unwrap_or(0.0),
            if p["greedy_steps"].as_u64().unwrap_or(0) > 0 {
                format!(
                    "{}/{} ({} steps)",
                    p["greedy_exact"], p["prompts"], p["greedy_steps"]
                )
            } else {
                "-".into()
            },
            if tr.is_empty() {
                "-".into()
            } else {
                tr.join(" → ")
            }
        );
    }
    Ok(())
}

fn verify(
    model: Option<PathBuf>,
    encodings: PathBuf,
    stats: Option<PathBuf>,
    dataset: PathBuf,
    limit: Option<usize>,
    steps: usize,
    as_json: bool,
) -> Result<()> {
    let dir = model_dir(model)?;
    let ck = Arc::new(Checkpoint::open(&dir)?);
    let tok = Tokenizer::from_dir(&dir)?;
    let enc: hexq_quantize::Encodings = read_json(&encodings)?;
    let st: Option<hexq_calibrate::Stats> = stats.as_deref().map(read_json).transpose()?;
    let v = enc.hexq["variant"]
        .as_str()
        .and_then(hexq_model::graph::Variant::parse)
        .ok_or_else(|| anyhow::anyhow!("{}: no hexq.variant", encodings.display()))?;
    let o = hexq_model::graph::GraphOptions {
        context: enc.hexq["context"].as_u64().unwrap_or(4096) as usize,
        seq: enc.hexq["seq"].as_u64().unwrap_or(128) as usize,
    };
    let mut recs = hexq_calibrate::load_dataset(&dataset)?;
    if let Some(n) = limit {
        recs.truncate(n);
    }
    let pb = count_progress("verify");
    let r = hexq_quantize::verify::verify(ck, &tok, &recs, &enc, st.as_ref(), v, &o, steps, &pb)?;
    pb.finish_and_clear();
    if as_json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        println!(
            "| metric ({} on {} held-out prompts) | value |\n|---|---|",
            r.variant, r.prompts
        );
        println!(
            "| next-token top-1 agreement (prefill) | {:.1} % |",
            100.0 * r.top1_agreement
        );
        println!(
            "| hidden cosine mean / min | {:.5} / {:.5} |",
            r.cosine_mean, r.cosine_min
        );
        println!(
            "| KL(float ‖ quant) mean / max | {:.2e} / {:.2e} |",
            r.kl_mean, r.kl_max
        );
        if r.greedy_steps > 0 {
            println!(
                "| token-exact greedy, {} steps | {}/{} |",
                r.greedy_steps, r.greedy_exact, r.prompts
            );
            let tr: Vec<String> = r
                .step_cosine_mean
                .iter()
                .map(|c| format!("{c:.4}"))
                .collect();
            println!("| decode cosine per step (mean) | {} |", tr.join(" → "));
        }
        println!(
            "| final hidden norm ratio min (quant/float) | {:.3}{} |",
            r.norm_ratio_min,
            if r.collapsed {
                "  COLLAPSED (< 0.1)"
            } else {
                ""
            }
        );
        if st.is_some() {
            println!(
                "| tensors outside calibrated range on held-out | {} |",
                r.coverage_outside.len()
            );
            for c in r.coverage_outside.iter().take(5) {
                println!(
                    "|   {} | calib [{:.4}, {:.4}] held-out [{:.4}, {:.4}] (+{:.1} % of range) |",
                    c.tensor,
                    c.calibrated.0,
                    c.calibrated.1,
                    c.heldout.0,
                    c.heldout.1,
                    100.0 * c.excess
                );
            }
        }
    }
    if r.collapsed {
        anyhow::bail!("quantsim's final hidden norm collapsed to {:.3} of float (< 10 %): these encodings would produce noise", r.norm_ratio_min);
    }
    Ok(())
}

fn pipeline(
    model: Option<PathBuf>,
    out: PathBuf,
    calib_limit: usize,
    verify_limit: usize,
    context: usize,
) -> Result<()> {
    std::fs::create_dir_all(&out)?;
    let (st, enc, enc8) = (
        out.join("stats.decode_wgqa.json"),
        out.join("decode_wgqa.encodings.json"),
        out.join("decode_wgqa_int8kv.encodings.json"),
    );
    eprintln!("== inspect");
    inspect(model.clone(), false, false)?;
    eprintln!("== run (cpu reference, then the decode_wgqa graph)");
    run(RunArgs {
        model: model.clone(),
        prompt: "What is the capital of France?".into(),
        system: None,
        max_tokens: 16,
        backend: BackendKind::Cpu,
        context,
        seq: 128,
        artifacts: vec![],
        threads: 0,
        target: "v79".into(),
        gguf: None,
        json: false,
    })?;
    run(RunArgs {
        model: model.clone(),
        prompt: "What is the capital of France?".into(),
        system: None,
        max_tokens: 16,
        backend: BackendKind::Graph,
        context,
        seq: 128,
        artifacts: vec![],
        threads: 0,
        target: "v79".into(),
        gguf: None,
        json: false,
    })?;
    eprintln!("== calibrate ({calib_limit} chat-formatted prompts, 8 decode tokens each)");
    calibrate(
        model.clone(),
        "datasets/calibration.jsonl".into(),
        VariantArg::DecodeWgqa,
        8,
        Some(calib_limit),
        context,
        128,
        false,
        "int8".into(),
        None,
        "interp".into(),
        false,
        st.clone(),
    )?;
    eprintln!("== quantize (A16W8, and A16W8 + int8 KV)");
    quantize(
        model.clone(),
        st.clone(),
        "a16w8".into(),
        false,
        false,
        None,
        false,
        enc.clone(),
    )?;
    quantize(
        model.clone(),
        st.clone(),
        "a16w8".into(),
        true,
        false,
        None,
        false,
        enc8.clone(),
    )?;
    eprintln!("== verify A16W8 ({verify_limit} held-out prompts)");
    verify(
        model.clone(),
        enc.clone(),
        Some(st.clone()),
        "datasets/heldout.jsonl".into(),
        Some(verify_limit),
        8,
        false,
    )?;
    eprintln!("== verify A16W8 + int8 KV");
    verify(
        model.clone(),
        enc8.clone(),
        Some(st),
        "datasets/heldout.jsonl".into(),
        Some(verify_limit),
        8,
        false,
    )?;
    let go = hexq_model::graph::GraphOptions { context, seq: 128 };
    for (variant, e) in [("decode_wgqa", &enc), ("decode_wgqa_int8kv", &enc8)] {
        eprintln!("== export {variant} (QDQ from the encodings, host-model/, manifest)");
        export(
            model.clone(),
            variant.into(),
            go,
            Some(e.clone()),
            true,
            "f32".into(),
            "native".into(),
            out.join(format!("{variant}.qdq")),
            true,
            false,
        )?;
    }
    eprintln!("== export trunk (float)");
    export(
        model.clone(),
        "trunk".into(),
        go,
        None,
        false,
        "f32".into(),
        "native".into(),
        out.join("trunk"),
        true,
        false,
    )?;
    eprintln!("== run the QDQ decode_wgqa export in onnxruntime");
    run(RunArgs {
        model: model.clone(),
        prompt: "What is the capital of France?".into(),
        system: None,
        max_tokens: 16,
        backend: BackendKind::Ort,
        context,
        seq: 128,
        artifacts: vec![out.join("decode_wgqa.qdq")],
        threads: 0,
        target: "v79".into(),
        gguf: None,
        json: false,
    })?;
    let qnn_ok = hexq_runtime::ort::find_qnn().is_ok();
    if qnn_ok {
        let d = out.join("decode_wgqa.qdq");
        for t in ["v79", "v81"] {
            eprintln!("== compile decode_wgqa for {t} (QNN HTP via onnxruntime-qnn), run it on the HTP simulator");
            compile::compile(compile::Args {
                dir: d.clone(),
                target: t.into(),
                toolchain: "ort-qnn".into(),
                dry_run: false,
                force: true,
                json: false,
                calib_steps: 8,
            })?;
            run(RunArgs {
                model: model.clone(),
                prompt: "What is the capital of France?".into(),
                system: None,
                max_tokens: 8,
                backend: BackendKind::Qnn,
                context,
                seq: 128,
                artifacts: vec![d.clone()],
                threads: 0,
                target: t.into(),
                gguf: None,
                json: false,
            })?;
        }
        eprintln!("== verify the v79/v81 binaries on the HTP simulator (4 held-out prompts)");
        verify_qnn(
            model.clone(),
            vec![d],
            "v79,v81".into(),
            "datasets/heldout.jsonl".into(),
            Some(4),
            4,
            false,
        )?;
    } else {
        eprintln!("== compile/qnn skipped: python3 cannot import onnxruntime_qnn (pip install onnxruntime-qnn==2.7.0)");
    }
    eprintln!("== GGUF q4_0 (--pure, the published 4-bit mix) and f16");
    gguf(
        model.clone(),
        "q4_0".into(),
        true,
        out.join("model-q4_0-pure.gguf"),
        true,
        false,
    )?;
    gguf(
        model.clone(),
        "f16".into(),
        false,
        out.join("model-f16.gguf"),
        true,
        false,
    )?;
    eprintln!("== weight-grid ablation (heavy-tailed input channels)");
    ablate(
        model,
        "int8-pc,int4-pc,q4_0-g32,g64,g128,int4-pc-mlp-only".into(),
        "datasets/heldout.jsonl".into(),
        verify_limit,
        true,
        context,
        false,
        false,
        Some(out.join("ablate.svg")),
    )?;
    eprintln!("artifacts in {}", out.display());
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn export(
    model: Option<PathBuf>,
    variant: String,
    graph: hexq_model::graph::GraphOptions,
    encodings: Option<PathBuf>,
    qdq: bool,
    weights: String,
    host: String,
    out: PathBuf,
    force: bool,
    as_json: bool,
) -> Result<()> {
    use hexq_export::host::HostDType;
    let variant = variant.replace('-', "_");
    hexq_export::variant_graph(&variant)?;
    let dir = model_dir(model)?;
    let ck = Checkpoint::open(&dir)?;
    let enc = match &encodings {
        Some(p) => Some((p.as_path(), read_json::<hexq_quantize::Encodings>(p)?)),
        None => None,
    };
    let staging = hexq_model::fsutil::AtomicDir::create(&out, force)?;
    let t0 = std::time::Instant::now();
    let total: u64 = ck
        .tensors
        .iter()
        .map(|(_, i)| (i.end - i.start) as u64)
        .sum();
    let pb = progress(total, "export");
    let tick = |n: u64| pb.inc(n);
    let manifest = hexq_export::export(
        &ck,
        &staging.tmp,
        &hexq_export::Options {
            variant,
            graph,
            encodings: enc,
            qdq,
            weights: if weights == "f16" {
                hexq_export::onnx::WeightType::F16
            } else {
                hexq_export::onnx::WeightType::F32
            },
            host: match host.as_str() {
                "int8" => Some(HostDType::Int8),
                "int4" => Some(HostDType::Int4),
                "none" => None,
                _ => Some(HostDType::Native),
            },
            command: std::env::args().collect(),
            progress: Some(&tick),
            calibration: None,
        },
    )?;
    pb.finish_and_clear();
    let dest = staging.commit()?;
    if as_json {
        println!("{}", serde_json::to_string_pretty(&manifest)?);
    } else {
        for f in manifest["files"].as_array().unwrap() {
            println!("{:>14}  {}", f["bytes"], f["path"].as_str().unwrap());
        }
        eprintln!("{} ({:.1}s)", dest.display(), t0.elapsed().as_secs_f64());
    }
    Ok(())
}

fn gguf(
    model: Option<PathBuf>,
    ty: String,
    pure: bool,
    out: PathBuf,
    force: bool,
    as_json: bool,
) -> Result<()> {
    use hexq_export::gguf;
    if out.exists() && !force {
        anyhow::bail!(
            "{}: already exists (pass --force to replace it)",
            out.display()
        );
    }
    let dir = model_dir(model)?;
    let ck = Checkpoint::open(&dir)?;
    let ft = gguf::FileType::parse(&ty).unwrap();
    let total: u64 = ck
        .tensors
        .iter()
        .map(|(_, i)| (i.end - i.start) as u64)
        .sum();
    let pb = progress(total, "gguf");
    let t0 = std::time::Instant::now();
    let tick = |n: u64| pb.inc(n);
    let (plan, sha) = gguf::write_gguf(&ck, &out, ft, pure, &tick)?;
    pb.finish_and_clear();
    let mut types = std::collections::BTreeMap::new();
    for p in &plan {
        *types.entry(p.ty.name()).or_insert(0usize) += 1;
    }
    let m = json!({
        "hexq_version": env!("CARGO_PKG_VERSION"),
        "command": std::env::args().collect::<Vec<_>>(),
        "file": out.file_name().unwrap().to_string_lossy(),
        "bytes": std::fs::metadata(&out)?.len(),
        "sha256": sha,
        "type": ty, "pure": pure, "tensors": plan.len(), "tensor_types": types,
        // The source's identity without a second pass over 10 GB: config.json's SHA256 and each
        // safetensors file's size and header SHA256 (names, dtypes, shapes, offsets).
        "source": {"dir": ck.dir.display().to_string(), "identity": hexq_export::source_identity(&ck)?},
        "seconds": t0.elapsed().as_secs_f64(),
    });
    let mp = PathBuf::from(format!("{}.manifest.json", out.display()));
    hexq_model::fsutil::write_atomic(
        &mp,
        format!("{}\n", serde_json::to_string_pretty(&m)?).as_bytes(),
    )?;
    if as_json {
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

#[allow(clippy::too_many_arguments)]
fn ablate(
    model: Option<PathBuf>,
    schemes: String,
    dataset: PathBuf,
    limit: usize,
    heavy_tail: bool,
    context: usize,
    as_json: bool,
    csv: bool,
    plot: Option<PathBuf>,
) -> Result<()> {
    use hexq_quantize::ablate::{ablate, Scheme};
    let dir = model_dir(model)?;
    let ck = Arc::new(Checkpoint::open(&dir)?);
    let tok = Tokenizer::from_dir(&dir)?;
    let sc: Vec<Scheme> = schemes
        .split(',')
        .map(|s| Scheme::parse(s.trim()).ok_or_else(|| anyhow::anyhow!("unknown scheme {s:?} (int8-pc, int4-pc, int4-pc-mlp-only, q4_0-g32, g64, g128)")))
        .collect::<Result<_>>()?;
    let recs = hexq_calibrate::load_dataset(&dataset)?;
    let mut seqs = Vec::new();
    for r in recs.iter().take(limit) {
        let ids = match &r.messages {
            Some(m) => tok.encode_chat(m)?,
            None => anyhow::bail!(
                "{}: record {} is not chat-formatted",
                dataset.display(),
                r.id
            ),
        };
        seqs.push(ids.into_iter().take(context).collect::<Vec<u32>>());
    }
    let pb = count_progress("ablate");
    pb.set_length(sc.len() as u64 + 1);
    let o = hexq_model::graph::GraphOptions { context, seq: 128 };
    let rep = ablate(&ck, &seqs, &sc, heavy_tail, &o, &pb)?;
    pb.finish_and_clear();
    if let Some(p) = plot {
        hexq_model::fsutil::write_atomic(&p, rep.svg().as_bytes())?;
    }
    if as_json {
        println!("{}", serde_json::to_string_pretty(&rep)?);
    } else if csv {
        print!("{}", rep.csv());
    } else {
        print!("{}", rep.markdown());
    }
    Ok(())
}

fn synth(
    config: PathBuf,
    out: PathBuf,
    seed: u64,
    shard_bytes: u64,
    force: bool,
    as_json: bool,
) -> Result<()> {
    let cfg = hexq_model::ModelConfig::from_file(&config)?;
    let total: u64 = hexq_model::names::expected_tensors(&cfg)
        .iter()
        .map(|t| t.numel() as u64 * 2)
        .sum();
    let pb = progress(total, "synth");
    let opt = hexq_model::synth::SynthOptions {
        seed,
        max_shard_bytes: shard_bytes,
        force,
    };
    let t0 = std::time::Instant::now();
    let r = hexq_model::synth::synth(&config, &out, &opt, &pb)?;
    pb.finish_and_clear();
    let secs = t0.elapsed().as_secs_f64();
    if as_json {
        println!(
            "{}",
            serde_json::to_string_pretty(
                &json!({"dir": r.dir, "files": r.files, "tensors": r.tensors, "bytes": r.bytes, "seconds": secs})
            )?
        );
    } else {
        println!(
            "{}: {} tensors, {:.2} GiB bf16 in {} file(s), {:.1}s",
            r.dir.display(),
            r.tensors,
            r.bytes as f64 / (1u64 << 30) as f64,
            r.files.len(),
            secs
        );
    }
    Ok(())
}

fn main() {
    // A file-size limit (RLIMIT_FSIZE) must surface as a write error naming the file (EFBIG), cleaned up
    // like any disk error — not as SIGXFSZ killing the process with a half-written output behind it.
    #[cfg(unix)]
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
    }
    let cli = Cli::parse();
    let res = match cli.cmd {
        Cmd::Inspect {
            model,
            tensors,
            json,
        } => inspect(model, tensors, json),
        Cmd::Run(a) => run(a),
        Cmd::Ablate {
            model,
            schemes,
            dataset,
            limit,
            heavy_tail,
            context,
            json,
            csv,
            plot,
        } => ablate(
            model, schemes, dataset, limit, heavy_tail, context, json, csv, plot,
        ),
        Cmd::Gguf {
            model,
            ty,
            pure,
            out,
            force,
            json,
        } => gguf(model, ty, pure, out, force, json),
        Cmd::Graph {
            model,
            variant,
            context,
            seq,
            io_contract,
            json,
        } => graph(model, variant, context, seq, io_contract, json),
        Cmd::Pipeline {
            model,
            out,
            calib_limit,
            verify_limit,
            context,
        } => pipeline(model, out, calib_limit, verify_limit, context),
        Cmd::Export {
            model,
            variant,
            context,
            seq,
            encodings,
            qdq,
            weights,
            host,
            out,
            force,
            json,
        } => export(
            model,
            variant,
            hexq_model::graph::GraphOptions { context, seq },
            encodings,
            qdq,
            weights,
            host,
            out,
            force,
            json,
        ),
        Cmd::Calibrate {
            model,
            dataset,
            variant,
            decode_tokens,
            limit,
            context,
            seq,
            noise,
            params,
            overrides,
            engine,
            force,
            out,
        } => calibrate(
            model,
            dataset,
            variant,
            decode_tokens,
            limit,
            context,
            seq,
            noise,
            params,
            overrides,
            engine,
            force,
            out,
        ),
        Cmd::Quantize {
            model,
            stats,
            scheme,
            int8_kv,
            full_mask_range,
            overrides,
            force,
            out,
        } => quantize(
            model,
            stats,
            scheme,
            int8_kv,
            full_mask_range,
            overrides,
            force,
            out,
        ),
        Cmd::Verify {
            model,
            backend,
            encodings,
            artifacts,
            targets,
            stats,
            dataset,
            limit,
            steps,
            json,
        } => {
            if backend == "qnn" {
                verify_qnn(model, artifacts, targets, dataset, limit, steps, json)
            } else {
                verify(
                    model,
                    encodings.unwrap(),
                    stats,
                    dataset,
                    limit,
                    steps,
                    json,
                )
            }
        }
        Cmd::Synth {
            config,
            out,
            seed,
            shard_bytes,
            force,
            json,
        } => synth(config, out, seed, shard_bytes, force, json),
        Cmd::Compile {
            artifacts,
            target,
            toolchain,
            dry_run,
            calib_steps,
            force,
            json,
        } => compile::compile(compile::Args {
            dir: artifacts,
            target,
            toolchain,
            dry_run,
            force,
            json,
            calib_steps,
        }),
    };
    if let Err(e) = res {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
