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

//!
//! The room: `lib.rs` (options, stats, the run), `observer.rs` (the range hook), `decode.rs` (the batched
//! decode loops). Datasets are read by `hexq_model::dataset`. May import: model, graph, runtime, fsutil.

mod decode;
pub mod imatrix;
mod observer;

pub use decode::decode_batched;
use decode::prompt_ids;
use hexq_graph::interp::Hook;
use hexq_graph::{build, GraphOptions, Variant};
use hexq_model::chat::{Tokenizer, STOP_IDS};
use hexq_model::dataset::{load_dataset, Record};
use hexq_model::forward::argmax;
use hexq_model::{Checkpoint, Error, Result};
use hexq_runtime::graph::GraphBackend;
use hexq_runtime::Hidden;
pub use observer::RangeObserver;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::sync::Arc;

/// Chat-template ids whose activations must be observed: `<|turn>`, `<turn|>`, `\n`, `user`, `model`.
pub const TEMPLATE_IDS: [u32; 5] = [105, 106, 107, 2364, 4368];

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
    /// Compute position 0 (BOS) on the graph rather than take it from the host prefix
    /// ([`hexq_model::prefix`]), so the observers see its row too: the importance matrix counts every
    /// position, as llama.cpp computes (and llama-imatrix observes) them.
    pub bos_on_graph: bool,
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
    // The checkpoint's own files: rounded-weight overlays do not change which model it is.
    ps.extend(
        ck.store.files[..ck.store.base_files]
            .iter()
            .map(|p| p.as_path()),
    );
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
    // Prompts are cut to context − decode_tokens − 1 (decode::prompt_ids): at least one prompt token must stay.
    if o.graph.context < o.decode_tokens + 2 {
        return Err(Error::Usage(format!(
            "--context {} leaves no room for a prompt beside --decode-tokens {} (needs at least {})",
            o.graph.context,
            o.decode_tokens,
            o.decode_tokens + 2
        )));
    }
    if o.variant == Variant::Trunk && o.graph.seq > o.graph.context {
        return Err(Error::Usage(format!(
            "--seq {} exceeds --context {}: a trunk chunk must fit the KV it writes",
            o.graph.seq, o.graph.context
        )));
    }
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
    let g = build(&ck.config, o.variant, &o.graph);
    let graph_sha = g.content_hash();
    let mut run = Run::new(&g, obs);
    let batched =
        matches!(engine, Engine::Interp { .. }) && o.variant != Variant::Trunk && !o.noise;
    pb.set_length(recs.len() as u64);
    let mut interp;
    let b: &mut dyn Hidden = match engine {
        Engine::Interp { params } => {
            let ids: Vec<Vec<u32>> = match batched {
                true => recs
                    .iter()
                    .map(|r| prompt_ids(tok, r, o))
                    .collect::<Result<_>>()?,
                false => vec![],
            };
            interp = interp_backend(&ck, o, &ids, params, &mut run.obs)?;
            if batched {
                let key = serde_json::json!({"model_sha256": model_hash(&ck)?, "graph_sha256": graph_sha,
                    "dataset_sha256": hexq_fsutil::sha256_file(dataset)?, "prompts": ids.len(),
                    "decode_tokens": o.decode_tokens, "context": o.graph.context, "variant": o.variant.name(),
                    "params": mode});
                run.batched(&ck, &mut interp, &ids, key, o, pb)?;
            }
            &mut interp
        }
        // (--noise: its set_noise refuses, before any observation.)
        Engine::Ort(b) => {
            b.taps = Some(Box::new(run.obs.clone()));
            b
        }
    };
    if !batched {
        run.sequential(b, &recs, tok, o, pb)?;
    }
    let seen = run.template_ids(o, &mut warnings)?;
    let mut tensors = run.obs.ranges.lock().unwrap().clone();
    if o.variant == Variant::Trunk && !run.history {
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
        template_ids_seen: seen,
        tokens_observed: run.tokens,
        params: mode,
        tensors,
    })
}

/// Token sequences given as ids (not a chat dataset: `hexq imatrix --text`, llama-imatrix's chunks side by
/// side) through the batched decode loops, each from an empty cache, every position observed by `obs`.
/// Returns the tokens fed. No guard applies: the caller chose raw text on purpose.
pub fn observe_ids(
    ck: Arc<Checkpoint>,
    ids: &[Vec<u32>],
    o: &Options,
    pb: &indicatif::ProgressBar,
    obs: RangeObserver,
) -> Result<u64> {
    let mut run = Run::new(&build(&ck.config, o.variant, &o.graph), obs);
    pb.set_length(ids.len() as u64);
    let mut interp = interp_backend(&ck, o, ids, None, &mut run.obs)?;
    let key = serde_json::json!({"ids": ids.len()});
    run.batched(&ck, &mut interp, ids, key, o, pb)?;
    Ok(run.tokens)
}

/// The interpreter backend calibration observes: rings as long as the batched prompts reach (plus a
/// never-written slot: the same value sets as full rings), the params baked once, the observer hooked.
fn interp_backend(
    ck: &Arc<Checkpoint>,
    o: &Options,
    ids: &[Vec<u32>],
    params: Option<Box<dyn Hook + Send>>,
    obs: &mut RangeObserver,
) -> Result<GraphBackend> {
    let t0 = std::time::Instant::now();
    let lap = |what: &str| {
        if std::env::var_os("HEXQ_PROFILE").is_some() {
            eprintln!("calibrate: {what} at {:.1} s", t0.elapsed().as_secs_f64());
        }
    };
    let trunk = o.variant == Variant::Trunk;
    let decode_variant = if trunk {
        Variant::DecodeWgqa
    } else {
        o.variant
    };
    let n = ids.iter().map(Vec::len).max().unwrap_or(0) + o.decode_tokens;
    let span = (!ids.is_empty() && !o.full_rings)
        .then(|| hexq_graph::build::spanning(&ck.config, decode_variant, &o.graph, n))
        .flatten();
    let go = span.as_ref().map_or(o.graph, |s| s.options);
    if let Some(s) = span {
        obs.span = Arc::new(s.tensors);
    }
    let mut interp = GraphBackend::for_model(ck, decode_variant, trunk, &go)?;
    lap(&format!("graph backend (rings for context {})", go.context));
    if let Some(mut p) = params {
        // Weights fake-quantized once, not on every decode call.
        interp.bake(p.as_mut())?;
    }
    lap("weights baked");
    if o.bos_on_graph {
        interp.prefix = None;
    }
    interp.hook = Some(Box::new(obs.clone()));
    Ok(interp)
}

/// What a calibration run has gathered so far.
struct Run {
    obs: RangeObserver,
    seen: HashSet<u32>,
    tokens: u64,
    /// A trunk prompt filled a second chunk (its past_* inputs saw more than the prefix).
    history: bool,
}

impl Run {
    /// Nothing gathered yet; `obs` skips the graph's initializers (weights get encodings from their values).
    fn new(g: &hexq_graph::Graph, obs: RangeObserver) -> Self {
        let skip: HashSet<String> = g.initializers.iter().map(|i| i.name.clone()).collect();
        Run {
            obs: RangeObserver {
                skip: Arc::new(skip),
                ..obs
            },
            seen: HashSet::new(),
            tokens: 0,
            history: false,
        }
    }

    /// Every prompt through [`decode_batched`], resumable from `o.checkpoint` (keyed by `key`).
    fn batched(
        &mut self,
        ck: &Arc<Checkpoint>,
        interp: &mut GraphBackend,
        ids: &[Vec<u32>],
        key: serde_json::Value,
        o: &Options,
        pb: &indicatif::ProgressBar,
    ) -> Result<()> {
        for p in ids {
            self.seen
                .extend(p.iter().copied().filter(|i| TEMPLATE_IDS.contains(i)));
        }
        let start = self.resume(&key, ids.len(), o, pb);
        let ranges = self.obs.ranges.clone();
        let base = self.tokens;
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
            if std::env::var("HEXQ_TEST_INTERRUPT_AFTER").is_ok_and(|n| n.parse() == Ok(done)) {
                std::process::exit(130); // tests: an interruption right after this checkpoint
            }
            Ok(())
        };
        let mut seqs = vec![Vec::new(); ids.len()];
        let want = o.tokens_out.is_some().then_some(&mut seqs);
        self.tokens += decode_batched(ck, interp, ids, start, o, pb, &mut save, want)?;
        if let Some(p) = &o.tokens_out {
            // The exact sequences observed (prompt + greedy ids), for judges that replay them.
            hexq_fsutil::write_atomic(
                p,
                &serde_json::to_vec(&seqs[start..]).map_err(|e| Error::file(p, e.to_string()))?,
            )?;
        }
        Ok(())
    }

    /// The prompts a checkpoint of the same settings already observed (its ranges and tokens taken over).
    fn resume(
        &mut self,
        key: &serde_json::Value,
        n: usize,
        o: &Options,
        pb: &indicatif::ProgressBar,
    ) -> usize {
        let Some(cp) = &o.checkpoint else {
            return 0;
        };
        let prev: Option<Partial> = std::fs::read(cp)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok());
        match prev {
            Some(p) if p.key == *key => {
                eprintln!(
                    "resuming from {}: {} of {n} prompts already observed",
                    cp.display(),
                    p.prompts_done,
                );
                self.tokens = p.tokens;
                *self.obs.ranges.lock().unwrap() = p.tensors;
                pb.inc(p.prompts_done as u64);
                p.prompts_done
            }
            Some(_) => {
                eprintln!("{}: from other settings; starting over", cp.display());
                0
            }
            None => 0,
        }
    }

    /// One prompt at a time (trunk chunks, `--noise`, the ort engine): the prompt, then greedy decode steps.
    fn sequential(
        &mut self,
        b: &mut dyn Hidden,
        recs: &[Record],
        tok: &Tokenizer,
        o: &Options,
        pb: &indicatif::ProgressBar,
    ) -> Result<()> {
        for (k, r) in recs.iter().enumerate() {
            let ids = prompt_ids(tok, r, o)?;
            self.seen
                .extend(ids.iter().copied().filter(|i| TEMPLATE_IDS.contains(i)));
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
                self.history |= ids.len() > o.graph.seq;
                b.hidden_all(&ids)?;
                self.tokens += ids.len() as u64;
            } else {
                let mut h = vec![];
                for &id in &ids {
                    h = b.step_one(id)?;
                }
                self.tokens += ids.len() as u64;
                for _ in 0..o.decode_tokens {
                    let next = argmax(&b.logits_of(&h)?);
                    if STOP_IDS.contains(&next) {
                        break;
                    }
                    h = b.step_one(next)?;
                    self.tokens += 1;
                }
            }
            if o.noise {
                b.set_noise(None)?;
            }
            pb.inc(1);
        }
        Ok(())
    }

    /// The template ids seen, sorted; the guard when some never appeared (or the inputs were noise).
    fn template_ids(&self, o: &Options, warnings: &mut Vec<String>) -> Result<Vec<u32>> {
        let mut seen: Vec<u32> = self.seen.iter().copied().collect();
        seen.sort();
        if o.noise || seen.len() < TEMPLATE_IDS.len() {
            let missing: Vec<u32> = TEMPLATE_IDS
                .iter()
                .copied()
                .filter(|i| o.noise || !seen.contains(i))
                .collect();
            guard(warnings, o.ignore_guards, format!(
                "calibration inputs never contain the chat template tokens {missing:?}{}: their activations would be uncalibrated",
                if o.noise { " (random-noise embeddings)" } else { "" }))?;
        }
        Ok(if o.noise { vec![] } else { seen })
    }
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
