#!/usr/bin/env python3
"""Make tests/fixtures/tiny-gemma4: a tiny random Gemma-4 checkpoint saved by transformers' own
save_pretrained (Gemma4ForConditionalGeneration, tensors under model.language_model.*, as the real
gemma-4-E2B-it), a Gemma-style BPE tokenizer with the real special-token ids, and golden outputs computed
by transformers in float32.

Deterministic: seeded, single-threaded torch, no network. Needs transformers==5.23.0, torch, tokenizers.
Run from the repo root:  python3 scripts/make_fixture.py
Outputs (committed, so CI never needs torch):
  tests/fixtures/tiny-gemma4/          config.json, model.safetensors (f32), tokenizer.json,
                                       tokenizer_config.json, chat_template.jinja, ...
  tests/fixtures/tiny-gemma4-bf16/     the same model re-saved by transformers as bf16
  tests/fixtures/golden/golden.json    ids, greedy continuations, chat-template renders, derived config facts
  tests/fixtures/golden/golden.safetensors  logits [S,V] and hidden states [L+2,S,H] per sequence
"""
import json
import os
import shutil
import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures"
OUT = FIX / "tiny-gemma4"
OUT_BF16 = FIX / "tiny-gemma4-bf16"
GOLD = FIX / "golden"

SEED = 1234
VOCAB = 4608  # holds the real special ids 105, 106, 107, 2364, 4368
SPECIAL_FIXED = {0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 4: "<mask>", 105: "<|turn>", 106: "<turn|>"}
NORMAL_FIXED = {107: "\n", 2364: "user", 4368: "model"}

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<|turn>' + role + '\n' + message['content'] + '<turn|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|turn>model\n' }}{% endif %}"
)

CORPUS_LINES = [
    "The capital of France is Paris.", "What is the capital of Italy?", "Name a planet with rings.",
    "Write a short poem about the sea.", "def add(a, b):\n    return a + b", "1 + 1 = 2, 2 * 3 = 6, 10 / 4 = 2.5",
    "Explain quantization in one sentence.", "The quick brown fox jumps over the lazy dog.",
    "Bonjour, comment allez-vous ?", "Wie spät ist es?", "¿Dónde está la biblioteca?",
    "A neural network maps inputs to outputs.", "int8 weights and int16 activations on the Hexagon NPU.",
    "The model answers the user in a friendly tone.", "Summarize the following text in three bullet points.",
    "for i in range(10):\n    print(i)", "Translate to German: good morning.", "Hello! How can I help you today?",
]


def build_tokenizer(tmp: Path) -> "transformers.PreTrainedTokenizerBase":
    # Corpus: chat-shaped text so "user", "model" and "\n" become tokens of their own.
    corpus = []
    for i in range(60):
        for line in CORPUS_LINES:
            corpus.append(f"user\n{line}\nmodel\n{line} user model")
    t = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    t.normalizer = normalizers.Replace(" ", "▁")
    t.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    trainer = trainers.BpeTrainer(vocab_size=1400, min_frequency=2, show_progress=False, special_tokens=[])
    t.train_from_iterator(corpus, trainer)
    trained = json.loads(t.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    # As in Gemma's vocabulary, "\n" stays a token of its own: drop every merge that would glue it to text.
    merges = [m for m in merges if "\n" not in m[0] + m[1]]
    produced = {m[0] + m[1] for m in merges}
    tvocab = {t: i for t, i in trained["vocab"].items() if len(t) == 1 or t in produced}
    for need in ["user", "model", "\n"]:
        assert need in tvocab, f"trainer did not learn {need!r}"

    vocab = {}
    used = set()
    for i, s in SPECIAL_FIXED.items():
        vocab[s] = i
        used.add(i)
    for i, s in NORMAL_FIXED.items():
        vocab[s] = i
        used.add(i)
    free = (i for i in range(VOCAB) if i not in used)
    # Gemma vocabularies carry the 256 byte-fallback pieces.
    for b in range(256):
        i = next(free)
        vocab[f"<0x{b:02X}>"] = i
        used.add(i)
    for tok, _ in sorted(tvocab.items(), key=lambda kv: kv[1]):
        if tok in vocab:
            continue
        i = next(free)
        vocab[tok] = i
        used.add(i)
    n = 0
    for i in list(free):
        vocab[f"<unused{n}>"] = i
        n += 1
    assert sorted(vocab.values()) == list(range(VOCAB))

    tok = transformers.GemmaTokenizer(vocab=vocab, merges=merges)
    tok.add_special_tokens({"additional_special_tokens": ["<|turn>", "<turn|>"]})
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(tmp)
    # llama.cpp's converter (gguf-py LlamaHfVocab) looks for the turn markers under this key.
    tc_path = tmp / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["additional_special_tokens"] = ["<|turn>", "<turn|>"]
    tc_path.write_text(json.dumps(tc, indent=2, sort_keys=True) + "\n")
    return transformers.AutoTokenizer.from_pretrained(tmp)


def build_config():
    text = transformers.Gemma4TextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=10,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        sliding_window=16,
        # E2B style: 4 sliding + 1 full, KV shared by the last two periods' worth of layers.
        layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 2,
        final_logit_softcapping=30.0,
        vocab_size_per_layer_input=VOCAB,
        hidden_size_per_layer_input=16,
        num_kv_shared_layers=5,
        use_double_wide_mlp=True,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
        },
        tie_word_embeddings=True,
        pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )
    vision = transformers.Gemma4VisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        head_dim=8,
    )
    cfg = transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None)
    cfg.tie_word_embeddings = True
    return cfg


def randomize(model):
    """Weights with spread: norm weights and layer scalars away from 1 (catches w vs 1+w and a dropped scalar),
    logits large enough that the 30·tanh(x/30) softcap bends them."""
    g = torch.Generator().manual_seed(SEED)
    lm = model.model.language_model
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif name == "embed_tokens.weight":
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif name == "embed_tokens_per_layer.weight":
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 / fan_in ** 0.5))
        lm.norm.weight.copy_(torch.rand(lm.norm.weight.shape, generator=g) * 2 + 1)
        for layer in lm.layers:
            layer.layer_scalar.copy_(torch.rand(1, generator=g) + 0.5)
        # Vision tower: keep whatever init it had, seeded above.


def main():
    assert transformers.__version__ == "5.23.0", f"goldens are pinned to transformers 5.23.0, have {transformers.__version__}"
    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    for d in (OUT, OUT_BF16, GOLD):
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)

    tok = build_tokenizer(OUT)
    cfg = build_config()
    model = transformers.Gemma4ForConditionalGeneration(cfg).eval().float()
    randomize(model)
    model.save_pretrained(OUT)
    model.to(torch.bfloat16).save_pretrained(OUT_BF16)
    for f in OUT.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            shutil.copy(f, OUT_BF16 / f.name)
    model = transformers.Gemma4ForConditionalGeneration.from_pretrained(OUT, dtype=torch.float32).eval()
    model.config._attn_implementation = "eager"
    lm = model.model.language_model
    tc = model.config.text_config

    # Token-id contract of the chat template.
    single = tok.apply_chat_template([{"role": "user", "content": "Hi there"}], add_generation_prompt=True, tokenize=False)
    single_ids = tok(single, add_special_tokens=False)["input_ids"]
    prompt_ids = tok("Hi there", add_special_tokens=False)["input_ids"]
    assert single_ids == [2, 105, 2364, 107] + prompt_ids + [106, 107, 105, 4368, 107], single_ids

    chats = {
        "single": [{"role": "user", "content": "What is the capital of France?"}],
        "system": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a planet with rings."}],
        "multi": [
            {"role": "user", "content": "Hello!"},
            {"role": "assistant", "content": "Hello! How can I help you today?"},
            {"role": "user", "content": "Write a short poem about the sea."},
        ],
        "unicode": [{"role": "user", "content": "¿Dónde está la biblioteca? 日本語 ✓"}],
    }
    chat_gold = {}
    for k, msgs in chats.items():
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        chat_gold[k] = {"messages": msgs, "text": text, "ids": ids, "decoded": tok.decode(ids)}

    g = torch.Generator().manual_seed(SEED + 1)
    seqs = {
        "short": [2] + torch.randint(300, VOCAB, (6,), generator=g).tolist(),
        "long": [2] + torch.randint(300, VOCAB, (39,), generator=g).tolist(),  # 40 > sliding_window 16
        "chat": chat_gold["single"]["ids"],
    }
    tensors = {}
    gold = {"transformers": transformers.__version__, "torch": torch.__version__, "seed": SEED,
            "kv_sharing_modes": tc.kv_sharing_modes, "layer_types": tc.layer_types,
            "head_dims": [tc.per_layer_config[i].head_dim for i in range(tc.num_hidden_layers)],
            "chat": chat_gold, "sequences": {}}

    def hidden_trace(ids):
        outs = []
        hooks = [lm.embed_tokens.register_forward_hook(lambda m, i, o: outs.append(o[0].clone()))]
        for layer in lm.layers:
            hooks.append(layer.register_forward_hook(lambda m, i, o: outs.append((o[0] if isinstance(o, tuple) else o)[0].clone())))
        hooks.append(lm.norm.register_forward_hook(lambda m, i, o: outs.append(o[0].clone())))
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids]), use_cache=False, output_hidden_states=True)
        for h in hooks:
            h.remove()
        return out.logits[0], torch.stack(outs)

    def greedy(ids, n, use_cache):
        ids = list(ids)
        gen = []
        with torch.no_grad():
            if not use_cache:
                for _ in range(n):
                    logits = model(input_ids=torch.tensor([ids + gen]), use_cache=False).logits[0, -1]
                    gen.append(int(torch.argmax(logits)))
            else:
                out = model(input_ids=torch.tensor([ids]), use_cache=True)
                past = out.past_key_values
                nxt = int(torch.argmax(out.logits[0, -1]))
                gen.append(nxt)
                for _ in range(n - 1):
                    out = model(input_ids=torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
                    past = out.past_key_values
                    nxt = int(torch.argmax(out.logits[0, -1]))
                    gen.append(nxt)
        return gen

    def precap(ids):
        with torch.no_grad():
            h = model.model(input_ids=torch.tensor([ids]), use_cache=False).last_hidden_state
            return (h @ lm.embed_tokens.weight.T).abs().max()

    for name, ids in seqs.items():
        logits, hid = hidden_trace(ids)
        assert hid.shape[0] == tc.num_hidden_layers + 2, hid.shape
        tensors[f"{name}.logits"] = logits.contiguous()
        tensors[f"{name}.hidden"] = hid.contiguous()
        g_nc = greedy(ids, 8, use_cache=False)
        g_c = greedy(ids, 8, use_cache=True)
        assert g_nc == g_c, (name, g_nc, g_c)
        gold["sequences"][name] = {"ids": ids, "greedy8": g_c, "greedy8_uncached": g_nc,
                                   "max_abs_logit": float(logits.abs().max()),
                                   "max_abs_logit_precap": float(precap(ids))}
    # The bf16 re-save, upcast to f32 by transformers: hexq's bf16 reading must reproduce it exactly.
    m16 = transformers.Gemma4ForConditionalGeneration.from_pretrained(OUT_BF16, dtype=torch.float32).eval()
    for name, ids in seqs.items():
        with torch.no_grad():
            tensors[f"{name}.logits_bf16_weights"] = m16(input_ids=torch.tensor([ids]), use_cache=False).logits[0].contiguous()
    save_file(tensors, str(GOLD / "golden.safetensors"))
    (GOLD / "golden.json").write_text(json.dumps(gold, indent=1, ensure_ascii=False) + "\n")
    print("fixture:", sum(f.stat().st_size for f in OUT.iterdir()) / 1e6, "MB;",
          "max|logit|:", {k: (round(v["max_abs_logit"], 2), round(v["max_abs_logit_precap"], 2)) for k, v in gold["sequences"].items()})


if __name__ == "__main__":
    sys.exit(main())
