"""Offline serving throughput: fivefold's engine against transformers `generate` with static batching.

One seeded request set whose output lengths vary widely, as real traffic's do, all arriving at t=0:

- **fivefold**: `LLM(model).generate(all requests)`: continuous batching over a paged KV cache;
- **transformers**: `LlamaForCausalLM.generate` on the same weights, requests in arrival order grouped into
  static batches (left-padded), each batch running until its longest request is done. Every batch size
  in --batch-sizes is tried and the best one is the reference.

Both sides decode greedily with end-of-sequence ignored, so each request yields exactly its wanted
number of tokens. Also printed: TTFT / TPOT percentiles, the fraction of the compute roofline fivefold
reaches, and batch-1 decode speed against the memory-bandwidth roofline.

--server adds a third side: the same requests through the OpenAI-compatible HTTP server
(fivefold/serve/server.py), streamed by concurrent asyncio clients that time each token chunk. With no
URL it serves the same model itself, in this process, on a free port; with a URL it drives that server.

    python bench/serve.py --json bench/results/serve_default.json   # smollm2-135m, 32 requests, fp32
    python bench/serve.py --model tiny --requests 8 --max-output 16 # a quick check
    python bench/serve.py --profile --skip-hf --requests 64         # + where one batch-64 decode step goes
    python bench/serve.py --server --skip-hf --requests 8           # + through HTTP, all at t=0
    python bench/serve.py --server http://host:8000 --request-rate 2 --concurrency 16   # a running server

--device cuda runs both sides on the GPU (bfloat16 by default) and adds per-step figures: every engine
step's wall time in the timed run, and with --profile kernel launches, copies, syncs and GPU kernel time
per decode step at a full batch (torch.profiler, CUDA activities). The rooflines then come from the GPU's
hardware profile (fivefold/planner/profiles), or a measurement where none matches. --workload anchors is
the published anchor's request set: 256 requests, prompt and output lengths uniform in 100..1024.

    python bench/serve.py --device cuda --model llama3.2-1b --workload anchors --profile --json bench/results/serve_anchors_h100.json
    python bench/serve.py --workload anchors --model tiny --requests 8 --max-prompt 64 --max-output 16   # CPU check
    bash bench/gpu_serve.sh                                          # the whole GPU session, one script
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import json
import math
import os
import pstats
import random
import re
import statistics
import time
from collections import Counter

import torch

from fivefold.config import ModelConfig, ServeConfig
from fivefold.interop.hf import hf_config_from, weights_to_hf
from fivefold.memory.formulas import count_params, matmul_params
from fivefold.model import build_model
from fivefold.planner.calibrate import measure_bandwidth
from fivefold.planner.hardware import load_profile, profile_for_device_name
from fivefold.presets import PRESETS, get_preset
from fivefold.serve import LLM, SamplingParams
from fivefold.serve.blocks import blocks_for
from fivefold.serve.kv_pool import kv_bytes_per_token
from fivefold.train.metrics import measure_peak_flops
from serve_client import (Request, id_tokenizer, latency_summary, local_server, make_requests, percentile, run_server,
                           served_model)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PROFILE_DTYPES = {"float32": "fp32", "bfloat16": "bf16"}  # fivefold.planner.hardware's [flops] keys

MODEL_ALIASES = {"llama-3.2-1b": "llama3.2-1b"}

# Request sets. default: the CPU results' set (bench/README.md). anchors: the published anchor (vLLM on
# Llama-3.2-1B, ~12,600 output tok/s on an A800): 256 requests, prompt and output lengths both uniform
# in 100..1024, all at t=0. Explicit flags win over a workload's values.
WORKLOADS = {
    "default": dict(requests=32, min_prompt=16, max_prompt=256, min_output=16, max_output=256,
                    output_dist="loguniform", batch_sizes="16,32", max_num_seqs=64, max_num_batched_tokens=2048),
    "anchors": dict(requests=256, min_prompt=100, max_prompt=1024, min_output=100, max_output=1024,
                    output_dist="uniform", batch_sizes="256,128,64", max_num_seqs=256, max_num_batched_tokens=8192),
}

# The GPU targets (bench/README.md): offline >= 10x transformers' best static batching and >= 12,000
# output tok/s on the anchor workload (H100); batch-1 decode >= 50% of the HBM roofline; a full-batch
# decode step's wall <= 1.3x its GPU kernel time; no step slower than 3x the median after warm-up.
TARGETS = {"ratio_vs_transformers_best": 10.0, "anchors_output_tokens_per_s": 12000.0,
           "batch1_hbm_roofline_fraction": 0.5, "decode_step_wall_over_kernel": 1.3, "max_step_over_median": 3.0}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m",
                   help="preset name (fivefold.presets); random weights")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where both sides run; cuda: the first GPU, rooflines from its hardware profile")
    p.add_argument("--workload", default="default", choices=list(WORKLOADS),
                   help="the request set and engine limits: default (32 requests, prompts 16..256, outputs "
                        "log-uniform 16..256, max-num-seqs 64, 2048 batched tokens, batch sizes 16,32) or anchors "
                        "(256 requests, prompts and outputs uniform 100..1024, max-num-seqs 256, 8192 batched "
                        "tokens, batch sizes 256,128,64); the flags below override its values")
    p.add_argument("--requests", type=int, default=None, help="default: the workload's")
    p.add_argument("--min-prompt", type=int, default=None)
    p.add_argument("--max-prompt", type=int, default=None)
    p.add_argument("--min-output", type=int, default=None)
    p.add_argument("--max-output", type=int, default=None)
    # 8 is left out by default: it was the slowest to run and the worst of 8/16/32 on a 2-core CPU
    # (bench/README.md); a fast accelerator may want it back.
    p.add_argument("--batch-sizes", default=None,
                   help="transformers static batch sizes to try (default: the workload's); 'none' times no static "
                        "batch (transformers' batch-1 decode still runs)")
    p.add_argument("--dtype", default=None, choices=list(DTYPES),
                   help="default float32 on cpu, bfloat16 on cuda. On a CPU bfloat16 wants native bf16 matmuls "
                        "(avx512_bf16, AMX or a GPU-class CPU kernel); on AVX2 only, the matmul-peak measurement "
                        "alone takes tens of minutes")
    p.add_argument("--seed", type=int, default=0, help="weights and request set")
    p.add_argument("--linear", default="auto", choices=["auto", "onednn", "torch"],
                   help="serve.linear: the engine's linears on a CPU (oneDNN, or F.linear for the before/after)")
    p.add_argument("--compile-decode", action="store_true",
                   help="serve.compile_decode: on a CPU, decode steps of one attention group as one inductor graph")
    p.add_argument("--cpu-kernel", default="auto", choices=["auto", "true", "false"],
                   help="serve.cpu_kernel: on a CPU, decodes attend through the C++ kernel reading the pool in place")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--skip-hf", action="store_true", help="fivefold only (no transformers reference)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: the workload's")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: the workload's")
    p.add_argument("--kv-blocks", type=int, default=0,
                   help="KV pool blocks; 0: enough for every request at once (no preemption)")
    p.add_argument("--decode-prompt", type=int, default=128, help="batch-1 decode: prompt tokens")
    p.add_argument("--decode-output", type=int, default=128, help="batch-1 decode: output tokens")
    p.add_argument("--decode-reps", type=int, default=2, help="batch-1 decode runs per side (best and median kept)")
    p.add_argument("--profile", action="store_true",
                   help="profile decode steps of fivefold at a full batch (cuda: max-num-seqs requests; kernel "
                        "launches, copies, syncs and GPU kernel time per step)")
    p.add_argument("--server", nargs="?", const="local", default="", metavar="URL",
                   help="also send the requests through the HTTP server: with no URL (or 'local') one serving the "
                        "same model in this process; with a URL a running `fivefold serve` of the same preset")
    p.add_argument("--concurrency", type=int, default=0,
                   help="--server: most requests in flight at once; 0: all")
    p.add_argument("--request-rate", type=float, default=0.0,
                   help="--server: Poisson arrivals at this many requests/s; 0: all at t=0")
    p.add_argument("--quant", default="", metavar="METHODS",
                   help="also serve the model with its block linears quantized (fivefold.quant; comma-separated "
                        "int8,int4; GPTQ stores int4's format and runs at its speed) and compare batch-1 decode "
                        "and the whole request set against the --dtype model")
    p.add_argument("--paths", action="store_true",
                   help="also serve the request set through the engine's other paths on the same weights: eager "
                        "decode (serve.cuda_graphs=false; CUDA), and a LoRA adapter loaded (unfused, eager), with "
                        "base requests and with every request on it")
    p.add_argument("--skip-roofline", action="store_true",
                   help="do not measure the matmul peak and memory bandwidth (minutes for bf16 on a CPU without "
                        "native bf16 matmuls); the roofline fractions are then not printed")
    p.add_argument("--json", default="", help="write all numbers here")
    args = p.parse_args(argv)
    apply_workload(args)
    args.model = MODEL_ALIASES.get(args.model, args.model)
    if args.model not in PRESETS:
        p.error(f"--model {args.model!r}: one of {', '.join(PRESETS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device here (torch.cuda.is_available() is False)")
    args.batch_sizes = [int(x) for x in args.batch_sizes.split(",") if x.strip() and x.strip() != "none"]
    if not 1 <= args.min_prompt <= args.max_prompt:
        p.error(f"--min-prompt {args.min_prompt} / --max-prompt {args.max_prompt}: need 1 <= min <= max")
    if not 1 <= args.min_output <= args.max_output:
        p.error(f"--min-output {args.min_output} / --max-output {args.max_output}: need 1 <= min <= max")
    if args.decode_output < 2:
        p.error("--decode-output must be >= 2: decode speed is measured after the first token")
    if args.concurrency < 0 or args.request_rate < 0:
        p.error("--concurrency and --request-rate must be >= 0 (0: no limit / all at t=0)")
    if (args.concurrency or args.request_rate) and not args.server:
        p.error("--concurrency / --request-rate shape the HTTP clients: add --server (or --server URL)")
    if args.server:
        import importlib.util
        missing = [m for m in ("httpx", "uvicorn", "fastapi") if importlib.util.find_spec(m) is None]
        if missing:
            p.error(f"--server needs {', '.join(missing)}: pip install -e '.[dev]' "
                    f"(or pip install {' '.join(missing)})")
    if args.server and args.server != "local":
        if not args.server.startswith(("http://", "https://")):
            p.error(f"--server {args.server!r}: give a base URL such as http://127.0.0.1:8000, or no value "
                    f"to serve the model in this process")
        args.server = args.server.rstrip("/").removesuffix("/v1")
    # The engine's context: the longest request it is given (the request set, the batch-1 decode, the
    # warm-up and greedy-check prompts), in whole blocks, so its block tables are no wider than needed.
    block = ServeConfig().block_size
    longest = max(args.max_prompt + args.max_output, args.decode_prompt + args.decode_output, 64 + 8, 32 + 8)
    args.max_model_len = -(-longest // block) * block
    return args


def apply_workload(args) -> None:
    """Fill what the command line left unset from --workload's values; --dtype from --device. An explicit
    length bound beyond the workload's other bound moves that one with it (--workload anchors
    --max-prompt 64: prompts 64..64, not an error), so a small check of a workload needs only the maxima."""
    values = WORKLOADS[args.workload]
    explicit = {k for k in values if getattr(args, k, None) is not None}
    for key, value in values.items():
        if key not in explicit:
            setattr(args, key, value)
    for lo, hi in (("min_prompt", "max_prompt"), ("min_output", "max_output")):
        if hi in explicit and lo not in explicit:
            setattr(args, lo, min(getattr(args, lo), getattr(args, hi)))
        elif lo in explicit and hi not in explicit:
            setattr(args, hi, max(getattr(args, lo), getattr(args, hi)))
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"


def machine_info(threads: int, device: str = "cpu") -> dict:
    import transformers
    from machine import base_info
    info = {**base_info(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "transformers": transformers.__version__, "threads": threads}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=torch.cuda.get_device_name(0), gpu_memory_bytes=props.total_memory,
                    gpu_capability=f"{props.major}.{props.minor}", gpu_sms=props.multi_processor_count,
                    cuda=torch.version.cuda)
        try:
            import triton
            info["triton"] = triton.__version__
        except ImportError:
            info["triton"] = None
    return info


def sync(device) -> None:
    """Wait for the device's queued work (CUDA); nothing on a CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# --------------------------------------------------------------------------------------------
# Rooflines on a GPU: the datasheet figures of its hardware profile


def gpu_rooflines(dtype_name: str, measure: bool) -> dict:
    """HBM bandwidth and the dense matmul peak of `dtype_name` for the compute and bandwidth rooflines:
    the matching hardware profile's datasheet figures; with no profile, a device-to-device copy of 1 GB
    (counted as read + write) and the best of 3 measured 2048^3 matmuls. The copy and a 1 GB sum are
    measured either way (unless not `measure`) and recorded beside the figures used."""
    nan = float("nan")
    gpu = torch.cuda.get_device_name(0)
    measured = measure_bandwidth(1.0, 5, "cuda") if measure else {"read_gb_per_s": nan, "copy_gb_per_s": nan,
                                                                   "tensor_gb": nan}
    name = profile_for_device_name(gpu)
    if name is not None:
        profile = load_profile(name)
        return {"bandwidth_gb_per_s": profile.memory_bandwidth / 1e9,
                "peak_flops": profile.peak_flops(PROFILE_DTYPES[dtype_name]), "profile": name,
                "source": f"from hardware profile {name} (fivefold/planner/profiles/{name}.toml, {profile.source}), "
                          f"matched to {gpu!r}", "measured": measured}
    peaks = [measure_peak_flops(torch.device("cuda"), DTYPES[dtype_name]) for _ in range(3)] if measure else [nan]
    return {"bandwidth_gb_per_s": measured["copy_gb_per_s"], "peak_flops": max(peaks), "profile": None,
            "source": f"measured on {gpu!r} (no shipped hardware profile matches it): device-to-device copy "
                      f"bandwidth (read + write) and the best of 3 {dtype_name} 2048^3 matmuls",
            "measured": measured, "peak_flops_samples": peaks}


# --------------------------------------------------------------------------------------------
# FLOPs and bytes, from the same config the model is built from


def forward_flops(cfg, requests: list[Request]) -> float:
    """Forward FLOPs the requests need, counting what is necessary, not what an implementation spends:
    - every layer matmul for each token fed through the model: the whole prompt and every output token
      but the last (which is returned, never fed back): 2 FLOPs per weight;
    - the LM head only where a token is sampled: once per output token;
    - attention over the context actually there: a token at position p attends p + 1 keys, so
      2 * (p + 1) * q_size for q.k and as much for the weighted sum, per layer (the causal half only;
      fivefold.memory.formulas.flops_per_token counts the full square, as MFU conventions do)."""
    head = cfg.vocab_size * cfg.hidden_size
    layers = matmul_params(cfg) - head
    total = 0.0
    for r in requests:
        fed = len(r.prompt) + r.max_tokens - 1
        total += 2 * layers * fed + 2 * head * r.max_tokens
        total += 4 * cfg.num_layers * cfg.q_size * fed * (fed + 1) / 2  # sum of (p + 1) over p < fed
    return total


def decode_bytes_per_token(cfg, dtype: torch.dtype, prompt: int, output: int) -> dict:
    """Bytes one batch-1 decode step must read, averaged over the decode steps: every weight once (the
    tied embedding once, as the LM head; an input embedding row lookup is negligible) plus the keys and
    values of the context. Decode steps feed the output tokens 1..output-1 at positions prompt..prompt+output-2."""
    size = torch.empty((), dtype=dtype).element_size()
    lookups = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.hidden_size
    if cfg.position == "learned":
        lookups += cfg.max_seq_len * cfg.hidden_size
    weights = (count_params(cfg) - lookups) * size
    mean_context = statistics.mean(p + 1 for p in range(prompt, prompt + output - 1))
    kv = kv_bytes_per_token(cfg, dtype) * mean_context
    return {"weights": weights, "kv": kv, "total": weights + kv, "mean_context": mean_context}


# --------------------------------------------------------------------------------------------
# The two sides


def model_config(name: str) -> ModelConfig:
    return get_preset(name)


def build_models(name: str, seed: int, dtype: torch.dtype, skip_hf: bool, device: str = "cpu"):
    cfg = model_config(name)
    ours = build_model(cfg, device, seed=seed, dtype=dtype).eval()
    if skip_hf:
        return cfg, ours, None
    from transformers import LlamaConfig, LlamaForCausalLM

    if cfg.position != "rope":
        raise SystemExit(f"--model {name}: the transformers reference here is Llama only; use --skip-hf")
    # On a GPU, built there: a 1B model's random initialisation on the host would take longer than the run.
    with torch.device(device) if device != "cpu" else contextlib.nullcontext():
        hf = LlamaForCausalLM(LlamaConfig(**hf_config_from(cfg, "llama"), attn_implementation="sdpa"))
    missing, unexpected = hf.load_state_dict(weights_to_hf(ours.state_dict(), cfg), strict=False)
    # A tied model's lm_head is the embedding in both; anything else left over is a naming bug.
    leftover = [k for k in missing + unexpected if not (cfg.tie_embeddings and k == "lm_head.weight")]
    assert not leftover, f"weights do not map onto LlamaForCausalLM: {leftover[:5]}"
    # The rotary frequencies stay fp32, as from_pretrained(dtype=...) leaves them (they are computed in
    # fp32 and not cast); .to(dtype) alone would round them, and with them every position's angle.
    rope = {n: b for n, b in hf.named_buffers() if n.rsplit(".", 1)[-1] in ("inv_freq", "original_inv_freq")}
    hf = hf.to(dtype).eval()
    for n, b in rope.items():
        owner, _, attr = n.rpartition(".")
        setattr(hf.get_submodule(owner), attr, b)
    # No stopping on eos, like ignore_eos: every request produces exactly max_new_tokens.
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = pad_id(cfg)
    return cfg, ours, hf


def pad_id(cfg) -> int:
    return cfg.eos_token_id if cfg.eos_token_id is not None and cfg.eos_token_id >= 0 else 0


def make_llm(model, args, requests: list[Request], tokenizer=None, **options) -> LLM:
    """The engine every run here measures; `options`: LLM's others (adapters, cuda_graphs, ...)."""
    # Room for every request at once, plus a spare block each, so the run never preempts: this measures
    # batching, not a pool sized too small (that is --kv-blocks N).
    block = ServeConfig().block_size
    blocks = args.kv_blocks or max(sum(blocks_for(len(r.prompt) + r.max_tokens, block) for r in requests) + len(requests),
                                   blocks_for(args.decode_prompt + args.decode_output, block) + 1)  # batch-1 decode too
    return LLM(model, tokenizer=tokenizer, device=args.device, seed=args.seed, num_blocks=blocks,
               max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
               max_model_len=args.max_model_len, linear=args.linear,
               compile_decode=args.compile_decode, cpu_kernel=args.cpu_kernel, **options)


def greedy(r: Request) -> SamplingParams:
    return SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True)


@contextlib.contextmanager
def timed_steps(engine):
    """Record the wall time of each `engine.step()` called inside (LLM.generate steps the engine through
    this attribute). Nothing is synchronized here: the engine waits for the device itself once a step,
    when it copies the sampled tokens to the host, so a step's time is the host's view of it."""
    times: list[float] = []
    step = engine.step

    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = step(*args, **kwargs)
        times.append(time.perf_counter() - start)
        return out

    engine.step = timed
    try:
        yield times
    finally:
        del engine.step


def step_summary(times: list[float], skip: float = 0.1) -> dict:
    """Median, p99 and max of the steps after the first `skip` of them (warm-up: allocator growth, kernel
    choice, prefill-heavy first steps), and the max over the median (GPU target: <= 3)."""
    first = int(len(times) * skip)
    rest = times[first:] or times
    median = statistics.median(rest)
    slowest = max(range(len(rest)), key=rest.__getitem__)
    return {"steps": len(times), "skipped": first, "median_s": median, "p99_s": percentile(rest, 99),
            "max_s": rest[slowest], "max_step": first + slowest, "max_over_median": rest[slowest] / median,
            "steps_over_3x_median": sum(t > 3 * median for t in rest), "times_s": times}


def run_fivefold(llm: LLM, requests: list[Request], adapter: str | None = None) -> dict:
    """All requests at once (on LoRA adapter `adapter`, None: the base); the engine's own clock gives each
    one's TTFT and TPOT."""
    preempted = llm.engine.scheduler.preemptions
    steps = llm.engine.stats["steps"]
    device = llm.engine.device
    sync(device)
    start, cpu = time.perf_counter(), time.process_time()
    with timed_steps(llm.engine) as step_times:
        outs = llm.generate([r.prompt for r in requests], [greedy(r) for r in requests], adapter=adapter)
    sync(device)
    wall = time.perf_counter() - start
    # On a GPU the host mostly waits for it: its CPU time says nothing about contention.
    util = (time.process_time() - cpu) / (wall * torch.get_num_threads()) if device.type == "cpu" else None
    assert all(len(o.token_ids) == r.max_tokens for o, r in zip(outs, requests))
    ttft = [o.ttft for o in outs]
    tpot = [o.tpot for o in outs]
    e2e = [o.ttft + (o.tpot or 0) * (len(o.token_ids) - 1) for o in outs]
    tokens = sum(len(o.token_ids) for o in outs)
    prompt = sum(len(r.prompt) for r in requests)
    return {"wall_s": wall, "output_tokens": tokens, "output_tokens_per_s": tokens / wall,
            "prompt_and_output_tokens_per_s": (prompt + tokens) / wall, "cpu_util": util,
            "steps": llm.engine.stats["steps"] - steps, "preemptions": llm.engine.scheduler.preemptions - preempted,
            "step_times": step_summary(step_times),
            **latency_summary(ttft, tpot, e2e), "token_ids": [o.token_ids for o in outs]}


def run_server_side(model, args, requests: list[Request], warm: list[Request]) -> dict:
    """--server: warm up with `warm`, then time `requests`. 'local' serves `model` in this process over an
    engine of its own, configured as the offline one (a fresh prefix cache: no hits from the offline run)."""
    options = {"concurrency": args.concurrency, "rate": args.request_rate, "seed": args.seed}
    if args.server != "local":
        run_server(args.server, warm, seed=args.seed)
        # The serving work is done elsewhere: this process's CPU time says nothing about it.
        return {**run_server(args.server, requests, **options), "cpu_util": None}
    tokenizer = id_tokenizer(model.cfg.vocab_size)
    engine = make_llm(model, args, requests, tokenizer).engine
    with local_server(engine, args.model, max_waiting=len(requests)) as url:
        run_server(url, warm, seed=args.seed, tokenizer=tokenizer)
        steps, preempted = engine.stats["steps"], engine.scheduler.preemptions
        out = run_server(url, requests, **options, tokenizer=tokenizer)
        out.update(url="local", steps=engine.stats["steps"] - steps,
                   preemptions=engine.scheduler.preemptions - preempted)
    return out


class StepClock:
    """A transformers logits processor that only records when each generation step's logits arrive:
    step i's time is when the batch's i-th new token is chosen. On a GPU the host runs ahead of the
    kernels, so it records a CUDA event instead (no synchronization added to transformers' loop) and
    `finish()` turns the events into perf_counter times, from one event taken with a synchronized clock."""

    def __init__(self, device=None):
        self.times: list[float] = []
        self.cuda = device is not None and torch.device(device).type == "cuda"
        if self.cuda:
            self.events: list[torch.cuda.Event] = []
            torch.cuda.synchronize()
            self.origin = torch.cuda.Event(enable_timing=True)
            self.origin.record()
            self.origin_time = time.perf_counter()

    def __call__(self, input_ids, scores):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append(event)
        else:
            self.times.append(time.perf_counter())
        return scores

    def finish(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            self.times = [self.origin_time + self.origin.elapsed_time(e) / 1e3 for e in self.events]
        return self.times


def hf_generate(hf, prompts: list[list[int]], new_tokens: int, pad: int) -> tuple[list[list[int]], list[float]]:
    """One static batch, left-padded; returns each row's new tokens and the step times."""
    from transformers import LogitsProcessorList

    device = next(hf.parameters()).device
    longest = max(map(len, prompts))
    ids = torch.tensor([[pad] * (longest - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=device)
    clock = StepClock(device)
    with torch.inference_mode():
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=0,
                          do_sample=False, logits_processor=LogitsProcessorList([clock]))
    new = out[:, longest:]
    assert new.shape[1] == new_tokens, f"transformers stopped after {new.shape[1]} of {new_tokens} tokens"
    return new.tolist(), clock.finish()


def run_hf(hf, requests: list[Request], batch_size: int, pad: int) -> dict:
    """Requests in arrival order, `batch_size` at a time; a batch generates its longest request's length
    and only each request's own wanted tokens count. TTFT and TPOT are what a streaming client of each
    request would see: all arrived at t=0, so a later batch's requests also waited for earlier batches."""
    ttft, tpot, e2e, batch_walls, token_ids = [], [], [], [], []
    device = next(hf.parameters()).device
    sync(device)
    start, cpu = time.perf_counter(), time.process_time()
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        batch_start = time.perf_counter()
        new, times = hf_generate(hf, [r.prompt for r in batch], max(r.max_tokens for r in batch), pad)
        batch_walls.append(time.perf_counter() - batch_start)
        for r, row in zip(batch, new):
            n = r.max_tokens
            token_ids.append(row[:n])
            ttft.append(times[0] - start)
            tpot.append((times[n - 1] - times[0]) / (n - 1) if n > 1 else None)
            e2e.append(times[n - 1] - start)
    sync(device)
    wall = time.perf_counter() - start
    util = (time.process_time() - cpu) / (wall * torch.get_num_threads()) if device.type == "cpu" else None
    useful = sum(r.max_tokens for r in requests)
    generated = sum(len(b) * max(r.max_tokens for r in b) for b in
                    (requests[i:i + batch_size] for i in range(0, len(requests), batch_size)))
    return {"batch_size": batch_size, "wall_s": wall, "output_tokens": useful, "output_tokens_per_s": useful / wall,
            "generated_tokens": generated, "wasted_fraction": 1 - useful / generated, "cpu_util": util,
            "batch_wall_s": batch_walls, **latency_summary(ttft, tpot, e2e), "token_ids": token_ids}


# Same weights, same tokens: fp32 differs only in op order (~1e-6 on a logprob); bf16 rounds every op.
CHECK_ATOL = {"float32": 1e-4, "bfloat16": 0.1}


def check_same_greedy(llm: LLM, hf, vocab: int, dtype: str, seed: int, tokens: int = 8, top: int = 5) -> dict:
    """Before any timing: one prompt, greedy, both sides must give the same tokens and the same top-5
    logprobs at every step. Tokens alone are a weak check here: random tied weights make the model
    repeat one token, whatever small errors the implementation has."""
    rng = random.Random(seed + 1)
    prompt = [rng.randrange(vocab) for _ in range(32)]
    ours = llm.generate([prompt], SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, logprobs=top))[0]
    with torch.inference_mode():
        out = hf.generate(input_ids=torch.tensor([prompt], device=next(hf.parameters()).device), max_new_tokens=tokens,
                          do_sample=False, output_logits=True, return_dict_in_generate=True)
    theirs = out.sequences[0, len(prompt):].tolist()
    worst, split = 0.0, None
    for i, (entry, logits) in enumerate(zip(ours.logprobs, out.logits)):
        reference = torch.log_softmax(logits[0].float(), dim=-1).cpu()
        ids, values = zip(*entry["top"])
        worst = max(worst, (torch.tensor(values) - reference[list(ids)]).abs().max().item())
        if dtype != "float32" and ours.token_ids[i] != theirs[i]:
            # After a different token the two continue from different prefixes: nothing more to compare.
            split = {"step": i, "logprob_gap": abs(reference[ours.token_ids[i]] - reference[theirs[i]]).item()}
            break
    print(f"greedy check, {tokens} tokens of one 32-token prompt: fivefold {ours.token_ids}, transformers "
          f"{theirs}; top-{top} logprobs differ by at most {worst:.1e}"
          + (f" up to step {split['step']}, where the two pick tokens {split['logprob_gap']:.1e} apart in "
             f"transformers' logprobs" if split else ""))
    if split is None:
        assert ours.token_ids == theirs, "fivefold and transformers disagree on greedy tokens from the same weights"
    else:
        # bf16 rounds every op: near-uniform random-weight logits leave near-ties that either side may break.
        assert split["logprob_gap"] < CHECK_ATOL[dtype], (
            f"fivefold and transformers pick different greedy tokens at step {split['step']}, "
            f"{split['logprob_gap']:.1e} apart in logprob: not a near-tie (> {CHECK_ATOL[dtype]})")
    assert worst < CHECK_ATOL[dtype], f"fivefold and transformers logprobs differ by {worst:.1e} (> {CHECK_ATOL[dtype]})"
    return {"prompt_len": len(prompt), "fivefold": ours.token_ids, "transformers": theirs,
            "max_logprob_diff": worst, "near_tie_split": split}


def splits(hf, requests: list[Request], ours: list[list[int]], theirs: list[list[int]], most: int = 8) -> list[dict]:
    """Where greedy outputs part (up to `most` requests): the first differing step and how far apart the two
    tokens are in transformers' own logprobs there, one forward of the prompt and the shared prefix each.
    A near tie (a gap within the dtype's rounding) is either side's fair pick; a wide one is a bug."""
    out = []
    device = next(hf.parameters()).device
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a == b or len(out) == most:
            continue
        step = next((t for t, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        if step == min(len(a), len(b)):  # one stopped early: not a choice between two tokens
            out.append({"request": i, "step": step, "logprob_gap": None})
            continue
        with torch.inference_mode():
            logits = hf(input_ids=torch.tensor([requests[i].prompt + a[:step]], device=device)).logits[0, -1]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        out.append({"request": i, "step": step, "logprob_gap": abs(logprobs[a[step]] - logprobs[b[step]]).item()})
    return out


def decode_batch1(llm: LLM, hf, prompt: list[int], output: int, reps: int, pad: int, adapter: str | None = None) -> dict:
    """Decode tokens/s of one request (on LoRA adapter `adapter`) after its first token: (output - 1) / (time
    after the first)."""
    params = SamplingParams(max_tokens=output, temperature=0, ignore_eos=True)
    out = {"fivefold": [], "transformers": []}
    for _ in range(reps):
        o = llm.generate([prompt], params, adapter=adapter)[0]
        out["fivefold"].append(1 / o.tpot)
        if hf is not None:
            _, times = hf_generate(hf, [prompt], output, pad)
            out["transformers"].append((output - 1) / (times[output - 1] - times[0]))
    return {side: {"tokens_per_s": xs, "best": max(xs), "median": statistics.median(xs)}
            for side, xs in out.items() if xs}


def serve_variant(model, args, requests: list[Request], decode_prompt: list[int], adapter: str | None = None,
                  **options) -> dict:
    """Another engine over `model` (make_llm's `options`), warmed up, then timed like the main one: the whole
    request set and batch-1 decode, every request on `adapter` (None: the base)."""
    llm = make_llm(model, args, requests, **options)
    warm = make_requests(4, model.cfg.vocab_size, (16, 64), (4, 8), args.seed + 2)
    llm.generate([r.prompt for r in warm], [greedy(r) for r in warm], adapter=adapter)
    run = run_fivefold(llm, requests, adapter)
    decode = decode_batch1(llm, None, decode_prompt, args.decode_output, args.decode_reps, 0, adapter)["fivefold"]
    return {"engine_path": llm.engine.path, "output_tokens_per_s": run["output_tokens_per_s"],
            "step_median_s": run["step_times"]["median_s"], "token_ids": run["token_ids"], "decode_batch1": decode}


def run_quantized(model, args, requests: list[Request], decode_prompt: list[int]) -> dict:
    """Each --quant method: the same weights with the blocks' linears as QuantLinear (round-to-nearest codes;
    int4 in groups of 128, or the largest of 64, 32 that divides the widths), served by the same engine:
    batch-1 decode and the whole request set."""
    import copy

    from fivefold.quant.gptq import quantize_model
    from fivefold.quant.linear import swap_linears

    out = {}
    for method in filter(None, args.quant.split(",")):
        quantized = copy.deepcopy(model).float()
        group = next(g for g in (128, 64, 32, -1) if all(w % g == 0 for w in (model.cfg.hidden_size, model.cfg.q_size,
                                                                            model.cfg.ffn_hidden_size)) or g == -1)
        qweights = quantize_model(quantized, method, group_size=group)
        swap_linears(quantized, qweights)
        quantized = quantized.to(DTYPES[args.dtype]).eval()
        weight_bytes = sum(b.numel() * b.element_size() for b in quantized.buffers()) + \
            sum(p.numel() * p.element_size() for p in quantized.parameters())
        print(f"fivefold engine, {method} weights ...", flush=True)
        out[method] = {"weight_bytes": weight_bytes, **serve_variant(quantized, args, requests, decode_prompt)}
    return out


def random_adapter(cfg, directory: str, rank: int = 16, seed: int = 0) -> str:
    """A PEFT directory of random rank-`rank` adapters on every projection of `cfg`'s shape."""
    from fivefold.config import Config, LoraConfig
    from fivefold.finetune.lora import adapter_shapes
    from fivefold.finetune.peft import save_adapter

    lora = LoraConfig(r=rank, alpha=rank)
    g = torch.Generator().manual_seed(seed)
    tensors = {n: torch.randn(shape, generator=g) * 0.02 for n, shape in adapter_shapes(cfg, lora).items()}
    return str(save_adapter(tensors, Config(model=cfg, lora=lora), directory))


def run_paths(model, args, requests: list[Request], decode_prompt: list[int]) -> dict:
    """--paths: the request set and batch-1 decode through each of the engine's other paths on the same weights
    (docs/serving.md, "Paths"): eager decode, the same engine with serve.cuda_graphs=false, and the separate
    RoPE, store, add and norm kernels, serve.fuse_launches=false (both only where they exist: CUDA); a rank-16 adapter on every projection loaded (q/k/v and gate/up unfused, decode eager), with
    base requests, then with every request on it (two thin products per projection). The adapter's engine
    serves a copy of the model, since the main engine fused this one's projections in place."""
    import copy
    import tempfile

    out = {}
    if args.device == "cuda":
        print("fivefold engine, eager decode ...", flush=True)
        out["eager decode"] = serve_variant(model, args, requests, decode_prompt, cuda_graphs="false")
        print("fivefold engine, separate kernels (serve.fuse_launches=false) ...", flush=True)
        out["separate kernels"] = serve_variant(model, args, requests, decode_prompt, fuse_launches=False)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = {"a": random_adapter(model.cfg, tmp, seed=args.seed)}
        twin = copy.deepcopy(model)
        for name, adapter in (("LoRA loaded, base requests", None), ("LoRA on every request", "a")):
            print(f"fivefold engine, {name} ...", flush=True)
            out[name] = serve_variant(twin, args, requests, decode_prompt, adapter, adapters=adapters)
            gc.collect()  # the engine's KV pool, before the next one sizes its own
    return out


def print_variants(title: str, variants: dict, ours: dict, decode: dict, first: str) -> None:
    """The variants' batch-1 decode and request-set speeds beside the main run's (`first` names it)."""
    print(f"\n{title}:")
    print(f"  {'':<28}{'batch-1 decode tok/s':>22}{'ratio':>7}{'all requests tok/s':>20}{'ratio':>7}")
    print(f"  {first:<28}{decode['fivefold']['best']:>22.1f}{1:>7.2f}{ours['output_tokens_per_s']:>20.1f}{1:>7.2f}")
    for name, v in variants.items():
        best = v["decode_batch1"]["best"]
        print(f"  {name:<28}{best:>22.1f}{best / decode['fivefold']['best']:>7.2f}"
              f"{v['output_tokens_per_s']:>20.1f}{v['output_tokens_per_s'] / ours['output_tokens_per_s']:>7.2f}")
    for name, v in variants.items():
        print(f"  {name}: {v['engine_path']}")


def print_quantized(quant: dict, ours: dict, decode: dict, model, dtype: str) -> None:
    base_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print_variants(f"quantized weights against {dtype} (same engine, same requests)", quant, ours, decode, dtype)
    print(f"  weight bytes: {dtype} {base_bytes:,}; " + "; ".join(f"{m} {q['weight_bytes']:,}" for m, q in quant.items()))


# --------------------------------------------------------------------------------------------
# Where a full-batch decode step goes


def profile_decode(model, args, requests: list[Request], steps: int = 3, rows: int = 20) -> dict:
    """Fill the engine with the requests (each given max-output tokens, so none finishes early), run
    until every one is past its prompt, then profile `steps` decode steps: torch ops and Python."""
    from torch.profiler import ProfilerActivity, profile

    engine = fill_for_decode(model, args, requests, len(requests)).engine
    engine.step()  # one warm decode step
    batch = engine.num_running
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    profiled = (time.perf_counter() - start) / steps
    py = cProfile.Profile()
    start = time.perf_counter()
    py.enable()
    engine.step()
    py.disable()
    cprofiled = time.perf_counter() - start
    text = io.StringIO()
    pstats.Stats(py, stream=text).strip_dirs().sort_stats("tottime").print_stats(rows)
    ops = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
    contexts = [len(s.token_ids) for s in engine.scheduler.running]
    return {"batch": batch, "context_mean": statistics.mean(contexts), "context_max": max(contexts),
            "step_s_under_torch_profiler": profiled, "step_s_under_cprofile": cprofiled,
            "torch_ops": ops, "python": text.getvalue()}


# Host-side CUDA runtime / driver calls counted per step (the profiler's names for them).
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
GRAPH_LAUNCHES = ("cudaGraphLaunch", "cuGraphLaunch")
COPIES = ("cudaMemcpyAsync", "cudaMemcpy", "cudaMemcpy2DAsync", "cuMemcpyAsync", "cuMemcpyHtoDAsync",
          "cuMemcpyDtoHAsync")
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cuStreamSynchronize",
         "cuCtxSynchronize", "cuEventSynchronize")
RUNTIME_CALL = re.compile(r"^cu(da)?[A-Z]\w*$")


def merged_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (overlapping kernels on several streams count once)."""
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def step_profile(prof, wall: float) -> dict:
    """One profiled step: host runtime calls by name, and the GPU's kernels (and memcpy / memset) as
    their summed durations and as the time the GPU was busy with any of them."""
    from torch.autograd import DeviceType

    calls: Counter = Counter()
    kernels, transfers = [], []
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            span = (e.time_range.start, e.time_range.end)
            (transfers if e.name.startswith(("Memcpy", "Memset")) else kernels).append(span)
        elif RUNTIME_CALL.match(e.name):
            calls[re.sub(r"_v\d+$", "", e.name)] += 1  # driver calls may carry a version: cuMemcpyAsync_v2
    kernel_s = sum(b - a for a, b in kernels) / 1e6
    return {"wall_s_under_profiler": wall, "kernel_launches": sum(calls[n] for n in LAUNCHES),
            "graph_launches": sum(calls[n] for n in GRAPH_LAUNCHES), "copies": sum(calls[n] for n in COPIES),
            "syncs": sum(calls[n] for n in SYNCS), "gpu_kernels": len(kernels), "gpu_transfers": len(transfers),
            "kernel_s": kernel_s, "gpu_busy_s": merged_us(kernels + transfers) / 1e6, "runtime_calls": dict(calls)}


def fill_for_decode(model, args, requests: list[Request], count: int):
    """An engine holding `count` requests, each wanting --max-output tokens (none finishes in the window),
    stepped until every one is decoding. Prompts come from the request set; past its end they repeat
    shifted by one token id per round, so no two share a prefix-cache entry."""
    vocab = model.cfg.vocab_size
    long = [Request([(t + i // len(requests)) % vocab for t in requests[i % len(requests)].prompt], args.max_output)
            for i in range(count)]
    llm = make_llm(model, args, long)
    engine = llm.engine
    for r in long:
        engine.add_request(r.prompt, greedy(r))
    while engine.num_waiting or any(s.remaining > 1 for s in engine.scheduler.running):
        engine.step()
    return llm


def profile_decode_cuda(model, args, requests: list[Request], steps: int = 5, rows: int = 15,
                        count: int = 0) -> dict:
    """A full batch (--max-num-seqs requests, all decoding; `count` requests if given) on the GPU: `steps`
    decode steps timed as the engine runs them (their mean is the step's wall), then `steps` more each under
    its own torch.profiler
    (CPU + CUDA activities): kernel launches (graph launches apart), host<->device copies, synchronizations,
    GPU kernel time. wall / kernel time is the GPU target (<= 1.3): what the host adds on top of the
    kernels. Then one step under cProfile, for where the host's time goes."""
    from torch.profiler import ProfilerActivity, profile

    llm = fill_for_decode(model, args, requests, count or args.max_num_seqs)
    engine = llm.engine
    for _ in range(3):  # warm decode steps: allocator, kernel choice, graphs
        engine.step()
    batch = engine.num_running
    torch.cuda.synchronize()
    start = time.perf_counter()
    walls = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / steps  # a step's wall: the mean over the window, as the engine runs
    per_step, table = [], ""
    for i in range(steps):
        # No synchronize of ours inside: it would count as one of the step's syncs. The step's kernels are
        # done when it returns (the engine waits for its sampled tokens), and leaving the profiler flushes.
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            engine.step()
            profiled = time.perf_counter() - t
        torch.cuda.synchronize()
        per_step.append(step_profile(prof, profiled))
        if i == steps - 1:
            averages = prof.key_averages()
            for key in ("self_device_time_total", "self_cuda_time_total"):
                try:
                    table = averages.table(sort_by=key, row_limit=rows)
                    break
                except (AttributeError, KeyError):
                    continue
    py = cProfile.Profile()
    py.enable()
    engine.step()
    torch.cuda.synchronize()
    py.disable()
    text = io.StringIO()
    pstats.Stats(py, stream=text).strip_dirs().sort_stats("tottime").print_stats(20)
    contexts = [len(s.token_ids) for s in engine.scheduler.running]
    kernel = statistics.median(p["kernel_s"] for p in per_step)
    summary = {key: statistics.median(p[key] for p in per_step)
               for key in ("kernel_launches", "graph_launches", "copies", "syncs", "gpu_kernels", "kernel_s",
                           "gpu_busy_s", "wall_s_under_profiler")}
    return {"batch": batch, "context_mean": statistics.mean(contexts), "context_max": max(contexts),
            "step_wall_s": wall, "step_walls_s": walls, "median": summary, "per_step": per_step,
            "wall_over_kernel": wall / kernel if kernel else None,
            "wall_over_gpu_busy": wall / summary["gpu_busy_s"] if summary["gpu_busy_s"] else None,
            "kernels_table": table, "python": text.getvalue()}


# --------------------------------------------------------------------------------------------


def fmt_ms(x: float | None) -> str:
    return f"{1e3 * x:8.1f}" if x is not None else f"{'-':>8}"


def print_table(rows: list[tuple[str, dict]], best_hf: float | None) -> None:
    print(f"\n{'side':<22} | {'wall s':>7} | {'out tok/s':>9} | {'ratio':>5} | {'TTFT p50':>8} {'p99':>8} ms | "
          f"{'TPOT p50':>8} {'p99':>8} ms | {'cpu util':>8}")
    print("-" * 118)
    for name, r in rows:
        ratio = f"{r['output_tokens_per_s'] / best_hf:5.2f}" if best_hf else f"{'-':>5}"
        print(f"{name:<22} | {r['wall_s']:>7.2f} | {r['output_tokens_per_s']:>9.1f} | {ratio} | "
              f"{fmt_ms(r.get('ttft_p50_s'))} {fmt_ms(r.get('ttft_p99_s'))}    | "
              f"{fmt_ms(r.get('tpot_p50_s'))} {fmt_ms(r.get('tpot_p99_s'))}    | "
              + (f"{r['cpu_util']:>8.2f}" if r["cpu_util"] is not None else f"{'-':>8}"))
    utils = [r["cpu_util"] for _, r in rows if r["cpu_util"] is not None]  # none on a GPU
    if utils and min(utils) < 0.8:
        print("warning: CPU utilisation < 0.8 somewhere: the machine was contended; rerun before comparing")


def print_server_notes(server: dict, ours: dict, count: int) -> None:
    where = ("in this process: uvicorn's event loop, the engine's stepping thread and the asyncio clients "
             "share its CPUs and GIL, so the client's own cost is in these numbers"
             if server["url"] == "local" else f"at {server['url']}; this process only ran the clients")
    print(f"fivefold server: {where}. Times are the client's, per streamed chunk: TTFT from sending to the "
          f"first token, latency to the last; {count} requests, {server['concurrency']} in flight at most, "
          + (f"Poisson arrivals at {server['request_rate']:g}/s" if server["request_rate"] else "all sent at t=0")
          + f" (client-side wait p50 {server['client_wait_p50_s']:.2f} s)")
    line = (f"  server / offline engine: {server['output_tokens_per_s'] / ours['output_tokens_per_s']:.2f}x output "
            f"tokens/s; TTFT p50 {server['ttft_p50_s']:.2f} s against {ours['ttft_p50_s']:.2f} s; latency p50 "
            f"{server['latency_p50_s']:.1f} s, p99 {server['latency_p99_s']:.1f} s")
    if "steps" in server:
        line += f"; {server['steps']} engine steps, {server['preemptions']} preemptions"
    if "requests_matching_fivefold" in server:
        line += f"; {server['requests_matching_fivefold']}/{count} requests token-identical to the offline run"
    print(line)


def without_token_ids(x):
    """`x` for the JSON: every dict's token_ids left out (the comparisons are counted already)."""
    if isinstance(x, dict):
        return {k: without_token_ids(v) for k, v in x.items() if k != "token_ids"}
    if isinstance(x, list):
        return [without_token_ids(v) for v in x]
    return x


def write_json(path: str, out: dict, stage: str) -> None:
    """All numbers so far, marked with the stage reached: a run cut short (a GPU session's timeout) still
    leaves what it measured. Written whole to a temporary file, then renamed over the last one."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(without_token_ids({**out, "stage": stage}), f, indent=1)
    os.replace(tmp, path)


def print_steps(steps: dict) -> None:
    print(f"fivefold steps: {steps['steps']}; after the first {steps['skipped']}: median "
          f"{1e3 * steps['median_s']:.1f} ms, p99 {1e3 * steps['p99_s']:.1f} ms, max {1e3 * steps['max_s']:.1f} ms "
          f"(step {steps['max_step']}) = {steps['max_over_median']:.2f}x the median; "
          f"{steps['steps_over_3x_median']} steps above 3x")


def print_cuda_profile(profile: dict, kernels: bool = True) -> None:
    m = profile["median"]
    print(f"\nfivefold decode step at batch {profile['batch']} (context mean {profile['context_mean']:.0f}, longest "
          f"{profile['context_max']} tokens): {1e3 * profile['step_wall_s']:.2f} ms wall (mean of "
          f"{len(profile['step_walls_s'])} steps as the engine runs them), GPU kernels {1e3 * m['kernel_s']:.2f} ms "
          f"(busy {1e3 * m['gpu_busy_s']:.2f} ms) -> wall / kernel time "
          + (f"{profile['wall_over_kernel']:.2f}" if profile["wall_over_kernel"] else "-")
          + f" (target <= {TARGETS['decode_step_wall_over_kernel']})")
    print(f"  {'step':>4} {'launches':>9} {'graphs':>7} {'copies':>7} {'syncs':>6} {'kernels':>8} "
          f"{'kernel ms':>10} {'busy ms':>8} {'wall ms (profiled)':>19}")
    for i, p in enumerate(profile["per_step"]):
        print(f"  {i:>4} {p['kernel_launches']:>9} {p['graph_launches']:>7} {p['copies']:>7} {p['syncs']:>6} "
              f"{p['gpu_kernels']:>8} {1e3 * p['kernel_s']:>10.2f} {1e3 * p['gpu_busy_s']:>8.2f} "
              f"{1e3 * p['wall_s_under_profiler']:>19.2f}")
    calls = Counter()
    for p in profile["per_step"]:
        calls.update(p["runtime_calls"])
    n = len(profile["per_step"])
    print("  runtime calls per step: " + ", ".join(f"{k} {v / n:g}" for k, v in calls.most_common()))
    if kernels:
        print(profile["kernels_table"])
        print(profile["python"])


def print_targets(out: dict, args) -> dict:
    """The GPU targets (bench/README.md), each with its measured value; None where not measured."""
    ours, decode, profile = out["fivefold"], out["decode_batch1"], out["profile"]
    rows = {
        "ratio_vs_transformers_best": (out["ratio_vs_transformers_best"], ">="),
        "anchors_output_tokens_per_s": (ours["output_tokens_per_s"] if args.workload == "anchors" else None, ">="),
        "batch1_hbm_roofline_fraction": (decode["fivefold"]["bandwidth_roofline_fraction"], ">="),
        "decode_step_wall_over_kernel": (profile.get("wall_over_kernel") if profile else None, "<="),
        "max_step_over_median": (ours["step_times"]["max_over_median"], "<="),
    }
    result = {}
    print(f"\nGPU targets ({out['machine'].get('gpu')}; the output tok/s target is an H100's):")
    for key, (value, op) in rows.items():
        target = TARGETS[key]
        met = None if value is None or value != value else (value >= target if op == ">=" else value <= target)
        result[key] = {"value": value, "target": target, "op": op, "met": met}
        shown = "not measured" if met is None else f"{value:,.2f} -> {'met' if met else 'NOT met'}"
        print(f"  {key:<30} {op} {target:<8g} {shown}")
    return result


def run_decode_batch1(llm: LLM, hf, prompt: list[int], args, pad: int) -> dict:
    print(f"batch-1 decode ({args.decode_prompt}-token prompt, {args.decode_output} tokens) ...", flush=True)
    return decode_batch1(llm, hf, prompt, args.decode_output, args.decode_reps, pad)


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    cuda = args.device == "cuda"
    info = machine_info(torch.get_num_threads(), args.device)
    if cuda:
        print(f"{info['gpu']} ({info['gpu_memory_bytes'] / 2**30:.0f} GiB, compute {info['gpu_capability']}, "
              f"{info['gpu_sms']} SMs), CUDA {info['cuda']}, triton {info['triton']}; host {info['cpu_model']}; "
              f"torch {info['torch']}, transformers {info['transformers']}")
    else:
        print(f"{info['cpu_model']} ({info['cpu_capability']}), {info['threads']} threads, torch {info['torch']}, "
              f"transformers {info['transformers']}")
    if args.server and args.server != "local":
        print(f"--server {args.server} serves {served_model(args.server)!r}; its prompts are token ids of "
              f"--model {args.model}, so it should serve that preset's vocabulary")
    nan = float("nan")
    roofline = not args.skip_roofline
    if cuda:
        # A GPU's figures are its datasheet's (its hardware profile), not a CPU matmul or host memory.
        gpu = gpu_rooflines(args.dtype, roofline)
        peaks, bandwidth = [gpu["peak_flops"]], gpu["measured"]
    else:
        gpu = None
        peaks = [measure_peak_flops(torch.device("cpu"), dtype) for _ in range(3)] if roofline else [nan]
        bandwidth = measure_bandwidth() if roofline else {"read_gb_per_s": nan, "copy_gb_per_s": nan, "tensor_gb": nan}

    cfg, model, hf = build_models(args.model, args.seed, dtype, args.skip_hf, args.device)
    pad = pad_id(cfg)
    requests = make_requests(args.requests, cfg.vocab_size, (args.min_prompt, args.max_prompt),
                             (args.min_output, args.max_output), args.seed, args.output_dist)
    prompt_tokens = sum(len(r.prompt) for r in requests)
    outputs = [r.max_tokens for r in requests]
    preset = "" if args.model in PRESETS else " (this script's shape: fivefold.presets has none)"
    print(f"{args.model}{preset}: {count_params(cfg) / 1e6:.1f}M params, {args.dtype}, {args.device}; workload "
          f"{args.workload}: {len(requests)} requests, {prompt_tokens} prompt tokens ({args.min_prompt}..{args.max_prompt} "
          f"each), {sum(outputs)} output tokens (each {min(outputs)}..{max(outputs)}, {args.output_dist}, median "
          f"{statistics.median(outputs):.0f}); max-num-seqs {args.max_num_seqs}, max-num-batched-tokens "
          f"{args.max_num_batched_tokens}, max-model-len {args.max_model_len}")
    out = {"machine": info, "settings": {k: v for k, v in vars(args).items() if k != "json"},
           "model": {"name": args.model, "params": count_params(cfg)},
           "requests": {"count": len(requests), "prompt_tokens": prompt_tokens, "output_tokens": sum(outputs),
                        "prompt_lengths": [len(r.prompt) for r in requests], "output_lengths": outputs}}

    llm = make_llm(model, args, requests)
    print(llm.engine.plan.describe(args.max_prompt + args.max_output))
    print(f"engine path: {llm.engine.path}")
    out["engine_path"] = llm.engine.path
    check = None
    if hf is not None:
        try:
            check = check_same_greedy(llm, hf, cfg.vocab_size, args.dtype, args.seed)
        except AssertionError as e:
            if not cuda:
                raise
            # One GPU session, no second try: record the failure and measure anyway.
            print(f"GREEDY CHECK FAILED (measuring anyway; compare with care): {e}", flush=True)
            check = {"failed": str(e)}
    out["greedy_check"] = check
    # Warm both up (thread pools, allocator, kernel choice) on a small batch outside the request set.
    warm = make_requests(4, cfg.vocab_size, (16, 64), (4, 8), args.seed + 2)
    llm.generate([r.prompt for r in warm], [greedy(r) for r in warm])
    if hf is not None:
        hf_generate(hf, [r.prompt for r in warm], 4, pad)

    print("fivefold engine ...", flush=True)
    ours = run_fivefold(llm, requests)
    print(f"fivefold: {ours['output_tokens_per_s']:.1f} output tok/s ({ours['wall_s']:.2f} s, {ours['steps']} steps, "
          f"{ours['preemptions']} preemptions)", flush=True)
    print_steps(ours["step_times"])
    out["fivefold"] = ours
    write_json(args.json, out, "fivefold")

    rng = random.Random(args.seed + 3)
    decode_prompt = [rng.randrange(cfg.vocab_size) for _ in range(args.decode_prompt)]
    per_token = decode_bytes_per_token(cfg, dtype, args.decode_prompt, args.decode_output)
    decode = profile = None
    if cuda:
        # On a GPU the transformers runs take longest: what needs no more of them is measured (and written)
        # first, so a session cut short by its time limit still has it.
        decode = run_decode_batch1(llm, hf, decode_prompt, args, pad)
        hbm_tps = gpu["bandwidth_gb_per_s"] * 1e9 / per_token["total"]
        for side, d in decode.items():
            d["bandwidth_roofline_fraction"] = d["best"] / hbm_tps
            print(f"  {side:<12}: {d['best']:.1f} tok/s best = {100 * d['bandwidth_roofline_fraction']:.0f}% of the "
                  f"HBM roofline ({hbm_tps:.0f} tok/s: {per_token['total'] / 1e9:.2f} GB a token at "
                  f"{gpu['bandwidth_gb_per_s']:.0f} GB/s)", flush=True)
        out["decode_batch1"] = {**decode, "bytes_per_token": per_token, "roofline_tokens_per_s": hbm_tps,
                                "roofline_bandwidth_gb_per_s": gpu["bandwidth_gb_per_s"]}
        write_json(args.json, out, "batch-1 decode")
        if args.profile:
            print(f"profiling decode steps at batch {args.max_num_seqs} ...", flush=True)
            try:
                profile = profile_decode_cuda(model, args, requests)
                print_cuda_profile(profile)
            except Exception as e:  # one GPU session: the transformers runs still come
                import traceback
                traceback.print_exc()
                print(f"PROFILE FAILED ({type(e).__name__}: {e}); going on without it", flush=True)
                profile = {"failed": f"{type(e).__name__}: {e}"}
            out["profile"] = profile
            # Batch 1 too: whether a single request's token waits on the host or on the kernels (the batch-1
            # roofline target), in a few more steps.
            gc.collect()
            torch.cuda.empty_cache()  # the batch-256 engine's KV pool
            try:
                out["profile_batch1"] = profile_decode_cuda(model, args, requests, count=1)
                print_cuda_profile(out["profile_batch1"], kernels=False)
            except Exception as e:
                print(f"BATCH-1 PROFILE FAILED ({type(e).__name__}: {e}); going on without it", flush=True)
                out["profile_batch1"] = {"failed": f"{type(e).__name__}: {e}"}
            write_json(args.json, out, "profile")
            gc.collect()
            torch.cuda.empty_cache()  # the profiled engine's KV pool, before transformers' caches
    server = None
    if args.server:
        print(f"fivefold server ({'in this process' if args.server == 'local' else args.server}), "
              f"{args.concurrency or 'all'} in flight, "
              + (f"Poisson arrivals at {args.request_rate:g}/s" if args.request_rate else "all at t=0") + " ...",
              flush=True)
        server = run_server_side(model, args, requests, warm)
    out["server"] = server
    hf_runs = []
    out["transformers"] = hf_runs
    for bs in args.batch_sizes if hf is not None else []:
        print(f"transformers generate, static batches of {bs} ...", flush=True)
        hf_runs.append(run_hf(hf, requests, bs, pad))
        print(f"  {hf_runs[-1]['output_tokens_per_s']:.1f} output tok/s ({hf_runs[-1]['wall_s']:.2f} s)", flush=True)
        write_json(args.json, out, f"transformers bs={bs}")
    best = max(hf_runs, key=lambda r: r["output_tokens_per_s"]) if hf_runs else None

    # Greedy on both sides: tokens should agree, up to near-ties flipped by padding / op-order rounding.
    for r in hf_runs + ([server] if server and server["token_ids"] else []):
        r["requests_matching_fivefold"] = sum(a == b for a, b in zip(ours["token_ids"], r["token_ids"]))
        r["splits"] = splits(hf, requests, ours["token_ids"], r["token_ids"]) if hf is not None else []

    if decode is None:
        decode = run_decode_batch1(llm, hf, decode_prompt, args, pad)
    if roofline and not cuda:
        peaks.append(measure_peak_flops(torch.device("cpu"), dtype))
        # Like the peak, outside load only lowers a bandwidth sample: keep the better of start and end.
        bandwidth = max(bandwidth, measure_bandwidth(), key=lambda b: b["read_gb_per_s"])
    peak = max(peaks)
    # The bandwidth the decode roofline divides by: the GPU's HBM figure, or the CPU's measured read.
    roof_bandwidth = gpu["bandwidth_gb_per_s"] if cuda else bandwidth["read_gb_per_s"]

    flops = forward_flops(cfg, requests)
    ours["compute_roofline_fraction"] = flops / ours["wall_s"] / peak
    for r in hf_runs:
        r["compute_roofline_fraction"] = flops / r["wall_s"] / peak
    roofline_tps = roof_bandwidth * 1e9 / per_token["total"]
    for side in decode.values():
        side["bandwidth_roofline_fraction"] = side["best"] / roofline_tps

    out.update({"peak_flops": peak, "peak_flops_samples": peaks, "bandwidth": bandwidth, "forward_flops": flops,
                "transformers_best_batch_size": best["batch_size"] if best else None,
                "ratio_vs_transformers_best": ours["output_tokens_per_s"] / best["output_tokens_per_s"] if best else None,
                "server_ratio_vs_transformers_best":
                    server["output_tokens_per_s"] / best["output_tokens_per_s"] if best and server else None,
                "decode_batch1": {**decode, "bytes_per_token": per_token, "roofline_tokens_per_s": roofline_tps,
                                  "roofline_bandwidth_gb_per_s": roof_bandwidth},
                "gpu_rooflines": gpu})
    write_json(args.json, out, "summary")

    rows = [("fivefold", ours)] + ([("fivefold server", server)] if server else []) + \
        [(f"transformers bs={r['batch_size']}", r) for r in hf_runs]
    print_table(rows, best["output_tokens_per_s"] if best else None)
    if best:
        print(f"fivefold / transformers best (bs={best['batch_size']}): "
              f"{ours['output_tokens_per_s'] / best['output_tokens_per_s']:.2f}x output tokens/s")
        if server:
            print(f"fivefold server / transformers best (bs={best['batch_size']}): "
                  f"{server['output_tokens_per_s'] / best['output_tokens_per_s']:.2f}x output tokens/s")
        for r in hf_runs:
            print(f"  transformers bs={r['batch_size']}: {100 * r['wasted_fraction']:.0f}% of generated tokens wasted "
                  f"on finished requests; latency p50 {r['latency_p50_s']:.1f} s, p99 {r['latency_p99_s']:.1f} s; "
                  f"batch wall {', '.join(f'{t:.1f}' for t in r['batch_wall_s'])} s; "
                  f"{r['requests_matching_fivefold']}/{len(requests)} requests token-identical to fivefold"
                  + "".join(f"; request {x['request']} parts at output token {x['step']}, "
                            + ("one side stopped" if x["logprob_gap"] is None else
                               f"{x['logprob_gap']:.1e} apart in transformers' logprobs") for x in r["splits"]))
    print(f"fivefold: {ours['steps']} engine steps, {ours['preemptions']} preemptions; latency p50 "
          f"{ours['latency_p50_s']:.1f} s, p99 {ours['latency_p99_s']:.1f} s")
    if server:
        print_server_notes(server, ours, len(requests))
    if cuda:
        print(f"rooflines {gpu['source']}: {args.dtype} dense matmul peak {peak / 1e12:.0f} TFLOP/s, HBM "
              f"{roof_bandwidth:.0f} GB/s")
        print(f"forward FLOPs needed {flops / 1e12:.2f} T -> fivefold reaches "
              f"{100 * ours['compute_roofline_fraction']:.1f}% of the compute roofline"
              + (f" (transformers best {100 * best['compute_roofline_fraction']:.1f}%)" if best else ""))
        print(f"measured on this GPU ({bandwidth['tensor_gb']:.1f} GB fp32 tensor, best of 5): device-to-device copy "
              f"{bandwidth['copy_gb_per_s']:.0f} GB/s read+write, sum {bandwidth['read_gb_per_s']:.0f} GB/s read")
    else:
        print(f"matmul peak ({args.dtype}, best of {len(peaks)}): {peak / 1e9:.1f} GFLOP/s; forward FLOPs needed "
              f"{flops / 1e12:.2f} T -> fivefold reaches {100 * ours['compute_roofline_fraction']:.1f}% of the compute "
              f"roofline" + (f" (transformers best {100 * best['compute_roofline_fraction']:.1f}%)" if best else ""))
        print(f"memory bandwidth ({bandwidth['tensor_gb']:.1f} GB tensor, best of 2 x 5): sum {bandwidth['read_gb_per_s']:.1f} "
              f"GB/s read, copy {bandwidth['copy_gb_per_s']:.1f} GB/s read+write")
    print(f"batch-1 decode: {per_token['total'] / 1e6:.1f} MB read per token (weights {per_token['weights'] / 1e6:.1f}, "
          f"KV {per_token['kv'] / 1e6:.1f}) -> roofline {roofline_tps:.1f} tok/s at {roof_bandwidth:.1f} GB/s"
          + (" (HBM)" if cuda else ""))
    for side, d in decode.items():
        print(f"  {side:<12}: {d['best']:.1f} tok/s best, {d['median']:.1f} median = "
              f"{100 * d['bandwidth_roofline_fraction']:.0f}% of the bandwidth roofline")
    if best:
        ratio = decode["fivefold"]["best"] / decode["transformers"]["best"]
        print(f"  fivefold / transformers batch-1 decode: {ratio:.2f}x")
    print_steps(ours["step_times"])

    quant = run_quantized(model, args, requests, decode_prompt) if args.quant else None
    if quant:
        print_quantized(quant, ours, decode, model, args.dtype)
    out["quantized"] = quant
    paths = run_paths(model, args, requests, decode_prompt) if args.paths else None
    if paths:
        for v in paths.values():
            v["requests_matching_fivefold"] = sum(a == b for a, b in zip(ours["token_ids"], v["token_ids"]))
        print_variants("the engine's other paths (same weights, same requests)", paths, ours, decode,
                       "main run (" + ("graphs" if cuda else "eager") + ")")
    out["paths"] = paths

    if cuda and profile and "failed" not in profile:
        m = profile["median"]
        print(f"\nfivefold decode step at batch {profile['batch']} (profiled above): {1e3 * profile['step_wall_s']:.2f} ms "
              f"wall, {1e3 * m['kernel_s']:.2f} ms GPU kernels, {m['kernel_launches']:g} launches + "
              f"{m['graph_launches']:g} graph launches, {m['copies']:g} copies, {m['syncs']:g} syncs per step")
    elif args.profile:
        profile = profile_decode(model, args, requests)
        print(f"\nfivefold decode step at batch {profile['batch']} (context mean {profile['context_mean']:.0f}, "
              f"longest {profile['context_max']} tokens): "
              f"{1e3 * profile['step_s_under_torch_profiler']:.0f} ms under torch.profiler, "
              f"{1e3 * profile['step_s_under_cprofile']:.0f} ms under cProfile\n" + profile["torch_ops"])
        print(profile["python"])
    out["profile"] = profile
    if cuda:
        out["targets"] = print_targets(out, args)

    if args.json:
        write_json(args.json, out, "done")
        print(f"wrote {args.json}")
    return out


if __name__ == "__main__":
    main()
