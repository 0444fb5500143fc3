"""Whether a layout is legal: the one check that `fivefold plan`, the layout search, launch and the trainer
all call, so a layout the planner prints is a layout `train` accepts.

`check_layout` is the config's own rules (fivefold.config_checks.validate: ranges, divisibility), the world size,
what fp8 and the automatic batch ramp need of the layout, and the combinations whose implementation has not
landed (`check_implemented`). Pure functions of the config, so every rank, the planner and the launcher
decide alike. Whether this machine can run a layout (Triton, torchao, CUDA) is a separate question, asked at
start-up (fivefold.parallel.mesh.check_supported).
"""

from __future__ import annotations

from functools import lru_cache

from fivefold.config import Config, ConfigError, ModelConfig
from fivefold.config_checks import validate
from fivefold.parallel.pipeline_schedules import build_schedule


def check_implemented(cfg: Config) -> None:
    """Combinations of dimensions that are refused up front, with what to use instead."""
    p = cfg.parallel
    if cfg.model.num_experts:
        if p.cp > 1 and cfg.model.capacity_factor > 0:
            raise ConfigError(f"parallel.cp={p.cp} with model.capacity_factor={cfg.model.capacity_factor} is not "
                              f"supported: capacity is granted in token order over the whole micro-batch, which cp "
                              f"splits; use model.capacity_factor=0 (dropless)")
        if p.zero > 0 and p.dp > 1:
            raise ConfigError(f"parallel.zero={p.zero} with a mixture-of-experts model is not supported yet: an "
                              f"expert may get no tokens on a rank; use parallel.zero=0")
    if p.cp > 1:
        if cfg.model.document_mask and p.pp > 1:
            raise ConfigError("model.document_mask with parallel.cp>1 and parallel.pp>1 is not supported yet: "
                              "pipeline stages find documents from their own tokens only; use one of cp and pp, "
                              "or model.document_mask=false")
    if p.pp > 1 and p.zero >= 2 and p.dp > 1:
        raise ConfigError(f"parallel.zero={p.zero} with parallel.pp={p.pp} is not supported: a pipeline runs each "
                          f"micro-batch's backward at a different time on each stage; use parallel.zero=1 "
                          f"(optimizer states sharded) or 0")


def check_layout(cfg: Config, world_size: int | None = None, implemented: bool = True) -> None:
    """Raise a ConfigError naming the fix unless `cfg`'s layout is one `fivefold train` runs (over
    `world_size` processes, when given). implemented=False leaves out `check_implemented`: what loading a
    config and the published runs' layouts ask (a layout another framework runs)."""
    validate(cfg)
    p = cfg.parallel
    if world_size is not None and world_size != p.world_size:
        others = p.tp * p.pp * p.cp
        fix = (f"set parallel.dp={world_size // others} or launch {p.world_size} processes"
               if world_size % others == 0 else
               f"launch {p.world_size} processes (any multiple of tp*pp*cp = {others}, with parallel.dp to match)")
        raise ConfigError(
            f"world size {world_size} != dp*tp*pp*cp = {p.dp}*{p.tp}*{p.pp}*{p.cp} = {p.world_size}; {fix}")
    if cfg.train.batch_ramp == "auto":
        reason = layout_unavailable(cfg)
        if reason is None and p.pp > 1:
            reason = unavailable(cfg, cfg.train.grad_accum)
        if reason is not None:
            raise ConfigError(f"train.batch_ramp=auto needs the gradient noise scale, which this layout cannot "
                              f"measure: {reason}; or use train.batch_ramp=schedule")
    if cfg.train.precision == "fp8":
        check_fp8(cfg)
    if implemented:
        check_implemented(cfg)


def check_fp8(cfg: Config) -> None:
    """What train.precision=fp8 (fivefold.train.fp8) cannot run with. Whether torchao is installed is asked at
    start-up (fivefold.parallel.mesh.check_supported); the device's fp8 support at trainer start (apply_fp8)."""
    p, lora = cfg.parallel, cfg.lora
    if p.tp > 1:
        raise ConfigError(
            f"train.precision=fp8 with parallel.tp={p.tp} is not supported: tensor parallelism replaces the "
            f"blocks' linears by fivefold's column / row-parallel shards, torchao has no public float8 matmul "
            f"for them, and each shard's own tensorwise scale would differ from the whole layer's (torchao "
            f"all-reduces the amax only through DTensor); use parallel.tp=1 (split the model with pp or "
            f"ZeRO-3 instead), or train.precision=bf16-mixed")
    if lora.r or lora.quantize_base != "none":
        raise ConfigError(
            "train.precision=fp8 with LoRA (lora.r>0) is not supported: the adapters are child modules of the "
            "base linears that torchao's conversion would drop, and QLoRA's int4 base has no bf16 weight to "
            "cast; fine-tune adapters with train.precision=bf16-mixed")
    if p.pp > 1 and p.pp_schedule == "zero-bubble":
        raise ConfigError(
            "train.precision=fp8 with parallel.pp_schedule=zero-bubble is not supported: zero-bubble defers "
            "each plain linear's weight gradient to a later W pass, which a float8 linear computes in its own "
            "backward; use parallel.pp_schedule=1f1b or interleaved")
    bad = {key: n for key, n in fp8_widths(cfg.model).items() if n % 16}
    if bad:
        fixes = ", ".join(f"{key}={n} (e.g. {16 * max(1, round(n / 16))})" for key, n in bad.items())
        raise ConfigError(f"train.precision=fp8 needs every width of the blocks' linears to be a multiple of 16 "
                          f"(float8 tensor-core matmuls); not so: {fixes}; change those model keys, or use "
                          f"train.precision=bf16-mixed")


def fp8_widths(m: ModelConfig) -> dict[str, int]:
    """Every in / out width of the linears train.precision=fp8 converts, by the model key that sets it."""
    widths = {"model.hidden_size": m.hidden_size,
              f"model.num_heads x head size ({m.num_heads} x {m.head_size})": m.q_size,
              f"model.num_kv_heads x head size ({m.num_kv_heads} x {m.head_size})": m.kv_size}
    if m.num_experts:  # the routed experts stay bf16
        if m.shared_expert_size:
            widths["model.shared_expert_size"] = m.shared_expert_size
    else:
        widths["model.ffn_hidden_size"] = m.ffn_hidden_size
    return widths


# -- where the gradient noise scale can be measured (fivefold.parallel.small_batch measures it) -------------


def reduces_every_micro_batch(cfg) -> bool:
    """ZeRO-2/3 over more than one rank (apply.py runs ZeRO only when dp x cp > 1)."""
    return cfg.parallel.zero >= 2 and cfg.parallel.dp * cfg.parallel.cp > 1


def layout_unavailable(cfg) -> str | None:
    """Why this parallel layout cannot measure the first micro-batch's gradient (None: it can). A pure
    function of the config, so every rank (and validation, before any process group) decides alike."""
    p = cfg.parallel
    if p.ep > 1:
        return (f"under parallel.ep={p.ep} a rank's experts hold the gradient of other ranks' tokens beside its "
                f"own; use parallel.ep=1")
    if p.cp > 1 and not reduces_every_micro_batch(cfg):
        return (f"under parallel.cp={p.cp} a rank holds a partial gradient of rows shared with the ring until the "
                f"last micro-batch's reduction; use parallel.zero=2 or 3 (it reduces every micro-batch)")
    if p.pp > 1 and reduces_every_micro_batch(cfg):
        return "a pipeline with ZeRO-2/3 reduces micro-batches at different times on each stage"
    if p.pp > 1 and cfg.model.tie_embeddings:
        return ("under a pipeline the tied embedding's two copies are summed only at the optimizer step; use "
                "model.tie_embeddings=false")
    return None


def unavailable(cfg, micro_batches: int) -> str | None:
    """Why a step of `micro_batches` micro-batches (per rank) has no small-batch gradient to measure."""
    if micro_batches < 2:
        return ("a step of one micro-batch has no smaller batch to compare with; set train.grad_accum >= 2 (halve "
                "train.micro_batch_size and double grad_accum for the same batch)")
    reason = layout_unavailable(cfg)
    if reason is None and cfg.parallel.pp > 1 and first_micro_batch_points(
            cfg.parallel.pp_schedule, cfg.parallel.pp, micro_batches, cfg.parallel.pp_virtual_stages) is None:
        reason = (f"parallel.pp_schedule={cfg.parallel.pp_schedule} adds a later micro-batch's gradient before "
                  f"micro-batch 0's is complete; use 1f1b, afab or interleaved")
    return reason


@lru_cache(maxsize=64)
def first_micro_batch_points(schedule: str, pp: int, m: int, v: int = 1) -> tuple[dict[int, int], ...] | None:
    """Per rank, {action index: chunk}: after that action the chunk's parameters hold micro-batch 0's whole
    gradient and nothing else (its last B/W action of micro-batch 0, with none of a later micro-batch's
    before it). None when some rank's chunk has no such point."""
    points = []
    for actions in build_schedule(schedule, pp, m, v):
        mine = {}
        for chunk in range(v):
            work = [(i, a) for i, a in enumerate(actions) if a.chunk == chunk and a.kind in ("B", "W")]
            leading = next((k for k, (_, a) in enumerate(work) if a.mb != 0), len(work))
            if leading == 0 or any(a.mb == 0 for _, a in work[leading:]):
                return None
            mine[work[leading - 1][0]] = chunk
        points.append(mine)
    return tuple(points)

