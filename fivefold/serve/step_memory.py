"""What one engine step holds beyond the weights and the KV pool, before launch: the forward's activations at
the token budget, the sampler's working set at max_num_seqs rows, and the scored rows' logits at
serve.max_scored_tokens. The three never coexist (a forward's activations are freed before its logits are
sampled or scored, and the scored rows are freed before sampling), so the step's peak is the largest.

Each count names the tensors live at the phase's peak, as `LivePeak` (fivefold.memory.live_peak) measures
them in a real step: tests/test_serve_step_memory.py checks the plan against it on each path.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from fivefold.config import ModelConfig, ServeConfig
from fivefold.kernels.cpu_paged_decode import unsupported as cpu_kernel_unsupported
from fivefold.memory.live_peak import LivePeak
from fivefold.model.moe import grouped_mm_runs
from fivefold.quant.formats import dequantized_bytes
from fivefold.quant.linear import QuantLinear
from fivefold.serve.kv_pool import DECODE_GROUP, KERNEL_CHUNK_CONTEXT
from fivefold.serve.sampling import DRAW_BYTES, draw_rows

# The sampler's bytes per (row, vocabulary) element beside the forward's logits, for every row of the step
# (fivefold.serve.sampling.launch_sampling): a copy with logit biases or penalties; and a draw's working set
# (sampling.DRAW_BYTES) for the rows drawn at once (sampling.draw_rows), after which the same rows' logprobs
# take less (their gathered logits and log-softmax, 8 bytes).
SAMPLER_BYTES = 4
# The scorer's, per element of the rows it takes at once (fivefold.serve.sampling.score_rows): logsumexp's
# shifted and exponentiated rows and the rank's comparison.
SCORER_BYTES = 4 + 4 + 1
# What no count above names: a step's small index vectors (rows, lengths, the sampled tokens) and RoPE's
# frequencies, a few kilobytes at any size.
SMALL = 4096


# Each forward path in the words the plan and the engine print.
PATH_WORDS = {"triton": "Triton kernels'", "lean": "lean loop's", "lean-cpp": "lean loop's (C++ block ops)",
              "modules": "modules'"}


@dataclass(frozen=True)
class StepMemory:
    """Bytes of each phase of a step at its worst. `forward`: the MLP's or the attention's moment, whichever holds
    more, plus the torch path's masks (held for the whole forward); `sampling`: max_num_seqs rows' logits and
    the sampler's working set; `scoring`: the logits of max_num_seqs + max_scored_tokens rows with their hidden
    states (the forward's end) and the scorer's."""
    path: str  # "triton", "lean", "lean-cpp" or "modules": which forward the engine runs (fivefold.serve.engine)
    mlp: int  # at max_num_batched_tokens tokens, without the mask
    attention: int  # the torch path's attention over a chunk at max_model_len, without the mask
    mask: int  # the torch path's boolean masks of the chunks' rows over their context (and the kernel rows' indices)
    sampling: int
    scoring: int
    dequantized: int = 0  # the largest quantized weight dequantized for its product (fivefold.quant), with its chunk

    @property
    def forward(self) -> int:
        return max(self.mlp, self.attention) + self.mask + self.dequantized

    @property
    def peak(self) -> int:
        return max(self.forward, self.sampling, self.scoring)

    def describe(self) -> str:
        mib = 2**20
        weight = f" with a dequantized weight's {self.dequantized / mib:,.1f}" if self.dequantized else ""
        return (f"a step's working set: up to {self.peak / mib:,.1f} MiB (the {PATH_WORDS[self.path]} forward "
                f"{self.forward / mib:,.1f}{weight}, sampling {self.sampling / mib:,.1f}, scoring "
                f"{self.scoring / mib:,.1f})")


def forward_path(m: ModelConfig, s: ServeConfig, device: str, tp: int = 1) -> str:
    """The engine's forward for this model and device, as fivefold.serve.engine chooses it: the Triton kernels
    on CUDA (serve.kernels auto or triton), else the torch path's lean loop (fivefold.serve.lean_forward) where
    it reproduces the model (not under tensor parallelism, whose hooks it would skip), with its C++ block ops
    on a CPU in float32 under serve.cpu_kernel ("lean-cpp"), else the modules."""
    if device == "cuda" and s.kernels != "torch":
        return "triton"
    lean = (s.fuse_launches and m.position == "rope" and m.norm == "rmsnorm" and m.activation == "swiglu"
            and not m.num_experts and tp == 1)
    if lean and device == "cpu" and cpu_kernels(m, s):
        return "lean-cpp"  # with fivefold.kernels.cpu_block_ops
    return "lean" if lean else "modules"


def cpu_kernels(m: ModelConfig, s: ServeConfig) -> bool:
    """Whether a CPU engine runs the C++ kernels (serve.cpu_kernel) for this model, where they build (as auto
    assumes): float32 or bfloat16, and a head size they are compiled for."""
    return s.cpu_kernel != "false" and cpu_kernel_unsupported(m.head_size, getattr(torch, s.dtype)) is None


def step_memory(m: ModelConfig, s: ServeConfig, path: str, itemsize: int, tp: int = 1,
                quantized: tuple = (), device: str = "cuda", dtype: str = "") -> StepMemory:
    """The step's phases in bytes on one rank for the model `m` served under `s` on forward `path`
    (`forward_path`) on a `device` of this type in elements of `itemsize` bytes, tensor parallel over `tp` ranks:
    each holds its share of the heads and MLP columns, and gathers the logits whole (fivefold.serve.sharded).
    Counted for SwiGLU or GELU blocks in the serving `dtype` (default serve.dtype), a mixture of experts' by
    moe_bytes_per_token. `quantized`: a quantized model's linears as (method, (out, in), itemsize)
    (quantized_shapes), each of which dequantizes its weight for a chunk's product
    (fivefold.quant.formats.dequantized_bytes): the largest such weight is counted on top of the forward's
    activations, with what its dequantizing holds beyond the product's output (which the activations count
    and which is not allocated yet while it dequantizes). A bound: the weight lives beside one product's input
    and output, not the MLP's whole peak."""
    tokens, rows, scored = s.max_num_batched_tokens, s.max_num_seqs, s.max_scored_tokens
    h, f, d, v = m.hidden_size, m.ffn_hidden_size // tp, m.head_size, m.vocab_size
    q, kv = m.q_size // tp, m.kv_size // tp
    # Per token, at the MLP: its input product (gate and up, 2f), the activation and the product with up (f
    # each), the residual stream (and what the path keeps beside it), RoPE's cos and sin; and the positions.
    if path == "triton":  # gate/up, the SwiGLU kernel's output; the fused norms' streams and the attention's outputs
        per_token = 3 * f + 6 * h + 2 * q + 2 * d
    elif path == "lean":  # gate/up, silu, the product; the embedding and the stream; cos, sin and the signed sin
        per_token = 4 * f + 2 * h + 3 * d
    elif path == "lean-cpp":  # as "lean", but SwiGLU is one C++ call: gate/up and its output
        per_token = 3 * f + 2 * h + 3 * d
    else:  # the modules: gate/up (or fc), their activation and product; the embedding, stream and norm; cos, sin
        per_token = 4 * f + 3 * h + 2 * d
    mlp = tokens * (per_token * itemsize + 8) + SMALL
    if m.num_experts:
        mlp = tokens * moe_bytes_per_token(m, path, dtype or s.dtype, device) + SMALL
    attention = mask = 0
    if path != "triton":
        # The torch path's attention gathers a chunk's earlier keys and values for SDPA (whole blocks), with a
        # boolean mask of its rows over them, built for the step; without the C++ decode kernel, each group of
        # decodes gathers its blocks, padded to the longest. At most max_model_len tokens of context. Per token:
        # the embedding and the stream, q/k/v, q and k rotated, the output zeroed for the rows and SDPA's, cos,
        # sin and the sign. Under the C++ kernel, chunks of sequences up to KERNEL_CHUNK_CONTEXT tokens attend as
        # kernel rows (fivefold.serve.kv_pool), gathering nothing: where max_model_len is no longer, none gathers.
        length = s.max_model_len or m.max_seq_len
        blocks = -(-length // s.block_size) * s.block_size
        as_rows = cpu_kernels(m, s) and length <= KERNEL_CHUNK_CONTEXT
        gathered = 0 if as_rows else (1 if cpu_kernels(m, s) else DECODE_GROUP) * 2 * blocks * kv * itemsize
        per_token = 2 * h + (q + 2 * kv) + (q + kv) + 2 * q + 3 * d
        attention = tokens * (per_token * itemsize + 8) + gathered + SMALL
        # Held for the whole forward too: under the kernel, each row's sequence and context length (int32 each).
        mask = (0 if as_rows else tokens * length) + (8 * tokens if cpu_kernels(m, s) else 0)
    upcast = 4 if itemsize != 4 else 0  # the sampler and scorer work in fp32
    head = (v + 2 * h) * itemsize  # a row's logits, its hidden state and its norm
    sampling = rows * (head + v * (upcast + SAMPLER_BYTES)) + min(rows, draw_rows(v)) * v * DRAW_BYTES + SMALL
    chunk = max(1, rows // 4)  # fivefold.serve.engine scores this many rows at a time
    # The logits of the sampled and scored rows, with (at the LM head, the forward's end) the rows' hidden states
    # and norms and the step's residual stream, or (after) the scorer's chunk, or (last) the sampled rows' copy.
    at_head = (rows + scored) * 2 * h * itemsize + tokens * h * itemsize
    after = max(chunk * v * (upcast + SCORER_BYTES), rows * v * itemsize)
    scoring = (rows + scored) * v * itemsize + max(at_head, after)
    if tp > 1:  # gathered: each rank's share, the parts received and their concatenation at once
        scoring = max(scoring, (rows + scored) * v * itemsize * (2 * tp + 1) // tp + tokens * h * itemsize)
    scoring = scoring + SMALL if scored else 0
    def dequantizing(method: str, out: int, k: int, size: int) -> int:  # the weight, and its chunk past the output
        weight = out * k * size
        return weight + max(0, dequantized_bytes(method, (out, k), size) - weight - tokens * out * size)
    dequantized = max((dequantizing(method, *shape, size) for method, shape, size in quantized), default=0)
    return StepMemory(path, mlp, attention, mask, sampling, scoring, dequantized)


# A mixture of experts' routing, per token and routed copy (fivefold.model.moe.MoE, LocalDispatch): top-k's values
# and int64 ids, their softmax, the copies' token ids, what capacity keeps (a mask, the kept ids, token ids and
# weights), the order by expert and the rows it gathers: 4 + 8 + 4 + 8 + 1 + 8 + 8 + 4 + 8 + 8.
ROUTING_BYTES = 61


def moe_bytes_per_token(m: ModelConfig, path: str, dtype: str, device: str) -> int:
    """A mixture-of-experts block's most bytes per token in a forward (every block routes): at the experts, the
    routed copies' gathered rows, gate, up, activation and product (k of each), with the router's fp32 logits
    and the routing's index vectors (ROUTING_BYTES); without grouped products (model.moe_grouped_mm=false, or
    where F.grouped_mm does not run: fivefold.model.moe.grouped_mm_runs) the experts run one at a time, each
    on at most every token (a token's k experts differ), beside the outputs so far, which are then joined
    (the worst routing: every token to the same k experts). Then, with a
    shared expert, its MLP beside the routed output while the routing's tensors are still held. The
    residual stream around them is the path's: the modules' embedding, stream, norm and cos / sin, or the
    Triton path's streams and attention outputs (checked in Triton's interpreter for grouped products, what
    CUDA runs in bf16; the loop, CUDA's form in fp16 or fp32, held more there than counted here, unexplained
    and not measured on a GPU)."""
    h, d, k, e, f, shared = (m.hidden_size, m.head_size, m.experts_per_token, m.num_experts, m.expert_size,
                             m.shared_expert_size)
    itemsize = getattr(torch, dtype).itemsize
    # The Triton path keeps the fused norms' streams, the last layer's output and the attention's q-wide
    # tensors, and its SwiGLU kernel writes one output (gate, up, output: 3 of f); the modules' activation
    # and product are two (4 of f).
    stream, acts = (5 * h + 2 * m.q_size + 2 * d, 3) if path == "triton" else (3 * h + 2 * d, 4)
    logits = e * (4 + (itemsize if itemsize != 4 else 0))  # the router's output, then in fp32
    if m.moe_grouped_mm and grouped_mm_runs(device, getattr(torch, dtype), (h, f)):
        routed = k * h + acts * k * f
    else:  # one expert at a time, on at most every token; the outputs so far held, then joined
        routed = max((2 * k - 1) * h + acts * f, 3 * k * h)
    experts = (stream + routed) * itemsize + logits + ROUTING_BYTES * k
    after = (stream + h + acts * shared) * itemsize + logits + 25 * k if shared else 0
    return max(experts, after) + 8  # and the positions'


def quantized_shapes(model: torch.nn.Module) -> tuple[tuple[str, tuple[int, int], int], ...]:
    """(method, (out, in), compute itemsize) of each of `model`'s quantized linears (fivefold.quant.linear.
    QuantLinear; the serving engine's fused ones too, which are attributes, not submodules)."""
    found = {id(q): q for module in model.modules() for q in (module, *vars(module).values())
             if isinstance(q, QuantLinear)}
    return tuple(sorted({(q.method, (q.out_features, q.in_features), q.dtype.itemsize) for q in found.values()}))


@contextmanager
def measured_phases(engine):
    """Within: the peak of each phase of the engine's steps run inside, measured (fivefold.memory.live_peak), in
    the dict yielded: "forward" from the forward's start to its logits, "scoring" and "sampling" from theirs,
    each with what is live when it starts (the logits)."""
    peaks = {"forward": 0, "scoring": 0, "sampling": 0}
    methods = {"forward": "_forward", "scoring": "_score_prompts", "sampling": "_launch_sampling"}
    tracker = LivePeak()

    def phase(name, method):
        def run(*args, **kwargs):
            tracker.reset_peak()
            try:
                return method(*args, **kwargs)
            finally:
                peaks[name] = max(peaks[name], tracker.peak)
        return run

    for name, attr in methods.items():
        setattr(engine, attr, phase(name, getattr(engine, attr)))
    try:
        with tracker:
            yield peaks
    finally:
        for attr in methods.values():
            delattr(engine, attr)  # the class's methods again
