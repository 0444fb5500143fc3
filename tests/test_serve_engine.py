"""The serving engine against plain full forwards: paged attention, batching, chunking, the prefix cache,
preemption, seeded sampling, stops, logprobs, weight updates, and the requests it must refuse."""

import dataclasses

import pytest
import torch

from fivefold.config import ConfigError
from fivefold.model import ForwardContext, build_model
from fivefold.presets import PRESETS
from fivefold.serve import LLM, RequestError, SamplingParams
from fivefold.serve.kv_pool import KVPool, PagedBatch, kv_plan
from fivefold.serve.sampling import apply_penalties, filtered_probs
from paged_steps import admitted

GREEDY = dict(temperature=0, ignore_eos=True)


def tiny(preset="tiny", seed=3, **changes):
    cfg = dataclasses.replace(PRESETS[preset], max_seq_len=256, **changes)
    return build_model(cfg, seed=seed).eval()


@torch.no_grad()
def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding by a full forward over the whole sequence for every token: no cache at all."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def mixed_prompts(count: int, vocab: int, seed: int = 0, shared: int = 0, longest: int = 70):
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, vocab, (shared,), generator=g).tolist()
    lengths = torch.randint(1, longest, (count,), generator=g).tolist()
    return [prefix + torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt2", "tiny-moe"])
@torch.no_grad()
def test_paged_attention_equals_full_forward(preset, attention):
    """Two sequences advanced together through the pool in uneven chunks and single tokens: every
    position's logits equal the full forward of that sequence alone."""
    model = tiny(preset, attention=attention)
    cfg = model.cfg
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (21, 13)]
    full = [model(torch.tensor([s]))[0] for s in seqs]
    pool = KVPool(cfg, kv_plan(cfg, 1, 4, torch.float32, num_blocks=16), "cpu", torch.float32)
    tables = [[3, 9, 1, 14, 6, 12], [0, 7, 2, 11]]  # scattered blocks: reads must go through the table
    plan = [[(0, 5), (0, 3)], [(5, 1), (3, 7)], [(6, 1), (10, 1)], [(7, 14), (11, 2)]]  # (past, n) per step
    batch, buffers, rows = admitted(seqs, tables, block_size=4, max_model_len=24)
    for step in plan:
        for row, (past, n) in zip(rows, step):
            row.num_computed = past
        order = sorted(range(2), key=lambda i: step[i][1] != 1)
        inputs = batch.prepare([(rows[i], step[i][1]) for i in order])
        dev = buffers.upload(inputs)
        paged = PagedBatch(pool, dev, inputs)
        ctx = ForwardContext(positions=paged.positions, kv_cache=paged, mask=paged,
                             logits_at=torch.arange(inputs.num_tokens))
        logits = model(dev.input_ids[None], ctx)
        start = 0
        for i in order:
            past, n = step[i]
            torch.testing.assert_close(logits[start:start + n], full[i][past:past + n], rtol=1e-5, atol=1e-5)
            start += n


@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt2", "tiny-moe"])
def test_greedy_batched_equals_each_alone_and_no_cache(preset):
    model = tiny(preset)
    prompts = mixed_prompts(24, model.cfg.vocab_size)
    lengths = [1 + i % 17 for i in range(len(prompts))]
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in lengths]
    batched = LLM(model).generate(prompts, params)
    for prompt, p, out in zip(prompts, params, batched):
        assert out.token_ids == reference_greedy(model, prompt, p.max_tokens)
        assert out.finish_reason == "length" and out.ttft > 0
    alone = [LLM(model).generate(prompt, p)[0].token_ids for prompt, p in zip(prompts[:6], params[:6])]
    assert alone == [o.token_ids for o in batched[:6]]


def test_greedy_equals_transformers_on_an_imported_model(tmp_path):
    """32 mixed-length prompts batched through a model imported from a transformers checkpoint: the
    token ids of transformers' own greedy generate, prompt by prompt."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256), attn_implementation="eager").eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    prompts = mixed_prompts(32, 384, seed=1, longest=90)
    lengths = [4 + (7 * i) % 21 for i in range(32)]
    outs = LLM(str(tmp_path), device="cpu", max_num_batched_tokens=256).generate(
        prompts, [SamplingParams(max_tokens=n, **GREEDY) for n in lengths])
    for prompt, n, out in zip(prompts, lengths, outs):
        with torch.no_grad():
            # An explicit attention mask: without one, generate() takes every token equal to pad_token_id
            # for padding. The eos id is cleared rather than suppressed (min_new_tokens would change logits).
            ids = torch.tensor([prompt])
            expected = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                   pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
        assert out.token_ids == expected


def test_prefix_cache_shares_blocks_and_changes_nothing():
    model = tiny()
    prompts = mixed_prompts(12, model.cfg.vocab_size, seed=2, shared=48)
    params = SamplingParams(max_tokens=6, **GREEDY)
    without = LLM(model, prefix_cache=False).generate(prompts, params)
    llm = LLM(model, block_size=16)
    first = llm.generate(prompts[:1], params)  # its prefix blocks stay cached after it finishes
    rest = llm.generate(prompts[1:], params)
    assert [o.token_ids for o in first + rest] == [o.token_ids for o in without]
    assert all(o.num_cached_tokens == 48 for o in rest)  # the 3 shared blocks of 16, for each later request
    blocks = llm.engine.blocks
    assert blocks.hit_rate == pytest.approx(48 * 11 / sum(map(len, prompts)))
    assert blocks.num_used == 0 and len(blocks.cached) >= 3


def test_chunked_prefill_equals_unchunked():
    model = tiny()
    prompts = mixed_prompts(10, model.cfg.vocab_size, seed=3, longest=120)
    params = SamplingParams(max_tokens=8, **GREEDY)
    whole = LLM(model).generate(prompts, params)
    llm = LLM(model, max_num_batched_tokens=5, max_num_seqs=4)
    chunked = llm.generate(prompts, params)
    assert [o.token_ids for o in chunked] == [o.token_ids for o in whole]
    assert llm.engine.stats["steps"] > sum(map(len, prompts)) // 5  # it really ran in chunks of 5


def test_preemption_by_recompute_gives_identical_outputs():
    """A pool of 12 blocks of 4 tokens for 16 requests that grow to ~60 tokens: sequences are preempted
    (latest first) and recomputed, yet every request finishes with the output of an unconstrained run,
    sampled ones included (their generators are not reset)."""
    model = tiny()
    prompts = mixed_prompts(16, model.cfg.vocab_size, seed=4, longest=30)
    params = [SamplingParams(max_tokens=24, ignore_eos=True, temperature=0 if i % 2 else 0.9, top_p=0.95, seed=i)
              for i in range(16)]
    free = LLM(model).generate(prompts, params)
    llm = LLM(model, num_blocks=14, block_size=4)
    tight = llm.generate(prompts, params)
    assert llm.engine.scheduler.preemptions > 0
    assert [o.token_ids for o in tight] == [o.token_ids for o in free]
    assert all(o.finish_reason == "length" for o in tight)
    assert llm.engine.blocks.num_used == 0


def test_seeded_sampling_does_not_depend_on_the_batch():
    model = tiny()
    prompts = mixed_prompts(8, model.cfg.vocab_size, seed=5)
    params = [SamplingParams(max_tokens=12, temperature=1.0, top_k=40, top_p=0.9, min_p=0.01, seed=100 + i,
                             ignore_eos=True) for i in range(8)]
    together = LLM(model).generate(prompts, params)
    alone = [LLM(model).generate(p, s)[0] for p, s in zip(prompts, params)]
    reversed_batch = LLM(model).generate(prompts[::-1], params[::-1])[::-1]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone] == [o.token_ids for o in reversed_batch]
    other_seed = LLM(model).generate(prompts[0], dataclasses.replace(params[0], seed=7))[0]
    assert other_seed.token_ids != together[0].token_ids


@pytest.mark.parametrize("rows", [1, 3])
def test_drawing_a_few_rows_at_a_time_changes_no_token(monkeypatch, rows):
    """launch_sampling filters and draws draw_rows() rows at a time past DRAW_BUDGET (a large vocabulary at many
    rows): greedy and drawn rows mixed, top-k, top-p and min-p, the same tokens and logprobs as one pass."""
    from fivefold.serve import sampling
    model = tiny()
    prompts = mixed_prompts(8, model.cfg.vocab_size, seed=5)
    params = [SamplingParams(max_tokens=10, temperature=0 if i % 3 == 0 else 0.9, top_k=40 * (i % 2), logprobs=2,
                             top_p=0.9 if i % 4 else 1.0, min_p=0.02 * (i % 2), seed=100 + i, ignore_eos=True)
              for i in range(8)]
    one_pass = LLM(model).generate(prompts, params)
    monkeypatch.setattr(sampling, "DRAW_BUDGET", rows * model.cfg.vocab_size * sampling.DRAW_BYTES)
    assert sampling.draw_rows(model.cfg.vocab_size) == rows
    chunked = LLM(model).generate(prompts, params)
    assert [o.token_ids for o in chunked] == [o.token_ids for o in one_pass]
    assert [o.logprobs for o in chunked] == [o.logprobs for o in one_pass]
    assert len({t for o in one_pass for t in o.token_ids}) > 20  # drawn, not a constant


def test_blocks_return_to_zero_after_finishing_and_aborting():
    model = tiny()
    llm = LLM(model, block_size=4)
    engine = llm.engine
    ids = [engine.add_request(p, SamplingParams(max_tokens=30, **GREEDY))
           for p in mixed_prompts(6, model.cfg.vocab_size, seed=6)]
    for _ in range(3):
        engine.step()
    assert engine.blocks.num_used > 0
    engine.abort(ids[0])
    engine.abort(ids[3])
    engine.abort("no-such-request")
    while engine.has_unfinished():
        engine.step()
    assert engine.blocks.num_used == 0 and set(engine.blocks.ref) == {0}
    assert engine.stats["aborted"] == 2 and engine.stats["finished"] == 4


def test_requests_that_can_never_run_are_refused_at_once():
    model = tiny()
    llm = LLM(model, num_blocks=4, block_size=16)
    with pytest.raises(RequestError, match=r"prompt \(250 tokens\) \+ max_tokens \(10\) = 260 exceeds the model's "
                                           r"context of 256 tokens"):
        llm.generate([1] * 250, SamplingParams(max_tokens=10))
    with pytest.raises(RequestError, match="needs 5 KV blocks but the pool holds 4; raise serve.kv_memory"):
        llm.generate([1] * 70, SamplingParams(max_tokens=10))
    with pytest.raises(RequestError, match="empty"):
        llm.engine.add_request([], SamplingParams())
    with pytest.raises(RequestError, match=r"integers in \[0, 512\)"):
        llm.engine.add_request([5, 512], SamplingParams())
    with pytest.raises(RequestError, match="no tokenizer"):
        llm.engine.add_request("text", SamplingParams())
    assert not llm.engine.has_unfinished()
    # A batch with one impossible prompt is refused as a whole, naming it, and leaves nothing queued.
    with pytest.raises(RequestError, match="prompt 1: "):
        llm.generate([[1, 2], [1] * 300], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished() and llm.engine.blocks.num_used == 0
    for bad, message in [(dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(max_tokens=-1), "max_tokens"),
                         (dict(logprobs=21), "logprobs"), (dict(min_p=2), "min_p")]:
        with pytest.raises(ValueError, match=message):
            SamplingParams(**bad)
    with pytest.raises(ConfigError, match="unknown engine option"):
        LLM(model, block_sise=16)
    with pytest.raises(ConfigError, match="serve.max_num_seqs=0 must be at least 1"):
        LLM(model, max_num_seqs=0)


def test_logprobs_are_the_models_own():
    model = tiny()
    prompt = mixed_prompts(1, model.cfg.vocab_size, seed=7)[0]
    out = LLM(model).generate(prompt, SamplingParams(max_tokens=5, logprobs=3, **GREEDY))[0]
    with torch.no_grad():
        logp = model(torch.tensor([prompt + out.token_ids]))[0].log_softmax(-1)
    assert len(out.logprobs) == 5
    for i, entry in enumerate(out.logprobs):
        row = logp[len(prompt) - 1 + i]
        assert entry["token_id"] == out.token_ids[i]
        assert entry["logprob"] == pytest.approx(float(row[out.token_ids[i]]), abs=1e-5)
        top = row.topk(3)
        assert [t for t, _ in entry["top"]] == top.indices.tolist()
        assert [lp for _, lp in entry["top"]] == pytest.approx(top.values.tolist(), abs=1e-5)


def test_stop_token_ids_eos_and_stop_strings():
    from fivefold.data.tokenizer import train_tokenizer

    docs = ["the cat sat on the mat", "a dog ran in the park", "numbers 12 345 6789"] * 10
    tokenizer = train_tokenizer(docs, 300)
    model = tiny(vocab_size=300)
    llm = LLM(model, tokenizer=tokenizer)
    free = llm.generate("the cat", SamplingParams(max_tokens=20, **GREEDY))[0]
    assert free.text == tokenizer.decode(free.token_ids) and len(free.text) > 6
    stop_id = free.token_ids[3]
    first = free.token_ids.index(stop_id)
    by_id = llm.generate("the cat", SamplingParams(max_tokens=20, stop_token_ids=[stop_id], **GREEDY))[0]
    assert by_id.token_ids == free.token_ids[:first + 1] and by_id.finish_reason == "stop"
    assert by_id.text == tokenizer.decode(free.token_ids[:first])
    stop = free.text[4:7]
    by_text = llm.generate("the cat", SamplingParams(max_tokens=20, stop=[stop, "never-there"], **GREEDY))[0]
    assert by_text.text == free.text[:free.text.index(stop)] and by_text.finish_reason == "stop"
    # Two stop strings completed by one token: the text ends before the one that starts first.
    starts = [len(tokenizer.decode(free.token_ids[:i])) for i in range(len(free.token_ids) + 1)]
    k = next(k for k in range(2, len(free.token_ids))
             if starts[k + 1] > starts[k] > starts[k - 1] and free.text.find(free.text[starts[k]:starts[k + 1]]) == starts[k]
             and free.text.find(free.text[starts[k - 1]:starts[k + 1]]) == starts[k - 1])
    pair = [free.text[starts[k]:starts[k + 1]], free.text[starts[k - 1]:starts[k + 1]]]  # the later-starting first
    both = llm.generate("the cat", SamplingParams(max_tokens=20, stop=pair, **GREEDY))[0]
    assert both.token_ids == free.token_ids[:k + 1] and both.text == free.text[:starts[k - 1]]
    # eos ends a request unless ignore_eos; the eos token is not part of the text.
    eos_model = tiny(vocab_size=300, eos_token_id=free.token_ids[2])
    out = LLM(eos_model, tokenizer=tokenizer).generate("the cat", SamplingParams(max_tokens=20, temperature=0))[0]
    first_eos = free.token_ids.index(free.token_ids[2])
    assert out.token_ids == free.token_ids[:first_eos + 1] and out.finish_reason == "stop"


def test_penalties_and_filters_by_hand():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    p = SamplingParams(repetition_penalty=2.0)
    assert apply_penalties(logits.clone(), p, prompt=[0], output=[1]).tolist() == [1.0, -2.0, 0.5, 3.0]
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    assert apply_penalties(logits.clone(), p, prompt=[2], output=[3, 3, 1]).tolist() == [2.0, -1.75, 0.5, 2.0]
    probs = torch.tensor([[0.05, 0.40, 0.10, 0.30, 0.15]])
    one = torch.ones(1)
    kept = filtered_probs(probs.log(), one, torch.zeros(1, dtype=torch.long), one, torch.tensor([0.3]))
    # min_p 0.3 keeps tokens with p >= 0.3 x 0.40 = 0.12: ids 1, 3, 4, renormalised.
    torch.testing.assert_close(kept[0], torch.tensor([0, 0.40, 0, 0.30, 0.15]) / 0.85)
    # Rows keep their own parameters: top-k 2 in one row, top-p 0.35 in the other.
    both = filtered_probs(probs.log().expand(2, 5), torch.ones(2), torch.tensor([2, 0]), torch.tensor([1.0, 0.35]),
                          torch.zeros(2))
    torch.testing.assert_close(both, torch.tensor([[0, 0.4 / 0.7, 0, 0.3 / 0.7, 0], [0, 1.0, 0, 0, 0]]))


@pytest.mark.parametrize("top_p, kept", [(0.39, [1]), (0.41, [1, 3]), (0.71, [1, 3, 4]), (0.86, [1, 3, 4, 2]),
                                         (0.96, [0, 1, 2, 3, 4])])
def test_top_p_keeps_the_smallest_nucleus_reaching_p(top_p, kept):
    """Sorted probabilities 0.40, 0.30, 0.15, 0.10, 0.05: the nucleus grows by one token each time p
    passes a cumulative sum (0.40, 0.70, 0.85, 0.95)."""
    base = torch.tensor([0.05, 0.40, 0.10, 0.30, 0.15])
    expected = torch.zeros(5)
    expected[kept] = base[kept] / base[kept].sum()
    got = filtered_probs(base.log()[None], torch.ones(1), torch.zeros(1, dtype=torch.long), torch.tensor([top_p]),
                         torch.zeros(1))
    torch.testing.assert_close(got[0], expected, rtol=1e-6, atol=1e-7)


def test_sampling_follows_the_filtered_distribution():
    """4,000 seeded one-token requests through the engine's draw: frequencies within 0.03 of top-k 3."""
    from fivefold.serve.sampling import sample

    logits = torch.tensor([0.05, 0.40, 0.10, 0.30, 0.15]).log().expand(4000, 5)
    reqs = [type("R", (), dict(params=SamplingParams(top_k=3), prompt_ids=[], output_ids=[],
                                generator=torch.Generator().manual_seed(i)))() for i in range(4000)]
    tokens, _ = sample(logits, reqs)
    freq = torch.bincount(torch.tensor(tokens), minlength=5).float() / 4000
    torch.testing.assert_close(freq, torch.tensor([0, 0.40, 0, 0.30, 0.15]) / 0.85, atol=0.03, rtol=0)


def test_update_weights_recomputes_running_requests_and_keeps_the_queue():
    old, new = tiny(seed=3), tiny(seed=4)
    llm = LLM(old, max_num_seqs=2, block_size=4)
    engine = llm.engine
    prompts = mixed_prompts(4, old.cfg.vocab_size, seed=8, longest=20)
    ids = [engine.add_request(p, SamplingParams(max_tokens=10, **GREEDY)) for p in prompts]
    for _ in range(4):
        engine.step()
    running = {s.request_id: list(s.output_ids) for s in engine.scheduler.running}
    assert len(running) == 2 and engine.num_waiting == 2
    engine.update_weights({n: p.detach().clone() for n, p in new.named_parameters()})
    assert engine.num_waiting == 4 and not engine.blocks.cached  # all queued; no stale prefix
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.token_ids
    for request_id, prompt in zip(ids, prompts):
        before = running.get(request_id, [])
        assert outs[request_id][:len(before)] == before
        assert outs[request_id][len(before):] == reference_greedy(new, prompt + before, 10 - len(before))
    with pytest.raises(ValueError, match="no parameter named"):
        engine.update_weights({"nope": torch.zeros(1)})


def test_kv_pool_is_what_the_plan_says():
    model = tiny()
    llm = LLM(model, kv_memory=0.001, max_num_seqs=1000)
    engine, cfg = llm.engine, model.cfg
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_size * 4
    assert engine.plan.bytes_per_token == per_token
    assert engine.pool.bytes == engine.plan.bytes == engine.plan.num_blocks * 16 * per_token
    # Never more blocks than max_num_seqs sequences of the longest length can fill.
    capped = LLM(model, kv_memory=8, max_num_seqs=3).engine.plan
    assert capped.num_blocks == 3 * 256 // 16
    assert capped.max_sequences(256) == 3 and capped.max_sequences(100) == 6


MEASURE_SERVING_MEMORY = """
import json
import sys
from fivefold.config_load import load_config
from fivefold.memory.host import resident, return_freed_memory
from fivefold.model import build_model
from fivefold.presets import PRESETS
from fivefold.serve import LLM
from fivefold.serve.plan import plan_serving

cfg = load_config(preset="tiny", overrides=["model.hidden_size=512", "model.num_layers=4", "model.ffn_hidden_size=1536",
                                            "model.vocab_size=8192", "model.num_heads=8", "model.num_kv_heads=4",
                                            "serve.kv_memory=1.0", "serve.max_num_seqs=256"])
planned = plan_serving(cfg)
if sys.argv[1:] == ["choose"]:  # a first start: on a CPU, each linear shape's product timed and kept in the cache
    LLM(build_model(cfg.model), num_blocks=1)
    sys.exit()
LLM(build_model(PRESETS["tiny"]), num_blocks=1)  # the code it runs is loaded: lazily imported modules are not weights
return_freed_memory()
before = resident()
model = build_model(cfg.model)
return_freed_memory()  # the initialiser's scratch
weights = resident() - before
llm = LLM(model, **vars(cfg.serve))
kv = resident() - before - weights
print(json.dumps({"weights": weights, "kv": kv, "planned_weights": planned.weights, "planned_kv": planned.kv.bytes,
                  "same_plan": llm.engine.plan == planned.kv}))
"""


def test_plan_serve_predicts_the_memory_the_engine_takes():
    """`fivefold plan --serve`'s KV pool and weights are what a fresh process's resident set grows by when
    the model is built and the engine starts (measured, /proc/self/status). A fresh process: in a long
    one, freed memory the allocator kept would be reused and hide part of the growth."""
    import json
    import subprocess
    import sys

    # A start that finds its linears' products chosen for this machine (fivefold.serve.cpu_linear), as every start
    # after the first does: the first times them, which leaves ~20 MB of the libraries' code and workspaces
    # resident beside the pool.
    subprocess.run([sys.executable, "-c", MEASURE_SERVING_MEMORY, "choose"], check=True, capture_output=True,
                   timeout=300)
    run = subprocess.run([sys.executable, "-c", MEASURE_SERVING_MEMORY], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    m = json.loads(run.stdout.strip().splitlines()[-1])
    assert m["same_plan"]
    assert m["planned_kv"] == pytest.approx(1e9, rel=0.01)
    assert m["kv"] == pytest.approx(m["planned_kv"], rel=0.02)
    assert m["weights"] == pytest.approx(m["planned_weights"], rel=0.1)  # plus what glibc keeps of the init scratch


def test_plan_serve_on_this_host_takes_its_available_memory(monkeypatch, capsys):
    """`fivefold plan --serve --device cpu` with a fractional serve.kv_memory plans for this host: its available
    memory now, as an engine started here would find it once its weights are loaded (the same KV blocks)."""
    import json

    import fivefold.commands.plan as plan_command
    import fivefold.serve.engine as engine_module
    from fivefold.cli import main
    from fivefold.config_load import load_config
    from fivefold.serve.plan import plan_serving

    host = 3 * 10**8
    monkeypatch.setattr(plan_command, "available_memory", lambda device: host)
    sets = ["--set", "serve.kv_memory=0.5", "--set", "serve.max_num_seqs=4096"]  # 4,096 x 16 blocks: no cap
    assert main(["plan", "--serve", "--preset", "tiny", "--device", "cpu", "--json", *sets]) == 0
    out = capsys.readouterr()
    planned = json.loads(out.out)
    assert "planning for this host: 300.00 MB available now" in out.err
    cfg = load_config(preset="tiny", overrides=["serve.kv_memory=0.5", "serve.max_num_seqs=4096"])
    expected = plan_serving(cfg, device_memory=host, device="cpu")
    assert planned["num_blocks"] == expected.kv.num_blocks > 0 and planned["kv_bytes"] < host / 2
    monkeypatch.setattr(engine_module, "available_memory", lambda device: host - expected.weights)
    assert LLM(tiny(), **vars(cfg.serve)).engine.plan.num_blocks == planned["num_blocks"]


def test_plan_serve_counts_every_cuda_graph_output():
    """The decode graphs' pool: the largest graph's working set plus each smaller graph's kept logits. An H100
    measured 1,078 and 1,110 MiB for the Llama-3.2-1B shape in bf16 at 256 sequences (35 graphs); the
    largest graph alone, the estimate before, is 85 MiB."""
    from fivefold.config_load import load_config
    from fivefold.serve.cuda_graphs import batch_ladder
    from fivefold.serve.plan import graph_pool_bytes

    cfg = load_config(preset="llama3.2-1b", overrides=["serve.max_num_seqs=256"])
    assert len(batch_ladder(256)) == 35 and sum(batch_ladder(256)) == 4231
    measured = 1078 * 2**20
    assert graph_pool_bytes(cfg, 2) == pytest.approx(measured, rel=0.03)
    m = cfg.model
    assert graph_pool_bytes(cfg, 2) - 2 * 256 * (m.vocab_size + 4 * m.ffn_hidden_size + 6 * m.hidden_size) == \
        2 * (4231 - 256) * m.vocab_size


def test_prefix_cache_keys_a_block_by_everything_before_it():
    """Second blocks token-identical after different first blocks are different blocks. A + S then C + S:
    the second request finds nothing cached. B + X, then B + S: only B's block is reused, not A + S's
    second block (its keys and values were computed after A). Each output is the prompt's alone, logprobs
    included (a wrongly shared block changes them)."""
    model = tiny()
    g = torch.Generator().manual_seed(9)
    a, b, c, s, x, tail = (torch.randint(0, model.cfg.vocab_size, (n,), generator=g).tolist()
                           for n in (16, 16, 16, 16, 16, 5))
    prompts = {"a+s": a + s + tail, "c+s": c + s + tail, "b+x": b + x + tail, "b+s": b + s + tail}
    params = SamplingParams(max_tokens=4, logprobs=1, **GREEDY)
    llm = LLM(model, block_size=16)
    outs = {name: llm.generate(p, params)[0] for name, p in prompts.items()}  # one after another
    cached = {name: o.num_cached_tokens for name, o in outs.items()}
    assert cached == {"a+s": 0, "c+s": 0, "b+x": 0, "b+s": 16}
    for name, prompt in prompts.items():
        alone = LLM(model, block_size=16).generate(prompt, params)[0]
        assert outs[name].token_ids == alone.token_ids, name
        assert [e["logprob"] for e in outs[name].logprobs] == \
            pytest.approx([e["logprob"] for e in alone.logprobs], abs=1e-5), name


@pytest.mark.parametrize("top_p, kept", [(0.5, [1]), (0.7, [1, 3]), (0.75, [1, 3]), (0.9, [1, 3, 0]),
                                         (0.9375, [1, 3, 0]), (0.95, [1, 3, 0, 2]), (1.0, [1, 3, 0, 2])])
def test_top_p_at_the_nucleus_boundary(top_p, kept):
    """Probabilities exact in binary, so the masses above each token are exact too: sorted 0.5, 0.25,
    0.1875, 0.0625, with 0, 0.5, 0.75, 0.9375 ranked above them. A token is dropped once the tokens
    ranked above it cover top_p: at top_p 0.5 the second token (0.5 above it) goes, at 0.75 the third."""
    base = torch.tensor([0.1875, 0.5, 0.0625, 0.25])
    assert torch.equal(base.log().softmax(-1), base)  # the premise: no rounding anywhere
    got = filtered_probs(base.log()[None], torch.ones(1), torch.zeros(1, dtype=torch.long), torch.tensor([top_p]),
                         torch.zeros(1))[0]
    assert set(got.nonzero().flatten().tolist()) == set(kept)
    expected = torch.zeros(4)
    expected[kept] = base[kept] / base[kept].sum()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-7)


@pytest.mark.parametrize("min_p, kept", [(0.5, [1, 3]), (0.375, [0, 1, 3]), (0.125, [0, 1, 2, 3]), (1.0, [1])])
def test_min_p_keeps_a_token_exactly_at_the_threshold(min_p, kept):
    """Probabilities exact in binary (sorted 0.5, 0.25, 0.1875, 0.0625), so min_p x 0.5 lands exactly on a
    token: that token stays. Only tokens below the threshold go, as in transformers' MinPLogitsWarper."""
    base = torch.tensor([0.1875, 0.5, 0.0625, 0.25])
    got = filtered_probs(base.log()[None], torch.ones(1), torch.zeros(1, dtype=torch.long), torch.ones(1),
                         torch.tensor([min_p]))[0]
    assert set(got.nonzero().flatten().tolist()) == set(kept)
    expected = torch.zeros(4)
    expected[kept] = base[kept] / base[kept].sum()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-7)


@pytest.mark.parametrize("probs, params, u, token", [
    ([0.5, 0.25, 0.25], dict(temperature=1.0), 0.6, 1),  # cdf 0.5, 0.75, 1
    ([0.5, 0.25, 0.25], dict(temperature=0.5), 0.6, 0),  # p^2: 2/3, 1/6, 1/6
    ([0.5, 0.25, 0.25], dict(temperature=0.5), 0.7, 1),
    ([0.5, 0.25, 0.25], dict(temperature=2.0), 0.45, 1),  # sqrt(p): 0.414, 0.293, 0.293
    ([0.125, 0.5, 0.375], dict(top_k=2), 0.0, 1),  # u = 0 never draws the token top-k dropped
    ([0.125, 0.5, 0.375], dict(top_k=2), 0.999, 2),
])
def test_a_draw_is_the_inverse_cdf_of_the_tempered_filtered_distribution(probs, params, u, token):
    """The engine's draw with a chosen uniform: the first token whose cumulative probability under
    softmax(logits / temperature), filtered, exceeds u. Sampling tests at temperature 1 cannot see a wrong
    temperature; a uniform of exactly 0 must not pick a token of probability 0."""
    from fivefold.serve.sampling import sample_rows, slot_params

    logits = torch.tensor(probs).log()[None]
    req = type("R", (), dict(params=SamplingParams(**params), prompt_ids=[], output_ids=[]))()
    tokens, _ = sample_rows(logits, slot_params([req], uniforms=[u]), [req])
    assert tokens == [token]


def test_logit_bias_moves_its_own_rows_only():
    """logit_bias (OpenAI's): +100 on a token makes a greedy and a sampled request emit only it; -100 on
    the greedy choice bans it, the next most likely token taking its place; the bias is added before the
    filters and the logprobs stay the model's own. A biased request leaves its batch companions' tokens
    as they are alone. Out-of-range biases and token ids are refused with the field named."""
    from fivefold.serve.sampling import sample

    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]]).expand(3, 4)
    params = [SamplingParams(temperature=0, logit_bias={3: 100}), SamplingParams(top_k=1, logit_bias={1: -100}),
              SamplingParams(temperature=0, logprobs=1, logit_bias={2: 1.5})]
    reqs = [type("R", (), dict(params=p, prompt_ids=[], output_ids=[],
                                generator=torch.Generator().manual_seed(i)))() for i, p in enumerate(params)]
    tokens, logprobs = sample(logits, reqs)
    assert tokens == [3, 2, 2]  # forced; the top token banned (top-k 1 of what is left); 1.0 + 1.5 > 2.0
    assert logprobs[2]["top"][0][0] == 1  # the model's own most likely token, not the biased draw

    model = tiny()
    prompts = mixed_prompts(4, model.cfg.vocab_size, seed=9)
    plain = [SamplingParams(max_tokens=6, temperature=0.8, seed=i, ignore_eos=True) for i in range(4)]
    forced = dataclasses.replace(plain[1], logit_bias={7: 100})
    together = LLM(model).generate(prompts, [plain[0], forced, *plain[2:]])
    alone = [LLM(model).generate(p, s)[0] for p, s in zip(prompts, plain)]
    assert together[1].token_ids == [7] * 6
    assert [o.token_ids for i, o in enumerate(together) if i != 1] == [o.token_ids for i, o in enumerate(alone)
                                                                      if i != 1]
    with pytest.raises(RequestError, match="logit_bias values must be numbers in"):
        SamplingParams(logit_bias={1: 101})
    with pytest.raises(RequestError, match="logit_bias keys must be token ids"):
        SamplingParams(logit_bias={-1: 1})
    with pytest.raises(RequestError, match=f"the vocabulary has ids 0..{model.cfg.vocab_size - 1}"):
        LLM(model).generate(prompts[0], SamplingParams(logit_bias={model.cfg.vocab_size: 1}))


def test_min_tokens_holds_off_every_end():
    """min_tokens (vLLM's): end-of-sequence and stop token ids are banned from the sampler, and stop strings
    not looked for, until that many tokens are out. Forced by logit_bias towards ending at once, a request
    ends at its first chance after min_tokens; without min_tokens at its first token."""
    model = tiny()
    eos = model.cfg.eos_token_id
    prompt = mixed_prompts(1, model.cfg.vocab_size, seed=2)[0]
    for end, params in (("eos", dict(logit_bias={eos: 100})), ("stop id", dict(logit_bias={7: 100}, stop_token_ids=[7]))):
        token = eos if end == "eos" else 7
        for min_tokens, length in ((0, 1), (3, 4)):
            out = LLM(model).generate(prompt, SamplingParams(max_tokens=10, temperature=0.7, seed=1,
                                                             min_tokens=min_tokens, **params))[0]
            assert out.finish_reason == "stop" and len(out.token_ids) == length, (end, min_tokens, out.token_ids)
            assert out.token_ids[-1] == token and token not in out.token_ids[:-1]
    with pytest.raises(RequestError, match=r"min_tokens must be an integer in \[0, max_tokens\]"):
        SamplingParams(max_tokens=2, min_tokens=3)


def test_max_tokens_0_computes_the_prompt_into_the_prefix_cache():
    """max_tokens=0 without prompt_logprobs: nothing sampled (no text, finish "length", no prompt scores), even
    beside requests that generate, and the prompt's blocks are cached: the same prompt next finds all but its
    last token's block, and generates what it generates alone."""
    model = tiny()
    prompt = torch.randint(0, model.cfg.vocab_size, (50,), generator=torch.Generator().manual_seed(4)).tolist()
    llm = LLM(model, block_size=16)
    warm, other = llm.generate([prompt, prompt[:20]], [SamplingParams(max_tokens=0), SamplingParams(max_tokens=3, **GREEDY)])
    assert warm.token_ids == [] and warm.text == "" and warm.finish_reason == "length" and warm.prompt_logprobs is None
    assert len(other.token_ids) == 3
    after = llm.generate(prompt, SamplingParams(max_tokens=4, **GREEDY))[0]
    assert after.num_cached_tokens == 48
    assert after.token_ids == LLM(model, block_size=16).generate(prompt, SamplingParams(max_tokens=4, **GREEDY))[0].token_ids


def filtered_by_definition(logits, top_k, top_p):
    """Top-k then top-p one row at a time over a full sort: the definition filtered_probs computes."""
    out = []
    for row, k, p in zip(logits, top_k.tolist(), top_p.tolist()):
        values, order = row.sort(descending=True)
        keep = torch.ones_like(values, dtype=torch.bool)
        if k:
            keep[k:] = False
        probs = values.masked_fill(~keep, float("-inf")).softmax(-1)
        if p < 1:
            keep &= probs.cumsum(-1) - probs < p
        mask = torch.zeros_like(keep).index_fill_(0, order[keep], True)
        out.append(row.masked_fill(~mask, float("-inf")).softmax(-1))
    return torch.stack(out)


@pytest.mark.parametrize("candidates", [0, 4, 256])
def test_the_nucleus_among_candidates_is_the_full_sorts(candidates):
    """Rows peaked (the nucleus a few tokens) and flat (thousands), top-k and top-p mixed per row: looking for
    the nucleus among the likeliest `candidates` first, and sorting whole only the rows it passes, keeps what a
    full sort of each row keeps (0: every row sorted, CUDA's way)."""
    g = torch.Generator().manual_seed(5)
    v = 3000
    logits = torch.randn(12, v, generator=g) * torch.tensor([8.0, 0.5] * 6)[:, None]  # peaked, flat, ...
    top_k = torch.tensor([0, 0, 5, 2000, 0, 0, 50, 0, 1, 0, 0, 300])
    top_p = torch.tensor([0.9, 0.95, 1.0, 0.9, 0.5, 0.999, 0.8, 1.0, 0.9, 0.3, 0.99, 0.97])
    one = torch.ones(12)
    for k in (top_k, top_k.clamp(max=3)):  # top-k's k-th taken beside the candidates, or past them
        got = filtered_probs(logits, one, k, top_p, torch.zeros(12), candidates=candidates)
        want = filtered_by_definition(logits, k, top_p)
        assert torch.equal(got > 0, want > 0)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    got = filtered_probs(logits, one, top_k, top_p, torch.zeros(12), candidates=candidates)
    kept = (got > 0).sum(-1).tolist()
    assert min(kept) == 1 and max(kept) > 2000  # nuclei inside and past the candidates, and past top-k's 2,000
