"""Several LoRA adapters served at once (fivefold.serve.adapters): one batch mixing the base and two adapters
(a fivefold LoRA run and a PEFT directory of another rank and targets) gives each request exactly what that
adapter's merged model gives alone; the prefix cache keeps adapters apart; the server routes `base:adapter`."""

from __future__ import annotations

import httpx
import pytest

from fivefold.cli import main
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
    a = train(data_cache, root / "a", 4, **{"lora.r": 4, "train.init_from": str(base), "train.lr": 5e-2})
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
