"""The gradient noise scale B_simple = tr(S) / |G|^2 (McCandlish et al. 2018, "An Empirical Model of
Large-Batch Training", appendix A.1), estimated from two batch sizes the step already has.

S is the per-token gradient covariance and G the true gradient. A mean gradient over B tokens has
E|G_B|^2 = |G|^2 + tr(S) / B, so two measured sizes, the first micro-batch (B_small, |G_small|^2; read by
fivefold.parallel.small_batch) and the whole step (B_big, |G_big|^2: the clipping norm's), give unbiased
estimates of both terms (appendix A.1):

    |G|^2  ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(S)  ~ (|G_small|^2 - |G_big|^2) / (1/B_small - 1/B_big)

Each step's estimates are noisy (|G|^2's can be negative), so the numerator and the denominator are
smoothed separately with an exponential moving average of factor `train.gns_ema` (0.95: about 20 steps)
and B_simple is their ratio, not an average of ratios (which would be biased). Batch sizes are in target
tokens, the labels that are not IGNORE_INDEX (for pretraining data, every position), so B_simple reads
as a batch size in tokens: the batch beyond which doubling it gains less than it costs (B_crit ~ B_noise).
"""

from __future__ import annotations

import math


def unbiased_estimates(small_sq: float, small_tokens: float, big_sq: float, big_tokens: float) -> tuple[float, float]:
    """(|G|^2, tr(S)) from one step's two batch sizes (McCandlish et al. 2018, appendix A.1)."""
    grad_sq = (big_tokens * big_sq - small_tokens * small_sq) / (big_tokens - small_tokens)
    trace = (small_sq - big_sq) / (1 / small_tokens - 1 / big_tokens)
    return grad_sq, trace


def settle_steps(ema: float) -> int:
    """Steps an EMA of factor `ema` needs to reflect mostly new values: its horizon 1 / (1 - ema)."""
    return max(1, round(1 / (1 - ema)))


class NoiseScale:
    """EMAs of |G|^2 and tr(S), bias-corrected as Adam's moments are (Kingma & Ba 2015, section 3), and
    their ratio B_simple. Plain floats: the same on every rank when fed the same (all-reduced) norms."""

    def __init__(self, ema: float):
        self.ema = ema
        self.count = 0  # steps measured
        self.grad_sq_avg = 0.0
        self.trace_avg = 0.0

    def update(self, small_sq: float, small_tokens: float, big_sq: float, big_tokens: float) -> None:
        """Fold in one step: |G_small|^2 over small_tokens, |G_big|^2 over big_tokens (> small_tokens)."""
        if not big_tokens > small_tokens > 0 or not math.isfinite(small_sq) or not math.isfinite(big_sq):
            return
        grad_sq, trace = unbiased_estimates(small_sq, small_tokens, big_sq, big_tokens)
        self.grad_sq_avg = self.ema * self.grad_sq_avg + (1 - self.ema) * grad_sq
        self.trace_avg = self.ema * self.trace_avg + (1 - self.ema) * trace
        self.count += 1

    def _corrected(self, avg: float) -> float:
        return avg / (1 - self.ema ** self.count)

    @property
    def grad_sq(self) -> float:
        """Smoothed |G|^2 (bias-corrected)."""
        return self._corrected(self.grad_sq_avg) if self.count else math.nan

    @property
    def trace(self) -> float:
        """Smoothed tr(S), per token (bias-corrected)."""
        return self._corrected(self.trace_avg) if self.count else math.nan

    @property
    def value(self) -> float | None:
        """B_simple in tokens; None before the first step, or while the smoothed estimates are not both
        positive (early, noise can outweigh the signal in |G|^2's estimate)."""
        if not self.count or self.grad_sq_avg <= 0 or self.trace_avg <= 0:
            return None
        return self.trace_avg / self.grad_sq_avg  # the bias corrections cancel

    def record(self) -> dict:
        """What a step's metrics record gets: `gns` (when defined), `gns_trace`, `gns_grad_sq`."""
        if not self.count:
            return {}
        out = {"gns_trace": self.trace, "gns_grad_sq": self.grad_sq}
        if self.value is not None:
            out["gns"] = self.value
        return out

    def state_dict(self) -> dict:
        return {"count": self.count, "grad_sq_avg": self.grad_sq_avg, "trace_avg": self.trace_avg}

    def load_state_dict(self, state: dict) -> None:
        self.count = int(state["count"])
        self.grad_sq_avg, self.trace_avg = float(state["grad_sq_avg"]), float(state["trace_avg"])
