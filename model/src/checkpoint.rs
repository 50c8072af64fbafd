//! A Hugging Face Gemma-4 checkpoint directory: config.json + safetensors (+ tokenizer files).
//! Opening validates every tensor the decoder needs (present, right shape, float dtype) without reading data.

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::names::{expected_tensors, Role, TensorSpec, LM_HEAD};
use crate::weights::{SafetensorsStore, TensorInfo};
use std::path::{Path, PathBuf};

/// Set by `--allow-nonfinite`: open checkpoints whose weights hold NaN or inf.
pub static ALLOW_NONFINITE: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

pub struct Checkpoint {
    pub dir: PathBuf,
    pub config: ModelConfig,
    pub store: SafetensorsStore,
    /// The decoder's tensors in table order, each resolved to its location.
    pub tensors: Vec<(TensorSpec, TensorInfo)>,
}

impl Checkpoint {
    pub fn open(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            return Err(Error::file(dir, "not a checkpoint directory"));
        }
        let config = ModelConfig::from_file(&dir.join("config.json"))?;
        let store = SafetensorsStore::open_dir(dir)?;
        let mut tensors = Vec::new();
        for spec in expected_tensors(&config) {
            let full = if spec.role == Role::LmHead {
                LM_HEAD.to_string()
            } else {
                format!("{}{}", config.prefix, spec.name)
            };
            let info = store.get(&full).ok_or_else(|| {
                let where_ = if store.files.len() == 1 {
                    store.files[0].clone()
                } else {
                    dir.join("model.safetensors.index.json")
                };
                Error::tensor(&where_, &full, "missing from the checkpoint")
            })?;
            if info.shape != spec.shape {
                return Err(Error::tensor(
                    store.file_of(info),
                    &full,
                    format!(
                        "shape {:?}, config.json implies {:?}",
                        info.shape, spec.shape
                    ),
                ));
            }
            tensors.push((spec, info.clone()));
        }
        let ck = Checkpoint {
            dir: dir.to_path_buf(),
            config,
            store,
            tensors,
        };
        if !ALLOW_NONFINITE.load(std::sync::atomic::Ordering::Relaxed) {
            ck.check_finite()?;
        }
        Ok(ck)
    }

    /// Every decoder tensor finite: a NaN or inf weight would otherwise run and print `<pad>` tokens. A bit
    /// test on the stored encoding, tensors in parallel, each read by `pread` in 16 MiB chunks (through the
    /// mapping it was 2.3 M page faults at E2B, ~4 s of the open; and no pages stay resident).
    fn check_finite(&self) -> Result<()> {
        use rayon::prelude::*;
        const CHUNK: usize = 16 << 20;
        self.tensors.par_iter().try_for_each(|(_, info)| {
            let es = info.dtype.size();
            let mut at = 0;
            self.store.read_chunks(info, CHUNK, |b| {
                if let Some(i) = crate::weights::nonfinite_at(b, info.dtype) {
                    let m = format!(
                        "element {} is NaN or infinite (pass --allow-nonfinite to proceed anyway)",
                        at / es + i
                    );
                    return Err(Error::tensor(self.store.file_of(info), &info.name, m));
                }
                at += b.len();
                Ok(())
            })
        })
    }

    /// Read the decoder tensors of safetensors file `p` instead of the checkpoint's (same names, same shapes,
    /// float): the rounded weights a GPTQ encodings file names. A tensor the decoder has not is refused.
    pub fn overlay(&mut self, p: &Path) -> Result<()> {
        let infos = self.store.overlay(p)?;
        self.replace(p, infos)
    }

    /// [`Self::overlay`] from values in memory: decoder tensor (prefix-relative name) → f32 values in the
    /// tensor's shape (an ablation's rounded weights, a quantized embedding table).
    pub fn overlay_values(
        &mut self,
        values: &std::collections::BTreeMap<String, Vec<f32>>,
    ) -> Result<()> {
        let mut ts = Vec::new();
        for (t, v) in values {
            let info = self.info(t)?;
            ts.push((info.name.clone(), info.shape.clone(), v.as_slice()));
        }
        let label = self.dir.join("(values in memory)");
        let infos = self.store.overlay_f32(&label, &ts)?;
        self.replace(&label, infos)
    }

    /// The decoder's slots of `infos`' tensors pointed at them (same shapes; overlays only).
    fn replace(&mut self, p: &Path, infos: Vec<TensorInfo>) -> Result<()> {
        for info in infos {
            let Some((_, slot)) = self.tensors.iter_mut().find(|(_, t)| t.name == info.name) else {
                return Err(Error::tensor(p, &info.name, "not a tensor of the decoder"));
            };
            if info.shape != slot.shape {
                return Err(Error::tensor(
                    p,
                    &info.name,
                    format!(
                        "{} {:?} does not replace the checkpoint's {} {:?}",
                        info.dtype.name(),
                        info.shape,
                        slot.dtype.name(),
                        slot.shape
                    ),
                ));
            }
            *slot = info;
        }
        Ok(())
    }

    /// Location of a decoder tensor by its prefix-relative name (`layers.0.mlp.up_proj.weight`).
    pub fn info(&self, name: &str) -> Result<&TensorInfo> {
        self.tensors
            .iter()
            .find(|(s, _)| s.name == name)
            .map(|(_, i)| i)
            .ok_or_else(|| Error::tensor(&self.dir, name, "the decoder has no such tensor"))
    }

    /// A decoder tensor as f32 in Gemma-4's form ([`crate::names::fold`]): the one way stages read weights.
    pub fn f32(&self, name: &str) -> Result<Vec<f32>> {
        let mut v = Vec::new();
        self.f32_into(self.info(name)?, &mut v);
        Ok(v)
    }

    /// [`Self::f32`] of a tensor into a reused buffer (streaming writers).
    pub fn f32_into(&self, info: &TensorInfo, out: &mut Vec<f32>) {
        crate::weights::to_f32_into(self.store.bytes(info), info.dtype, out);
        self.fold(info, out);
    }

    /// Gemma-4's form of stored values ([`crate::names::fold`]; elementwise, so any slice of a tensor).
    fn fold(&self, info: &TensorInfo, v: &mut [f32]) {
        let rel = info
            .name
            .strip_prefix(self.config.prefix.as_str())
            .unwrap_or(&info.name);
        crate::names::fold(&self.config, rel).apply(v);
    }

    /// Rows `[r0, r1)` of a 2-D decoder tensor as f32 in Gemma-4's form, into a reused buffer (per-row
    /// scans of a whole weight without an f32 copy of it).
    pub fn rows_f32_into(&self, info: &TensorInfo, r0: usize, r1: usize, out: &mut Vec<f32>) {
        let cols: usize = info.shape[1..].iter().product();
        let es = info.dtype.size();
        let b = &self.store.bytes(info)[r0 * cols * es..r1 * cols * es];
        crate::weights::to_f32_serial_into(b, info.dtype, out);
        self.fold(info, out);
    }

    /// Tokenizer file, if the checkpoint has one.
    pub fn tokenizer_path(&self) -> Option<PathBuf> {
        let p = self.dir.join("tokenizer.json");
        p.exists().then_some(p)
    }
}
