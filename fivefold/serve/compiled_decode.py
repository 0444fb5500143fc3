"""The CPU decode step's loop over the blocks as one inductor graph (serve.compile_decode).

At a decode's few rows the lean loop (fivefold.serve.lean_forward) is bound by the per-call cost of its
small ops: on the 2-vCPU test host a block's norms, RoPE, SwiGLU and residual adds cost more than their
bytes. Inductor fuses them into a few C++ loops, but a compiled call has a fixed cost of 27-45 us there
(twice that of three eager elementwise ops), so only one graph over all the blocks can pay. It measured
1.03-1.11x the eager loop's best batch-1 decode and 1.03-1.14x its median over four runs, about the host's
noise (bench/serve_cpu_compile.py).

The paged attention stays eager inside the graph as one op registered with torch.library, whose schema says
it writes the two pools: compiling it inline would functionalise the pool's index_copy_ (a copy of the whole
pool a step), and torch.library.custom_op's Python wrapper costs more than the op saves. The op reads the step's
grouping from the PagedBatch the forward is running, kept per thread for the call.

Only decode-only steps whose attention is one call a layer (every one when the C++ decode kernel reads the
pool, serve.cpu_kernel; else those whose rows form one attention group: every batch-1 decode, and small
batches in row order) run the graph; the others run the eager loop. The graph computes the same arithmetic in another
order (fused loops, sums split differently), so its logits are the eager loop's to float rounding, not bit
for bit, and a near tie between two tokens may break the other way: the tokens of a request are then those
of its step's path, which the batch decides. The default is therefore off.

Since the C++ block ops (fivefold.kernels.cpu_block_ops, serve.cpu_kernel), a decode step whose blocks all run
the rows kernel is one C++ call, and that call beats the graph: on smollm2-135m, batch-1 decode 60.2 tok/s
eager against 52.5 compiled (median of 4, 0.87x; 2026-11-29, AMD host). Such steps take the call; the graph
runs the decode steps the call cannot (serve.cpu_kernel=false, products on other libraries, quantized blocks).
"""

from __future__ import annotations

import functools
import threading

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.serve.cpu_linear import compiles
from fivefold.serve.fused import FusedAttention, FusedMLP
from fivefold.serve.lean_forward import LeanTransformer, blocks_loop

_running = threading.local()  # the PagedBatch and attention cores of the forward this thread runs

_LIB = torch.library.Library("fivefold", "FRAGMENT")
_LIB.define("cpu_attend_heads(Tensor q, Tensor k, Tensor v, Tensor(a!) k_pool, Tensor(b!) v_pool, int layer) "
            "-> Tensor")


def _attend_heads(q, k, v, k_pool, v_pool, layer):
    return _running.batch.attend_heads(layer, q, k, v, _running.cores[layer])


_LIB.impl("cpu_attend_heads", _attend_heads, "CPU")
torch.library.register_fake("fivefold::cpu_attend_heads", lambda q, k, v, kp, vp, layer: torch.empty_like(q),
                            lib=_LIB)


def _blocks_with_the_op(blocks, x, cos, signed_sin, half: int, k_pools, v_pools):
    def attend(attn, q, k, v):
        layer = attn.layer_idx
        return torch.ops.fivefold.cpu_attend_heads(q, k, v, k_pools[layer], v_pools[layer], layer)
    return blocks_loop(blocks, x, cos, signed_sin, half, attend)


@functools.cache
def _compiled_loop():
    """One compiled function for every model, made at the first compiled step (torch.compile imports dynamo, a
    second at start-up): dynamo keeps a graph per set of modules it was traced with (its guards check them), up
    to its recompile limit, past which it runs the loop eagerly."""
    return torch.compile(_blocks_with_the_op, dynamic=None)


class CompiledDecodeTransformer(LeanTransformer):
    """The lean loop, compiled on decode-only steps of one attention group."""
    compiled_steps = 0  # per instance once a step has run compiled; the tests read it

    def run_blocks(self, blocks, x, cos, signed_sin, half: int, cache) -> torch.Tensor:
        # Quantized blocks' products stay out of the graph, and so do steps of several attention groups and
        # blocks with a product on oneDNN, whose op inductor cannot lower.
        if (not cache.one_call or not all(type(b[1]) is FusedAttention and type(b[4]) is FusedMLP for b in blocks)
                or not all(compiles(getattr(m, "linear_fn", F.linear))
                           for b in blocks for m in (b[1], b[2], b[4], b[5]))):
            return super().run_blocks(blocks, x, cos, signed_sin, half, cache)
        # A step whose blocks are one C++ call (fivefold.kernels.cpu_block_ops.decode_blocks) takes it: with the
        # same products it measured 1.15x the graph (2026-11-29, AMD host).
        out = self.one_call(blocks, x, cos, signed_sin, cache)
        if out is not None:
            return out
        _running.batch = cache
        _running.cores = {b[1].layer_idx: b[1].core.forward for b in blocks}
        try:
            x = _compiled_loop()(blocks, x, cos, signed_sin, half, list(cache.pool.k), list(cache.pool.v))
        finally:
            _running.batch = _running.cores = None
        self.compiled_steps += 1
        return x


def use_compiled_decode(model: nn.Module, on: bool) -> bool:
    """Make a model the lean loop runs (fivefold.serve.lean_forward.use_lean_forward) compile its decode
    steps or not, in place; whether it now does."""
    if not isinstance(model, LeanTransformer):
        return False
    model.__class__ = CompiledDecodeTransformer if on else LeanTransformer
    return on
