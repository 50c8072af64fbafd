#!/usr/bin/env python3
"""Make tests/fixtures/tiny-gemma3: a tiny random Gemma-3 text model saved by transformers' own save_pretrained
(Gemma3ForCausalLM, model_type gemma3_text, tensors under model.*, as google/gemma-3-270m), with the tiny
Gemma-4 fixture's tokenizer files, and golden outputs computed by transformers in float32.

What it exercises, against Gemma-4: RMSNorm by (1 + w) (norm weights drawn around 0, as trained Gemma-3
norms are), attention scaled by query_pre_attn_scalar^-1/2 (24: not head_dim, not a power of two), no
v_norm, no per-layer embeddings / KV sharing / layer scalar, no softcap, linear RoPE scaling (factor 8) on
full layers, a last layer that is sliding (Gemma-3 does not force it full), one KV head (as the 270M).

Deterministic: seeded, single-threaded torch, no network. Needs transformers==5.24.0, torch.
Run from the repo root after make_fixture.py:  python3 scripts/make_fixture_gemma3.py
Outputs (committed; random weights, no licence attached):
  tests/fixtures/tiny-gemma3/                  config.json, model.safetensors (f32), tokenizer files
  tests/fixtures/golden-gemma3/golden.json     ids, greedy continuations (cached and not)
  tests/fixtures/golden-gemma3/golden.safetensors  logits [S,V] and hidden states [L+2,S,H] per sequence
"""
import json
import shutil
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures"
TOK_SRC = FIX / "tiny-gemma4"
OUT = FIX / "tiny-gemma3"
GOLD = FIX / "golden-gemma3"
SEED = 4321
VOCAB = 4608


def build_config():
    return transformers.Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,  # sliding x5, full, sliding x2: the last layer is sliding
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=24,
        hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        sliding_window=16,
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        },
        tie_word_embeddings=True,
        pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )


def randomize(model):
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in model.model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(torch.rand(p.shape, generator=g) - 0.5)  # 1 + w in [0.5, 1.5]
            elif name == "embed_tokens.weight":
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 / p.shape[-1] ** 0.5))


def main():
    assert transformers.__version__ == "5.24.0", f"goldens are pinned to transformers 5.24.0, have {transformers.__version__}"
    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    for d in (OUT, GOLD):
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
    model = transformers.Gemma3ForCausalLM(build_config()).eval().float()
    randomize(model)
    model.save_pretrained(OUT)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TOK_SRC / f, OUT / f)
    model = transformers.Gemma3ForCausalLM.from_pretrained(OUT, dtype=torch.float32).eval()
    model.config._attn_implementation = "eager"
    tc = model.config
    tok = transformers.AutoTokenizer.from_pretrained(OUT)
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, tokenize=False)
    g = torch.Generator().manual_seed(SEED + 1)
    seqs = {
        "short": [2] + torch.randint(300, VOCAB, (6,), generator=g).tolist(),
        "long": [2] + torch.randint(300, VOCAB, (39,), generator=g).tolist(),  # 40 > sliding_window 16
        "chat": tok(chat, add_special_tokens=False)["input_ids"],
    }
    lm = model.model

    def hidden_trace(ids):
        outs = []
        hooks = [lm.embed_tokens.register_forward_hook(lambda m, i, o: outs.append(o[0].clone()))]
        for layer in lm.layers:
            hooks.append(layer.register_forward_hook(lambda m, i, o: outs.append((o[0] if isinstance(o, tuple) else o)[0].clone())))
        hooks.append(lm.norm.register_forward_hook(lambda m, i, o: outs.append(o[0].clone())))
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids]), use_cache=False)
        for h in hooks:
            h.remove()
        return out.logits[0], torch.stack(outs)

    def greedy(ids, n, use_cache):
        gen = []
        with torch.no_grad():
            if not use_cache:
                for _ in range(n):
                    gen.append(int(torch.argmax(model(input_ids=torch.tensor([ids + gen]), use_cache=False).logits[0, -1])))
                return gen
            out = model(input_ids=torch.tensor([ids]), use_cache=True)
            for _ in range(n):
                nxt = int(torch.argmax(out.logits[0, -1]))
                gen.append(nxt)
                out = model(input_ids=torch.tensor([[nxt]]), past_key_values=out.past_key_values, use_cache=True)
        return gen

    tensors = {}
    gold = {"transformers": transformers.__version__, "torch": torch.__version__, "seed": SEED,
            "layer_types": tc.layer_types, "sequences": {}}
    for name, ids in seqs.items():
        logits, hid = hidden_trace(ids)
        assert hid.shape[0] == tc.num_hidden_layers + 2, hid.shape
        tensors[f"{name}.logits"] = logits.contiguous()
        tensors[f"{name}.hidden"] = hid.contiguous()
        g_nc, g_c = greedy(ids, 8, False), greedy(ids, 8, True)
        assert g_nc == g_c, (name, g_nc, g_c)
        gold["sequences"][name] = {"ids": ids, "greedy8": g_c, "greedy8_uncached": g_nc,
                                   "max_abs_logit": float(logits.abs().max())}
    save_file(tensors, str(GOLD / "golden.safetensors"))
    (GOLD / "golden.json").write_text(json.dumps(gold, indent=1, ensure_ascii=False) + "\n")
    print("fixture:", sum(f.stat().st_size for f in OUT.iterdir()) / 1e6, "MB;", gold["layer_types"])


if __name__ == "__main__":
    main()
