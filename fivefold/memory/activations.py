"""Activation memory of one micro-batch, derived from what autograd really saves in fivefold's model.

Instead of a closed formula, the forward pass is replayed as the list of tensors it allocates, in the
order the model's code allocates them (fivefold/model/*.py), each with its size in bytes and its
lifetime: a tensor autograd saves for backward lives until the backward pass reaches it; any other
tensor dies when its last Python reference does. Replaying that list gives the forward peak
(saved tensors plus the transient ones around them, e.g. the logits and their fp32 copy); the
backward pass frees saved tensors in reverse order, except that recomputation (torch.utils.checkpoint,
non-reentrant, early stop) re-runs a checkpointed region and holds its tensors again.

The tensors one block saves, per micro-batch of b sequences of s tokens (p = bytes of the parameter
dtype; q, kv = query and key/value widths, a = heads, f = FFN width):

  RMSNorm             input in fp32 (4bsh: the input itself under fp32, a copy under bf16), rsqrt (4bs),
                      normalised x before the gain (p bsh); LayerNorm: input (p bsh) and mean/rstd
  q/k/v input         the norm output (p bsh), shared by the three projections
  attention, SDPA     q (p bsq), k and v (p bs kv, not repeated for GQA), output (p bsq, shared with the
                      o_proj input), logsumexp (4bas). No s^2 term: flash kernels never store scores.
  attention, eager    q, k, v repeated to all heads (3 p bsq), the causal mask (s^2 bytes), softmax
                      output in fp32 (4bas^2) and, under bf16, its bf16 copy (2bas^2), o_proj input (p bsq)
  SwiGLU MLP          input (p bsh), gate, silu(gate), up, product (4 p bsf); GELU: input, fc out, gelu out
  fp8 linears         nothing more: torchao's Float8Linear saves the bf16 input and the weight, as F.linear
                      does, and casts them to float8 again in backward. Transient while a linear runs: the
                      float8 copies of its input and weight (1 byte per element), each made through two
                      fp32 intermediates (x.float() * scale, clamped); emulated on a CPU, the matmul also
                      dequantizes both operands to fp32 and multiplies in fp32 before the cast to bf16.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", eq. 1) count
34sbh + 5as^2b bytes for a 16-bit GPT layer (LayerNorm, GELU, f = 4h, eager attention, dropout). The
same inventory without dropout (-2sbh for the two dropout masks, -3as^2b for the attention-dropout
mask and output) is 32sbh + 2as^2b; fivefold's eager softmax runs in fp32 and keeps the bf16 copy
(+4as^2b) and saves the s^2 causal mask: tests check both against this replay.
"""

from __future__ import annotations

import functools
import math

from fivefold.memory import replay_layers
from fivefold.memory.backward_temporaries import labels_copy_bytes
from fivefold.memory.replay import Buf, Replay, Shapes
from fivefold.memory.replay_compiled import compiled_block, compiled_head
from fivefold.memory.replay_moe import moe


def _block(r: Replay, x: Buf, d: Shapes, selective: bool, grad_in: bool = True) -> Buf:
    if d.compiled and r.ops is None:  # (a compiled block under the ops policy: eager's replay, less its last product)
        return compiled_block(r, x, d, grad_in, selective)
    r.mark("block")
    n = replay_layers.norm(r, x, d, grad_in)
    o = replay_layers.attention(r, n, d, selective, grad_in)
    r.mark("attention")
    r.free(n)
    x2 = r.alloc(d.p * d.bsh)  # residual
    r.free(o)
    n2 = replay_layers.norm(r, x2, d)
    m = moe(r, n2, d) if d.experts else replay_layers.mlp(r, n2, d)
    r.mark("mlp")
    r.free(n2)
    x3 = r.alloc(d.p * d.bsh)
    r.free(m, x2, x)
    return x3


@functools.lru_cache(maxsize=4096)
def replay_forward(d: Shapes, layers: int, recompute: str = "none", embed: bool = True,
                   head: bool = True, chosen: tuple[bool, ...] | None = None) -> Replay:
    """Replay one micro-batch through `layers` blocks (plus the embedding and the LM head + loss when
    this rank holds them) and return the Replay: forward peak, saved bytes, recompute regions.

    Every block allocates the same tensors and adds the same saved bytes, so beyond a few blocks the
    figures grow linearly with the block count: a deep stack is replayed with 2, 3 and 4 blocks and
    extrapolated when those three agree on a constant step (the layout search plans thousands of
    126-layer stacks), else replayed in full. tests/test_memory_plan.py checks the two agree. Cached:
    the search asks again for every ZeRO stage and schedule; callers only read the result.

    `chosen`: which of the blocks `recompute` applies to (train.recompute_layers); None: all of them. A
    mixed stack is replayed in full."""
    if chosen is not None and len(set(chosen)) == 1:
        recompute, chosen = (recompute if chosen[0] else "none"), None
    if layers <= 4 or chosen is not None:
        return _replay(d, layers, recompute, embed, head, chosen)
    few = [_replay(d, n, recompute, embed, head) for n in (2, 3, 4)]
    steps = {key: [getattr(b, key) - getattr(a, key) for a, b in zip(few, few[1:])]
             for key in ("peak", "saved_bytes", "live", "backward_peak", "before_loss", "blocks_peak")}
    if any(not math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-6) for a, b in steps.values()):
        return _replay(d, layers, recompute, embed, head)
    last = few[-1]
    more = layers - 4
    out = Replay(live=last.live + more * steps["live"][1], peak=last.peak + more * steps["peak"][1],
                 saved_bytes=last.saved_bytes + more * steps["saved_bytes"][1],
                 before_loss=last.before_loss + more * steps["before_loss"][1],
                 blocks_peak=last.blocks_peak + more * steps["blocks_peak"][1])

    def grown(items: list, i: int, shift):  # item i of `layers`, from the 4-block replay's items 2 and 3
        if i < 3:
            return items[i]
        return shift(items[2], items[3], i - 2)

    def block(a: dict, b: dict, k: int) -> dict:
        return {key: a[key] + k * (b[key] - a[key]) for key in a}

    def region(a: tuple, b: tuple, k: int) -> tuple:
        return (a[0] + k * (b[0] - a[0]), a[1], a[2])

    out.blocks = [grown(last.blocks, i, block) for i in range(len(last.blocks) and layers)]
    out.regions = [grown(last.regions, i, region) for i in range(len(last.regions) and layers)]
    return out


def _replay(d: Shapes, layers: int, recompute: str, embed: bool, head: bool,
            chosen: tuple[bool, ...] | None = None) -> Replay:
    r = Replay()
    positions = r.alloc(8 * d.s)  # arange(s).expand(b, s): int64, one row
    if embed:
        x = r.alloc(d.p * d.bsh)  # embedding lookup (saves the token ids, allocated before forward)
        if d.vocab_parallel:  # VocabParallelEmbedding: the ids as rows of this rank's shard (int64, saved by
            r.save(r.alloc(9 * d.b * d.s))  # the lookup) and the mask of the other ranks' (saved by masked_fill)
        if not d.rope:
            pos = r.alloc(d.p * d.bsh)
            r.save(positions)
            summed = r.alloc(d.p * d.bsh)
            r.free(x, pos)
            x = summed
    else:
        x = r.alloc(d.p * d.bsh)  # received from the previous pipeline stage
    rope = []
    if d.rope:  # cos/sin (b, 1, s, head_size), computed in fp32 then cast; saved by every layer
        bsd = d.b * d.s * d.head_size
        pos32 = r.alloc(4 * d.b * d.s)
        half = r.alloc(2 * bsd)
        r.free(pos32)
        angles = r.alloc(4 * bsd)
        r.free(half)
        for _ in range(2):
            c32 = r.alloc(4 * bsd)
            c = c32 if d.p == 4 else r.alloc(d.p * bsd)
            if c is not c32:
                r.free(c32)
            rope.append(c)
        r.free(angles)
        r.save(*rope)
    if d.doc_mask:  # attention_mask(): causal & same-document, (b, 1, s, sk) bool
        ones = r.alloc(d.s * d.sk)
        causal = r.alloc(d.s * d.sk)
        r.free(ones)
        same_doc = r.alloc(d.b * d.s * d.sk)
        r.shared_mask = [r.alloc(d.b * d.s * d.sk)]
        r.free(causal, same_doc)
    for i in range(layers):
        grad_in = not (i == 0 and embed and d.adapters)  # a frozen embedding's output needs no gradient
        mode = recompute if chosen is None or chosen[i] else "none"
        if mode in ("full", "ops"):
            x = r.checkpoint(_block, [x], d, False, grad_in, keep_ops=mode == "ops")
        else:
            x = _block(r, x, d, mode == "selective", grad_in)
    r.blocks_peak = r.peak
    if head and d.loss_chunk:  # the loss runs after the model's forward has returned its last states
        n = replay_layers.norm(r, x, d)
        r.before_loss = r.saved_bytes
        r.free(x, positions, *rope, *r.shared_mask)
        _chunked_head(r, n, d)
    elif head and d.compiled_loss:
        compiled_head(r, x, d)
        r.free(positions, *rope, *r.shared_mask)
    elif head:
        n = replay_layers.norm(r, x, d)
        r.before_loss = r.saved_bytes
        logits = r.alloc(d.p * d.b * d.s * d.vocab)
        if not d.adapters:  # the LM head's input, for its weight's gradient
            r.save(n)
        r.free(n, x, positions, *rope, *r.shared_mask)
        as_float = logits if d.p == 4 else r.alloc(4 * d.b * d.s * d.vocab)
        if labels_copy_bytes(d):
            r.save(labels := r.alloc(labels_copy_bytes(d)))
            r.free(labels)
        log_probs = r.alloc(4 * d.b * d.s * d.vocab)  # log_softmax saves its output (vocab-parallel: the softmax)
        r.save(log_probs)
        if d.vocab_parallel:
            _vocab_parallel_loss(r, d)
        r.free(log_probs, as_float, logits)
    else:
        r.free(positions, *rope, *r.shared_mask)
    return r


def _vocab_parallel_loss(r: Replay, d: Shapes) -> None:
    """fivefold.parallel.tensor_parallel._VocabParallelCrossEntropy's per-token tensors beside its softmax
    buffer, N = b s tokens: the flattened labels it is called with (a copy when they are strided), the row
    max, the local ids (saved), the target's mask, the row indices, the target logit, the denominator, both
    stacked for one all-reduce (unpacked as views, so the two are freed), the kept mask (saved), the loss's
    fp32 steps and the saved mask of targets on this rank: 46 bytes a token at the peak with the copy."""
    n = d.b * d.s
    copy = [r.alloc(8 * n)] if d.labels_copy else []
    top, local, mine, rows = r.alloc(4 * n), r.alloc(8 * n), r.alloc(n), r.alloc(8 * n)
    target, denominator = r.alloc(4 * n), r.alloc(4 * n)
    both = r.alloc(8 * n)
    r.free(target, denominator)
    keep = r.alloc(n)
    log, diff = r.alloc(4 * n), r.alloc(4 * n)
    r.free(log)
    loss = r.alloc(4 * n)
    r.free(diff)
    hit = r.alloc(n)
    r.save(local, hit, keep)
    r.free(*copy, top, local, mine, rows, both, keep, hit, loss)  # the loss is summed by its caller


def _chunked_head(r: Replay, n: Buf, d: Shapes) -> None:
    """fivefold.train.chunked_loss forward: the normed input (this rank's part under SP), each token's
    log-sum-exp and the label masks it makes once (kept: 1 byte, local ids int64, mine: 1 byte) are saved,
    beside the flattened copy of strided labels; one chunk's logits live at a time, in the compute dtype and
    then in fp32, with the chunk's log-sum-exp and target logit (index rows and clamped ids, int64; a later
    chunk's beside the last chunk's target logit, which its name holds until it is replaced). A
    vocabulary-parallel log-sum-exp makes the row max (and its int64 argmax, dropped at once), one more
    fp32 chunk (the shifted exponentials) and the sum."""
    r.save(n)  # the logits are made again from it in backward, even when the head is frozen
    tokens, c = d.b * d.s, d.chunk
    whole = r.alloc(d.p * d.b * d.s * d.h) if d.rep != 1 else None  # all-gathered along the sequence
    copy = [r.alloc(8 * tokens)] if d.labels_copy else []
    keep, local = r.alloc(tokens), r.alloc(8 * tokens)
    above, below = r.alloc(tokens), r.alloc(tokens)
    both = r.alloc(tokens)
    r.free(above, below)
    mine = r.alloc(tokens)
    r.free(both)
    r.save(keep, local, mine)
    lse = r.alloc(4 * tokens)
    r.save(lse)
    previous = r.alloc(4 * c) if tokens > c else None  # a later chunk runs beside the last one's target logit
    logits = r.alloc(d.p * c * d.vocab)
    if d.p != 4:
        as_float = r.alloc(4 * c * d.vocab)
        r.free(logits)
        logits = as_float
    if d.vocab_parallel:
        top, argmax = r.alloc(4 * c), r.alloc(8 * c)
        r.free(argmax)
        shifted = r.alloc(4 * c * d.vocab)
        total = r.alloc(4 * c)
        r.free(shifted)
        out = r.alloc(4 * c)
        r.free(total, top)
    else:
        out = r.alloc(4 * c)
    r.free(out)  # copied into lse
    rows, ids, picked = r.alloc(8 * c), r.alloc(8 * c), r.alloc(4 * c)
    r.free(ids)
    target = r.alloc(4 * c)
    r.free(picked, rows, logits, *([previous] if previous else []))
    diff = r.alloc(4 * c)
    kept = r.alloc(4 * c)
    r.free(diff, kept, target, *copy, keep, local, mine, n)
    if whole is not None:
        r.free(whole)
