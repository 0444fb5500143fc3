"""Tensor-parallel serving (tp=2, gloo, torchrun) against one process: the same tokens, the same logprobs,
from a Hugging Face directory and from a fivefold checkpoint, before and after update_weights; a bad --tp is
refused before any worker starts."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fivefold.cli import main
from fivefold.config import Config
from fivefold.model import build_model
from fivefold.presets import PRESETS
from fivefold.serve import LLM, SamplingParams
from fivefold.checkpoint.store import save_model

WORKER = Path(__file__).with_name("serve_tp_worker.py")
MEMORY_WORKER = Path(__file__).with_name("serve_tp_memory_worker.py")


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """The same tiny GQA Llama (4 heads, 2 kv heads, vocab 512) as a fivefold checkpoint and as an HF export."""
    from fivefold.data.tokenizer import train_tokenizer
    from fivefold.interop.hf import export_hf

    root = tmp_path_factory.mktemp("tp-serve")
    model = build_model(PRESETS["tiny"], seed=5)
    tokenizer = train_tokenizer(["the cat sat on the mat", "a dog ran"] * 20, 300)
    save_model(root / "ckpt", Config(model=PRESETS["tiny"]), model,
               extra_files={"tokenizer.json": tokenizer.to_str().encode()})
    export_hf(model, root / "hf")
    return {"checkpoint": root / "ckpt", "hf": root / "hf"}


def requests(vocab: int) -> dict:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (int(n),), generator=g).tolist() for n in (3, 40, 17, 1, 29, 8)]
    params = [dict(max_tokens=12, temperature=0 if i % 2 else 0.8, top_p=0.9, seed=i, ignore_eos=True, logprobs=2,
                   prompt_logprobs=None if i % 2 else 2) for i in range(len(prompts))]
    return {"prompts": prompts, "params": params, "update_seed": 6}


@pytest.mark.parametrize("kind", ["checkpoint", "hf"])
def test_tp2_serves_what_one_process_serves(sources, kind, tmp_path):
    spec = requests(PRESETS["tiny"].vocab_size)
    (tmp_path / "requests.json").write_text(json.dumps(spec))
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          str(WORKER), str(sources[kind]), str(tmp_path / "requests.json"), str(tmp_path / "out.json")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    sharded = json.loads((tmp_path / "out.json").read_text())
    llm = LLM(str(sources[kind]), device="cpu", block_size=4, max_num_batched_tokens=48)
    params = [SamplingParams(**p) for p in spec["params"]]
    single = [llm.generate(spec["prompts"], params)]
    llm.engine.update_weights(build_model(PRESETS["tiny"], seed=spec["update_seed"]).state_dict())
    single.append(llm.generate(spec["prompts"], params))
    assert [o.token_ids for o in single[0]] != [o.token_ids for o in single[1]]  # the update changed the tokens
    for ones, twos in zip(single, sharded):
        for one, two in zip(ones, twos):
            assert two["token_ids"] == one.token_ids
            assert two["logprobs"] == pytest.approx([e["logprob"] for e in one.logprobs], abs=1e-5)
            assert two["prompt_logprobs"] == pytest.approx([e["logprob"] for e in (one.prompt_logprobs or [])[1:]],
                                                           abs=1e-5)
    assert sum(bool(two["prompt_logprobs"]) for two in sharded[0]) == 3  # the 3-, 17- and 29-token prompts


def test_tp2_step_memory_is_each_ranks_measured_peak(tmp_path):
    """Each rank of tp=2 holds its share of the heads and MLP columns and gathers the logits whole: scoring 200
    rows a step, the gather (its share, the parts and their concatenation, 2.5x the rows' logits) is every
    rank's largest moment, and the engine's planned scoring phase bounds it within 3%. `fivefold plan --serve`
    with parallel.tp=2 plans each rank's weights, KV pool and step as the engine then holds them."""
    import dataclasses

    cfg = dataclasses.replace(PRESETS["tiny"], hidden_size=256, num_layers=2, ffn_hidden_size=1024, head_dim=16,
                              vocab_size=8192, num_heads=8, num_kv_heads=4, max_seq_len=2048)
    save_model(tmp_path / "ckpt", Config(model=cfg), build_model(cfg, seed=0))
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          str(MEMORY_WORKER), str(tmp_path / "ckpt"), str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    from fivefold.config import ParallelConfig, ServeConfig
    from fivefold.serve.plan import plan_serving

    serve = ServeConfig(max_num_seqs=16, max_num_batched_tokens=216, max_scored_tokens=200, num_blocks=256)
    plan = plan_serving(Config(model=cfg, serve=serve, parallel=ParallelConfig(tp=2)), device="cpu")
    assert "one rank of 2" in plan.table()
    for rank in (0, 1):
        m = json.loads((tmp_path / f"out.{rank}").read_text())
        # `fivefold plan --serve --set parallel.tp=2`: each rank's weights, pool and step, as the engine has them
        assert (plan.weights, plan.kv.bytes) == (m["weights"], m["kv"])
        assert dataclasses.asdict(plan.step) == m["planned"]
        peaks, planned = m["peaks"], m["planned"]
        measured = max(peaks.values())
        assert measured == peaks["forward"]  # the gather ends the forward
        assert planned["scoring"] >= measured and planned["scoring"] == pytest.approx(measured, rel=0.03), rank
        assert planned["mlp"] < measured / 4  # the MLP's share is not what counts here


def test_bad_tp_is_refused_before_any_worker_starts(sources, capsys):
    # 4 heads, 2 kv heads: tp=3 cannot split them.
    assert main(["generate", "--checkpoint", str(sources["checkpoint"]), "--prompt", "x", "--tp", "3"]) == 2
    err = capsys.readouterr().err
    assert "parallel.tp=3 does not divide model.num_heads=4" in err and err.count("\n") == 1
    with pytest.raises(Exception, match="run under torchrun --nproc-per-node 2"):
        LLM(str(sources["checkpoint"]), tp=2)
