//! `hexq run`: greedy generation with the chat template on one backend.

use super::{model_dir, StdoutToStderr};
use anyhow::Result;
use clap::ValueEnum;
use hexq_graph::{GraphOptions, Variant};
use hexq_model::chat::{Message, Tokenizer};
use hexq_model::{Checkpoint, Model};
use std::path::PathBuf;
use std::sync::Arc;

/// Which backend runs the model, and what it needs: the options `run`, `chat` and `serve` share.
#[derive(clap::Args, Clone)]
pub struct BackendArgs {
    /// Checkpoint directory (config.json + safetensors); default: the bundled tiny Gemma-4.
    #[arg(long)]
    pub model: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = BackendKind::Cpu)]
    pub backend: BackendKind,
    /// Graph backend: full-attention buffer length (max context).
    #[arg(long, default_value_t = 4096, value_parser = super::positive)]
    pub context: usize,
    /// Graph backend: trunk chunk length (0 = no trunk, prompt token by token through decode).
    #[arg(long, default_value_t = 128)]
    pub seq: usize,
    /// ort/qnn backends: `hexq export` directories (one decode variant, optionally a trunk); the host side
    /// comes from their host-model/.
    #[arg(long)]
    pub artifacts: Vec<PathBuf>,
    /// ort/llama backends: threads (0 = the runtime's default).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// qnn backend: the HTP target whose compiled binary runs (v79, v81, v75).
    #[arg(long, default_value = "v79")]
    pub target: String,
    /// llama backend: the GGUF to run (llama.cpp from $LLAMA_CPP_BUILD); tokenizer and chat template from --model.
    #[arg(long)]
    pub gguf: Option<PathBuf>,
}

impl BackendArgs {
    /// `backend` on `model` with every other option at its default.
    pub fn new(model: Option<PathBuf>, backend: BackendKind) -> Self {
        BackendArgs {
            model,
            backend,
            context: 4096,
            seq: 128,
            artifacts: vec![],
            threads: 0,
            target: "v79".into(),
            gguf: None,
        }
    }
}

#[derive(clap::Args, Clone)]
pub struct Args {
    #[command(flatten)]
    pub b: BackendArgs,
    #[arg(long)]
    pub prompt: String,
    /// Optional system turn before the prompt.
    #[arg(long)]
    pub system: Option<String>,
    #[arg(long, default_value_t = 32)]
    pub max_tokens: usize,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[arg(long)]
    pub json: bool,
}

impl Args {
    /// A run of `prompt` on `backend` with every other option at its default (the pipeline's runs).
    pub fn new(
        model: Option<PathBuf>,
        backend: BackendKind,
        prompt: &str,
        max_tokens: usize,
    ) -> Self {
        Args {
            b: BackendArgs::new(model, backend),
            prompt: prompt.into(),
            system: None,
            max_tokens,
            sampling: SamplingArgs::default(),
            json: false,
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
pub enum BackendKind {
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

pub fn run(a: Args) -> Result<()> {
    let sampling = a.sampling.sampling();
    let quiet = matches!(a.b.backend, BackendKind::Qnn).then(StdoutToStderr::new);
    let (mut b, tok) = open_backend(&a.b)?;
    let (system, prompt, max_tokens, as_json) = (a.system, a.prompt, a.max_tokens, a.json);
    let mut msgs = Vec::new();
    if let Some(s) = system {
        msgs.push(Message {
            role: "system".into(),
            content: s,
        });
    }
    msgs.push(Message::user(&prompt));
    let g = hexq_runtime::generate_with(b.as_mut(), &tok, &msgs, max_tokens, &sampling)?;
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

/// Sampling flags, shared by `run` and `chat`.
#[derive(clap::Args, Clone, Debug)]
pub struct SamplingArgs {
    /// Sampling temperature; 0 (the default) is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Keep the k most likely tokens before drawing (0 = off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches p (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Drop tokens less likely than min-p × the most likely one (0 = off).
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    /// llama.cpp's repetition penalty over the last 64 tokens (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Seed of the draw: the same seed gives the same tokens wherever the logits are the same.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

impl Default for SamplingArgs {
    fn default() -> Self {
        let d = hexq_runtime::sample::Sampling::default();
        SamplingArgs {
            temperature: d.temperature,
            top_k: d.top_k,
            top_p: d.top_p,
            min_p: d.min_p,
            repeat_penalty: d.repeat_penalty,
            seed: d.seed,
        }
    }
}

impl SamplingArgs {
    /// The sampling configuration, checked (an out-of-range value is a usage error, exit 2).
    pub fn sampling(&self) -> hexq_runtime::sample::Sampling {
        let s = hexq_runtime::sample::Sampling {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            seed: self.seed,
            ..Default::default()
        };
        if let Err(e) = s.check() {
            eprintln!("error: invalid value {e}");
            std::process::exit(2);
        }
        s
    }
}

/// The backend `a` names, and the tokenizer that goes with it.
pub fn open_backend(a: &BackendArgs) -> Result<(Box<dyn hexq_runtime::Backend>, Tokenizer)> {
    use hexq_runtime::ort::Ep;
    Ok(match a.backend {
        BackendKind::Cpu | BackendKind::Graph => {
            let dir = model_dir(a.model.clone())?;
            let ck = Arc::new(Checkpoint::open(&dir)?);
            let tok = Tokenizer::from_dir(&dir)?;
            let b: Box<dyn hexq_runtime::Backend> = if matches!(a.backend, BackendKind::Cpu) {
                Box::new(hexq_runtime::CpuBackend::new(Model::load(ck)?))
            } else {
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
            let tok = gguf_tokenizer(&g)?;
            if let Some(m) = &a.model {
                let mt = Tokenizer::from_dir(m)?;
                if !tok.same_vocab(&mt) {
                    anyhow::bail!(
                        "{}: its vocabulary ({} tokens) differs from --model {}'s ({} tokens); drop --model \
                         (a GGUF carries its own tokenizer) or pass the checkpoint it was made from",
                        g.display(),
                        tok.vocab_size(),
                        m.display(),
                        mt.vocab_size()
                    );
                }
            }
            let b = hexq_runtime::llama::LlamaBackend::open(&g, a.context, a.threads)?;
            (Box::new(b), tok)
        }
    })
}

/// A GGUF is self-describing: its tokenizer and chat template rebuilt from its metadata, as `hexq import`
/// writes them (and as llama.cpp tokenizes it).
fn gguf_tokenizer(g: &std::path::Path) -> Result<Tokenizer> {
    let f = hexq_gguf::GgufFile::open(g).map_err(|e| anyhow::anyhow!("{e}"))?;
    let t = hexq_import::tokenizer::files(&f)?;
    let template = (!t.chat_template.is_empty()).then(|| t.chat_template.clone());
    Ok(Tokenizer::from_parts(
        g,
        t.tokenizer_json.as_bytes(),
        Some(&t.tokenizer_config),
        template,
    )?)
}
