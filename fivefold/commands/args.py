"""The argument types and config options the commands share."""

from __future__ import annotations

import argparse

from fivefold.config_load import load_config
from fivefold.weights import take_source_shape


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """The config options every config-driven command shares."""
    parser.add_argument("--config", help="TOML config file (see configs/)")
    parser.add_argument("--preset", help="model preset, e.g. demo, tiny, llama3-8b (fivefold presets lists them)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set model.num_layers=2 (repeatable)")


def config_from_args(args):
    """The config the options give; with train.init_from and no model settings, the source's model."""
    return take_source_shape(load_config(args.config, args.preset, args.overrides))


def _int_in(text: str, low: int, high: int | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < low or (high is not None and value > high):
        raise argparse.ArgumentTypeError(f"{value} must be " + (f"in {low}..{high}" if high is not None
                                                                else f"at least {low}"))
    return value


def positive_int(text: str) -> int:
    """argparse type for counts that must be >= 1 (e.g. --nproc, --tp)."""
    return _int_in(text, 1)


def nonnegative_int(text: str) -> int:
    return _int_in(text, 0)


def port_number(text: str) -> int:
    return _int_in(text, 0, 65535)
