"""Scoring prompts (SamplingParams.prompt_logprobs, the server's echo, `fivefold score`): each prompt token's
logprob through the engine equals a full forward's log-softmax, however the prompt is chunked, preempted,
batched or already in the prefix cache, and scoring changes no sampled token."""

import dataclasses

import pytest
import torch

from fivefold.model import build_model
from fivefold.presets import PRESETS
from fivefold.serve import LLM, RequestError, SamplingParams

TOP = 3


def tiny(preset="tiny", **changes):
    cfg = dataclasses.replace(PRESETS[preset], max_seq_len=256, **changes)
    return build_model(cfg, seed=3).eval()


def prompts_of(lengths, vocab, seed=0, shared=()):
    g = torch.Generator().manual_seed(seed)
    return [list(shared) + torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def assert_scores_exact(model, prompt: list[int], entries: list) -> None:
    """`entries` (a RequestOutput's prompt_logprobs) against log_softmax of the full forward over `prompt`:
    one per token, the first None, each the next token's logprob (fp32: 1e-5), its rank and the TOP likeliest
    ids."""
    assert len(entries) == len(prompt) and entries[0] is None
    if len(prompt) == 1:
        return
    ref = torch.log_softmax(model(torch.tensor([prompt]))[0, :-1].float(), dim=-1)
    assert [e["token_id"] for e in entries[1:]] == prompt[1:]
    torch.testing.assert_close(torch.tensor([e["logprob"] for e in entries[1:]]),
                               ref.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0], atol=1e-5, rtol=0)
    chosen = ref.gather(1, torch.tensor(prompt[1:])[:, None])
    assert [e["rank"] for e in entries[1:]] == ((ref > chosen).sum(dim=-1) + 1).tolist()
    values, ids = ref.topk(TOP, dim=-1)
    assert [[t for t, _ in e["top"]] for e in entries[1:]] == ids.tolist()
    torch.testing.assert_close(torch.tensor([[lp for _, lp in e["top"]] for e in entries[1:]]), values,
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt2", "tiny-moe"])
def test_prompt_logprobs_equal_the_full_forward_in_chunks_beside_generation(preset):
    """Prompts of 1 to 90 tokens scored in chunks of 16 tokens a step, in the same steps as requests that
    generate: every score is the full forward's, and the generated tokens are those of a run without scoring."""
    model = tiny(preset)
    prompts = prompts_of([1, 2, 7, 40, 90, 33], model.cfg.vocab_size)
    scoring = [SamplingParams(max_tokens=k, temperature=0, ignore_eos=True, prompt_logprobs=TOP)
               for k in (3, 0, 5, 0, 2, 4)]
    plain = [dataclasses.replace(p, prompt_logprobs=None, max_tokens=max(p.max_tokens, 1)) for p in scoring]
    llm = LLM(model, max_num_batched_tokens=16, block_size=8, max_num_seqs=4)
    outs = llm.generate(prompts, scoring)
    for prompt, out in zip(prompts, outs):
        assert_scores_exact(model, prompt, out.prompt_logprobs)
    without = LLM(model).generate(prompts, plain)
    for p, out, ref in zip(scoring, outs, without):
        assert out.finish_reason == "length"
        assert out.token_ids == ref.token_ids[:p.max_tokens]  # max_tokens 0: nothing sampled
        assert out.prompt_logprobs is not None and ref.prompt_logprobs is None
    assert llm.engine.stats["steps"] > sum(map(len, prompts)) // 16  # the prompts really ran in chunks
    assert llm.engine.blocks.num_used == 0


def test_a_scored_prompt_is_computed_whole_though_its_prefix_is_cached():
    """Cached blocks hold keys and values, not the logits of their tokens: a prompt to score skips the prefix
    cache (0 cached tokens) and still scores exactly, while an unscored request behind it uses the cache. Its
    blocks are published for later requests."""
    model = tiny()
    shared = prompts_of([48], model.cfg.vocab_size, seed=1)[0]
    prompts = prompts_of([10, 12, 9], model.cfg.vocab_size, seed=2, shared=shared)
    llm = LLM(model, block_size=16)
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.generate(prompts[0], greedy)  # its 3 full prompt blocks stay cached
    scored = llm.generate(prompts[1], dataclasses.replace(greedy, prompt_logprobs=TOP))[0]
    assert scored.num_cached_tokens == 0
    assert_scores_exact(model, prompts[1], scored.prompt_logprobs)
    assert llm.generate(prompts[2], greedy)[0].num_cached_tokens == 48


def test_preempted_scoring_resumes_without_repeating_a_score():
    """A pool too small for the batch: scoring sequences are preempted mid-prompt and recomputed; each prompt
    token is scored once (no duplicates from the recomputed chunks) and exactly."""
    model = tiny()
    prompts = prompts_of([30, 26, 21, 28, 25, 19], model.cfg.vocab_size, seed=4)
    params = [SamplingParams(max_tokens=20, temperature=0.8, seed=i, ignore_eos=True, prompt_logprobs=TOP)
              for i in range(6)]
    llm = LLM(model, num_blocks=14, block_size=4, max_num_batched_tokens=8)
    outs = llm.generate(prompts, params)
    assert llm.engine.scheduler.preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert_scores_exact(model, prompt, out.prompt_logprobs)
    free = LLM(model).generate(prompts, [dataclasses.replace(p, prompt_logprobs=None) for p in params])
    assert [o.token_ids for o in outs] == [o.token_ids for o in free]


def test_scores_do_not_depend_on_the_batch_and_sum_to_the_training_loss():
    """A prompt scored alone and among others gives the same entries; minus their mean is the cross-entropy the
    trainer minimises on the same tokens."""
    model = tiny()
    prompts = prompts_of([64, 17, 50], model.cfg.vocab_size, seed=6)
    params = SamplingParams(max_tokens=0, prompt_logprobs=0)
    together = LLM(model, max_num_batched_tokens=24).generate(prompts, params)
    alone = [LLM(model).generate(p, params)[0] for p in prompts]
    for a, b in zip(together, alone):
        torch.testing.assert_close([e["logprob"] for e in a.prompt_logprobs[1:]],
                                   [e["logprob"] for e in b.prompt_logprobs[1:]], atol=1e-5, rtol=0)
        assert all(e["top"] == [] for e in a.prompt_logprobs[1:])  # prompt_logprobs=0: the token's own only
    ids = torch.tensor(prompts[0])
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(model(ids[None, :-1])[0].float(), ids[1:])
    mean = sum(e["logprob"] for e in together[0].prompt_logprobs[1:]) / (len(prompts[0]) - 1)
    assert -mean == pytest.approx(float(loss), abs=1e-5)


def test_scoring_requests_that_cannot_be_served_are_refused():
    with pytest.raises(RequestError, match="max_tokens must be an integer >= 0"):
        SamplingParams(max_tokens=-1)
    for bad in (21, -1, 1.5):
        with pytest.raises(RequestError, match="prompt_logprobs must be an integer in 0..20"):
            SamplingParams(prompt_logprobs=bad)
