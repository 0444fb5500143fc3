"""The serving fast path against the plain one: fused projections, the persistent batch's slots and
buffers, batched penalties, and the CUDA-graph decode path (on the CPU with capture off: the same padded
buffers a graph reads; on CUDA, captured graphs against eager)."""

import numpy as np
import pytest
import torch

from fivefold.config import ConfigError
from fivefold.model import build_model
from fivefold.presets import PRESETS
from fivefold.serve import LLM, SamplingParams
from fivefold.serve.batch import StepInputs
from fivefold.serve.cpu_linear import Product, RoutedLinear, onednn_available, onednn_linear, route_linears
from fivefold.serve.cuda_graphs import DecodeGraphs, batch_ladder
from fivefold.serve.fused import FusedAttention, fuse_projections
from fivefold.serve.sampling import _penalise, apply_penalties, slot_params

GREEDY = dict(temperature=0, ignore_eos=True)


def tiny(preset="tiny", seed=3, **changes):
    import dataclasses
    cfg = dataclasses.replace(PRESETS[preset], **changes)
    return build_model(cfg, seed=seed).eval()


def prompts(count: int, vocab: int, seed: int = 0, longest: int = 60) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, longest, (count,), generator=g).tolist()
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
@torch.no_grad()
def test_fused_projections_keep_names_values_and_logits(preset):
    plain, fused = tiny(preset), tiny(preset)
    count = fuse_projections(fused)
    layers = plain.cfg.num_layers
    assert count == (2 * layers if preset == "tiny" else layers)  # experts are not an MLP: attention only
    assert isinstance(fused.layers[0].attn, FusedAttention)
    before, after = plain.state_dict(), fused.state_dict()
    assert list(before) == list(after)
    for name in before:
        torch.testing.assert_close(after[name], before[name], rtol=0, atol=0)
    attn = fused.layers[0].attn
    # The separate parameters are views into the fused weight: nothing is held twice.
    assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()
    assert attn.v_proj.weight.data_ptr() == attn.qkv_weight[-attn.v_proj.weight.shape[0]:].data_ptr()
    ids = torch.randint(0, plain.cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(fused(ids), plain(ids), rtol=1e-5, atol=1e-5)


def test_engine_update_weights_reaches_the_fused_weights():
    old, new = tiny(seed=3), tiny(seed=4)
    llm = LLM(old)
    assert llm.engine.fused == 2 * old.cfg.num_layers
    ps = prompts(4, old.cfg.vocab_size, seed=1)
    params = SamplingParams(max_tokens=6, **GREEDY)
    llm.engine.update_weights(new.state_dict())
    assert [o.token_ids for o in llm.generate(ps, params)] == [o.token_ids for o in LLM(new).generate(ps, params)]


ONEDNN = pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN")


@ONEDNN
@pytest.mark.parametrize("library", ["oneDNN", "F.linear"])
@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt2", "tiny-moe"])  # SwiGLU, GELU with biases and a tied head, MoE
def test_cpu_linears_routed_to_either_library_compute_what_f_linear_does(preset, library):
    """Every linear and fused product routed to the library chosen for its shape, logits within fp32 rounding
    of F.linear's, in float32 and bfloat16."""
    model = tiny(preset)
    ids = torch.randint(0, model.cfg.vocab_size, (3, 21), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        reference = model(ids)
        fuse_projections(model)
        routed = route_linears(model, choose=lambda shape, dtype, layouts: Product(library, layouts))
        assert set(routed) == {library} and isinstance(model.lm_head, RoutedLinear)
        expected = onednn_linear if library == "oneDNN" else torch.nn.functional.linear
        assert model.lm_head.linear_fn is expected and model.layers[0].attn.linear_fn is expected
        torch.testing.assert_close(model(ids), reference, rtol=1e-5, atol=1e-5)
    bf16 = tiny(preset).to(torch.bfloat16)
    with torch.no_grad():
        reference = bf16(ids).float()
        route_linears(bf16, choose=lambda shape, dtype, layouts: Product(library, layouts))
        torch.testing.assert_close(bf16(ids).float(), reference, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt2", "tiny-moe"])
def test_the_engine_routes_its_cpu_linears_and_gives_serve_linear_torchs_tokens(preset, monkeypatch, tmp_path):
    """serve.linear=auto on a CPU: each product chosen (and said in the path); a batch of greedy requests gives
    the tokens serve.linear=torch gives."""
    monkeypatch.setenv("FIVEFOLD_CACHE", str(tmp_path))
    ps, params = prompts(6, PRESETS[preset].vocab_size, seed=3), SamplingParams(max_tokens=8, **GREEDY)
    ours, plain = LLM(tiny(preset)), LLM(tiny(preset), linear="torch")
    assert sum(ours.engine.linears.values()) > 0 and "the faster product on this CPU: " in ours.engine.path
    assert "; 0 of " in ours.engine.path  # tiny weights: below LAYOUT_MIN_BYTES, not re-laid
    assert not plain.engine.linears and "linears: torch" in plain.engine.path
    assert [o.token_ids for o in ours.generate(ps, params)] == [o.token_ids for o in plain.generate(ps, params)]


@pytest.mark.parametrize("library", ["oneDNN", "F.linear"])
@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt2"])  # untied head; tied head with biases
def test_input_major_block_weights_hold_nothing_twice(preset, library):
    """Where the layout pays, the block products' weights become the transpose of an (in, out) contiguous
    tensor, same names, shapes and values; the fused parts stay views into their fused weight; the embedding
    and LM head keep their layout; the parameters take the same bytes as before; new weights still reach the
    fused product; routing the model again changes nothing."""
    if library == "oneDNN" and not onednn_available():
        pytest.skip("this torch has no oneDNN")
    model = tiny(preset)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    storage = sum(p.untyped_storage().nbytes() for p in {p.untyped_storage().data_ptr(): p
                                                          for p in model.parameters()}.values())
    with torch.no_grad():
        fuse_projections(model)
        for _ in range(2):  # on a machine where every shape is faster so; a second engine on the same model
            route_linears(model, choose=lambda shape, dtype, layouts: Product(library, layouts))
    params = dict(model.named_parameters())
    assert list(params) == list(before)
    for name, p in params.items():
        torch.testing.assert_close(p, before[name], rtol=0, atol=0)
        if name.startswith("layers.") and p.dim() == 2:  # input-major: an output's weights one column apart
            assert p.stride()[0] == 1 and p.stride()[1] >= p.shape[0], name
    attn = model.layers[0].attn
    assert attn.qkv_weight.stride() == (1, attn.qkv_weight.shape[0])
    assert attn.k_proj.weight.data_ptr() == attn.qkv_weight[attn.q_proj.weight.shape[0]:].data_ptr()
    assert attn.o_proj.weight.stride() == (1, attn.o_proj.weight.shape[0])
    assert model.embed_tokens.weight.is_contiguous() and model.lm_head.weight.is_contiguous()
    after = sum(p.untyped_storage().nbytes() for p in {p.untyped_storage().data_ptr(): p
                                                        for p in model.parameters()}.values())
    assert after == storage
    new = tiny(preset, seed=4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(dict(new.named_parameters())[name])
        ids = torch.randint(0, new.cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(model(ids), new(ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fastest", ["oneDNN plain", "oneDNN input-major", "F.linear plain", "F.linear input-major"])
def test_each_weight_shape_takes_the_product_that_times_fastest_once_per_machine(monkeypatch, tmp_path, fastest,
                                                                                 product_clock):
    import json
    import fivefold.serve.cpu_linear as cl
    calls, shape, expected = [], (1024, 256), cl.Product.parse(fastest)

    def library(name):
        def product(x, weight, bias=None):  # the other library takes longer, and longer still the other layout
            calls.append(1)
            layout = "input-major" if cl.is_input_major(weight) else "plain"
            product_clock.sleep(1e-3 + 1e-3 * (name != expected.library) + 2e-3 * (layout != fastest.split()[-1]))
            return x @ weight.t()
        return product

    monkeypatch.setenv("FIVEFOLD_CACHE", str(tmp_path))
    monkeypatch.setattr(cl, "LIBRARIES", {"oneDNN": library("oneDNN"), "F.linear": library("F.linear")})
    monkeypatch.setattr(cl, "onednn_available", lambda: True)
    monkeypatch.setattr(cl, "_chosen", {})
    monkeypatch.setattr(cl, "LAYOUT_BYTES", 2**20)  # one copy of a 1 MiB weight
    assert cl.chosen_product(shape, torch.float32) == expected
    timed = len(calls)
    assert timed and cl.chosen_product(shape, torch.float32) == expected and len(calls) == timed
    # Kept for the next start: a new process (no choices in memory) reads it instead of timing again.
    saved = json.loads((tmp_path / cl.PRODUCTS_FILE).read_text())
    candidates = "oneDNN plain, oneDNN input-major, F.linear plain, F.linear input-major"
    assert saved == {cl._machine(): {f"1024x256 float32 auto: {candidates} at rows 1,4,8,16,32": fastest}}
    monkeypatch.setattr(cl, "_chosen", {})
    assert cl.chosen_product(shape, torch.float32) == expected and len(calls) == timed
    (tmp_path / cl.PRODUCTS_FILE).write_text("{not json")  # damaged: timed again, and rewritten
    monkeypatch.setattr(cl, "_chosen", {})
    assert cl.chosen_product(shape, torch.float32) == expected and len(calls) > timed
    assert json.loads((tmp_path / cl.PRODUCTS_FILE).read_text()) == saved
    # serve.linear=onednn chooses among oneDNN's layouts only; a weight too small to lay out, the library only.
    assert cl.chosen_product(shape, torch.float32, "onednn").library == "oneDNN"
    assert cl.chosen_product((64, 64), torch.float32) == cl.Product(expected.library)
    assert cl.chosen_product((64, 64), torch.float32, "onednn") == cl.Product("oneDNN")
    # An entry for a product this mode does not choose among (or an older file's) is timed again.
    calls.clear()
    saved[cl._machine()]["1024x256 float32 onednn: oneDNN plain, oneDNN input-major at rows 1,4,8,16,32"] = \
        "F.linear plain"
    (tmp_path / cl.PRODUCTS_FILE).write_text(json.dumps(saved))
    monkeypatch.setattr(cl, "_chosen", {})
    assert cl.chosen_product(shape, torch.float32, "onednn").library == "oneDNN" and calls


def test_a_product_slow_only_between_one_and_sixteen_rows_is_not_chosen(monkeypatch, tmp_path, product_clock):
    """The LM head's case on the Intel host: MKL's product on par with oneDNN's at 1 and 16 rows but twice as slow
    at 4-14. Timed at 1, 4, 8 and 16 rows, the product that is never slow is chosen."""
    import fivefold.serve.cpu_linear as cl

    def product(fast, slow, slow_rows=()):
        def run(x, weight, bias=None):
            product_clock.sleep(slow if x.shape[0] in slow_rows else fast)
            return x @ weight.t()
        return run

    monkeypatch.setenv("FIVEFOLD_CACHE", str(tmp_path))
    # F.linear twice as fast at 1 and 16 rows (what timing at those alone would pick), 4x slower at 4 and 8
    monkeypatch.setattr(cl, "LIBRARIES", {"oneDNN": product(4e-3, 4e-3), "F.linear": product(2e-3, 16e-3, (4, 8))})
    monkeypatch.setattr(cl, "onednn_available", lambda: True)
    monkeypatch.setattr(cl, "_chosen", {})
    monkeypatch.setattr(cl, "LAYOUT_BYTES", 2**20)
    assert cl.chosen_product((1024, 256), torch.float32, layouts=False) == cl.Product("oneDNN")


def test_a_product_that_cannot_run_the_dtype_is_left_out(monkeypatch, tmp_path, product_clock):
    """oneDNN has no float16 inner product on a CPU without AVX-512 FP16 (this host's: "could not create a
    primitive descriptor"): timing leaves out a product that raises, so a float16 engine starts, with
    serve.linear=torch's tokens, where it used to stop with oneDNN's error."""
    import fivefold.serve.cpu_linear as cl

    def fast(x, weight, bias=None):
        raise RuntimeError("could not create a primitive descriptor for the inner product")

    def slow(x, weight, bias=None):
        product_clock.sleep(1e-2)
        return x @ weight.t()
    monkeypatch.setenv("FIVEFOLD_CACHE", str(tmp_path))
    monkeypatch.setattr(cl, "LIBRARIES", {"oneDNN": fast, "F.linear": slow})
    monkeypatch.setattr(cl, "onednn_available", lambda: True)
    monkeypatch.setattr(cl, "_chosen", {})
    assert cl.chosen_product((1024, 256), torch.float16, layouts=False) == cl.Product("F.linear")
    monkeypatch.undo()
    monkeypatch.setenv("FIVEFOLD_CACHE", str(tmp_path))
    half = LLM(tiny().to(torch.float16))
    assert set(half.engine.linears) <= {"oneDNN", "F.linear"}
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert half.generate([[1, 2, 3]], greedy)[0].token_ids == \
        LLM(tiny().to(torch.float16), linear="torch").generate([[1, 2, 3]], greedy)[0].token_ids


def test_a_bad_serve_linear_is_refused():
    with pytest.raises(ConfigError, match=r"serve.linear.*auto, onednn, torch"):
        LLM(tiny(), linear="mkl")


def test_without_onednn_auto_falls_back_and_onednn_is_refused(monkeypatch):
    import fivefold.serve.cpu_linear as cpu_linear
    monkeypatch.setattr(cpu_linear, "onednn_available", lambda: False)
    # auto: F.linear, its layout chosen (or fivefold's rows kernel where it runs and timed faster)
    assert set(LLM(tiny()).engine.linears) <= {"F.linear", "rows kernel", "rows kernel+F.linear"}
    assert set(LLM(tiny(), cpu_kernel="false").engine.linears) == {"F.linear"}
    with pytest.raises(ConfigError, match="serve.linear=onednn cannot be used here: this torch has no oneDNN; set "
                                          "serve.linear=auto or torch"):
        LLM(tiny(), linear="onednn")


def test_onednn_without_the_engines_dtype_is_refused_at_start(monkeypatch):
    """serve.linear=onednn where oneDNN cannot multiply the engine's dtype (float16 on a CPU without AVX-512 FP16,
    as on this project's hosts; elsewhere such a CPU stood in for) stops at start with what to set, not at the
    first product with oneDNN's own error."""
    import fivefold.serve.cpu_linear as cpu_linear
    from fivefold.serve.cpu_linear import onednn_problem
    if onednn_problem(torch.float16) is None:
        real = cpu_linear.onednn_linear

        def no_half(x, weight, bias=None):
            if x.dtype == torch.float16:
                raise RuntimeError("could not create a primitive descriptor")
            return real(x, weight, bias)
        monkeypatch.setattr(cpu_linear, "onednn_linear", no_half)
    assert onednn_problem(torch.float32) is None
    with pytest.raises(ConfigError, match="serve.linear=onednn cannot be used here: oneDNN has no float16 product on "
                                          "this CPU; set serve.linear=auto or torch"):
        LLM(tiny().to(torch.float16), linear="onednn")


def test_slots_are_reused_and_all_returned():
    model = tiny()
    llm = LLM(model, max_num_seqs=4, num_blocks=40)
    engine = llm.engine
    ps = prompts(10, model.cfg.vocab_size, seed=2)
    outs = llm.generate(ps, [SamplingParams(max_tokens=3 + i, **GREEDY) for i in range(10)])
    assert sorted(engine.batch.free) == [0, 1, 2, 3]  # 10 requests through 4 slots, every slot back
    alone = [LLM(model).generate(p, SamplingParams(max_tokens=3 + i, **GREEDY))[0].token_ids for i, p in enumerate(ps)]
    assert [o.token_ids for o in outs] == alone


def test_batched_penalties_equal_the_per_row_rule():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=g)
    reqs = []
    for i in range(5):
        params = SamplingParams(repetition_penalty=1.0 + 0.3 * i, presence_penalty=0.1 * i, frequency_penalty=0.2 - 0.1 * i)
        prompt = torch.randint(0, 50, (3 + i,), generator=g).tolist()
        # Few ids, so outputs repeat some: where a presence penalty and a frequency penalty differ.
        output = torch.randint(0, 4, (2 * i,), generator=g).tolist()
        reqs.append(type("R", (), dict(params=params, prompt_ids=prompt, output_ids=output))())
    assert any(len(set(r.output_ids)) < len(r.output_ids) for r in reqs if r.params.presence_penalty)
    expected = torch.stack([apply_penalties(logits[i].clone(), r.params, r.prompt_ids, r.output_ids)
                            for i, r in enumerate(reqs)])
    got = logits.clone()
    _penalise(got, np.arange(5), slot_params(reqs, uniforms=[0.5] * 5), reqs)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_padded_step_rows_are_inert():
    step = StepInputs.empty().padded(3)
    assert step.slot_mapping.tolist() == [-1, -1, -1] and step.seq_lens.tolist() == [0, 0, 0]
    assert step.query_start_loc.tolist() == [0, 1, 2, 3] and step.decode_only
    assert batch_ladder(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_ladder(5) == [1, 2, 4, 5] and batch_ladder(1) == [1]


@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt2"])
def test_graph_buffers_without_capture_give_the_eager_tokens(preset):
    """Decode steps through the CUDA-graph path's padded static buffers (capture off: the CPU runs the
    same forward eagerly) at every ladder size a shrinking batch meets: tokens equal the plain engine's,
    greedy and seeded sampling alike."""
    model = tiny(preset)
    ps = prompts(11, model.cfg.vocab_size, seed=3)
    params = [SamplingParams(max_tokens=2 + 2 * i, ignore_eos=True, temperature=0 if i % 2 else 0.8, top_p=0.9,
                             seed=i) for i in range(11)]
    plain = LLM(model, max_num_seqs=16).generate(ps, params)
    llm = LLM(model, max_num_seqs=16)
    engine = llm.engine
    engine.graphs = DecodeGraphs(engine.model, engine.pool, engine.buffers, 16, kernel=False, capture=False)
    sizes = []
    run = engine.graphs.run
    engine.graphs.run = lambda step, pending=None: (sizes.append(engine.graphs.size_for(step.num_seqs)), run(step, pending))[1]
    padded = llm.generate(ps, params)
    assert [o.token_ids for o in padded] == [o.token_ids for o in plain]
    assert {1, 2, 4, 8, 16} <= set(sizes)  # 11 running pads to 16, and the batch shrinks through the ladder


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@torch.no_grad()
def test_cuda_graph_replay_equals_eager_at_every_ladder_size():
    model = tiny().cuda()
    llm = LLM(model, device="cuda", max_num_seqs=24, cuda_graphs="true")
    eager = LLM(tiny().cuda(), device="cuda", max_num_seqs=24, cuda_graphs="false")
    assert llm.engine.graphs is not None and eager.engine.graphs is None
    for n in batch_ladder(24):
        ps = prompts(n, model.cfg.vocab_size, seed=n)
        p = SamplingParams(max_tokens=5, **GREEDY)
        assert [o.token_ids for o in llm.generate(ps, p)] == [o.token_ids for o in eager.generate(ps, p)]


@cuda
@torch.no_grad()
def test_cuda_fused_launches_give_the_separate_kernels_outputs():
    """serve.fuse_launches on a GPU (RoPE in the KV store's kernel, residual adds in the norms', through the
    graphs and the eager prefill steps) against the separate kernels: the same tokens and finish reasons,
    logprobs to 1e-5 (the GPU's compiler may contract the rotation's products differently in each kernel)."""
    ps, params = mixed_requests(tiny())
    fused = LLM(tiny().cuda(), device="cuda", max_num_seqs=8, max_num_batched_tokens=64)
    plain = LLM(tiny().cuda(), device="cuda", max_num_seqs=8, max_num_batched_tokens=64, fuse_launches=False)
    assert fused.engine.residuals_fused and not plain.engine.residuals_fused
    assert_same_outputs(outputs(fused, ps, params), outputs(plain, ps, params))


@cuda
def test_cuda_greedy_equals_transformers():
    from transformers import LlamaConfig, LlamaForCausalLM

    from fivefold.interop.hf import hf_config_from, weights_to_hf

    model = tiny()
    hf = LlamaForCausalLM(LlamaConfig(**hf_config_from(model.cfg, "llama")))
    hf.load_state_dict(weights_to_hf(model.state_dict(), model.cfg), strict=False)
    hf = hf.cuda().eval()
    llm = LLM(model.cuda(), device="cuda")
    for prompt in prompts(4, model.cfg.vocab_size, seed=9):
        ours = llm.generate(prompt, SamplingParams(max_tokens=8, **GREEDY))[0].token_ids
        ids = torch.tensor([prompt], device="cuda")
        theirs = hf.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None)[0, len(prompt):].tolist()
        assert ours == theirs


def mixed_requests(model, count: int = 12):
    """Prompts and parameters that exercise every way a request ends or draws: stop token ids met early,
    max_tokens, seeded sampling with filters, penalties, logprobs."""
    ps = prompts(count, model.cfg.vocab_size, seed=7)
    greedy = LLM(model).generate(ps[0], SamplingParams(max_tokens=8, **GREEDY))[0].token_ids
    params = []
    for i in range(count):
        kind = i % 4
        params.append(SamplingParams(max_tokens=4 + i, ignore_eos=True, seed=i,
                                     temperature=0 if kind == 0 else 0.9, top_k=20 if kind == 1 else 0,
                                     top_p=0.9 if kind == 2 else 1.0, repetition_penalty=1.3 if kind == 3 else 1.0,
                                     frequency_penalty=0.5 if kind == 3 else 0.0, logprobs=2 if kind == 1 else None,
                                     stop_token_ids=[greedy[2]] if kind == 0 else []))
    return ps, params


def outputs(llm, ps, params):
    return [(o.token_ids, o.finish_reason, o.logprobs) for o in llm.generate(ps, params)]


def assert_same_outputs(got, expected):
    """Tokens and finish reasons exactly; logprobs to 1e-5 (another batch shape rounds the matmuls apart)."""
    assert [(t, r) for t, r, _ in got] == [(t, r) for t, r, _ in expected]
    for (_, _, a), (_, _, b) in zip(got, expected):
        assert (a is None) == (b is None)
        for x, y in zip(a or [], b or []):
            assert x["token_id"] == y["token_id"] and [i for i, _ in x["top"]] == [i for i, _ in y["top"]]
            assert x["logprob"] == pytest.approx(y["logprob"], abs=1e-5)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-buffers"])
@pytest.mark.parametrize("num_blocks", [0, 14], ids=["roomy", "preempting"])
def test_async_scheduling_gives_the_synchronous_outputs(graphs, num_blocks):
    """Step n+1 scheduled and launched before step n's tokens reach the host (its decode inputs read from
    the device): tokens, finish reasons and logprobs equal the synchronous engine's, when a stop token ends
    a request a step early (its extra row dropped), with seeded filters and penalties, and under preemption."""
    model = tiny()
    ps, params = mixed_requests(model)
    options = dict(max_num_seqs=8, max_num_batched_tokens=48, block_size=4)
    if num_blocks:
        options["num_blocks"] = num_blocks
    sync = LLM(model, async_scheduling="false", **options)
    asynchronous = LLM(model, async_scheduling="true", **options)
    assert asynchronous.engine.async_scheduling and not sync.engine.async_scheduling
    if graphs:
        e = asynchronous.engine
        e.graphs = DecodeGraphs(e.model, e.pool, e.buffers, 8, kernel=False, capture=False)
    expected = outputs(sync, ps, params)
    assert any(reason == "stop" for _, reason, _ in expected)  # a stop token ended some request early
    assert_same_outputs(outputs(asynchronous, ps, params), expected)
    assert asynchronous.engine.pending is None and sorted(asynchronous.engine.batch.free) == list(range(8))
    assert asynchronous.engine.blocks.num_free == sync.engine.blocks.num_free
    if num_blocks:
        assert asynchronous.engine.scheduler.preemptions > 0


def test_async_scheduling_abort_and_new_weights_between_steps():
    """An abort while a request's token is still on the device drops that token; new weights take in the
    tokens drawn under the old ones first. Both as the synchronous engine does them."""
    old, new = tiny(seed=3), tiny(seed=4)
    ps = prompts(4, old.cfg.vocab_size, seed=11)
    runs = {}
    for mode in ("false", "true"):
        engine = LLM(tiny(seed=3), async_scheduling=mode).engine
        ids = [engine.add_request(p, SamplingParams(max_tokens=10, **GREEDY)) for p in ps]
        done = {}
        for i in range(4):
            for out in engine.step():
                done[out.request_id] = out
        engine.abort(ids[0])
        engine.update_weights(new.state_dict())
        while engine.has_unfinished():
            for out in engine.step():
                done[out.request_id] = out
        runs[mode] = {k: (v.token_ids, v.finish_reason) for k, v in done.items() if v.finished}
        assert PLACEHOLDER_FREE(done.values())
    assert runs["true"] == runs["false"]
    assert ids[0] not in runs["true"] and len(runs["true"]) == 3


def PLACEHOLDER_FREE(outs) -> bool:
    return all(t >= 0 for o in outs for t in o.token_ids)


def test_fast_path_options_refuse_what_cannot_run_here(monkeypatch):
    """One-line errors naming the fix: graphs forced on a CPU, the Triton kernel without a GPU or the
    interpreter, a value that is not a choice; booleans from the Python API are taken as the switches."""
    from fivefold.config import ConfigError

    model = tiny()
    with pytest.raises(ConfigError, match="serve.cuda_graphs=true cannot be used here: the device is not CUDA"):
        LLM(model, cuda_graphs=True)
    with pytest.raises(ConfigError, match="serve.cuda_graphs='maybe' is not valid; choose one of auto, true, false"):
        LLM(model, cuda_graphs="maybe")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    import fivefold.kernels as kernels
    monkeypatch.setattr(kernels, "triton_available", lambda: False)
    monkeypatch.setattr(kernels, "_unavailable", lambda: "no CUDA GPU is available to compile them for")
    with pytest.raises(ConfigError, match="serve.kernels=triton cannot run here: no CUDA GPU.*use serve.kernels=torch"):
        LLM(model, kernels="triton")
    engine = LLM(model, cuda_graphs=False, async_scheduling=False).engine
    assert engine.cfg.cuda_graphs == "false" and engine.graphs is None and not engine.async_scheduling
