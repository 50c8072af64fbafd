//! hexq-model: the Gemma-4 text decoder as hexq sees it.
//!
//! - [`config`]: config.json (multimodal or causal-LM layout) → validated per-layer facts;
//! - [`names`]: the tensor table (names, shapes, roles);
//! - [`weights`] / [`checkpoint`]: memory-mapped safetensors, lazily read, validated at open;
//! - [`forward`]: the exact f32 reference forward (candle), split host/device;
//! - [`prefix`]: the BOS position computed on the host (device graphs start at position 1);
//! - [`chat`]: tokenizer and chat template; [`spm`]: SentencePiece's `tokenizer.model`;
//! - [`synth`]: random-weight checkpoints at any config (full-size benchmarks without the real weights).
//!
//! May import: fsutil, kernels (bf16 widening) and the format crates (safetensors, tokenizers, minijinja, candle); never a later stage.

pub mod chat;
pub mod checkpoint;
pub mod config;
pub mod dataset;
pub mod error;
pub mod forward;
pub mod hostmodel;
pub mod names;
pub mod prefix;
pub mod spm;
pub mod synth;
pub mod weights;

pub use checkpoint::Checkpoint;
pub use config::{AttnKind, KvMode, LayerSpec, ModelConfig};
pub use error::{Error, Result};
pub use forward::{KvCache, Model};
