"""Communication volume per training step and rank, by parallel dimension, from the config alone.

Bytes a rank sends for one optimizer step with ring algorithms: an all-reduce of N bytes over g ranks
sends 2 (g-1)/g N, an all-gather or reduce-scatter of N (full size) sends (g-1)/g N, a point-to-point
send its size, an all-to-all (g-1)/g of its input. They follow what fivefold/parallel does (fp32
gradient reductions; activations in the compute dtype):

    dp / zero   0: all-reduce of every gradient, once per step; 1: reduce-scatter then all-gather of the
                parameters; 2: the reduce-scatter on every micro-batch; 3: also two all-gathers of the
                parameters (forward, backward) per micro-batch
    tp          per layer and micro-batch 4 activations of B x S x H, as all-reduces (2 forward, 2
                backward) or, under SP, all-gathers and reduce-scatters (plus the SP re-gathers of the
                attention and MLP inputs before backward)
    cp          ring attention: forward cp-1 shifts of the local K and V; backward cp-1 shifts of K and V
                and cp shifts of their fp32 gradients, per layer and micro-batch
    pp          each micro-batch's activation forward and its gradient backward across each stage boundary
    ep          per MoE layer and micro-batch, the routed tokens (k per token) to their experts and back,
                forward and backward
"""

from __future__ import annotations

from fivefold.config import Config
from fivefold.memory import formulas


def _ring(group: int) -> float:
    return (group - 1) / group if group > 1 else 0.0


def step_communication(cfg: Config) -> dict[str, float]:
    """Bytes this rank sends per optimizer step, by dimension (the first pipeline stage's view)."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    act = 2 if t.precision == "bf16-mixed" else 4
    param_bytes = act
    micro = t.grad_accum
    tokens = t.micro_batch_size * t.seq_len // p.cp  # per micro-batch on this rank
    bsh = tokens * m.hidden_size * act
    stage0 = formulas.rank_layers(m.num_layers, p.pp, 0, p.pp_virtual_stages, p.pp_layers)
    layers = len(stage0)
    params = sum(n for _, n in formulas.parameter_shapes(m, p.tp, stage0, True, p.pp == 1, p.ep))
    out: dict[str, float] = {}
    g = p.dp * p.cp  # gradients are reduced over dp x cp
    if g > 1:
        grads = 4 * params
        if p.zero == 0:
            out["dp"] = 2 * _ring(g) * grads
        else:
            scatters = micro if p.zero >= 2 else 1
            gathers = 2 * micro if p.zero == 3 else 1
            out["dp"] = _ring(g) * (scatters * grads + gathers * param_bytes * params)
    if p.tp > 1:
        per_layer = 4 * bsh
        if p.sequence_parallel:
            per_layer += 2 * bsh  # attention and MLP inputs gathered again before their backward
            out["tp"] = _ring(p.tp) * per_layer * layers * micro
        else:
            out["tp"] = 2 * _ring(p.tp) * per_layer * layers * micro
    if p.cp > 1:
        kv = 2 * t.micro_batch_size * (m.num_kv_heads // p.tp) * (t.seq_len // p.cp) * m.head_size
        out["cp"] = layers * micro * (kv * act * (p.cp - 1) * 2 + kv * 4 * p.cp)
    if p.pp > 1:
        out["pp"] = 2 * micro * t.micro_batch_size * t.seq_len * m.hidden_size * act / (p.tp if p.sequence_parallel else 1)
    if p.ep > 1 and m.num_experts:
        routed = tokens * m.experts_per_token * m.hidden_size * act
        out["ep"] = 4 * _ring(p.ep) * routed * layers * micro
    return out
