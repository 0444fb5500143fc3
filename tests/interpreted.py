"""Run a test file again in a child process whose Triton runs kernels in its CPU interpreter.

triton.jit chooses compiler or interpreter when a function is decorated, so TRITON_INTERPRET=1 must be
set before triton's first import; a test file imported after triton was loaded without it reruns itself."""

import os
import subprocess
import sys
from pathlib import Path


def rerun_interpreted(test_file: str) -> None:
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file],
                           env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=Path(__file__).parent.parent,
                           capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-2000:]
