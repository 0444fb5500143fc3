"""The training loss: summed next-token cross-entropy, in fp32, over the labels that are not padding.

One convention everywhere: the loss of a global batch is the mean over all its non-padding target tokens,
whatever the micro-batching or the parallel layout. Micro-batches therefore return *sums*, which the
step divides by the global batch's token count before backward.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch
import torch.nn.functional as F

from fivefold.config import Config
from fivefold.data.labels import IGNORE_INDEX
from fivefold.model import ForwardContext, doc_ids_from_tokens


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of (B, S, V) logits against (B, S) labels, skipping IGNORE_INDEX."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def token_loss_sum(model, inputs: torch.Tensor, labels: torch.Tensor, cfg: Config, ctx: ForwardContext | None = None,
                   loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy_sum) -> torch.Tensor:
    """Forward of one micro-batch and its summed token loss. With packed documents masked, the
    documents are found from `inputs` unless the context gives them (e.g. for a part of each sequence)."""
    ctx = ctx or ForwardContext()
    if ctx.doc_ids is None and cfg.model.document_mask:
        ctx = replace(ctx, doc_ids=doc_ids_from_tokens(inputs, cfg.model.eos_token_id))
    return loss_sum(model(inputs, ctx), labels)
