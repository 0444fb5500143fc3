"""A serving step's working set: what `fivefold plan --serve` counts beside the weights and the KV pool, against
what real steps hold at their peak, measured op by op (fivefold.memory.live_peak.LivePeak).

Four steps, each the worst case of one phase of fivefold.serve.step_memory:
- **first chunk**: a prompt chunk of max_num_batched_tokens tokens (the MLP's products and the residual stream);
- **long context**: the last chunk of a prompt of max_model_len - 1 tokens (on the torch path, its mask over the
  earlier tokens and their gathered keys and values);
- **sampling**: max_num_seqs decodes drawn with temperature, top-p and a repetition penalty, each asking for
  logprobs (the sampler's sort, cumulative sums and copies);
- **scoring**: prompts scored at max_scored_tokens rows a step beside max_num_seqs - 2 decodes (the scored rows'
  logits), the largest of their steps.

Printed: each step's planned and measured bytes and their ratio (the plan is a bound: >= 1). On CUDA (the Triton
path) each row also gives the caching allocator's peak over the step less what was allocated before it
(`torch.cuda.max_memory_allocated`), which sees the kernels' workspaces too; its ratio is to the plan's
largest phase, since the allocator cannot tell the phases apart.

    python bench/serve_step_memory.py --json bench/results/serve_step_memory_cpu.json   # smollm2-135m, fp32, CPU
    python bench/serve_step_memory.py --model tiny                                     # a quick check
    python bench/serve_step_memory.py --device cuda --model llama3.2-1b --dtype bfloat16 --max-num-seqs 256 \
        --max-model-len 8192 --json bench/results/serve_step_memory_h100.json             # on a GPU
"""

from __future__ import annotations

import argparse

import torch

from fivefold.config_load import load_config
from fivefold.memory.units import human_bytes
from fivefold.model import build_model
from fivefold.serve import LLM, SamplingParams
from fivefold.serve.plan import plan_serving
from fivefold.serve.step_memory import measured_phases
from machine import base_info, write_results


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="a preset (random weights)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-scored-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more config overrides")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    return p.parse_args(argv)


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def phases(engine) -> dict:
    """The next step's phases' peaks (fivefold.serve.step_memory.measured_phases); on CUDA also "allocator":
    the caching allocator's peak over the step less what was allocated when it began."""
    cuda = engine.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(engine.device)
        torch.cuda.reset_peak_memory_stats(engine.device)
        before = torch.cuda.memory_allocated(engine.device)
    with measured_phases(engine) as peaks:
        engine.step()
    if cuda:
        torch.cuda.synchronize(engine.device)
        peaks["allocator"] = torch.cuda.max_memory_allocated(engine.device) - before
    return peaks


def drain(engine) -> None:
    while engine.has_unfinished():
        engine.step()


def main(argv=None) -> dict:
    args = parse_args(argv)
    cfg = load_config(preset=args.model, overrides=[
        f"serve.max_num_seqs={args.max_num_seqs}", f"serve.max_num_batched_tokens={args.max_num_batched_tokens}",
        f"serve.max_scored_tokens={args.max_scored_tokens}", f"serve.max_model_len={args.max_model_len}",
        "serve.kv_memory=1.0", f"serve.dtype={args.dtype}", *args.set])
    vocab, n = cfg.model.vocab_size, cfg.serve.max_num_seqs
    planned = plan_serving(cfg, device=args.device).step
    model = build_model(cfg.model, args.device, seed=args.seed, dtype=getattr(torch, args.dtype))
    engine = LLM(model, **vars(cfg.serve)).engine
    assert engine.step_memory == planned, (engine.step_memory, planned)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{args.model}, {args.dtype}, {device}: max_num_seqs {n}, max_num_batched_tokens {cfg.serve.max_num_batched_tokens}, "
          f"max_scored_tokens {cfg.serve.max_scored_tokens}, max_model_len {cfg.serve.max_model_len}; {planned.path} path",
          flush=True)
    greedy = SamplingParams(max_tokens=1, temperature=0)
    rows = []

    def row(name: str, planned_bytes: int, measured: int, allocator: int | None = None) -> None:
        rows.append({"step": name, "planned_bytes": planned_bytes, "measured_bytes": measured,
                     "planned_over_measured": planned_bytes / measured})
        extra = ""
        if allocator is not None:
            rows[-1].update(allocator_bytes=allocator, planned_peak_over_allocator=planned.peak / allocator)
            extra = f"  allocator {human_bytes(allocator):>10} (plan's largest / it {planned.peak / allocator:.3f})"
        print(f"{name:<14} planned {human_bytes(planned_bytes):>10}  measured {human_bytes(measured):>10}  "
              f"ratio {planned_bytes / measured:.3f}" + extra, flush=True)

    engine.add_request(prompt(cfg.serve.max_num_batched_tokens + 1, vocab, 1), greedy)
    peaks = phases(engine)
    row("first chunk", planned.mlp, peaks["forward"], peaks.get("allocator"))  # no earlier context: no mask
    drain(engine)

    engine.add_request(prompt(cfg.serve.max_model_len - 1, vocab, 2), greedy)
    steps = []
    while engine.has_unfinished():
        steps.append(phases(engine))
    row("long context", planned.forward, steps[-1]["forward"], steps[-1].get("allocator"))

    drawn = SamplingParams(max_tokens=3, temperature=0.8, top_p=0.9, repetition_penalty=1.1, logprobs=5, ignore_eos=True)
    for i in range(n):
        engine.add_request(prompt(8, vocab, 10 + i), drawn)
    engine.step()  # the prompts; then a step of n decodes
    peaks = phases(engine)
    row("sampling", planned.sampling, peaks["sampling"], peaks.get("allocator"))
    drain(engine)

    if cfg.serve.max_scored_tokens:
        for i in range(max(0, n - 2)):
            engine.add_request(prompt(4, vocab, 1000 + i), SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
        for i in range(min(2, n)):
            engine.add_request(prompt(2 * cfg.serve.max_scored_tokens, vocab, 3 + i),
                               SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
        steps, allocator = [], []
        while engine.has_unfinished():  # the LM head's moment ends the forward, then the scorer's
            peaks = phases(engine)
            steps.append(max(peaks["forward"], peaks["scoring"]))
            allocator.append(peaks.get("allocator", 0))
        # The bound of a step that scores: its forward's (the MLP's moment may hold more on a small vocabulary) or
        # the scored rows'.
        row("scoring", max(planned.mlp, planned.scoring), max(steps), max(allocator) if args.device == "cuda" else None)

    out = {**base_info(), "device": device, "model": args.model, "dtype": args.dtype, "path": planned.path,
           "serve": {k: getattr(cfg.serve, k) for k in ("max_num_seqs", "max_num_batched_tokens", "max_scored_tokens",
                                                       "max_model_len")},
           "planned_peak_bytes": planned.peak, "rows": rows}
    if args.json:
        write_results(args.json, out)
    return out


if __name__ == "__main__":
    main()
