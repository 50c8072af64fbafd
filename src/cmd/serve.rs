//! `hexq serve`: an OpenAI-compatible HTTP server over any backend — `POST /v1/chat/completions` (JSON, or
//! server-sent events with `"stream": true`), `GET /v1/models`, `GET /health`.
//!
//! One model, loaded once; requests are answered one at a time in arrival order (tiny_http queues the rest),
//! each with llama-server's `timings` (prompt_n, prompt_ms, predicted_per_second …). Like llama-server's
//! prompt cache, a request whose templated ids start with what the backend already holds (the previous
//! request's prompt and reply — the next turn of the same chat) feeds only the new ids (`timings.cache_n`).
//! Bad requests get a 4xx with an OpenAI-style `{"error": {...}}` body; a client that disconnects mid-stream
//! stops its generation. HTTP via `tiny_http` (synchronous, four small dependencies, no async runtime: the
//! model runs one request at a time on this thread anyway).

use super::run::{self, BackendKind};
use anyhow::{anyhow, Result};
use hexq_model::chat::{Message, Tokenizer, STOP_IDS};
use hexq_runtime::sample::{Sampler, Sampling};
use hexq_runtime::Backend;
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

#[derive(clap::Args, Clone)]
pub struct Args {
    #[command(flatten)]
    pub b: run::BackendArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port (0: any free port; the address is printed).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Most tokens per reply when a request does not say (`max_tokens`).
    #[arg(long, default_value_t = 256, value_parser = super::positive)]
    pub max_tokens: usize,
    /// Defaults for requests that do not set them (a request's own fields win).
    #[command(flatten)]
    pub sampling: run::SamplingArgs,
    /// Print the listening address as one JSON line on stdout.
    #[arg(long)]
    pub json: bool,
}

/// A request refused: HTTP status and message.
struct Reject(u16, String);

fn reject<T>(code: u16, msg: impl Into<String>) -> std::result::Result<T, Reject> {
    Err(Reject(code, msg.into()))
}

/// What a chat-completions request asks for, validated.
struct ChatRequest {
    messages: Vec<Message>,
    stream: bool,
    max_tokens: usize,
    sampling: Sampling,
}

/// Text of a message's `content`: a string, or an array of `{"type": "text", "text": …}` parts.
fn content_text(c: &Value, i: usize) -> std::result::Result<String, Reject> {
    match c {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => parts
            .iter()
            .map(|p| match (p["type"].as_str(), p["text"].as_str()) {
                (Some("text"), Some(t)) => Ok(t.to_string()),
                _ => reject(
                    400,
                    format!("messages[{i}].content: only text parts are supported, got {p}"),
                ),
            })
            .collect(),
        _ => reject(
            400,
            format!("messages[{i}].content must be a string or an array of text parts"),
        ),
    }
}

fn parse_request(
    body: &[u8],
    defaults: &Sampling,
    max_default: usize,
) -> std::result::Result<ChatRequest, Reject> {
    let v: Value =
        serde_json::from_slice(body).or_else(|e| reject(400, format!("invalid JSON body: {e}")))?;
    if !v.is_object() {
        return reject(400, "the body must be a JSON object");
    }
    let msgs = v["messages"].as_array().filter(|m| !m.is_empty());
    let Some(msgs) = msgs else {
        return reject(400, "\"messages\" must be a non-empty array");
    };
    let mut messages = Vec::new();
    for (i, m) in msgs.iter().enumerate() {
        let role = match m["role"].as_str() {
            Some(r @ ("system" | "user" | "assistant")) => r,
            Some("developer") => "system",
            _ => {
                return reject(
                    400,
                    format!(
                        "messages[{i}].role: {} (system, developer, user or assistant)",
                        m["role"]
                    ),
                )
            }
        };
        messages.push(Message {
            role: role.into(),
            content: content_text(&m["content"], i)?,
        });
    }
    let num = |k: &str| -> std::result::Result<Option<f64>, Reject> {
        match &v[k] {
            Value::Null => Ok(None),
            Value::Number(n) => Ok(n.as_f64()),
            x => reject(400, format!("\"{k}\" must be a number, got {x}")),
        }
    };
    let uint = |k: &str| -> std::result::Result<Option<u64>, Reject> {
        match &v[k] {
            Value::Null => Ok(None),
            x => x.as_u64().map(Some).ok_or(()).or_else(|_| {
                reject(
                    400,
                    format!("\"{k}\" must be a non-negative integer, got {x}"),
                )
            }),
        }
    };
    if uint("n")?.is_some_and(|n| n != 1) {
        return reject(400, "\"n\": this server returns one choice");
    }
    let max_tokens = uint("max_completion_tokens")?
        .or(uint("max_tokens")?)
        .unwrap_or(max_default as u64);
    if max_tokens == 0 {
        return reject(400, "\"max_tokens\" must be at least 1");
    }
    let mut s = defaults.clone();
    if let Some(x) = num("temperature")? {
        s.temperature = x as f32;
    }
    if let Some(x) = num("top_p")? {
        s.top_p = x as f32;
    }
    if let Some(x) = num("min_p")? {
        s.min_p = x as f32;
    }
    if let Some(x) = num("repeat_penalty")? {
        s.repeat_penalty = x as f32;
    }
    if let Some(x) = uint("top_k")? {
        s.top_k = x as usize;
    }
    if let Some(x) = uint("seed")? {
        s.seed = x;
    }
    s.check().or_else(|e| {
        reject(
            400,
            format!("invalid sampling value {}", e.trim_start_matches("--")),
        )
    })?;
    let stream = match &v["stream"] {
        Value::Null => false,
        Value::Bool(b) => *b,
        x => return reject(400, format!("\"stream\" must be a boolean, got {x}")),
    };
    Ok(ChatRequest {
        messages,
        stream,
        max_tokens: max_tokens as usize,
        sampling: s,
    })
}

/// The server's state: the backend, and the ids it has been fed since its last reset (the prompt cache).
struct Server {
    b: Box<dyn Backend>,
    tok: Tokenizer,
    model: String,
    fed: Vec<u32>,
    defaults: Sampling,
    max_tokens: usize,
    served: u64,
}

/// One finished (or cut) completion.
struct Done {
    text: String,
    finish: &'static str,
    prompt_tokens: usize,
    completion_tokens: usize,
    timings: Value,
}

impl Server {
    /// Run one completion; `emit` gets each piece of text as it becomes final and returns false when the
    /// client is gone (generation stops).
    /// The request's templated ids, refused when they do not fit the backend (checked before any reply).
    fn prompt_ids(&self, r: &ChatRequest) -> std::result::Result<Vec<u32>, Reject> {
        let ids = self
            .tok
            .encode_chat(&r.messages)
            .or_else(|e| reject(400, format!("chat template: {e}")))?;
        match self.b.capacity() {
            Some(cap) if ids.len() + 1 > cap => reject(400, format!(
                "context_length_exceeded: the prompt has {} tokens; the {} backend holds {cap} positions",
                ids.len(), self.b.name())),
            _ => Ok(ids),
        }
    }

    fn complete(
        &mut self,
        ids: Vec<u32>,
        r: &ChatRequest,
        emit: &mut dyn FnMut(&str) -> bool,
    ) -> std::result::Result<Done, Reject> {
        // Prompt cache: continue from what the backend holds when the new prompt extends it.
        let cache_n = if ids.len() > self.fed.len() && ids.starts_with(&self.fed) {
            self.fed.len()
        } else {
            self.b.reset();
            self.fed.clear();
            0
        };
        let name = self.b.name().to_string();
        let internal = |e: hexq_runtime::Error| Reject(500, format!("{name} backend: {e}"));
        let t0 = Instant::now();
        let mut logits = self.b.feed(&ids[cache_n..]).map_err(internal)?;
        self.fed = ids.clone();
        let prompt_s = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let mut sampler = Sampler::new(r.sampling.clone());
        let mut history = ids.clone();
        let (mut gen, mut shown, mut finish) = (Vec::<u32>::new(), String::new(), "length");
        loop {
            let next = sampler.next(&logits, &history);
            if STOP_IDS.contains(&next) {
                finish = "stop";
                break;
            }
            gen.push(next);
            history.push(next);
            let s = self
                .tok
                .decode(&gen, false)
                .map_err(|e| Reject(500, e.to_string()))?;
            // Text is final once decoding more tokens cannot change it (a split UTF-8 sequence shows as U+FFFD).
            if let Some(add) = s
                .strip_prefix(shown.as_str())
                .filter(|a| !a.ends_with('\u{FFFD}'))
            {
                if !add.is_empty() && !emit(add) {
                    finish = "cancelled";
                    break;
                }
                shown = s;
            }
            if gen.len() >= r.max_tokens || self.b.capacity().is_some_and(|c| history.len() >= c) {
                break;
            }
            logits = self.b.feed(&[next]).map_err(internal)?;
            self.fed.push(next);
        }
        let text = self
            .tok
            .decode(&gen, false)
            .map_err(|e| Reject(500, e.to_string()))?;
        if let Some(add) = text.strip_prefix(shown.as_str()).filter(|a| !a.is_empty()) {
            emit(add);
        }
        let predicted_s = t1.elapsed().as_secs_f64();
        let prompt_n = ids.len() - cache_n;
        let per = |n: usize, s: f64| if n > 0 && s > 0.0 { n as f64 / s } else { 0.0 };
        let timings = json!({
            "cache_n": cache_n,
            "prompt_n": prompt_n,
            "prompt_ms": prompt_s * 1e3,
            "prompt_per_token_ms": if prompt_n > 0 { prompt_s * 1e3 / prompt_n as f64 } else { 0.0 },
            "prompt_per_second": per(prompt_n, prompt_s),
            "predicted_n": gen.len(),
            "predicted_ms": predicted_s * 1e3,
            "predicted_per_token_ms": if gen.is_empty() { 0.0 } else { predicted_s * 1e3 / gen.len() as f64 },
            "predicted_per_second": per(gen.len(), predicted_s),
        });
        self.served += 1;
        Ok(Done {
            text,
            finish,
            prompt_tokens: ids.len(),
            completion_tokens: gen.len(),
            timings,
        })
    }

    fn id(&self) -> String {
        format!("chatcmpl-hexq-{}", self.served)
    }
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn json_response(code: u16, v: &Value) -> tiny_http::Response<std::io::Cursor<Vec<u8>>> {
    let h = tiny_http::Header::from_bytes("Content-Type", "application/json").unwrap();
    tiny_http::Response::from_data(serde_json::to_vec(v).unwrap_or_default())
        .with_status_code(code)
        .with_header(h)
}

fn error_body(code: u16, msg: &str) -> Value {
    let ty = match code {
        404 => "not_found_error",
        405 => "method_not_allowed",
        413 => "request_too_large",
        500 => "server_error",
        _ => "invalid_request_error",
    };
    json!({"error": {"message": msg, "type": ty, "code": code}})
}

const MAX_BODY: usize = 4 << 20;

fn read_body(req: &mut tiny_http::Request) -> std::result::Result<Vec<u8>, Reject> {
    let mut body = Vec::new();
    req.as_reader()
        .take(MAX_BODY as u64 + 1)
        .read_to_end(&mut body)
        .or_else(|e| reject(400, format!("reading the body: {e}")))?;
    if body.len() > MAX_BODY {
        return reject(413, format!("the body is over {MAX_BODY} bytes"));
    }
    Ok(body)
}

/// A streamed reply: HTTP/1.1 chunked transfer written by hand, one chunk per server-sent event, flushed —
/// so each token reaches the client when it is produced.
struct Sse(Box<dyn Write + Send>);

impl Sse {
    fn start(req: tiny_http::Request) -> std::io::Result<Sse> {
        let mut w = req.into_writer();
        w.write_all(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n\
                      Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n",
        )?;
        w.flush()?;
        Ok(Sse(w))
    }
    fn event(&mut self, data: &str) -> bool {
        let ev = format!("data: {data}\n\n");
        let r = write!(self.0, "{:x}\r\n{ev}\r\n", ev.len()).and_then(|_| self.0.flush());
        r.is_ok()
    }
    fn end(mut self) {
        let _ = self.0.write_all(b"0\r\n\r\n").and_then(|_| self.0.flush());
    }
}

fn chat_completions(s: &mut Server, mut req: tiny_http::Request) {
    let parsed = read_body(&mut req).and_then(|b| parse_request(&b, &s.defaults, s.max_tokens));
    let r = match parsed {
        Ok(r) => r,
        Err(Reject(c, m)) => return respond(req, c, &error_body(c, &m)),
    };
    let ids = match s.prompt_ids(&r) {
        Ok(ids) => ids,
        Err(Reject(c, m)) => return respond(req, c, &error_body(c, &m)),
    };
    let (id, created, model) = (s.id(), now(), s.model.clone());
    if !r.stream {
        let done = s.complete(ids, &r, &mut |_| true);
        let v = match done {
            Ok(d) => {
                json!({"id": id, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": d.text},
                             "finish_reason": d.finish}],
                "usage": {"prompt_tokens": d.prompt_tokens, "completion_tokens": d.completion_tokens,
                          "total_tokens": d.prompt_tokens + d.completion_tokens},
                "timings": d.timings})
            }
            Err(Reject(c, m)) => return respond(req, c, &error_body(c, &m)),
        };
        return respond(req, 200, &v);
    }
    let Ok(mut sse) = Sse::start(req) else { return };
    let chunk = |delta: Value, finish: Value| {
        json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
    };
    let mut alive =
        sse.event(&chunk(json!({"role": "assistant", "content": ""}), Value::Null).to_string());
    let done = s.complete(ids, &r, &mut |t| {
        alive = alive && sse.event(&chunk(json!({"content": t}), Value::Null).to_string());
        alive
    });
    match done {
        Ok(d) => {
            let mut last = chunk(json!({}), json!(d.finish));
            last["usage"] = json!({"prompt_tokens": d.prompt_tokens, "completion_tokens": d.completion_tokens,
                                   "total_tokens": d.prompt_tokens + d.completion_tokens});
            last["timings"] = d.timings;
            sse.event(&last.to_string());
        }
        Err(Reject(c, m)) => {
            sse.event(&error_body(c, &m).to_string());
        }
    }
    sse.event("[DONE]");
    sse.end();
}

fn respond(req: tiny_http::Request, code: u16, v: &Value) {
    let _ = req.respond(json_response(code, v));
}

pub fn run(a: Args) -> Result<()> {
    let ra = run::Args {
        b: a.b.clone(),
        sampling: a.sampling.clone(),
        ..run::Args::new(None, a.b.backend, "", a.max_tokens)
    };
    let defaults = ra.sampling.sampling();
    let quiet = matches!(a.b.backend, BackendKind::Qnn).then(super::StdoutToStderr::new);
    let (b, tok) = run::open_backend(&ra.b)?;
    drop(quiet);
    let model =
        a.b.model
            .as_ref()
            .or(a.b.artifacts.first())
            .or(a.b.gguf.as_ref())
            .and_then(|p| p.file_name())
            .map_or("tiny-gemma4".to_string(), |n| {
                n.to_string_lossy().into_owned()
            });
    let server = tiny_http::Server::http((a.host.as_str(), a.port))
        .map_err(|e| anyhow!("cannot listen on {}:{}: {e}", a.host, a.port))?;
    let addr = server
        .server_addr()
        .to_ip()
        .ok_or_else(|| anyhow!("not an IP listener"))?;
    eprintln!(
        "hexq serve: {} backend, model {model}, listening on http://{addr}",
        b.name()
    );
    if a.json {
        println!(
            "{}",
            json!({"url": format!("http://{addr}"), "backend": b.name(), "model": model})
        );
        std::io::stdout().flush()?;
    }
    let mut s = Server {
        b,
        tok,
        model,
        fed: Vec::new(),
        defaults,
        max_tokens: a.max_tokens,
        served: 0,
    };
    for req in server.incoming_requests() {
        let path = req.url().split('?').next().unwrap_or("").to_string();
        match (req.method(), path.as_str()) {
            (tiny_http::Method::Get, "/health") => respond(req, 200, &json!({"status": "ok"})),
            (tiny_http::Method::Get, "/v1/models") => {
                let v = json!({"object": "list", "data": [{"id": s.model, "object": "model", "created": now(),
                                                           "owned_by": "hexq"}]});
                respond(req, 200, &v)
            }
            (tiny_http::Method::Post, "/v1/chat/completions") => chat_completions(&mut s, req),
            (_, "/health" | "/v1/models" | "/v1/chat/completions") => {
                let m = format!("{} {path}: method not allowed", req.method());
                respond(req, 405, &error_body(405, &m))
            }
            _ => {
                let m = format!("no route {path}");
                respond(req, 404, &error_body(404, &m))
            }
        }
    }
    Ok(())
}
