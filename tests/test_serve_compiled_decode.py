"""The CPU decode step's loop over the blocks compiled by inductor (serve.compile_decode,
fivefold.serve.compiled_decode) against the eager loop it compiles: the same tokens, logprobs and KV pool
to float rounding, through batch-1 decodes (every one compiled) and a batch mixing prefill chunks and decodes
(those steps eager); and the engines that must refuse it."""

import pytest
import torch

from fivefold.config import ConfigError
from fivefold.kernels.cpu_linear_rows import max_rows
import fivefold.serve.cpu_linear as cpu_linear
from fivefold.serve.cpu_linear import Product, onednn_available
from fivefold.serve import LLM, SamplingParams
from fivefold.serve.compiled_decode import CompiledDecodeTransformer
from fivefold.serve.lean_forward import LeanTransformer
from test_serve_lean_forward import tiny

PROMPTS = [list(range(5, 5 + n)) for n in (3, 17, 40)]
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)


def test_compiled_decode_steps_give_the_eager_loops_tokens_logprobs_and_pool(monkeypatch):
    # Products on F.linear whatever this machine would time fastest: oneDNN's do not compile (tested below).
    monkeypatch.setattr(cpu_linear, "chosen_product", lambda shape, dtype, *a: Product("F.linear"))
    runs = {}
    for on in (False, True):
        model = tiny(num_layers=3)
        # serve.cpu_kernel=false: with the C++ block ops a decode step is one C++ call, which the graph defers to
        llm = LLM(model, device="cpu", seed=0, num_blocks=32, block_size=8, compile_decode=on, cpu_kernel="false")
        assert llm.engine.compiled_decode is on
        assert ("one inductor graph" in llm.engine.path) is on
        alone = llm.generate(PROMPTS[1:2], PARAMS)[0]  # 11 decode steps of one row
        compiled_alone = getattr(model, "compiled_steps", 0)
        together = llm.generate(PROMPTS, PARAMS)  # chunks and decodes; the last steps one group
        runs[on] = (alone, together, llm.engine.pool, compiled_alone, getattr(model, "compiled_steps", 0))
    (eager_alone, eager_together, eager_pool, *_), (alone, together, pool, compiled_alone, compiled) = runs.values()
    assert compiled_alone == PARAMS.max_tokens - 1  # every decode of the request alone ran the graph
    assert compiled > compiled_alone  # and some steps of the batch
    for want, got in zip([eager_alone, *eager_together], [alone, *together]):
        assert got.token_ids == want.token_ids
        for w, g in zip(want.logprobs, got.logprobs):
            assert g["token_id"] == w["token_id"] and [i for i, _ in g["top"]] == [i for i, _ in w["top"]]
            assert [g["logprob"], *(lp for _, lp in g["top"])] == pytest.approx(
                [w["logprob"], *(lp for _, lp in w["top"])], abs=1e-5)
    # The registered op stored each step's keys and values where the eager loop did.
    torch.testing.assert_close(pool.k, eager_pool.k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool.v, eager_pool.v, rtol=1e-5, atol=1e-5)


def test_an_engine_without_it_runs_a_compiled_model_eagerly_and_one_without_the_loop_refuses_it():
    model = tiny()
    LLM(model, device="cpu", num_blocks=16, compile_decode=True)
    assert type(model) is CompiledDecodeTransformer
    llm = LLM(model, device="cpu", num_blocks=16)  # the same model, the default: the eager loop
    assert type(model) is LeanTransformer and not llm.engine.compiled_decode
    with pytest.raises(ConfigError, match="serve.fuse_launches=false runs the modules; set serve.compile_decode=false"):
        LLM(tiny(), device="cpu", num_blocks=16, compile_decode=True, fuse_launches=False)


@pytest.mark.parametrize("library", ["oneDNN", "rows kernel"])
def test_steps_the_graph_should_not_run_take_the_eager_path(library, monkeypatch):
    """Products on oneDNN (whose op inductor cannot lower: compiling them failed the step) and decode steps
    whose blocks are one C++ call (faster than the graph, bench/serve_cpu_compile.py) run eagerly under
    serve.compile_decode=true, with the tokens of an engine without it."""
    if library == "oneDNN" and not onednn_available():
        pytest.skip("this torch has no oneDNN")
    if library == "rows kernel" and max_rows() == 0:
        pytest.skip("this CPU has no rows kernel")
    monkeypatch.setattr(cpu_linear, "chosen_product", lambda shape, dtype, *a: Product(library))
    runs = {}
    for on in (False, True):
        model = tiny(num_layers=2)
        llm = LLM(model, device="cpu", seed=0, num_blocks=32, block_size=8, compile_decode=on)
        runs[on] = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
        assert getattr(model, "compiled_steps", 0) == 0
    assert runs[True] == runs[False]
