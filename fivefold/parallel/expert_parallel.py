"""Expert parallelism: the experts of every MoE layer are split across `ep` data-parallel ranks, and
each token's hidden state travels to the rank of each expert it was routed to and back, by all-to-all
(Lepikhin et al. 2020, "GShard"). Routing, gate weights, capacity and the auxiliary losses stay on
the token's own rank, so they are exactly the single-process ones.

Ranks: data-parallel rank d = g * ep + e; the ep ranks of one group g split the experts (rank e holds
experts e * E/ep ... (e+1) * E/ep - 1: those rows of each stacked expert weight), and expert parameters are averaged only across the groups that
hold the same experts (the expert-data-parallel group), while every other parameter is reduced over
all dp ranks as usual.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.nn.functional import all_to_all_single as differentiable_all_to_all

from fivefold.model.moe import MoE, sorted_by_expert


class AllToAllDispatch:
    def __init__(self, group, num_experts: int):
        self.group = group
        self.ep, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.per_rank = num_experts // self.ep

    def __call__(self, moe, tokens, expert_ids, token_ids, weights):
        dest = torch.div(expert_ids, self.per_rank, rounding_mode="floor")
        order = torch.argsort(dest, stable=True)  # grouped by destination rank, token order within
        expert_ids, token_ids, weights, dest = expert_ids[order], token_ids[order], weights[order], dest[order]
        send = torch.bincount(dest, minlength=self.ep)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        send_splits, recv_splits = send.tolist(), recv.tolist()
        incoming = tokens.new_empty((sum(recv_splits), tokens.shape[-1]))
        incoming = differentiable_all_to_all(incoming, tokens[token_ids], recv_splits, send_splits, self.group)
        incoming_experts = expert_ids.new_empty(sum(recv_splits))
        dist.all_to_all_single(incoming_experts, expert_ids, recv_splits, send_splits, group=self.group)
        # Sorted by local expert for the grouped matmul. Every expert runs, on zero rows if it got none,
        # which keeps `incoming` in the graph: every rank must run the dispatch's backward all-to-all, or
        # the collectives of the ranks stop matching.
        order, counts = sorted_by_expert(incoming_experts - self.rank * self.per_rank, self.per_rank)
        processed = moe.experts(incoming[order], counts)[torch.argsort(order)]
        returned = differentiable_all_to_all(tokens.new_empty((len(token_ids), tokens.shape[-1])), processed,
                                             send_splits, recv_splits, self.group)
        return torch.zeros_like(tokens).index_add(0, token_ids, returned * weights[:, None].to(tokens.dtype))


def expert_groups(ranks: torch.Tensor, ep: int):
    """(this rank's ep group, this rank's expert-data-parallel group). `ranks` (dp, cp, tp): the global
    rank of each (data-parallel, context-parallel, tensor-parallel) coordinate of one pipeline stage;
    data-parallel rank d = g * ep + e. An ep group joins the ep ranks of one (cp, tp) coordinate, whose
    token sets and expert shards correspond; the ranks holding the same experts are every group g's e-th,
    at every cp coordinate (each holds part of the same sequences). Every rank creates every group, in
    the same order, as torch.distributed requires."""
    me = dist.get_rank()
    dp, cp, tp = ranks.shape
    mine_ep = mine_edp = None
    for t in range(tp):
        for c in range(cp):
            for g in range(dp // ep):
                members = [int(ranks[g * ep + e, c, t]) for e in range(ep)]
                group = dist.new_group(members)
                mine_ep = group if me in members else mine_ep
        for e in range(ep):
            members = [int(ranks[g * ep + e, c, t]) for g in range(dp // ep) for c in range(cp)]
            group = dist.new_group(members)
            mine_edp = group if me in members else mine_edp
    return mine_ep, mine_edp


def apply_expert_parallel(model: nn.Module, group) -> set[str]:
    """Keep this rank's experts, rows rank * E/ep ... of each stacked expert weight (on the meta device
    before materialisation; names stay global), and route through all-to-all. Returns the names of the
    expert parameters: each ep rank holds different rows, so the gradient norm sums them over the ep
    group and they are reduced over the expert-data-parallel group."""
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    names = set()
    for prefix, moe in ((n, m) for n, m in model.named_modules() if isinstance(m, MoE)):
        per_rank = moe.num_experts // ep
        for name, param in list(moe.experts.named_parameters()):
            mine = param.detach()[rank * per_rank:(rank + 1) * per_rank].clone()
            setattr(moe.experts, name, nn.Parameter(mine, requires_grad=param.requires_grad))
            names.add(f"{prefix}.experts.{name}")
        moe.distribute(dispatch=AllToAllDispatch(group, moe.num_experts))
    return names
