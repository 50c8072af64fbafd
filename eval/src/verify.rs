//! `hexq verify`: quantsim (or any hooked graph run) against float on held-out chat prompts — next-token
//! top-1, hidden cosine, KL, token-exact greedy, a per-step decode cosine trace, final-norm collapse and
//! range coverage.

use candle_core::Tensor;
use hexq_calibrate::{Range, RangeObserver, Stats};
use hexq_graph::interp::Hook;
use hexq_graph::{GraphOptions, Variant};
use hexq_model::chat::Tokenizer;
use hexq_model::dataset::Record;
use hexq_model::forward::argmax;
use hexq_model::{Checkpoint, Result};
use hexq_quantize::quantsim::FakeQuant;
use hexq_quantize::Encodings;
use hexq_runtime::graph::GraphBackend;
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::Arc;

/// Observe the un-quantized value (coverage), then fake-quantize it.
struct ObserveThenQuant(RangeObserver, FakeQuant);
impl Hook for ObserveThenQuant {
    fn tensor(&mut self, n: &str, t: &Tensor) -> Option<Tensor> {
        self.0.tensor(n, t);
        self.1.tensor(n, t)
    }
    fn tensors(&mut self, n: &str, ts: &[Tensor]) -> Vec<Option<Tensor>> {
        self.0.tensors(n, ts);
        self.1.tensors(n, ts)
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct PromptResult {
    pub id: String,
    pub prompt_tokens: usize,
    pub top1_agree: bool,
    pub cosine: f64,
    pub kl: f64,
    pub norm_ratio: f64,
    pub greedy_exact: bool,
    pub greedy_agree_steps: usize,
    pub step_cosine: Vec<f64>,
}

impl PromptResult {
    /// The prefill figures of one prompt: reference (hidden, logits) vs candidate (hidden, logits).
    fn prefill(
        id: &str,
        tokens: usize,
        (hf, lf): (&[f32], &[f32]),
        (hq, lq): (&[f32], &[f32]),
    ) -> Self {
        PromptResult {
            id: id.to_string(),
            prompt_tokens: tokens,
            top1_agree: argmax(lf) == argmax(lq),
            cosine: cos(hf, hq),
            kl: kl(lf, lq),
            norm_ratio: norm(hq) / norm(hf).max(1e-30),
            greedy_exact: true,
            greedy_agree_steps: 0,
            step_cosine: vec![],
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Coverage {
    pub tensor: String,
    pub calibrated: (f32, f32),
    pub heldout: (f32, f32),
    /// How far outside, relative to the calibrated width.
    pub excess: f32,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub variant: String,
    pub prompts: usize,
    pub top1_agreement: f64,
    pub cosine_mean: f64,
    pub cosine_min: f64,
    pub kl_mean: f64,
    pub kl_max: f64,
    pub greedy_steps: usize,
    pub greedy_exact: usize,
    pub norm_ratio_min: f64,
    pub collapsed: bool,
    /// Mean over prompts of the hidden cosine at each teacher-forced decode step.
    pub step_cosine_mean: Vec<f64>,
    pub coverage_outside: Vec<Coverage>,
    pub per_prompt: Vec<PromptResult>,
}

/// A held-out record's ids (chat template, or raw text), cut to leave room for `steps` decode steps.
fn prompt_ids(tok: &Tokenizer, r: &Record, context: usize, steps: usize) -> Result<Vec<u32>> {
    let ids = match (&r.messages, &r.text) {
        (Some(m), _) => tok.encode_chat(m)?,
        (None, Some(t)) => tok.encode(t)?,
        (None, None) => {
            return Err(hexq_model::Error::Usage(format!(
                "record {}: no messages or text",
                r.id
            )))
        }
    };
    Ok(ids
        .into_iter()
        .take(context.saturating_sub(steps + 1).max(1))
        .collect())
}

/// Cosine similarity in f64.
pub fn cos(a: &[f32], b: &[f32]) -> f64 {
    let (mut d, mut na, mut nb) = (0f64, 0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        d += *x as f64 * *y as f64;
        na += (*x as f64).powi(2);
        nb += (*y as f64).powi(2);
    }
    d / (na.sqrt() * nb.sqrt()).max(1e-30)
}

fn norm(a: &[f32]) -> f64 {
    a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt()
}

fn log_softmax(l: &[f32]) -> Vec<f64> {
    let m = l.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    let z = l.iter().map(|x| (*x as f64 - m).exp()).sum::<f64>().ln() + m;
    l.iter().map(|x| *x as f64 - z).collect()
}

/// KL(p_float || p_quant).
pub fn kl(float: &[f32], quant: &[f32]) -> f64 {
    let (lp, lq) = (log_softmax(float), log_softmax(quant));
    lp.iter().zip(&lq).map(|(a, b)| a.exp() * (a - b)).sum()
}

pub fn backend(ck: &Arc<Checkpoint>, v: Variant, o: &GraphOptions) -> Result<GraphBackend> {
    let decode = if v == Variant::Trunk {
        Variant::DecodeWgqa
    } else {
        v
    };
    Ok(GraphBackend::for_model(ck, decode, v == Variant::Trunk, o)?)
}

/// hexq's quantsim of graph `v`: params fake-quantized once, activations as they are produced.
pub fn quantsim(
    ck: &Arc<Checkpoint>,
    enc: &Encodings,
    v: Variant,
    o: &GraphOptions,
) -> Result<GraphBackend> {
    let mut q = backend(ck, v, o)?;
    q.bake(&mut FakeQuant::params_of(enc))?;
    q.hook = Some(Box::new(FakeQuant::activations(enc)));
    Ok(q)
}

/// `qck`: the checkpoint quantsim reads — `ck` itself, or `ck` with the rounded weights of a GPTQ
/// encodings file overlaid (`hexq_quantize::rounding::open_overlay`).
#[allow(clippy::too_many_arguments)]
pub fn verify(
    ck: Arc<Checkpoint>,
    qck: &Arc<Checkpoint>,
    tok: &Tokenizer,
    recs: &[Record],
    enc: &Encodings,
    stats: Option<&Stats>,
    v: Variant,
    o: &GraphOptions,
    steps: usize,
    batch: usize,
    pb: &indicatif::ProgressBar,
) -> Result<Report> {
    let prompts = match v {
        Variant::Trunk => vec![],
        _ => recs
            .iter()
            .map(|r| Ok((r.id.clone(), prompt_ids(tok, r, o.context, steps)?)))
            .collect::<Result<Vec<_>>>()?,
    };
    // Decode graphs with rings as long as the prompts reach (the same figures; see `spanning`), the
    // encodings applied under the full graph's names.
    let reach = prompts.iter().map(|p| p.1.len()).max().unwrap_or(0) + steps;
    let span = match v {
        Variant::Trunk => None,
        _ => hexq_graph::build::spanning(&ck.config, v, o, reach),
    };
    let go = span.as_ref().map_or(*o, |s| s.options);
    if std::env::var_os("HEXQ_PROFILE").is_some() {
        eprintln!(
            "verify: rings for context {} (prompts reach {reach})",
            go.context
        );
    }
    let names: Arc<std::collections::HashMap<String, String>> = Arc::new(
        span.map(|s| s.tensors.into_iter().map(|(k, v)| (k, v.0)).collect())
            .unwrap_or_default(),
    );
    let renamed = |h: Box<dyn hexq_graph::interp::Hook + Send>| hexq_graph::interp::Renamed {
        inner: h,
        names: names.clone(),
    };
    let t0 = std::time::Instant::now();
    let mut f = backend(&ck, v, &go)?;
    let mut q = backend(qck, v, &go)?;
    let obs = RangeObserver::default();
    // Params quantized once; activations as they are produced.
    q.bake(&mut renamed(Box::new(FakeQuant::params_of(enc))))?;
    let acts = FakeQuant::activations(enc).on_grid(&q.decode.graph, &names);
    q.hook = Some(Box::new(renamed(Box::new(ObserveThenQuant(
        obs.clone(),
        acts,
    )))));
    pb.set_length(recs.len() as u64);
    if std::env::var_os("HEXQ_PROFILE").is_some() {
        eprintln!(
            "verify: set-up (two backends, bake) {:.1} s",
            t0.elapsed().as_secs_f64()
        );
    }
    let per = if v == Variant::Trunk {
        prompt_by_prompt(&mut f, &mut q, tok, recs, o, steps, pb)?
    } else {
        let head = hexq_runtime::graph::Head::of(&ck)?;
        // Held-out coverage needs every tensor at every position.
        decode_batched(
            &mut f,
            &mut q,
            &head,
            &prompts,
            steps,
            batch,
            stats.is_some(),
            pb,
        )?
    };
    let mut coverage_outside = Vec::new();
    if let Some(st) = stats {
        let held: BTreeMap<String, Range> = obs.ranges.lock().unwrap().clone();
        for (name, h) in held {
            if let Some(c) = st.tensors.get(&name) {
                let w = (c.max - c.min).max(1e-12);
                let ex = ((c.min - h.min).max(0.0) + (h.max - c.max).max(0.0)) / w;
                if ex > 0.0 {
                    coverage_outside.push(Coverage {
                        tensor: name,
                        calibrated: (c.min, c.max),
                        heldout: (h.min, h.max),
                        excess: ex,
                    });
                }
            }
        }
        coverage_outside.sort_by(|a, b| {
            b.excess
                .partial_cmp(&a.excess)
                .unwrap()
                .then(a.tensor.cmp(&b.tensor))
        });
    }
    let greedy = if v == Variant::Trunk { 0 } else { steps };
    Ok(summarize(v.name(), per, greedy, coverage_outside))
}

/// The trunk: each prompt through the trunk graph (prefill figures only).
fn prompt_by_prompt(
    f: &mut GraphBackend,
    q: &mut GraphBackend,
    tok: &Tokenizer,
    recs: &[Record],
    o: &GraphOptions,
    steps: usize,
    pb: &indicatif::ProgressBar,
) -> Result<Vec<PromptResult>> {
    let mut per = Vec::new();
    for r in recs {
        let ids = prompt_ids(tok, r, o.context, steps)?;
        hexq_runtime::Backend::reset(f);
        hexq_runtime::Backend::reset(q);
        let hf = f.hidden(&ids)?.pop().unwrap();
        let hq = q.hidden(&ids)?.pop().unwrap();
        let (lf, lq) = (f.logits(&hf)?, q.logits(&hq)?);
        per.push(PromptResult::prefill(
            &r.id,
            ids.len(),
            (&hf, &lf),
            (&hq, &lq),
        ));
        pb.inc(1);
    }
    Ok(per)
}

/// One held-out prompt in flight through both backends.
struct Job {
    index: usize,
    ids: Vec<u32>,
    cur: usize,
    steps_done: usize,
    slots: [hexq_runtime::graph::Slot; 2],
    logits: [Vec<f32>; 2],
    res: Option<PromptResult>,
}

/// Decode graphs: `batch` prompts side by side through float and quantsim, one batched step per call on
/// each (continuous batching). Every prompt token, then `steps` teacher-forced decode steps on float's
/// greedy token; quantsim agreeing on every step ⇔ its own greedy continuation is token-exact. Per prompt the
/// same calls, inputs and figures as one prompt at a time (`step_batch` and [`Head`] are exact per row):
/// the report does not depend on `batch`.
///
/// Unless `every_position` (an observer wants every tensor of every position), a prompt's inner positions
/// only write their KV ([`GraphBackend::step_chain_last`]: under KV sharing most of the decoder is skipped
/// there) — the scored hidden states and so every figure are the same values.
///
/// [`Head`]: hexq_runtime::graph::Head
#[allow(clippy::too_many_arguments)]
fn decode_batched(
    f: &mut GraphBackend,
    q: &mut GraphBackend,
    head: &hexq_runtime::graph::Head,
    prompts: &[(String, Vec<u32>)],
    steps: usize,
    batch: usize,
    every_position: bool,
    pb: &indicatif::ProgressBar,
) -> Result<Vec<PromptResult>> {
    let mut per: Vec<Option<PromptResult>> = vec![None; prompts.len()];
    let (mut jobs, mut next) = (Vec::<Job>::new(), 0);
    let (mut step_s, mut head_s) = (0f64, 0f64);
    loop {
        while jobs.len() < batch.max(1) && next < prompts.len() {
            jobs.push(Job {
                index: next,
                ids: prompts[next].1.clone(),
                cur: 0,
                steps_done: 0,
                slots: [f.new_slot(), q.new_slot()],
                logits: [vec![], vec![]],
                res: None,
            });
            next += 1;
        }
        if jobs.is_empty() {
            break;
        }
        // Prompt positions before the last first, `batch` of them per call chained (their hidden states are
        // not read); then, once no job has any left, one scored position per job per call — the prompt's
        // last, then each teacher-forced step — so the scored rows share their calls (the layers no KV
        // depends on and the head run for them alone).
        let mut take = vec![0usize; jobs.len()];
        let inner: Vec<usize> = jobs
            .iter()
            .map(|job| (job.ids.len() - job.cur).saturating_sub(1))
            .collect();
        if inner.iter().any(|&n| n > 0) {
            let mut budget = batch.max(1);
            for (t, &n) in take.iter_mut().zip(&inner) {
                if n > 0 && budget > 0 {
                    *t = 1;
                    budget -= 1;
                }
            }
            hexq_runtime::graph::spread(&mut take, &inner, budget);
        } else {
            for (j, job) in jobs.iter_mut().enumerate() {
                if job.cur < job.ids.len() {
                    take[j] = 1;
                } else if job.steps_done < steps {
                    let res = job.res.as_mut().unwrap();
                    let nf = argmax(&job.logits[0]);
                    if argmax(&job.logits[1]) != nf {
                        res.greedy_exact = false;
                    } else if res.greedy_exact {
                        res.greedy_agree_steps += 1;
                    }
                    job.steps_done += 1;
                    job.ids.push(nf);
                    take[j] = 1;
                }
            }
        }
        let idx: Vec<usize> = (0..jobs.len()).filter(|&j| take[j] > 0).collect();
        // Scored where the prompt is through: the prefill figures, then each decode step's.
        let scored: Vec<bool> = idx
            .iter()
            .map(|&j| jobs[j].cur + take[j] == jobs[j].ids.len())
            .collect();
        let mut hs = Vec::new();
        let ts = std::time::Instant::now();
        for (k, b) in [&mut *f, &mut *q].into_iter().enumerate() {
            let mut slots = Vec::new();
            let mut runs: Vec<&[u32]> = Vec::new();
            for (j, job) in jobs.iter_mut().enumerate() {
                if take[j] > 0 {
                    runs.push(&job.ids[job.cur..job.cur + take[j]]);
                    slots.push(&mut job.slots[k]);
                }
            }
            let h: Vec<Option<Vec<f32>>> = if every_position {
                b.step_chain(&mut slots, &runs)?
                    .into_iter()
                    .map(|mut h| h.pop())
                    .collect()
            } else {
                b.step_chain_last(&mut slots, &runs, &scored)?
            };
            hs.push(h);
        }
        step_s += ts.elapsed().as_secs_f64();
        let th = std::time::Instant::now();
        for &j in &idx {
            jobs[j].cur += take[j];
        }
        let want: Vec<usize> = (0..idx.len()).filter(|&r| scored[r]).collect();
        let rows: Vec<&[f32]> = (0..2)
            .flat_map(|k| want.iter().map(move |&r| (k, r)))
            .map(|(k, r)| hs[k][r].as_deref().unwrap())
            .collect();
        let mut ls = head.logits(&rows).into_iter();
        let lf: Vec<Vec<f32>> = ls.by_ref().take(want.len()).collect();
        for ((&r, lf), lq) in want.iter().zip(lf).zip(ls) {
            let (hf, hq) = (hs[0][r].as_deref().unwrap(), hs[1][r].as_deref().unwrap());
            let job = &mut jobs[idx[r]];
            match job.res.as_mut() {
                None => {
                    let id = &prompts[job.index].0;
                    job.res = Some(PromptResult::prefill(
                        id,
                        job.ids.len(),
                        (hf, &lf),
                        (hq, &lq),
                    ));
                }
                Some(res) => {
                    res.step_cosine.push(cos(hf, hq));
                    res.norm_ratio = res.norm_ratio.min(norm(hq) / norm(hf).max(1e-30));
                }
            }
            job.logits = [lf, lq];
        }
        head_s += th.elapsed().as_secs_f64();
        let mut j = 0;
        while j < jobs.len() {
            if jobs[j].cur == jobs[j].ids.len()
                && jobs[j].steps_done == steps
                && jobs[j].res.is_some()
            {
                let job = jobs.remove(j);
                per[job.index] = job.res;
                pb.inc(1);
            } else {
                j += 1;
            }
        }
    }
    if std::env::var_os("HEXQ_PROFILE").is_some() {
        eprintln!("verify: graph steps {step_s:.1} s, head and figures {head_s:.1} s");
    }
    Ok(per.into_iter().map(|p| p.unwrap()).collect())
}

/// Reference vs candidate on held-out prompts through the [`hexq_runtime::Hidden`] interface: the same
/// figures as [`verify`] (top-1, hidden cosine mean/min, KL, token-exact greedy over `steps` steps driven by the
/// reference's tokens, per-step decode cosine) for any two backends — float or quantsim vs the HTP simulator.
#[allow(clippy::too_many_arguments)]
pub fn compare(
    label: &str,
    reference: &mut dyn hexq_runtime::Hidden,
    cand: &mut (dyn hexq_runtime::Hidden + Send),
    tok: &Tokenizer,
    recs: &[Record],
    context: usize,
    steps: usize,
    pb: &indicatif::ProgressBar,
) -> Result<Report> {
    let mut r = compare_many(
        label,
        &mut [reference],
        &mut [cand],
        tok,
        recs,
        context,
        steps,
        pb,
    )?;
    Ok(r.remove(0).remove(0))
}

/// [`compare`] for several candidates against several references: each reference runs once (decode steps
/// driven by the first reference's greedy tokens) and the candidates run side by side on their own threads
/// (the HTP simulator is slow and single-threaded: two targets take the time of one). Reports
/// `[candidate][reference]`; every candidate sees exactly the calls it would see alone.
#[allow(clippy::too_many_arguments)]
pub fn compare_many(
    label: &str,
    refs: &mut [&mut dyn hexq_runtime::Hidden],
    cands: &mut [&mut (dyn hexq_runtime::Hidden + Send)],
    tok: &Tokenizer,
    recs: &[Record],
    context: usize,
    steps: usize,
    pb: &indicatif::ProgressBar,
) -> Result<Vec<Vec<Report>>> {
    type Hl = (Vec<f32>, Vec<f32>);
    // `f` on every candidate at once, the references' work `g` on this thread meanwhile.
    fn side_by_side<T>(
        cands: &mut [&mut (dyn hexq_runtime::Hidden + Send)],
        f: &(dyn Fn(&mut (dyn hexq_runtime::Hidden + Send)) -> Result<Hl> + Sync),
        g: impl FnOnce() -> Result<T>,
    ) -> Result<(Vec<Hl>, T)> {
        std::thread::scope(|s| {
            let hs: Vec<_> = cands
                .iter_mut()
                .map(|c| s.spawn(move || f(&mut **c)))
                .collect();
            let t = g();
            let out = hs
                .into_iter()
                .map(|h| h.join().expect("candidate thread panicked"))
                .collect::<Result<Vec<_>>>()?;
            Ok((out, t?))
        })
    }
    let mut per: Vec<Vec<Vec<PromptResult>>> = vec![vec![Vec::new(); refs.len()]; cands.len()];
    pb.set_length(recs.len() as u64);
    for r in recs {
        let ids = prompt_ids(tok, r, context, steps)?;
        let prefill = |c: &mut (dyn hexq_runtime::Hidden + Send)| -> Result<Hl> {
            c.reset_all();
            let h = c.hidden_all(&ids)?.pop().unwrap();
            let l = c.logits_of(&h)?;
            Ok((h, l))
        };
        let (mut cq, rf) = side_by_side(cands, &prefill, || {
            refs.iter_mut()
                .map(|rf| {
                    rf.reset_all();
                    let hf = rf.hidden_all(&ids)?.pop().unwrap();
                    let lf = rf.logits_of(&hf)?;
                    Ok((hf, lf))
                })
                .collect::<Result<Vec<Hl>>>()
        })?;
        for (c, (hq, lq)) in cq.iter().enumerate() {
            for (k, (hf, lf)) in rf.iter().enumerate() {
                per[c][k].push(PromptResult::prefill(&r.id, ids.len(), (hf, lf), (hq, lq)));
            }
        }
        let mut lfs: Vec<Vec<f32>> = rf.into_iter().map(|x| x.1).collect();
        for _ in 0..steps {
            let drive = argmax(&lfs[0]);
            for (c, (_, lq)) in cq.iter().enumerate() {
                for (k, lf) in lfs.iter().enumerate() {
                    let res = per[c][k].last_mut().unwrap();
                    if argmax(lq) != argmax(lf) {
                        res.greedy_exact = false;
                    } else if res.greedy_exact {
                        res.greedy_agree_steps += 1;
                    }
                }
            }
            let step = |c: &mut (dyn hexq_runtime::Hidden + Send)| -> Result<Hl> {
                let h = c.step_one(drive)?;
                let l = c.logits_of(&h)?;
                Ok((h, l))
            };
            let (q, rf) = side_by_side(cands, &step, || {
                refs.iter_mut()
                    .map(|rf| {
                        let hf = rf.step_one(drive)?;
                        let lf = rf.logits_of(&hf)?;
                        Ok((hf, lf))
                    })
                    .collect::<Result<Vec<Hl>>>()
            })?;
            cq = q;
            for (c, (hq, _)) in cq.iter().enumerate() {
                for (k, (hf, _)) in rf.iter().enumerate() {
                    let res = per[c][k].last_mut().unwrap();
                    res.step_cosine.push(cos(hf, hq));
                    res.norm_ratio = res.norm_ratio.min(norm(hq) / norm(hf).max(1e-30));
                }
            }
            lfs = rf.into_iter().map(|x| x.1).collect();
        }
        pb.inc(1);
    }
    Ok(per
        .into_iter()
        .map(|pc| {
            pc.into_iter()
                .map(|p| summarize(label, p, steps, vec![]))
                .collect()
        })
        .collect())
}

fn summarize(
    label: &str,
    per: Vec<PromptResult>,
    steps: usize,
    coverage_outside: Vec<Coverage>,
) -> Report {
    let n = per.len() as f64;
    let maxlen = per.iter().map(|p| p.step_cosine.len()).max().unwrap_or(0);
    let step_cosine_mean = (0..maxlen)
        .map(|s| {
            let v: Vec<f64> = per
                .iter()
                .filter_map(|p| p.step_cosine.get(s).copied())
                .collect();
            v.iter().sum::<f64>() / v.len() as f64
        })
        .collect();
    let norm_ratio_min = per
        .iter()
        .map(|p| p.norm_ratio)
        .fold(f64::INFINITY, f64::min);
    Report {
        variant: label.into(),
        prompts: per.len(),
        top1_agreement: per.iter().filter(|p| p.top1_agree).count() as f64 / n,
        cosine_mean: per.iter().map(|p| p.cosine).sum::<f64>() / n,
        cosine_min: per.iter().map(|p| p.cosine).fold(f64::INFINITY, f64::min),
        kl_mean: per.iter().map(|p| p.kl).sum::<f64>() / n,
        kl_max: per.iter().map(|p| p.kl).fold(0.0, f64::max),
        greedy_steps: steps,
        greedy_exact: per.iter().filter(|p| p.greedy_exact).count(),
        norm_ratio_min,
        collapsed: norm_ratio_min < 0.1,
        step_cosine_mean,
        coverage_outside,
        per_prompt: per,
    }
}

/// The report as `hexq verify` prints it: one Markdown table (with the coverage rows when stats were given).
pub fn markdown(r: &Report, with_coverage: bool) -> String {
    let mut s = format!(
        "| metric ({} on {} held-out prompts) | value |\n|---|---|\n",
        r.variant, r.prompts
    );
    let mut line = |l: String| {
        s += &l;
        s.push('\n');
    };
    line(format!(
        "| next-token top-1 agreement (prefill) | {:.1} % |",
        100.0 * r.top1_agreement
    ));
    line(format!(
        "| hidden cosine mean / min | {:.5} / {:.5} |",
        r.cosine_mean, r.cosine_min
    ));
    line(format!(
        "| KL(float ‖ quant) mean / max | {:.2e} / {:.2e} |",
        r.kl_mean, r.kl_max
    ));
    if r.greedy_steps > 0 {
        line(format!(
            "| token-exact greedy, {} steps | {}/{} |",
            r.greedy_steps, r.greedy_exact, r.prompts
        ));
        let tr: Vec<String> = r
            .step_cosine_mean
            .iter()
            .map(|c| format!("{c:.4}"))
            .collect();
        line(format!(
            "| decode cosine per step (mean) | {} |",
            tr.join(" → ")
        ));
    }
    let collapsed = if r.collapsed {
        "  COLLAPSED (< 0.1)"
    } else {
        ""
    };
    line(format!(
        "| final hidden norm ratio min (quant/float) | {:.3}{collapsed} |",
        r.norm_ratio_min
    ));
    if with_coverage {
        line(format!(
            "| tensors outside calibrated range on held-out | {} |",
            r.coverage_outside.len()
        ));
        for c in r.coverage_outside.iter().take(5) {
            line(format!(
                "|   {} | calib [{:.4}, {:.4}] held-out [{:.4}, {:.4}] (+{:.1} % of range) |",
                c.tensor,
                c.calibrated.0,
                c.calibrated.1,
                c.heldout.0,
                c.heldout.1,
                100.0 * c.excess
            ));
        }
    }
    s
}
