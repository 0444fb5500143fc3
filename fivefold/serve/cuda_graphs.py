"""CUDA-graph decode: the whole decode forward (embedding to LM head) captured once per batch size.

A decode step launches a few kernels per layer; at small batch sizes the GPU finishes each faster than
the host can launch the next, so the step is bound by Python and launches, not by the card. A graph
replays every kernel of the forward with one launch. Graphs are captured for a ladder of batch sizes
(1, 2, 4, 8, then every 8 up to `max_num_seqs`), largest first, all in one memory pool: a step pads to
the next size up with inert rows (fivefold.serve.batch.StepInputs.padded). The inputs are read from the
fixed segments of the step buffers (fivefold.serve.buffers), so a replay only needs them filled.

Only decode-only steps replay; a step with prompt chunks runs eagerly with the same paged-attention
kernel. `capture=False` runs the very same padded forward eagerly: the path the CPU tests take.
"""

from __future__ import annotations

import time

import torch

from fivefold.model import ForwardContext
from fivefold.serve.batch import StepInputs
from fivefold.serve.buffers import StepBuffers
from fivefold.serve.kv_pool import KVPool, PagedBatch


def batch_ladder(max_num_seqs: int) -> list[int]:
    """The batch sizes graphs are captured for: 1, 2, 4, 8, 16, 24, ... up to max_num_seqs (included)."""
    sizes = [n for n in (1, 2, 4, 8) if n < max_num_seqs] + list(range(8, max_num_seqs, 8))[1:]
    return sorted(set(sizes) | {max_num_seqs})


class DecodeGraphs:
    def __init__(self, model, pool: KVPool, buffers: StepBuffers, max_num_seqs: int, kernel: bool,
                 capture: bool = True, fused_launches: bool = False):
        self.model, self.pool, self.buffers, self.kernel = model, pool, buffers, kernel
        self.fused_launches = fused_launches
        self.sizes = batch_ladder(max_num_seqs)
        self.capture = capture
        self.rows = torch.arange(max_num_seqs, device=buffers.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_s, self.memory_bytes = 0.0, 0
        if capture:
            self._capture_all()

    def size_for(self, num_seqs: int) -> int | None:
        return next((s for s in self.sizes if s >= num_seqs), None)

    def _upload(self, step: StepInputs, size: int, pending: torch.Tensor | None = None) -> StepInputs:
        """`step` padded to `size` rows, in the step buffers. Full-width block tables: the columns a step
        needs change from step to step, a captured graph's inputs cannot."""
        padded = step.padded(size)
        self.buffers.upload(padded, max_blocks=self.buffers.max_blocks_per_seq, pending=pending)
        return padded

    def _model(self, size: int, host: StepInputs | None = None) -> torch.Tensor:
        """The model over the `size` rows in the step buffers (no copies: capturable); logits (size, V)."""
        dev = self.buffers.views(size, size, 0, 1, self.buffers.max_blocks_per_seq)
        batch = PagedBatch(self.pool, dev, host, kernel=self.kernel, fused_launches=self.fused_launches)
        ctx = ForwardContext(positions=batch.positions, kv_cache=batch, mask=batch, logits_at=self.rows[:size])
        return self.model(dev.input_ids[None], ctx)

    def _forward(self, step: StepInputs, size: int, pending: torch.Tensor | None = None) -> torch.Tensor:
        return self._model(size, self._upload(step, size, pending))

    @torch.inference_mode()
    def _capture_all(self) -> None:
        device = self.buffers.device
        torch.cuda.synchronize(device)
        before, start = torch.cuda.memory_allocated(device), time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        inert = StepInputs.empty()
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm up: Triton compiles, the allocator settles, outside the capture
                self._forward(inert, self.sizes[-1])
        torch.cuda.current_stream(device).wait_stream(side)
        for size in reversed(self.sizes):  # largest first: the smaller graphs reuse its pool
            graph = torch.cuda.CUDAGraph()
            self._upload(inert, size)  # the inputs in place, before and outside the capture
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._model(size)
            self.graphs[size] = graph
        torch.cuda.synchronize(device)
        self.capture_s = time.perf_counter() - start
        self.memory_bytes = torch.cuda.memory_allocated(device) - before

    def run(self, step: StepInputs, pending: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, V) of a decode-only step of B <= max_num_seqs sequences, every row sampled or not;
        `pending`: the previous step's sampled tokens on the device (asynchronous scheduling)."""
        b = step.num_seqs
        size = self.size_for(b)
        if not self.capture:
            return self._forward(step, size, pending)[:b]
        self._upload(step, size, pending)
        self.graphs[size].replay()
        return self.outputs[size][:b]

    def describe(self) -> str:
        return (f"CUDA graphs: {len(self.sizes)} decode batch sizes ({self.sizes[0]}..{self.sizes[-1]}) captured in "
                f"{self.capture_s:.1f} s, {self.memory_bytes / 2**20:.0f} MiB")
