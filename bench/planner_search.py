"""The layout search's time, with the pipeline simulation it runs against a plain sweep, in one process.

`search_layouts` prices every legal layout, and each price simulates the layout's pipeline schedule
(fivefold.parallel.pipeline_schedules.simulate_schedule: event-driven, each action once, over the schedule
compiled once per shape). The reference is the simulation written plainly (`sweep`): sweep the ranks again
and again, each running its next actions while their inputs are done. Both give every action the same start
and end to the bit (tests/test_pipeline.py), so the two searches must rank the same layouts with the same
figures; this asserts that and prints the time of each, alternating rounds, and their ratio:

    python bench/planner_search.py                      # Mixtral 8x7B at 32 GPUs, Llama 3 8B at 16 (~2 min)
    python bench/planner_search.py --case llama3-8b:16 --rounds 3 --json out.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

from machine import base_info, write_results

from fivefold.config_load import load_config
from fivefold.parallel.pipeline_schedules import Timeline, build_schedule
from fivefold.planner import speed
from fivefold.planner.hardware import load_profile
from fivefold.planner.search import search_layouts

CASES = ["mixtral-8x7b:32", "llama3-8b:16"]


def sweep_times(lists, cost) -> dict:
    """{(rank, action): (start, end)} of every action, each run as soon as its rank is free and its input
    has arrived (F from the stage before, B from the stage after or the last stage's own F, W from its own
    B), found by sweeping the ranks until nothing is left. Raises on a deadlock."""
    pp, chunks = len(lists), 1 + max(a.chunk for lst in lists for a in lst)
    last, done, times = pp * chunks - 1, {}, {}
    position, free = [0] * pp, [0.0] * pp
    while any(position[r] < len(lists[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            while position[r] < len(lists[r]):
                a = lists[r][position[r]]
                stage = a.chunk * pp + r
                need = (None if a.kind == "F" and stage == 0 else ("F", a.mb, stage - 1) if a.kind == "F" else
                        ("F", a.mb, stage) if a.kind == "B" and stage == last else
                        ("B", a.mb, stage + 1) if a.kind == "B" else ("B", a.mb, stage))
                if need is not None and need not in done:
                    break
                start = max(free[r], done[need] if need else 0.0)
                free[r] = done[(a.kind, a.mb, stage)] = start + cost(r, a)
                times[r, a] = (start, free[r])
                position[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("pipeline schedule deadlocks")
    return times


def sweep(name: str, pp: int, m: int, v: int, stage_costs: dict) -> Timeline:
    """simulate_schedule's answer by the plain sweep."""
    lists = build_schedule(name, pp, m, v)
    times = sweep_times(lists, lambda r, a: stage_costs[r, a.chunk, a.kind])
    return Timeline([(r, a, start, end) for r, actions in enumerate(lists) for a in actions
                     for start, end in [times[r, a]]], pp)


def search(case: str, simulation=None):
    preset, gpus = case.split(":")
    cfg = load_config(preset=preset, overrides=["train.precision=bf16-mixed", "train.seq_len=2048"])
    with mock.patch.object(speed, "simulate_schedule", simulation or speed.simulate_schedule):
        start = time.perf_counter()
        result = search_layouts(cfg, load_profile("h100-sxm"), int(gpus), 1024 * 2048, top=1000)
        return time.perf_counter() - start, result


def ranking(result) -> list:
    return [(c.layout(), round(c.speed.tokens_per_s_per_gpu, 6), c.memory) for c in result.ranked]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", help="PRESET:GPUS (repeatable); default: " + ", ".join(CASES))
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds of both searches per case")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    rows = []
    for case in args.case or CASES:
        ours, plain = [], []
        for _ in range(args.rounds):
            seconds, result = search(case)
            ours.append(seconds)
            seconds, reference = search(case, sweep)
            plain.append(seconds)
            assert ranking(result) == ranking(reference), f"{case}: the two simulations rank differently"
        row = {"case": case, "layouts": len(result.ranked), "event_driven_s": statistics.median(ours),
               "sweep_s": statistics.median(plain)}
        row["speedup"] = row["sweep_s"] / row["event_driven_s"]
        rows.append(row)
        print(f"{case:18s} {row['layouts']:4d} layouts   event-driven {row['event_driven_s']:6.2f} s   "
              f"plain sweep {row['sweep_s']:6.2f} s   {row['speedup']:.2f}x", flush=True)
    if args.json:
        write_results(args.json, {"machine": base_info(), "rounds": args.rounds, "rows": rows})


if __name__ == "__main__":
    main()
