"""The OpenAI API's shapes: request bodies (validated by pydantic), errors, usage, logprobs, and the text
of a running request that is safe to stream."""

from __future__ import annotations

from dataclasses import replace

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticUseDefault

from fivefold.serve.engine import RequestOutput
from fivefold.serve.sampling import SamplingParams

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 429: "rate_limit_error", 500: "server_error"}


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.status}}


class StepFailed(APIError):
    """The engine raised during a step this request was part of."""

    def __init__(self, message: str):
        super().__init__(500, message)


MAX_CHOICES = 128  # n, as OpenAI's API bounds it
MAX_PROMPTS = 2048  # prompts in one completions request, as OpenAI's API bounds them


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """The fields both endpoints share. Unknown fields are ignored, as other OpenAI-compatible servers
    do, and an explicit null means the default, as in OpenAI's API."""
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)  # checked here, so the error names the field the client sent
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logit_bias: dict[str, float] = {}  # OpenAI's: token ids as strings -> bias in [-100, 100]
    min_tokens: int = 0  # vLLM's: no end before this many tokens
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Fields that would change what a client gets back, which this server does not do: refused, not ignored.
    best_of: int | None = None
    response_format: dict | None = None

    def refuse_unsupported(self) -> None:
        if not 1 <= self.n <= MAX_CHOICES:
            raise APIError(400, f"n={self.n}: ask for 1 to {MAX_CHOICES} choices", "n")
        if self.best_of not in (None, 1, self.n):
            raise APIError(400, f"best_of={self.best_of}: this server returns every choice it samples (n); it "
                                "does not sample more and keep the best", "best_of")
        kind = (self.response_format or {}).get("type", "text")
        if kind != "text":
            raise APIError(400, f"response_format {kind!r} is not supported: this server does not constrain what it "
                                "generates (only 'text')", "response_format")

    @field_validator("*", mode="before")
    @classmethod
    def null_is_default(cls, value):
        if value is None:
            raise PydanticUseDefault()
        return value


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)  # 0 with echo: the prompt scored, nothing generated
    logprobs: int | None = None
    # The prompt before the completion in each choice's text, and with logprobs its tokens' logprobs first
    # (the first token's null): how evaluation harnesses score a continuation (lm-evaluation-harness).
    echo: bool = False
    # vLLM's: each choice's `prompt_logprobs`, per prompt token {token id: {logprob, rank, decoded_token}} for
    # the token itself and the k likeliest (the first token's null)
    prompt_logprobs: int | None = None
    suffix: str | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens=0 generates nothing: it scores the prompt, with echo: true (and "
                                "logprobs for its tokens' logprobs)", "max_tokens")
        if self.suffix:
            raise APIError(400, "suffix is not supported: this server completes the prompt only", "suffix")
        if len(self.prompts()) > MAX_PROMPTS:
            raise APIError(400, f"{len(self.prompts())} prompts: send at most {MAX_PROMPTS} in one request", "prompt")

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one text or token-id list, or a batch of either."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            return list(prompt)
        return [prompt]


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a text, or chat messages rendered by the chat template (its own special tokens)."""
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list["ChatMessage"] | None = None
    add_special_tokens: bool = True  # for a prompt (the completions endpoint adds them)
    add_generation_prompt: bool = True  # for messages


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str = ""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[ContentPart] | None = None


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    """The messages as the chat template sees them: role and text content."""
    out = []
    for i, m in enumerate(messages):
        content = m.content or ""
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                raise APIError(400, "only text content parts are supported", f"messages.{i}.content")
            content = "".join(part.text for part in content)
        out.append({"role": m.role, "content": content})
    return out


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list | None = None
    functions: list | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        for name in ("tools", "functions"):
            if getattr(self, name):
                raise APIError(400, f"{name} are not supported: this server's chat template renders text messages "
                                    "only", name)

    def message_dicts(self) -> list[dict]:
        return message_dicts(self.messages)

    def logprobs_asked(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


def sampling_params(body: SamplingRequest, max_tokens: int, logprobs: int | None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    body.refuse_unsupported()
    try:
        bias = {int(token): value for token, value in body.logit_bias.items()}
    except ValueError:
        raise APIError(400, "logit_bias keys must be token ids (integers, as strings)", "logit_bias") from None
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=body.temperature, top_k=0 if body.top_k == -1 else body.top_k,
            top_p=body.top_p, min_p=body.min_p, repetition_penalty=body.repetition_penalty,
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty, seed=body.seed,
            stop=[body.stop] if isinstance(body.stop, str) else list(body.stop),
            stop_token_ids=list(body.stop_token_ids), ignore_eos=body.ignore_eos, logprobs=logprobs,
            logit_bias=bias, min_tokens=body.min_tokens, prompt_logprobs=prompt_logprobs)
    except ValueError as e:  # "SamplingParams: FIELD must ...": the field is the one the client sent
        message = str(e).removeprefix("SamplingParams: ")
        field = message.split()[0]
        raise APIError(400, message, field if field in type(body).model_fields else None) from None


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """One request's n choices: choice i is what a request with seed `seed + i` returns (each draws its own
    seed from the engine when the request gives none)."""
    if n == 1:
        return [params]
    return [replace(params, seed=None if params.seed is None else params.seed + i) for i in range(n)]


def usage(outs: RequestOutput | list[RequestOutput], n: int = 1) -> dict:
    """Each prompt once (every n-th output starts a prompt's n choices; its cached tokens as that choice met
    them), the tokens of every choice."""
    outs = outs if isinstance(outs, list) else [outs]
    firsts = outs[::n]
    prompt, completion = sum(len(o.prompt_token_ids) for o in firsts), sum(len(out.token_ids) for out in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in firsts)}}


def token_text(tokenizer, token_id: int) -> str:
    # A byte-level token that ends inside a UTF-8 character decodes with U+FFFD, as in OpenAI's tokens.
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tokenizer, entries: list[dict], offset: int) -> tuple[dict, int]:
    """The completions API's logprobs object for `entries`, their text offsets counted from `offset`;
    also the offset after them."""
    tokens = [token_text(tokenizer, e["token_id"]) for e in entries]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    tops = []
    for e in entries:
        if e["top"] is None:  # an echoed prompt's first token: nothing before it to predict it from
            tops.append(None)
            continue
        # Keyed by text, two tokens can collide (e.g. partial characters, both U+FFFD): keep the likelier.
        top = {}
        for token_id, logprob in e["top"]:
            top.setdefault(token_text(tokenizer, token_id), logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries], "top_logprobs": tops,
            "text_offset": offsets}, offset


def vllm_prompt_logprobs(tokenizer, entries: list[dict | None], k: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs` of a choice: per prompt token, the token itself then the k likeliest, keyed
    by id (as strings), each {logprob, rank, decoded_token}; null for the first token."""
    def item(token_id: int, logprob: float, rank: int) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": token_text(tokenizer, token_id)}

    out: list[dict | None] = [None]
    for e in entries[1:]:
        position = {str(e["token_id"]): item(e["token_id"], e["logprob"], e["rank"])}
        for rank, (token_id, logprob) in enumerate(e["top"][:k], start=1):
            position.setdefault(str(token_id), item(token_id, logprob, rank))
        out.append(position)
    return out


def echoed_entries(out: RequestOutput, k: int) -> list[dict]:
    """An echoed prompt's logprob entries, as the completion's are (the k likeliest at each token): the first
    token's logprob and top null."""
    first = {"token_id": out.prompt_token_ids[0], "logprob": None, "top": None}
    return [first] + [{**e, "top": e["top"][:k]} for e in out.prompt_logprobs[1:]]


def chat_logprobs(tokenizer, entries: list[dict]) -> dict:
    def item(token_id: int, logprob: float) -> dict:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**item(e["token_id"], e["logprob"]), "top_logprobs": [item(i, lp) for i, lp in e["top"]]}
                        for e in entries]}


class TextStream:
    """A running request's token ids -> the text that is safe to send so far.

    Held back: a character still incomplete (a byte-level token can end inside one; it decodes as
    U+FFFD), and with stop strings the last (longest stop - 1) characters, where a stop string could
    be starting: the engine cuts the text before a stop string, and no part of one may have been sent.
    """

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.hold = max(map(len, stop), default=1) - 1
        self.text = ""  # complete characters decoded so far
        self.sent = 0  # of which sent
        # Tokens [prefix, read) decode to the end of self.text. Decoding from one token back keeps the
        # leading space a decoder such as SentencePiece's drops from a slice's first token.
        self.prefix = self.read = 0

    def push(self, token_ids: list[int]) -> str:
        before = self.tokenizer.decode(token_ids[self.prefix:self.read])
        now = self.tokenizer.decode(token_ids[self.prefix:])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.text += now[len(before):]
            self.prefix, self.read = self.read, len(token_ids)
        end = len(self.text) - self.hold
        delta = self.text[self.sent:end] if end > self.sent else ""
        self.sent += len(delta)
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of the final text (the engine's own, stop strings cut)."""
        return final_text[self.sent:]


TokenizeRequest.model_rebuild()  # its messages are ChatMessages, defined after it
