"""train.optimizer_impl=compiled (fivefold.train.compiled_adamw): its kernels make no temporaries, so the plan's
step adds none; refused with ZeRO. Its values against torch's AdamW, and its skip of a non-finite step, are
tested with the other updates in test_train.py."""

import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from fivefold.config import ConfigError
from fivefold.config_load import load_config
from fivefold.memory.plan import plan_memory
from fivefold.train.compiled_adamw import _update


def test_the_compiled_kernels_allocate_nothing_and_update_in_place():
    """The generated code of one unit's update (a bf16 matrix and a vector, their fp32 masters and moments)
    allocates no buffer: every value is computed in registers and written into the master, the moments, the
    step count and the bf16 parameter, so the update moves 30 bytes a parameter and adds no memory."""
    g = torch.Generator().manual_seed(0)
    shapes = [(37, 53), (53,)]  # shapes no other test compiles, so that the code is generated here
    masters = [torch.randn(s, generator=g) for s in shapes]
    params = [m.bfloat16() for m in masters]
    grads = [torch.randn(s, generator=g).bfloat16() for s in shapes]
    moments = [torch.zeros(s) for s in shapes], [torch.zeros(s) for s in shapes]
    steps = [torch.zeros(()) for _ in shapes]
    compiled = torch.compile(_update, fullgraph=True, dynamic=False)
    _, codes = run_and_get_code(compiled, params, masters, grads, *moments, steps, [0.1, 0.0], torch.tensor(0.5),
                                torch.tensor(False), 1e-3, 0.9, 0.95, 1e-8, True)
    code = "\n".join(codes)
    body = code[code.index("def call("):]
    assert re.findall(r"\w+ = (?:empty_strided\w*|torch\.empty\w*|alloc_from_pool)\(", body) == [], body
    assert all(float(s) == 1 for s in steps)
    for p, m in zip(params, masters):
        assert torch.equal(p, m.bfloat16())


def overrides(impl: str, precision: str = "bf16-mixed") -> list[str]:
    return ["model.hidden_size=128", "model.num_layers=4", "model.ffn_hidden_size=384", "train.seq_len=128",
            f"train.precision={precision}", f"train.optimizer_impl={impl}"]


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp32"])
def test_the_plan_takes_the_compiled_steps_temporaries_out(precision):
    """The fused update's step makes an fp32 copy of a unit's bf16 gradients (and a clip over it); the compiled
    one reads them as they are: its planned step temporaries are none, and the other categories the same."""
    plans = {impl: plan_memory(load_config(preset="tiny", overrides=overrides(impl, precision)), suggest=False)
             for impl in ("fused", "compiled")}
    fused, compiled = plans["fused"].memory, plans["compiled"].memory
    for category in ("parameters", "gradients", "optimizer_states", "activations"):
        assert compiled[category] == fused[category]
    assert compiled["total"] <= fused["total"]


def test_the_compiled_update_is_refused_with_zero():
    with pytest.raises(ConfigError, match="train.optimizer_impl=compiled steps whole tensors, and parallel.zero=1 "
                                          "shards them; set train.optimizer_impl=fused, or parallel.zero=0"):
        load_config(preset="tiny", overrides=[*overrides("compiled"), "parallel.zero=1"])
