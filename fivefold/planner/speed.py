"""Step-time model: how long one optimizer step of a layout takes on a hardware profile, and where the
time goes. Pure arithmetic on the config; no model is built.

Per micro-batch and pipeline stage, a forward (F), a backward (B) and, under zero-bubble, a weight pass
(W) are costed from:
- matmuls: 2 M K N FLOPs at the profile's peak x matmul_efficiency x prod(d / (d + knee)) over the three
  dimensions (small or skinny shapes fill fewer tensor-core tiles); backward twice the forward (input and
  weight gradients), split B / W under zero-bubble;
- attention: causal, so half of 4 b heads s s_kv head_size FLOPs forward, 2.5x that backward
  (FlashAttention recomputes the scores: Dao 2023), at attention_efficiency; eager attention computes
  the full scores at matmul speed and moves them through memory;
- elementwise kernels (norms, RoPE, activations, residuals, the loss): bytes moved / (memory_bandwidth x
  memory_efficiency), unfused as the eager model runs them, or fused (torch.compile; the fused kernels of
  published frameworks);
- kernel launches: op_overhead per op;
- recomputation: the forward again before backward (full), the attention core (selective), or all but
  every other matmul and the fused attention (ops);
- communication on the critical path: tensor / sequence parallel and expert all-to-alls inside every
  layer, the ring-attention shifts beyond the block compute they overlap, pipeline sends, ZeRO-3's gathers
  beyond the prefetch window and ZeRO-2's per-micro-batch reduce-scatters beyond their backward.
Each collective is timed on the link its group crosses (fivefold.memory.communication lists them): ranks
are laid out (pp, dp, cp, tp), tp innermost, so a group of `size` ranks `stride` apart stays inside a
node when stride x size <= gpus_per_node; ring algorithms, latency per step; a ring across nodes uses the
NICs of all the group's ranks in a node. Overlapped communication is not free even when hidden: NCCL's
kernels hold some of the SMs while it is in flight (the profile's comm_interference), and collectives that
share a link at the same time (ZeRO-3's gathers and reduce-scatters in backward) hide behind it together.
Full and ops recomputation replay the forward's in-layer collectives too.

The stages' F / B / W costs drive the pipeline's own action lists (fivefold.parallel.pipeline_schedules:
AFAB, 1F1B, interleaved, zero-bubble) through the schedule simulator: the bubble is what the simulated
schedule leaves idle, not a closed formula. After the last backward: the data-parallel gradient
reduction beyond the backward it overlaps, the optimizer step (memory-bound: the bytes fivefold's update
moves per local parameter, 50 under bf16-mixed with clipping: optimizer_bytes_per_param), and ZeRO-1/2's
parameter all-gather.

A step of N devices waits for the slowest of them: devices of one kind differ in speed (the profile's
speed_spread), so the device work of the step (compute, recomputation, optimizer) takes the expected slowest
of N draws, not one device's time (slowest_of).

MFU counts model FLOPs (fivefold.memory.formulas.flops_per_token: no recomputation, the PaLM convention)
against the profile's peak for the compute dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fivefold.config import Config, ModelConfig
from fivefold.memory import formulas
from fivefold.memory.communication import Collective, step_collectives
from fivefold.parallel.pipeline_schedules import rank_schedule, simulate_schedule
from fivefold.planner.hardware import HardwareProfile

# Elementwise traffic per element, in units of the activation dtype's bytes p, plus fp32 bytes (the norms'
# statistics, the loss). Counted from the eager model's ops (fivefold/model); "fused" assumes one read and
# one write per fused region. Backward moves about twice the forward's bytes.
UNFUSED = {"norm": (4, 28), "residual": (3, 0), "rope": (13, 0), "heads": (2, 0), "swiglu": (5, 0),
           "gelu": (4, 0), "loss": (2, 24), "permute": (7, 0), "permute_ep": (11, 0), "combine": (3, 0)}
FUSED = {"norm": (3, 0), "residual": (0, 0), "rope": (3, 0), "heads": (0, 0), "swiglu": (3, 0),
         "gelu": (2, 0), "loss": (1, 8), "permute": (5, 0), "permute_ep": (9, 0), "combine": (1, 0)}
# A mixture of experts, per element of its k routed copies of each token (fivefold.model.moe.LocalDispatch):
# the gather of the tokens (read, write), the gate weighting (read, write) and index_add's read of it and
# read-modify-write of the output: 7; expert parallelism (AllToAllDispatch) also sorts the received rows
# by expert and unsorts the outputs (read, write each): 11. Fused, the weighting runs inside index_add's
# read: 5 and 9. `combine`, per element of the layer's output: index_add's zeroed base and out-of-place copy.
OPS_PER_LAYER = {False: 45, True: 12}  # kernels per layer forward (backward: twice), eager vs fused
OPTIMIZER_OPS = 20
BREAKDOWN = ("compute", "recompute", "tp", "cp", "ep", "pp", "dp", "bubble", "optimizer", "slowest", "host")


@dataclass
class SpeedPlan:
    step_time_s: float
    tokens_per_step: int
    world: int
    flops_per_token: float
    peak_flops: float
    breakdown: dict[str, float]  # seconds of the step on the critical path (sums to step_time_s)
    profile: str
    micro_batches: int
    bubble_fraction: float  # idle / busy on the busiest pipeline rank
    notes: list[str] = field(default_factory=list)

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_step / self.step_time_s / self.world

    @property
    def mfu(self) -> float:
        return self.tokens_per_s_per_gpu * self.flops_per_token / self.peak_flops

    def to_json(self) -> dict:
        return {"step_time_s": self.step_time_s, "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
                "tokens_per_s": self.tokens_per_s_per_gpu * self.world, "mfu": self.mfu,
                "tokens_per_step": self.tokens_per_step, "gpus": self.world, "profile": self.profile,
                "peak_flops": self.peak_flops, "micro_batches": self.micro_batches,
                "bubble_fraction": self.bubble_fraction,
                "breakdown_s": {k: v for k, v in self.breakdown.items() if v > 0}, "notes": self.notes}

    def table(self) -> str:
        lines = [f"speed on {self.world} x {self.profile}: step {_seconds(self.step_time_s)}, "
                 f"{self.tokens_per_s_per_gpu:,.0f} tokens/s per GPU ({self.tokens_per_s_per_gpu * self.world:,.0f} "
                 f"in all), MFU {100 * self.mfu:.1f}%",
                 "  where the step goes: " + ", ".join(
                     f"{_LABELS[k]} {100 * v / self.step_time_s:.1f}%" for k, v in self.breakdown.items() if v > 0)]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


_LABELS = {"compute": "compute", "recompute": "recompute", "tp": "tp comm", "cp": "cp comm", "ep": "ep comm",
           "pp": "pp comm", "dp": "dp comm", "bubble": "bubble", "optimizer": "optimizer",
           "slowest": "waiting on the slowest GPU", "host": "waiting on the host"}


def _seconds(t: float) -> str:
    return f"{t * 1e3:.1f} ms" if t < 1 else f"{t:.2f} s"


# -- costs ------------------------------------------------------------------------------------------------


def recomputed_matmul_share(m: ModelConfig) -> float:
    """The share of a layer's matmul FLOPs that train.recompute=ops runs again: it keeps every other
    matmul in the order the block runs them (q, k, v, o, then the MLP's, or the router's and the
    experts'), so it recomputes k, o and up of a SwiGLU block."""
    h, q, kv = m.hidden_size, m.q_size, m.kv_size  # each matmul's input x output width, per token
    sizes = [h * q, h * kv, h * kv, q * h]
    if m.num_experts:
        sizes.append(h * m.num_experts)
        widths = [m.experts_per_token * m.expert_size] + ([m.shared_expert_size] if m.shared_expert_size else [])
    else:
        widths = [m.ffn_hidden_size]
    for f in widths:
        sizes += [h * f] * (2 if m.activation == "swiglu" or m.num_experts else 1) + [f * h]
    return sum(sizes[1::2]) / sum(sizes)


def attention_efficiency(hw: HardwareProfile, head_size: int) -> float:
    """The fused attention's share of the peak at `head_size`: the profile's attention_efficiency holds at head
    size 128, and each head's two products (scores, values) run with one dimension `head_size` wide, which
    the profile's attention_knee scales as d / (d + knee) (0: any head size alike). On an H200 cuDNN's flash
    kernels ran a 64-wide head's forward and backward at 31.5% of the peak (bench/results/kernels_h200.json),
    FlashAttention-3's 128-wide ones at ~45% (the profile's figure): a knee of 96."""
    knee = hw.attention_knee
    return hw.attention_efficiency * (head_size / (head_size + knee)) / (128 / (128 + knee))


def matmul_seconds(m: float, k: float, n: float, peak: float, efficiency: float, knee: float) -> float:
    """Seconds of an (m x k) @ (k x n) product: 2 m k n FLOPs at peak x efficiency x prod(d / (d + knee)) over
    the three dimensions (bench/matmul_shapes.py times real products against it and fits the knee)."""
    shape = (m / (m + knee)) * (k / (k + knee)) * (n / (n + knee))
    return 2 * m * k * n / (peak * efficiency * shape)


class _Costs:
    """Seconds of one micro-batch's work on this hardware, by kind."""

    def __init__(self, cfg: Config, hw: HardwareProfile, fused: bool, head_fused: bool | None = None):
        t, p = cfg.train, cfg.parallel
        dtype = "bf16" if t.mixed else "fp32"
        hw = hw.for_dtype(dtype)  # the matmul and attention figures measured in the dtype the step computes in
        self.cfg, self.hw, self.fused = cfg, hw, fused
        self.head_fused = fused if head_fused is None else head_fused
        self.p = 2 if t.mixed else 4
        self.peak = hw.peak_flops(dtype)
        # fp8 (fivefold.train.fp8): the blocks' linears on the fp8 peak where the profile has one, else as
        # bf16; attention, the router and the LM head stay bf16, and MFU stays against the bf16 peak.
        self.linear_peak = (hw.flops.get("fp8") or self.peak) if t.precision == "fp8" else self.peak
        self.tokens = t.micro_batch_size * t.seq_len // p.cp  # per rank and micro-batch
        self.fused_qkv, self.fused_gate_up = cfg.fused_projections(hw.device)  # one product each, or separate
        self.bandwidth = hw.memory_bandwidth * hw.memory_efficiency

    def matmul(self, m: float, k: float, n: float, peak: float | None = None) -> float:
        return matmul_seconds(m, k, n, peak or self.peak, self.hw.matmul_efficiency, self.hw.matmul_knee)

    def linear(self, m: float, k: float, n: float) -> float:
        """A block's linear layer: float8 under train.precision=fp8."""
        return self.matmul(m, k, n, self.linear_peak)

    def bytes(self, kind: str, elements: float, fused: bool | None = None) -> float:
        act, fp32 = (FUSED if (self.fused if fused is None else fused) else UNFUSED)[kind]
        return elements * (act * self.p + fp32) / self.bandwidth

    def layer_matmuls(self) -> float:
        """Forward seconds of one layer's linears: q/k/v as one product and gate/up as one where they run so
        (Config.fused_projections), else each its own, a thin one (GQA's k and v) further below the peak."""
        m, tp, T = self.cfg.model, self.cfg.parallel.tp, self.tokens
        h = m.hidden_size
        if self.fused_qkv:
            out = self.linear(T, h, (m.q_size + 2 * m.kv_size) / tp)
        else:
            out = self.linear(T, h, m.q_size / tp) + 2 * self.linear(T, h, m.kv_size / tp)
        out += self.linear(T, m.q_size / tp, h)
        if m.num_experts:
            ep = self.cfg.parallel.ep
            per_expert = T * m.experts_per_token * ep / m.num_experts  # tokens each local expert gets
            experts = m.num_experts / ep
            out += self.matmul(T, h, m.num_experts)
            # the routed experts' grouped matmuls stay bf16 under fp8 (fivefold.train.fp8)
            out += experts * (self.matmul(per_expert, h, 2 * m.expert_size / tp)
                              + self.matmul(per_expert, m.expert_size / tp, h))
            if m.shared_expert_size:  # its gate and up run as two products (fused projections leave it alone)
                out += 2 * self.linear(T, h, m.shared_expert_size / tp) + self.linear(T, m.shared_expert_size / tp, h)
            return out
        f = m.ffn_hidden_size / tp
        if m.activation != "swiglu":
            up = self.linear(T, h, f)
        else:
            up = self.linear(T, h, 2 * f) if self.fused_gate_up else 2 * self.linear(T, h, f)
        return out + up + self.linear(T, f, h)

    def fp8_casts(self) -> tuple[float, float]:
        """(forward, backward) seconds of one layer's float8 casts under train.precision=fp8 (torchao's dynamic
        tensorwise scaling, fivefold.train.fp8): each matmul of a float8 linear casts both its operands, each
        cast an amax pass and a scaling pass (2p + 1 bytes an element: read twice, one float8 byte written).
        Forward: the input and the weight; backward: the output gradient for each of its two products, the
        weight again and the input again. q, k and v cast their shared input each; the routed experts of a
        mixture stay bf16. On an H100 (Llama-3.2-3B shape, micro-batch 2: bench/results/train_throughput_3b_fp8_
        h100.json) fp8 measured 201.7 ms a step against bf16's 215.3; without the casts the model said 158 ms
        (+28% tokens/s), with them 191 (+5.4%; 195, +3.5%, once the eagerly-run head is costed too)."""
        m, tp, T = self.cfg.model, self.cfg.parallel.tp, self.tokens
        if self.cfg.train.precision != "fp8" or self.linear_peak == self.peak:  # no fp8 tensor cores: as bf16
            return 0.0, 0.0
        h = m.hidden_size
        shapes = [(h, m.q_size / tp), (h, m.kv_size / tp), (h, m.kv_size / tp), (m.q_size / tp, h)]
        f = m.shared_expert_size if m.num_experts else m.ffn_hidden_size
        if f:
            up = 2 if m.activation == "swiglu" or m.num_experts else 1
            shapes += [(h, f / tp)] * up + [(f / tp, h)]
        # Weights cast once a step (train.fp8_weight_cast=step): only the activations and gradients are cast
        # here (the weights after the update: predict_step's optimizer term)
        w = 0 if self.cfg.fp8_cast_once(self.hw.device) else 1
        forward = sum(T * k + w * k * n for k, n in shapes)
        backward = sum(2 * T * n + w * k * n + T * k for k, n in shapes)
        per_element = (2 * self.p + 1) / self.bandwidth
        return forward * per_element, backward * per_element

    def recomputed_matmul_share(self) -> float:
        return recomputed_matmul_share(self.cfg.model)

    @property
    def eager_attention(self) -> bool:
        return self.cfg.model.attention == "eager" and self.cfg.parallel.cp == 1

    def attention(self) -> tuple[float, float]:
        """(forward, backward) seconds of the attention core."""
        m, t, p = self.cfg.model, self.cfg.train, self.cfg.parallel
        heads, s_q, s_kv = m.num_heads / p.tp, self.tokens / t.micro_batch_size, t.seq_len
        full = 4 * t.micro_batch_size * heads * s_q * s_kv * m.head_size
        if self.eager_attention:  # scores materialised, masked, not skipped
            scores = t.micro_batch_size * heads * s_q * s_kv
            forward = full / (self.peak * self.hw.matmul_efficiency) + 6 * scores * self.p / self.bandwidth
            return forward, 2 * forward
        forward = full / 2 / (self.peak * attention_efficiency(self.hw, m.head_size))
        return forward, 2.5 * forward

    def layer_elementwise(self) -> float:
        """Forward seconds of one layer's memory-bound kernels."""
        m, p = self.cfg.model, self.cfg.parallel
        T = self.tokens
        sp = p.tp if p.sequence_parallel else 1
        width = (m.experts_per_token * m.expert_size + m.shared_expert_size) if m.num_experts else m.ffn_hidden_size
        out = self.bytes("norm", 2 * T * m.hidden_size / sp) + self.bytes("residual", 2 * T * m.hidden_size / sp)
        out += self.bytes("heads", T * (2 * m.q_size + 2 * m.kv_size) / p.tp)
        # fused projections concatenate their weights (read and written once a pass); under RoPE v is copied out
        # of the product (fivefold.train.fused_projections)
        weights = self.fused_qkv * (m.q_size + 2 * m.kv_size) + self.fused_gate_up * 2 * m.ffn_hidden_size
        v_copy = self.fused_qkv * (m.position == "rope") * T * m.kv_size
        out += 2 * self.p * (m.hidden_size * weights + v_copy) / p.tp / self.bandwidth
        if m.position == "rope":
            out += self.bytes("rope", T * (m.q_size + m.kv_size) / p.tp)
        if m.num_experts:
            out += self.bytes("permute_ep" if p.ep > 1 else "permute", T * m.experts_per_token * m.hidden_size)
            out += self.bytes("combine", T * m.hidden_size)
        return out + self.bytes("swiglu" if m.activation == "swiglu" else "gelu", T * width / p.tp)

    def head(self) -> tuple[dict[str, float], dict[str, float]]:
        """(forward, backward) seconds of the final norm, LM head and loss, by kernel kind: the head's product
        (backward has two, three with the chunked loss, which makes the logits again) and the loss's and the
        norm's traffic (a third of it forward, two thirds backward)."""
        m, T = self.cfg.model, self.tokens
        matmul = self.matmul(T, m.hidden_size, m.vocab_size / self.cfg.parallel.tp)
        traffic = (self.bytes("loss", T * m.vocab_size / self.cfg.parallel.tp, self.head_fused)
                   + self.bytes("norm", T * m.hidden_size, self.head_fused))
        products = 3 if self.cfg.train.loss_chunk else 2
        return ({"matmul": matmul, "elementwise": traffic / 3},
                {"matmul": products * matmul, "elementwise": 2 * traffic / 3})

    def kernels(self, layers: int) -> int:
        """Kernels one forward of `layers` layers launches (a backward twice as many)."""
        return OPS_PER_LAYER[self.fused] * layers

    def ops(self, layers: int) -> float:
        return self.kernels(layers) * self.hw.op_overhead


def _link(profile: HardwareProfile, stride: int, size: int) -> tuple[float, float, bool]:
    """(bandwidth, latency, crosses nodes) of a group of `size` ranks `stride` apart."""
    if stride * size <= profile.gpus_per_node:
        return profile.intra_node_bandwidth, profile.intra_node_latency, False
    return profile.inter_node_bandwidth, profile.inter_node_latency, True


def collective_seconds(c: Collective, profile: HardwareProfile, cfg: Config) -> float:
    """One call of `c` on the link its group crosses: ring bandwidth term plus a latency per ring step
    (across nodes at most 2 log2(g) steps: NCCL's trees and hierarchical rings)."""
    p = cfg.parallel
    stride = {"tp": 1, "cp": p.tp, "dp": p.tp, "ep": p.tp * p.cp, "pp": p.tp * p.cp * p.dp}[c.dim]
    bandwidth, latency, inter = _link(profile, stride, c.group)
    if not bandwidth:
        return 0.0
    if inter and c.op in ("all_reduce", "all_gather", "reduce_scatter"):
        # NCCL runs a ring collective as several channels, each leaving a node through its own NIC (its
        # topology search, src/graph/search.cc, gives every channel its own net), so a group with k ranks
        # in each node crosses nodes on all k of their NICs: a node's share of the data moves at k times
        # one GPU's link, up to what NVLink carries inside the node. Point-to-point traffic (pipeline sends,
        # all-to-alls, ring attention) leaves each GPU on its own NIC.
        bandwidth = min(profile.intra_node_bandwidth or bandwidth, bandwidth * max(1, profile.gpus_per_node // stride))
    steps = {"all_reduce": 2 * (c.group - 1), "send": 1}.get(c.op, c.group - 1)
    if inter:
        steps = min(steps, 2 * math.ceil(math.log2(c.group)))
    return steps * latency + c.sent / bandwidth


@dataclass
class _Stage:
    """Per-micro-batch seconds of one pipeline rank's chunk, by breakdown category, for F, B and W."""
    F: dict[str, float]
    B: dict[str, float]
    W: dict[str, float]


KERNEL_KINDS = ("matmul", "attention", "elementwise", "launches")


def _pass_kinds(cfg: Config, costs: _Costs, layers: int, last: bool) -> dict[str, dict[str, float]]:
    """Seconds of one micro-batch's forward, backward (with its weight gradients) and recomputation on one
    rank's `layers` (and the final norm, head and loss where `last`), by kernel kind (KERNEL_KINDS)."""
    t = cfg.train
    matmul, (attn_f, attn_b), elem = costs.layer_matmuls(), costs.attention(), costs.layer_elementwise()
    cast_f, cast_b = costs.fp8_casts()
    ops = costs.ops(layers)
    forward = {"matmul": layers * matmul, "attention": layers * attn_f, "elementwise": layers * (elem + cast_f),
               "launches": ops}
    backward = {"matmul": layers * 2 * matmul, "attention": layers * attn_b,
                "elementwise": layers * (2 * elem + cast_b), "launches": 2 * ops}
    recompute = dict.fromkeys(KERNEL_KINDS, 0.0)
    if t.recompute == "full":
        recompute = dict(forward)
    elif t.recompute == "selective":
        recompute["attention"] = layers * attn_f
    elif t.recompute == "ops":  # all but every other matmul and the fused attention (eager's is not kept)
        recompute.update(matmul=layers * matmul * costs.recomputed_matmul_share(), elementwise=layers * elem,
                         attention=layers * attn_f if costs.eager_attention else 0.0, launches=ops)
    if last:
        for passed, head in zip((forward, backward), costs.head()):
            for kind, seconds in head.items():
                passed[kind] += seconds
    return {"forward": forward, "backward": backward, "recompute": recompute}


def _stage_costs(cfg: Config, costs: _Costs, layers: int, last: bool, comm: dict[str, dict[str, float]],
                 split_w: bool) -> _Stage:
    kinds = _pass_kinds(cfg, costs, layers, last)
    forward, backward, recompute = (sum(kinds[name].values()) for name in ("forward", "backward", "recompute"))
    weight = layers * costs.layer_matmuls() if split_w else 0.0  # the weight gradients, a W pass of their own
    F = {"compute": forward, **comm["forward"]}
    B = {"compute": backward - weight, "recompute": recompute, **comm["backward"]}
    return _Stage(F, B, {"compute": weight})


def optimizer_bytes_per_param(cfg: Config) -> int:
    """Bytes one parameter's update moves in fivefold's optimizer (fivefold.train.optim.MasterWeightAdamW): the
    gradient read by the norm; a bf16 gradient copied to fp32 (read, write); the clip's in-place scale (read,
    write); the fused AdamW (master, gradient and both moments read, master and moments written); under bf16
    parameters the master copied back (read, write). 50 under bf16-mixed with clipping: on an H200 the profiled
    step's optimizer kernels moved the 1B's and the 3B's parameters at 56.5 bytes each at 80% of the bandwidth
    (18.2 and 47.3 ms, bench/results/train_throughput_{1b,3b}_profile_h200.json), where Adam's own 36 said 30.
    The compiled update (train.optimizer_impl=compiled, fivefold.train.compiled_adamw) moves 30: the norm's
    read, then one pass reading gradient, master and moments and writing master, moments and parameter."""
    t, p = cfg.train, cfg.parallel
    grad = 4 if not t.mixed or t.fp32_grad_accum or p.zero >= 2 else 2  # ZeRO-2/3 keep fp32 gradient shards
    if t.optimizer_impl == "compiled":  # one kernel a tensor: the gradient read as it is, the parameter written
        return 2 * grad + 24 + t.mixed * 2
    out = grad + (grad == 2) * (2 + 4) + (t.grad_clip > 0) * 8 + 28
    return out + t.mixed * (4 + 2)


def host_bound(cfg: Config, costs: _Costs, layers: int, params: int, device: float, optimizer: float) -> float:
    """The step's time where its host sets it: the device starts a step only once the host has read the last
    one's result and issued the first kernel (host_step_s), and cannot run the optimizer's update before the
    host has issued every micro-batch's forward and backward (OPS_PER_LAYER kernels a layer forward, twice
    that backward, once more for a replay under full or op-level recomputation, at host_launch_s each). So a
    step takes host_step_s plus the longer of the device's own time and the host's issue of the passes
    followed by the longer of the update's device time and its host time (host_param_s per parameter tensor).
    A large model's step is the first (its device lags the host throughout), a small one's the second (the
    135M's 30 blocks' kernels take the host about as long as the device)."""
    hw = costs.hw
    replays = 1 if cfg.train.recompute in ("full", "ops") else 0
    passes = cfg.train.grad_accum * costs.kernels(layers) * (3 + replays) * hw.host_launch_s
    return hw.host_step_s + max(device, passes + max(optimizer, params * hw.host_param_s))


def slowest_of(devices: int, spread: float) -> float:
    """The fraction by which the slowest of `devices` devices takes longer than one typical device, when their
    speeds spread evenly over `spread` (fastest to slowest): the expected maximum of n uniform draws lies
    n / (n + 1) of the way across, the typical one half-way, so spread (n - 1) / (2 (n + 1)). Zero for one
    device, spread / 2 for many: a large job holds both ends of the spread, and its collectives make every
    rank wait for the slowest at every step. Outliers (Sinha et al.: up to 1.5x the median) are left out: a
    production run finds and drains them."""
    return spread * (devices - 1) / (2 * (devices + 1))


def _optimizer_seconds(cfg: Config, profile: HardwareProfile, costs: _Costs, shapes) -> float:
    """The optimizer step's device time on a rank holding `shapes`: Adam's traffic over its (ZeRO: its
    shard of the) parameters, and under fp8 with weights cast once a step the cast after the update."""
    p = cfg.parallel
    local = sum(n for _, n in shapes)
    seconds = (local / (p.dp if p.zero >= 1 else 1)) * optimizer_bytes_per_param(cfg) / costs.bandwidth
    if cfg.fp8_cast_once(profile.device):
        seconds += fp8_cast_seconds(cfg, shapes, costs, profile)
    return seconds


def kernel_time(cfg: Config, profile: HardwareProfile) -> dict[str, float]:
    """Device seconds of one step of a layout without pipeline stages by kernel kind, as predict_step prices
    them: every micro-batch's forward, backward and recomputation (KERNEL_KINDS; "launches" is the model's
    per-kernel overhead), and the optimizer. `bench/train_throughput.py --profile` measures the same kinds
    on CUDA from the kernels' names, which says which term of the model misses where the step's total does."""
    m, p = cfg.model, cfg.parallel
    if p.pp > 1:
        raise ValueError("kernel_time prices one stage: pp must be 1")
    costs = _Costs(cfg, profile, cfg.train.compiled(profile.device), head_fused=cfg.compiled_loss(profile.device))
    kinds = _pass_kinds(cfg, costs, m.num_layers, True)
    out = {kind: cfg.train.grad_accum * sum(kinds[name][kind] for name in kinds) for kind in KERNEL_KINDS}
    out["optimizer"] = _optimizer_seconds(cfg, profile, costs, formulas.parameter_shapes(m, p.tp, ep=p.ep))
    return out


def _exposed(hw: HardwareProfile, seconds: float, window: float, floor: float = 0.0) -> float:
    """Seconds an overlapped collective of `seconds` adds to the critical path when it may hide behind
    `window` seconds of compute, at least `floor` (what must run after the compute, e.g. a last bucket).
    While it is in flight NCCL's kernels hold comm_interference of the SMs, so the compute it overlaps
    runs that much slower: the hidden part still costs comm_interference of itself."""
    return max(floor + hw.comm_interference * max(0.0, seconds - floor), seconds - hw.overlap * window)


def _per_micro_batch_comm(cfg: Config, hw: HardwareProfile, costs: _Costs, stage: int, layers: int,
                          stage_layers: int, compute_f: float, compute_b: float,
                          recompute: float = 0.0) -> dict[str, dict[str, float]]:
    """Exposed communication seconds per micro-batch of one chunk (`layers` of the rank's `stage_layers`),
    forward and backward, by dimension."""
    p, micro = cfg.parallel, cfg.train.grad_accum
    share = layers / stage_layers if stage_layers else 0.0
    fwd: dict[str, float] = {}
    bwd: dict[str, float] = {}
    attn_f, attn_b = costs.attention()
    # Full recomputation replays each block's forward before its backward, collectives included: the
    # tensor-parallel all-reduces (Korthikanti et al. 2022, sec. 4) and expert all-to-alls of the forward
    # run again inside the backward, as do the ring-attention shifts.
    replay = cfg.train.recompute in ("full", "ops")
    gather = gradients = gather_floor = gradients_floor = 0.0  # ZeRO data-parallel traffic, this chunk
    for c in step_collectives(cfg, stage):
        seconds = collective_seconds(c, hw, cfg) * c.count / micro  # per micro-batch, the whole stage
        if c.phase in ("forward", "backward"):
            side = fwd if c.phase == "forward" else bwd
            side[c.dim] = side.get(c.dim, 0.0) + seconds * share
            if replay and c.phase == "forward" and c.count > micro:  # per layer (not the embedding's, the head's)
                bwd[c.dim] = bwd.get(c.dim, 0.0) + seconds * share
        elif c.phase.startswith("ring"):  # each shift hides behind one block of attention compute
            block = (attn_f if c.phase == "ring_forward" else attn_b) / p.cp
            shifts = c.count / micro / max(1, stage_layers) * layers
            side = fwd if c.phase == "ring_forward" else bwd
            one = shifts * _exposed(hw, collective_seconds(c, hw, cfg), block)
            side["cp"] = side.get("cp", 0.0) + one
            if replay and c.phase == "ring_forward":
                bwd["cp"] = bwd.get("cp", 0.0) + one
        elif c.phase == "boundary":
            one = collective_seconds(c, hw, cfg)
            if stage < p.pp - 1:
                fwd["pp"] = fwd.get("pp", 0.0) + one * share
            if stage > 0:
                bwd["pp"] = bwd.get("pp", 0.0) + one * share
        elif c.phase == "gather":  # ZeRO-3: one gather per block, the next prefetched behind this block
            gather += seconds / 2 * share  # forward's, and backward's again
            gather_floor += seconds / 2 * share / max(1, layers)  # the first block's: nothing to hide behind
        elif c.phase == "gradients" and p.zero >= 2:  # reduce-scattered behind every micro-batch's backward
            gradients += seconds * share
            gradients_floor += seconds * share * _last_bucket(cfg, c)
    if gather:
        fwd["dp"] = fwd.get("dp", 0.0) + _exposed(hw, gather, compute_f, gather_floor)
    if gather or gradients:
        # Backward's gathers of the next block and reduce-scatters of the last block's gradients cross the
        # same links at the same time, so they hide behind the backward (the recomputed forward included:
        # it runs inside the backward, on parameters already gathered) together, not each on its own.
        bwd["dp"] = bwd.get("dp", 0.0) + _exposed(hw, gather + gradients, compute_b + recompute,
                                                  gather_floor + gradients_floor)
    return {"forward": fwd, "backward": bwd}


def _last_bucket(cfg: Config, c: Collective) -> float:
    """Fraction of a bucketed gradient reduction that runs after backward is over (its last bucket)."""
    return min(1.0, cfg.parallel.bucket_mb * 2**20 / max(c.size, 1.0))


# -- the step ---------------------------------------------------------------------------------------------


# train.fp8_weight_cast=step's cast after the update (fivefold.train.fp8.cast_weights). Eager, weight by weight:
# bytes an element beyond 2 p (amax and the fp32 copy read the weight): the fp32 copy written (4), the product
# (4 + 4), its clamp (4 + 4), the float8 copy (4 + 1), that copied into place (1 + 1); kernels a weight (the
# fp32 copy, product, clamp, float8 copy, copy into place, its scale) and for all of them (the inf-norms, the
# scales). Compiled (where the blocks compile): one kernel a weight, reading it and writing the float8 copy.
FP8_CAST_BYTES, FP8_CAST_OPS_PER_WEIGHT, FP8_CAST_OPS = 27, 6, 8
FP8_CAST_BYTES_COMPILED, FP8_CAST_OPS_PER_WEIGHT_COMPILED = 1, 1


def fp8_cast_seconds(cfg: Config, shapes, costs: _Costs, profile: HardwareProfile) -> float:
    """Seconds of casting the float8 weights once a step (under ZeRO-3 each rank its rows): its memory
    passes, or its kernel launches where those take longer."""
    weights = formulas.fp8_weights(shapes)
    elements = sum(weights) / (cfg.parallel.dp if formulas.fp8_gathered(cfg) else 1)
    compiled = cfg.train.compiled(profile.device)
    extra, per_weight = ((FP8_CAST_BYTES_COMPILED, FP8_CAST_OPS_PER_WEIGHT_COMPILED) if compiled
                         else (FP8_CAST_BYTES, FP8_CAST_OPS_PER_WEIGHT))
    memory = elements * (2 * costs.p + extra) / costs.bandwidth
    return max(memory, (per_weight * len(weights) + FP8_CAST_OPS) * profile.op_overhead)


def predict_step(cfg: Config, profile: HardwareProfile, fused: bool | None = None,
                 at_least: float = 0.0) -> SpeedPlan | None:
    """Step time, throughput, MFU and the breakdown of training `cfg` on `profile` devices. `fused`:
    assume fused elementwise kernels everywhere, as published frameworks' fused kernels give (default:
    fivefold's own, where train.compile compiles the blocks on the profile's device, and the final norm and
    the loss where Config.compiled_loss says so; eager, their unfused traffic is 7 ms of a 1B step at
    micro-batch 4 on an H100, and 5.5 of the 8.3 ms by which smollm2-135m's measured 83 ms step exceeded
    the all-fused prediction (the stored H100 runs' loss was eager: train.compile=blocks))
    `at_least` (tokens/s per device): None when even a pipeline without bubble would not reach it (the
    search skips the simulation)."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    own = fused is None
    fused = t.compiled(profile.device) if own else fused
    costs = _Costs(cfg, profile, fused, head_fused=cfg.compiled_loss(profile.device) if own else fused)
    v = p.pp_virtual_stages if p.pp_schedule == "interleaved" else 1
    parts = formulas.partition(m.num_layers, p.pp * v, p.pp_layers)
    split_w = p.pp_schedule == "zero-bubble" and p.pp > 1
    stages: dict[tuple[int, int], _Stage] = {}
    for rank in range(p.pp):
        stage_layers = sum(len(parts[c * p.pp + rank]) for c in range(v))
        for chunk in range(v):
            index = chunk * p.pp + rank
            layers = len(parts[index])
            last = index == p.pp * v - 1
            # Compute first: it is the window the overlapped collectives can hide behind.
            compute = _stage_costs(cfg, costs, layers, last, {"forward": {}, "backward": {}}, split_w)
            comm = _per_micro_batch_comm(cfg, profile, costs, rank, layers, stage_layers,
                                         compute.F["compute"], compute.B["compute"], compute.B["recompute"])
            stages[rank, chunk] = _stage_costs(cfg, costs, layers, last, comm, split_w)

    micro = t.grad_accum
    tokens = t.micro_batch_size * micro * p.dp * t.seq_len
    if at_least:
        busy = max(micro * sum(sum(getattr(stages[r, c], kind).values()) for c in range(v) for kind in "FBW")
                   for r in range(p.pp))
        if tokens / busy / p.world_size < at_least:
            return None
    schedule = p.pp_schedule if p.pp > 1 else "1f1b"
    totals = {(rank, chunk, kind): sum(getattr(stage, kind).values())
              for (rank, chunk), stage in stages.items() for kind in "FBW"}
    timeline = simulate_schedule(schedule, p.pp, micro, v, totals)
    busiest = max(range(p.pp), key=timeline.busy)
    breakdown = dict.fromkeys(BREAKDOWN, 0.0)
    for action in rank_schedule(schedule, p.pp, micro, busiest, v):
        for key, seconds in getattr(stages[busiest, action.chunk], action.kind).items():
            breakdown[key] += seconds
    breakdown["bubble"] = timeline.makespan - timeline.busy(busiest)

    # After the last backward: the gradient reduction beyond what the last backward hides, the optimizer.
    shapes = formulas.parameter_shapes(
        m, p.tp, formulas.rank_layers(m.num_layers, p.pp, busiest, p.pp_virtual_stages, p.pp_layers),
        busiest == 0, busiest == p.pp - 1, p.ep)
    optimizer = _optimizer_seconds(cfg, profile, costs, shapes) + OPTIMIZER_OPS * profile.op_overhead
    last_backward = sum(stages[busiest, c].B["compute"] for c in range(v)) / v
    for c in step_collectives(cfg, busiest):
        seconds = collective_seconds(c, profile, cfg) * c.count
        if c.phase == "gradients" and p.zero <= 1:
            breakdown["dp"] += _exposed(profile, seconds, last_backward, seconds * _last_bucket(cfg, c))
        elif c.phase == "after_step":
            breakdown["dp"] += _exposed(profile, seconds, optimizer)
    breakdown["optimizer"] = optimizer
    own_work = breakdown["compute"] + breakdown["recompute"] + optimizer
    breakdown["slowest"] = own_work * slowest_of(p.world_size, profile.speed_spread)
    device = sum(breakdown.values())
    layers = sum(len(parts[c * p.pp + busiest]) for c in range(v))
    breakdown["host"] = host_bound(cfg, costs, layers, len(shapes), device, optimizer) - device
    step = sum(breakdown.values())
    notes = []
    if p.tp > 1 and _link(profile, 1, p.tp)[2]:
        notes.append(f"tp={p.tp} spans more than one node of {profile.gpus_per_node}: its collectives use the "
                     f"inter-node link")
    if p.cp > 1 and profile.device != "cpu":
        notes.append(f"cp={p.cp}: attention is timed as a fused kernel per ring block, which fivefold runs on "
                     f"the CPU; on CUDA its ring blocks are still explicit matmuls (slower, and their scores "
                     f"take memory: see the memory notes)")
    if not profile.intra_node_bandwidth and p.world_size > 1:
        notes.append(f"profile {profile.name!r} has no link figures: communication is not timed")
    if t.precision == "fp8":
        notes.append("fp8: the blocks' linears at the fp8 peak, their float8 casts as memory passes; MFU against "
                     "the bf16 peak" if profile.flops.get("fp8") else
                     f"fp8: profile {profile.name!r} has no fp8 matmul figure (no fp8 tensor cores): the linears "
                     f"are timed as bf16")
    return SpeedPlan(step_time_s=step, tokens_per_step=tokens, world=p.world_size,
                     flops_per_token=formulas.flops_per_token(m, t.seq_len), peak_flops=costs.peak,
                     breakdown=breakdown, profile=profile.name, micro_batches=micro,
                     bubble_fraction=timeline.bubble, notes=notes)
