"""The gradient of a step's first micro-batch: the "small batch" of the gradient noise scale (McCandlish
et al. 2018, "An Empirical Model of Large-Batch Training", appendix A.1; the estimator is in
fivefold.train.noise_scale). Measured where the layout already has it, as one extra norm per step: no
gradient is copied and no extra gradient communication is made.

Micro-batch losses are token-loss sums divided by the global batch's target-token count N, so after the
first micro-batch a gradient is (n / N) x the MEAN gradient over its n target tokens: its norm^2 is
rescaled by (N / n)^2. Where that gradient is, by layout:

    one process, tp, pp, or dp with   gradients are reduced on the last micro-batch only, so after the
    ZeRO-0/1 ("local")                first one each dp rank holds its own micro-batch's gradient: |G_small|^2
                                      is the mean over dp ranks, B_small one micro-batch (the harmonic mean of
                                      the ranks' token counts, which keeps E|G_small|^2 = |G|^2 + tr(S)/B_small)
    ZeRO-2/3 ("reduced")              every micro-batch is reduce-scattered at once: after the first, the
                                      shards hold the sum over all dp x cp ranks' first micro-batches: one
                                      gradient, B_small = dp micro-batches
    pipeline (afab, 1f1b,             each rank's model chunk holds micro-batch 0's gradient after its last
    interleaved)                      B/W action of micro-batch 0, if no later micro-batch's came before it:
                                      measured chunk by chunk at those points, summed over stages afterwards

Not measured, with a note instead of a wrong number (`unavailable`): one micro-batch per step (nothing
smaller to compare with); cp > 1 without ZeRO-2/3 (a rank holds a partial sum over its tokens of rows it
shares with the ring); ep > 1 (a rank's experts hold other ranks' tokens beside its own); a pipeline with
tied embeddings (the two copies are summed only at the optimizer step); a pipeline schedule that mixes
micro-batch 0's gradient with a later one's before the former is complete (zero-bubble's deferred W).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from fivefold.data.labels import IGNORE_INDEX
from fivefold.parallel.rules import first_micro_batch_points, reduces_every_micro_batch, unavailable


class SmallBatchGradient:
    """Captures this rank's part of |first micro-batch gradient|^2 during forward_backward; `result`
    reduces it over the ranks after the step. Reads gradients through the optimizer's own norm code
    (MasterWeightAdamW.local_squares / reduce_squares), so it counts exactly what clipping counts."""

    def __init__(self, cfg, mesh, optimizer, reducer, pipeline=None):
        self.cfg, self.mesh, self.optimizer, self.reducer = cfg, mesh, optimizer, reducer
        self.reduced = reduces_every_micro_batch(cfg)
        self.pp_rank = mesh.pp_rank
        self.chunk_params: dict[int, set[int]] = {}
        if pipeline is not None:
            for i, name in enumerate(optimizer.names):
                self.chunk_params.setdefault(pipeline.chunk_of(name), set()).add(i)
        self._parts: torch.Tensor | None = None  # local squares by kind (MasterWeightAdamW.local_squares)
        self._tokens: torch.Tensor | None = None  # target tokens of this rank's first micro-batch

    def unavailable(self, micro_batches: int) -> str | None:
        return unavailable(self.cfg, micro_batches)

    def reset(self) -> None:
        """A new step: forget what an earlier one captured and nobody read."""
        self._parts = self._tokens = None

    def _gradients(self) -> list[torch.Tensor | None]:
        if self.reduced:  # ZeRO-2/3: this rank's fp32 row shards of the reduced sum (views; nothing handed over)
            return self.reducer.local_grads()
        return [self.optimizer.grad_of(p) for p in self.optimizer.params]

    @torch.no_grad()
    def capture(self, labels: torch.Tensor, chunk: int | None = None) -> None:
        """Now (after the first micro-batch's backward, or one pipeline chunk's), note the local squares
        of the gradients (of `chunk`'s parameters only, under a pipeline) and the micro-batch's tokens."""
        grads = self._gradients()
        if chunk is not None:
            mine = self.chunk_params.get(chunk, set())
            grads = [g if i in mine else None for i, g in enumerate(grads)]
        parts = self.optimizer.local_squares(grads)
        self._parts = parts if self._parts is None else self._parts + parts
        self._tokens = (labels != IGNORE_INDEX).sum()

    def pipeline_points(self, micro_batches: int, labels: torch.Tensor) -> dict[int, Callable[[], None]]:
        """This rank's {action index: capture} for a pipeline step of `micro_batches` (this rank's
        first-micro-batch `labels`)."""
        p = self.cfg.parallel
        points = first_micro_batch_points(p.pp_schedule, p.pp, micro_batches, p.pp_virtual_stages)
        return {i: (lambda c=chunk: self.capture(labels, c)) for i, chunk in points[self.pp_rank].items()}

    @torch.no_grad()
    def result(self, num_tokens: int) -> tuple[float, float] | None:
        """(|G_small|^2, B_small in target tokens) of the step just run, the same on every rank; None if
        nothing was captured (or the first micro-batch had no target token). Collective: every rank calls it."""
        if self._parts is None:
            return None
        parts, tokens = self._parts, self._tokens
        self._parts = self._tokens = None
        square = self.optimizer.reduce_squares(parts, zero_rows=self.reduced).double()
        group, ranks = self.mesh.grad_group, self.mesh.grad_size
        if self.reduced:  # one gradient: the sum over every rank's first micro-batch
            total = tokens.double().reshape(1)
            dist.all_reduce(total, group=group)
            n = total.item()
            return (square.item() * (num_tokens / n) ** 2, n) if n > 0 else None
        # One gradient per dp rank: rescale each to its micro-batch's mean, then average over the ranks.
        n = tokens.double()
        stats = torch.stack([square * (num_tokens / n.clamp(min=1)) ** 2, 1 / n.clamp(min=1), (n == 0).double()])
        if ranks > 1:
            dist.all_reduce(stats, group=group)
        mean_square, inverse_tokens, empty = (stats / ranks).tolist()
        return None if empty else (mean_square, 1 / inverse_tokens)
