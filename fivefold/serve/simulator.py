"""The serving engine replayed on a clock: throughput and latency of a workload, before launch.

The simulator runs the engine's own scheduler and block manager (fivefold.serve.scheduler, blocks) over a
workload (fivefold.serve.workload), step by step as `Engine.step` does (synchronously: admit what has
arrived, schedule, compute, take each sampled sequence's token, finish what is done), but instead of a
forward it advances a clock by the step-cost model's time for that batch (fivefold.serve.step_cost).
So the batches are exactly the engine's (tested against a recorded run), preemption and KV usage
included; only the seconds come from the model. Greedy generation to each request's output length, as
bench/serve.py measures with ignore_eos.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from fivefold.config import Config, ConfigError
from fivefold.serve.blocks import BlockManager, blocks_for
from fivefold.serve.sampling import SamplingParams
from fivefold.serve.scheduler import Scheduler, Sequence
from fivefold.serve.step_cost import StepCostModel, StepShape
from fivefold.serve.workload import Workload


@dataclass
class SimResult:
    makespan: float  # seconds from the first arrival to the last token
    output_tokens: int
    ttft: list[float]  # per request, seconds
    tpot: list[float | None]
    e2e: list[float]
    steps: list[list[tuple[int, int]]] = field(default_factory=list)  # per step: (request index, tokens)
    kv_used: list[tuple[float, int]] = field(default_factory=list)  # (time, blocks in use) after each step
    preemptions: int = 0
    num_blocks: int = 0

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.makespan if self.makespan else 0.0

    def summary(self) -> dict:
        tpot = [t for t in self.tpot if t is not None]

        def pct(xs, q):
            return float(np.percentile(xs, q)) if xs else None

        return {"output_tokens_per_s": self.output_tokens_per_s, "makespan_s": self.makespan,
                "output_tokens": self.output_tokens, "steps": len(self.steps), "preemptions": self.preemptions,
                "ttft_p50_s": pct(self.ttft, 50), "ttft_p99_s": pct(self.ttft, 99),
                "tpot_p50_s": pct(tpot, 50), "tpot_p99_s": pct(tpot, 99),
                "e2e_p50_s": pct(self.e2e, 50), "e2e_p99_s": pct(self.e2e, 99),
                "kv_peak_fraction": max((u for _, u in self.kv_used), default=0) / max(self.num_blocks, 1)}


def simulate(cfg: Config, cost: StepCostModel, workload: Workload, num_blocks: int, graphs: bool = False,
             record_steps: bool = True) -> SimResult:
    """Replay `workload` through the engine's scheduler with `cost` as the clock, on a pool of `num_blocks`
    KV blocks; `graphs`: decode-only steps replay CUDA graphs (no per-layer host work)."""
    s, m = cfg.serve, cfg.model
    max_len = s.max_model_len or m.max_seq_len
    if num_blocks < 1:
        raise ConfigError("the KV pool holds no block on this hardware: the weights leave no room for it; raise "
                          "serve.kv_memory or set serve.num_blocks, or use more memory (a larger device or serve "
                          "tp>1) or a smaller model")
    for i, r in enumerate(workload.requests):
        need = r.prompt + r.output
        if need > max_len or blocks_for(need, s.block_size) > num_blocks:
            raise ConfigError(f"workload request {i}: prompt {r.prompt} + output {r.output} tokens does not fit "
                              f"(context {max_len}, pool {num_blocks} blocks of {s.block_size}); the engine would "
                              f"refuse it")
    blocks = BlockManager(num_blocks, s.block_size, s.prefix_cache)
    scheduler = Scheduler(blocks, s.max_num_seqs, s.max_num_batched_tokens)
    pending = deque(sorted(range(len(workload.requests)), key=lambda i: workload.requests[i].arrival))
    arrivals, index = itertools.count(), {}
    first: dict[int, float] = {}
    done: dict[int, float] = {}
    clock, steps, kv = 0.0, [], []
    token = itertools.count(1)  # distinct token ids: no prompt shares a prefix with another, as in the bench
    while pending or scheduler.has_work():
        while pending and workload.requests[pending[0]].arrival <= clock:  # the engine's inbox
            i = pending.popleft()
            r = workload.requests[i]
            seq = Sequence(f"req-{i}", [next(token) for _ in range(r.prompt)],
                           SamplingParams(max_tokens=r.output, temperature=0, ignore_eos=True), None,
                           next(arrivals))
            index[id(seq)] = i
            scheduler.add(seq)
        work = scheduler.schedule()
        if not work:
            if pending:  # idle until the next arrival
                clock = max(clock, workload.requests[pending[0]].arrival)
            continue
        work.sort(key=lambda e: e[1] != 1)  # as Engine.step orders a batch
        tokens = np.array([n for _, n in work])
        context = np.array([seq.num_computed + n for seq, n in work])
        sampled = [seq for seq, n in work if seq.num_computed + n == len(seq.token_ids)]
        decode_only = bool((tokens == 1).all())
        clock += cost.seconds(StepShape(tokens, context, len(sampled), graphed=graphs and decode_only))
        if record_steps:
            steps.append([(index[id(seq)], n) for seq, n in work])
        for seq, n in work:
            seq.num_computed += n
            blocks.register(seq)
        for seq in sampled:
            i = index[id(seq)]
            first.setdefault(i, clock)
            seq.append(0)
            if len(seq.output_ids) >= seq.params.max_tokens:
                seq.finish_reason = "length"
                scheduler.finish(seq)
                done[i] = clock
        kv.append((clock, blocks.num_used))
    reqs = workload.requests
    ttft = [first[i] - reqs[i].arrival for i in range(len(reqs))]
    tpot = [(done[i] - first[i]) / (reqs[i].output - 1) if reqs[i].output > 1 else None for i in range(len(reqs))]
    e2e = [done[i] - reqs[i].arrival for i in range(len(reqs))]
    start = min(r.arrival for r in reqs)
    return SimResult(max(done.values()) - start, workload.output_tokens, ttft, tpot, e2e, steps, kv,
                     scheduler.preemptions, num_blocks)
