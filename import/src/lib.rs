//! hexq-import: a GGUF into a Hugging Face-layout checkpoint.
