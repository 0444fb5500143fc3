"""Which of fivefold's ConfigError raises no test provokes: the check behind "bad input gets a clear error".

    python tests/error_coverage.py [PYTEST ARGS ...]      # the whole suite by default, ~22 min on 2 cores

Runs pytest in this process with a hook that records the source line of every ConfigError constructed, then
lists each `raise ConfigError(...)` under fivefold/ that no test reached. A raise reached only inside a
subprocess (a test that runs the CLI or torchrun) is not seen, so the list can name a raise some test does
check; grep the tests for its message before writing one. Exits non-zero when the list is not empty.
"""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HITS: set[tuple[str, int]] = set()


def _record() -> None:
    """From here on, every ConfigError constructed in this process records its caller's file and line."""
    from fivefold.config import ConfigError

    base = ConfigError.__init__

    def init(self, *args, **kwargs):
        frame = sys._getframe(1)
        while frame is not None and frame.f_locals.get("self") is self:  # a subclass's own __init__
            frame = frame.f_back
        if frame is not None:
            HITS.add((os.path.realpath(frame.f_code.co_filename), frame.f_lineno))
        base(self, *args, **kwargs)

    ConfigError.__init__ = init


def raise_sites() -> list[tuple[str, int, int, str]]:
    """(path, first line, last line, the raise's first line) of every `raise ConfigError(...)` under fivefold/."""
    sites = []
    for path in sorted((ROOT / "fivefold").rglob("*.py")):
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
                    and getattr(node.exc.func, "id", None) == "ConfigError"):
                first = ast.get_source_segment(source, node).splitlines()[0].strip()
                sites.append((str(path.resolve()), node.lineno, node.end_lineno, first))
    return sites


def unraised(hits: set[tuple[str, int]], sites: list | None = None) -> list[tuple[str, int, int, str]]:
    """The raise sites (default: every one under fivefold/) that no recorded line falls inside."""
    lines: dict[str, set[int]] = {}
    for path, line in hits:
        lines.setdefault(path, set()).add(line)
    return [site for site in (raise_sites() if sites is None else sites)
            if not any(site[1] <= line <= site[2] for line in lines.get(site[0], ()))]


def main(argv: list[str]) -> int:
    import pytest

    _record()
    os.chdir(ROOT)
    sys.path.insert(0, str(ROOT / "tests"))
    pytest.main(["-q", "-p", "no:cacheprovider", *(argv or ["tests"])])
    sites = raise_sites()
    missing = unraised(HITS, sites)
    total = len(sites)
    for path, line, _, first in missing:
        print(f"{os.path.relpath(path, ROOT)}:{line}: {first[:120]}")
    print(f"{total - len(missing)} of {total} ConfigError raises provoked by a test in this process")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
