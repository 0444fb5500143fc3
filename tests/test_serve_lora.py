"""Several LoRA adapters served at once (fivefold.serve.adapters): one batch mixing the base and two adapters
(a fivefold LoRA run and a PEFT directory of another rank and targets) gives each request exactly what that
adapter's merged model gives alone; the prefix cache keeps adapters apart; the server routes `base:adapter`."""

from __future__ import annotations

import httpx
import pytest

from fivefold.cli import main
from fivefold.config import ConfigError
from fivefold.config_load import load_config
from fivefold.serve import LLM, SamplingParams
from fivefold.serve.sampling import RequestError
from fivefold.train.trainer import Trainer
from parity import BASE

ENGINE = {"block_size": 8, "num_blocks": 128, "max_num_seqs": 8}
PROMPTS = ["The with statement", "Return the value of", "The with statement", "A class is", "Return the value of"]
ADAPTERS = [None, "a", "a", "b", "b"]  # the same prompt under the base and an adapter; each adapter twice
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def train(cache, out, steps, **overrides):
    values = {**BASE, "data.cache_dir": cache, "train.out_dir": str(out), "train.steps": steps,
              "train.save_every": 0, "train.micro_batch_size": 8, **overrides}
    trainer = Trainer(load_config(preset="tiny", overrides=[f"{k}={v}" for k, v in values.items()]), quiet=True)
    trainer.fit()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    root = tmp_path_factory.mktemp("serve_lora")
    base = train(data_cache, root / "base", 6)
    train(data_cache, root / "a", 4, **{"lora.r": 4, "train.init_from": str(base), "train.lr": 5e-2})
    b = train(data_cache, root / "b", 4, **{"lora.r": 2, "lora.targets": "q,v,down", "train.init_from": str(base),
                                            "train.lr": 5e-2})
    assert main(["export-hf", "--checkpoint", str(b), "--out", str(root / "b_peft")]) == 0
    return root


def texts(outputs):
    return [o.token_ids for o in outputs]


def test_mixed_batch_equals_each_merged_model(runs):
    llm = LLM(runs / "base", adapters={"a": runs / "a", "b": runs / "b_peft"}, **ENGINE)
    mixed = texts(llm.generate(PROMPTS, GREEDY, adapter=ADAPTERS))
    # References: the base alone, and each LoRA run loaded as its merged model (fivefold.finetune.lora).
    reference = {None: LLM(runs / "base", **ENGINE), "a": LLM(runs / "a", **ENGINE), "b": LLM(runs / "b", **ENGINE)}
    for prompt, adapter, got in zip(PROMPTS, ADAPTERS, mixed):
        assert got == texts(reference[adapter].generate(prompt, GREEDY))[0], (prompt, adapter)
    assert mixed[0] != mixed[2] and mixed[1] != mixed[4]  # the adapters change what the same prompt gives


def test_prefix_cache_is_kept_per_adapter(runs):
    llm = LLM(runs / "base", adapters={"a": runs / "a"}, **ENGINE)
    prompt = "The with statement is used to wrap the execution of a block"  # more than one full block
    first = texts(llm.generate(prompt, GREEDY, adapter="a"))[0]
    base = llm.generate(prompt, GREEDY)[0]
    assert base.num_cached_tokens == 0  # the adapter's blocks are not the base's
    again = llm.generate(prompt, GREEDY, adapter="a")[0]
    assert again.num_cached_tokens > 0 and again.token_ids == first


def test_unknown_adapter_is_a_request_error(runs):
    llm = LLM(runs / "base", adapters={"a": runs / "a"}, **ENGINE)
    with pytest.raises(RequestError, match="no LoRA adapter named 'zz'"):
        llm.generate("x", GREEDY, adapter="zz")


def test_server_routes_base_colon_adapter(runs):
    from fivefold.serve.engine import Engine, serve_config
    from fivefold.serve.loading import load_model_for_serving
    from fivefold.serve.server import create_app, running_in_thread

    loaded = load_model_for_serving(runs / "base")
    engine = Engine(loaded.model, loaded.tokenizer, serve_config(ENGINE), adapters={"a": runs / "a"})
    want = texts(LLM(runs / "a", **ENGINE).generate(PROMPTS[0], GREEDY))[0]
    with running_in_thread(create_app(engine, "base"), timeout=10) as url:
        models = httpx.get(f"{url}/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["base", "base:a"]
        body = {"model": "base:a", "prompt": PROMPTS[0], "max_tokens": 10, "temperature": 0, "ignore_eos": True}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()
        assert reply["choices"][0]["text"] == loaded.tokenizer.decode(want)
        missing = httpx.post(f"{url}/v1/completions", json={**body, "model": "base:zz"}, timeout=30)
        assert missing.status_code == 404 and "base:a" in missing.json()["error"]["message"]


# -- one model, several engines: each prepares the model in place (fused projections, adapter hooks) --------

@pytest.fixture(scope="module")
def random_adapter(tmp_path_factory):
    """A PEFT directory of random rank-4 adapters on every projection of the tiny preset."""
    import torch

    from fivefold.config import Config, LoraConfig
    from fivefold.finetune.lora import adapter_shapes
    from fivefold.finetune.peft import save_adapter
    from fivefold.presets import get_preset

    cfg, lora = get_preset("tiny"), LoraConfig(r=4, alpha=8)
    g = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(shape, generator=g) * 0.3 for n, shape in adapter_shapes(cfg, lora).items()}
    return save_adapter(tensors, Config(model=cfg, lora=lora), tmp_path_factory.mktemp("random_adapter"))


def fresh_model():
    from fivefold.model import build_model
    from fivefold.presets import get_preset

    return build_model(get_preset("tiny"), "cpu", seed=0).eval()


IDS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [7, 8, 9]]


def served(model, linear, adapter_dir=None):
    adapters = {"a": adapter_dir} if adapter_dir else None
    llm = LLM(model, adapters=adapters, linear=linear, **ENGINE)
    return llm, texts(llm.generate(IDS, GREEDY, adapter="a" if adapter_dir else None))


@pytest.mark.parametrize("linear", ["torch", "onednn"])
def test_adapters_on_a_model_an_earlier_engine_fused(random_adapter, linear):
    import copy

    from fivefold.serve.cpu_linear import onednn_available

    if linear == "onednn" and not onednn_available():
        pytest.skip("this torch has no oneDNN")
    want = served(fresh_model(), linear, random_adapter)[1]
    assert want != served(fresh_model(), linear)[1]  # the adapter changes the outputs
    model = fresh_model()
    llm, _ = served(model, linear)  # fuses q/k/v and gate/up in place (on oneDNN, re-laid input-major)
    twin = copy.deepcopy(model)  # fused too, and no engine's
    assert served(twin, linear, random_adapter)[1] == want
    del llm
    assert served(model, linear, random_adapter)[1] == want  # unfused again: the adapters' hooks see every product


def test_two_live_engines_share_a_model_only_without_adapters(random_adapter):
    want = served(fresh_model(), "torch")[1]
    model = fresh_model()
    first, got = served(model, "torch")
    second, again = served(model, "torch")
    assert got == again == want and texts(first.generate(IDS, GREEDY)) == want
    with pytest.raises(ConfigError, match=r"already served by another engine \(without LoRA adapters\)"):
        served(model, "torch", random_adapter)
    del first, second
    adapted, _ = served(model, "torch", random_adapter)
    with pytest.raises(ConfigError, match=r"already served by another engine \(with LoRA adapters\)"):
        served(model, "torch")
    del adapted
    assert served(model, "torch")[1] == want  # the adapters' hooks are gone with their engine
    assert not model.layers[0].attn.o_proj._forward_hooks


def test_an_engine_with_adapters_waits_for_every_engine_sharing_the_model(random_adapter):
    """Two plain engines share one model; the second going leaves the first, which still runs it."""
    model = fresh_model()
    first, want = served(model, "torch")
    second, _ = served(model, "torch")
    del second
    with pytest.raises(ConfigError, match=r"already served by another engine \(without LoRA adapters\)"):
        served(model, "torch", random_adapter)
    assert texts(first.generate(IDS, GREEDY)) == want
