//! hexq-import: a GGUF into a Hugging Face-layout checkpoint every other stage reads — `config.json`,
//! `model.safetensors` (f32, or bf16), `tokenizer.json` + `tokenizer_config.json` + `chat_template.jinja` + `tokenizer.model`,
//! and `manifest.json` (the source's and every file's SHA256).
//!
//! Weights are dequantized as gguf-py does ([`hexq_gguf::dequant`]), renamed through the tensor table
//! inverted ([`hexq_model::names::GLOBAL_TENSORS`], `LAYER_TENSORS`), and llama.cpp's norm offset is undone
//! (its Gemma converter stores every RMSNorm weight as 1 + w; `w = stored − 1` in f32, as transformers'
//! GGUF loader computes it). Written in phases into a directory the caller renames into place.
//!
//! May import: model (the tensor table, tokenizer files), gguf (reader, dequantizers), fsutil.

pub mod config;
pub mod tokenizer;

use hexq_gguf::{GgufFile, TensorInfo};
use hexq_model::names::{LayerTensor, GLOBAL_TENSORS};
use hexq_model::weights::{safetensors_header, DType};
use std::io::Write;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Gguf(#[from] hexq_gguf::GgufError),
    #[error(transparent)]
    Model(#[from] hexq_model::Error),
    #[error(transparent)]
    Fs(#[from] hexq_fsutil::Error),
}

impl Error {
    /// The GGUF file and what is wrong with it.
    pub fn gguf(g: &GgufFile, msg: impl Into<String>) -> Self {
        Error::Gguf(hexq_gguf::GgufError {
            path: g.path.clone(),
            msg: msg.into(),
        })
    }
}

pub type Result<T> = std::result::Result<T, Error>;

/// Storage of the written weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutDType {
    F32,
    Bf16,
}

pub struct Report {
    pub arch: String,
    pub tensors: usize,
    /// (file name, bytes, SHA256) of every file written.
    pub files: Vec<(String, u64, String)>,
}

/// Checkpoint name (prefix `model.`, the text-only layout) of a GGUF tensor.
pub fn hf_name(gguf: &str) -> Option<String> {
    if let Some((h, _)) = GLOBAL_TENSORS.iter().find(|(_, g)| *g == gguf) {
        return Some(format!("model.{h}"));
    }
    let (i, rest) = gguf.strip_prefix("blk.")?.split_once('.')?;
    let i: usize = i.parse().ok()?;
    let t = hexq_model::names::LAYER_TENSORS
        .iter()
        .find(|d| d.gguf == rest)?;
    Some(format!("model.{}", t.t.name(i)))
}

/// Whether llama.cpp's converter stored this tensor as 1 + w (every RMSNorm weight of a Gemma).
fn norm_shifted(hf: &str) -> bool {
    let rel = hf.trim_start_matches("model.");
    rel == hexq_model::names::FINAL_NORM
        || LayerTensor::parse(rel).is_some_and(|(_, t)| t.def().hf.ends_with("norm.weight"))
}

/// Import `src` into `dir` (an empty staging directory). `progress` gets GGUF bytes consumed.
pub fn import(src: &Path, dir: &Path, dtype: OutDType, progress: &dyn Fn(u64)) -> Result<Report> {
    let g = GgufFile::open(src)?;
    let arch = g
        .get("general.architecture")
        .and_then(|v| v.as_str())
        .unwrap_or("")
        .to_string();
    let cfg = match arch.as_str() {
        "gemma3" => config::gemma3(&g)?,
        other => {
            return Err(Error::gguf(
                &g,
                format!("general.architecture {other:?}: hexq imports gemma3"),
            ))
        }
    };
    let mut files = vec![write(
        dir,
        "config.json",
        (serde_json::to_string_pretty(&cfg).expect("JSON") + "\n").as_bytes(),
    )?];
    let plan = plan(&g)?;
    files.push(weights(&g, &plan, dir, dtype, progress)?);
    let t = tokenizer::files(&g)?;
    files.push(write(dir, "tokenizer.json", t.tokenizer_json.as_bytes())?);
    files.push(write(
        dir,
        "tokenizer_config.json",
        t.tokenizer_config.as_bytes(),
    )?);
    files.push(write(
        dir,
        "chat_template.jinja",
        t.chat_template.as_bytes(),
    )?);
    files.push(write(dir, "tokenizer.model", &t.spm)?);
    let source = hexq_fsutil::sha256_file_cached(src)?;
    let m = serde_json::json!({
        "hexq_version": env!("CARGO_PKG_VERSION"),
        "source": {"file": src.display().to_string(), "sha256": source, "architecture": arch},
        "weights": match dtype { OutDType::F32 => "f32", OutDType::Bf16 => "bf16" },
        "files": files.iter().map(|(f, b, h)| serde_json::json!({"path": f, "bytes": b, "sha256": h})).collect::<Vec<_>>(),
    });
    write(
        dir,
        "manifest.json",
        (serde_json::to_string_pretty(&m).expect("JSON") + "\n").as_bytes(),
    )?;
    Ok(Report {
        arch,
        tensors: plan.len(),
        files,
    })
}

/// Every GGUF tensor with its checkpoint name; a tensor the table does not know is an error.
fn plan(g: &GgufFile) -> Result<Vec<(&TensorInfo, String)>> {
    g.tensors
        .iter()
        .map(|t| match hf_name(&t.name) {
            Some(h) => Ok((t, h)),
            None => Err(Error::gguf(
                g,
                format!("tensor {}: not in hexq's Gemma tensor table", t.name),
            )),
        })
        .collect()
}

/// model.safetensors: header (every shape known up front), then each tensor dequantized, un-shifted and
/// converted, streamed through a hashed writer.
fn weights(
    g: &GgufFile,
    plan: &[(&TensorInfo, String)],
    dir: &Path,
    dtype: OutDType,
    progress: &dyn Fn(u64),
) -> Result<(String, u64, String)> {
    let dt = match dtype {
        OutDType::F32 => DType::F32,
        OutDType::Bf16 => DType::BF16,
    };
    let entries: Vec<_> = plan
        .iter()
        .map(|(t, h)| (h.clone(), dt, t.shape()))
        .collect();
    let meta = serde_json::json!({"format": "pt", "hexq": "import"});
    let (head, _) = safetensors_header(&entries, &meta);
    let path = dir.join("model.safetensors");
    let n: u64 = plan
        .iter()
        .map(|(t, _)| t.shape().iter().product::<usize>() as u64)
        .sum();
    hexq_fsutil::ensure_space(dir, n * dt.size() as u64 + head.len() as u64)?;
    let mut w = hexq_fsutil::HashedFile::create(&path)?;
    let io = |e| hexq_model::Error::io(&path, e);
    w.write_all(&head).map_err(io)?;
    let (mut v, mut out) = (Vec::new(), Vec::new());
    for (t, h) in plan {
        g.f32(t, &mut v)?;
        if norm_shifted(h) {
            v.iter_mut().for_each(|x| *x -= 1.0);
        }
        out.clear();
        match dtype {
            OutDType::F32 => out.extend(v.iter().flat_map(|x| x.to_le_bytes())),
            OutDType::Bf16 => out.extend(
                v.iter()
                    .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()),
            ),
        }
        w.write_all(&out).map_err(io)?;
        progress((t.end - t.start) as u64);
    }
    let (bytes, sha) = w.finish()?;
    Ok(("model.safetensors".into(), bytes, sha))
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> Result<(String, u64, String)> {
    use sha2::{Digest, Sha256};
    let p: PathBuf = dir.join(name);
    std::fs::write(&p, bytes).map_err(|e| hexq_model::Error::io(&p, e))?;
    Ok((
        name.into(),
        bytes.len() as u64,
        format!("{:x}", Sha256::digest(bytes)),
    ))
}
