"""Drive `hexq serve` with the real OpenAI Python client (openai ≥ 1): non-streaming and streaming chat
completions, a continued conversation (prompt cache), seeded sampling, error statuses, then N sequential
requests while sampling the server's RSS. Prints one JSON report on stdout; the Rust test asserts on it.

usage: openai_client.py URL SERVER_PID N_REQUESTS
"""

import json
import sys
import time

import urllib.error
import urllib.request

import openai


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def http(url, method, data):
    """Status and JSON body of a raw request (stdlib only)."""
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            status, body = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read()
    try:
        return {"status": status, "body": json.loads(body)}
    except ValueError:
        return {"status": status, "body": body.decode(errors="replace")}


def main():
    url, pid, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    rep = {}
    hello = [{"role": "user", "content": "Hello there"}]

    r = c.chat.completions.create(model="any", messages=hello, max_tokens=8)
    rep["plain"] = {
        "content": r.choices[0].message.content,
        "finish_reason": r.choices[0].finish_reason,
        "usage": r.usage.model_dump(),
        "timings": (r.model_extra or {}).get("timings"),
        "object": r.object,
    }

    # Streaming: deltas in order; the last chunk carries finish_reason, usage and timings.
    pieces, finish, t_first, t0, last = [], None, None, time.time(), None
    for ch in c.chat.completions.create(model="any", messages=hello, max_tokens=8, stream=True):
        last = ch
        d = ch.choices[0].delta
        if d.content:
            t_first = t_first or time.time() - t0
            pieces.append(d.content)
        finish = ch.choices[0].finish_reason or finish
    rep["stream"] = {
        "content": "".join(pieces),
        "chunks": len(pieces),
        "finish_reason": finish,
        "timings": (last.model_extra or {}).get("timings"),
    }

    # A continued conversation: turn 2's ids extend what the backend holds (turn 1's prompt; with max_tokens 1
    # the one reply token is sampled, not fed), so only the new ids are fed. (A longer reply is cached too when
    # its text re-tokenizes to the same ids; the tiny model's <unusedN> replies do not.)
    t1 = c.chat.completions.create(model="any", messages=hello, max_tokens=1)
    conv = hello + [
        {"role": "assistant", "content": t1.choices[0].message.content},
        {"role": "user", "content": "And then?"},
    ]
    t2 = c.chat.completions.create(model="any", messages=conv, max_tokens=6)
    c.chat.completions.create(model="any", messages=[{"role": "user", "content": "unrelated"}], max_tokens=2)
    t2_fresh = c.chat.completions.create(model="any", messages=conv, max_tokens=6)
    rep["cache"] = {
        "turn2": t2.choices[0].message.content,
        "turn2_timings": t2.model_extra["timings"],
        "turn2_fresh": t2_fresh.choices[0].message.content,
        "turn2_fresh_timings": t2_fresh.model_extra["timings"],
        "turn2_usage": t2.usage.model_dump(),
    }

    # Seeded sampling: the same seed gives the same reply; extra llama.cpp-style fields pass through.
    kw = dict(model="any", messages=hello, max_tokens=8, temperature=1.5, top_p=0.95, seed=7,
              extra_body={"top_k": 40, "min_p": 0.01})
    a, b = (c.chat.completions.create(**kw).choices[0].message.content for _ in range(2))
    rep["seeded"] = {"same": a == b, "content": a}

    # Errors: the client raises the matching status errors; raw requests get JSON error bodies.
    errs = {}
    for name, call in [
        ("empty_messages", lambda: c.chat.completions.create(model="any", messages=[], max_tokens=4)),
        ("bad_role", lambda: c.chat.completions.create(model="any", messages=[{"role": "robot", "content": "x"}])),
        ("bad_temperature", lambda: c.chat.completions.create(model="any", messages=hello, temperature=-1)),
        ("n2", lambda: c.chat.completions.create(model="any", messages=hello, n=2)),
    ]:
        try:
            call()
            errs[name] = None
        except openai.APIStatusError as e:
            errs[name] = {"status": e.status_code, "message": e.body.get("message") if isinstance(e.body, dict) else str(e.body)}
    long_prompt = json.dumps({"messages": [{"role": "user", "content": "word " * 5000}]}).encode()
    for name, method, path, data in [
        ("not_json", "POST", "/v1/chat/completions", b"{nope"),
        ("no_route", "GET", "/v2/whatever", None),
        ("wrong_method", "DELETE", "/health", None),
        ("too_large", "POST", "/v1/chat/completions", b" " * (5 << 20)),
        ("too_long_prompt", "POST", "/v1/chat/completions", long_prompt),
    ]:
        errs[name] = http(url + path, method, data)
    rep["errors"] = errs
    rep["health"] = http(url + "/health", "GET", None)["body"]
    rep["models"] = [m.id for m in c.models.list().data]

    # Load: n sequential requests, alternating plain and streamed; RSS after the first tenth and at the end.
    failures, empty, rss = 0, 0, []
    t0 = time.time()
    for i in range(n):
        msgs = [{"role": "user", "content": f"Request {i}: say something about the number {i}."}]
        try:
            if i % 2:
                text = "".join(ch.choices[0].delta.content or "" for ch in
                               c.chat.completions.create(model="any", messages=msgs, max_tokens=4, stream=True))
            else:
                text = c.chat.completions.create(model="any", messages=msgs, max_tokens=4).choices[0].message.content
            empty += not text  # a stop token first: a valid, empty reply
        except Exception as e:  # noqa: BLE001 — every failure counts
            failures += 1
            print(f"request {i}: {e}", file=sys.stderr)
        if i + 1 == max(1, n // 10) or i + 1 == n:
            rss.append(rss_kib(pid))
    rep["load"] = {"requests": n, "failures": failures, "empty_replies": empty, "seconds": time.time() - t0,
                   "rss_kib_after_first_tenth": rss[0], "rss_kib_at_end": rss[-1]}
    print(json.dumps(rep))


if __name__ == "__main__":
    main()
