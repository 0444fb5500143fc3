"""Sequences admitted to a persistent batch on block tables of the test's choosing, for tests that drive
PagedBatch steps by hand (which tokens each step computes) instead of through the scheduler."""

from types import SimpleNamespace

from fivefold.serve import SamplingParams
from fivefold.serve.batch import InputBatch
from fivefold.serve.buffers import StepBuffers


def admitted(seqs: list[list[int]], tables: list[list[int]], block_size: int, max_model_len: int, rows: int = 0):
    """(the InputBatch, its StepBuffers for up to `rows` sequences a step (default: as many as `seqs`), the
    admitted rows: set each one's `num_computed`, then `batch.prepare([(row, tokens), ...])`)."""
    rows = rows or len(seqs)
    batch = InputBatch(max_num_seqs=len(seqs), max_model_len=max_model_len, block_size=block_size)
    buffers = StepBuffers(64, rows, rows, batch.max_blocks_per_seq, "cpu")
    admitted_rows = [SimpleNamespace(token_ids=s, block_table=t, num_computed=0, params=SamplingParams(),
                                     pending=False, scoring=False) for s, t in zip(seqs, tables)]
    for row in admitted_rows:
        batch.admit(row)
    return batch, buffers, admitted_rows
