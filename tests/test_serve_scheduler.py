"""The scheduler on its own, over a small BlockManager: admission, the reserve, preemption, queue order."""

import itertools

import torch

from fivefold.serve.blocks import BlockManager
from fivefold.serve.sampling import SamplingParams
from fivefold.serve.scheduler import Scheduler, Sequence

BS = 4
_tokens = itertools.count(1)  # distinct token ids: no two prompts share a prefix


def request(name: str, arrival: int, prompt_len: int, max_tokens: int = 16) -> Sequence:
    return Sequence(name, [next(_tokens) for _ in range(prompt_len)], SamplingParams(max_tokens=max_tokens),
                    torch.Generator(), arrival)


def step(scheduler: Scheduler) -> list[tuple[str, int]]:
    """One engine step without a model: schedule, compute what was scheduled, publish full blocks, and give
    each sequence whose last token was computed a new token. Returns (request id, tokens) pairs."""
    work = scheduler.schedule()
    for s, n in work:
        s.num_computed += n
        scheduler.blocks.register(s)
    for s, n in work:
        if s.num_computed == len(s.token_ids):
            s.append(0)
    return [(s.request_id, n) for s, n in work]


def test_admission_while_others_run_keeps_the_reserve_free():
    """While a sequence runs, a waiting one is admitted only if `reserve` blocks stay free afterwards, so the
    running ones can grow for a few steps before anyone is preempted. Admitting into the last free block
    would preempt someone at the very next decode that crosses a block boundary."""
    blocks = BlockManager(num_blocks=4, block_size=BS)
    scheduler = Scheduler(blocks, max_num_seqs=8, max_num_batched_tokens=64)
    assert scheduler.reserve == 1
    first, second = request("first", 0, BS), request("second", 1, 3 * BS)
    scheduler.add(first)
    scheduler.add(second)
    # first takes 1 block (no reserve: nothing runs yet); second needs the other 3, which would leave 0.
    assert step(scheduler) == [("first", BS)]
    assert blocks.num_free == 3
    assert list(scheduler.waiting) == [second] and scheduler.running == [first]


def test_admission_into_an_empty_scheduler_may_take_every_block():
    """With nothing running there is no one to keep room for: a prompt that needs the whole pool is
    admitted (were the reserve kept here too, it would never be)."""
    blocks = BlockManager(num_blocks=4, block_size=BS)
    scheduler = Scheduler(blocks, max_num_seqs=8, max_num_batched_tokens=64)
    whole = request("whole", 0, 4 * BS)
    scheduler.add(whole)
    assert step(scheduler) == [("whole", 4 * BS)]
    assert blocks.num_free == 0


def test_a_preempted_sequence_goes_back_to_the_front_of_the_queue():
    """When the pool runs out, the latest running sequence is preempted and queued ahead of requests that
    arrived after it: it was admitted before them and has already waited. Queued behind them, it could
    be overtaken again and again and starve."""
    blocks = BlockManager(num_blocks=3, block_size=BS)
    scheduler = Scheduler(blocks, max_num_seqs=8, max_num_batched_tokens=64)
    old, victim, late = request("old", 0, BS), request("victim", 1, BS), request("late", 2, BS)
    for s in (old, victim, late):
        scheduler.add(s)
    # old and victim take a block each; late would leave none free (reserve 1) and waits.
    assert step(scheduler) == [("old", BS), ("victim", BS)]
    assert blocks.num_free == 1
    # Each now has 5 tokens and needs a second block: old takes the last one, victim is preempted.
    assert step(scheduler) == [("old", 1)]
    assert victim.preemptions == 1 and scheduler.preemptions == 1
    assert victim.block_table == [] and victim.num_computed == 0 and not victim.running
    assert list(scheduler.waiting) == [victim, late]
    assert scheduler.running == [old]


def test_no_admission_in_a_step_that_preempted():
    """A step that had to preempt admits nothing, though the freed blocks and the budget left would fit the
    victim's first chunk: preemption freed those blocks so the running sequences can grow, and handing
    them straight to a waiting sequence would spend that room in the same step, so the next block
    boundary preempts again (thrashing: recomputing prompts instead of decoding)."""
    blocks = BlockManager(num_blocks=6, block_size=BS, prefix_cache=False)
    scheduler = Scheduler(blocks, max_num_seqs=8, max_num_batched_tokens=5)
    short, long = request("short", 0, BS), request("long", 1, 10 * BS)
    scheduler.add(short)
    scheduler.add(long)
    # short decodes one token a step; long's prompt is prefilled in chunks with the rest of the budget.
    assert step(scheduler) == [("short", BS), ("long", 1)]
    assert step(scheduler) == [("short", 1), ("long", 4)]
    assert step(scheduler) == [("short", 1), ("long", 4)]
    assert step(scheduler) == [("short", 1), ("long", 4)]
    assert blocks.num_free == 0 and len(long.block_table) == 4 and long.num_computed == 13
    # long's next chunk needs a fifth block: it is preempted, freeing 4; its first chunk (4 tokens, 1 block)
    # would fit beside the reserve, but it waits for the next step.
    assert step(scheduler) == [("short", 1)]
    assert long.preemptions == 1 and not long.running
    assert list(scheduler.waiting) == [long] and blocks.num_free == 4
    assert step(scheduler) == [("short", 1), ("long", 4)]
