"""Whether a layout is legal: the one check that `fivefold plan`, the layout search, launch and the trainer
all call, so a layout the planner prints is a layout `train` accepts.

`check_layout` is the config's own rules (fivefold.config.validate: divisibility, ranges, the world size)
plus the combinations whose implementation has not landed (`check_implemented`). Whether this machine can
run a layout (Triton, CUDA) is a separate question, asked at start-up (fivefold.parallel.mesh.check_supported).
"""

from __future__ import annotations

from fivefold.config import Config, ConfigError, validate


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


def check_layout(cfg: Config, world_size: int | None = None) -> None:
    """Raise a ConfigError naming the fix unless `cfg`'s layout is one `fivefold train` runs."""
    validate(cfg, world_size)
    check_implemented(cfg)
