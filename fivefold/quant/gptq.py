"""GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers"), and quantizing a whole fivefold model.

GPTQ quantizes a linear's weight W (out, in) one input column at a time and moves each column's rounding
error onto the columns not yet quantized, weighted by the inverse Hessian of the layer's squared output
error, H = 2 X X^T (X: the layer's calibration inputs, in x tokens). With U the upper Cholesky factor of
H^-1 (Algorithm 1 of the paper), quantizing column j updates W[:, k] -= (w_j - q_j) / U_jj * U_jk for
k >= j: the Optimal Brain Quantization update with every row sharing one order. Columns are taken in
`block_size` blocks: inside a block the updates are applied column by column, the rest of the matrix
gets the block's accumulated update in one matmul afterwards ("lazy batch updates", section 3 step 2),
which changes nothing mathematically (tested against a column-by-column reference).

Choices, against the paper's reference code:
- columns in their natural order (no act-order, the reference code's later option of descending H_ii): with
  groups, act-order would need a permutation kept at inference, or group grids fixed beforehand.
- a group's grid (fivefold.quant.formats.int4_grid) is chosen when its first column is reached, from the
  weights with every earlier column's error already fed back, as the reference does. The reference reads
  the in-block part of that group from before the block started when groups do not line up with blocks;
  here the group always sees every update so far (identical for group_size == block_size, the default).
- the Hessian inverse and its Cholesky factor are computed in float64 (a few in^3 flops, and no failed
  factorization on near-singular H); the column loop runs in the weight's precision (fp32, fp64 in tests).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from fivefold.model import ForwardContext, Transformer, doc_ids_from_tokens
from fivefold.quant.formats import (METHODS, QuantizedWeight, from_codes, int4_codes, int4_grid, quantize_int4,
                                    quantize_int8, resolve_group_size, stored_layout)

# The linears of each block that are quantized (fivefold.finetune.lora's names: GELU MLPs have up / down),
# grouped by the input they read in Attention.forward / MLP.forward.
SHARED_INPUT = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))
LINEARS = tuple(name for group in SHARED_INPUT for name in group)


class HessianAccumulator:
    """The running mean of x x^T over calibration tokens x (in,), kept in float64 and updated as
    H <- H * n / (n + m) + X^T X / (n + m): nothing grows with the token count, and each batch's few
    thousand products, summed by one fp32 matmul (fp64 for fp64 inputs), join the mean at full precision."""

    def __init__(self, in_features: int, device=None):
        self.mean = torch.zeros(in_features, in_features, dtype=torch.float64, device=device)
        self.tokens = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).to(self.mean.device)  # (m, in)
        x = x.double() if x.dtype == torch.float64 else x.float()
        m = x.shape[0]
        if not m:
            return
        total = self.tokens + m
        self.mean.mul_(self.tokens / total).add_(x.T @ x, alpha=1.0 / total)
        self.tokens = total

    def hessian(self) -> torch.Tensor:
        """H = 2 X X^T / tokens (in, in), float64 (the scale does not change GPTQ's result)."""
        return 2 * self.mean


class _SharedInput:
    """One Hessian for the linears that read the very same tensor (q, k, v; gate, up): the first one's
    hook accumulates it, the others' check that they were handed that tensor too."""

    def __init__(self, accumulator: HessianAccumulator, names: list[str]):
        self.accumulator, self.names, self.last = accumulator, names, None

    def lead(self, module, args) -> None:
        self.accumulator.add(args[0])
        self.last = args[0]

    def follow(self, module, args) -> None:
        if args[0] is not self.last:
            raise RuntimeError(f"{', '.join(self.names)} were expected to read the same input; they do not")


def inverse_hessian_factor(hessian: torch.Tensor, damp: float = 0.01) -> tuple[torch.Tensor, torch.Tensor]:
    """(U, dead): U the upper Cholesky factor of (H + lambda I)^-1 with lambda = damp * mean(diag H), in
    float64; dead the columns no calibration token used (H_jj = 0), given H_jj = 1 so H stays invertible
    (their weights are zeroed by the caller: nothing ever multiplies them)."""
    h = hessian.detach().to(torch.float64).clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1
    diag = torch.diagonal(h)
    diag += damp * diag.mean()
    chol, info = torch.linalg.cholesky_ex(h)
    if info:
        raise ValueError(f"the damped Hessian is not positive definite (damp={damp}); use a larger damp or more "
                         f"calibration data")
    return torch.linalg.cholesky(torch.cholesky_inverse(chol), upper=True), dead


@torch.no_grad()
def gptq_quantize(w: torch.Tensor, hessian: torch.Tensor, group_size: int = 128, block_size: int = 128,
                  damp: float = 0.01, *, factor: tuple[torch.Tensor, torch.Tensor] | None = None) -> QuantizedWeight:
    """GPTQ int4 codes of `w` (out, in) in the group-wise format of fivefold.quant.formats, given the
    layer's Hessian (in, in) (HessianAccumulator.hessian()). group_size -1 / 0: one group per row.
    `factor`: inverse_hessian_factor(hessian, damp), when several weights share one Hessian."""
    out_f, in_f = w.shape
    g = resolve_group_size(in_f, group_size, "gptq")
    stored_layout(w.shape, "gptq", g)
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be at least 1")
    dtype = torch.float64 if w.dtype == torch.float64 else torch.float32
    u, dead = factor or inverse_hessian_factor(hessian.to(w.device), damp)
    u = u.to(dtype)
    W = w.detach().to(dtype).t().contiguous()  # (in, out): each column of w a contiguous row
    W[dead] = 0
    codes = torch.empty(in_f, out_f, dtype=torch.float32, device=w.device)
    scales = torch.empty(in_f // g, out_f, dtype=torch.float32, device=w.device)
    zeros = torch.empty_like(scales)
    for i1 in range(0, in_f, block_size):
        i2 = min(i1 + block_size, in_f)
        W1, U1 = W[i1:i2].clone(), u[i1:i2, i1:i2]
        err = torch.zeros_like(W1)  # (block, out): each column's error / U_jj, for the lazy update
        diag = U1.diagonal().tolist()
        for i in range(i2 - i1):
            col = i1 + i
            if col % g == 0:
                group = W1[i:i + g]
                if col + g > i2:  # the group runs past this block: its later columns with this block's updates
                    group = torch.cat([group, W[i2:col + g] - u[i1:col, i2:col + g].T @ err[:i]])
                scale, zero = int4_grid(group.T)
                scales[col // g], zeros[col // g] = scale, zero
            q = int4_codes(W1[i], scale, zero)
            codes[col] = q
            torch.sub(W1[i], ((q - zero) * scale).to(dtype), out=err[i]).div_(diag[i])
            W1[i:].addr_(U1[i, i:], err[i], alpha=-1)  # OBQ's update of the block's remaining columns
        W[i2:].addmm_(u[i1:i2, i2:].T, err, alpha=-1)  # the block's updates to every later column at once
    return from_codes("gptq", codes.T, scales.T, zeros.T, g)


def quantized_linears(model: Transformer) -> dict[str, nn.Linear]:
    """{name: module} of the linears quantize_model quantizes: q, k, v, o and the dense MLP's gate / up /
    down of every block. The embedding and the LM head stay in full precision (the head is tied to the
    embedding in many models, and both are where 4-bit errors hurt most while costing one matrix each);
    so do the norms and a mixture of experts' router and experts (not covered)."""
    out = {}
    for i, block in enumerate(model.layers):
        for part in ("attn", "mlp"):
            parent = getattr(block, part)
            for attr in LINEARS:
                module = getattr(parent, attr, None)
                if isinstance(module, nn.Linear):
                    out[f"layers.{i}.{part}.{attr}"] = module
    return out


def rtn(w: torch.Tensor, method: str, group_size: int) -> QuantizedWeight:
    return quantize_int8(w) if method == "int8" else quantize_int4(w, group_size)


def _hessian_hooks(linears: dict[str, nn.Linear], device) -> tuple[dict[str, HessianAccumulator], list]:
    """Forward pre-hooks that accumulate the Hessians of one block's `linears`, one per shared input."""
    hessians, hooks = {}, []
    for group in SHARED_INPUT:
        for part in ("attn", "mlp"):
            names = [n for n in linears if n.rpartition(".")[2] in group and f".{part}." in n]
            if not names:
                continue
            shared = _SharedInput(HessianAccumulator(linears[names[0]].in_features, device), names)
            for k, n in enumerate(names):
                hooks.append(linears[n].register_forward_pre_hook(shared.follow if k else shared.lead))
                hessians[n] = shared.accumulator
    return hessians, hooks


@torch.no_grad()
def quantize_model(model: Transformer, method: str, group_size: int = 128,
                   calibration: list[torch.Tensor] | None = None, block_size: int = 128, damp: float = 0.01,
                   log: Callable[[str], None] | None = None) -> dict[str, QuantizedWeight]:
    """{"<linear>.weight": QuantizedWeight} for every linear of quantized_linears(model) (a plain, unsharded
    Transformer). int8 / int4: round to nearest, no data. gptq: the paper's sequential scheme over
    `calibration` ((B, S) token tensors): each block runs on the previous block's outputs computed *with
    that block's weights quantized*, so a block's GPTQ corrects the errors of the blocks before it too.
    All linears of a block take their inputs from one pass with the block still in full precision (no
    "true-sequential" sub-steps). The model's weights are unchanged on return."""
    if method not in METHODS:
        raise ValueError(f"unknown quantization method {method!r}; choose one of {', '.join(METHODS)}")
    linears = quantized_linears(model)
    if method != "gptq":
        return {f"{name}.weight": rtn(m.weight, method, group_size) for name, m in linears.items()}
    if not calibration:
        raise ValueError("GPTQ needs calibration data: a list of (B, S) token tensors")
    device = next(model.parameters()).device
    states = []  # (hidden states, rope, mask) per calibration batch: the next block's inputs
    for ids in calibration:
        ids = ids.to(device)
        ctx = ForwardContext(doc_ids=doc_ids_from_tokens(ids, model.cfg.eos_token_id)
                             if model.cfg.document_mask else None)
        positions = model.positions(ids, ctx)
        x = model.embed(ids, positions)
        states.append((x, *model.context(ids, positions, ctx, x.dtype)))

    result, originals = {}, {}
    try:
        for i, block in enumerate(model.layers):
            mine = {n: m for n, m in linears.items() if n.startswith(f"layers.{i}.")}
            hessians, hooks = _hessian_hooks(mine, device)
            try:
                for x, rope, mask in states:
                    block(x, rope, mask)
            finally:
                for h in hooks:
                    h.remove()
            factors = {}  # one inverse per shared Hessian
            for n, m in mine.items():
                acc = hessians[n]
                if id(acc) not in factors:
                    factors[id(acc)] = inverse_hessian_factor(acc.hessian(), damp)
                qw = gptq_quantize(m.weight, acc.hessian(), group_size, block_size, damp, factor=factors[id(acc)])
                result[f"{n}.weight"] = qw
                originals[n] = m.weight.data
                m.weight.data = qw.dequantize(m.weight.dtype)  # the next blocks see this block quantized
            states = [(block(x, rope, mask), rope, mask) for x, rope, mask in states]
            if log:
                log(f"gptq: block {i + 1}/{len(model.layers)} quantized ({len(mine)} linears)")
    finally:
        for n, data in originals.items():
            linears[n].weight.data = data
    return result
