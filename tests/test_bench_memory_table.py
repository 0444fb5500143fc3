"""bench/memory_table.py: the rows are configs fivefold accepts, the cells say one figure only where every
variant has it, and one real measurement comes back as rows of the plan's categories."""

import pytest

from bench_modules import bench_module
from fivefold.config_load import load_config


def test_every_variant_of_every_row_is_a_valid_config():
    with bench_module("memory_table") as table:
        for _, label, preset, nproc, variants in table.ROWS:
            assert variants, label
            for overrides in variants:
                cfg = load_config(preset=preset, overrides=[*table.SMALL, *overrides])
                p = cfg.parallel
                ranks = p.dp * p.tp * p.pp * p.cp  # dp = 1 where the launch's world size gives it (ZeRO rows)
                assert ranks == nproc or (nproc > 1 and ranks == 1), (label, overrides)


def test_a_cell_is_one_figure_only_where_every_variant_agrees():
    with bench_module("memory_table") as table:
        same = [{"total": {"error": -2e-7}}, {"total": {"error": 1e-7}}]
        assert table.cell(same, "total") == "0.000%"
        differ = [{"total": {"error": 0.01}}, {"total": {"error": -0.0042}}]
        assert table.cell(differ, "total") == "+1.000% / -0.420%"
        assert table.cell([{"total": {"error": 0.0}}, {}], "total") == "0.000% / "


def test_an_unknown_row_key_is_refused_with_the_choices(capsys):
    with bench_module("memory_table") as table, pytest.raises(SystemExit) as exit_:
        table.main(["--rows", "tiny,nope"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "unknown row keys ['nope']" in err and "tiny" in err


def test_one_measurement_gives_every_category_near_the_plan():
    with bench_module("memory_table") as table:
        rows = table.measure("tiny", 1, ("train.recompute=none",))
    assert set(table.COLUMNS) <= set(rows)
    for category in table.COLUMNS:
        assert abs(rows[category]["error"]) <= 0.005, rows[category]
