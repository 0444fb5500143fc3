"""bench/train_throughput.py's memory decisions, made from the memory plan before anything is built on a GPU:
whether a precision's runners can alternate on the device or must be timed one at a time, and refusing a
runner the plan says cannot fit at all. The shapes are the GPU benchmark's (bench/gpu_train.sh) on an 80 GB
card; nothing here needs a GPU (the plan is arithmetic). Tiny CPU runs check the --skip-hf, --sequential and
--fit paths end to end, and the GPU scripts' summaries (bench/gpu_summary.py) read real result files."""

import json
from pathlib import Path

import pytest
import torch
from bench_modules import bench_module

from fivefold.config_load import load_config
from fivefold.memory.formulas import count_params

ROOT = Path(__file__).resolve().parent.parent
H100 = 80 * 10**9  # bytes: an H100 80GB (torch.cuda.mem_get_info reports ~79.2e9 of it)


@pytest.fixture(scope="module")
def bench():
    with bench_module("train_throughput") as module:
        yield module


def _cfg(preset, precision, batch):
    return load_config(preset=preset, overrides=[f"train.precision={precision}", "train.seq_len=2048",
                                                 f"train.micro_batch_size={batch}", "train.device=cuda"])


def _args(bench, *extra):
    return bench.parse_args(["--device", "cuda", *extra])


def test_the_1b_and_hf_alternate_on_80_gb_but_two_3b_runners_go_one_at_a_time(bench):
    args = _args(bench)
    # 1B bf16-mixed, micro-batch 4: ours plans 44.3 GB; with HF's copy resident beside it, ~64 GB.
    one_b = _cfg("llama3.2-1b", "bf16-mixed", 4)
    plans = {("ours", True): bench.planned_runner(one_b, "ours"), ("hf", True): bench.planned_runner(one_b, "hf")}
    sequential, why = bench.choose_sequential(args, plans, H100)
    assert not sequential, why
    # HF: fp32 weights, gradients and two AdamW moments, resident between its steps.
    assert plans["hf", True][0] == 16 * count_params(one_b.model)
    # gpu_train.sh's --compile both: four such runners' states (~79 GB) no longer fit beside each other
    four = {**plans, ("ours", False): plans["ours", True], ("hf", False): plans["hf", True]}
    assert bench.choose_sequential(args, four, H100)[0]
    # 3B bf16 and fp8 (ours both), micro-batch 2: each alone fits (66.4 GB); their resident states together do not.
    three_b = {("ours", p): bench.planned_runner(_cfg("llama3.2-3b", p, 2), "ours") for p in ("bf16-mixed", "fp8")}
    assert all(r + t <= H100 for r, t in three_b.values())
    sequential, why = bench.choose_sequential(args, three_b, H100)
    assert sequential and "one at a time" in why, why
    bench.check_fits_alone(three_b, H100)  # no refusal


def test_the_choice_follows_the_plan_at_the_boundary(bench):
    """Alternating needs sum(resident) + max(transient) within the usable share of the device."""
    args = _args(bench)
    plans = {("ours", False): (30e9, 20e9), ("hf", False): (25e9, 10e9)}  # together 75e9
    usable = 75e9 / (1 - bench.FIT_HEADROOM)
    assert bench.choose_sequential(args, plans, usable * 1.001)[0] is False
    assert bench.choose_sequential(args, plans, usable * 0.999)[0] is True
    assert bench.choose_sequential(args, plans, None)[0] is False  # CPU: no device memory to plan against
    assert bench.choose_sequential(_args(bench, "--sequential", "yes"), plans, None)[0] is True
    assert bench.choose_sequential(_args(bench, "--sequential", "no"), plans, 1e9)[0] is False


def test_a_runner_the_plan_says_cannot_fit_is_refused_before_it_is_built(bench):
    # 1B in fp32 at micro-batch 4, seq 2048, compiled on CUDA: the plan's 79.8 GiB peak (83.8 eager) is over
    # an 80 GB card's usable share.
    cfg = _cfg("llama3.2-1b", "fp32", 4)
    with pytest.raises(SystemExit, match=r"ours plans 79\.8 GiB, over the device's 74\.5 GiB: lower --batch"):
        bench.check_fits_alone({("ours", False): bench.planned_runner(cfg, "ours")}, H100)


def test_ours_alone_one_runner_at_a_time_on_cpu(bench, data_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("FIVEFOLD_CACHE", data_cache)  # the session's tokenizer and shards
    out = tmp_path / "tt.json"
    bench.main(["--preset", "tiny", "--seq-len", "32", "--batch", "2", "--steps", "2", "--precision", "fp32,bf16",
                "--skip-hf", "--sequential", "yes", "--profile", "--json", str(out)])
    data = json.loads(out.read_text())
    assert [(r["precision"], r["impl"]) for r in data["results"]] == [("fp32", "ours"), ("bf16", "ours")]
    profile = data["profiles_bf16"]["ours"]  # --profile: ours only, HF skipped; a CPU run has no kernel time
    assert set(profile) == {"wall_s", "table"} and profile["wall_s"] > 0 and "aten::mm" in profile["table"]
    assert all(r["ratio_vs_hf"] is None and len(r["step_times_s"]) == 2 for r in data["results"])
    assert all(r["loss_compiled"] is False for r in data["results"])  # eager on a CPU (train.compile=auto)
    assert data["first_step_loss_fp32"] is None and data["schedule"] == {"fp32": "--sequential yes",
                                                                         "bf16": "--sequential yes"}
    # The end of a GPU session's log (bench/gpu_train.sh) reads this file.
    import gpu_summary

    lines = gpu_summary.train_lines(data)
    assert lines[0] == "tiny, seq 32, 64 tokens a step"
    assert lines[1].startswith("fp32 ours (micro-batch 2 x 1, recompute none): ") and "HF" not in lines[1]
    assert lines[-1].startswith("profiled bf16 step, ours: wall ") and lines[-1].endswith(" ms")


def test_fused_projections_both_times_ours_fused_and_separate_beside_hf(bench, data_cache, tmp_path, monkeypatch):
    """--fused-projections both: "ours" with q/k/v and gate/up fused, "ours-separate" without, HF beside them;
    the first-step check against HF ran on the fused runner (its loss and gradient norm equal HF's)."""
    monkeypatch.setenv("FIVEFOLD_CACHE", data_cache)
    out = tmp_path / "fused.json"
    bench.main(["--preset", "tiny", "--seq-len", "32", "--batch", "2", "--steps", "1", "--precision", "fp32",
                "--fused-projections", "both", "--json", str(out)])
    data = json.loads(out.read_text())
    rows = {r["impl"]: r for r in data["results"]}
    assert set(rows) == {"ours", "ours-separate", "hf"}
    assert rows["ours"]["fused_projections"] == {"qkv": True, "gate_up": True}
    assert rows["ours-separate"]["fused_projections"] == {"qkv": False, "gate_up": False}
    assert rows["ours-separate"]["ratio_vs_hf"] > 0 and data["settings"]["fused_projections"] == "both"
    check = data["first_step_loss_fp32"]
    assert check["loss_rel_diff"] < 1e-4 and check["grad_norm_rel_diff"] < 1e-5


def test_fit_trains_ours_at_the_planners_micro_batch_keeping_the_step(bench, data_cache, tmp_path, monkeypatch):
    """--fit: the micro-batch, accumulation and recomputation fivefold.planner.fit chooses for the given
    memory, the step's sequences (--batch x --grad-accum) kept, recorded on the row."""
    from fivefold.planner.fit import fit_micro_batch

    monkeypatch.setenv("FIVEFOLD_CACHE", data_cache)
    out = tmp_path / "fit.json"
    bench.main(["--preset", "tiny", "--seq-len", "32", "--batch", "2", "--grad-accum", "4", "--steps", "1",
                "--precision", "bf16", "--skip-hf", "--fit", "--device-memory", "0.3", "--json", str(out)])
    row = json.loads(out.read_text())["results"][0]
    cfg = load_config(preset="tiny", overrides=["train.seq_len=32", "train.micro_batch_size=2", "train.grad_accum=4",
                                                "train.precision=bf16-mixed", "model.eos_token_id=0"])
    chosen = fit_micro_batch(cfg, int(0.3e9), device="cpu", headroom=bench.FIT_HEADROOM).config.train
    assert (row["micro_batch_size"], row["grad_accum"], row["recompute"]) == \
        (chosen.micro_batch_size, chosen.grad_accum, chosen.recompute)
    assert row["micro_batch_size"] * row["grad_accum"] == 8 and row["micro_batch_size"] > 2


def test_waits_both_times_ours_beside_the_same_trainer_made_to_wait(bench, data_cache, tmp_path, monkeypatch):
    """--waits both: "ours-waiting" is our Trainer reading the loss before its update and the norm after it, as
    the step did before it read once; both train the same weights (here, a CPU, at the same losses)."""
    monkeypatch.setenv("FIVEFOLD_CACHE", data_cache)
    out = tmp_path / "waits.json"
    reads = []
    item = torch.Tensor.item

    def counted(self):
        reads.append(self.shape)
        return item(self)
    monkeypatch.setattr(torch.Tensor, "item", counted)
    bench.main(["--preset", "tiny", "--seq-len", "32", "--batch", "2", "--steps", "2", "--precision", "fp32",
                "--skip-hf", "--waits", "both", "--json", str(out)])
    data = json.loads(out.read_text())
    rows = {r["impl"]: r for r in data["results"]}
    assert set(rows) == {"ours", "ours-waiting"} and data["settings"]["waits"] == "both"
    assert all(len(r["step_times_s"]) == 2 for r in rows.values())
    # at least the waiting runner's two reads a step (a warm-up and two timed steps)
    assert len(reads) >= 6 and all(shape == torch.Size([]) for shape in reads)


def test_fused_projections_both_is_refused_with_fit(bench):
    with pytest.raises(SystemExit):
        bench.parse_args(["--fused-projections", "both", "--fit", "--skip-hf", "--device-memory", "80"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--waits", "both", "--fused-projections", "both"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--waits", "both", "--fit", "--skip-hf", "--device-memory", "80"])


def test_fit_is_refused_beside_hf_and_without_a_memory(bench):
    with pytest.raises(SystemExit):
        bench.parse_args(["--fit", "--device-memory", "1"])  # HF would train another shape
    with pytest.raises(SystemExit):
        bench.parse_args(["--fit", "--skip-hf"])  # a CPU has no device memory to fill


def test_the_gpu_scripts_parse_and_the_serving_summary_reads_a_real_result(bench, capsys):
    import subprocess

    import gpu_summary

    for script in ("gpu_common.sh", "gpu_serve.sh", "gpu_train.sh"):
        subprocess.run(["bash", "-n", str(ROOT / "bench" / script)], check=True)
    # ONLY runs the named steps, leaves the others out, and names a word that is no step.
    run = subprocess.run(["bash", "-c", 'source bench/gpu_common.sh; name=check gpu=cpu; ONLY="b typo"; '
                          'step a 5 echo ran-a; step b 5 echo ran-b; print_steps'],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    assert "ran-b" in run.stdout and "ran-a" not in run.stdout and '== a: left out (not in ONLY="b typo")' in run.stdout
    assert "ONLY names 'typo', which is no step here (steps: a b)" in run.stdout
    path = ROOT / "bench/results/serve_default.json"  # bench/serve.py on this CPU
    gpu_summary.main(["serve", str(path), str(ROOT / "bench/results/not_there.json")])
    out = capsys.readouterr().out
    assert "fivefold / transformers best: " in out and "batch-1 decode " in out
    assert "not_there.json: not written" in out
    # The stored H100 results (the serving anchors, the training rows with the planner's errors).
    gpu_summary.main(["serve", str(ROOT / "bench/results/serve_anchors_h100.json")])
    out = capsys.readouterr().out
    assert "fivefold / transformers best: 31.16x" in out and "batch-1 decode 659 tok/s = 49%" in out
    assert "decode step at batch 256: wall / kernel time 1.16" in out
    assert "target batch1_hbm_roofline_fraction >= 0.5: 0.49 NOT met" in out
    # The second lease's: batch-1 decode over the 50% line, transformers' static batches not timed.
    gpu_summary.main(["serve", str(ROOT / "bench/results/serve_anchors_h100_20261127.json")])
    out = capsys.readouterr().out
    assert "batch-1 decode 696 tok/s = 52%" in out and "target batch1_hbm_roofline_fraction >= 0.5: 0.52 met" in out
    assert "target ratio_vs_transformers_best >= 10: - not measured" in out
    gpu_summary.main(["train", str(ROOT / "bench/results/train_throughput_3b_fp8_h100.json")])
    out = capsys.readouterr().out
    assert "fp8 ours+compile (micro-batch 2 x 1, recompute none): 20,306 tok/s, MFU 43.9%, 1.07x our bf16" in out


def test_copy_to_packs_each_finished_steps_results_into_one_archive(tmp_path):
    """COPY_TO=DIR: after every step, the files written under bench/results since the call's first script began
    (and no older one) are in DIR/results.tgz, so a call cut short keeps its finished steps."""
    import subprocess
    import tarfile

    written = ROOT / "bench/results/copy_check_dry.json"  # *_dry.* is git-ignored
    try:
        script = ('source bench/gpu_common.sh; name=check gpu=cpu; GPU_RESULTS_SINCE=$(mktemp); '
                  f'COPY_TO={tmp_path}; step one 5 bash -c "echo 1 > {written}"; '
                  f'test -f {tmp_path}/results.tgz && cp {tmp_path}/results.tgz {tmp_path}/after_one.tgz; '
                  'step two 5 true')
        subprocess.run(["bash", "-c", script], cwd=ROOT, check=True, capture_output=True)
        with tarfile.open(tmp_path / "after_one.tgz") as tar:
            assert tar.getnames() == ["./copy_check_dry.json"]  # the stored results are older: left out
    finally:
        written.unlink(missing_ok=True)


def test_hf_accumulates_like_ours(bench, data_cache, tmp_path, monkeypatch):
    """--grad-accum: the first fp32 step of HF's loop (mean of the micro-batches' mean losses, one clip and
    AdamW step) against our Trainer's, on the same batches: loss and gradient norm agree (the bench asserts
    1e-4 / 1e-5 relative before timing anything; here held to the same bounds)."""
    monkeypatch.setenv("FIVEFOLD_CACHE", data_cache)
    out = tmp_path / "accum.json"
    bench.main(["--preset", "tiny", "--seq-len", "32", "--batch", "2", "--grad-accum", "3", "--steps", "1",
                "--precision", "fp32", "--json", str(out)])
    check = json.loads(out.read_text())["first_step_loss_fp32"]
    assert check["loss_rel_diff"] < 1e-4 and check["grad_norm_rel_diff"] < 1e-5
    assert check["loss_ours"] > 5.0  # ~ln(512) at init: the three micro-batches' mean, not one of them / 3


H100_ROWS = ["1b", "1b_fit", "3b_fp8", "135m", "host_135m", "host_1b"]
# Reported misses of the +-10% target among the H100 rows, predicted / measured - 1 (docs/planner_validation.md):
# the 135M row of the first lease (82.8 ms a step), whose host and device take about as long as each other, which
# the model's max() of the two does not price (the lease's own host was not measured; this call's host-bound
# steps ran on a later lease's machine).
H100_MISSES = {("135m", True, "bf16"): 0.234}


def test_the_planner_predicts_our_stored_h100_rows(bench, tmp_path):
    """Issue 32's check of the planner against fivefold's own GPU runs, on the rows H100s measured
    (bench/results/train_throughput_*_h100.json), each row's Config rebuilt as the bench built it (and as it
    ran: projections separate where the row does not say): the step-time model within 10% of every row's
    measured tokens/s but H100_MISSES (within a point of its reported error; the 1B and 3B rows +3.1% to +9.5%
    with the products bench/matmul_shapes.py timed on an H100, -13.4% to -5.4% with the datasheet's), and the
    memory plan within 0.3% of torch.cuda.max_memory_allocated at seq 2048 (measured: -0.24% to -0.00%; the
    compiled rows were +1.1% to +2.6% while the plan counted o_proj's input apart from the attention output
    it is a view of), 3% on the 128-token rows."""
    from fivefold.memory.plan import plan_memory
    from fivefold.planner.hardware import load_profile
    from fivefold.planner.speed import predict_step

    profile = load_profile("h100-sxm")
    rows = 0
    for tag in H100_ROWS:
        d = json.loads((ROOT / f"bench/results/train_throughput_{tag}_h100.json").read_text())
        assert d["planner"]["profile"] == "h100-sxm" and "H100" in d["machine"]["gpu"]
        for r in d["results"]:
            if r["impl"] != "ours":
                continue
            cfg = _stored_row_config(bench, tmp_path, d, r)
            key = (tag, r["compiled"], r["precision"])
            error = predict_step(cfg, profile).tokens_per_s_per_gpu / r["tokens_per_s"] - 1
            if key in H100_MISSES:
                assert error == pytest.approx(H100_MISSES[key], abs=0.01), (key, error)
            else:
                assert abs(error) < 0.10, (key, error)
            planned = plan_memory(cfg, device="cuda", suggest=False).memory["total"]
            long = d["settings"]["seq_len"] >= 2048
            assert planned / r["measured_peak_bytes"] - 1 == pytest.approx(0, abs=0.003 if long else 0.03), key
            rows += 1
    assert rows == 8


# The H200 leases of 2026-11-27 (bench/results/train_throughput_*_h200.json): every row of ours, the profiled
# 1B and 3B rows and the two host-bound rows of 128 tokens a step that calibrated the profile's host figures.
H200_ROWS = ("1b_fit", "3b_fp8", "135m", "1b_profile", "3b_profile", "host_135m", "host_1b")


def _stored_row_config(bench, tmp_path, d, r):
    """The Config a stored row of ours ran with, rebuilt as the bench built it (and as it ran: projections
    separate where the row does not say, weights cast at each use under fp8 where it does not say)."""
    args = bench.parse_args(["--device", "cuda", "--preset", d["settings"]["preset"],
                             "--seq-len", str(d["settings"]["seq_len"])])
    cfg = bench.make_config(args, r["precision"], r["compiled"], 1.0, str(tmp_path), batch=r["micro_batch_size"])
    cfg.train.grad_accum, cfg.train.recompute = r["grad_accum"], r["recompute"]
    if r["compiled"] and not r.get("loss_compiled", False):  # measured before the loss was compiled
        cfg.train.compile = "blocks"
    cfg.train.fp8_weight_cast = r.get("fp8_weight_cast", "use")  # before weights were cast once a step
    fused = r.get("fused_projections", {"qkv": False, "gate_up": False})  # before projections fused
    cfg.train.fused_projections = "true" if fused["gate_up"] else "auto" if fused["qkv"] else "false"
    return cfg


def test_the_planner_against_our_stored_h200_rows(bench, tmp_path):
    """Issue 32's planner check on the rows one H200 measured: the step-time model within 8% of every row's
    measured tokens/s (target 10%; measured -1.5% to +7.0%: the products as bench/matmul_shapes.py timed them, the
    attention by head size, the optimizer's bytes as its update moves them, the host's floor), and the memory
    plan within 3% of torch.cuda.max_memory_allocated (-0.30% to -0.01% at 2048 tokens a sequence; the 128-token
    rows' few hundred MB -2.8%)."""
    from fivefold.memory.plan import plan_memory
    from fivefold.planner.hardware import load_profile
    from fivefold.planner.speed import predict_step

    profile = load_profile("h200")
    rows = 0
    for tag in H200_ROWS:
        d = json.loads((ROOT / f"bench/results/train_throughput_{tag}_h200.json").read_text())
        assert d["planner"]["profile"] == "h200" and d["machine"]["gpu"] == "NVIDIA H200"
        for r in d["results"]:
            if not r["impl"].startswith("ours"):
                continue
            cfg = _stored_row_config(bench, tmp_path, d, r)
            error = predict_step(cfg, profile).tokens_per_s_per_gpu / r["tokens_per_s"] - 1
            assert abs(error) < 0.08, (tag, r["impl"], r["precision"], error)
            planned = plan_memory(cfg, device="cuda", suggest=False).memory["total"]
            long = d["settings"]["seq_len"] >= 2048
            assert planned / r["measured_peak_bytes"] - 1 == pytest.approx(0, abs=0.005 if long else 0.03), tag
            rows += 1
    assert rows == 10


# Kernel time by kind, the planner's (fivefold.planner.speed.kernel_time) against one profiled H200 step's kernels
# sorted by name (bench/train_throughput.py --profile): how far each kind may lie from the measured one.
KIND_TOLERANCE = {"matmul": 0.03, "attention": 0.10, "optimizer": 0.13, "elementwise": 0.15}


def test_the_planners_kernel_kinds_against_profiled_h200_steps(bench, tmp_path):
    """The 1B's --fit step and the 3B's bf16 and fp8 steps, profiled on an H200: each kernel kind the planner
    prices within KIND_TOLERANCE of the kernels measured under that name (matmul -2.1% to +0.0%, attention -9.2%
    to +0.0%, optimizer -11.6% to -7.7%, elementwise -13.1% to -6.6%), and the kinds together within 6% of the
    step's kernels. With the datasheet pricing the matmuls read +33%, the 1B's attention -30% and the optimizer
    -36%: the step's total was off by 9-13% while single kinds were off by a third."""
    from fivefold.planner.hardware import load_profile
    from fivefold.planner.speed import kernel_time

    profile = load_profile("h200")
    steps = 0
    for tag in ("1b_profile", "3b_profile"):
        d = json.loads((ROOT / f"bench/results/train_throughput_{tag}_h200.json").read_text())
        for name, measured in d["profiles_bf16"].items():
            precision = "fp8" if name.endswith("fp8") else "bf16"
            row = next(r for r in d["results"] if r["impl"] == "ours" and r["precision"] == precision)
            kinds = kernel_time(_stored_row_config(bench, tmp_path, d, row), profile)
            for kind, tolerance in KIND_TOLERANCE.items():
                seen = measured["kernel_kinds_s"][kind]
                assert kinds[kind] / seen - 1 == pytest.approx(0, abs=tolerance), (tag, name, kind)
            priced = sum(v for k, v in kinds.items() if k != "launches")
            assert priced / measured["kernel_s"] - 1 == pytest.approx(0, abs=0.06), (tag, name)
            steps += 1
    assert steps == 3


def test_the_memory_plan_holds_on_the_second_h100_leases_135m_rows(bench, tmp_path):
    """The second H100 lease's smollm2-135m rows (bench/results/train_throughput_135m_h100_20261127.json: the loss
    compiled, projections fused and separate): the memory plan within 0.5% of torch.cuda.max_memory_allocated
    (measured -0.31% and -0.32%). Their speed is a reported miss, not asserted: the planner reads +25.9% fused and
    +15.3% separate, while the three sides' median steps lay within 1.5% of each other and their best steps spread
    78-90 ms (docs/planner_validation.md)."""
    from fivefold.memory.plan import plan_memory

    d = json.loads((ROOT / "bench/results/train_throughput_135m_h100_20261127.json").read_text())
    assert "H100" in d["machine"]["gpu"]
    args = bench.parse_args(["--device", "cuda", "--preset", d["settings"]["preset"],
                             "--seq-len", str(d["settings"]["seq_len"])])
    rows = [r for r in d["results"] if r["impl"] in ("ours", "ours-separate")]
    assert len(rows) == 2 and all(r["loss_compiled"] for r in rows)
    for r in rows:
        fused = "true" if r["fused_projections"]["gate_up"] else "false"
        cfg = bench.make_config(args, r["precision"], r["compiled"], 1.0, str(tmp_path), batch=r["micro_batch_size"],
                                fused=fused)
        assert cfg.fused_projections("cuda") == (r["fused_projections"]["qkv"], r["fused_projections"]["gate_up"])
        planned = plan_memory(cfg, device="cuda", suggest=False).memory["total"]
        assert planned / r["measured_peak_bytes"] - 1 == pytest.approx(0, abs=0.005), r["impl"]


def test_the_peaks_measure_each_dtype_once_and_fp8_rows_take_bf16s(bench, monkeypatch):
    """fp8's rows are timed against bf16's peak: one bf16 measurement, not a second one filed as fp8's."""
    import torch

    calls = []
    monkeypatch.setattr(bench, "measure_peak_flops", lambda device, dtype: calls.append(dtype) or len(calls) * 1e12)
    peaks = {p: [] for p in bench.PRECISIONS}
    bench.sample_peaks(peaks, "cpu")
    assert calls == [torch.float32, torch.bfloat16]
    assert peaks == {"fp32": [1e12], "bf16": [2e12], "fp8": [2e12]}


def test_kernels_are_sorted_into_the_kinds_the_planner_prices(bench):
    """Names of kernels an H200's profiled 135M steps launched (bench/results/train_throughput_135m_profile_h200
    .json), each in the kind the planner's kernel_time prices it as."""
    names = {"cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_3_64x128x64": "attention",
             "flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 64, 4>>": "attention",
             "nvjet_sm90_tst_192x192_64x3_1x2_h_bz_coopB_NNN": "matmul",
             "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "matmul",
             "triton_tem_fused_mm_0": "matmul",
             "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::FusedAdamMathFunctor>": "optimizer",
             "triton_poi_fused_add_cat_mul_neg_slice_slice_backward_3": "elementwise",
             "triton_red_fused__log_softmax__log_softmax_backward_data_0": "elementwise",
             "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda>": "elementwise",
             "Memcpy HtoD (Pageable -> Device)": "other"}
    assert {name: bench.kernel_kind(name) for name in names} == names
    assert set(bench.MEASURED_KINDS) == {"attention", "matmul", "optimizer", "elementwise", "other"}


def test_the_window_note_splits_each_windows_first_step_from_the_rest(bench):
    """--steps 7 --rounds 3: windows of 3, 2, 2 steps; their first steps (0, 3, 5) apart from the others."""
    times = [0.010, 0.001, 0.002, 0.020, 0.003, 0.030, 0.004]
    assert bench.window_note(times, 7, 3) == "; a window's first step 20.0 ms, the others 2.5 ms"
    assert bench.window_note(times, 7, 0) == "" and bench.window_note(times, 7, 7) == ""
