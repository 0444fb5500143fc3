"""`fivefold plan --serve --cluster PROFILE --workload SPEC`: serving throughput and latency before launch.

Prints the memory plan, then the simulator's replay of the workload (fivefold.serve.simulator): output
tokens/s, TTFT / TPOT / end-to-end percentiles, preemptions and peak KV use. `--search` ranks serving
layouts (tp degree, max_num_seqs, token budget, block size, dtype) by throughput under a latency bound
(`--max-tpot`, p99); `--png` plots predicted tokens/s and p99 TPOT against the request rate, knee marked.
"""

from __future__ import annotations

import dataclasses
import json

import torch

from fivefold.config import Config, ConfigError
from fivefold.planner.hardware import HardwareProfile
from fivefold.serve.blocks import blocks_for
from fivefold.serve.kv_pool import kv_plan
from fivefold.serve.plan import plan_serving, replays_graphs
from fivefold.serve.simulator import SimResult, simulate
from fivefold.serve.step_cost import StepCostModel
from fivefold.serve.workload import Workload, parse_workload


def predict(cfg: Config, profile: HardwareProfile, workload: Workload, tp: int = 1,
            num_blocks: int | None = None) -> SimResult:
    """The simulator's replay of `workload` on `profile` under cfg.serve, tensor parallel over `tp`."""
    if cfg.model.num_heads % tp or cfg.model.num_kv_heads % tp:
        raise ConfigError(f"tp={tp} does not divide num_heads={cfg.model.num_heads} and "
                          f"num_kv_heads={cfg.model.num_kv_heads}")
    if num_blocks is None:
        num_blocks = pool_blocks(cfg, profile, tp)
    return simulate(cfg, StepCostModel(cfg, profile, tp), workload, num_blocks, graphs=replays_graphs(cfg, profile.device, tp))


def pool_blocks(cfg: Config, profile: HardwareProfile, tp: int = 1) -> int:
    """KV blocks the engine would allocate on one rank of `profile`: serve.kv_memory of what its shard
    of the weights leaves (each rank holds 1/tp of every block)."""
    s, m = cfg.serve, cfg.model
    memory = int(profile.memory_bytes)
    whole = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, tp=1))  # the whole model's weights
    plan = plan_serving(whole, memory, device=profile.device)
    free = memory - plan.weights // tp
    return kv_plan(m, s.kv_memory, s.block_size, getattr(torch, s.dtype), free_bytes=free, tp=tp,
                   num_blocks=s.num_blocks, max_blocks=s.max_num_seqs * blocks_for(plan.max_model_len, s.block_size)
                   ).num_blocks


def run(args, cfg: Config, profile: HardwareProfile, device_memory: int | None) -> int:
    workload = parse_workload(args.workload or "default")
    if args.search:
        return _search(args, cfg, profile, workload)
    plan = plan_serving(cfg, device_memory, device=profile.device)
    result = predict(cfg, profile, workload, tp=cfg.parallel.tp)
    summary = result.summary()
    if args.png:
        _plot_rates(args.png, cfg, profile, workload)
    if args.json:
        print(json.dumps({"memory": plan.to_json(), "workload": _describe(workload), "profile": profile.name,
                          "prediction": summary}, indent=2))
        return 0
    print(plan.table())
    print(f"\nworkload {workload.spec}: {_describe(workload)['text']}; on {profile.name} ({profile.description})")
    print(_table(summary))
    return 0


def _describe(w: Workload) -> dict:
    n = len(w.requests)
    rate = "all at t=0" if all(r.arrival == 0 for r in w.requests) else \
        f"arrivals over {w.requests[-1].arrival:.1f} s"
    return {"requests": n, "prompt_tokens": w.prompt_tokens, "output_tokens": w.output_tokens,
            "text": f"{n} requests, {w.prompt_tokens:,} prompt and {w.output_tokens:,} output tokens, {rate}"}


def _ms(x: float | None) -> str:
    return f"{1e3 * x:9.1f}" if x is not None else f"{'-':>9}"


def _table(s: dict) -> str:
    return "\n".join([
        f"predicted: {s['output_tokens_per_s']:,.1f} output tok/s ({s['output_tokens']:,} tokens in "
        f"{s['makespan_s']:.2f} s, {s['steps']} engine steps, {s['preemptions']} preemptions, "
        f"peak KV use {100 * s['kv_peak_fraction']:.0f}%)",
        f"  {'':<6}{'p50 ms':>9} {'p99 ms':>9}",
        f"  {'TTFT':<6}{_ms(s['ttft_p50_s'])} {_ms(s['ttft_p99_s'])}",
        f"  {'TPOT':<6}{_ms(s['tpot_p50_s'])} {_ms(s['tpot_p99_s'])}",
        f"  {'E2E':<6}{_ms(s['e2e_p50_s'])} {_ms(s['e2e_p99_s'])}"])


def layouts(cfg: Config, profile: HardwareProfile) -> list[tuple[dict, Config, int]]:
    """Serving layouts worth trying: tp degrees that divide the heads and fit a node, batch limits, token
    budgets, block sizes, and the dtypes the device has."""
    m, base = cfg.model, cfg.serve
    tps = [t for t in (1, 2, 4, 8) if t <= profile.gpus_per_node and not m.num_heads % t and not m.num_kv_heads % t]
    dtypes = [d for d, key in (("bfloat16", "bf16"), ("float32", "fp32")) if profile.flops.get(key)]
    out = []
    for tp in tps:
        for seqs in (64, 128, 256):
            for budget in (2048, 8192):
                for block in (16, 32):
                    for dtype in dtypes:
                        serve = dataclasses.replace(base, max_num_seqs=seqs, max_num_batched_tokens=budget,
                                                    block_size=block, dtype=dtype)
                        out.append(({"tp": tp, "max_num_seqs": seqs, "max_num_batched_tokens": budget,
                                     "block_size": block, "dtype": dtype}, dataclasses.replace(cfg, serve=serve), tp))
    return out


def _search(args, cfg: Config, profile: HardwareProfile, workload: Workload) -> int:
    bound = args.max_tpot
    rows = []
    for layout, candidate, tp in layouts(cfg, profile):
        try:
            s = predict(candidate, profile, workload, tp).summary()
        except ConfigError as e:
            rows.append({**layout, "error": str(e)})
            continue
        # Throughput per GPU: a tp=2 layout uses two of them.
        rows.append({**layout, **s, "output_tokens_per_s_per_gpu": s["output_tokens_per_s"] / tp,
                     "meets_bound": s["tpot_p99_s"] is None or s["tpot_p99_s"] <= bound})
    ok = sorted((r for r in rows if "error" not in r and r["meets_bound"]),
                key=lambda r: -r["output_tokens_per_s_per_gpu"])
    if args.json:
        print(json.dumps({"workload": _describe(workload), "profile": profile.name, "max_tpot_p99_s": bound,
                          "ranked": ok[:args.top], "rejected": len(rows) - len(ok)}, indent=2))
        return 0
    print(f"workload {workload.spec}: {_describe(workload)['text']}; on {profile.name}; p99 TPOT <= "
          f"{1e3 * bound:.0f} ms; {len(rows)} layouts, {len(ok)} meet the bound")
    print(f"{'tp':>3} {'seqs':>5} {'budget':>6} {'block':>5} {'dtype':>9} | {'tok/s':>9} {'tok/s/GPU':>9} | "
          f"{'TTFT p50':>9} {'TPOT p50':>9} {'TPOT p99':>9} ms | {'preempt':>7}")
    for r in ok[:args.top]:
        print(f"{r['tp']:>3} {r['max_num_seqs']:>5} {r['max_num_batched_tokens']:>6} {r['block_size']:>5} "
              f"{r['dtype']:>9} | {r['output_tokens_per_s']:>9,.0f} {r['output_tokens_per_s_per_gpu']:>9,.0f} | "
              f"{_ms(r['ttft_p50_s'])} {_ms(r['tpot_p50_s'])} {_ms(r['tpot_p99_s'])}    | {r['preemptions']:>7}")
    if not ok:
        raise ConfigError(f"no serving layout meets p99 TPOT <= {1e3 * bound:.3g} ms for this workload; "
                          f"raise --max-tpot or lighten the workload")
    return 0


def rate_sweep(cfg: Config, profile: HardwareProfile, workload: Workload, rates: list[float]) -> list[dict]:
    """The workload's requests arriving as a Poisson stream at each rate (seeded): tokens/s and p99 TPOT."""
    import numpy as np

    out = []
    for rate in rates:
        gaps = np.random.default_rng(0).exponential(1 / rate, len(workload.requests))
        arrivals = np.cumsum(gaps)
        shifted = Workload([dataclasses.replace(r, arrival=float(a)) for r, a in zip(workload.requests, arrivals)],
                           f"{workload.spec} at {rate:g}/s")
        s = predict(cfg, profile, shifted).summary()
        out.append({"rate": rate, **s})
    return out


def knee(points: list[dict]) -> dict:
    """The rate past which p99 TPOT grows fastest per unit of extra throughput (the latency knee)."""
    best, where = -1.0, points[0]
    for a, b in zip(points, points[1:]):
        gain = max(b["output_tokens_per_s"] - a["output_tokens_per_s"], 1e-9)
        slope = ((b["tpot_p99_s"] or 0) - (a["tpot_p99_s"] or 0)) / gain
        if slope > best:
            best, where = slope, a
    return where


def _plot_rates(path: str, cfg: Config, profile: HardwareProfile, workload: Workload) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    top = predict(cfg, profile, workload).summary()
    # Requests per second the engine sustains when all arrive at once, and rates around it.
    full = len(workload.requests) / top["makespan_s"]
    rates = [full * f for f in (0.1, 0.2, 0.35, 0.5, 0.65, 0.8, 0.9, 1.0, 1.2, 1.5)]
    points = rate_sweep(cfg, profile, workload, rates)
    k = knee(points)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([p["rate"] for p in points], [p["output_tokens_per_s"] for p in points], "o-", color="tab:blue")
    ax.set_xlabel("request rate (requests/s, Poisson)")
    ax.set_ylabel("output tokens/s", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot([p["rate"] for p in points], [1e3 * (p["tpot_p99_s"] or 0) for p in points], "s--", color="tab:red")
    ax2.set_ylabel("p99 TPOT (ms)", color="tab:red")
    ax.axvline(k["rate"], color="gray", linestyle=":")
    ax.annotate(f"knee {k['rate']:.2f}/s", (k["rate"], k["output_tokens_per_s"]), textcoords="offset points",
                xytext=(5, -15))
    ax.set_title(f"predicted on {profile.name}: {len(workload.requests)} requests, {workload.spec}"[:90], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")
