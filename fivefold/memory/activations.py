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

from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Shapes:
    """Per-rank sizes of one micro-batch. Tensor parallelism divides heads, FFN width and vocabulary;
    sequence parallelism also divides the tensors that are otherwise replicated (norms, residual,
    linear inputs: the `rep` factor), as in Korthikanti et al. 2022, section 4.2.2. Context parallelism
    divides the query tokens (s); eager scores span all sk keys."""
    b: int
    s: int  # query tokens per rank
    sk: int  # key length (s * cp)
    h: int
    q: int  # query width per rank (num_heads * head_size / tp)
    kv: int  # key/value width per rank
    heads: int  # query heads per rank
    f: int  # FFN width per rank
    vocab: int  # vocabulary rows per rank
    head_size: int
    p: int  # bytes per element of the parameter dtype (4 fp32, 2 bf16)
    rep: float = 1.0  # 1/tp under sequence parallelism, else 1
    rms: bool = True
    swiglu: bool = True
    sdpa: bool = True  # scores never materialised (flash-style kernel)
    ring: bool = False  # context-parallel ring attention: no scores either, output laid out (b, heads, s, d)
    rope: bool = True
    groups: int = 1  # query heads per key/value head
    doc_mask: bool = False  # packed documents: a (b, 1, s, sk) boolean mask built once per forward
    stats_bytes: int = 2  # LayerNorm mean/rstd element size (the input dtype on CPU, fp32 on CUDA)
    # LoRA (fivefold.finetune.lora): the targeted linears; () = every weight trains. A frozen weight needs
    # no saved input (nor a norm gain its normalised x); each adapter saves its r-wide A output.
    adapters: tuple[str, ...] = ()
    rank: int = 0
    adapter_dropout: bool = False  # each adapter then saves its own dropped input and mask
    loss_chunk: int = 0  # tokens per chunk of the fused head + loss (fivefold.train.chunked_loss); 0: plain
    vocab_parallel: bool = False  # the vocabulary is split over tensor-parallel ranks
    # train.precision=fp8 (fivefold.train.fp8): the blocks' linears cast their operands to float8 as they run;
    # `fp8_emulated`: torchao's CPU emulation (the product in fp32) instead of the GPU's scaled matmul.
    fp8: bool = False
    fp8_emulated: bool = False
    # fp8 with weights cast once a step (train.fp8_weight_cast=step): no linear casts its weight, in forward
    # or backward
    fp8_precast: bool = False
    biased: tuple[str, ...] = ()  # linears with a bias (q, k, v, o, gate, up, down): fp8 adds it as its own op
    tp_reduce: bool = False  # row-parallel outputs all-reduced (tensor parallel without SP)
    # A mixture of experts (fivefold.model.moe) in place of the MLP: E experts, k per token, each expert's
    # and the shared expert's width on this rank; routed through all-to-all when ep > 1. `capacity`:
    # assignments one expert takes at most (0: dropless).
    experts: int = 0
    topk: int = 0
    expert_f: int = 0
    shared_f: int = 0
    ep: int = 1
    capacity: int = 0
    # train.compile: each block saves what torch.compile's min-cut partitioning keeps (_compiled_block);
    # set only for the blocks that replay models (fivefold.memory.plan.compiled_blocks_modelled).
    compiled: bool = False
    # Config.compiled_loss: the final norm and the cross-entropy compiled (_compiled_head).
    compiled_loss: bool = False
    # The plain loss flattens labels that are a strided view of the batch's windows (language-model data,
    # more than one row): labels.flatten() copies them, and the cross-entropy saves the copy for backward.
    labels_copy: bool = False
    # Config.fused_projections (fivefold.train.fused_projections): q/k/v, and gate/up, as one product each; the
    # concatenated weight is transient in forward and backward.
    fused_qkv: bool = False
    fused_gate_up: bool = False

    @property
    def chunk(self) -> int:
        """Tokens of the fused loss's largest chunk (all of this rank's b s tokens at most)."""
        return min(self.loss_chunk, self.b * self.s)

    @property
    def assignments(self) -> float:
        """(token, expert) pairs a MoE layer routes on this rank: k per token, at most `capacity` per expert."""
        routed = self.b * self.s * self.topk
        return min(routed, self.experts * self.capacity) if self.capacity else routed

    @property
    def bsh(self) -> float:
        return self.b * self.s * self.h * self.rep

    @property
    def bs(self) -> float:
        return self.b * self.s * self.rep


class _Buf:
    __slots__ = ("nbytes", "state", "taken", "released")

    def __init__(self, nbytes: float):
        self.nbytes, self.state = nbytes, "temp"  # temp -> saved (until backward) or freed
        # a recomputation's kept output: the events at which it takes it from the cache and releases it
        self.taken = self.released = -1


@dataclass
class Replay:
    """Live activation bytes as the forward pass allocates and frees tensors."""
    live: float = 0.0
    peak: float = 0.0
    saved_bytes: float = 0.0  # tensors autograd holds for backward (plus checkpoint inputs)
    events: list[float] = field(default_factory=list)  # live bytes after each event
    last_save: int = -1  # index in events of the last save (recomputation stops there)
    regions: list[tuple[float, float, dict]] = field(default_factory=list)  # (saved before, peak, marks)
    blocks: list[dict[str, float]] = field(default_factory=list)  # per block: saved bytes at its start,
    # after its attention and after its MLP
    in_region: bool = False  # inside a checkpointed region its ops' saves are not kept
    ops: int | None = None  # inside a train.recompute=ops region: the matmuls run so far
    recomputing: bool = False  # replaying a checkpointed block's recomputation (in backward)
    # In a recomputation: each kept output taken from the cache, and the event of each mark of `blocks`.
    taken: list[_Buf] = field(default_factory=list)
    marked_at: dict[str, int] = field(default_factory=dict)
    shared_mask: list = field(default_factory=list)  # the document mask, alive for the whole forward
    before_loss: float = 0.0  # saved bytes once the final norm has run, before the loss saves its own
    blocks_peak: float = 0.0  # the forward's peak up to the end of the blocks (before the head and loss)

    def _tick(self) -> None:
        self.peak = max(self.peak, self.live)
        self.events.append(self.live)

    def alloc(self, nbytes: float) -> _Buf:
        self.live += nbytes
        self._tick()
        return _Buf(nbytes)

    def save(self, *bufs: _Buf) -> None:
        """Autograd saves these for backward (a no-op inside a checkpointed region)."""
        if self.in_region:
            return
        for buf in bufs:
            if buf.state in ("temp", "cached"):
                if buf.state == "temp":
                    self.saved_bytes += buf.nbytes
                buf.state = "saved"
                self.last_save = len(self.events)
                self.events.append(self.live)

    def free(self, *bufs: _Buf) -> None:
        """The last Python reference dies; saved tensors live on until backward."""
        for buf in bufs:
            if buf.state in ("temp", "cached"):
                if buf.state == "cached":  # counted before the recomputation: released now
                    self.saved_bytes -= buf.nbytes
                    buf.released = len(self.events)
                buf.state = "freed"
                self.live -= buf.nbytes
                self._tick()

    def checkpoint(self, fn, inputs: list[_Buf], *args, keep_ops: bool = False):
        """Run fn(self, *inputs, *args) as a non-reentrant checkpoint: its inputs are held, its saves
        dropped; its recomputation in backward is replayed alone, stopping after its last save.
        `keep_ops`: train.recompute=ops's policy keeps some op outputs of the region (`kept`)."""
        self.save(*inputs)
        alone = Replay(ops=0 if keep_ops else None, recomputing=True)
        fn(alone, *[_Buf(0.0) for _ in inputs], *args)  # inputs are already counted outside
        outer, self.in_region = (self.in_region, self.ops), True
        self.ops = 0 if keep_ops else None
        out = fn(self, *inputs, *args)
        self.in_region, self.ops = outer

        # A mark's bytes are what the region holds when backward reaches that point of the block (its
        # attention's backward runs after its MLP's). The recomputation stops at its last save, before the
        # op that would take a later kept output from the cache (a block's last product): the cache holds
        # that output until the block's backward ends, so its release in the replay did not happen. A kept
        # output taken after the mark (the MLP's, for the attention) is released by then: its backward ran.
        def held(upto: int) -> float:
            return sum(b.nbytes for b in alone.taken if b.taken > alone.last_save and 0 <= b.released <= upto)

        def gone(after: int) -> float:
            return sum(b.nbytes for b in alone.taken if after < b.taken <= alone.last_save)

        marks = {name: saved + held(alone.marked_at[name]) - gone(alone.marked_at[name])
                 for name, saved in (alone.blocks or [{}])[0].items()}
        # Held when the recomputation starts: everything saved so far, what this region kept included.
        self.regions.append((self.saved_bytes, max(alone.events[: alone.last_save + 1], default=0.0),
                             dict(marks, saved=alone.saved_bytes + held(len(alone.events)))))
        return out

    def kept(self, *bufs: _Buf) -> None:
        """train.recompute=ops's policy keeps these op outputs of its region until its recomputation, which
        takes each back from the cache instead of running its op: held from the recomputation's start
        (counted before it), released once its last use has run unless autograd saves it again."""
        if self.ops is None:
            return
        for buf in bufs:
            if buf.state != "temp":
                continue
            if self.recomputing:  # held since the recomputation's start
                self.live -= buf.nbytes
                buf.state, buf.taken = "cached", len(self.events)
                self.taken.append(buf)
            else:
                buf.state = "saved"
                self.saved_bytes += buf.nbytes

    def unkeep(self, buf: _Buf) -> None:
        """Undo `kept` for an output no backward reads: torch.compile's partitioner drops it from what the
        graph saves, where eager's policy cache holds it (a compiled block's last product)."""
        if buf.state == "saved":
            self.saved_bytes -= buf.nbytes
            buf.state = "temp"
        elif buf.state == "cached":
            self.live += buf.nbytes
            self._tick()
            buf.state = "temp"

    def matmul(self, buf: _Buf) -> _Buf:
        """A matmul's output: in a train.recompute=ops region every other one is kept."""
        if self.ops is not None:
            self.ops += 1
            if self.ops % 2:
                self.kept(buf)
        return buf

    @property
    def backward_peak(self) -> float:
        """Largest live activation during backward: saved-before-region plus the recomputed region."""
        return max((before + peak for before, peak, _ in self.regions), default=0.0)

    def mark(self, name: str) -> None:
        if name == "block":
            self.blocks.append({})
        self.blocks[-1][name] = self.saved_bytes
        self.marked_at[name] = len(self.events)


# ---------------------------------------------------------------------------------------------------
# The model's forward, tensor by tensor (fivefold/model/layers.py, attention.py, rope.py, transformer.py).


def _norm(r: Replay, x: _Buf, d: Shapes, grad_in: bool = True) -> _Buf:
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


def _rope(r: Replay, x: _Buf, width: int, d: Shapes) -> _Buf:
    numel = d.b * d.s * width
    neg = r.alloc(d.p * numel / 2)
    rotated = r.alloc(d.p * numel)  # cat([-x2, x1])
    r.free(neg)
    x_cos = r.alloc(d.p * numel)  # mul by cos/sin saves only cos/sin (they need no grad)
    rot_sin = r.alloc(d.p * numel)
    out = r.alloc(d.p * numel)
    r.free(x_cos, rot_sin, rotated)
    return out


def _core(r: Replay, q: _Buf, k: _Buf, v: _Buf, d: Shapes) -> _Buf:
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


def _to_fp8(r: Replay, numel: float, d: Shapes) -> _Buf:
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


def _fp8_product(r: Replay, a: float, b: float, out: float, d: Shapes) -> _Buf:
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


def _linear(r: Replay, out_bytes: float, k: int, n: int, d: Shapes, target: str) -> _Buf:
    """A block's linear (k inputs, n outputs) on this rank's b s tokens: its output, `out_bytes`. Under fp8
    (torchao's Float8Linear) the input and then the weight are cast to float8, multiplied, and the casts
    dropped when the product is made; a bias is added after, as its own op."""
    if not d.fp8:
        return r.matmul(r.alloc(out_bytes))
    rows = d.b * d.s
    x8 = _to_fp8(r, rows * k, d)
    w8 = _to_fp8(r, k * n, d) if not d.fp8_precast else None
    out = _fp8_product(r, rows * k, k * n, rows * n, d)  # the cast weight (W^T) is column-major already
    r.free(x8, *([w8] if w8 is not None else []))
    if target in d.biased:
        biased = r.alloc(out.nbytes)
        r.free(out)
        out = biased
    return out


def _row_parallel(r: Replay, k: int, d: Shapes, target: str) -> _Buf:
    """A linear whose input is split under tensor parallelism (o_proj, down_proj), `k` inputs and h outputs,
    after its partial products are summed (fivefold.parallel.tensor_parallel): all-reduced in place,
    except in a train.recompute=ops region, which may keep the partial product, so it is copied first;
    under SP reduce-scattered along the sequence, through a rank-major copy of the whole product."""
    if d.rep == 1:
        y = _linear(r, d.p * d.bsh, k, d.h, d, target)
        if not (d.tp_reduce and r.ops is not None):
            return y
        out = r.alloc(y.nbytes)
        r.free(y)
        return out
    y = _linear(r, d.p * d.b * d.s * d.h, k, d.h, d, target)
    chunks = r.alloc(y.nbytes)
    out = r.alloc(d.p * d.bsh)
    r.free(chunks, y)
    return out


def _weight_input(d: Shapes, *targets: str) -> bool:
    """Whether a linear input is saved: for the weights' gradients, or by an adapter on one of `targets`
    (with dropout, each adapter saves its own dropped copy instead)."""
    return not d.adapters or (not d.adapter_dropout and any(t in d.adapters for t in targets))


def _adapt(r: Replay, x: _Buf, y: _Buf, d: Shapes, target: str, grad_in: bool = True) -> _Buf:
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


def _gathered(r: Replay, n: _Buf, d: Shapes) -> _Buf:
    """The input the column-parallel linears save. Under SP it is gathered along the sequence and, in
    forward, released to this rank's part once the module has run (SequenceGatheredInput): the part is
    what stays. A recomputation in backward keeps the gathered tensor whole: it is used at once."""
    return r.alloc(d.p * d.b * d.s * d.h) if r.recomputing and d.rep != 1 else n


def _fused_linear(r: Replay, x: _Buf, k: int, n: int, d: Shapes, *targets: str) -> _Buf:
    """The linears `targets` of one input as one product (fivefold.train.fused_projections.FusedLinear): the
    concatenated weight (k x n) made, multiplied and dropped; the input saved once the product is made
    (an autograd.Function saves after its forward), when a weight trains."""
    weight = r.alloc(d.p * k * n)
    out = r.matmul(r.alloc(d.p * d.b * d.s * n))
    r.free(weight)
    if _weight_input(d, *targets):
        r.save(x)
    return out


def _attention(r: Replay, n: _Buf, d: Shapes, selective: bool, grad_in: bool = True) -> _Buf:
    x = _gathered(r, n, d)
    if d.fused_qkv:
        qkv = _fused_linear(r, x, d.h, d.q + 2 * d.kv, d, "q", "k", "v")
        q = k = v = qkv  # column slices of the product
        if d.rope:  # RoPE copies q and k; v is copied so that attention does not keep the product alive
            q, k, v = _rope(r, qkv, d.q, d), _rope(r, qkv, d.kv, d), r.alloc(d.p * d.b * d.s * d.kv)
            r.free(qkv)
    else:
        q = _adapt(r, n, _linear(r, d.p * d.b * d.s * d.q, d.h, d.q, d, "q"), d, "q", grad_in)
        if _weight_input(d, "q", "k", "v"):
            r.save(x)  # shared input of q/k/v projections
        k = _adapt(r, n, _linear(r, d.p * d.b * d.s * d.kv, d.h, d.kv, d, "k"), d, "k", grad_in)
        v = _adapt(r, n, _linear(r, d.p * d.b * d.s * d.kv, d.h, d.kv, d, "v"), d, "v", grad_in)
        if d.rope:
            q_lin, k_lin = q, k
            q, k = _rope(r, q_lin, d.q, d), _rope(r, k_lin, d.kv, d)
            r.free(q_lin, k_lin)
    out = r.checkpoint(_core, [q, k, v], d) if selective else _core(r, q, k, v, d)
    if d.sdpa and not d.ring:  # flash output is laid out (b, s, heads, d): the o_proj input is a view of it
        o_in = out
    else:  # eager or ring output (b, heads, s, d): transpose + reshape copies
        o_in = r.alloc(d.p * d.b * d.s * d.q)
    if _weight_input(d, "o"):
        r.save(o_in)
    o = _adapt(r, o_in, _row_parallel(r, d.q, d, "o"), d, "o")
    r.free(o_in, out, q, k, v)
    if x is not n:
        r.free(x)
    return o


def _mlp(r: Replay, n: _Buf, d: Shapes) -> _Buf:
    bsf = d.p * d.b * d.s * d.f
    x = _gathered(r, n, d)
    down_input = _weight_input(d, "down")
    if d.swiglu and d.fused_gate_up:
        gate = up = _fused_linear(r, x, d.h, 2 * d.f, d, "gate", "up")  # halves of one product
        act = r.alloc(bsf)  # silu saves its input (the product's gate half: the product stays)
        prod = r.alloc(bsf)  # the mul saves both factors
        r.save(gate, act, *([prod] if down_input and not d.fp8 else []))
        r.free(act, gate)
    elif d.swiglu:
        if _weight_input(d, "gate", "up"):
            r.save(x)
        gate = _adapt(r, n, _linear(r, bsf, d.h, d.f, d, "gate"), d, "gate")
        act = r.alloc(bsf)  # silu saves its input
        r.save(gate)
        r.free(gate)
        up = _adapt(r, n, _linear(r, bsf, d.h, d.f, d, "up"), d, "up")
        prod = r.alloc(bsf)  # the mul saves both factors
        r.save(act, up, *([prod] if down_input and not d.fp8 else []))
        r.free(act, up)
    else:
        if _weight_input(d, "gate", "up"):
            r.save(x)
        up = _adapt(r, n, _linear(r, bsf, d.h, d.f, d, "up"), d, "up")
        prod = r.alloc(bsf)  # gelu saves its input
        r.save(up, *([prod] if down_input and not d.fp8 else []))
        r.free(up)
    out = _adapt(r, prod, _row_parallel(r, d.f, d, "down"), d, "down")
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


def _moe(r: Replay, n: _Buf, d: Shapes) -> _Buf:
    """MoE.forward on this rank's b s tokens (the whole sequence under SP: gathered first, split after), A
    routed (token, expert) assignments, routing assumed balanced: each expert gets A / E of them, and
    under expert parallelism each rank receives as many as it sends. Saved: the router's input, its fp32
    logits (z-loss) and softmax (balance loss), the top-k indices and gate weights; per assignment the
    routed token (the grouped matmuls' input), the experts' gate, silu(gate), up and product, their
    output, weighed by the gate (the weighed copy too: index_add keeps its source), and the int64 indices
    that route it back."""
    T, A = d.b * d.s, d.assignments
    trains = _weight_input(d, "router", "experts")  # frozen under LoRA: their inputs are not saved
    x = n
    if d.rep != 1:  # _GatherToReplicated: a rank-major buffer, reordered into sequence order (b > 1)
        x = r.alloc(d.p * T * d.h)
        if d.b > 1:
            rank_major, x = x, r.alloc(d.p * T * d.h)
            r.free(rank_major)
    logits = r.matmul(r.alloc(d.p * T * d.experts))  # the router stays in the compute dtype under fp8
    if trains:
        r.save(x)
    if d.p != 4:  # routing decisions in fp32
        low, logits = logits, r.alloc(4 * T * d.experts)
        r.free(low)
    top = r.alloc(4 * T * d.topk)
    top_ids = r.alloc(8 * T * d.topk)
    r.save(top_ids)
    weights = r.alloc(4 * T * d.topk)  # softmax over the k chosen logits saves its output
    r.save(weights)
    arange = r.alloc(8 * T)
    token_ids = r.alloc(8 * T * d.topk)
    r.free(arange)
    r.alloc(8 * d.experts)  # the count per expert: MoE.stats keeps it past the forward
    keep = _capacity_mask(r, T * d.topk, d)
    r.save(keep)  # weights[keep]'s backward keeps its mask
    picked = []
    for size in (8, 8, 4):  # expert ids, token ids, weights of the kept assignments (nonzero first)
        nonzero = r.alloc(8 * A)
        picked.append(r.alloc(size * A))
        r.free(nonzero)
    out = (_all_to_all_dispatch if d.ep > 1 else _local_dispatch)(r, x, A, d)
    r.free(*picked)
    if d.shared_f:  # a dense tensor-parallel MLP of its own, on the whole sequence
        shared = _mlp(r, x, replace(d, f=d.shared_f, rep=1.0, tp_reduce=d.tp_reduce or d.rep != 1))
        total = r.alloc(d.p * T * d.h)
        r.free(out, shared)
        out = total
    probs = r.alloc(4 * T * d.experts)
    r.save(probs)
    lse = r.alloc(4 * T)  # logsumexp saves the fp32 logits and its result; square saves it again
    r.free(r.alloc(4 * T * d.experts))  # exp(logits - max), summed
    r.save(logits, lse)
    r.free(r.alloc(4 * T))
    r.free(logits, top, top_ids, weights, token_ids, keep, probs, lse)
    if x is not n:
        r.free(x)
    if d.rep != 1 and d.b > 1:  # _SplitSequence: this rank's part, copied out of the whole output
        part = r.alloc(d.p * d.bsh)
        r.free(out)
        out = part
    return out


def _capacity_mask(r: Replay, assignments: float, d: Shapes) -> _Buf:
    """MoE._within_capacity: all ones when dropless; else each assignment's arrival order at its expert
    from a one-hot (A, E) int64 cumulative sum."""
    if not d.capacity:
        return r.alloc(assignments)
    one_hot = r.alloc(8 * assignments * d.experts)
    cumulative = r.alloc(8 * assignments * d.experts)
    arrivals = r.alloc(8 * assignments * d.experts)
    r.free(cumulative)
    position = r.alloc(8 * assignments)
    r.free(arrivals)
    shifted = r.alloc(8 * assignments)
    r.free(position)
    keep = r.alloc(assignments)
    r.free(shifted, one_hot)
    return keep


def _experts(r: Replay, routed: _Buf, rows: float, d: Shapes) -> _Buf:
    """GroupedExperts.forward on `rows` routed tokens: gate and up (grouped matmuls saving their input),
    silu(gate) * up, down; returns down's output."""
    trains = _weight_input(d, "experts")
    cumulative = r.alloc(8 * d.experts / d.ep)
    ends = r.alloc(4 * d.experts / d.ep)  # the group ends in int32, saved by every grouped matmul
    r.free(cumulative)
    r.save(ends)
    gate = r.matmul(r.alloc(d.p * rows * d.expert_f))
    up = r.matmul(r.alloc(d.p * rows * d.expert_f))
    if trains:
        r.save(routed)
    act = r.alloc(d.p * rows * d.expert_f)  # silu saves its input, the mul both factors
    prod = r.alloc(d.p * rows * d.expert_f)
    r.save(gate, act, up)
    r.free(gate, act, up)
    down = r.matmul(r.alloc(d.p * rows * d.h))
    if trains:
        r.save(prod)
    r.free(prod, ends)
    return down


def _sort(r: Replay, n: float) -> _Buf:
    """A stable argsort of n int64 keys: the sorted keys are made and dropped, the order kept."""
    values = r.alloc(8 * n)
    order = r.alloc(8 * n)
    r.free(values)
    return order


def _weigh_and_sum(r: Replay, expert_out: _Buf, rows: float, d: Shapes, index: list,
                   weights: _Buf | None = None) -> _Buf:
    """expert outputs * gate weights (A, 1) in the compute dtype, added back per token (index_add).
    `weights`: the fp32 gate weights already in the outputs' order; else gathered into it here."""
    w32 = weights or r.alloc(4 * rows)
    w = w32 if d.p == 4 else r.alloc(d.p * rows)
    if w is not w32 and weights is None:
        r.free(w32)
    weighed = r.alloc(d.p * rows * d.h)
    r.save(expert_out, w, weighed)  # the mul keeps both factors, index_add's backward its source
    zeros = r.alloc(d.p * d.b * d.s * d.h)
    out = r.alloc(d.p * d.b * d.s * d.h)
    r.free(zeros, weighed, expert_out, w, *index)
    return out


def _local_dispatch(r: Replay, x: _Buf, A: float, d: Shapes) -> _Buf:
    """LocalDispatch: the assignments sorted by expert, their tokens gathered, run and added back."""
    order = _sort(r, A)
    counts = r.alloc(8 * d.experts)
    rows = r.alloc(8 * A)
    routed = r.alloc(d.p * A * d.h)
    r.save(rows, order)  # the token gather's and the gate weights' index_select keep their indices
    down = _experts(r, routed, A, d)
    r.free(routed, counts)
    return _weigh_and_sum(r, down, A, d, [order, rows])


def _all_to_all_dispatch(r: Replay, x: _Buf, A: float, d: Shapes) -> _Buf:
    """AllToAllDispatch (fivefold.parallel.expert_parallel): assignments sorted by destination rank,
    tokens sent by all-to-all, sorted by local expert, run, unsorted, sent back, weighed and added."""
    dest = r.alloc(8 * A)
    order = _sort(r, A)
    sorted_ids = [r.alloc(8 * A), r.alloc(8 * A), r.alloc(4 * A)]  # expert ids, token ids, weights
    old_dest, dest = dest, r.alloc(8 * A)
    r.free(old_dest)
    r.save(order, sorted_ids[1])  # weights[order]; tokens[token_ids]
    received = A  # balanced: every rank receives what it sends
    incoming = r.alloc(d.p * received * d.h)
    r.free(r.alloc(d.p * A * d.h))  # tokens[token_ids], sent
    incoming_ids = r.alloc(8 * received)
    local_ids = r.alloc(8 * received)
    by_expert = _sort(r, received)
    counts = r.alloc(8 * d.experts / d.ep)
    r.free(local_ids)
    routed = r.alloc(d.p * received * d.h)
    r.save(by_expert)
    down = _experts(r, routed, received, d)
    back = _sort(r, received)
    processed = r.alloc(d.p * received * d.h)
    r.save(back)
    r.free(down, routed, counts)
    returned = r.alloc(d.p * A * d.h)
    out = _weigh_and_sum(r, returned, A, d, [], weights=sorted_ids[2])
    r.free(dest, order, *sorted_ids, incoming, incoming_ids, by_expert, back, processed)
    return out


def _compiled_block(r: Replay, x: _Buf, d: Shapes, grad_in: bool = True, selective: bool = False) -> _Buf:
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
    the replay is eager's policy less the block's last product (_mlp, Replay.unkeep).

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

    def adapters(targets: tuple[str, ...], width: int, input_grad: bool) -> list[_Buf]:
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


def _block(r: Replay, x: _Buf, d: Shapes, selective: bool, grad_in: bool = True) -> _Buf:
    if d.compiled and r.ops is None:  # (a compiled block under the ops policy: eager's replay, less its last product)
        return _compiled_block(r, x, d, grad_in, selective)
    r.mark("block")
    n = _norm(r, x, d, grad_in)
    o = _attention(r, n, d, selective, grad_in)
    r.mark("attention")
    r.free(n)
    x2 = r.alloc(d.p * d.bsh)  # residual
    r.free(o)
    n2 = _norm(r, x2, d)
    m = _moe(r, n2, d) if d.experts else _mlp(r, n2, d)
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
        n = _norm(r, x, d)
        r.before_loss = r.saved_bytes
        r.free(x, positions, *rope, *r.shared_mask)
        _chunked_head(r, n, d)
    elif head and d.compiled_loss:
        _compiled_head(r, x, d)
        r.free(positions, *rope, *r.shared_mask)
    elif head:
        n = _norm(r, x, d)
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


def _compiled_head(r: Replay, x: _Buf, d: Shapes) -> None:
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
        n = _norm(r, x, d)
    logits = r.alloc(d.p * d.b * d.s * d.vocab)
    if not d.adapters:  # the LM head's input, for its weight's gradient
        r.save(n)
    r.free(n, x)
    stats = r.alloc(8 * d.b * d.s)
    r.save(logits, stats)


def _chunked_head(r: Replay, n: _Buf, d: Shapes) -> None:
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
        _to_fp8(r, numel, d)
    layout = r.alloc(k * n)
    _fp8_product(r, rows * n, n * k, rows * k, d)  # the input gradient, kept
    r.free(layout)
    for numel in (rows * n, rows * k):  # the output gradient's again, the saved input's
        _to_fp8(r, numel, d)
    layouts = [r.alloc(rows * n), r.alloc(rows * k)]
    _fp8_product(r, n * rows, rows * k, n * k, d)  # the weight gradient
    r.free(*layouts)
    return r.peak


def layer_backward_bytes(d: Shapes) -> float:
    parts = layer_backward_parts(d)
    return parts["residual"] + max(parts["attention"], parts["mlp"], parts["norm"], parts["fp8_attention"],
                                   parts["fp8_down"], parts["fp8_up"])
