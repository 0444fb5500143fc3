"""The torch path's blocks as one loop of tensor ops (fivefold.serve.lean_forward) against the model's own
modules: the same logits and the same KV pool, bit for bit, step after step; and the models and hooks it
must leave to the modules."""

import dataclasses
import pytest
import torch

from fivefold.model import ForwardContext, build_model
from fivefold.presets import PRESETS
from fivefold.serve import LLM, SamplingParams
from fivefold.serve.cpu_linear import Product, onednn_available, route_linears
from fivefold.serve.fused import fuse_projections
from fivefold.serve.kv_pool import KVPool, PagedBatch, kv_plan
from fivefold.serve.lean_forward import LeanTransformer, lean_blocks, use_lean_forward
from paged_steps import admitted

GREEDY = dict(temperature=0, ignore_eos=True)


def tiny(preset="tiny", seed=3, dtype=torch.float32, **changes):
    """A tiny model whose norms have weights other than ones (at ones, multiplying by the weight before or
    after the cast back would agree)."""
    cfg = dataclasses.replace(PRESETS[preset], max_seq_len=256, **changes)
    model = build_model(cfg, seed=seed, dtype=dtype).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    return model


def served(model, onednn: bool):
    """The model as an engine prepares it for the torch path: fused, on oneDNN where asked (each weight
    laid out input-major, the layout the 576-wide products take), then the lean loop."""
    assert fuse_projections(model) == 2 * model.cfg.num_layers
    if onednn:
        route_linears(model, choose=lambda shape, dtype, layouts: Product("oneDNN", layouts))
    assert use_lean_forward(model) and type(model) is LeanTransformer
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["gqa", "qkv-bias", "mha-eager-attention", "onednn"])
@torch.no_grad()
def test_the_loop_gives_the_modules_logits_and_pool_bit_for_bit(case, dtype):
    """Three sequences through scattered blocks in chunks with and without earlier context, single-token
    decodes mixed with chunks, decode-only steps (one group in row order, and out of order), a step padded
    with inert rows: at every step the loop's logits and pool equal the modules' exactly."""
    if case == "onednn" and not onednn_available():
        pytest.skip("this torch has no oneDNN")
    changes = {"qkv-bias": dict(qkv_bias=True), "mha-eager-attention": dict(num_kv_heads=4, attention="eager")}
    model = served(tiny(dtype=dtype, **changes.get(case, {})), onednn=case == "onednn")
    cfg = model.cfg
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (23, 13, 9)]
    plan = kv_plan(cfg, 1, 4, dtype, num_blocks=24)
    pools = {lean: KVPool(cfg, plan, "cpu", dtype) for lean in (True, False)}
    tables = [[3, 9, 1, 14, 6, 12, 20], [0, 7, 2, 11], [5, 8, 21]]
    # (tokens already computed, tokens this step) per sequence; 0 tokens: not in the step
    steps = [[(0, 5), (0, 3), (0, 0)], [(5, 1), (3, 7), (0, 4)], [(6, 1), (10, 1), (4, 1)],
             [(7, 1), (11, 1), (5, 1)], [(8, 14), (12, 1), (6, 3)], [(22, 1), (0, 0), (9, 0)]]
    batch, buffers, rows = admitted(seqs, tables, block_size=4, max_model_len=28, rows=4)  # 4: the padded step
    wholes = []
    for i, step in enumerate(steps):
        work = [(rows[j], n) for j, (past, n) in enumerate(step) if n]
        for j, (past, n) in enumerate(step):
            rows[j].num_computed = past
        # decodes first; in step 3 the longest decode first, so its group is out of row order
        work.sort(key=lambda e: (e[1] != 1, -len(e[0].token_ids[:e[0].num_computed]) if i == 3 else 0))
        inputs = batch.prepare(work)
        if i == 2:
            inputs = inputs.padded(4)
        dev = buffers.upload(inputs)
        logits = {}
        for lean in (True, False):
            paged = PagedBatch(pools[lean], dev, inputs, fused_launches=lean)
            ctx = ForwardContext(positions=paged.positions, kv_cache=paged, mask=paged,
                                 logits_at=torch.arange(inputs.num_tokens))
            logits[lean] = model(dev.input_ids[None], ctx)
            wholes.append(paged.whole)
        assert torch.equal(logits[True], logits[False]), f"step {i}"
        assert torch.equal(pools[True].k, pools[False].k) and torch.equal(pools[True].v, pools[False].v)
    assert True in wholes and False in wholes  # both of attend_heads' decode branches ran


@torch.no_grad()
def test_the_loop_follows_the_full_forward_through_the_engine():
    """Greedy tokens through the engine with the loop equal full forwards' (no cache at all) and the engine
    without it; the engine says which path it took."""
    model = tiny()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (1, 5, 17, 40, 9, 63)]
    params = [SamplingParams(max_tokens=3 + 4 * i, **GREEDY) for i in range(len(prompts))]
    plain = LLM(model, fuse_launches=False)
    assert not plain.engine.lean and "one loop" not in plain.engine.path
    expected = plain.generate(prompts, params)
    llm = LLM(model)
    assert llm.engine.lean and "blocks as one loop of tensor ops" in llm.engine.path
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    ids = list(prompts[2])
    for _ in range(params[2].max_tokens):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert got[2].token_ids == ids[len(prompts[2]):]


@pytest.mark.parametrize("preset", ["tiny-gpt2", "tiny-moe"])
def test_models_the_loop_does_not_reproduce_keep_their_modules(preset):
    model = tiny(preset)
    llm = LLM(model)
    assert not llm.engine.lean and type(llm.engine.model) is not LeanTransformer


@torch.no_grad()
def test_a_hook_or_an_unfused_block_sends_the_step_through_the_modules():
    """A hook on any module whose work the loop does, added after the swap, runs (the step takes the
    modules); so does a global hook; an engine with LoRA adapters unfusing the shared model stops the loop."""
    model = tiny()
    llm = LLM(model)
    assert llm.engine.lean and lean_blocks(model) is not None
    block = model.layers[1]
    for module in (model, block, block.attn_norm, block.attn, block.attn.core, block.attn.o_proj, block.mlp_norm,
                   block.mlp, block.mlp.down_proj, model.norm, model.lm_head, model.embed_tokens):
        calls = []
        handle = module.register_forward_hook(lambda m, args, out: calls.append(1))
        assert lean_blocks(model) is None
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, **GREEDY))
        handle.remove()
        assert calls, type(module).__name__
    assert lean_blocks(model) is not None
    calls = []
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, args, out: calls.append(1))
    try:
        assert lean_blocks(model) is None
    finally:
        handle.remove()
    block.attn.__class__ = type(block.attn).__bases__[0]  # what unfuse_projections does to each module
    assert lean_blocks(model) is None
