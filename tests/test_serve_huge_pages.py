"""Weights and KV pool in transparent huge pages (fivefold.serve.huge_pages): the same tensors, values and
logits; memory advised for huge pages; nothing held twice; refused where it cannot run."""

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

import fivefold.serve.engine as engine_module
from fivefold.config import ConfigError
from fivefold.model import build_model
from fivefold.presets import PRESETS
from fivefold.serve import LLM, SamplingParams
from fivefold.serve.huge_pages import HUGE_PAGE, huge_page_bytes, huge_pages_available, move_to_huge_pages

GREEDY = dict(temperature=0, ignore_eos=True)
needs_thp = pytest.mark.skipif(not huge_pages_available(), reason="this kernel offers no transparent huge pages")


def smaps_entry(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds `address`."""
    fields, inside = {}, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                if inside:
                    break
                inside = lo <= address < hi
            elif inside:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
    return fields


@needs_thp
def test_the_arena_starts_on_a_huge_page_and_is_advised_for_them():
    block = huge_page_bytes(3 * HUGE_PAGE + 5)
    assert block.numel() == 3 * HUGE_PAGE + 5 and block.data_ptr() % HUGE_PAGE == 0
    assert int(block.sum()) == 0
    block.fill_(1)  # written through: the kernel backs it now
    entry = smaps_entry(block.data_ptr())
    assert entry["THPeligible"] == "1"
    assert "hg" in entry["VmFlags"].split()  # MADV_HUGEPAGE


def tied(vocab: int = 512):
    """A tiny model with tied embeddings; at vocab 16384 its weights span several huge pages."""
    return build_model(dataclasses.replace(PRESETS["tiny"], tie_embeddings=True, vocab_size=vocab), seed=3).eval()


@torch.no_grad()
def test_moving_keeps_every_tensor_its_values_views_and_ties():
    model = tied()
    LLM(model, huge_pages="false")  # fused and laid out as an engine leaves them
    before = {n: (p.detach().clone(), p.shape, p.stride()) for n, p in model.named_parameters()}
    attn = model.layers[0].attn
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (*model.parameters(), *model.buffers())}  # RoPE's frequencies are a buffer
    moved = move_to_huge_pages(model)
    assert moved == sum(storages.values())
    assert len({p.untyped_storage().data_ptr() for p in model.parameters()}) == 1  # one arena
    for n, p in model.named_parameters():
        value, shape, stride = before[n]
        assert torch.equal(p, value) and p.shape == shape and p.stride() == stride, n
    assert model.lm_head.weight is model.embed_tokens.weight
    q_rows = attn.q_proj.weight.shape[0]
    assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()  # parts still view the fused weight
    assert attn.k_proj.weight.data_ptr() == attn.qkv_weight[q_rows].data_ptr()
    assert move_to_huge_pages(model) == 0  # already there


def test_the_engine_in_huge_pages_gives_the_same_tokens():
    model = tied(16384)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 16384, (n,), generator=g).tolist() for n in (3, 30, 61)]
    params = SamplingParams(max_tokens=12, **GREEDY)
    plain = LLM(model, huge_pages="false")
    assert not plain.engine.huge_pages
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    del plain
    if not huge_pages_available():
        pytest.skip("this kernel offers no transparent huge pages")
    llm = LLM(tied(16384))
    assert llm.engine.huge_pages and "huge pages" in llm.engine.path
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert smaps_entry(llm.engine.pool.k.data_ptr())["THPeligible"] == "1"
    assert smaps_entry(llm.engine.model.lm_head.weight.data_ptr())["THPeligible"] == "1"


def test_huge_pages_true_is_refused_where_the_kernel_has_none(monkeypatch):
    monkeypatch.setattr(engine_module, "huge_pages_available", lambda: False)
    model = build_model(PRESETS["tiny"], seed=3).eval()
    with pytest.raises(ConfigError, match="serve.huge_pages=true cannot be used here: this kernel does not offer"):
        LLM(model, huge_pages="true")
    assert not LLM(model).engine.huge_pages  # auto: left off


MEASURE_MOVE = """
import json
import torch
from fivefold.memory import host
from fivefold.model import build_model
from fivefold.presets import PRESETS
from fivefold.serve import LLM
import dataclasses

cfg = dataclasses.replace(PRESETS["tiny"], hidden_size=512, num_layers=4, ffn_hidden_size=2048, vocab_size=16384,
                          num_heads=8, num_kv_heads=4)
llm = LLM(build_model(cfg, seed=0).eval(), huge_pages="false", num_blocks=4)
from fivefold.serve.huge_pages import _trim_heap, move_to_huge_pages
_trim_heap()
assert host.reset_resident_peak()
before = host.resident()
largest = max(p.untyped_storage().nbytes() for p in llm.engine.model.parameters())
moved = move_to_huge_pages(llm.engine.model)
print(json.dumps({"moved": moved, "largest": largest, "growth": host.resident() - before,
                  "peak_growth": host.resident_peak() - before}))
"""


@needs_thp
def test_moving_holds_at_most_one_storage_twice():
    """In a fresh process (a long one reuses freed memory): while the weights move, the resident set rises
    by at most the largest storage (it is copied before its old copy is freed), and afterwards by nothing
    but page rounding."""
    run = subprocess.run([sys.executable, "-c", MEASURE_MOVE], capture_output=True, text=True, timeout=300)
    if run.returncode and "reset_resident_peak" in run.stderr:
        pytest.skip("this kernel does not let a process reset its resident-set peak")
    assert run.returncode == 0, run.stderr[-2000:]
    m = json.loads(run.stdout.strip().splitlines()[-1])
    assert m["moved"] > 60e6
    assert abs(m["growth"]) < 4 * 2**20
    assert m["peak_growth"] <= m["largest"] + 4 * 2**20
