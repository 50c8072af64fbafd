//! Backend `ort`: exported ONNX graphs run by onnxruntime (the `ort` crate, C API loaded at run time from
//! the PyPI wheel's libonnxruntime.so), driven by the same host loop as the interpreter: host-model/
//! lookups in, `hidden_states` out, `present_*` values handed straight back as `past_*` (no copy through
//! host vectors), prompts through `trunk` in SEQ-token chunks when a trunk export is given.

use crate::host::HostFiles;
use crate::{Backend, Result};
use hexq_model::Error;
use ort::session::Session;
use ort::value::{DynValue, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

fn oe(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Msg(format!("onnxruntime: {what}: {e}"))
}

/// libonnxruntime.so: `$ORT_DYLIB_PATH`, else the one inside the `onnxruntime` Python package.
pub fn find_onnxruntime() -> Result<PathBuf> {
    if let Ok(p) = std::env::var("ORT_DYLIB_PATH") {
        return Ok(PathBuf::from(p));
    }
    let o = std::process::Command::new("python3")
        .args(["-c", "import onnxruntime, os, glob; d = os.path.join(os.path.dirname(onnxruntime.__file__), 'capi'); print(sorted(glob.glob(os.path.join(d, 'libonnxruntime.so*')))[0])"])
        .output()
        .map_err(|e| Error::Msg(format!("looking for onnxruntime with python3: {e}")))?;
    if !o.status.success() {
        return Err(Error::Msg(format!(
            "libonnxruntime.so not found: set ORT_DYLIB_PATH or `pip install onnxruntime` ({})",
            String::from_utf8_lossy(&o.stderr)
                .lines()
                .last()
                .unwrap_or("")
        )));
    }
    Ok(PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()))
}

/// Load onnxruntime once per process; its environment.
pub fn init() -> Result<&'static ort::environment::Environment> {
    static INIT: std::sync::OnceLock<std::result::Result<ort::environment::Environment, String>> =
        std::sync::OnceLock::new();
    INIT.get_or_init(|| {
        let p = find_onnxruntime().map_err(|e| e.to_string())?;
        let b = ort::init_from(&p).map_err(|e| format!("loading {}: {e}", p.display()))?;
        b.with_name("hexq")
            .build()
            .map_err(|e| format!("onnxruntime environment: {e}"))
    })
    .as_ref()
    .map_err(|e| Error::Msg(e.clone()))
}

pub struct Graph {
    pub session: Session,
    pub name: String,
    /// (name, shape) of every input.
    pub inputs: Vec<(String, Vec<usize>)>,
}

impl Graph {
    pub fn load(onnx: &Path, threads: usize) -> Result<Self> {
        let env = init()?;
        let mut b = Session::builder(env).map_err(|e| oe("session builder", e))?;
        if threads > 0 {
            b = b
                .with_intra_threads(threads)
                .map_err(|e| oe("threads", e))?;
        }
        let session = b
            .commit_from_file(onnx)
            .map_err(|e| oe(&format!("loading {}", onnx.display()), e))?;
        let inputs = session
            .inputs()
            .iter()
            .map(|i| {
                let shape = i
                    .dtype()
                    .tensor_shape()
                    .map(|s| s.iter().map(|&d| d.max(0) as usize).collect())
                    .unwrap_or_default();
                (i.name().to_string(), shape)
            })
            .collect();
        let name = onnx.file_stem().unwrap().to_string_lossy().to_string();
        Ok(Graph {
            session,
            name,
            inputs,
        })
    }
}

pub struct OrtBackend {
    pub host: HostFiles,
    pub decode: Graph,
    pub trunk: Option<Graph>,
    kv: HashMap<String, DynValue>,
    pub pos: usize,
    pub context: usize,
    pub last_hidden: Vec<f32>,
    /// Sessions created (graphs load once per backend, not per step).
    pub sessions_created: usize,
}

/// The .onnx of an export directory (its manifest's variant).
pub fn graph_in(dir: &Path) -> Result<(String, PathBuf)> {
    let mp = dir.join("manifest.json");
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&mp).map_err(|e| Error::io(&mp, e))?)
            .map_err(|e| Error::file(&mp, format!("invalid JSON: {e}")))?;
    let v = m["variant"]
        .as_str()
        .ok_or_else(|| Error::file(&mp, "no \"variant\""))?
        .to_string();
    let p = dir.join(format!("{v}.onnx"));
    if !p.exists() {
        return Err(Error::file(&p, "missing (the manifest names it)"));
    }
    Ok((v, p))
}

impl OrtBackend {
    /// From export directories: one decode variant, optionally a trunk; host-model/ from the first that has one.
    pub fn open(dirs: &[PathBuf], threads: usize) -> Result<Self> {
        let (mut decode, mut trunk, mut host) = (None, None, None);
        for d in dirs {
            let (v, p) = graph_in(d)?;
            if v == "trunk" {
                trunk = Some(Graph::load(&p, threads)?);
            } else if decode.is_none() {
                decode = Some(Graph::load(&p, threads)?);
            } else {
                return Err(Error::file(
                    d,
                    "a second decode graph (give one decode export and at most one trunk)",
                ));
            }
            if host.is_none() && d.join("host-model").is_dir() {
                host = Some(HostFiles::open(&d.join("host-model"))?);
            }
        }
        let decode =
            decode.ok_or_else(|| Error::Msg("no decode export among --artifacts".into()))?;
        let host =
            host.ok_or_else(|| Error::Msg("no host-model/ in the --artifacts directories".into()))?;
        let context = decode
            .inputs
            .iter()
            .filter(|(n, _)| n.starts_with("past_key_"))
            .map(|(_, s)| s[2])
            .max()
            .unwrap_or(usize::MAX);
        let n = 1 + trunk.is_some() as usize;
        let mut b = OrtBackend {
            host,
            decode,
            trunk,
            kv: HashMap::new(),
            pos: 0,
            context,
            last_hidden: vec![],
            sessions_created: n,
        };
        b.reset();
        Ok(b)
    }

    fn inputs(&mut self, ids: &[u32], s: usize, trunk: bool) -> Result<Vec<(String, DynValue)>> {
        let (h, l, p) = (
            self.host.cfg.hidden_size,
            self.host.cfg.num_layers,
            self.host.cfg.ple_dim,
        );
        let mut e = Vec::with_capacity(s * h);
        let mut pl = Vec::with_capacity(s * l * p);
        for j in 0..s {
            let id = ids.get(j).copied().unwrap_or(self.host.cfg.pad_token_id);
            e.extend(self.host.embed(id)?);
            pl.extend(self.host.ple(id)?);
        }
        let t = |shape: Vec<usize>, v: Vec<f32>| -> Result<DynValue> {
            Ok(Tensor::from_array((shape, v))
                .map_err(|e| oe("tensor", e))?
                .into_dyn())
        };
        let ti = |shape: Vec<usize>, v: Vec<i32>| -> Result<DynValue> {
            Ok(Tensor::from_array((shape, v))
                .map_err(|e| oe("tensor", e))?
                .into_dyn())
        };
        let mut v = vec![("inputs_embeds".to_string(), t(vec![1, s, h], e)?)];
        if p > 0 {
            v.push(("per_layer_inputs".into(), t(vec![1, s, l, p], pl)?));
        }
        // Padding positions continue the sequence (clamped); their outputs are ignored.
        let pos: Vec<i32> = (0..s)
            .map(|j| (self.pos + j).min(self.context - 1) as i32)
            .collect();
        v.push(("position_ids".into(), ti(vec![1, s], pos)?));
        if trunk {
            v.push(("valid_len".into(), ti(vec![1], vec![ids.len() as i32])?));
        } else {
            v.push(("cache_position".into(), ti(vec![1], vec![self.pos as i32])?));
        }
        Ok(v)
    }

    fn run(&mut self, trunk: bool, ins: Vec<(String, DynValue)>) -> Result<Vec<f32>> {
        let g = if trunk {
            self.trunk.as_mut().unwrap()
        } else {
            &mut self.decode
        };
        let mut all: Vec<(String, ort::session::SessionInputValue)> =
            ins.into_iter().map(|(k, v)| (k, v.into())).collect();
        for (n, _) in g.inputs.iter().filter(|(n, _)| n.starts_with("past_")) {
            let v = self
                .kv
                .get(n)
                .ok_or_else(|| Error::Msg(format!("no KV buffer {n}")))?;
            all.push((n.clone(), v.into()));
        }
        let mut out = g
            .session
            .run(all)
            .map_err(|e| oe(&format!("running {}", g.name), e))?;
        let hidden = out
            .remove("hidden_states")
            .ok_or_else(|| Error::Msg(format!("{}: no hidden_states output", g.name)))?;
        let (_, h) = hidden
            .try_extract_tensor::<f32>()
            .map_err(|e| oe("hidden_states", e))?;
        let h = h.to_vec();
        let names: Vec<String> = self.kv.keys().cloned().collect();
        for n in names {
            let present = format!("present_{}", &n["past_".len()..]);
            let v = out
                .remove(&present)
                .ok_or_else(|| Error::Msg(format!("{}: no {present} output", g.name)))?;
            self.kv.insert(n, v);
        }
        Ok(h)
    }

    /// One token through the decode graph; returns the final hidden state [H].
    pub fn step(&mut self, id: u32) -> Result<Vec<f32>> {
        if self.pos + 1 > self.context {
            return Err(Error::Msg(format!("context full at position {}", self.pos)));
        }
        let ins = self.inputs(&[id], 1, false)?;
        let h = self.run(false, ins)?;
        self.pos += 1;
        Ok(h)
    }

    /// Up to SEQ tokens through the trunk; hidden states of the real tokens.
    pub fn chunk(&mut self, ids: &[u32]) -> Result<Vec<Vec<f32>>> {
        let seq = self
            .trunk
            .as_ref()
            .unwrap()
            .inputs
            .iter()
            .find(|(n, _)| n == "inputs_embeds")
            .unwrap()
            .1[1];
        if self.pos + ids.len() > self.context {
            return Err(Error::Msg(format!("context full at position {}", self.pos)));
        }
        let ins = self.inputs(ids, seq, true)?;
        let h = self.run(true, ins)?;
        self.pos += ids.len();
        let hs = self.host.cfg.hidden_size;
        Ok(h.chunks(hs).take(ids.len()).map(|c| c.to_vec()).collect())
    }

    /// Hidden states of every position of `ids`.
    pub fn hidden(&mut self, ids: &[u32]) -> Result<Vec<Vec<f32>>> {
        let mut out = Vec::new();
        if let Some(t) = &self.trunk {
            let seq = t
                .inputs
                .iter()
                .find(|(n, _)| n == "inputs_embeds")
                .unwrap()
                .1[1];
            for c in ids.chunks(seq) {
                out.extend(self.chunk(c)?);
            }
        } else {
            for &id in ids {
                out.push(self.step(id)?);
            }
        }
        Ok(out)
    }
}

impl Backend for OrtBackend {
    fn name(&self) -> &str {
        "ort"
    }
    fn reset(&mut self) {
        self.kv.clear();
        for (n, s) in self
            .decode
            .inputs
            .iter()
            .filter(|(n, _)| n.starts_with("past_"))
        {
            let z = vec![0f32; s.iter().product()];
            self.kv.insert(
                n.clone(),
                Tensor::from_array((s.clone(), z)).unwrap().into_dyn(),
            );
        }
        self.pos = 0;
    }
    fn feed(&mut self, ids: &[u32]) -> Result<Vec<f32>> {
        let h = if ids.len() > 1 && self.trunk.is_some() {
            self.hidden(ids)?.pop().unwrap()
        } else {
            let mut last = vec![];
            for &id in ids {
                last = self.step(id)?;
            }
            last
        };
        self.last_hidden = h.clone();
        self.host.logits(&h)
    }
}
