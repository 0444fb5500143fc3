"""bench/optimizer_host.py: the optimizer step's host time over a model's own parameter list."""

import json

import pytest
from bench_modules import bench_module


@pytest.fixture(scope="module")
def bench():
    with bench_module("optimizer_host") as module:
        yield module


def test_every_update_is_timed_over_the_presets_parameters(bench, tmp_path):
    out = tmp_path / "host.json"
    data = bench.main(["--preset", "tiny", "--steps", "2", "--json", str(out)])
    assert json.loads(out.read_text()) == data
    from fivefold.presets import get_preset
    tiny = get_preset("tiny")
    assert data["parameters"] == 2 + 9 * tiny.num_layers + (0 if tiny.tie_embeddings else 1)
    assert [r["impl"] for r in data["rows"]] == ["fused", "foreach", "compiled"]
    timed = [r[name] for r in data["rows"] for name in ("ours", "reference")]
    assert all(0 < t["host_s_min"] <= t["host_s_median"] and "device_s_median" not in t for t in timed)
    rows = {r["impl"]: r for r in data["rows"]}
    assert data["compiled_over_fused"] == rows["compiled"]["ours"]["host_s_median"] / rows["fused"]["ours"]["host_s_median"]
    assert data["width"] == "narrow"


def test_a_step_count_below_one_and_an_unknown_preset_are_refused(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--steps", "0"])
    with pytest.raises(SystemExit):
        bench.main(["--preset", "llama-9"])
    assert "--preset: unknown preset 'llama-9'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--impl", "fused,adam"])
    assert "--impl 'fused,adam': give fused, foreach and/or compiled" in capsys.readouterr().err
