"""Importing a bench/ script as a module in a test, with bench/ on sys.path for the helpers it imports
(machine, serve_client, gpu_summary) while the test runs."""

import contextlib
import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


@contextlib.contextmanager
def bench_module(script: str, name: str | None = None):
    """bench/<script>.py, loaded as the module `name` (default: the script's name)."""
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(name or script, BENCH / f"{script}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH))
