"""Per-request sampling: parameters, the token draw, logprobs and stop conditions.

Each request draws from its own seeded generator, one uniform number per token, so its output depends
on its seed and its own logits only, never on what else shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from fivefold.errors import UserError
from fivefold.serve.batch import SlotParams

MAX_LOGPROBS = 20


class RequestError(UserError, ValueError):
    """A request that cannot be served as asked; the message says what to change."""


@dataclass
class SamplingParams:
    # 0: the prompt alone is computed (its blocks enter the prefix cache, e.g. to warm it; with prompt_logprobs
    # it is scored) and no token is sampled
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
    # None: none; k: each prompt token's logprob under the tokens before it and the k most likely there (the
    # first token has none). The prompt is then computed whole, not taken from the prefix cache.
    prompt_logprobs: int | None = None
    # OpenAI's: token id -> a number in [-100, 100] added to its logit before penalties, temperature and the
    # filters (greedy rows too); -100 bans a token in practice, +100 forces it
    logit_bias: dict[int, float] = field(default_factory=dict)
    # vLLM's: no end (end-of-sequence, stop token ids, stop strings) before this many tokens
    min_tokens: int = 0

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        checks = [
            (isinstance(self.max_tokens, int) and self.max_tokens >= 0,
             "max_tokens must be an integer >= 0 (0: the prompt computed, into the prefix cache, and scored with "
             "prompt_logprobs; nothing sampled)"),
            (self.temperature >= 0, "temperature must be >= 0 (0 is greedy)"),
            (isinstance(self.top_k, int) and self.top_k >= 0, "top_k must be an integer >= 0 (0 is off)"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0 (1 is off)"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, f"logprobs must be in 0..{MAX_LOGPROBS}"),
            (self.prompt_logprobs is None or isinstance(self.prompt_logprobs, int)
             and 0 <= self.prompt_logprobs <= MAX_LOGPROBS, f"prompt_logprobs must be an integer in 0..{MAX_LOGPROBS}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids must be token ids"),
            (isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
             "min_tokens must be an integer in [0, max_tokens]"),
            (isinstance(self.logit_bias, dict) and all(isinstance(t, int) and t >= 0 for t in self.logit_bias),
             "logit_bias keys must be token ids"),
            (isinstance(self.logit_bias, dict) and all(isinstance(b, (int, float)) and -100 <= b <= 100
                                                       for b in self.logit_bias.values()),
             "logit_bias values must be numbers in [-100, 100]"),
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


# On a CPU the nucleus is first looked for among this many likeliest tokens of each row (one top-k, a partial
# sort); only a row whose nucleus reaches past them is sorted whole. Sorting 64 rows of a 49K vocabulary took
# 139 ms on the 2-vCPU test host, the candidates 10 ms where the nuclei were within them, and 2% more than the
# sort where none was (bench/serve_sampling.py).
NUCLEUS_CANDIDATES = 256


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor, kmax: int | None = None, use_top_p: bool | None = None,
                   use_min_p: bool | None = None, candidates: int | None = None) -> torch.Tensor:
    """Rows (N, V) with per-row parameters (N,) -> the distributions to draw from. `kmax` (the largest top_k,
    0: none), `use_top_p` and `use_min_p` (whether any row uses them), when the caller knows (else asked of the
    device, a sync).

    Top-k keeps the tokens at least as likely as the k-th; top-p then the smallest set of likeliest tokens
    whose probability (renormalised over what top-k kept) reaches p: a token goes once the tokens likelier
    than it cover top_p, the likeliest always stays. Tokens as likely as the last one kept all stay (a tie is
    not broken by position). `candidates`: look for each row's nucleus among that many likeliest tokens first,
    and sort whole only the rows whose nucleus reaches past them (a host sync); by default on a CPU, where a
    full sort is slow, not on CUDA, where it is fast and the look-up would wait on the device."""
    logits = logits / temperature[:, None]
    n, v = logits.shape
    kmax = int(top_k.max()) if kmax is None else kmax
    nucleus = use_top_p if use_top_p is not None else bool((top_p < 1).any())
    if candidates is None:
        candidates = NUCLEUS_CANDIDATES if logits.device.type == "cpu" else 0
    # Each row's likeliest tokens, taken once: top-k's k-th, and the nucleus's candidates. In place where a
    # tensor is ours: at max_num_seqs rows of a 128K vocabulary each (N, V) float is hundreds of MB, and
    # fivefold.serve.step_memory counts the ones live at once.
    width = min(v, max(kmax, candidates if nucleus else 0))
    top = logits.topk(width, dim=-1) if width else None
    if kmax > 0:
        floor = top.values.gather(1, (top_k.clamp(min=1, max=width) - 1)[:, None])
        floor = torch.where(top_k[:, None] > 0, floor, float("-inf"))
        # (the candidates need no cut: the tokens past a row's k-th have no probability left, so its nucleus
        # ends by its k-th)
        logits = logits.masked_fill_(logits < floor, float("-inf"))
    if nucleus:
        rows = top_p < 1
        probs = logits.softmax(dim=-1)
        floor, rest = torch.full((n,), float("-inf"), device=logits.device), None
        if candidates:
            last, ends = _last_kept(top.values, top.indices, probs, top_p)
            floor = torch.where(rows & ends, last, floor)
            rest = (rows & ~ends).nonzero()[:, 0]  # a host sync: worth it where a full sort is slow (a CPU)
        top = None  # freed before the sort
        if rest is None or len(rest) == n:  # every row sorted (without copying them)
            values, order = logits.sort(dim=-1, descending=True)
            floor = torch.where(rows, _last_kept(values, order, probs, top_p)[0], floor)
        elif len(rest):
            values, order = logits[rest].sort(dim=-1, descending=True)
            floor = floor.index_copy_(0, rest, _last_kept(values, order, probs[rest], top_p[rest])[0])
        del probs
        logits = logits.masked_fill_(logits < floor[:, None], float("-inf"))
    top = None
    probs = logits.softmax(dim=-1)
    if use_min_p if use_min_p is not None else bool((min_p > 0).any()):
        probs = probs.masked_fill_(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
        probs = probs.div_(probs.sum(dim=-1, keepdim=True))
    return probs


def _last_kept(values: torch.Tensor, order: torch.Tensor, probs: torch.Tensor, top_p: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows' likeliest tokens (R, K), logits and ids in order, their full probabilities (R, V) and top_p (R,) ->
    the last logit top-p keeps among them (R,), and whether the nucleus ends there: a token past it is kept no
    more, or no token is left past the K."""
    mass = probs.gather(1, order)
    covered = mass.cumsum(dim=-1).sub_(mass) < top_p[:, None]  # what is likelier covers less than p: kept
    del mass
    count = covered.sum(dim=-1, keepdim=True)
    ends = (count[:, 0] < values.shape[-1]) | (values[:, -1] == float("-inf"))
    return values.gather(1, count - 1)[:, 0], ends


def _padded(rows: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged id lists -> (P, L) ids (padding repeats a row's first id, or 0) and a (P, L) validity mask."""
    width = max(1, max(map(len, rows)))
    ids = np.zeros((len(rows), width), dtype=np.int64)
    valid = np.zeros((len(rows), width), dtype=bool)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
        ids[i, len(r):] = r[0] if r else 0
        valid[i, :len(r)] = True
    return torch.from_numpy(ids).to(device, non_blocking=True), torch.from_numpy(valid).to(device, non_blocking=True)


def _biased(logits: torch.Tensor, requests: list, eos_id: int | None = None) -> torch.Tensor:
    """The logits plus each request's logit_bias, and -inf on the tokens that would end a request short of
    its min_tokens: one scatter-add over every (row, token) pair."""
    pairs = []
    for i, r in enumerate(requests):  # one pass over the batch; most rows add nothing
        p = r.params
        if p.logit_bias:
            pairs += [(i, t, b) for t, b in p.logit_bias.items()]
        if len(r.output_ids) < p.min_tokens:
            ends = {*p.stop_token_ids, *([eos_id] if eos_id is not None and not p.ignore_eos else [])}
            pairs += [(i, t, float("-inf")) for t in ends if t < logits.shape[-1]]
    if not pairs:
        return logits
    rows, ids, bias = zip(*pairs)
    device = logits.device
    index = torch.from_numpy(np.array([rows, ids], dtype=np.int64)).to(device, non_blocking=True)
    values = torch.from_numpy(np.array(bias, dtype=np.float32)).to(device, non_blocking=True)
    return logits.index_put((index[0], index[1]), values, accumulate=True)


def _penalise(logits: torch.Tensor, rows: np.ndarray, params: SlotParams, requests: list) -> None:
    """apply_penalties for several rows at once: one gather / scatter over padded id lists."""
    device = logits.device
    sub = logits[torch.from_numpy(rows).to(device)]
    rep = params.repetition_penalty[rows]
    if (rep != 1).any():
        seen, _ = _padded([sorted(set(requests[i].prompt_ids) | set(requests[i].output_ids)) for i in rows], device)
        penalty = torch.from_numpy(rep).to(device)[:, None]
        picked = sub.gather(1, seen)
        sub.scatter_(1, seen, torch.where(picked > 0, picked / penalty, picked * penalty))
    presence, frequency = params.presence_penalty[rows], params.frequency_penalty[rows]
    if (presence != 0).any() or (frequency != 0).any():
        out, valid = _padded([requests[i].output_ids for i in rows], device)
        counts = torch.zeros_like(sub).scatter_add_(1, out, valid.to(sub.dtype))
        sub -= (torch.from_numpy(frequency).to(device)[:, None] * counts
                + torch.from_numpy(presence).to(device)[:, None] * (counts > 0))
    logits[torch.from_numpy(rows).to(device)] = sub


class SampledTokens:
    """One step's draw, launched on the device: `tokens` (N,) stay there for the next forward to read;
    `result()` brings them (and any logprobs) to the host in one copy, waiting only for this draw."""

    def __init__(self, tokens: torch.Tensor, packed: torch.Tensor, asked: list[int | None], logprob_rows: list[int],
                 top: int):
        self.tokens, self.asked, self.logprob_rows, self.top = tokens, asked, logprob_rows, top
        if packed.device.type == "cuda":
            self.host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self.host.copy_(packed, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()
        else:
            self.host, self.ready = packed, None

    def result(self) -> tuple[list[int], list[dict | None]]:
        if self.ready is not None:
            self.ready.synchronize()
        packed = self.host.numpy()
        n, m, top = len(self.asked), len(self.logprob_rows), self.top
        out = packed[:n].astype(np.int64).tolist()
        entries: list[dict | None] = [None] * n
        if not m:
            return out, entries
        chosen_lp = packed[n:n + m]
        top_ids = packed[n + m:n + m + m * top].reshape(m, top).astype(np.int64)
        top_lp = packed[n + m + m * top:].reshape(m, top)
        for row, i in enumerate(self.logprob_rows):
            k = self.asked[i]
            entries[i] = {"token_id": out[i], "logprob": float(chosen_lp[row]),
                          "top": list(zip(top_ids[row, :k].tolist(), top_lp[row, :k].tolist()))}
        return out, entries


# A draw's bytes per (row, vocabulary) element at its peak, where top-p sorts a row's nucleus whole
# (filtered_probs): the tempered logits, the probabilities, the sort's values and int64 order, the probabilities
# in that order, their cumulative sum and the mask of what it keeps (fivefold.serve.step_memory counts them).
DRAW_BYTES = 4 + 4 + 4 + 8 + 4 + 4 + 1
# The most bytes that working set takes at once: at 256 rows of a 128K vocabulary the whole batch's would be
# 0.95 GB beside the logits, so the rows are drawn this many bytes' worth at a time (72 rows there; 64 rows of
# a 49K vocabulary are one pass).
DRAW_BUDGET = 256 * 2**20


def draw_rows(vocab: int) -> int:
    """How many rows of a `vocab`-wide batch launch_sampling filters and draws at once (DRAW_BUDGET)."""
    return max(1, DRAW_BUDGET // (vocab * DRAW_BYTES))


def launch_sampling(logits: torch.Tensor, params: SlotParams, requests: list, eos_id: int | None = None
                    ) -> SampledTokens:
    """Logits (N, V), one row per request, and the rows' parameters (fivefold.serve.batch.SlotParams) ->
    the next token of each, and its logprobs entry where asked for. Batched passes on the device (draw_rows()
    rows each) and one device-to-host copy: greedy rows take the argmax, the others the first token whose
    cumulative probability passes the row's own pre-drawn uniform (inverse-CDF sampling). Logit biases (and the bans
    that hold a request to its min_tokens: `eos_id` and its stop token ids), then penalties, apply before
    both; logprobs are the model's own distribution, before either."""
    device = logits.device
    logits = logits.float()
    asked = [r.params.logprobs for r in requests]
    logprob_rows = [i for i, k in enumerate(asked) if k is not None]
    model = logits  # the model's own distribution: logprobs are read off it after the draw, a few rows at a time
    biased = _biased(logits, requests, eos_id)
    penalised = np.flatnonzero((params.repetition_penalty != 1) | (params.presence_penalty != 0)
                               | (params.frequency_penalty != 0))
    if len(penalised):
        if biased is logits:  # penalised in place: a copy, the forward's logits are the caller's
            biased = logits.clone()
        _penalise(biased, penalised, params, requests)
    logits = biased
    tokens = logits.argmax(dim=-1)
    step = draw_rows(logits.shape[-1])  # rows filtered, drawn and read for logprobs at once
    if not params.greedy.all():
        host = np.stack([params.temperature, params.top_p, params.min_p, params.uniforms]).astype(np.float32)
        temperature, top_p, min_p, u = torch.from_numpy(host).to(device, non_blocking=True)
        top_k = torch.from_numpy(params.top_k).to(device, non_blocking=True)
        drawn = ~params.greedy
        filters = {"kmax": int(params.top_k[drawn].max()), "use_top_p": bool((params.top_p[drawn] < 1).any()),
                   "use_min_p": bool((params.min_p[drawn] > 0).any())}
        picked = tokens.clone()
        for a in range(0, len(drawn), step):  # a few rows at a time: each row's draw is its own
            b = min(a + step, len(drawn))
            if drawn[a:b].any():
                probs = filtered_probs(logits[a:b], temperature[a:b], top_k[a:b], top_p[a:b], min_p[a:b], **filters)
                cdf = probs.cumsum(dim=-1)
                del probs
                # right=True: the first token whose cumulative probability exceeds u, never a zero-probability one.
                picked[a:b] = torch.searchsorted(cdf, (u[a:b] * cdf[:, -1])[:, None], right=True).squeeze(-1)
                del cdf
        picked.clamp_(max=logits.shape[-1] - 1)
        greedy = torch.from_numpy(params.greedy).to(device, non_blocking=True)
        tokens = torch.where(greedy, tokens, picked)
    if not logprob_rows:
        return SampledTokens(tokens, tokens, asked, [], 0)
    top = max(asked[i] for i in logprob_rows)
    parts = []
    for a in range(0, len(logprob_rows), step):
        rows = torch.tensor(logprob_rows[a:a + step], device=device)
        raw = torch.log_softmax(model[rows], dim=-1)
        values, ids = raw.topk(top, dim=-1) if top else (raw.new_empty(len(rows), 0),) * 2  # not views of raw
        parts.append((raw.gather(1, tokens[rows][:, None]), ids, values))
        del raw
    chosen, ids, values = (torch.cat(p) for p in zip(*parts))
    # One copy to the host: tokens, the chosen tokens' logprobs, the top ids and logprobs.
    packed = torch.cat([tokens.double(), chosen.double().flatten(), ids.double().flatten(), values.double().flatten()])
    return SampledTokens(tokens, packed, asked, logprob_rows, top)


def score_rows(logits: torch.Tensor, targets: np.ndarray, top: int, chunk: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Rows (M, V) of logits and the token each row is scored on (M,) -> that token's logprob (M,) and rank
    (M,: 1 + the tokens more likely than it), and the `top` likeliest tokens' ids and logprobs (M, top), on
    the host. The scores are taken in fp32 `chunk` rows at a time, so a long prompt's never hold more than
    that many fp32 rows at once; one copy to the host."""
    device = logits.device
    index = torch.from_numpy(targets.astype(np.int64)).to(device, non_blocking=True)[:, None]
    parts = []
    for start in range(0, len(targets), chunk):
        # logit - logsumexp, read off the logits: the same as log_softmax's (to fp32 rounding) without writing
        # a second (rows, V) tensor; the order, hence the rank and the top, is the logits' own.
        x = logits[start:start + chunk].float()
        lse = torch.logsumexp(x, dim=-1, keepdim=True)
        chosen = x.gather(1, index[start:start + chunk])
        rank = (x > chosen).sum(dim=-1, keepdim=True) + 1
        values, ids = x.topk(top, dim=-1) if top else (x[:, :0], x[:, :0])
        parts.append(torch.cat([(chosen - lse).double(), rank.double(), ids.double(), (values - lse).double()], dim=1))
    packed = torch.cat(parts).cpu().numpy() if parts else np.zeros((0, 2 + 2 * top))
    return (packed[:, 0], packed[:, 1].astype(np.int64), packed[:, 2:2 + top].astype(np.int64),
            packed[:, 2 + top:])


def sample_rows(logits: torch.Tensor, params: SlotParams, requests: list) -> tuple[list[int], list[dict | None]]:
    """`launch_sampling`, waited for."""
    return launch_sampling(logits, params, requests).result()


def slot_params(requests: list, uniforms: list[float] | None = None) -> SlotParams:
    """SlotParams for requests outside an engine (each with .params and .generator): a uniform drawn from
    each request's generator unless given."""
    ps = [r.params for r in requests]
    if uniforms is None:
        uniforms = [float(torch.rand((), generator=r.generator)) for r in requests]

    def col(f, dtype):
        return np.array([f(p) for p in ps], dtype=dtype)

    return SlotParams(col(lambda p: p.temperature if not p.greedy else 1.0, np.float32), col(lambda p: p.top_k, np.int64),
                      col(lambda p: p.top_p, np.float32), col(lambda p: p.min_p, np.float32),
                      col(lambda p: p.repetition_penalty, np.float32), col(lambda p: p.presence_penalty, np.float32),
                      col(lambda p: p.frequency_penalty, np.float32), col(lambda p: p.greedy, bool),
                      np.array(uniforms, dtype=np.float32))


def sample(logits: torch.Tensor, requests: list) -> tuple[list[int], list[dict | None]]:
    """`sample_rows` for requests outside an engine (each with .params, .prompt_ids, .output_ids, .generator)."""
    return sample_rows(logits, slot_params(requests), requests)
