"""One step's inputs on the device: pinned host buffers with device twins, filled and sent in one copy.

Every int32 input of a forward lives in one buffer of fixed segments (token ids, positions, slot mapping,
query starts, sequence lengths, slots), so a step costs one non-blocking host-to-device copy, plus one
for the block-table entries written since the last step (the table itself stays on the device and is
updated in place). The segments never move, so a captured CUDA graph can read its inputs from them
(fivefold.serve.cuda_graphs). On a CPU the "device" tensors are the host buffer itself: no copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fivefold.serve.batch import StepInputs

SEGMENTS = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "slots", "logits_indices",
            "patch_rows", "patch_from")


@dataclass
class DeviceStep:
    """The device tensors one forward reads (views into StepBuffers' device buffer)."""
    input_ids: torch.Tensor  # (T,) int32
    positions: torch.Tensor  # (T,) int32
    slot_mapping: torch.Tensor  # (T,) int32, -1: a padding row (nothing stored)
    query_start_loc: torch.Tensor  # (B + 1,) int32
    seq_lens: torch.Tensor  # (B,) int32, 0: a padding row (attends to nothing)
    slots: torch.Tensor  # (B,) int32: rows of the block table
    logits_indices: torch.Tensor  # (N,) int32: the rows whose logits are wanted
    table: torch.Tensor  # (max_num_seqs, max_blocks_per_seq) int32: every slot's block table
    max_query_len: int
    max_blocks: int  # block-table columns the step needs

    @property
    def block_tables(self) -> torch.Tensor:
        """(B, max_blocks) int32: the step's rows of the table."""
        return self.table[:, :self.max_blocks].index_select(0, self.slots)


class StepBuffers:
    def __init__(self, max_tokens: int, max_seqs: int, max_num_seqs: int, max_blocks_per_seq: int, device):
        self.device = torch.device(device)
        self.sizes = {"input_ids": max_tokens, "positions": max_tokens, "slot_mapping": max_tokens,
                      "query_start_loc": max_seqs + 1, "seq_lens": max_seqs, "slots": max_seqs,
                      "logits_indices": max_tokens, "patch_rows": max_seqs, "patch_from": max_seqs}
        self.offsets, total = {}, 0
        for name in SEGMENTS:
            self.offsets[name] = total
            total += self.sizes[name]
        self.on_device = self.device.type != "cpu"
        # Two pinned host buffers, used in turn: under asynchronous scheduling a step's inputs are written
        # while the previous step's copy may still wait in the stream behind the step before it (the
        # host only waits for a step's sampled tokens one step later).
        self.hosts = [torch.zeros(total, dtype=torch.int32, pin_memory=self.on_device)
                      for _ in range(2 if self.on_device else 1)]
        self.turn = 0
        self.dev = torch.zeros(total, dtype=torch.int32, device=self.device) if self.on_device else self.hosts[0]
        self.table = torch.zeros((max_num_seqs, max_blocks_per_seq), dtype=torch.int32, device=self.device)
        self.max_blocks_per_seq = max_blocks_per_seq

    def segment(self, name: str, n: int | None = None) -> torch.Tensor:
        start = self.offsets[name]
        return self.dev[start:start + (self.sizes[name] if n is None else n)]

    def upload(self, step: StepInputs, max_blocks: int | None = None,
               pending: torch.Tensor | None = None) -> DeviceStep:
        """Send `step` to the device (one copy, plus one for new block-table entries); the device views.
        `max_blocks`: the table columns attention may read (default: what the step needs). `pending`: the
        previous step's sampled tokens, still on the device, that the step's placeholder rows read."""
        t, b, n = step.num_tokens, step.num_seqs, len(step.logits_indices)
        p = 0 if step.patch_rows is None else len(step.patch_rows)
        self.turn = (self.turn + 1) % len(self.hosts)
        host = self.hosts[self.turn]
        staged = host.numpy()
        for name in SEGMENTS:  # StepInputs' fields of the same names
            values = getattr(step, name)
            if values is not None:
                staged[self.offsets[name]:self.offsets[name] + len(values)] = values
        if self.on_device:
            end = self.offsets["patch_from"] + p if p else self.offsets["logits_indices"] + n
            self.dev[:end].copy_(host[:end], non_blocking=True)
        self._write_table(step.table_index, step.table_value)
        views = self.views(t, b, n, step.max_query_len, max_blocks or step.max_blocks)
        if p:
            if pending is None:
                raise RuntimeError("a step reads tokens still being sampled, but none were given")
            rows, source = self.segment("patch_rows", p).long(), self.segment("patch_from", p).long()
            views.input_ids.index_copy_(0, rows, pending.index_select(0, source).to(views.input_ids.dtype))
        return views

    def views(self, tokens: int, seqs: int, sampled: int, max_query_len: int, max_blocks: int) -> DeviceStep:
        """The device tensors of a step of these sizes, as they stand (no copy)."""
        return DeviceStep(self.segment("input_ids", tokens), self.segment("positions", tokens),
                          self.segment("slot_mapping", tokens), self.segment("query_start_loc", seqs + 1),
                          self.segment("seq_lens", seqs), self.segment("slots", seqs),
                          self.segment("logits_indices", sampled), self.table, max_query_len, max_blocks)

    def _write_table(self, index: np.ndarray, value: np.ndarray) -> None:
        d = len(index)
        if not d:
            return
        if not self.on_device:
            self.table.view(-1).numpy()[index] = value
            return
        # From pageable memory: the copy is staged before it returns, so the array is free to change after.
        entries = torch.from_numpy(np.concatenate([index, value])).to(self.device)
        self.table.view(-1).index_copy_(0, entries[:d].long(), entries[d:])
