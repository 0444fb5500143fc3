"""Parameter and FLOP counts as pure functions of the model config.

The same config objects build the model, so tests assert these equal the built model's counts.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from fivefold.config import Config, ModelConfig


def norm_params(cfg: ModelConfig) -> int:
    has_bias = cfg.norm == "layernorm" and cfg.linear_bias
    return cfg.hidden_size * (2 if has_bias else 1)


def attention_params(cfg: ModelConfig) -> int:
    h = cfg.hidden_size
    weights = h * cfg.q_size + 2 * h * cfg.kv_size + cfg.q_size * h
    qkv_bias = (cfg.q_size + 2 * cfg.kv_size) if (cfg.qkv_bias or cfg.linear_bias) else 0
    out_bias = h if cfg.linear_bias else 0
    return weights + qkv_bias + out_bias


def mlp_params(cfg: ModelConfig, active: bool = False) -> int:
    """The feed-forward block of one layer: a dense MLP, or a mixture of experts (router + experts +
    shared expert; `active`: only the k experts a token uses)."""
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    if cfg.num_experts:
        experts = cfg.experts_per_token if active else cfg.num_experts
        return h * cfg.num_experts + experts * 3 * h * cfg.expert_size + 3 * h * cfg.shared_expert_size
    matrices = 3 if cfg.activation == "swiglu" else 2
    bias = ((matrices - 1) * f + h) if cfg.linear_bias else 0
    return matrices * h * f + bias


def layer_params(cfg: ModelConfig) -> int:
    return attention_params(cfg) + mlp_params(cfg) + 2 * norm_params(cfg)


def embedding_params(cfg: ModelConfig) -> int:
    """Token embedding, learned positions and the (untied) LM head."""
    tokens = cfg.vocab_size * cfg.hidden_size
    positions = cfg.max_seq_len * cfg.hidden_size if cfg.position == "learned" else 0
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.hidden_size
    return tokens + positions + head


def count_params(cfg: ModelConfig) -> int:
    return embedding_params(cfg) + cfg.num_layers * layer_params(cfg) + norm_params(cfg)


def matmul_params(cfg: ModelConfig) -> int:
    """Weights that take part in a matmul per token: every layer's linear weights plus the LM head
    (embeddings are lookups; norms and biases are elementwise)."""
    h = cfg.hidden_size
    attention = 2 * h * cfg.q_size + 2 * h * cfg.kv_size
    if cfg.num_experts:  # the router and the k experts each token goes through (MFU counts active FLOPs)
        mlp = mlp_params(cfg, active=True)
    else:
        mlp = (3 if cfg.activation == "swiglu" else 2) * h * cfg.ffn_hidden_size
    return cfg.num_layers * (attention + mlp) + cfg.vocab_size * h


def flops_per_token(cfg: ModelConfig, seq_len: int, training: bool = True) -> float:
    """Model FLOPs per token: 2 per matmul parameter forward (x3 for forward + backward), plus the
    attention scores and weighted sum: 2 * 2 * s * q_size per layer forward for full (non-causal)
    attention, as in the PaLM paper's MFU definition (Chowdhery et al. 2022, appendix B), which
    counts the causal half as done."""
    forward = 2 * matmul_params(cfg) + 4 * cfg.num_layers * seq_len * cfg.q_size
    return 3 * forward if training else forward


def active_params(cfg: ModelConfig) -> int:
    """Parameters that touch each token: all of a dense model's; of a mixture of experts, the router,
    the shared expert and only the top-k routed experts."""
    return count_params(cfg) - cfg.num_layers * (mlp_params(cfg) - mlp_params(cfg, active=True))


# --------------------------------------------------------------------------------------------
# Parameter inventory per rank: the model's named parameters, from the config alone.


def parameter_shapes(cfg: ModelConfig, tp: int = 1, layers=None, first_stage: bool = True,
                     last_stage: bool = True, ep: int = 1) -> list[tuple[str, int]]:
    """(name, numel on one tensor-parallel rank) of every parameter a rank holds (_parameter_shapes);
    memoised, as the layout search asks for the same stages thousands of times."""
    layers = tuple(range(cfg.num_layers) if layers is None else layers)
    return list(_cached_shapes(tuple(vars(cfg).items()), tp, layers, first_stage, last_stage, ep))


@functools.lru_cache(maxsize=1024)
def _cached_shapes(fields: tuple, tp: int, layers: tuple, first: bool, last: bool, ep: int) -> tuple:
    return tuple(_parameter_shapes(ModelConfig(**dict(fields)), tp, layers, first, last, ep))


def _parameter_shapes(cfg: ModelConfig, tp: int, layers, first_stage: bool, last_stage: bool,
                      ep: int) -> list[tuple[str, int]]:
    """(name, numel on one tensor-parallel rank) of every parameter a rank holds, named as the model
    names them. `layers` (default all; a pipeline rank's from rank_layers) and first/last stage select
    a pipeline stage; the first stage
    holds the embeddings, the last the final norm and LM head, and with tied embeddings and more than
    one stage the last stage keeps its own copy of the shared matrix (Megatron-LM does the same).

    Tensor parallelism follows Megatron-LM (Shoeybi et al. 2019): q/k/v and gate/up are split by
    output columns (with their biases), o/down by input rows (their biases stay whole), embedding and
    LM head by vocabulary rows; norms are replicated."""
    h, f, v = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size
    shapes: list[tuple[str, int]] = []
    norm_bias = cfg.norm == "layernorm" and cfg.linear_bias

    def norm(prefix: str) -> None:
        shapes.append((f"{prefix}.weight", h))
        if norm_bias:
            shapes.append((f"{prefix}.bias", h))

    if first_stage:
        shapes.append(("embed_tokens.weight", v * h // tp))
        if cfg.position == "learned":
            shapes.append(("embed_positions.weight", cfg.max_seq_len * h))
    qkv_bias = cfg.qkv_bias or cfg.linear_bias
    for i in layers:
        p = f"layers.{i}"
        norm(f"{p}.attn_norm")
        for name, out in (("q_proj", cfg.q_size), ("k_proj", cfg.kv_size), ("v_proj", cfg.kv_size)):
            shapes.append((f"{p}.attn.{name}.weight", out * h // tp))
            if qkv_bias:
                shapes.append((f"{p}.attn.{name}.bias", out // tp))
        shapes.append((f"{p}.attn.o_proj.weight", h * cfg.q_size // tp))
        if cfg.linear_bias:
            shapes.append((f"{p}.attn.o_proj.bias", h))
        norm(f"{p}.mlp_norm")
        if cfg.num_experts:  # experts split over ep ranks; the router and the shared expert are whole
            shapes.append((f"{p}.mlp.router.weight", h * cfg.num_experts))
            # Stacked (E, out, in): E/ep experts here, each split like a dense MLP under tensor parallelism.
            for name in ("gate_proj", "up_proj", "down_proj"):
                shapes.append((f"{p}.mlp.experts.{name}", cfg.num_experts // ep * h * cfg.expert_size // tp))
            if cfg.shared_expert_size:
                for name in ("gate_proj", "up_proj", "down_proj"):
                    shapes.append((f"{p}.mlp.shared_expert.{name}.weight", h * cfg.shared_expert_size // tp))
            continue
        for name in (("gate_proj", "up_proj") if cfg.activation == "swiglu" else ("up_proj",)):
            shapes.append((f"{p}.mlp.{name}.weight", f * h // tp))
            if cfg.linear_bias:
                shapes.append((f"{p}.mlp.{name}.bias", f // tp))
        shapes.append((f"{p}.mlp.down_proj.weight", h * f // tp))
        if cfg.linear_bias:
            shapes.append((f"{p}.mlp.down_proj.bias", h))
    if last_stage:
        norm("norm")
        if not cfg.tie_embeddings or not first_stage:
            shapes.append(("lm_head.weight", v * h // tp))
    return shapes


def step_chunk_key(name: str) -> str:
    """The unit the optimizer steps together (fivefold.train.optim): `layers.<i>`, else the top-level
    module (embed_tokens, norm, lm_head). The step's temporaries are sized by the largest unit."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else parts[0]


def joined_units(sizes) -> list[list[int]]:
    """Positions of the step units (in order, by numel) that the optimizer steps together: neighbours joined
    while the joined numel stays within the largest single unit's. The step's temporaries are sized by its
    largest unit, so joining smaller ones adds none, and each join saves a unit's launches and host work (a
    small model's blocks are a few million parameters each: smollm2-135m steps 32 units as 6). A step sharded
    by ZeRO over several ranks keeps the units apart (ZeRO-1/2 publish each by an all-gather as soon as it is
    stepped, and the plan prices those gathers unit by unit)."""
    budget = max(sizes, default=0)
    groups: list[list[int]] = []
    total = 0
    for j, size in enumerate(sizes):
        if groups and total + size <= budget:
            groups[-1].append(j)
            total += size
        else:
            groups.append([j])
            total = size
    return groups


_FP8_WEIGHT = re.compile(r"layers\.\d+\.(attn|mlp)\.(\w+\.)?\w+_proj\.weight")


def is_fp8_weight(name: str) -> bool:
    """A weight train.precision=fp8 multiplies in float8 (fivefold.train.fp8): a block linear's, the shared
    expert's included; not the router's, nor the routed experts' stacked weights."""
    return _FP8_WEIGHT.fullmatch(name) is not None


def fp8_weights(shapes) -> list[int]:
    """The numels of the float8 weights among (name, numel) `shapes`."""
    return [numel for name, numel in shapes if is_fp8_weight(name)]


def fp8_gathered(cfg: Config) -> bool:
    """Whether ZeRO-3 gathers the float8 weights cast once a step, as float8 (fivefold.parallel.zero)."""
    return cfg.fp8_cast_once() and cfg.parallel.zero == 3 and cfg.parallel.grad_size > 1


def is_no_decay(name: str) -> bool:
    """The weight-decay rule, on names (the optimizer and the planner both use this one): norm gains,
    biases and embeddings are not decayed. The optimizer keeps the two groups apart, so its per-group
    temporaries are sized by the larger group."""
    return name.endswith(".bias") or "embed" in name or "norm" in name


def adapter_shapes(cfg: ModelConfig, lora, tp: int = 1, layers=None) -> list[tuple[str, int]]:
    """(name, numel on one tensor-parallel rank) of the LoRA adapters (fivefold.finetune.lora) of `layers`:
    r x in (A) and out x r (B) per targeted linear; A whole and B split for column-parallel linears (q, k, v,
    gate, up), A split and B whole for row-parallel ones (o, down)."""
    if not lora.r:
        return []
    h, f, r = cfg.hidden_size, cfg.ffn_hidden_size, lora.r
    dims = {"q": ("attn.q_proj", h, cfg.q_size, 0), "k": ("attn.k_proj", h, cfg.kv_size, 0),
            "v": ("attn.v_proj", h, cfg.kv_size, 0), "o": ("attn.o_proj", cfg.q_size, h, 1),
            "gate": ("mlp.gate_proj", h, f, 0), "up": ("mlp.up_proj", h, f, 0), "down": ("mlp.down_proj", f, h, 1)}
    order = [t for t in dims if t in lora.target_list]
    shapes = []
    for i in range(cfg.num_layers) if layers is None else layers:
        for target in order:
            module, d_in, d_out, row = dims[target]
            shapes.append((f"layers.{i}.{module}.lora_A.weight", r * d_in // (tp if row else 1)))
            shapes.append((f"layers.{i}.{module}.lora_B.weight", d_out * r // (1 if row else tp)))
    return shapes


# --------------------------------------------------------------------------------------------
# Bytes per parameter of the model states (Rajbhandari et al. 2020, "ZeRO", section 3.1).


@dataclass(frozen=True)
class BytesPerParam:
    """Model-state bytes per parameter. ZeRO's K=12 convention counts the fp32 master weights with the
    Adam moments as optimizer states."""
    parameters: int  # the weights forward and backward use
    gradients: int  # .grad in the parameter dtype
    main_gradients: int  # fp32 accumulation buffers (bf16-mixed with fp32 gradient accumulation)
    optimizer_states: int  # fp32 master copy (mixed precision only) + Adam exp_avg + exp_avg_sq

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.main_gradients + self.optimizer_states


def bytes_per_param(precision: str, fp32_grad_accum: bool = False) -> BytesPerParam:
    """fp32: 4 + 4 + 8 = 16. bf16-mixed: 2 + 2 + (4 + 4 + 4) = 16. With fp32 gradient accumulation the
    fp32 buffer adds 4: 20, the accounting that keeps every bf16 .grad as well (Megatron-LM's
    distributed-optimizer table counts 20 for fp16 params + fp16 grads). fivefold's trainer folds each
    bf16 .grad into the buffer and frees it at once, so its plan charges the buffer plus one live bf16
    gradient, not a bf16 copy of every gradient (planner.model_states)."""
    if precision == "fp32":
        if fp32_grad_accum:
            raise ValueError("fp32_grad_accum applies to bf16-mixed and fp8 only")
        return BytesPerParam(parameters=4, gradients=4, main_gradients=0, optimizer_states=8)
    if precision in ("bf16-mixed", "fp8"):  # fp8 keeps bf16 weights: its float8 copies are transient
        return BytesPerParam(parameters=2, gradients=2, main_gradients=4 if fp32_grad_accum else 0,
                             optimizer_states=12)
    raise ValueError(f"unknown precision {precision!r}; choose fp32, bf16-mixed or fp8")


def model_state_bytes(num_params: int, precision: str, fp32_grad_accum: bool = False) -> int:
    """Parameters + gradients + optimizer states of an unsharded model: 16 bytes/param, so 7B -> 112 GB."""
    return num_params * bytes_per_param(precision, fp32_grad_accum).total


CHECKPOINT_BYTES_PER_PARAM = 12  # fp32 weights (the masters under bf16-mixed) + Adam exp_avg + exp_avg_sq


def checkpoint_bytes(cfg: ModelConfig) -> int:
    """Size of a training checkpoint on disk, whatever the layout: each tensor is written once."""
    return count_params(cfg) * CHECKPOINT_BYTES_PER_PARAM


# --------------------------------------------------------------------------------------------
# Pipeline parallelism: layers per stage and micro-batches whose activations a stage holds at once.


def partition(num_layers: int, stages: int, override: str = "") -> list[range]:
    """Layers of each (virtual) pipeline stage: `override` "3,5" gives them explicitly; otherwise
    balanced, the first stages taking one more when the count does not divide (the last stage also runs
    the head). The pipeline runtime and the planner both split by this."""
    if override:
        counts = [int(c) for c in override.split(",")]
    else:
        base, extra = divmod(num_layers, stages)
        counts = [base + (i < extra) for i in range(stages)]
    starts = [sum(counts[:i]) for i in range(stages)]
    return [range(start, start + n) for start, n in zip(starts, counts)]


def rank_layers(num_layers: int, pp: int, rank: int, virtual_stages: int = 1, override: str = "") -> list[int]:
    """The layers pipeline rank `rank` holds: its stage `chunk * pp + rank` of every model chunk."""
    stages = partition(num_layers, pp * virtual_stages, override)
    return [i for chunk in range(virtual_stages) for i in stages[chunk * pp + rank]]


def micro_batches_in_flight(schedule: str, pp: int, stage: int, micro_batches: int,
                            virtual_stages: int = 1) -> float:
    """Micro-batches whose activations `stage` (0-based) holds at its peak, in units of the stage's
    whole layer stack.

    afab (GPipe, Huang et al. 2019): all forwards before any backward, so every micro-batch.
    1f1b (PipeDream-Flush, Narayanan et al. 2021): stage i runs pp - i warm-up forwards, then
    alternates, so it holds min(pp - i, m).
    interleaved (Narayanan et al. 2021): stage 0 warms up 2(pp-1) + (v-1)pp model chunks of L/(pp v)
    layers each (Megatron-LM's schedule), i.e. pp (1 + (pp-1)/(pp v)) micro-batches of the stage's
    layers: the factor of Korthikanti et al. 2022, section 4.2.3.
    zero-bubble (ZB-H1, Qi et al. 2023): same peak activation memory as 1F1B by construction."""
    m = micro_batches
    if pp == 1:
        return 1.0
    if schedule == "afab":
        return float(m)
    if schedule in ("1f1b", "zero-bubble"):
        return float(min(pp - stage, m))
    if schedule == "interleaved":
        v = virtual_stages
        chunks = min(2 * (pp - stage - 1) + (v - 1) * pp + 1, m * v)
        return chunks / v
    raise ValueError(f"unknown pipeline schedule {schedule!r}")
