"""The C++ CPU kernels (serve.cpu_kernel), built once per machine (and version of fivefold) as one torch extension.

cpu_paged_decode.cpp (decode attention reading the paged pool in place), cpu_linear_rows.cpp (a linear's
product at a decode's few rows) and cpu_block_ops.cpp (a block's norms, SwiGLU, and RoPE with the KV store before
decode attention, one call each, and a decode step's every block as one call), bound by cpu_kernels.cpp. Built
at first use with torch's extension builder (a C++ compiler and ninja; ~1 min on 2 cores) for this CPU's
instruction set, where torch keeps its extensions ($TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions; a
directory per version of the sources), and loaded from there afterwards.
Where it cannot be built, `kernel_problem()` says why and the engine keeps torch's ops; the failure is
remembered in the build directory (`failed.txt`) until the compiler changes.

torch's builder guards a build directory with a lock file that only the process holding it removes: a build
interrupted (Ctrl-C, a killed job) leaves it behind, and every later process waits on it forever, silently.
Here each process first takes an advisory lock of the operating system's (fcntl.flock), which dies with its
holder; whoever holds it knows that no other build of this directory runs, so a lock file found then is a
dead build's and goes. The sources are compiled from copies inside the build directory: ninja keys its work
by source paths, so two checkouts of the same version (a clone for CI, a worktree) share one build instead of
each rebuilding it for the other.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import shutil
import sys
from pathlib import Path

import torch

HERE = Path(__file__).parent
SOURCES = [HERE / "cpu_kernels.cpp", HERE / "cpu_paged_decode.cpp", HERE / "cpu_linear_rows.cpp",
           HERE / "cpu_block_ops.cpp"]
HEADERS = [HERE / "cpu_simd.h"]
FAILED = "failed.txt"  # in the build directory: the compiler of a build that failed, and why
DTYPES = (torch.float32, torch.bfloat16)  # what the kernels compute in (bfloat16 widened to float32 as read)


def _signature() -> str:
    """What the built code depends on: the CPU it is compiled for (-march=native: a cache directory shared by
    machines with other instruction sets must not hand them this build), torch's version, and the sources and
    headers. torch's builder would notice changed sources by itself, but it rebuilds in place, where ninja
    judges each object by its time stamp: a source edited while it compiled kept its old object and linked
    against the new ones (an undefined symbol at load). A directory of its own per version cannot mix them,
    and two checkouts of different versions sharing the cache do not rebuild each other's."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    code = b"".join(h.read_bytes() for h in SOURCES + HEADERS)
    return hashlib.sha256(f"{platform.machine()} {flags} {torch.__version__}".encode() + code).hexdigest()[:10]


def _ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH. The ninja wheel (a dependency) installs it beside the
    environment's python, which is not on PATH where that python runs without the environment activated
    (run.sh calls .venv/bin/python): add its directory after the others, so that a system ninja still wins."""
    try:
        import ninja
    except ImportError:
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = f"{path}{os.pathsep}{ninja.BIN_DIR}" if path else ninja.BIN_DIR


def _staged(build_dir: Path) -> Path:
    """The sources and headers copied into build_dir/src (the directory's name fixes their content), written
    only where missing or different, so that a copy's time stamp, which ninja reads, changes no more often than
    its content."""
    src = build_dir / "src"
    src.mkdir(exist_ok=True)
    for original in SOURCES + HEADERS:
        copy, data = src / original.name, original.read_bytes()
        if not copy.is_file() or copy.read_bytes() != data:
            partial = copy.with_name(f"{copy.name}.{os.getpid()}.partial")
            partial.write_bytes(data)
            os.replace(partial, copy)
    return src


@contextlib.contextmanager
def _only_builder(build_dir: Path):
    """Hold the build directory alone among fivefold's processes, and clear a lock file an interrupted build
    left (see the module's docstring)."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): torch's lock file alone, as before
        yield
        return
    with open(build_dir / "fivefold.lock", "a") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another process building fivefold's CPU kernels in {build_dir}", file=sys.stderr,
                  flush=True)
            fcntl.flock(held, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                print(f"removing {stale}, left by an interrupted build", file=sys.stderr, flush=True)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def build_directory() -> Path:
    """Where this version of the kernels is built: torch's own place for extensions, shared by every run on
    this machine."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    return Path(root) / f"fivefold_cpu_kernels_{_signature()}"


def _compiler() -> str:
    """The C++ compiler torch's builder runs ($CXX, default c++) as the path it resolves to and that file's
    time stamp: a build that failed is tried again once either changes (a compiler installed or updated)."""
    path = shutil.which(os.environ.get("CXX", "c++"))
    return f"{path} {os.stat(path).st_mtime_ns}" if path else "no compiler"


def _remembered_failure(build_dir: Path) -> str | None:
    """Why the last build in build_dir failed, where it failed with this compiler; None otherwise."""
    try:
        compiler, why = (build_dir / FAILED).read_text().split("\n", 1)
    except (OSError, ValueError):
        return None
    return why if compiler == _compiler() else None


def compile_sources(src: Path, build_dir: Path):
    """The extension built from the kernels' files in `src` (SOURCES' names, with HEADERS) into `build_dir`,
    named after it, and loaded (torch's builder: nothing is compiled again where the objects are current)."""
    from torch.utils.cpp_extension import load

    return load(name=build_dir.name, sources=[str(src / s.name) for s in SOURCES], extra_include_paths=[str(src)],
                extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir), verbose=False)


@functools.cache
def build():
    """(module, None) once built and loaded, or (None, why not). A build that fails is remembered in its
    directory with the compiler that failed it, so that each later process of this machine (every
    `fivefold generate` on a Mac whose clang has no OpenMP) does not try again and announce a minute's build."""
    from torch.utils.cpp_extension import verify_ninja_availability

    _ninja_on_path()
    try:
        verify_ninja_availability()
    except RuntimeError:
        return None, "ninja is not installed (pip install ninja)"
    build_dir = build_directory()
    build_dir.mkdir(parents=True, exist_ok=True)
    failed = _remembered_failure(build_dir)
    if failed:
        return None, f"{failed} (an earlier build's; remove {build_dir / FAILED} to try again)"
    if not any(build_dir.glob("*.so")):  # on stderr: `fivefold generate` writes its text on stdout
        print(f"building fivefold's CPU kernels for this machine (once; ~1 min on 2 cores) in {build_dir}",
              file=sys.stderr, flush=True)
    try:
        with _only_builder(build_dir):
            module = compile_sources(_staged(build_dir), build_dir)
    except Exception as e:  # noqa: BLE001 - whatever failed (no compiler, a linker error), the answer is the same
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        why = f"building it failed: {type(e).__name__}: {first}"[:300]
        partial = build_dir / f"{FAILED}.{os.getpid()}.partial"
        partial.write_text(f"{_compiler()}\n{why}")
        os.replace(partial, build_dir / FAILED)
        return None, why
    (build_dir / FAILED).unlink(missing_ok=True)
    return module, None


def kernel_problem() -> str | None:
    """Why the CPU kernels cannot run here (building them on the first call), or None when they can."""
    return build()[1]
