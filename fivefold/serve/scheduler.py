"""Continuous batching: which sequences run in the next forward, and how many of their tokens.

Prefill and decode are one operation here: a sequence has `num_computed` tokens whose keys and values
are cached, and the next forward computes some of the rest. When that reaches its last token, a new
token is sampled (a decode is the case of exactly one token left). Each step fills a token budget:
running sequences first, oldest first, then waiting ones in arrival order, their prompts in chunks.
When the pool runs out, the latest arrival is preempted: its blocks are freed and it goes back to the
front of the queue, to be recomputed from its prompt and the tokens it already produced (its sampler
state is kept, so its output is the same as if it had never been interrupted).

Bookkeeping is O(B) per step for B running sequences: a sequence's tokens are one list appended to, and
whether it runs is a flag, not a search of the running list. `slots` (fivefold.serve.batch.InputBatch)
is told when a sequence starts and stops running, so it can give it, and take back, a persistent slot.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from fivefold.serve.blocks import BlockManager
from fivefold.serve.sampling import SamplingParams


@dataclass(eq=False)  # identity: the scheduler looks sequences up in its lists every step
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    arrival: int  # admission order: preemption picks the largest
    prompt: str | None = None
    uniforms: object = None  # (max_tokens,) numpy float32: the uniform number each output token is drawn with
    output_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # prompt + output, appended to (set in __post_init__)
    logprobs: list[dict] = field(default_factory=list)
    # With params.prompt_logprobs: each prompt token's entry so far (the first token's is None)
    prompt_logprobs: list[dict | None] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop", "length" or "abort"
    num_computed: int = 0  # tokens whose keys and values are in the cache
    num_cached: int = 0  # of the prompt, found in the prefix cache at admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    preemptions: int = 0
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    adapter: str | None = None  # the LoRA adapter this request runs with (fivefold.serve.adapters); None: the base
    cache_salt: bytes = b""  # roots its prefix-cache chain: an adapter's keys and values are its own
    slot: int = -1  # its row in the persistent batch while it runs (fivefold.serve.batch); -1: none
    running: bool = False
    # Under asynchronous scheduling (fivefold.serve.engine): its last token is still being sampled on the
    # device; token_ids ends with a placeholder the next forward reads from the device (`pending_row`:
    # its row among that step's sampled tokens).
    pending: bool = False
    pending_row: int = -1

    def __post_init__(self):
        self.token_ids = self.prompt_ids + self.output_ids
        if self.params.prompt_logprobs is not None and not self.prompt_logprobs:
            self.prompt_logprobs = [None]

    @property
    def scoring(self) -> bool:
        """Whether some prompt token's logprob is still to be computed (its prompt is then not taken from the
        prefix cache: cached blocks come without the logits of their tokens)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids)

    def append(self, token: int) -> None:
        self.output_ids.append(token)
        self.token_ids.append(token)

    def scored_rows(self, n: int) -> int:
        """How many of the next `n` tokens' rows score a prompt token (row at position p scores token p + 1;
        what was scored before a preemption is not scored again)."""
        if not self.scoring:
            return 0
        start = max(self.num_computed, len(self.prompt_logprobs) - 1)
        return max(0, min(self.num_computed + n, len(self.prompt_ids) - 1) - start)

    def within_scored(self, n: int, rows: int) -> int:
        """The most of the next `n` tokens whose rows score at most `rows` prompt tokens."""
        if self.scored_rows(n) <= rows:
            return n
        return max(self.num_computed, len(self.prompt_logprobs) - 1) - self.num_computed + rows

    @property
    def remaining(self) -> int:
        """Tokens to compute before the next one can be sampled; 0 once every wanted token is sampled
        (under asynchronous scheduling, before the last is known)."""
        if self.params.max_tokens and len(self.output_ids) >= self.params.max_tokens:
            return 0  # (max_tokens 0: the prompt is computed, scored if asked, and nothing is sampled)
        return len(self.token_ids) - self.num_computed

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, slots=None,
                 max_scored_tokens: int | None = None):
        """`max_scored_tokens`: prompt tokens scored in one step (None: no bound but the token budget)."""
        self.blocks, self.slots = blocks, slots
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.max_scored_tokens = max_num_batched_tokens if max_scored_tokens is None else max_scored_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # by arrival
        self.preemptions = 0
        # Blocks kept free when admitting while others run, so running sequences can grow for a few steps
        # before anyone is preempted.
        self.reserve = max(1, blocks.num_blocks // 100)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """The next forward: (sequence, tokens to compute) pairs."""
        budget, scheduled, preempted = self.max_num_batched_tokens, [], False
        scored = self.max_scored_tokens  # rows left this step to score prompt tokens on
        for seq in list(self.running):
            if budget == 0:
                break
            if not seq.running:  # preempted below by an older sequence
                continue
            n = min(seq.remaining, budget)
            scoring = seq.scoring
            if scoring:
                n = seq.within_scored(n, scored)
            if n == 0:  # its last token is being sampled (it finishes when that is known), or no scoring rows are left
                continue
            while not self.blocks.grow(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                scheduled.append((seq, n))
                budget -= n
                if scoring:
                    scored -= seq.scored_rows(n)
        while self.waiting and budget and not preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            allowed, scoring = budget, seq.scoring
            if scoring:  # it starts from its first token: a prompt being scored takes nothing from the cache
                seq.num_computed = 0
                allowed = seq.within_scored(budget, scored)
            n = self.blocks.start(seq, allowed, reserve=self.reserve if self.running else 0) if allowed else 0
            if not n:
                break
            self.waiting.popleft()
            bisect.insort(self.running, seq, key=lambda s: s.arrival)
            seq.running = True
            if self.slots is not None:
                self.slots.admit(seq)
            scheduled.append((seq, n))
            budget -= n
            if scoring:
                scored -= seq.scored_rows(n)
        return scheduled

    def _stop_running(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.running = False
        if self.slots is not None:
            self.slots.release(seq)

    def _preempt(self, seq: Sequence) -> None:
        self._stop_running(seq)
        self.blocks.release(seq)
        seq.preemptions += 1
        self.preemptions += 1
        # Victims go latest first, so the earliest ends up in front.
        self.waiting.appendleft(seq)

    def preempt_all(self) -> None:
        """Every running sequence back to the queue, to recompute its cache (e.g. after new weights)."""
        for seq in reversed(list(self.running)):
            self._preempt(seq)

    def finish(self, seq: Sequence) -> None:
        if seq.running:
            self._stop_running(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq)
