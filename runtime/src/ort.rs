//! Backends `ort` and `qnn`: exported ONNX graphs run by onnxruntime (the `ort` crate, C API loaded at run
//! time from the PyPI wheel's libonnxruntime.so), driven by the same host loop as the interpreter: host-model/
//! lookups in, `hidden_states` out. `qnn` is the same loop over the compiled EPContext graph with the QNN
//! execution provider (onnxruntime-qnn's plugin library; QNN HTP backend, the simulator on x86-64): the context
//! binary is loaded once per backend, every node on HTP (CPU fallback disabled).
//!
//! KV stays resident: each `past_*`/`present_*` pair is two buffers allocated once and bound with IoBinding,
//! ping-ponged between steps (step t reads A and writes B, step t+1 reads B and writes A) — no per-step
//! allocation and no copy through host vectors. Prompts go through `trunk` in SEQ-token chunks when one is given.

use crate::host::HostFiles;
use crate::Error;
use crate::{Backend, Result};
use ort::session::Session;
use ort::value::{DynValue, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

fn oe(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Ort {
        what: what.into(),
        msg: e.to_string(),
    }
}

/// libonnxruntime.so: `$ORT_DYLIB_PATH`, else the one inside the `onnxruntime` Python package.
pub fn find_onnxruntime() -> Result<PathBuf> {
    if let Ok(p) = std::env::var("ORT_DYLIB_PATH") {
        return Ok(PathBuf::from(p));
    }
    let script = "import onnxruntime, os, glob; d = os.path.join(os.path.dirname(onnxruntime.__file__), 'capi'); print(sorted(glob.glob(os.path.join(d, 'libonnxruntime.so*')))[0])";
    let out = python_probe(
        script,
        1,
        "libonnxruntime.so",
        "set ORT_DYLIB_PATH or `pip install onnxruntime`",
    )?;
    Ok(PathBuf::from(&out[0]))
}

/// Run a python3 one-liner that prints `lines` lines; a missing interpreter or package is [`Error::Missing`]
/// naming `tool` with `hint` and python's last stderr line.
fn python_probe(
    script: &str,
    lines: usize,
    tool: &'static str,
    hint: &'static str,
) -> Result<Vec<String>> {
    let missing = |detail: String| Error::Missing { tool, hint, detail };
    let o = std::process::Command::new("python3")
        .args(["-c", script])
        .output()
        .map_err(|e| missing(format!("running python3: {e}")))?;
    let out: Vec<String> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| l.trim().to_string())
        .collect();
    if !o.status.success() || out.len() != lines {
        let err = String::from_utf8_lossy(&o.stderr);
        return Err(missing(err.lines().last().unwrap_or("").into()));
    }
    Ok(out)
}

/// QNN contexts the QNN EP reported loading (counted only with HEXQ_COUNT_QNN_CONTEXTS set).
pub static QNN_CONTEXT_LOADS: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(0);

/// Load onnxruntime once per process; its environment.
pub fn init() -> Result<&'static ort::environment::Environment> {
    static INIT: std::sync::OnceLock<std::result::Result<ort::environment::Environment, String>> =
        std::sync::OnceLock::new();
    INIT.get_or_init(|| {
        let p = find_onnxruntime().map_err(|e| e.to_string())?;
        let mut b = ort::init_from(&p)
            .map_err(|e| format!("loading {}: {e}", p.display()))?
            .with_name("hexq");
        let count = std::env::var_os("HEXQ_COUNT_QNN_CONTEXTS").is_some();
        if count {
            // Count the QNN EP's own "context loaded" log lines: an independent check that the binary is
            // loaded once per run (tests/qnn.rs). Needs verbose logging; warnings and errors still go to stderr.
            b = b.with_logger(std::sync::Arc::new(
                |level: ort::logging::LogLevel, _c: &str, _id: &str, loc: &str, msg: &str| {
                    if msg.contains("Load from cached QNN Context completed") {
                        QNN_CONTEXT_LOADS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    }
                    if matches!(
                        level,
                        ort::logging::LogLevel::Warning
                            | ort::logging::LogLevel::Error
                            | ort::logging::LogLevel::Fatal
                    ) {
                        eprintln!("onnxruntime {loc}: {msg}");
                    }
                },
            ));
        }
        let env = b
            .build()
            .map_err(|e| format!("onnxruntime environment: {e}"))?;
        if count {
            env.set_log_level(ort::logging::LogLevel::Verbose);
        }
        Ok(env)
    })
    .as_ref()
    .map_err(|e| Error::Unsupported(e.clone()))
}

/// Where a graph runs.
#[derive(Clone, Debug, PartialEq)]
pub enum Ep {
    Cpu,
    /// QNN HTP through onnxruntime-qnn; the target (v75, v79, v81) picks the compiled binary.
    Qnn {
        target: String,
    },
}

/// onnxruntime-qnn's files: the plugin EP library and the QNN HTP backend.
pub struct QnnLibs {
    pub ep_name: String,
    pub ep_lib: PathBuf,
    pub htp: PathBuf,
}

/// `$HEXQ_QNN_EP_LIB` + `$HEXQ_QNN_BACKEND` (e.g. a device's libQnnHtp.so), else the `onnxruntime_qnn` wheel.
pub fn find_qnn() -> Result<QnnLibs> {
    if let (Ok(l), Ok(b)) = (
        std::env::var("HEXQ_QNN_EP_LIB"),
        std::env::var("HEXQ_QNN_BACKEND"),
    ) {
        return Ok(QnnLibs {
            ep_name: "QNNExecutionProvider".into(),
            ep_lib: l.into(),
            htp: b.into(),
        });
    }
    let script = "import onnxruntime_qnn as q; print(q.EP_NAME); print(q.get_library_path()); print(q.get_qnn_htp_path())";
    let hint = "`pip install onnxruntime-qnn` (or set HEXQ_QNN_EP_LIB and HEXQ_QNN_BACKEND)";
    let l = python_probe(script, 3, "the QNN HTP backend", hint)?;
    Ok(QnnLibs {
        ep_name: l[0].clone(),
        ep_lib: (&l[1]).into(),
        htp: (&l[2]).into(),
    })
}

/// Register the QNN plugin EP with the process's environment once.
fn qnn() -> Result<&'static QnnLibs> {
    static Q: std::sync::OnceLock<std::result::Result<QnnLibs, String>> =
        std::sync::OnceLock::new();
    Q.get_or_init(|| {
        let env = init().map_err(|e| e.to_string())?;
        let q = find_qnn().map_err(|e| e.to_string())?;
        env.register_ep_library(q.ep_name.clone(), &q.ep_lib)
            .map_err(|e| format!("registering {}: {e}", q.ep_lib.display()))?;
        Ok(q)
    })
    .as_ref()
    .map_err(|e| Error::Unsupported(e.clone()))
}

/// The HTP arch number of a target name ("v79" → 79).
pub fn htp_arch(target: &str) -> Result<u32> {
    target
        .strip_prefix('v')
        .and_then(|n| n.parse().ok())
        .filter(|n| [73, 75, 79, 81].contains(n))
        .ok_or_else(|| {
            Error::Unsupported(format!(
                "unknown HTP target {target:?} (v73, v75, v79, v81)"
            ))
        })
}

pub struct Graph {
    pub session: Session,
    pub name: String,
    /// (name, shape) of every input.
    pub inputs: Vec<(String, Vec<usize>)>,
    /// Every output name.
    pub outputs: Vec<String>,
}

impl Graph {
    /// `optimize`: onnxruntime's graph rewrites; off for QDQ graphs, whose fused QDQ kernels change the
    /// arithmetic (measured: one MatMul 86 int16 steps from DequantizeLinear→MatMul→QuantizeLinear).
    /// `share`: the graph is one of several in a shared QNN context binary (`hexq compile --out`): the
    /// sessions share one loaded context (`ep.share_ep_contexts`) instead of loading the binary each.
    pub fn load(onnx: &Path, threads: usize, ep: &Ep, optimize: bool, share: bool) -> Result<Self> {
        let env = init()?;
        let mut b = Session::builder(env).map_err(|e| oe("session builder", e))?;
        if threads > 0 {
            b = b
                .with_intra_threads(threads)
                .map_err(|e| oe("threads", e))?;
        }
        if !optimize {
            b = b
                .with_optimization_level(ort::session::builder::GraphOptimizationLevel::Disable)
                .map_err(|e| oe("optimization level", e))?;
        }
        if let Ep::Qnn { target } = ep {
            let q = qnn()?;
            let arch = htp_arch(target)?.to_string();
            let devs: Vec<_> = env
                .devices()
                .filter(|d| d.ep().map(|n| n == q.ep_name).unwrap_or(false))
                .take(1)
                .collect();
            if devs.is_empty() {
                return Err(Error::Unsupported(format!(
                    "no {} device after registering {}",
                    q.ep_name,
                    q.ep_lib.display()
                )));
            }
            let p = |k: &str| format!("{}.{k}", q.ep_name);
            let opts = vec![
                (p("backend_path"), q.htp.to_string_lossy().to_string()),
                (p("htp_arch"), arch),
            ];
            if share {
                b = b
                    .with_config_entry("ep.share_ep_contexts", "1")
                    .map_err(|e| oe("config", e))?;
            }
            b = b
                .with_config_entry("session.disable_cpu_ep_fallback", "1")
                .map_err(|e| oe("config", e))?
                .with_devices(devs, Some(&opts))
                .map_err(|e| oe("QNN execution provider", e))?;
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
        let outputs = session
            .outputs()
            .iter()
            .map(|o| o.name().to_string())
            .collect();
        let name = onnx.file_stem().unwrap().to_string_lossy().to_string();
        Ok(Graph {
            session,
            name,
            inputs,
            outputs,
        })
    }
}

/// One KV tensor's two resident buffers; `cur` is the one the next step reads.
struct KvPair {
    bufs: [Tensor<f32>; 2],
    cur: usize,
}

pub struct OrtBackend {
    pub host: HostFiles,
    /// None for a trunk-only backend (then single tokens go through the trunk too).
    pub decode: Option<Graph>,
    pub trunk: Option<Graph>,
    pub ep: Ep,
    kv: std::collections::BTreeMap<String, KvPair>,
    hidden: HashMap<bool, Tensor<f32>>,
    pub pos: usize,
    pub context: usize,
    pub last_hidden: Vec<f32>,
    /// Sessions created (graphs load once per backend, not per step).
    pub sessions_created: usize,
    /// For `qnn`: QNN contexts loaded — one per binary, so one for a shared prefill+decode build.
    pub contexts: usize,
    /// KV buffers allocated over the backend's life (2 per KV tensor: allocated once, reused every step).
    pub kv_buffers_allocated: usize,
    pub steps: usize,
    /// When set, every run's inputs are recorded as raw little-endian bytes (QAIRT's --input_list files).
    pub capture: Option<Vec<Vec<(String, Vec<u8>)>>>,
    /// When set, sees every float input and every float output of every run (a graph exported with taps has
    /// every node output among its outputs): calibration on onnxruntime's arithmetic.
    pub taps: Option<Box<dyn hexq_graph::interp::Hook + Send>>,
}

/// Hand one onnxruntime f32 value to a hook (as a candle tensor, the interpreter's currency).
fn tap(
    hook: &mut dyn hexq_graph::interp::Hook,
    name: &str,
    shape: &[i64],
    x: &[f32],
) -> Result<()> {
    let dims: Vec<usize> = shape.iter().map(|&d| d.max(0) as usize).collect();
    let t = candle_core::Tensor::from_slice(x, dims.as_slice(), &candle_core::Device::Cpu)?;
    hook.tensor(name, &t);
    Ok(())
}

/// A export directory's manifest.
pub fn manifest(dir: &Path) -> Result<serde_json::Value> {
    let mp = dir.join("manifest.json");
    serde_json::from_str(&std::fs::read_to_string(&mp).map_err(|e| Error::io(&mp, e))?)
        .map_err(|e| Error::file(&mp, format!("invalid JSON: {e}")))
}

/// The .onnx of an export directory (its manifest's variant).
pub fn graph_in(dir: &Path) -> Result<(String, PathBuf)> {
    let m = manifest(dir)?;
    let mp = dir.join("manifest.json");
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

/// The graph a directory runs on `ep`: the export's .onnx (cpu), or the EPContext .onnx `hexq compile` wrote
/// for the target (qnn). Returns (variant, path, optimize).
pub fn graph_for(dir: &Path, ep: &Ep) -> Result<(String, PathBuf, bool)> {
    let (v, p) = graph_in(dir)?;
    let m = manifest(dir)?;
    let qdq = m["graph"]["qdq"].as_bool().unwrap_or(false);
    // A calibration graph runs as written (no fusions): aimet-onnx's own forward has none across its
    // quantizer nodes, and the ranges must be its arithmetic.
    let calibration = m["graph"]["calibration"].as_bool().unwrap_or(false);
    match ep {
        Ep::Cpu => Ok((v, p, !qdq && !calibration)),
        Ep::Qnn { target } => {
            let c = m["compiled"]
                .as_array()
                .and_then(|a| a.iter().find(|c| c["target"] == target.as_str()))
                .ok_or_else(|| {
                    Error::file(
                        &dir.join("manifest.json"),
                        format!("no {v} binary compiled for {target}: run `hexq compile --artifacts {} --target {target}`", dir.display()),
                    )
                })?;
            let p = dir.join(c["onnx"].as_str().unwrap_or_default());
            if !p.exists() || !dir.join(c["bin"].as_str().unwrap_or_default()).exists() {
                return Err(Error::file(
                    &p,
                    "missing (the manifest lists it as compiled)",
                ));
            }
            Ok((v, p, true))
        }
    }
}

/// Every graph a directory runs on `ep`: one for an export ([`graph_for`]); both for a shared-context build
/// (`hexq compile --artifacts D --artifacts T --out B`), whose EPContext graphs share one binary per target.
/// Returns (variant, path, optimize, shared).
pub fn graphs_for(dir: &Path, ep: &Ep) -> Result<Vec<(String, PathBuf, bool, bool)>> {
    let m = manifest(dir)?;
    if m["kind"] != "shared-context" {
        let (v, p, o) = graph_for(dir, ep)?;
        return Ok(vec![(v, p, o, false)]);
    }
    let mp = dir.join("manifest.json");
    let Ep::Qnn { target } = ep else {
        return Err(Error::file(
            &mp,
            "a shared-context build holds compiled binaries only: run it with --backend qnn",
        ));
    };
    let c = m["compiled"]
        .as_array()
        .and_then(|a| a.iter().find(|c| c["target"] == target.as_str()))
        .ok_or_else(|| Error::file(&mp, format!("no binary for {target} in this build")))?;
    // Measured with onnxruntime-qnn 2.7.0: the x86-64 HTP simulator segfaults deserializing a weight-shared
    // context (even one graph of it, with or without ep.share_ep_contexts); onnxruntime-qnn's own tests
    // (qnn_ep_context_test.cc, QnnContextShareAcrossSessions) load such binaries only on aarch64 devices.
    if cfg!(target_arch = "x86_64") && std::env::var_os("HEXQ_QNN_LOAD_SHARED").is_none() {
        return Err(Error::Unsupported(format!(
            "{}: a weight-shared context binary loads on the device (aarch64) only — onnxruntime-qnn's x86-64 HTP simulator crashes deserializing one; on this host run the per-graph binaries (`hexq compile` each export, then --artifacts DECODE --artifacts TRUNK), or set HEXQ_QNN_LOAD_SHARED=1 to try",
            dir.display()
        )));
    }
    if !dir.join(c["bin"].as_str().unwrap_or_default()).exists() {
        return Err(Error::file(&mp, format!("{} is missing", c["bin"])));
    }
    let mut out = Vec::new();
    for g in c["graphs"].as_array().into_iter().flatten() {
        let p = dir.join(g["onnx"].as_str().unwrap_or_default());
        if !p.exists() {
            return Err(Error::file(&p, "missing (the manifest lists it)"));
        }
        out.push((
            g["variant"].as_str().unwrap_or_default().to_string(),
            p,
            true,
            true,
        ));
    }
    Ok(out)
}

impl OrtBackend {
    /// From export directories (or one shared-context build): one decode variant, optionally a trunk;
    /// host-model/ from the first that has one.
    pub fn open(dirs: &[PathBuf], threads: usize, ep: Ep) -> Result<Self> {
        let (mut decode, mut trunk, mut host) = (None, None, None);
        let mut contexts = 0;
        for d in dirs {
            let gs = graphs_for(d, &ep)?;
            // Sessions sharing one binary load one QNN context between them.
            contexts += if gs.iter().any(|g| g.3) { 1 } else { gs.len() };
            for (v, p, opt, share) in gs {
                if v == "trunk" {
                    trunk = Some(Graph::load(&p, threads, &ep, opt, share)?);
                } else if decode.is_none() {
                    decode = Some(Graph::load(&p, threads, &ep, opt, share)?);
                } else {
                    return Err(Error::file(
                        d,
                        "a second decode graph (give one decode export and at most one trunk)",
                    ));
                }
            }
            if host.is_none() && d.join("host-model").is_dir() {
                host = Some(HostFiles::open(&d.join("host-model"))?);
            }
        }
        if decode.is_none() && trunk.is_none() {
            return Err(Error::Artifacts(
                "no decode or trunk export among them".into(),
            ));
        }
        let host = host.ok_or_else(|| Error::Artifacts("no host-model/ in them".into()))?;
        let kvg: &Graph = decode.as_ref().or(trunk.as_ref()).unwrap();
        let context = kvg
            .inputs
            .iter()
            .filter(|(n, _)| n.starts_with("past_key_"))
            .map(|(_, s)| s[2])
            .max()
            .unwrap_or(usize::MAX);
        let n = decode.is_some() as usize + trunk.is_some() as usize;
        let mut kv = std::collections::BTreeMap::new();
        let alloc = ort::memory::Allocator::default();
        let mut kv_buffers_allocated = 0;
        for (name, shape) in kvg.inputs.iter().filter(|(n, _)| n.starts_with("past_")) {
            let mk = || -> Result<Tensor<f32>> {
                Tensor::<f32>::new(&alloc, shape.clone()).map_err(|e| oe("KV buffer", e))
            };
            kv.insert(
                name.clone(),
                KvPair {
                    bufs: [mk()?, mk()?],
                    cur: 0,
                },
            );
            kv_buffers_allocated += 2;
        }
        let mut b = OrtBackend {
            host,
            decode,
            trunk,
            ep,
            kv,
            hidden: HashMap::new(),
            pos: 0,
            context,
            last_hidden: vec![],
            sessions_created: n,
            contexts,
            kv_buffers_allocated,
            steps: 0,
            capture: None,
            taps: None,
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
            self.decode.as_mut().unwrap()
        };
        if let Some(cap) = self.capture.as_mut() {
            let mut row = Vec::new();
            for (k, v) in &ins {
                let bytes: Vec<u8> = if let Ok((_, x)) = v.try_extract_tensor::<f32>() {
                    x.iter().flat_map(|f| f.to_le_bytes()).collect()
                } else {
                    let (_, x) = v.try_extract_tensor::<i32>().map_err(|e| oe(k, e))?;
                    x.iter().flat_map(|f| f.to_le_bytes()).collect()
                };
                row.push((k.clone(), bytes));
            }
            for (n, pair) in &self.kv {
                let (_, x) = pair.bufs[pair.cur].extract_tensor();
                row.push((n.clone(), x.iter().flat_map(|f| f.to_le_bytes()).collect()));
            }
            cap.push(row);
        }
        let mut bind = g.session.create_binding().map_err(|e| oe("binding", e))?;
        for (k, v) in &ins {
            bind.bind_input(k.as_str(), v).map_err(|e| oe(k, e))?;
        }
        for (n, pair) in self.kv.iter_mut() {
            let present = format!("present_{}", &n["past_".len()..]);
            let (r, w) = pair.bufs.split_at_mut(1);
            let (read, write) = if pair.cur == 0 {
                (&r[0], &mut w[0])
            } else {
                (&w[0], &mut r[0])
            };
            bind.bind_input(n.as_str(), read).map_err(|e| oe(n, e))?;
            bind.bind_output(present.as_str(), write)
                .map_err(|e| oe(&present, e))?;
        }
        // hidden_states: one resident buffer per graph as well.
        if let std::collections::hash_map::Entry::Vacant(e) = self.hidden.entry(trunk) {
            let shape: Vec<i64> = g
                .session
                .outputs()
                .iter()
                .find(|o| o.name() == "hidden_states")
                .and_then(|o| {
                    o.dtype()
                        .tensor_shape()
                        .map(|s| s.iter().copied().collect())
                })
                .ok_or_else(|| Error::Artifacts(format!("{}: no hidden_states output", g.name)))?;
            let t = Tensor::<f32>::new(
                &ort::memory::Allocator::default(),
                shape.iter().map(|&d| d.max(1) as usize).collect::<Vec<_>>(),
            )
            .map_err(|e| oe("hidden buffer", e))?;
            e.insert(t);
        }
        let hbuf = self.hidden.get_mut(&trunk).unwrap();
        bind.bind_output("hidden_states", &mut *hbuf)
            .map_err(|e| oe("hidden_states", e))?;
        if let Some(h) = self.taps.as_mut() {
            for (k, v) in &ins {
                if let Ok((shape, x)) = v.try_extract_tensor::<f32>() {
                    tap(h.as_mut(), k, shape, x)?;
                }
            }
            for (n, pair) in &self.kv {
                let (shape, x) = pair.bufs[pair.cur].extract_tensor();
                tap(h.as_mut(), n, shape, x)?;
            }
            let cpu = ort::memory::MemoryInfo::new(
                ort::memory::AllocationDevice::CPU,
                0,
                ort::memory::AllocatorType::Device,
                ort::memory::MemoryType::Default,
            )
            .map_err(|e| oe("memory info", e))?;
            // The taps; present_* and hidden_states are bound to their resident buffers above.
            for n in g
                .outputs
                .iter()
                .filter(|n| !n.starts_with("present_") && *n != "hidden_states")
            {
                bind.bind_output_to_device(n.as_str(), &cpu)
                    .map_err(|e| oe(n, e))?;
            }
            let res = g
                .session
                .run_binding(&bind)
                .map_err(|e| oe(&format!("running {}", g.name), e))?;
            for (n, v) in &res {
                if let Ok((shape, x)) = v.try_extract_tensor::<f32>() {
                    tap(h.as_mut(), n, shape, x)?;
                }
            }
        } else {
            g.session
                .run_binding(&bind)
                .map_err(|e| oe(&format!("running {}", g.name), e))?;
        }
        drop(bind);
        for pair in self.kv.values_mut() {
            pair.cur ^= 1;
        }
        self.steps += 1;
        let (_, h) = self.hidden[&trunk]
            .try_extract_tensor::<f32>()
            .map_err(|e| oe("hidden_states", e))?;
        Ok(h.to_vec())
    }

    /// Position 0 from host-model/'s prefix when `ids` start with its token there: K/V written into ring
    /// slot 0 of the current buffers, no graph run (hexq_model::prefix). Returns position 0's hidden state.
    fn take_prefix(&mut self, ids: &[u32]) -> Option<Vec<f32>> {
        let p = self.host.prefix.as_ref()?;
        if self.pos != 0 || ids.first() != Some(&p.token) {
            return None;
        }
        for (name, heads, x) in p.entries() {
            if let Some(pair) = self.kv.get_mut(&name) {
                let cur = pair.cur;
                hexq_model::prefix::write_slot0(pair.bufs[cur].extract_tensor_mut().1, heads, x);
            }
        }
        self.pos = 1;
        Some(p.hidden.clone())
    }

    /// One token through the decode graph; returns the final hidden state `[H]`.
    pub fn step(&mut self, id: u32) -> Result<Vec<f32>> {
        if self.pos + 1 > self.context {
            return Err(Error::ContextFull(format!("at position {}", self.pos)));
        }
        if let Some(h) = self.take_prefix(&[id]) {
            return Ok(h);
        }
        if self.decode.is_none() {
            return Ok(self.chunk(&[id])?.pop().unwrap());
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
            return Err(Error::ContextFull(format!("at position {}", self.pos)));
        }
        if let Some(h) = self.take_prefix(ids) {
            let mut out = vec![h];
            if ids.len() > 1 {
                out.extend(self.chunk(&ids[1..])?);
            }
            return Ok(out);
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
        match self.ep {
            Ep::Cpu => "ort",
            Ep::Qnn { .. } => "qnn",
        }
    }
    fn reset(&mut self) {
        for pair in self.kv.values_mut() {
            pair.cur = 0;
            pair.bufs[0].extract_tensor_mut().1.fill(0.0);
        }
        self.pos = 0;
    }
    fn capacity(&self) -> Option<usize> {
        Some(self.context)
    }
    fn stats(&self) -> Option<serde_json::Value> {
        let mut v = serde_json::json!({
            "sessions_created": self.sessions_created,
            "kv_buffers_allocated": self.kv_buffers_allocated,
            "kv_tensors": self.kv.len(),
            "graph_runs": self.steps,
        });
        if let Ep::Qnn { target } = &self.ep {
            v["target"] = target.as_str().into();
            v["contexts_created"] = self.contexts.into();
            if std::env::var_os("HEXQ_COUNT_QNN_CONTEXTS").is_some() {
                v["qnn_ep_context_loads"] = QNN_CONTEXT_LOADS
                    .load(std::sync::atomic::Ordering::SeqCst)
                    .into();
            }
        }
        Some(v)
    }
    fn feed(&mut self, ids: &[u32]) -> Result<Vec<f32>> {
        let trunk = self.trunk.is_some();
        let h = crate::last_hidden(self, ids, trunk)?;
        self.last_hidden = h.clone();
        self.host.logits(&h)
    }
}
