"""Activation memory swept over one setting: `sweep` over train.seq_len or train.micro_batch_size (eager
against SDPA), `recompute_sweep` against the compute recomputation adds (`fivefold plan --sweep`)."""

from __future__ import annotations

import math

from fivefold.config import Config
from fivefold.config_checks import recompute_layer_set
from fivefold.memory import formulas
from fivefold.memory.plan import compiled_blocks_modelled, plan_memory, with_changes


def sweep(cfg: Config, key: str, values: list[int], device: str = "cuda") -> dict[str, list[float]]:
    """Activation bytes per rank over train.seq_len or train.micro_batch_size, for eager and SDPA."""
    field_name = {"seq": "seq_len", "batch": "micro_batch_size"}[key]
    out: dict[str, list[float]] = {"values": list(values)}
    for attention in ("eager", "sdpa"):
        series = []
        for v in values:
            new = with_changes(cfg, {f"train.{field_name}": v, "model.attention": attention})
            series.append(plan_memory(new, device=device, suggest=False).memory["activations"])
        out[attention] = series
    return out


RECOMPUTE_SWEEP_NOTE = ("the rows replay eager blocks: the compiled replay covers recomputation for dense bf16 / fp32 "
                        "blocks without LoRA only; under train.compile the blocks without recomputation save less "
                        "(the plan without --sweep shows it)")


def sweep_replays_eager(cfg: Config, device: str) -> bool:
    """Whether recompute_sweep compares eager blocks for a compiled run: where the compiled replay does not
    cover recomputation (compiled_blocks_modelled), so that its rows compare like with like."""
    return cfg.train.compiled(device) and not compiled_blocks_modelled(with_changes(cfg, {"train.recompute": "full"}),
                                                                        device)


def recompute_sweep(cfg: Config, device: str = "cuda", every: list[int] | None = None) -> list[dict]:
    """Activation memory against the compute recomputation adds: no recomputation, full recomputation of
    every k-th layer (train.recompute_layers="every:k") for k from the layer count down to 1, and selective.
    `extra_compute`: the recomputed forward FLOPs as a fraction of the step's (formulas.flops_per_token).
    Each recomputed layer gives back its saved activations but its input for one more forward, so memory
    falls and compute grows linearly in the recomputed layers. Compiled runs replay compiled blocks in every
    row where the compiled replay covers recomputation, and eager blocks in every row elsewhere
    (sweep_replays_eager, RECOMPUTE_SWEEP_NOTE): a sweep compares like with like."""
    if sweep_replays_eager(cfg, device):
        cfg = with_changes(cfg, {"train.compile": "false"})
    m, seq = cfg.model, cfg.train.seq_len
    n = m.num_layers
    step = formulas.flops_per_token(m, seq)
    layer_forward = (step / 3 - 2 * m.vocab_size * m.hidden_size) / n
    core_forward = 4 * seq * m.q_size  # the attention scores and weighted sum, per layer and token
    ks = every or sorted({k for k in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64) if k <= n}
                         | {n, max(1, round(math.sqrt(n)))}, reverse=True)

    def row(label: str, mode: str, layers: str, recomputed: int, flops: float) -> dict:
        changed = with_changes(cfg, {"train.recompute": mode, "train.recompute_layers": layers})
        plan = plan_memory(changed, device=device, suggest=False)
        return {"recompute": label, "recomputed_layers": recomputed, "activations": plan.memory["activations"],
                "total": plan.memory["total"], "extra_compute": recomputed * flops / step}

    rows = [row("none", "none", "", 0, 0.0)]
    for k in ks:
        count = len(recompute_layer_set(f"every:{k}", n))
        if count != rows[-1]["recomputed_layers"]:  # e.g. every:24 and every:16 of 32 layers both take two
            rows.append(row("full" if k == 1 else f"every:{k}", "full", "" if k == 1 else f"every:{k}", count,
                            layer_forward))
    rows.append(row("selective", "selective", "", n, core_forward))
    return rows
