"""bench/cpu_paged_decode.py: both forms of the CPU decode kernel agree on every case (the bench asserts it)
and each case reports both times."""

import pytest

from bench_modules import bench_module
from fivefold.kernels.cpu_paged_decode import kernel_problem

if kernel_problem():
    pytest.skip(f"the CPU paged-decode kernel cannot be built here: {kernel_problem()}", allow_module_level=True)


def test_both_forms_agree_and_are_timed():
    with bench_module("cpu_paged_decode") as bench:
        result = bench.main(["--rounds", "1", "--reps", "5"])
    assert [(r["rows"], r["tokens"]) for r in result["rows"]] == bench.CASES
    for row in result["rows"]:
        assert row["native_us"] > 0 and row["portable_us"] > 0
        assert row["native_speedup"] == row["portable_us"] / row["native_us"]
