//! `hexq serve` answered by the real OpenAI Python client (tests/judges/openai_client.py): plain and streamed
//! replies equal `hexq run`'s, llama-server-style timings, the prompt cache, seeded sampling, 4xx errors, and
//! 200 sequential requests without an error or RSS growth beyond a bound.

mod common;

use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

/// The server, killed when dropped (a failing assertion must not leave it running).
struct Serve(Child);

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start() -> (Serve, String) {
    let mut c = Command::new(env!("CARGO_BIN_EXE_hexq"))
        .current_dir(common::root())
        .args(["serve", "--port", "0", "--json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(c.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let v: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"));
    (Serve(c), v["url"].as_str().unwrap().to_string())
}

#[test]
fn openai_client_streams_and_gets_timings_errors_and_steady_memory() {
    if !common::judge("openai") {
        return;
    }
    let (s, url) = start();
    let o = Command::new("python3")
        .arg(common::root().join("tests/judges/openai_client.py"))
        .args([url.as_str(), &s.0.id().to_string(), "200"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let r: Value = serde_json::from_slice(&o.stdout).unwrap();
    drop(s);

    // The plain reply is `hexq run`'s greedy reply to the same prompt.
    let run = common::hexq_ok(&[
        "run",
        "--prompt",
        "Hello there",
        "--max-tokens",
        "8",
        "--json",
    ]);
    let run: Value = serde_json::from_slice(&run.stdout).unwrap();
    let plain = &r["plain"];
    assert_eq!(plain["content"], run["text"], "{r}");
    assert_eq!(plain["object"], "chat.completion");
    assert_eq!(
        plain["usage"]["prompt_tokens"],
        run["prompt_ids"].as_array().unwrap().len()
    );
    let t = &plain["timings"];
    for k in [
        "prompt_n",
        "prompt_ms",
        "prompt_per_second",
        "predicted_n",
        "predicted_ms",
        "predicted_per_second",
    ] {
        assert!(t[k].is_number(), "timings.{k}: {t}");
    }
    assert_eq!(t["predicted_n"], plain["usage"]["completion_tokens"]);
    // Streamed: the same text, in more than one event, the finish reason and timings on the last chunk.
    let st = &r["stream"];
    assert_eq!(st["content"], plain["content"]);
    assert!(st["chunks"].as_u64().unwrap() >= 2, "{st}");
    assert_eq!(st["finish_reason"], plain["finish_reason"]);
    assert!(st["timings"]["predicted_per_second"].is_number(), "{st}");
    // Prompt cache: turn 2 feeds only what follows turn 1's prompt, and replies as a fresh prefill does.
    let c = &r["cache"];
    let (hit, fresh) = (&c["turn2_timings"], &c["turn2_fresh_timings"]);
    assert_eq!(hit["cache_n"], plain["usage"]["prompt_tokens"], "{c}");
    assert_eq!(
        hit["prompt_n"].as_u64().unwrap() + hit["cache_n"].as_u64().unwrap(),
        c["turn2_usage"]["prompt_tokens"].as_u64().unwrap()
    );
    assert_eq!(fresh["cache_n"], 0);
    assert_eq!(c["turn2"], c["turn2_fresh"]);
    assert_eq!(r["seeded"]["same"], true);
    // Bad requests: 4xx with an OpenAI-style error body, never a crash (the load below still runs).
    let e = &r["errors"];
    for (k, code) in [
        ("empty_messages", 400),
        ("bad_role", 400),
        ("bad_temperature", 400),
        ("n2", 400),
        ("not_json", 400),
        ("no_route", 404),
        ("wrong_method", 405),
        ("too_large", 413),
        ("too_long_prompt", 400),
    ] {
        assert_eq!(e[k]["status"], code, "{k}: {}", e[k]);
        let msg = e[k]["message"]
            .as_str()
            .or(e[k]["body"]["error"]["message"].as_str());
        assert!(msg.is_some_and(|m| !m.is_empty()), "{k}: {}", e[k]);
    }
    assert!(e["too_long_prompt"]["body"]["error"]["message"]
        .as_str()
        .unwrap()
        .contains("context_length_exceeded"));
    assert_eq!(r["health"]["status"], "ok");
    assert_eq!(r["models"][0], "tiny-gemma4");
    // 200 sequential requests: none fails; RSS grows by at most 8 MiB between the first 20 and the end
    // (measured: 1.8 MiB over 180; flat over 900 more).
    let l = &r["load"];
    assert_eq!(l["failures"], 0, "{l}");
    let growth =
        l["rss_kib_at_end"].as_i64().unwrap() - l["rss_kib_after_first_tenth"].as_i64().unwrap();
    assert!(growth <= 8192, "RSS grew {growth} KiB over the load: {l}");
}

#[test]
fn serve_refuses_a_taken_port() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port().to_string();
    let e = common::hexq_err(&["serve", "--port", &port]);
    assert!(
        e.contains(&format!("cannot listen on 127.0.0.1:{port}")),
        "{e}"
    );
}
