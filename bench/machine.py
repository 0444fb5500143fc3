"""What the benchmarks record about the machine they ran on."""

import json
import os
import platform
import time

import torch

from fivefold.planner.calibrate import cpu_model


def base_info(device: str = "cpu") -> dict:
    """The host, torch and Python; and the GPU's name where `device` is cuda."""
    info = {"cpu_model": cpu_model(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version()}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info


def write_results(path: str, data: dict) -> None:
    """A benchmark's numbers as indented JSON at `path` (its folder made if missing), and a line saying where."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    print(f"wrote {path}")


def us_per_call(fns: dict, *args, reps: int = 4000, warmup: int = 200) -> dict:
    """Microseconds per call of each of `fns` (name -> function) on `args`, in inference mode: a fixed cost,
    where the arguments are small."""
    out = {}
    with torch.inference_mode():
        for name, fn in fns.items():
            for _ in range(warmup):
                fn(*args)
            start = time.perf_counter()
            for _ in range(reps):
                fn(*args)
            out[name] = (time.perf_counter() - start) / reps * 1e6
    return out
