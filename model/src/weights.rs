//! Memory-mapped safetensors, single file or sharded, read lazily one tensor at a time.
//!
//! Nothing is copied at open: headers are parsed and validated, tensor bytes stay in the mmap until a
//! caller asks for one tensor (as f32, or as raw bytes for streaming writers). Every failure names the
//! file and, where there is one, the tensor.

use crate::error::{Error, Result};
use half::f16;
use memmap2::Mmap;
use rayon::prelude::*;
use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

/// Storage dtypes hexq reads (the ones Gemma checkpoints use).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum DType {
    F32,
    F16,
    BF16,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
        }
    }
}

/// Where one tensor lives.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub file: usize,
    /// Absolute byte range in the file.
    pub start: usize,
    pub end: usize,
}

impl TensorInfo {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// All safetensors files of one checkpoint, mapped.
pub struct SafetensorsStore {
    pub files: Vec<PathBuf>,
    /// The checkpoint's own files: `files[..base_files]`; the rest are overlays ([`Self::overlay`]).
    pub base_files: usize,
    maps: Vec<std::sync::Arc<Mmap>>,
    /// Files that are anonymous mappings ([`Self::overlay_f32`]): never released (DONTNEED would zero them).
    anon: std::collections::BTreeSet<usize>,
    tensors: BTreeMap<String, TensorInfo>,
}

impl SafetensorsStore {
    /// Open `model.safetensors` or the shards listed by `model.safetensors.index.json` in `dir`.
    pub fn open_dir(dir: &Path) -> Result<Self> {
        let index = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|e| Error::io(&index, e))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| Error::file(&index, format!("invalid JSON: {e}")))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| Error::file(&index, "missing object \"weight_map\""))?;
            let mut shards: Vec<String> = Vec::new();
            for (t, f) in map {
                let f = f.as_str().ok_or_else(|| {
                    Error::file(&index, format!("weight_map[{t:?}] is not a file name"))
                })?;
                if !shards.iter().any(|s| s == f) {
                    shards.push(f.to_string());
                }
            }
            shards.sort();
            let paths: Vec<PathBuf> = shards.iter().map(|s| dir.join(s)).collect();
            let store = Self::open_files(&paths)?;
            // The index must agree with the shards, or a later lookup would fail far from the cause.
            for (t, f) in map {
                let f = f.as_str().unwrap();
                match store.tensors.get(t) {
                    None => {
                        return Err(Error::file(
                            &index,
                            format!("tensor {t:?} listed for shard {f:?} is not in that shard"),
                        ))
                    }
                    Some(info) if store.files[info.file] != dir.join(f) => {
                        return Err(Error::file(
                            &index,
                            format!(
                                "tensor {t:?} listed in {f:?} but found in {}",
                                store.files[info.file].display()
                            ),
                        ))
                    }
                    _ => {}
                }
            }
            Ok(store)
        } else if single.exists() {
            Self::open_files(&[single])
        } else {
            Err(Error::file(
                dir,
                "no model.safetensors or model.safetensors.index.json",
            ))
        }
    }

    pub fn open_files(paths: &[PathBuf]) -> Result<Self> {
        let mut maps = Vec::new();
        let mut tensors = BTreeMap::new();
        for (fi, p) in paths.iter().enumerate() {
            let f = File::open(p).map_err(|e| Error::io(p, e))?;
            // SAFETY: the file is opened read-only; checkpoints are not modified while hexq runs.
            let m = unsafe { Mmap::map(&f) }.map_err(|e| Error::io(p, e))?;
            for info in parse_header(p, &m, fi)? {
                if let Some(prev) = tensors.insert(info.name.clone(), info) {
                    return Err(Error::file(
                        p,
                        format!(
                            "tensor {:?} also present in {}",
                            prev.name,
                            paths[prev.file].display()
                        ),
                    ));
                }
            }
            maps.push(std::sync::Arc::new(m));
        }
        Ok(Self {
            files: paths.to_vec(),
            base_files: paths.len(),
            maps,
            anon: Default::default(),
            tensors,
        })
    }

    /// Map one more safetensors file whose tensors replace the same-named ones (rounded weights written by
    /// `hexq quantize --rounding gptq`); returns its tensors.
    pub fn overlay(&mut self, p: &Path) -> Result<Vec<TensorInfo>> {
        let f = File::open(p).map_err(|e| Error::io(p, e))?;
        // SAFETY: as in open_files.
        let m = unsafe { Mmap::map(&f) }.map_err(|e| Error::io(p, e))?;
        let infos = parse_header(p, &m, self.files.len())?;
        self.files.push(p.to_path_buf());
        self.maps.push(std::sync::Arc::new(m));
        for i in &infos {
            self.tensors.insert(i.name.clone(), i.clone());
        }
        Ok(infos)
    }

    /// [`Self::overlay`] of f32 tensors held in memory (an ablation's rounded weights): an anonymous mapping
    /// laid out as a safetensors file, so every reader takes it as it takes a file. `label` names it in
    /// errors; it is never opened.
    pub fn overlay_f32(
        &mut self,
        label: &Path,
        tensors: &[(String, Vec<usize>, &[f32])],
    ) -> Result<Vec<TensorInfo>> {
        let ts: Vec<(String, DType, Vec<usize>)> = tensors
            .iter()
            .map(|(n, s, _)| (n.clone(), DType::F32, s.clone()))
            .collect();
        let (hdr, data) = safetensors_header(&ts, &serde_json::json!({"format": "pt"}));
        let io = |e| Error::io(label, e);
        let mut m = memmap2::MmapMut::map_anon((hdr.len() + data).max(1)).map_err(io)?;
        m[..hdr.len()].copy_from_slice(&hdr);
        let mut at = hdr.len();
        for (name, shape, v) in tensors {
            if v.len() != shape.iter().product::<usize>() {
                return Err(Error::tensor(
                    label,
                    name,
                    format!("{} values for shape {shape:?}", v.len()),
                ));
            }
            let b: &[u8] = bytemuck::cast_slice(v);
            m[at..at + b.len()].copy_from_slice(b);
            at += b.len();
        }
        let m = m.make_read_only().map_err(io)?;
        let infos = parse_header(label, &m, self.files.len())?;
        self.anon.insert(self.files.len());
        self.files.push(label.to_path_buf());
        self.maps.push(std::sync::Arc::new(m));
        for i in &infos {
            self.tensors.insert(i.name.clone(), i.clone());
        }
        Ok(infos)
    }

    pub fn get(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.get(name)
    }
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(|s| s.as_str())
    }
    pub fn infos(&self) -> impl Iterator<Item = &TensorInfo> {
        self.tensors.values()
    }
    pub fn file_of(&self, info: &TensorInfo) -> &Path {
        &self.files[info.file]
    }

    /// Raw little-endian bytes of a tensor, straight from the mmap.
    pub fn bytes(&self, info: &TensorInfo) -> &[u8] {
        &self.maps[info.file][info.start..info.end]
    }

    /// The mapping a tensor lives in and its byte range there: for readers that keep using a tensor in
    /// place (the weight kernel's bf16 rows) instead of copying it out.
    pub fn mapped(&self, info: &TensorInfo) -> (std::sync::Arc<Mmap>, std::ops::Range<usize>) {
        (self.maps[info.file].clone(), info.start..info.end)
    }

    /// Rows `[r0, r1)` of a 2-D tensor as f32 (embedding lookups read only what they need).
    pub fn rows_f32(&self, info: &TensorInfo, r0: usize, r1: usize) -> Vec<f32> {
        let cols: usize = info.shape[1..].iter().product();
        let es = info.dtype.size();
        let b = self.bytes(info);
        to_f32(&b[r0 * cols * es..r1 * cols * es], info.dtype)
    }

    /// A tensor's bytes in whole-row chunks of at most `max_bytes` (at least one row), each read by `pread`
    /// into one reused buffer rather than faulted in through the mapping page by page (the E2B per-layer
    /// embedding alone is a million 4 KiB faults). `f` gets each chunk.
    pub fn read_chunks(
        &self,
        info: &TensorInfo,
        max_bytes: usize,
        mut f: impl FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        use std::os::unix::fs::FileExt;
        let file = self.file_of(info);
        let fh = std::fs::File::open(file).map_err(|e| Error::io(file, e))?;
        let len = info.end - info.start;
        let row_b = info.shape.last().copied().unwrap_or(1).max(1) * info.dtype.size();
        let step = (max_bytes / row_b).max(1) * row_b;
        let mut buf = vec![0u8; step.min(len)];
        let mut a = 0;
        while a < len {
            let b = (a + step).min(len);
            let chunk = &mut buf[..b - a];
            fh.read_exact_at(chunk, (info.start + a) as u64)
                .map_err(|e| Error::tensor(file, &info.name, format!("reading: {e}")))?;
            f(chunk)?;
            a = b;
        }
        Ok(())
    }

    /// Drop a tensor's pages from this process's resident set once a streaming writer is done with it
    /// (they stay in the page cache and are re-read on demand), so a pass over a 10 GB checkpoint keeps
    /// RSS near one tensor instead of growing to the whole mapped file.
    pub fn release(&self, info: &TensorInfo) {
        self.release_range(info, 0, info.end - info.start);
    }

    /// [`Self::release`] for bytes `[a, b)` of a tensor (streaming writers release as they go).
    pub fn release_range(&self, info: &TensorInfo, a: usize, b: usize) {
        #[cfg(unix)]
        if !self.anon.contains(&info.file) {
            let page = 4096usize;
            let start = (info.start + a) / page * page;
            let len = info.start + b - start;
            // SAFETY: read-only, file-backed mapping: DONTNEED only discards clean pages, which the kernel
            // re-reads from the file on the next access; no slice into them is live across this call in
            // the streaming writers that use it.
            unsafe {
                let _ = self.maps[info.file].unchecked_advise_range(
                    memmap2::UncheckedAdvice::DontNeed,
                    start,
                    len,
                );
            }
        }
    }

    /// A whole tensor as f32.
    pub fn to_f32(&self, info: &TensorInfo) -> Vec<f32> {
        to_f32(self.bytes(info), info.dtype)
    }
}

/// Convert little-endian storage bytes to f32 (parallel; used on whole weight matrices).
pub fn to_f32(b: &[u8], dt: DType) -> Vec<f32> {
    let mut out = Vec::new();
    to_f32_into(b, dt, &mut out);
    out
}

/// Min and max of a slice, NaN counted as +inf (an infinite range is visible; NaN would poison min/max
/// silently), 16 lanes at a time (compare-and-select vectorizes; `f32::min` does not).
/// Exact: min and max do not round, so lanes and order give the same answer as a sequential fold.
pub fn min_max(v: &[f32]) -> (f32, f32) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F.
        return unsafe { min_max_avx512(v) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2.
        return unsafe { min_max_avx2(v) };
    }
    min_max_lanes(v)
}

/// [`min_max_lanes`] compiled for AVX2 (CPUs without AVX-512).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn min_max_avx2(v: &[f32]) -> (f32, f32) {
    min_max_lanes(v)
}

/// [`min_max_lanes`] compiled for AVX-512 (the observer scans every activation of a calibration with it).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn min_max_avx512(v: &[f32]) -> (f32, f32) {
    min_max_lanes(v)
}

#[inline(always)]
fn min_max_lanes(v: &[f32]) -> (f32, f32) {
    const L: usize = 16;
    let (mut lo, mut hi, mut nan) = ([f32::INFINITY; L], [f32::NEG_INFINITY; L], [false; L]);
    let mut chunks = v.chunks_exact(L);
    for c in chunks.by_ref() {
        for k in 0..L {
            let x = c[k];
            lo[k] = if x < lo[k] { x } else { lo[k] };
            hi[k] = if x > hi[k] { x } else { hi[k] };
            nan[k] |= x.is_nan();
        }
    }
    let (mut l, mut h, mut n) = (f32::INFINITY, f32::NEG_INFINITY, nan.contains(&true));
    for &x in chunks.remainder() {
        n |= x.is_nan();
        l = if x < l { x } else { l };
        h = if x > h { x } else { h };
    }
    for k in 0..L {
        l = l.min(lo[k]);
        h = h.max(hi[k]);
    }
    if n {
        h = f32::INFINITY;
    }
    (l, h)
}

/// Index of the first NaN or infinite element of `b` (stored as `dt`): exponent bits all ones.
/// Blocks of 4 KiB are tested without an early exit (a loop the compiler vectorizes: a scalar `position`
/// over a 10 GB checkpoint was ~25 s of CPU at every open); the failing block is searched element by element.
pub fn nonfinite_at(b: &[u8], dt: DType) -> Option<usize> {
    let (es, mask) = match dt {
        DType::F32 => (4, 0x7f80_0000u32),
        DType::BF16 => (2, 0x7f80),
        DType::F16 => (2, 0x7c00),
    };
    let word = |c: &[u8]| match es {
        4 => u32::from_le_bytes([c[0], c[1], c[2], c[3]]),
        _ => u16::from_le_bytes([c[0], c[1]]) as u32,
    };
    const BLOCK: usize = 4096;
    for (n, blk) in b.chunks(BLOCK).enumerate() {
        // One fold per width, so each loop body has no branch to vectorize around.
        let any = match es {
            4 => blk.chunks_exact(4).fold(false, |a, c| {
                a | (u32::from_le_bytes([c[0], c[1], c[2], c[3]]) & mask == mask)
            }),
            _ => blk.chunks_exact(2).fold(false, |a, c| {
                a | (u16::from_le_bytes([c[0], c[1]]) as u32 & mask == mask)
            }),
        };
        if any {
            let i = blk.chunks_exact(es).position(|c| word(c) & mask == mask)?;
            return Some(n * BLOCK / es + i);
        }
    }
    None
}

/// [`to_f32`] into a reused buffer (streaming writers: no fresh pages to fault in and zero per tensor).
pub fn to_f32_into(b: &[u8], dt: DType, out: &mut Vec<f32>) {
    // resize also shrinks; every element is overwritten below.
    out.resize(b.len() / dt.size(), 0.0);
    const CH: usize = 1 << 16;
    let es = dt.size();
    out.par_chunks_mut(CH)
        .enumerate()
        .for_each(|(ci, o)| convert(&b[ci * CH * es..], dt, o));
}

/// [`to_f32_into`] on the calling thread (small row ranges, already inside a parallel loop).
pub fn to_f32_serial_into(b: &[u8], dt: DType, out: &mut Vec<f32>) {
    out.resize(b.len() / dt.size(), 0.0);
    convert(b, dt, out);
}

/// `o.len()` values from the front of `s` (bf16 by the kernels' widening, the one the weight MatMul's
/// packer mirrors).
fn convert(s: &[u8], dt: DType, o: &mut [f32]) {
    if dt == DType::BF16 {
        return hexq_kernels::convert::bf16_to_f32(s, o);
    }
    convert_lanes(s, dt, o)
}

#[inline(always)]
fn convert_lanes(s: &[u8], dt: DType, o: &mut [f32]) {
    match dt {
        DType::F32 => {
            for (i, v) in o.iter_mut().enumerate() {
                *v = f32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
            }
        }
        DType::BF16 => hexq_kernels::convert::bf16_to_f32(s, o),
        DType::F16 => {
            for (i, v) in o.iter_mut().enumerate() {
                *v = f16::from_bits(u16::from_le_bytes([s[2 * i], s[2 * i + 1]])).to_f32();
            }
        }
    }
}

/// Parse and validate a safetensors header: 8-byte LE length, JSON, tensors tiling the data area.
fn parse_header(path: &Path, m: &[u8], file: usize) -> Result<Vec<TensorInfo>> {
    let bad = |msg: String| Error::file(path, msg);
    if m.len() < 8 {
        return Err(bad(format!(
            "truncated: {} bytes, shorter than the 8-byte header length",
            m.len()
        )));
    }
    let n = u64::from_le_bytes(m[..8].try_into().unwrap()) as usize;
    if n > 100 << 20 || 8 + n > m.len() {
        return Err(bad(format!(
            "corrupt or truncated header: header length {n}, file length {}",
            m.len()
        )));
    }
    let hdr: serde_json::Value = serde_json::from_slice(&m[8..8 + n])
        .map_err(|e| bad(format!("corrupt header (not JSON): {e}")))?;
    let obj = hdr
        .as_object()
        .ok_or_else(|| bad("corrupt header: not a JSON object".into()))?;
    let data0 = 8 + n;
    let data_len = m.len() - data0;
    let mut out = Vec::new();
    for (name, v) in obj {
        if name == "__metadata__" {
            continue;
        }
        let terr = |msg: &str| bad(format!("tensor {name:?}: {msg}"));
        let dt = v
            .get("dtype")
            .and_then(|d| d.as_str())
            .ok_or_else(|| terr("missing dtype"))?;
        let dtype = match dt {
            "F32" => DType::F32,
            "F16" => DType::F16,
            "BF16" => DType::BF16,
            other => {
                return Err(terr(&format!(
                    "unsupported dtype {other} (hexq reads F32, F16, BF16)"
                )))
            }
        };
        let shape: Vec<usize> = v
            .get("shape")
            .and_then(|s| s.as_array())
            .ok_or_else(|| terr("missing shape"))?
            .iter()
            .map(|x| x.as_u64().map(|u| u as usize))
            .collect::<Option<_>>()
            .ok_or_else(|| terr("shape is not a list of integers"))?;
        let offs = v
            .get("data_offsets")
            .and_then(|s| s.as_array())
            .filter(|a| a.len() == 2)
            .and_then(|a| Some((a[0].as_u64()? as usize, a[1].as_u64()? as usize)))
            .ok_or_else(|| terr("missing or malformed data_offsets"))?;
        let numel: usize = shape.iter().product();
        if offs.1 < offs.0 || offs.1 - offs.0 != numel * dtype.size() {
            return Err(terr(&format!(
                "data_offsets {:?} hold {} bytes but shape {:?} {dt} needs {}",
                offs,
                offs.1.saturating_sub(offs.0),
                shape,
                numel * dtype.size()
            )));
        }
        if offs.1 > data_len {
            return Err(terr(&format!(
                "data ends at byte {} but the file's data area has {data_len} bytes (truncated file?)",
                offs.1
            )));
        }
        out.push(TensorInfo {
            name: name.clone(),
            dtype,
            shape,
            file,
            start: data0 + offs.0,
            end: data0 + offs.1,
        });
    }
    reference_check(path, m, &mut out, data0)?;
    Ok(out)
}

/// The `safetensors` crate, the format's reference loader, has the last word on the header: hexq accepts
/// no file it refuses (tensors overlapping, leaving gaps, reaching past the data or not reaching its end).
/// Its errors name no file and few details, so the message is built from the tensors parsed above.
fn reference_check(path: &Path, m: &[u8], t: &mut [TensorInfo], data0: usize) -> Result<()> {
    use safetensors::SafeTensorError as E;
    let Err(e) = safetensors::SafeTensors::read_metadata(m) else {
        return Ok(());
    };
    t.sort_by_key(|x| (x.start, x.end));
    let rel = |x: usize| x - data0;
    let msg = match e {
        E::InvalidOffset(name) => {
            let mut end = data0;
            let mut msg = format!("tensor {name:?}: data_offsets out of order");
            for x in t.iter() {
                if x.start != end {
                    let how = if x.start < end { "overlaps the tensor before it" } else { "leaves a gap after the tensor before it" };
                    msg = format!(
                        "tensor {:?}: data_offsets [{}, {}] {how} (which ends at byte {}); safetensors tensors \
                         must tile the data area back to back",
                        x.name, rel(x.start), rel(x.end), rel(end)
                    );
                    break;
                }
                end = x.end;
            }
            msg
        }
        E::MetadataIncompleteBuffer => format!(
            "the tensors' data_offsets end at byte {} but the data area holds {} bytes (a truncated file, or \
             bytes after the last tensor); safetensors tensors must cover the data area exactly",
            t.last().map_or(0, |x| rel(x.end)),
            m.len() - data0
        ),
        e => format!("refused by the safetensors format check: {e}"),
    };
    Err(Error::file(path, msg))
}

/// A safetensors header for tensors written back to back in this order: the 8-byte length, then the JSON
/// (padded with spaces to 8 bytes, as the Rust and Python writers do). Returns the header and the data size.
pub fn safetensors_header(
    tensors: &[(String, DType, Vec<usize>)],
    metadata: &serde_json::Value,
) -> (Vec<u8>, usize) {
    let mut hdr = serde_json::Map::new();
    hdr.insert("__metadata__".into(), metadata.clone());
    let mut off = 0usize;
    for (name, dt, shape) in tensors {
        let n = shape.iter().product::<usize>() * dt.size();
        let e =
            serde_json::json!({"dtype": dt.name(), "shape": shape, "data_offsets": [off, off + n]});
        hdr.insert(name.clone(), e);
        off += n;
    }
    let mut hj = serde_json::to_vec(&serde_json::Value::Object(hdr)).expect("a JSON map");
    while !hj.len().is_multiple_of(8) {
        hj.push(b' ');
    }
    let mut out = (hj.len() as u64).to_le_bytes().to_vec();
    out.extend(hj);
    (out, off)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vectorized bf16 widening is half's, bit for bit, on all 65,536 encodings (NaNs quieted).
    #[test]
    fn bf16_widening_equals_half() {
        let b: Vec<u8> = (0..=u16::MAX).flat_map(|h| h.to_le_bytes()).collect();
        let mut o = vec![0f32; 1 << 16];
        convert(&b, DType::BF16, &mut o);
        for (h, v) in (0..=u16::MAX).zip(&o) {
            assert_eq!(
                v.to_bits(),
                half::bf16::from_bits(h).to_f32().to_bits(),
                "{h:#06x}"
            );
        }
    }

    /// The blocked scan finds the same first bad element as a plain scan, in every dtype, at block edges.
    #[test]
    fn nonfinite_at_equals_a_plain_scan() {
        for (dt, bad) in [
            (DType::F32, f32::NAN.to_le_bytes().to_vec()),
            (DType::BF16, vec![0x80, 0x7f]),
            (DType::F16, vec![0x00, 0x7c]),
        ] {
            let es = dt.size();
            let n = 3 * 4096 / es + 5;
            for at in [
                None,
                Some(0),
                Some(4096 / es - 1),
                Some(4096 / es),
                Some(n - 1),
            ] {
                let mut b: Vec<u8> = (0..n * es).map(|i| (i % 61) as u8).collect();
                if let Some(a) = at {
                    b[a * es..(a + 1) * es].copy_from_slice(&bad);
                    // A second bad value later: the first one must be reported.
                    if a + 7 < n {
                        b[(a + 7) * es..(a + 8) * es].copy_from_slice(&bad);
                    }
                }
                assert_eq!(nonfinite_at(&b, dt), at, "{dt:?} at {at:?}");
            }
        }
    }
}
