"""Model: parameter counts, deterministic layout-independent init, attention implementations, masks, KV cache."""

import dataclasses
import random

import pytest
import torch

from fivefold.config import ModelConfig
from fivefold.memory.formulas import count_params
from fivefold.model import ForwardContext, build_model, doc_ids_from_tokens, initial_value, meta_model
from fivefold.presets import PRESETS, REAL_PARAM_COUNTS
from model_shapes import random_model_config


@pytest.mark.parametrize("name", sorted(REAL_PARAM_COUNTS))
def test_preset_param_counts_equal_real_models(name):
    cfg = PRESETS[name]
    assert count_params(cfg) == REAL_PARAM_COUNTS[name]
    assert sum(p.numel() for p in meta_model(cfg).parameters()) == REAL_PARAM_COUNTS[name]


def test_param_count_formula_matches_built_model_for_random_shapes():
    rng = random.Random(0)
    for _ in range(60):
        cfg = random_model_config(rng)
        assert count_params(cfg) == sum(p.numel() for p in meta_model(cfg).parameters()), cfg


def test_init_depends_only_on_seed_and_name():
    cfg = PRESETS["tiny"]
    a, b = build_model(cfg, seed=7), build_model(cfg, seed=7)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
        # The value is a pure function of (seed, name, shape): what a sharded run slices from.
        assert torch.equal(pa, initial_value(name, pa.shape, cfg, seed=7)), name
    c = build_model(cfg, seed=8)
    assert not torch.equal(a.layers[0].attn.q_proj.weight, c.layers[0].attn.q_proj.weight)
    # A deeper model shares the first layers' initial values: init does not depend on the layout.
    deeper = build_model(ModelConfig(**{**cfg.__dict__, "num_layers": 3}), seed=7)
    assert torch.equal(deeper.layers[1].mlp.up_proj.weight, a.layers[1].mlp.up_proj.weight)
    assert a.layers[0].attn.o_proj.weight.std() < a.layers[0].attn.q_proj.weight.std()  # residual scaling


def test_tied_embeddings_share_storage():
    model = build_model(PRESETS["tiny-gpt2"])
    assert model.lm_head.weight is model.embed_tokens.weight


@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt2"])
def test_sdpa_and_eager_attention_agree(preset):
    cfg = PRESETS[preset]
    sdpa = build_model(cfg, seed=1)
    eager = build_model(ModelConfig(**{**cfg.__dict__, "attention": "eager"}), seed=1)
    ids = torch.randint(0, cfg.vocab_size, (2, 24))
    torch.testing.assert_close(eager(ids), sdpa(ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 2), (4, 4)])
def test_one_query_token_folds_shared_heads_into_rows_exactly(impl, heads, kv_heads):
    """A decode step's attention (one query token, a mask) runs the heads sharing a key/value head as that
    head's query rows; it must equal attention with the keys and values repeated per head, in float64."""
    from fivefold.model.attention import AttentionCore

    cfg = ModelConfig(**{**PRESETS["tiny"].__dict__, "num_heads": heads, "num_kv_heads": kv_heads,
                         "hidden_size": 16 * heads, "attention": impl})
    core = AttentionCore(cfg)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, heads, 1, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(5, kv_heads, 37, 16, generator=g, dtype=torch.float64) for _ in range(2))
    lengths = torch.tensor([37, 1, 20, 33, 9])
    mask = (torch.arange(37) < lengths[:, None])[:, None, None]
    rep = heads // kv_heads
    kr, vr = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = (q @ kr.transpose(-2, -1)) / 4.0
    want = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ vr
    tol = 1e-12 if impl == "sdpa" else 1e-6  # the eager path's softmax runs in float32 by design
    out = core(q, k, v, mask)
    torch.testing.assert_close(out, want, rtol=tol, atol=tol)
    # Row b's output depends on row b alone: batch companions (another length, another mask) change nothing.
    assert torch.equal(core(q[2:3], k[2:3], v[2:3], mask[2:3]), out[2:3])


def test_causality_and_document_mask():
    cfg = ModelConfig(**{**PRESETS["tiny"].__dict__, "document_mask": True})
    model = build_model(cfg, seed=2)
    ids = torch.randint(1, cfg.vocab_size, (1, 20))
    ids[0, 7] = cfg.eos_token_id  # document 0 is tokens 0..7, document 1 starts at 8
    doc_ids = doc_ids_from_tokens(ids, cfg.eos_token_id)
    assert doc_ids[0, 7] == 0 and doc_ids[0, 8] == 1
    base = model(ids, ForwardContext(doc_ids=doc_ids))
    changed = ids.clone()
    changed[0, 2] = (ids[0, 2] + 1) % cfg.vocab_size
    out = model(changed, ForwardContext(doc_ids=doc_ids_from_tokens(changed, cfg.eos_token_id)))
    torch.testing.assert_close(out[0, 8:], base[0, 8:], rtol=0, atol=0)  # later document unaffected
    assert not torch.allclose(out[0, 2:8], base[0, 2:8])
    # Without the document mask, later tokens do see the earlier document; earlier never see later.
    plain = model(ids)
    later_changed = ids.clone()
    later_changed[0, 15] = (ids[0, 15] + 1) % cfg.vocab_size
    torch.testing.assert_close(model(later_changed)[0, :15], plain[0, :15], rtol=0, atol=0)


def test_materialising_keeps_parameter_identity_ties_and_gradient_hooks():
    """Parallelism registers gradient hooks (e.g. SP's all-reduce of norm gradients) on the meta model;
    giving a parameter memory must keep the object, its ties and those hooks."""
    from fivefold.model.init import give_memory

    model = meta_model(dataclasses.replace(PRESETS["tiny"], tie_embeddings=True))
    weight = model.embed_tokens.weight
    weight.register_hook(lambda g: g * 2)
    give_memory(weight, torch.ones(weight.shape))
    assert model.embed_tokens.weight is weight is model.lm_head.weight and weight.device.type == "cpu"
    weight.sum().backward()
    assert torch.equal(weight.grad, torch.full(weight.shape, 2.0))
