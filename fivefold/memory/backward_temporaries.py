"""Temporaries of the backward pass that the forward replay does not see: the loss's backward, the largest
temporaries inside one block's backward, by part, and a float8 linear's backward."""

from __future__ import annotations

from fivefold.memory import replay_layers
from fivefold.memory.replay import Replay, Shapes


def labels_copy_bytes(d: Shapes) -> float:
    """The plain loss's flattened copy of strided labels (Shapes.labels_copy), saved by the cross-entropy until
    its own backward: the vocabulary-parallel, chunked and compiled losses keep labels of their own."""
    plain = not (d.vocab_parallel or d.loss_chunk or d.compiled_loss)
    return 8.0 * d.b * d.s if d.labels_copy and plain else 0.0


def loss_backward_bytes(d: Shapes, head_grad: float = 0.0) -> float:
    """Temporaries at the start of backward, beside the saved log-probabilities: the gradient of the
    log-probabilities (nll_loss backward) and of the fp32 logits (log_softmax backward), 4 bytes each;
    compiled (Config.compiled_loss), the logits' gradient in the compute dtype, beside the saved logits.
    The fused chunked loss instead makes the input gradient (p b s h, on the gathered sequence under
    SP, which is gathered again too), the head's weight gradient (`head_grad` bytes) and the kept tokens'
    output gradient, then chunk by chunk one chunk's fp32 softmax beside its index tensors, and its gradient
    in the compute dtype; under SP it ends in the input gradient's reduce-scatter. The vocabulary-parallel
    loss (fivefold.parallel.tensor_parallel) turns its saved softmax into the logits' gradient in place:
    only the cast back to the compute dtype is new."""
    if d.compiled_loss:  # one fused kernel turns the saved logits into their gradient; the head's product
        # then frees them and makes its input's and weight's gradients beside that gradient
        return max(d.p * d.b * d.s * d.vocab, d.p * d.bsh + head_grad)
    if not d.loss_chunk:
        if d.vocab_parallel:
            return d.p * d.b * d.s * d.vocab if d.p != 4 else 0.0
        return 2 * 4 * d.b * d.s * d.vocab
    whole = d.p * d.b * d.s * d.h
    cv, c = d.chunk * d.vocab, d.chunk
    # the kept tokens' output gradient (4 bytes a token); a chunk's target ids and row indices (int64), with
    # the target logits and mask read as fp32 beside the fp32 chunk, or its cast to the compute dtype
    chunk = 4 * cv + (24 * c if d.p == 4 else d.p * cv + 16 * c)
    if d.rep == 1:
        return whole + head_grad + 4 * d.b * d.s + chunk
    # under SP the input gradient is reduce-scattered at the end: a rank-major copy (b > 1) and this rank's part
    scatter = (whole if d.b > 1 else 0) + d.rep * whole
    return 2 * whole + head_grad + 4 * d.b * d.s + max(chunk, scatter)


def layer_backward_parts(d: Shapes) -> dict[str, float]:
    """The largest temporaries inside one block's backward, by part (an estimate, checked against
    measurement to within a few per cent on the tests' models); the residual-stream gradient is beside
    each. eager attention: the probability gradient and the softmax gradient, both fp32 (8 bytes per
    score); SDPA: the q/k/v and output gradients and RoPE's backward (about p bs (4q + 2kv));
    MLP: the product's gradient and both factors' (SwiGLU: 3 p bsf; GELU: 2 p bsf);
    RMSNorm: five fp32 intermediates of its composite backward (20 bsh) and the cast back;
    fp8: each float8 linear's casts and products (fp8_linear_backward), for attention, down_proj, up/gate."""
    bs = d.b * d.s
    if d.sdpa:
        attention = d.p * bs * (4 * d.q + 2 * d.kv)
    else:
        attention = 8 * d.b * d.heads * d.s * d.sk + d.p * bs * d.q
    parts = {"residual": d.p * d.bsh, "attention": attention, "mlp": (3 if d.swiglu else 2) * d.p * bs * d.f,
             "norm": 20 * d.bsh if d.rms else 2 * d.p * d.bsh, "fp8_attention": 0.0, "fp8_down": 0.0, "fp8_up": 0.0}
    if d.fp8:
        # Float8 linears (fp8_linear_backward), each beside the gradients alive when it runs: o_proj and
        # down_proj take the residual's; v, k, q the attention's (the q/k/v gradients, and the input
        # gradient summed so far); up and gate the product's factors', as large as the factors the
        # product's backward released (GELU: fc's, as large as the GELU input it released).
        qkv = d.p * bs * (d.q + 2 * d.kv) + d.p * d.bsh
        parts["fp8_attention"] = max(fp8_linear_backward(d, d.q, d.h),
                                     qkv + max(fp8_linear_backward(d, d.h, d.q), fp8_linear_backward(d, d.h, d.kv)))
        parts["fp8_down"] = fp8_linear_backward(d, d.f, d.h)
        parts["fp8_up"] = fp8_linear_backward(d, d.h, d.f)
    return parts


def fp8_linear_backward(d: Shapes, k: int, n: int) -> float:
    """Peak bytes of one float8 linear's backward (torchao's matmul_with_hp_or_float8_args), beside its
    output gradient: b s tokens, k inputs, n outputs. The output gradient and the weight are cast to float8,
    then the input gradient's product; the output gradient is cast again and the saved input cast, then
    the weight gradient's product. Every float8 copy lives until the backward returns, and each product
    first copies an operand whose layout the matmul cannot take (float8_ops.preprocess_addmm: W^T and
    the input are made column-major, the output gradient's transpose row-major)."""
    r = Replay()
    rows = d.b * d.s
    # the output gradient's and (unless cast once a step) the weight's float8 copies, kept
    for numel in (rows * n, *([k * n] if not d.fp8_precast else [])):
        replay_layers.to_fp8(r, numel, d)
    layout = r.alloc(k * n)
    replay_layers.fp8_product(r, rows * n, n * k, rows * k, d)  # the input gradient, kept
    r.free(layout)
    for numel in (rows * n, rows * k):  # the output gradient's again, the saved input's
        replay_layers.to_fp8(r, numel, d)
    layouts = [r.alloc(rows * n), r.alloc(rows * k)]
    replay_layers.fp8_product(r, n * rows, rows * k, n * k, d)  # the weight gradient
    r.free(*layouts)
    return r.peak


def layer_backward_bytes(d: Shapes) -> float:
    parts = layer_backward_parts(d)
    return parts["residual"] + max(parts["attention"], parts["mlp"], parts["norm"], parts["fp8_attention"],
                                   parts["fp8_down"], parts["fp8_up"])
