//! The bundled tiny Gemma-4 checkpoint (tests/fixtures/tiny-gemma4), embedded in the binary so every
//! command has a default model on a fresh machine. Materialised once into the user cache directory,
//! keyed by content hash, atomically.

use anyhow::{Context, Result};
use sha2::{Digest, Sha256};
use std::path::PathBuf;

const FILES: &[(&str, &[u8])] = &[
    (
        "config.json",
        include_bytes!("../tests/fixtures/tiny-gemma4/config.json"),
    ),
    (
        "model.safetensors",
        include_bytes!("../tests/fixtures/tiny-gemma4/model.safetensors"),
    ),
    (
        "tokenizer.json",
        include_bytes!("../tests/fixtures/tiny-gemma4/tokenizer.json"),
    ),
    (
        "tokenizer_config.json",
        include_bytes!("../tests/fixtures/tiny-gemma4/tokenizer_config.json"),
    ),
    (
        "chat_template.jinja",
        include_bytes!("../tests/fixtures/tiny-gemma4/chat_template.jinja"),
    ),
    (
        "generation_config.json",
        include_bytes!("../tests/fixtures/tiny-gemma4/generation_config.json"),
    ),
];

pub fn tiny_gemma4_dir() -> Result<PathBuf> {
    let mut h = Sha256::new();
    for (n, b) in FILES {
        h.update(n.as_bytes());
        h.update(b);
    }
    let tag = format!("{:x}", h.finalize());
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir)
        .join("hexq");
    let dir = base.join(format!("tiny-gemma4-{}", &tag[..12]));
    if dir.join("config.json").exists() {
        return Ok(dir);
    }
    let staging = hexq_fsutil::AtomicDir::create(&dir, true)?;
    for (n, b) in FILES {
        std::fs::write(staging.path(n), b)
            .with_context(|| format!("writing bundled model to {}", staging.tmp.display()))?;
    }
    Ok(staging.commit()?)
}
