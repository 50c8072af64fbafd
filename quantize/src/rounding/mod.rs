//! Calibration-aware rounding of the MatMul weights onto the grids the encodings describe:
//! `seqmse` chooses each channel's (or LPBQ block's) scale by the output error on the calibration inputs
//! ([`seqmse`], aimet-onnx's Sequential MSE); `gptq` keeps the scales and chooses the integers ([`gptq`]);
//! `seqmse-gptq` does both, in that order. Both read the inputs' Gram matrices gathered during the
//! chat-formatted calibration ([`hexq_calibrate::imatrix::SquareSums::gram_for`]).
//!
//! GPTQ's result is weights: the rounded values, each exactly on its grid, written as an f32 safetensors
//! overlay beside the encodings ([`OverlayWriter`]) that [`hexq_model::Checkpoint::overlay`] reads in place
//! of the checkpoint's, so quantsim, the QDQ export and the QNN compile round them to the same integers.
//!
//! The room: `mod.rs` (the methods, the entry point, the overlay), `seqmse.rs`, `gptq.rs`, `linalg.rs`.

pub mod gptq;
mod linalg;
pub mod seqmse;

use crate::{lpbq::LpbqEncoding, Encodings};
use hexq_calibrate::imatrix::Gram;
use hexq_graph::ir::{Graph, InitSource};
use hexq_model::{Checkpoint, Error, Result};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Rounding {
    Rtn,
    SeqMse,
    Gptq(gptq::Options),
    SeqMseGptq(gptq::Options),
}

impl Rounding {
    pub fn name(&self) -> &'static str {
        match self {
            Rounding::Rtn => "rtn",
            Rounding::SeqMse => "seqmse",
            Rounding::Gptq(_) => "gptq",
            Rounding::SeqMseGptq(_) => "seqmse-gptq",
        }
    }
    pub fn needs_inputs(&self) -> bool {
        *self != Rounding::Rtn
    }
    fn gptq(&self) -> Option<&gptq::Options> {
        match self {
            Rounding::Gptq(o) | Rounding::SeqMseGptq(o) => Some(o),
            _ => None,
        }
    }
}

/// The MatMul weights a rounding works on: initializer (the `[in, out]` view) → checkpoint tensor.
pub fn targets(graph: &Graph) -> BTreeMap<String, String> {
    let mw = crate::matmul_weights(graph);
    graph
        .initializers
        .iter()
        .filter(|i| mw.contains(i.name.as_str()))
        .filter_map(|i| match &i.source {
            InitSource::Weight {
                tensor,
                transpose: true,
            } => Some((i.name.clone(), tensor.clone())),
            _ => None,
        })
        .collect()
}

/// The initializers of `grams` by the input they read (q, k, v share one Σxxᵀ; gate, up another), in the
/// order of each input's first initializer: what one GPTQ factor serves.
/// Taken by value: once an input's weights are done, its Gram matrix is freed.
pub fn by_input(grams: BTreeMap<String, Arc<Gram>>) -> Vec<(Arc<Gram>, Vec<String>)> {
    let mut out: Vec<(Arc<Gram>, Vec<String>)> = Vec::new();
    for (init, g) in grams {
        match out.iter_mut().find(|(k, _)| Arc::ptr_eq(k, &g)) {
            Some((_, v)) => v.push(init),
            None => out.push((g, vec![init])),
        }
    }
    out
}

/// Apply `r` to the weights of `grams` (initializer → Σxxᵀ of its input): SeqMSE rewrites their encodings
/// in `enc`; GPTQ hands each weight's rounded values to `put` (checkpoint tensor, `[out, in]`) as it
/// finishes, so a caller can stream them out. One GPTQ factor per input, dropped when its weights are done.
pub fn apply(
    ck: &Checkpoint,
    graph: &Graph,
    enc: &mut Encodings,
    grams: BTreeMap<String, Arc<Gram>>,
    r: &Rounding,
    progress: &dyn Fn(&str),
    put: &mut dyn FnMut(&str, Vec<f32>) -> Result<()>,
) -> Result<()> {
    let tg = targets(graph);
    // Each input's Gram and factor are dropped as its weights finish.
    for (gram, inits) in by_input(grams) {
        let factors = gptq::Factors::default();
        for init in &inits {
            let Some(tensor) = tg.get(init) else {
                continue;
            };
            progress(init);
            let info = ck.info(tensor)?;
            let n = info.shape[1];
            let w = ck.f32(tensor)?;
            let bad = |msg: String| Error::Encoding {
                tensor: init.clone(),
                msg,
            };
            if gram.n != n {
                return Err(bad(format!(
                    "the input statistics are {0}×{0}, the weight has {n} inputs",
                    gram.n
                )));
            }
            if matches!(r, Rounding::SeqMse | Rounding::SeqMseGptq(_)) {
                if let Some(l) = enc.lpbq_encodings.get(init) {
                    let l = l.to_lpbq();
                    let s = seqmse::lpbq_blocks(&w, n, &gram, l.block, l.bw, l.scale_bits);
                    enc.lpbq_encodings
                        .insert(init.clone(), LpbqEncoding::from_lpbq(init, &s));
                } else if let Some(e) = enc.param_encodings.get_mut(init) {
                    if e.len() == info.shape[0] {
                        *e = seqmse::per_channel(&w, n, &gram, e);
                    }
                }
            }
            let Some(o) = r.gptq() else {
                continue;
            };
            let q = if let Some(l) = enc.lpbq_encodings.get(init) {
                let l = l.to_lpbq();
                let f = factors.get(&gram, o).map_err(bad)?;
                gptq::gptq(&w, &f, &|c, i, x| l.fake_one(c, i, x, n), o)
            } else if let Some(e) = enc
                .param_encodings
                .get(init)
                .filter(|e| e.len() == info.shape[0])
            {
                let f = factors.get(&gram, o).map_err(bad)?;
                gptq::gptq(&w, &f, &|c, _, x| e[c].fake_param(x), o)
            } else {
                continue;
            };
            put(tensor, q.map_err(bad)?)?;
        }
    }
    Ok(())
}

/// `enc.json` → `enc.weights.safetensors`: where the rounded weights of an encodings file live.
pub fn overlay_path(encodings: &Path) -> PathBuf {
    let stem = encodings
        .file_stem()
        .map(|s| s.to_string_lossy().to_string())
        .unwrap_or_default();
    encodings.with_file_name(format!("{stem}.weights.safetensors"))
}

/// The rounded weights as f32 safetensors under the checkpoint's tensor names, written as they come: each
/// tensor is spilled to a temp file beside the overlay (so memory holds one weight, not the decoder), and
/// [`OverlayWriter::finish`] lays them out in name order, whatever order they were rounded in (the bytes
/// do not depend on how the layers were grouped).
pub struct OverlayWriter {
    path: PathBuf,
    spill: hexq_fsutil::AtomicFile,
    file: std::io::BufWriter<std::fs::File>,
    /// Tensor → (offset, bytes) in the spill.
    at: BTreeMap<String, (u64, u64)>,
    pos: u64,
}

impl OverlayWriter {
    pub fn new(path: &Path) -> Result<Self> {
        let spill = hexq_fsutil::AtomicFile::new(&path.with_extension("spill"));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&spill.tmp)
            .map_err(|e| Error::io(&spill.tmp, e))?;
        Ok(OverlayWriter {
            path: path.to_path_buf(),
            file: std::io::BufWriter::new(file),
            spill,
            at: BTreeMap::new(),
            pos: 0,
        })
    }

    /// Tensors written so far.
    pub fn len(&self) -> usize {
        self.at.len()
    }

    pub fn is_empty(&self) -> bool {
        self.at.is_empty()
    }

    /// One rounded tensor (checkpoint name, `[out, in]` values).
    pub fn put(&mut self, tensor: &str, v: &[f32]) -> Result<()> {
        use std::io::Write;
        let bytes: &[u8] = bytemuck::cast_slice(v);
        self.file
            .write_all(bytes)
            .map_err(|e| Error::io(&self.spill.tmp, e))?;
        self.at
            .insert(tensor.to_string(), (self.pos, bytes.len() as u64));
        self.pos += bytes.len() as u64;
        Ok(())
    }

    /// Header and data in name order, through a temp file renamed into place; returns its SHA256.
    pub fn finish(self, ck: &Checkpoint) -> Result<String> {
        use hexq_model::weights::{safetensors_header, DType};
        use std::io::{Read, Seek, Write};
        let path = self.path;
        let spill_path = self.spill.tmp.clone();
        let mut spill = self
            .file
            .into_inner()
            .map_err(|e| Error::io(&spill_path, e.into_error()))?;
        let mut ts = Vec::new();
        for t in self.at.keys() {
            let info = ck.info(t)?;
            ts.push((info.name.clone(), DType::F32, info.shape.clone()));
        }
        let meta = serde_json::json!({"format": "pt", "hexq": "rounded weights (hexq quantize --rounding)"});
        let (hdr, _) = safetensors_header(&ts, &meta);
        let out = hexq_fsutil::AtomicFile::new(&path);
        let io = |e| Error::io(&path, e);
        let mut f = std::io::BufWriter::new(std::fs::File::create(&out.tmp).map_err(io)?);
        f.write_all(&hdr).map_err(io)?;
        for (off, len) in self.at.values() {
            let sio = |e| Error::io(&spill_path, e);
            spill.seek(std::io::SeekFrom::Start(*off)).map_err(sio)?;
            let copied = std::io::copy(&mut (&mut spill).take(*len), &mut f).map_err(sio)?;
            if copied != *len {
                return Err(Error::file(&spill_path, "the spilled weights are short"));
            }
        }
        f.into_inner()
            .map_err(|e| io(e.into_error()))?
            .sync_all()
            .map_err(io)?;
        out.commit()
            .map_err(|e| Error::io(&path, std::io::Error::other(e.to_string())))?;
        drop(self.spill);
        hexq_fsutil::sha256_file(&path)
            .map_err(|e| Error::io(&path, std::io::Error::other(e.to_string())))
    }
}

/// The overlay an encodings file names (`hexq.rounding.weights`, relative to the file), opened into `ck`.
pub fn open_overlay(ck: &mut Checkpoint, enc: &Encodings, encodings: &Path) -> Result<()> {
    let Some(f) = enc.hexq["rounding"]["weights"].as_str() else {
        return Ok(());
    };
    let p = encodings.parent().unwrap_or(Path::new("")).join(f);
    if !p.exists() {
        return Err(Error::file(
            encodings,
            format!("hexq.rounding.weights names {f}, which is not beside it"),
        ));
    }
    ck.overlay(&p)
}
