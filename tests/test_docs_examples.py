"""The documentation's examples work as written: docs/python-api.md's Python (train, plan, search, serve) runs
in a fresh directory, and every `fivefold ...` command line the docs show is one the CLI accepts."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from fivefold.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), re.S | re.M)


def test_python_api_example_runs(data_cache, tmp_path):
    blocks = python_blocks(ROOT / "docs/python-api.md")
    assert len(blocks) == 1
    run = subprocess.run([sys.executable, "-c", blocks[0]], cwd=tmp_path, capture_output=True, text=True,
                         timeout=600, env={**os.environ, "FIVEFOLD_CACHE": data_cache})
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert "parameters" in out and "parallel.dp=" in out  # the memory table and the best layout's overrides
    assert (tmp_path / "runs").is_dir()  # fit() saved where the example serves from


def documented_commands() -> list[tuple[str, list[str]]]:
    """(file, argv) of each `fivefold ...` command in the shell blocks of the README, docs/ and bench/README.md:
    continuation lines joined, `&&` chains split, optional `[--flag]` tokens dropped."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench/README.md"]:
        if path.name == "architecture.md":  # its code blocks are diagrams of the call path
            continue
        for block in re.findall(r"^```(?:bash|sh|console)?\n(.*?)^```", path.read_text(), re.S | re.M):
            for line in block.replace("\\\n", " ").splitlines():
                for command in line.split("&&"):
                    command = command.strip().removeprefix("$ ")
                    if command.startswith("fivefold "):
                        words = shlex.split(command, comments=True)
                        words = words[1:words.index("|")] if "|" in words else words[1:]
                        found.append((path.name, [w for w in words if not w.startswith("[")]))
    return found


def test_documented_commands_parse():
    """Every `fivefold ...` command the documentation shows is one the command line accepts (argparse only:
    nothing runs), so a renamed flag cannot leave the docs behind."""
    commands = documented_commands()
    assert len(commands) >= 70 and sum(name == "README.md" for name, _ in commands) >= 3
    parser = build_parser()
    for name, argv in commands:
        args, extra = parser.parse_known_args(argv)
        assert not extra and callable(args.func), (name, argv)
