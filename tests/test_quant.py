"""Post-training quantization (fivefold.quant): the storage format and its byte count, RTN error bounds,
GPTQ against RTN and against a column-by-column reference of the paper's algorithm, QuantLinear against
F.linear on the dequantized weight, the quantized directory round trip, and `fivefold quantize`."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from fivefold.checkpoint.kinds import is_quantized_dir
from fivefold.cli import main
from fivefold.config_load import load_config
from fivefold.model import build_model
from fivefold.quant.directory import load_quantized, save_quantized
from fivefold.quant.formats import (METHODS, expected_bytes, int4_grid, pack_int4, quantize_int4, quantize_int8,
                                    unpack_int4)
from fivefold.quant.gptq import HessianAccumulator, gptq_quantize, quantize_model, quantized_linears
from fivefold.quant.cpu_gemv import ROWS_READ_FROM_CODES, gemv_problem
from fivefold.quant.linear import QuantLinear, swap_linears


def gen(seed):
    return torch.Generator().manual_seed(seed)


def correlated_inputs(tokens, width, rank=8, seed=0):
    """Tokens living near a rank-`rank` subspace: the case where GPTQ's error feedback pays."""
    g = gen(seed)
    return torch.randn(tokens, rank, generator=g) @ torch.randn(rank, width, generator=g) \
        + 0.05 * torch.randn(tokens, width, generator=g)


# -- format -------------------------------------------------------------------------------------------------


def test_pack_unpack_are_exact_inverses():
    q = torch.randint(0, 16, (7, 10), dtype=torch.uint8, generator=gen(0))
    packed = pack_int4(q)
    assert packed.shape == (7, 5) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), q)
    assert pack_int4(torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)).tolist() == [[0x21, 0x0F]]  # 2j low nibble
    every = torch.arange(256, dtype=torch.uint8)[None]
    assert torch.equal(pack_int4(unpack_int4(every)), every)
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        pack_int4(torch.full((1, 2), 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="even"):
        pack_int4(torch.zeros(1, 3, dtype=torch.uint8))


@pytest.mark.parametrize("group_size", [16, 64, -1])
def test_int4_error_is_at_most_half_a_step_and_bytes_match(group_size):
    w = torch.randn(24, 64, generator=gen(1)) * torch.logspace(-3, 1, 64)  # columns of very different scales
    w[3] = 0  # an all-zero row stays exactly zero
    qw = quantize_int4(w, group_size)
    g = 64 if group_size == -1 else group_size
    assert (qw.qweight.dtype, qw.scales.dtype, qw.zeros.dtype) == (torch.uint8, torch.float16, torch.uint8)
    assert qw.qweight.shape == (24, 32) and qw.scales.shape == qw.zeros.shape == (24, 64 // g)
    assert int(qw.zeros.max()) <= 15
    step = qw.scales.float().repeat_interleave(g, dim=1)
    assert ((w - qw.dequantize()).abs() <= step / 2 * (1 + 1e-6)).all()
    assert torch.equal(qw.dequantize()[3], torch.zeros(64))
    assert qw.nbytes == expected_bytes((24, 64), "int4", group_size) == 24 * 32 + 24 * (64 // g) * 3


def test_int4_grid_covers_groups_whose_float16_scale_rounds_down():
    """Groups built to be the hard case: a range of 15 s whose s float16 rounds down, placed so that both the
    zero point and the top element sit at x.5 steps. A scale rounded to nearest leaves the top element past
    code 15, clipped by more than half a step; rounded up, every element stays within half a step."""
    g = gen(3)
    s = torch.rand(256, generator=g) * 0.5 + 0.01
    s = s[s.half().float() < s][:64]
    assert len(s) == 64
    lo, hi = -(7.5 + 1e-4) * s, (7.5 - 1e-4) * s
    w = torch.rand(len(s), 16, generator=g) * (hi - lo)[:, None] + lo[:, None]
    w[:, 0], w[:, 1] = lo, hi
    qw = quantize_int4(w, 16)
    step = qw.scales.float().repeat_interleave(16, dim=1)
    assert ((w - qw.dequantize()).abs() <= step / 2 * (1 + 1e-6)).all()


def test_int8_error_is_at_most_half_a_step_and_bytes_match():
    w = torch.randn(24, 40, generator=gen(2)) * torch.logspace(-2, 1, 24)[:, None]
    qw = quantize_int8(w)
    assert (qw.qweight.dtype, qw.scales.dtype, qw.zeros) == (torch.int8, torch.float32, None)
    assert qw.scales.shape == (24, 1) and qw.group_size == 40
    assert ((w - qw.dequantize()).abs() <= qw.scales / 2 * (1 + 1e-6)).all()
    assert int(qw.qweight.abs().max()) == 127
    assert qw.nbytes == expected_bytes((24, 40), "int8", 0) == 24 * 40 + 24 * 4


def test_group_size_must_divide_the_width():
    with pytest.raises(ValueError, match="group_size=48 does not divide the input width 64"):
        quantize_int4(torch.randn(4, 64), 48)
    with pytest.raises(ValueError, match="group_size=48"):
        gptq_quantize(torch.randn(4, 64), torch.eye(64), 48)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [2**24, 7 * 64, 64])  # whole, 7 rows, one row at a time
def test_dequantize_takes_rows_a_chunk_at_a_time_and_holds_what_it_says(method, dtype, chunk, monkeypatch):
    """dequantize computes DEQUANT_CHUNK elements of rows at a time, in place where the weight is fp32: bit for bit
    the whole weight's (q - zero) * scale in fp32 then cast, holding at its peak what dequantized_bytes says
    (the weight, one chunk's fp32 values unless they are the weight's, int4's unpacked codes)."""
    from fivefold.memory.live_peak import LivePeak
    from fivefold.quant import formats
    w = torch.randn(30, 64, generator=gen(21))
    qw = quantize_int8(w) if method == "int8" else quantize_int4(w, 16)
    qw.method = method
    if method == "int8":
        whole = (qw.qweight.float() * qw.scales.float()).to(dtype)
    else:
        q = formats.unpack_int4(qw.qweight).view(30, 4, 16)
        whole = ((q.float() - qw.zeros.float()[..., None]) * qw.scales.float()[..., None]).view(30, 64).to(dtype)
    monkeypatch.setattr(formats, "DEQUANT_CHUNK", chunk)
    with LivePeak() as held:
        got = qw.dequantize(dtype)
    assert got.dtype == dtype and torch.equal(got, whole)
    assert held.peak == formats.dequantized_bytes(method, (30, 64), dtype.itemsize)
    rows = min(30, max(1, chunk // 64))
    assert held.peak == 30 * 64 * dtype.itemsize + rows * 64 * ((dtype != torch.float32) * 4 + (method != "int8") * 2)


def test_state_round_trip_checks_shapes():
    from fivefold.quant.formats import QuantizedWeight

    qw = quantize_int4(torch.randn(8, 32, generator=gen(3)), 16)
    state = qw.state("layers.0.attn.q_proj")
    assert set(state) == {f"layers.0.attn.q_proj.{k}" for k in ("qweight", "scales", "zeros")}
    back = QuantizedWeight.from_state(state, "layers.0.attn.q_proj", "int4", (8, 32), 16)
    assert torch.equal(back.dequantize(), qw.dequantize())
    with pytest.raises(ValueError, match="scales"):
        QuantizedWeight.from_state(state, "layers.0.attn.q_proj", "int4", (8, 32), 8)


# -- GPTQ -----------------------------------------------------------------------------------------------------


def test_hessian_accumulator_is_the_mean_of_xxt():
    x = torch.randn(300, 12, generator=gen(4))
    acc = HessianAccumulator(12)
    for part in (x[:1], x[1:120], x[120:120], x[120:]):  # uneven batches, one empty
        acc.add(part)
    assert acc.tokens == 300
    torch.testing.assert_close(acc.hessian(), 2 * x.double().T @ x.double() / 300, rtol=1e-6, atol=1e-7)


def output_error(x, w, qw):
    return float((x @ w.T - x @ qw.dequantize().T).norm())


@pytest.mark.parametrize("group_size", [16, -1])
def test_gptq_beats_rtn_on_correlated_inputs_on_the_same_grid(group_size):
    x = correlated_inputs(2048, 64)
    w = torch.randn(48, 64, generator=gen(5)) * 0.1
    acc = HessianAccumulator(64)
    for part in x.split(500):
        acc.add(part)
    gptq, rtn = gptq_quantize(w, acc.hessian(), group_size), quantize_int4(w, group_size)
    assert output_error(x, w, gptq) < 0.5 * output_error(x, w, rtn)
    # The same format as RTN, and every value on its group's grid: (deq / scale + zero) an integer in [0, 15].
    assert [(t.dtype, t.shape) for t in gptq.tensors().values()] == [(t.dtype, t.shape) for t in rtn.tensors().values()]
    assert gptq.nbytes == rtn.nbytes == expected_bytes(w.shape, "gptq", group_size)
    g = gptq.group_size
    codes = gptq.dequantize() / gptq.scales.float().repeat_interleave(g, 1) + gptq.zeros.float().repeat_interleave(g, 1)
    torch.testing.assert_close(codes, codes.round(), rtol=0, atol=1e-4)
    assert codes.round().min() >= 0 and codes.round().max() <= 15


def test_gptq_with_uncorrelated_inputs_is_rtn():
    """H = I: the inverse Hessian is diagonal, no error moves to other columns, so GPTQ rounds to nearest."""
    w = torch.randn(16, 64, generator=gen(6))
    gptq, rtn = gptq_quantize(w, torch.eye(64), 16), quantize_int4(w, 16)
    assert all(torch.equal(a, b) for a, b in zip(gptq.tensors().values(), rtn.tensors().values()))


def reference_gptq(w, hessian, group_size, damp=0.01):
    """The paper's algorithm one column at a time (no blocks), float64: quantize column j on its group's grid
    (chosen from the error-updated weights when the group starts), then W[:, j:] -= e_j / U_jj * U[j, j:],
    with U = cholesky((H + damp * mean(diag H) I)^-1)^T."""
    W, H = w.clone().double(), hessian.clone().double()
    H += damp * H.diagonal().mean() * torch.eye(H.shape[0], dtype=torch.float64)
    U = torch.linalg.cholesky(torch.linalg.inv(H)).T
    codes, deq = torch.zeros_like(W), torch.zeros_like(W)
    for j in range(W.shape[1]):
        if j % group_size == 0:
            scale, zero = int4_grid(W[:, j:j + group_size])
        codes[:, j] = (torch.round(W[:, j].float() / scale) + zero).clamp(0, 15).double()
        deq[:, j] = ((codes[:, j].float() - zero) * scale).double()
        W[:, j:] -= ((W[:, j] - deq[:, j]) / U[j, j])[:, None] * U[j, j:][None, :]
    return codes, deq


@pytest.mark.parametrize("group_size, block_size", [(4, 8), (8, 8), (12, 8), (24, 5), (4, 1), (8, 24)])
def test_lazy_batch_updates_equal_the_column_by_column_reference(group_size, block_size):
    x = correlated_inputs(256, 24, rank=4, seed=7).double()
    hessian = 2 * x.T @ x / 256
    w = torch.randn(10, 24, generator=gen(8), dtype=torch.float64)
    codes, deq = reference_gptq(w, hessian, group_size)
    qw = gptq_quantize(w, hessian, group_size, block_size)
    assert torch.equal(unpack_int4(qw.qweight).double(), codes)
    torch.testing.assert_close(qw.dequantize(torch.float64), deq, rtol=0, atol=1e-12)


def test_dead_columns_quantize_to_zero():
    x = correlated_inputs(512, 32, seed=9)
    x[:, [3, 17]] = 0  # inputs no token uses: their weights never matter
    acc = HessianAccumulator(32)
    acc.add(x)
    w = torch.randn(8, 32, generator=gen(10))
    qw = gptq_quantize(w, acc.hessian(), 16)
    deq = qw.dequantize()
    assert torch.isfinite(deq).all() and torch.equal(deq[:, [3, 17]], torch.zeros(8, 2))


# -- inference and whole models -------------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("rows", [1, 3, 9, 20])  # up to ROWS_READ_FROM_CODES (8 int8, 16 int4) read the codes
def test_quant_linear_equals_linear_on_the_dequantized_weight(method, rows):
    w = torch.randn(40, 64, generator=gen(11))
    qw = quantize_int8(w) if method == "int8" else quantize_int4(w, 16) if method == "int4" else \
        gptq_quantize(w, HessianAccumulator(64).hessian() + torch.eye(64), 16)
    bias = torch.randn(40, generator=gen(12))
    layer = QuantLinear(qw, bias)
    x = torch.randn(rows, 1, 64, generator=gen(13))
    from_codes = layer._rows_from_codes(x)
    reads = rows <= ROWS_READ_FROM_CODES["int8" if method == "int8" else "int4"]
    assert (from_codes is not None) == reads, gemv_problem()
    # a bfloat16 row is widened to float32 for the codes-reading product
    assert (QuantLinear(qw, bias).to(torch.bfloat16)._rows_from_codes(x.bfloat16()) is not None) == reads
    torch.testing.assert_close(layer(x), F.linear(x, qw.dequantize(), bias), rtol=1e-5, atol=1e-5)
    half = layer.to(torch.bfloat16)  # the compute dtype follows; the stored codes and scales do not change
    assert half.dtype == torch.bfloat16 and half.scales.dtype == qw.scales.dtype and torch.equal(half.scales, qw.scales)
    xb = x.bfloat16()
    torch.testing.assert_close(half(xb).float(), F.linear(xb, qw.dequantize(torch.bfloat16), bias.bfloat16()).float(),
                               rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("method,group_size", [("int8", 0), ("int4", 32), ("int4", 64), ("int4", 576)])
def test_one_row_read_from_the_codes_equals_the_dequantized_product(method, group_size, monkeypatch):
    """A decode's row through the compiled codes-reading product, at a served model's widths and every group
    layout (one group per row included), equals the dequantized product to float32 rounding; where the
    kernels cannot compile, the layer dequantizes and still gives it."""
    import fivefold.quant.cpu_gemv as cpu_gemv

    w = torch.randn(960, 576, generator=gen(21))
    qw = quantize_int8(w) if method == "int8" else quantize_int4(w, group_size)
    layer = QuantLinear(qw)
    x = torch.randn(1, 1, 576, generator=gen(22))
    expected = F.linear(x, qw.dequantize())
    assert layer._rows_from_codes(x) is not None, gemv_problem()
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=2e-5)
    monkeypatch.setattr(cpu_gemv, "_problem", ["no C++ compiler"])
    assert layer._rows_from_codes(x) is None
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=2e-5)


def tiny_model(preset="tiny"):
    cfg = load_config(preset=preset)
    return cfg, build_model(cfg.model, seed=3).eval()


def calibration(n=3, seed=14):
    return [torch.randint(0, 512, (2, 16), generator=gen(seed + i)) for i in range(n)]


def test_quantize_model_covers_the_block_linears_and_leaves_the_model_unchanged():
    _, model = tiny_model()
    before = {n: p.clone() for n, p in model.named_parameters()}
    qweights = quantize_model(model, "gptq", 16, calibration())
    assert set(qweights) == {f"{n}.weight" for n in quantized_linears(model)}
    assert len(qweights) == 2 * 7 and not any(n.startswith(("embed", "lm_head")) for n in qweights)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    # The whole GPTQ model is closer to the full-precision one than RTN's, on tokens it was not calibrated on.
    rtn = quantize_model(model, "int4", 16)
    ids = torch.randint(0, 512, (2, 16), generator=gen(15))
    with torch.no_grad():
        ref = model(ids)
        swap_linears(model, qweights)
        err_gptq = (model(ids) - ref).norm()
    _, fresh = tiny_model()
    with torch.no_grad():
        swap_linears(fresh, rtn)
        err_rtn = (fresh(ids) - ref).norm()
    assert err_gptq < err_rtn


def test_gptq_calibrates_each_block_on_the_blocks_before_it_quantized():
    """The paper's sequential scheme: block 1's Hessian comes from the outputs of block 0 with block 0's
    weights already quantized, so block 1 also corrects their error. Reference: block 0 replaced by its
    dequantized GPTQ weights, block 1's q_proj input collected by a hook over the same calibration, and
    gptq_quantize on that Hessian."""
    import copy

    _, model = tiny_model()
    batches = calibration()
    qweights = quantize_model(model, "gptq", 16, batches)
    reference = copy.deepcopy(model)
    for name, qw in qweights.items():
        if name.startswith("layers.0."):
            reference.get_submodule(name.removesuffix(".weight")).weight.data = qw.dequantize()
    hessian = HessianAccumulator(model.cfg.hidden_size)
    hook = reference.layers[1].attn.q_proj.register_forward_pre_hook(lambda m, args: hessian.add(args[0]))
    with torch.no_grad():
        for ids in batches:
            reference(ids)
    hook.remove()
    expected = gptq_quantize(model.layers[1].attn.q_proj.weight, hessian.hessian(), 16)
    got = qweights["layers.1.attn.q_proj.weight"]
    assert all(torch.equal(a, b) for a, b in zip(got.tensors().values(), expected.tensors().values()))



@pytest.mark.parametrize("method, preset", [("int8", "tiny"), ("int4", "tiny"), ("gptq", "tiny"),
                                            ("gptq", "tiny-gpt2")])  # GELU MLP, biases, tied head
def test_save_and_load_give_identical_logits(method, preset, tmp_path):
    cfg, model = tiny_model(preset)
    qweights = quantize_model(model, method, 16, calibration())
    save_quantized(tmp_path / "q", cfg, model, qweights, {"windows": 3}, {"tokenizer.json": b"{}"})
    assert is_quantized_dir(tmp_path / "q") and (tmp_path / "q" / "tokenizer.json").read_bytes() == b"{}"
    meta = json.loads((tmp_path / "q" / "quantization.json").read_text())
    assert meta["method"] == method and meta["bits"] == (8 if method == "int8" else 4)
    assert meta["group_size"] == (-1 if method == "int8" else 16)
    assert len(meta["modules"]) == 2 * (7 if cfg.model.activation == "swiglu" else 6)
    assert meta["bytes"]["quantized"] == meta["bytes"]["expected"]
    loaded_cfg, loaded = load_quantized(tmp_path / "q")
    assert loaded_cfg.model == cfg.model
    assert not any(n.endswith("_proj.weight") for n, _ in loaded.named_parameters())
    ids = torch.randint(0, 512, (2, 16), generator=gen(16))
    with torch.no_grad():
        swap_linears(model, qweights)
        assert torch.equal(loaded(ids), model(ids))
    _, fresh = tiny_model()
    save_quantized(tmp_path / "q", cfg, fresh, quantize_model(fresh, "int8", 0))  # replaces the directory
    assert json.loads((tmp_path / "q" / "quantization.json").read_text())["method"] == "int8"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]  # no temporary left behind


def test_load_rejects_a_file_of_another_shape(tmp_path):
    from fivefold.errors import CheckpointError

    cfg, model = tiny_model()
    save_quantized(tmp_path / "q", cfg, model, quantize_model(model, "int4", 16))
    meta = json.loads((tmp_path / "q" / "quantization.json").read_text())
    (tmp_path / "q" / "quantization.json").write_text(json.dumps({**meta, "group_size": 32}))
    with pytest.raises(CheckpointError, match=r"layers\.0\.attn\.q_proj\.scales is torch.float16 \(64, 4\)"):
        load_quantized(tmp_path / "q")


def test_save_refuses_a_directory_that_is_not_quantized(tmp_path):
    from fivefold.errors import UserError

    cfg, model = tiny_model()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(UserError, match="not a quantized model directory"):
        save_quantized(tmp_path / "mine", cfg, model, quantize_model(model, "int8", 0))
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


# -- the command line ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, data_cache):
    from fivefold.train.trainer import Trainer

    out = tmp_path_factory.mktemp("quant") / "run"
    values = {"train.seq_len": 32, "train.micro_batch_size": 4, "train.steps": 2, "train.progress": False,
              "train.tensorboard": False, "train.eval_every": 0, "train.save_every": 0, "data.cache_dir": data_cache,
              "train.out_dir": str(out)}
    Trainer(load_config(preset="tiny", overrides=[f"{k}={v}" for k, v in values.items()]), quiet=True).fit()
    return out


@pytest.mark.parametrize("method", METHODS)
def test_cli_quantizes_a_run_and_reports_bytes_and_perplexity(method, tiny_run, tmp_path, capsys):
    out = tmp_path / method
    assert main(["quantize", str(tiny_run), "--method", method, "--group-size", "32", "--calib-samples", "8",
                 "--eval-samples", "8", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "equal" in text and "MISMATCH" not in text and "val ppl" in text
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.startswith("  ")}
    assert set(rows) == {"method", "fp32", method}
    assert math.isfinite(float(rows[method][5])) and float(rows[method][5]) > 1
    meta = json.loads((out / "quantization.json").read_text())
    assert meta["method"] == method and meta["calibration"].get("windows") == (8 if method == "gptq" else None)
    cfg, model = load_quantized(out)
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == 14
    assert (out / "tokenizer.json").is_file()


def test_cli_compare_and_calibration_file(tiny_run, tmp_path, capsys):
    calib = tmp_path / "calib.txt"
    calib.write_text("def main():\n    return sorted(range(10), key=lambda x: -x)\n" * 60)
    assert main(["quantize", str(tiny_run), "--method", "gptq", "--group-size", "-1", "--calib", str(calib),
                 "--calib-samples", "4", "--eval-samples", "8", "--compare", "--out", str(tmp_path / "q")]) == 0
    text = capsys.readouterr().out
    assert [line.split()[0] for line in text.splitlines() if line.startswith("  ")] == \
        ["method", "fp32", "int8", "int4", "gptq"]
    assert json.loads((tmp_path / "q" / "quantization.json").read_text())["calibration"]["source"] == str(calib)


@pytest.mark.parametrize("args, message", [
    (["--method", "int4", "--group-size", "48"], "--group-size 48 does not divide the input width 64"),
    (["--method", "int3"], "invalid choice: 'int3'"),
])
def test_cli_rejects_bad_input_in_one_line(args, message, tiny_run, tmp_path, capsys):
    code = main(["quantize", str(tiny_run), *args, "--calib-samples", "2", "--eval-samples", "2",
                 "--out", str(tmp_path / "q")])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_cli_missing_model_is_one_line(tmp_path, capsys):
    assert main(["quantize", str(tmp_path / "nope"), "--method", "int8"]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and len(err.strip().splitlines()) == 1


def test_cli_quantizes_a_hugging_face_directory_with_a_calibration_file(tiny_run, tmp_path, capsys):
    from fivefold.interop.hf import export_hf, read_tokenizer_files
    from fivefold.checkpoint.store import resolve_checkpoint
    from fivefold.weights import load_model

    _, model = load_model(tiny_run)
    hf = export_hf(model, tmp_path / "hf", extra_files=read_tokenizer_files(resolve_checkpoint(tiny_run)))
    calib = tmp_path / "calib.jsonl"
    calib.write_text("\n".join(json.dumps({"text": f"for i in range({k}):\n    print(i * {k})"}) for k in range(200)))
    assert main(["quantize", str(hf), "--method", "gptq", "--group-size", "32", "--calib", str(calib),
                 "--calib-samples", "4", "--eval-samples", "4", "--out", str(tmp_path / "q")]) == 0
    text = capsys.readouterr().out
    assert "4 windows of --calib not used for calibration" in text
    assert main(["quantize", str(hf), "--method", "gptq", "--group-size", "32", "--out", str(tmp_path / "r")]) == 2
    assert "give --calib FILE" in capsys.readouterr().err


@pytest.mark.parametrize("method", ["int8", "gptq"])
def test_a_quantized_directory_serves_what_its_dequantized_model_computes(method, tiny_run, tmp_path, capsys):
    """fivefold.serve loads a quantized directory (QuantLinear, the codes as stored): greedy outputs equal
    those of the same model with each quantized weight replaced by its dequantized value."""
    from fivefold.serve import LLM, SamplingParams
    from fivefold.weights import load_model

    out = tmp_path / method
    assert main(["quantize", str(tiny_run), "--method", method, "--group-size", "32", "--calib-samples", "8",
                 "--eval-samples", "8", "--out", str(out)]) == 0
    _, quantized = load_quantized(out)
    _, plain = load_model(tiny_run)
    with torch.no_grad():
        for name, module in quantized.named_modules():
            if isinstance(module, QuantLinear):
                plain.get_submodule(name).weight.copy_(module.quantized().dequantize(torch.float32))
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 17, 42, 7], [100, 3, 9, 250, 11, 12]]
    engine = {"block_size": 8, "num_blocks": 32}
    served = [o.token_ids for o in LLM(out, **engine).generate(prompts, greedy)]
    assert served == [o.token_ids for o in LLM(plain, **engine).generate(prompts, greedy)]
    from fivefold.config import ConfigError
    from fivefold.serve.loading import load_model_for_serving
    with pytest.raises(ConfigError, match="tp=1"):
        load_model_for_serving(out, tp=2)


@pytest.mark.parametrize("linear", ["torch", "auto"])  # F.linear as on a GPU: a miss would be silent there
def test_quantizing_a_model_an_engine_fused_serves_the_quantized_weights(linear):
    """An engine fuses q/k/v and gate/up in place (fivefold.serve.fused). Quantizing that model (or a copy of
    it) afterwards must not leave the fused full-precision products computing the quantized projections:
    the served log-probabilities are the quantized model's, not the full-precision one's."""
    import copy

    from fivefold.serve import LLM, SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    ids = [[5, 17, 300, 2, 41, 9], [7, 8]]

    def served(model):
        outs = LLM(model, num_blocks=32, block_size=8, linear=linear).generate(ids, params)
        return torch.tensor([[e["logprob"] for e in o.logprobs] for o in outs])

    def quantized(model):
        swap_linears(model, quantize_model(model, "int4", 32))
        return model

    _, fresh = tiny_model()
    full = served(fresh)  # fuses `fresh` in place
    _, other = tiny_model()
    want = served(quantized(other))
    assert (want - full).abs().max() > 1e-3  # int4 codes move these log-probabilities
    torch.testing.assert_close(served(quantized(copy.deepcopy(fresh))), want, rtol=0, atol=1e-5)
    torch.testing.assert_close(served(quantized(fresh)), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("method", ["int8", "int4"])
@torch.no_grad()
def test_quantized_projections_fuse_in_serving_like_full_precision_ones(method, monkeypatch):
    """An engine fuses a quantized model's q/k/v (with biases, as Qwen2 has) and gate/up: one QuantLinear
    each over the parts' concatenated codes, which the parts' buffers then view (nothing held twice, names and
    state dict unchanged); the blocks run as one loop; greedy tokens equal those of the same model served
    unfused; unfusing gives each part its own buffers with the same values."""
    import dataclasses

    import fivefold.serve.fused as fused_module
    from fivefold.presets import PRESETS
    from fivefold.serve import LLM, SamplingParams
    from fivefold.serve.fused import FusedQuantAttention, FusedQuantMLP, unfuse_projections

    cfg = dataclasses.replace(PRESETS["tiny"], qkv_bias=True, max_seq_len=128)

    def quantized():
        model = build_model(cfg, seed=5).eval()
        swap_linears(model, {n: quantize_int8(p) if method == "int8" else quantize_int4(p, 16)
                             for n, p in model.named_parameters() if n.startswith("layers.") and n.endswith("proj.weight")})
        return model

    model = quantized()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prompts = [[5, 17, 42, 7], list(range(30, 70)), [9]]
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    llm = LLM(model, block_size=8, num_blocks=32)
    assert llm.engine.fused == 2 * cfg.num_layers and llm.engine.lean
    attn, mlp = model.layers[0].attn, model.layers[0].mlp
    assert type(attn) is FusedQuantAttention and type(mlp) is FusedQuantMLP
    assert attn.q_proj.qweight.untyped_storage().data_ptr() == attn.qkv_quant.qweight.untyped_storage().data_ptr()
    assert mlp.up_proj.qweight.untyped_storage().data_ptr() == mlp.gate_up_quant.qweight.untyped_storage().data_ptr()
    assert attn.v_proj.bias.untyped_storage().data_ptr() == attn.qkv_quant.bias.untyped_storage().data_ptr()
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    got = [o.token_ids for o in llm.generate(prompts, greedy)]

    monkeypatch.setattr(fused_module, "_fuse_quantized", lambda module, names: None)
    plain = LLM(quantized(), block_size=8, num_blocks=32)
    assert plain.engine.fused == 0 and not plain.engine.lean
    assert got == [o.token_ids for o in plain.generate(prompts, greedy)]

    assert unfuse_projections(model) == 2 * cfg.num_layers
    assert type(model.layers[0].attn).__name__ == "Attention" and type(model.layers[0].mlp).__name__ == "MLP"
    assert "qkv_quant" not in vars(model.layers[0].attn)
    q = model.layers[0].attn.q_proj.qweight
    assert q.untyped_storage().nbytes() == q.numel() * q.element_size()  # its own storage again
    assert all(torch.equal(model.state_dict()[k], before[k]) for k in before)


@torch.no_grad()
def test_parts_quantized_differently_are_served_apart():
    """Only parts of one method and group size fuse: gate and up with different int4 group sizes, or q int8
    beside k and v in int4, stay separate products (their scales could not be concatenated), and the engine
    serves what the same quantized model computes unfused."""
    import dataclasses

    from fivefold.presets import PRESETS
    from fivefold.serve import LLM, SamplingParams

    cfg = dataclasses.replace(PRESETS["tiny"], max_seq_len=128)
    model = build_model(cfg, seed=5).eval()
    chosen = {}
    for n, p in model.named_parameters():
        if n.startswith("layers.") and n.endswith("proj.weight"):
            part = n.split(".")[-2]
            chosen[n] = (quantize_int8(p) if part == "q_proj" else
                         quantize_int4(p, 32 if part == "up_proj" else 16))
    swap_linears(model, chosen)
    ids = torch.tensor([[5, 17, 42, 7, 30, 31]])
    want = model(ids)[0, -1]
    llm = LLM(model, block_size=8, num_blocks=32)
    assert llm.engine.fused == 0
    assert type(model.layers[0].attn).__name__ == "Attention" and type(model.layers[0].mlp).__name__ == "MLP"
    out = llm.generate([ids[0].tolist()], SamplingParams(max_tokens=1, temperature=0, logprobs=0))[0]
    assert out.token_ids == [int(want.argmax())]
    assert out.logprobs[0]["logprob"] == pytest.approx(float(want.log_softmax(-1).max()), abs=1e-4)
