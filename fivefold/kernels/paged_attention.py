"""Attention over the paged KV pool, and the store of new keys and values into it, as the custom ops
fivefold::paged_attention and fivefold::store_kv.

Layouts (one layer):
  k_cache, v_cache   (num_blocks, block_size, Hkv, d), contiguous; slot s = block * block_size + offset
  q                  (T, H, d): the query tokens of S sequences, flattened
  query_start_loc    int32 (S + 1,): sequence i's queries are rows qsl[i]:qsl[i + 1]
  seq_lens           int32 (S,): sequence i's context INCLUDING its queries, which are its last
                     n_i = qsl[i + 1] - qsl[i] tokens (positions seq_lens[i] - n_i .. seq_lens[i] - 1)
  block_tables       int32 (S, max_blocks_per_seq), padded with any valid block index
Causal: the query at position p sees its sequence's keys 0..p, its own chunk's earlier tokens included
(store_kv has written them before attention runs). GQA: query head h reads kv head h // (H // Hkv).
A sequence with seq_lens[i] == 0 (CUDA-graph padding) reads nothing and gives zeros; rows past
query_start_loc[-1] give zeros too.

On CUDA tensors the ops run the Triton kernels (fivefold.kernels.paged_attention_triton: one launch
for prefill chunks and decode rows together, K/V read in place through the block tables); on the CPU
they run the PyTorch reference below, or the kernels in Triton's interpreter when TRITON_INTERPRET=1
was set before triton was imported (the tests). This module imports without Triton: the engine loads
it on every machine.
"""

from __future__ import annotations

import math

import torch

import fivefold.kernels as kernels
from fivefold.model.rope import apply_rope

# Split-K (flash-decoding) for decode batches. One program per (sequence, kv head) leaves most of a
# large GPU idle when there are few of them (H100: 132 SMs, and a program per SM is not enough to
# saturate HBM), and each one then walks the whole context alone. Splitting the context into parts
# computed in parallel and merged by a small second kernel pays when (a) every query is a single token
# (a prefill tile already has work in its rows), (b) sequences x kv heads < SPLIT_TARGET_PROGRAMS, and
# (c) the longest context holds at least two SPLIT_MIN_KEYS-key parts. Splits =
# min(ceil(SPLIT_TARGET_PROGRAMS / programs), longest // SPLIT_MIN_KEYS, SPLIT_MAX), rounded down to a power
# of two: the split count is compiled into the kernel (a Triton constexpr), and a count first met in the
# middle of a run would stall that step while Triton compiles it, so the few counts there are (1, 2, 4, 8,
# 16) are compiled before serving starts (warm_up). Constants, not a device query, so torch.compile and
# CUDA graphs see nothing but host integers.
SPLIT_TARGET_PROGRAMS = 256
SPLIT_MIN_KEYS = 512  # keys per part below which the merge costs more than the parallelism gains
SPLIT_MAX = 16


def choose_splits(num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int) -> int:
    """How many parts to split each decode row's context into (1: no split); see SPLIT_* above."""
    programs = num_seqs * num_kv_heads
    if max_query_len != 1 or programs == 0 or programs >= SPLIT_TARGET_PROGRAMS:
        return 1
    splits = min(-(-SPLIT_TARGET_PROGRAMS // programs), max_seq_len // SPLIT_MIN_KEYS, SPLIT_MAX)
    return 1 << (splits.bit_length() - 1) if splits >= 2 else 1


def split_counts() -> list[int]:
    """Every split count choose_splits can return."""
    return [1 << i for i in range(SPLIT_MAX.bit_length())]


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
           seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int,
           split_k: int | None = None) -> None:
    """ValueError naming the fix for inputs the ops do not take. Shapes, dtypes and devices only: nothing
    that would need the tensors' values (a device sync)."""
    if q.dim() != 3:
        raise ValueError(f"paged_attention: q must be (tokens, heads, head_dim), got shape {tuple(q.shape)}; "
                         f"flatten the batch's query tokens into one dimension")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"paged_attention: k_cache and v_cache must both be (num_blocks, block_size, "
                         f"kv_heads, head_dim), got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"paged_attention: q's head_dim {head_dim} differs from the cache's {k_cache.shape[3]}")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"paged_attention: {heads} query heads are not a multiple of {kv_heads} kv heads; "
                         f"each kv head must serve a whole group of query heads (GQA)")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("paged_attention: k_cache and v_cache must be contiguous (the kernels address slots "
                         "by block * block_size + offset); allocate the pool contiguous, or pass one layer's "
                         "slice pool[layer] of a contiguous (layers, ...) pool")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"paged_attention: q, k_cache and v_cache must share a dtype, got {q.dtype}, "
                         f"{k_cache.dtype} and {v_cache.dtype}; cast q to the cache's dtype")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"paged_attention: dtype {q.dtype} is not supported; use bf16, fp16 or fp32")
    if head_dim > 256:
        raise ValueError(f"paged_attention: head_dim {head_dim} is over 256, the most one tile holds")
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    for name, tensor, dims in (("block_tables", block_tables, 2), ("seq_lens", seq_lens, 1),
                               ("query_start_loc", query_start_loc, 1)):
        if tensor.dim() != dims or tensor.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"paged_attention: {name} must be a {dims}-d int32 tensor, got "
                             f"{tensor.dim()}-d {tensor.dtype}")
    if block_tables.shape[0] != num_seqs or query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(f"paged_attention: for {num_seqs} sequences (seq_lens), block_tables needs "
                         f"{num_seqs} rows and query_start_loc {num_seqs + 1} entries, got "
                         f"{block_tables.shape[0]} and {query_start_loc.shape[0]}")
    if block_tables.stride(1) != 1 or seq_lens.stride(0) != 1 or query_start_loc.stride(0) != 1:
        raise ValueError("paged_attention: block_tables' rows, seq_lens and query_start_loc must be "
                         "contiguous; call .contiguous() on them")
    devices = {t.device for t in (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)}
    if len(devices) > 1:
        raise ValueError(f"paged_attention: all tensors must be on one device, got {sorted(map(str, devices))}")
    if max_query_len < 0:
        raise ValueError(f"paged_attention: max_query_len must be >= 0, got {max_query_len}")
    if split_k is not None and split_k < 1:
        raise ValueError(f"paged_attention: split_k must be None (choose), 1 (off) or more, got {split_k}")


def _check_store(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"store_kv: k_cache and v_cache must both be (num_blocks, block_size, kv_heads, "
                         f"head_dim), got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("store_kv: k_cache and v_cache must be contiguous; allocate the pool contiguous")
    if k.dim() != 3 or v.shape != k.shape or k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"store_kv: k and v must both be (tokens, {k_cache.shape[2]}, {k_cache.shape[3]}) to "
                         f"match the cache, got {tuple(k.shape)} and {tuple(v.shape)}")
    if not (k.dtype == v.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"store_kv: k, v and the caches must share a dtype, got {k.dtype}, {v.dtype}, "
                         f"{k_cache.dtype}, {v_cache.dtype}; cast k and v to the cache's dtype")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"store_kv: slot_mapping must be int32 or int64 of shape ({k.shape[0]},), got "
                         f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    devices = {t.device for t in (k_cache, v_cache, k, v, slot_mapping)}
    if len(devices) > 1:
        raise ValueError(f"store_kv: all tensors must be on one device, got {sorted(map(str, devices))}")


def _triton(device: torch.device):
    """The Triton kernels' module when they can run on `device`'s tensors, else None (the reference)."""
    if device.type not in ("cuda", "cpu") or not kernels.triton_available():
        return None
    from fivefold.kernels import paged_attention_triton as module  # imports triton: only now
    # On the CPU only interpreted kernels run, i.e. TRITON_INTERPRET=1 before triton was imported.
    return module if device.type == "cuda" or module.INTERPRETED else None


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                              max_query_len: int, scale: float | None = None) -> torch.Tensor:
    """paged_attention in plain PyTorch, one sequence at a time: gather its blocks, repeat the kv heads
    for GQA, mask causally with the offset of its queries, softmax in fp32. The tests' oracle and the CPU
    path. Reads the sequence lengths to the host."""
    _check(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len)
    heads, head_dim = q.shape[1], q.shape[2]
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.zeros_like(q)
    starts, lengths = query_start_loc.tolist(), seq_lens.tolist()
    for i, length in enumerate(lengths):
        first, n = starts[i], starts[i + 1] - starts[i]
        if n == 0 or length == 0:  # nothing to answer, or a padding row: zeros
            continue
        blocks = block_tables[i, :-(-length // block_size)].long()
        k = k_cache[blocks].reshape(-1, kv_heads, head_dim)[:length].float()  # (L, Hkv, d)
        v = v_cache[blocks].reshape(-1, kv_heads, head_dim)[:length].float()
        k = k.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)  # (H, L, d)
        v = v.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        scores = q[first:first + n].float().transpose(0, 1) @ k.transpose(1, 2) * scale  # (H, n, L)
        positions = torch.arange(length - n, length, device=q.device)  # the queries' own
        visible = torch.arange(length, device=q.device)[None, :] <= positions[:, None]  # (n, L)
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        probs = probs.where(visible.any(-1)[:, None], 0.0)  # a query with no key (more queries than context)
        out[first:first + n] = (probs @ v).transpose(0, 1).to(q.dtype)
    return out


def store_kv_reference(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """store_kv in plain PyTorch: k[t], v[t] into slot slot_mapping[t] of the pools, -1 skipped."""
    _check_store(k_cache, v_cache, k, v, slot_mapping)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep]
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep]


@torch.library.custom_op("fivefold::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int,
                    scale: float | None = None, split_k: int | None = None,
                    max_seq_len: int | None = None) -> torch.Tensor:
    """Causal attention of the flattened query tokens q (T, H, d) over their sequences' keys and values in
    the paged pool (layouts: the module docstring) -> (T, H, d) in q's dtype.

    max_query_len: the most query tokens of any one sequence, a host int (no device sync). It sizes the
        kernel's query tiles and gates split-K; the launch covers every row whatever it says, so a loose
        value costs speed, not correctness.
    scale: of the scores; None: 1/sqrt(d).
    split_k: None lets choose_splits decide, 1 turns split-K off, k > 1 forces k parts.
    max_seq_len: a bound on the longest context, for that choice; None: the block table's width times
        block_size (a loose bound where the tables are padded to the model's length)."""
    _check(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, split_k)
    module = _triton(q.device)
    if module is None:
        return paged_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                          max_query_len, scale)
    if split_k is None:
        longest = block_tables.shape[1] * k_cache.shape[1] if max_seq_len is None else max_seq_len
        split_k = choose_splits(seq_lens.shape[0], k_cache.shape[2], max_query_len, longest)
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else scale
    return module.attend(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, scale,
                         split_k)


@paged_attention.register_fake
def _(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, scale=None, split_k=None,
      max_seq_len=None):
    _check(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, split_k)
    return q.new_empty(q.shape)  # contiguous, like both implementations' output


@torch.library.custom_op("fivefold::store_kv", mutates_args=("k_cache", "v_cache"))
def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write k[t], v[t] (T, Hkv, d; any strides) into slot slot_mapping[t] (int32 or int64, (T,)) of
    k_cache and v_cache, in place; slot -1 marks a padding token and writes nothing."""
    _check_store(k_cache, v_cache, k, v, slot_mapping)
    module = _triton(k.device)
    if module is None:
        store_kv_reference(k_cache, v_cache, k, v, slot_mapping)
    else:
        module.store(k_cache, v_cache, k, v, slot_mapping)


def _check_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    _check_store(k_cache, v_cache, k, v, slot_mapping)
    if q.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.dtype != k.dtype:
        raise ValueError(f"rope_store_kv: q must be (tokens, heads, {k.shape[2]}) in {k.dtype} like k, got "
                         f"{tuple(q.shape)} {q.dtype}")
    if q.shape[2] % 2:
        raise ValueError(f"rope_store_kv: RoPE rotates pairs of the head dimension; {q.shape[2]} is odd")
    if cos.shape != (q.shape[0], q.shape[2]) or sin.shape != cos.shape:
        raise ValueError(f"rope_store_kv: cos and sin must be (tokens, head_dim) = {(q.shape[0], q.shape[2])}, "
                         f"got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if any(t.stride(-1) != 1 for t in (q, k, v, cos, sin)):
        raise ValueError("rope_store_kv: q, k, v, cos and sin must each have a contiguous last dimension")
    if len({t.device for t in (q, k, cos, sin)}) > 1:
        raise ValueError("rope_store_kv: q, k, cos and sin must be on one device")


def rope_store_kv_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            slot_mapping: torch.Tensor) -> torch.Tensor:
    """rope_store_kv in plain PyTorch: the rotation in fp32, rounded once (as fivefold.kernels.rope)."""
    _check_rope_store(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)

    def rotate(x: torch.Tensor) -> torch.Tensor:  # (T, heads, d); cos and sin broadcast over the heads
        return apply_rope(x.float(), cos.float()[:, None], sin.float()[:, None]).to(x.dtype)

    store_kv_reference(k_cache, v_cache, rotate(k), v, slot_mapping)
    return rotate(q).contiguous()


@torch.library.custom_op("fivefold::rope_store_kv", mutates_args=("k_cache", "v_cache"))
def rope_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """RoPE and the KV store in one launch: q (T, H, d), k and v (T, Hkv, d), unrotated, any row and head
    strides (column slices of one fused q/k/v product); cos, sin (T, d), each token's angles. Rotates k
    into slot slot_mapping[t] of k_cache and copies v into v_cache (slot -1: skipped) as store_kv does,
    and returns q rotated, (T, H, d) contiguous. What fivefold.kernels.rope.apply_rope on q and k and
    store_kv compute, in one kernel where those take three, with q written once in attention's layout."""
    _check_rope_store(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    module = _triton(q.device)
    if module is None:
        return rope_store_kv_reference(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    return module.rope_store(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)


@rope_store_kv.register_fake
def _(q, k, v, cos, sin, k_cache, v_cache, slot_mapping):
    _check_rope_store(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    return q.new_empty(q.shape)


def warm_up(k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int) -> list[tuple[int, int]]:
    """Compile, before serving starts, every variant of the attention kernels a step can meet, so that no step
    waits for Triton's compiler mid-run. A variant is a combination of compile-time constants: the query tile
    (decode rows, short and long prefill chunks: paged_attention_triton.tiles) and, for decode rows, the split
    count (split_counts). The per-step sizes (sequences, tokens, block-table width) are not specialised on
    (the kernel's do_not_specialize), so they add none. Each variant runs once on one dummy sequence over
    block 0 of `k_cache` / `v_cache` (one layer's (blocks, block_size, kv_heads, head_dim) view, nothing
    written). The (max_query_len, split_k) pairs launched; none where the reference runs (nothing to compile)."""
    module = _triton(k_cache.device)
    if module is None:
        return []
    block_size, kv_heads, head_dim = k_cache.shape[1:]
    device, group = k_cache.device, num_heads // kv_heads
    lengths: dict[tuple, int] = {}
    for n in (1 << i for i in range(module.MAX_ROWS.bit_length())):  # rows stop growing at MAX_ROWS
        lengths.setdefault(module.tiles(n, group, head_dim, k_cache.dtype), n)
    launched = []
    for n in lengths.values():
        q = torch.zeros(n, num_heads, head_dim, dtype=k_cache.dtype, device=device)
        tables = torch.zeros(1, -(-n // block_size), dtype=torch.int32, device=device)
        seq_lens = torch.tensor([n], dtype=torch.int32, device=device)
        qsl = torch.tensor([0, n], dtype=torch.int32, device=device)
        for splits in split_counts() if n == 1 else [1]:
            paged_attention(q, k_cache, v_cache, tables, seq_lens, qsl, n, split_k=splits)
            launched.append((n, splits))
    return launched


@store_kv.register_fake
def _(k_cache, v_cache, k, v, slot_mapping):
    _check_store(k_cache, v_cache, k, v, slot_mapping)
