"""The config tree's own rules: each field's range and choices, and the checks across one config's fields
(recomputation, fine-tuning, batch schedules and ramps, serving), every one naming the keys involved and what
would be valid; and which keys a resumed run may not change. fivefold.parallel.rules.check_layout runs
`validate` first, then the layout's rules."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from fivefold.config import LORA_TARGETS, Config, ConfigError, ServeConfig, coerce, field_types


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def validate_serve(cfg: Config) -> None:
    s = cfg.serve
    # Every value as --set checks it, also for values given through the Python API: a choice (dtype, kernels,
    # cuda_graphs, ...) takes booleans as "true" / "false" (LLM(..., cuda_graphs=True)), and a count refuses
    # them (LLM(..., block_size=True) would otherwise serve blocks of one token).
    for key, typ in field_types(ServeConfig).items():
        setattr(s, key, coerce(f"serve.{key}", getattr(s, key), typ))
    for key in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_waiting"):
        if getattr(s, key) < 1:
            raise ConfigError(f"serve.{key}={getattr(s, key)} must be at least 1")
    if s.kv_memory <= 0:
        raise ConfigError(f"serve.kv_memory={s.kv_memory} must be > 0 (GB if >= 1, else a fraction of free memory)")
    if s.num_blocks < 0:
        raise ConfigError(f"serve.num_blocks={s.num_blocks} must be >= 0 (0 = sized from serve.kv_memory)")
    if s.max_scored_tokens < 0:
        raise ConfigError(f"serve.max_scored_tokens={s.max_scored_tokens} must be >= 0 (0 = prompts are not scored)")
    if s.max_model_len < 0:
        raise ConfigError(f"serve.max_model_len={s.max_model_len} must be >= 0 (0 = model.max_seq_len)")


def recompute_layer_set(spec: str, num_layers: int, mode: str = "full") -> frozenset[int]:
    """The layers train.recompute applies to, from train.recompute_layers ("" all, "every:k", "0,3,5")."""
    key = f"train.recompute_layers={spec!r}"
    if not spec.strip():
        return frozenset(range(num_layers))
    if mode == "none":
        raise ConfigError(f"{key} needs train.recompute=selective, ops or full")
    text = spec.replace(" ", "")
    try:
        if text.startswith("every:"):
            k = int(text[len("every:"):])
            if k < 1:
                raise ValueError
            return frozenset(range(0, num_layers, k))
        layers = frozenset(int(i) for i in text.split(","))
    except ValueError:
        raise ConfigError(f"{key} is not valid: give \"every:k\" (k >= 1) or layer indices like \"0,2,5\"") from None
    if not all(0 <= i < num_layers for i in layers):
        raise ConfigError(f"{key} names layers outside 0..{num_layers - 1} (model.num_layers={num_layers})")
    return layers


def validate(cfg: Config) -> None:
    """The config's own rules: each field's range, and the shapes the model and the layout need (heads
    that tp divides, stages that have layers). The rules that need the layout's arithmetic, and the world
    size, are fivefold.parallel.rules.check_layout's."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    positive = {
        "model.vocab_size": m.vocab_size, "model.hidden_size": m.hidden_size, "model.num_layers": m.num_layers,
        "model.num_heads": m.num_heads, "model.num_kv_heads": m.num_kv_heads,
        "model.ffn_hidden_size": m.ffn_hidden_size, "model.max_seq_len": m.max_seq_len,
        "train.seq_len": t.seq_len, "train.micro_batch_size": t.micro_batch_size, "train.grad_accum": t.grad_accum,
        "train.log_every": t.log_every, "train.keep_checkpoints": t.keep_checkpoints,
        "parallel.dp": p.dp, "parallel.tp": p.tp, "parallel.pp": p.pp, "parallel.cp": p.cp, "parallel.ep": p.ep,
        "parallel.pp_virtual_stages": p.pp_virtual_stages,
    }
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"{key}={value} must be at least 1")
    validate_serve(cfg)
    _check_ranges(cfg)
    if m.num_heads % m.num_kv_heads:
        valid = [d for d in _divisors(m.num_heads)]
        raise ConfigError(
            f"model.num_kv_heads={m.num_kv_heads} must divide model.num_heads={m.num_heads}; choose one of {valid}")
    if not m.head_dim and m.hidden_size % m.num_heads:
        raise ConfigError(
            f"model.hidden_size={m.hidden_size} is not divisible by model.num_heads={m.num_heads}; "
            f"set model.head_dim explicitly or choose num_heads in {_divisors(m.hidden_size)}")
    if m.position == "rope" and m.head_size % 2:
        raise ConfigError(f"RoPE needs an even head size, got {m.head_size}; change model.hidden_size or model.num_heads")
    if m.position == "learned" and t.seq_len > m.max_seq_len:
        raise ConfigError(
            f"train.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len} (learned positions); "
            f"lower train.seq_len or raise model.max_seq_len")
    if not 0 <= m.eos_token_id < m.vocab_size:
        raise ConfigError(f"model.eos_token_id={m.eos_token_id} must be in [0, model.vocab_size={m.vocab_size})")
    if t.fp32_grad_accum and not t.mixed:
        raise ConfigError("train.fp32_grad_accum=true only applies to train.precision=bf16-mixed or fp8")
    if t.kernels == "triton" and t.device.startswith("cpu") and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError("train.kernels=triton runs Triton kernels on a CUDA GPU, not train.device=cpu; use "
                          "train.kernels=torch (or set TRITON_INTERPRET=1 to interpret them on the CPU, for tests)")
    if t.fused_projections == "true" and t.recompute == "ops":
        raise ConfigError("train.fused_projections=true does not combine with train.recompute=ops: that policy keeps "
                          "every other matmul's output, which fused would be the whole q/k/v and gate/up products; "
                          "use train.fused_projections=auto (separate under ops) or another train.recompute")
    if t.loss_chunk < 0:
        raise ConfigError(f"train.loss_chunk={t.loss_chunk} must be >= 0 (tokens per chunk; 0 = the plain loss)")
    recompute_layer_set(t.recompute_layers, m.num_layers, t.recompute)
    parse_batch_schedule(t.batch_schedule)
    if p.zero not in (0, 1, 2, 3):
        raise ConfigError(f"parallel.zero={p.zero} is not valid; choose one of 0, 1, 2, 3")
    if t.optimizer_impl == "compiled" and p.zero:
        raise ConfigError(f"train.optimizer_impl=compiled steps whole tensors, and parallel.zero={p.zero} shards "
                          f"them; set train.optimizer_impl=fused, or parallel.zero=0")
    if p.tp > 1:
        # Whole heads per rank, and vocabulary / FFN rows split evenly.
        sizes = (("model.num_heads", m.num_heads), ("model.num_kv_heads", m.num_kv_heads),
                 ("model.vocab_size", m.vocab_size), ("model.ffn_hidden_size", m.ffn_hidden_size))
        for key, n in sizes:
            if n % p.tp:
                valid = [d for d in _divisors(m.num_heads) if all(v % d == 0 for _, v in sizes)]
                raise ConfigError(f"parallel.tp={p.tp} does not divide {key}={n}; choose tp in {valid}")
        if p.sequence_parallel and t.seq_len % (p.tp * p.cp):
            what = f"tp={p.tp} ranks" if p.cp == 1 else f"cp x tp = {p.cp} x {p.tp} ranks"
            raise ConfigError(f"parallel.sequence_parallel splits train.seq_len={t.seq_len} across {what}; "
                              f"choose seq_len divisible by {p.tp * p.cp}")
    if p.pp * p.pp_virtual_stages > m.num_layers:
        raise ConfigError(f"parallel.pp={p.pp} x pp_virtual_stages={p.pp_virtual_stages} stages exceed "
                          f"model.num_layers={m.num_layers}; each stage needs a layer")
    if p.pp_virtual_stages > 1 and p.pp_schedule != "interleaved":
        raise ConfigError(f"parallel.pp_virtual_stages={p.pp_virtual_stages} needs parallel.pp_schedule=interleaved")
    if p.pp > 1 and p.pp_schedule == "interleaved":
        accums = [t.grad_accum] + [a for _, a in parse_batch_schedule(t.batch_schedule)]
        accums += [t.max_grad_accum] if t.batch_ramp == "auto" else []
        if any(a % p.pp for a in accums):
            raise ConfigError(f"the interleaved schedule runs micro-batches in groups of pp={p.pp}: make "
                              f"train.grad_accum (and every batch_schedule value, and max_grad_accum) a "
                              f"multiple of {p.pp}")
    if m.num_experts:
        if not 1 <= m.experts_per_token <= m.num_experts:
            raise ConfigError(f"model.experts_per_token={m.experts_per_token} must be in 1..model.num_experts="
                              f"{m.num_experts}")
        if m.activation != "swiglu":
            raise ConfigError("model.num_experts>0 needs model.activation=swiglu (experts are SwiGLU MLPs)")
    if p.ep > 1:
        if not m.num_experts or m.num_experts % p.ep:
            raise ConfigError(f"parallel.ep={p.ep} must divide model.num_experts={m.num_experts}; choose ep in "
                              f"{_divisors(m.num_experts) if m.num_experts else [1]}")
        if p.dp % p.ep:
            raise ConfigError(f"parallel.ep={p.ep} splits experts among data-parallel ranks: it must divide "
                              f"parallel.dp={p.dp}; choose ep in {[d for d in _divisors(p.dp) if m.num_experts % d == 0]}")
    if p.cp > 1 and t.seq_len % (2 * p.cp):
        raise ConfigError(f"parallel.cp={p.cp} cuts train.seq_len={t.seq_len} into 2 x cp = {2 * p.cp} chunks "
                          f"(zig-zag load balance); choose seq_len divisible by {2 * p.cp}")
    if p.pp_layers:
        try:
            counts = [int(c) for c in p.pp_layers.split(",")]
        except ValueError:
            raise ConfigError(f"parallel.pp_layers={p.pp_layers!r} must be comma-separated layer counts") from None
        stages = p.pp * p.pp_virtual_stages
        if len(counts) != stages or sum(counts) != m.num_layers or min(counts) < 1:
            raise ConfigError(f"parallel.pp_layers={p.pp_layers!r} must give {stages} stages of >= 1 layer "
                              f"summing to model.num_layers={m.num_layers}")
    _check_batch_ramp(cfg)
    _check_finetune(cfg)



# (key, low, high, low inclusive, high inclusive): every number a user may get wrong, with its valid range.
_RANGES = [
    ("model.norm_eps", 0, None, False, None), ("model.rope_theta", 0, None, False, None),
    ("model.rope_scaling_factor", 1, None, True, None), ("model.rope_low_freq_factor", 0, None, False, None),
    ("model.rope_high_freq_factor", 0, None, False, None), ("model.rope_original_max_seq_len", 1, None, True, None),
    ("model.init_std", 0, None, False, None), ("model.head_dim", 0, None, True, None),
    ("model.num_experts", 0, None, True, None), ("model.moe_ffn_hidden_size", 0, None, True, None),
    ("model.shared_expert_size", 0, None, True, None), ("model.router_aux_loss_coef", 0, None, True, None),
    ("model.router_z_loss_coef", 0, None, True, None), ("model.capacity_factor", 0, None, True, None),
    ("train.steps", 0, None, True, None), ("train.seed", 0, 2**63 - 1, True, True),
    ("train.lr", 0, None, False, None), ("train.min_lr_ratio", 0, 1, True, True),
    ("train.warmup_steps", 0, None, True, None), ("train.decay_fraction", 0, 1, False, True),
    ("train.base_batch_tokens", 0, None, True, None), ("train.weight_decay", 0, None, True, None),
    ("train.beta1", 0, 1, True, False), ("train.beta2", 0, 1, True, False), ("train.eps", 0, None, True, None),
    ("train.grad_clip", 0, None, True, None), ("train.eval_every", 0, None, True, None),
    ("train.eval_batches", 1, None, True, None), ("train.save_every", 0, None, True, None),
    ("train.peak_flops", 0, None, True, None), ("train.max_grad_accum", 0, None, True, None),
    ("train.gns_ema", 0, 1, True, False), ("data.val_fraction", 0, 1, False, False),
    ("parallel.bucket_mb", 0, None, False, None),
]


def _check_ranges(cfg: Config) -> None:
    for key, low, high, low_in, high_in in _RANGES:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        too_low = low is not None and (value < low if low_in else value <= low)
        too_high = high is not None and (value > high if high_in else value >= high)
        if too_low or too_high:
            if high is None:
                rule = f"must be {'>=' if low_in else '>'} {low}"
            else:
                rule = f"must be in {'[' if low_in else '('}{low}, {high}{']' if high_in else ')'}"
            hint = {"train.grad_clip": " (0 turns clipping off)", "train.eval_every": " (0 turns evaluation off)",
                    "train.save_every": " (0 saves at the end only)", "model.capacity_factor": " (0 is dropless)",
                    "train.warmup_steps": " (0: no warm-up)",
                    "train.max_grad_accum": " (the largest grad_accum train.batch_ramp=auto may reach)",
                    "train.gns_ema": " (the gradient noise scale's EMA factor, e.g. 0.95)"}.get(key, "")
            raise ConfigError(f"{key}={value} {rule}{hint}")
    device = cfg.train.device
    if device != "auto" and not re.fullmatch(r"(cpu|cuda)(:\d+)?", device):
        raise ConfigError(f"train.device={device!r} is not valid; use auto, cpu, cuda or cuda:N")


def _check_finetune(cfg: Config) -> None:
    """LoRA adapters and supervised fine-tuning data (fivefold.finetune)."""
    lora, m = cfg.lora, cfg.model
    if lora.r < 0:
        raise ConfigError(f"lora.r={lora.r} must be >= 0 (0: no adapters; typical ranks are 2 to 64)")
    if lora.r:
        if lora.alpha <= 0:
            raise ConfigError(f"lora.alpha={lora.alpha} must be > 0 (the update is scaled by alpha / r)")
        if not 0 <= lora.dropout < 1:
            raise ConfigError(f"lora.dropout={lora.dropout} must be in [0, 1)")
        targets = lora.target_list
        unknown = [t for t in targets if t not in LORA_TARGETS]
        if unknown or not targets or len(set(targets)) != len(targets):
            raise ConfigError(f"lora.targets={lora.targets!r} must list distinct names among "
                              f"{', '.join(LORA_TARGETS)} (comma-separated)")
        if m.activation != "swiglu" and "gate" in targets:
            raise ConfigError("lora.targets names gate, but model.activation=gelu has no gate projection; drop "
                              "gate (up and down are the GELU MLP's fc and proj)")
        if m.num_experts and set(targets) & {"gate", "up", "down"}:
            raise ConfigError("LoRA on a mixture of experts' MLPs is not supported: set lora.targets=q,k,v,o "
                              "(attention only)")
        if lora.quantize_base != "none":
            tp = cfg.parallel.tp
            widths = {"model.hidden_size": m.hidden_size, "model.q_size (heads x head size) / tp": m.q_size // tp,
                      "model.ffn_hidden_size / tp": m.ffn_hidden_size // tp}
            bad = [f"{k}={v}" for k, v in widths.items() if lora.group_size < 1 or v % lora.group_size]
            if bad:
                raise ConfigError(f"lora.group_size={lora.group_size} must divide every quantized linear's input "
                                  f"width ({', '.join(bad)}); choose e.g. lora.group_size=32 or 64")
        if lora.init_from and not Path(lora.init_from).is_dir():
            raise ConfigError(f"lora.init_from={lora.init_from!r} is not a directory; give a PEFT adapter directory "
                              f"(adapter_config.json + adapter_model.safetensors)")
        if cfg.parallel.zero == 3 and cfg.parallel.dp > 1:
            raise ConfigError("lora.r>0 with parallel.zero=3: ZeRO-3 shards parameters that train, and the frozen "
                              "base does not; use parallel.zero=1 or 2 (the adapters' states are small), and "
                              "tp or pp to split the base")
    if lora.quantize_base != "none" and not lora.r:
        raise ConfigError(f"lora.quantize_base={lora.quantize_base} quantizes LoRA's frozen base (QLoRA): set lora.r "
                          f"(e.g. lora.r=16) as well")
    if cfg.data.sft and cfg.data.sft_packing == "pack" and not m.document_mask:
        raise ConfigError("data.sft with data.sft_packing=pack puts several examples in one row, which must not "
                          "attend to each other: set model.document_mask=true, or data.sft_packing=pad")


def _check_batch_ramp(cfg: Config) -> None:
    """train.batch_ramp=auto needs a noise scale to follow and room to grow (fivefold.train.batch_ramp)."""
    t = cfg.train
    if t.batch_ramp != "auto":
        if t.max_grad_accum:
            raise ConfigError(f"train.max_grad_accum={t.max_grad_accum} only applies to train.batch_ramp=auto; set "
                              f"train.batch_ramp=auto, or remove max_grad_accum")
        return
    if t.batch_schedule.strip():
        raise ConfigError(f"train.batch_ramp=auto grows the batch itself, and train.batch_schedule="
                          f"{t.batch_schedule!r} sets it too; remove train.batch_schedule, or use "
                          f"train.batch_ramp=schedule")
    if t.grad_accum < 2:
        raise ConfigError("train.batch_ramp=auto follows the gradient noise scale, measured from a step's first "
                          "micro-batch, which needs train.grad_accum >= 2; set train.grad_accum=2 (and halve "
                          "train.micro_batch_size to keep the batch)")
    if t.max_grad_accum <= t.grad_accum:
        raise ConfigError(f"train.batch_ramp=auto needs train.max_grad_accum > train.grad_accum={t.grad_accum} (the "
                          f"largest grad_accum the batch may grow to), e.g. train.max_grad_accum={8 * t.grad_accum}")



# What may change when a run is resumed. Anything that changes what the saved state means is refused:
# the model (the weights' shapes), the data and tokenizer (the sampler's position counts this dataset's
# windows), train.seq_len (window size), train.seed (data order), and the global batch in sequences
# (micro_batch_size x grad_accum x dp; the layout and micro-batching may change if that product does not).
# Everything else (steps, the schedule's settings, layout, precision, recomputation, logging, saving,
# device) may change: the run goes on from the saved step with the new values.
RESUME_FIXED = ("model", "lora", "data.dataset", "data.sft", "data.sft_packing", "data.tokenizer", "data.val_fraction", "train.seq_len", "train.seed")


def resume_conflicts(saved: Config, new: Config) -> list[str]:
    """Why `new` cannot continue a run saved with `saved` (empty: it can)."""
    conflicts = []
    for key in RESUME_FIXED:
        section, _, name = key.partition(".")
        old_value, new_value = (getattr(getattr(c, section), name) if name else getattr(c, section)
                                for c in (saved, new))
        if old_value != new_value:
            if not name:
                changed = [f.name for f in dataclasses.fields(old_value)
                           if getattr(old_value, f.name) != getattr(new_value, f.name)]
                what = "the model differs" if key == "model" else f"the {key} settings differ"
                conflicts.append(f"{what} ({', '.join(f'{key}.{k}' for k in changed)}); the checkpoint's weights "
                                 f"have the saved shapes")
            else:
                conflicts.append(f"{key} was {old_value!r}, now {new_value!r}")
    if saved.global_batch_sequences != new.global_batch_sequences:
        conflicts.append(f"the global batch was {saved.global_batch_sequences} sequences (micro_batch_size "
                         f"{saved.train.micro_batch_size} x grad_accum {saved.train.grad_accum} x dp "
                         f"{saved.parallel.dp}), now {new.global_batch_sequences}; keep the product, or grow the "
                         f"batch with train.batch_schedule")
    return conflicts


def parse_batch_schedule(text: str) -> list[tuple[int, int]]:
    """'200000:2,600000:4' -> [(200000, 2), (600000, 4)]: from that many tokens on, use that grad_accum."""
    if not text.strip():
        return []
    stages = []
    for part in text.split(","):
        try:
            tokens, accum = part.split(":")
            stages.append((int(float(tokens)), int(accum)))
        except ValueError:
            raise ConfigError(
                f"train.batch_schedule={text!r}: each entry must be tokens:grad_accum, e.g. '200000:2,600000:4'"
            ) from None
    if any(a < 1 for _, a in stages) or [s for s, _ in stages] != sorted(s for s, _ in stages):
        raise ConfigError(f"train.batch_schedule={text!r}: token thresholds must increase and grad_accum be >= 1")
    return stages
