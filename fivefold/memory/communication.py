"""Communication per training step and rank, by parallel dimension, from the config alone: every
collective fivefold/parallel runs, with its size, group, how often and when. `fivefold plan` sums the
bytes; the step-time model (fivefold.planner.speed) times each one on the link its group crosses.

Bytes a rank sends with ring algorithms: an all-reduce of N bytes over g ranks sends 2 (g-1)/g N, an
all-gather or reduce-scatter of N (full size) sends (g-1)/g N, a point-to-point send its size, an
all-to-all (g-1)/g of its input. They follow what fivefold/parallel does (fp32 gradient reductions;
activations in the compute dtype):

    dp / zero   0: all-reduce of every gradient, once per step, bucketed behind the last backward;
                1: reduce-scatter instead, then an all-gather of the updated parameters; 2: the
                reduce-scatter on every micro-batch; 3: also two all-gathers of each block's parameters
                (forward, backward) per micro-batch, prefetched one block ahead
    tp          per layer and micro-batch 4 activations of B x S x H, as all-reduces (2 forward, 2
                backward) or, under SP, as 4 all-gathers and 4 reduce-scatters, plus the SP re-gathers
                of the attention and MLP inputs before backward; the vocabulary-parallel embedding
                (forward) and LM head (backward) one more each
    cp          ring attention: forward cp-1 shifts of the local K and V; backward cp-1 shifts of K and V
                and cp shifts of their fp32 gradients, per layer and micro-batch, each overlapping a block
    pp          each micro-batch's activation forward and its gradient backward across each stage boundary
    ep          per MoE layer and micro-batch, the routed tokens (k per token) to their experts and back,
                forward and backward
"""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.config import Config
from fivefold.memory import formulas

# When a collective runs, which decides what it can hide behind (fivefold.planner.speed):
#   forward / backward  inside a layer's forward or backward, on the critical path (tp, ep)
#   ring_forward / _backward  ring-attention shifts, each behind one block's attention compute (cp)
#   boundary            a pipeline send between stages (pp)
#   gradients           the gradient reductions behind the last backward (dp, zero 0-1) or every
#                       micro-batch's backward (zero 2-3)
#   gather              ZeRO-3's parameter gathers, each prefetched behind the previous block
#   after_step          ZeRO-1/2's all-gather of the updated parameters, behind the optimizer step
PHASES = ("forward", "backward", "ring_forward", "ring_backward", "boundary", "gradients", "gather", "after_step")


@dataclass(frozen=True)
class Collective:
    dim: str  # dp, tp, cp, pp, ep
    op: str  # all_reduce, all_gather, reduce_scatter, all_to_all, send
    size: float  # bytes of the full buffer (all-gather: its output; reduce-scatter: its input)
    group: int  # ranks taking part
    count: float  # calls per optimizer step on this rank
    phase: str  # one of PHASES

    @property
    def sent(self) -> float:
        """Bytes one rank sends in one call (ring algorithms)."""
        ring = (self.group - 1) / self.group
        return {"all_reduce": 2 * ring, "all_gather": ring, "reduce_scatter": ring, "all_to_all": ring,
                "send": 1.0}[self.op] * self.size


def step_collectives(cfg: Config, stage: int = 0) -> list[Collective]:
    """Every collective pipeline stage `stage` runs in one optimizer step."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    act = 2 if t.mixed else 4
    micro = t.grad_accum
    tokens = t.micro_batch_size * t.seq_len // p.cp  # per micro-batch on this rank
    bsh = tokens * m.hidden_size * act
    mine = formulas.rank_layers(m.num_layers, p.pp, stage, p.pp_virtual_stages, p.pp_layers)
    layers = len(mine)
    first, last = stage == 0, stage == p.pp - 1
    shapes = formulas.parameter_shapes(m, p.tp, mine, first, last, p.ep)
    params = sum(n for _, n in shapes)
    out: list[Collective] = []
    g = p.dp * p.cp  # gradients are reduced over dp x cp
    if g > 1:
        grads = 4 * params
        if p.zero == 0:
            out.append(Collective("dp", "all_reduce", grads, g, 1, "gradients"))
        else:
            out.append(Collective("dp", "reduce_scatter", grads, g, micro if p.zero >= 2 else 1, "gradients"))
            if p.zero == 3:
                # train.fp8_weight_cast=step: the float8 linears' weights gathered as float8, 1 byte an
                # element, after one all-reduce of their amaxes a step
                fp8 = formulas.fp8_weights(shapes) if formulas.fp8_gathered(cfg) else []
                out.append(Collective("dp", "all_gather", act * params - (act - 1) * sum(fp8), g, 2 * micro, "gather"))
                if fp8:
                    out.append(Collective("dp", "all_reduce", 4 * len(fp8), g, 1, "after_step"))
            else:
                out.append(Collective("dp", "all_gather", act * params, g, 1, "after_step"))
    if p.tp > 1:
        if p.sequence_parallel:
            out += [Collective("tp", "all_gather", bsh, p.tp, 2 * layers * micro, "forward"),
                    Collective("tp", "reduce_scatter", bsh, p.tp, 2 * layers * micro, "forward"),
                    Collective("tp", "all_gather", bsh, p.tp, 4 * layers * micro, "backward"),
                    Collective("tp", "reduce_scatter", bsh, p.tp, 2 * layers * micro, "backward")]
        else:
            out += [Collective("tp", "all_reduce", bsh, p.tp, 2 * layers * micro, "forward"),
                    Collective("tp", "all_reduce", bsh, p.tp, 2 * layers * micro, "backward")]
        if first:  # the vocabulary-parallel embedding sums its partial lookups
            out.append(Collective("tp", "all_reduce", bsh, p.tp, micro, "forward"))
        if last:  # the LM head's input: gathered (SP; again before backward) forward, its gradient reduced
            if p.sequence_parallel:
                out += [Collective("tp", "all_gather", bsh, p.tp, micro, "forward"),
                        Collective("tp", "all_gather", bsh, p.tp, micro, "backward"),
                        Collective("tp", "reduce_scatter", bsh, p.tp, micro, "backward")]
            else:
                out.append(Collective("tp", "all_reduce", bsh, p.tp, micro, "backward"))
    if p.cp > 1:
        kv = 2 * t.micro_batch_size * (m.num_kv_heads // p.tp) * (t.seq_len // p.cp) * m.head_size
        out += [Collective("cp", "send", kv * act, p.cp, (p.cp - 1) * layers * micro, "ring_forward"),
                Collective("cp", "send", kv * act, p.cp, (p.cp - 1) * layers * micro, "ring_backward"),
                Collective("cp", "send", kv * 4, p.cp, p.cp * layers * micro, "ring_backward")]
    if p.pp > 1:
        boundary = t.micro_batch_size * t.seq_len * m.hidden_size * act / (p.tp if p.sequence_parallel else 1)
        sends = (not last) + (not first)  # activations forward, their gradients backward
        out.append(Collective("pp", "send", boundary, p.pp, sends * micro, "boundary"))
    if p.ep > 1 and m.num_experts:
        routed = tokens * m.experts_per_token * m.hidden_size * act
        out += [Collective("ep", "all_to_all", routed, p.ep, 2 * layers * micro, "forward"),
                Collective("ep", "all_to_all", routed, p.ep, 2 * layers * micro, "backward")]
    return out


def step_communication(cfg: Config) -> dict[str, float]:
    """Bytes this rank sends per optimizer step, by dimension (the first pipeline stage's view)."""
    out: dict[str, float] = {}
    for c in step_collectives(cfg, 0):
        if c.sent:
            out[c.dim] = out.get(c.dim, 0.0) + c.sent * c.count
    return out
