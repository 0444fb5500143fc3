"""bench/optimizer_host.py: the optimizer step's host time over a model's own parameter list."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "bench"))  # its `machine` helper
    spec = importlib.util.spec_from_file_location("optimizer_host", ROOT / "bench/optimizer_host.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    sys.path.remove(str(ROOT / "bench"))


def test_both_adamws_are_timed_over_the_presets_parameters(bench, tmp_path):
    out = tmp_path / "host.json"
    data = bench.main(["--preset", "tiny", "--steps", "2", "--json", str(out)])
    assert json.loads(out.read_text()) == data
    from fivefold.presets import get_preset
    tiny = get_preset("tiny")
    assert data["parameters"] == 2 + 9 * tiny.num_layers + (0 if tiny.tie_embeddings else 1)
    assert [r["impl"] for r in data["rows"]] == ["fused", "foreach"]
    assert all(0 < r["host_s_min"] <= r["host_s_median"] and "device_s_median" not in r for r in data["rows"])


def test_a_step_count_below_one_is_refused(bench):
    with pytest.raises(SystemExit):
        bench.main(["--steps", "0"])
