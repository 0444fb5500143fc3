"""The persistent batch: what the engine keeps per running request, and one step's inputs built from it.

Each running request owns a slot (a row) from admission until it finishes or is preempted. The slot holds
what does not change from step to step: its block table (int32, appended to as the sequence grows, never
rebuilt) and its sampling parameters. A step's inputs (token ids, positions, slot mapping, query starts,
sequence lengths, which rows are sampled) are then a few vectorised numpy operations over the scheduled
slots, with no per-token Python and no per-sequence device tensors (vLLM's persistent batch, simply).

`StepInputs` is plain numpy, so the tensor-parallel driver can broadcast it and every rank builds the
same forward from it (fivefold.serve.buffers puts it on the device).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fivefold.serve.blocks import blocks_for


@dataclass
class StepInputs:
    """One forward, rows ordered decodes first. T tokens, B sequences, N sampled."""
    input_ids: np.ndarray  # (T,) int32
    positions: np.ndarray  # (T,) int32
    slot_mapping: np.ndarray  # (T,) int32: where each token's key and value go in the pool (-1: padding)
    query_start_loc: np.ndarray  # (B + 1,) int32: sequence i's tokens are rows qsl[i]:qsl[i+1]
    seq_lens: np.ndarray  # (B,) int32: each sequence's context after this step, its new tokens included
    slots: np.ndarray  # (B,) int32: each sequence's slot, i.e. its row of the block table
    logits_indices: np.ndarray  # (N + M,) int32: rows whose logits are sampled (a sequence's last token), then scored
    sampled: np.ndarray  # (N,) int64: which of the B sequences those are
    num_decodes: int  # the first num_decodes sequences have one token each
    max_query_len: int
    max_blocks: int  # block-table columns the longest sequence uses
    # Block-table entries written since the last step: flat index slot * max_blocks_per_seq + column, value.
    table_index: np.ndarray  # (D,) int32
    table_value: np.ndarray  # (D,) int32
    # Asynchronous scheduling: rows whose input token is still on the device (a placeholder here), and
    # where each is among the previous step's sampled tokens.
    patch_rows: np.ndarray = None  # (P,) int32
    patch_from: np.ndarray = None  # (P,) int32
    # Prompt scoring (SamplingParams.prompt_logprobs): rows whose logits score the prompt token after them,
    # after the sampled rows in logits_indices; the token each is scored on, and which sequence it is of.
    scored_targets: np.ndarray = None  # (M,) int64
    scored_owners: np.ndarray = None  # (M,) int64, indices into the B sequences

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def decode_only(self) -> bool:
        return self.num_decodes == self.num_seqs

    def padded(self, rows: int) -> "StepInputs":
        """A decode-only step grown to `rows` sequences of one token each, as a CUDA graph of that batch
        size reads it: each padding row stores nothing (slot -1), has no context (length 0, so it attends
        to nothing and reads no block) and is not sampled."""
        extra = rows - self.num_seqs
        if extra < 0 or not self.decode_only:
            raise ValueError(f"padded({rows}): a decode-only step of at most {rows} sequences is needed")

        def grow(a: np.ndarray, fill) -> np.ndarray:
            return np.concatenate([a, np.full(extra, fill, dtype=a.dtype)])

        qsl = np.concatenate([self.query_start_loc, self.query_start_loc[-1] + np.arange(1, extra + 1, dtype=np.int32)])
        return StepInputs(grow(self.input_ids, 0), grow(self.positions, 0), grow(self.slot_mapping, -1), qsl,
                          grow(self.seq_lens, 0), grow(self.slots, 0), self.logits_indices, self.sampled, rows, 1,
                          self.max_blocks, self.table_index, self.table_value, self.patch_rows, self.patch_from)

    @classmethod
    def empty(cls) -> "StepInputs":
        """No sequences (grown with `padded`, the inert input a CUDA graph is captured with)."""
        none = np.zeros(0, dtype=np.int32)
        return cls(none, none, none, np.zeros(1, dtype=np.int32), none, none, none, np.zeros(0, dtype=np.int64),
                   0, 1, 1, none, none)


@dataclass
class SlotParams:
    """Per-row sampling parameters of the sampled rows of one step (numpy, gathered from the slots)."""
    temperature: np.ndarray  # float32; rows with temperature 0 are greedy (their value is set to 1)
    top_k: np.ndarray  # int64, 0: off
    top_p: np.ndarray  # float32, 1: off
    min_p: np.ndarray  # float32, 0: off
    repetition_penalty: np.ndarray
    presence_penalty: np.ndarray
    frequency_penalty: np.ndarray
    greedy: np.ndarray  # bool
    uniforms: np.ndarray  # float32: each row's pre-drawn uniform for this token


class InputBatch:
    """Slots for up to `max_num_seqs` running sequences (fivefold.serve.scheduler.Sequence)."""

    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int):
        self.block_size = block_size
        self.max_blocks_per_seq = blocks_for(max_model_len, block_size)
        self.block_tables = np.zeros((max_num_seqs, self.max_blocks_per_seq), dtype=np.int32)
        self.blocks_written = np.zeros(max_num_seqs, dtype=np.int64)
        self.free = list(range(max_num_seqs - 1, -1, -1))  # pop() gives the lowest slot
        self.temperature = np.ones(max_num_seqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_seqs, dtype=np.int64)
        self.top_p = np.ones(max_num_seqs, dtype=np.float32)
        self.min_p = np.zeros(max_num_seqs, dtype=np.float32)
        self.repetition_penalty = np.ones(max_num_seqs, dtype=np.float32)
        self.presence_penalty = np.zeros(max_num_seqs, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_num_seqs, dtype=np.float32)
        self.greedy = np.zeros(max_num_seqs, dtype=bool)
        self.scores = np.zeros(max_num_seqs, dtype=bool)  # the slot's request asked for prompt_logprobs
        self.no_tokens = np.zeros(max_num_seqs, dtype=bool)  # its max_tokens is 0: it ends when its prompt is in
        self.pending: list[tuple[int, int, list[int]]] = []  # (slot, first column, new entries) for the device

    # ---- slots (called by the scheduler)

    def admit(self, seq) -> None:
        slot = self.free.pop()
        seq.slot = slot
        p = seq.params
        self.greedy[slot] = p.greedy
        self.scores[slot] = p.prompt_logprobs is not None
        self.no_tokens[slot] = p.max_tokens == 0
        self.temperature[slot] = p.temperature if not p.greedy else 1.0
        self.top_k[slot], self.top_p[slot], self.min_p[slot] = p.top_k, p.top_p, p.min_p
        self.repetition_penalty[slot] = p.repetition_penalty
        self.presence_penalty[slot], self.frequency_penalty[slot] = p.presence_penalty, p.frequency_penalty
        self.blocks_written[slot] = 0

    def release(self, seq) -> None:
        self.free.append(seq.slot)
        seq.slot = -1

    # ---- one step

    def _sync_tables(self, seqs) -> tuple[np.ndarray, np.ndarray]:
        """Append each sequence's new blocks to its row; the entries written, for the device's copy."""
        index, value = [], []
        width = self.max_blocks_per_seq
        for seq in seqs:
            slot, have = seq.slot, int(self.blocks_written[seq.slot])
            table = seq.block_table
            if len(table) > have:
                new = table[have:]
                self.block_tables[slot, have:len(table)] = new
                index.extend(range(slot * width + have, slot * width + len(table)))
                value.extend(new)
                self.blocks_written[slot] = len(table)
        return np.asarray(index, dtype=np.int32), np.asarray(value, dtype=np.int32)

    def prepare(self, work: list) -> StepInputs:
        """`work`: (sequence, tokens to compute) pairs, single tokens first (the scheduler's step)."""
        seqs = [s for s, _ in work]
        b = len(work)
        n = np.fromiter((k for _, k in work), dtype=np.int64, count=b)
        computed = np.fromiter((s.num_computed for s in seqs), dtype=np.int64, count=b)
        total = np.fromiter((len(s.token_ids) for s in seqs), dtype=np.int64, count=b)
        slots = np.fromiter((s.slot for s in seqs), dtype=np.int64, count=b)
        num_decodes = int(np.searchsorted(n != 1, True))  # the single-token rows come first
        ids = [s.token_ids[-1] if k == 1 and c + 1 == len(s.token_ids) else None for (s, k), c in zip(work, computed)]
        if all(i is not None for i in ids):
            input_ids = np.asarray(ids, dtype=np.int32)
        else:
            input_ids = np.fromiter((t for (s, k), c in zip(work, computed.tolist()) for t in s.token_ids[c:c + k]),
                                    dtype=np.int32, count=int(n.sum()))
        qsl = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(n, out=qsl[1:])
        row = np.repeat(np.arange(b), n)
        positions = np.arange(qsl[-1]) - qsl[row] + computed[row]
        seq_lens = computed + n
        index, value = self._sync_tables(seqs)
        bs = self.block_size
        blocks = self.block_tables[slots[row], positions // bs].astype(np.int64)
        slot_mapping = blocks * bs + positions % bs
        sampled = np.flatnonzero(seq_lens == total)
        pending = np.fromiter((s.pending_row if s.pending else -1 for s in seqs), dtype=np.int64, count=b)
        patch = np.flatnonzero(pending >= 0)  # decode rows all: a pending token is a sequence's last
        logits_rows = (qsl[1:][sampled] - 1).astype(np.int32)
        targets = owners = None
        # A step without a request that scores (the usual one) pays one vectorised test, not a look at each.
        scoring = [i for i in np.flatnonzero(self.scores[slots]).tolist() if seqs[i].scoring]
        if scoring:
            rows, targets, owners = self._scored_rows(work, scoring, qsl, computed)
            logits_rows = np.concatenate([logits_rows, rows])
        return StepInputs(input_ids, positions.astype(np.int32), slot_mapping.astype(np.int32),
                          qsl.astype(np.int32), seq_lens.astype(np.int32), slots.astype(np.int32),
                          logits_rows, sampled, num_decodes, int(n.max()),
                          blocks_for(int(seq_lens.max()), bs), index, value,
                          qsl[patch].astype(np.int32), pending[patch].astype(np.int32), targets, owners)

    @staticmethod
    def _scored_rows(work: list, scoring: list[int], qsl: np.ndarray, computed: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The rows of the scoring sequences' chunks whose logits score a prompt token not yet scored (row at
        position p scores prompt token p + 1; a recomputed chunk after preemption skips what was scored)."""
        rows, targets, owners = [], [], []
        for i in scoring:
            seq, k = work[i]
            c, prompt = int(computed[i]), seq.prompt_ids
            first, end = max(c, len(seq.prompt_logprobs) - 1), min(c + k, len(prompt) - 1)
            if first < end:
                rows.append(np.arange(first, end) - c + qsl[i])
                targets.append(np.asarray(prompt[first + 1:end + 1], dtype=np.int64))
                owners.append(np.full(end - first, i, dtype=np.int64))
        if not rows:
            return np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        return np.concatenate(rows).astype(np.int32), np.concatenate(targets), np.concatenate(owners)

    def sampling_params(self, seqs) -> SlotParams:
        """The sampled sequences' parameters, and the uniform each draws its next token with (its own,
        pre-drawn: the token does not depend on what else is in the batch)."""
        slots = np.fromiter((s.slot for s in seqs), dtype=np.int64, count=len(seqs))
        uniforms = np.fromiter((s.uniforms[len(s.output_ids)] for s in seqs), dtype=np.float32, count=len(seqs))
        return SlotParams(self.temperature[slots], self.top_k[slots], self.top_p[slots], self.min_p[slots],
                          self.repetition_penalty[slots], self.presence_penalty[slots],
                          self.frequency_penalty[slots], self.greedy[slots], uniforms)
