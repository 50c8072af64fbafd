//! The host side of an exported build, read from its `host-model/` directory alone (no checkpoint): token
//! and per-layer embedding rows from the mapped files (bf16/f16/f32 or int8/int4 per row), the tied lm_head
//! and `30·tanh(x/30)` softcap, the tokenizer and config. Every backend that runs exported artifacts (ort,
//! qnn) uses it; files are checked against the sidecar's byte lengths before use.

use crate::Error;
use crate::Result;
use candle_core::{Device, Tensor};
use half::{bf16, f16};
use hexq_model::hostmodel::{HostModel, HostTensor, SIDECAR};
use hexq_model::prefix::{self, Prefix, PrefixKv};
use hexq_model::ModelConfig;
use memmap2::Mmap;
use std::path::{Path, PathBuf};

pub struct Table {
    map: Mmap,
    dtype: String,
    pub rows: usize,
    pub cols: usize,
    scales: Option<Vec<f32>>,
    mult: f32,
}

impl Table {
    fn open(dir: &Path, t: &HostTensor) -> Result<Self> {
        let p = dir.join(&t.file);
        let f = std::fs::File::open(&p).map_err(|e| Error::io(&p, e))?;
        // SAFETY: read-only map of a file hexq wrote; it is not modified while mapped.
        let map = unsafe { Mmap::map(&f) }.map_err(|e| Error::io(&p, e))?;
        if map.len() as u64 != t.bytes {
            return Err(Error::file(
                &p,
                format!(
                    "{} bytes, {SIDECAR} says {} (truncated or replaced?)",
                    map.len(),
                    t.bytes
                ),
            ));
        }
        let rows = t.shape[0];
        let cols: usize = t.shape[1..].iter().product();
        let want = match t.dtype.as_str() {
            "bf16" | "f16" => rows * cols * 2,
            "f32" => rows * cols * 4,
            "int8" => rows * cols,
            "int4" => rows * cols.div_ceil(2),
            d => return Err(Error::file(&p, format!("unknown host dtype {d:?}"))),
        };
        if want != map.len() {
            return Err(Error::file(
                &p,
                format!("{} bytes for shape {:?} {}", map.len(), t.shape, t.dtype),
            ));
        }
        let scales = match &t.scales {
            Some(s) => {
                let sp = dir.join(&s.file);
                let b = std::fs::read(&sp).map_err(|e| Error::io(&sp, e))?;
                if b.len() != rows * 4 {
                    return Err(Error::file(
                        &sp,
                        format!("{} bytes, expected {} f32 row scales", b.len(), rows),
                    ));
                }
                Some(
                    b.chunks(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect(),
                )
            }
            None => None,
        };
        Ok(Table {
            map,
            dtype: t.dtype.clone(),
            rows,
            cols,
            scales,
            mult: t.row_multiplier,
        })
    }

    /// Row `r` dequantized, times the row multiplier (the embedding scale).
    pub fn row(&self, r: usize) -> Vec<f32> {
        let mut v = self.raw_row(r);
        for x in &mut v {
            *x *= self.mult;
        }
        v
    }

    /// Row `r` dequantized, without the multiplier (the tied head uses the raw embedding).
    pub fn raw_row(&self, r: usize) -> Vec<f32> {
        let c = self.cols;
        let b = &self.map[..];
        match self.dtype.as_str() {
            "bf16" => b[r * c * 2..(r + 1) * c * 2]
                .chunks(2)
                .map(|x| bf16::from_le_bytes([x[0], x[1]]).to_f32())
                .collect(),
            "f16" => b[r * c * 2..(r + 1) * c * 2]
                .chunks(2)
                .map(|x| f16::from_le_bytes([x[0], x[1]]).to_f32())
                .collect(),
            "f32" => b[r * c * 4..(r + 1) * c * 4]
                .chunks(4)
                .map(|x| f32::from_le_bytes([x[0], x[1], x[2], x[3]]))
                .collect(),
            "int8" => {
                let s = self.scales.as_ref().unwrap()[r];
                b[r * c..(r + 1) * c]
                    .iter()
                    .map(|&q| q as i8 as f32 * s)
                    .collect()
            }
            "int4" => {
                let s = self.scales.as_ref().unwrap()[r];
                let w = c.div_ceil(2);
                let mut v = Vec::with_capacity(c);
                for &byte in &b[r * w..(r + 1) * w] {
                    for q in [byte & 0xF, byte >> 4] {
                        v.push(((q as i8) << 4 >> 4) as f32 * s);
                    }
                }
                v.truncate(c);
                v
            }
            _ => unreachable!(),
        }
    }
}

/// The `prefix.*` tensors of the sidecar back into a [`Prefix`]: one K and one V per KV-owning layer.
fn read_prefix(dir: &Path, hm: &HostModel, token: u32, cfg: &ModelConfig) -> Result<Prefix> {
    let sp = dir.join(SIDECAR);
    let get = |name: &str| -> Result<Vec<f32>> {
        let t = hm.tensors.iter().find(|t| t.name == name).ok_or_else(|| {
            Error::file(&sp, format!("prefix_token is set but {name} is missing"))
        })?;
        if t.dtype != "f32" {
            return Err(Error::file(
                &sp,
                format!("{name}: prefix tensors are f32, not {}", t.dtype),
            ));
        }
        Ok(Table::open(dir, t)?.raw_row(0))
    };
    let mut kv = Vec::new();
    for l in cfg
        .layers
        .iter()
        .filter(|l| l.kv_mode != hexq_model::KvMode::Reuse)
    {
        let (k, v) = (
            get(&prefix::host_name(&format!("past_key_{}", l.index)))?,
            get(&prefix::host_name(&format!("past_value_{}", l.index)))?,
        );
        if k.len() != l.num_kv_heads * l.head_dim || v.len() != k.len() {
            return Err(Error::file(
                &sp,
                format!(
                    "prefix K/V of layer {} have {} values, expected {}",
                    l.index,
                    k.len(),
                    l.num_kv_heads * l.head_dim
                ),
            ));
        }
        kv.push(PrefixKv {
            layer: l.index,
            heads: l.num_kv_heads,
            k,
            v,
        });
    }
    let hidden = get(prefix::HIDDEN)?;
    if hidden.len() != cfg.hidden_size {
        return Err(Error::file(
            &sp,
            format!(
                "{}: {} values, expected hidden_size {}",
                prefix::HIDDEN,
                hidden.len(),
                cfg.hidden_size
            ),
        ));
    }
    Ok(Prefix { token, kv, hidden })
}

pub struct HostFiles {
    pub dir: PathBuf,
    pub cfg: ModelConfig,
    pub embed: Table,
    pub ple: Option<Table>,
    /// [V, H] f32 head (tied: the embedding without its scale).
    head: Tensor,
    /// Position 0 computed on the host (hexq_model::prefix), when the export carries it.
    pub prefix: Option<Prefix>,
}

impl HostFiles {
    pub fn open(dir: &Path) -> Result<Self> {
        let sp = dir.join(SIDECAR);
        let text = std::fs::read_to_string(&sp).map_err(|e| Error::io(&sp, e))?;
        let hm: HostModel = serde_json::from_str(&text)
            .map_err(|e| Error::file(&sp, format!("invalid sidecar: {e}")))?;
        let cfg = ModelConfig::from_file(&dir.join("config.json"))?;
        let find = |n: &str| hm.tensors.iter().find(|t| t.name == n);
        let et = find(hexq_model::names::EMBED)
            .ok_or_else(|| Error::file(&sp, "no embed_tokens.weight entry"))?;
        let embed = Table::open(dir, et)?;
        if embed.rows != cfg.vocab_size || embed.cols != cfg.hidden_size {
            return Err(Error::file(
                &sp,
                format!(
                    "embedding {}×{} but config.json says {}×{}",
                    embed.rows, embed.cols, cfg.vocab_size, cfg.hidden_size
                ),
            ));
        }
        let ple = match find(hexq_model::names::EMBED_PLE) {
            Some(t) => Some(Table::open(dir, t)?),
            None if cfg.ple_dim > 0 => {
                return Err(Error::file(
                    &sp,
                    "config has per-layer inputs but no embed_tokens_per_layer.weight",
                ))
            }
            None => None,
        };
        let head_t = match find(hexq_model::names::LM_HEAD) {
            Some(t) => Table::open(dir, t)?,
            None => Table::open(dir, et)?,
        };
        let mut hv = Vec::with_capacity(head_t.rows * head_t.cols);
        for r in 0..head_t.rows {
            hv.extend(head_t.raw_row(r));
        }
        let head = Tensor::from_vec(hv, (head_t.rows, head_t.cols), &Device::Cpu)?;
        let prefix = match hm.prefix_token {
            Some(token) => Some(read_prefix(dir, &hm, token, &cfg)?),
            None => None,
        };
        Ok(HostFiles {
            prefix,
            dir: dir.to_path_buf(),
            cfg,
            embed,
            ple,
            head,
        })
    }

    fn check(&self, id: u32) -> Result<()> {
        if id as usize >= self.embed.rows {
            return Err(hexq_model::Error::Token {
                id,
                field: "vocab_size",
                limit: self.embed.rows,
            }
            .into());
        }
        Ok(())
    }

    /// `inputs_embeds` row for one token `[H]`.
    pub fn embed(&self, id: u32) -> Result<Vec<f32>> {
        self.check(id)?;
        Ok(self.embed.row(id as usize))
    }

    /// `per_layer_inputs` for one token [L·P], empty without per-layer embeddings.
    pub fn ple(&self, id: u32) -> Result<Vec<f32>> {
        self.check(id)?;
        Ok(match &self.ple {
            Some(t) => t.row(id as usize),
            None => vec![],
        })
    }

    /// logits = h @ head^T, then the softcap.
    pub fn logits(&self, h: &[f32]) -> Result<Vec<f32>> {
        let t = Tensor::from_vec(h.to_vec(), (1, h.len()), &Device::Cpu)?;
        let l = hexq_model::forward::mm_t(&t, &self.head)?;
        let l = match self.cfg.final_logit_softcapping {
            Some(cap) => ((l / cap)?.tanh()? * cap)?,
            None => l,
        };
        Ok(l.flatten_all()?.to_vec1()?)
    }
}
