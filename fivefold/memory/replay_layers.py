"""The model's layers as a replay allocates their tensors (fivefold/model/layers.py, attention.py, rope.py):
each function takes the Replay, its inputs' buffers and the Shapes, and returns its output's buffer, having
allocated, saved and freed in the order the model's code does (see fivefold/memory/activations.py)."""

from __future__ import annotations

from fivefold.memory.replay import Buf, Replay, Shapes


def norm(r: Replay, x: Buf, d: Shapes, grad_in: bool = True) -> Buf:
    """`grad_in`: x needs a gradient (not so for a frozen embedding's output): else nothing is saved."""
    save = r.save if grad_in else (lambda *bufs: None)
    if not d.rms:  # F.layer_norm saves its input, mean and rstd
        n = r.alloc(d.p * d.bsh)
        stats = r.alloc(2 * d.stats_bytes * d.bs)
        save(x, stats)
        r.free(stats)
        return n
    x32 = x if d.p == 4 else r.alloc(4 * d.bsh)  # x.float(): a copy unless already fp32
    sq = r.alloc(4 * d.bsh)  # pow(2) saves x32
    save(x32)
    mean = r.alloc(4 * d.bs)
    r.free(sq)
    eps = r.alloc(4 * d.bs)
    r.free(mean)
    rsqrt = r.alloc(4 * d.bs)  # saved by rsqrt and by the mul
    save(rsqrt)
    r.free(eps)
    y32 = r.alloc(4 * d.bsh)  # x32 = x32 * rsqrt: the local now names the product
    if x32 is not x:
        r.free(x32)
    y = y32 if d.p == 4 else r.alloc(d.p * d.bsh)  # .to(x.dtype)
    n = r.alloc(d.p * d.bsh)  # weight * y saves y (for the gain's gradient: none when it is frozen)
    if not d.adapters:
        save(y)
    r.free(rsqrt, y, y32)
    return n


def rope(r: Replay, x: Buf, width: int, d: Shapes) -> Buf:
    numel = d.b * d.s * width
    neg = r.alloc(d.p * numel / 2)
    rotated = r.alloc(d.p * numel)  # cat([-x2, x1])
    r.free(neg)
    x_cos = r.alloc(d.p * numel)  # mul by cos/sin saves only cos/sin (they need no grad)
    rot_sin = r.alloc(d.p * numel)
    out = r.alloc(d.p * numel)
    r.free(x_cos, rot_sin, rotated)
    return out


def core(r: Replay, q: Buf, k: Buf, v: Buf, d: Shapes) -> Buf:
    """AttentionCore.forward: SDPA (flash: q, k, v, out, logsumexp) or the explicit softmax."""
    bsq = d.b * d.s * d.q
    if d.sdpa:
        extra = []
        if d.doc_mask:  # SDPA turns the boolean mask into an additive one in the input dtype, per call
            extra = [r.alloc(d.p * d.b * d.s * d.sk)]
        out = r.alloc(d.p * bsq)
        lse = r.alloc(4 * d.b * d.heads * d.s)
        if not d.ring:  # ring attention is fivefold's own kernel, of ops the policy does not keep
            r.kept(out, lse)
        r.save(q, k, v, out, lse, *extra)
        r.free(lse, *extra)
        return out
    scores = d.b * d.heads * d.s * d.sk
    if d.groups > 1:  # repeat_interleave to all heads
        k = r.alloc(d.p * bsq)
        v = r.alloc(d.p * bsq)
    q_c = r.alloc(d.p * bsq)  # matmul makes q contiguous per head (a copy), saved by bmm
    k_c = k if d.groups > 1 else r.alloc(d.p * bsq)  # k^T of the un-repeated, transposed k: a copy
    r.save(q_c, k_c)
    raw = r.alloc(d.p * scores)
    r.free(q_c, k_c)
    scaled = r.alloc(d.p * scores)
    r.free(raw)
    if d.doc_mask:  # the model's (b, 1, s, sk) document mask: ~mask per layer, saved by masked_fill
        mask = None
        inverted = r.alloc(d.b * d.s * d.sk)
    else:  # the causal mask is built per layer (bool), and its negation saved by masked_fill
        ones = r.alloc(d.s * d.sk)
        mask = r.alloc(d.s * d.sk)
        r.free(ones)
        inverted = r.alloc(d.s * d.sk)
    r.save(inverted)
    masked = r.alloc(d.p * scores)
    r.free(inverted, scaled)
    as_float = r.alloc(4 * scores) if d.p != 4 else masked
    probs = r.alloc(4 * scores)  # softmax saves its output
    r.save(probs)
    if as_float is not masked:
        r.free(as_float)
    probs_low = probs
    if d.p != 4:  # .to(q.dtype), saved by the bmm with v
        probs_low = r.alloc(d.p * scores)
        r.free(probs)
    v_c = v if d.groups > 1 else r.alloc(d.p * bsq)  # the un-repeated v is transposed: a copy
    r.save(probs_low, v_c)
    if d.groups == 1:
        r.free(v_c)
    out = r.alloc(d.p * bsq)
    r.free(probs_low, masked)
    if mask is not None:
        r.free(mask)
    if d.groups > 1:
        r.free(k, v)
    return out


def to_fp8(r: Replay, numel: float, d: Shapes) -> Buf:
    """torchao's dynamic tensorwise cast (float8_scaling_utils): abs() for the amax, then x.float() * scale,
    clamped to the float8 range, then the float8 copy (1 byte per element; its 0-dim scale is not counted)."""
    r.free(r.alloc(d.p * numel))  # abs(x), reduced to its max at once
    as_float = r.alloc(4 * numel) if d.p != 4 else None
    scaled = r.alloc(4 * numel)
    if as_float is not None:
        r.free(as_float)
    clamped = r.alloc(4 * numel)
    r.free(scaled)
    out = r.alloc(numel)
    r.free(clamped)
    return out


def fp8_product(r: Replay, a: float, b: float, out: float, d: Shapes) -> Buf:
    """The product of two float8 operands of `a` and `b` elements, `out` elements in the compute dtype.
    Emulated: each operand dequantized to fp32 (float(), then / scale), the product in fp32, then cast."""
    if not d.fp8_emulated:
        return r.matmul(r.alloc(d.p * out))
    operands = []
    for numel in (a, b):
        as_float = r.alloc(4 * numel)
        operands.append(r.alloc(4 * numel))
        r.free(as_float)
    out32 = r.alloc(4 * out)
    r.free(*operands)
    result = r.matmul(r.alloc(d.p * out))  # one mm on float8 tensors, as the recompute policy sees it
    r.free(out32)
    return result


def linear(r: Replay, out_bytes: float, k: int, n: int, d: Shapes, target: str) -> Buf:
    """A block's linear (k inputs, n outputs) on this rank's b s tokens: its output, `out_bytes`. Under fp8
    (torchao's Float8Linear) the input and then the weight are cast to float8, multiplied, and the casts
    dropped when the product is made; a bias is added after, as its own op."""
    if not d.fp8:
        return r.matmul(r.alloc(out_bytes))
    rows = d.b * d.s
    x8 = to_fp8(r, rows * k, d)
    w8 = to_fp8(r, k * n, d) if not d.fp8_precast else None
    out = fp8_product(r, rows * k, k * n, rows * n, d)  # the cast weight (W^T) is column-major already
    r.free(x8, *([w8] if w8 is not None else []))
    if target in d.biased:
        biased = r.alloc(out.nbytes)
        r.free(out)
        out = biased
    return out


def row_parallel(r: Replay, k: int, d: Shapes, target: str) -> Buf:
    """A linear whose input is split under tensor parallelism (o_proj, down_proj), `k` inputs and h outputs,
    after its partial products are summed (fivefold.parallel.tensor_parallel): all-reduced in place,
    except in a train.recompute=ops region, which may keep the partial product, so it is copied first;
    under SP reduce-scattered along the sequence, through a rank-major copy of the whole product."""
    if d.rep == 1:
        y = linear(r, d.p * d.bsh, k, d.h, d, target)
        if not (d.tp_reduce and r.ops is not None):
            return y
        out = r.alloc(y.nbytes)
        r.free(y)
        return out
    y = linear(r, d.p * d.b * d.s * d.h, k, d.h, d, target)
    chunks = r.alloc(y.nbytes)
    out = r.alloc(d.p * d.bsh)
    r.free(chunks, y)
    return out


def weight_input(d: Shapes, *targets: str) -> bool:
    """Whether a linear input is saved: for the weights' gradients, or by an adapter on one of `targets`
    (with dropout, each adapter saves its own dropped copy instead)."""
    return not d.adapters or (not d.adapter_dropout and any(t in d.adapters for t in targets))


def adapt(r: Replay, x: Buf, y: Buf, d: Shapes, target: str, grad_in: bool = True) -> Buf:
    """y + (alpha / r) B A dropout(x) (fivefold.finetune.lora) when `target` is adapted: A's output is saved
    for B's gradient; B's output and its scaled copy are transient. Dropout keeps its mask (in x's dtype)
    only when x needs a gradient; A keeps the dropped x."""
    if target not in d.adapters:
        return y
    if d.adapter_dropout:
        mask = r.alloc(x.nbytes) if grad_in else None
        dropped = r.alloc(x.nbytes)
        r.save(dropped, *([mask] if mask else []))
    h = r.matmul(r.alloc(d.p * d.b * d.s * d.rank))
    r.save(h)
    b_out = r.matmul(r.alloc(y.nbytes))
    scaled = r.alloc(y.nbytes)
    r.free(b_out)
    out = r.alloc(y.nbytes)
    r.free(scaled, y, h)  # (saved tensors stay: free only drops what a recomputed region does not keep)
    if d.adapter_dropout:
        r.free(dropped, *([mask] if mask else []))
    return out


def gathered(r: Replay, n: Buf, d: Shapes) -> Buf:
    """The input the column-parallel linears save. Under SP it is gathered along the sequence and, in
    forward, released to this rank's part once the module has run (SequenceGatheredInput): the part is
    what stays. A recomputation in backward keeps the gathered tensor whole: it is used at once."""
    return r.alloc(d.p * d.b * d.s * d.h) if r.recomputing and d.rep != 1 else n


def fused_linear(r: Replay, x: Buf, k: int, n: int, d: Shapes, *targets: str) -> Buf:
    """The linears `targets` of one input as one product (fivefold.train.fused_projections.FusedLinear): the
    concatenated weight (k x n) made, multiplied and dropped; the input saved once the product is made
    (an autograd.Function saves after its forward), when a weight trains."""
    weight = r.alloc(d.p * k * n)
    out = r.matmul(r.alloc(d.p * d.b * d.s * n))
    r.free(weight)
    if weight_input(d, *targets):
        r.save(x)
    return out


def attention(r: Replay, n: Buf, d: Shapes, selective: bool, grad_in: bool = True) -> Buf:
    x = gathered(r, n, d)
    if d.fused_qkv:
        qkv = fused_linear(r, x, d.h, d.q + 2 * d.kv, d, "q", "k", "v")
        q = k = v = qkv  # column slices of the product
        if d.rope:  # RoPE copies q and k; v is copied so that attention does not keep the product alive
            q, k, v = rope(r, qkv, d.q, d), rope(r, qkv, d.kv, d), r.alloc(d.p * d.b * d.s * d.kv)
            r.free(qkv)
    else:
        q = adapt(r, n, linear(r, d.p * d.b * d.s * d.q, d.h, d.q, d, "q"), d, "q", grad_in)
        if weight_input(d, "q", "k", "v"):
            r.save(x)  # shared input of q/k/v projections
        k = adapt(r, n, linear(r, d.p * d.b * d.s * d.kv, d.h, d.kv, d, "k"), d, "k", grad_in)
        v = adapt(r, n, linear(r, d.p * d.b * d.s * d.kv, d.h, d.kv, d, "v"), d, "v", grad_in)
        if d.rope:
            q_lin, k_lin = q, k
            q, k = rope(r, q_lin, d.q, d), rope(r, k_lin, d.kv, d)
            r.free(q_lin, k_lin)
    out = r.checkpoint(core, [q, k, v], d) if selective else core(r, q, k, v, d)
    if d.sdpa and not d.ring:  # flash output is laid out (b, s, heads, d): the o_proj input is a view of it
        o_in = out
    else:  # eager or ring output (b, heads, s, d): transpose + reshape copies
        o_in = r.alloc(d.p * d.b * d.s * d.q)
    if weight_input(d, "o"):
        r.save(o_in)
    o = adapt(r, o_in, row_parallel(r, d.q, d, "o"), d, "o")
    r.free(o_in, out, q, k, v)
    if x is not n:
        r.free(x)
    return o


def mlp(r: Replay, n: Buf, d: Shapes) -> Buf:
    bsf = d.p * d.b * d.s * d.f
    x = gathered(r, n, d)
    down_input = weight_input(d, "down")
    if d.swiglu and d.fused_gate_up:
        gate = up = fused_linear(r, x, d.h, 2 * d.f, d, "gate", "up")  # halves of one product
        act = r.alloc(bsf)  # silu saves its input (the product's gate half: the product stays)
        prod = r.alloc(bsf)  # the mul saves both factors
        r.save(gate, act, *([prod] if down_input and not d.fp8 else []))
        r.free(act, gate)
    elif d.swiglu:
        if weight_input(d, "gate", "up"):
            r.save(x)
        gate = adapt(r, n, linear(r, bsf, d.h, d.f, d, "gate"), d, "gate")
        act = r.alloc(bsf)  # silu saves its input
        r.save(gate)
        r.free(gate)
        up = adapt(r, n, linear(r, bsf, d.h, d.f, d, "up"), d, "up")
        prod = r.alloc(bsf)  # the mul saves both factors
        r.save(act, up, *([prod] if down_input and not d.fp8 else []))
        r.free(act, up)
    else:
        if weight_input(d, "gate", "up"):
            r.save(x)
        up = adapt(r, n, linear(r, bsf, d.h, d.f, d, "up"), d, "up")
        prod = r.alloc(bsf)  # gelu saves its input
        r.save(up, *([prod] if down_input and not d.fp8 else []))
        r.free(up)
    out = adapt(r, prod, row_parallel(r, d.f, d, "down"), d, "down")
    if d.compiled and r.ops is not None:  # compiled, under the ops policy: the block's last product, which the
        r.unkeep(out)                     # policy keeps and nothing in backward reads
    if d.fp8:
        # A float8 linear is an autograd.Function: its saved input is packed once its forward has returned
        # (an aten op saves before it runs), which is where a recomputed block stops.
        r.save(prod)
    r.free(prod)
    if x is not n:
        r.free(x)
    return out
