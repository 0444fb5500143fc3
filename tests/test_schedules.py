"""Learning-rate shapes, batch-size scaling rules and the batch-size schedule."""

import math

import pytest

from fivefold.config import TrainConfig
from fivefold.train.optim import grad_accum_at, lr_at


def cfg(**kw):
    return TrainConfig(**{"lr": 1.0, "steps": 100, "warmup_steps": 10, "min_lr_ratio": 0.1, **kw})


def test_warmup_then_cosine_to_the_floor():
    c = cfg()
    assert lr_at(0, c, 1, 1) == pytest.approx(0.1)
    assert lr_at(9, c, 1, 1) == pytest.approx(1.0)
    assert lr_at(55, c, 1, 1) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(100, c, 1, 1) == pytest.approx(0.1)


def test_linear_and_constant():
    assert lr_at(55, cfg(lr_schedule="linear"), 1, 1) == pytest.approx(1 - 0.9 * 0.5)
    assert lr_at(90, cfg(lr_schedule="constant"), 1, 1) == 1.0


def test_warmup_stable_decay():
    c = cfg(lr_schedule="wsd", decay_fraction=0.2)
    assert lr_at(50, c, 1, 1) == 1.0 and lr_at(79, c, 1, 1) == 1.0
    assert lr_at(90, c, 1, 1) == pytest.approx(1 - 0.9 * 0.5)
    assert lr_at(100, c, 1, 1) == pytest.approx(0.1)


def test_batch_size_scaling_rules():
    assert lr_at(50, cfg(lr_scaling="linear", lr_schedule="constant"), 4000, 1000) == pytest.approx(4.0)
    assert lr_at(50, cfg(lr_scaling="sqrt", lr_schedule="constant"), 4000, 1000) == pytest.approx(2.0)
    assert lr_at(50, cfg(lr_scaling="none", lr_schedule="constant"), 4000, 1000) == 1.0


def test_batch_schedule_raises_grad_accum_at_token_thresholds():
    c = TrainConfig(grad_accum=1, batch_schedule="1000:2,5000:4")
    assert [grad_accum_at(t, c) for t in (0, 999, 1000, 4999, 5000, 10**9)] == [1, 1, 2, 2, 4, 4]
