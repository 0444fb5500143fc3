"""Tensor-parallel serving: each rank holds its shard of the weights and of every KV block; rank 0 drives.

Launched by torchrun (`fivefold generate|serve --tp N`, or a script calling `LLM(..., tp=N)` on every
rank). The model is the training code's tensor-parallel model (`apply_tensor_parallel`: heads, FFN and
vocabulary split, one all-reduce after attention and after the MLP), built on the meta device and
materialised from the checkpoint slice by slice (fivefold.weights), so no rank holds the whole
model. Rank 0 runs the
scheduler and sampler; for every forward it broadcasts the batch (token ids and block tables), all ranks
run the forward on their shard, and the vocabulary-sharded logits are gathered for sampling.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fivefold.config import Config, ParallelConfig
from fivefold.parallel.launch import launch_workers
from fivefold.parallel.placement import Placements
from fivefold.weights import model_config_of


class TensorParallelGroup:
    """The tp group's collectives the engine needs: the batch from the driver, and the logits; and where each
    of this rank's parameters sits in the whole one (`placements`), to take its part of a new value."""

    def __init__(self, group, rank: int, size: int, placements: Placements):
        self.group, self.rank, self.size, self.placements = group, rank, size, placements
        self.driver = dist.get_global_rank(group, 0)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def broadcast(self, message=None):
        """The driver's message on every rank (a small Python object: ids, block tables, a command).
        Pickled between our own ranks only; nothing read from a file."""
        box = [message]
        dist.broadcast_object_list(box, src=self.driver, group=self.group)
        return box[0]

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """(N, V / tp) on each rank -> (N, V) everywhere."""
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        dist.all_gather(parts, logits.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def agree_on_blocks(self, num_blocks: int) -> int:
        """The fewest blocks any rank can hold: the pools must match, block for block."""
        t = torch.tensor([num_blocks])
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t)


def launch(source, tp: int, argv: list[str], command: str) -> int:
    """Re-run this fivefold command on `tp` processes under torchrun, once the model's shapes are known to
    split `tp` ways (a bad --tp fails here, before any worker starts)."""
    cfg = Config(model=model_config_of(source), parallel=ParallelConfig(tp=tp))
    return launch_workers(cfg, tp, argv, command)
