"""The demo fine-tuning set (`data.sft=demo`): short tasks with one right answer each, such as
reversing a word, adding two small numbers or naming the day after Tuesday, that a 5M-parameter model
pretrained on Python's documentation can learn with a few hundred LoRA steps.

The shipped `sft_demo.jsonl` is exactly `demo_lines()` (tested); regenerate it with
    python -m fivefold.data.sft_demo
About a quarter of the examples are chat conversations with a system message (some with two turns), the
rest {"prompt", "completion"} pairs, so both formats of fivefold.data.sft are exercised.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

DEMO_PATH = Path(__file__).with_name("sft_demo.jsonl")
NUM_EXAMPLES = 3000
CHAT_SHARE = 0.25
SEED = 2024

# Words of the documentation the base model was trained on, so their tokens are familiar.
WORDS = ("python list string module function class object value error file method import return number "
         "integer float tuple dict set print loop type index lambda yield buffer socket thread queue token "
         "parser syntax format path name data line text word code test debug event stream array bytes "
         "field key item node tree graph frame stack heap cache lock timer signal async await raise except "
         "close open read write start stop sort search match split join count order range slice").split()
DAYS = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()
MONTHS = ("January February March April May June July August September October November "
          "December").split()
OPPOSITES = {"hot": "cold", "big": "small", "fast": "slow", "up": "down", "open": "closed", "true": "false",
             "start": "stop", "left": "right", "old": "new", "first": "last", "high": "low", "light": "dark",
             "in": "out", "yes": "no", "early": "late", "full": "empty", "read": "write", "push": "pop"}
SYSTEM = "You are a helpful assistant. Answer with the result only."


def _phrase(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 3)))


def _task(rng: random.Random) -> tuple[str, str]:
    """One (question, answer) of a task drawn uniformly."""
    kind = rng.randrange(12)
    word = rng.choice(WORDS)
    a, b = rng.randint(0, 50), rng.randint(0, 50)
    if kind == 0:
        return f"Reverse the letters of '{word}'.", word[::-1]
    if kind == 1:
        return f"What is {a} + {b}?", str(a + b)
    if kind == 2:
        a, b = max(a, b), min(a, b)
        return f"What is {a} - {b}?", str(a - b)
    if kind == 3:
        phrase = _phrase(rng)
        return f"Uppercase: {phrase}", phrase.upper()
    if kind == 4:
        phrase = _phrase(rng).upper()
        return f"Lowercase: {phrase}", phrase.lower()
    if kind == 5:
        i = rng.randrange(7)
        if rng.random() < 0.5:
            return f"What comes after {DAYS[i]}?", DAYS[(i + 1) % 7]
        return f"What comes before {DAYS[i]}?", DAYS[i - 1]
    if kind == 6:
        i = rng.randrange(12)
        return f"Which month comes after {MONTHS[i]}?", MONTHS[(i + 1) % 12]
    if kind == 7:
        n = rng.randint(0, 199)
        return f"What number comes after {n}?", str(n + 1)
    if kind == 8:
        return f"How many letters are in '{word}'?", str(len(word))
    if kind == 9:
        return f"Spell '{word}' with dashes.", "-".join(word)
    if kind == 10:
        key = rng.choice(sorted(OPPOSITES))
        return f"What is the opposite of '{key}'?", OPPOSITES[key]
    while a == b:
        b = rng.randint(0, 50)
    return f"Which is larger, {a} or {b}?", str(max(a, b))


def demo_examples(n: int = NUM_EXAMPLES, seed: int = SEED) -> list[dict]:
    """`n` distinct examples; a deterministic function of (n, seed) on every Python 3 (random.Random's
    integer draws are stable across versions)."""
    rng = random.Random(seed)
    examples, seen = [], set()
    while len(examples) < n:
        question, answer = _task(rng)
        if rng.random() < CHAT_SHARE:
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question},
                        {"role": "assistant", "content": answer}]
            if rng.random() < 0.3:
                second, reply = _task(rng)
                messages += [{"role": "user", "content": second}, {"role": "assistant", "content": reply}]
            example = {"messages": messages}
        else:
            example = {"prompt": question + "\n", "completion": answer}
        line = json.dumps(example, ensure_ascii=False)
        if line not in seen:  # small task spaces (days, months) saturate; the rest fill the set
            seen.add(line)
            examples.append(example)
    return examples


def demo_lines(n: int = NUM_EXAMPLES, seed: int = SEED) -> str:
    """The JSONL text of the demo set."""
    return "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in demo_examples(n, seed))


if __name__ == "__main__":
    DEMO_PATH.write_text(demo_lines(), encoding="utf-8")
    print(f"wrote {DEMO_PATH} ({NUM_EXAMPLES} examples)")
