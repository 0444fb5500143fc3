"""Run `python -m fivefold ...` as on a system without /proc (macOS, Windows): any read of /proc by fivefold,
or by a library it calls, raises FileNotFoundError as it would there; psutil alone reads it, as psutil reads
each system its own way. Used as `python tests/without_proc.py ARGS` by tests/test_host_memory.py."""

import builtins
import io
import os
import runpy
import sys


def _guarded(real):
    def open_(file, *args, **kwargs):
        path = os.fspath(file) if isinstance(file, (str, bytes, os.PathLike)) else ""
        path = path.decode() if isinstance(path, bytes) else path
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if path.startswith("/proc") and path != "/proc/cpuinfo" and not caller.startswith("psutil"):
            raise FileNotFoundError(2, "No such file or directory (no /proc on this system)", path)
        return real(file, *args, **kwargs)
    return open_


builtins.open = _guarded(builtins.open)
io.open = _guarded(io.open)
sys.argv = ["fivefold", *sys.argv[1:]]
runpy.run_module("fivefold", run_name="__main__", alter_sys=True)
