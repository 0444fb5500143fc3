"""fivefold's rows kernel (fivefold.kernels.cpu_linear_rows): a linear's product at a decode's 4-32 rows on a
CPU, against float64 products; each row's result independent of its companions and of the thread count;
the wrapper handing other cases to F.linear; one op under torch.compile; chosen per shape among the
libraries (fivefold.serve.cpu_linear) and giving the libraries' tokens in the engine."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fivefold.serve.cpu_linear as cl
from fivefold.kernels import cpu_build
from fivefold.kernels.cpu_linear_rows import MIN_ROWS, linear_rows, max_rows, rows_kernel_problem
from fivefold.model import build_model
from fivefold.presets import PRESETS
from fivefold.serve import LLM, SamplingParams
from fivefold.serve.fused import fuse_projections

if rows_kernel_problem():
    pytest.skip(f"the rows kernel cannot run here: {rows_kernel_problem()}", allow_module_level=True)

GREEDY = dict(temperature=0.0, ignore_eos=True)


def kernel(x, w, width=0):
    """The C++ product itself, at any row count (the wrapper sends only MIN_ROWS..max_rows() rows to it): the
    widest tiles built here, or the AVX2 ones (width 256)."""
    return cpu_build.build()[0].linear_rows(x, w, width)


# The tile widths this build has: an AVX-512 build runs the AVX2 tiles too, so both are tested on such a host.
WIDTHS = sorted({cpu_build.build()[0].linear_rows_width(), 256})
DOT = cpu_build.build()[0].bf16_pairs()  # bfloat16 rows multiplied as bfloat16 pairs (AVX512_BF16)


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def assert_within_float32_sums(y, x, w):
    """y = x w^T to float32 rounding: each output within K ulps-worth (2^-24 K) of the sum of |x_k w_k|, its
    float64 value's error bound for any order of float32 additions (a tree's is far smaller: the check also
    asserts the error is under 1e-5 of that bound's scale times sqrt K)."""
    exact = x.double() @ w.double().t()
    scale = x.double().abs() @ w.double().abs().t()
    k = x.shape[1]
    err = (y.double() - exact).abs()
    assert bool((err <= 2.0**-24 * k * scale + 1e-30).all()), float((err / scale.clamp_min(1e-30)).max())
    assert float((err / scale.clamp_min(1e-30)).max()) < 1e-6 * k ** 0.5


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("k", [1, 7, 8, 9, 15, 16, 17, 100, 576])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 37])
def test_every_tail_of_rows_columns_and_k_against_float64(n, k, width):
    """Full tiles and every tail: rows 1-3 past a multiple of 4, weight rows 1-3 past a tile's 4 (AVX-512) or
    3 (AVX2), K not a multiple of the 16 or 8 lanes (masked loads)."""
    w = randn(n, k, seed=1)
    for m in (1, 2, 3, 4, 5, 7, 16, 33):
        x = randn(m, k, seed=m)
        y = kernel(x, w, width)
        assert y.shape == (m, n) and y.dtype == torch.float32
        assert_within_float32_sums(y, x, w)


@pytest.mark.parametrize("width", WIDTHS)
def test_a_real_shape_and_strided_rows(width):
    """smollm2-135m's down projection (K 1536) at 4 and 32 rows, and x and w given as row slices of wider
    tensors (row strides larger than K)."""
    w = randn(576, 1536, seed=3)
    for m in (4, 32):
        x = randn(m, 1536, seed=m)
        assert_within_float32_sums(kernel(x, w, width), x, w)
    wide_x, wide_w = randn(9, 700, seed=5), randn(50, 600, seed=6)
    x, w = wide_x[:, 10:110], wide_w[:, :100]
    assert x.stride(0) == 700 and w.stride(0) == 600
    torch.testing.assert_close(kernel(x, w, width), kernel(x.contiguous(), w.contiguous(), width), rtol=0, atol=0)


@pytest.mark.parametrize("width", WIDTHS)
def test_a_row_alone_equals_the_row_in_any_batch_and_any_thread_count(width):
    """Each output is one dot product summed in one order: a row's result is bit for bit the same alone, at
    any position of a batch of any size, and on 1 or 2 threads (the engine's batch-independence guarantee)."""
    w = randn(203, 576, seed=7)
    batch = randn(32, 576, seed=8)
    alone = torch.cat([kernel(batch[i:i + 1], w, width) for i in range(32)])
    for m in (2, 3, 4, 5, 13, 32):
        torch.testing.assert_close(kernel(batch[:m], w, width), alone[:m], rtol=0, atol=0)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(batch, w, width)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(one, alone, rtol=0, atol=0)


def test_the_wrapper_runs_the_kernel_only_where_it_applies():
    """MIN_ROWS..max_rows() float32 rows over an (out, in) weight: the kernel (any leading shape, a bias
    added); anything else: F.linear itself, bit for bit (fewer or more rows, an input-major weight, float16,
    autograd)."""
    w, b = randn(64, 48, seed=9), randn(64, seed=10)
    with torch.no_grad():
        for m in (MIN_ROWS, 9, max_rows()):
            x = randn(m, 48, seed=m)
            torch.testing.assert_close(linear_rows(x, w), kernel(x, w), rtol=0, atol=0)
            torch.testing.assert_close(linear_rows(x, w, b), kernel(x, w) + b, rtol=0, atol=0)
        x3 = randn(2, 3, 48, seed=11)  # 6 rows as (2, 3)
        torch.testing.assert_close(linear_rows(x3, w), kernel(x3.reshape(6, 48), w).view(2, 3, 64), rtol=0, atol=0)
        for m in (1, MIN_ROWS - 1, max_rows() + 1):
            x = randn(m, 48, seed=m)
            assert torch.equal(linear_rows(x, w, b), F.linear(x, w, b))
        x = randn(8, 48, seed=12)
        major = w.t().contiguous().t()
        assert torch.equal(linear_rows(x, major), F.linear(x, major))
        assert torch.equal(linear_rows(x.half(), w.half()), F.linear(x.half(), w.half()))
    leaf = w.clone().requires_grad_()
    linear_rows(x, leaf).sum().backward()  # F.linear's autograd
    torch.testing.assert_close(leaf.grad, x.sum(0).expand(64, 48))


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("k", [1, 7, 8, 9, 15, 16, 17, 100, 576])
def test_bfloat16_weights_widened_as_loaded(k, width):
    """bfloat16 weights (a bfloat16 engine's), read at their 2 bytes and widened to float32 as loaded, every
    tail of rows, weight rows and K: the float32 product of the same values to float32 rounding, and a row alone
    bit for bit the row in a batch."""
    for n in (1, 3, 5, 37):
        w = randn(n, k, seed=20 + n).bfloat16()
        for m in (1, 3, 4, 7, 33):
            x = randn(m, k, seed=m)
            y = kernel(x, w, width)
            assert y.shape == (m, n) and y.dtype == torch.float32
            assert_within_float32_sums(y, x, w.float())
    w, batch = randn(203, k, seed=7).bfloat16(), randn(32, k, seed=8)
    alone = torch.cat([kernel(batch[i:i + 1], w, width) for i in range(32)])
    for m in (2, 5, 32):
        torch.testing.assert_close(kernel(batch[:m], w, width), alone[:m], rtol=0, atol=0)


@pytest.mark.skipif(not DOT, reason="this CPU has no AVX512_BF16: bfloat16 rows are widened to float32 first")
@pytest.mark.parametrize("k", [1, 2, 31, 32, 33, 63, 64, 65, 576])
def test_bfloat16_rows_multiplied_as_bfloat16_pairs(k):
    """bfloat16 rows over bfloat16 weights, 32 elements an instruction in pairs (AVX512_BF16), every tail of rows,
    weight rows and K (odd K splits a pair, masked loads): small integers, whose products and float32 sums are
    exact, give exactly the float64 product rounded once to bfloat16; random values give it within half a
    bfloat16 step (plus the float32 sums' error); and a row alone is bit for bit the row in any batch."""
    for n in (1, 3, 4, 5, 37):
        gen = torch.Generator().manual_seed(30 + n + k)
        w = torch.randint(-3, 4, (n, k), generator=gen).bfloat16()
        for m in (1, 3, 4, 5, 7, 33):
            x = torch.randint(-3, 4, (m, k), generator=gen).bfloat16()
            y = kernel(x, w)
            assert y.dtype == torch.bfloat16 and y.shape == (m, n)
            assert torch.equal(y, (x.double() @ w.double().t()).bfloat16())
            b = torch.randint(-3, 4, (n,), generator=gen).bfloat16()  # a bias joins the float32 sums
            biased = cpu_build.build()[0].linear_rows(x, w, 0, b)
            assert torch.equal(biased, (x.double() @ w.double().t() + b.double()).bfloat16())
    w, batch = randn(203, k, seed=31).bfloat16(), randn(32, k, seed=32).bfloat16()
    exact = batch.double() @ w.double().t()
    scale = batch.double().abs() @ w.double().abs().t()
    alone = torch.cat([kernel(batch[i:i + 1], w) for i in range(32)])
    err = (alone.double() - exact).abs()
    assert bool((err <= 2.0**-8 * exact.abs() + 2.0**-24 * k * scale + 1e-30).all()), float((err / exact.abs()).max())
    for m in (2, 5, 32):
        torch.testing.assert_close(kernel(batch[:m], w), alone[:m], rtol=0, atol=0)
    wide = randn(32, k + 40, seed=33).bfloat16()  # rows that are a view with a longer stride
    torch.testing.assert_close(kernel(wide[:, 3:3 + k], w), kernel(wide[:, 3:3 + k].contiguous(), w), rtol=0, atol=0)


def test_the_wrapper_in_bfloat16_rounds_once():
    """bfloat16 rows over a bfloat16 weight: the kernel's float32 sums, a bias added in float32, then one rounding
    to bfloat16; so within half a bfloat16 step, 2^-8 of the value (plus the sums' float32 error), of the exact
    product, as F.linear's bfloat16 product is (checked beside it)."""
    w, b = randn(64, 48, seed=9).bfloat16(), randn(64, seed=10).bfloat16()
    module = cpu_build.build()[0]
    with torch.no_grad():
        for m in (MIN_ROWS, 9, max_rows()):
            x = randn(m, 48, seed=m).bfloat16()
            y = linear_rows(x, w, b)
            assert y.dtype == torch.bfloat16
            assert torch.equal(y, module.linear_rows(x, w, 0, b))
            for width in WIDTHS:  # the float32 sums: the kernel's product over rows it rounds or widens itself
                sums = module.linear_rows(x.float(), w, width) if width == 256 or not DOT else None
                if sums is not None:
                    assert torch.equal(module.linear_rows(x, w, width, b), (sums + b.float()).bfloat16())
            assert torch.equal(linear_rows(x, w), kernel(x, w))  # multiplied (or widened) and rounded in C++
            assert torch.equal(kernel(x, w, 256), kernel(x.float(), w, 256).bfloat16())
            if not DOT:
                assert torch.equal(kernel(x, w), kernel(x.float(), w).bfloat16())
            exact = x.double() @ w.double().t() + b.double()
            for product in (y, F.linear(x, w, b)):
                err = (product.double() - exact).abs()
                assert bool((err <= 2.0**-8 * exact.abs() + 1e-5).all()), float(err.max())


def test_under_torch_compile_it_is_one_op_in_the_graph():
    """serve.compile_decode traces the blocks' loop: the kernel stays one op (no graph break), with the
    eager call's result."""
    for dtype in (torch.float32, torch.bfloat16):  # bfloat16: its rows widened and rounded inside the op
        w = randn(96, 64, seed=13).to(dtype)
        x = randn(8, 64, seed=14).to(dtype)
        compiled = torch.compile(lambda a: linear_rows(torch.relu(a), w) * 2, backend="aot_eager", fullgraph=True)
        b = randn(96, seed=15).to(dtype)
        with_bias = torch.compile(lambda a: linear_rows(a, w, b), backend="aot_eager", fullgraph=True)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), kernel(torch.relu(x), w) * 2, rtol=0, atol=0)
            torch.testing.assert_close(with_bias(x), cpu_build.build()[0].linear_rows(x, w, 0, b), rtol=0, atol=0)


def test_it_is_a_candidate_only_where_asked_and_only_in_the_plain_layout(monkeypatch):
    monkeypatch.setattr(cl, "onednn_available", lambda: True)
    rows = cl.Product("rows kernel")
    assert rows in cl.candidates("auto", True, rows_kernel=True)
    assert cl.Product("rows kernel", True) not in cl.candidates("auto", True, rows_kernel=True)
    assert rows not in cl.candidates("auto", True) and rows not in cl.candidates("onednn", True, rows_kernel=True)
    assert cl.Product.parse(str(rows)) == rows and str(rows) == "rows kernel plain"


@pytest.mark.skipif(not cl.onednn_available(), reason="this torch has no oneDNN inner product")
def test_its_three_forms_differ_only_in_who_runs_one_to_three_rows():
    """At MIN_ROWS..max_rows() rows all three forms are the kernel; below, 'rows kernel' is the kernel too,
    '+F.linear' and '+oneDNN' are those libraries bit for bit; past max_rows() all are F.linear. Each a
    candidate in the plain layout only."""
    w, b = randn(64, 48, seed=15), randn(64, seed=16)
    forms = {"rows kernel": None, "rows kernel+F.linear": F.linear, "rows kernel+oneDNN": cl.onednn_linear}
    with torch.no_grad():
        for name, library in forms.items():
            fn = cl.LIBRARIES[name]
            for m in (1, MIN_ROWS - 1):
                x = randn(m, 48, seed=m)
                expected = kernel(x, w) + b if library is None else library(x, w, b)
                torch.testing.assert_close(fn(x, w, b), expected, rtol=0, atol=0)
            for m in (MIN_ROWS, max_rows()):
                x = randn(m, 48, seed=m)
                torch.testing.assert_close(fn(x, w, b), kernel(x, w) + b, rtol=0, atol=0)
            x = randn(max_rows() + 1, 48, seed=17)
            assert torch.equal(fn(x, w, b), F.linear(x, w, b))
    assert {p for p in cl.candidates("auto", True, rows_kernel=True) if "rows" in p.library} == {
        cl.Product(name) for name in forms}


@pytest.mark.parametrize("one_row", ["oneDNN", "F.linear", "kernel"])
def test_the_kernel_is_kept_with_whichever_runs_one_row_fastest(monkeypatch, tmp_path, one_row, product_clock):
    """The kernel fastest at 4-32 rows: kept with the library whose one-row product is fastest (oneDNN's on
    the AMD host, MKL's on the Intel one), or alone where it is itself (beside MKL it lost the AMD host's
    batch-1 decode by half)."""
    def product(library):
        def run(x, weight, bias=None):
            rows = x.shape[0]
            few = library if library in ("oneDNN", "F.linear") else library.partition("+")[2] or "kernel"
            if rows >= MIN_ROWS:  # the kernel's rows: it is the fastest there
                product_clock.sleep(1e-3 if library.startswith("rows kernel") else 3e-3)
            else:
                product_clock.sleep(1e-3 if few == one_row else 3e-3)
            return x @ weight.t()
        return run

    monkeypatch.setenv("FIVEFOLD_CACHE", str(tmp_path))
    names = ["oneDNN", "F.linear", "rows kernel", "rows kernel+F.linear", "rows kernel+oneDNN"]
    monkeypatch.setattr(cl, "LIBRARIES", {name: product(name) for name in names})
    monkeypatch.setattr(cl, "onednn_available", lambda: True)
    monkeypatch.setattr(cl, "_chosen", {})
    monkeypatch.setattr(cl, "LAYOUT_BYTES", 2**20)
    expected = "rows kernel" if one_row == "kernel" else f"rows kernel+{one_row}"
    assert cl.chosen_product((1024, 256), torch.float32, layouts=False, rows_kernel=True) == cl.Product(expected)


def test_a_choice_timed_without_the_kernel_is_timed_again_with_it(monkeypatch, tmp_path, product_clock):
    """The products file keeps choices by their candidates: one timed before the rows kernel existed is not
    read as the choice among candidates that include it."""
    calls = []

    def product(delay):
        def run(x, weight, bias=None):
            calls.append(1)
            product_clock.sleep(delay)
            return x @ weight.t()
        return run

    monkeypatch.setenv("FIVEFOLD_CACHE", str(tmp_path))
    monkeypatch.setattr(cl, "LIBRARIES", {"oneDNN": product(3e-3), "F.linear": product(2e-3), "rows kernel": product(1e-3),
                                          "rows kernel+F.linear": product(4e-3), "rows kernel+oneDNN": product(4e-3)})
    monkeypatch.setattr(cl, "onednn_available", lambda: True)
    monkeypatch.setattr(cl, "_chosen", {})
    monkeypatch.setattr(cl, "LAYOUT_BYTES", 2**20)
    assert cl.chosen_product((1024, 256), torch.float32, layouts=False) == cl.Product("F.linear")
    timed = len(calls)
    assert cl.chosen_product((1024, 256), torch.float32, layouts=False, rows_kernel=True) == cl.Product("rows kernel")
    assert len(calls) > timed


def tiny(preset="tiny", seed=3):
    return build_model(PRESETS[preset], "cpu", seed=seed).eval()


@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt2"])  # SwiGLU, untied; GELU with biases and a tied head
def test_a_model_routed_to_the_kernel_computes_what_f_linear_does(preset):
    """Every linear and fused product on the rows kernel: logits at decode-sized batches (4 and 24 rows) within
    float32 rounding of F.linear's; the weights keep their (out, in) layout."""
    model = tiny(preset)
    with torch.no_grad():
        for rows in (4, 24):
            ids = torch.randint(0, model.cfg.vocab_size, (rows, 1), generator=torch.Generator().manual_seed(rows))
            reference = model(ids)
            routed = tiny(preset)
            fuse_projections(routed)
            counts = cl.route_linears(routed, choose=lambda shape, dtype, layouts: cl.Product("rows kernel"))
            assert set(counts) == {"rows kernel"} and routed.lm_head.linear_fn is cl.rows_kernel_all
            assert all(p.stride(-1) == 1 for p in routed.parameters())
            torch.testing.assert_close(routed(ids), reference, rtol=1e-5, atol=1e-5)


def test_a_model_laid_out_input_major_before_goes_back_to_the_plain_layout_for_it():
    """A second engine on a model the first laid out input-major for the libraries: routed to the rows kernel,
    its block weights are plain again (the kernel reads no other layout), same values and logits."""
    model = tiny()
    ids = torch.randint(0, model.cfg.vocab_size, (6, 1), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model(ids)
        fuse_projections(model)
        cl.route_linears(model, choose=lambda shape, dtype, layouts: cl.Product("F.linear", layouts))
        block = model.layers[0]
        assert cl.is_input_major(block.attn.qkv_weight) and cl.is_input_major(block.mlp.down_proj.weight)
        cl.route_linears(model, choose=lambda shape, dtype, layouts: cl.Product("rows kernel"))
        attn = model.layers[0].attn
        assert all(p.stride(-1) == 1 for p in model.parameters()) and attn.qkv_weight.stride(-1) == 1
        assert attn.k_proj.weight.data_ptr() == attn.qkv_weight[attn.q_proj.weight.shape[0]:].data_ptr()
        torch.testing.assert_close(model(ids), reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 0.05)])
def test_the_engine_takes_it_where_timed_faster_and_gives_the_libraries_tokens(monkeypatch, tmp_path, dtype,
                                                                               tolerance):
    """serve.cpu_kernel=auto offers the kernel to the per-shape choice (here made to pick it), in float32 and for
    a bfloat16 engine's weights too, said in the engine's path; a batch of 8 greedy requests gives the tokens the
    libraries' products give (their logprobs within float32's, or bfloat16's, rounding); serve.cpu_kernel=false
    leaves it out."""
    monkeypatch.setenv("FIVEFOLD_CACHE", str(tmp_path))
    chosen = cl.chosen_product

    def prefer_rows(shape, dtype, mode="auto", layouts=True, rows_kernel=False):
        return cl.Product("rows kernel") if rows_kernel else chosen(shape, dtype, mode, layouts, rows_kernel)
    monkeypatch.setattr(cl, "chosen_product", prefer_rows)
    ours, libraries = LLM(tiny().to(dtype)), LLM(tiny().to(dtype), cpu_kernel="false")
    assert set(ours.engine.linears) == {"rows kernel"} and "rows kernel" in ours.engine.path
    assert "rows kernel" not in libraries.engine.linears
    vocab = PRESETS["tiny"].vocab_size
    ps = [torch.randint(1, vocab, (5 + 3 * i,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(8)]
    params = SamplingParams(max_tokens=12, logprobs=1, **GREEDY)
    a, b = ours.generate(ps, params), libraries.generate(ps, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    diff = max(abs(x["logprob"] - y["logprob"]) for oa, ob in zip(a, b) for x, y in zip(oa.logprobs, ob.logprobs))
    assert diff < tolerance


def test_an_engine_where_the_kernel_cannot_run_keeps_the_libraries(monkeypatch, tmp_path):
    import fivefold.kernels.cpu_linear_rows as rows
    monkeypatch.setenv("FIVEFOLD_CACHE", str(tmp_path))
    monkeypatch.setattr(rows, "rows_kernel_problem", lambda: "this CPU has no AVX-512")
    assert "rows kernel" not in LLM(tiny()).engine.linears
