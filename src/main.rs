//! `hexq` — the command line over the pipeline crates. One file per subcommand under `cmd/`.

mod bundled;
mod cmd;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "hexq",
    version,
    about = "Gemma-4 → Qualcomm Hexagon NPU: load, calibrate, quantize, export, compile, run, verify"
)]
struct Cli {
    /// Open checkpoints whose weights hold NaN or inf (refused by default, naming the file and tensor).
    #[arg(long, global = true)]
    allow_nonfinite: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Summarise a checkpoint: config, per-layer facts, parameter counts, tensors.
    Inspect(cmd::inspect::Args),
    /// Generate from a chat-formatted prompt (greedy, or sampled with --temperature …).
    Run(cmd::run::Args),
    /// Multi-turn chat, one user turn per stdin line: replies streamed, the KV cache kept across turns
    /// (only the new turn is fed), TTFT and decode tok/s per turn; /reset, /quit.
    Chat(cmd::chat::Args),
    /// An OpenAI-compatible HTTP server (POST /v1/chat/completions, streaming or not; GET /v1/models,
    /// /health) over any backend: one model loaded once, requests answered in order, llama-server's timings.
    Serve(cmd::serve::Args),
    /// Build a deployable graph and summarise it (I/O, op histogram, Expand count, KV bytes per step).
    Graph(cmd::graph::Args),
    /// Record activation ranges of a graph on chat-formatted decode loops.
    Calibrate(cmd::calibrate::Args),
    /// llama.cpp's importance matrix (GGUF) from chat-formatted decode loops, for `llama-quantize --imatrix`.
    Imatrix(cmd::imatrix::Args),
    /// llama-perplexity's PPL (and, against a base logits file, its KLD statistics) on any backend.
    Perplexity(cmd::perplexity::Args),
    /// 0-shot chat-formatted multiple choice (MMLU's CSV or JSONL) on any backend, accuracy ± bootstrap SE.
    Mmlu(cmd::mmlu::Args),
    /// Compute A16W8 encodings (AIMET/QNN format) from calibration stats and the weights.
    Quantize(cmd::quantize::Args),
    /// Quantsim vs float on held-out prompts: top-1, hidden cosine, KL, token-exact greedy, per-step cosine.
    Verify(cmd::verify::Args),
    /// The main job end to end on a model (default: the bundled tiny Gemma-4), ending with a table of every
    /// stage; stages whose tool is not installed are skipped with the command that enables them.
    Pipeline(cmd::pipeline::Args),
    /// Rebuild an artifact set from a recipe (recipes/*.toml): calibrate → quantize → export → compile
    /// (optionally one weight-shared prefill+decode binary per target) and GGUF files; resumable, with a
    /// manifest of every input's and output's SHA256.
    Build(cmd::build::Args),
    /// Export one variant's artifacts: `<variant>.onnx` + .data (float, or QDQ with --qdq), the encodings beside
    /// it, host-model/ (vocab tensors + tokenizer), io-contract.json, manifest.json (sizes, SHA256s).
    Export(cmd::export::Args),
    /// Write a GGUF llama.cpp loads (gemma4 architecture, metadata as its converter writes it), streamed from
    /// the safetensors; q4_0/q8_0/q6_K blocks bit-identical to ggml's reference quantizers.
    Gguf(cmd::gguf::Args),
    /// Weights-only grid ablation vs float: bits/weight, size, SQNR per tensor class, top-1, KL, perplexity,
    /// hidden cosine — Markdown table (or --json/--csv), and an SVG of accuracy vs bits/weight.
    Ablate(cmd::ablate::Args),
    /// Compile an export to a QNN HTP context binary for a target: `<variant>_<target>.bin` + its EPContext
    /// `.onnx` in the export dir, recorded in manifest.json and SHA256SUMS; the embedded SoC/arch is checked.
    Compile(cmd::compile::Args),
    /// A Genie bundle from a shared prefill+decode build: genie_config.json (validated against Genie's
    /// schema), htp_backend_ext_config.json, the binary, tokenizer, embedding LUTs, and genie-io.json — where
    /// the graphs' I/O differs from what Genie's engine expects.
    Genie(cmd::genie::Args),
    /// Import a GGUF as a Hugging Face-layout checkpoint (config.json, safetensors, tokenizer, chat template).
    Import(cmd::import::Args),
    /// Write a random-weight bf16 checkpoint with the real names and shapes of a config (streamed).
    Synth(cmd::synth::Args),
}

/// glibc hands freed memory back to the kernel eagerly (heap trimming; blocks over a moving threshold are
/// mmap'd and unmapped on free), so a loop that frees and reallocates large buffers faults in and zeroes
/// fresh pages every time: at E2B size 38 s of calibrate's 4.4 min were kernel time (20 s after this). Keep
/// freed memory in the heap instead: no trimming, no mmap'd blocks (peak RSS measured unchanged).
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
        libc::mallopt(libc::M_TOP_PAD, 64 << 20);
        libc::mallopt(libc::M_MMAP_MAX, 0);
    }
}

fn main() {
    // A file-size limit (RLIMIT_FSIZE) must surface as a write error naming the file (EFBIG), cleaned up
    // like any disk error — not as SIGXFSZ killing the process with a half-written output behind it.
    #[cfg(unix)]
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
    }
    // Ctrl-C / SIGTERM: remove the temp outputs in flight, exit 130 / 143.
    hexq_fsutil::signals::install();
    keep_freed_memory();
    let cli = Cli::parse();
    hexq_model::checkpoint::ALLOW_NONFINITE
        .store(cli.allow_nonfinite, std::sync::atomic::Ordering::Relaxed);
    let res = match cli.cmd {
        Cmd::Inspect(a) => cmd::inspect::run(a),
        Cmd::Run(a) => cmd::run::run(a),
        Cmd::Graph(a) => cmd::graph::run(a),
        Cmd::Calibrate(a) => cmd::calibrate::run(a),
        Cmd::Imatrix(a) => cmd::imatrix::run(a),
        Cmd::Perplexity(a) => cmd::perplexity::run(a),
        Cmd::Mmlu(a) => cmd::mmlu::run(a),
        Cmd::Quantize(a) => cmd::quantize::run(a),
        Cmd::Verify(a) => cmd::verify::run(a),
        Cmd::Pipeline(a) => cmd::pipeline::run(a),
        Cmd::Build(a) => cmd::build::run(a),
        Cmd::Chat(a) => cmd::chat::run(a),
        Cmd::Serve(a) => cmd::serve::run(a),
        Cmd::Export(a) => cmd::export::run(a),
        Cmd::Gguf(a) => cmd::gguf::run(a),
        Cmd::Ablate(a) => cmd::ablate::run(a),
        Cmd::Compile(a) => cmd::compile::run(a),
        Cmd::Genie(a) => cmd::genie::run(a),
        Cmd::Synth(a) => cmd::synth::run(a),
        Cmd::Import(a) => cmd::import::run(a),
    };
    if let Some(p) = hexq_graph::interp::profile_report() {
        eprintln!("interpreter time by op (HEXQ_PROFILE):\n{p}");
    }
    if let Err(e) = res {
        // The cause chain, each cause once (typed errors already spell their source: "file: os error").
        let mut msg = e.to_string();
        for c in e.chain().skip(1) {
            let c = c.to_string();
            if !msg.contains(&c) {
                msg = format!("{msg}: {c}");
            }
        }
        eprintln!("error: {}", user_paths(&msg));
        std::process::exit(1);
    }
}

/// An error as the user should read it: temp outputs (`DIR/.NAME.tmp-PID`) named by the `--out` they become,
/// and a part repeated back to back ("F: F: os error") said once.
fn user_paths(msg: &str) -> String {
    let tag = format!(".tmp-{}", std::process::id());
    let mut m = msg.to_string();
    while let Some(i) = m.find(&tag) {
        let j = m[..i].rfind(['/', ' ']).map_or(0, |j| j + 1);
        let name = m[j..i].strip_prefix('.').unwrap_or(&m[j..i]).to_string();
        m.replace_range(j..i + tag.len(), &name);
    }
    let mut parts: Vec<&str> = Vec::new();
    for p in m.split(": ") {
        if parts.last() != Some(&p) {
            parts.push(p);
        }
    }
    parts.join(": ")
}
