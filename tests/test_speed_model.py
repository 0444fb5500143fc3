"""The step-time model (fivefold.planner.speed), the layout search and their validation tables.

Nothing here is timed: the CPU validation re-predicts the step times bench/planner_cpu.py measured and
stored, and the published-run validation predicts the runs in fivefold/planner/published_runs.toml."""

import dataclasses
import json
import math
import types
from pathlib import Path

import pytest

from fivefold import cli
from fivefold.config_load import load_config
from fivefold.memory import formulas
from fivefold.memory.communication import Collective, step_collectives, step_communication
from fivefold.memory.plan import plan_memory
from fivefold.planner.hardware import load_profile, profile_from_dict, shipped_profiles
from fivefold.planner.speed import (OPS_PER_LAYER, attention_efficiency, collective_seconds, kernel_time,
                                    optimizer_bytes_per_param, predict_step, slowest_of)

ROOT = Path(__file__).resolve().parent.parent
H100 = load_profile("h100-sxm")


def _cfg(*overrides, preset="llama3-8b"):
    return load_config(preset=preset, overrides=["train.seq_len=4096", "train.precision=bf16-mixed",
                                                 "train.micro_batch_size=1", *overrides])


def test_breakdown_adds_up_and_throughput_follows():
    speed = predict_step(_cfg("parallel.dp=8", "train.grad_accum=4"), H100)
    assert sum(speed.breakdown.values()) == pytest.approx(speed.step_time_s, rel=1e-12)
    assert speed.tokens_per_step == 1 * 4 * 8 * 4096
    assert speed.tokens_per_s_per_gpu == pytest.approx(speed.tokens_per_step / speed.step_time_s / 8)
    assert speed.mfu == pytest.approx(speed.tokens_per_s_per_gpu * speed.flops_per_token / 989e12)
    assert 0.2 < speed.mfu < 0.75  # an 8B model on H100s is neither idle nor above the sustained matmul rate
    assert speed.world == 8


@pytest.mark.parametrize("overrides", [(), ("train.recompute=full",), ("train.recompute=selective",),
                                       ("train.recompute=ops", "train.grad_accum=3"), ("train.precision=fp8",)])
def test_kernel_time_by_kind_is_the_step_the_model_prices(overrides):
    """One rank's step by kernel kind (what bench/train_throughput.py --profile measures by kernel name) sums to
    predict_step's compute, recomputation and optimizer less its 20 launches after the update; only the matmul
    kind follows the matmul rate, only attention the attention rate."""
    cfg = _cfg(*overrides, preset="llama3.2-1b")
    kinds, speed = kernel_time(cfg, H100), predict_step(cfg, H100)
    b = speed.breakdown
    assert sum(kinds.values()) == pytest.approx(b["compute"] + b["recompute"] + b["optimizer"] - 20 * H100.op_overhead,
                                                rel=1e-9)
    assert speed.step_time_s == pytest.approx(b["compute"] + b["recompute"] + b["optimizer"], rel=1e-12)
    slower = kernel_time(cfg, dataclasses.replace(H100, matmul_efficiency=H100.matmul_efficiency / 2))
    assert slower["matmul"] > 1.9 * kinds["matmul"]
    assert all(slower[k] == pytest.approx(kinds[k]) for k in kinds if k not in ("matmul", "attention"))
    flash = kernel_time(cfg, dataclasses.replace(H100, attention_efficiency=H100.attention_efficiency / 2))
    assert flash["attention"] == pytest.approx(2 * kinds["attention"])
    assert all(flash[k] == pytest.approx(kinds[k]) for k in kinds if k != "attention")
    with pytest.raises(ValueError, match="pp must be 1"):
        kernel_time(_cfg("parallel.pp=2", preset="llama3.2-1b"), H100)


def test_a_step_waits_for_its_host_where_the_host_is_slower():
    """host_bound: a step takes host_step_s plus the longer of the device's time and the host's issue of the
    passes followed by the longer of the update's device and host time. A profile without host figures (a
    calibrated one, the A100s') prices the device alone; a host that issues slowly sets a small model's step,
    and a large one's device time hides the same host (only host_step_s shows)."""
    small = _cfg(preset="smollm2-135m")
    bare = dataclasses.replace(H100, host_step_s=0.0, host_launch_s=0.0, host_param_s=0.0)
    device = predict_step(small, bare)
    assert device.breakdown["host"] == 0.0  # no host figures: the device alone
    host = dataclasses.replace(H100, host_step_s=0.007, host_launch_s=30e-6, host_param_s=16e-6)
    waiting = predict_step(small, host)
    passes = OPS_PER_LAYER[True] * small.model.num_layers * 3 * 30e-6 * small.train.grad_accum
    params = len(formulas.parameter_shapes(small.model, 1))
    update = max(device.breakdown["optimizer"], params * 16e-6)
    assert waiting.step_time_s == pytest.approx(0.007 + max(device.step_time_s, passes + update), rel=1e-9)
    assert waiting.step_time_s > device.step_time_s + 0.007  # issuing the passes takes longer than running them
    large = _cfg(preset="llama3.2-1b")
    assert predict_step(large, host).step_time_s == pytest.approx(predict_step(large, bare).step_time_s + 0.007)
    for mode in ("full", "ops"):  # a replay's kernels are issued too: op-level recomputation replays the block
        replayed = predict_step(dataclasses.replace(small, train=dataclasses.replace(small.train, recompute=mode)),
                                host)
        assert replayed.breakdown["host"] > waiting.breakdown["host"], mode


def test_a_step_of_many_gpus_waits_for_the_slowest():
    """slowest_of: same-SKU GPUs spread evenly over speed_spread, and a synchronous step waits for the slowest of
    its N, the expected maximum of N draws, spread (N - 1) / (2 (N + 1)) beyond a typical one: none for one GPU,
    towards half the spread for many. The step's own device work (compute, recomputation, optimizer) takes
    that much longer; the layouts of one N alike, so the search's order does not change."""
    assert slowest_of(1, 0.08) == 0.0
    assert slowest_of(8, 0.08) == pytest.approx(0.08 * 7 / 18)
    assert slowest_of(3, 0.2) == pytest.approx(0.05)
    assert 0.0399 < slowest_of(16384, 0.08) < 0.04
    even = dataclasses.replace(H100, speed_spread=0.0, host_step_s=0.0, host_launch_s=0.0, host_param_s=0.0)
    spread = dataclasses.replace(even, speed_spread=0.08)
    one = _cfg(preset="llama3.2-1b")
    assert predict_step(one, spread).step_time_s == predict_step(one, even).step_time_s
    assert predict_step(one, spread).breakdown["slowest"] == 0.0
    for layout in (["parallel.dp=64"], ["parallel.dp=16", "parallel.tp=4", "train.recompute=full"]):
        cfg = _cfg(*layout, preset="llama3.2-1b")
        waits, alone = predict_step(cfg, spread), predict_step(cfg, even)
        own = alone.breakdown["compute"] + alone.breakdown["recompute"] + alone.breakdown["optimizer"]
        assert waits.breakdown["slowest"] == pytest.approx(own * 0.08 * 63 / 130), layout
        assert waits.step_time_s == pytest.approx(alone.step_time_s + waits.breakdown["slowest"]), layout
    assert all(load_profile(name).speed_spread == 0.08 for name in shipped_profiles())


def test_the_optimizer_moves_the_bytes_its_update_reads_and_writes():
    """optimizer_bytes_per_param counts fivefold's update: 50 bytes under bf16-mixed with clipping (norm read 2,
    fp32 copy 6, clip 8, fused AdamW 28, copy back 6), 40 in fp32, 46 with fp32 gradient accumulation, and 8
    fewer without clipping; the compiled update 30 (norm read 2, then 2 + 12 read, 12 + 2 written), 32 in fp32,
    34 with fp32 accumulation, clipped or not; the optimizer's time follows it."""
    base = _cfg(preset="llama3.2-1b")
    t = base.train
    assert optimizer_bytes_per_param(base) == 50
    assert optimizer_bytes_per_param(dataclasses.replace(base, train=dataclasses.replace(t, precision="fp32"))) == 40
    accumulated = dataclasses.replace(base, train=dataclasses.replace(t, fp32_grad_accum=True))
    assert optimizer_bytes_per_param(accumulated) == 46
    assert optimizer_bytes_per_param(dataclasses.replace(base, train=dataclasses.replace(t, grad_clip=0.0))) == 42
    compiled = dataclasses.replace(t, optimizer_impl="compiled")
    assert optimizer_bytes_per_param(dataclasses.replace(base, train=compiled)) == 30
    assert optimizer_bytes_per_param(dataclasses.replace(base, train=dataclasses.replace(compiled, grad_clip=0.0))) == 30
    assert optimizer_bytes_per_param(dataclasses.replace(base, train=dataclasses.replace(compiled, precision="fp32"))) == 32
    assert optimizer_bytes_per_param(dataclasses.replace(base, train=dataclasses.replace(compiled, fp32_grad_accum=True))) == 34
    params = sum(n for _, n in formulas.parameter_shapes(base.model, 1))
    assert kernel_time(base, H100)["optimizer"] == pytest.approx(
        params * 50 / (H100.memory_bandwidth * H100.memory_efficiency), rel=1e-9)


def test_attention_efficiency_by_head_size():
    """The profile's attention_efficiency holds at head size 128; attention_knee scales other head sizes as
    d / (d + knee) relative to 128's (the H200's 96: 64-wide heads at 70% of 128-wide ones' rate, 31.5% of
    the peak as bench/results/kernels_h200.json measured); a knee of 0 leaves every head size alike."""
    h200 = load_profile("h200")
    assert attention_efficiency(h200, 128) == pytest.approx(0.45)
    assert attention_efficiency(h200, 64) == pytest.approx(0.315, abs=0.001)
    a100 = load_profile("a100-80gb")  # no knee
    assert attention_efficiency(a100, 64) == attention_efficiency(a100, 256) == a100.attention_efficiency


def test_compute_scales_with_the_hardware_and_recompute_costs_a_forward():
    cfg = _cfg("train.grad_accum=2")
    fast = dataclasses.replace(H100, flops={**H100.flops, "bf16": 2 * H100.flops["bf16"]})
    a, b = predict_step(cfg, H100), predict_step(cfg, fast)
    matmul_share = a.breakdown["compute"] - b.breakdown["compute"]
    assert 0 < matmul_share < a.breakdown["compute"]  # halving matmul time halves only the matmul part
    full = predict_step(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, recompute="full")), H100)
    selective = predict_step(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, recompute="selective")),
                             H100)
    assert 0 < selective.breakdown["recompute"] < full.breakdown["recompute"]
    # full recomputation replays every forward: a third of forward + backward's compute, minus the head
    assert full.breakdown["recompute"] == pytest.approx(a.breakdown["compute"] / 3, rel=0.15)


def test_a_step_is_priced_with_the_kernel_figures_of_the_dtype_it_computes_in():
    """[kernels.<dtype>]: a bf16-mixed step takes bf16's matmul and attention figures, an fp32 step the top
    level's; a profile without the table prices both with the top level (every shipped profile)."""
    bf16_cfg, fp32_cfg = _cfg(), _cfg("train.precision=fp32")
    slow_bf16 = dataclasses.replace(H100, kernels={"bf16": {"attention_efficiency": H100.attention_efficiency / 2,
                                                            "matmul_knee": 4 * H100.matmul_knee}})
    base, slowed = predict_step(bf16_cfg, H100), predict_step(bf16_cfg, slow_bf16)
    assert slowed.breakdown["compute"] > base.breakdown["compute"]
    assert slowed.breakdown["optimizer"] == base.breakdown["optimizer"]  # not a matmul or attention figure
    assert predict_step(fp32_cfg, slow_bf16).step_time_s == predict_step(fp32_cfg, H100).step_time_s
    # the same figures given at the top level price the bf16 step alike
    top = dataclasses.replace(H100, attention_efficiency=H100.attention_efficiency / 2,
                              matmul_knee=4 * H100.matmul_knee)
    assert predict_step(bf16_cfg, top).step_time_s == slowed.step_time_s
    assert slow_bf16.for_dtype("fp8") is slow_bf16


def test_ops_recompute_runs_half_the_matmuls_and_the_memory_bound_work_again():
    """train.recompute=ops keeps q, v, gate and down (every other matmul) and the attention: it runs k, o
    and up again (their share of the block's matmul FLOPs)
    and every elementwise kernel, so it costs more than selective and less than full."""
    from fivefold.planner.speed import _Costs

    cfg = _cfg("train.grad_accum=2", "train.recompute=ops")
    costs = _Costs(cfg, H100, fused=True)
    h, q, kv, f = 4096, 4096, 1024, 14336
    assert costs.recomputed_matmul_share() == pytest.approx((h * kv + q * h + h * f) / (2 * h * q + 2 * h * kv + 3 * h * f))
    modes = {mode: predict_step(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, recompute=mode)),
                                H100).breakdown["recompute"] for mode in ("selective", "ops", "full")}
    assert modes["selective"] < modes["ops"] < modes["full"]


def test_the_bubble_comes_from_the_schedule_simulation():
    """With equal stages the simulated bubble is the textbook one: (pp-1)/m for 1F1B, less interleaved."""
    def bubble(schedule, v=1, m=8):
        cfg = _cfg("model.num_layers=32", "parallel.pp=4", f"parallel.pp_schedule={schedule}",
                   f"parallel.pp_virtual_stages={v}", f"train.grad_accum={m}", "model.tie_embeddings=false",
                   "train.compile=false")
        return predict_step(cfg, H100).bubble_fraction

    one = bubble("1f1b")
    assert one == pytest.approx(3 / 8, rel=0.2)  # the last stage's LM head makes stages unequal
    assert bubble("interleaved", v=2) < one and bubble("zero-bubble") < one
    assert bubble("1f1b", m=32) < one / 3


def test_collectives_are_timed_on_the_link_they_cross():
    cfg = _cfg("parallel.tp=8", "parallel.dp=2")
    tp = next(c for c in step_collectives(cfg) if c.dim == "tp")
    inside = collective_seconds(tp, H100, cfg)
    assert inside == pytest.approx(14 * 3e-6 + tp.sent / 450e9)  # ring all-reduce on NVLink
    dp = next(c for c in step_collectives(cfg) if c.dim == "dp")  # 2 ranks 8 apart: one in each node
    assert collective_seconds(dp, H100, cfg) == pytest.approx(2 * 10e-6 + dp.sent / 50e9)
    assert Collective("pp", "send", 100.0, 2, 1, "boundary").sent == 100.0
    assert step_communication(cfg)["tp"] == pytest.approx(sum(c.sent * c.count for c in step_collectives(cfg)
                                                              if c.dim == "tp"))


def test_a_ring_across_nodes_uses_every_nic_of_its_ranks_in_a_node():
    cfg = _cfg("parallel.dp=32", "parallel.zero=3")  # tp=1: 8 ranks of the dp group in each node
    gather = next(c for c in step_collectives(cfg) if c.phase == "gather")
    bandwidth = gather.sent / (collective_seconds(gather, H100, cfg) - 2 * 5 * 10e-6)  # 2 log2(32) steps
    assert bandwidth == pytest.approx(min(450e9, 8 * 50e9))
    wide = _cfg("parallel.dp=32", "parallel.tp=8")  # one rank of the dp group per node: one NIC
    grads = next(c for c in step_collectives(wide) if c.dim == "dp")
    assert collective_seconds(grads, H100, wide) == pytest.approx(2 * 5 * 10e-6 + grads.sent / 50e9)


def test_hidden_communication_still_costs_the_sms_it_holds():
    """ZeRO-3's gathers hide behind compute, but NCCL's CTAs slow the compute they overlap; with no
    interference the same layout only pays the first block's gather."""
    cfg = _cfg("parallel.dp=8", "parallel.zero=3", "train.grad_accum=2")
    quiet = dataclasses.replace(H100, comm_interference=0.0)
    busy, free = predict_step(cfg, H100), predict_step(cfg, quiet)
    assert busy.breakdown["compute"] == pytest.approx(free.breakdown["compute"])
    assert busy.breakdown["dp"] > free.breakdown["dp"] > 0
    gathers = sum(collective_seconds(c, H100, cfg) * c.count for c in step_collectives(cfg)
                  if c.phase in ("gather", "gradients"))
    assert busy.breakdown["dp"] == pytest.approx(0.18 * gathers, rel=0.1)  # all hidden, 18% of it paid
    # full recomputation replays the forward's tensor-parallel collectives inside the backward
    tp = _cfg("parallel.tp=8", "train.grad_accum=2")
    full = dataclasses.replace(tp, train=dataclasses.replace(tp.train, recompute="full"))
    assert predict_step(full, H100).breakdown["tp"] > 1.3 * predict_step(tp, H100).breakdown["tp"]


def test_search_ranks_layouts_that_fit_and_reproduce():
    from fivefold.planner.search import search_layouts, why_first

    cfg = load_config(preset="llama3-8b", overrides=["train.seq_len=4096", "train.precision=bf16-mixed"])
    result = search_layouts(cfg, H100, 16, 256 * 4096, top=5)
    assert len(result.ranked) == 5 and result.fitting >= 5 and result.meshes > 5
    speeds = [c.speed.tokens_per_s_per_gpu for c in result.ranked]
    assert speeds == sorted(speeds, reverse=True)
    for c in result.ranked:
        assert c.cfg.parallel.world_size == 16
        assert c.cfg.train.micro_batch_size * c.cfg.train.grad_accum * c.cfg.parallel.dp == 256
        exact = plan_memory(c.cfg, device="cuda", suggest=False).memory["total"]
        assert exact == pytest.approx(c.memory) and exact <= H100.memory_bytes
        again = load_config(preset="llama3-8b", overrides=["train.seq_len=4096", "train.precision=bf16-mixed",
                                                          *c.overrides().split()])
        assert predict_step(again, H100).step_time_s == pytest.approx(c.speed.step_time_s)
    assert why_first(result.ranked[0], result.ranked[1]).startswith(("#1 is ", "#1 and #2 tie"))
    assert why_first(result.ranked[0], result.ranked[-1]).startswith("#1 is ")
    tight = search_layouts(cfg, H100, 16, 256 * 4096, top=0, device_memory=30e9)
    assert tight.ranked and all(c.memory <= 30e9 for c in tight.ranked)
    every = search_layouts(cfg, H100, 16, 256 * 4096, top=0)
    assert tight.fitting < every.fitting
    # Pruning below the fifth (a layout that cannot beat it is not costed in full) keeps the true top five.
    assert len(every.ranked) > 5
    assert speeds == pytest.approx([c.speed.tokens_per_s_per_gpu for c in every.ranked[:5]])


def test_plan_cli_speed_search_and_errors(tmp_path, capsys):
    def _fivefold(*args):  # the real entry point, in this process (seven interpreter start-ups cost ~25 s)
        code = cli.main(list(args))
        out = capsys.readouterr()
        return types.SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)

    base = ["plan", "--preset", "llama3-8b", "--set", "train.seq_len=4096", "--set", "train.precision=bf16-mixed",
            "--set", "train.micro_batch_size=1"]
    run = _fivefold(*base, "--cluster", "h100-sxm", "--gpus", "16", "--global-batch", "1Mi", "--json")
    assert run.returncode == 0, run.stderr
    speed = json.loads(run.stdout)["speed"]
    assert {"step_time_s", "tokens_per_s_per_gpu", "mfu"} <= set(speed) and speed["gpus"] == 16
    assert speed["tokens_per_step"] == 2**20
    # one stage: the device time by kernel kind, the compute, recomputation and optimizer terms
    kinds, parts = speed["kernels_s"], speed["breakdown_s"]
    assert set(kinds) == {"matmul", "attention", "elementwise", "launches", "optimizer"}
    assert sum(kinds.values()) == pytest.approx(parts["compute"] + parts.get("recompute", 0) + parts["optimizer"]
                                                - 20 * H100.op_overhead, rel=1e-9)
    run = _fivefold(*base, "--cluster", "h100-sxm", "--gpus", "1")
    assert run.returncode == 0, run.stderr
    assert "  device time by kernel kind: matmul " in run.stdout
    # without --global-batch each rank keeps its micro-batches: the batch grows with --gpus's dp
    run = _fivefold(*base, "--set", "train.grad_accum=2", "--cluster", "h100-sxm", "--gpus", "8", "--json")
    assert run.returncode == 0, run.stderr
    plan = json.loads(run.stdout)
    assert plan["speed"]["tokens_per_step"] == 1 * 2 * 8 * 4096 and plan["speed"]["gpus"] == 8
    run = _fivefold(*base, "--cluster", "h100-sxm", "--gpus", "8", "--global-batch", "1Mi", "--search", "--top", "3",
                    "--png", str(tmp_path / "top.png"))
    assert run.returncode == 0, run.stderr
    assert "run #1 with: --set parallel.dp=" in run.stdout and " --set train.grad_accum=" in run.stdout and (tmp_path / "top.png").stat().st_size > 10_000
    for args, message in ((["--search"], "give the hardware with --cluster"),
                          (["--cluster", "h100-sxm", "--gpus", "6", "--set", "parallel.tp=4"], "not a multiple of"),
                          (["--cluster", "h100-sxm", "--global-batch", "5000"], "not a whole number"),
                          (["--cluster", "h100-sxm", "--global-batch", "4X"], "write a whole number")):
        run = _fivefold(*base, *args)
        assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr, (args, run.stderr)


def test_cpu_layouts_predicted_within_25_percent_of_measured():
    """bench/planner_cpu.py measured these step times with the profile it calibrated; the current model
    must still predict each within +-25%."""
    data = json.loads((ROOT / "bench/results/planner_cpu.json").read_text())
    profile = profile_from_dict(data["profile"], "bench/results/planner_cpu.json")
    assert len(data["layouts"]) == 9
    for row in data["layouts"]:
        cfg = load_config(preset=data["preset"], overrides=[*data["base"], *row["overrides"]])
        predicted = predict_step(cfg, profile).step_time_s
        assert abs(predicted / row["measured_s"] - 1) <= 0.25, (row["layout"], predicted, row)


def test_published_runs():
    """Every verified run in the data file is predicted; the errors are the ones docs/planner_validation.md
    reports (regression bounds: see that page for the issue's targets and where they are missed)."""
    from fivefold.planner.published import check_run, load_runs, summary

    checks = [check_run(run) for run in load_runs()]
    s = summary(checks)
    assert s["runs"] >= 8 and s["sources"] >= 3
    assert s["median_abs_error"] <= 0.12  # issue 32's target: 15%
    assert s["worst_abs_error"] <= 0.55
    assert sum(c.error < 0 for c in checks if c.verified) >= 2  # both signs, if not yet in balance
    # Two runs miss the earlier 30%: DeepSpeed's ZeRO-3 of 2021 and Megatron-Bridge's GPT-OSS (see the page).
    assert sum(abs(c.error) > 0.30 for c in checks if c.verified) <= 2
    assert all(math.isfinite(c.predicted) and c.predicted > 0 for c in checks)


def test_fused_projections_are_priced_as_they_run():
    """train.fused_projections: q/k/v as one product is higher on the matmul knee than three (GQA's k and v
    are thin), less the concatenation's traffic. On an H100's device at seq 2048 (its products as measured, knee
    248): SmolLM2-135M (micro-batch 8) gains 1.4% from fusing q/k/v and a little more from gate/up too;
    Llama-3.2-3B (micro-batch 2) loses from both, its weights costing more to concatenate each pass than the
    wider products save (under the datasheet's knee of 512 the 135M gained 4%; measured, the 135M's fused and
    separate steps were equal, 94.7 against 93.8 ms). With the H100's host the 135M's step is the host's,
    every choice alike."""
    measured = load_profile("h100-sxm")
    hw = dataclasses.replace(measured, host_step_s=0.0, host_launch_s=0.0, host_param_s=0.0)

    def step(preset, mb, fused, profile=hw):
        cfg = load_config(preset=preset, overrides=["train.seq_len=2048", f"train.micro_batch_size={mb}",
                                                    "train.precision=bf16-mixed", f"train.fused_projections={fused}"])
        return predict_step(cfg, profile).step_time_s

    for preset, mb in (("smollm2-135m", 8), ("llama3.2-3b", 2)):
        separate, auto, both = (step(preset, mb, f) for f in ("false", "auto", "true"))
        assert (auto < separate) is (preset == "smollm2-135m"), preset  # auto on CUDA: q/k/v only
        assert (both < auto) is (preset == "smollm2-135m"), preset
    assert 1.01 < step("smollm2-135m", 8, "false") / step("smollm2-135m", 8, "auto") < 1.02
    assert len({step("smollm2-135m", 8, f, measured) for f in ("false", "auto", "true")}) == 1
