//! `host-model/`: the vocab-sized tensors that never enter a graph (token embedding, per-layer token
//! embedding, untied head if any) and the final norm, as raw little-endian files the host loop maps, plus the
//! tokenizer/config files and a JSON sidecar (`host-model.json`: name, shape, dtype, byte length, SHA256).
//!
//! Default storage is the checkpoint's own dtype (bf16 for Gemma releases — lossless). `int8` / `int4` are
//! weight-only per-row symmetric (as the INT4-embedder builds ship them): `q = clamp(round(x / s), lo, hi)`,
//! `s = absmax(row) / hi` with hi = 127 / 7, scales as f32 per row in `<file>.scales`; int4 packs two values
//! per byte, even column in the low nibble (two's-complement nibbles).

pub use hexq_model::hostmodel::{HostFile, HostModel, HostTensor, SIDECAR};
use hexq_model::names::{self, Role};
use hexq_model::weights::{to_f32, DType as SDType};
use hexq_model::{Checkpoint, Error, Result};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// Checkpoint files the host needs beside the tensors (those that exist are copied).
pub const HOST_FILES: &[&str] = &[
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
];

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HostDType {
    /// The checkpoint's own dtype (bf16 / f16 / f32), bytes copied.
    Native,
    Int8,
    Int4,
}

fn sdtype_name(d: SDType) -> &'static str {
    match d {
        SDType::BF16 => "bf16",
        SDType::F16 => "f16",
        SDType::F32 => "f32",
    }
}

/// A file written and hashed as it streams (page cache bypassed: see `HashedFile`).
struct Hashed(hexq_fsutil::HashedFile);

impl Hashed {
    fn create(p: &Path) -> Result<Self> {
        Ok(Hashed(hexq_fsutil::HashedFile::create(p)?))
    }
    fn put(&mut self, b: &[u8]) -> Result<()> {
        Ok(self.0.put(b)?)
    }
    fn finish(self, name: &str) -> Result<HostFile> {
        let (bytes, sha256) = self.0.finish()?;
        Ok(HostFile {
            file: name.into(),
            bytes,
            sha256,
        })
    }
}

/// Per-row symmetric quantization of `rows` (row-major, `cols` wide) at `hi` = 127 or 7.
pub fn quantize_rows(v: &[f32], cols: usize, hi: i32) -> (Vec<i8>, Vec<f32>) {
    let rows = v.len() / cols;
    let mut q = vec![0i8; v.len()];
    let mut s = vec![0f32; rows];
    q.par_chunks_mut(cols)
        .zip(s.par_iter_mut())
        .zip(v.par_chunks(cols))
        .for_each(|((qr, sr), xr)| {
            let amax = xr.iter().fold(0f32, |a, &x| a.max(x.abs()));
            let scale = if amax > 0.0 { amax / hi as f32 } else { 1.0 };
            *sr = scale;
            for (o, &x) in qr.iter_mut().zip(xr) {
                *o = (x / scale).round().clamp(-(hi as f32) - 1.0, hi as f32) as i8;
            }
        });
    (q, s)
}

pub fn pack_int4(q: &[i8]) -> Vec<u8> {
    q.chunks(2)
        .map(|p| (p[0] as u8 & 0xF) | ((p.get(1).copied().unwrap_or(0) as u8 & 0xF) << 4))
        .collect()
}

/// Write `dir/host-model/`. `progress` gets bytes of checkpoint data consumed.
pub fn write_host_model(
    ck: &std::sync::Arc<Checkpoint>,
    dir: &Path,
    dt: HostDType,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<HostModel> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let cfg = &ck.config;
    let mut list: Vec<(&str, &str, f32)> = Vec::new();
    let edt = ck.info(names::EMBED)?.dtype;
    list.push((names::EMBED, "embed_tokens_weight", cfg.embed_scale(edt)));
    if cfg.ple_dim > 0 {
        let pdt = ck.info(names::EMBED_PLE)?.dtype;
        list.push((
            names::EMBED_PLE,
            "embed_tokens_per_layer_weight",
            cfg.ple_embed_scale(pdt),
        ));
    }
    if ck.tensors.iter().any(|(s, _)| s.role == Role::LmHead) {
        list.push((names::LM_HEAD, "lm_head_weight", 1.0));
    }
    list.push((names::FINAL_NORM, "norm_weight", 1.0));
    let mut tensors = Vec::new();
    for (name, stem, mult) in list {
        let info = ck.info(name)?.clone();
        // The small norm always stays in its own dtype.
        let dt = if name == names::FINAL_NORM {
            HostDType::Native
        } else {
            dt
        };
        let cols: usize = info.shape[1..].iter().product::<usize>().max(1);
        let bytes = ck.store.bytes(&info);
        // Stream whole rows, ~64 MiB of source at a time, releasing the mapped pages behind us.
        let rows_per = ((64usize << 20) / (cols * info.dtype.size())).max(1);
        let total_rows = info.numel() / cols;
        let row_b = cols * info.dtype.size();
        let (file, dtype) = match dt {
            HostDType::Native => (
                format!("{stem}.{}", sdtype_name(info.dtype)),
                sdtype_name(info.dtype),
            ),
            HostDType::Int8 => (format!("{stem}.int8"), "int8"),
            HostDType::Int4 => (format!("{stem}.int4"), "int4"),
        };
        if dt == HostDType::Int4 && cols % 2 == 1 {
            let m = format!("int4 host storage needs an even row length, not {cols}");
            return Err(Error::tensor(ck.store.file_of(&info), name, m));
        }
        let mut out = Hashed::create(&dir.join(&file))?;
        let mut sc = match dt {
            HostDType::Native => None,
            _ => Some(Hashed::create(&dir.join(format!("{file}.scales")))?),
        };
        let mut r0 = 0;
        while r0 < total_rows {
            let r1 = (r0 + rows_per).min(total_rows);
            let chunk = &bytes[r0 * row_b..r1 * row_b];
            match dt {
                HostDType::Native => out.put(chunk)?,
                HostDType::Int8 | HostDType::Int4 => {
                    let v = to_f32(chunk, info.dtype);
                    let hi = if dt == HostDType::Int8 { 127 } else { 7 };
                    let (q, s) = quantize_rows(&v, cols, hi);
                    if dt == HostDType::Int8 {
                        out.put(bytemuck_i8(&q))?;
                    } else {
                        out.put(&pack_int4(&q))?;
                    }
                    let sb: Vec<u8> = s.iter().flat_map(|x| x.to_le_bytes()).collect();
                    sc.as_mut().unwrap().put(&sb)?;
                }
            }
            progress(chunk.len() as u64);
            ck.store.release_range(&info, r0 * row_b, r1 * row_b);
            r0 = r1;
        }
        ck.store.release(&info);
        let f = out.finish(&file)?;
        let scales = match sc {
            Some(s) => Some(s.finish(&format!("{file}.scales"))?),
            None => None,
        };
        tensors.push(HostTensor {
            name: name.into(),
            file,
            shape: info.shape.clone(),
            dtype: dtype.into(),
            bytes: f.bytes,
            sha256: f.sha256,
            scales,
            row_multiplier: mult,
        });
    }
    let mut files = Vec::new();
    let tj = ck.dir.join("tokenizer.json");
    if !tj.exists() {
        // Without it the export runs nowhere: the host tokenizes prompts and decodes ids.
        return Err(Error::file(
            &tj,
            "missing: the host side needs it (or export with --host none)",
        ));
    }
    for f in HOST_FILES {
        let src = ck.dir.join(f);
        if src.exists() {
            let b = std::fs::read(&src).map_err(|e| Error::io(&src, e))?;
            let mut h = Hashed::create(&dir.join(f))?;
            h.put(&b)?;
            files.push(h.finish(f)?);
        }
    }
    // The BOS prefix (hexq_model::prefix): position 0's K/V and hidden state in f32, run on the host.
    let pre = hexq_model::prefix::Prefix::compute(ck)?;
    for (name, shape, v) in pre.tensors() {
        let file = format!("{name}.f32");
        let mut h = Hashed::create(&dir.join(&file))?;
        let b: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        h.put(&b)?;
        let f = h.finish(&file)?;
        tensors.push(HostTensor {
            name,
            file,
            shape,
            dtype: "f32".into(),
            bytes: f.bytes,
            sha256: f.sha256,
            scales: None,
            row_multiplier: 1.0,
        });
    }
    let hm = HostModel {
        tensors,
        files,
        prefix_token: Some(pre.token),
    };
    let p = dir.join(SIDECAR);
    let mut s = serde_json::to_string_pretty(&hm).unwrap();
    s.push('\n');
    std::fs::write(&p, s).map_err(|e| Error::io(&p, e))?;
    Ok(hm)
}

fn bytemuck_i8(q: &[i8]) -> &[u8] {
    // SAFETY: i8 and u8 have the same size and alignment.
    unsafe { std::slice::from_raw_parts(q.as_ptr() as *const u8, q.len()) }
}
