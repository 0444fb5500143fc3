"""bench/serve.py's request set and its HTTP side: the seeded requests, latency percentiles, and the
asyncio clients that stream them through the OpenAI-compatible server (--server)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import time
from dataclasses import dataclass

import torch

# --------------------------------------------------------------------------------------------
# The request set


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int


OUTPUT_DISTRIBUTIONS = ("loguniform", "uniform")


def make_requests(n: int, vocab: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                  seed: int, output_dist: str = "loguniform") -> list[Request]:
    """Prompt lengths uniform in prompt_range. Output lengths log-uniform in output_range by default, so
    most answers are short and a few are long (with 16..256: median 64, mean ~87, 1 in 4 above 128); that
    long tail is what static batching pays for: a batch runs as long as its longest request.
    output_dist="uniform": output lengths uniform integers in output_range too (the anchor workload:
    prompts and outputs both uniform in 100..1024). Each request draws its prompt length, its prompt
    tokens, then its output length, in that order, so the log-uniform sets stay as they always were."""
    if output_dist not in OUTPUT_DISTRIBUTIONS:
        raise ValueError(f"output_dist={output_dist!r}: one of {', '.join(OUTPUT_DISTRIBUTIONS)}")
    rng = random.Random(seed)
    lo, hi = output_range
    out = []
    for _ in range(n):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(*prompt_range))]
        if output_dist == "uniform":
            length = rng.randint(lo, hi)
        else:
            length = round(math.exp(rng.uniform(math.log(lo), math.log(hi + 1))) - 0.5)
        out.append(Request(prompt, min(max(length, lo), hi)))
    return out


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    i = math.floor(pos)
    return xs[i] + (xs[min(i + 1, len(xs) - 1)] - xs[i]) * (pos - i)


def latency_summary(ttft: list[float], tpot: list[float], e2e: list[float]) -> dict:
    out = {}
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("latency", e2e)):
        xs = [x for x in xs if x is not None]
        if xs:
            out.update({f"{name}_p50_s": percentile(xs, 50), f"{name}_p99_s": percentile(xs, 99)})
    return out


# --------------------------------------------------------------------------------------------
# The same requests through the HTTP server (--server)


def id_tokenizer(vocab: int):
    """Token i is the word `t<i>`. The server needs a tokenizer to stream text, and a preset with random
    weights has none. This one turns every id into text at once (nothing held back as a partial
    character), and lets the client read the token ids back out of the streamed text."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tokenizer


@contextlib.contextmanager
def local_server(engine, name: str, max_waiting: int):
    """The server's app over `engine`, served by uvicorn in a thread of this process, on a free port;
    yields the base URL."""
    from fivefold.serve.server import create_app, running_in_thread

    with running_in_thread(create_app(engine, name, max_waiting=max_waiting)) as url:
        yield url


def served_model(url: str) -> str:
    """The model id the server at `url` serves (its /v1/models); fails with the fix when it is not there."""
    import httpx

    try:
        response = httpx.get(f"{url}/v1/models", timeout=10)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise SystemExit(f"--server {url}: no OpenAI-compatible server answers GET /v1/models there "
                         f"({type(e).__name__}: {e}); start one (fivefold serve ...) or pass --server with no URL "
                         f"to serve the model in this process") from None


async def stream_one(client, url: str, model: str, r: Request, arrival: float, start: float,
                     gate: asyncio.Semaphore) -> dict:
    """One request: wait for its arrival time, then for a free slot (--concurrency), then stream it.
    Times are taken as each SSE line arrives; a token chunk is one whose text is not empty."""
    await asyncio.sleep(max(0.0, start + arrival - time.perf_counter()))
    async with gate:
        body = {"model": model, "prompt": r.prompt, "max_tokens": r.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        sent = time.perf_counter()
        first = last = usage = finish = None
        text = []
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"the server answered HTTP {response.status_code}: "
                                   f"{(await response.aread()).decode(errors='replace')[:300]}")
            async for line in response.aiter_lines():
                now = time.perf_counter()
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(f"the server failed the request: {chunk['error']['message']}")
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    if choice["text"]:
                        first = now if first is None else first
                        last = now
                        text.append(choice["text"])
                    finish = choice.get("finish_reason") or finish
    return {"arrival": start + arrival, "sent": sent, "first": first, "last": last, "usage": usage,
            "finish_reason": finish, "text": "".join(text)}


def run_server(url: str, requests: list[Request], concurrency: int = 0, rate: float = 0.0, seed: int = 0,
               tokenizer=None) -> dict:
    """Every request to the OpenAI-compatible server at `url` as a token-id prompt (temperature 0,
    ignore_eos, streamed with usage), from concurrent asyncio clients: all at t=0, or Poisson arrivals
    at `rate` requests/s; at most `concurrency` in flight (0: all). Returns what run_fivefold returns,
    timed by the client: TTFT from sending to the first token chunk, TPOT (last - first chunk) / (n - 1),
    latency from sending to the last chunk; n from the usage chunk. `tokenizer` (the server's) reads
    the token ids back from the text; without it token_ids is None."""
    import httpx

    rng = random.Random(seed + 4)
    arrivals, t = [], 0.0
    for _ in requests:
        arrivals.append(t)
        t += rng.expovariate(rate) if rate else 0.0

    model = served_model(url)

    async def drive():
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=None, limits=limits) as client:
            gate = asyncio.Semaphore(concurrency or len(requests))
            start = time.perf_counter()
            done = await asyncio.gather(*(stream_one(client, url, model, r, a, start, gate)
                                          for r, a in zip(requests, arrivals)))
            return done, start, time.perf_counter()

    cpu = time.process_time()
    done, start, end = asyncio.run(drive())
    wall = end - start
    wrong = [f"request {i} wanted {r.max_tokens}, got {(d['usage'] or {}).get('completion_tokens')} "
             f"(finish_reason {d['finish_reason']})" for i, (r, d) in enumerate(zip(requests, done))
             if d["usage"] is None or d["usage"]["completion_tokens"] != r.max_tokens or d["first"] is None]
    assert not wrong, (f"{len(wrong)} of {len(requests)} requests did not stream exactly max_tokens tokens with "
                       f"usage (does the server honour ignore_eos and stream_options.include_usage?): "
                       + "; ".join(wrong[:5]))
    n = [r.max_tokens for r in requests]
    ttft = [d["first"] - d["sent"] for d in done]
    tpot = [(d["last"] - d["first"]) / (k - 1) if k > 1 else None for d, k in zip(done, n)]
    e2e = [d["last"] - d["sent"] for d in done]
    token_ids = None
    if tokenizer is not None:
        token_ids = [tokenizer.encode(d["text"]).ids for d in done]
        assert [len(ids) for ids in token_ids] == n, "the streamed text does not decode to max_tokens tokens each"
    tokens, prompt = sum(n), sum(len(r.prompt) for r in requests)
    return {"url": url, "concurrency": concurrency or len(requests), "request_rate": rate or None,
            "wall_s": wall, "output_tokens": tokens, "output_tokens_per_s": tokens / wall,
            "prompt_and_output_tokens_per_s": (prompt + tokens) / wall,
            # This process's CPU time: with a local server, that of the server, engine and clients together.
            "cpu_util": (time.process_time() - cpu) / (wall * torch.get_num_threads()),
            "client_wait_p50_s": percentile([d["sent"] - d["arrival"] for d in done], 50),
            **latency_summary(ttft, tpot, e2e), "token_ids": token_ids}
