"""The `fivefold` command line. Each module of fivefold/commands/ registers its subcommands (a
`register(subparsers)` function), so this file only assembles them and turns known errors into clean
messages."""

from __future__ import annotations

import argparse
import difflib
import errno
import importlib
import os
import sys
import traceback
import warnings

from fivefold.errors import UserError
from fivefold.memory.formulas import count_params
from fivefold.parallel.mesh import exit_worker, leave_failed_worker
from fivefold.presets import PRESETS

# Modules that define `register(subparsers)`; each adds one or more subcommands.
COMMAND_MODULES = [
    "fivefold.commands.train",      # train, compare-runs, plot
    "fivefold.commands.data",       # prepare
    "fivefold.commands.interop",    # import-hf, export-hf
    "fivefold.commands.plan",       # plan, memory
    "fivefold.commands.pipeline",   # pipeline
    "fivefold.commands.serve",      # serve, generate
    "fivefold.commands.hardware",   # calibrate, hardware
    "fivefold.commands.quantize",   # quantize
]


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line like every other error (the usage is one --help away)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="fivefold",
                    description="Train, plan, measure and serve Llama-family models on one CPU or many GPUs.")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of every error (also FIVEFOLD_DEBUG=1)")
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
    parser.commands = sub.choices  # name -> its parser
    return parser


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """parse_args, but an unknown option is reported by its subcommand's parser, which names the subcommand's
    --help and the closest option it has (argparse leaves these to the top-level parser)."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        sub = parser.commands[args.command]
        options = [o for action in sub._actions for o in action.option_strings]  # argparse lists them nowhere public
        close = difflib.get_close_matches(extra[0].split("=")[0], options, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        sub.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    return args


def _list_presets(args) -> int:
    for name, cfg in PRESETS.items():
        print(f"{name:16s} {count_params(cfg):>18,d} params  layers={cfg.num_layers} hidden={cfg.hidden_size} "
              f"heads={cfg.num_heads}/{cfg.num_kv_heads}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run one command. This is the error boundary: an anticipated error (UserError, a missing file, a
    full disk) is one line `fivefold <command>: error: ...` and exit 2; anything else is a bug, shown
    with its traceback and a request to report it (exit 1). `--debug` shows tracebacks for all."""
    try:
        args = _parse(build_parser(), argv)
    except SystemExit as e:  # --help, or a usage error already printed as one line
        return e.code if isinstance(e.code, int) else 2
    _show_warnings_as_lines()
    try:
        code = args.func(args) or 0
        exit_worker(code)  # a torchrun worker ends here; a single process returns
        return code
    except KeyboardInterrupt:
        print(f"fivefold {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `fivefold plan --json | head`: the reader left, nothing to report
        sys.stderr.close()
        return 0
    except Exception as e:
        code = _report(e, args)
        leave_failed_worker(code)  # a torchrun worker ends here; a single process returns
        return code


def _report(e: Exception, args) -> int:
    """Print what went wrong (one line, or a traceback for a bug); the exit code."""
    if not is_anticipated(e):
        traceback.print_exc()
        print(f"fivefold {args.command}: internal error ({type(e).__name__}); this is a bug in fivefold: please "
              f"report it with the command line and the traceback above", file=sys.stderr)
        return 1
    if args.debug or os.environ.get("FIVEFOLD_DEBUG"):
        traceback.print_exc()
    rank = os.environ.get("RANK", "0")
    if rank != "0" and getattr(e, "every_rank", False):
        return 2  # rank 0 reports the same error
    where = f" (rank {rank})" if rank != "0" else ""
    print(f"fivefold {args.command}: error{where}: {one_line(e)}", file=sys.stderr)
    return 2


def is_anticipated(e: BaseException) -> bool:
    """Errors whose message tells the user what to change: ours, and the file system's."""
    if isinstance(e, (UserError, FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError,
                      NotADirectoryError)):
        return True
    if _out_of_memory(e):
        return True
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)


def _out_of_memory(e: BaseException) -> bool:
    """torch's OutOfMemoryError (an accelerator), or the CPU allocator's RuntimeError."""
    import torch

    return isinstance(e, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(e, RuntimeError) and "can't allocate memory" in str(e))


def one_line(e: BaseException) -> str:
    if _out_of_memory(e):
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return (f"out of memory ({first[:200]}); `fivefold plan` with the same options predicts what this needs: "
                f"lower train.micro_batch_size or train.seq_len, use train.recompute=full, or shard the model "
                f"(parallel.zero, tp, pp)")
    if isinstance(e, OSError) and not isinstance(e, UserError) and e.strerror:  # "[Errno 28] ..." reads badly
        return f"{e.strerror}: {e.filename}" if e.filename else e.strerror
    return " ".join(str(e).split())


def _show_warnings_as_lines() -> None:
    """fivefold's own warnings read `fivefold: warning: ...`, without a source line."""
    original = warnings.formatwarning

    def format_warning(message, category, filename, lineno, line=None):
        if category.__module__.startswith("fivefold"):
            return f"fivefold: warning: {message}\n"
        return original(message, category, filename, lineno, line)
    warnings.formatwarning = format_warning


if __name__ == "__main__":
    sys.exit(main())
