"""The config tree: the single source of truth for the model, the planner and the trainer.

A `Config` is dataclasses (model, train, data, parallel, serve, lora), and how `--set key=value` text and
dicts become their typed fields. It is built from defaults, a preset, a TOML file and overrides by
fivefold.config_load, its fields' rules are fivefold.config_checks, and it is checked as a whole by
fivefold.parallel.rules.check_layout. Every error names the key and what would be valid.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_origin

from fivefold.errors import UserError


class ConfigError(UserError, ValueError):
    """An invalid configuration; the message names the key and the fix."""


@dataclass
class ModelConfig:
    vocab_size: int = 4096
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 4  # grouped-query attention; == num_heads is plain multi-head attention
    ffn_hidden_size: int = 768
    head_dim: int = 0  # 0 means hidden_size // num_heads
    max_seq_len: int = 1024  # size of the learned position table; RoPE models ignore it for shapes
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    norm_eps: float = 1e-5
    activation: Literal["swiglu", "gelu"] = "swiglu"  # swiglu: gate/up/down; gelu: fc/proj (GPT-2)
    position: Literal["rope", "learned"] = "rope"
    rope_theta: float = 10000.0
    rope_scaling: Literal["none", "llama3"] = "none"
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 style: bias on q, k, v only
    linear_bias: bool = False  # GPT-2 style: bias on every linear layer (and norms)
    attention: Literal["sdpa", "eager"] = "sdpa"
    document_mask: bool = False  # packed sequences do not attend across documents (eos-delimited)
    eos_token_id: int = 0
    init_std: float = 0.02
    # Mixture of experts (0 experts = dense MLP): top-k routing over SwiGLU experts.
    num_experts: int = 0
    experts_per_token: int = 2
    moe_ffn_hidden_size: int = 0  # each expert's hidden size; 0 means ffn_hidden_size
    shared_expert_size: int = 0  # hidden size of an always-on shared expert; 0 means none
    router_aux_loss_coef: float = 0.01  # Switch-style load balancing: E * sum_e f_e P_e
    router_z_loss_coef: float = 0.001  # ST-MoE router z-loss: mean logsumexp(logits)^2
    capacity_factor: float = 0.0  # tokens per expert <= factor * tokens * k / E (the rest dropped); 0: dropless
    moe_grouped_mm: bool = True  # experts as one grouped matmul where the device has one; false: a loop over experts

    @property
    def expert_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_size

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_size


@dataclass
class TrainConfig:
    seq_len: int = 256
    micro_batch_size: int = 8
    grad_accum: int = 1
    steps: int = 600
    seed: int = 1234
    # "bf16-mixed": bf16 parameters and compute, fp32 master weights and Adam moments. "fp8": the same, plus
    # float8 matmuls in the blocks' linear layers (torchao.float8, dynamic tensorwise scales; the embedding,
    # router and LM head stay bf16): on CUDA it needs fp8 tensor cores (compute capability >= 8.9: Ada,
    # Hopper and later); on a CPU torchao emulates the float8 matmuls (same rounding, no speed), which is
    # what the tests run. fivefold.train.fp8 says what it applies to and what it refuses.
    precision: Literal["fp32", "bf16-mixed", "fp8"] = "fp32"
    # fp8: when a float8 linear's weight is cast. "step": once after each update, and every use (forward,
    # backward, each micro-batch) multiplies by that copy (1 byte an element more per weight); under
    # parallel.zero=3 each rank casts its rows with the whole weight's scale and the float8 rows are what is
    # gathered (half the bytes). The same bits as casting at each use. "use": torchao's own, at each use.
    # "auto": step under ZeRO-3 over several ranks or where the blocks compile (the cast then compiles too),
    # use elsewhere (Config.fp8_cast_once says why).
    fp8_weight_cast: Literal["auto", "step", "use"] = "auto"
    fp32_grad_accum: bool = False  # bf16-mixed / fp8 only: accumulate gradients in fp32 buffers
    # none | selective (the attention core) | ops (every other matmul and the attention kept, the rest
    # recomputed: torchtitan's policy) | full (only block inputs kept): fivefold.train.recompute
    recompute: Literal["none", "selective", "ops", "full"] = "none"
    # Which layers train.recompute applies to: "" = all; "every:k" = layers 0, k, 2k, ...; or a list
    # "0,3,5" (global layer indices). The others keep their activations (fivefold.train.recompute).
    recompute_layers: str = ""
    # Tokens per chunk of the fused LM head + cross-entropy (fivefold.train.chunked_loss): the full
    # (tokens x vocabulary) logits are never made; 0 = the plain head and loss.
    loss_chunk: int = 0
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    lr_schedule: Literal["cosine", "linear", "wsd", "constant"] = "cosine"
    warmup_steps: int = 50
    decay_fraction: float = 0.2  # wsd: fraction of the run spent decaying
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"
    base_batch_tokens: int = 0  # lr is given for this global batch (tokens); 0 = the initial batch
    # Batch-size schedule: "tokens_seen:grad_accum,..." e.g. "200000:2,600000:4" grows the global
    # batch by raising grad_accum once that many tokens have been trained on.
    batch_schedule: str = ""
    # "auto": grow grad_accum toward the measured gradient noise scale (fivefold.train.batch_ramp), up to
    # max_grad_accum; "schedule": train.batch_schedule (or a fixed batch).
    batch_ramp: Literal["schedule", "auto"] = "schedule"
    max_grad_accum: int = 0  # batch_ramp=auto: the largest grad_accum the ramp may reach (0: unset)
    # EMA factor smoothing the gradient noise scale's two estimates (fivefold.train.noise_scale); its
    # horizon 1 / (1 - gns_ema) steps is also how often batch_ramp=auto reconsiders the batch.
    gns_ema: float = 0.95
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    # fused: torch's fused AdamW, one kernel, no per-group temporaries; compiled: the whole update (bf16 gradient
    # read as it is, clipped, AdamW, bf16 parameter written) as one compiled kernel a tensor, 30 bytes a
    # parameter where fused moves 50 (fivefold.train.compiled_adamw; ZeRO off)
    optimizer_impl: Literal["foreach", "fused", "compiled"] = "fused"
    # torch.compile each block, and the final norm and the loss: "auto" = on CUDA (compiled graphs, fused
    # kernels), off elsewhere (a CPU gains little and pays the compile time); "blocks": the blocks only, the
    # final norm and the loss eager (Config.compiled_loss says where the loss compiles). Every layout compiles.
    compile: Literal["auto", "true", "blocks", "false"] = "auto"
    # "triton": RMSNorm, the SwiGLU product and RoPE as fused Triton kernels (fivefold.kernels: a CUDA GPU, or
    # TRITON_INTERPRET=1 for tests); "torch": the model's plain PyTorch ops. bench/kernels.py says where it pays.
    kernels: Literal["torch", "triton"] = "torch"
    # Each block's q/k/v as one GEMM and gate/up as one GEMM, every part still its own parameter
    # (fivefold.train.fused_projections). "true": both; "auto": q/k/v on CUDA, where a grouped-query model's thin
    # k and v products run far below the card's peak (the step-time model predicts a gain for every Llama shape;
    # gate/up pays at a narrow FFN, SmolLM2-135M's, and costs at Llama-3.2-3B's, where concatenating the large
    # weights each pass outweighs it), nothing on a CPU, where bench/train_throughput.py measured no gain.
    # Never under train.recompute=ops, whose policy would then keep the whole products instead of every other
    # part's output. Config.fused_projections says what runs.
    fused_projections: Literal["auto", "true", "false"] = "auto"
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 8
    save_every: int = 0  # 0: save only at the end
    keep_checkpoints: int = 2
    out_dir: str = "runs/default"
    # Start from these weights instead of the seeded init: a Hugging Face model directory (streamed, each
    # rank reading only its slices) or a fivefold run / checkpoint (its weights; optimizer starts afresh).
    init_from: str = ""
    peak_flops: float = 0.0  # FLOP/s per device for MFU; 0 = a known GPU's datasheet peak, else a measured matmul
    # On resume, skip a damaged newest checkpoint (with a warning) for the newest intact one;
    # false: refuse to start instead (`fivefold train --no-fallback`).
    checkpoint_fallback: bool = True
    device: str = "auto"
    tensorboard: bool = True
    progress: bool = True

    @property
    def mixed(self) -> bool:
        """bf16 parameters with fp32 masters: bf16-mixed, and fp8 (which adds float8 linears to it)."""
        return self.precision in ("bf16-mixed", "fp8")

    def compiled(self, device: str) -> bool:
        """Whether blocks are compiled on `device` ("cuda", "cpu") under train.compile."""
        return self.compile in ("true", "blocks") or (self.compile == "auto" and device == "cuda")


@dataclass
class DataConfig:
    # "embedded" = the English documentation that ships inside CPython; otherwise a directory
    # written by `fivefold prepare`.
    dataset: str = "embedded"
    tokenizer: str = ""  # path to a tokenizer.json; "" = train (and cache) a BPE on the corpus
    # Supervised fine-tuning instead of next-token pretraining: a JSONL file of {"prompt", "completion"} or
    # {"messages": [...]} examples, or "demo" (the set that ships with fivefold); the loss counts only
    # completion tokens (fivefold.data.sft).
    sft: str = ""
    # pack: several examples per row, attention kept inside each (needs model.document_mask=true);
    # pad: one example per row, padded to train.seq_len.
    sft_packing: Literal["pack", "pad"] = "pack"
    val_fraction: float = 0.05
    cache_dir: str = ""  # "" = $FIVEFOLD_CACHE or ~/.cache/fivefold


@dataclass
class ParallelConfig:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    sequence_parallel: bool = False
    pp_schedule: Literal["afab", "1f1b", "interleaved", "zero-bubble"] = "1f1b"
    pp_virtual_stages: int = 1
    pp_layers: str = ""  # layers per (virtual) stage, e.g. "3,5"; empty = balanced
    bucket_mb: float = 25.0  # data parallel: gradient all-reduce bucket size (MiB of fp32)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def grad_size(self) -> int:
        """Ranks a gradient is reduced over, and ZeRO shards over: dp x cp (each cp rank saw other tokens)."""
        return self.dp * self.cp


@dataclass
class ServeConfig:
    """The serving engine (fivefold.serve): KV pool, batching limits and the server's queue."""
    block_size: int = 16  # tokens per KV block
    # KV pool size: GB if >= 1, else a fraction of free accelerator memory (CPU: of available RAM); never
    # more than max_num_seqs sequences of max_model_len tokens need.
    kv_memory: float = 0.5
    num_blocks: int = 0  # > 0: exactly this many KV blocks, overriding kv_memory
    max_num_seqs: int = 64  # sequences in one forward
    max_num_batched_tokens: int = 2048  # tokens in one forward (decodes + prefill chunks)
    # Prompt tokens scored in one forward (SamplingParams.prompt_logprobs, the server's echo with logprobs): each
    # row's logits cover the vocabulary, so this bounds what scoring adds to a step's memory (fivefold.serve.plan);
    # a prompt being scored goes in chunks of at most this many rows. 0 = scoring refused.
    max_scored_tokens: int = 512
    max_model_len: int = 0  # longest prompt + output; 0 = model.max_seq_len
    prefix_cache: bool = True
    max_waiting: int = 256  # requests queued beyond the running ones; the server answers 429 past it
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # Attention over the paged pool: "triton" = one paged-attention kernel per layer reading keys and
    # values in place, plus the Triton RMSNorm / RoPE / SwiGLU (fivefold.kernels; CUDA, or TRITON_INTERPRET=1
    # for tests); "torch" = gather the blocks and run SDPA (the CPU path and the reference); "auto" = triton
    # on CUDA when Triton is installed, else torch.
    kernels: Literal["auto", "torch", "triton"] = "auto"
    # Decode-only steps replay a CUDA graph captured for the next batch size up (fivefold.serve.cuda_graphs):
    # "auto" = on CUDA with the triton kernels, for models that can be captured (no LoRA adapters, tp=1).
    cuda_graphs: Literal["auto", "true", "false"] = "auto"
    # Schedule and launch step n+1 while step n's tokens are still on the device, so the host's work
    # overlaps the device's: "auto" = on CUDA with tp=1 (on a CPU the device is the host: nothing to overlap).
    async_scheduling: Literal["auto", "true", "false"] = "auto"
    # The linears on a CPU (fivefold.serve.cpu_linear): "auto" = for each weight shape, the faster of F.linear
    # (MKL on x86) and oneDNN's inner product, each in the faster layout, timed once per machine (which wins
    # depends on the CPU); "onednn" = oneDNN's, its layout chosen; "torch" = F.linear as the model has it.
    # On CUDA the linears are cuBLAS's either way.
    linear: Literal["auto", "onednn", "torch"] = "auto"
    # On the Triton path, fewer launches a layer: RoPE inside the KV store's kernel, reading q/k/v in place
    # from the fused product, and each residual add inside the next RMSNorm's kernel (fivefold.serve.residual);
    # on the torch path (a CPU), the blocks as one loop of tensor ops without per-module calls
    # (fivefold.serve.lean_forward). The logits are bit for bit those of the separate kernels or modules,
    # which false runs (to measure the difference).
    fuse_launches: bool = True
    # On a CPU, the weights and the KV pool in transparent huge pages (fivefold.serve.huge_pages): a decode
    # streams every weight, and 2 MiB pages take that many fewer TLB misses. "auto" = on a CPU whose kernel
    # offers them (transparent_hugepage not "never"); the bytes and the logits are unchanged.
    huge_pages: Literal["auto", "true", "false"] = "auto"
    # On a CPU, decode-only steps whose rows form one attention group (every batch-1 decode) run the blocks'
    # loop as one inductor graph (fivefold.serve.compiled_decode): 1.03-1.14x the eager loop on the 2-vCPU
    # test host, for a compile of seconds at start-up (minutes with a cold cache). Its logits are the eager
    # loop's to float rounding, not bit for bit, so a near tie may break the other way in a compiled step.
    compile_decode: bool = False
    # On a CPU, fivefold's C++ kernels (fivefold.kernels.cpu_build; a C++ compiler and ninja, built once per
    # machine, ~1 min): decode rows attend through one that reads the KV pool in place through the block tables
    # (fivefold.kernels.cpu_paged_decode) instead of gathering their blocks for SDPA (prompt chunks gather either
    # way), and under serve.linear=auto a float32 linear's product at 1-32 rows may be the rows kernel
    # (fivefold.kernels.cpu_linear_rows, AVX-512 or AVX2) where it times faster for the weight's shape.
    # "auto" = where they can run (float32, a head size the attention instantiates, and they build; "true"
    # refuses to start where the attention kernel cannot); logits equal the libraries' and SDPA's to float
    # rounding.
    cpu_kernel: Literal["auto", "true", "false"] = "auto"


LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


@dataclass
class LoraConfig:
    """Low-rank adapters (Hu et al. 2021) on a frozen base (fivefold.finetune.lora): W x + (alpha / r) B A x,
    A random and B zero, so step 0 is the base model exactly."""
    r: int = 0  # 0: no adapters (every parameter trains)
    alpha: float = 16.0
    dropout: float = 0.0  # on the adapters' input; > 0 makes runs depend on the layout's random streams
    targets: str = "q,k,v,o,gate,up,down"  # comma-separated, any of LORA_TARGETS
    init_from: str = ""  # a PEFT adapter directory to start the adapters from (fivefold.finetune.peft)
    # QLoRA (fivefold.finetune.qlora): the blocks' frozen linears stored as int4 codes, group_size columns
    # per float16 scale and zero point, dequantized for each matmul.
    quantize_base: Literal["none", "int4"] = "none"
    group_size: int = 64

    @property
    def target_list(self) -> list[str]:
        return [t.strip() for t in self.targets.split(",") if t.strip()]

    @property
    def scaling(self) -> float:
        return self.alpha / self.r if self.r else 0.0


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def compiled_loss(self, device: str) -> bool:
        """Whether the final norm and the cross-entropy are compiled on `device` beside the blocks: the
        plain loss only (the chunked loss and the vocabulary-parallel one of tp > 1 run their own loops and
        collectives eagerly). Compiled, the loss keeps the logits in the compute dtype and two fp32 figures
        a row for backward where eager keeps fp32 log-probabilities, and runs as a few fused kernels."""
        t = self.train
        return t.compiled(device) and t.compile != "blocks" and not t.loss_chunk and self.parallel.tp == 1

    def fused_projections(self, device: str = "cuda") -> tuple[bool, bool]:
        """Whether (q/k/v, gate/up) run as one product each on `device` (fivefold.train.fused_projections):
        under train.fused_projections, where the group's linears are plain ones, not float8 (fp8), quantized
        (QLoRA) or adapted (a LoRA target); gate/up in a dense SwiGLU MLP only."""
        t, m = self.train, self.model
        wanted = t.fused_projections == "true" or (t.fused_projections == "auto" and device == "cuda")
        if not wanted or t.recompute == "ops" or t.precision == "fp8" or self.lora.quantize_base != "none":
            return False, False
        adapted = set(self.lora.target_list) if self.lora.r else set()
        return (not adapted & {"q", "k", "v"}, t.fused_projections == "true" and m.activation == "swiglu"
                and not m.num_experts and not adapted & {"gate", "up"})

    def fp8_cast_once(self, device: str = "cuda") -> bool:
        """Whether fp8's float8 weights are cast once a step on `device` (train.fp8_weight_cast,
        fivefold.train.fp8). "auto" takes it where the step-time model puts it ahead: under ZeRO-3 over
        several ranks, where it halves the parameter gathers, and wherever the blocks compile, because the
        cast after the update then compiles too (one fused pass a weight, 5 bytes an element) and saves every
        use's cast (each micro-batch's forward and backward). Eager, that cast moves 31 bytes an element in 6
        launches a weight: slower than the per-use casts compiled blocks fuse, at one micro-batch a step."""
        t, par = self.train, self.parallel
        if t.precision != "fp8":
            return False
        if t.fp8_weight_cast == "auto":
            return (par.zero == 3 and par.grad_size > 1) or t.compiled(device)
        return t.fp8_weight_cast == "step"

    @property
    def global_batch_sequences(self) -> int:
        return self.train.micro_batch_size * self.train.grad_accum * self.parallel.dp

    @property
    def global_batch_tokens(self) -> int:
        return self.global_batch_sequences * self.train.seq_len


# --------------------------------------------------------------------------------------------
# Building a config from dicts, TOML files and --set overrides


def field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def coerce(key: str, value: Any, typ: Any) -> Any:
    """Convert `value` (from TOML or a --set string) to `typ`, or raise a ConfigError naming `key`."""
    if get_origin(typ) is Literal:
        allowed = get_args(typ)
        if "true" in allowed and (isinstance(value, bool) or str(value).lower() in ("true", "false")):
            value = str(value).lower()  # a switch with a third setting ("auto") still takes booleans
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not valid; choose one of {', '.join(map(str, allowed))}")
        return value
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{key}={value!r} is not valid; expected true or false")
    if typ is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} is not valid; expected an integer")
        try:
            if isinstance(value, str):
                value = value.replace("_", "")
                as_float = float(value)  # accept 1e6 style for counts
                if as_float != int(as_float):
                    raise ValueError
                return int(as_float)
            if isinstance(value, float) and value != int(value):
                raise ValueError
            return int(value)
        except ValueError:
            raise ConfigError(f"{key}={value!r} is not valid; expected an integer") from None
    if typ is float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={value!r} is not valid; expected a number") from None
        if not math.isfinite(number):
            raise ConfigError(f"{key}={value!r} is not valid; expected a finite number")
        return number
    if typ is str:
        return str(value)
    raise TypeError(f"unsupported config type {typ} for {key}")


def _did_you_mean(name: str, choices, prefix: str = "") -> str:
    close = difflib.get_close_matches(name, sorted(choices), n=1)
    return f" (did you mean '{prefix}{close[0]}'?)" if close else ""


def _apply_section(obj: Any, section: str, values: dict[str, Any]) -> None:
    types = field_types(type(obj))
    for name, value in values.items():
        key = f"{section}.{name}"
        if name not in types:
            sections = field_types(Config)
            elsewhere = [f"{other}.{name}" for other, cls in sections.items()
                         if dataclasses.is_dataclass(cls) and name in field_types(cls)]
            hint = f" (it is {elsewhere[0]!r})" if elsewhere else _did_you_mean(name, types, section + ".")
            raise ConfigError(f"unknown config key {key!r}{hint}; "
                              f"valid keys in [{section}]: {', '.join(sorted(types))}")
        setattr(obj, name, coerce(key, value, types[name]))


def apply_dict(cfg: Config, values: dict[str, Any]) -> Config:
    sections = {f.name for f in dataclasses.fields(Config)}
    for section, body in values.items():
        if section == "preset":
            continue
        if section not in sections:
            raise ConfigError(f"unknown config section {section!r}{_did_you_mean(section, sections)}; "
                              f"valid sections: {', '.join(sorted(sections))}")
        if not isinstance(body, dict):
            raise ConfigError(f"config section {section!r} must be a table of key = value")
        _apply_section(getattr(cfg, section), section, body)
    return cfg


def parse_override(text: str) -> tuple[str, str, str]:
    """'model.hidden_size=64' -> ('model', 'hidden_size', '64')."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r} must look like section.key=value (e.g. model.hidden_size=64)")
    path, value = text.split("=", 1)
    parts = path.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"--set {text!r}: the key must be section.key, e.g. train.lr=1e-3")
    return parts[0], parts[1], value.strip()
