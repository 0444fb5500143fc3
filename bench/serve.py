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
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import statistics
import time

import torch

from fivefold.config import ServeConfig
from fivefold.interop.hf import hf_config_from, weights_to_hf
from fivefold.memory.formulas import count_params, matmul_params
from fivefold.model import build_model
from fivefold.planner.calibrate import measure_bandwidth
from fivefold.presets import get_preset
from fivefold.serve import LLM, SamplingParams
from fivefold.serve.blocks import blocks_for
from fivefold.serve.kv_pool import kv_bytes_per_token
from fivefold.train.metrics import measure_peak_flops
from serve_client import Request, id_tokenizer, latency_summary, local_server, make_requests, run_server, served_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="preset name (fivefold.presets); random weights")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=256)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=256)
    # 8 is left out by default: it was the slowest to run and the worst of 8/16/32 on a 2-core CPU
    # (bench/README.md); a fast accelerator may want it back.
    p.add_argument("--batch-sizes", default="16,32", help="transformers static batch sizes to try")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES),
                   help="bfloat16 wants native bf16 matmuls (avx512_bf16, AMX or a GPU-class CPU kernel); "
                        "on AVX2 only, the matmul-peak measurement alone takes tens of minutes")
    p.add_argument("--seed", type=int, default=0, help="weights and request set")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--skip-hf", action="store_true", help="fivefold only (no transformers reference)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-blocks", type=int, default=0,
                   help="KV pool blocks; 0: enough for every request at once (no preemption)")
    p.add_argument("--decode-prompt", type=int, default=128, help="batch-1 decode: prompt tokens")
    p.add_argument("--decode-output", type=int, default=128, help="batch-1 decode: output tokens")
    p.add_argument("--decode-reps", type=int, default=2, help="batch-1 decode runs per side (best and median kept)")
    p.add_argument("--profile", action="store_true", help="profile decode steps of fivefold at a full batch")
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
    p.add_argument("--skip-roofline", action="store_true",
                   help="do not measure the matmul peak and memory bandwidth (minutes for bf16 on a CPU without "
                        "native bf16 matmuls); the roofline fractions are then not printed")
    p.add_argument("--json", default="", help="write all numbers here")
    args = p.parse_args(argv)
    args.batch_sizes = [int(x) for x in args.batch_sizes.split(",") if x.strip()]
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
    return args


def machine_info(threads: int) -> dict:
    import transformers
    from machine import base_info
    return {**base_info(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "transformers": transformers.__version__, "threads": threads}


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


def build_models(name: str, seed: int, dtype: torch.dtype, skip_hf: bool):
    cfg = get_preset(name)
    ours = build_model(cfg, "cpu", seed=seed, dtype=dtype).eval()
    if skip_hf:
        return cfg, ours, None
    from transformers import LlamaConfig, LlamaForCausalLM

    if cfg.position != "rope":
        raise SystemExit(f"--model {name}: the transformers reference here is Llama only; use --skip-hf")
    hf = LlamaForCausalLM(LlamaConfig(**hf_config_from(cfg, "llama"), attn_implementation="sdpa"))
    missing, unexpected = hf.load_state_dict(weights_to_hf(ours.state_dict(), cfg), strict=False)
    # A tied model's lm_head is the embedding in both; anything else left over is a naming bug.
    leftover = [k for k in missing + unexpected if not (cfg.tie_embeddings and k == "lm_head.weight")]
    assert not leftover, f"weights do not map onto LlamaForCausalLM: {leftover[:5]}"
    hf = hf.to(dtype).eval()
    # No stopping on eos, like ignore_eos: every request produces exactly max_new_tokens.
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = pad_id(cfg)
    return cfg, ours, hf


def pad_id(cfg) -> int:
    return cfg.eos_token_id if cfg.eos_token_id is not None and cfg.eos_token_id >= 0 else 0


def make_llm(model, args, requests: list[Request], tokenizer=None) -> LLM:
    # Room for every request at once, plus a spare block each, so the run never preempts: this measures
    # batching, not a pool sized too small (that is --kv-blocks N).
    block = ServeConfig().block_size
    blocks = args.kv_blocks or sum(blocks_for(len(r.prompt) + r.max_tokens, block) for r in requests) + len(requests)
    return LLM(model, tokenizer=tokenizer, device="cpu", seed=args.seed, num_blocks=blocks,
               max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)


def greedy(r: Request) -> SamplingParams:
    return SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True)


def run_fivefold(llm: LLM, requests: list[Request]) -> dict:
    """All requests at once; the engine's own clock gives each one's TTFT and TPOT."""
    preempted = llm.engine.scheduler.preemptions
    steps = llm.engine.stats["steps"]
    start, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate([r.prompt for r in requests], [greedy(r) for r in requests])
    wall = time.perf_counter() - start
    util = (time.process_time() - cpu) / (wall * torch.get_num_threads())
    assert all(len(o.token_ids) == r.max_tokens for o, r in zip(outs, requests))
    ttft = [o.ttft for o in outs]
    tpot = [o.tpot for o in outs]
    e2e = [o.ttft + (o.tpot or 0) * (len(o.token_ids) - 1) for o in outs]
    tokens = sum(len(o.token_ids) for o in outs)
    prompt = sum(len(r.prompt) for r in requests)
    return {"wall_s": wall, "output_tokens": tokens, "output_tokens_per_s": tokens / wall,
            "prompt_and_output_tokens_per_s": (prompt + tokens) / wall, "cpu_util": util,
            "steps": llm.engine.stats["steps"] - steps, "preemptions": llm.engine.scheduler.preemptions - preempted,
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
    step i's time is when the batch's i-th new token is chosen."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def hf_generate(hf, prompts: list[list[int]], new_tokens: int, pad: int) -> tuple[list[list[int]], list[float]]:
    """One static batch, left-padded; returns each row's new tokens and the step times."""
    from transformers import LogitsProcessorList

    longest = max(map(len, prompts))
    ids = torch.tensor([[pad] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    clock = StepClock()
    with torch.inference_mode():
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=0,
                          do_sample=False, logits_processor=LogitsProcessorList([clock]))
    new = out[:, longest:]
    assert new.shape[1] == new_tokens, f"transformers stopped after {new.shape[1]} of {new_tokens} tokens"
    return new.tolist(), clock.times


def run_hf(hf, requests: list[Request], batch_size: int, pad: int) -> dict:
    """Requests in arrival order, `batch_size` at a time; a batch generates its longest request's length
    and only each request's own wanted tokens count. TTFT and TPOT are what a streaming client of each
    request would see: all arrived at t=0, so a later batch's requests also waited for earlier batches."""
    ttft, tpot, e2e, batch_walls, token_ids = [], [], [], [], []
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
    wall = time.perf_counter() - start
    util = (time.process_time() - cpu) / (wall * torch.get_num_threads())
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
        out = hf.generate(input_ids=torch.tensor([prompt]), max_new_tokens=tokens, do_sample=False,
                          output_logits=True, return_dict_in_generate=True)
    theirs = out.sequences[0, len(prompt):].tolist()
    worst = 0.0
    for entry, logits in zip(ours.logprobs, out.logits):
        reference = torch.log_softmax(logits[0].float(), dim=-1)
        ids, values = zip(*entry["top"])
        worst = max(worst, (torch.tensor(values) - reference[list(ids)]).abs().max().item())
    print(f"greedy check, {tokens} tokens of one 32-token prompt: fivefold {ours.token_ids}, transformers "
          f"{theirs}; top-{top} logprobs differ by at most {worst:.1e}")
    assert ours.token_ids == theirs, "fivefold and transformers disagree on greedy tokens from the same weights"
    assert worst < CHECK_ATOL[dtype], f"fivefold and transformers logprobs differ by {worst:.1e} (> {CHECK_ATOL[dtype]})"
    return {"prompt_len": len(prompt), "fivefold": ours.token_ids, "transformers": theirs,
            "max_logprob_diff": worst}


def decode_batch1(llm: LLM, hf, prompt: list[int], output: int, reps: int, pad: int) -> dict:
    """Decode tokens/s of one request after its first token: (output - 1) / (time after the first)."""
    params = SamplingParams(max_tokens=output, temperature=0, ignore_eos=True)
    out = {"fivefold": [], "transformers": []}
    for _ in range(reps):
        o = llm.generate([prompt], params)[0]
        out["fivefold"].append(1 / o.tpot)
        if hf is not None:
            _, times = hf_generate(hf, [prompt], output, pad)
            out["transformers"].append((output - 1) / (times[output - 1] - times[0]))
    return {side: {"tokens_per_s": xs, "best": max(xs), "median": statistics.median(xs)}
            for side, xs in out.items() if xs}


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
        llm = make_llm(quantized, args, requests)
        warm = make_requests(4, model.cfg.vocab_size, (16, 64), (4, 8), args.seed + 2)
        llm.generate([r.prompt for r in warm], [greedy(r) for r in warm])
        print(f"fivefold engine, {method} weights ...", flush=True)
        run = run_fivefold(llm, requests)
        decode = decode_batch1(llm, None, decode_prompt, args.decode_output, args.decode_reps, 0)["fivefold"]
        out[method] = {"weight_bytes": weight_bytes, "output_tokens_per_s": run["output_tokens_per_s"],
                       "decode_batch1": decode, "token_ids": run["token_ids"]}
    return out


def print_quantized(quant: dict, ours: dict, decode: dict, model, dtype: str) -> None:
    base_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"\nquantized weights against {dtype} (same engine, same requests):")
    print(f"  {'weights':<10}{'bytes':>14}{'batch-1 decode tok/s':>22}{'ratio':>7}{'all requests tok/s':>20}{'ratio':>7}")
    print(f"  {dtype:<10}{base_bytes:>14,}{decode['fivefold']['best']:>22.1f}{1:>7.2f}"
          f"{ours['output_tokens_per_s']:>20.1f}{1:>7.2f}")
    for method, q in quant.items():
        print(f"  {method:<10}{q['weight_bytes']:>14,}{q['decode_batch1']['best']:>22.1f}"
              f"{q['decode_batch1']['best'] / decode['fivefold']['best']:>7.2f}{q['output_tokens_per_s']:>20.1f}"
              f"{q['output_tokens_per_s'] / ours['output_tokens_per_s']:>7.2f}")


# --------------------------------------------------------------------------------------------
# Where a full-batch decode step goes


def profile_decode(model, args, requests: list[Request], steps: int = 3, rows: int = 20) -> dict:
    """Fill the engine with the requests (each given max-output tokens, so none finishes early), run
    until every one is past its prompt, then profile `steps` decode steps: torch ops and Python."""
    from torch.profiler import ProfilerActivity, profile

    long = [Request(r.prompt, args.max_output) for r in requests]
    llm = make_llm(model, args, long)
    engine = llm.engine
    for r in long:
        engine.add_request(r.prompt, greedy(r))
    while engine.num_waiting or any(s.remaining > 1 for s in engine.scheduler.running):
        engine.step()
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
    if min(r["cpu_util"] for _, r in rows if r["cpu_util"] is not None) < 0.8:
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


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    info = machine_info(torch.get_num_threads())
    print(f"{info['cpu_model']} ({info['cpu_capability']}), {info['threads']} threads, torch {info['torch']}, "
          f"transformers {info['transformers']}")
    if args.server and args.server != "local":
        print(f"--server {args.server} serves {served_model(args.server)!r}; its prompts are token ids of "
              f"--model {args.model}, so it should serve that preset's vocabulary")
    nan = float("nan")
    roofline = not args.skip_roofline
    peaks = [measure_peak_flops(torch.device("cpu"), dtype) for _ in range(3)] if roofline else [nan]
    bandwidth = measure_bandwidth() if roofline else {"read_gb_per_s": nan, "copy_gb_per_s": nan, "tensor_gb": nan}

    cfg, model, hf = build_models(args.model, args.seed, dtype, args.skip_hf)
    pad = pad_id(cfg)
    requests = make_requests(args.requests, cfg.vocab_size, (args.min_prompt, args.max_prompt),
                             (args.min_output, args.max_output), args.seed)
    prompt_tokens = sum(len(r.prompt) for r in requests)
    outputs = [r.max_tokens for r in requests]
    print(f"{args.model}: {count_params(cfg) / 1e6:.1f}M params, {args.dtype}; {len(requests)} requests, "
          f"{prompt_tokens} prompt tokens, {sum(outputs)} output tokens (each {min(outputs)}..{max(outputs)}, "
          f"median {statistics.median(outputs):.0f})")

    llm = make_llm(model, args, requests)
    print(llm.engine.plan.describe(args.max_prompt + args.max_output))
    check = check_same_greedy(llm, hf, cfg.vocab_size, args.dtype, args.seed) if hf is not None else None
    # Warm both up (thread pools, allocator, kernel choice) on a small batch outside the request set.
    warm = make_requests(4, cfg.vocab_size, (16, 64), (4, 8), args.seed + 2)
    llm.generate([r.prompt for r in warm], [greedy(r) for r in warm])
    if hf is not None:
        hf_generate(hf, [r.prompt for r in warm], 4, pad)

    print("fivefold engine ...", flush=True)
    ours = run_fivefold(llm, requests)
    server = None
    if args.server:
        print(f"fivefold server ({'in this process' if args.server == 'local' else args.server}), "
              f"{args.concurrency or 'all'} in flight, "
              + (f"Poisson arrivals at {args.request_rate:g}/s" if args.request_rate else "all at t=0") + " ...",
              flush=True)
        server = run_server_side(model, args, requests, warm)
    hf_runs = []
    for bs in args.batch_sizes if hf is not None else []:
        print(f"transformers generate, static batches of {bs} ...", flush=True)
        hf_runs.append(run_hf(hf, requests, bs, pad))
    best = max(hf_runs, key=lambda r: r["output_tokens_per_s"]) if hf_runs else None

    # Greedy on both sides: tokens should agree, up to near-ties flipped by padding / op-order rounding.
    for r in hf_runs + ([server] if server and server["token_ids"] else []):
        r["requests_matching_fivefold"] = sum(a == b for a, b in zip(ours["token_ids"], r["token_ids"]))

    rng = random.Random(args.seed + 3)
    decode_prompt = [rng.randrange(cfg.vocab_size) for _ in range(args.decode_prompt)]
    print(f"batch-1 decode ({args.decode_prompt}-token prompt, {args.decode_output} tokens) ...", flush=True)
    decode = decode_batch1(llm, hf, decode_prompt, args.decode_output, args.decode_reps, pad)
    if roofline:
        peaks.append(measure_peak_flops(torch.device("cpu"), dtype))
        # Like the peak, outside load only lowers a bandwidth sample: keep the better of start and end.
        bandwidth = max(bandwidth, measure_bandwidth(), key=lambda b: b["read_gb_per_s"])
    peak = max(peaks)

    flops = forward_flops(cfg, requests)
    ours["compute_roofline_fraction"] = flops / ours["wall_s"] / peak
    for r in hf_runs:
        r["compute_roofline_fraction"] = flops / r["wall_s"] / peak
    per_token = decode_bytes_per_token(cfg, dtype, args.decode_prompt, args.decode_output)
    roofline_tps = bandwidth["read_gb_per_s"] * 1e9 / per_token["total"]
    for side in decode.values():
        side["bandwidth_roofline_fraction"] = side["best"] / roofline_tps

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
                  f"{r['requests_matching_fivefold']}/{len(requests)} requests token-identical to fivefold")
    print(f"fivefold: {ours['steps']} engine steps, {ours['preemptions']} preemptions; latency p50 "
          f"{ours['latency_p50_s']:.1f} s, p99 {ours['latency_p99_s']:.1f} s")
    if server:
        print_server_notes(server, ours, len(requests))
    print(f"matmul peak ({args.dtype}, best of {len(peaks)}): {peak / 1e9:.1f} GFLOP/s; forward FLOPs needed "
          f"{flops / 1e12:.2f} T -> fivefold reaches {100 * ours['compute_roofline_fraction']:.1f}% of the compute "
          f"roofline" + (f" (transformers best {100 * best['compute_roofline_fraction']:.1f}%)" if best else ""))
    print(f"memory bandwidth ({bandwidth['tensor_gb']:.1f} GB tensor, best of 2 x 5): sum {bandwidth['read_gb_per_s']:.1f} "
          f"GB/s read, copy {bandwidth['copy_gb_per_s']:.1f} GB/s read+write")
    print(f"batch-1 decode: {per_token['total'] / 1e6:.1f} MB read per token (weights {per_token['weights'] / 1e6:.1f}, "
          f"KV {per_token['kv'] / 1e6:.1f}) -> roofline {roofline_tps:.1f} tok/s at {bandwidth['read_gb_per_s']:.1f} GB/s")
    for side, d in decode.items():
        print(f"  {side:<12}: {d['best']:.1f} tok/s best, {d['median']:.1f} median = "
              f"{100 * d['bandwidth_roofline_fraction']:.0f}% of the bandwidth roofline")
    if best:
        ratio = decode["fivefold"]["best"] / decode["transformers"]["best"]
        print(f"  fivefold / transformers batch-1 decode: {ratio:.2f}x")

    quant = run_quantized(model, args, requests, decode_prompt) if args.quant else None
    if quant:
        print_quantized(quant, ours, decode, model, args.dtype)

    profile = profile_decode(model, args, requests) if args.profile else None
    if profile:
        print(f"\nfivefold decode step at batch {profile['batch']} (context mean {profile['context_mean']:.0f}, "
              f"longest {profile['context_max']} tokens): "
              f"{1e3 * profile['step_s_under_torch_profiler']:.0f} ms under torch.profiler, "
              f"{1e3 * profile['step_s_under_cprofile']:.0f} ms under cProfile\n" + profile["torch_ops"])
        print(profile["python"])

    for r in [ours] + hf_runs + ([server] if server else []) + list((quant or {}).values()):
        r.pop("token_ids")
    out = {"machine": info, "settings": {k: v for k, v in vars(args).items() if k != "json"},
           "model": {"name": args.model, "params": count_params(cfg)},
           "requests": {"count": len(requests), "prompt_tokens": prompt_tokens, "output_tokens": sum(outputs),
                        "prompt_lengths": [len(r.prompt) for r in requests], "output_lengths": outputs},
           "greedy_check": check, "peak_flops": peak, "peak_flops_samples": peaks, "bandwidth": bandwidth,
           "forward_flops": flops, "fivefold": ours, "server": server, "transformers": hf_runs,
           "transformers_best_batch_size": best["batch_size"] if best else None,
           "ratio_vs_transformers_best": ours["output_tokens_per_s"] / best["output_tokens_per_s"] if best else None,
           "server_ratio_vs_transformers_best":
               server["output_tokens_per_s"] / best["output_tokens_per_s"] if best and server else None,
           "decode_batch1": {**decode, "bytes_per_token": per_token, "roofline_tokens_per_s": roofline_tps},
           "quantized": quant, "profile": profile}
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")
    return out


if __name__ == "__main__":
    main()
