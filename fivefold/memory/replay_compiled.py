"""What torch.compile's partitioner keeps of a compiled block (train.compile) and of the compiled final
norm and loss (Config.compiled_loss), as replays: tests/test_memory_compiled.py checks both against the
partitioner."""

from __future__ import annotations

from fivefold.memory import replay_layers
from fivefold.memory.replay import Buf, Replay, Shapes


def compiled_block(r: Replay, x: Buf, d: Shapes, grad_in: bool = True, selective: bool = False) -> Buf:
    """A dense block as torch.compile runs it. Its min-cut partitioner keeps the tensors that a matmul or
    the attention kernel made and recomputes the pointwise rest (the norms' products, RoPE, SiLU, the
    residual sums) in backward, from: the block input and each norm's rsqrt; the normed inputs of q/k/v
    and of gate/up; roped q and k, and v; the attention output with its logsumexp (SDPA lays its output
    out as (b, s, heads, d), so o_proj's input, which the graph keeps too, is a view of the same memory);
    o_proj's output (the residual is recomputed from it); gate, up and their product. Per token and block,
    p bytes an element: 4ph + 2pq + 2p kv + 4 heads + 8 + 3pf, where eager bf16 saves 8h + 4ph + 2pq + 2p kv
    + 4 heads + 8 + 4pf (the norms' fp32 inputs, SiLU's output): 75.9 against 108.7 KB at Llama-3.2-1B's
    shape. Measured on an H100 the compiled bf16 rows came 0.92-1.00 of one pq a token and block below a
    replay that counted o_proj's input apart, which is what the alias explains.

    Under fp8 each linear casts its input to float8 inside torchao's autograd function, which saves the bf16
    input; the partitioner recomputes those inputs (the normed x, the attention output, the SwiGLU product)
    from what it keeps besides them, the block input, the rsqrts and the mid-block residual (plus each
    cast's 0-dim amax): 2ph + 2pq + 2p kv + 4 heads + 8 + 2pf, 61.5 against 96.4 KB (bf16, compiled) at
    Llama-3.2-3B's shape.

    Recomputation: under `selective` the block's backward graph runs the attention core again, so its
    output and logsumexp are not kept (o_proj's weight gradient waits for that recomputation, which a single
    backward graph may order first); under `full` only the block input is (the checkpoint's); under `ops`
    the replay is eager's policy less the block's last product (replay_layers.mlp, Replay.unkeep).

    Under LoRA the block is frozen: each adapter keeps its A output (and under dropout its dropped input,
    plus a bool mask where that input needs a gradient); a linear's input stays only where an adapter reads
    it; and what only serves a gradient into the block is dropped where none flows (the first block, after
    the frozen embedding, until a trained part). tests/test_memory_compiled.py checks the three lists
    against the partitioner (inductor's decompositions; fp8 as torchao's CPU emulation, which differs only
    in the product)."""
    bs, bsh, bsq, bsf = d.b * d.s, d.p * d.bsh, d.p * d.b * d.s * d.q, d.p * d.b * d.s * d.f
    lora = bool(d.adapters)

    def adapted(*targets: str) -> bool:
        return any(t in d.adapters for t in targets)

    def adapters(targets: tuple[str, ...], width: int, input_grad: bool) -> list[Buf]:
        """What LoRA keeps for the adapted ones among `targets`, linears reading an input `width` wide: each
        adapter's A output (r wide); with dropout also its dropped input and, when that input needs a
        gradient, the bool mask."""
        bufs = []
        for t in targets:
            if t in d.adapters:
                bufs.append(r.alloc(d.p * bs * d.rank))
                if d.adapter_dropout:
                    bufs += [r.alloc(d.p * bs * width)] + ([r.alloc(bs * width)] if input_grad else [])
        return bufs

    def input_kept(*targets: str) -> bool:
        """The linears' shared input is kept for a weight's gradient: every linear trains without LoRA; with
        it only an adapter's A needs the input, and under dropout each adapter keeps its own dropped copy."""
        return not lora or (not d.adapter_dropout and adapted(*targets))

    # Which activations need a gradient (all of them without LoRA; with it, the frozen embedding's output
    # does not, and a frozen part only when something trained lies before it).
    attention_grad = grad_in or not lora or adapted("q", "k", "v")
    x2_grad = attention_grad or adapted("o")
    r.mark("block")
    rsqrt, n = r.alloc(4 * bs), r.alloc(bsh)
    if grad_in:
        r.save(x, rsqrt)
    qkv_adapters = adapters(("q", "k", "v"), d.h, grad_in)
    q, k, v = r.alloc(bsq), r.alloc(d.p * bs * d.kv), r.alloc(d.p * bs * d.kv)
    out, lse = r.alloc(bsq), r.alloc(4 * d.b * d.heads * d.s)  # o_proj's input is a view of out
    o_adapter = adapters(("o",), d.q, attention_grad)
    o = r.alloc(bsh)
    r.save(*qkv_adapters, *o_adapter, *([n] if input_kept("q", "k", "v") and not d.fp8 else []))
    if attention_grad:  # selective: the attention core is run again in the block's backward graph
        r.save(q, k, v, *([] if selective else [out, lse]))
    elif input_kept("o"):  # o_proj's adapter multiplies the attention output
        r.save(out)
    if x2_grad and not d.fp8:  # the mid-block residual is recomputed from o_proj's output (fp8: kept itself)
        r.save(o)
    r.mark("attention")
    r.free(n, *qkv_adapters, *o_adapter)
    x2 = r.alloc(bsh)
    r.free(o, rsqrt)
    rsqrt2, n2 = r.alloc(4 * bs), r.alloc(bsh)
    gate_up_adapters = adapters(("gate", "up"), d.h, x2_grad)
    gate, up, prod = r.alloc(bsf), r.alloc(bsf), r.alloc(bsf)
    down_adapter = adapters(("down",), d.f, x2_grad or adapted("gate", "up"))
    r.save(*gate_up_adapters, *down_adapter, *([n2] if input_kept("gate", "up") and not d.fp8 else []),
           *([prod] if input_kept("down") and not d.fp8 else []))
    if x2_grad or adapted("gate", "up"):
        r.save(gate, up)
    if x2_grad:
        r.save(rsqrt2, *([x2] if d.fp8 else []))
    m = r.alloc(bsh)
    r.mark("mlp")
    r.free(n2, prod, rsqrt2, *gate_up_adapters, *down_adapter)
    x3 = r.alloc(bsh)
    r.free(m, x2, gate, up, x)  # the rest is saved (freeing a saved tensor is a no-op)
    return x3


def compiled_head(r: Replay, x: Buf, d: Shapes) -> None:
    """The final norm and the loss compiled (Config.compiled_loss), the LM head's product between them
    eager. torch.compile's partitioner keeps an RMSNorm's input and its rsqrt (4 bytes a row; a LayerNorm
    keeps what eager's does), and the cross-entropy's logits as they came, in the compute dtype, with two
    fp32 figures a row (the row's max and log-sum-exp) where eager keeps fp32 log-probabilities; no
    (tokens x vocabulary) temporary is made beside the logits. tests/test_memory_compiled.py checks both
    against the partitioner."""
    if d.rms:
        r.save(x)
        rsqrt = r.alloc(4 * d.bs)
        r.save(rsqrt)
        n = r.alloc(d.p * d.bsh)
    else:
        n = replay_layers.norm(r, x, d)
    logits = r.alloc(d.p * d.b * d.s * d.vocab)
    if not d.adapters:  # the LM head's input, for its weight's gradient
        r.save(n)
    r.free(n, x)
    stats = r.alloc(8 * d.b * d.s)
    r.save(logits, stats)
