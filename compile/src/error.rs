//! The compile stage's error: every variant names the file, target or tool at fault (as the other stages'
//! do), so a failed compile says where to look.

use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file whose content is wrong (a manifest, an I/O contract, an encodings file, a binary).
    #[error("{}: {msg}", path.display())]
    File { path: PathBuf, msg: String },
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// Options that do not go together, an unknown target, a missing SDK.
    #[error("{0}")]
    Usage(String),
    /// An external tool (python3 with onnxruntime-qnn, the QAIRT SDK) that failed, with what it said.
    #[error("{tool}: {msg}")]
    Tool { tool: String, msg: String },
    #[error(transparent)]
    Model(#[from] hexq_model::Error),
    #[error(transparent)]
    Fs(#[from] hexq_fsutil::Error),
    #[error(transparent)]
    Runtime(#[from] hexq_runtime::Error),
}

impl Error {
    pub fn file(p: &Path, msg: impl Into<String>) -> Self {
        Error::File {
            path: p.to_path_buf(),
            msg: msg.into(),
        }
    }
    pub fn tool(tool: &str, msg: impl Into<String>) -> Self {
        Error::Tool {
            tool: tool.into(),
            msg: msg.into(),
        }
    }
}

pub type Result<T> = std::result::Result<T, Error>;

/// An I/O or JSON result with the path it concerns attached.
pub trait At<T> {
    fn at(self, p: &Path) -> Result<T>;
}

impl<T> At<T> for std::io::Result<T> {
    fn at(self, p: &Path) -> Result<T> {
        self.map_err(|e| Error::Io {
            path: p.to_path_buf(),
            source: e,
        })
    }
}

impl<T> At<T> for serde_json::Result<T> {
    fn at(self, p: &Path) -> Result<T> {
        self.map_err(|e| Error::file(p, format!("invalid JSON: {e}")))
    }
}

/// `std::fs` calls whose error names the path.
pub mod fs {
    use super::{At, Result};
    use std::path::Path;

    pub fn write(p: impl AsRef<Path>, data: impl AsRef<[u8]>) -> Result<()> {
        std::fs::write(p.as_ref(), data).at(p.as_ref())
    }
    pub fn copy(from: impl AsRef<Path>, to: impl AsRef<Path>) -> Result<u64> {
        std::fs::copy(from.as_ref(), to.as_ref()).at(from.as_ref())
    }
    pub fn create_dir_all(p: impl AsRef<Path>) -> Result<()> {
        std::fs::create_dir_all(p.as_ref()).at(p.as_ref())
    }
    pub fn len(p: impl AsRef<Path>) -> Result<u64> {
        Ok(std::fs::metadata(p.as_ref()).at(p.as_ref())?.len())
    }
}
