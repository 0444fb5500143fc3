"""Launching worker processes through torchrun (torch.distributed.run), never a home-made spawner."""

from __future__ import annotations


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


def torchrun_args(nproc: int, target: list[str]) -> list[str]:
    """Arguments for torch.distributed.run: one machine, a free rendezvous port, `target` per worker
    (e.g. ["-m", "fivefold", "train", ...] or [script.py, ...])."""
    return ["--standalone", f"--nproc-per-node={nproc}", *target]
