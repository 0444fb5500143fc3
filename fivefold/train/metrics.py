"""Step metrics: model FLOPs utilisation against a measured peak, a JSONL log, TensorBoard, a progress bar."""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from pathlib import Path

import torch


def measure_peak_flops(device: torch.device, dtype: torch.dtype, size: int = 2048, reps: int = 8) -> float:
    """Achievable dense-matmul FLOP/s of this device and dtype, measured (not a datasheet number), so MFU
    is relative to what this machine's kernels really do with the threads it has. The fastest of several
    repetitions is kept: other load on the machine can only make a repetition slower."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    for _ in range(2):  # warm up: thread pools, kernel selection, AMX tiles
        a @ b
    synchronize(device)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size ** 3 / best


def probed_peak_flops(device: torch.device, dtype: torch.dtype, budget_s: float = 5.0) -> float:
    """measure_peak_flops at full size, unless a small probe says that would take longer than `budget_s`:
    a dtype the device only emulates (bf16 on a CPU without AVX512-BF16 or AMX runs two orders of
    magnitude below fp32, minutes for the full measurement) keeps the probe's figure."""
    probe = measure_peak_flops(device, dtype, size=512, reps=3)
    full = 10 * 2 * 2048 ** 3 / probe  # the full measurement's matmuls (warm-up included) at the probe's rate
    return measure_peak_flops(device, dtype) if full <= budget_s else probe


@functools.lru_cache(maxsize=None)
def peak_flops(device: torch.device, dtype: torch.dtype, threads: int) -> float:
    """Measured matmul peak, remembered across runs as the best ever seen for this device, dtype and
    thread count: a measurement taken while the machine is busy reads low and would inflate MFU."""
    from fivefold.data.corpus import cache_dir

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    key = f"{name}|{dtype}|{threads}|{torch.__version__}"
    path = cache_dir() / "peak_flops.json"
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    peak = max(probed_peak_flops(device, dtype), known.get(key, 0.0))
    if peak != known.get(key):
        known[key] = peak
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps(known, indent=1))
        os.replace(tmp, path)
    return peak


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory_bytes(device: torch.device) -> int:
    """Memory in use now: the CUDA caching allocator's allocated bytes, or this process's RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


class MetricsLog:
    """Writes one JSON object per logged step to metrics.jsonl, and mirrors scalars to TensorBoard."""

    def __init__(self, out_dir: Path, tensorboard: bool, append: bool):
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / "metrics.jsonl"
        self.file = open(self.path, "a" if append else "w", encoding="utf-8")
        self.writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.writer = SummaryWriter(str(out_dir / "tensorboard"))
            except ImportError:  # tensorboard is an optional extra
                self.writer = None

    def log(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.writer.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self.file.close()
        if self.writer is not None:
            self.writer.close()


def progress_bar(total: int, initial: int, enabled: bool):
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                disable=not enabled or not sys.stderr.isatty())
