//! `hexq gguf --imatrix F`: the importance weights llama-quantize applies (the imatrix's mean x² per input
//! column, by GGUF tensor name; `tools/quantize/quantize.cpp::load_imatrix`) and the `quantize.imatrix.*`
//! keys it records (`LLM_KV_QUANTIZE_IMATRIX_*`, appended after the copied keys; counts as UINT32).

use super::Val;
use hexq_gguf::imatrix::Imatrix;
use std::collections::HashMap;
use std::path::Path;

pub struct Importance {
    /// The file as the user named it (llama-quantize records the argument; an absolute path is cut to its
    /// file name, so no machine's directory lands in the artifact).
    pub file: String,
    pub dataset: Option<String>,
    pub chunks: u32,
    /// GGUF tensor name → one weight per input column.
    pub weights: HashMap<String, Vec<f32>>,
}

impl Importance {
    pub fn read(path: &Path) -> Result<Self, hexq_gguf::GgufError> {
        let m = Imatrix::read(path)?;
        for (n, e) in &m.entries {
            if let Some(v) = e.sums.iter().chain(&e.counts).find(|v| !v.is_finite()) {
                return Err(hexq_gguf::GgufError {
                    path: path.to_path_buf(),
                    msg: format!("{n}: non-finite value {v} (llama-quantize refuses it too)"),
                });
            }
        }
        let file = match path.is_absolute() {
            true => hexq_fsutil::dir_name(path),
            false => path.display().to_string(),
        };
        Ok(Importance {
            file,
            dataset: m.datasets.first().cloned(),
            chunks: m.chunk_count,
            weights: m
                .entries
                .iter()
                .map(|(n, e)| (n.clone(), e.mean_sq()))
                .collect(),
        })
    }

    /// The keys llama-quantize appends.
    pub fn metadata(&self, kv: &mut Vec<(String, Val)>) {
        kv.push(("quantize.imatrix.file".into(), Val::Str(self.file.clone())));
        if let Some(d) = &self.dataset {
            kv.push(("quantize.imatrix.dataset".into(), Val::Str(d.clone())));
        }
        kv.push((
            "quantize.imatrix.entries_count".into(),
            Val::U32(self.weights.len() as u32),
        ));
        if self.chunks > 0 {
            kv.push((
                "quantize.imatrix.chunks_count".into(),
                Val::U32(self.chunks),
            ));
        }
    }
}
