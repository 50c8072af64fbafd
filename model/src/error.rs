//! One error type for the model crate: every variant says which file, tensor or config field is at fault.

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
    #[error("{0}")]
    Msg(String),
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
