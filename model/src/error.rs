//! The error the pipeline stages share: every variant says which file, tensor, config field, graph node or
//! option is at fault. Stages with their own failure modes have their own type (`hexq_runtime::Error`,
//! `hexq_graph::ir::GraphError`, `hexq_gguf::ggml::GgmlError`, `hexq_fsutil::Error`) and convert into it.

use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {msg}")]
    File { path: PathBuf, msg: String },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: config field `{field}`: {msg}")]
    Config {
        path: PathBuf,
        field: String,
        msg: String,
    },
    #[error("{path}: tensor `{tensor}`: {msg}")]
    Tensor {
        path: PathBuf,
        tensor: String,
        msg: String,
    },
    #[error("tokenizer {path}: {msg}")]
    Tokenizer { path: PathBuf, msg: String },
    /// A token id outside a vocabulary.
    #[error("token id {id} out of range ({field} {limit})")]
    Token {
        id: u32,
        field: &'static str,
        limit: usize,
    },
    /// A graph that does not check, or a node that fails to evaluate.
    #[error("graph {graph}: {msg}")]
    Graph { graph: String, msg: String },
    /// An encoding (quantization parameters) that does not fit its tensor.
    #[error("encodings: tensor {tensor:?}: {msg}")]
    Encoding { tensor: String, msg: String },
    /// Options that do not go together, or a guard's refusal (with how to override it).
    #[error("{0}")]
    Usage(String),
    /// A later stage's own error type (a backend, a worker thread).
    #[error(transparent)]
    Stage(Box<dyn std::error::Error + Send + Sync>),
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    #[error(transparent)]
    Fs(#[from] hexq_fsutil::Error),
}

impl Error {
    pub fn file(p: &Path, msg: impl Into<String>) -> Self {
        Error::File {
            path: p.to_path_buf(),
            msg: msg.into(),
        }
    }
    pub fn io(p: &Path, e: std::io::Error) -> Self {
        Error::Io {
            path: p.to_path_buf(),
            source: e,
        }
    }
    pub fn config(p: &Path, field: &str, msg: impl Into<String>) -> Self {
        Error::Config {
            path: p.to_path_buf(),
            field: field.into(),
            msg: msg.into(),
        }
    }
    pub fn tensor(p: &Path, t: &str, msg: impl Into<String>) -> Self {
        Error::Tensor {
            path: p.to_path_buf(),
            tensor: t.into(),
            msg: msg.into(),
        }
    }
}

pub type Result<T> = std::result::Result<T, Error>;
