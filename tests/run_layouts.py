"""Worker for the parity tests, run under torchrun: trains each config of a JSON list in turn in the
same process group (one launch instead of one per layout), each into its own train.out_dir.

Every layout also checks that the parameters this rank built are exactly the ones `fivefold plan`
counts for its pipeline stage (before ZeRO splits them): the planner and the runtime share one partition
and one set of shard shapes, and this is the proof. And that dropping the trainer frees its parameters,
masters and optimizer states at once, with the cycle collector off (no reference cycle holds them).

    torchrun --nproc-per-node 4 tests/run_layouts.py runs.json
"""

import gc
import json
import math
import sys
import weakref

import torch
from torch._dynamo.utils import counters

from fivefold.config_load import config_from_dict
from fivefold.memory.plan import plan_memory
from fivefold.parallel.mesh import exit_worker
from fivefold.train.trainer import Trainer


def check_planned_parameters(trainer: Trainer) -> None:
    planned = plan_memory(trainer.cfg, device="cpu", suggest=False).stages[trainer.mesh.pp_rank].params
    built = sum(math.prod(p.local_shape) for p in trainer.parallel.placements.values())
    if built != planned:
        raise AssertionError(f"rank {trainer.mesh.rank}: built {built:,} parameters, the plan says {planned:,}")


def write_compile_stats(trainer: Trainer) -> None:
    """What torch.compile made of this rank's blocks: graphs compiled, graph breaks and their reasons."""
    stats = {"unique_graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values()),
             "break_reasons": sorted(counters["graph_break"])}
    with open(f"{trainer.out_dir}/compile_stats_rank{trainer.mesh.rank}.json", "w") as f:
        json.dump(stats, f)


def model_state_refs(trainer: Trainer) -> list[weakref.ref]:
    opt = trainer.optimizer
    tensors = [*trainer.model.parameters(), *opt.masters]
    tensors += [v for state in opt.inner.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return [weakref.ref(t) for t in tensors]


if __name__ == "__main__":
    gc.disable()
    for run in json.loads(open(sys.argv[1]).read()):
        compiled = run["config"]["train"]["compile"] == "true"
        counters.clear()
        trainer = Trainer(config_from_dict(run["config"]), resume=run.get("resume", False), quiet=True)
        check_planned_parameters(trainer)
        trainer.fit(until=run.get("until"))
        if compiled:
            write_compile_stats(trainer)
        refs = model_state_refs(trainer)
        del trainer
        if compiled:
            # torch.compile's process-wide caches hold compiled blocks' tensors, some through reference cycles
            # of their own (fivefold's compile_module adds none): drop them, then collect.
            torch._dynamo.reset()
            gc.collect()
        alive = sum(r() is not None for r in refs)
        if alive:
            raise AssertionError(f"{alive} of {len(refs)} model-state tensors outlive their trainer")
    exit_worker()
