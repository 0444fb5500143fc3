"""Hardware profiles: the shipped datasheets load and round-trip, bad files are clear errors, `fivefold plan
--cluster` takes its device memory from one, and `fivefold calibrate` measures this machine into one."""

import json
import os
import subprocess
import sys

import pytest

from fivefold import cli
from fivefold.config import ConfigError
from fivefold.planner.hardware import load_profile, profile_for_device_name, profile_from_dict, shipped_profiles


def test_shipped_profiles_load_and_round_trip(tmp_path):
    assert shipped_profiles() == ["a100-40gb", "a100-80gb", "h100-hbm2e-500w", "h100-sxm", "h200"]
    for name in shipped_profiles():
        profile = load_profile(name)
        assert profile.device == "cuda" and profile.gpus_per_node == 8
        assert profile.peak_flops("bf16") > 1e14 and profile.memory_bytes >= 40e9
        assert profile.intra_node_bandwidth > profile.inter_node_bandwidth > 0
        assert 0 < profile.comm_interference < 0.5  # NCCL's resident CTAs: a minority of the SMs
        path = tmp_path / f"{name}.toml"
        path.write_text(profile.to_toml())
        assert load_profile(path) == profile
    h100 = load_profile("h100-sxm")
    assert h100.peak_flops("fp8") > h100.peak_flops("bf16") > h100.peak_flops("fp32")
    with pytest.raises(ConfigError, match="has no fp8 matmul figure"):
        load_profile("a100-80gb").peak_flops("fp8")


GOOD = load_profile("h200").to_toml()


@pytest.mark.parametrize("text, message", [
    (GOOD.replace("gpus_per_node = 8", "gpus_per_node = 0"), "gpus_per_node=0 must be an integer >= 1"),
    (GOOD.replace("memory_bandwidth = ", "memory_bandwith = "), "unknown field(s) memory_bandwith"),
    (GOOD.replace('device = "cuda"', 'device = "tpu"'), "device='tpu' must be cuda or cpu"),
    (GOOD.replace("inter_node_latency = 1e-05", "inter_node_latency = -1"), "inter_node_latency=-1 must be"),
    (GOOD.replace("bf16 = 9.89e+14", "bf16 = nan"), "flops.bf16=nan must be a number >= 0"),
    (GOOD.replace("fp8 = ", "int4 = "), "[flops] takes bf16, fp16, fp8, fp32"),
    ("\n".join(line for line in GOOD.splitlines() if not line.startswith("memory_bytes")), "missing memory_bytes"),
    ("name = [", "is not valid TOML"),
    (GOOD.replace("attention_efficiency = 0.45", "attention_efficiency = 1.5"), "attention_efficiency=1.5 must be a "
                                                                               "fraction in (0, 1]"),
    (GOOD.replace("matmul_efficiency = 0.857", "matmul_efficiency = 0"), "matmul_efficiency=0 must be in (0, 4]"),
    (GOOD.replace("host_step_s = 0.0068", "host_step_s = -1"), "host_step_s=-1 must be a number >= 0"),
    (GOOD.replace("comm_interference = 0.18", "comm_interference = 1"), "comm_interference=1 must be a fraction "
                                                                         "in [0, 1)"),
    (GOOD.replace("speed_spread = 0.08", "speed_spread = 1.5"), "speed_spread=1.5 must be a fraction in [0, 1)"),
    (GOOD + "\n[kernels.int4]\nmatmul_knee = 1\n", "[kernels.<dtype>] tables are for bf16, fp16, fp8, fp32"),
    (GOOD + "\n[kernels.fp32]\nop_overhead = 1e-6\n",
     "[kernels]: [fp32] takes matmul_efficiency, matmul_knee, attention_efficiency"),
    (GOOD + "\n[kernels.fp32]\nattention_efficiency = 2\n", "[kernels.fp32]: attention_efficiency=2.0 must be a "
                                                             "fraction in (0, 1]"),
    (GOOD + "\n[kernels.fp32]\nmatmul_knee = -3\n", "fp32.matmul_knee=-3 must be a number >= 0"),
])
def test_a_bad_profile_is_a_clear_error(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"{path}.*" + message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]").replace("+", r"\+")):
        load_profile(path)


def test_plan_takes_device_memory_and_kind_from_the_cluster(capsys):
    assert cli.main(["plan", "--preset", "llama3-8b", "--cluster", "h200", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["device_memory"] == 141e9 and plan["device"] == "cuda"
    assert cli.main(["plan", "--preset", "llama3-8b", "--cluster", "h200", "--device-memory", "24GB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["device_memory"] == 24e9  # an explicit figure wins
    assert cli.main(["hardware"]) == 0
    assert capsys.readouterr().out.count("NVIDIA") == 5
    assert cli.main(["hardware", "h200"]) == 0  # one profile's figures, the measured ones the planner prices with
    shown = capsys.readouterr().out
    assert "knee 216, efficiency 0.857, attention 0.45 at head size 128 (knee 96)" in shown
    assert "host: 6.8 ms a step, 30.4 us a kernel, 16 us a parameter tensor" in shown
    assert cli.main(["hardware", "a100-80gb"]) == 0
    assert "host:" not in capsys.readouterr().out  # no host figures: the planner prices the device alone


def test_calibrate_measures_this_machine_into_a_profile(tmp_path, data_cache):
    out = tmp_path / "here.toml"
    env = {**os.environ, "FIVEFOLD_CACHE": data_cache}
    proc = subprocess.run([sys.executable, "-m", "fivefold", "calibrate", "--nproc", "2", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    profile = load_profile(out)
    assert profile.name == "here" and profile.device == "cpu" and profile.gpus_per_node == 2
    assert profile.flops["fp32"] > 1e9 and profile.flops["bf16"] > 0
    assert profile.memory_bandwidth > 1e9 and profile.memory_bytes > 1e9
    assert profile.intra_node_bandwidth > 1e7 and 0 < profile.intra_node_latency < 0.1
    assert "gloo all-reduce over 2 processes" in profile.source
    # the step-time model's kernel figures: a 2048^3 matmul is predicted at the measured [flops]
    knee = profile.matmul_knee
    assert profile.matmul_efficiency * (2048 / (2048 + knee)) ** 3 == pytest.approx(1.0, rel=1e-4)  # 6 digits in TOML
    assert 0 < profile.attention_efficiency <= 1 and 0 < profile.memory_efficiency <= 1
    assert profile.overlap == 0 and 1e-7 < profile.op_overhead < 1e-2
    # bf16's own matmul and attention figures, measured apart: what a bf16-mixed step is priced with
    bf16 = profile.for_dtype("bf16")
    assert set(profile.kernels) == {"bf16"} and set(profile.kernels["bf16"]) == {
        "matmul_efficiency", "matmul_knee", "attention_efficiency"}
    assert bf16.matmul_efficiency * (2048 / (2048 + bf16.matmul_knee)) ** 3 == pytest.approx(1.0, rel=1e-4)
    assert 0 < bf16.attention_efficiency <= 1 and bf16.op_overhead == profile.op_overhead
    assert profile.for_dtype("fp32") == profile  # the top level is fp32's on a CPU
    assert profile_from_dict(__import__("tomllib").loads(out.read_text()), str(out)) == profile


@pytest.mark.parametrize("device_name, profile", [
    ("NVIDIA H200", "h200"),
    ("NVIDIA H100 80GB HBM3", "h100-sxm"),
    ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
    ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
    # other boards of the same chips (lower clocks and power), other chips, and names that cannot tell
    ("NVIDIA H100 PCIe", None), ("NVIDIA H100 NVL", None), ("NVIDIA H200 NVL", None), ("NVIDIA GH200 480GB", None),
    ("NVIDIA A100-PCIE-40GB", None), ("NVIDIA A100 80GB PCIe", None), ("NVIDIA H800", None), ("NVIDIA H20", None),
    ("NVIDIA H100", None), ("Tesla T4", None),
])
def test_a_cuda_device_name_finds_its_profile(device_name, profile):
    assert profile_for_device_name(device_name) == profile
    if profile is not None:
        assert load_profile(profile).device == "cuda"
