"""Per-request sampling: parameters, the token draw, logprobs and stop conditions.

Each request draws from its own seeded generator, one uniform number per token, so its output depends
on its seed and its own logits only, never on what else shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fivefold.errors import UserError

MAX_LOGPROBS = 20


class RequestError(UserError, ValueError):
    """A request that cannot be served as asked; the message says what to change."""


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability; 0: off
    repetition_penalty: float = 1.0  # > 1 discourages any token seen in the prompt or output (CTRL's rule)
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from tokens already generated
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per occurrence in the output
    seed: int | None = None  # None: drawn from the engine's generator
    stop: list[str] = field(default_factory=list)  # the output ends before the first of these strings
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k: the sampled token's logprob and the k most likely

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        checks = [
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens must be an integer >= 1"),
            (self.temperature >= 0, "temperature must be >= 0 (0 is greedy)"),
            (isinstance(self.top_k, int) and self.top_k >= 0, "top_k must be an integer >= 0 (0 is off)"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0 (1 is off)"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, f"logprobs must be in 0..{MAX_LOGPROBS}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids must be token ids"),
        ]
        for ok, message in checks:
            if not ok:
                raise RequestError(f"SamplingParams: {message}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """One row (V,) of logits, penalised for what the request has already seen and said."""
    if params.repetition_penalty != 1:
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long, device=logits.device)
        picked = logits[seen]
        logits[seen] = torch.where(picked > 0, picked / params.repetition_penalty, picked * params.repetition_penalty)
    if output and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.tensor(output, device=logits.device), minlength=logits.shape[-1])[:logits.shape[-1]]
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return logits


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor) -> torch.Tensor:
    """Rows (N, V) with per-row parameters (N,) -> the distributions to draw from."""
    logits = logits / temperature[:, None]
    v = logits.shape[-1]
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(v, device=logits.device)
        k = torch.where(top_k > 0, top_k, v)
        drop = rank[None] >= k[:, None]
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # Nucleus: drop a token once the tokens ranked above it cover top_p; the top one always stays.
        drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(dim=-1)
    if bool((min_p > 0).any()):
        probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(logits: torch.Tensor, requests: list) -> tuple[list[int], list[dict | None]]:
    """Logits (N, V), one row per request (each with .params, .prompt_ids, .output_ids, .generator)
    -> the next token of each, and its logprobs entry where asked for."""
    logits = logits.float()
    logprob_rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    raw = torch.log_softmax(logits[logprob_rows], dim=-1) if logprob_rows else None  # the model's own distribution
    penalised = [i for i, r in enumerate(requests) if r.params.penalised]
    if penalised:
        logits = logits.clone()
        for i in penalised:
            r = requests[i]
            apply_penalties(logits[i], r.params, r.prompt_ids, r.output_ids)
    tokens = logits.argmax(dim=-1)
    drawn = [i for i, r in enumerate(requests) if not r.params.greedy]
    if drawn:
        ps = [requests[i].params for i in drawn]
        device = logits.device
        probs = filtered_probs(logits[drawn], torch.tensor([p.temperature for p in ps], device=device),
                               torch.tensor([p.top_k for p in ps], device=device),
                               torch.tensor([p.top_p for p in ps], device=device),
                               torch.tensor([p.min_p for p in ps], device=device))
        u = torch.stack([torch.rand((), generator=requests[i].generator) for i in drawn]).to(device)
        cdf = probs.cumsum(dim=-1)
        # right=True: the first token whose cumulative probability exceeds u, never a zero-probability one.
        picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)
        tokens[drawn] = picked
    out = tokens.tolist()
    entries: list[dict | None] = [None] * len(requests)
    for row, i in enumerate(logprob_rows):
        k = requests[i].params.logprobs
        top = raw[row].topk(k) if k else None
        entries[i] = {"token_id": out[i], "logprob": float(raw[row, out[i]]),
                      "top": list(zip(top.indices.tolist(), top.values.tolist())) if k else []}
    return out, entries
