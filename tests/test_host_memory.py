"""This host's memory (fivefold.memory.host): the readings agree with Linux's own counters, a peak is honest
where the system cannot restart it, and the main job runs on a system without /proc (a Mac), where reading
/proc/meminfo and /proc/self/status directly once stopped `generate`, `memory` and `plan --device cpu`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fivefold.memory import host

HERE = Path(__file__).parent
MiB = 2 ** 20
linux_only = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="Linux's counters are the reference")


def proc_field(path: str, key: str) -> int:
    with open(path) as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


@linux_only
def test_the_readings_are_linuxs_own():
    """Total RAM and the high-water mark to the byte; what moves while it is read (available memory, this
    worker's resident set) between two readings of /proc, with a page or two to spare."""
    assert host.total() == proc_field("/proc/meminfo", "MemTotal")
    for reading, path, key, slack in [(host.available, "/proc/meminfo", "MemAvailable", 64 * MiB),
                                      (host.resident, "/proc/self/status", "VmRSS", 1 * MiB)]:
        before = proc_field(path, key)
        value = reading()
        after = proc_field(path, key)
        assert min(before, after) - slack <= value <= max(before, after) + slack, (key, before, value, after)
    assert host.resident_peak() == proc_field("/proc/self/status", "VmHWM")


NO_RESET = """
import json, sys, torch
from fivefold.memory import host
from fivefold.memory.tracker import StartupPeak

def refuse(path, *args, **kwargs):
    raise FileNotFoundError(2, "no /proc", path)
host.open = refuse  # host's reads of /proc fail as on a Mac; psutil's own stay
size = 32 * 2 ** 20
assert not host.reset_resident_peak()
earlier = torch.ones(8 * size, dtype=torch.uint8)  # a higher peak before the measurements
del earlier
# The process's peak may have been set before (an import's transient): the second block clears it by 256 MiB.
sizes = [size, host.resident_peak() - host.resident() + 8 * size]
readings = []
for n in sizes:
    with StartupPeak(torch.device("cpu")) as startup:
        block = torch.ones(n, dtype=torch.uint8)  # every page written
        del block
    readings.append(startup.bytes)
print(json.dumps({"sizes": sizes, "readings": readings, "peak": host.resident_peak()}))
"""


@linux_only
def test_a_peak_that_cannot_be_restarted_is_read_only_when_it_is_new():
    """Without clear_refs the high-water mark counts from the process's start (getrusage): a block that stays
    below an earlier peak has no peak of its own to read (None, not the earlier peak's); one that sets a new
    peak, 256 MiB above the earlier one, is read within 4 MiB. The fallback reads the mark Linux's VmHWM does."""
    run = subprocess.run([sys.executable, "-c", NO_RESET], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "1048576"})
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    small, large = out["readings"]
    assert small is None, out
    assert large is not None and abs(large - out["sizes"][1]) <= 4 * MiB, out
    assert out["peak"] >= out["sizes"][1]


def fivefold_without_proc(*args, cache):
    proc = subprocess.run([sys.executable, str(HERE / "without_proc.py"), *args], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "FIVEFOLD_CACHE": cache})
    assert proc.returncode == 0, f"fivefold {' '.join(args)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_the_main_job_runs_without_proc(data_cache, tmp_path):
    """Train, generate, measure memory and plan for this host as on a system without /proc."""
    out = tmp_path / "run"
    fivefold_without_proc("train", "--preset", "tiny", "--out", str(out), "--set", "train.steps=4",
                          "--set", "train.seq_len=64", "--set", "train.log_every=2", "--set", "train.peak_flops=1e11",
                          cache=data_cache)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4]
    assert all(r["memory_bytes"] > 50 * MiB for r in records), records  # the process's resident set: torch alone
    gen = fivefold_without_proc("generate", str(out), "--prompt", "The with", "--max-new-tokens", "8",
                                "--temperature", "0", cache=data_cache)
    assert gen.stdout.startswith("The with") and len(gen.stdout.strip()) > len("The with")
    memory = fivefold_without_proc("memory", "--preset", "tiny", "--synthetic", "--set", "train.seq_len=64",
                                   "--steps", "2", "--json", cache=data_cache)
    total = next(row for row in json.loads(memory.stdout)["comparison"] if row["category"] == "total")
    assert abs(total["measured"] - total["predicted"]) <= 256, total  # to the bytes, as with /proc
    serve = fivefold_without_proc("plan", "--serve", "--device", "cpu", "--preset", "tiny", cache=data_cache)
    assert "planning for this host" in serve.stderr
    free_gb = float(serve.stdout.split(" GB free)")[0].rsplit("(from ", 1)[1])
    assert free_gb * 1e9 == pytest.approx(host.available(), rel=0.1)  # other tests' processes come and go
    fit = fivefold_without_proc("plan", "--fit", "--device", "cpu", "--preset", "tiny", cache=data_cache)
    assert "planning for this host" in fit.stderr and "run with: --set train.micro_batch_size=" in fit.stdout
