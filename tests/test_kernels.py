"""Triton kernels (fivefold.kernels) against the PyTorch path they replace: RMSNorm, the SwiGLU product
and RoPE, forward and every gradient, then a whole model with them applied. On the CPU through Triton's
interpreter (TRITON_INTERPRET=1), so sizes are small but odd: hidden sizes that are not powers of two,
a tail block, strided inputs."""

import dataclasses
import importlib
import sys

import pytest
from interpreted import rerun_interpreted

# triton.jit chooses compiler or interpreter when a function is decorated, triton's own library included,
# and importing torch._dynamo (as fivefold.model does) imports triton. So the flag must be set before
# triton's first import: here when this file is the first to import it; otherwise (after other test files,
# as in the whole suite) test_in_a_fresh_process reruns this file in a child process started with it.
with pytest.MonkeyPatch.context() as mp:
    if "triton" not in sys.modules:
        mp.setenv("TRITON_INTERPRET", "1")
    triton = pytest.importorskip("triton")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fivefold.kernels as kernels  # noqa: E402
from fivefold.config import ConfigError  # noqa: E402
from fivefold.model import build_model, materialise, meta_model  # noqa: E402
from fivefold.model.layers import RMSNorm  # noqa: E402
from fivefold.model.rope import apply_rope, rope_cos_sin  # noqa: E402
from fivefold.presets import PRESETS  # noqa: E402

INTERPRETED = isinstance(triton.language.sum, InterpretedFunction)
KERNEL_MODULES = ("fivefold.kernels.rmsnorm", "fivefold.kernels.swiglu", "fivefold.kernels.rope")


@pytest.fixture(autouse=True)
def interpreter(request, monkeypatch):
    """Every test but test_in_a_fresh_process runs the kernels in Triton's interpreter, or skips when
    this process imported triton without it. A kernel module imported earlier without the flag is
    imported again (its kernels, too, chose compiler or interpreter when defined)."""
    if request.function is test_in_a_fresh_process:
        return
    if not INTERPRETED:
        pytest.skip("triton was imported without TRITON_INTERPRET=1; test_in_a_fresh_process runs this test")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for name in KERNEL_MODULES:
        module = importlib.import_module(name)
        if any(isinstance(value, JITFunction) for value in vars(module).values()):
            importlib.reload(module)


def run(fn, inputs, grad_out):
    """fn(*inputs) and the gradient of <fn(*inputs), grad_out> w.r.t. each input."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(grad_out)
    return out, [t.grad for t in leaves]


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:  # the same arithmetic up to summation order
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # two bf16 ulps (2**-8 each, 2**-7 where the interpreter truncates), of the element or of the
        # tensor's largest: a gradient summed from rounded terms may cancel far below its terms
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=2**-6 * want.abs().max().item())


def check(kernel, reference, inputs, grad_out):
    """The kernel's output and input gradients against the PyTorch path's, in the same dtype."""
    out, grads = run(kernel, inputs, grad_out)
    ref_out, ref_grads = run(reference, inputs, grad_out)
    assert_close(out, ref_out)
    for grad, ref in zip(grads, ref_grads, strict=True):
        assert_close(grad, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [96, 100])
def test_rmsnorm_matches_torch(dtype, hidden):
    from fivefold.kernels.rmsnorm import rms_norm

    torch.manual_seed(hidden)
    norm = RMSNorm(hidden, eps=1e-5)
    x = torch.randn(3, 5, hidden).to(dtype)  # 15 rows: the backward's 4 programs take 3 or 4 rows each
    weight = (1 + 0.5 * torch.randn(hidden)).to(dtype)
    grad = torch.randn(3, 5, hidden).to(dtype)

    def reference(x, weight):  # the module's own forward, with this weight
        return torch.func.functional_call(norm, {"weight": weight}, (x,))

    check(lambda x, w: rms_norm(x, w, 1e-5), reference, (x, weight), grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_matches_torch(dtype):
    from fivefold.kernels.swiglu import swiglu

    torch.manual_seed(0)
    gate, up, grad = (torch.randn(3, 5, 100).to(dtype) for _ in range(3))  # 1500 values: a partial last block
    check(swiglu, lambda g, u: F.silu(g) * u, (gate, up), grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_reads_the_halves_of_a_fused_product_in_place(dtype):
    """gate and up as serving's fused gate/up product gives them (strided halves of one tensor): the same
    bits as from contiguous copies, and no copy made (the saved inputs are views of the product)."""
    from fivefold.kernels.swiglu import SwiGLUFunction, swiglu

    torch.manual_seed(1)
    product = torch.randn(2, 7, 2 * 1100).to(dtype)  # 1100 columns: two blocks a row, the second partial
    gate, up = product.chunk(2, dim=-1)
    assert not gate.is_contiguous()
    got = swiglu(gate, up)
    assert torch.equal(got, swiglu(gate.contiguous(), up.contiguous()))
    assert_close(got, F.silu(gate) * up)
    with torch.enable_grad():
        leaf = product.clone().requires_grad_()
        out = SwiGLUFunction.apply(*leaf.chunk(2, dim=-1))
        assert all(t.untyped_storage().data_ptr() == leaf.untyped_storage().data_ptr()
                   for t in out.grad_fn.saved_tensors)
        out.backward(torch.ones_like(out))
    want = torch.func.grad(lambda x: (F.silu(x.chunk(2, -1)[0]) * x.chunk(2, -1)[1]).float().sum())(product)
    assert_close(leaf.grad, want.to(dtype))


@pytest.mark.parametrize("shape", [(), (0,), (3, 0), (0, 5), (7,), (2, 3, 5)])
def test_swiglu_takes_every_shape_eager_does(shape):
    """Scalars, empty tensors and 1-D or 3-D ones: the values and gradients of the eager product."""
    from fivefold.kernels.swiglu import swiglu

    torch.manual_seed(0)
    gate, up, grad = (torch.randn(shape) for _ in range(3))
    check(swiglu, lambda g, u: F.silu(g) * u, (gate, up), grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [96, 100])
def test_add_rms_norm_is_the_add_then_the_norm(dtype, hidden):
    """The residual add and the RMSNorm of its result in one kernel: the sum is x + delta, and the
    normalised sum the bits the Triton RMSNorm gives for that sum; with autograd recording, the separate ops.
    The sum is exact in fp32; in bf16 Triton's interpreter truncates the rounding that torch (and Triton on
    a GPU) takes to nearest, so there it is within one bf16 step."""
    from fivefold.kernels.rmsnorm import add_rms_norm, rms_norm

    torch.manual_seed(hidden)
    x, delta = (torch.randn(3, 5, hidden).to(dtype) for _ in range(2))
    weight = (1 + 0.5 * torch.randn(hidden)).to(dtype)
    total, normed = add_rms_norm(x, delta, weight, 1e-5)
    if dtype == torch.float32:
        assert torch.equal(total, x + delta)
    else:
        torch.testing.assert_close(total, x + delta, rtol=2**-7, atol=0)
    assert torch.equal(normed, rms_norm(total, weight, 1e-5))
    assert_close(normed, torch.func.functional_call(RMSNorm(hidden, 1e-5), {"weight": weight}, (x + delta,)))
    with torch.enable_grad():
        leaf = x.clone().requires_grad_()
        total, normed = add_rms_norm(leaf, delta, weight, 1e-5)
        normed.sum().backward()
    assert leaf.grad is not None and torch.equal(total.detach(), x + delta)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim, batch_positions", [(12, False), (10, True)])
def test_rope_matches_torch(dtype, head_dim, batch_positions):
    from fivefold.kernels.rope import apply_rope as rope_triton

    torch.manual_seed(head_dim)
    b, s, h = 2, 5, 3
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    # One set of positions broadcast over the batch (cos/sin (1, 1, S, d)), or each row its own.
    positions = torch.arange(s)[None] + (torch.tensor([[0], [7]]) if batch_positions else 0)
    cos, sin = rope_cos_sin(inv_freq, positions, dtype)
    # As Attention makes q: (B, S, H, d) transposed to (B, H, S, d), not contiguous.
    x = torch.randn(b, s, h, head_dim).to(dtype).transpose(1, 2)
    grad = torch.randn(b, h, s, head_dim).to(dtype)
    check(lambda x: rope_triton(x, cos, sin), lambda x: apply_rope(x, cos, sin), (x,), grad)


# The mixture of experts trimmed to one layer of 4 experts: the interpreter takes ~3 ms per program.
MODELS = {"tiny": PRESETS["tiny"],
          "tiny-moe": dataclasses.replace(PRESETS["tiny-moe"], num_layers=1, num_experts=4)}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_with_kernels_matches_plain_model(name):
    from fivefold.kernels.rmsnorm import TritonRMSNorm
    from fivefold.kernels.rope import apply_rope as rope_triton
    from fivefold.kernels.swiglu import TritonMLP, swiglu

    cfg = MODELS[name]
    plain = build_model(cfg, seed=3)
    fused = meta_model(cfg)  # as fivefold.train.parallelize does: kernels applied before there is memory
    kernels.apply_kernels(fused, "triton")
    materialise(fused, "cpu", seed=3)
    assert [n for n, _ in fused.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert fused.state_dict().keys() == plain.state_dict().keys()
    assert isinstance(fused.norm, TritonRMSNorm) and fused.layers[0].attn.rope_fn is rope_triton
    if cfg.num_experts:  # the stacked experts' product is the fused kernel
        assert all(block.mlp.experts.swiglu_fn is swiglu for block in fused.layers)
    else:
        assert sum(isinstance(m, TritonMLP) for m in fused.modules()) == cfg.num_layers

    ids = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    logits = []
    for model in (plain, fused):
        logits.append(model(ids))
        F.cross_entropy(logits[-1].flatten(0, 1), ids.roll(-1, dims=1).flatten()).backward()
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
    for (param, p), q in zip(fused.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{param}: {m}")


def test_training_with_train_kernels_triton_matches_torch(tiny_config, tmp_path):
    """The config key end to end: parallelize applies the kernels; two steps give the plain run's losses. Also
    with fused projections (train.fused_projections=true), whose SwiGLU reads gate and up in place from one
    product."""
    from fivefold.kernels.rmsnorm import TritonRMSNorm
    from fivefold.train.trainer import Trainer

    runs = {}
    for name in ("torch", "triton", "triton-fused"):
        trainer = Trainer(tiny_config(**{"train.kernels": name.split("-")[0], "train.micro_batch_size": 2,
                                         "train.seq_len": 16, "train.out_dir": str(tmp_path / name),
                                         "train.fused_projections": str(name.endswith("fused")).lower()}),
                          quiet=True)
        assert isinstance(trainer.model.norm, TritonRMSNorm) == (name != "torch")
        assert (type(trainer.model.layers[0].mlp).__name__ == "FusedProjectionTritonMLP") == (name == "triton-fused")
        runs[name] = trainer.fit(until=2)
    for name in ("triton", "triton-fused"):
        for key in ("loss", "grad_norm"):
            assert [r[key] for r in runs[name]] == pytest.approx([r[key] for r in runs["torch"]], rel=1e-5), name


def test_apply_kernels_torch_is_a_no_op_and_other_models_are_untouched():
    plain = build_model(PRESETS["tiny"])
    kernels.apply_kernels(plain, "torch")
    assert type(plain.norm) is RMSNorm and plain.layers[0].attn.rope_fn is apply_rope
    gpt2 = build_model(PRESETS["tiny-gpt2"])  # LayerNorm, GELU, learned positions: nothing to swap
    classes = [type(m) for m in gpt2.modules()]
    kernels.apply_kernels(gpt2, "triton")
    assert [type(m) for m in gpt2.modules()] == classes
    with pytest.raises(ConfigError, match="choose one of torch, triton"):
        kernels.apply_kernels(plain, "cuda")


def test_apply_kernels_names_the_fix_when_triton_is_unusable(monkeypatch):
    model = build_model(PRESETS["tiny"])
    with monkeypatch.context() as mp:
        mp.setattr(kernels, "triton_available", lambda: False)
        with pytest.raises(ConfigError, match="train.kernels=torch") as err:
            kernels.apply_kernels(model, "triton")
        assert "install triton" in str(err.value) and "TRITON_INTERPRET=1" in str(err.value)
    # Without a GPU or the interpreter, the message says which is missing.
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="no CUDA GPU"):
        kernels.apply_kernels(model, "triton")
    assert type(model.norm) is RMSNorm  # nothing was swapped


@pytest.mark.skipif(INTERPRETED, reason="this process runs the kernels in the interpreter itself")
def test_in_a_fresh_process():
    """This file's tests in a child process that imports triton with TRITON_INTERPRET=1 (see the top)."""
    rerun_interpreted(__file__)


def test_config_refuses_triton_kernels_on_the_cpu_without_the_interpreter(monkeypatch):
    from fivefold.config_load import load_config

    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ConfigError, match="train.kernels=triton runs Triton kernels on a CUDA GPU"):
        load_config(preset="tiny", overrides=["train.kernels=triton", "train.device=cpu"])
