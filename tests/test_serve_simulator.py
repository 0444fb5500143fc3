"""Serving prediction: the simulator drives the engine's own scheduler (same batches as a recorded run),
the step-cost model's terms against their formulas, workload specs, and `fivefold plan --serve --cluster`."""

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from fivefold.commands.plan_serve import knee, predict
from fivefold.config import Config, ConfigError, ServeConfig
from fivefold.config_load import load_config
from fivefold.model import build_model
from fivefold.planner.hardware import load_profile, profile_from_dict
from fivefold.presets import PRESETS
from fivefold.serve import LLM, SamplingParams
from fivefold.serve.simulator import simulate
from fivefold.serve.step_cost import StepCostModel, StepShape, measure_serving
from fivefold.serve.workload import Request, Workload, parse_workload


def record_engine_batches(model, workload: Workload, serve: dict) -> tuple[list, int]:
    """Run the engine on random prompts of the workload's lengths (all at t=0, greedy to each output
    length) and record every step's batch as (request index, tokens), in the order the engine runs it."""
    llm = LLM(model, **serve)
    engine = llm.engine
    g = torch.Generator().manual_seed(0)
    # Distinct prompts: no block of one equals another's, as the simulator's token ids never repeat.
    prompts = [torch.randperm(model.cfg.vocab_size, generator=g)[:r.prompt].tolist() for r in workload.requests]
    steps = []
    schedule = engine.scheduler.schedule

    def recorded():
        work = schedule()
        ordered = sorted(work, key=lambda e: e[1] != 1)
        if work:
            steps.append([(int(s.request_id.split("-")[1]), n) for s, n in ordered])
        return work

    engine.scheduler.schedule = recorded
    llm.generate(prompts, [SamplingParams(max_tokens=r.output, temperature=0, ignore_eos=True)
                           for r in workload.requests])
    return steps, engine.scheduler.preemptions


@pytest.mark.parametrize("blocks", [64, 18], ids=["roomy", "preempting"])
def test_simulator_reproduces_the_engines_batches(blocks):
    model = build_model(PRESETS["tiny"], seed=0).eval()
    workload = parse_workload("requests=14,prompt=1:60,output=1:24,dist=uniform,seed=3")
    serve = dict(max_num_seqs=5, max_num_batched_tokens=40, block_size=4, num_blocks=blocks)
    recorded, preempted = record_engine_batches(model, workload, serve)
    cfg = Config(model=model.cfg, serve=dataclasses.replace(ServeConfig(), **serve))
    result = simulate(cfg, StepCostModel(cfg, load_profile("h100-sxm")), workload, blocks)
    assert result.steps == recorded
    assert result.preemptions == preempted and (preempted > 0) == (blocks == 18)


def h100_llama(**serve) -> tuple[Config, StepCostModel]:
    cfg = load_config(preset="llama3.2-1b", overrides=["serve.dtype=bfloat16", "serve.max_model_len=2048",
                                                        *(f"serve.{k}={v}" for k, v in serve.items())])
    return cfg, StepCostModel(cfg, load_profile("h100-sxm"))


def test_step_cost_terms_follow_their_formulas():
    cfg, cost = h100_llama()
    m, hw = cfg.model, cost.hw
    bandwidth = hw.memory_bandwidth * hw.memory_efficiency
    one = StepShape(np.array([1]), np.array([1000]), sampled=1, graphed=True)
    parts = cost.breakdown(one)
    # Batch-1 decode reads every block weight once (2 bytes each) and the LM head: bandwidth-bound.
    block_weights = (cost.attention_products + cost.mlp_products)
    expected_linear = m.num_layers * sum(k * n for k, n in block_weights) * 2 / bandwidth
    assert parts["linear"] == pytest.approx(expected_linear, rel=1e-9)
    assert parts["head"] == pytest.approx(m.hidden_size * m.vocab_size * 2 / bandwidth, rel=1e-9)
    # Attention reads each context token's keys and values once per layer (the kernel reads in place).
    assert parts["attention"] == pytest.approx(m.num_layers * 1000 * 2 * m.kv_size * 2 / bandwidth, rel=1e-9)
    # A graphed step pays no per-layer host work; an eager one does.
    eager = dataclasses.replace(one, graphed=False)
    assert cost.host(eager) - cost.host(one) == pytest.approx(m.num_layers * cost.serving["layer_s"])
    # A large prefill is compute-bound: linear time grows with its tokens.
    big = StepShape(np.array([4096]), np.array([4096]), sampled=1)
    small = StepShape(np.array([2048]), np.array([2048]), sampled=1)
    assert cost.breakdown(big)["linear"] == pytest.approx(2 * cost.breakdown(small)["linear"], rel=0.02)
    # Tensor parallelism splits the weights: batch-1 linear time halves, and all-reduces appear.
    cost2 = StepCostModel(cfg, hw, tp=2)
    assert cost2.breakdown(one)["linear"] == pytest.approx(parts["linear"] / 2, rel=1e-9)
    assert cost2.collectives(1, 1) > 0 == cost.collectives(1, 1)


def test_predicted_throughput_grows_with_the_batch_limit_and_latency_with_the_rate():
    workload = parse_workload("requests=64,prompt=64:256,output=64:256,dist=uniform")
    few = predict(h100_llama(max_num_seqs=8)[0], load_profile("h100-sxm"), workload).summary()
    many = predict(h100_llama(max_num_seqs=64)[0], load_profile("h100-sxm"), workload).summary()
    assert many["output_tokens_per_s"] > 2 * few["output_tokens_per_s"]
    assert many["tpot_p50_s"] > few["tpot_p50_s"]  # bigger batches: slower steps
    points = [{"rate": r, "output_tokens_per_s": t, "tpot_p99_s": p}
              for r, t, p in [(1, 10, 0.01), (2, 20, 0.011), (3, 29, 0.012), (4, 31, 0.05), (5, 31.5, 0.2)]]
    assert knee(points)["rate"] == 4  # past 4/s, latency grows most per token gained


@pytest.mark.parametrize("spec, names", [
    ("requests=0", "requests"), ("prompt=9:3", "prompt"), ("output=x", "output"), ("speed=3", "speed"),
    ("dist=normal", "dist"), ("rate=-1", "rate"), ("nope.jsonl", "nope.jsonl")])
def test_bad_workloads_are_one_line_errors_naming_the_field(spec, names):
    with pytest.raises(ConfigError) as err:
        parse_workload(spec)
    assert names in str(err.value) and "\n" not in str(err.value)


def test_trace_workloads_and_bad_profiles(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"arrival": 0.5, "prompt": 10, "output": 3}\n{"prompt": 7, "output": 2}\n')
    w = parse_workload(str(trace))
    assert [(r.arrival, r.prompt, r.output) for r in w.requests] == [(0.0, 7, 2), (0.5, 10, 3)]
    trace.write_text('{"prompt": 7}\n')
    with pytest.raises(ConfigError, match="t.jsonl:1"):
        parse_workload(str(trace))
    values = {"name": "x", "device": "cpu", "memory_bytes": 1e9, "gpus_per_node": 1, "memory_bandwidth": 1e9,
              "intra_node_bandwidth": 0, "intra_node_latency": 0, "inter_node_bandwidth": 0, "inter_node_latency": 0,
              "flops": {"fp32": 1e11}, "serving": {"step_ms": 1}}
    with pytest.raises(ConfigError, match=r"\[serving\] takes"):
        profile_from_dict(values, "p.toml")
    values["serving"] = {"step_s": -1}
    with pytest.raises(ConfigError, match="serving.step_s"):
        profile_from_dict(values, "p.toml")


def test_a_request_the_engine_would_refuse_is_named():
    cfg, cost = h100_llama()
    w = Workload([Request(0.0, 10, 5), Request(0.0, 2000, 100)], "x")
    with pytest.raises(ConfigError, match="workload request 1"):
        simulate(cfg, cost, w, num_blocks=1000)


def test_measure_serving_gives_the_serving_table():
    table = measure_serving(torch.device("cpu"), load_profile("h100-sxm").__class__(
        name="c", description="", device="cpu", memory_bytes=1e10, memory_bandwidth=2e10, gpus_per_node=1,
        intra_node_bandwidth=0, intra_node_latency=0, inter_node_bandwidth=0, inter_node_latency=0,
        flops={"fp32": 1e11}))
    assert set(table) == {"skinny_knee", "linear_flops_fp32", "step_s", "seq_s", "layer_s", "layer_seq_s",
                          "elementwise_bandwidth", "kv_bandwidth"}
    assert all(v >= 0 for v in table.values()) and table["step_s"] + table["layer_s"] > 0
    assert table["linear_flops_fp32"] > 1e9  # a square product of the engine's own linear, timed
    # Measured from prefill and decode steps, capped at the profile's streaming rate (2e10 x its efficiency).
    assert 0 < table["elementwise_bandwidth"] <= 2e10 * 0.8 and 0 < table["kv_bandwidth"] <= 2e10 * 0.8
    profile = dataclasses.replace(load_profile("h100-sxm"), device="cpu", serving=table)
    cfg = Config(model=PRESETS["tiny"])
    cost = StepCostModel(cfg, profile)  # the engine's timed rate, not the training peak, at the timed width
    assert cost.rate * cost._width(2048, 2048) == pytest.approx(table["linear_flops_fp32"], rel=1e-12)
    # The elementwise term moves its bytes at the measured rate, not the streaming one; so do the CPU path's
    # cache reads (a decode of 16 sequences at 4,096 tokens: bound by them, not by its FLOPs).
    assert cost.elementwise(100) == pytest.approx(100 * cost.elementwise_bytes / table["elementwise_bandwidth"])
    # Through the C++ decode kernel the keys are read once in place; gathered (serve.cpu_kernel=false), three
    # times over each group padded to whole blocks (4,100 -> 4,112 tokens).
    decode = StepShape(np.ones(16, dtype=int), np.full(16, 4100), sampled=16)
    assert cost.cpu_decode_kernel
    assert cost.attention(decode) == pytest.approx(16 * 4100 * cost.kv_row_bytes / table["kv_bandwidth"])
    gathered = StepCostModel(dataclasses.replace(cfg, serve=ServeConfig(cpu_kernel="false")), profile)
    assert gathered.attention(decode) == pytest.approx(3 * 16 * 4112 * cost.kv_row_bytes / table["kv_bandwidth"])


def fivefold(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fivefold", *args], capture_output=True, text=True, timeout=300)


def test_plan_serve_cluster_workload_cli():
    base = ["plan", "--serve", "--preset", "llama3.2-1b", "--cluster", "h200", "--set", "serve.dtype=bfloat16",
            "--set", "serve.max_model_len=2048"]
    out = fivefold(*base, "--workload", "chat", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["prediction"]["output_tokens_per_s"] > 0 and data["workload"]["requests"] == 32
    ranked = fivefold(*base, "--workload", "requests=64,prompt=100:400,output=50:200", "--search", "--json",
                      "--max-tpot", "0.03")
    assert ranked.returncode == 0, ranked.stderr
    rows = json.loads(ranked.stdout)["ranked"]
    assert rows and all(r["tpot_p99_s"] <= 0.03 for r in rows)
    tps = [r["output_tokens_per_s_per_gpu"] for r in rows]
    assert tps == sorted(tps, reverse=True)
    bad = fivefold("plan", "--serve", "--preset", "tiny", "--workload", "chat")
    assert bad.returncode == 2 and "--cluster" in bad.stderr
    bad = fivefold(*base, "--workload", "requests=3,dist=gauss")
    assert bad.returncode == 2 and "dist" in bad.stderr
