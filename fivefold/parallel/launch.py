"""Launching worker processes through torchrun (torch.distributed.run), never a home-made spawner."""

from __future__ import annotations

import sys

from fivefold.parallel.mesh import check_supported


def without_option(argv: list[str], name: str) -> list[str]:
    """argv minus `name VALUE` / `name=VALUE`: what the workers must not see again (e.g. --nproc)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == name:
            skip = True
        elif not arg.startswith(name + "="):
            out.append(arg)
    return out


SHUTDOWN_TIMEOUT_S = 600


def torchrun_args(nproc: int, target: list[str]) -> list[str]:
    """Arguments for torch.distributed.run: one machine, a free rendezvous port, `target` per worker
    (e.g. ["-m", "fivefold", "train", ...] or [script.py, ...])."""
    # A stopped job's workers finish their step and save before they exit: give them time for that
    # (torchrun's default is 30 s before SIGKILL).
    return ["--standalone", f"--nproc-per-node={nproc}", f"--shutdown-timeout={SHUTDOWN_TIMEOUT_S}", *target]


def check_launch(cfg, nproc: int) -> None:
    """The config against `nproc` processes (without a layout they are data parallel): a bad one fails
    here, before any worker starts or anything is written."""
    if cfg.parallel.dp == 1 and cfg.parallel.world_size == 1:
        cfg.parallel.dp = nproc
    check_supported(cfg, nproc)


def launch_workers(cfg, nproc: int, argv: list[str], command: str) -> int:
    """Re-run this same fivefold command in `nproc` workers under torchrun's elastic agent, which also
    ends the whole job (non-zero exit, naming the failed rank) as soon as one worker dies. The config is
    checked against the layout first, so a bad one fails here, before any worker starts."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    check_launch(cfg, nproc)

    try:
        torchrun(torchrun_args(nproc, ["-m", "fivefold", *without_option(argv, "--nproc")]))
    except SignalException as e:  # Ctrl-C / SIGTERM: forwarded to the workers, which stop (and save)
        print(f"fivefold {command}: stopped by {e.sigval.name}", file=sys.stderr)
        return 128 + e.sigval.value
    except Exception as e:  # torchrun raises ChildFailedError after printing which rank failed and why
        first = e.get_first_failure()[1] if hasattr(e, "get_first_failure") else None
        if first is not None and first.exitcode == 2:  # the first to fail printed an anticipated error
            return 2  # (fivefold.cli); the others were stopped by torchrun after it
        print(f"fivefold {command}: a worker failed: {e}", file=sys.stderr)
        return 1
    return 0
