"""The `fivefold` command line. Each area registers its own subcommands (a `register(subparsers)`
function next to the code it drives), so this file only assembles them and turns known errors into
clean messages."""

from __future__ import annotations

import argparse
import importlib
import sys

from fivefold.config import ConfigError

# Modules that define `register(subparsers)`; each adds one or more subcommands.
COMMAND_MODULES = [
    "fivefold.train.commands",      # train, generate
    "fivefold.data.commands",       # prepare
    "fivefold.interop.commands",    # import-hf, export-hf
    "fivefold.memory.commands",     # plan, memory
    "fivefold.parallel.commands",   # pipeline
    "fivefold.serve.commands",      # serve
]


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """The config options every config-driven command shares."""
    parser.add_argument("--config", help="TOML config file (see configs/)")
    parser.add_argument("--preset", help="model preset, e.g. demo, tiny, llama3-8b (fivefold presets lists them)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set model.num_layers=2 (repeatable)")


def config_from_args(args):
    from fivefold.config import load_config
    return load_config(args.config, args.preset, args.overrides)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fivefold", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            continue
        module.register(sub)
    presets = sub.add_parser("presets", help="list model presets with their parameter counts")
    presets.set_defaults(func=_list_presets)
    return parser


def _list_presets(args) -> int:
    from fivefold.memory.formulas import count_params
    from fivefold.presets import PRESETS
    for name, cfg in PRESETS.items():
        print(f"{name:16s} {count_params(cfg):>18,d} params  layers={cfg.num_layers} hidden={cfg.hidden_size} "
              f"heads={cfg.num_heads}/{cfg.num_kv_heads}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from fivefold.serve.sampling import RequestError

    args = build_parser().parse_args(argv)
    try:
        code = args.func(args) or 0
        from fivefold.parallel.mesh import exit_worker

        exit_worker(code)  # a torchrun worker ends here; a single process returns
        return code
    except (ConfigError, FileNotFoundError, RequestError) as e:
        print(f"fivefold {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `fivefold plan --json | head`: the reader left, nothing to report
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
