"""Sampling filters against hand-computed distributions; the MFU FLOP count against PyTorch's counter."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from fivefold.config import ModelConfig
from fivefold.infer.sampling import next_token_probs, sample_next
from fivefold.memory.formulas import flops_per_token
from fivefold.model import build_model
from fivefold.presets import PRESETS

LOGITS = torch.log(torch.tensor([[0.05, 0.40, 0.10, 0.30, 0.15]]))  # probabilities by token id


def empirical(n=4000, **kw):
    gen = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_next(LOGITS, generator=gen, **kw) for _ in range(n)]).flatten()
    return torch.bincount(draws, minlength=5).float() / n


def test_greedy_and_top_k_1_pick_the_argmax():
    assert sample_next(LOGITS, temperature=0).item() == 1
    assert (empirical(200, top_k=1) == torch.tensor([0, 1.0, 0, 0, 0])).all()


def test_top_k_renormalises_over_the_k_most_likely():
    expected = torch.tensor([0, 0.40, 0, 0.30, 0.15]) / 0.85
    torch.testing.assert_close(empirical(top_k=3), expected, atol=0.03, rtol=0)


@pytest.mark.parametrize("top_p, kept", [(0.39, [1]), (0.41, [1, 3]), (0.69, [1, 3]), (0.71, [1, 3, 4]),
                                         (0.84, [1, 3, 4]), (0.86, [1, 3, 4, 2]), (0.96, [0, 1, 2, 3, 4])])
def test_top_p_keeps_the_smallest_nucleus_reaching_p(top_p, kept):
    """Sorted probabilities 0.40, 0.30, 0.15, 0.10, 0.05: the nucleus grows by one token each time p
    passes a cumulative sum (0.40, 0.70, 0.85, 0.95); tested 0.01 on either side of each, exactly."""
    base = LOGITS.softmax(-1)[0]
    expected = torch.zeros(5)
    expected[kept] = base[kept] / base[kept].sum()
    torch.testing.assert_close(next_token_probs(LOGITS, top_p=top_p)[0], expected, rtol=1e-6, atol=1e-7)


def test_sampling_follows_the_filtered_distribution():
    expected = torch.tensor([0, 0.40, 0, 0.30, 0.15]) / 0.85
    torch.testing.assert_close(empirical(top_p=0.75), expected, atol=0.03, rtol=0)


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
