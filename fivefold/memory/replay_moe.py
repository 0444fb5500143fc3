"""A mixture of experts' layer as a replay allocates its tensors (fivefold/model/moe.py and
fivefold/parallel/expert_parallel.py): router, capacity mask, dispatch (local or all-to-all), grouped
experts and the weighed sum back per token."""

from __future__ import annotations

from dataclasses import replace

from fivefold.memory import replay_layers
from fivefold.memory.replay import Buf, Replay, Shapes


def moe(r: Replay, n: Buf, d: Shapes) -> Buf:
    """MoE.forward on this rank's b s tokens (the whole sequence under SP: gathered first, split after), A
    routed (token, expert) assignments, routing assumed balanced: each expert gets A / E of them, and
    under expert parallelism each rank receives as many as it sends. Saved: the router's input, its fp32
    logits (z-loss) and softmax (balance loss), the top-k indices and gate weights; per assignment the
    routed token (the grouped matmuls' input), the experts' gate, silu(gate), up and product, their
    output, weighed by the gate (the weighed copy too: index_add keeps its source), and the int64 indices
    that route it back."""
    T, A = d.b * d.s, d.assignments
    trains = replay_layers.weight_input(d, "router", "experts")  # frozen under LoRA: their inputs are not saved
    x = n
    if d.rep != 1:  # _GatherToReplicated: a rank-major buffer, reordered into sequence order (b > 1)
        x = r.alloc(d.p * T * d.h)
        if d.b > 1:
            rank_major, x = x, r.alloc(d.p * T * d.h)
            r.free(rank_major)
    logits = r.matmul(r.alloc(d.p * T * d.experts))  # the router stays in the compute dtype under fp8
    if trains:
        r.save(x)
    if d.p != 4:  # routing decisions in fp32
        low, logits = logits, r.alloc(4 * T * d.experts)
        r.free(low)
    top = r.alloc(4 * T * d.topk)
    top_ids = r.alloc(8 * T * d.topk)
    r.save(top_ids)
    weights = r.alloc(4 * T * d.topk)  # softmax over the k chosen logits saves its output
    r.save(weights)
    arange = r.alloc(8 * T)
    token_ids = r.alloc(8 * T * d.topk)
    r.free(arange)
    r.alloc(8 * d.experts)  # the count per expert: MoE.stats keeps it past the forward
    keep = _capacity_mask(r, T * d.topk, d)
    r.save(keep)  # weights[keep]'s backward keeps its mask
    picked = []
    for size in (8, 8, 4):  # expert ids, token ids, weights of the kept assignments (nonzero first)
        nonzero = r.alloc(8 * A)
        picked.append(r.alloc(size * A))
        r.free(nonzero)
    out = (_all_to_all_dispatch if d.ep > 1 else _local_dispatch)(r, x, A, d)
    r.free(*picked)
    if d.shared_f:  # a dense tensor-parallel MLP of its own, on the whole sequence
        shared = replay_layers.mlp(r, x, replace(d, f=d.shared_f, rep=1.0, tp_reduce=d.tp_reduce or d.rep != 1))
        total = r.alloc(d.p * T * d.h)
        r.free(out, shared)
        out = total
    probs = r.alloc(4 * T * d.experts)
    r.save(probs)
    lse = r.alloc(4 * T)  # logsumexp saves the fp32 logits and its result; square saves it again
    r.free(r.alloc(4 * T * d.experts))  # exp(logits - max), summed
    r.save(logits, lse)
    r.free(r.alloc(4 * T))
    r.free(logits, top, top_ids, weights, token_ids, keep, probs, lse)
    if x is not n:
        r.free(x)
    if d.rep != 1 and d.b > 1:  # _SplitSequence: this rank's part, copied out of the whole output
        part = r.alloc(d.p * d.bsh)
        r.free(out)
        out = part
    return out


def _capacity_mask(r: Replay, assignments: float, d: Shapes) -> Buf:
    """MoE._within_capacity: all ones when dropless; else each assignment's arrival order at its expert
    from a one-hot (A, E) int64 cumulative sum."""
    if not d.capacity:
        return r.alloc(assignments)
    one_hot = r.alloc(8 * assignments * d.experts)
    cumulative = r.alloc(8 * assignments * d.experts)
    arrivals = r.alloc(8 * assignments * d.experts)
    r.free(cumulative)
    position = r.alloc(8 * assignments)
    r.free(arrivals)
    shifted = r.alloc(8 * assignments)
    r.free(position)
    keep = r.alloc(assignments)
    r.free(shifted, one_hot)
    return keep


def _experts(r: Replay, routed: Buf, rows: float, d: Shapes) -> Buf:
    """GroupedExperts.forward on `rows` routed tokens: gate and up (grouped matmuls saving their input),
    silu(gate) * up, down; returns down's output."""
    trains = replay_layers.weight_input(d, "experts")
    cumulative = r.alloc(8 * d.experts / d.ep)
    ends = r.alloc(4 * d.experts / d.ep)  # the group ends in int32, saved by every grouped matmul
    r.free(cumulative)
    r.save(ends)
    gate = r.matmul(r.alloc(d.p * rows * d.expert_f))
    up = r.matmul(r.alloc(d.p * rows * d.expert_f))
    if trains:
        r.save(routed)
    act = r.alloc(d.p * rows * d.expert_f)  # silu saves its input, the mul both factors
    prod = r.alloc(d.p * rows * d.expert_f)
    r.save(gate, act, up)
    r.free(gate, act, up)
    down = r.matmul(r.alloc(d.p * rows * d.h))
    if trains:
        r.save(prod)
    r.free(prod, ends)
    return down


def _sort(r: Replay, n: float) -> Buf:
    """A stable argsort of n int64 keys: the sorted keys are made and dropped, the order kept."""
    values = r.alloc(8 * n)
    order = r.alloc(8 * n)
    r.free(values)
    return order


def _weigh_and_sum(r: Replay, expert_out: Buf, rows: float, d: Shapes, index: list,
                   weights: Buf | None = None) -> Buf:
    """expert outputs * gate weights (A, 1) in the compute dtype, added back per token (index_add).
    `weights`: the fp32 gate weights already in the outputs' order; else gathered into it here."""
    w32 = weights or r.alloc(4 * rows)
    w = w32 if d.p == 4 else r.alloc(d.p * rows)
    if w is not w32 and weights is None:
        r.free(w32)
    weighed = r.alloc(d.p * rows * d.h)
    r.save(expert_out, w, weighed)  # the mul keeps both factors, index_add's backward its source
    zeros = r.alloc(d.p * d.b * d.s * d.h)
    out = r.alloc(d.p * d.b * d.s * d.h)
    r.free(zeros, weighed, expert_out, w, *index)
    return out


def _local_dispatch(r: Replay, x: Buf, A: float, d: Shapes) -> Buf:
    """LocalDispatch: the assignments sorted by expert, their tokens gathered, run and added back."""
    order = _sort(r, A)
    counts = r.alloc(8 * d.experts)
    rows = r.alloc(8 * A)
    routed = r.alloc(d.p * A * d.h)
    r.save(rows, order)  # the token gather's and the gate weights' index_select keep their indices
    down = _experts(r, routed, A, d)
    r.free(routed, counts)
    return _weigh_and_sum(r, down, A, d, [order, rows])


def _all_to_all_dispatch(r: Replay, x: Buf, A: float, d: Shapes) -> Buf:
    """AllToAllDispatch (fivefold.parallel.expert_parallel): assignments sorted by destination rank,
    tokens sent by all-to-all, sorted by local expert, run, unsorted, sent back, weighed and added."""
    dest = r.alloc(8 * A)
    order = _sort(r, A)
    sorted_ids = [r.alloc(8 * A), r.alloc(8 * A), r.alloc(4 * A)]  # expert ids, token ids, weights
    old_dest, dest = dest, r.alloc(8 * A)
    r.free(old_dest)
    r.save(order, sorted_ids[1])  # weights[order]; tokens[token_ids]
    received = A  # balanced: every rank receives what it sends
    incoming = r.alloc(d.p * received * d.h)
    r.free(r.alloc(d.p * A * d.h))  # tokens[token_ids], sent
    incoming_ids = r.alloc(8 * received)
    local_ids = r.alloc(8 * received)
    by_expert = _sort(r, received)
    counts = r.alloc(8 * d.experts / d.ep)
    r.free(local_ids)
    routed = r.alloc(d.p * received * d.h)
    r.save(by_expert)
    down = _experts(r, routed, received, d)
    back = _sort(r, received)
    processed = r.alloc(d.p * received * d.h)
    r.save(back)
    r.free(down, routed, counts)
    returned = r.alloc(d.p * A * d.h)
    out = _weigh_and_sum(r, returned, A, d, [], weights=sorted_ids[2])
    r.free(dest, order, *sorted_ids, incoming, incoming_ids, by_expert, back, processed)
    return out
