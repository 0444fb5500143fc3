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


def test_each_version_of_the_sources_builds_in_a_directory_of_its_own(tmp_path, monkeypatch):
    """The build directory's name changes with any source or header, so a rebuild never reuses an object
    compiled from an earlier version (and two versions sharing the cache do not rebuild each other's)."""
    sources = [tmp_path / p.name for p in cpu_build.SOURCES]
    headers = [tmp_path / p.name for p in cpu_build.HEADERS]
    for copy, original in zip(sources + headers, cpu_build.SOURCES + cpu_build.HEADERS):
        copy.write_bytes(original.read_bytes())
    monkeypatch.setattr(cpu_build, "SOURCES", sources)
    monkeypatch.setattr(cpu_build, "HEADERS", headers)
    seen = {cpu_build._signature()}
    for path in (sources[0], sources[-1], headers[0]):
        path.write_text(path.read_text() + "\n// changed\n")
        seen.add(cpu_build._signature())
    assert len(seen) == 4
    assert cpu_build._signature() == cpu_build._signature()
