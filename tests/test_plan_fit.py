"""`fivefold plan --fit` (fivefold.planner.fit): the micro-batch and recomputation that fill a device.

Every expected answer is worked out here from the memory planner itself (plan_memory's total for each
micro-batch and mode), so the tests check the choice, not the memory model; the recomputed-FLOP shares are
checked against bench-30m's shapes by hand."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fivefold.config import ConfigError
from fivefold.config_load import load_config
from fivefold.memory.plan import plan_memory
from fivefold.planner.fit import RECOMPUTE, fit_micro_batch, recomputed_flops
from fivefold.planner.hardware import load_profile
from fivefold.planner.speed import predict_step

ROOT = Path(__file__).resolve().parent.parent
PRESET = "bench-30m"
BATCH = ["train.micro_batch_size=1", "train.grad_accum=16"]  # 16 sequences per step to split
HEADROOM = 0.05


def _cfg(*overrides):
    return load_config(preset=PRESET, overrides=[*BATCH, *overrides])


def _total(cfg, mode: str, micro: int, accum: int) -> float:
    new = load_config(preset=PRESET, overrides=[*BATCH, f"train.recompute={mode}", f"train.micro_batch_size={micro}",
                                                f"train.grad_accum={accum}"])
    return plan_memory(new, device="cuda", suggest=False).memory["total"]


@pytest.fixture(scope="module")
def totals():
    """Planned peak of each mode and micro-batch that divides the 16 sequences (the rest accumulated)."""
    return {mode: {b: _total(_cfg(), mode, b, 16 // b) for b in (1, 2, 4, 8, 16)} for mode in RECOMPUTE}


def _memory_for(limit: float) -> int:
    """Device memory whose limit, less the headroom, is `limit`."""
    return int(limit / (1 - HEADROOM))


def test_recomputed_flops_match_the_shapes():
    # bench-30m: h 512, 8 layers, q 512, kv 256, SwiGLU ffn 1536, vocab 8192; seq 256.
    layer_matmuls = 2 * (2 * 512 * 512 + 2 * 512 * 256 + 3 * 512 * 1536)  # 2 FLOPs per weight
    core = 4 * 256 * 512
    step = 3 * (8 * (layer_matmuls + core) + 2 * 8192 * 512)
    ops_share = (512 * 256 + 512 * 512 + 512 * 1536) / (2 * 512 * 512 + 2 * 512 * 256 + 3 * 512 * 1536)  # k, o, up
    expected = {"none": 0.0, "selective": 8 * core / step, "ops": 8 * ops_share * layer_matmuls / step,
                "full": 8 * (layer_matmuls + core) / step}
    got = {mode: recomputed_flops(_cfg(), mode) for mode in RECOMPUTE}
    assert got == pytest.approx(expected, rel=1e-12)
    assert got["selective"] == pytest.approx(0.022222, abs=1e-6) and got["full"] == pytest.approx(0.288889, abs=1e-6)


def test_largest_micro_batch_that_fits_without_recompute(totals):
    none = totals["none"]
    assert none[4] < none[8], "the case needs memory that grows from micro-batch 4 to 8"
    limit = (none[4] + none[8]) / 2
    expected = max(b for b, total in none.items() if total <= limit)
    result = fit_micro_batch(_cfg(), _memory_for(limit), device="cuda", headroom=HEADROOM)
    c = result.chosen
    assert (c.recompute, c.micro_batch_size, c.grad_accum) == ("none", expected, 16 // expected)
    assert c.memory == none[expected]
    assert result.changes == {"train.micro_batch_size": (1, expected), "train.grad_accum": (16, 16 // expected)}
    assert not result.capped  # micro-batch 16, the whole batch, does not fit


def test_less_memory_forces_recompute(totals):
    none_least = min(totals["none"].values())
    limit = none_least * 0.98  # no micro-batch fits without recomputation
    fitting = {mode: [b for b, total in totals[mode].items() if total <= limit] for mode in RECOMPUTE}
    assert not fitting["none"] and any(fitting.values())
    mode = min((m for m in RECOMPUTE if fitting[m]), key=lambda m: recomputed_flops(_cfg(), m))
    result = fit_micro_batch(_cfg(), _memory_for(limit), device="cuda", headroom=HEADROOM)
    c = result.chosen
    assert (c.recompute, c.micro_batch_size) == (mode, max(fitting[mode]))
    assert c.memory == totals[mode][c.micro_batch_size] <= limit
    # Every candidate's verdict is the planner's.
    for cand in result.candidates:
        assert cand.memory == totals[cand.recompute][cand.micro_batch_size]
        assert cand.fits == (cand.memory <= limit)


def test_too_little_memory_names_the_fix(totals):
    least = min(min(by_b.values()) for by_b in totals.values())
    with pytest.raises(ConfigError, match=r"nothing fits .*parallel\.tp or parallel\.pp.*parallel\.zero=3"):
        fit_micro_batch(_cfg(), _memory_for(least * 0.99), device="cuda", headroom=HEADROOM)


def test_chosen_flags_plan_within_the_memory(totals):
    """Round trip: the printed --set flags, applied to the config, plan within the limit."""
    limit = min(totals["none"].values()) * 0.98
    result = fit_micro_batch(_cfg("train.recompute=full", "train.recompute_layers=every:2"), _memory_for(limit),
                             device="cuda", headroom=HEADROOM)
    assert "train.recompute_layers=" in result.overrides()  # the config's layer subset is cleared
    applied = _cfg("train.recompute=full", "train.recompute_layers=every:2", *result.overrides())
    total = plan_memory(applied, device="cuda", suggest=False).memory["total"]
    assert total == result.chosen.memory <= result.limit
    assert applied.global_batch_sequences == 16  # the global batch is kept


def test_grow_batch_finds_the_largest_whole_micro_batch():
    cfg = _cfg("train.grad_accum=2")
    limit = _total(cfg, "none", 37, 2) + 1.0  # 37 fits; the next size must not
    result = fit_micro_batch(cfg, _memory_for(limit), device="cuda", headroom=HEADROOM, grow=True)
    c = result.chosen
    assert (c.recompute, c.micro_batch_size, c.grad_accum) == ("none", 37, 2)
    assert _total(cfg, "none", 38, 2) > result.limit
    assert [x.micro_batch_size for x in result.candidates if x.recompute == "none"] == [1, 2, 4, 8, 16, 32, 37, 64]


def test_with_a_speed_model_the_fastest_fitting_wins(totals):
    limit = (totals["none"][4] + totals["none"][8]) / 2
    profile = load_profile("h100-sxm")
    result = fit_micro_batch(_cfg(), _memory_for(limit), device="cuda", headroom=HEADROOM, profile=profile)
    speeds = {}
    for mode in RECOMPUTE:
        for b, total in totals[mode].items():
            if total <= limit:
                cfg = _cfg(f"train.recompute={mode}", f"train.micro_batch_size={b}", f"train.grad_accum={16 // b}")
                speeds[mode, b] = predict_step(cfg, profile).tokens_per_s_per_gpu
    best = max(speeds, key=speeds.get)
    assert (result.chosen.recompute, result.chosen.micro_batch_size) == best
    # then, for it, train.fused_projections: the fastest of the three (true and ops do not combine)
    mode, b = best
    options = {f: predict_step(_cfg(f"train.recompute={mode}", f"train.micro_batch_size={b}",
                                    f"train.grad_accum={16 // b}", f"train.fused_projections={f}"),
                               profile).tokens_per_s_per_gpu
               for f in ("false", "auto", "true") if not (f == "true" and mode == "ops")}
    fastest = max(options, key=lambda f: (options[f], f == "auto"))  # a tie keeps the configured setting
    assert options[fastest] >= speeds[best]  # auto, the configured setting, is one of them
    assert result.chosen.speed.tokens_per_s_per_gpu == pytest.approx(options[fastest], rel=1e-12)
    assert result.config.train.fused_projections == fastest and result.chosen.memory <= limit
    assert ("train.fused_projections" in result.changes) is (fastest != "auto")


@pytest.mark.parametrize("profile, preset, micro, fused", [("h200", "smollm2-135m", 8, "true"),
                                                           ("h100-sxm", "smollm2-135m", 8, "auto"),
                                                           ("h100-sxm", "llama3.2-3b", 2, "false")])
def test_fit_chooses_fused_projections_where_the_speed_model_puts_them_ahead(profile, preset, micro, fused):
    """At seq 2048, each profile's products as measured: on an H200 SmolLM2-135M fuses gate/up too (its narrow
    FFN gains more than the concatenation costs); on an H100 its step is the host's, every choice alike, so the
    configured auto stays; the 3B keeps its projections separate (its weights cost more to concatenate each pass
    than the wider products gain)."""
    cfg = load_config(preset=preset, overrides=["train.seq_len=2048", f"train.micro_batch_size={micro}",
                                                "train.precision=bf16-mixed"])
    result = fit_micro_batch(cfg, 80 * 10**9, device="cuda", profile=load_profile(profile))
    assert result.config.train.fused_projections == fused
    assert (f"train.fused_projections={fused}" in result.overrides()) is (fused != "auto")


def test_pipeline_keeps_at_least_pp_micro_batches():
    cfg = _cfg("parallel.pp=2", "train.grad_accum=8", "train.micro_batch_size=1")
    result = fit_micro_batch(cfg, 10**12, device="cuda")
    assert {c.grad_accum for c in result.candidates} == {8, 4, 2}
    assert (result.chosen.micro_batch_size, result.chosen.grad_accum) == (4, 2)
    assert result.capped  # 4 is the largest micro-batch that leaves pp=2 micro-batches


def test_global_batch_must_split_over_ranks():
    with pytest.raises(ConfigError, match="use a multiple of 256"):
        fit_micro_batch(_cfg(), 10**12, global_batch_tokens=1000)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "fivefold", "plan", "--preset", PRESET,
                           *(f"--set={o}" for o in BATCH), "--fit", *args], capture_output=True, text=True, cwd=ROOT)


def test_cli_json_and_table(totals):
    limit = (totals["none"][4] + totals["none"][8]) / 2
    memory = _memory_for(limit)
    out = _cli("--device-memory", str(memory), "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["chosen"]["recompute"] == "none" and data["chosen"]["micro_batch_size"] == 4
    assert data["chosen"]["memory"] == int(totals["none"][4])
    assert data["set"] == ["train.micro_batch_size=4", "train.grad_accum=4", "train.recompute=none"]
    assert data["limit"] == int(memory * (1 - HEADROOM)) and data["global_batch"]["tokens"] == 16 * 256
    assert {(c["recompute"], c["micro_batch_size"]) for c in data["candidates"]} == {
        (m, b) for m in RECOMPUTE for b in (1, 2, 4, 8, 16)}

    text = _cli("--device-memory", str(memory))
    assert text.returncode == 0, text.stderr
    assert "run with: --set train.micro_batch_size=4 --set train.grad_accum=4 --set train.recompute=none" in text.stdout
    assert "changes: train.micro_batch_size 1 -> 4, train.grad_accum 16 -> 4" in text.stdout


def test_cli_error_is_one_line(totals):
    out = _cli("--device-memory", "1MB")
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "nothing fits" in out.stderr and "parallel.zero=3" in out.stderr


def test_fit_on_this_host_fills_its_available_memory(totals, monkeypatch, capsys):
    """`--fit --device cpu` without --device-memory plans for this host: its available memory now, the same
    choice as that memory given explicitly."""
    import fivefold.commands.plan as plan_command
    from fivefold.cli import main

    memory = _memory_for((totals["none"][4] + totals["none"][8]) / 2)
    monkeypatch.setattr(plan_command, "available_memory", lambda device: memory)
    base = ["plan", "--preset", PRESET, *(f"--set={o}" for o in BATCH), "--fit", "--device", "cpu", "--json"]
    assert main(base) == 0
    here = capsys.readouterr()
    assert main([*base, "--device-memory", str(memory)]) == 0
    given = capsys.readouterr()
    assert "planning for this host" in here.err and "planning for this host" not in given.err
    assert json.loads(here.out) == json.loads(given.out)
