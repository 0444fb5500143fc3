"""The replay's bookkeeping: the per-rank sizes of one micro-batch (`Shapes`) and the live, saved and peak
bytes as a replayed forward allocates and frees tensors (`Replay`). What is replayed, tensor by tensor, is
in fivefold/memory/replay_layers.py, replay_moe.py, replay_compiled.py and activations.py."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    # train.compile: each block saves what torch.compile's min-cut partitioning keeps (compiled_block);
    # set only for the blocks that replay models (fivefold.memory.plan.compiled_blocks_modelled).
    compiled: bool = False
    # Config.compiled_loss: the final norm and the cross-entropy compiled (compiled_head).
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


class Buf:
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
    taken: list[Buf] = field(default_factory=list)
    marked_at: dict[str, int] = field(default_factory=dict)
    shared_mask: list = field(default_factory=list)  # the document mask, alive for the whole forward
    before_loss: float = 0.0  # saved bytes once the final norm has run, before the loss saves its own
    blocks_peak: float = 0.0  # the forward's peak up to the end of the blocks (before the head and loss)

    def _tick(self) -> None:
        self.peak = max(self.peak, self.live)
        self.events.append(self.live)

    def alloc(self, nbytes: float) -> Buf:
        self.live += nbytes
        self._tick()
        return Buf(nbytes)

    def save(self, *bufs: Buf) -> None:
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

    def free(self, *bufs: Buf) -> None:
        """The last Python reference dies; saved tensors live on until backward."""
        for buf in bufs:
            if buf.state in ("temp", "cached"):
                if buf.state == "cached":  # counted before the recomputation: released now
                    self.saved_bytes -= buf.nbytes
                    buf.released = len(self.events)
                buf.state = "freed"
                self.live -= buf.nbytes
                self._tick()

    def checkpoint(self, fn, inputs: list[Buf], *args, keep_ops: bool = False):
        """Run fn(self, *inputs, *args) as a non-reentrant checkpoint: its inputs are held, its saves
        dropped; its recomputation in backward is replayed alone, stopping after its last save.
        `keep_ops`: train.recompute=ops's policy keeps some op outputs of the region (`kept`)."""
        self.save(*inputs)
        alone = Replay(ops=0 if keep_ops else None, recomputing=True)
        fn(alone, *[Buf(0.0) for _ in inputs], *args)  # inputs are already counted outside
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

    def kept(self, *bufs: Buf) -> None:
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

    def unkeep(self, buf: Buf) -> None:
        """Undo `kept` for an output no backward reads: torch.compile's partitioner drops it from what the
        graph saves, where eager's policy cache holds it (a compiled block's last product)."""
        if buf.state == "saved":
            self.saved_bytes -= buf.nbytes
            buf.state = "temp"
        elif buf.state == "cached":
            self.live += buf.nbytes
            self._tick()
            buf.state = "temp"

    def matmul(self, buf: Buf) -> Buf:
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
