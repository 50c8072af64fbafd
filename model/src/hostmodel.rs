//! The `host-model/` sidecar format (written by hexq-export, read by the runtime's host loop): the vocab-sized
//! tensors as raw little-endian files, each with shape, dtype, byte length and SHA256.

use serde::{Deserialize, Serialize};

pub const SIDECAR: &str = "host-model.json";

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct HostFile {
    pub file: String,
    pub bytes: u64,
    pub sha256: String,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct HostTensor {
    /// Checkpoint tensor (prefix-relative).
    pub name: String,
    pub file: String,
    pub shape: Vec<usize>,
    /// "bf16" | "f16" | "f32" | "int8" | "int4".
    pub dtype: String,
    pub bytes: u64,
    pub sha256: String,
    /// Per-row f32 scales for int8/int4.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scales: Option<HostFile>,
    /// Multiply looked-up rows by this (sqrt(hidden) / sqrt(P), rounded to the checkpoint dtype as
    /// transformers does); 1 for the norm and the head.
    pub row_multiplier: f32,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct HostModel {
    pub tensors: Vec<HostTensor>,
    /// The token whose position-0 K/V and hidden state are stored as `prefix.*` tensors (f32), written into
    /// the KV buffers by the host instead of running the graphs ([`crate::prefix`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix_token: Option<u32>,
    pub files: Vec<HostFile>,
}
