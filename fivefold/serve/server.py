"""The OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

One thread owns the engine (`EngineLoop`): it steps while there is work and sleeps on an Event
otherwise. Handlers run on the asyncio loop. They submit a request from a worker thread (add_request
waits for the engine lock while a step runs, and the event loop must not), then await its outputs on
an asyncio.Queue that the stepping thread fills through `loop.call_soon_threadsafe`. A client that
goes away hands its request id back to the stepping thread, which aborts it between steps.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticUseDefault
from starlette.exceptions import HTTPException

from fivefold.serve.chat import ChatTemplate
from fivefold.serve.engine import Engine, RequestOutput
from fivefold.serve.metrics import ServerMetrics
from fivefold.serve.sampling import SamplingParams

log = logging.getLogger("fivefold.serve")

DISCONNECT_POLL = 0.25  # seconds between checks that a non-streaming client is still there
ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
               429: "rate_limit_error", 500: "server_error"}


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


# ---- request bodies and response pieces, in OpenAI's shapes


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """The fields both endpoints share. Unknown fields are ignored, as other OpenAI-compatible servers
    do, and an explicit null means the default, as in OpenAI's API."""
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = None
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
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("*", mode="before")
    @classmethod
    def null_is_default(cls, value):
        if value is None:
            raise PydanticUseDefault()
        return value


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False

    def single_prompt(self) -> str | list[int]:
        if self.echo:
            raise APIError(400, "echo is not supported", "echo")
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise APIError(400, f"one prompt per request ({len(prompt)} given); send them as separate requests",
                               "prompt")
            prompt = prompt[0]
        return prompt


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str = ""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[ContentPart] | None = None


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None

    def message_dicts(self) -> list[dict]:
        """The messages as the chat template sees them: role and text content."""
        messages = []
        for i, m in enumerate(self.messages):
            content = m.content or ""
            if isinstance(content, list):
                if any(part.type != "text" for part in content):
                    raise APIError(400, "only text content parts are supported", f"messages.{i}.content")
                content = "".join(part.text for part in content)
            messages.append({"role": m.role, "content": content})
        return messages

    def logprobs_asked(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


def sampling_params(body: SamplingRequest, max_tokens: int, logprobs: int | None) -> SamplingParams:
    if body.n != 1:
        raise APIError(400, f"n={body.n}: this server returns one choice per request; send n requests", "n")
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=body.temperature, top_k=0 if body.top_k == -1 else body.top_k,
            top_p=body.top_p, min_p=body.min_p, repetition_penalty=body.repetition_penalty,
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty, seed=body.seed,
            stop=[body.stop] if isinstance(body.stop, str) else list(body.stop),
            stop_token_ids=list(body.stop_token_ids), ignore_eos=body.ignore_eos, logprobs=logprobs)
    except ValueError as e:
        raise APIError(400, str(e)) from None


def usage(out: RequestOutput) -> dict:
    prompt, completion = len(out.prompt_token_ids), len(out.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}


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
        # Keyed by text, two tokens can collide (e.g. partial characters, both U+FFFD): keep the likelier.
        top = {}
        for token_id, logprob in e["top"]:
            top.setdefault(token_text(tokenizer, token_id), logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries], "top_logprobs": tops,
            "text_offset": offsets}, offset


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


# ---- the stepping thread and its bridge to asyncio


@dataclass
class Subscriber:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    stream: bool  # every output, or only the final one


class EngineLoop:
    def __init__(self, engine: Engine, metrics: ServerMetrics, max_waiting: int):
        self.engine, self.metrics, self.max_waiting = engine, metrics, max_waiting
        self.subscribers: dict[str, Subscriber] = {}  # changed under engine.lock, or popped (atomic)
        self.aborts: deque[str] = deque()  # request ids whose clients left, for the stepping thread
        self.wake = threading.Event()
        self.stopping = False
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="fivefold-engine", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopping = True
        self.wake.set()
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    def submit(self, request_id: str, prompt, params, subscriber: Subscriber) -> None:
        """Queue a request; blocks while a step holds the engine lock, so call it from a worker thread."""
        engine = self.engine
        with engine.lock:
            if engine.num_waiting >= self.max_waiting:
                raise APIError(429, f"the server's queue is full ({engine.num_waiting} requests waiting, "
                                    f"serve.max_waiting={self.max_waiting}); retry later")
            try:
                engine.add_request(prompt, params, request_id)
            except ValueError as e:  # RequestError: a request that could never be served
                raise APIError(400, str(e)) from None
            self.subscribers[request_id] = subscriber
        self.wake.set()

    async def start_request(self, request_id: str, prompt, params, stream: bool) -> asyncio.Queue:
        loop = asyncio.get_running_loop()
        subscriber = Subscriber(loop, asyncio.Queue(), stream)
        done = loop.run_in_executor(None, self.submit, request_id, prompt, params, subscriber)
        try:
            await asyncio.shield(done)
        except asyncio.CancelledError:
            # The handler was cancelled while the worker thread submits: abort once it has.
            done.add_done_callback(lambda f: f.cancelled() or f.exception() or self.cancel(request_id))
            raise
        return subscriber.queue

    def cancel(self, request_id: str) -> None:
        """Nobody waits for this request any more: abort it between steps (no-op if it has finished)."""
        self.subscribers.pop(request_id, None)
        self.aborts.append(request_id)
        self.wake.set()

    async def outputs(self, request_id: str, queue: asyncio.Queue, request: Request | None = None
                      ) -> AsyncIterator[RequestOutput]:
        """The request's outputs up to its final one. Stopping early aborts the request: a stream is
        cancelled when its client disconnects (Starlette does that), and a non-streaming handler passes
        `request` to be checked for a disconnect while it waits."""
        finished = False
        try:
            while not finished:
                if request is None:
                    item = await queue.get()
                else:
                    try:
                        item = await asyncio.wait_for(queue.get(), DISCONNECT_POLL)
                    except TimeoutError:
                        if await request.is_disconnected():
                            return
                        continue
                if isinstance(item, StepFailed):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.cancel(request_id)

    async def final_output(self, request_id: str, queue: asyncio.Queue, request: Request) -> RequestOutput | None:
        """The finished output, or None if the client left first."""
        out = None
        async for out in self.outputs(request_id, queue, request):
            pass
        return out if out is not None and out.finished else None

    # ---- the stepping thread

    def _run(self) -> None:
        engine = self.engine
        while not self.stopping:
            try:
                self._abort_pending()
                if not engine.has_unfinished():
                    # A submit adds its request before it sets the event, so clearing here loses no
                    # work: the loop checks has_unfinished() again before it waits.
                    self.wake.wait()
                    self.wake.clear()
                    continue
                outputs = engine.step()
                if outputs:
                    self.metrics.record_step(outputs)
                for out in outputs:
                    self._deliver(out.request_id, out, final=out.finished)
            except Exception as e:  # noqa: BLE001 - one bad step must not end the server
                log.exception("engine step failed")
                self._fail_step(e)

    def _abort_pending(self) -> None:
        while self.aborts:
            request_id = self.aborts.popleft()
            with self.engine.lock:
                live = request_id in self.engine.requests
                self.engine.abort(request_id)
            if live:
                self.metrics.record_end("abort")

    def _fail_step(self, error: Exception) -> None:
        """Fail the requests the step was running (and any it finished but did not hand out); the rest
        stay queued. If none ran, fail every request, so a step that always fails cannot spin forever."""
        engine = self.engine
        with engine.lock:
            running = {seq.request_id for seq in engine.scheduler.running}
            # list(): a single call under the GIL, while cancel() may pop from the event loop's thread.
            failed = [r for r in list(self.subscribers) if r in running or r not in engine.requests]
            failed = failed or list(engine.requests)
            for request_id in failed:
                engine.abort(request_id)
        message = f"the engine failed during a step: {type(error).__name__}: {error}"
        for request_id in failed:
            self.metrics.record_end("error")
            self._deliver(request_id, StepFailed(message), final=True)

    def _deliver(self, request_id: str, item, final: bool) -> None:
        subscriber = self.subscribers.pop(request_id, None) if final else self.subscribers.get(request_id)
        if subscriber is None or not (final or subscriber.stream):
            return
        try:
            subscriber.loop.call_soon_threadsafe(subscriber.queue.put_nowait, item)
        except RuntimeError:  # the event loop has closed: nobody is waiting any more
            pass


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def sse(data) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def create_app(engine: Engine, model_name: str, chat_template: str | None = None, max_waiting: int | None = None,
               bos_token: str = "", eos_token: str | None = None) -> FastAPI:
    """The app over `engine`; its stepping thread runs from app startup to shutdown (the lifespan).
    `max_waiting`: queued requests before answering 429 (default serve.max_waiting); `bos_token` /
    `eos_token`: the strings the chat template sees (eos default: the engine's eos token)."""
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise ValueError("the server needs a tokenizer: pass one to the Engine (e.g. --tokenizer tokenizer.json)")
    metrics = ServerMetrics(engine)
    runner = EngineLoop(engine, metrics, engine.cfg.max_waiting if max_waiting is None else max_waiting)
    if eos_token is None:
        eos_token = tokenizer.id_to_token(engine.eos_id) or ""
    template = ChatTemplate(chat_template, bos_token, eos_token)
    # The most tokens one request may hold: its context, within the KV pool.
    capacity = min(engine.max_model_len, engine.plan.num_blocks * engine.cfg.block_size)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        runner.start()
        try:
            yield
        finally:
            runner.stop()

    app = FastAPI(title="fivefold", lifespan=lifespan)
    app.state.engine, app.state.runner, app.state.metrics = engine, runner, metrics

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0]
        where = ".".join(str(p) for p in first["loc"] if p != "body")
        if first["type"] == "json_invalid":
            message = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}"
        else:
            message = f"{where or 'body'}: {first['msg']}"
            if len(errors) > 1:
                message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
        return error_response(APIError(400, message, where or None))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        return error_response(APIError(exc.status_code, str(exc.detail)))

    def check_model(name: str | None) -> None:
        if name and name != model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {model_name!r}", "model")

    def header(kind: str, request_id: str) -> dict:
        return {"id": request_id, "object": kind, "created": int(time.time()), "model": model_name}

    def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def deltas(request_id: str, queue: asyncio.Queue, stop: list[str]):
        """(text to send, logprob entries since the last, output) whenever there is text, and at the end."""
        text, given = TextStream(tokenizer, stop), 0
        async for out in runner.outputs(request_id, queue):
            delta = text.finish(out.text) if out.finished else text.push(out.token_ids)
            if delta or out.finished:
                yield delta, (out.logprobs or [])[given:], out
                given = len(out.token_ids)

    async def finish_stream(events: AsyncIterator[tuple[str, RequestOutput]], request_id: str, kind: str,
                            include_usage: bool):
        """Relay the chunks, turn a failed step into an error event, then usage and [DONE]."""
        last = None
        try:
            async for chunk, last in events:
                yield chunk
        except StepFailed as e:
            yield sse(e.body())
            last = None
        if include_usage and last is not None:
            yield sse({**header(kind, request_id), "choices": [], "usage": usage(last)})
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        prompt = body.single_prompt()
        params = sampling_params(body, 16 if body.max_tokens is None else body.max_tokens, body.logprobs)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        queue = await runner.start_request(request_id, prompt, params, body.stream)
        # text_offset counts from the start of the prompt's text, as OpenAI's does.
        base = len(prompt) if isinstance(prompt, str) else len(tokenizer.decode(prompt))

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            async def chunks():
                offset = base
                async for delta, entries, out in deltas(request_id, queue, params.stop):
                    logprobs = None
                    if params.logprobs is not None:
                        logprobs, offset = completion_logprobs(tokenizer, entries, offset)
                    choice = {"index": 0, "text": delta, "logprobs": logprobs, "finish_reason": out.finish_reason}
                    chunk = {**header("text_completion", request_id), "choices": [choice]}
                    if include_usage:
                        chunk["usage"] = None
                    yield sse(chunk), out

            return event_stream(finish_stream(chunks(), request_id, "text_completion", include_usage))

        out = await runner.final_output(request_id, queue, request)
        if out is None:
            return Response(status_code=499)  # the client closed the connection: nobody reads this
        logprobs = completion_logprobs(tokenizer, out.logprobs, base)[0] if out.logprobs is not None else None
        choice = {"index": 0, "text": out.text, "logprobs": logprobs, "finish_reason": out.finish_reason}
        return {**header("text_completion", request_id), "choices": [choice], "usage": usage(out)}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        check_model(body.model)
        try:
            text = template.render(body.message_dicts())
        except ValueError as e:
            raise APIError(400, str(e), "messages") from None
        # The template writes any special tokens itself (e.g. bos_token): add none when encoding.
        prompt = tokenizer.encode(text, add_special_tokens=False).ids
        max_tokens = next((n for n in (body.max_completion_tokens, body.max_tokens) if n is not None),
                          max(1, capacity - len(prompt)))
        params = sampling_params(body, max_tokens, body.logprobs_asked())
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        queue = await runner.start_request(request_id, prompt, params, body.stream)

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            def chunk(delta: dict, entries, finish_reason) -> dict:
                logprobs = chat_logprobs(tokenizer, entries) if params.logprobs is not None and entries else None
                choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
                c = {**header("chat.completion.chunk", request_id), "choices": [choice]}
                if include_usage:
                    c["usage"] = None
                return c

            async def chunks():
                first = True
                async for delta, entries, out in deltas(request_id, queue, params.stop):
                    if first:  # the role comes first, on its own, as OpenAI sends it
                        yield sse(chunk({"role": "assistant", "content": ""}, [], None)), out
                        first = False
                    yield sse(chunk({"content": delta} if delta else {}, entries, out.finish_reason)), out

            return event_stream(finish_stream(chunks(), request_id, "chat.completion.chunk", include_usage))

        out = await runner.final_output(request_id, queue, request)
        if out is None:
            return Response(status_code=499)
        choice = {"index": 0, "message": {"role": "assistant", "content": out.text},
                  "logprobs": chat_logprobs(tokenizer, out.logprobs) if out.logprobs is not None else None,
                  "finish_reason": out.finish_reason}
        return {**header("chat.completion", request_id), "choices": [choice], "usage": usage(out)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "fivefold", "max_model_len": engine.max_model_len}]}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=metrics.content_type)

    return app


def serve(engine: Engine, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          chat_template: str | None = None, **app_options) -> None:
    """Run the app with uvicorn until interrupted; `app_options` go to create_app."""
    import uvicorn

    uvicorn.run(create_app(engine, model_name, chat_template, **app_options), host=host, port=port,
                log_level="info")
