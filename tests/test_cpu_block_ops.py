"""A decode block's small ops as C++ calls (fivefold.kernels.cpu_block_ops, serve.cpu_kernel) against torch's:
the norms and SwiGLU to float32 rounding, the residual add exactly, and RoPE + the KV store bit for bit before
the paged decode attention; and the lean loop that calls them against the model's modules."""

import contextlib
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from fivefold.kernels.cpu_block_ops import (add_rms_norm_rows, decode_blocks, rms_norm_rows, rotary_decode_attention,
                                            silu_mul_rows)
from fivefold.kernels.cpu_linear_rows import max_rows
from fivefold.kernels.cpu_paged_decode import decode_attention, kernel_problem
from fivefold.model import ForwardContext, build_model
from fivefold.presets import PRESETS
from fivefold.serve.cpu_linear import (ROWS_KERNEL, TORCH_LINEAR, Product, onednn_linear, route_linears,
                                       rows_kernel_onednn)
from fivefold.serve.fused import fuse_projections
from fivefold.serve.kv_pool import KVPool, PagedBatch, kv_plan
import fivefold.serve.lean_forward as lean_forward
from fivefold.serve.lean_forward import lean_blocks, one_call_blocks, use_lean_forward
from paged_steps import admitted

if kernel_problem():
    pytest.skip(f"the CPU kernels cannot be built here: {kernel_problem()}", allow_module_level=True)

# The norm's sum of squares in another order than torch's: a few ulp of a factor near 1 (measured 9.5e-7
# absolute on values up to ~5 over these cases).
NORM_TOLERANCE = dict(rtol=1e-6, atol=2e-6)


@pytest.mark.parametrize("rows", [1, 7, 300])  # 300: split among threads
@pytest.mark.parametrize("width", [576, 100, 64])  # 100: not a whole number of vectors
def test_norms_equal_torch_to_float32_rounding(rows, width):
    g = torch.Generator().manual_seed(rows * width)
    x, delta = (torch.randn(rows, width, generator=g) for _ in range(2))
    weight, eps = 1 + 0.3 * torch.randn(width, generator=g), 1e-5
    torch.testing.assert_close(rms_norm_rows(x, weight, eps), F.rms_norm(x, (width,), weight, eps), **NORM_TOLERANCE)
    total, normed = add_rms_norm_rows(x, delta, weight, eps)
    assert torch.equal(total, x + delta)
    torch.testing.assert_close(normed, F.rms_norm(x + delta, (width,), weight, eps), **NORM_TOLERANCE)
    # A row's norm is its own: alone it is what it is among the others, bit for bit.
    assert torch.equal(rms_norm_rows(x[-1:], weight, eps), rms_norm_rows(x, weight, eps)[-1:])


@pytest.mark.parametrize("rows", [1, 40])
def test_swiglu_equals_torch_to_a_few_ulp(rows):
    """Gates from -100 to 100 (exp(-g) past float32's range on one side) and the fused product's layout."""
    g = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 1536, generator=g) * 4
    gate_up[0, :9] = torch.tensor([-100.0, -88.0, -20.0, -1e-30, 0.0, 1e-30, 20.0, 88.0, 100.0])
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(silu_mul_rows(gate_up), F.silu(gate) * up, rtol=4e-7, atol=1e-30)


def within_one_bfloat16_step(ours, theirs, at_most_off=0.05):
    """bfloat16 results that round the same float32 values, summed or exponentiated in another order: each within
    one bfloat16 step (2^-7 of its value) of torch's, and all but a few of them equal."""
    diff = (ours.float() - theirs.float()).abs()
    assert bool((diff <= 2.0**-7 * theirs.float().abs() + 1e-30).all()), float(diff.max())
    assert float((diff > 0).float().mean()) <= at_most_off


@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("width", [576, 100])
def test_bfloat16_norms_and_swiglu_round_where_torch_rounds(rows, width):
    """A bfloat16 engine's rows: the residual sum rounded to bfloat16 exactly as torch's add, the norm as
    RMSNorm.forward (normalised in float32, rounded, times the weight, rounded), silu(gate) * up as torch's two
    bfloat16 ops: within a bfloat16 step, mostly equal; a row alone bit for bit that row among others."""
    g = torch.Generator().manual_seed(rows * width)
    x, delta = (torch.randn(rows, width, generator=g).bfloat16() for _ in range(2))
    norm = build_model(PRESETS["tiny"], seed=0).norm  # the model's own RMSNorm
    norm.weight.data = (1 + 0.3 * torch.randn(width, generator=g)).bfloat16()
    norm.eps = 1e-5
    with torch.no_grad():
        within_one_bfloat16_step(rms_norm_rows(x, norm.weight, norm.eps), norm(x))
        total, normed = add_rms_norm_rows(x, delta, norm.weight, norm.eps)
        assert total.dtype == normed.dtype == torch.bfloat16 and torch.equal(total, x + delta)
        within_one_bfloat16_step(normed, norm(x + delta))
    assert torch.equal(rms_norm_rows(x[-1:], norm.weight, norm.eps), rms_norm_rows(x, norm.weight, norm.eps)[-1:])
    gate_up = (torch.randn(rows, 2 * width, generator=g) * 4).bfloat16()
    gate, up = gate_up.chunk(2, dim=-1)
    within_one_bfloat16_step(silu_mul_rows(gate_up), F.silu(gate) * up)


def rotated(x, cos, signed_sin):
    """The lean loop's RoPE in torch's ops: x (T, H, d), cos and signed_sin (T, d)."""
    return x * cos[:, None] + x.roll(x.shape[-1] // 2, -1) * signed_sin[:, None]


# query heads, key/value heads, head size, block size
CASES = [(32, 8, 64, 16), (9, 3, 64, 32), (4, 2, 128, 16), (6, 2, 48, 16)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", CASES,
                         ids=[f"{h}/{kv}h-d{d}-bs{bs}" for h, kv, d, bs in CASES])
def test_rotary_store_and_attention_equal_torch_then_the_kernel_bit_for_bit(heads, kv_heads, head_dim, block_size,
                                                                            portable, dtype):
    """Rows at contexts of 1 to 300 tokens, and a padding row (slot -1, length 0), in scattered blocks: the
    pool after the call equals torch's RoPE and index_copy_ into a copy of it, and the output equals the
    decode kernel's over that copy, exactly, in float32 and in bfloat16 (each product and the sum rounded as
    torch's bfloat16 ops round them); the padding row stores nothing and attends to nothing."""
    g = torch.Generator().manual_seed(heads + head_dim)
    lengths = [1, 17, 300, 0, block_size]
    counts = [max(1, -(-n // block_size)) for n in lengths]
    num_blocks = sum(counts) + 3
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots = [], []
    for n, count in zip(lengths, counts):
        table, order = order[:count], order[count:]
        tables.append(table + [0] * (max(counts) - count))
        slots.append(table[(n - 1) // block_size] * block_size + (n - 1) % block_size if n else -1)
    k_pool = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_pool = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    t = len(lengths)
    # The fused product's output viewed as heads: a row stride of the whole product, as in the loop.
    heads_view = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype).view(t, -1, head_dim)
    angles = torch.rand(t, head_dim // 2, generator=g) * 100
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(dtype)
    sin = angles.sin()
    signed_sin = torch.cat([-sin, sin], dim=-1).to(dtype)
    tables, lens = torch.tensor(tables, dtype=torch.int32), torch.tensor(lengths, dtype=torch.int32)
    slot_mapping = torch.tensor(slots, dtype=torch.int32)

    ref_k, ref_v = k_pool.clone(), v_pool.clone()
    qk = rotated(heads_view[:, :heads + kv_heads], cos, signed_sin)
    stored = slot_mapping >= 0
    flat_k, flat_v = ref_k.view(-1, kv_heads, head_dim), ref_v.view(-1, kv_heads, head_dim)
    flat_k.index_copy_(0, slot_mapping[stored].long(), qk[stored, heads:])
    flat_v.index_copy_(0, slot_mapping[stored].long(), heads_view[stored, heads + kv_heads:])
    expected = decode_attention(qk[:, :heads], ref_k, ref_v, tables, lens, portable=portable)

    got = rotary_decode_attention(heads_view, heads, cos, signed_sin, k_pool, v_pool, slot_mapping, tables, lens,
                                  portable=portable)
    assert torch.equal(k_pool, ref_k) and torch.equal(v_pool, ref_v)
    assert torch.equal(got, expected)
    assert not got[3].any()  # the padding row


def test_what_the_calls_refuse_is_named():
    x, w = torch.randn(2, 8), torch.randn(8)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 only"):
        rms_norm_rows(x.double(), w.double(), 1e-5)
    with pytest.raises(RuntimeError, match="the weight must be contiguous"):
        rms_norm_rows(x, torch.randn(9), 1e-5)
    pool = torch.zeros(2, 4, 1, 8)
    heads = torch.randn(1, 3, 8)
    args = (torch.ones(1, 8), torch.zeros(1, 8), pool, pool.clone())
    with pytest.raises(RuntimeError, match="slot 8 is past the pool's 8"):
        rotary_decode_attention(heads, 1, *args, torch.tensor([8], dtype=torch.int32),
                                torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="heads must hold q_heads queries"):
        rotary_decode_attention(heads, 2, *args, torch.tensor([0], dtype=torch.int32),
                                torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, dtype=torch.int32))


def served_tiny(qkv_bias=False, library=None, dtype=torch.float32):
    """The tiny model as the engine prepares it for the CPU path (fused, the lean loop), with norm weights other
    than ones; every product on `library` (fivefold.serve.cpu_linear.LIBRARIES) where given; in `dtype`."""
    cfg = dataclasses.replace(PRESETS["tiny"], max_seq_len=256, qkv_bias=qkv_bias)
    model = build_model(cfg, seed=3, dtype=dtype).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    assert fuse_projections(model) == 2 * cfg.num_layers
    if library:
        route_linears(model, choose=lambda shape, dtype, layouts: Product(library))
    assert use_lean_forward(model)
    return model


# (tokens already computed, tokens this step) per sequence: prompt chunks, mixed steps, decode-only steps (step
# 2 padded with an inert row), 1 to 3 decodes a step
STEPS = [[(0, 5), (0, 3), (0, 0)], [(5, 1), (3, 7), (0, 4)], [(6, 1), (10, 1), (4, 1)],
         [(7, 1), (11, 1), (5, 1)], [(8, 14), (12, 1), (6, 3)], [(22, 1), (13, 1), (9, 1)], [(23, 1), (0, 0), (0, 0)]]


@torch.no_grad()
def run_steps(model, sides: dict) -> dict:
    """Each side's (logits of every step, KV pool) over STEPS: `sides` maps a name to (PagedBatch options, a
    context manager to run it under)."""
    cfg = model.cfg
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (24, 14, 10)]
    dtype = next(model.parameters()).dtype
    plan = kv_plan(cfg, 1, 4, dtype, num_blocks=24)
    pools = {name: KVPool(cfg, plan, "cpu", dtype) for name in sides}
    tables = [[3, 9, 1, 14, 6, 12, 20], [0, 7, 2, 11], [5, 8, 21]]
    batch, buffers, rows = admitted(seqs, tables, block_size=4, max_model_len=28, rows=4)
    logits = {name: [] for name in sides}
    for i, step in enumerate(STEPS):
        work = [(rows[j], n) for j, (past, n) in enumerate(step) if n]
        for j, (past, n) in enumerate(step):
            rows[j].num_computed = past
        work.sort(key=lambda e: e[1] != 1)
        inputs = batch.prepare(work)
        if i == 2:
            inputs = inputs.padded(4)  # a padding row in a decode-only step
        dev = buffers.upload(inputs)
        for name, (options, context) in sides.items():
            paged = PagedBatch(pools[name], dev, inputs, **options)
            ctx = ForwardContext(positions=paged.positions, kv_cache=paged, mask=paged,
                                 logits_at=torch.arange(inputs.num_tokens))
            with context():
                logits[name].append(model(dev.input_ids[None], ctx))
    return {name: (logits[name], pools[name]) for name in sides}


def test_the_loop_with_the_calls_follows_the_modules(monkeypatch):
    """The lean loop under serve.cpu_kernel (the C++ norms and SwiGLU, and RoPE + store + attention on
    decode-only steps) against the modules with the same decode kernel, over prompt chunks, mixed steps and
    decode-only steps: logits and pool to float32 rounding, step after step."""
    rotary = []
    monkeypatch.setattr(lean_forward, "one_call_blocks", lambda blocks, rows: None)  # the calls one by one
    attend_rotary_rows = PagedBatch.attend_rotary_rows
    monkeypatch.setattr(PagedBatch, "attend_rotary_rows",
                        lambda self, *a: rotary.append(1) or attend_rotary_rows(self, *a))
    plain = contextlib.nullcontext
    runs = run_steps(served_tiny(qkv_bias=True), {"loop": (dict(fused_launches=True, cpu_kernel=True), plain),
                                                  "modules": (dict(fused_launches=False, cpu_kernel=True), plain)})
    (loop, loop_pool), (modules, modules_pool) = runs["loop"], runs["modules"]
    for i, (a, b) in enumerate(zip(loop, modules, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"step {i}")
    torch.testing.assert_close(loop_pool.k, modules_pool.k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loop_pool.v, modules_pool.v, rtol=1e-5, atol=1e-5)
    assert len(rotary) == 4 * 2  # the four decode-only steps, each layer


@pytest.mark.skipif(max_rows() == 0, reason="this CPU has no rows kernel")
@pytest.mark.parametrize("library, qkv_bias, dtype", [
    ("rows kernel", False, torch.float32), ("rows kernel", True, torch.float32), ("F.linear", True, torch.float32),
    ("rows kernel+F.linear", True, torch.float32), (None, False, torch.float32),
    ("rows kernel", True, torch.bfloat16), ("F.linear", False, torch.bfloat16)])
def test_one_call_for_all_blocks_equals_the_calls_one_by_one(library, qkv_bias, dtype, monkeypatch):
    """Every product on the rows kernel, on F.linear, on F.linear below 4 rows and the kernel from 4 (a q/k/v
    bias added after the kernel's product, inside F.linear's), or left as the model's (serve.linear=torch: plain
    linears): decode-only steps of 1 to 3 rows (and one
    padded to 4) as one C++ call give the logits and KV pool of the loop calling the same ops one by one, bit
    for bit; other steps take the loop."""
    calls = []
    monkeypatch.setattr(lean_forward, "decode_blocks", lambda *a: calls.append(a[0].shape[0]) or decode_blocks(*a))

    @contextlib.contextmanager
    def one_by_one():
        with monkeypatch.context() as m:
            m.setattr(lean_forward, "one_call_blocks", lambda blocks, rows: None)
            yield
    options = dict(fused_launches=True, cpu_kernel=True)
    runs = run_steps(served_tiny(qkv_bias, library=library, dtype=dtype),
                     {"one call": (options, contextlib.nullcontext), "one by one": (options, one_by_one)})
    (one, one_pool), (each, each_pool) = runs["one call"], runs["one by one"]
    assert all(torch.equal(a, b) for a, b in zip(one, each, strict=True))
    assert torch.equal(one_pool.k, each_pool.k) and torch.equal(one_pool.v, each_pool.v)
    assert calls == [4, 3, 3, 1]  # the decode-only steps' rows (step 2 padded to 4)


def test_blocks_whose_products_c_cannot_run_keep_the_loop():
    """A product on oneDNN in any block (C++ does not call it), or one on the rows kernel with oneDNN below 4
    rows, at 1 row: no params; rows past the kernel's take torch's linear."""
    model = served_tiny(library="rows kernel")
    blocks = lean_blocks(model)
    params, eps, products = one_call_blocks(blocks, 1)
    assert products == [ROWS_KERNEL] * 8 and len(params) == 14 and len(eps) == 4
    assert one_call_blocks(blocks, max_rows() + 1)[2] == [TORCH_LINEAR] * 8
    blocks[1][2].linear_fn = onednn_linear  # one block's o_proj
    assert one_call_blocks(blocks, 1) is None
    blocks[1][2].linear_fn = rows_kernel_onednn
    assert one_call_blocks(blocks, 1) is None and one_call_blocks(blocks, 4) is not None


def test_heads_in_any_layout_give_the_same_call():
    """A quantized product's output can come transposed ((T, N) with unit stride along T): the call takes it
    as it takes contiguous heads."""
    g = torch.Generator().manual_seed(5)
    t, heads, kv_heads, d = 3, 4, 2, 16
    columns = torch.randn((heads + 2 * kv_heads) * d, t, generator=g)
    cos, signed_sin = torch.rand(t, d, generator=g), torch.rand(t, d, generator=g)
    tables, lens = torch.tensor([[0], [1], [2]], dtype=torch.int32), torch.tensor([1, 2, 3], dtype=torch.int32)
    slots = torch.tensor([0, 5, 10], dtype=torch.int32)
    outs, pools = [], []
    for layout in (columns.t(), columns.t().contiguous()):
        k_pool, v_pool = torch.zeros(3, 4, kv_heads, d), torch.zeros(3, 4, kv_heads, d)
        view = layout.view(t, -1, d)
        outs.append(rotary_decode_attention(view, heads, cos, signed_sin, k_pool, v_pool, slots, tables, lens))
        pools.append((k_pool, v_pool))
    assert columns.t().view(t, -1, d).stride(-1) != 1
    assert torch.equal(outs[0], outs[1]) and all(torch.equal(a, b) for a, b in zip(*pools))
