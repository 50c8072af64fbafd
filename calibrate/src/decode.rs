//! The decode loops calibration observes: prompts side by side on the batched interpreter, each prompt
//! token then greedy tokens, one decode step per position.

use crate::Options;
use hexq_model::chat::{Tokenizer, STOP_IDS};
use hexq_model::dataset::Record;
use hexq_model::forward::argmax;
use hexq_model::{Checkpoint, Result};
use hexq_runtime::graph::GraphBackend;
use std::sync::Arc;

/// A record's ids: the chat template (or raw text), cut to leave room for the decode steps.
pub(crate) fn prompt_ids(tok: &Tokenizer, r: &Record, o: &Options) -> Result<Vec<u32>> {
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
