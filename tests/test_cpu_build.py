"""The C++ CPU kernels' build (fivefold.kernels.cpu_build): ninja found where run.sh runs the environment's
python without activating it, a directory per version of the sources, shared by checkouts, and a build that
survives one interrupted before it."""

import json
import os
import subprocess
import sys

import pytest
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


def test_the_sources_are_staged_once_into_the_build_directory(tmp_path):
    """The build reads copies inside its own directory, so that checkouts of one version at other paths share
    one build. A copy is written only when missing or different: a time stamp that moved on every call would
    make ninja rebuild every time."""
    src = cpu_build._staged(tmp_path)
    originals = cpu_build.SOURCES + cpu_build.HEADERS
    assert sorted(p.name for p in src.iterdir()) == sorted(p.name for p in originals)
    assert all((src / p.name).read_bytes() == p.read_bytes() for p in originals)
    stamps = {p.name: (src / p.name).stat().st_mtime_ns for p in originals}
    damaged = src / cpu_build.SOURCES[0].name
    damaged.write_text("// cut short")
    os.utime(damaged, ns=(stamps[damaged.name], stamps[damaged.name]))
    cpu_build._staged(tmp_path)
    assert damaged.read_bytes() == cpu_build.SOURCES[0].read_bytes()
    assert {p.name: (src / p.name).stat().st_mtime_ns for p in originals if p.name != damaged.name} == \
        {k: v for k, v in stamps.items() if k != damaged.name}
    assert not list(src.glob("*.partial"))


def test_a_lock_left_by_an_interrupted_build_is_cleared_and_builders_take_turns(tmp_path, capsys):
    """torch's lock file, left behind by a build that was killed, would make every later build wait forever.
    While another process holds the directory, a builder waits and says so; once it holds it, a lock file
    there can only be a dead build's, and it goes."""
    import fcntl
    import threading

    (tmp_path / "lock").touch()
    entered = threading.Event()

    def builder():
        with cpu_build._only_builder(tmp_path):
            entered.set()

    with open(tmp_path / "fivefold.lock", "a") as other:
        fcntl.flock(other, fcntl.LOCK_EX)
        thread = threading.Thread(target=builder)
        thread.start()
        assert not entered.wait(0.5)
        assert (tmp_path / "lock").exists()
        fcntl.flock(other, fcntl.LOCK_UN)
    thread.join(10)
    assert entered.is_set() and not (tmp_path / "lock").exists()
    err = capsys.readouterr().err
    assert "waiting for another process building" in err and "left by an interrupted build" in err


def test_a_real_build_after_an_interrupted_one_loads(tmp_path):
    """End to end, in a fresh process: the lock file of a killed build in the real build directory, then
    build(), which returns the module instead of waiting forever. Other processes of the suite (parallel
    workers, their engines) may build at the same time and clear the file first, so the test holds the
    directory while it leaves the file and until the fresh process waits for it: whichever builder takes the
    directory next meets the file, and without the clearing that builder, and every one after it, would wait
    forever (the message is checked by the test above)."""
    import subprocess
    import sys

    if cpu_build.kernel_problem() is not None:
        pytest.skip(f"the CPU kernels cannot be built here: {cpu_build.kernel_problem()}")
    build_dir = cpu_build.build_directory()
    code = "from fivefold.kernels import cpu_build; m, why = cpu_build.build(); print(why, hasattr(m, 'linear_rows'))"
    with cpu_build._only_builder(build_dir):  # the builders' own lock
        (build_dir / "lock").touch()
        fresh = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True)
        waiting = fresh.stderr.readline()
    try:
        out, err = fresh.communicate(timeout=600)
    finally:
        fresh.kill()
    assert "waiting for another process building" in waiting, waiting + err
    assert out.split() == ["None", "True"], err
    assert not (build_dir / "lock").exists()


REMEMBERED = r"""
import json, os, sys
import torch.utils.cpp_extension as ext
from fivefold.kernels import cpu_build

calls = []
def failing_load(**kwargs):
    calls.append(kwargs["name"])
    raise RuntimeError("Error building extension: clang: error: unsupported option '-fopenmp'")
ext.load = failing_load
seen = []
def attempt():
    cpu_build.build.cache_clear()
    before = len(calls)
    seen.append({"why": cpu_build.build()[1], "built": len(calls) > before,
                 "remembered": (cpu_build.build_directory() / cpu_build.FAILED).exists()})
attempt()  # fails, and is remembered
attempt()  # the same compiler: not tried again
os.utime(os.environ["CXX"], ns=(1, 1))  # the compiler changed (installed anew)
attempt()  # tried again
ext.load = lambda **kwargs: calls.append(kwargs["name"]) or "module"
os.utime(os.environ["CXX"], ns=(2, 2))
attempt()  # builds: the failure is forgotten
print(json.dumps(seen))
"""


def test_a_failed_build_is_remembered_until_the_compiler_changes(tmp_path):
    """Where the kernels cannot be built (a Mac's clang without OpenMP), each later process takes the failure
    from the build directory instead of building again, and says how to retry; a changed compiler tries again,
    and a build that succeeds forgets the failure."""
    compiler = tmp_path / "c++"
    compiler.write_text("#!/bin/sh\nexit 1\n")
    compiler.chmod(0o755)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "CXX": str(compiler)}
    run = subprocess.run([sys.executable, "-c", REMEMBERED], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    first, again, changed, built = json.loads(run.stdout.strip().splitlines()[-1])
    assert first == {"why": "building it failed: RuntimeError: Error building extension: clang: error: "
                            "unsupported option '-fopenmp'", "built": True, "remembered": True}
    assert not again["built"] and again["why"].startswith(first["why"] + " (an earlier build's; remove ")
    assert again["why"].endswith(f"{cpu_build.FAILED} to try again)")
    assert changed == first
    assert built == {"why": None, "built": True, "remembered": False}
    assert "building fivefold's CPU kernels" in run.stderr
