"""What the benchmarks record about the machine they ran on."""

import os
import platform

import torch


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        return "unknown"


def base_info() -> dict:
    return {"cpu_model": cpu_model(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version()}
