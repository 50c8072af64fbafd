//! ONNX writer: the graph IR node for node (same tensor names, so encodings line up), opset 21, IR version
//! 10, weights streamed from the safetensors mmap into external-data files at 4 KiB-aligned offsets (no
//! file near protobuf's 2 GB limit, no model in memory: one tensor at a time, its mapped pages released
//! after it is written).
//!
//! With encodings (`qdq`), the same graph in QDQ form — what onnxruntime runs as an independent quantsim and
//! what the QNN HTP backend compiles: every encoded activation `T` is followed by `QuantizeLinear →
//! DequantizeLinear` (consumers read the dequantized copy; a graph output keeps its name on the DQ side), and
//! every encoded parameter is stored quantized and `DequantizeLinear`'d (MatMul weights per output channel,
//! `axis = 1` of the `[in, out]` view). AIMET's `real = scale·(q + offset)` maps to ONNX's
//! `real = scale·(q − zero_point)`: asymmetric → unsigned storage, `zero_point = −offset`; symmetric →
//! signed storage, `zero_point = −offset − 2^(bw−1)` (0 for the usual −128 / −32768).

pub use crate::onnx_proto::elem;
use crate::onnx_proto::*;
use crate::qdq::*;
use hexq_graph::ir::{DType, Graph, InitSource, Initializer, Node, Op, ValueInfo, OPSET};
use hexq_model::{Checkpoint, Error, Result};
use hexq_quantize::{Encoding, Encodings};
use prost::Message;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Write;
use std::path::Path;

pub const IR_VERSION: i64 = 10;
const ALIGN: u64 = 4096;
/// Start a new .data file past this many bytes.
const MAX_DATA_FILE: u64 = 1 << 30;
/// Float constants at least this large go to external data.
const EXTERNAL_MIN_BYTES: usize = 4096;

/// ONNX `AttributeProto.AttributeType`.
mod attr_type {
    pub const INT: i32 = 2;
    pub const INTS: i32 = 7;
}

pub fn onnx_dtype(d: DType) -> i32 {
    match d {
        DType::F32 => elem::FLOAT,
        DType::I32 => elem::INT32,
        DType::I64 => elem::INT64,
        DType::Bool => elem::BOOL,
        DType::F16 => elem::FLOAT16,
        DType::BF16 => elem::BFLOAT16,
    }
}

fn attr_i(name: &str, v: i64) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        i: v,
        r#type: attr_type::INT,
        ..Default::default()
    }
}
fn attr_ints(name: &str, v: &[i64]) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        ints: v.to_vec(),
        r#type: attr_type::INTS,
        ..Default::default()
    }
}

fn vinfo(name: &str, d: DType, shape: &[usize], doc: &str) -> ValueInfoProto {
    ValueInfoProto {
        name: name.into(),
        r#type: Some(TypeProto {
            tensor_type: Some(TypeProtoTensor {
                elem_type: onnx_dtype(d),
                shape: Some(TensorShapeProto {
                    dim: shape
                        .iter()
                        .map(|&s| Dimension {
                            dim_value: s as i64,
                        })
                        .collect(),
                }),
            }),
        }),
        doc_string: doc.into(),
    }
}

struct DataWriter<'a> {
    dir: &'a Path,
    stem: String,
    files: Vec<String>,
    /// The current file, hashed as it is written (the manifest needs the SHA256s; re-reading gigabytes to
    /// hash them was a third of the export), and the hashes of the finished ones.
    cur: Option<hexq_fsutil::HashedFile>,
    off: u64,
    sha256: Vec<String>,
}

impl DataWriter<'_> {
    fn put(&mut self, bytes: &[u8]) -> Result<(String, u64)> {
        if self.cur.is_none() || (self.off > 0 && self.off + bytes.len() as u64 > MAX_DATA_FILE) {
            if let Some(w) = self.cur.take() {
                self.sha256.push(w.finish()?.1);
            }
            let name = if self.files.is_empty() {
                format!("{}.data", self.stem)
            } else {
                format!("{}.{}.data", self.stem, self.files.len())
            };
            let p = self.dir.join(&name);
            self.cur = Some(hexq_fsutil::HashedFile::create(&p)?);
            self.files.push(name);
            self.off = 0;
        }
        let w = self.cur.as_mut().unwrap();
        let pad = (ALIGN - self.off % ALIGN) % ALIGN;
        w.put(&vec![0u8; pad as usize])?;
        self.off += pad;
        let at = self.off;
        w.put(bytes)?;
        self.off += bytes.len() as u64;
        Ok((self.files.last().unwrap().clone(), at))
    }
    /// The files written, with their SHA256.
    fn finish(mut self) -> Result<Vec<(String, String)>> {
        if let Some(w) = self.cur.take() {
            self.sha256.push(w.finish()?.1);
        }
        Ok(self.files.into_iter().zip(self.sha256).collect())
    }
}

fn external(t: &mut TensorProto, file: &str, off: u64, len: usize) {
    t.data_location = 1;
    t.external_data = vec![
        StringStringEntryProto {
            key: "location".into(),
            value: file.into(),
        },
        StringStringEntryProto {
            key: "offset".into(),
            value: off.to_string(),
        },
        StringStringEntryProto {
            key: "length".into(),
            value: len.to_string(),
        },
    ];
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum WeightType {
    F32,
    /// f16 storage, `Cast` to f32 in the graph (half the .data; numerics of an f16 checkpoint).
    F16,
}

pub struct ExportOptions<'a> {
    /// File stem of the .onnx/.data files (the variant name; defaults to the graph's name).
    pub stem: Option<String>,
    pub weights: WeightType,
    /// Write the QDQ form of the graph from these encodings.
    pub qdq: Option<&'a Encodings>,
    /// Called after each initializer with the checkpoint bytes it consumed (progress).
    pub progress: Option<&'a (dyn Fn(u64) + Sync)>,
    /// A calibration graph (`hexq calibrate --engine ort`): these params written quantize-dequantized (f32),
    /// every float node output a graph output as well (onnxruntime hands each one back), and each MatMul
    /// weight read through an `Identity`.
    pub calibration: Option<&'a BTreeMap<String, Vec<Encoding>>>,
}

impl Default for ExportOptions<'_> {
    fn default() -> Self {
        ExportOptions {
            stem: None,
            weights: WeightType::F32,
            qdq: None,
            progress: None,
            calibration: None,
        }
    }
}

/// `[r, c]` → `[c, r]` into a reused buffer, in 64×64 tiles (a naive column walk misses the cache on every
/// element), rayon over bands of output rows.
fn transpose_into(v: &[f32], r: usize, c: usize, out: &mut Vec<f32>) {
    use rayon::prelude::*;
    const T: usize = 64;
    out.resize(v.len(), 0.0);
    out.par_chunks_mut(T * r)
        .enumerate()
        .for_each(|(bi, band)| {
            let b0 = bi * T;
            let bn = band.len() / r;
            for a0 in (0..r).step_by(T) {
                let an = T.min(r - a0);
                for b in 0..bn {
                    let o = &mut band[b * r + a0..b * r + a0 + an];
                    for (k, x) in o.iter_mut().enumerate() {
                        *x = v[(a0 + k) * c + b0 + b];
                    }
                }
            }
        });
}

/// f32 values as little-endian f32 bytes: the values themselves on a little-endian machine.
fn f32_le(v: &[f32]) -> std::borrow::Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        // SAFETY: f32 has no padding and every byte pattern is a valid u8; the length is exact.
        std::borrow::Cow::Borrowed(unsafe {
            std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v))
        })
    } else {
        let mut out = Vec::new();
        le_bytes_into(v, false, &mut out);
        std::borrow::Cow::Owned(out)
    }
}

/// f32 values as little-endian f32 or f16 bytes into a reused buffer (rayon over chunks).
fn le_bytes_into(v: &[f32], f16: bool, out: &mut Vec<u8>) {
    use rayon::prelude::*;
    let w = if f16 { 2 } else { 4 };
    out.resize(v.len() * w, 0);
    out.par_chunks_mut(w << 16)
        .zip(v.par_chunks(1 << 16))
        .for_each(|(o, x)| {
            for (d, &s) in o.chunks_exact_mut(w).zip(x) {
                if f16 {
                    d.copy_from_slice(&half::f16::from_f32(s).to_le_bytes());
                } else {
                    d.copy_from_slice(&s.to_le_bytes());
                }
            }
        });
}

struct Emit<'a> {
    data: DataWriter<'a>,
    inits: Vec<TensorProto>,
    nodes: Vec<NodeProto>,
}

impl Emit<'_> {
    /// An initializer; external when large.
    fn init(
        &mut self,
        name: &str,
        dims: &[i64],
        data_type: i32,
        bytes: impl AsRef<[u8]>,
    ) -> Result<()> {
        let bytes = bytes.as_ref();
        let mut t = TensorProto {
            dims: dims.to_vec(),
            data_type,
            name: name.into(),
            ..Default::default()
        };
        if bytes.len() >= EXTERNAL_MIN_BYTES {
            let (f, off) = self.data.put(bytes)?;
            external(&mut t, &f, off, bytes.len());
        } else {
            t.raw_data = bytes.to_vec();
        }
        self.inits.push(t);
        Ok(())
    }
    fn node(&mut self, op: &str, name: &str, ins: &[&str], out: &str, attrs: Vec<AttributeProto>) {
        self.nodes.push(NodeProto {
            input: ins.iter().map(|s| s.to_string()).collect(),
            output: vec![out.into()],
            name: name.into(),
            op_type: op.into(),
            attribute: attrs,
            domain: String::new(),
        });
    }
    /// `scale`/`zero_point` initializers for `e` (scalar for one encoding, [C] per channel).
    fn qparams(&mut self, base: &str, e: &[Encoding]) -> Result<(String, String, i32)> {
        let (elem, _) = onnx_qtype(&e[0])?;
        let dims: Vec<i64> = if e.len() == 1 {
            vec![]
        } else {
            vec![e.len() as i64]
        };
        let sc: Vec<u8> = e
            .iter()
            .flat_map(|x| (x.scale as f32).to_le_bytes())
            .collect();
        let mut zps = Vec::with_capacity(e.len());
        for x in e {
            let (el, zp) = onnx_qtype(x)?;
            if el != elem {
                return Err(Error::Encoding {
                    tensor: base.to_string(),
                    msg: "channels with different storage types".into(),
                });
            }
            zps.push(zp);
        }
        let (s, z) = (format!("{base}.scale"), format!("{base}.zero_point"));
        self.init(&s, &dims, elem::FLOAT, sc)?;
        self.init(&z, &dims, elem, int_bytes(elem, zps.into_iter()))?;
        Ok((s, z, elem))
    }
}

/// Write `<dir>/<stem>.onnx` and its `.data` file(s). Returns the files written (the .onnx first), each
/// `.data` file with the SHA256 computed as it was written.
pub fn write_onnx(
    ck: &Checkpoint,
    g: &Graph,
    dir: &Path,
    o: &ExportOptions,
) -> Result<Vec<(String, Option<String>)>> {
    let stem = o.stem.clone().unwrap_or_else(|| g.name.clone());
    let mut em = Emit {
        data: DataWriter {
            dir,
            stem: stem.clone(),
            files: vec![],
            cur: None,
            off: 0,
            sha256: vec![],
        },
        inits: Vec::new(),
        nodes: Vec::new(),
    };
    let enc = Encs::new(o);
    // Phases: initializers (weights streamed to external data, params stored quantized), activation QDQ on
    // the inputs, the nodes (with their QDQ), then the model proto.
    initializers(&mut em, ck, g, o, &enc)?;
    let reads = input_qdq(&mut em, g, &enc)?;
    nodes(&mut em, g, o, &enc, reads)?;
    let Emit { data, inits, nodes } = em;
    let files = data.finish()?;
    let model = model_proto(g, o, nodes, inits);
    let p = dir.join(format!("{stem}.onnx"));
    let bytes = model.encode_to_vec();
    let mut f = std::fs::File::create(&p).map_err(|e| Error::io(&p, e))?;
    f.write_all(&bytes).map_err(|e| Error::io(&p, e))?;
    f.sync_all().map_err(|e| Error::io(&p, e))?;
    let mut all = vec![(format!("{stem}.onnx"), None)];
    all.extend(files.into_iter().map(|(f, h)| (f, Some(h))));
    Ok(all)
}

/// The encodings by tensor name: activations (first entry) and params (per channel).
struct Encs<'a> {
    acts: HashMap<&'a str, &'a Encoding>,
    params: HashMap<&'a str, &'a Vec<Encoding>>,
    lpbq: HashMap<&'a str, &'a hexq_quantize::lpbq::LpbqEncoding>,
}

impl<'a> Encs<'a> {
    fn new(o: &'a ExportOptions) -> Self {
        let Some(e) = o.qdq else {
            return Encs {
                acts: HashMap::new(),
                params: HashMap::new(),
                lpbq: HashMap::new(),
            };
        };
        Encs {
            acts: e
                .activation_encodings
                .iter()
                .filter_map(|(k, v)| v.first().map(|x| (k.as_str(), x)))
                .collect(),
            params: e
                .param_encodings
                .iter()
                .map(|(k, v)| (k.as_str(), v))
                .collect(),
            lpbq: e
                .lpbq_encodings
                .iter()
                .map(|(k, v)| (k.as_str(), v))
                .collect(),
        }
    }
}

/// Buffers reused across weights: converting into fresh vectors faulted in and zeroed ~15 GB of pages.
#[derive(Default)]
struct Bufs {
    f: Vec<f32>,
    t: Vec<f32>,
    q: Vec<f32>,
    h: Vec<u8>,
}

/// Every initializer: int64 constants, float constants, checkpoint weights (transposed for MatMul views),
/// fake-quantized for a calibration graph, stored quantized + DequantizeLinear for params with encodings,
/// or f16 + Cast.
fn initializers(
    em: &mut Emit,
    ck: &Checkpoint,
    g: &Graph,
    o: &ExportOptions,
    enc: &Encs,
) -> Result<()> {
    let mut b = Bufs::default();
    for i in &g.initializers {
        let dims: Vec<i64> = i.ty.shape.iter().map(|&d| d as i64).collect();
        let mut src_bytes = 0u64;
        let values: &[f32] = match &i.source {
            InitSource::I64(v) => {
                let bytes = v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
                em.init(&i.name, &dims, elem::INT64, bytes)?;
                continue;
            }
            InitSource::F32(v) => v,
            InitSource::Weight { tensor, transpose } => {
                let info = ck.info(tensor)?;
                ck.f32_into(info, &mut b.f);
                ck.store.release(info);
                src_bytes = (info.end - info.start) as u64;
                if *transpose {
                    transpose_into(&b.f, info.shape[0], info.shape[1], &mut b.t);
                    &b.t
                } else {
                    &b.f
                }
            }
        };
        let values = match o.calibration.and_then(|p| p.get(i.name.as_str())) {
            Some(e) => {
                let c = e.len();
                if c != 1 && Some(&c) != i.ty.shape.last() {
                    return Err(Error::Encoding {
                        tensor: i.name.clone(),
                        msg: format!("{c} channel encodings for shape {:?}", i.ty.shape),
                    });
                }
                b.q.clear();
                b.q.extend(
                    values
                        .iter()
                        .enumerate()
                        .map(|(k, &x)| e[k % c].fake_param(x)),
                );
                &b.q[..]
            }
            None => values,
        };
        if let Some(l) = enc.lpbq.get(i.name.as_str()) {
            lpbq_param(em, i, &dims, l, values)?;
        } else if let Some(e) = enc.params.get(i.name.as_str()) {
            quantized_param(em, i, &dims, e, values)?;
        } else if o.weights == WeightType::F16 && matches!(i.source, InitSource::Weight { .. }) {
            let h = format!("{}.f16", i.name);
            le_bytes_into(values, true, &mut b.h);
            em.init(&h, &dims, elem::FLOAT16, &b.h)?;
            let to = vec![attr_i("to", elem::FLOAT as i64)];
            em.node("Cast", &format!("{}.cast", i.name), &[&h], &i.name, to);
        } else {
            em.init(&i.name, &dims, elem::FLOAT, f32_le(values))?;
        }
        if let Some(p) = o.progress {
            p(src_bytes);
        }
    }
    Ok(())
}

/// A param stored as integers on its grid (per channel along the last axis: the output channel of the
/// [in, out] view), read through DequantizeLinear.
fn quantized_param(
    em: &mut Emit,
    i: &Initializer,
    dims: &[i64],
    e: &[Encoding],
    values: &[f32],
) -> Result<()> {
    let qname = format!("{}.quantized", i.name);
    let (s, z, ty) = em.qparams(&i.name, e)?;
    let q: Vec<i64> = if e.len() == 1 {
        values.iter().map(|&x| quant_store(&e[0], x)).collect()
    } else {
        let c = *i.ty.shape.last().unwrap_or(&0);
        if c != e.len() {
            return Err(Error::Encoding {
                tensor: i.name.clone(),
                msg: format!("{} channel encodings for {c} output channels", e.len()),
            });
        }
        values
            .iter()
            .enumerate()
            .map(|(k, &x)| quant_store(&e[k % c], x))
            .collect()
    };
    em.init(&qname, dims, ty, int_bytes(ty, q.into_iter()))?;
    let attrs = if e.len() > 1 {
        vec![attr_i("axis", dims.len() as i64 - 1)]
    } else {
        vec![]
    };
    em.node(
        "DequantizeLinear",
        &format!("{}.dq", i.name),
        &[&qname, &s, &z],
        &i.name,
        attrs,
    );
    Ok(())
}

/// An LPBQ weight as a DequantizeLinear chain: `int_scale` uint8 [in/B, out] → DequantizeLinear(per-channel
/// f32 scale, axis 1) → block scales [in/B, out]; the int4 weight [in, out] → DequantizeLinear on those scales
/// (zero point 0, axis 0, block_size B) → the MatMul.
fn lpbq_param(
    em: &mut Emit,
    i: &Initializer,
    dims: &[i64],
    l: &hexq_quantize::lpbq::LpbqEncoding,
    values: &[f32],
) -> Result<()> {
    let (inn, out) = (i.ty.shape[0], i.ty.shape[1]);
    let nb = inn / l.block_size;
    let n = &i.name;
    // [out, nb] channel-major (AIMET's order) → [nb, out].
    let mut ints = vec![0u8; nb * out];
    for c in 0..out {
        for b in 0..nb {
            ints[b * out + c] = l.per_block_int_scale[c * nb + b] as u8;
        }
    }
    let (iq, cs, cz, bs) = (
        format!("{n}.lpbq_int_scale"),
        format!("{n}.lpbq_channel_scale"),
        format!("{n}.lpbq_int_scale_zero_point"),
        format!("{n}.lpbq_block_scale"),
    );
    em.init(&iq, &[nb as i64, out as i64], elem::UINT8, ints)?;
    let sc: Vec<u8> = l
        .scale
        .iter()
        .flat_map(|&x| (x as f32).to_le_bytes())
        .collect();
    em.init(&cs, &[out as i64], elem::FLOAT, sc)?;
    em.init(&cz, &[out as i64], elem::UINT8, vec![0u8; out])?;
    em.node(
        "DequantizeLinear",
        &format!("{n}.lpbq_scale_dq"),
        &[&iq, &cs, &cz],
        &bs,
        vec![attr_i("axis", 1)],
    );
    // The weight stored as its int4 integers (aimet-onnx's export with prequantize_constants): one
    // consumer of the block scales, so onnxruntime-qnn's fusion takes the chain whole. Integers as quantsim
    // computes them (`round(x / scale')` in f64, [`hexq_quantize::lpbq::Lpbq::fake`]).
    let lp = l.to_lpbq();
    let mut q = vec![0i8; inn * out];
    for r in 0..inn {
        for c in 0..out {
            let s = lp.int_scale[c * nb + r / l.block_size] as f64 * lp.channel_scale[c];
            q[r * out + c] = (values[r * out + c] as f64 / s)
                .round_ties_even()
                .clamp(-8.0, 7.0) as i8;
        }
    }
    let packed: Vec<u8> = q
        .chunks(2)
        .map(|p| (p[0] as u8 & 0xF) | ((p.get(1).copied().unwrap_or(0) as u8 & 0xF) << 4))
        .collect();
    let (wq, wz) = (format!("{n}.quantized"), format!("{n}.lpbq_zero_point"));
    em.init(&wq, dims, elem::INT4, packed)?;
    em.init(
        &wz,
        &[nb as i64, out as i64],
        elem::INT4,
        vec![0u8; (nb * out).div_ceil(2)],
    )?;
    let blk = vec![attr_i("axis", 0), attr_i("block_size", l.block_size as i64)];
    em.node(
        "DequantizeLinear",
        &format!("{n}.dq"),
        &[&wq, &bs, &wz],
        n,
        blk,
    );
    Ok(())
}

/// QuantizeLinear → DequantizeLinear of `t` on its encoding, `src` → `dst`.
fn qdq(em: &mut Emit, t: &str, e: &Encoding, src: &str, dst: &str) -> Result<()> {
    let (s, z, _) = em.qparams(t, std::slice::from_ref(e))?;
    let q = format!("{t}.q");
    em.node(
        "QuantizeLinear",
        &format!("{t}.quantize"),
        &[src, &s, &z],
        &q,
        vec![],
    );
    em.node(
        "DequantizeLinear",
        &format!("{t}.dequantize"),
        &[&q, &s, &z],
        dst,
        vec![],
    );
    Ok(())
}

/// Activation QDQ on the float inputs; returns which tensor each consumer reads instead of an input.
fn input_qdq(em: &mut Emit, g: &Graph, enc: &Encs) -> Result<HashMap<String, String>> {
    let mut reads = HashMap::new();
    for v in &g.inputs {
        if let Some(e) = enc
            .acts
            .get(v.name.as_str())
            .filter(|_| v.ty.dtype.is_float())
        {
            let dq = format!("{}.dq", v.name);
            qdq(em, &v.name, e, &v.name, &dq)?;
            reads.insert(v.name.clone(), dq);
        }
    }
    Ok(reads)
}

/// The graph's nodes in order: ONNX attributes or constant inputs from the op, consumers of an encoded
/// tensor reading its dequantized copy (graph outputs keep their names on the dequantized side).
fn nodes(
    em: &mut Emit,
    g: &Graph,
    o: &ExportOptions,
    enc: &Encs,
    mut reads: HashMap<String, String>,
) -> Result<()> {
    let outputs: HashSet<&str> = g.outputs.iter().map(|v| v.name.as_str()).collect();
    let inits: HashSet<&str> = g.initializers.iter().map(|i| i.name.as_str()).collect();
    let taps = o.calibration.is_some();
    for n in &g.nodes {
        let mut inputs: Vec<String> = n
            .inputs
            .iter()
            .map(|x| reads.get(x).cloned().unwrap_or_else(|| x.clone()))
            .collect();
        let attrs = op_attrs(em, n, &mut inputs)?;
        if taps && n.op == Op::MatMul && inits.contains(inputs[1].as_str()) {
            // A calibration graph reads each weight through a node, as aimet-onnx's (weight → its quantizer →
            // MatMul) does: onnxruntime prepacks a constant MatMul input, and MLAS's prepacked and dynamic
            // sgemm paths sum in different orders (measured: bit-identical to AIMET's forward only this way).
            let d = format!("{}.dynamic", inputs[1]);
            em.node(
                "Identity",
                &format!("{d}.identity"),
                &[&inputs[1]],
                &d,
                vec![],
            );
            inputs[1] = d;
        }
        let out = &n.outputs[0];
        let e = enc
            .acts
            .get(out.as_str())
            .filter(|_| g.types[out].dtype.is_float());
        let written = match e {
            Some(_) if outputs.contains(out.as_str()) => format!("{out}.float"),
            _ => out.clone(),
        };
        let ins: Vec<&str> = inputs.iter().map(|s| s.as_str()).collect();
        em.node(n.op.onnx_name(), &n.name, &ins, &written, attrs);
        if let Some(e) = e {
            if written != *out {
                qdq(em, out, e, &written, out)?;
            } else {
                let dq = format!("{out}.dq");
                qdq(em, out, e, out, &dq)?;
                reads.insert(out.clone(), dq);
            }
        }
    }
    Ok(())
}

/// An op's ONNX attributes; opset-21 ops that take them as inputs get int64 constants appended to `inputs`.
fn op_attrs(em: &mut Emit, n: &Node, inputs: &mut Vec<String>) -> Result<Vec<AttributeProto>> {
    let mut attrs = Vec::new();
    let mut konst = |em: &mut Emit, suffix: &str, v: &[i64]| -> Result<()> {
        let name = format!("{}.{suffix}", n.name);
        let bytes = v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        em.init(&name, &[v.len() as i64], elem::INT64, bytes)?;
        inputs.push(name);
        Ok(())
    };
    match &n.op {
        Op::Mod => attrs.push(attr_i("fmod", 0)),
        Op::ReduceMean { axes, keepdims } => {
            konst(em, "axes", axes)?;
            attrs.push(attr_i("keepdims", *keepdims as i64));
        }
        Op::Softmax { axis } | Op::Concat { axis } | Op::Gather { axis } => {
            attrs.push(attr_i("axis", *axis))
        }
        Op::Reshape { shape } => konst(em, "shape", shape)?,
        Op::Transpose { perm } => {
            let perm: Vec<i64> = perm.iter().map(|&p| p as i64).collect();
            attrs.push(attr_ints("perm", &perm))
        }
        Op::Slice { starts, ends, axes } => {
            konst(em, "starts", starts)?;
            konst(em, "ends", ends)?;
            konst(em, "axes", axes)?;
        }
        Op::Cast { to } => attrs.push(attr_i("to", onnx_dtype(*to) as i64)),
        Op::Expand { shape } => konst(em, "shape", shape)?,
        Op::Unsqueeze { axes } => konst(em, "axes", axes)?,
        _ => {}
    }
    Ok(attrs)
}

/// The model: graph I/O with their docs (a calibration graph also outputs every float tensor), opset 21,
/// IR 10, and the graph's content hash as metadata.
fn model_proto(
    g: &Graph,
    o: &ExportOptions,
    nodes: Vec<NodeProto>,
    inits: Vec<TensorProto>,
) -> ModelProto {
    let taps = o.calibration.is_some();
    let outputs: HashSet<&str> = g.outputs.iter().map(|v| v.name.as_str()).collect();
    let io = |v: &ValueInfo| vinfo(&v.name, v.ty.dtype, &v.ty.shape, &v.doc);
    let tapped = g
        .nodes
        .iter()
        .map(|n| &n.outputs[0])
        .filter(|t| taps && g.types[*t].dtype.is_float() && !outputs.contains(t.as_str()))
        .map(|t| vinfo(t, g.types[t].dtype, &g.types[t].shape, ""));
    let graph = GraphProto {
        node: nodes,
        name: g.name.clone(),
        initializer: inits,
        doc_string: format!(
            "hexq {} graph{}; I/O contract in io-contract.json",
            g.name,
            if o.qdq.is_some() { " (QDQ)" } else { "" }
        ),
        input: g.inputs.iter().map(io).collect(),
        output: g.outputs.iter().map(io).chain(tapped).collect(),
        value_info: vec![],
    };
    ModelProto {
        ir_version: IR_VERSION,
        producer_name: "hexq".into(),
        producer_version: env!("CARGO_PKG_VERSION").into(),
        doc_string: String::new(),
        graph: Some(graph),
        opset_import: vec![OperatorSetIdProto {
            domain: String::new(),
            version: OPSET,
        }],
        metadata_props: vec![StringStringEntryProto {
            key: "hexq.graph_sha256".into(),
            value: g.content_hash(),
        }],
    }
}
