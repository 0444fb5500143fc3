"""The MFU FLOP count against PyTorch's counter."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from fivefold.config import ModelConfig
from fivefold.memory.formulas import flops_per_token
from fivefold.model import build_model
from fivefold.presets import PRESETS


@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt2"])
def test_flops_per_token_equals_pytorch_flop_counter(preset):
    """The MFU numerator: 6 x matmul parameters + the full-attention term, counted by torch itself on
    eager attention (explicit q k^T and probs v matmuls) over forward and backward."""
    cfg = ModelConfig(**{**PRESETS[preset].__dict__, "attention": "eager"})
    model = build_model(cfg)
    batch, seq = 2, 16
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    with FlopCounterMode(display=False) as counter:
        model(ids).float().sum().backward()
    assert counter.get_total_flops() == flops_per_token(cfg, seq) * batch * seq
