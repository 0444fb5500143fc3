"""The analytical planner: parameter inventory vs the built model, the classic bytes-per-parameter
numbers, Korthikanti et al.'s activation formula, parallel divisions, scaling laws, and the CLI."""

import dataclasses
import json
import random

import pytest

from fivefold.cli import main
from fivefold.config import Config, ParallelConfig
from fivefold.config_load import load_config
from fivefold.memory import formulas
from fivefold.memory.activations import replay_forward
from fivefold.memory.plan import activation_shapes, plan_memory
from fivefold.memory.replay import Shapes
from fivefold.memory.units import parse_bytes
from fivefold.presets import PRESETS, REAL_PARAM_COUNTS
from fivefold.model import meta_model
from model_shapes import random_model_config

GB = 1e9


# -- parameters ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(PRESETS))
def test_parameter_inventory_equals_built_model(name):
    cfg = PRESETS[name]
    model = meta_model(cfg)
    built = [(n, p.numel()) for n, p in model.named_parameters()]
    assert formulas.parameter_shapes(cfg) == built
    plan = plan_memory(Config(model=cfg), device="cpu")
    assert plan.params == sum(n for _, n in built) == plan.params_per_rank
    if cfg.num_experts:  # only the router, the shared expert and k of the experts touch a token
        expert = 3 * cfg.hidden_size * cfg.expert_size
        unused = cfg.num_layers * (cfg.num_experts - cfg.experts_per_token) * expert
        assert plan.active_params == plan.params - unused
    else:
        assert plan.active_params == plan.params


def test_joined_units_stay_within_the_largest_unit():
    assert formulas.joined_units([10, 3, 3, 3, 1, 10]) == [[0], [1, 2, 3, 4], [5]]
    assert formulas.joined_units([2, 2, 5, 1, 1]) == [[0, 1], [2], [3, 4]]
    assert formulas.joined_units([]) == []


@pytest.mark.parametrize("name", ["smollm2-135m", "llama3.2-1b", "llama3.2-3b", "mixtral-8x7b", "gpt2-xl"])
def test_the_plan_steps_the_units_the_optimizer_steps(name):
    """The plan's joined units are the optimizer's chunks (fivefold.train.optim.step_chunks), decayed and not,
    and none is larger than the largest single unit: joining adds no memory to the step."""
    from fivefold.memory.model_states import inventory as read_inventory
    from fivefold.train.optim import step_chunks

    cfg = PRESETS[name]
    names, numels = zip(*[(n, p.numel()) for n, p in meta_model(cfg).named_parameters()])
    inventory = read_inventory(tuple(formulas.parameter_shapes(cfg)))
    for join, units in ((True, inventory.joined), (False, inventory.units)):
        chunks = step_chunks(list(names), list(numels), join)
        assert [(sum(numels[i] for i in c if not formulas.is_no_decay(names[i])),
                 sum(numels[i] for i in c if formulas.is_no_decay(names[i]))) for c in chunks] == list(units)
        assert sorted(i for c in chunks for i in c) == list(range(len(names)))
    assert max(map(sum, inventory.joined)) == max(map(sum, inventory.units))
    if name == "smollm2-135m":  # 30 blocks of 3.5M parameters, the 28.3M embedding, the final norm
        assert (len(inventory.units), len(inventory.joined)) == (32, 6)


def test_mixtral_8x7b_total_and_active_parameters():
    """46.7B in total (the released checkpoint's count), 12.9B active per token (Mistral AI's figure)."""
    cfg = PRESETS["mixtral-8x7b"]
    assert formulas.count_params(cfg) == REAL_PARAM_COUNTS["mixtral-8x7b"] == 46_702_792_704
    assert formulas.active_params(cfg) == 12_879_925_248
    plan = plan_memory(Config(model=cfg, parallel=ParallelConfig(dp=8, ep=8)), device="cpu")
    expert_bytes = 4 * cfg.num_layers * 7 * 3 * cfg.hidden_size * cfg.expert_size  # 7 of 8 experts elsewhere
    assert plan.memory["parameters"] == 4 * formulas.count_params(cfg) - expert_bytes


def test_parameter_inventory_and_decay_groups_for_random_shapes():
    rng = random.Random(0)
    for _ in range(100):
        cfg = random_model_config(rng)
        model = meta_model(cfg)
        assert formulas.parameter_shapes(cfg) == [(n, p.numel()) for n, p in model.named_parameters()], cfg
        # The one decay rule (optimizer and planner) exempts exactly the vectors and the embeddings.
        assert [formulas.is_no_decay(n) for n, _ in formulas.parameter_shapes(cfg)] == \
            [p.ndim < 2 or n.startswith("embed") for n, p in model.named_parameters()], cfg


def test_pipeline_stages_and_tensor_shards_partition_the_model():
    rng = random.Random(1)
    for _ in range(40):
        cfg = random_model_config(rng)
        total = formulas.count_params(cfg)
        for pp in range(1, cfg.num_layers + 1):
            stages = [formulas.rank_layers(cfg.num_layers, pp, s) for s in range(pp)]
            assert [i for r in stages for i in r] == list(range(cfg.num_layers))
            counts = [sum(n for _, n in formulas.parameter_shapes(cfg, 1, r, s == 0, s == pp - 1))
                      for s, r in enumerate(stages)]
            tied_copy = cfg.vocab_size * cfg.hidden_size if cfg.tie_embeddings and pp > 1 else 0
            assert sum(counts) == total + tied_copy  # Megatron keeps a copy of a tied head on the last stage
        tp = cfg.num_kv_heads
        replicated = sum(n for name, n in formulas.parameter_shapes(cfg)
                         if "norm" in name or "positions" in name or name.endswith(("o_proj.bias", "down_proj.bias")))
        local = sum(n for _, n in formulas.parameter_shapes(dataclasses.replace(cfg, ffn_hidden_size=cfg.ffn_hidden_size
                                                                                * tp), tp))
        wide = sum(n for _, n in formulas.parameter_shapes(dataclasses.replace(cfg, ffn_hidden_size=cfg.ffn_hidden_size
                                                                               * tp)))
        assert tp * (local - replicated) == wide - replicated, cfg


# -- the classic bytes-per-parameter numbers (Rajbhandari et al. 2020) ------------------------------

@pytest.mark.parametrize("billions, gigabytes", [(1, 16), (7, 112), (70, 1120), (405, 6480)])
def test_sixteen_bytes_per_parameter(billions, gigabytes):
    n = int(billions * 1e9)
    assert formulas.model_state_bytes(n, "fp32") == gigabytes * GB
    assert formulas.model_state_bytes(n, "bf16-mixed") == gigabytes * GB
    assert formulas.model_state_bytes(n, "bf16-mixed", fp32_grad_accum=True) == gigabytes * GB * 20 / 16
    # ZeRO's K = 12: fp32 masters + two Adam moments are the optimizer states under mixed precision.
    assert formulas.bytes_per_param("bf16-mixed").optimizer_states == 12


def test_gpt2_xl_model_states_are_24_gb():
    assert formulas.model_state_bytes(int(1.5e9), "bf16-mixed") == 24 * GB  # ZeRO paper, section 3.1
    cfg = load_config(preset="gpt2-xl", overrides=["train.precision=bf16-mixed"])
    m = plan_memory(cfg).memory
    states = m["parameters"] + m["gradients"] + m["optimizer_states"]
    assert states == 16 * formulas.count_params(cfg.model)
    assert states == pytest.approx(24 * GB, rel=0.04)  # 1.56e9 real parameters


@pytest.mark.parametrize("precision, accum", [("fp32", False), ("bf16-mixed", False), ("bf16-mixed", True)])
def test_plan_model_states_per_rank_with_zero(precision, accum):
    cfg = load_config(preset="llama3-8b", overrides=[f"train.precision={precision}", f"train.fp32_grad_accum={accum}",
                                                     "parallel.dp=8"])
    n = formulas.count_params(cfg.model)
    largest = cfg.model.vocab_size * cfg.model.hidden_size
    bpp = formulas.bytes_per_param(precision, accum)
    plans = {}
    for zero in range(4):
        cfg.parallel.zero = zero
        plans[zero] = plan_memory(cfg).memory
    shard = -(-n // 8)
    assert plans[0]["parameters"] == bpp.parameters * n and plans[0]["optimizer_states"] == bpp.optimizer_states * n
    assert plans[1]["optimizer_states"] == bpp.optimizer_states * shard
    assert plans[2]["parameters"] == bpp.parameters * n and plans[3]["parameters"] == bpp.parameters * shard
    # Gradients: reduced in fp32, and the optimizer reads the fp32 result (fivefold.parallel).
    if accum:  # fp32 accumulation buffers stay beside the reduced gradients (full, or ZeRO-1's shard)
        assert plans[0]["gradients"] == 4 * n + 4 * n and plans[1]["gradients"] == 4 * n + 4 * shard
    else:
        assert plans[0]["gradients"] == 4 * n and plans[1]["gradients"] == max(bpp.gradients * n, 4 * shard)
    # ZeRO-2/3: fp32 shards plus the full gradients of the bucket / gather unit being filled; llama3-8b's
    # largest unit is the root: embedding + final norm + untied head.
    bucket = 25 * 2**20 // 4
    assert 4 * shard + bpp.gradients * largest <= plans[2]["gradients"] <= 4 * shard + bpp.gradients * (largest + bucket)
    assert plans[3]["gradients"] == 4 * shard + bpp.gradients * (2 * largest + cfg.model.hidden_size)
    assert plans[3]["activations"] == plans[0]["activations"]


# -- activations: Korthikanti et al. 2022 ------------------------------------------------------------

def gpt_layer(b=2, s=64, h=64, a=4, p=2, tp=1, sp=False, sdpa=False) -> Shapes:
    """A 16-bit GPT-3-style layer: LayerNorm, GELU, f = 4h, multi-head attention, learned positions."""
    return Shapes(b=b, s=s, sk=s, h=h, q=h // tp, kv=h // tp, heads=a // tp, f=4 * h // tp, vocab=128, head_size=h // a,
                  p=p, rep=1 / tp if sp else 1.0, rms=False, swiglu=False, sdpa=sdpa, rope=False, groups=1)


def per_layer(d: Shapes, recompute="none") -> float:
    return (replay_forward(d, 2, recompute, embed=False, head=False).saved_bytes
            - replay_forward(d, 1, recompute, embed=False, head=False).saved_bytes)


@pytest.mark.parametrize("b, s, h, a", [(2, 64, 64, 4), (1, 256, 128, 8), (4, 32, 96, 3)])
def test_gpt_layer_reproduces_korthikanti(b, s, h, a):
    """Korthikanti et al. 2022, eq. 1: 34sbh + 5as^2b bytes per layer with dropout. Without dropout the
    same inventory loses its two sbh dropout masks and the as^2b attention-dropout mask + 2as^2b output:
    32sbh + 2as^2b. fivefold's softmax runs in fp32 and keeps its output beside the bf16 copy (+4as^2b),
    its masked_fill saves the s^2 boolean causal mask, and each LayerNorm saves mean and rstd (2 x 2bs)."""
    sbh, as2b = s * b * h, a * s * s * b
    paper_without_dropout = (34 - 2) * sbh + (5 - 3) * as2b
    assert per_layer(gpt_layer(b, s, h, a)) == paper_without_dropout + 4 * as2b + s * s + 2 * 2 * 2 * b * s
    # Selective recomputation drops exactly the s^2 terms (section 4.2: "34sbh" with dropout).
    assert per_layer(gpt_layer(b, s, h, a), "selective") == (34 - 2) * sbh + 2 * 2 * 2 * b * s
    # Flash-style SDPA never stores scores: only the 4-byte logsumexp per row and head remains.
    assert per_layer(gpt_layer(b, s, h, a, sdpa=True)) == (34 - 2) * sbh + 2 * 2 * 2 * b * s + 4 * a * s * b
    # Full recomputation keeps each layer's input: 2sbh (section 4.1).
    assert per_layer(gpt_layer(b, s, h, a), "full") == 2 * sbh


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_and_sequence_parallel_divisions(tp):
    """Korthikanti et al. 2022, eq. 2 and 4: with t-way TP the attention and MLP internals divide by t
    and the LayerNorm inputs / linear inputs do not (10sbh + 24sbh/t with dropout); sequence
    parallelism divides those too (34sbh/t)."""
    s, b, h, a = 64, 2, 64, 4
    sbh, as2b = s * b * h, a * s * s * b
    stats = 2 * 2 * 2 * b * s
    assert per_layer(gpt_layer(tp=tp)) == 8 * sbh + 24 * sbh / tp + 6 * as2b / tp + s * s + stats
    assert per_layer(gpt_layer(tp=tp, sp=True)) == pytest.approx((32 * sbh + 6 * as2b + stats) / tp + s * s)


def test_activations_linear_in_batch_quadratic_in_seq_only_when_scores_are_stored():
    def act(attention, **train):
        cfg = load_config(preset="llama3-8b", overrides=["train.precision=bf16-mixed", f"model.attention={attention}",
                                                         *[f"train.{k}={v}" for k, v in train.items()]])
        return plan_memory(cfg, suggest=False).memory["activations"]

    for attention in ("eager", "sdpa"):
        a1, a2, a4 = (act(attention, micro_batch_size=b, seq_len=1024) for b in (1, 2, 4))
        assert a4 - a2 == pytest.approx(2 * (a2 - a1), rel=1e-9)  # affine in b: linear growth
    s1, s2, s4 = (act("sdpa", seq_len=s) for s in (1024, 2048, 4096))
    assert s4 - s2 == pytest.approx(2 * (s2 - s1), rel=1e-9)  # flash: linear in s
    e1, e2, e4 = (act("eager", seq_len=s) for s in (2048, 4096, 8192))
    # eager: f(s) = c2 s^2 + c1 s + c0, so the increments grow 4x as s doubles once c2 s dominates
    assert (e4 - e2) / (e2 - e1) > 3.5
    assert e4 / s4 > 4


# -- pipeline schedules ------------------------------------------------------------------------------

def test_micro_batches_in_flight():
    assert formulas.micro_batches_in_flight("afab", 4, 0, 8) == 8
    assert [formulas.micro_batches_in_flight("1f1b", 4, s, 8) for s in range(4)] == [4, 3, 2, 1]
    assert formulas.micro_batches_in_flight("1f1b", 4, 0, 2) == 2
    assert formulas.micro_batches_in_flight("zero-bubble", 4, 0, 8) == 4
    for p, v in [(4, 2), (8, 4), (2, 3)]:  # Korthikanti et al. 2022, section 4.2.3: p (1 + (p-1)/(p v))
        inter = formulas.micro_batches_in_flight("interleaved", p, 0, 64, v)
        assert inter == pytest.approx(p * (1 + (p - 1) / (p * v)))


def test_pipeline_plan_most_loaded_stage():
    # Eager blocks: compiled ones save less, and the last stage's LM head then outweighs half of stage 0.
    cfg = load_config(preset="llama3-8b", overrides=["train.precision=bf16-mixed", "parallel.pp=4",
                                                     "train.grad_accum=8", "train.seq_len=4096",
                                                     "train.compile=false"])
    plan = plan_memory(cfg)
    first, last = plan.stages[0], plan.stages[-1]
    assert first.in_flight == 4 and last.in_flight == 1
    assert first.layers == last.layers == 8
    # Stage 0 holds 4 micro-batches of its 8 layers: as much as all 32 layers (no LM head) for one.
    whole_stack = replay_forward(activation_shapes(cfg), 32, head=False).peak
    assert first.memory["activations"] == pytest.approx(whole_stack, rel=0.01)
    assert last.memory["activations"] < first.memory["activations"] / 2
    assert plan.memory is plan.stages[plan.stage].memory
    assert plan.memory["total"] == max(s.memory["total"] for s in plan.stages)


# -- output ------------------------------------------------------------------------------------------

def test_parse_bytes():
    assert parse_bytes("80GB") == 80 * 10**9 and parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("512MiB") == 512 * 2**20 and parse_bytes("24e9") == 24 * 10**9


def test_plan_json_and_fit_suggestions(capsys):
    args = ["plan", "--preset", "llama3-8b", "--set", "train.precision=bf16-mixed", "--set", "train.seq_len=8192",
            "--set", "train.micro_batch_size=1", "--device-memory", "80GB"]
    assert main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params"] == out["active_params"] == 8_030_261_248
    mem = out["memory"]
    assert set(mem) >= {"parameters", "gradients", "optimizer_states", "activations", "total"}
    assert mem["optimizer_states"] == 12 * out["params"] and out["fits"] is False
    assert mem["total"] >= mem["parameters"] + mem["optimizer_states"] + mem["activations"]
    assert out["suggestions"]
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "DOES NOT FIT" in table and "optimizer states" in table and "%" in table
    # Every suggested single change really fits.
    cfg = load_config(preset="llama3-8b", overrides=args[4:10:2])
    from fivefold.memory.plan import _candidates, with_changes
    fitting = [t for t, ch in _candidates(cfg)
               if plan_memory(with_changes(cfg, ch), suggest=False).memory["total"] <= 80e9]
    assert [s.rsplit(":", 1)[0] for s in out["suggestions"]] == fitting[:6]


def test_sweep_cli_writes_png(tmp_path, capsys):
    png = tmp_path / "sweep.png"
    assert main(["plan", "--preset", "llama3-8b", "--set", "train.precision=bf16-mixed", "--set",
                 "train.micro_batch_size=1", "--sweep", "seq", "--values", "1024,2048,4096,8192",
                 "--png", str(png), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert png.stat().st_size > 10_000
    assert out["loglog_slope"]["sdpa"] == pytest.approx(1.0, abs=0.01)
    assert out["loglog_slope"]["eager"] > 1.8


def test_cpu_and_cuda_device_models_differ_only_where_kernels_do():
    cfg = load_config(preset="tiny", overrides=["train.precision=bf16-mixed"])
    assert activation_shapes(cfg, "cpu").sdpa and activation_shapes(cfg, "cuda").sdpa
    cfg.train.precision = "fp32"  # no flash kernel on CUDA in fp32, and the efficient one has no GQA
    assert activation_shapes(cfg, "cpu").sdpa and not activation_shapes(cfg, "cuda").sdpa


def test_communication_per_step_follows_the_collectives():
    """Bytes a rank sends per step (ring algorithms), by dimension, for hand-checkable layouts; the
    tensor-parallel and ring-attention terms are also checked against counted collectives
    (bench/tensor_parallel.py, tests/ring_attention_worker.py)."""
    from fivefold.memory.communication import step_communication

    cfg = load_config(preset="tiny", overrides=["parallel.dp=4", "train.seq_len=64", "train.micro_batch_size=2"])
    n = formulas.count_params(cfg.model)
    assert step_communication(cfg) == {"dp": 2 * 3 / 4 * 4 * n}
    cfg.parallel.zero = 3
    cfg.train.grad_accum = 2
    assert step_communication(cfg)["dp"] == 3 / 4 * (2 * 4 * n + 4 * 4 * n)  # 2 reduce-scatters, 4 gathers
    tp = load_config(preset="tiny", overrides=["parallel.tp=2", "train.seq_len=64", "train.micro_batch_size=2"])
    bsh = 2 * 64 * 64 * 4
    assert step_communication(tp) == {"tp": 2 * 1 / 2 * bsh * (4 * 2 + 2)}  # 4 all-reduces per layer, 2 layers, embedding, head
    tp.parallel.sequence_parallel = True  # each all-reduce a gather + a scatter, plus re-gathers before backward
    assert step_communication(tp) == {"tp": 1 / 2 * bsh * (10 * 2 + 2 + 3)}
    cp = load_config(preset="tiny", overrides=["parallel.cp=2", "train.seq_len=64", "train.micro_batch_size=2"])
    kv = 2 * 2 * 2 * 32 * 16  # K and V: batch 2, 2 kv heads, 32 local tokens, head size 16
    assert step_communication(cp)["cp"] == 2 * (kv * 4 * 2 + kv * 4 * 2)


def test_pipeline_split_of_the_plan_is_the_runtimes():
    """parallel.pp_layers and interleaving change the plan as they change what each rank builds
    (tests/run_layouts.py checks planned == built parameters for every parity layout)."""
    def plan(*extra):
        cfg = load_config(preset="tiny", overrides=["model.num_layers=8", "parallel.pp=2", *extra])
        return plan_memory(cfg, device="cpu", suggest=False)

    even, custom = plan(), plan("parallel.pp_layers=1,7")
    interleaved = plan("parallel.pp_schedule=interleaved", "parallel.pp_virtual_stages=2", "parallel.pp_layers=1,3,2,2",
                       "train.grad_accum=2")
    assert [s.layers for s in even.stages] == [4, 4] and [s.layers for s in custom.stages] == [1, 7]
    assert [s.layers for s in interleaved.stages] == [3, 5]  # rank 0: stages 0 and 2 (1 + 2 layers)
    block = formulas.layer_params(load_config(preset="tiny").model)
    assert custom.stages[1].params - even.stages[1].params == 3 * block
    assert custom.stages[0].params - even.stages[0].params == -3 * block


def test_deep_stacks_extrapolate_exactly():
    """replay_forward extrapolates deep stacks from 2-4 blocks; every figure the planner reads equals
    the block-by-block replay, for every recomputation mode, attention kernel and stage position."""
    from fivefold.memory import activations

    for preset, overrides in (("tiny", []), ("tiny-gpt2", []), ("tiny", ["model.document_mask=true"]),
                              ("tiny", ["model.attention=eager", "parallel.tp=2", "parallel.sequence_parallel=true"]),
                              ("tiny-moe", ["model.shared_expert_size=96", "parallel.dp=2", "parallel.ep=2"])):
        cfg = load_config(preset=preset, overrides=overrides)
        d = activation_shapes(cfg, "cpu")
        for recompute in ("none", "selective", "ops", "full"):
            for embed, head in ((True, True), (False, False), (True, False), (False, True)):
                for layers in (5, 9):
                    fast = activations.replay_forward(d, layers, recompute, embed, head)
                    slow = activations._replay(d, layers, recompute, embed, head)
                    for key in ("peak", "saved_bytes", "live", "backward_peak"):
                        assert getattr(fast, key) == pytest.approx(getattr(slow, key), rel=1e-12), key
                    assert len(fast.blocks) == len(slow.blocks) and len(fast.regions) == len(slow.regions)
                    for a, b in zip(fast.blocks, slow.blocks):
                        assert a == pytest.approx(b)
                    for a, b in zip(fast.regions, slow.regions):
                        assert a[0] == pytest.approx(b[0]) and a[1] == pytest.approx(b[1]) and a[2] == b[2]


@pytest.mark.parametrize("preset, overrides", [
    ("mixtral-8x7b", ["parallel.dp=8", "parallel.ep=8", "parallel.tp=2", "parallel.sequence_parallel=true",
                      "train.recompute=ops"]),
    ("mixtral-8x7b", ["parallel.dp=8", "parallel.ep=4", "parallel.pp=4", "train.grad_accum=8"]),
    ("llama3-8b", ["parallel.tp=4", "parallel.pp=2", "train.grad_accum=4"]),
])
def test_the_total_is_at_most_the_categories(preset, overrides):
    """Without ZeRO-3 (whose gathered blocks belong to no category) every byte of the peak is in one of the
    categories, so their sum bounds it. The gradients a block's backward has made so far are this rank's:
    counted as every expert of the model, a MoE's were 8x too many under ep=8 (Mixtral: 136.9 GB planned
    against 64.3 GB in all the categories)."""
    plan = plan_memory(load_config(preset=preset, overrides=overrides))
    for stage in plan.stages:
        memory = stage.memory
        parts = sum(memory[k] for k in ("parameters", "gradients", "optimizer_states", "activations", "temporary"))
        assert memory["total"] <= parts
