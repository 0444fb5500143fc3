"""The C++ CPU kernels' build (fivefold.kernels.cpu_build): ninja found where run.sh runs the environment's
python without activating it."""

import os

from torch.utils.cpp_extension import verify_ninja_availability

from fivefold.kernels import cpu_build


def test_the_ninja_wheel_is_found_without_the_environment_on_path(monkeypatch):
    """PATH without the environment's bin directory (and no system ninja on it): after _ninja_on_path torch's
    builder finds the wheel's ninja; a PATH that already has it is left as it was, and a system ninja earlier
    on PATH keeps its place."""
    import ninja
    monkeypatch.setenv("PATH", "/nonexistent")
    cpu_build._ninja_on_path()
    assert os.environ["PATH"] == f"/nonexistent{os.pathsep}{ninja.BIN_DIR}"
    verify_ninja_availability()  # raises where ninja cannot be run
    cpu_build._ninja_on_path()
    assert os.environ["PATH"] == f"/nonexistent{os.pathsep}{ninja.BIN_DIR}"
