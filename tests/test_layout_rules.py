"""One legality check (fivefold.parallel.rules): what `fivefold train` refuses, `fivefold plan` refuses with the
same message, and the layout search never ranks it."""

import subprocess
import sys

import pytest

from fivefold.config import ConfigError
from fivefold.config_load import load_config
from fivefold.parallel.mesh import check_supported
from fivefold.parallel.rules import check_layout
from fivefold.planner.hardware import load_profile
from fivefold.planner.search import search_layouts

REFUSED = [
    ("mixtral-8x7b", ["parallel.dp=2", "parallel.zero=1"]),
    ("tiny-moe", ["parallel.dp=2", "parallel.cp=2", "model.capacity_factor=1.25"]),
    ("llama3-8b", ["parallel.dp=2", "parallel.pp=2", "parallel.zero=2"]),
]


@pytest.mark.parametrize("preset, overrides", REFUSED, ids=[p for p, _ in REFUSED])
def test_plan_refuses_what_train_refuses_with_the_same_message(preset, overrides):
    cfg = load_config(preset=preset, overrides=overrides)
    with pytest.raises(ConfigError) as train:
        check_supported(cfg)  # what launch and the trainer's mesh run before any process group starts
    with pytest.raises(ConfigError) as rules:
        check_layout(cfg)
    assert str(rules.value) == str(train.value)
    args = [a for o in overrides for a in ("--set", o)]
    plan = subprocess.run([sys.executable, "-m", "fivefold", "plan", "--preset", preset, *args],
                          capture_output=True, text=True, timeout=120)
    assert plan.returncode == 2 and str(train.value) in plan.stderr


# Before the search asked the rules, it ranked ZeRO layouts of Mixtral and ZeRO-2 under pp for llama3-8b.
# Mixtral (46.7B, with no ZeRO for experts yet) first fits at 16 H100s; the others from 4.
GRID = [(preset, gpus) for preset in ("llama3-8b", "qwen2.5-0.5b", "tiny-moe") for gpus in (4, 8, 16)]
GRID += [("mixtral-8x7b", gpus) for gpus in (16, 32)]


@pytest.mark.parametrize("preset, gpus", GRID, ids=[f"{p}-{g}gpus" for p, g in GRID])
def test_every_layout_the_search_ranks_passes_the_check(preset, gpus):
    cfg = load_config(preset=preset, overrides=["train.precision=bf16-mixed", "train.seq_len=2048"])
    result = search_layouts(cfg, load_profile("h100-sxm"), gpus, 1024 * 2048, top=1000)
    assert result.ranked, "the search found nothing to check"
    for candidate in result.ranked:
        check_layout(candidate.cfg, world_size=gpus)
    if cfg.model.num_experts:  # ZeRO would have won some of these, had the search not been told it is refused
        assert all(c.cfg.parallel.zero == 0 or c.cfg.parallel.dp == 1 for c in result.ranked)
