"""A serving step's working set (fivefold.serve.step_memory): what `fivefold plan --serve` counts for the
forward at the token budget, the sampler at max_num_seqs rows and the scored rows, against what a real step
holds at its peak, measured op by op (fivefold.memory.live_peak.LivePeak), on each forward path. The plan is
a bound: never below the measurement, and above it only by what the measurement cannot see or a few rows."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fivefold.config import ConfigError
from fivefold.config_load import load_config
from fivefold.memory.live_peak import LivePeak
from fivefold.model import build_model
from fivefold.serve import LLM, RequestError, SamplingParams
from fivefold.serve.plan import plan_serving
from fivefold.serve.step_memory import measured_phases

SHAPE = ["model.hidden_size=256", "model.num_layers=2", "model.ffn_hidden_size=1024", "model.head_dim=16",
         "model.vocab_size=8192", "model.num_heads=8", "model.num_kv_heads=4", "model.max_seq_len=2048",
         "serve.max_num_seqs=16", "serve.max_num_batched_tokens=512", "serve.num_blocks=256"]


def engine(*overrides):
    cfg = load_config(preset="tiny", overrides=SHAPE + list(overrides))
    return cfg, LLM(build_model(cfg.model, seed=0), **vars(cfg.serve)).engine


def step_memory(cfg, device: str, eng=None):
    """What `fivefold plan --serve` counts for a step (on `device`); the engine it builds counts the same."""
    planned = plan_serving(cfg, device=device).step
    if eng is not None:
        assert eng.step_memory == planned
    return planned


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 8192, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def peak_of_step(eng, phase: str) -> int:
    """The peak of one phase of the engine's next step (fivefold.serve.step_memory.measured_phases)."""
    with measured_phases(eng) as peaks:
        eng.step()
    return peaks[phase]


def test_live_peak_counts_new_storages_until_freed():
    base = torch.zeros(1000)
    with LivePeak() as m:
        view = base[10:]  # a view: nothing new
        base.add_(1)  # in place: nothing new
        torch.add(base, 1, out=base)  # into a buffer that existed: nothing new
        a = base * 2  # 4,000 bytes
        b = a + 1  # 8,000 live
        del a, b  # freed
        c = torch.ones(250)  # 1,000
    assert m.peak == 8000 and m.live == 1000 and sorted(m.at_peak) == [("add.Tensor", (1000,), 4000), ("mul.Tensor", (1000,), 4000)]
    del view, c


@pytest.mark.parametrize("path,overrides", [("lean-cpp", []), ("lean", ["serve.cpu_kernel=false"]),
                                            ("modules", ["serve.fuse_launches=false"])])
def test_forward_at_the_token_budget(path, overrides):
    """A prompt chunk of max_num_batched_tokens tokens: the MLP's products and the residual stream, as planned
    for the path the engine runs."""
    cfg, eng = engine(*overrides)
    planned = step_memory(cfg, "cpu", eng)
    assert planned.path == path
    eng.add_request(prompt(1000), SamplingParams(max_tokens=1, temperature=0))
    measured = peak_of_step(eng, "forward")  # the first chunk: 512 tokens, no context (no mask)
    assert planned.mlp >= measured and planned.mlp == pytest.approx(measured, rel=0.01)


def test_a_bfloat16_forward_at_the_token_budget():
    """serve.dtype=bfloat16 on a CPU: the lean loop with its C++ norms and SwiGLU (the rotation stays torch's), its
    activations at 2 bytes, as planned."""
    cfg = load_config(preset="tiny", overrides=SHAPE + ["serve.dtype=bfloat16"])
    eng = LLM(build_model(cfg.model, seed=0, dtype=torch.bfloat16), **vars(cfg.serve)).engine
    assert eng.cpu_kernel and eng.dtype == torch.bfloat16
    planned = step_memory(cfg, "cpu", eng)
    assert planned.path == "lean-cpp"
    eng.add_request(prompt(1000), SamplingParams(max_tokens=1, temperature=0))
    measured = peak_of_step(eng, "forward")
    assert planned.mlp >= measured and planned.mlp == pytest.approx(measured, rel=0.01)


def dequantized_gate_up(method: str) -> int:
    """The fused gate/up weight of the quantized tests' shape (ffn 2048, hidden 256) dequantized in fp32 for one
    64-token chunk: the weight, and for int4 its codes unpacked (2 bytes an element) beyond the chunk's output."""
    return 2 * 2048 * 256 * 4 + (method == "int4") * (2 * (2 * 2048) * 256 - 64 * 2 * 2048 * 4)


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("path,overrides", [("lean-cpp", []), ("modules", ["serve.fuse_launches=false"])])
def test_a_quantized_forward_holds_its_dequantized_weight(method, path, overrides):
    """A quantized model's linears dequantize their weights for a chunk's products (fivefold.quant.linear): the
    largest one's weight and chunk (gate/up, fused: 4 MB here, where the 64-token chunk's activations are 2 MB)
    counted on top of the forward's activations, a bound within 20% of what the step holds; without it the plan
    would be less than half the measured peak."""
    from fivefold.quant.gptq import quantize_model
    from fivefold.quant.linear import swap_linears
    cfg = load_config(preset="tiny", overrides=SHAPE + ["serve.max_num_batched_tokens=64",
                                                        "model.ffn_hidden_size=2048", *overrides])
    model = build_model(cfg.model, seed=0)
    swap_linears(model, quantize_model(model, method, group_size=64))
    eng = LLM(model, **vars(cfg.serve)).engine
    planned = eng.step_memory
    assert planned.path == path
    assert planned.dequantized == dequantized_gate_up(method)
    eng.add_request(prompt(64), SamplingParams(max_tokens=1, temperature=0))
    measured = peak_of_step(eng, "forward")
    assert planned.forward >= measured > 0.8 * planned.forward
    assert measured > 2 * (planned.forward - planned.dequantized)
    assert "with a dequantized weight's" in planned.describe()


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_plan_serve_of_a_quantized_directory_is_what_its_engine_holds(method, tmp_path, capsys):
    """`fivefold plan --serve --model DIR` reads a quantized directory without its weights: the stored bytes of
    its quantized linears in place of theirs at full size (what the engine then holds, to the byte), and the
    step with each one's dequantizing (fused q/k/v and gate/up as the engine fuses them): the engine's count."""
    from fivefold.cli import main
    from fivefold.quant.directory import save_quantized
    from fivefold.quant.gptq import quantize_model
    from fivefold.quant.linear import QuantLinear
    from fivefold.serve.plan import QuantizedLinears
    cfg = load_config(preset="tiny", overrides=["model.ffn_hidden_size=512"])
    model = build_model(cfg.model, seed=0)
    save_quantized(tmp_path / method, cfg, model, quantize_model(model, method, group_size=32))
    eng = LLM(tmp_path / method, num_blocks=64).engine
    served = load_config(preset="tiny", overrides=["model.ffn_hidden_size=512", "serve.num_blocks=64"])
    plan = plan_serving(served, device="cpu", quantized=QuantizedLinears.read(tmp_path / method))
    assert plan.step == eng.step_memory and plan.step.dequantized > 0
    held = sum(p.numel() * p.element_size() for p in eng.model.parameters()) + sum(
        t.numel() * t.element_size() for m in eng.model.modules() if type(m) is QuantLinear
        for t in m._buffers.values() if t is not None)
    assert plan.weights == held < plan_serving(served, device="cpu").weights
    assert main(["plan", "--serve", "--model", str(tmp_path / method), "--device", "cpu",
                 "--set", "serve.num_blocks=64"]) == 0
    out = capsys.readouterr().out
    assert f"weights ({method})" in out and "with a dequantized weight's" in out
    for args, message in ((["--set", "parallel.tp=2"], "served with tp=1"), (["--cluster", "h100-sxm"], "memory only"),
                          (["--preset", "tiny", "--set", "model.num_layers=3"], "drop --preset, model.num_layers")):
        assert main(["plan", "--serve", "--model", str(tmp_path / method), "--set", "serve.num_blocks=64", *args]) == 2
        assert message in capsys.readouterr().err
    assert main(["plan", "--model", str(tmp_path / method)]) == 2
    assert "add --serve" in capsys.readouterr().err


MOE = ["model.num_experts=8", "model.experts_per_token=2", "model.moe_ffn_hidden_size=512"]


@pytest.mark.parametrize("overrides", [
    [],  # the experts as grouped products
    ["model.moe_grouped_mm=false"],  # one expert at a time: the outputs so far held beside it
    ["model.moe_grouped_mm=false", "model.moe_ffn_hidden_size=64", "model.experts_per_token=3"],  # then joined
    ["model.moe_ffn_hidden_size=98"],  # rows of 392 bytes: F.grouped_mm cannot run them, the loop does
    ["model.moe_ffn_hidden_size=128", "model.shared_expert_size=2048"],  # the shared expert's MLP after them
])
def test_a_mixture_of_experts_forward_at_its_worst_routing(overrides):
    """A mixture of experts' block at the token budget (moe_bytes_per_token): the routed copies, the experts'
    products, the router's logits and the routing's index vectors, as planned. With a zero router every token
    goes to the same experts, the worst a loop over experts meets: the plan is its bound, to the routing's
    bytes."""
    cfg, eng = engine(*MOE, *overrides)
    [mod.router.weight.data.zero_() for mod in eng.model.modules() if hasattr(mod, "router")]
    planned = step_memory(cfg, "cpu", eng)
    eng.add_request(prompt(1000), SamplingParams(max_tokens=1, temperature=0))
    measured = peak_of_step(eng, "forward")  # the first chunk: 512 tokens, no context
    assert planned.path == "modules" and planned.mlp >= measured and planned.mlp == pytest.approx(measured, rel=0.002)


def test_forward_attention_over_a_long_context():
    """A narrow model with a long context: the last chunk's mask over its earlier tokens and their gathered
    keys and values outweigh its MLP, as planned (the chunk is one token short of the budget)."""
    cfg, eng = engine("model.ffn_hidden_size=64", "model.hidden_size=64", "model.head_dim=16", "serve.block_size=16")
    planned = step_memory(cfg, "cpu", eng)
    mlp = 512 * (4 * 64 + 2 * 64 + 3 * 16) * 4
    assert planned.forward > 2 * mlp  # the attention's bound is the one that counts here
    eng.add_request(prompt(2047), SamplingParams(max_tokens=1, temperature=0))
    for _ in range(3):
        eng.step()
    measured = peak_of_step(eng, "forward")  # the last chunk: 511 tokens at 2,047
    assert planned.forward >= measured and planned.forward == pytest.approx(measured, rel=0.02)


def test_sampling_at_max_num_seqs_rows():
    """Every row drawn with top-p and penalised, asking for logprobs: the sampler's working set, as planned."""
    cfg, eng = engine()
    planned = step_memory(cfg, "cpu", eng)
    params = SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9, logprobs=2, repetition_penalty=1.2,
                            ignore_eos=True)
    for i in range(16):
        eng.add_request(prompt(8, seed=i), params)
    eng.step()
    measured = peak_of_step(eng, "sampling")  # a decode step of 16 rows
    assert planned.sampling >= measured and planned.sampling == pytest.approx(measured, rel=0.02)


def test_sampling_draws_a_few_rows_at_a_time(monkeypatch):
    """Past DRAW_BUDGET a draw's working set is taken draw_rows() rows at a time: the step's peak holds the
    working set of those rows only, as planned (4 of 16 rows here)."""
    from fivefold.serve import sampling
    cfg = load_config(preset="tiny", overrides=SHAPE)
    whole = step_memory(cfg, "cpu").sampling
    v = cfg.model.vocab_size
    monkeypatch.setattr(sampling, "DRAW_BUDGET", 4 * v * sampling.DRAW_BYTES)
    assert sampling.draw_rows(v) == 4
    cfg, eng = engine()
    planned = step_memory(cfg, "cpu", eng)
    assert whole - planned.sampling == 12 * v * sampling.DRAW_BYTES
    params = SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9, logprobs=2, repetition_penalty=1.2,
                            ignore_eos=True)
    for i in range(16):
        eng.add_request(prompt(8, seed=i), params)
    eng.step()
    measured = peak_of_step(eng, "sampling")
    assert planned.sampling >= measured and planned.sampling == pytest.approx(measured, rel=0.02)


def test_scoring_is_bounded_by_max_scored_tokens():
    """Prompts of 1,000 and 300 tokens scored under serve.max_scored_tokens=200 beside 14 decoding requests:
    no step scores more than 200 rows, every prompt token is scored once, and the largest step holds what the
    plan's scoring bound counts (200 scored rows and up to max_num_seqs sampled)."""
    cfg, eng = engine("serve.max_scored_tokens=200", "serve.max_num_batched_tokens=216")  # steps fill their budget
    planned = step_memory(cfg, "cpu", eng)
    ids = prompt(1000)
    for i in range(14):  # decoding beside it: the step's sampled rows, most of max_num_seqs
        eng.add_request(prompt(4, seed=2 + i), SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    eng.add_request(ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
    eng.add_request(prompt(300, seed=1), SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0))
    prepare, scored = eng.batch.prepare, []

    def counted(work):
        step = prepare(work)
        scored.append(0 if step.scored_targets is None else len(step.scored_targets))
        return step

    eng.batch.prepare = counted
    peaks = []
    while eng.has_unfinished():
        with measured_phases(eng) as phases:  # the LM head's moment ends the forward, then the scorer's
            eng.step()
        peaks.append(max(phases["forward"], phases["scoring"]))
    assert max(scored) == 200 and sum(scored) == 999 + 299
    assert planned.scoring >= max(peaks) and planned.scoring == pytest.approx(max(peaks), rel=0.02)


def test_no_scoring_when_max_scored_tokens_is_zero():
    cfg, eng = engine("serve.max_scored_tokens=0")
    assert step_memory(cfg, "cpu", eng).scoring == 0
    with pytest.raises(RequestError, match=r"serve.max_scored_tokens=0"):
        eng.add_request(prompt(10), SamplingParams(max_tokens=1, prompt_logprobs=0))


TRITON_STEP = """
import sys
sys.path.insert(0, "tests")
from test_serve_step_memory import engine, peak_of_step, prompt, step_memory
from fivefold.serve import SamplingParams
cfg, eng = engine("serve.kernels=triton", "serve.max_num_batched_tokens=128")
eng.add_request(prompt(300), SamplingParams(max_tokens=1, temperature=0))
print(peak_of_step(eng, "forward"), step_memory(cfg, "cuda", eng).mlp)
"""


TRITON_MOE_STEP = """
import sys
sys.path.insert(0, "tests")
from test_serve_step_memory import MOE, engine, peak_of_step, prompt
from fivefold.serve import SamplingParams
cfg, eng = engine("serve.kernels=triton", "serve.max_num_batched_tokens=128", *MOE)
[mod.router.weight.data.zero_() for mod in eng.model.modules() if hasattr(mod, "router")]
eng.add_request(prompt(300), SamplingParams(max_tokens=1, temperature=0))
assert eng.step_memory.path == "triton"  # the engine's own count: on the CPU, its experts run grouped in fp32
print(peak_of_step(eng, "forward"), eng.step_memory.mlp)
"""


TRITON_QUANTIZED_STEP = """
import sys
sys.path.insert(0, "tests")
from test_serve_step_memory import SHAPE, peak_of_step, prompt
from fivefold.config_load import load_config
from fivefold.model import build_model
from fivefold.quant.gptq import quantize_model
from fivefold.quant.linear import swap_linears
from fivefold.serve import LLM, SamplingParams
cfg = load_config(preset="tiny", overrides=SHAPE + ["serve.max_num_batched_tokens=64", "model.ffn_hidden_size=2048",
                                                    "serve.kernels=triton"])
model = build_model(cfg.model, seed=0)
swap_linears(model, quantize_model(model, "{method}", group_size=64))
eng = LLM(model, **vars(cfg.serve)).engine
assert eng.step_memory.path == "triton" and type(eng.model.layers[0].mlp).__name__ == "FusedQuantTritonMLP"
assert eng.step_memory.dequantized == {dequantized}
eng.add_request(prompt(64), SamplingParams(max_tokens=1, temperature=0))
print(peak_of_step(eng, "forward"), eng.step_memory.forward)
"""


def interpreted(script: str) -> tuple[int, int]:
    """(measured, planned) that `script` prints last, run in Triton's interpreter in a process of its own."""
    pytest.importorskip("triton")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).parent.parent, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    measured, planned = map(int, run.stdout.split()[-2:])
    return measured, planned


def test_a_mixture_of_experts_forward_on_the_triton_path():
    """A mixture of experts on the Triton path (its interpreter on the CPU): the grouped experts with the SwiGLU
    kernel's one output, beside the Triton path's streams, as planned."""
    measured, planned = interpreted(TRITON_MOE_STEP)
    assert planned >= measured and planned == pytest.approx(measured, rel=0.005)


def test_forward_on_the_triton_path():
    """The Triton path (here in Triton's interpreter on the CPU): the fused norms' streams and the SwiGLU
    kernel's output, as planned for CUDA."""
    measured, planned = interpreted(TRITON_STEP)
    assert planned >= measured and planned == pytest.approx(measured, rel=0.02)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_a_quantized_forward_on_the_triton_path(method):
    """The Triton MLP fuses a quantized gate/up as the torch path does, so the step holds the fused weight
    dequantized, as planned (the same bound as on the torch path)."""
    script = TRITON_QUANTIZED_STEP.format(method=method, dequantized=dequantized_gate_up(method))
    measured, planned = interpreted(script)
    assert planned >= measured > 0.8 * planned


def test_a_pool_that_leaves_no_room_for_a_step_is_refused(monkeypatch):
    """serve.kv_memory as a fraction of what is free: a pool that leaves less than the step's working set is
    refused at start-up with the fraction that fits, which then starts."""
    import fivefold.serve.engine as engine_module

    cfg = load_config(preset="tiny", overrides=[s for s in SHAPE if not s.startswith("serve.num_blocks")]
                      + ["serve.kv_memory=0.99"])
    monkeypatch.setattr(engine_module, "available_memory", lambda device: 32 * 2**20)
    model = build_model(cfg.model, seed=0)
    with pytest.raises(ConfigError, match=r"the KV pool \(33.21 MB, serve.kv_memory=0.99\) leaves 344.06 kB of the "
                                          r"33.55 MB free, and a step needs up to 18.91 MB \(the forward 8.50 MB, "
                                          r"sampling 4.89 MB, scoring 18.91 MB\): lower serve.kv_memory "
                                          r"\(below 0.436 of free memory\)"):
        LLM(model, **vars(cfg.serve))
    cfg.serve.kv_memory = 0.4
    assert LLM(model, **vars(cfg.serve)).engine.plan.bytes <= 0.4 * 32 * 2**20


def test_the_room_left_must_hold_the_cuda_graphs_too():
    """On CUDA the decode graphs' pool is captured after the KV pool: what the pool leaves must hold it beside
    the step (the check's arithmetic; no GPU here)."""
    from types import SimpleNamespace

    from fivefold.serve.engine import Engine
    from fivefold.serve.step_memory import StepMemory

    fake = SimpleNamespace(step_memory=StepMemory("triton", mlp=100, attention=0, mask=0, sampling=300, scoring=200),
                           plan=SimpleNamespace(bytes=1000), cfg=SimpleNamespace(kv_memory=0.9))
    Engine._check_room(fake, free=1300)  # 300 left: the step fits
    Engine._check_room(fake, free=1350, graphs=50)
    with pytest.raises(ConfigError, match=r"leaves 300 B of the 1.30 kB free, and a step needs up to 300 B .* "
                                          r"beside 50 B of CUDA graphs: lower serve.kv_memory \(below 0.731 .*"
                                          r"\(or serve.cuda_graphs=false\)"):
        Engine._check_room(fake, free=1300, graphs=50)
