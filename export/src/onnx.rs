//! ONNX writer: the graph IR node for node (same tensor names, so encodings line up), opset 21, IR version
//! 10, weights streamed from the safetensors mmap into external-data files at 4 KiB-aligned offsets (no
//! file near protobuf's 2 GB limit, no model in memory: one tensor at a time).

use crate::onnx_proto::*;
use hexq_model::graph::ir::{DType, Graph, InitSource, Op, OPSET};
use hexq_model::{Checkpoint, Error, Result};
use prost::Message;
use std::io::Write;
use std::path::Path;

pub const IR_VERSION: i64 = 10;
const ALIGN: u64 = 4096;
/// Start a new .data file past this many bytes.
const MAX_DATA_FILE: u64 = 1 << 30;
/// Float constants at least this large go to external data.
const EXTERNAL_MIN_BYTES: usize = 4096;

pub fn onnx_dtype(d: DType) -> i32 {
    match d {
        DType::F32 => 1,
        DType::I32 => 6,
        DType::I64 => 7,
        DType::Bool => 9,
        DType::F16 => 10,
        DType::BF16 => 16,
    }
}

fn attr_i(name: &str, v: i64) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        i: v,
        r#type: 2,
        ..Default::default()
    }
}
fn attr_ints(name: &str, v: &[i64]) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        ints: v.to_vec(),
        r#type: 7,
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

fn i64_tensor(name: &str, v: &[i64]) -> TensorProto {
    TensorProto {
        dims: vec![v.len() as i64],
        data_type: 7,
        name: name.into(),
        raw_data: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ..Default::default()
    }
}

pub struct ExportOptions {
    /// Store weights as f16 instead of f32.
    pub f16_weights: bool,
}

struct DataWriter<'a> {
    dir: &'a Path,
    stem: String,
    files: Vec<String>,
    cur: Option<std::io::BufWriter<std::fs::File>>,
    off: u64,
}

impl DataWriter<'_> {
    fn put(&mut self, bytes: &[u8]) -> Result<(String, u64)> {
        if self.cur.is_none() || (self.off > 0 && self.off + bytes.len() as u64 > MAX_DATA_FILE) {
            if let Some(mut w) = self.cur.take() {
                w.flush().map_err(|e| Error::io(self.dir, e))?;
            }
            let name = if self.files.is_empty() {
                format!("{}.data", self.stem)
            } else {
                format!("{}.{}.data", self.stem, self.files.len())
            };
            let p = self.dir.join(&name);
            self.cur = Some(std::io::BufWriter::with_capacity(
                8 << 20,
                std::fs::File::create(&p).map_err(|e| Error::io(&p, e))?,
            ));
            self.files.push(name);
            self.off = 0;
        }
        let w = self.cur.as_mut().unwrap();
        let pad = (ALIGN - self.off % ALIGN) % ALIGN;
        let p = self.dir.join(self.files.last().unwrap());
        w.write_all(&vec![0u8; pad as usize])
            .map_err(|e| Error::io(&p, e))?;
        self.off += pad;
        let at = self.off;
        w.write_all(bytes).map_err(|e| Error::io(&p, e))?;
        self.off += bytes.len() as u64;
        Ok((self.files.last().unwrap().clone(), at))
    }
    fn finish(mut self) -> Result<Vec<String>> {
        if let Some(mut w) = self.cur.take() {
            w.flush().map_err(|e| Error::io(self.dir, e))?;
            w.into_inner()
                .map_err(|e| Error::io(self.dir, e.into_error()))?
                .sync_all()
                .map_err(|e| Error::io(self.dir, e))?;
        }
        Ok(self.files)
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

/// Write `<dir>/<graph.name>.onnx` and its `.data` file(s). Returns the files written.
pub fn write_onnx(
    ck: &Checkpoint,
    g: &Graph,
    dir: &Path,
    o: &ExportOptions,
) -> Result<Vec<String>> {
    if o.f16_weights {
        return Err(Error::Msg(
            "f16 weights need Cast nodes in the IR (not yet): export f32".into(),
        ));
    }
    let mut data = DataWriter {
        dir,
        stem: g.name.clone(),
        files: vec![],
        cur: None,
        off: 0,
    };
    let mut inits = Vec::new();
    for i in &g.initializers {
        let dims: Vec<i64> = i.ty.shape.iter().map(|&d| d as i64).collect();
        let mut t = TensorProto {
            dims,
            name: i.name.clone(),
            ..Default::default()
        };
        match &i.source {
            InitSource::I64(v) => {
                t.data_type = 7;
                t.raw_data = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            }
            InitSource::F32(v) => {
                t.data_type = 1;
                let b: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                if b.len() >= EXTERNAL_MIN_BYTES {
                    let (f, off) = data.put(&b)?;
                    external(&mut t, &f, off, b.len());
                } else {
                    t.raw_data = b;
                }
            }
            InitSource::Weight { tensor, transpose } => {
                let info = ck.info(tensor)?;
                let v = ck.store.to_f32(info);
                let v = if *transpose {
                    let (r, c) = (info.shape[0], info.shape[1]);
                    let mut out = vec![0f32; v.len()];
                    for a in 0..r {
                        for b in 0..c {
                            out[b * r + a] = v[a * c + b];
                        }
                    }
                    out
                } else {
                    v
                };
                let b: Vec<u8> = if o.f16_weights {
                    t.data_type = 10;
                    v.iter()
                        .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
                        .collect()
                } else {
                    t.data_type = 1;
                    v.iter().flat_map(|x| x.to_le_bytes()).collect()
                };
                let (f, off) = data.put(&b)?;
                external(&mut t, &f, off, b.len());
            }
        }
        inits.push(t);
    }
    let mut nodes = Vec::new();
    for n in &g.nodes {
        let mut inputs = n.inputs.clone();
        let mut attrs = Vec::new();
        let mut konst = |suffix: &str, v: &[i64], inputs: &mut Vec<String>| {
            let name = format!("{}.{suffix}", n.name);
            inits.push(i64_tensor(&name, v));
            inputs.push(name);
        };
        match &n.op {
            Op::Mod => attrs.push(attr_i("fmod", 0)),
            Op::ReduceMean { axes, keepdims } => {
                konst("axes", axes, &mut inputs);
                attrs.push(attr_i("keepdims", *keepdims as i64));
            }
            Op::Softmax { axis } | Op::Concat { axis } | Op::Gather { axis } => {
                attrs.push(attr_i("axis", *axis))
            }
            Op::Reshape { shape } => konst("shape", shape, &mut inputs),
            Op::Transpose { perm } => attrs.push(attr_ints(
                "perm",
                &perm.iter().map(|&p| p as i64).collect::<Vec<_>>(),
            )),
            Op::Slice { starts, ends, axes } => {
                konst("starts", starts, &mut inputs);
                konst("ends", ends, &mut inputs);
                konst("axes", axes, &mut inputs);
            }
            Op::Cast { to } => attrs.push(attr_i("to", onnx_dtype(*to) as i64)),
            Op::Expand { shape } => konst("shape", shape, &mut inputs),
            Op::Unsqueeze { axes } => konst("axes", axes, &mut inputs),
            _ => {}
        }
        nodes.push(NodeProto {
            input: inputs,
            output: n.outputs.clone(),
            name: n.name.clone(),
            op_type: n.op.onnx_name().into(),
            attribute: attrs,
            domain: String::new(),
        });
    }
    let files = data.finish()?;
    let graph = GraphProto {
        node: nodes,
        name: g.name.clone(),
        initializer: inits,
        doc_string: format!("hexq {} graph; I/O contract in docs/io-contract.md", g.name),
        input: g
            .inputs
            .iter()
            .map(|v| vinfo(&v.name, v.ty.dtype, &v.ty.shape, &v.doc))
            .collect(),
        output: g
            .outputs
            .iter()
            .map(|v| vinfo(&v.name, v.ty.dtype, &v.ty.shape, &v.doc))
            .collect(),
        value_info: vec![],
    };
    let model = ModelProto {
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
    };
    let p = dir.join(format!("{}.onnx", g.name));
    std::fs::write(&p, model.encode_to_vec()).map_err(|e| Error::io(&p, e))?;
    let mut all = vec![format!("{}.onnx", g.name)];
    all.extend(files);
    Ok(all)
}
