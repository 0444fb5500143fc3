"""Fused projections in training (fivefold.train.fused_projections): q/k/v and gate/up as one GEMM each.

The fused product's forward and backward equal the separate linears' in float64; a model trains to the same
losses, gradient norms and weights fused as separate, in one process and under tensor, sequence, data (ZeRO-3),
pipeline and context parallelism; parameter names and checkpoints are unchanged; a part that is not a plain
linear (LoRA-wrapped, quantized, hooked) runs the separate products; the config says where it applies and
refuses what it cannot do. Compiled layouts with fused projections: tests/test_compile.py. The memory plan
with them: tests/test_memory_measured.py.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fivefold.config import ConfigError
from fivefold.config_load import config_from_dict, load_config
from fivefold.model import Transformer
from fivefold.model.context import ForwardContext
from fivefold.train.fused_projections import (FusedLinear, FusedProjectionAttention, apply_fused_projections,
                                              fused_product, unfuse_projections)
from fivefold.train.trainer import Trainer
from parity import BASE, assert_parity, launch_layouts

HEADS = {"model.num_heads": 8, "model.num_kv_heads": 4}
GLOBAL = 8


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("frozen", [(), (1,)])
def test_the_fused_product_is_the_separate_linears_in_float64(bias, frozen):
    """Outputs, and the gradients of the input, every trained weight and bias, against F.linear per part:
    within 1e-12 in float64 (the reductions' order differs). A frozen part gets no gradient. gradcheck passes."""
    torch.manual_seed(0)
    rows = [12, 4, 4]
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    weights = [torch.randn(r, 8, dtype=torch.float64, requires_grad=i not in frozen) for i, r in enumerate(rows)]
    biases = [torch.randn(r, dtype=torch.float64, requires_grad=i not in frozen) for i, r in enumerate(rows)] if bias else []
    fused = FusedLinear.apply(x, 3, *weights, *biases)
    separate = torch.cat([F.linear(x, w, b) for w, b in zip(weights, biases or [None] * 3)], dim=-1)
    torch.testing.assert_close(fused, separate, rtol=1e-12, atol=1e-12)
    upstream = torch.randn_like(fused)
    leaves = [x, *weights, *biases]
    ours = torch.autograd.grad(fused, [t for t in leaves if t.requires_grad], upstream)
    theirs = torch.autograd.grad(separate, [t for t in leaves if t.requires_grad], upstream)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x, *t: FusedLinear.apply(x, 3, *t), (x, *weights, *biases))


def _tiny_model(**model) -> Transformer:
    cfg = load_config(preset="tiny", overrides=[f"model.{k}={v}" for k, v in model.items()]).model
    torch.manual_seed(0)
    model = Transformer(cfg)
    for p in model.parameters():
        nn.init.normal_(p, std=0.2)
    return model


def test_a_fused_model_has_the_same_parameters_outputs_and_gradients():
    """fp32, q/k/v and gate/up fused: the same parameter names and state_dict keys; logits and every
    parameter's gradient equal the separate model's to fp32 rounding; the fused weight is not kept for
    backward (only the input and the parts are saved); unfusing restores the classes."""
    plain, fused = _tiny_model(), _tiny_model()
    assert apply_fused_projections(fused) == 2 * len(fused.layers)
    assert list(fused.state_dict()) == list(plain.state_dict())
    assert type(fused.layers[0].attn) is FusedProjectionAttention
    ids = torch.randint(0, plain.cfg.vocab_size, (2, 16))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fused(ids)
    # the concatenated weights are made again in backward: every saved weight-shaped tensor is a parameter
    params = {p.data_ptr() for p in fused.parameters()}
    widths = {plain.cfg.q_size + 2 * plain.cfg.kv_size, 2 * plain.cfg.ffn_hidden_size}
    made = [t for t in saved if t.dim() == 2 and t.shape[0] in widths and t.shape[1] == plain.cfg.hidden_size]
    assert made and all(t.data_ptr() in params for t in made)
    ref = plain(ids)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    out.square().mean().backward()
    ref.square().mean().backward()
    for (name, a), (_, b) in zip(fused.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert unfuse_projections(fused) == 2 * len(fused.layers)
    assert type(fused.layers[0].attn).__name__ == "Attention" and type(fused.layers[0].mlp).__name__ == "MLP"


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))]


@pytest.mark.parametrize("device", DEVICES)
def test_a_compiled_bf16_fused_block_has_the_separate_gradients_and_keeps_no_fused_weight(device):
    """bf16 weights (bf16-mixed's compute copy), the block compiled: the input's and every weight's gradient
    equal the eager separate block's to bf16 rounding, and the compiled graph saves for backward no weight-
    sized tensor of the fused widths that is not a parameter (its partitioner could keep forward's
    concatenation across the forward). Inductor's CPU code once produced NaN for the input gradient here."""
    model = _tiny_model().to(device, torch.bfloat16)
    plain, fused = model.layers[0], _tiny_model().to(device, torch.bfloat16).layers[0]
    apply_fused_projections(fused)
    compiled = torch.compile(fused)
    ids = torch.zeros(3, 20, dtype=torch.long, device=device)  # 60 tokens: no fused width
    rope, mask = model.context(ids, model.positions(ids, ForwardContext()), ForwardContext(), torch.bfloat16)
    x = torch.randn(3, 20, model.cfg.hidden_size, device=device, dtype=torch.bfloat16)
    grads, saved = [], []
    for block, run in ((plain, plain), (fused, compiled)):
        xi, saved = x.clone().requires_grad_(), []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = run(xi, rope, mask)
        out.float().square().mean().backward()
        grads.append([xi.grad] + [p.grad for p in block.parameters()])
    for a, b in zip(*grads):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(b.float(), a.float(), rtol=2e-2, atol=1e-2 * a.float().abs().max().item())
    cfg = model.cfg
    widths = {cfg.q_size + 2 * cfg.kv_size, 2 * cfg.ffn_hidden_size}
    params = {p.data_ptr() for p in fused.parameters()}
    assert saved and not [t.shape for t in saved if t.dim() == 2 and t.shape[0] in widths and t.data_ptr() not in params]


def test_serving_fuses_a_model_that_trained_fused():
    """The engine's own fusion (parameters as views of one weight, fivefold.serve.fused) takes a model whose
    training fused its projections: the same logits."""
    from fivefold.serve.fused import FusedAttention, fuse_projections

    model, ref = _tiny_model(), _tiny_model()
    apply_fused_projections(model)
    with torch.no_grad():
        assert fuse_projections(model) == 2 * len(model.layers)
        assert type(model.layers[0].attn) is FusedAttention
        ids = torch.randint(0, ref.cfg.vocab_size, (1, 8))
        torch.testing.assert_close(model(ids), ref(ids))


def test_parts_that_are_not_plain_linears_run_separately():
    """A hooked, replaced (QLoRA-style forward) or wrapped part: fused_product declines and the module runs
    its separate products, with the same outputs; mixed biases decline too."""
    model = _tiny_model()
    apply_fused_projections(model)
    attn = model.layers[0].attn
    x = torch.randn(2, 4, model.cfg.hidden_size)
    parts = [attn.q_proj, attn.k_proj, attn.v_proj]
    assert fused_product(x, parts) is not None
    calls = []
    handle = attn.k_proj.register_forward_hook(lambda *args: calls.append(1))
    assert fused_product(x, parts) is None
    attn.project(x)
    assert calls == [1]  # the hook ran: the separate path
    handle.remove()
    attn.v_proj.forward = lambda t: F.linear(t, attn.v_proj.weight)
    assert fused_product(x, parts) is None
    del attn.v_proj.forward
    wrapped = nn.Sequential(attn.q_proj)
    assert fused_product(x, [wrapped, attn.k_proj, attn.v_proj]) is None
    attn.q_proj.bias = nn.Parameter(torch.zeros(attn.q_proj.out_features))
    assert fused_product(x, parts) is None  # a bias on some parts only
    for name in ("k_proj", "v_proj"):
        getattr(attn, name).bias = nn.Parameter(torch.randn(getattr(attn, name).out_features))
    q, k, v = attn.project(x)  # all biased: fused again, the biases added per part
    torch.testing.assert_close(k, attn.k_proj(x))
    torch.testing.assert_close(v, attn.v_proj(x))


def test_the_config_says_where_fused_projections_run():
    def fused(*overrides, device="cuda"):
        return load_config(preset="tiny", overrides=list(overrides)).fused_projections(device)

    assert fused() == (True, False)  # auto: q/k/v on CUDA
    assert fused(device="cpu") == (False, False)
    assert fused("train.fused_projections=true", device="cpu") == (True, True)
    assert fused("train.fused_projections=false") == (False, False)
    assert fused("train.fused_projections=true", "lora.r=4", "lora.targets=q,v") == (False, True)
    assert fused("train.fused_projections=true", "train.precision=fp8") == (False, False)  # float8 linears
    assert fused("train.fused_projections=true", "train.recompute=full") == (True, True)
    assert fused("train.recompute=ops") == (False, False)  # auto leaves ops' policy its parts
    moe = load_config(preset="tiny-moe", overrides=["train.fused_projections=true"])
    assert moe.fused_projections("cuda") == (True, False)
    with pytest.raises(ConfigError, match="train.fused_projections=true does not combine with train.recompute=ops"):
        load_config(preset="tiny", overrides=["train.fused_projections=true", "train.recompute=ops"])


def _config(cache, out, **overrides) -> dict:
    values = {**BASE, **HEADS, "data.cache_dir": cache, "train.out_dir": str(out), **overrides}
    dp, accum = values.get("parallel.dp", 1), values.get("train.grad_accum", 1)
    values["train.micro_batch_size"] = GLOBAL // (dp * accum)
    return load_config(preset="tiny", overrides=[f"{k}={v}" for k, v in values.items()]).to_dict()


LAYOUTS = {  # on 4 processes, fused, against one separate process
    "tp2_sp_dp2_zero3": {"parallel.tp": 2, "parallel.sequence_parallel": True, "parallel.dp": 2, "parallel.zero": 3},
    "pp2_tp2_1f1b": {"parallel.pp": 2, "parallel.tp": 2, "train.grad_accum": 2},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    root = tmp_path_factory.mktemp("fused")
    for name, fused in (("separate", "false"), ("fused", "true")):
        Trainer(config_from_dict(_config(data_cache, root / name, **{"train.fused_projections": fused})),
                quiet=True).fit()
    todo = [{"config": _config(data_cache, root / name, **{"train.fused_projections": "true", **layout})}
            for name, layout in LAYOUTS.items()]
    launch_layouts(4, todo, root / "fused.json")
    return root


@pytest.mark.parametrize("name", ["fused", *LAYOUTS])
def test_fused_training_matches_one_separate_process(runs, name):
    """Every step's loss and gradient norm, and the final weights (read back by their unchanged names)."""
    assert_parity(runs / name, runs / "separate")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_compiled_fused_projections_train_as_separate(data_cache, tmp_path):
    """On a GPU, bf16-mixed with compiled blocks (CUDA's defaults): two steps fused (q/k/v and gate/up) give
    the separate run's losses and gradient norms to bf16's rounding (cuBLAS picks other kernels for the wider
    products, so not bit for bit; two steps, before the tiny model's third-step gradient spike, parity.py)."""
    from fivefold.train.compare import read_metric

    runs = {}
    for fused in ("false", "true"):
        cfg = _config(data_cache, tmp_path / fused, **{"train.fused_projections": fused, "train.device": "cuda",
                                                      "train.precision": "bf16-mixed", "train.compile": "true",
                                                      "train.steps": 2, "train.save_every": 0})
        Trainer(config_from_dict(cfg), quiet=True).fit()
        runs[fused] = tmp_path / fused
    for key in ("loss", "grad_norm"):
        ours, ref = read_metric(runs["true"], key), read_metric(runs["false"], key)
        assert len(ours) == 2 and all(ours[s] == pytest.approx(ref[s], rel=2e-2) for s in ref), (key, ours, ref)
