"""A config from its sources: defaults, then a preset, then a TOML file, then `--set key=value` overrides,
checked once before anything is materialised or any process group starts (fivefold.parallel.rules)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from fivefold.config import Config, ConfigError, apply_dict, parse_override
from fivefold.parallel.rules import check_layout
from fivefold.presets import get_preset


def load_config(path: str | Path | None = None, preset: str | None = None, overrides: list[str] = ()) -> Config:
    """Defaults <- preset <- TOML file <- --set overrides, then checked (rules.check_layout, less what
    has not landed yet: the trainer and the planner refuse that, with the same message)."""
    file_values: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            what = "is a directory; give a TOML file" if path.is_dir() else "does not exist"
            raise ConfigError(f"config file {str(path)!r} {what}")
        try:
            file_values = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {str(path)!r} is not valid TOML: {e}") from None
    preset = preset or file_values.get("preset")
    cfg = Config()
    if preset:
        cfg.model = get_preset(preset)
    apply_dict(cfg, file_values)
    for text in overrides:
        section, name, value = parse_override(text)
        apply_dict(cfg, {section: {name: value}})
    check_layout(cfg, implemented=False)
    return cfg


def config_from_dict(values: dict[str, Any]) -> Config:
    cfg = apply_dict(Config(), values)
    check_layout(cfg, implemented=False)
    return cfg
