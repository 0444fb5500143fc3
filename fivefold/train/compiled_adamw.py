"""AdamW over fp32 masters as one pass over memory a tensor (train.optimizer_impl=compiled).

The fused path's step over a unit of bf16-mixed parameters makes four passes: one foreach copy of the bf16
gradients into an fp32 buffer (read 2 bytes, write 4), the clipping multiply over that buffer (read 4, write 4),
torch's fused AdamW (read master, gradient and both moments, 16; write master and moments, 12), and one foreach
copy of the masters into the bf16 parameters (read 4, write 2): 48 bytes a parameter, 50 with the clipping
norm's read of the gradients. Written as one function of each tensor's gradient and state, torch.compile fuses
it into one kernel a tensor that reads the bf16 gradient, the master and both moments and writes the master,
both moments and the bf16 parameter: 28 bytes, 30 with the norm (fivefold.planner.speed prices both). No fp32
copy of the gradients is made, so the unit's step adds no temporaries.

The arithmetic is torch's AdamW's (decoupled weight decay, bias corrections from each tensor's step count),
written out, so it equals `torch.optim.adam.adam` within fp32 rounding (a compiled kernel may contract a
multiply and an add into one FMA), not bit for bit (tested). A step whose gradient norm or loss is not finite
changes nothing (masters, moments, step counts, parameters), decided on the device as the fused AdamW's
found_inf is, so the host never waits. Compiling: a unit's first call compiles its graph with its sizes and
learning rate fixed; when either changes dynamo compiles it once more with both as inputs, and that graph
serves every later step and every unit of the same structure (the joined blocks share one), so a run compiles
a few graphs in its first two steps and none after (measured on a CPU: 5 graphs for 3 structures).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

# Graphs a run may compile: one or two per distinct unit structure (embeddings, joined blocks, the head, a
# pipeline stage's remainder...), more than dynamo's default of 8 per function in a deep pipeline's layouts.
MAX_GRAPHS = 64


def _update(params: list[torch.Tensor], masters: list[torch.Tensor], grads: list[torch.Tensor],
            exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor],
            decays: list[float], coef: torch.Tensor, skip: torch.Tensor, lr: float, beta1: float, beta2: float,
            eps: float, write_params: bool) -> None:
    for p, w, g, m, v, step, decay in zip(params, masters, grads, exp_avgs, exp_avg_sqs, steps, decays):
        g = g.float() * coef
        t = step + 1
        m_new = m.lerp(g, 1 - beta1)
        v_new = v * beta2 + (1 - beta2) * g * g
        denom = v_new.sqrt() / (1 - beta2 ** t).sqrt() + eps
        w_new = w * (1 - lr * decay) - (lr / (1 - beta1 ** t)) * m_new / denom
        w.copy_(torch.where(skip, w, w_new))
        m.copy_(torch.where(skip, m, m_new))
        v.copy_(torch.where(skip, v, v_new))
        step.copy_(torch.where(skip, step, t))
        if write_params:
            p.copy_(w)


_compiled = None


def compiled_adamw(params: list[torch.Tensor], masters: list[torch.Tensor], grads: list[torch.Tensor],
                   exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor],
                   decays: list[float], coef: torch.Tensor, skip: torch.Tensor, lr: float, beta1: float,
                   beta2: float, eps: float) -> None:
    """One unit's AdamW step, in place: `masters` (fp32) by `grads` (any float dtype) times `coef` (the clipping
    factor, a device scalar), the moments and the step counts (device scalars) with them, and `params` made to
    follow where they are not the masters themselves (bf16 parameters); nothing changes where `skip` (a device
    bool scalar). `decays`: each tensor's weight decay."""
    global _compiled
    write_params = any(p is not w for p, w in zip(params, masters))
    if _get_current_dispatch_mode() is not None:
        # Under a dispatch mode (fivefold.memory.tracker's), which compiled code cannot run: the same arithmetic
        # eagerly, one tensor at a time (its temporaries, a few fp32 copies of one tensor, are the eager
        # path's; the compiled kernel makes none, tested on its generated code).
        for i in range(len(params)):
            _update(params[i:i + 1], masters[i:i + 1], grads[i:i + 1], exp_avgs[i:i + 1], exp_avg_sqs[i:i + 1],
                    steps[i:i + 1], decays[i:i + 1], coef, skip, lr, beta1, beta2, eps, write_params)
        return
    if _compiled is None:
        _compiled = torch.compile(_update, fullgraph=True)
    with torch._dynamo.config.patch(recompile_limit=MAX_GRAPHS, accumulated_recompile_limit=4 * MAX_GRAPHS):
        _compiled(params, masters, grads, exp_avgs, exp_avg_sqs, steps, decays, coef, skip, lr, beta1, beta2, eps,
                  write_params)
