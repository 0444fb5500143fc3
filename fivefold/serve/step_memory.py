"""What one engine step holds beyond the weights and the KV pool, before launch: the forward's activations at
the token budget, the sampler's working set at max_num_seqs rows, and the scored rows' logits at
serve.max_scored_tokens. The three never coexist (a forward's activations are freed before its logits are
sampled or scored, and the scored rows are freed before sampling), so the step's peak is the largest.

Each count names the tensors live at the phase's peak, as `LivePeak` (fivefold.memory.live_peak) measures
them in a real step: tests/test_serve_step_memory.py checks the plan against it on each path.
"""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.config import Config
from fivefold.serve.kv_pool import DECODE_GROUP

# The sampler's bytes per (row, vocabulary) element at its peak (fivefold.serve.sampling.launch_sampling),
# beside the forward's logits: the model's logprobs (fp32, rows asking for logprobs), a copy with logit biases
# or penalties, and top-k / top-p's: the tempered logits, the sort's values and int64 order, the probabilities,
# their cumulative sum and two boolean masks.
SAMPLER_BYTES = 4 + 4 + (4 + 4 + 8 + 4 + 4 + 1 + 1)
# The scorer's, per element of the rows it takes at once (fivefold.serve.sampling.score_rows): logsumexp's
# shifted and exponentiated rows and the rank's comparison.
SCORER_BYTES = 4 + 4 + 1
# What no count above names: a step's small index vectors (rows, lengths, the sampled tokens) and RoPE's
# frequencies, a few kilobytes at any size.
SMALL = 4096


@dataclass(frozen=True)
class StepMemory:
    path: str  # "triton", "lean" or "modules": which forward the engine runs (fivefold.serve.engine)
    forward: int  # bytes: the forward's peak over max_num_batched_tokens tokens
    sampling: int  # max_num_seqs rows' logits and the sampler's working set
    scoring: int  # the logits of max_num_seqs + max_scored_tokens rows and the scorer's working set

    @property
    def peak(self) -> int:
        return max(self.forward, self.sampling, self.scoring)


def forward_path(cfg: Config, device: str) -> str:
    """The engine's forward for this model and device: the Triton kernels on CUDA (serve.kernels auto or
    triton), else the torch path's lean loop (fivefold.serve.lean_forward) where it reproduces the model,
    else the modules."""
    s, m = cfg.serve, cfg.model
    if device == "cuda" and s.kernels != "torch":
        return "triton"
    lean = (s.fuse_launches and m.position == "rope" and m.norm == "rmsnorm" and m.activation == "swiglu"
            and not m.num_experts)
    return "lean" if lean else "modules"


def step_memory(cfg: Config, device: str, itemsize: int) -> StepMemory:
    s, m = cfg.serve, cfg.model
    tokens, rows, scored = s.max_num_batched_tokens, s.max_num_seqs, s.max_scored_tokens
    h, f, d, v = m.hidden_size, m.ffn_hidden_size, m.head_size, m.vocab_size
    q, kv = m.q_size, m.kv_size
    path = forward_path(cfg, device)
    # Per token, at the MLP: its input product (gate and up, 2f), the activation and the product with up (f
    # each), the residual stream (and what the path keeps beside it), RoPE's cos and sin.
    if path == "triton":  # gate/up, the SwiGLU kernel's output; the fused norms' streams and the attention's outputs
        mlp = 3 * f + 6 * h + 2 * q + 2 * d
    elif path == "lean":  # gate/up, silu, the product; the embedding and the stream; cos, sin and the signed sin
        mlp = 4 * f + 2 * h + 3 * d
    else:  # the modules: gate/up (or fc), their activation and product; the embedding, stream and norm; cos, sin
        mlp = 4 * f + 3 * h + 2 * d
    forward = tokens * (mlp * itemsize + 8)  # and the positions, int64
    if path != "triton":
        # The torch path's attention gathers a chunk's earlier keys and values for SDPA (whole blocks), with a
        # boolean mask of its rows over them; without the C++ decode kernel, each group of decodes gathers its
        # blocks, padded to the longest. At most max_model_len tokens of context. Per token: the embedding and
        # the stream, q/k/v, q and k rotated, the output zeroed for the rows and SDPA's, cos, sin and the sign.
        length = s.max_model_len or m.max_seq_len
        blocks = -(-length // s.block_size) * s.block_size
        gathered = (DECODE_GROUP if s.cpu_kernel == "false" or itemsize != 4 else 1) * 2 * blocks * kv * itemsize
        per_token = 2 * h + (q + 2 * kv) + (q + kv) + 2 * q + 3 * d
        attention = tokens * (per_token * itemsize + 8 + length) + gathered
        forward = max(forward, attention)
    upcast = 4 if itemsize != 4 else 0  # the sampler and scorer work in fp32
    head = (v + 2 * h) * itemsize  # a row's logits, its hidden state and its norm
    sampling = rows * (head + v * (upcast + SAMPLER_BYTES)) + v * 8  # and top-k's ranks, int64
    chunk = max(1, rows // 4)  # fivefold.serve.engine scores this many rows at a time
    scoring = (rows + scored) * head + chunk * v * (upcast + SCORER_BYTES) if scored else 0
    return StepMemory(path, forward + SMALL, sampling + SMALL, scoring + SMALL if scored else 0)
