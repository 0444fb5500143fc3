"""ForwardContext: what one forward call needs besides the token ids, passed with the call.

The model stores no runtime state: whoever runs it (the trainer, a parallel layout, the serving
engine) says per call where the tokens sit and what they may attend to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardContext:
    # (B, S) absolute positions of the tokens; None: 0..S-1 (a runtime with a cache always passes them).
    positions: torch.Tensor | None = None
    # (B, S) packed-document ids: a token attends only within its document (training on packed data).
    doc_ids: torch.Tensor | None = None
    # Keys and values of earlier tokens (serving): each attention layer hands its q, k, v to
    # `kv_cache.attend(layer, q, k, v, core, mask)`, which stores k, v and attends over everything cached
    # (fivefold.serve.kv_pool.PagedBatch: paged blocks of many sequences in one flattened row).
    kv_cache: object | None = None
    # What every attention core receives as its mask, when the runtime knows better than a local mask:
    # e.g. context parallelism's document blocks of the whole ring (fivefold.parallel.context_parallel).
    # None: the model builds the causal / document mask of this call's tokens.
    mask: object | None = None
    # (N,) indices into the flattened (B*S) tokens whose logits are wanted (e.g. the last token of each
    # sequence of a serving batch); None: all of them, shaped (B, S, V). The head is the largest matmul
    # of a long prompt, so computing it only where a token is sampled matters.
    logits_at: torch.Tensor | None = None
