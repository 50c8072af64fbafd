//! hexq-calibrate: run the float graph (the IR interpreter over decode_wgqa or trunk) on chat-formatted
//! prompts and record the range of every activation tensor.
//!
//! Capture happens **during decode loops**: every prompt token, then N greedily generated tokens, each one a
//! decode-graph call, so decode-time positions, masks and KV contents are what is observed. Stats are min/max
//! (+ count) per tensor, merged prompt by prompt (memory independent of the dataset size); min/max merging is
//! order-free, so the result is byte-identical across runs and thread counts.
//!
//! Guards: raw-text records (no chat template) and inputs that never show the template's special tokens
//! (e.g. random noise) are refused unless forced — the two calibration failures the published build hit.

use candle_core::{DType as CD, Tensor};
use hexq_graph::interp::Hook;
use hexq_graph::{build, GraphOptions, Variant};
use hexq_model::chat::{Message, Tokenizer, STOP_IDS};
use hexq_model::forward::argmax;
use hexq_model::{Checkpoint, Error, Result};
use hexq_runtime::graph::GraphBackend;
use hexq_runtime::Hidden;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex};

/// Chat-template ids whose activations must be observed: `<|turn>`, `<turn|>`, `\n`, `user`, `model`.
pub const TEMPLATE_IDS: [u32; 5] = [105, 106, 107, 2364, 4368];

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Record {
    pub id: String,
    #[serde(default)]
    pub messages: Option<Vec<Message>>,
    #[serde(default)]
    pub text: Option<String>,
}

/// Read a JSONL dataset; every line must be an object with `id` and `messages` or `text`.
pub fn load_dataset(path: &Path) -> Result<Vec<Record>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let r: Record = serde_json::from_str(line)
            .map_err(|e| Error::file(path, format!("line {}: {e}", i + 1)))?;
        let at = |m: String| Error::file(path, format!("line {} ({}): {m}", i + 1, r.id));
        match &r.messages {
            None if r.text.is_none() => return Err(at("needs \"messages\" or \"text\"".into())),
            Some(m) if m.is_empty() => return Err(at("\"messages\" is empty".into())),
            Some(m) => {
                // The roles Gemma's chat templates render.
                if let Some(x) = m
                    .iter()
                    .find(|x| !["system", "user", "model", "assistant"].contains(&x.role.as_str()))
                {
                    return Err(at(format!(
                        "role {:?} (expected system, user, model or assistant)",
                        x.role
                    )));
                }
            }
            None => {}
        }
        out.push(r);
    }
    if out.is_empty() {
        return Err(Error::file(path, "no records"));
    }
    Ok(out)
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Range {
    pub min: f32,
    pub max: f32,
    pub count: u64,
}

impl Range {
    pub fn merge(&mut self, o: &Range) {
        self.min = self.min.min(o.min);
        self.max = self.max.max(o.max);
        self.count += o.count;
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Stats {
    pub hexq_version: String,
    pub variant: String,
    pub model_sha256: String,
    pub graph_sha256: String,
    pub dataset_sha256: String,
    pub prompts: usize,
    pub decode_tokens: usize,
    pub context: usize,
    pub seq: usize,
    /// Every record went through the chat template.
    pub chat_formatted: bool,
    /// Which of [`TEMPLATE_IDS`] appeared in the calibration inputs.
    pub template_ids_seen: Vec<u32>,
    pub tokens_observed: u64,
    /// "float" or the weight scheme the ranges were observed under (e.g. "int8_per_channel").
    #[serde(default)]
    pub params: String,
    pub tensors: BTreeMap<String, Range>,
}

/// Observer hook: min/max of every float graph input and node output (initializers are weights/constants:
/// their encodings come from their values, not from calibration).
#[derive(Clone, Default)]
pub struct RangeObserver {
    pub skip: Arc<HashSet<String>>,
    pub ranges: Arc<Mutex<BTreeMap<String, Range>>>,
    /// Tensors whose every value is also kept (for independent judges of the encodings).
    pub capture: Arc<HashSet<String>>,
    pub captured: Arc<Mutex<BTreeMap<String, Vec<Vec<f32>>>>>,
    /// Observing a shorter-ring graph for the full one ([`hexq_graph::build::Span::tensors`]): recorded
    /// under the full graph's names with its element counts.
    pub span: Arc<HashMap<String, (String, usize, usize)>>,
}

impl RangeObserver {
    /// The full graph's name for `name` and the element count a tensor of `n` elements stands for.
    fn full<'a>(&'a self, name: &'a str, n: usize) -> (&'a str, u64) {
        match self.span.get(name) {
            Some((full, a, b)) if *b > 0 => (full, (n / b * a) as u64),
            Some((full, _, _)) => (full, n as u64),
            None => (name, n as u64),
        }
    }
}

impl Hook for RangeObserver {
    fn observes_only(&self) -> bool {
        self.capture.is_empty()
    }

    /// A batch's tensors scanned in parallel, merged once (min/max/count merge order-free: the same ranges).
    fn tensors(&mut self, name: &str, ts: &[Tensor]) -> Vec<Option<Tensor>> {
        use rayon::prelude::*;
        let work: usize = ts.iter().map(|t| t.elem_count()).sum();
        if ts.len() < 2
            || work < hexq_graph::interp::PAR_MIN
            || self.skip.contains(self.full(name, 0).0)
            || !self.capture.is_empty()
        {
            return ts.iter().map(|t| self.tensor(name, t)).collect();
        }
        let me = &*self;
        let rs: Vec<Range> = ts
            .par_iter()
            .filter(|t| t.dtype() == CD::F32)
            .filter_map(|t| {
                min_max(t).map(|(min, max)| Range {
                    min,
                    max,
                    count: me.full(name, t.elem_count()).1,
                })
            })
            .collect();
        let name = self.full(name, 0).0;
        let mut m = self.ranges.lock().unwrap();
        for r in rs {
            m.entry(name.to_string())
                .and_modify(|e| e.merge(&r))
                .or_insert(r);
        }
        vec![None; ts.len()]
    }

    fn tensor(&mut self, name: &str, t: &Tensor) -> Option<Tensor> {
        let (name, count) = self.full(name, t.elem_count());
        if t.dtype() != CD::F32 || self.skip.contains(name) {
            return None;
        }
        if self.capture.contains(name) {
            let v: Vec<f32> = t.flatten_all().ok()?.to_vec1().ok()?;
            self.captured
                .lock()
                .unwrap()
                .entry(name.to_string())
                .or_default()
                .push(v);
        }
        let (lo, hi) = min_max(t)?;
        let r = Range {
            min: lo,
            max: hi,
            count,
        };
        self.ranges
            .lock()
            .unwrap()
            .entry(name.to_string())
            .and_modify(|e| e.merge(&r))
            .or_insert(r);
        None
    }
}

/// Min and max of an f32 tensor, read in place when contiguous (a KV buffer is not copied to be scanned).
/// NaN would poison min/max silently; it counts as +inf, an infinite range that is visible.
fn min_max(t: &Tensor) -> Option<(f32, f32)> {
    {
        // A permuted view of a dense block (the transposed KV ring a score MatMul reads) holds the same
        // values as the block: min/max are order-free, so scan the block instead of copying the view.
        let (st, layout) = t.storage_and_layout();
        if let candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)) = &*st {
            let mut ds: Vec<(usize, usize)> = layout
                .stride()
                .iter()
                .copied()
                .zip(layout.dims().iter().copied())
                .filter(|&(_, d)| d > 1)
                .collect();
            ds.sort_by(|a, b| b.0.cmp(&a.0));
            let mut want = 1;
            let dense = ds.iter().rev().all(|&(s, d)| {
                let ok = s == want;
                want *= d;
                ok
            });
            let (a, n) = (layout.start_offset(), t.elem_count());
            if dense && a + n <= v.len() {
                return Some(hexq_model::weights::min_max(&v[a..a + n]));
            }
        }
    }
    hexq_graph::interp::with_f32(t, hexq_model::weights::min_max).ok()
}

pub struct Options {
    pub variant: Variant,
    pub graph: GraphOptions,
    /// Tokens generated (and observed) after each prompt.
    pub decode_tokens: usize,
    pub limit: Option<usize>,
    /// Accept raw-text records and inputs without the template tokens (the guards become warnings).
    /// Turn the guards' refusals into warnings.
    pub ignore_guards: bool,
    /// Replace the embeddings by N(0,1) noise (to demonstrate the failure mode; refused unless forced).
    pub noise: bool,
    /// Decode-graph calibration on the interpreter: decode steps (positions) per batched graph run — of
    /// prompts side by side and of consecutive prompt tokens of one prompt (see [`decode_batched`]); the
    /// ranges do not depend on it.
    pub batch: usize,
    /// Prompts in flight at once (0: `batch`); each holds a full KV cache, so this bounds the memory.
    pub sequences: usize,
    /// Resumable progress (batched decode calibration): every `checkpoint_every` prompts the stats so far
    /// are written here; a run that finds a file with its own settings continues from it.
    pub checkpoint: Option<std::path::PathBuf>,
    pub checkpoint_every: usize,
    /// Write the id sequences the decode loops fed (prompt + generated), one array per prompt (batched
    /// decode calibration; a resumed run writes the prompts it ran).
    pub tokens_out: Option<std::path::PathBuf>,
    /// Run the decode graph at the full `graph.context` even when the prompts reach less far (see
    /// [`hexq_graph::build::spanning`]: the same ranges, slower; for proving that).
    pub full_rings: bool,
}

/// What a checkpoint holds: the settings it belongs to, how many prompts (in dataset order) are in it, and
/// the merged ranges, token count and template ids seen so far.
#[derive(Serialize, Deserialize)]
struct Partial {
    key: serde_json::Value,
    prompts_done: usize,
    tokens: u64,
    tensors: BTreeMap<String, Range>,
}

/// What the weights were during calibration: "float", or the param scheme they were fake-quantized with
/// (AIMET's sequence: param encodings first, activation ranges observed in the param-quantized model).
pub type ParamMode = String;

/// Hash identifying a checkpoint: config.json and every safetensors file.
pub fn model_hash(ck: &Checkpoint) -> Result<String> {
    let cfgp = ck.dir.join("config.json");
    let mut ps: Vec<&Path> = vec![cfgp.as_path()];
    ps.extend(ck.store.files.iter().map(|p| p.as_path()));
    Ok(hexq_fsutil::sha256_files(&ps)?)
}

/// Warnings the guards raise; errors unless forced.
fn guard(msgs: &mut Vec<String>, ignore: bool, msg: String) -> Result<()> {
    if ignore {
        eprintln!("WARNING: {msg} (continuing because of --ignore-guards)");
        msgs.push(msg);
        Ok(())
    } else {
        Err(Error::Usage(format!(
            "{msg}; refusing to calibrate (pass --ignore-guards to override)"
        )))
    }
}

pub fn calibrate(
    ck: Arc<Checkpoint>,
    tok: &Tokenizer,
    dataset: &Path,
    o: &Options,
    pb: &indicatif::ProgressBar,
) -> Result<Stats> {
    calibrate_with(
        ck,
        tok,
        dataset,
        o,
        pb,
        RangeObserver::default(),
        Engine::Interp { params: None },
        "float".into(),
    )
}

/// Where the calibration forward passes run.
pub enum Engine<'a> {
    /// hexq's graph interpreter (candle); `params` fake-quantizes the weights as they load (None = float).
    Interp {
        params: Option<Box<dyn Hook + Send>>,
    },
    /// onnxruntime on the exported graph of the same variant, exported with taps (every float tensor an
    /// output) and the calibration params baked in: the engine and arithmetic aimet-onnx calibrates with.
    Ort(&'a mut hexq_runtime::ort::OrtBackend),
}

/// [`calibrate`] with a caller-made observer (e.g. one that also captures some tensors' values) on
/// `engine`; `mode` names what the weights were.
#[allow(clippy::too_many_arguments)]
pub fn calibrate_with(
    ck: Arc<Checkpoint>,
    tok: &Tokenizer,
    dataset: &Path,
    o: &Options,
    pb: &indicatif::ProgressBar,
    obs: RangeObserver,
    engine: Engine,
    mode: ParamMode,
) -> Result<Stats> {
    let mut recs = load_dataset(dataset)?;
    if let Some(n) = o.limit {
        recs.truncate(n);
    }
    let mut warnings = Vec::new();
    let raw = recs.iter().filter(|r| r.messages.is_none()).count();
    if raw > 0 {
        guard(&mut warnings, o.ignore_guards, format!(
            "{}: {raw} of {} records are raw text, not chat-formatted: chat prompts at inference would hit activation ranges never observed",
            dataset.display(), recs.len()))?;
    }
    let cfg = &ck.config;
    let g = build(cfg, o.variant, &o.graph);
    let graph_sha = g.content_hash();
    let skip: HashSet<String> = g.initializers.iter().map(|i| i.name.clone()).collect();
    let mut obs = RangeObserver {
        skip: Arc::new(skip),
        ..obs
    };
    let decode_variant = if o.variant == Variant::Trunk {
        Variant::DecodeWgqa
    } else {
        o.variant
    };
    let mut interp;
    let batched =
        matches!(engine, Engine::Interp { .. }) && o.variant != Variant::Trunk && !o.noise;
    pb.set_length(recs.len() as u64);
    let mut seen = HashSet::new();
    let mut tokens = 0u64;
    let mut history = false;
    let b: &mut dyn Hidden = match engine {
        Engine::Interp { params } => {
            let t0 = std::time::Instant::now();
            let lap = |what: &str| {
                if std::env::var_os("HEXQ_PROFILE").is_some() {
                    eprintln!("calibrate: {what} at {:.1} s", t0.elapsed().as_secs_f64());
                }
            };
            let ids: Vec<Vec<u32>> = match batched {
                true => recs
                    .iter()
                    .map(|r| prompt_ids(tok, r, o))
                    .collect::<Result<_>>()?,
                false => vec![],
            };
            // Rings as long as these prompts reach (plus a never-written slot): the same value sets.
            let n = ids.iter().map(Vec::len).max().unwrap_or(0) + o.decode_tokens;
            let span = (batched && !o.full_rings)
                .then(|| hexq_graph::build::spanning(cfg, decode_variant, &o.graph, n))
                .flatten();
            let go = span.as_ref().map_or(o.graph, |s| s.options);
            if let Some(s) = span {
                obs.span = Arc::new(s.tensors);
            }
            interp =
                GraphBackend::for_model(&ck, decode_variant, o.variant == Variant::Trunk, &go)?;
            lap(&format!("graph backend (rings for context {})", go.context));
            if let Some(mut p) = params {
                // Weights fake-quantized once, not on every decode call.
                interp.bake(p.as_mut())?;
            }
            lap("weights baked");
            interp.hook = Some(Box::new(obs.clone()));
            if batched {
                for p in &ids {
                    seen.extend(p.iter().copied().filter(|i| TEMPLATE_IDS.contains(i)));
                }
                let key = serde_json::json!({"model_sha256": model_hash(&ck)?, "graph_sha256": graph_sha,
                    "dataset_sha256": hexq_fsutil::sha256_file(dataset)?, "prompts": ids.len(),
                    "decode_tokens": o.decode_tokens, "context": o.graph.context, "variant": o.variant.name(),
                    "params": mode});
                lap("model hash");
                let mut start = 0;
                if let Some(cp) = &o.checkpoint {
                    let prev: Option<Partial> = std::fs::read(cp)
                        .ok()
                        .and_then(|b| serde_json::from_slice(&b).ok());
                    match prev {
                        Some(p) if p.key == key => {
                            eprintln!(
                                "resuming from {}: {} of {} prompts already observed",
                                cp.display(),
                                p.prompts_done,
                                ids.len()
                            );
                            start = p.prompts_done;
                            tokens = p.tokens;
                            *obs.ranges.lock().unwrap() = p.tensors;
                            pb.inc(start as u64);
                        }
                        Some(_) => {
                            eprintln!("{}: from other settings; starting over", cp.display())
                        }
                        None => {}
                    }
                }
                let ranges = obs.ranges.clone();
                let base = tokens;
                let mut save = |done: usize, toks: u64| -> Result<()> {
                    let Some(cp) = &o.checkpoint else {
                        return Ok(());
                    };
                    let p = Partial {
                        key: key.clone(),
                        prompts_done: done,
                        tokens: base + toks,
                        tensors: ranges.lock().unwrap().clone(),
                    };
                    hexq_fsutil::write_atomic(
                        cp,
                        &serde_json::to_vec(&p).map_err(|e| Error::file(cp, e.to_string()))?,
                    )?;
                    if std::env::var("HEXQ_TEST_INTERRUPT_AFTER")
                        .is_ok_and(|n| n.parse() == Ok(done))
                    {
                        std::process::exit(130); // tests: an interruption right after this checkpoint
                    }
                    Ok(())
                };
                let mut seqs = vec![Vec::new(); ids.len()];
                let want = o.tokens_out.is_some().then_some(&mut seqs);
                tokens += decode_batched(&ck, &mut interp, &ids, start, o, pb, &mut save, want)?;
                if let Some(p) = &o.tokens_out {
                    // The exact sequences observed (prompt + greedy ids), for judges that replay them.
                    hexq_fsutil::write_atomic(
                        p,
                        &serde_json::to_vec(&seqs[start..])
                            .map_err(|e| Error::file(p, e.to_string()))?,
                    )?;
                }
            }
            &mut interp
        }
        // (--noise: its set_noise refuses, before any observation.)
        Engine::Ort(b) => {
            b.taps = Some(Box::new(obs.clone()));
            b
        }
    };
    for (k, r) in recs.iter().enumerate().filter(|_| !batched) {
        let ids = prompt_ids(tok, r, o)?;
        seen.extend(ids.iter().copied().filter(|i| TEMPLATE_IDS.contains(i)));
        b.reset_all();
        if o.noise {
            // Noise instead of token embeddings: what "calibrate on np.random.randn" does.
            let mut rng = <rand::rngs::SmallRng as rand::SeedableRng>::seed_from_u64(k as u64);
            b.set_noise(Some(Box::new(move |n: usize| {
                use rand_distr::Distribution;
                let d = rand_distr::Normal::new(0.0f32, 1.0).unwrap();
                (0..n).map(|_| d.sample(&mut rng)).collect()
            })))?;
        }
        if o.variant == Variant::Trunk {
            // A second chunk reads the first one's K/V through its past_* inputs.
            history |= ids.len() > o.graph.seq;
            b.hidden_all(&ids)?;
            tokens += ids.len() as u64;
        } else {
            let mut h = vec![];
            for &id in &ids {
                h = b.step_one(id)?;
            }
            tokens += ids.len() as u64;
            for _ in 0..o.decode_tokens {
                let next = argmax(&b.logits_of(&h)?);
                if STOP_IDS.contains(&next) {
                    break;
                }
                h = b.step_one(next)?;
                tokens += 1;
            }
        }
        if o.noise {
            b.set_noise(None)?;
        }
        pb.inc(1);
    }
    let mut seen: Vec<u32> = seen.into_iter().collect();
    seen.sort();
    if o.noise || seen.len() < TEMPLATE_IDS.len() {
        let missing: Vec<u32> = TEMPLATE_IDS
            .iter()
            .copied()
            .filter(|i| o.noise || !seen.contains(i))
            .collect();
        guard(&mut warnings, o.ignore_guards, format!(
            "calibration inputs never contain the chat template tokens {missing:?}{}: their activations would be uncalibrated",
            if o.noise { " (random-noise embeddings)" } else { "" }))?;
    }
    let mut tensors = obs.ranges.lock().unwrap().clone();
    if o.variant == Variant::Trunk && !history {
        // The trunk's past_* inputs carried only the BOS prefix in slot 0 (no prompt filled a second
        // chunk): a range that looks observed but covers one position. Recorded as unobserved, so
        // `quantize` refuses them or takes them from the decode graph's stats (--kv-stats).
        for (_, r) in tensors.iter_mut().filter(|(k, _)| k.starts_with("past_")) {
            *r = Range {
                min: 0.0,
                max: 0.0,
                count: 0,
            };
        }
    }
    Ok(Stats {
        hexq_version: env!("CARGO_PKG_VERSION").into(),
        variant: o.variant.name().into(),
        model_sha256: model_hash(&ck)?,
        graph_sha256: graph_sha,
        dataset_sha256: hexq_fsutil::sha256_file(dataset)?,
        prompts: recs.len(),
        decode_tokens: o.decode_tokens,
        context: o.graph.context,
        seq: o.graph.seq,
        chat_formatted: raw == 0 && !o.noise,
        template_ids_seen: if o.noise { vec![] } else { seen },
        tokens_observed: tokens,
        params: mode,
        tensors,
    })
}

/// A record's ids: the chat template (or raw text), cut to leave room for the decode steps.
fn prompt_ids(tok: &Tokenizer, r: &Record, o: &Options) -> Result<Vec<u32>> {
    let ids = match &r.messages {
        Some(m) => tok.encode_chat(m)?,
        None => tok.encode(r.text.as_deref().unwrap())?,
    };
    Ok(ids
        .into_iter()
        .take(o.graph.context.saturating_sub(o.decode_tokens + 1))
        .collect())
}

/// One prompt in flight: its ids, how far it is, the tokens it generated, its last hidden state and KV.
struct Job {
    index: usize,
    ids: Vec<u32>,
    /// Every id fed so far (the prompt's, then the generated ones).
    fed: Vec<u32>,
    cur: usize,
    generated: usize,
    h: Vec<f32>,
    slot: hexq_runtime::graph::Slot,
}

/// Decode-graph calibration with `o.batch` prompts side by side (continuous batching: a finished prompt's
/// place goes to the next one): every prompt token, then up to `decode_tokens` greedy tokens, each a decode
/// step of its own sequence — the same steps, inputs and observed tensors as one prompt at a time, in
/// another order (min/max/count merge order-free; `GraphBackend::step_batch` is exact per sequence). The
/// greedy choice uses the head's rows through the same batch-invariant kernel, so it does not depend on the
/// batch either. Returns the tokens observed.
///
/// Resumable: from prompt `start`; every `o.checkpoint_every` prompts the batch drains (no prompt half
/// observed) and `save(prompts done, tokens)` records the state.
#[allow(clippy::too_many_arguments)]
pub fn decode_batched(
    ck: &Arc<Checkpoint>,
    b: &mut GraphBackend,
    prompts: &[Vec<u32>],
    start: usize,
    o: &Options,
    pb: &indicatif::ProgressBar,
    save: &mut dyn FnMut(usize, u64) -> Result<()>,
    mut seqs: Option<&mut Vec<Vec<u32>>>,
) -> Result<u64> {
    let head = hexq_runtime::graph::Head::of(ck)?;
    let mut next = start;
    let mut jobs: Vec<Job> = Vec::new();
    let (mut tokens, t0) = (0u64, std::time::Instant::now());
    let (mut head_s, mut step_s) = (0f64, 0f64);
    let every = if o.checkpoint.is_some() {
        o.checkpoint_every.max(1)
    } else {
        usize::MAX
    };
    let mut drain_at = (start / every + 1).saturating_mul(every).min(prompts.len());
    loop {
        if jobs.is_empty() && next == drain_at && next < prompts.len() {
            save(next, tokens)?;
            drain_at = (drain_at + every).min(prompts.len());
        }
        let in_flight = match o.sequences {
            0 => o.batch,
            n => n.min(o.batch),
        };
        while jobs.len() < in_flight.max(1) && next < drain_at.min(prompts.len()) {
            let p = &prompts[next];
            next += 1;
            tokens += p.len() as u64;
            jobs.push(Job {
                index: next - 1,
                ids: p.clone(),
                fed: Vec::new(),
                cur: 0,
                generated: 0,
                h: vec![],
                slot: b.new_slot(),
            });
        }
        // Greedy picks for the jobs past their prompt, in one head multiply.
        let want: Vec<usize> = (0..jobs.len())
            .filter(|&j| jobs[j].cur == jobs[j].ids.len() && jobs[j].generated < o.decode_tokens)
            .collect();
        let mut picks = vec![None; jobs.len()];
        let hs: Vec<&[f32]> = want.iter().map(|&j| jobs[j].h.as_slice()).collect();
        let th = std::time::Instant::now();
        for (row, &j) in head.logits(&hs).iter().zip(&want) {
            picks[j] = Some(argmax(row));
        }
        head_s += th.elapsed().as_secs_f64();
        // This call's positions: one greedy token per decoding job; the rest of the batch goes to the
        // prompts' next tokens, spread over the jobs still in their prompt (a lone long prompt gets many).
        let mut take = vec![0usize; jobs.len()];
        let mut finished = Vec::new();
        let mut budget = o.batch.max(1);
        for (j, job) in jobs.iter_mut().enumerate() {
            if job.cur < job.ids.len() {
                take[j] = 1;
                budget -= 1;
            } else {
                match picks[j] {
                    Some(t) if !STOP_IDS.contains(&t) => {
                        job.generated += 1;
                        tokens += 1;
                        job.ids.push(t);
                        take[j] = 1;
                        budget -= 1;
                    }
                    _ => finished.push(j),
                }
            }
        }
        let left: Vec<usize> = jobs.iter().map(|job| job.ids.len() - job.cur).collect();
        hexq_runtime::graph::spread(&mut take, &left, budget);
        let step: Vec<usize> = (0..jobs.len()).filter(|&j| take[j] > 0).collect();
        if step.is_empty() && finished.is_empty() {
            break;
        }
        if !step.is_empty() {
            let mut slots: Vec<&mut hexq_runtime::graph::Slot> = Vec::new();
            let mut runs: Vec<&[u32]> = Vec::new();
            for (j, job) in jobs.iter_mut().enumerate() {
                if take[j] > 0 {
                    let run = &job.ids[job.cur..job.cur + take[j]];
                    if seqs.is_some() {
                        job.fed.extend_from_slice(run);
                    }
                    job.cur += take[j];
                    runs.push(run);
                    slots.push(&mut job.slot);
                }
            }
            let ts = std::time::Instant::now();
            let hs = b.step_chain(&mut slots, &runs)?;
            step_s += ts.elapsed().as_secs_f64();
            for (j, mut h) in step.into_iter().zip(hs) {
                jobs[j].h = h.pop().unwrap();
            }
        }
        for &j in finished.iter().rev() {
            let job = jobs.remove(j);
            if let Some(out) = seqs.as_mut() {
                out[job.index] = job.fed;
            }
            pb.inc(1);
        }
        let s = t0.elapsed().as_secs_f64();
        pb.set_message(format!(
            "calibrate, {:.1} tok/s",
            tokens as f64 / s.max(1e-9)
        ));
        if jobs.is_empty() && next >= prompts.len() {
            break;
        }
    }
    if std::env::var_os("HEXQ_PROFILE").is_some() {
        eprintln!(
            "calibrate: decode loop {:.1} s: graph steps {step_s:.1} s, greedy head {head_s:.1} s",
            t0.elapsed().as_secs_f64()
        );
    }
    Ok(tokens)
}

#[cfg(test)]
mod tests {
    use hexq_model::weights::min_max as min_max_of;

    /// The 16-lane scan equals a sequential fold (NaN as +inf) on every length and with NaN anywhere.
    #[test]
    fn lane_min_max_equals_a_fold() {
        let fold = |v: &[f32]| {
            v.iter()
                .fold((f32::INFINITY, f32::NEG_INFINITY), |(l, h), &x| {
                    let x = if x.is_nan() { f32::INFINITY } else { x };
                    (l.min(x), h.max(x))
                })
        };
        let mut s = 0x9e3779b97f4a7c15u64;
        for n in [0usize, 1, 15, 16, 17, 100, 1023] {
            for nan_at in [None, Some(0), Some(n / 2)] {
                let mut v: Vec<f32> = (0..n)
                    .map(|_| {
                        s = s
                            .wrapping_mul(6364136223846793005)
                            .wrapping_add(1442695040888963407);
                        ((s >> 33) as f32 / (1u64 << 31) as f32 - 0.5) * 1e4
                    })
                    .collect();
                if let Some(k) = nan_at.filter(|&k| k < n) {
                    v[k] = f32::NAN;
                }
                assert_eq!(min_max_of(&v), fold(&v), "n={n} nan={nan_at:?}");
            }
        }
        assert_eq!(min_max_of(&[f32::NAN; 20]), (f32::INFINITY, f32::INFINITY));
    }
}
