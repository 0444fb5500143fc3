"""The paged KV cache: one preallocated pool of fixed-size blocks, and the attention of a serving batch
through per-sequence block tables.

The pool is sized before any request arrives, from a memory budget; what it costs per token and how
many sequences of a given length fit is known in advance (`kv_plan`, shown by `fivefold plan --serve`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fivefold.config import ModelConfig


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, tp: int = 1) -> int:
    """Keys and values of one token in every layer, on one tensor-parallel rank."""
    return 2 * cfg.num_layers * (cfg.num_kv_heads // tp) * cfg.head_size * torch.empty((), dtype=dtype).element_size()


@dataclass
class KVPlan:
    bytes_per_token: int
    block_size: int
    num_blocks: int

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def bytes(self) -> int:
        return self.tokens * self.bytes_per_token

    def max_sequences(self, length: int) -> int:
        """How many sequences of `length` tokens (prompt + output) fit in the pool at once."""
        return self.num_blocks // -(-length // self.block_size)

    def describe(self, length: int) -> str:
        return (f"KV cache: {self.bytes_per_token / 1024:.1f} KiB/token, {self.num_blocks} blocks x "
                f"{self.block_size} tokens = {self.tokens:,} tokens ({self.bytes / 2**30:.2f} GiB); "
                f"{self.max_sequences(length)} sequences of {length} tokens at once")


def available_memory(device: torch.device) -> int:
    """Bytes free for the KV pool: free accelerator memory, or on CPU the RAM the kernel can give."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info.get("MemAvailable", info["MemFree"])


def kv_plan(cfg: ModelConfig, kv_memory: float, block_size: int, dtype: torch.dtype,
            free_bytes: int | None = None, tp: int = 1, num_blocks: int = 0, max_blocks: int | None = None) -> KVPlan:
    """`num_blocks` if > 0; else as many as `kv_memory` allows (>= 1: GB; below 1: that fraction of
    `free_bytes`), but no more than `max_blocks` (what the engine could ever fill at once)."""
    per_token = kv_bytes_per_token(cfg, dtype, tp)
    if num_blocks:
        return KVPlan(per_token, block_size, num_blocks)
    budget = kv_memory * 1e9 if kv_memory >= 1 else kv_memory * (free_bytes or 0)
    blocks = int(budget // (per_token * block_size))
    return KVPlan(per_token, block_size, blocks if max_blocks is None else min(blocks, max_blocks))


class KVPool:
    """Keys and values of every layer: (layers, blocks x block_size slots, kv heads, head size) each.
    Slot b * block_size + i holds the i-th token of block b."""

    def __init__(self, cfg: ModelConfig, plan: KVPlan, device, dtype: torch.dtype, tp: int = 1):
        shape = (cfg.num_layers, plan.tokens, cfg.num_kv_heads // tp, cfg.head_size)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.block_size = plan.block_size

    @property
    def bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


def _slots(tables: list[list[int]], lengths: list[int], block_size: int) -> torch.Tensor:
    """(B, max length) pool slots of positions 0..length-1 of each sequence, padded with slot 0."""
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    pos = torch.arange(max(lengths))
    slots = table[:, pos // block_size] * block_size + pos % block_size
    return slots.masked_fill(pos >= torch.tensor(lengths)[:, None], 0)


class PagedBatch:
    """One forward of a serving batch, flattened to a single row of tokens: first one token for each of
    `decodes` sequences, then the prompt chunks. Passed as the ForwardContext's kv_cache: each layer
    writes this call's keys and values into their slots, then attends through the block tables, the
    decodes as one padded batch and each chunk on its own (SDPA over gathered blocks)."""

    def __init__(self, pool: KVPool, entries: list[tuple[list[int], int, int]], device):
        """entries: (block_table, tokens already cached, tokens now) per sequence, single tokens first."""
        bs = pool.block_size
        self.pool = pool
        tables = [t for t, _, _ in entries]
        ends = [p + n for _, p, n in entries]
        every = _slots(tables, ends, bs)  # (sequences, longest): all of each sequence's slots, this call's too
        self.slots = torch.cat([every[i, p:p + n] for i, (_, p, n) in enumerate(entries)]).to(device)
        self.positions = torch.cat([torch.arange(p, p + n) for _, p, n in entries])[None].to(device)
        self.num_decodes = sum(1 for _, _, n in entries if n == 1)
        if self.num_decodes:
            b = self.num_decodes
            longest = max(ends[:b])
            self.decode_index = every[:b, :longest].to(device)  # (B, Lmax): padded with slot 0
            self.decode_mask = (torch.arange(longest) < torch.tensor(ends[:b])[:, None])[:, None, None].to(device)
        self.chunks = []  # (start in the row, tokens, slots of the whole sequence so far, mask or None)
        start = self.num_decodes
        for i in range(self.num_decodes, len(entries)):
            _, past, n = entries[i]
            # None: causal over equal lengths (SDPA's own); else this chunk's rows of the causal mask.
            mask = None if past == 0 else torch.ones(n, past + n, dtype=torch.bool, device=device).tril(past)[None, None]
            self.chunks.append((start, n, every[i, :past + n].to(device), mask))
            start += n
        # Where each sequence's last token sits in the row: the logits to sample from.
        self.last = (torch.tensor([n for _, _, n in entries]).cumsum(0) - 1).to(device)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, core, mask) -> torch.Tensor:
        """q (1, H, T, d), k and v (1, Hkv, T, d) -> (1, H, T, d)."""
        kp, vp = self.pool.k[layer], self.pool.v[layer]
        kp.index_copy_(0, self.slots, k[0].transpose(0, 1))
        vp.index_copy_(0, self.slots, v[0].transpose(0, 1))
        out = []
        if self.num_decodes:
            b = self.num_decodes
            qd = q[0, :, :b].transpose(0, 1)[:, :, None]  # (B, H, 1, d)
            kd = kp[self.decode_index].transpose(1, 2)  # (B, Hkv, Lmax, d)
            vd = vp[self.decode_index].transpose(1, 2)
            out.append(core(qd, kd, vd, self.decode_mask)[:, :, 0].transpose(0, 1))  # (H, B, d)
        for start, n, index, mask in self.chunks:
            kc, vc = kp[index].transpose(0, 1)[None], vp[index].transpose(0, 1)[None]  # (1, Hkv, L, d)
            out.append(core(q[:, :, start:start + n], kc, vc, mask)[0])  # (H, n, d)
        return torch.cat(out, dim=1)[None]

    def advance(self, tokens: int) -> None:
        """The scheduler, not the batch, keeps each sequence's length."""
