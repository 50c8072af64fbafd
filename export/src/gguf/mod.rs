//! GGUF v3 for llama.cpp's `gemma4` architecture, written straight from the safetensors mmap: the metadata
//! keys, tensor names, order, shapes and types llama.cpp's `convert_hf_to_gguf.py` (+ `llama-quantize`)
//! writes (checked against their committed output, tests/fixtures/gguf/), tensors streamed one at a time
//! (rayon across rows inside a tensor), so peak memory is a small multiple of the largest tensor.
//!
//! Matched: llama.cpp as vendored by llama-cpp-python 0.3.36 (converter `conversion/gemma.py::Gemma4Model`,
//! gguf-py 0.19). Why our own writer: candle's `gguf_file::write` needs every tensor in memory, and gguf-rs
//! only reads.

mod importance;
mod vocab;
pub use importance::Importance;

use hexq_gguf::ggml::{self, GgmlType};
use hexq_model::config::Arch;
use hexq_model::{Checkpoint, Error, Result};
use std::io::Write;
use std::path::Path;

pub const ALIGN: u64 = 32;
/// The GGUF version written (gguf-py 0.19 writes 3).
pub const GGUF_VERSION: u32 = 3;

/// A metadata value (gguf-py's GGUFValueType).
#[derive(Debug, Clone)]
pub enum Val {
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    ArrI32(Vec<i32>),
    ArrF32(Vec<f32>),
    ArrBool(Vec<bool>),
    ArrStr(Vec<String>),
}

fn put_str(o: &mut Vec<u8>, s: &str) {
    o.extend((s.len() as u64).to_le_bytes());
    o.extend(s.as_bytes());
}

pub use hexq_gguf::ValueType;

impl Val {
    fn type_id(&self) -> ValueType {
        match self {
            Val::U32(_) => ValueType::U32,
            Val::I32(_) => ValueType::I32,
            Val::F32(_) => ValueType::F32,
            Val::Bool(_) => ValueType::Bool,
            Val::Str(_) => ValueType::String,
            _ => ValueType::Array,
        }
    }
    /// An array's element type and length.
    fn array_head(o: &mut Vec<u8>, t: ValueType, n: usize) {
        o.extend((t as u32).to_le_bytes());
        o.extend((n as u64).to_le_bytes());
    }
    fn write(&self, o: &mut Vec<u8>) {
        o.extend((self.type_id() as u32).to_le_bytes());
        match self {
            Val::U32(v) => o.extend(v.to_le_bytes()),
            Val::I32(v) => o.extend(v.to_le_bytes()),
            Val::F32(v) => o.extend(v.to_le_bytes()),
            Val::Bool(v) => o.push(*v as u8),
            Val::Str(s) => put_str(o, s),
            Val::ArrI32(v) => {
                Val::array_head(o, ValueType::I32, v.len());
                v.iter().for_each(|x| o.extend(x.to_le_bytes()));
            }
            Val::ArrF32(v) => {
                Val::array_head(o, ValueType::F32, v.len());
                v.iter().for_each(|x| o.extend(x.to_le_bytes()));
            }
            Val::ArrBool(v) => {
                Val::array_head(o, ValueType::Bool, v.len());
                v.iter().for_each(|x| o.push(*x as u8));
            }
            Val::ArrStr(v) => {
                Val::array_head(o, ValueType::String, v.len());
                v.iter().for_each(|x| put_str(o, x));
            }
        }
    }
}

pub use hexq_model::names::gguf_name;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum FileType {
    #[cfg_attr(feature = "clap", value(name = "f32"))]
    F32,
    #[cfg_attr(feature = "clap", value(name = "f16"))]
    F16,
    #[cfg_attr(feature = "clap", value(name = "bf16"))]
    BF16,
    #[cfg_attr(feature = "clap", value(name = "q8_0"))]
    Q8_0,
    /// llama-quantize's Q4_0 mix (q6_K token embeddings, q4_0 elsewhere; --pure: q4_0 everywhere).
    #[cfg_attr(feature = "clap", value(name = "q4_0"))]
    Q4_0,
}

impl FileType {
    /// (type, name as llama.cpp's tools spell it, llama_ftype written as general.file_type).
    const TABLE: [(FileType, &'static str, u32); 5] = [
        (FileType::F32, "f32", 0),
        (FileType::F16, "f16", 1),
        (FileType::Q4_0, "q4_0", 2),
        (FileType::Q8_0, "q8_0", 7),
        (FileType::BF16, "bf16", 32),
    ];
    pub fn parse(s: &str) -> Option<Self> {
        Self::TABLE.iter().find(|r| r.1 == s).map(|r| r.0)
    }
    pub fn name(self) -> &'static str {
        Self::TABLE.iter().find(|r| r.0 == self).unwrap().1
    }
    /// llama_ftype (general.file_type).
    fn id(self) -> u32 {
        Self::TABLE.iter().find(|r| r.0 == self).unwrap().2
    }
}

pub struct Plan {
    pub name: String,
    pub hf: Option<String>,
    /// ggml order (ne0 = the contiguous dimension first).
    pub ne: Vec<u64>,
    pub ty: GgmlType,
    /// Added to every value before encoding (Gemma-3 norms: 1).
    pub shift: f32,
}

/// general.architecture / the key prefix.
pub fn arch_name(a: Arch) -> &'static str {
    match a {
        Arch::Gemma4 => "gemma4",
        Arch::Gemma3 => "gemma3",
    }
}

/// Per-tensor types, as the converter (+ llama-quantize for Q4_0) choose them:
/// - 1-D tensors (norms, scalars, rope_freqs) stay F32;
/// - f16/bf16/q8_0 outputs: 2-D weights in that type (q8_0 only where rows are multiples of 32, else F16);
/// - Q4_0 (llama-quantize's mix, read from its source and checked on the fixture): q4_0, except
///   `per_layer_model_proj` (kept in the source GGUF's type: BF16 from a bf16 checkpoint, else F16), rows not
///   a multiple of 32 (F16), and, unless `pure`, the two token-embedding tables, which llama-quantize makes
///   q6_K — or q8_0 when their rows are not a multiple of 256 (`--pure` is the mix of the published 4-bit
///   build: every 2-D weight q4_0).
pub fn tensor_type(
    ft: FileType,
    gname: &str,
    ne: &[u64],
    pure: bool,
    src: hexq_model::weights::DType,
) -> GgmlType {
    if ne.len() < 2 {
        return GgmlType::F32;
    }
    let row_ok = ne[0].is_multiple_of(32);
    match ft {
        FileType::F32 => GgmlType::F32,
        FileType::F16 => GgmlType::F16,
        FileType::BF16 => GgmlType::BF16,
        FileType::Q8_0 if row_ok => GgmlType::Q8_0,
        FileType::Q8_0 => GgmlType::F16,
        FileType::Q4_0 => {
            if gname == "per_layer_model_proj.weight" {
                if src == hexq_model::weights::DType::BF16 {
                    GgmlType::BF16
                } else {
                    GgmlType::F16
                }
            } else if !row_ok {
                GgmlType::F16
            } else if !pure
                && (gname == "token_embd.weight" || gname == "per_layer_token_embd.weight")
            {
                if ne[0].is_multiple_of(256) {
                    GgmlType::Q6_K
                } else {
                    GgmlType::Q8_0
                }
            } else {
                GgmlType::Q4_0
            }
        }
    }
}

fn title(s: &str) -> String {
    // gguf-py Metadata.id_to_title: '-' → ' ', each all-lowercase word through Python's str.title()
    // (a letter is capitalized when the character before it is not a letter: "g3b" → "G3B"), except
    // versions (v1.2) and words starting with a digit.
    let version = |w: &str| {
        w.starts_with(|c: char| c.is_ascii_digit())
            || w.strip_prefix('v').is_some_and(|r| {
                r.split('.')
                    .all(|p| !p.is_empty() && p.chars().all(|c| c.is_ascii_digit()))
            })
    };
    let lower = |w: &str| {
        w.chars().any(char::is_alphabetic)
            && w.chars().all(|c| !c.is_alphabetic() || c.is_lowercase())
    };
    let py_title = |w: &str| {
        let mut prev = false;
        w.chars()
            .flat_map(|c| {
                let out: Vec<char> = match prev {
                    true => c.to_lowercase().collect(),
                    false => c.to_uppercase().collect(),
                };
                prev = c.is_alphabetic();
                out
            })
            .collect::<String>()
    };
    s.replace('-', " ")
        .split_whitespace()
        .map(|w| match lower(w) && !version(w) {
            true => py_title(w),
            false => w.to_string(),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[test]
fn title_is_gguf_py_id_to_title() {
    // Values from Python: Metadata.id_to_title(s) for each.
    for (s, want) in [
        ("g3b", "G3B"),
        ("tiny-gemma4-bf16", "Tiny Gemma4 Bf16"),
        ("hf-a5fd3b62230a", "Hf A5Fd3B62230A"),
        ("gemma-3-270m", "Gemma 3 270m"),
        ("model-v1.2-GGUF", "Model v1.2 GGUF"),
    ] {
        assert_eq!(title(s), want, "{s}");
    }
}

fn rounded_notation(n: u64) -> String {
    let n = n as f64;
    let (v, s) = if n > 1e12 {
        (n * 1e-12, "T")
    } else if n > 1e9 {
        (n * 1e-9, "B")
    } else if n > 1e6 {
        (n * 1e-6, "M")
    } else {
        (n * 1e-3, "K")
    };
    let digits = format!("{}", v.round() as u64)
        .trim_start_matches('0')
        .len();
    let fix = 2usize.saturating_sub(digits);
    format!("{v:.fix$}{s}")
}

/// Every tensor written, in the converter's order: rope_freqs, then the checkpoint's text tensors in
/// safetensors (sorted) order.
pub fn plan(ck: &Checkpoint, ft: FileType, pure: bool) -> Result<Vec<Plan>> {
    let cfg = &ck.config;
    let full = cfg.layers.iter().find(|l| l.window.is_none());
    let mut out = Vec::new();
    if let (Some(l), Arch::Gemma4) = (full, cfg.arch) {
        out.push(Plan {
            name: "rope_freqs.weight".into(),
            hf: None,
            ne: vec![(l.head_dim / 2) as u64],
            ty: GgmlType::F32,
            shift: 0.0,
        });
    }
    for full_name in ck.store.names() {
        let Some(hf) = full_name.strip_prefix(cfg.prefix.as_str()) else {
            continue;
        };
        let Some(g) = gguf_name(hf) else { continue };
        let info = ck.store.get(full_name).unwrap();
        let ne: Vec<u64> = info.shape.iter().rev().map(|&d| d as u64).collect();
        let ty = tensor_type(ft, &g, &ne, pure, info.dtype);
        // Gemma-3's RMSNorm scales by 1 + w; its converter stores 1 + w (norm_shift).
        let shift = match cfg.arch == Arch::Gemma3 && hf.ends_with("norm.weight") {
            true => 1.0,
            false => 0.0,
        };
        out.push(Plan {
            name: g,
            hf: Some(hf.to_string()),
            ne,
            ty,
            shift,
        });
    }
    if ft == FileType::Q4_0 {
        // llama-quantize rewrites in its own order: model-level tensors by name, then blocks by number.
        let key = |p: &Plan| -> (u64, String) {
            match p.name.strip_prefix("blk.").and_then(|r| r.split_once('.')) {
                Some((i, rest)) => (1 + i.parse::<u64>().unwrap_or(0), rest.to_string()),
                None => (0, p.name.clone()),
            }
        };
        out.sort_by_key(key);
    }
    Ok(out)
}

/// The metadata keys in the converter's order.
pub fn metadata(ck: &Checkpoint, ft: FileType, plan: &[Plan]) -> Result<Vec<(String, Val)>> {
    let c = &ck.config;
    let mut kv: Vec<(String, Val)> = Vec::new();
    let dir_name = ck.dir.canonicalize().unwrap_or(ck.dir.clone());
    let dir_name = dir_name
        .file_name()
        .map(|s| s.to_string_lossy().to_string())
        .unwrap_or_default();
    let total: u64 = plan.iter().map(|p| p.ne.iter().product::<u64>()).sum();
    kv.push((
        "general.architecture".into(),
        Val::Str(arch_name(c.arch).into()),
    ));
    kv.push(("general.type".into(), Val::Str("model".into())));
    kv.push(("general.name".into(), Val::Str(title(&dir_name))));
    kv.push((
        "general.size_label".into(),
        Val::Str(rounded_notation(total)),
    ));
    match c.arch {
        Arch::Gemma4 => gemma4_params(c, ft, &mut kv),
        Arch::Gemma3 => gemma3_params(c, ft, &mut kv),
    }
    kv.push(("general.quantization_version".into(), Val::U32(2)));
    match c.arch {
        Arch::Gemma4 => vocab::gemma4(ck, &mut kv)?,
        Arch::Gemma3 => vocab::gemma3(ck, &mut kv)?,
    }
    if ft == FileType::Q4_0 {
        // llama-quantize re-sets these two, which moves them to the end.
        let mut moved = Vec::new();
        for k in ["general.quantization_version", "general.file_type"] {
            if let Some(i) = kv.iter().position(|(n, _)| n == k) {
                moved.push(kv.remove(i));
            }
        }
        kv.extend(moved);
    }
    Ok(kv)
}

/// `gemma4.*` as conversion/gemma.py::Gemma4Model sets them.
fn gemma4_params(c: &hexq_model::ModelConfig, ft: FileType, kv: &mut Vec<(String, Val)>) {
    let raw = &c.raw_text;
    let a = |k: &str| format!("gemma4.{k}");
    kv.push((a("block_count"), Val::U32(c.num_layers as u32)));
    kv.push((
        a("context_length"),
        Val::U32(c.max_position_embeddings as u32),
    ));
    kv.push((a("embedding_length"), Val::U32(c.hidden_size as u32)));
    let double = raw["use_double_wide_mlp"].as_bool().unwrap_or(false);
    kv.push((
        a("feed_forward_length"),
        if double {
            Val::ArrI32(c.layers.iter().map(|l| l.mlp_width as i32).collect())
        } else {
            Val::U32(c.intermediate_size as u32)
        },
    ));
    kv.push((a("attention.head_count"), Val::U32(c.num_heads as u32)));
    let swa: Vec<bool> = c.layers.iter().map(|l| l.window.is_some()).collect();
    let kvh_full = c
        .layers
        .iter()
        .find(|l| l.window.is_none())
        .map(|l| l.num_kv_heads);
    let kvh_swa = c
        .layers
        .iter()
        .find(|l| l.window.is_some())
        .map(|l| l.num_kv_heads);
    kv.push((
        a("attention.head_count_kv"),
        match (kvh_full, kvh_swa) {
            (Some(f), Some(s)) if f != s => {
                Val::ArrI32(swa.iter().map(|&w| if w { s } else { f } as i32).collect())
            }
            _ => Val::U32(c.layers[0].num_kv_heads as u32),
        },
    ));
    let theta = |k: &str| c.rope.get(k).map(|r| r.theta as f32);
    if let Some(t) = theta("full_attention") {
        kv.push((a("rope.freq_base"), Val::F32(t)));
    }
    if let Some(t) = theta("sliding_attention") {
        kv.push((a("rope.freq_base_swa"), Val::F32(t)));
    }
    kv.push((
        a("attention.layer_norm_rms_epsilon"),
        Val::F32(c.rms_norm_eps as f32),
    ));
    let hd_full = c
        .layers
        .iter()
        .find(|l| l.window.is_none())
        .map(|l| l.head_dim)
        .unwrap_or(c.layers[0].head_dim);
    let hd_swa = c
        .layers
        .iter()
        .find(|l| l.window.is_some())
        .map(|l| l.head_dim)
        .unwrap_or(hd_full);
    kv.push((a("attention.key_length"), Val::U32(hd_full as u32)));
    kv.push((a("attention.value_length"), Val::U32(hd_full as u32)));
    kv.push(("general.file_type".into(), Val::U32(ft.id())));
    if let Some(s) = c.final_logit_softcapping {
        kv.push((a("final_logit_softcapping"), Val::F32(s as f32)));
    }
    kv.push((
        a("attention.sliding_window"),
        Val::U32(c.sliding_window as u32),
    ));
    kv.push((
        a("attention.shared_kv_layers"),
        Val::U32(c.num_kv_shared_layers as u32),
    ));
    kv.push((
        a("embedding_length_per_layer_input"),
        Val::U32(c.ple_dim as u32),
    ));
    kv.push((a("attention.sliding_window_pattern"), Val::ArrBool(swa)));
    kv.push((a("attention.key_length_swa"), Val::U32(hd_swa as u32)));
    kv.push((a("attention.value_length_swa"), Val::U32(hd_swa as u32)));
    let prf_swa = c
        .rope
        .get("sliding_attention")
        .map(|r| r.partial_rotary_factor)
        .unwrap_or(1.0);
    kv.push((a("rope.dimension_count"), Val::U32(hd_full as u32)));
    kv.push((
        a("rope.dimension_count_swa"),
        Val::U32((hd_swa as f64 * prf_swa) as u32),
    ));
}

/// `gemma3.*` as conversion/gemma.py::Gemma3Model sets them (TextModel's keys, then its own): RoPE scaling
/// of the full layers when linear, both RoPE bases, the window unless every layer is global.
fn gemma3_params(c: &hexq_model::ModelConfig, ft: FileType, kv: &mut Vec<(String, Val)>) {
    let raw = &c.raw_text;
    let a = |k: &str| format!("gemma3.{k}");
    kv.push((a("block_count"), Val::U32(c.num_layers as u32)));
    kv.push((
        a("context_length"),
        Val::U32(c.max_position_embeddings as u32),
    ));
    kv.push((a("embedding_length"), Val::U32(c.hidden_size as u32)));
    kv.push((
        a("feed_forward_length"),
        Val::U32(c.intermediate_size as u32),
    ));
    kv.push((a("attention.head_count"), Val::U32(c.num_heads as u32)));
    kv.push((
        a("attention.head_count_kv"),
        Val::U32(c.layers[0].num_kv_heads as u32),
    ));
    let full = c.rope.get("full_attention");
    if let Some(r) = full.filter(|r| r.rope_type == "linear") {
        kv.push((a("rope.scaling.type"), Val::Str("linear".into())));
        kv.push((a("rope.scaling.factor"), Val::F32(r.factor as f32)));
    }
    if let Some(r) = full {
        kv.push((a("rope.freq_base"), Val::F32(r.theta as f32)));
    }
    if let Some(r) = c.rope.get("sliding_attention") {
        kv.push((a("rope.freq_base_swa"), Val::F32(r.theta as f32)));
    }
    kv.push((
        a("attention.layer_norm_rms_epsilon"),
        Val::F32(c.rms_norm_eps as f32),
    ));
    kv.push((
        a("attention.key_length"),
        Val::U32(c.layers[0].head_dim as u32),
    ));
    kv.push((
        a("attention.value_length"),
        Val::U32(c.layers[0].head_dim as u32),
    ));
    kv.push(("general.file_type".into(), Val::U32(ft.id())));
    if let Some(s) = c.final_logit_softcapping {
        kv.push((a("final_logit_softcapping"), Val::F32(s as f32)));
    }
    if raw["sliding_window_pattern"].as_u64() != Some(1) {
        kv.push((
            a("attention.sliding_window"),
            Val::U32(c.sliding_window as u32),
        ));
    }
}

/// Values of one planned tensor as f32 (checkpoint bytes, or the generated rope_freqs).
fn values(ck: &Checkpoint, p: &Plan) -> Result<Vec<f32>> {
    match &p.hf {
        None => {
            // Full layers: "proportional" RoPE; ggml's neox rope rotates the first dims, so the
            // unrotated pairs get frequency factor 1e30 (conversion/gemma.py::generate_extra_tensors).
            let r = &ck.config.rope["full_attention"];
            let half = p.ne[0] as usize;
            let n_rot = (r.head_dim as f64 * r.partial_rotary_factor / 2.0) as usize;
            Ok((0..half)
                .map(|i| if i < n_rot { 1.0 } else { 1e30 })
                .collect())
        }
        Some(hf) => {
            let info = ck.store.get(&format!("{}{hf}", ck.config.prefix)).unwrap();
            let v = ck.store.to_f32(info);
            ck.store.release(info);
            Ok(v)
        }
    }
}

/// Write `path` (via a temp file renamed at the end), in gguf-py's phases: header, key-values, tensor
/// infos, then the aligned tensor data. `progress` gets checkpoint bytes consumed.
pub fn write_gguf(
    ck: &Checkpoint,
    path: &Path,
    ft: FileType,
    pure: bool,
    imp: Option<&Importance>,
    rounded: Option<&std::collections::HashMap<String, Vec<f32>>>,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<(Vec<Plan>, String)> {
    if imp.is_some() && ft == FileType::Q4_0 && !pure {
        // llama-quantize's Q4_0 mix with an imatrix makes the first n_layer/8 ffn_down Q4_1
        // (llama-quant.cpp, "Guard against craziness"), a type hexq does not write.
        return Err(Error::file(
            path,
            "--imatrix with the default q4_0 mix needs q4_1 for the first ffn_down layers, which hexq does not write: pass --pure",
        ));
    }
    let plan = plan(ck, ft, pure)?;
    let mut kv = metadata(ck, ft, &plan)?;
    if let Some(i) = imp {
        for p in plan.iter().filter(|p| p.ty.is_block()) {
            if let Some(w) = i.weights.get(&p.name).filter(|w| w.len() as u64 != p.ne[0]) {
                return Err(Error::file(
                    path,
                    format!(
                        "imatrix {}: {} has {} columns, its entry {}",
                        i.file,
                        p.name,
                        p.ne[0],
                        w.len()
                    ),
                ));
            }
        }
        i.metadata(&mut kv);
    }
    let head = header(&kv, &plan);
    let data: u64 = plan
        .iter()
        .map(|p| (p.ty.bytes(p.ne.iter().product::<u64>() as usize) as u64).div_ceil(ALIGN) * ALIGN)
        .sum();
    hexq_fsutil::ensure_space(path, head.len() as u64 + data)?;
    let out = hexq_fsutil::AtomicFile::new(path);
    // Hashed as written, page cache bypassed (O_DIRECT; see HashedFile).
    let mut w = hexq_fsutil::HashedFile::create(&out.tmp)?;
    w.write_all(&head).map_err(|e| Error::io(path, e))?;
    let mut t = TensorWriter {
        ck,
        path,
        w: &mut w,
        written: 0,
        obuf: Vec::new(),
        fbuf: Vec::new(),
        imp,
        rounded,
        progress,
    };
    for p in &plan {
        t.tensor(p)?;
    }
    let written = t.written;
    let (end, sha) = w.finish()?;
    debug_assert_eq!(end, head.len() as u64 + written);
    out.commit()?;
    Ok((plan, sha))
}

/// Header, key-values and tensor infos (offsets aligned to ALIGN), padded to the data section.
fn header(kv: &[(String, Val)], plan: &[Plan]) -> Vec<u8> {
    let mut head = Vec::new();
    head.extend(b"GGUF");
    head.extend(GGUF_VERSION.to_le_bytes());
    head.extend((plan.len() as u64).to_le_bytes());
    head.extend((kv.len() as u64).to_le_bytes());
    for (k, v) in kv {
        put_str(&mut head, k);
        v.write(&mut head);
    }
    let mut off = 0u64;
    for p in plan {
        put_str(&mut head, &p.name);
        head.extend((p.ne.len() as u32).to_le_bytes());
        p.ne.iter().for_each(|d| head.extend(d.to_le_bytes()));
        head.extend(p.ty.id().to_le_bytes());
        head.extend(off.to_le_bytes());
        let n: u64 = p.ne.iter().product();
        off += p.ty.bytes(n as usize) as u64;
        off = off.div_ceil(ALIGN) * ALIGN;
    }
    while !(head.len() as u64).is_multiple_of(ALIGN) {
        head.push(0);
    }
    head
}

/// The data phase: each tensor converted chunk by chunk into reused buffers, then padded to ALIGN.
struct TensorWriter<'a> {
    ck: &'a Checkpoint,
    /// The destination, named in errors (the temp file beside it is an implementation detail).
    path: &'a Path,
    w: &'a mut hexq_fsutil::HashedFile,
    written: u64,
    obuf: Vec<u8>,
    fbuf: Vec<f32>,
    imp: Option<&'a Importance>,
    /// GGUF name → values a rounding (GPTQ) put on each q4_0 block's grid, `[out, in]`.
    rounded: Option<&'a std::collections::HashMap<String, Vec<f32>>>,
    progress: &'a (dyn Fn(u64) + Sync),
}

impl TensorWriter<'_> {
    fn put(&mut self, b: &[u8]) -> Result<()> {
        self.w.write_all(b).map_err(|e| Error::io(self.path, e))?;
        self.written += b.len() as u64;
        Ok(())
    }

    /// The importance weights for this tensor, when an imatrix has them and its type uses them.
    fn weights(&self, p: &Plan) -> Option<&'_ [f32]> {
        let w = self.imp?.weights.get(&p.name)?;
        (p.ty == ggml::GgmlType::Q4_0).then_some(w.as_slice())
    }

    /// `v` encoded as the planned type (importance-weighted where [`Self::weights`] says).
    fn encode(&mut self, p: &Plan, v: &[f32]) -> Result<()> {
        let mut obuf = std::mem::take(&mut self.obuf);
        let row = p.ne[0] as usize;
        match self.weights(p) {
            Some(w) => hexq_gguf::weighted::encode_weighted_into(p.ty, v, row, w, &mut obuf),
            None => ggml::encode_into(p.ty, v, row, &mut obuf),
        }
        .map_err(|m| self.bad(p, m))?;
        let r = self.put(&obuf);
        self.obuf = obuf;
        r
    }

    fn bad(&self, p: &Plan, m: ggml::GgmlError) -> Error {
        let name = p.hf.as_deref().unwrap_or(&p.name);
        Error::tensor(&self.ck.dir, name, m.to_string())
    }

    /// Whole rows, ~64 MiB of source at a time: peak memory is a chunk, not the 4.7 GB per-layer embedding.
    fn tensor(&mut self, p: &Plan) -> Result<()> {
        if let Some(r) = self.rounded.and_then(|m| m.get(&p.name)) {
            if p.ty == ggml::GgmlType::Q4_0 {
                // Scales from the checkpoint's values (ggml's rule), integers from the rounded ones.
                let src = values(self.ck, p)?;
                let mut obuf = std::mem::take(&mut self.obuf);
                obuf.clear();
                ggml::quantize_q4_0_on(r, &src, &mut obuf).map_err(|m| self.bad(p, m))?;
                let res = self.put(&obuf);
                self.obuf = obuf;
                res?;
                let es = p
                    .hf
                    .as_ref()
                    .and_then(|hf| self.ck.store.get(&format!("{}{hf}", self.ck.config.prefix)));
                (self.progress)(es.map_or(4, |i| i.dtype.size()) as u64 * src.len() as u64);
                let pad = self.written.div_ceil(ALIGN) * ALIGN - self.written;
                return self.put(&vec![0u8; pad as usize]);
            }
        }
        match &p.hf {
            None => self.encode(p, &values(self.ck, p)?)?,
            Some(hf) => {
                let ck = self.ck;
                let info = ck
                    .store
                    .get(&format!("{}{hf}", ck.config.prefix))
                    .expect("planned from the store");
                ck.store
                    .read_chunks(info, 64 << 20, |chunk| self.chunk(p, info.dtype, chunk))?;
            }
        }
        let pad = self.written.div_ceil(ALIGN) * ALIGN - self.written;
        self.put(&vec![0u8; pad as usize])
    }

    fn chunk(&mut self, p: &Plan, dt: hexq_model::weights::DType, chunk: &[u8]) -> Result<()> {
        use hexq_model::weights::DType;
        // bf16 → bf16: the bytes are the answer (the f32 round trip is the identity for every non-NaN value;
        // NaN goes the long way, as the converter quiets it).
        let nan = |c: &[u8]| {
            c.chunks_exact(2)
                .any(|h| (u16::from_le_bytes([h[0], h[1]]) & 0x7fff) > 0x7f80)
        };
        if p.shift != 0.0 {
            // In the source's precision when that is f16 (the converter adds in torch's dtype; bf16 is
            // widened to f32 first).
            let mut fbuf = std::mem::take(&mut self.fbuf);
            hexq_model::weights::to_f32_into(chunk, dt, &mut fbuf);
            for x in fbuf.iter_mut() {
                *x += p.shift;
                if dt == DType::F16 {
                    *x = half::f16::from_f32(*x).to_f32();
                }
            }
            let r = self.encode(p, &fbuf);
            self.fbuf = fbuf;
            r?;
        } else if p.ty == ggml::GgmlType::BF16 && dt == DType::BF16 && !nan(chunk) {
            self.put(chunk)?;
        } else if p.ty.is_block() && dt == DType::BF16 && self.weights(p).is_none() {
            let mut obuf = std::mem::take(&mut self.obuf);
            ggml::encode_bf16_into(p.ty, chunk, p.ne[0] as usize, &mut obuf)
                .map_err(|m| self.bad(p, m))?;
            let r = self.put(&obuf);
            self.obuf = obuf;
            r?;
        } else {
            let mut fbuf = std::mem::take(&mut self.fbuf);
            hexq_model::weights::to_f32_into(chunk, dt, &mut fbuf);
            let r = self.encode(p, &fbuf);
            self.fbuf = fbuf;
            r?;
        }
        (self.progress)(chunk.len() as u64);
        Ok(())
    }
}
