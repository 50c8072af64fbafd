//! llama.cpp's importance matrix: per weight matrix, Σx² of each input column over the calibration tokens and
//! the token count — the file `llama-imatrix` writes and `llama-quantize --imatrix` reads (llama.cpp
//! `tools/imatrix/imatrix.cpp::save_imatrix`, `common/imatrix-loader.cpp`). Two layouts:
//! - GGUF (the default since 2025): `general.type = "imatrix"`, `imatrix.datasets` (string array),
//!   `imatrix.chunk_count`, `imatrix.chunk_size` (u32); per entry, in name order, `NAME.in_sum2` (F32, the raw
//!   sums, one row per expert) and `NAME.counts` (F32, tokens per expert);
//! - legacy `.dat`: i32 entry count; per entry i32 name length, name, i32 ncall, i32 nval, nval f32 holding
//!   sum/count·ncall; then i32 chunk count, i32 length + the dataset name.
//!
//! Written by hand as gguf_write_to_file lays it out (no kept Rust crate writes GGUF), so the bytes equal
//! llama-imatrix's for the same sums.

use crate::reader::{GgufError, GgufFile, Value};
use std::collections::BTreeMap;
use std::path::Path;

/// One weight matrix's statistics (dense: one expert).
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    /// Σx² per input column, `counts.len()` rows.
    pub sums: Vec<f32>,
    /// Tokens seen, per expert.
    pub counts: Vec<f32>,
}

impl Entry {
    /// The per-column weights llama-quantize uses: the mean of x² (1 where nothing was seen).
    pub fn mean_sq(&self) -> Vec<f32> {
        let per = self.sums.len() / self.counts.len().max(1);
        self.sums
            .iter()
            .enumerate()
            .map(|(i, &s)| {
                let c = self.counts[i / per.max(1)];
                if c > 0.0 {
                    s / c
                } else {
                    1.0
                }
            })
            .collect()
    }
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Imatrix {
    pub datasets: Vec<String>,
    pub chunk_count: u32,
    pub chunk_size: u32,
    /// By GGUF tensor name (`blk.0.attn_q.weight`).
    pub entries: BTreeMap<String, Entry>,
}

const ALIGN: usize = 32;

fn put_str(b: &mut Vec<u8>, s: &str) {
    b.extend((s.len() as u64).to_le_bytes());
    b.extend(s.as_bytes());
}

fn pad(b: &mut Vec<u8>) {
    b.resize(b.len().next_multiple_of(ALIGN), 0);
}

impl Imatrix {
    /// The GGUF file, as llama-imatrix writes it: key-values, tensor infos (names sorted, `in_sum2` before
    /// `counts`, dims with trailing 1s dropped), then the data, each tensor padded to 32 bytes.
    pub fn to_gguf(&self) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend((2 * self.entries.len() as u64).to_le_bytes());
        b.extend(4u64.to_le_bytes());
        put_str(&mut b, "general.type");
        b.extend(8u32.to_le_bytes());
        put_str(&mut b, "imatrix");
        put_str(&mut b, "imatrix.datasets");
        b.extend(9u32.to_le_bytes());
        b.extend(8u32.to_le_bytes());
        b.extend((self.datasets.len() as u64).to_le_bytes());
        for d in &self.datasets {
            put_str(&mut b, d);
        }
        for (k, v) in [
            ("imatrix.chunk_count", self.chunk_count),
            ("imatrix.chunk_size", self.chunk_size),
        ] {
            put_str(&mut b, k);
            b.extend(4u32.to_le_bytes());
            b.extend(v.to_le_bytes());
        }
        let mut data: Vec<u8> = Vec::new();
        for (name, e) in &self.entries {
            let nmat = e.counts.len();
            let shapes = [
                (
                    format!("{name}.in_sum2"),
                    [e.sums.len() / nmat.max(1), nmat],
                    &e.sums,
                ),
                (format!("{name}.counts"), [1, nmat], &e.counts),
            ];
            for (tn, ne, vals) in shapes {
                put_str(&mut b, &tn);
                let dims: &[usize] = if ne[1] > 1 { &ne } else { &ne[..1] };
                b.extend((dims.len() as u32).to_le_bytes());
                for d in dims {
                    b.extend((*d as u64).to_le_bytes());
                }
                b.extend(0u32.to_le_bytes()); // GGML_TYPE_F32
                b.extend((data.len() as u64).to_le_bytes());
                for v in vals.iter() {
                    data.extend(v.to_le_bytes());
                }
                pad(&mut data);
            }
        }
        pad(&mut b);
        b.extend(data);
        b
    }

    /// Either layout: GGUF (by its magic) or legacy `.dat`.
    pub fn read(path: &Path) -> Result<Self, GgufError> {
        let head = std::fs::read(path).map_err(|e| GgufError {
            path: path.to_path_buf(),
            msg: e.to_string(),
        })?;
        if head.starts_with(b"GGUF") {
            Self::from_gguf(&GgufFile::open(path)?)
        } else {
            Self::from_dat(&head).map_err(|msg| GgufError {
                path: path.to_path_buf(),
                msg: format!("not a GGUF imatrix, and as a legacy .dat imatrix: {msg}"),
            })
        }
    }

    fn from_gguf(g: &GgufFile) -> Result<Self, GgufError> {
        let err = |msg: String| GgufError {
            path: g.path.clone(),
            msg,
        };
        if g.get("general.type").and_then(Value::as_str) != Some("imatrix") {
            return Err(err("general.type is not \"imatrix\"".into()));
        }
        let u32_of = |k: &str| {
            g.get(k)
                .and_then(Value::as_u64)
                .map(|v| v as u32)
                .ok_or_else(|| err(format!("{k} missing (llama-quantize needs it)")))
        };
        let datasets = g
            .get("imatrix.datasets")
            .and_then(Value::as_array)
            .ok_or_else(|| err("imatrix.datasets missing".into()))?
            .iter()
            .filter_map(|v| v.as_str().map(str::to_string))
            .collect();
        let mut m = Imatrix {
            datasets,
            chunk_count: u32_of("imatrix.chunk_count")?,
            chunk_size: u32_of("imatrix.chunk_size")?,
            entries: BTreeMap::new(),
        };
        let mut sums: BTreeMap<String, Vec<f32>> = BTreeMap::new();
        let mut counts: BTreeMap<String, Vec<f32>> = BTreeMap::new();
        for t in &g.tensors {
            let mut v = Vec::new();
            g.f32(t, &mut v)?;
            if let Some(n) = t.name.strip_suffix(".in_sum2") {
                sums.insert(n.to_string(), v);
            } else if let Some(n) = t.name.strip_suffix(".counts") {
                counts.insert(n.to_string(), v);
            }
        }
        for (n, s) in sums {
            let c = counts
                .remove(&n)
                .ok_or_else(|| err(format!("{n}.in_sum2 has no {n}.counts")))?;
            if c.is_empty() || s.len() % c.len() != 0 {
                return Err(err(format!("{n}: {} sums for {} counts", s.len(), c.len())));
            }
            m.entries.insert(n, Entry { sums: s, counts: c });
        }
        if let Some(n) = counts.keys().next() {
            return Err(err(format!("{n}.counts has no {n}.in_sum2")));
        }
        Ok(m)
    }

    /// The legacy layout; its sums become raw sums again (value/ncall·count, with count = ncall·chunk_size
    /// unknown: kept as ncall calls of one token each, so `mean_sq` is what llama-quantize computes).
    fn from_dat(b: &[u8]) -> Result<Self, String> {
        let mut at = 0usize;
        let i32_at = |at: &mut usize| -> Result<i32, String> {
            let v = b
                .get(*at..*at + 4)
                .ok_or_else(|| format!("truncated at byte {at}"))?;
            *at += 4;
            Ok(i32::from_le_bytes(v.try_into().unwrap()))
        };
        let n = i32_at(&mut at)?;
        if !(1..=1 << 20).contains(&n) {
            return Err(format!("{n} entries"));
        }
        let mut m = Imatrix::default();
        for _ in 0..n {
            let len = i32_at(&mut at)?;
            let name = b
                .get(at..at + len.max(0) as usize)
                .ok_or("truncated name")?;
            let name = String::from_utf8(name.to_vec()).map_err(|e| e.to_string())?;
            at += len as usize;
            let ncall = i32_at(&mut at)?;
            let nval = i32_at(&mut at)?;
            if nval < 1 {
                return Err(format!("{name}: {nval} values"));
            }
            let raw = b
                .get(at..at + 4 * nval as usize)
                .ok_or_else(|| format!("{name}: truncated values"))?;
            at += 4 * nval as usize;
            let sums = raw
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            let counts = vec![ncall as f32];
            m.entries.insert(name, Entry { sums, counts });
        }
        if at < b.len() {
            m.chunk_count = i32_at(&mut at)?.max(0) as u32;
            if let Ok(len) = i32_at(&mut at) {
                if let Some(d) = b.get(at..at + len.max(0) as usize) {
                    m.datasets.push(String::from_utf8_lossy(d).into_owned());
                }
            }
        }
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Imatrix {
        let mut m = Imatrix {
            datasets: vec!["calibration.jsonl".into()],
            chunk_count: 3,
            chunk_size: 512,
            entries: BTreeMap::new(),
        };
        for (n, k) in [("blk.0.attn_q.weight", 64), ("blk.0.ffn_down.weight", 96)] {
            let sums = (0..k).map(|i| i as f32 * 0.5 + 1.0).collect();
            m.entries.insert(
                n.into(),
                Entry {
                    sums,
                    counts: vec![1536.0],
                },
            );
        }
        m
    }

    #[test]
    fn gguf_round_trips_through_the_reader() {
        let m = sample();
        let d = std::env::temp_dir().join(format!("hexq-imatrix-{}.gguf", std::process::id()));
        std::fs::write(&d, m.to_gguf()).unwrap();
        let back = Imatrix::read(&d).unwrap();
        std::fs::remove_file(&d).unwrap();
        assert_eq!(back, m);
        assert_eq!(
            back.entries["blk.0.attn_q.weight"].mean_sq()[2],
            2.0 / 1536.0
        );
    }

    #[test]
    fn legacy_dat_reads_as_llama_quantize_reads_it() {
        let mut b = Vec::new();
        b.extend(1i32.to_le_bytes());
        b.extend(5i32.to_le_bytes());
        b.extend(b"w.one");
        b.extend(4i32.to_le_bytes()); // ncall
        b.extend(2i32.to_le_bytes());
        b.extend(8f32.to_le_bytes());
        b.extend(2f32.to_le_bytes());
        b.extend(7i32.to_le_bytes());
        b.extend(3i32.to_le_bytes());
        b.extend(b"x.t");
        let m = Imatrix::from_dat(&b).unwrap();
        assert_eq!(m.entries["w.one"].mean_sq(), vec![2.0, 0.5]);
        assert_eq!((m.chunk_count, m.datasets[0].as_str()), (7, "x.t"));
        assert!(Imatrix::from_dat(&b[..9]).is_err());
    }
}
