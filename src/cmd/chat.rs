//! `hexq chat`: multi-turn chat on any backend, one user turn per stdin line. The KV cache is kept across
//! turns: only the new turn is fed (the template's text after what the cache already holds), tokens are
//! streamed as they are produced, and each turn reports TTFT and decode tokens/s. `/reset` forgets the
//! conversation, `/quit` (or end of input) ends it; a turn that would not fit the backend's positions is
//! refused with the count and the hint to `/reset`.

use super::run::{self, BackendKind};
use anyhow::Result;
use hexq_model::chat::{Message, STOP_IDS};
use hexq_runtime::sample::Sampler;
use serde_json::json;
use std::io::{BufRead, Write};
use std::time::Instant;

#[derive(clap::Args, Clone)]
pub struct Args {
    #[command(flatten)]
    pub b: run::BackendArgs,
    /// Optional system turn at the start of every conversation.
    #[arg(long)]
    pub system: Option<String>,
    /// Most tokens per reply.
    #[arg(long, default_value_t = 256, value_parser = super::positive)]
    pub max_tokens: usize,
    #[command(flatten)]
    pub sampling: run::SamplingArgs,
    /// At the end, print every turn as JSON on stdout (ids fed, ids generated, text, timings) instead of
    /// streaming the replies.
    #[arg(long)]
    pub json: bool,
}

fn run_args(a: &Args) -> run::Args {
    run::Args {
        b: a.b.clone(),
        sampling: a.sampling.clone(),
        ..run::Args::new(None, a.b.backend, "", a.max_tokens)
    }
}

/// The conversation: the messages, and the template text the KV cache holds (everything fed so far).
struct Conversation {
    msgs: Vec<Message>,
    in_cache: String,
    /// Every id of the conversation; the backend has been fed `ids[..fed]` (a reply cut at --max-tokens
    /// leaves its last token unfed until the next turn).
    ids: Vec<u32>,
    fed: usize,
}

impl Conversation {
    fn new(system: &Option<String>) -> Self {
        let mut msgs = Vec::new();
        if let Some(s) = system {
            msgs.push(Message {
                role: "system".into(),
                content: s.clone(),
            });
        }
        Conversation {
            msgs,
            in_cache: String::new(),
            ids: Vec::new(),
            fed: 0,
        }
    }
}

pub fn run(a: Args) -> Result<()> {
    let ra = run_args(&a);
    let sampling = ra.sampling.sampling();
    let quiet = matches!(a.b.backend, BackendKind::Qnn).then(super::StdoutToStderr::new);
    let (mut b, tok) = run::open_backend(&ra.b)?;
    drop(quiet);
    let mut sampler = Sampler::new(sampling);
    let mut conv = Conversation::new(&a.system);
    b.reset();
    let mut turns = Vec::new();
    let stdin = std::io::stdin();
    for line in stdin.lock().lines() {
        let line = line?;
        let text = line.trim();
        if text.is_empty() {
            continue;
        }
        if text == "/quit" {
            break;
        }
        if text == "/reset" {
            b.reset();
            conv = Conversation::new(&a.system);
            eprintln!("[conversation reset]");
            continue;
        }
        conv.msgs.push(Message::user(text));
        let full = tok.render_chat(&conv.msgs, true)?;
        // Only what the cache does not hold yet; a template that rewrites earlier turns means starting over.
        let delta_text = match full.strip_prefix(conv.in_cache.as_str()) {
            Some(d) => d.to_string(),
            None => {
                eprintln!(
                    "[the template rewrote earlier turns: prefilling the whole conversation]"
                );
                b.reset();
                conv.ids.clear();
                conv.fed = 0;
                full.clone()
            }
        };
        let delta = tok.encode(&delta_text)?;
        if let Some(cap) = b.capacity() {
            if conv.ids.len() + delta.len() + 1 > cap {
                eprintln!(
                    "[context full: this turn needs {} positions, {} of {cap} are used — /reset to start over]",
                    delta.len() + 1,
                    conv.ids.len()
                );
                conv.msgs.pop();
                continue;
            }
        }
        let t0 = Instant::now();
        conv.ids.extend(&delta);
        let mut logits = b.feed(&conv.ids[conv.fed..])?;
        conv.fed = conv.ids.len();
        let ttft = t0.elapsed().as_secs_f64();
        let fed = delta.clone();
        let t1 = Instant::now();
        let mut gen: Vec<u32> = Vec::new();
        let mut shown = String::new();
        let mut reason = "max_tokens";
        loop {
            let next = sampler.next(&logits, &conv.ids);
            if STOP_IDS.contains(&next) {
                reason = "stop_token";
                break;
            }
            gen.push(next);
            conv.ids.push(next);
            if !a.json {
                // Stream: print what decoding the reply so far adds to what is already shown.
                let s = tok.decode(&gen, false)?;
                if let Some(add) = s.strip_prefix(shown.as_str()) {
                    print!("{add}");
                    std::io::stdout().flush()?;
                }
                shown = s;
            }
            if gen.len() >= a.max_tokens {
                break;
            }
            if b.capacity().is_some_and(|c| conv.ids.len() >= c) {
                reason = "context_full";
                break;
            }
            logits = b.feed(&[next])?;
            conv.fed = conv.ids.len();
        }
        let decode_s = t1.elapsed().as_secs_f64();
        let reply = tok.decode(&gen, false)?;
        conv.in_cache = full + &reply;
        conv.msgs.push(Message {
            role: "assistant".into(),
            content: reply.clone(),
        });
        let tps = if decode_s > 0.0 {
            gen.len().saturating_sub(1) as f64 / decode_s
        } else {
            0.0
        };
        if !a.json {
            println!();
        }
        eprintln!(
            "[turn {}: {} tokens fed, {} generated ({reason}), TTFT {:.3}s, decode {:.1} tok/s]",
            turns.len() + 1,
            fed.len(),
            gen.len(),
            ttft,
            tps
        );
        if reason == "context_full" {
            eprintln!("[context full: /reset to start over]");
        }
        turns.push(
            json!({"fed_ids": fed, "generated_ids": gen, "text": reply, "stop_reason": reason,
                          "ttft_seconds": ttft, "decode_tokens_per_second": tps}),
        );
    }
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({"backend": b.name(), "turns": turns}))?
        );
    }
    Ok(())
}
