//! hexq-runtime: the host loop — chat template, embeddings, KV positions, lm_head + softcap, greedy
//! sampling, stop on `<turn|>` (106) or `<eos>` (1) — over interchangeable backends. A backend only turns
//! token ids at the next positions into next-token logits; everything else is here, shared.
//!
//! Backends: `cpu` (the reference forward), `graph` (IR interpreter), `ort` (exported ONNX in onnxruntime,
//! host side from host-model/), `qnn` (the compiled context binary on QNN HTP through onnxruntime-qnn;
//! the simulator on x86-64), `llama` (a GGUF in llama.cpp).
//!
//! May import: model, graph, kernels, fsutil; never calibrate, quantize or later (they stand on it).

pub mod error;
pub mod graph;
pub mod host;
pub mod llama;
pub mod ort;
pub mod sample;

use hexq_model::chat::{Message, Tokenizer, STOP_IDS};
use hexq_model::forward::to_rows;
use hexq_model::{KvCache, Model};
use serde::Serialize;
use std::time::Instant;

pub use error::{Error, Result};

pub trait Backend {
    fn name(&self) -> &str;
    /// Forget all positions.
    fn reset(&mut self);
    /// Run `ids` at the next positions; return the logits (after softcap) of the last one.
    fn feed(&mut self, ids: &[u32]) -> Result<Vec<f32>>;
    /// Run `ids` at the next positions; the logits of every one from index `from` of `ids` on (teacher
    /// forcing, as perplexity scores). By default one position at a time through [`Backend::feed`].
    fn feed_all(&mut self, ids: &[u32], from: usize) -> Result<Vec<Vec<f32>>> {
        feed_each(self, ids, from)
    }
    /// Positions the backend can hold (the KV buffers' length), when bounded.
    fn capacity(&self) -> Option<usize> {
        None
    }
    /// Counters a run reports (sessions/contexts created, buffers allocated, steps).
    fn stats(&self) -> Option<serde_json::Value> {
        None
    }
}

/// [`Backend::feed_all`] one position at a time: the default, and a backend's fallback.
pub fn feed_each<B: Backend + ?Sized>(
    b: &mut B,
    ids: &[u32],
    from: usize,
) -> Result<Vec<Vec<f32>>> {
    let mut out = Vec::with_capacity(ids.len().saturating_sub(from));
    for (i, &t) in ids.iter().enumerate() {
        let l = b.feed(&[t])?;
        if i >= from {
            out.push(l);
        }
    }
    Ok(out)
}

/// The f32 reference forward with its KV cache.
pub struct CpuBackend {
    pub model: Model,
    cache: KvCache,
}

impl CpuBackend {
    pub fn new(model: Model) -> Self {
        let n = model.cfg.num_layers;
        CpuBackend {
            model,
            cache: KvCache::new(n),
        }
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &str {
        "cpu"
    }
    /// The positions the model was trained for (RoPE beyond them is extrapolation, not the model).
    fn capacity(&self) -> Option<usize> {
        Some(self.model.cfg.max_position_embeddings)
    }
    fn reset(&mut self) {
        self.cache = KvCache::new(self.model.cfg.num_layers);
    }
    fn feed(&mut self, ids: &[u32]) -> Result<Vec<f32>> {
        let logits = self.model.forward(ids, &mut self.cache)?;
        let mut rows = to_rows(&logits)?;
        Ok(rows.pop().unwrap_or_default())
    }
}

/// What verification needs from a backend: hidden states by position, one step at a time, and logits.
pub trait Hidden {
    fn reset_all(&mut self);
    /// Hidden states of every position of `ids` (prompt path: trunk chunks when the backend has one).
    fn hidden_all(&mut self, ids: &[u32]) -> Result<Vec<Vec<f32>>>;
    fn step_one(&mut self, id: u32) -> Result<Vec<f32>>;
    fn logits_of(&self, h: &[f32]) -> Result<Vec<f32>>;
    /// Replace the token embeddings by a generator's values (calibration's noise demonstration).
    fn set_noise(&mut self, _f: Option<graph::Noise>) -> Result<()> {
        Err(Error::Unsupported(
            "this backend takes token embeddings only from host-model/".into(),
        ))
    }
}

/// `feed` for a [`Hidden`] backend: several ids through its trunk when it has one (chunked prefill), else
/// one decode step each; the last position's hidden state.
fn last_hidden(b: &mut impl Hidden, ids: &[u32], trunk: bool) -> Result<Vec<f32>> {
    if ids.len() > 1 && trunk {
        return Ok(b.hidden_all(ids)?.pop().unwrap_or_default());
    }
    let mut last = vec![];
    for &id in ids {
        last = b.step_one(id)?;
    }
    Ok(last)
}

/// One [`Hidden`] for both graph-running backends: their own prompt path (trunk chunks) and decode step; the
/// head and the noise hook are what differ.
macro_rules! hidden_via_graphs {
    ($t:ty, logits: $logits:expr, noise: $noise:expr) => {
        impl Hidden for $t {
            fn reset_all(&mut self) {
                Backend::reset(self)
            }
            fn hidden_all(&mut self, ids: &[u32]) -> Result<Vec<Vec<f32>>> {
                self.hidden(ids)
            }
            fn step_one(&mut self, id: u32) -> Result<Vec<f32>> {
                self.step(id)
            }
            fn logits_of(&self, h: &[f32]) -> Result<Vec<f32>> {
                $logits(self, h)
            }
            fn set_noise(&mut self, f: Option<graph::Noise>) -> Result<()> {
                $noise(self, f)
            }
        }
    };
}

hidden_via_graphs!(graph::GraphBackend,
logits: |b: &graph::GraphBackend, h: &[f32]| b.logits(h),
noise: |b: &mut graph::GraphBackend, f| {
    b.noise = f;
    Ok(())
});
hidden_via_graphs!(ort::OrtBackend,
logits: |b: &ort::OrtBackend, h: &[f32]| b.host.logits(h),
noise: |_: &mut ort::OrtBackend, _| Err(Error::Unsupported(
    "this backend takes token embeddings only from host-model/".into(),
)));

#[derive(Debug, Clone, Serialize)]
pub struct Generation {
    pub backend: String,
    pub prompt_ids: Vec<u32>,
    pub generated_ids: Vec<u32>,
    pub text: String,
    /// "stop_token" (106 or 1 emitted; not included in text), "max_tokens" or "context_full".
    pub stop_reason: String,
    pub prefill_seconds: f64,
    /// Prompt tokens per second of prefill (trunk chunks when the backend has a trunk).
    pub prefill_tokens_per_second: f64,
    /// Time to first token: the prompt's prefill, whose last logits give the first generated token.
    pub ttft_seconds: f64,
    pub decode_seconds: f64,
    pub decode_tokens_per_second: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stats: Option<serde_json::Value>,
}

/// Greedy generation from already-templated prompt ids.
pub fn generate_ids(
    b: &mut dyn Backend,
    prompt_ids: &[u32],
    max_tokens: usize,
) -> Result<(Vec<u32>, String, f64, f64)> {
    generate_ids_with(
        b,
        prompt_ids,
        max_tokens,
        &mut sample::Sampler::new(Default::default()),
    )
}

/// Generation from already-templated prompt ids, each next token drawn by `sampler` (greedy at
/// temperature 0).
pub fn generate_ids_with(
    b: &mut dyn Backend,
    prompt_ids: &[u32],
    max_tokens: usize,
    sampler: &mut sample::Sampler,
) -> Result<(Vec<u32>, String, f64, f64)> {
    if let Some(c) = b.capacity().filter(|&c| prompt_ids.len() > c) {
        return Err(Error::ContextFull(format!(
            "the prompt has {} tokens; the {} backend holds {c} positions (a larger --context, or max_position_embeddings for cpu)",
            prompt_ids.len(),
            b.name()
        )));
    }
    b.reset();
    let t0 = Instant::now();
    let mut logits = b.feed(prompt_ids)?;
    let prefill = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let mut out = Vec::new();
    let mut history = prompt_ids.to_vec();
    let mut reason = "max_tokens".to_string();
    while out.len() < max_tokens {
        let next = sampler.next(&logits, &history);
        history.push(next);
        out.push(next);
        if STOP_IDS.contains(&next) {
            reason = "stop_token".into();
            break;
        }
        if out.len() == max_tokens {
            break;
        }
        if b.capacity()
            .is_some_and(|c| prompt_ids.len() + out.len() > c)
        {
            reason = "context_full".into();
            break;
        }
        logits = b.feed(&[next])?;
    }
    Ok((out, reason, prefill, t1.elapsed().as_secs_f64()))
}

/// Chat-format `messages`, generate greedily, decode the text (stop token excluded).
pub fn generate(
    b: &mut dyn Backend,
    tok: &Tokenizer,
    messages: &[Message],
    max_tokens: usize,
) -> Result<Generation> {
    generate_with(b, tok, messages, max_tokens, &sample::Sampling::default())
}

/// [`generate`] with a sampling configuration (greedy at temperature 0).
pub fn generate_with(
    b: &mut dyn Backend,
    tok: &Tokenizer,
    messages: &[Message],
    max_tokens: usize,
    sampling: &sample::Sampling,
) -> Result<Generation> {
    let prompt_ids = tok.encode_chat(messages)?;
    let mut sampler = sample::Sampler::new(sampling.clone());
    let (ids, reason, prefill, decode) =
        generate_ids_with(b, &prompt_ids, max_tokens, &mut sampler)?;
    let n_prompt = prompt_ids.len();
    let body: Vec<u32> = ids
        .iter()
        .copied()
        .filter(|i| !STOP_IDS.contains(i))
        .collect();
    let text = tok.decode(&body, false)?;
    // Tokens produced by decode steps: the first comes from prefill.
    let steps = ids.len().saturating_sub(1);
    Ok(Generation {
        backend: b.name().to_string(),
        prompt_ids,
        generated_ids: ids,
        text,
        stop_reason: reason,
        prefill_seconds: prefill,
        prefill_tokens_per_second: if prefill > 0.0 {
            n_prompt as f64 / prefill
        } else {
            0.0
        },
        ttft_seconds: prefill,
        decode_seconds: decode,
        decode_tokens_per_second: if decode > 0.0 {
            steps as f64 / decode
        } else {
            0.0
        },
        stats: b.stats(),
    })
}
