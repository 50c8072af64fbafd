#!/usr/bin/env python3
"""Write datasets/calibration.jsonl (>= 200 prompts) and datasets/heldout.jsonl (>= 50), disjoint.

Every prompt is written by the hexq project (templates × fillers below), license CC0-1.0. Varied on purpose:
questions, instructions, code, maths, multilingual, short and long, some with a system turn and some
multi-turn — the chat template's special tokens must appear in every shape they take at inference.
Deterministic; fails if the two sets share a prompt (normalised: lowercase, collapsed whitespace).
Run: python3 datasets/make_datasets.py
"""
import json
import random
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = "hexq-authored (datasets/make_datasets.py)"
LIC = "CC0-1.0"

TOPICS = ["the water cycle", "photosynthesis", "black holes", "the French Revolution", "compound interest",
          "vaccines", "plate tectonics", "neural networks", "the Roman Empire", "climate change", "DNA replication",
          "the stock market", "volcanoes", "the printing press", "electric cars", "sleep", "coral reefs",
          "quantum computing", "the Silk Road", "honeybees", "inflation", "the Moon landing", "antibiotics",
          "renewable energy", "the human heart", "glaciers", "jazz music", "chess openings", "rainbows", "tides"]
QUESTIONS = ["What is {t}?", "Why does {t} matter?", "Explain {t} to a ten-year-old.", "Give three facts about {t}.",
             "What are common misconceptions about {t}?", "How would you summarise {t} in one sentence?",
             "Who first studied {t}, and what did they find?", "Write a short paragraph about {t}."]
INSTRUCTIONS = ["Write a haiku about {t}.", "List five questions a student might ask about {t}.",
                "Draft a polite email inviting a colleague to a talk on {t}.", "Create a quiz question about {t} with four options.",
                "Rewrite this sentence more formally: '{t} is kind of a big deal.'", "Give me a title for a blog post about {t}."]
CODE = ["Write a Python function that returns the {n}th Fibonacci number.", "Explain what this code does: `sum(x*x for x in range({n}))`",
        "Write a Rust function that reverses a string.", "How do I read a CSV file with {n} columns in Python?",
        "Fix the bug: `for i in range(len(xs)): print(xs[i+1])`", "Write a SQL query selecting the top {n} customers by revenue.",
        "What is the time complexity of binary search on {n} elements?", "Write a bash one-liner that counts lines in all .txt files."]
MATH = ["What is {a} + {b}?", "What is {a} times {b}?", "Solve for x: {a}x + {b} = {c}.", "Is {a} a prime number?",
        "What is {a} percent of {c}?", "A train travels {a} km in {b} hours. What is its average speed?",
        "Simplify the fraction {a}/{c}.", "What is the square root of {sq}?"]
MULTI = ["Bonjour ! Peux-tu m'expliquer {t} ?", "¿Qué es {t}? Responde en español.", "Erkläre mir bitte {t} in einfachen Worten.",
         "Spiega {t} in italiano.", "Explique {t} em português, por favor.", "请用中文简单解释一下{t}。", "{t}について日本語で説明してください。",
         "Объясни, пожалуйста, {t}.", "{t} के बारे में हिंदी में बताइए।", "Wat is {t}? Antwoord in het Nederlands."]
SYSTEMS = ["You are a concise assistant.", "You are a friendly tutor who answers step by step.",
           "Answer in at most two sentences.", "You are an expert software engineer."]
LONG = ("I am preparing a presentation for my team about {t}. The audience has mixed backgrounds: some are engineers, "
        "some work in sales, and a few are new to the company. I have fifteen minutes. Please suggest an outline with "
        "an opening hook, three main sections with one example each, and a closing that invites questions. Also tell me "
        "which part is most likely to confuse the non-technical listeners and how to explain it simply.")


def norm(s):
    return re.sub(r"\s+", " ", s.strip().lower())


def build():
    rng = random.Random(20261202)
    items = []
    for t in TOPICS:
        for q in QUESTIONS:
            items.append(("question", [{"role": "user", "content": q.format(t=t)}]))
        for q in INSTRUCTIONS:
            items.append(("instruction", [{"role": "user", "content": q.format(t=t)}]))
        for q in MULTI:
            items.append(("multilingual", [{"role": "user", "content": q.format(t=t)}]))
        items.append(("long", [{"role": "user", "content": LONG.format(t=t)}]))
    for n in [3, 7, 10, 12, 20, 25, 50, 100, 1000]:
        for q in CODE:
            items.append(("code", [{"role": "user", "content": q.format(n=n)}]))
    for _ in range(80):
        a, b, c = rng.randint(2, 999), rng.randint(2, 99), rng.randint(100, 9999)
        sq = rng.randint(2, 99) ** 2
        items.append(("maths", [{"role": "user", "content": rng.choice(MATH).format(a=a, b=b, c=c, sq=sq)}]))
    for hello in ["Hi!", "Hello", "Thanks!", "Good morning.", "What can you do?", "Tell me a joke.", "Who are you?"]:
        items.append(("short", [{"role": "user", "content": hello}]))
    # System turns and multi-turn conversations.
    for k, t in enumerate(TOPICS):
        items.append(("system", [{"role": "system", "content": SYSTEMS[k % len(SYSTEMS)]},
                                 {"role": "user", "content": f"Tell me about {t}."}]))
        items.append(("multi_turn", [{"role": "user", "content": f"What is {t}?"},
                                     {"role": "assistant", "content": f"{t[0].upper() + t[1:]} is a broad topic; what would you like to know?"},
                                     {"role": "user", "content": "Give me the single most important fact."}]))
    # Dedupe, shuffle deterministically, split.
    seen, uniq = set(), []
    for kind, msgs in items:
        key = norm(" | ".join(m["content"] for m in msgs))
        if key not in seen:
            seen.add(key)
            uniq.append((kind, msgs))
    rng.shuffle(uniq)
    # Held-out: every 8th item (covers all kinds), the rest calibrates.
    held = [x for i, x in enumerate(uniq) if i % 8 == 0]
    cal = [x for i, x in enumerate(uniq) if i % 8 != 0]
    return cal, held


def write(path, rows, prefix):
    with open(path, "w", encoding="utf-8") as f:
        for i, (kind, msgs) in enumerate(rows):
            f.write(json.dumps({"id": f"{prefix}-{i:04d}", "kind": kind, "messages": msgs, "source": SRC, "license": LIC},
                               ensure_ascii=False) + "\n")


def main():
    cal, held = build()
    a = {norm(" | ".join(m["content"] for m in msgs)) for _, msgs in cal}
    b = {norm(" | ".join(m["content"] for m in msgs)) for _, msgs in held}
    assert not (a & b), f"calibration and held-out overlap: {sorted(a & b)[:3]}"
    assert len(cal) >= 200 and len(held) >= 50, (len(cal), len(held))
    write(HERE / "calibration.jsonl", cal, "cal")
    write(HERE / "heldout.jsonl", held, "held")
    # A raw-text (non-chat) set: what NOT to calibrate on; the calibrate guard refuses it (tests use it).
    with open(HERE / "raw_text_sample.jsonl", "w", encoding="utf-8") as f:
        for i, (kind, msgs) in enumerate(cal[:24]):
            f.write(json.dumps({"id": f"raw-{i:04d}", "kind": kind, "text": msgs[-1]["content"], "source": SRC, "license": LIC},
                               ensure_ascii=False) + "\n")
    kinds = sorted({k for k, _ in cal})
    print(f"calibration {len(cal)}, heldout {len(held)}, disjoint; kinds: {kinds}")


if __name__ == "__main__":
    main()
