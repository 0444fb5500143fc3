"""`plan_memory(cfg)`: memory per rank before launch, from the config alone (no model is built).

Per category, for the most loaded rank (the pipeline stage whose total is largest):

  parameters        p bytes per local parameter; / dp under ZeRO-3
  gradients         p bytes per parameter (fp32 main gradients: 4, plus the one bf16 gradient that is
                    live while the accumulation hook folds it in); / dp under ZeRO-2 and 3
  optimizer_states  Adam moments (8) + fp32 masters under bf16-mixed (4): ZeRO's K = 12; / dp from ZeRO-1
  activations       the forward replay of fivefold.memory.activations for one micro-batch, times the
                    micro-batches the pipeline schedule keeps in flight
  temporary         the largest short-lived buffers: loss gradients at the start of backward, the
                    optimizer step's intermediates, ZeRO-3's gathered layers, the token batch
  total             parameters + optimizer states + the larger of (forward/backward: activations,
                    their gradients, and the gradients already held) and (optimizer step: gradients
                    and the step's intermediates)
  startup           the peak while the rank materialises its part: its parameters, fp32 masters and
                    up-front gradient buffers, plus the one full fp32 parameter being made

Local parameters follow Megatron-LM's tensor-parallel split and the pipeline stage's layers
(formulas.parameter_shapes); ZeRO stages follow Rajbhandari et al. 2020; the sharded data-parallel
group is dp (expert parallelism has nothing to split until the model has experts).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from dataclasses import dataclass, field

from fivefold.config import Config, ConfigError
from fivefold.config_checks import recompute_layer_set
from fivefold.finetune.qlora import quantized_weight_bytes
from fivefold.memory import formulas, model_states
from fivefold.memory.activations import replay_forward
from fivefold.memory.backward_temporaries import (labels_copy_bytes, layer_backward_bytes, layer_backward_parts,
                                                  loss_backward_bytes)
from fivefold.memory.communication import step_communication
from fivefold.memory.replay import Shapes
from fivefold.memory.units import CATEGORIES, human_bytes, parse_bytes
from fivefold.model.moe import expert_capacity
from fivefold.parallel.pipeline_schedules import peak_held, rank_schedule
from fivefold.parallel.rules import check_layout
from fivefold.presets import PRESETS


def scores_materialised(cfg: Config, device: str) -> bool:
    """Whether attention stores the (b, heads, s, s) probabilities for backward.

    eager: always. CPU SDPA: never (its flash kernel covers fp32/bf16, GQA and boolean masks; measured
    by tests/test_memory_measured.py). CUDA SDPA (not measured here): flash covers bf16 with a causal
    mask, GQA included; otherwise the memory-efficient kernel, which has no GQA, so fp32 or a document
    mask together with GQA falls back to the math kernel, which does store them (modelled as eager)."""
    m = cfg.model
    if m.attention == "eager":
        return True
    if device != "cuda":
        return False
    flash = cfg.train.mixed and not m.document_mask
    return not flash and m.num_kv_heads != m.num_heads


def _weight_pass_bytes(d) -> int:
    """What one layer's deferred weight gradients keep for a zero-bubble W pass: each linear's input
    (q/k/v share one, gate/up another) and output gradient."""
    inputs = d.h + d.q + d.h + d.f
    grads = d.q + 2 * d.kv + d.h + (2 if d.swiglu else 1) * d.f + d.h
    return d.p * d.b * d.s * (inputs + grads)


def compiled_blocks_modelled(cfg: Config, device: str) -> bool:
    """Whether the activations replay compiled blocks (replay_compiled.compiled_block): train.compile on
    `device` with the blocks that list was checked for against torch.compile's partitioner: dense
    RMSNorm / SwiGLU / RoPE blocks of PyTorch ops (train.kernels=torch) under flash-style SDPA, in any
    precision (fp8: torchao's float8 linears) without recomputation, or in bf16 / fp32 without LoRA under any
    train.recompute (ops: eager's op-level policy less the block's last product, which no backward reads;
    selective: without the attention core's output; full: the block input), no tensor, sequence or context
    parallelism, no QLoRA (LoRA is: its adapters' A outputs, dropout's masks and dropped inputs, and only the
    activations something trained needs), no document mask. Any other compiled run replays the eager model's saved
    tensors (an upper bound: the partitioner saves no more than eager does)."""
    m, t, par = cfg.model, cfg.train, cfg.parallel
    return (t.compiled(device) and (t.recompute == "none" or (t.precision != "fp8" and not cfg.lora.r))
            and t.kernels == "torch"
            and not m.num_experts and m.norm == "rmsnorm" and m.activation == "swiglu" and m.position == "rope"
            and not m.document_mask and not scores_materialised(cfg, device) and par.tp == 1 and par.cp == 1
            and cfg.lora.quantize_base == "none")


def activation_shapes(cfg: Config, device: str = "cuda") -> Shapes:
    m, t, par = cfg.model, cfg.train, cfg.parallel
    p = 2 if t.mixed else 4
    tp = par.tp
    fused = cfg.fused_projections(device)
    return Shapes(b=t.micro_batch_size, s=math.ceil(t.seq_len / par.cp), sk=t.seq_len, h=m.hidden_size,
                  q=m.q_size // tp, kv=m.kv_size // tp, heads=m.num_heads // tp,
                  f=math.ceil(_ffn_width(m) / tp), vocab=math.ceil(m.vocab_size / tp), head_size=m.head_size,
                  p=p, rep=1 / tp if par.sequence_parallel else 1.0, rms=m.norm == "rmsnorm",
                  swiglu=m.activation == "swiglu", sdpa=not scores_materialised(cfg, device) or par.cp > 1,
                  ring=par.cp > 1,
                  rope=m.position == "rope", groups=m.num_heads // m.num_kv_heads,
                  doc_mask=m.document_mask and par.cp == 1,  # ring attention masks block by block
                  stats_bytes=4 if device == "cuda" else p,
                  adapters=tuple(cfg.lora.target_list) if cfg.lora.r else (), rank=cfg.lora.r,
                  adapter_dropout=cfg.lora.r > 0 and cfg.lora.dropout > 0,
                  loss_chunk=t.loss_chunk, vocab_parallel=tp > 1, tp_reduce=tp > 1 and not par.sequence_parallel,
                  fp8=t.precision == "fp8", fp8_emulated=device != "cuda", fp8_precast=cfg.fp8_cast_once(device),
                  biased=("q", "k", "v", "o", "gate", "up", "down") if m.linear_bias else
                  ("q", "k", "v") if m.qkv_bias else (),
                  experts=m.num_experts, topk=m.experts_per_token if m.num_experts else 0,
                  expert_f=math.ceil(m.expert_size / tp) if m.num_experts else 0,
                  shared_f=math.ceil(m.shared_expert_size / tp) if m.num_experts else 0,
                  ep=par.ep if m.num_experts else 1, capacity=_capacity(cfg),
                  compiled=compiled_blocks_modelled(cfg, device), compiled_loss=cfg.compiled_loss(device),
                  fused_qkv=fused[0], fused_gate_up=fused[1],
                  labels_copy=t.micro_batch_size > 1 and not cfg.data.sft and par.cp == 1)


def _capacity(cfg: Config) -> int:
    """Assignments one expert takes at most per micro-batch and rank (MoE._within_capacity); 0: dropless."""
    m, t = cfg.model, cfg.train
    if not m.num_experts:
        return 0
    tokens = t.micro_batch_size * math.ceil(t.seq_len / cfg.parallel.cp)
    return expert_capacity(m.capacity_factor, tokens, m.experts_per_token, m.num_experts)


@dataclass
class StagePlan:
    stage: int
    layers: int
    params: int  # on one rank of this stage, before ZeRO
    memory: dict[str, float]
    in_flight: float
    activation_detail: dict[str, float]


@dataclass
class MemoryPlan:
    params: int
    active_params: int
    memory: dict[str, float]  # most loaded rank: CATEGORIES + total
    params_per_rank: int
    stage: int
    stages: list[StagePlan]
    device: str
    device_memory: int | None = None
    notes: list[str] = field(default_factory=list)
    suggestions: list[str] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    communication: dict = field(default_factory=dict)  # bytes sent per step by dimension (communication.py)
    keep_checkpoints: int = 1
    adapters: int = 0  # LoRA's trainable parameters (the rest is a frozen base); 0: every parameter trains

    @property
    def checkpoint_bytes(self) -> int:
        """One checkpoint on disk (the trainer checks free space against it): what trains, with its moments."""
        return (self.adapters or self.params) * formulas.CHECKPOINT_BYTES_PER_PARAM

    @property
    def checkpoint_disk_bytes(self) -> int:
        """keep_checkpoints of them, and one being written."""
        return self.checkpoint_bytes * (self.keep_checkpoints + 1)

    @property
    def fits(self) -> bool | None:
        return None if self.device_memory is None else self.memory["total"] <= self.device_memory

    def to_json(self) -> dict:
        most = self.stages[self.stage]
        return {"params": self.params, "active_params": self.active_params, "params_per_rank": self.params_per_rank,
                "adapters": self.adapters,
                "memory": {k: int(round(v)) for k, v in self.memory.items()},
                "device_memory": self.device_memory, "fits": self.fits, "device": self.device,
                "most_loaded_stage": self.stage, "micro_batches_in_flight": most.in_flight,
                "activations_detail": {k: int(round(v)) for k, v in most.activation_detail.items()},
                "communication_bytes_per_step": {k: int(v) for k, v in self.communication.items()},
                "checkpoint_bytes": self.checkpoint_bytes,
                "checkpoint_disk_bytes": self.checkpoint_disk_bytes,
                "notes": self.notes, "suggestions": self.suggestions, "config": self.summary}

    def table(self) -> str:
        s = self.summary
        lines = [f"{s['model']}: {s['precision']}, recompute={s['recompute']}, attention={s['attention']}, "
                 f"micro-batch {s['micro_batch_size']} x seq {s['seq_len']}, grad_accum {s['grad_accum']}",
                 f"parallel: dp={s['dp']} tp={s['tp']} pp={s['pp']} cp={s['cp']} ep={s['ep']} zero={s['zero']} "
                 f"sp={s['sequence_parallel']} schedule={s['pp_schedule']}; device model: {self.device}",
                 f"parameters: {self.params:,} (active {self.active_params:,}); on the most loaded rank "
                 f"(pipeline stage {self.stage}): {self.params_per_rank:,}",
                 f"LoRA: {self.adapters:,} adapter parameters train ({100 * self.adapters / self.params:.2f}% of the "
                 f"model); the base is frozen: no gradients, no optimizer states" if self.adapters else None, ""]
        dm = self.device_memory
        header = f"{'category':18s} {'bytes per rank':>18s} {'':>10s}" + (f" {'% of device':>12s}" if dm else "")
        lines.append(header)
        for name in CATEGORIES + ("total",):
            value = self.memory[name]
            row = f"{name.replace('_', ' '):18s} {value:>18,.0f} {human_bytes(value):>10s}"
            if dm:
                row += f" {100 * value / dm:>11.1f}%"
            lines.append(row)
        startup = self.memory["startup"]
        lines.append(f"{'start-up peak':18s} {startup:>18,.0f} {human_bytes(startup):>10s}"
                     + (f" {100 * startup / dm:>11.1f}%" if dm else "")
                     + "  (building this rank's part: shards only, one full parameter at a time)")
        if dm:
            verdict = "fits" if self.fits else "DOES NOT FIT"
            lines.append(f"\n{verdict} in {human_bytes(dm)} ({human_bytes(dm - self.memory['total'])} left)"
                         if self.fits else f"\n{verdict} in {human_bytes(dm)}")
        if self.communication:
            lines.append("sent per step and rank: " + ", ".join(f"{k} {human_bytes(v)}" for k, v in
                                                              self.communication.items()))
        if self.checkpoint_bytes:
            lines.append(f"checkpoint on disk: {human_bytes(self.checkpoint_bytes)} each; "
                         f"{human_bytes(self.checkpoint_disk_bytes)} with "
                         f"train.keep_checkpoints={self.keep_checkpoints} and one being written")
        for note in self.notes:
            lines.append(f"note: {note}")
        if self.suggestions:
            lines.append("to fit, change one of:" if self.suggestions[0][0] != "!" else "")
            lines.extend(f"  {s}" for s in self.suggestions)
        return "\n".join(line for line in lines if line is not None)


# ---------------------------------------------------------------------------------------------------


def _stage_plan(cfg: Config, stage: int, device: str, limit: float | None = None) -> StagePlan | None:
    m, t, par = cfg.model, cfg.train, cfg.parallel
    mixed, accum32 = t.mixed, t.fp32_grad_accum
    bpp = formulas.bytes_per_param(t.precision, accum32)
    dp, zero = par.grad_size, par.zero  # ZeRO shards over the gradient group, dp x cp
    layers = formulas.rank_layers(m.num_layers, par.pp, stage, par.pp_virtual_stages, par.pp_layers)
    first, last = stage == 0, stage == par.pp - 1
    shapes = tuple(formulas.parameter_shapes(m, par.tp, layers, first, last, par.ep))
    # With LoRA the base is frozen: parameters only; gradients and optimizer states are the adapters'.
    adapters = tuple(formulas.adapter_shapes(m, cfg.lora, par.tp, layers))
    frozen = model_states.inventory(shapes).n if adapters else 0
    frozen_bytes = bpp.parameters * frozen
    if cfg.lora.quantize_base != "none":  # QLoRA: the blocks' linears as int4 codes + group scales
        linear = sum(k for name, k in shapes if re.fullmatch(r"layers\.\d+\.(attn|mlp)\.\w+_proj\.weight", name))
        frozen_bytes += quantized_weight_bytes(linear, cfg.lora.group_size) - bpp.parameters * linear
    shapes = shapes + adapters
    trained = adapters or shapes
    inv = model_states.inventory(trained)
    n = inv.n

    def shard(count: float, from_stage: int) -> float:  # ZeRO partitions over the data-parallel group
        return math.ceil(count / dp) if zero >= from_stage else count

    # train.fp8_weight_cast=step: the float8 linears' weights cast once a step, 1 byte an element (under
    # ZeRO-3 this rank's rows, the float8 all-gather's source), and a 4-byte scale per weight
    fp8_weights = formulas.fp8_weights(shapes) if cfg.fp8_cast_once(device) else []
    fp8_gathered = formulas.fp8_gathered(cfg)
    # After the step (and at start-up) each float8 weight (under ZeRO-3 this rank's rows) is cast, one at a
    # time: eager, x.float() and then x.float() * scale, 8 bytes an element (fivefold.train.fp8.to_weight_float8);
    # compiled (where the blocks compile), one fused kernel from the bf16 rows into the float8 ones: nothing
    fp8_cast = 0 if t.compiled(device) else 8 * shard(max(fp8_weights, default=0), 3)
    memory = {"parameters": frozen_bytes + bpp.parameters * shard(n, 3) + shard(sum(fp8_weights), 3)
              + 4 * len(fp8_weights),
              "gradients": model_states.gradients(cfg, trained, inv, bpp)}
    memory["optimizer_states"] = bpp.optimizer_states * shard(n, 1)
    if limit is not None and sum(memory.values()) > limit:
        return None  # the model states alone do not fit: no need to replay the activations

    d = activation_shapes(cfg, device)
    recomputed = recompute_layer_set(t.recompute_layers, m.num_layers, t.recompute)
    chosen = tuple(i in recomputed for i in layers) if t.recompute != "none" else None
    replay = replay_forward(d, len(layers), t.recompute, embed=first, head=last, chosen=chosen)
    micro_batches = t.grad_accum
    in_flight = formulas.micro_batches_in_flight(par.pp_schedule, par.pp, stage, micro_batches,
                                                 par.pp_virtual_stages)
    # Earlier micro-batches waiting for their backward: what autograd saved, and on a stage before the
    # last the output it sent on, which the executor keeps to start that backward from
    # (fivefold.parallel.pipeline: `held`).
    kept = replay.saved_bytes + (d.p * d.bsh if not last else 0.0)
    held = (in_flight - 1) * kept
    zero_bubble = par.pp_schedule == "zero-bubble" and par.pp > 1
    if zero_bubble:
        # Micro-batches past their B keep what their W pass needs until it runs.
        actions = rank_schedule("zero-bubble", par.pp, micro_batches, stage)
        held = peak_held(actions, kept, len(layers) * _weight_pass_bytes(d)) - kept
    saved_end = replay.saved_bytes
    act_peak = held + max(replay.peak, replay.backward_peak)
    memory["activations"] = act_peak

    # Temporaries. At the start of backward the loss gradients sit beside every saved activation (last
    # stage); inside a block's backward its activation gradients do, and the LM head's weight gradient
    # (in .grad, or for tied embeddings in autograd's input buffer until the embedding's arrives).
    layer_t = layer_backward_bytes(d) if len(layers) else 0.0
    head_grad = d.p * d.vocab * m.hidden_size if last and not adapters else 0.0
    loss_t = loss_backward_bytes(d, head_grad) if last else 0.0
    tied_pending = head_grad if m.tie_embeddings and first and last else 0.0
    # The optimizer steps one unit (a block, the embedding, the head; unsharded, neighbours joined up to the
    # largest unit's size) at a time; within a unit, foreach AdamW makes sqrt(exp_avg_sq) per param group,
    # and bf16-mixed an fp32 copy of the unit's gradients (not the compiled update, which reads them as bf16).
    # Without a gradient reducer or fp32 buffers the step takes the .grad tensors over (then they are
    # temporaries), and releases a unit's bf16 gradients once one foreach copy has made their fp32 copies:
    # a unit then adds 4 bytes per parameter while it copies, 2 after.
    handed = memory["gradients"] if dp == 1 and not accum32 else 0.0
    # ZeRO-1/2 all-gather each unit's updated parameters as soon as it is stepped (fivefold.parallel.zero:
    # publish), into a full-size buffer beside the packed local shard, and copy them into the parameters
    # only after the last unit (finish_publish): the buffers pile up through the step.
    publishing = 1 <= zero <= 2 and dp > 1
    step = published = released = 0.0
    for decay, rest in (inv.units if zero and dp > 1 else inv.joined):  # (the optimizer's step_chunks)
        foreach = 4 * max(shard(decay, 1), shard(rest, 1)) if t.optimizer_impl == "foreach" else 0
        size = shard(decay + rest, 1)
        if t.optimizer_impl == "compiled":  # one kernel a tensor reads the gradients as they are: no copies
            unit = 0
        elif not mixed or accum32:
            unit = foreach
        elif handed:  # the copies made, then either their bf16 sources or foreach's temporaries
            unit = 2 * size + max(2 * size, foreach)
        else:
            unit = 4 * size + foreach
        step = max(step, published - released + unit)
        if handed:  # the unit's gradients, taken over, are released with it
            released += bpp.gradients * size
        if publishing:
            published += bpp.parameters * (dp + 1) * size
    if publishing:  # a parameter sharing its unit is reassembled from strided rows: one copy at a time
        step = max(step, published + bpp.parameters * inv.largest_shared)
    gather = gather_root = gather_forward = 0.0
    if zero == 3 and dp > 1 and len(layers):
        # FSDP: the root (embeddings, norm, head) gathered from forward to the end of backward; while the
        # blocks run (forward and backward) the current and the prefetched layer beside it; the head, the
        # loss and backward's start meet the root alone. `gather` bounds the temporaries with one layer's
        # full gradients besides; in the total a block's backward counts its own (_block_backward).
        layer = d.p * formulas.layer_params(m) // par.tp
        # float8-gathered weights: 1 byte each
        gathered = layer - (d.p - 1) * sum(fp8_weights) / len(layers) if fp8_gathered else layer
        gather_root = d.p * inv.root
        gather_forward, gather = gather_root + 2 * gathered, gather_root + 2 * gathered + layer
    if zero <= 1 and accum32:  # the fp32 accumulation buffers are packed in place of the .grads, and stay
        reduce_end, reduce_t = model_states.reductions(cfg, inv, trained, 0, 0.0, bpp.main_gradients * n)
    else:
        reduce_end, reduce_t = model_states.reductions(cfg, inv, trained, bpp.gradients,
                                           bpp.gradients * n if zero <= 1 and t.grad_accum > 1 else 0.0)
    batch = batch_bytes(cfg)
    memory["temporary"] = max(loss_t + gather_root, layer_t + tied_pending, handed + step, gather, reduce_t,
                              fp8_cast) + batch

    held_grads = 0.0  # gradients alive while activations are: fp32 buffers, or accumulation
    shards = zero >= 2 and dp > 1  # ZeRO-2/3's fp32 gradient shards: kept from step to step, and each
    if accum32:                    # micro-batch's gradients are reduce-scattered into them
        held_grads = bpp.main_gradients * shard(n, 2)
    elif shards:
        held_grads = 4 * shard(n, 2)
    elif t.grad_accum > 1:
        held_grads = memory["gradients"]
    # All-forward-all-backward runs every forward, and its first backward, before the step has made any
    # gradient (.grad is None from zero_grad until then): accumulated gradients only meet one micro-batch
    # fewer held. Buffers that persist from step to step (fp32 accumulation, ZeRO-2/3 shards) meet all.
    afab_first = par.pp_schedule == "afab" and par.pp > 1 and held_grads and not (accum32 or shards)
    in_block = in_block_first = 0.0
    top = head_grad + d.p * inv.final_norm  # the gradients made before the blocks' backward
    if len(layers):
        # This rank's block and MLP parameters (split by tp, a mixture of experts' by ep too); with LoRA
        # only the adapters' gradients are made. Before a block's attention core's backward: the MLP's,
        # its norm's and o_proj's.
        mlp, after_core = d.p * inv.mlp / len(layers), d.p * inv.after_core / len(layers)
        grads = (top, mlp, after_core, d.p * n / len(layers) if adapters else d.p * max(inv.blocks))
        modes = [t.recompute if chosen is None or c else "none" for c in chosen or [True] * len(layers)]
        extra = tied_pending + (d.p * d.bsh if not last else 0.0)  # a stage before the last: the output
        # it backpropagates from stays with the executor until the backward ends
        if zero == 3 and dp > 1:
            # ZeRO-3 reduce-scatters a block's full gradients into the shards and releases them as its
            # backward ends, the root's (head, final norm) only at the end of backward: a block's backward
            # meets the root's and its own made so far, with or without accumulation.
            block_grads = (top, mlp, after_core, 0.0)
        else:  # accumulating: into the .grads (or fp32 buffers, shards) held already
            block_grads = grads if not held_grads else (0, 0, 0, 0)
        in_block = held + _block_backward(replay, d, modes, *block_grads, deferred=zero_bubble) + extra
        if afab_first:
            in_block_first = held + _block_backward(replay, d, modes, *grads) + extra
    embedding = 0.0
    if first and not last and not adapters:
        # The embedding's weight gradient, made dense at the end of a micro-batch's backward while the
        # later micro-batches are still held (one process has freed every activation by then), beside
        # the output and the incoming gradient.
        embedding = held + 2 * d.p * d.bsh + d.p * d.vocab * m.hidden_size
    # The loss's backward peaks in log_softmax's, after nll_loss's has released the labels it saved.
    loss_saved = saved_end - (labels_copy_bytes(d) if last else 0.0)
    # ZeRO-3 holds the current and the prefetched block gathered only while the blocks run: the head's and
    # the loss's forward, and backward's start, meet the root alone.
    before_backward = max(act_peak + gather_root, held + replay.blocks_peak + gather_forward,
                          held + loss_saved + loss_t + gather_root)
    final_norm = 0.0
    if last and replay.before_loss and d.rms:
        # The final RMSNorm's backward, once the loss's saved tensors are released: its composite's
        # intermediates beside the gradient it receives (the chunked loss's is small enough for this to
        # be the peak, above all with a frozen head); by then it has released its saved rsqrt and, for
        # the gain's gradient, its normalised input.
        released = 4 * d.bs + (d.p * d.bsh if not d.adapters else 0.0)
        final_norm = (held + replay.before_loss - released + layer_backward_parts(d)["norm"]
                      + (top if not held_grads else 0.0))
    in_backward = max(in_block + gather_forward, embedding + gather_root, final_norm + gather_root)
    if afab_first:  # the first backward without gradients; the later ones with them, one held fewer
        forward_backward = max(before_backward, in_block_first + gather_forward, in_backward - kept + held_grads)
    else:
        forward_backward = max(before_backward, in_backward) + held_grads
    # The end of backward: activations gone, the last (largest: under ZeRO-3 the root) gradient
    # reductions in flight beside every gradient shard.
    forward_backward = max(forward_backward, reduce_end)
    # The step reads the reduced fp32 shards (and under ZeRO-1 keeps any fp32 accumulation buffers); the
    # full gradients were released into the reduction.
    at_step = ((bpp.main_gradients * n if accum32 and zero == 1 else 0.0) + 4 * shard(n, 1) if publishing
               else memory["gradients"])
    optimizer_step = at_step + step
    memory["total"] = (memory["parameters"] + memory["optimizer_states"]
                       + max(forward_backward, optimizer_step) + batch)
    memory["startup"] = model_states.startup(cfg, shapes, memory["parameters"], shard, n, bool(adapters), fp8_cast)
    detail = {"saved_per_micro_batch": saved_end, "forward_peak": replay.peak,
              "recompute_peak": replay.backward_peak, "held_micro_batches": held}
    return StagePlan(stage, len(layers), frozen + n, memory, in_flight, detail)


def batch_bytes(cfg: Config) -> int:
    """The step's token ids as a rank holds them, int64: every rank reads the whole global batch, micro-batch x
    grad_accum x dp windows of seq_len + 1 tokens, whose inputs and labels are views; fine-tuning data makes
    its labels as a tensor of their own; under context parallelism each rank copies its columns of the inputs
    and the labels (and of the documents' ids when they mask attention)."""
    t, p = cfg.train, cfg.parallel
    n = t.micro_batch_size * t.grad_accum * p.dp
    ids = n * (t.seq_len + 1) + (n * t.seq_len if cfg.data.sft else 0)
    if p.cp > 1:
        ids += (2 + cfg.model.document_mask) * n * math.ceil(t.seq_len / p.cp)
    return 8 * ids


def stage_total(cfg: Config, stage: int, device: str, limit: float) -> float:
    """Peak bytes of one pipeline stage's rank, or infinity once the model states alone pass `limit` (the
    layout search's test of fit; cfg already validated)."""
    plan = _stage_plan(cfg, stage, device, limit)
    return math.inf if plan is None else plan.memory["total"]


def _ffn_width(m) -> int:
    """Hidden width each token's feed-forward activations have: the dense MLP's, or under MoE the k
    chosen experts' plus the shared expert's."""
    if m.num_experts:
        return m.experts_per_token * m.expert_size + m.shared_expert_size
    return m.ffn_hidden_size


def _block_backward(replay, d: Shapes, modes: list[str], top_grad: float, mlp_grad: float, core_grad: float,
                    layer_grad: float, deferred: bool = False) -> float:
    """Activations + temporaries + gradients made so far at the largest point of a block's backward:
    its MLP backward with the whole block saved; its attention backward once the MLP's tensors are
    gone and the MLP's and the output projection's gradients made (eager: its input, v and the bf16
    probabilities are released by then); under recomputation, with the recomputed tensors back.
    Saved activations shrink and gradients grow linearly as backward moves down the layers, so the
    largest point is in the last block or in the first of each recompute mode (`modes`, block by block):
    those are evaluated."""
    parts = layer_backward_parts(d)
    region = {}  # block -> its recomputed region in replay.regions
    core_graph = d.compiled  # a compiled block's backward graph runs its selective core again itself: no region
    for i, mode in enumerate(modes):
        if mode != "none" and not (mode == "selective" and core_graph):
            region[i] = len(region)
    last = len(modes) - 1
    ends = {i for mode in set(modes) for i in (modes.index(mode), last - modes[::-1].index(mode))}
    worst = 0.0
    for i in ends:
        if modes[i] in ("full", "ops"):
            before, peak, alone = replay.regions[region[i]]
            # An adapter on the block's last product scales its output gradient before the recomputation
            # starts (the first saved tensor backward asks for is its A's output): held through it.
            pending = parts["residual"] if "down" in d.adapters and not d.experts else 0.0
            attn_end, mlp_end, recomputed = before + alone["attention"], before + alone["mlp"], before + peak + pending
        else:
            attn_end, mlp_end, recomputed = replay.blocks[i]["attention"], replay.blocks[i]["mlp"], 0.0
            if modes[i] == "selective" and core_graph:  # its output and logsumexp are back for its backward
                attn_end += d.p * d.b * d.s * d.q + 4 * d.b * d.heads * d.s
            elif modes[i] == "selective":  # the attention core's tensors are recomputed before its backward
                before, peak, alone = replay.regions[region[i]]
                attn_end, recomputed = attn_end + alone["saved"], before + peak
        if not d.sdpa:
            attn_end -= 2 * d.p * d.b * d.s * d.q + (d.p * d.b * d.heads * d.s * d.sk if d.p != 4 else 0)
        # The MLP's temporaries peak once down_proj's backward has run: its input is released and its
        # weight gradient made. A MoE has by then also released the weighed expert outputs that index_add
        # kept (the experts' output gradient takes their unweighed copy's place).
        down = d.p * d.b * d.s * d.f if not d.experts else d.p * d.assignments * (d.expert_f + d.h)
        down_grad = mlp_grad / (3 if d.swiglu else 2)
        if deferred:  # zero-bubble: the weight gradient waits for the W pass, which keeps the input
            down, down_grad, core_grad = 0.0, 0.0, 0.0
        grads = top_grad + (last - i) * layer_grad
        # fp8: a float8 linear's backward casts and products; down_proj's with every MLP tensor still saved.
        worst = max(worst, parts["residual"] + grads + max(
            mlp_end - down + down_grad + max(parts["mlp"], parts["fp8_up"]), mlp_end + parts["fp8_down"],
            attn_end + max(parts["attention"], parts["norm"], parts["fp8_attention"]) + mlp_grad + core_grad,
            recomputed))
    return worst


def plan_memory(cfg: Config, device_memory: int | str | None = None, device: str = "cuda",
                suggest: bool = True) -> MemoryPlan:
    """Per-rank memory of training `cfg` on `device` ("cuda" or "cpu": they differ in which attention
    kernel SDPA picks and in LayerNorm statistics' dtype). A layout `fivefold train` refuses is refused here,
    with the same message (fivefold.parallel.rules)."""
    check_layout(cfg)
    if isinstance(device_memory, str):
        device_memory = parse_bytes(device_memory)
    par = cfg.parallel
    stages = [_stage_plan(cfg, i, device) for i in range(par.pp)]
    worst = max(range(par.pp), key=lambda i: stages[i].memory["total"])
    notes = []
    if par.ep > 1 and not cfg.model.num_experts:
        notes.append(f"parallel.ep={par.ep} has no experts to split in a dense model; it changes nothing here")
    if cfg.model.num_experts:
        notes.append("MoE activations assume balanced routing: the routed tokens' tensors are as planned, but "
                     "with ep > 1 a rank whose experts draw more than their share receives more"
                     + ("; under fp8 the routed experts' matmuls stay bf16" if cfg.train.precision == "fp8" else ""))
    if cfg.model.attention == "sdpa" and scores_materialised(cfg, device):
        notes.append("SDPA falls back to the math kernel here (no flash kernel for this dtype/mask with GQA): "
                     "its s^2 scores are counted as under eager attention")
    if par.cp > 1 and device != "cpu":
        block = 4 * cfg.train.micro_batch_size * (cfg.model.num_heads // par.tp) * (cfg.train.seq_len // par.cp) ** 2
        notes.append(f"cp={par.cp}: off the CPU, ring attention computes each block as explicit matmuls (the "
                     f"CPU runs its fused flash kernel): a block's fp32 scores, {human_bytes(block)}, and about "
                     f"three more of that size are transient in its forward and backward, not counted here")
    copied = (["one gradient bucket or gathered unit"] if par.grad_size > 1 and (par.zero >= 1 or par.dp > 1)
              else []) + (["one whole sequence of the residual stream (SP)"] if par.tp > 1 and par.sequence_parallel
                          else [])
    if device == "cpu" and copied:
        notes.append("gloo (CPU) copies a reduce-scatter's input or an all-gather's output on its own thread "
                     f"while the collective runs: transient, up to {' or '.join(copied)} more, not counted here "
                     "(NCCL makes no such copy)")
    if compiled_blocks_modelled(cfg, device):
        ops = "; under train.recompute=ops, eager's kept op outputs less the block's last product"
        notes.append(f"train.compile={cfg.train.compile}: the blocks save what torch.compile's min-cut partitioning "
                     f"keeps (checked against it on CPU){ops if cfg.train.recompute == 'ops' else ''}")
    elif cfg.train.compiled(device):
        notes.append(f"train.compile={cfg.train.compile}: torch.compile chooses what to save (min-cut partitioning), usually "
                     "less than eager; for this model, precision or layout the activations here replay the eager model")
    if cfg.compiled_loss(device):
        notes.append("the final norm and the loss are compiled too: the logits are kept in the compute dtype with two "
                     "fp32 figures a row, not as fp32 log-probabilities")
    elif cfg.train.compiled(device):
        why = ("train.compile=blocks" if cfg.train.compile == "blocks" else "the chunked loss" if cfg.train.loss_chunk
               else "tp > 1: the vocabulary-parallel loss")
        notes.append(f"the final norm and the loss run eagerly ({why})")
    if cfg.train.precision == "fp8" and compiled_blocks_modelled(cfg, device):
        notes.append("fp8: bf16-mixed's model states; the compiled blocks save less than bf16-mixed's (each float8 "
                     "linear's bf16 input is recomputed in backward)")
    elif cfg.train.precision == "fp8":
        notes.append("fp8: bf16-mixed's model states and saved activations; each linear's float8 casts are "
                     "transient" + ("" if device != "cuda" else " (modelled for eager torch._scaled_mm, measured "
                                    "only in CPU emulation)"))
    if cfg.fp8_cast_once(device):
        notes.append("fp8: each float8 weight cast once a step (train.fp8_weight_cast=step): a float8 copy, 1 byte "
                     "an element, in parameters" + (", this rank's rows; ZeRO-3 gathers them as float8"
                                                    if formulas.fp8_gathered(cfg) else ""))
    if par.pp > 1 and cfg.train.grad_accum < par.pp:
        notes.append(f"train.grad_accum={cfg.train.grad_accum} micro-batches < pp={par.pp}: the pipeline "
                     f"bubble dominates; use grad_accum >= {par.pp}")
    summary = {"model": model_name(cfg), "precision": cfg.train.precision, "recompute": cfg.train.recompute,
               "attention": cfg.model.attention, "micro_batch_size": cfg.train.micro_batch_size,
               "seq_len": cfg.train.seq_len, "grad_accum": cfg.train.grad_accum,
               "fp32_grad_accum": cfg.train.fp32_grad_accum, **dataclasses.asdict(par)}
    plan = MemoryPlan(params=formulas.count_params(cfg.model), active_params=formulas.active_params(cfg.model),
                      memory=stages[worst].memory, params_per_rank=stages[worst].params, stage=worst,
                      stages=stages, device=device, device_memory=device_memory, notes=notes, summary=summary,
                      keep_checkpoints=cfg.train.keep_checkpoints,
                      adapters=sum(k for _, k in formulas.adapter_shapes(cfg.model, cfg.lora)))
    if suggest and plan.fits is False:
        plan.suggestions = suggest_fixes(cfg, device_memory, device)
    plan.communication = step_communication(cfg)
    return plan


def model_name(cfg: Config) -> str:
    """The preset whose shapes the config has (attention kernel and masking aside), else a description."""
    runtime = {"attention", "document_mask", "init_std", "max_seq_len"}
    mine = {k: v for k, v in dataclasses.asdict(cfg.model).items() if k not in runtime}
    for name, preset in PRESETS.items():
        if {k: v for k, v in dataclasses.asdict(preset).items() if k not in runtime} == mine:
            return name
    return f"custom model (h={cfg.model.hidden_size}, L={cfg.model.num_layers})"


# ---------------------------------------------------------------------------------------------------
# What to change when it does not fit


def _candidates(cfg: Config) -> list[tuple[str, dict[str, object]]]:
    t, par, m = cfg.train, cfg.parallel, cfg.model
    out: list[tuple[str, dict[str, object]]] = []
    for mode in ("selective", "ops", "full")[("none", "selective", "ops", "full").index(t.recompute):]:
        if mode != t.recompute:
            out.append((f"train.recompute={mode}", {"train.recompute": mode}))
    b = t.micro_batch_size
    while b > 1:
        b //= 2
        factor = t.micro_batch_size // b
        out.append((f"train.micro_batch_size={b} train.grad_accum={t.grad_accum * factor} (same global batch)",
                    {"train.micro_batch_size": b, "train.grad_accum": t.grad_accum * factor}))
    if t.precision == "fp32":
        out.append(("train.precision=bf16-mixed", {"train.precision": "bf16-mixed"}))
    if t.optimizer_impl == "foreach":
        out.append(("train.optimizer_impl=fused (no per-group sqrt(exp_avg_sq) temporaries)",
                    {"train.optimizer_impl": "fused"}))
    if t.optimizer_impl != "compiled" and t.mixed and not par.zero:
        out.append(("train.optimizer_impl=compiled (no fp32 copies of a unit's gradients)",
                    {"train.optimizer_impl": "compiled"}))
    if par.dp > 1:
        for z in range(par.zero + 1, 4):
            out.append((f"parallel.zero={z}", {"parallel.zero": z}))
    else:
        for dp in (2, 4, 8):
            out.append((f"parallel.dp={dp} parallel.zero=3",
                        {"parallel.dp": dp, "parallel.zero": 3}))
    for tp in (2, 4, 8):
        if tp > par.tp and m.num_kv_heads % tp == 0 and m.num_heads % tp == 0:
            out.append((f"parallel.tp={tp} parallel.sequence_parallel=true",
                        {"parallel.tp": tp, "parallel.sequence_parallel": True}))
    for pp in (2, 4, 8, 16):
        if pp > par.pp and pp <= m.num_layers:
            out.append((f"parallel.pp={pp} train.grad_accum={max(t.grad_accum, pp)}",
                        {"parallel.pp": pp, "train.grad_accum": max(t.grad_accum, pp)}))
    return [(text, changes) for text, changes in out if _valid(with_changes(cfg, changes))]


def _valid(cfg: Config) -> bool:
    """Whether a suggested change is a config that runs (e.g. fp8 refuses tensor parallelism)."""
    try:
        check_layout(cfg)
    except ConfigError:
        return False
    return True


def with_changes(cfg: Config, changes: dict[str, object]) -> Config:
    """A copy of cfg with `changes` ({"section.key": value}) set, not validated."""
    new = copy.deepcopy(cfg)
    for key, value in changes.items():
        section, name = key.split(".")
        setattr(getattr(new, section), name, value)
    return new


def _outcome(cfg: Config, new: Config, total: float) -> str:
    world = new.parallel.world_size
    return f"{total / 1e9:,.1f} GB" + (f" on {world} GPUs" if world != cfg.parallel.world_size else "")


def suggest_fixes(cfg: Config, device_memory: int, device: str, limit: int = 6) -> list[str]:
    """Single changes that make the plan fit, least disruptive first; else a greedy combination."""
    fits = []
    for text, changes in _candidates(cfg):
        new = with_changes(cfg, changes)
        total = plan_memory(new, device=device, suggest=False).memory["total"]
        if total <= device_memory:
            fits.append(f"{text}: {_outcome(cfg, new, total)}")
    if fits:
        return fits[:limit]
    current, applied = cfg, []
    for _ in range(4):  # greedy: take the change that saves the most, until it fits
        options = [(plan_memory(with_changes(current, ch), device=device, suggest=False).memory["total"], text, ch)
                   for text, ch in _candidates(current)]
        if not options:
            break
        total, text, changes = min(options, key=lambda o: o[0])
        current = with_changes(current, changes)
        applied.append(text)
        if total <= device_memory:
            return [" + ".join(applied) + f": {_outcome(cfg, current, total)}"]
    return ["! nothing tried fits: even " + " + ".join(applied) + " is too large; add GPUs (dp with zero=3, "
            "tp, pp) or shorten train.seq_len"]
