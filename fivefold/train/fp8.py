"""FP8 training (train.precision=fp8): bf16-mixed plus float8 matmuls in the transformer blocks' linears.

Everything else is bf16-mixed: bf16 parameters, activations and gradients, fp32 master weights and Adam
moments in the optimizer (fivefold.train.optim), the loss in fp32. On top of it every nn.Linear inside
`model.layers` (q/k/v/o, the MLP's gate/up/down, a mixture of experts' shared expert) becomes torchao's
Float8Linear (`torchao.float8.convert_to_float8_training`), with torchao's default recipe: dynamic
tensorwise scaling. Each of the three matmuls of a linear (forward, input gradient, weight gradient)
casts its two operands to float8 with a scale from the operand's current absolute maximum (amax):
inputs and weights to e4m3, output gradients to e5m2 (Micikevicius et al. 2022, "FP8 Formats for Deep
Learning"), and multiplies them with higher-precision accumulation (`torch._scaled_mm` on the GPU).

As torchtitan does, the embedding, the LM head and the MoE router stay bf16: the head's logits and the
routing decisions are where low precision costs the most, and they are a small part of the FLOPs. A
mixture of experts' routed experts (fivefold.model.moe.GroupedExperts: stacked weights, one grouped
matmul) stay bf16 too: torchao's float8 grouped matmul for them is a prototype.

What it costs in memory (fivefold.memory.activations, `Shapes.fp8`): torchao (0.18) saves the bf16 input
and the weight for backward, exactly what F.linear saves, and casts them again there, so the saved
activations are bf16-mixed's. What fp8 adds is temporary: while a linear runs, its float8 copies of the
input and the weight (1 byte per element, plus a 4-byte scale), and the fp32 intermediates of the cast
(x.float() * scale, clamped). Parameter names and objects are unchanged, so checkpoints are bf16-mixed's
(fp32 masters) and load into a plain model.

Layouts: a scale comes from the tensor a rank multiplies, so a layout reproduces one process exactly when
it multiplies the same tensors: data parallelism and pipeline stages over the same micro-batches do
(tests/test_fp8.py), while a different micro-batch split, or context parallelism (each rank scaling its
part of the sequences), trains as well but rounds differently.

Where it runs: on CUDA, GPUs with fp8 tensor cores (compute capability >= 8.9: Ada, Hopper, Blackwell;
checked when the device is known, at trainer start). On a CPU torchao emulates the float8 matmuls
(`Float8LinearConfig(emulate=True)`: the same float8 rounding of both operands, the product in fp32),
which is slow and only for tests. Refused by fivefold.parallel.rules.check_layout, each with the reason in its message: tensor
parallelism, LoRA / QLoRA, the zero-bubble pipeline schedule, and linear widths that are not multiples
of 16 (rules.check_fp8).
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from fivefold.config import Config, ConfigError
from fivefold.model.swap import derived_class

FP8_MIN_CAPABILITY = (8, 9)  # Ada (sm_89) and Hopper (sm_90) have fp8 tensor cores; Ampere (8.0, 8.6) has none


def torchao_missing() -> str | None:
    """Why torchao.float8 cannot be imported here, or None when it can."""
    try:
        _import_float8()
    except ImportError as e:
        return f"torchao is not installed or not usable ({e}); pip install torchao"
    return None


def _import_float8():
    # On import torchao warns about each optional CUDA extension it cannot load (every CPU-only install),
    # and torch about an enum torchao registers with pytree: noise for fp8 training, which needs neither.
    logs = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)
    return float8


def fp8_supported(device: torch.device) -> str | None:
    """Why `device` cannot run float8 matmuls natively, or None (CPU: emulation is always possible)."""
    if device.type != "cuda":
        return None
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return (f"{name} has compute capability {capability[0]}.{capability[1]}, and float8 tensor cores need "
                f"{FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} or newer (Ada, Hopper, Blackwell)")
    return None


def is_fp8_linear(name: str, module: nn.Module) -> bool:
    """The linears train.precision=fp8 converts: every nn.Linear in a block but the MoE router (`name` is
    the module's path below model.layers); the routed experts are no nn.Linear."""
    return type(module) is nn.Linear and name.rsplit(".", 1)[-1] != "router"


def apply_fp8(model: nn.Module, cfg: Config, device: torch.device) -> list[str]:
    """Under train.precision=fp8, make the blocks' linears torchao Float8Linears (on the meta model, before
    materialisation: same Parameter objects and names, so placements, init, masters and checkpoints see no
    difference); emulated on a CPU. Returns the converted modules' names ([] for other precisions)."""
    if cfg.train.precision != "fp8":
        return []
    reason = fp8_supported(device)
    if reason:
        raise ConfigError(f"train.precision=fp8 on {device}: {reason}; use train.precision=bf16-mixed")
    float8 = _import_float8()
    config = float8.Float8LinearConfig(emulate=device.type != "cuda")  # the default recipe: tensorwise, dynamic
    converted = []
    for i, block in enumerate(model.layers):
        before = {name: (module.weight, module.bias) for name, module in block.named_modules()
                  if is_fp8_linear(name, module)}
        # The filter sees names only: torchao's recursive traversal is a reference cycle that keeps the
        # filter (and what it holds) until the cycle collector runs.
        chosen = frozenset(before)
        float8.convert_to_float8_training(block, config=config, module_filter_fn=lambda m, n: n in chosen)
        for name, (weight, bias) in before.items():
            module = block.get_submodule(name)
            # torchao 0.18 re-attaches the linear's own Parameters (Float8Linear.from_float); should a version
            # make new ones, put ours back: the placement record, gradient hooks and tied names refer to them.
            if module.weight is not weight:
                module.weight = weight
            if module.bias is not bias:
                module.bias = bias
            converted.append(f"layers.{i}.{name}")
    return converted


# -- weights cast once a step (train.fp8_weight_cast=step) ----------------------------------------------------
# torchao casts a float8 linear's weight at each use: in forward, again in backward, and for every
# micro-batch. The weight only changes at the optimizer step, so here it is cast once after each update
# (WeightCast) and every use multiplies by that copy. Under ZeRO-3 (fivefold.parallel.zero) each rank casts
# its own rows with the scale of the whole weight (every rank's amax, reduced) and the float8 rows are
# what is gathered: half the bytes of a bf16 gather. Either way the bits are those torchao makes from the
# whole bf16 weight (its tensorwise recipe: one amax, fp32 multiply, saturating cast).

WEIGHT_DTYPE = torch.float8_e4m3fn  # torchao's default recipe casts weights (and inputs) to e4m3


def weight_scale(amax: torch.Tensor) -> torch.Tensor:
    """torchao's tensorwise scale of a weight whose largest magnitude is `amax` (any shape, elementwise)."""
    from torchao.float8.float8_utils import amax_to_scale

    return amax_to_scale(amax, WEIGHT_DTYPE)


def amaxes(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Each tensor's largest magnitude, fp32, as one vector: one multi-tensor kernel (the inf-norm), where
    torchao's cast takes two per weight. Exact: a maximum rounds nothing. An empty tensor gives 0."""
    full = [i for i, t in enumerate(tensors) if t.numel()]  # the inf-norm has no value for an empty tensor
    if len(full) == len(tensors):
        return torch.stack(torch._foreach_norm(tensors, float("inf"), dtype=torch.float32))
    out = torch.zeros(len(tensors), dtype=torch.float32, device=tensors[0].device)
    if full:
        out[full] = torch.stack(torch._foreach_norm([tensors[i] for i in full], float("inf"), dtype=torch.float32))
    return out


def to_weight_float8(rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Rows of a bf16 weight cast as torchao casts the whole weight under `scale`."""
    from torchao.float8.float8_utils import to_fp8_saturated

    return to_fp8_saturated(rows.to(torch.float32) * scale, WEIGHT_DTYPE)


def _cast_into(rows: list[torch.Tensor], outs: list[torch.Tensor], scales: torch.Tensor) -> None:
    for r, out, scale in zip(rows, outs, scales):
        out.copy_(to_weight_float8(r, scale))


@functools.cache
def _compiled_cast():
    """torch.compile(_cast_into), made on first use: one fused kernel a weight."""
    _import_float8()  # torchao's imports before tracing, with its warnings quieted
    return torch.compile(_cast_into, dynamic=False)


@torch.no_grad()
def cast_weights(rows: list[torch.Tensor], outs: list[torch.Tensor], scales: torch.Tensor,
                 reduce_amax=None, compiled: bool = False) -> None:
    """Cast each of `rows` (a bf16 weight, or under ZeRO-3 this rank's rows of it) into `outs` (float8) with
    its weight's scale, written into `scales` (fp32, one each); `reduce_amax(amax)`, in place: the largest
    magnitudes over every rank's rows (ZeRO-3). `compiled` (where the blocks compile): each weight's cast
    is one fused kernel reading the bf16 rows and writing the float8 ones (3 bytes an element, with the
    amax pass 5), where eager takes 6 launches and 27 bytes; the same bits."""
    amax = amaxes(rows)
    if reduce_amax is not None:
        reduce_amax(amax)
    scales.copy_(weight_scale(amax))
    if not compiled:
        _cast_into(rows, outs, scales)
        return
    # Each new set of weight shapes compiles anew; past dynamo's usual limit of 8 (a process that builds
    # many models: tests, sweeps) it would run eagerly, with the fp32 temporaries the plan leaves out.
    with torch._dynamo.config.patch(recompile_limit=256):
        _compiled_cast()(rows, outs, scales)


class WeightCast:
    """train.fp8_weight_cast=step outside ZeRO-3 (whose engine casts its rows, fivefold.parallel.zero): each
    float8 linear's whole weight cast once after every update, into a float8 copy beside it that forward and
    backward multiply by, every micro-batch; torchao would cast it at each of those uses."""

    def __init__(self, modules: list[nn.Module], device: torch.device, compiled: bool = False):
        """`compiled`: the cast runs as compiled kernels (cast_weights), where the blocks compile."""
        self.modules, self.compiled = modules, compiled
        self.scales = torch.ones(len(modules), dtype=torch.float32, device=device)
        for module, scale in zip(modules, self.scales):
            multiply_by_cast(module, torch.empty(module.weight.shape, dtype=WEIGHT_DTYPE, device=device), scale)
        self.refresh()

    def refresh(self) -> None:
        cast_weights([m.weight for m in self.modules], [m.weight_float8 for m in self.modules], self.scales,
                     compiled=self.compiled)


def multiply_by_cast(module: nn.Module, data: torch.Tensor, scale: torch.Tensor) -> None:
    """Make Float8Linear `module` multiply by `data` (its whole weight cast to float8: by WeightCast, or
    under ZeRO-3 gathered around each use) under `scale` instead of casting its weight at each use; the
    weight parameter still takes the gradient."""
    module.__class__ = derived_class(type(module), "Precast", lambda: {"forward": _precast_forward()})
    module.weight_float8, module.weight_float8_scale = data, scale


def _precast_forward():
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
    from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

    class CastWeight(torch.autograd.Function):
        """The weight's float8 copy in forward; its gradient (torchao's, in the weight's dtype) to the
        parameter. torchao's own linear then takes it as already cast, in forward and in backward."""

        @staticmethod
        def forward(ctx, weight, data, scale, mm_config):
            return Float8TrainingTensor(data, scale, weight.dtype, mm_config, GemmInputRole.WEIGHT)

        @staticmethod
        def backward(ctx, grad):
            return grad, None, None, None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = CastWeight.apply(self.weight, self.weight_float8, self.weight_float8_scale, self.linear_mm_config)
        output = matmul_with_hp_or_float8_args.apply(input, weight.t(), self.linear_mm_config, self.config)
        if self.bias is not None:
            output = output + self.bias.to(output.dtype)
        return output

    return forward
