//! What a backend can fail on, beyond the model's own errors: a tool that is not installed, onnxruntime or
//! llama.cpp refusing, the KV buffers full, artifacts that do not fit together.

/// The runtime's error; converts into the pipeline's shared [`hexq_model::Error`] for the stages above.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Model(#[from] hexq_model::Error),
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    /// A library hexq loads at run time is not installed.
    #[error("{tool} not found: {hint} ({detail})")]
    Missing {
        tool: &'static str,
        hint: &'static str,
        detail: String,
    },
    #[error("onnxruntime: {what}: {msg}")]
    Ort { what: String, msg: String },
    #[error("llama.cpp: {0}")]
    Llama(String),
    /// The KV buffers hold no more positions.
    #[error("context full: {0}")]
    ContextFull(String),
    /// `--artifacts` directories that do not make a runnable set.
    #[error("--artifacts: {0}")]
    Artifacts(String),
    /// A backend asked for something it does not do.
    #[error("{0}")]
    Unsupported(String),
}

/// The model error's constructors, for the files a backend reads (host-model/, manifests, exports).
impl Error {
    pub fn io(p: &std::path::Path, e: std::io::Error) -> Self {
        Error::Model(hexq_model::Error::io(p, e))
    }
    pub fn file(p: &std::path::Path, msg: impl Into<String>) -> Self {
        Error::Model(hexq_model::Error::file(p, msg))
    }
    pub fn tensor(p: &std::path::Path, t: &str, msg: impl Into<String>) -> Self {
        Error::Model(hexq_model::Error::tensor(p, t, msg))
    }
}

impl From<Error> for hexq_model::Error {
    fn from(e: Error) -> Self {
        match e {
            Error::Model(m) => m,
            e => hexq_model::Error::Stage(Box::new(e)),
        }
    }
}

pub type Result<T> = std::result::Result<T, Error>;
