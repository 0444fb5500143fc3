"""Serving workloads: who arrives when, with how long a prompt, wanting how many tokens.

A workload is either a spec of comma-separated `key=value` fields,

    requests=256,prompt=100:1024,output=100:1024,dist=uniform,rate=0,seed=0

(`prompt` / `output`: a length or `lo:hi`; `dist`: `uniform` or `loguniform` over [lo, hi]; `rate`: Poisson
arrivals per second, 0 = all at t=0), or a JSONL trace, one request a line:
`{"arrival": 0.5, "prompt": 812, "output": 128}` (arrival in seconds, default 0).

Named workloads: `default` (bench/serve.py's: 32 requests, prompt and output 16-256 log-uniform), `chat`
(short prompts, medium answers) and `summarise` (long prompts, short answers).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fivefold.config import ConfigError

NAMED = {
    "default": "requests=32,prompt=16:256,output=16:256,dist=loguniform",
    "chat": "requests=32,prompt=8:64,output=32:256,dist=loguniform",
    "summarise": "requests=16,prompt=512:1024,output=16:64,dist=uniform",
    "anchors": "requests=256,prompt=100:1024,output=100:1024,dist=uniform",
}
FIELDS = ("requests", "prompt", "output", "dist", "rate", "seed")


@dataclass
class Request:
    arrival: float  # seconds after the start
    prompt: int  # tokens
    output: int  # tokens wanted (generation runs to this length: ignore_eos)


@dataclass
class Workload:
    requests: list[Request]
    spec: str

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(r.output for r in self.requests)


def _lengths(text: str, key: str) -> tuple[int, int]:
    try:
        lo, _, hi = text.partition(":")
        lo, hi = int(lo), int(hi or lo)
    except ValueError:
        raise ConfigError(f"workload {key}={text!r}: give a length or lo:hi, e.g. {key}=16:256") from None
    if not 1 <= lo <= hi:
        raise ConfigError(f"workload {key}={text!r}: need 1 <= lo <= hi")
    return lo, hi


def _draw(rng: np.random.Generator, lo: int, hi: int, dist: str, n: int) -> list[int]:
    if dist == "uniform":
        return rng.integers(lo, hi + 1, n).tolist()
    return np.clip(np.round(np.exp(rng.uniform(math.log(lo), math.log(hi), n))), lo, hi).astype(int).tolist()


def parse_workload(spec: str) -> Workload:
    """A workload from a spec, a name in NAMED, or a JSONL trace file; a bad one is a one-line error
    naming the field."""
    if spec in NAMED:
        return _from_spec(NAMED[spec], spec)
    path = Path(spec)
    if path.suffix == ".jsonl" or (path.is_file() and "=" not in spec):
        return _from_trace(path)
    return _from_spec(spec, spec)


def _from_spec(text: str, name: str) -> Workload:
    fields = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        if not eq or key not in FIELDS:
            raise ConfigError(f"workload field {part!r} is not valid: give key=value with key one of "
                              f"{', '.join(FIELDS)} (or a named workload: {', '.join(NAMED)}, or a .jsonl trace)")
        fields[key] = value
    try:
        count = int(fields.get("requests", 32))
        rate = float(fields.get("rate", 0))
        seed = int(fields.get("seed", 0))
    except ValueError as e:
        raise ConfigError(f"workload {name!r}: requests and seed are integers, rate a number ({e})") from None
    if count < 1:
        raise ConfigError(f"workload requests={count}: need at least 1")
    if rate < 0 or not math.isfinite(rate):
        raise ConfigError(f"workload rate={rate}: give requests per second >= 0 (0: all at t=0)")
    dist = fields.get("dist", "loguniform")
    if dist not in ("uniform", "loguniform"):
        raise ConfigError(f"workload dist={dist!r}: choose uniform or loguniform")
    prompt = _lengths(fields.get("prompt", "16:256"), "prompt")
    output = _lengths(fields.get("output", "16:256"), "output")
    rng = np.random.default_rng(seed)
    prompts, outputs = _draw(rng, *prompt, dist, count), _draw(rng, *output, dist, count)
    arrivals = np.cumsum(rng.exponential(1 / rate, count)) if rate else np.zeros(count)
    return Workload([Request(float(a), p, o) for a, p, o in zip(arrivals, prompts, outputs)], name)


def _from_trace(path: Path) -> Workload:
    if not path.is_file():
        raise ConfigError(f"workload trace {path} does not exist (or give a spec such as requests=32,prompt=16:256)")
    requests = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            request = Request(float(row.get("arrival", 0.0)), int(row["prompt"]), int(row["output"]))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"workload trace {path}:{i}: each line is a JSON object with prompt and output "
                              f"lengths (and arrival seconds): {e}") from None
        if request.prompt < 1 or request.output < 1 or request.arrival < 0:
            raise ConfigError(f"workload trace {path}:{i}: prompt and output must be >= 1, arrival >= 0")
        requests.append(request)
    if not requests:
        raise ConfigError(f"workload trace {path} holds no requests")
    return Workload(sorted(requests, key=lambda r: r.arrival), str(path))
