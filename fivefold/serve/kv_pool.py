"""The paged KV cache: one preallocated pool of fixed-size blocks, and the attention of a serving batch
through per-sequence block tables.

The pool is sized before any request arrives, from a memory budget; what it costs per token and how
many sequences of a given length fit is known in advance (`kv_plan`, shown by `fivefold plan --serve`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from fivefold.config import ModelConfig
from fivefold.kernels.cpu_block_ops import rotary_decode_attention
from fivefold.kernels.cpu_paged_decode import decode_attention
from fivefold.kernels.paged_attention import paged_attention, rope_store_kv, store_kv
from fivefold.memory import host
from fivefold.serve.hooks import hooked
from fivefold.serve.huge_pages import huge_page_bytes


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
    return host.available()


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

    def __init__(self, cfg: ModelConfig, plan: KVPlan, device, dtype: torch.dtype, tp: int = 1,
                 huge_pages: bool = False):
        """`huge_pages` (a CPU): each pool in memory advised for transparent huge pages
        (fivefold.serve.huge_pages), written through at once so that it is resident, as torch.zeros makes it."""
        shape = (cfg.num_layers, plan.tokens, cfg.num_kv_heads // tp, cfg.head_size)
        if huge_pages:
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            self.k, self.v = (huge_page_bytes(nbytes).view(dtype).view(shape).zero_() for _ in range(2))
        else:
            self.k = torch.zeros(shape, device=device, dtype=dtype)
            self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.block_size = plan.block_size
        # Each layer's (blocks, block_size, kv heads, head size) views, made once: a step asks for them a layer
        # at a time, and making them took 4-8 us a call on the 2-vCPU host (30 calls a smollm2-135m token).
        self._blocks = [tuple(pool[layer].view(-1, self.block_size, *pool.shape[2:]) for pool in (self.k, self.v))
                        for layer in range(shape[0])]

    @property
    def bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def blocks(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's keys and values as (blocks, block_size, kv heads, head size) views."""
        return self._blocks[layer]


# The longest sequence whose prompt chunks attend as rows of the CPU kernel (serve.cpu_kernel) rather than over
# gathered blocks with SDPA. Prefill of smollm2-135m on the 2-vCPU AMD host, A/B in one process (bench/serve_cpu_ab.py
# --compare chunk-rows --output 1): as rows, 16 prompts of 128 tokens +12.8% tokens/s in bfloat16 and +6.9% in float32,
# 4 of 511 +3.1% (float32), 2 of 1,024 -4.1% (float32, --chunk-context 4096).
KERNEL_CHUNK_CONTEXT = 512

# The CPU path attends decodes in groups of this many sequences of similar length: padding every sequence
# to the longest of the whole batch doubled the keys and values gathered (bench/serve.py, batch 64).
DECODE_GROUP = 16


class PagedBatch:
    """One forward of a serving batch, flattened to a single row of tokens (decodes first, then prompt
    chunks), passed as the ForwardContext's kv_cache: each layer stores this call's keys and values in
    their slots, then attends through the block tables.

    `kernel=True` (CUDA, fivefold.kernels.paged_attention): one store and one paged-attention launch per
    layer, reading keys and values in place; nothing here depends on the host, so the forward can be
    captured in a CUDA graph. Otherwise (the CPU path, and the reference): whole blocks are gathered and
    SDPA runs over them, the decodes in padded groups of similar length, each chunk on its own; the
    grouping is read from the step's host arrays (`host`)."""

    def __init__(self, pool: KVPool, dev, host=None, kernel: bool = False, fused_launches: bool = False,
                 cpu_kernel: bool = False):
        """`dev`: fivefold.serve.buffers.DeviceStep; `host`: its fivefold.serve.batch.StepInputs;
        `fused_launches` (serve.fuse_launches): on the kernel path the model runs RoPE in the store's launch
        (attend_rotary) and its residual adds in the norms'; otherwise its blocks as one loop of tensor ops
        (fivefold.serve.lean_forward, through attend_heads). `cpu_kernel` (serve.cpu_kernel): on the CPU path
        the decodes attend through fivefold.kernels.cpu_paged_decode, reading the pool in place, instead of in
        gathered groups, and so do the tokens of prompt chunks of sequences up to KERNEL_CHUNK_CONTEXT tokens, as
        rows of their own, each over its context up to itself; longer sequences' chunks gather."""
        self.pool, self.dev, self.kernel = pool, dev, kernel
        # The lean loop's norms, SwiGLU and a decode-only step's RoPE + store + attention as C++ calls too
        # (fivefold.kernels.cpu_block_ops): bench/serve_cpu_ab.py --compare block-ops turns this off alone.
        self.block_kernels = cpu_kernel and not kernel
        self.fused_launches = kernel and fused_launches
        self.lean = not kernel and fused_launches
        self.positions = dev.positions[None]
        if kernel:
            self.block_tables = dev.block_tables
            return
        device, bs = pool.k.device, pool.block_size
        seq_lens, qsl = host.seq_lens.astype(np.int64), host.query_start_loc
        int_tables = dev.block_tables
        tables = int_tables.long()
        valid = host.slot_mapping >= 0
        self.store = dev.slot_mapping.long() if valid.all() else torch.from_numpy(np.flatnonzero(valid)).to(device)
        self.store_at = None if valid.all() else dev.slot_mapping.long()[self.store]
        self.num_decodes = host.num_decodes
        self.decode_tables = self.decode_lens = None  # the kernel's view of the decodes
        self.groups = []  # (which decodes, (G, blocks) block indices, (G, 1, 1, blocks x bs) mask)
        decodes = np.flatnonzero(seq_lens[:self.num_decodes] > 0)  # padding rows attend to nothing
        order = decodes[np.argsort(seq_lens[decodes], kind="stable")]
        if cpu_kernel and self.num_decodes:  # the kernel reads the decodes in place: no groups to gather
            self.decode_tables, self.decode_lens = int_tables[:self.num_decodes], dev.seq_lens[:self.num_decodes]
        else:
            for start in range(0, len(order), DECODE_GROUP):
                group = order[start:start + DECODE_GROUP]
                lengths = torch.from_numpy(seq_lens[group])
                blocks = -(-int(lengths.max()) // bs)
                mask = torch.arange(blocks * bs) < lengths[:, None]
                rows = torch.from_numpy(group).to(device)
                self.groups.append((rows, tables[rows, :blocks], mask[:, None, None].to(device)))
        self.chunks = []  # (start in the row, tokens, the sequence's context, its blocks, attended as kernel rows)
        self.masks = {}  # chunk start -> its rows of the causal mask, for the chunks that gather (not the first)
        self.row_owners = self.row_lens = self.seq_tables = None  # the kernel's rows: each one's sequence, context
        self.rows_whole = False
        self.kernel_chunks = np.zeros(host.num_seqs, dtype=bool)  # which sequences' chunks are kernel rows
        if cpu_kernel and host.num_seqs > self.num_decodes:
            # A chunk's token attends as a decode row of its own, over its context up to itself: the kernel reads
            # the pool in place, one call a layer for the decodes and these rows, and a row's output is the same
            # whatever chunk it comes in (its context is stored before it is read). Row by row, the kernel re-reads
            # the context a token at a time where SDPA's blocks reuse it: it pays up to KERNEL_CHUNK_CONTEXT tokens
            # of context, and longer sequences' chunks gather for SDPA (their rows' lengths 0 here).
            self.kernel_chunks[self.num_decodes:] = seq_lens[self.num_decodes:host.num_seqs] <= KERNEL_CHUNK_CONTEXT
            counts = np.diff(qsl[:host.num_seqs + 1].astype(np.int64))
            owner = np.repeat(np.arange(host.num_seqs), counts)
            rows = np.arange(len(owner))
            lens = seq_lens[owner] - (qsl[1:host.num_seqs + 1][owner] - 1 - rows)
            lens[(owner >= self.num_decodes) & ~self.kernel_chunks[owner]] = 0
            self.row_owners = torch.from_numpy(owner.astype(np.int32)).to(device)
            self.seq_tables = int_tables
            self.row_lens = torch.from_numpy(lens.astype(np.int32)).to(device)
            self.rows_whole = len(owner) == host.num_tokens and bool(self.kernel_chunks[self.num_decodes:].all())
        for i in range(self.num_decodes, host.num_seqs):
            start, n, length = int(qsl[i]), int(qsl[i + 1] - qsl[i]), int(seq_lens[i])
            self.chunks.append((start, n, length, tables[i, :-(-length // bs)], bool(self.kernel_chunks[i])))
            if not self.kernel_chunks[i]:
                self.chunk_mask(start, n, length)
        # A decode-only step whose decodes are one group already in row order (batch 1, or a few sequences
        # of rising length) needs no scatter into a zeroed output.
        self.whole = (not self.chunks and len(self.groups) == 1 and len(order) == host.num_tokens
                      and np.array_equal(order, np.arange(len(order))))
        self.kernel_whole = self.decode_lens is not None and not self.chunks and self.num_decodes == host.num_tokens

    @property
    def one_call(self) -> bool:
        """The CPU path's attention is one call a layer whose output is the step's: every decode-only step
        under the C++ kernel, else one whose decodes form one group in row order."""
        return self.whole or self.kernel_whole

    def attend_rotary(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor) -> torch.Tensor:
        """The kernel path with RoPE folded into the store: q (T, H, d), k and v (T, Hkv, d) not yet rotated,
        cos and sin (T, d) -> (T, H, d). Two launches (fivefold::rope_store_kv, fivefold::paged_attention)
        where rotating first and then `attend` takes four (two RoPEs, the store, attention)."""
        kb, vb = self.pool.blocks(layer)
        d = self.dev
        q = rope_store_kv(q, k, v, cos, sin, kb, vb, d.slot_mapping)
        return paged_attention(q, kb, vb, self.block_tables, d.seq_lens, d.query_start_loc, d.max_query_len)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, core, mask) -> torch.Tensor:
        """q (1, H, T, d), k and v (1, Hkv, T, d) -> (1, H, T, d)."""
        if self.kernel:
            kb, vb = self.pool.blocks(layer)  # (blocks, bs, Hkv, d)
            d = self.dev
            store_kv(kb, vb, k[0].transpose(0, 1), v[0].transpose(0, 1), d.slot_mapping)
            out = paged_attention(q[0].transpose(0, 1), kb, vb, self.block_tables, d.seq_lens, d.query_start_loc,
                                  d.max_query_len)  # (T, H, d); the kernel reads q through its strides
            return out.transpose(0, 1)[None]
        return self.attend_heads(layer, q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                                 core).transpose(0, 1)[None]

    def attend_rotary_rows(self, layer: int, heads: torch.Tensor, q_heads: int, cos: torch.Tensor,
                           signed_sin: torch.Tensor) -> torch.Tensor:
        """A decode-only step under serve.cpu_kernel (`kernel_whole`) from the fused q/k/v product's heads (T,
        q_heads + 2 Hkv, d), not yet rotated: RoPE, the store and the attention in one C++ call
        (fivefold.kernels.cpu_block_ops) -> (T, q_heads, d)."""
        kb, vb = self.pool.blocks(layer)
        return rotary_decode_attention(heads, q_heads, cos, signed_sin, kb, vb, self.dev.slot_mapping,
                                       self.decode_tables, self.decode_lens)

    def attend_heads(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, core) -> torch.Tensor:
        """The CPU path in the tokens' own layout: q (T, H, d), k and v (T, Hkv, d) -> (T, H, d); `core` is the
        layer's AttentionCore (or its forward)."""
        bs, heads, dim = self.pool.block_size, k.shape[1], k.shape[2]
        kb, vb = self.pool.blocks(layer)  # (blocks, bs, Hkv, d)
        if self.store_at is None:
            self.pool.k[layer].index_copy_(0, self.store, k)
            self.pool.v[layer].index_copy_(0, self.store, v)
        else:
            self.pool.k[layer].index_copy_(0, self.store_at, k[self.store])
            self.pool.v[layer].index_copy_(0, self.store_at, v[self.store])

        def gather(pool: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:  # (..., blocks) -> (..., Hkv, L, d)
            whole = pool.index_select(0, blocks.reshape(-1))
            return whole.view(*blocks.shape[:-1], blocks.shape[-1] * bs, heads, dim).transpose(-3, -2)

        if self.kernel_whole:  # every row a decode: the kernel's output is the step's
            return decode_attention(q, kb, vb, self.decode_tables, self.decode_lens)
        qd = q[:self.num_decodes, :, None]  # (B, H, 1, d)
        if self.whole:  # every row one decode, in one group in row order: the core's output is the step's
            _, blocks, group_mask = self.groups[0]
            return core(qd, gather(kb, blocks), gather(vb, blocks), group_mask)[:, :, 0]
        by_rows = self.row_lens is not None and not hooked(core)  # decodes and short chunks' tokens: kernel rows
        if by_rows and self.rows_whole:  # every row one of them: the kernel's output is the step's
            return decode_attention(q, kb, vb, self.seq_tables, self.row_lens, owners=self.row_owners)
        out = torch.zeros_like(q)  # padding rows stay 0
        od = out[:self.num_decodes, :, None]
        if by_rows:
            rows = self.row_lens.shape[0]
            out[:rows] = decode_attention(q[:rows], kb, vb, self.seq_tables, self.row_lens, owners=self.row_owners)
        elif self.decode_lens is not None:
            out[:self.num_decodes] = decode_attention(q[:self.num_decodes], kb, vb, self.decode_tables, self.decode_lens)
        for rows, blocks, group_mask in self.groups:
            od[rows] = core(qd[rows], gather(kb, blocks), gather(vb, blocks), group_mask)
        for start, n, length, blocks, as_rows in self.chunks:
            if by_rows and as_rows:
                continue
            kc, vc = gather(kb, blocks)[None, :, :length], gather(vb, blocks)[None, :, :length]  # (1, Hkv, L, d)
            out[start:start + n] = core(q[start:start + n].transpose(0, 1)[None], kc, vc,
                                        self.chunk_mask(start, n, length))[0].transpose(0, 1)
        return out

    def chunk_mask(self, start: int, n: int, length: int) -> torch.Tensor | None:
        """The chunk's rows of the causal mask over its context, made once a step (None for a first chunk: causal
        over equal lengths, SDPA's own)."""
        if n == length:
            return None
        if start not in self.masks:
            mask = torch.ones(n, length, dtype=torch.bool, device=self.pool.k.device).tril(length - n)
            self.masks[start] = mask[None, None]
        return self.masks[start]
