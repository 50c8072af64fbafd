//! GGUF reader (v2/v3, little-endian, as gguf-py's `GGUFReader` reads it): header, key-values, tensor
//! infos, aligned data, memory-mapped. Every read is bounds-checked against the file, so a truncated or
//! malformed file is an error naming the file, the byte offset and what was being read — never a panic or
//! an allocation the file's size cannot back.

use crate::ggml::GgmlType;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// gguf-py's `GGUFValueType`: the type ids a metadata value is written with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum ValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl ValueType {
    const ALL: [ValueType; 13] = [
        ValueType::U8,
        ValueType::I8,
        ValueType::U16,
        ValueType::I16,
        ValueType::U32,
        ValueType::I32,
        ValueType::F32,
        ValueType::Bool,
        ValueType::String,
        ValueType::Array,
        ValueType::U64,
        ValueType::I64,
        ValueType::F64,
    ];
    pub fn from_id(id: u32) -> Option<Self> {
        Self::ALL.get(id as usize).copied()
    }
    /// Bytes of a fixed-size value (None: string, array).
    fn size(self) -> Option<usize> {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => Some(1),
            U16 | I16 => Some(2),
            U32 | I32 | F32 => Some(4),
            U64 | I64 | F64 => Some(8),
            String | Array => None,
        }
    }
}

/// A metadata value as read.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Int(i64),
    UInt(u64),
    Float(f64),
    Bool(bool),
    Str(String),
    Array(Vec<Value>),
}

impl Value {
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::UInt(v) => Some(v),
            Value::Int(v) if v >= 0 => Some(v as u64),
            _ => None,
        }
    }
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::Float(v) => Some(v),
            Value::UInt(v) => Some(v as f64),
            Value::Int(v) => Some(v as f64),
            _ => None,
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// A tensor's info: name, dims in ggml order (ne0 = the contiguous one first), type, byte range in the file.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    pub ne: Vec<u64>,
    pub ty: GgmlType,
    pub start: usize,
    pub end: usize,
}

impl TensorInfo {
    pub fn numel(&self) -> u64 {
        self.ne.iter().product()
    }
    /// The shape as safetensors / PyTorch write it (reversed ne).
    pub fn shape(&self) -> Vec<usize> {
        self.ne.iter().rev().map(|&d| d as usize).collect()
    }
}

#[derive(Debug, thiserror::Error)]
#[error("{path}: {msg}")]
pub struct GgufError {
    pub path: PathBuf,
    pub msg: String,
}

pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub kv: BTreeMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    map: memmap2::Mmap,
}

/// A cursor over the mapped bytes; every read checks the remaining length.
struct Cur<'a> {
    b: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cur<'a> {
    fn err(&self, what: &str) -> GgufError {
        GgufError {
            path: self.path.to_path_buf(),
            msg: format!("at byte {}: {what}", self.pos),
        }
    }
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], GgufError> {
        if self.b.len().saturating_sub(self.pos) < n {
            return Err(self.err(&format!(
                "truncated reading {what} ({n} bytes past the end)"
            )));
        }
        let s = &self.b[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(
            self.take(4, what)?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(
            self.take(8, what)?.try_into().expect("8 bytes"),
        ))
    }
    /// A count of items each at least `min_size` bytes, refused if the rest of the file cannot hold them.
    fn count(&mut self, min_size: usize, what: &str) -> Result<usize, GgufError> {
        let n = self.u64(what)?;
        let left = (self.b.len() - self.pos) as u64;
        if n.saturating_mul(min_size.max(1) as u64) > left {
            return Err(self.err(&format!("{what} {n} exceeds what the file can hold")));
        }
        Ok(n as usize)
    }
    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let n = self.count(1, what)?;
        let s = self.take(n, what)?;
        String::from_utf8(s.to_vec()).map_err(|_| self.err(&format!("{what} is not UTF-8")))
    }
    fn value(&mut self, t: ValueType, what: &str, depth: usize) -> Result<Value, GgufError> {
        use ValueType::*;
        let fixed = |c: &mut Self, n: usize| c.take(n, what).map(|b| b.to_vec());
        Ok(match t {
            U8 => Value::UInt(fixed(self, 1)?[0] as u64),
            I8 => Value::Int(fixed(self, 1)?[0] as i8 as i64),
            Bool => Value::Bool(fixed(self, 1)?[0] != 0),
            U16 => Value::UInt(u16::from_le_bytes(fixed(self, 2)?.try_into().unwrap()) as u64),
            I16 => Value::Int(i16::from_le_bytes(fixed(self, 2)?.try_into().unwrap()) as i64),
            U32 => Value::UInt(u32::from_le_bytes(fixed(self, 4)?.try_into().unwrap()) as u64),
            I32 => Value::Int(i32::from_le_bytes(fixed(self, 4)?.try_into().unwrap()) as i64),
            F32 => Value::Float(f32::from_le_bytes(fixed(self, 4)?.try_into().unwrap()) as f64),
            U64 => Value::UInt(u64::from_le_bytes(fixed(self, 8)?.try_into().unwrap())),
            I64 => Value::Int(i64::from_le_bytes(fixed(self, 8)?.try_into().unwrap())),
            F64 => Value::Float(f64::from_le_bytes(fixed(self, 8)?.try_into().unwrap())),
            String => Value::Str(self.string(what)?),
            Array => {
                if depth > 4 {
                    return Err(self.err(&format!("{what}: arrays nested too deep")));
                }
                let et = self.value_type(what)?;
                let n = self.count(et.size().unwrap_or(8), what)?;
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.value(et, what, depth + 1)?);
                }
                Value::Array(v)
            }
        })
    }
    fn value_type(&mut self, what: &str) -> Result<ValueType, GgufError> {
        let id = self.u32(what)?;
        ValueType::from_id(id).ok_or_else(|| self.err(&format!("{what}: unknown value type {id}")))
    }
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        let e = |msg: String| GgufError {
            path: path.to_path_buf(),
            msg,
        };
        let f = std::fs::File::open(path).map_err(|x| e(x.to_string()))?;
        if f.metadata().map(|m| m.is_dir()).unwrap_or(false) {
            return Err(e("is a directory, not a GGUF file".into()));
        }
        // SAFETY: read-only mapping of a file hexq does not modify while it is open.
        let map = unsafe { memmap2::Mmap::map(&f) }.map_err(|x| e(x.to_string()))?;
        let (version, kv, tensors) = Self::parse(&map, path)?;
        Ok(GgufFile {
            path: path.to_path_buf(),
            version,
            kv,
            tensors,
            map,
        })
    }

    #[allow(clippy::type_complexity)]
    fn parse(
        b: &[u8],
        path: &Path,
    ) -> Result<(u32, BTreeMap<String, Value>, Vec<TensorInfo>), GgufError> {
        let mut c = Cur { b, pos: 0, path };
        if c.take(4, "the magic")? != b"GGUF" {
            return Err(c.err("not a GGUF file (magic is not \"GGUF\")"));
        }
        let version = c.u32("the version")?;
        if !(2..=3).contains(&version) {
            return Err(c.err(&format!("GGUF version {version} (hexq reads 2 and 3)")));
        }
        let n_tensors = c.count(24, "the tensor count")?;
        let n_kv = c.count(12, "the key-value count")?;
        let mut kv = BTreeMap::new();
        for _ in 0..n_kv {
            let k = c.string("a key")?;
            let t = c.value_type(&k)?;
            let v = c.value(t, &k, 0)?;
            kv.insert(k, v);
        }
        let mut infos = Vec::with_capacity(n_tensors);
        for _ in 0..n_tensors {
            let name = c.string("a tensor name")?;
            let nd = c.u32(&name)? as usize;
            if nd == 0 || nd > 4 {
                return Err(c.err(&format!("tensor {name}: {nd} dimensions")));
            }
            let ne = (0..nd)
                .map(|_| c.u64(&name))
                .collect::<Result<Vec<_>, _>>()?;
            let id = c.u32(&name)?;
            let ty = GgmlType::from_id(id).ok_or_else(|| {
                c.err(&format!(
                    "tensor {name}: ggml type {id} is not one hexq reads"
                ))
            })?;
            let off = c.u64(&name)?;
            infos.push((name, ne, ty, off));
        }
        let align = match kv.get("general.alignment") {
            None => 32,
            Some(v) => v
                .as_u64()
                .filter(|&a| a > 0 && a.is_power_of_two())
                .ok_or_else(|| c.err(&format!("general.alignment {v:?} is not a power of two")))?
                as usize,
        };
        let data = c.pos.div_ceil(align) * align;
        let mut tensors = Vec::with_capacity(infos.len());
        for (name, ne, ty, off) in infos {
            tensors.push(Self::place(b, path, data, name, ne, ty, off)?);
        }
        Ok((version, kv, tensors))
    }

    /// The tensor's byte range, checked: whole blocks, inside the file.
    fn place(
        b: &[u8],
        path: &Path,
        data: usize,
        name: String,
        ne: Vec<u64>,
        ty: GgmlType,
        off: u64,
    ) -> Result<TensorInfo, GgufError> {
        let e = |m: String| GgufError {
            path: path.to_path_buf(),
            msg: format!("tensor {name}: {m}"),
        };
        let n = ne
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .ok_or_else(|| e(format!("dims {ne:?} overflow")))?;
        if !ne[0].is_multiple_of(ty.block() as u64) {
            return Err(e(format!(
                "row of {} is not whole {} blocks",
                ne[0],
                ty.name()
            )));
        }
        let bytes = (n / ty.block() as u64).checked_mul(ty.info().block_bytes as u64);
        let start = (data as u64).checked_add(off);
        let end = start.zip(bytes).and_then(|(s, l)| s.checked_add(l));
        match (start, end) {
            (Some(s), Some(t)) if t <= b.len() as u64 => Ok(TensorInfo {
                name,
                ne,
                ty,
                start: s as usize,
                end: t as usize,
            }),
            _ => Err(e(format!(
                "data at offset {off} runs past the end of the file ({} bytes)",
                b.len()
            ))),
        }
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.kv.get(key)
    }
    /// Raw bytes of a tensor.
    pub fn bytes(&self, t: &TensorInfo) -> &[u8] {
        &self.map[t.start..t.end]
    }
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }
    /// A tensor dequantized to f32 (gguf-py's `dequantize`).
    pub fn f32(&self, t: &TensorInfo, out: &mut Vec<f32>) -> Result<(), GgufError> {
        crate::dequant::dequantize_into(t.ty, self.bytes(t), out).map_err(|m| GgufError {
            path: self.path.clone(),
            msg: format!("tensor {}: {m}", t.name),
        })
    }
}
