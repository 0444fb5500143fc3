"""The Triton kernels behind fivefold.kernels.paged_attention: attention over the paged KV pool, its
split-K reduction, and the store of new keys and values into their slots.

Imported only once Triton is known to be usable (fivefold.kernels.triton_available): the public module
must import on machines without Triton. Shapes and the checks on them live there; the launchers here
take inputs already checked.

Attention: one program per (query tile, kv head, split). A query tile is BLOCK_Q consecutive query
tokens of one sequence times every query head of the kv head's group, flattened to BLOCK_Q * BLOCK_G
rows (token-major), so each K/V tile loaded serves the whole group. The tiles of all sequences are
numbered one after another, sequence i's first at qsl[i] // BLOCK_Q + i, which bounds their count by
T // BLOCK_Q + S from host-known sizes (no device sync, graph-capturable) while a decode row costs one
program rather than max_query_len / BLOCK_Q of them; a program finds its sequence by binary search on
that numbering. Keys are walked BLOCK_N at a time, each key's block looked up in the block table, so
the walk is independent of the pool's block size. Online softmax in fp32 with exp2 (the scale folded
with log2 e into the scores).

Split-K: the same kernel with NUM_SPLITS > 1 cuts each tile's key range into NUM_SPLITS parts and
writes unnormalised partial outputs with their running max and sum; _combine merges them per (token,
head) by log-sum-exp. The same arithmetic per key, so the results agree with one split to rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

# A running max below any real score: finite, so a row that has seen no key yet gives exp2(m - m) = 1
# rather than exp2(-inf + inf) = NaN, and keys masked with -inf still get weight exp2(-inf) = 0. A
# constexpr: jit code may read no other kind of global.
_NO_MAX = tl.constexpr(-1.0e30)


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b accumulated in fp32. UPCAST (the interpreter with bf16 only: it multiplies bf16's raw bits
    as integers) computes from the same values widened to fp32, which every bf16 value is exactly."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


# The per-step sizes are not specialised on: Triton would otherwise compile another variant the first time
# one of them is 1 or a multiple of 16, in the middle of a run (paged_attention.warm_up compiles the rest).
@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "stride_tab"])
def _attend(q_ptr, k_ptr, v_ptr, out_ptr, part_acc_ptr, part_ml_ptr, tables_ptr, seq_lens_ptr, qsl_ptr,
            num_seqs, num_tokens, scale_log2, stride_qt, stride_qh, stride_qd, stride_tab, num_kv_heads, group,
            head_dim,
            BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    # The sequence whose tiles hold this one: the last i with qsl[i] // BLOCK_Q + i <= tile.
    # Explicit int32 tensors: Triton turns an int argument equal to 1 into a constant, and a loop-carried
    # variable may not change type.
    lo = tl.zeros([], dtype=tl.int32)
    hi = lo + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(qsl_ptr + mid).to(tl.int32) // BLOCK_Q + mid
        lo = tl.where(first <= tile, mid + 1, lo)
        hi = tl.where(first <= tile, hi, mid)
    seq = lo - 1
    q_start = tl.load(qsl_ptr + seq).to(tl.int32)
    n = tl.load(qsl_ptr + seq + 1).to(tl.int32) - q_start  # this sequence's query tokens
    tok0 = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if tok0 >= n:  # a spare tile of the bound T // BLOCK_Q + S
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)  # context including the queries; 0 = padding

    BLOCK_R: tl.constexpr = BLOCK_Q * BLOCK_G
    rows = tl.arange(0, BLOCK_R)
    tok = tok0 + rows // BLOCK_G  # (R,) token within the sequence's queries
    head = kvh * group + rows % BLOCK_G  # (R,) query head
    # The last term keeps a query_start_loc past T (a caller's bug) from writing outside `out`.
    row_ok = (tok < n) & (rows % BLOCK_G < group) & (q_start + tok < num_tokens)
    pos = seq_len - n + tok  # (R,) the query's position: it sees keys 0..pos
    dims = tl.arange(0, BLOCK_D)
    d_ok = dims < head_dim  # head sizes need not be powers of two
    q_off = (q_start + tok).to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
    q = tl.load(q_ptr + q_off[:, None] + dims[None, :] * stride_qd, mask=row_ok[:, None] & d_ok[None, :],
                other=0.0)  # (R, D)

    # Keys this tile can see at all: up to its last query's position (none for a padding row).
    last_tok = tl.minimum(tok0 + BLOCK_Q, n) - 1
    kv_end = tl.maximum(tl.minimum(seq_len - n + last_tok + 1, seq_len), 0)
    per_split = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
    kv_lo = split * per_split
    kv_hi = tl.minimum(kv_lo + per_split, kv_end)

    m_i = tl.full([BLOCK_R], _NO_MAX, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    slot_stride = num_kv_heads * head_dim  # the pool is contiguous: (blocks, BLOCK_SIZE, Hkv, d)
    table = tables_ptr + seq.to(tl.int64) * stride_tab
    for start in range(kv_lo, kv_hi, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)  # (N,) key positions in the sequence
        k_ok = kpos < kv_hi
        block = tl.load(table + kpos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        slot = block * BLOCK_SIZE + kpos % BLOCK_SIZE
        kv_off = slot * slot_stride + kvh * head_dim  # (N,) int64: a pool may pass 2**31 elements
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + kv_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)  # (N, D)
        s = _dot(q, tl.trans(k), PRECISION, UPCAST) * scale_log2  # (R, N) fp32
        s = tl.where(k_ok[None, :] & (kpos[None, :] <= pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + kv_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)  # (N, D)
        # P rounded to V's dtype for the tensor cores, as FlashAttention does; accumulated in fp32.
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
        m_i = m_new

    token = (q_start + tok).to(tl.int64)
    out_mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        # A row that saw no key (padding: seq_len 0) has l = 0 and writes zeros.
        out = tl.where(l_i[:, None] > 0, acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)
        out_off = (token * (num_kv_heads * group) + head) * head_dim
        tl.store(out_ptr + out_off[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:  # partials (T, H, NUM_SPLITS, d) and their (max, sum) pairs (T, H, NUM_SPLITS, 2)
        part = (token * (num_kv_heads * group) + head) * NUM_SPLITS + split
        tl.store(part_acc_ptr + (part * head_dim)[:, None] + dims[None, :], acc, mask=out_mask)
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _combine(part_acc_ptr, part_ml_ptr, out_ptr, head_dim,
             NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # one (token, head)
    splits = tl.arange(0, BLOCK_S)
    s_ok = splits < NUM_SPLITS
    dims = tl.arange(0, BLOCK_D)
    d_ok = dims < head_dim
    # A split that saw no key has (max, sum) = (_NO_MAX, 0), a row outside every sequence (0, 0): both
    # weigh nothing.
    m = tl.load(part_ml_ptr + (row * NUM_SPLITS + splits) * 2, mask=s_ok, other=_NO_MAX)  # (S,)
    l = tl.load(part_ml_ptr + (row * NUM_SPLITS + splits) * 2 + 1, mask=s_ok, other=0.0)
    acc = tl.load(part_acc_ptr + ((row * NUM_SPLITS + splits) * head_dim)[:, None] + dims[None, :],
                  mask=s_ok[:, None] & d_ok[None, :], other=0.0)  # (S, D)
    weight = tl.where(l > 0, tl.math.exp2(m - tl.max(m, axis=0)), 0.0)  # (S,)
    total = tl.sum(weight * l, axis=0)
    out = tl.sum(weight[:, None] * acc, axis=0)
    out = tl.where(total > 0, out / tl.maximum(total, 1e-30), 0.0)
    tl.store(out_ptr + row * head_dim + dims, out.to(out_ptr.dtype.element_ty), mask=d_ok)


@triton.jit
def _store(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, num_slots, num_kv_heads, head_dim,
           stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
           BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)  # one token: all its kv heads
    slot = tl.load(slots_ptr + t).to(tl.int64)
    # -1 marks a padding token. A slot past the pool is dropped too: on a GPU nothing can raise, and a
    # write there would land in someone else's memory.
    if (slot < 0) | (slot >= num_slots):
        return
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_dim)
    k = tl.load(k_ptr + t * stride_kt + heads * stride_kh + dims * stride_kd, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + heads * stride_vh + dims * stride_vd, mask=mask)
    cache = slot * (num_kv_heads * head_dim) + heads * head_dim + dims
    tl.store(k_cache_ptr + cache, k, mask=mask)
    tl.store(v_cache_ptr + cache, v, mask=mask)


@triton.jit
def _rope_store(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, num_slots,
                num_heads, num_kv_heads, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                stride_ct, stride_st, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr,
                BLOCK_HALF: tl.constexpr):
    # One token: its query heads rotated into q_out (T, H, d), its key heads rotated and its value heads
    # copied into their slot. The rotation is fivefold.kernels.rope's (rotate-half, fp32, rounded once).
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    col_ok = cols < HALF
    cos1 = tl.load(cos_ptr + t * stride_ct + cols, mask=col_ok, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + t * stride_ct + HALF + cols, mask=col_ok, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + t * stride_st + cols, mask=col_ok, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + t * stride_st + HALF + cols, mask=col_ok, other=0.0).to(tl.float32)
    heads = tl.arange(0, BLOCK_H)[:, None].to(tl.int64)
    mask = (heads < num_heads) & col_ok
    x = q_ptr + t * stride_qt + heads * stride_qh + cols
    x1 = tl.load(x, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x + HALF, mask=mask, other=0.0).to(tl.float32)
    out = q_out_ptr + (t * num_heads + heads) * (2 * HALF) + cols
    tl.store(out, (x1 * cos1 - x2 * sin1).to(q_out_ptr.dtype.element_ty), mask=mask)
    tl.store(out + HALF, (x2 * cos2 + x1 * sin2).to(q_out_ptr.dtype.element_ty), mask=mask)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if (slot >= 0) & (slot < num_slots):  # -1: a padding token; past the pool: dropped, as _store drops it
        kv_heads = tl.arange(0, BLOCK_KV)[:, None].to(tl.int64)
        kv_mask = (kv_heads < num_kv_heads) & col_ok
        k = k_ptr + t * stride_kt + kv_heads * stride_kh + cols
        k1 = tl.load(k, mask=kv_mask, other=0.0).to(tl.float32)
        k2 = tl.load(k + HALF, mask=kv_mask, other=0.0).to(tl.float32)
        cache = (slot * num_kv_heads + kv_heads) * (2 * HALF) + cols
        tl.store(k_cache_ptr + cache, (k1 * cos1 - k2 * sin1).to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
        tl.store(k_cache_ptr + cache + HALF, (k2 * cos2 + k1 * sin2).to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
        v = v_ptr + t * stride_vt + kv_heads * stride_vh + cols
        tl.store(v_cache_ptr + cache, tl.load(v, mask=kv_mask), mask=kv_mask)
        tl.store(v_cache_ptr + cache + HALF, tl.load(v + HALF, mask=kv_mask), mask=kv_mask)


# True when the kernels above were defined for Triton's CPU interpreter (TRITON_INTERPRET=1 when this
# module was imported): only then can they run on CPU tensors.
INTERPRETED = not isinstance(_attend, JITFunction)

MAX_ROWS = 64  # query rows (tokens x heads of a group) per tile, beyond a group's own size


def tiles(max_query_len: int, group: int, head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """(BLOCK_Q, BLOCK_G, BLOCK_N, BLOCK_D, num_warps) for a batch. Rows per tile are the group's heads
    times as many tokens as the longest query run uses, up to MAX_ROWS: a decode-only batch gets the
    16 rows tl.dot needs at least (one token's group, padded), not a prefill-sized tile. Keys per
    step: 64, halved for rows over 256 bytes (fp32 at d = 128, 16-bit at d = 256) so a K and a V tile
    stay within the shared memory of GPUs smaller than an H100 (sm_90, fp32, d = 128: 115 KB at 64)."""
    block_g = triton.next_power_of_2(group)
    rows = max(16, block_g, min(MAX_ROWS, block_g * triton.next_power_of_2(max(max_query_len, 1))))
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_n = 64 if block_d * dtype.itemsize <= 256 else 32
    warps = 8 if rows * block_d >= 128 * 128 else 4
    return rows // block_g, block_g, block_n, block_d, warps


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
           seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int, scale: float,
           splits: int) -> torch.Tensor:
    """The checked inputs of fivefold.kernels.paged_attention -> out (T, H, d) in q's dtype."""
    t, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    num_seqs = seq_lens.shape[0]
    block_q, block_g, block_n, block_d, warps = tiles(max_query_len, group, head_dim, q.dtype)
    # Rows outside every sequence (past query_start_loc[-1]) are never written: zeros, like the reference.
    out = torch.zeros(t, heads, head_dim, dtype=q.dtype, device=q.device)
    programs = t // block_q + num_seqs
    if t == 0 or num_seqs == 0:
        return out
    if splits > 1:
        part_acc = torch.empty(t, heads, splits, head_dim, dtype=torch.float32, device=q.device)
        part_ml = torch.zeros(t, heads, splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # fp32 stays fp32, as the reference
    _attend[(programs, kv_heads, splits)](
        q, k_cache, v_cache, out, part_acc, part_ml, block_tables, seq_lens, query_start_loc,
        num_seqs, t, scale * 1.4426950408889634, q.stride(0), q.stride(1), q.stride(2), block_tables.stride(0),
        kv_heads, group, head_dim, BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_G=block_g, BLOCK_N=block_n,
        BLOCK_D=block_d, NUM_SPLITS=splits, PRECISION=precision,
        UPCAST=INTERPRETED and q.dtype == torch.bfloat16, num_warps=warps)
    if splits > 1:
        _combine[(t * heads,)](part_acc, part_ml, out, head_dim, NUM_SPLITS=splits,
                               BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d, num_warps=1)
    return out


def store(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          slot_mapping: torch.Tensor) -> None:
    """k, v (T, Hkv, d), any strides, into the contiguous pools at slot_mapping (T,) (-1: skip)."""
    t, kv_heads, head_dim = k.shape
    if t == 0:
        return
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    block_h, block_d = max(2, triton.next_power_of_2(kv_heads)), max(16, triton.next_power_of_2(head_dim))
    _store[(t,)](k, v, k_cache, v_cache, slot_mapping, num_slots, kv_heads, head_dim,
                 k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
                 BLOCK_H=block_h, BLOCK_D=block_d,
                 num_warps=4 if kv_heads * head_dim >= 1024 else 1)


def rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """The checked inputs of fivefold.kernels.paged_attention.rope_store_kv -> rotated q (T, H, d)."""
    t, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    out = torch.empty(t, heads, head_dim, dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    half = head_dim // 2
    _rope_store[(t,)](q, k, v, cos, sin, out, k_cache, v_cache, slot_mapping, num_slots, heads, kv_heads,
                      q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                      cos.stride(0), sin.stride(0), HALF=half, BLOCK_H=max(2, triton.next_power_of_2(heads)),
                      BLOCK_KV=max(2, triton.next_power_of_2(kv_heads)), BLOCK_HALF=triton.next_power_of_2(half),
                      num_warps=4 if heads * head_dim >= 1024 else 1)
    return out
