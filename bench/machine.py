"""What the benchmarks record about the machine they ran on."""

import os
import platform

import torch

from fivefold.planner.calibrate import cpu_model


def base_info() -> dict:
    return {"cpu_model": cpu_model(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version()}
