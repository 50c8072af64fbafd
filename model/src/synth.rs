//! `hexq synth`: a random-weight bf16 checkpoint with the real tensor names and shapes of any Gemma-4 config
//! (plus a Gemma-style tokenizer padded to the config's vocabulary), so full-size benchmarks run without the
//! real weights. Written streamed — one tensor at a time, generated in parallel chunks — so peak RSS is a
//! small fixed buffer whatever the model size. Values are deterministic in (seed, tensor, chunk), independent
//! of the thread count.

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::names::{expected_tensors, Role, TensorSpec, LM_HEAD};
use half::bf16;
use hexq_fsutil::AtomicDir;
use rand::{rngs::SmallRng, Rng, SeedableRng};
use rand_distr::{Distribution, Normal};
use rayon::prelude::*;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

const TOKENIZER_JSON: &str = include_str!("../../tests/fixtures/tiny-gemma4/tokenizer.json");
const TOKENIZER_CONFIG: &str =
    include_str!("../../tests/fixtures/tiny-gemma4/tokenizer_config.json");
const CHAT_TEMPLATE: &str = include_str!("../../tests/fixtures/tiny-gemma4/chat_template.jinja");

/// Elements generated per parallel work item.
const CHUNK: usize = 1 << 20;
/// Work items held in memory at once (CHUNK * BATCH * 2 bytes = 64 MiB).
const BATCH: usize = 32;

pub struct SynthOptions {
    pub seed: u64,
    /// Split into shards of at most this many bytes (with model.safetensors.index.json); 0 = one file.
    pub max_shard_bytes: u64,
    pub force: bool,
}

impl Default for SynthOptions {
    fn default() -> Self {
        SynthOptions {
            seed: 0,
            max_shard_bytes: 4 << 30,
            force: false,
        }
    }
}

pub struct SynthReport {
    pub dir: PathBuf,
    pub files: Vec<PathBuf>,
    pub tensors: usize,
    pub bytes: u64,
}

fn mix(mut x: u64) -> u64 {
    // splitmix64: independent streams per (seed, tensor, chunk).
    x = x.wrapping_add(0x9E3779B97F4A7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D049BB133111EB);
    x ^ (x >> 31)
}

fn fill_chunk(spec: &TensorSpec, seed: u64, ti: usize, ci: usize, out: &mut [u8]) {
    let mut rng = SmallRng::seed_from_u64(mix(seed ^ mix((ti as u64) << 32 | ci as u64)));
    let n = out.len() / 2;
    let put = |out: &mut [u8], i: usize, v: f32| {
        out[2 * i..2 * i + 2].copy_from_slice(&bf16::from_f32(v).to_bits().to_le_bytes())
    };
    match spec.role {
        Role::Norm if spec.name.ends_with("layer_scalar") => (0..n).for_each(|i| put(out, i, 1.0)),
        Role::Norm => (0..n).for_each(|i| put(out, i, rng.random_range(0.5f32..1.5))),
        Role::TokenEmbedding | Role::PleEmbedding | Role::LmHead => {
            let d = Normal::new(0.0f32, 0.03).unwrap();
            (0..n).for_each(|i| put(out, i, d.sample(&mut rng)))
        }
        _ => {
            let fan_in = *spec.shape.last().unwrap() as f32;
            let d = Normal::new(0.0f32, fan_in.powf(-0.5)).unwrap();
            (0..n).for_each(|i| put(out, i, d.sample(&mut rng)))
        }
    }
}

/// Tokenizer files for a vocabulary of `vocab` ids: the fixture's Gemma-style BPE, padded with `<unusedN>` pieces.
pub fn tokenizer_files(vocab: usize) -> Result<Vec<(&'static str, String)>> {
    let mut tj: serde_json::Value =
        serde_json::from_str(TOKENIZER_JSON).expect("embedded tokenizer.json");
    let v = tj["model"]["vocab"].as_object_mut().expect("BPE vocab");
    let have = v.len();
    if vocab < have {
        return Err(Error::Usage(format!(
            "synth: vocab_size {vocab} is smaller than the bundled tokenizer's {have} pieces (it holds the Gemma-4 special ids up to 4368)"
        )));
    }
    let n = v.keys().filter(|k| k.starts_with("<unused")).count();
    for (k, id) in (have..vocab).enumerate() {
        v.insert(format!("<unused{}>", n + k), id.into());
    }
    Ok(vec![
        ("tokenizer.json", serde_json::to_string(&tj).unwrap()),
        ("tokenizer_config.json", TOKENIZER_CONFIG.to_string()),
        ("chat_template.jinja", CHAT_TEMPLATE.to_string()),
    ])
}

/// Write a synthetic checkpoint for the config at `config_path` into `out`.
pub fn synth(
    config_path: &Path,
    out: &Path,
    opt: &SynthOptions,
    progress: &indicatif::ProgressBar,
) -> Result<SynthReport> {
    let cfg = ModelConfig::from_file(config_path)?;
    let raw = cfg.raw.clone();
    let specs = expected_tensors(&cfg);
    let full_name = |s: &TensorSpec| {
        if s.role == Role::LmHead {
            LM_HEAD.to_string()
        } else {
            format!("{}{}", cfg.prefix, s.name)
        }
    };
    let total: u64 = specs.iter().map(|s| s.numel() as u64 * 2).sum();
    progress.set_length(total);

    // Assign tensors to shards in table order.
    let mut shards: Vec<Vec<usize>> = vec![vec![]];
    let mut cur = 0u64;
    for (i, s) in specs.iter().enumerate() {
        let b = s.numel() as u64 * 2;
        if opt.max_shard_bytes > 0 && cur > 0 && cur + b > opt.max_shard_bytes {
            shards.push(vec![]);
            cur = 0;
        }
        shards.last_mut().unwrap().push(i);
        cur += b;
    }
    let nsh = shards.len();
    let shard_name = |k: usize| {
        if nsh == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", k + 1, nsh)
        }
    };

    let dir = AtomicDir::create(out, opt.force)?;
    let mut weight_map = serde_json::Map::new();
    let mut files = Vec::new();
    for (k, members) in shards.iter().enumerate() {
        let path = dir.path(&shard_name(k));
        // Header first: every shape is known up front.
        let entries: Vec<_> = members
            .iter()
            .map(|&i| {
                (
                    full_name(&specs[i]),
                    crate::weights::DType::BF16,
                    specs[i].shape.clone(),
                )
            })
            .collect();
        for (name, _, _) in &entries {
            weight_map.insert(name.clone(), shard_name(k).into());
        }
        let meta = serde_json::json!({"format": "pt", "hexq": "synth"});
        let (head, _) = crate::weights::safetensors_header(&entries, &meta);
        let f = std::fs::File::create(&path).map_err(|e| Error::io(&path, e))?;
        let mut w = BufWriter::with_capacity(8 << 20, f);
        let io = |e| Error::io(&path, e);
        w.write_all(&head).map_err(io)?;
        let mut buf = vec![0u8; CHUNK * BATCH * 2];
        for &ti in members {
            let s = &specs[ti];
            let n = s.numel();
            let nchunks = n.div_ceil(CHUNK);
            let mut c0 = 0;
            while c0 < nchunks {
                let c1 = (c0 + BATCH).min(nchunks);
                let elems = (c1 * CHUNK).min(n) - c0 * CHUNK;
                let b = &mut buf[..elems * 2];
                b.par_chunks_mut(CHUNK * 2)
                    .enumerate()
                    .for_each(|(j, o)| fill_chunk(s, opt.seed, ti, c0 + j, o));
                w.write_all(b).map_err(io)?;
                progress.inc(b.len() as u64);
                c0 = c1;
            }
        }
        w.flush().map_err(io)?;
        w.into_inner()
            .map_err(|e| Error::io(&path, e.into_error()))?
            .sync_all()
            .map_err(io)?;
        files.push(out.join(shard_name(k)));
    }
    if nsh > 1 {
        let idx = serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        let p = dir.path("model.safetensors.index.json");
        std::fs::write(&p, serde_json::to_string_pretty(&idx).unwrap())
            .map_err(|e| Error::io(&p, e))?;
    }
    let p = dir.path("config.json");
    std::fs::write(&p, serde_json::to_string_pretty(&raw).unwrap())
        .map_err(|e| Error::io(&p, e))?;
    for (name, text) in tokenizer_files(cfg.vocab_size)? {
        let p = dir.path(name);
        std::fs::write(&p, text).map_err(|e| Error::io(&p, e))?;
    }
    let dest = dir.commit()?;
    Ok(SynthReport {
        dir: dest,
        files,
        tensors: specs.len(),
        bytes: total,
    })
}
