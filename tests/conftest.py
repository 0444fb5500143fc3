"""Shared fixtures: tiny fp32 configs on the embedded corpus, with one data cache per test session."""

import pytest

from fivefold.config_load import load_config
from fivefold.kernels.cpu_build import kernel_problem

TINY_DEFAULTS = {
    "train.seq_len": 32, "train.micro_batch_size": 4, "train.steps": 6, "train.lr": 1e-2,
    "train.warmup_steps": 2, "train.peak_flops": 1e11, "train.progress": False, "train.tensorboard": False,
    "train.eval_every": 0, "train.log_every": 1,
}


@pytest.fixture(scope="session", autouse=True)
def cpu_kernels_built():
    """The C++ CPU kernels are built (or known unbuildable) before any test starts an engine: the one-time
    build prints a notice and takes ~1 min, which would otherwise land in whichever test came first,
    inside its timeout and its captured output."""
    kernel_problem()


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("fivefold-cache"))


@pytest.fixture
def tiny_config(data_cache, tmp_path):
    """tiny_config(**{"train.grad_accum": 2}) -> a validated Config for the 'tiny' preset."""
    def make(preset="tiny", **overrides):
        values = {**TINY_DEFAULTS, "data.cache_dir": data_cache, "train.out_dir": str(tmp_path / "run"),
                  **overrides}
        return load_config(preset=preset, overrides=[f"{k}={v}" for k, v in values.items()])
    return make


class FakeClock:
    """A clock that moves only when a fake product "takes" time: what the timed product choices
    (fivefold.serve.cpu_linear) measure, free of a busy host's late wake-ups (the suite runs in two workers)."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def product_clock(monkeypatch):
    """fivefold.serve.cpu_linear timed by a FakeClock: fake products call clock.sleep(seconds)."""
    import fivefold.serve.cpu_linear as cl

    clock = FakeClock()
    monkeypatch.setattr(cl, "time", clock)
    return clock
