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


# Decodes attend in groups of this many sequences of similar length: padding every sequence to the
# longest of the whole batch doubled the keys and values gathered (bench/serve.py, batch 64).
DECODE_GROUP = 16


def _padded(rows: list[list[int]]) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [0] * (width - len(r)) for r in rows])


class PagedBatch:
    """One forward of a serving batch, flattened to a single row of tokens: first one token for each of
    the decoding sequences, then the prompt chunks. Passed as the ForwardContext's kv_cache: each layer
    writes this call's keys and values into their slots, then attends through the block tables, gathering
    whole blocks: the decodes as padded batches of similar lengths, each chunk on its own."""

    def __init__(self, pool: KVPool, entries: list[tuple[list[int], int, int]], device):
        """entries: (block_table, tokens already cached, tokens now) per sequence, single tokens first."""
        bs = pool.block_size
        self.pool = pool
        positions = torch.cat([torch.arange(p, p + n) for _, p, n in entries])
        rows = torch.repeat_interleave(torch.arange(len(entries)), torch.tensor([n for _, _, n in entries]))
        tables = _padded([t for t, _, _ in entries])
        self.slots = (tables[rows, positions // bs] * bs + positions % bs).to(device)
        self.positions = positions[None].to(device)
        self.num_decodes = sum(1 for _, _, n in entries if n == 1)
        lengths = torch.tensor([p + n for _, p, n in entries])
        self.groups = []  # (which decodes, (G, blocks) block indices, (G, 1, 1, blocks x bs) mask)
        for group in lengths[:self.num_decodes].argsort().split(DECODE_GROUP) if self.num_decodes else ():
            blocks = -(-int(lengths[group].max()) // bs)
            mask = torch.arange(blocks * bs) < lengths[group][:, None]
            self.groups.append((group.to(device), tables[group, :blocks].to(device), mask[:, None, None].to(device)))
        self.chunks = []  # (start in the row, tokens, the sequence's blocks, mask or None)
        start = self.num_decodes
        for table, past, n in entries[self.num_decodes:]:
            # None: causal over equal lengths (SDPA's own); else this chunk's rows of the causal mask.
            mask = None if past == 0 else torch.ones(n, past + n, dtype=torch.bool, device=device).tril(past)[None, None]
            self.chunks.append((start, n, torch.tensor(table[:-(-(past + n) // bs)], device=device), mask))
            start += n
        # Where each sequence's last token sits in the row: the logits to sample from.
        self.last = (torch.tensor([n for _, _, n in entries]).cumsum(0) - 1).to(device)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, core, mask) -> torch.Tensor:
        """q (1, H, T, d), k and v (1, Hkv, T, d) -> (1, H, T, d)."""
        kp, vp = self.pool.k[layer], self.pool.v[layer]
        kp.index_copy_(0, self.slots, k[0].transpose(0, 1))
        vp.index_copy_(0, self.slots, v[0].transpose(0, 1))
        bs, heads, dim = self.pool.block_size, kp.shape[1], kp.shape[2]
        kb, vb = kp.view(-1, bs, heads, dim), vp.view(-1, bs, heads, dim)  # (blocks, bs, Hkv, d)

        def gather(pool: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:  # (..., blocks) -> (..., Hkv, L, d)
            whole = pool.index_select(0, blocks.reshape(-1))
            return whole.view(*blocks.shape[:-1], blocks.shape[-1] * bs, heads, dim).transpose(-3, -2)

        out = []
        if self.num_decodes:
            qd = q[0, :, :self.num_decodes].transpose(0, 1)[:, :, None]  # (B, H, 1, d)
            od = torch.empty_like(qd)
            for rows, blocks, group_mask in self.groups:
                od[rows] = core(qd[rows], gather(kb, blocks), gather(vb, blocks), group_mask)
            out.append(od[:, :, 0].transpose(0, 1))  # (H, B, d)
        for start, n, blocks, chunk_mask in self.chunks:
            length = n if chunk_mask is None else chunk_mask.shape[-1]
            kc, vc = gather(kb, blocks)[None, :, :length], gather(vb, blocks)[None, :, :length]  # (1, Hkv, L, d)
            out.append(core(q[:, :, start:start + n], kc, vc, chunk_mask)[0])  # (H, n, d)
        return torch.cat(out, dim=1)[None]
