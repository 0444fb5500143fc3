"""The OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

One thread owns the engine (`EngineLoop`): it steps while there is work and sleeps on an Event
otherwise. Handlers run on the asyncio loop. They submit a request from a worker thread (tokenizing
and validating; the request then waits in the engine's inbox for the next step), then await its outputs
on an asyncio.Queue that the stepping thread fills through `loop.call_soon_threadsafe`. A client that
goes away hands its request id back to the stepping thread, which aborts it between steps.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from fivefold.data.chat import ChatTemplate
from fivefold.serve.engine import Engine, RequestOutput
from fivefold.serve.metrics import ServerMetrics
from fivefold.serve.protocol import (APIError, ChatRequest, CompletionRequest, DetokenizeRequest, StepFailed, TextStream,
                                     TokenizeRequest, chat_logprobs, choice_params, completion_logprobs, echoed_entries,
                                     message_dicts, sampling_params, usage, vllm_prompt_logprobs)

log = logging.getLogger("fivefold.serve")

DISCONNECT_POLL = 0.25  # seconds between checks that a non-streaming client is still there


# ---- the stepping thread and its bridge to asyncio


@dataclass
class Subscriber:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    stream: bool  # every output, or only the final one


class EngineLoop:
    def __init__(self, engine: Engine, metrics: ServerMetrics, max_waiting: int):
        self.engine, self.metrics, self.max_waiting = engine, metrics, max_waiting
        self.subscribers: dict[str, Subscriber] = {}  # set before a request can produce output; popped (atomic)
        self.submitting = threading.Lock()
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

    def submit(self, request_ids: list[str], prompts: list, params: list, subscriber: Subscriber,
               adapter: str | None = None) -> None:
        """Queue a request's choices, one engine request each, with its prompt and parameters (into the
        engine's inbox: this does not wait for a running step), all or none."""
        engine = self.engine
        if len(request_ids) > self.max_waiting:
            raise APIError(400, f"{len(request_ids)} choices (prompts x n) in one request: the queue holds "
                                f"serve.max_waiting={self.max_waiting}; split the request")
        with self.submitting:  # the queue check and the adds, as one
            if engine.num_waiting + len(request_ids) > self.max_waiting:
                asked = f", {len(request_ids)} choices asked" if len(request_ids) > 1 else ""
                raise APIError(429, f"the server's queue is full ({engine.num_waiting} requests waiting{asked}, "
                                    f"serve.max_waiting={self.max_waiting}); retry later")
            added = []
            try:
                for request_id, prompt, choice in zip(request_ids, prompts, params):
                    self.subscribers[request_id] = subscriber  # first: the next step may already produce output
                    engine.add_request(prompt, choice, request_id, adapter=adapter)
                    added.append(request_id)
            except ValueError as e:  # RequestError: a request that could never be served
                for request_id in request_ids:
                    if request_id in added:
                        self.cancel(request_id)
                    else:
                        self.subscribers.pop(request_id, None)
                raise APIError(400, str(e)) from None
        self.wake.set()

    async def start_request(self, request_ids: list[str], prompts: list, params: list, stream: bool,
                            adapter: str | None = None) -> asyncio.Queue:
        """Submit the choices (a prompt and parameters per id); their outputs arrive on the returned queue."""
        loop = asyncio.get_running_loop()
        subscriber = Subscriber(loop, asyncio.Queue(), stream)
        done = loop.run_in_executor(None, self.submit, request_ids, prompts, params, subscriber, adapter)
        try:
            await asyncio.shield(done)
        except asyncio.CancelledError:
            # The handler was cancelled while the worker thread submits: abort once it has.
            done.add_done_callback(lambda f: f.cancelled() or f.exception() or [*map(self.cancel, request_ids)])
            raise
        return subscriber.queue

    def cancel(self, request_id: str) -> None:
        """Nobody waits for this request any more: abort it between steps (no-op if it has finished)."""
        self.subscribers.pop(request_id, None)
        self.aborts.append(request_id)
        self.wake.set()

    async def outputs(self, request_ids: list[str], queue: asyncio.Queue, request: Request | None = None
                      ) -> AsyncIterator[RequestOutput]:
        """The choices' outputs, as they come, up to the final one of each. Stopping early aborts the
        unfinished ones: a stream is cancelled when its client disconnects (Starlette does that), and a
        non-streaming handler passes `request` to be checked for a disconnect while it waits."""
        unfinished = set(request_ids)
        try:
            while unfinished:
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
                    raise item
                if item.finished:
                    unfinished.discard(item.request_id)
                yield item
        finally:
            for request_id in unfinished:
                self.cancel(request_id)

    async def final_outputs(self, request_ids: list[str], queue: asyncio.Queue, request: Request
                            ) -> list[RequestOutput] | None:
        """The finished outputs in the order of `request_ids`, or None if the client left first."""
        last = {}
        async for out in self.outputs(request_ids, queue, request):
            last[out.request_id] = out
        if not all(r in last and last[r].finished for r in request_ids):
            return None
        return [last[r] for r in request_ids]

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


OPEN_PATHS = ("/health", "/metrics")  # answered without the API key: for probes and scrapers


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def sse(data) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def create_app(engine: Engine, model_name: str, chat_template: str | None = None, max_waiting: int | None = None,
               bos_token: str = "", eos_token: str | None = None, api_key: str | None = None) -> FastAPI:
    """The app over `engine`; its stepping thread runs from app startup to shutdown (the lifespan).
    `max_waiting`: queued requests before answering 429 (default serve.max_waiting); `bos_token` /
    `eos_token`: the strings the chat template sees (eos default: the engine's eos token); `api_key`: the
    key every request must bring as `Authorization: Bearer KEY` (401 otherwise), but to /health and /metrics,
    which stay open for probes and scrapers."""
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

    if api_key:
        expected = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def authenticate(request: Request, call_next):
            given = request.headers.get("authorization", "").encode()
            if request.url.path not in OPEN_PATHS and not hmac.compare_digest(given, expected):
                return error_response(APIError(401, "a valid API key is needed: send the header "
                                                    "'Authorization: Bearer KEY' with the server's --api-key"))
            return await call_next(request)

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

    adapters = list(engine.adapters.adapters) if engine.adapters is not None else []
    served = [model_name, *(f"{model_name}:{a}" for a in adapters)]

    def check_model(name: str | None) -> str | None:
        """The LoRA adapter a request's `model` names ("base:adapter"; None: the base)."""
        if name and name not in served:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                                f"{', '.join(map(repr, served))}", "model")
        return name.split(":", 1)[1] if name and name != model_name else None

    def header(kind: str, request_id: str) -> dict:
        return {"id": request_id, "object": kind, "created": int(time.time()), "model": model_name}

    def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def deltas(request_ids: list[str], queue: asyncio.Queue, stop: list[str]):
        """(choice index, text to send, logprob entries since the last, output) whenever a choice has text,
        and at its end."""
        texts = {r: TextStream(tokenizer, stop) for r in request_ids}
        given = dict.fromkeys(request_ids, 0)
        index = {r: i for i, r in enumerate(request_ids)}
        async for out in runner.outputs(request_ids, queue):
            r = out.request_id
            delta = texts[r].finish(out.text) if out.finished else texts[r].push(out.token_ids)
            if delta or out.finished:
                yield index[r], delta, (out.logprobs or [])[given[r]:], out
                given[r] = len(out.token_ids)

    async def finish_stream(events: AsyncIterator[tuple[str, RequestOutput]], request_id: str, kind: str,
                            include_usage: bool, ids: list[str], n: int):
        """Relay the chunks, turn a failed step into an error event, then usage and [DONE]."""
        last: dict[str, RequestOutput] = {}
        try:
            async for chunk, out in events:
                last[out.request_id] = out
                yield chunk
        except StepFailed as e:
            yield sse(e.body())
            last = {}
        if include_usage and len(last) == len(ids):
            yield sse({**header(kind, request_id), "choices": [], "usage": usage([last[r] for r in ids], n)})
        yield "data: [DONE]\n\n"

    async def start(request_id: str, body, prompts: list, params, adapter):
        """Submit n choices of each prompt (choice index: prompt x n + choice, as OpenAI numbers them);
        their engine ids (the response's id, suffixed past one choice), each one's prompt, and the queue
        their outputs arrive on."""
        n = body.n
        each = [p for p in prompts for _ in range(n)]
        ids = [request_id] if len(each) == 1 else [f"{request_id}-{k}" for k in range(len(each))]
        params = choice_params(params, n) * len(prompts)  # the same n choices for every prompt
        return ids, each, await runner.start_request(ids, each, params, body.stream, adapter)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        adapter = check_model(body.model)
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        # Echoed with logprobs, or with vLLM's prompt_logprobs, the prompt is scored (to the larger k); an echo
        # with max_tokens 0 and neither is its prompt computed and sent back, nothing scored.
        asked = [k for k in (body.logprobs if body.echo else None, body.prompt_logprobs) if k is not None]
        scored = max(asked) if asked else None
        params = sampling_params(body, max_tokens, body.logprobs, scored)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        ids, prompts, queue = await start(request_id, body, body.prompts(), params, adapter)
        # text_offset counts from the start of the prompt's text, as OpenAI's does.
        texts = [p if isinstance(p, str) else tokenizer.decode(p) for p in prompts]
        bases = [0 if body.echo else len(t) for t in texts]

        def echoed(i: int, text: str, entries: list[dict], out: RequestOutput) -> tuple[str, list[dict]]:
            """With echo, a choice's first text and logprob entries start with its prompt's."""
            if not body.echo:
                return text, entries
            if params.logprobs is None:
                return texts[i] + text, entries
            return texts[i] + text, echoed_entries(out, params.logprobs) + entries

        def scored_prompt(out: RequestOutput) -> dict:
            """vLLM's prompt_logprobs field of a choice, where asked for."""
            if body.prompt_logprobs is None:
                return {}
            return {"prompt_logprobs": vllm_prompt_logprobs(tokenizer, out.prompt_logprobs, body.prompt_logprobs)}

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            async def chunks():
                offsets, started = list(bases), set()
                async for i, delta, entries, out in deltas(ids, queue, params.stop):
                    first = i not in started
                    if first:
                        started.add(i)
                        delta, entries = echoed(i, delta, entries, out)
                    logprobs = None
                    if params.logprobs is not None:
                        logprobs, offsets[i] = completion_logprobs(tokenizer, entries, offsets[i])
                    choice = {"index": i, "text": delta, "logprobs": logprobs, "finish_reason": out.finish_reason,
                              **(scored_prompt(out) if first else {})}
                    chunk = {**header("text_completion", request_id), "choices": [choice]}
                    if include_usage:
                        chunk["usage"] = None
                    yield sse(chunk), out

            return event_stream(finish_stream(chunks(), request_id, "text_completion", include_usage, ids, body.n))

        outs = await runner.final_outputs(ids, queue, request)
        if outs is None:
            return Response(status_code=499)  # the client closed the connection: nobody reads this
        choices = []
        for i, out in enumerate(outs):
            text, entries = echoed(i, out.text, out.logprobs or [], out)
            logprobs = completion_logprobs(tokenizer, entries, bases[i])[0] if params.logprobs is not None else None
            choices.append({"index": i, "text": text, "logprobs": logprobs, "finish_reason": out.finish_reason,
                            **scored_prompt(out)})
        return {**header("text_completion", request_id), "choices": choices, "usage": usage(outs, body.n)}

    def chat_prompt(messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        try:
            text = template.render(messages, add_generation_prompt)
        except ValueError as e:
            raise APIError(400, str(e), "messages") from None
        # The template writes any special tokens itself (e.g. bos_token): add none when encoding.
        return tokenizer.encode(text, add_special_tokens=False).ids

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        adapter = check_model(body.model)
        prompt = chat_prompt(body.message_dicts())
        max_tokens = next((n for n in (body.max_completion_tokens, body.max_tokens) if n is not None),
                          max(1, capacity - len(prompt)))
        params = sampling_params(body, max_tokens, body.logprobs_asked())
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        ids, _, queue = await start(request_id, body, [prompt], params, adapter)

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            def chunk(i: int, delta: dict, entries, finish_reason) -> dict:
                logprobs = chat_logprobs(tokenizer, entries) if params.logprobs is not None and entries else None
                choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
                c = {**header("chat.completion.chunk", request_id), "choices": [choice]}
                if include_usage:
                    c["usage"] = None
                return c

            async def chunks():
                started = set()
                async for i, delta, entries, out in deltas(ids, queue, params.stop):
                    if i not in started:  # a choice's role comes first, on its own, as OpenAI sends it
                        yield sse(chunk(i, {"role": "assistant", "content": ""}, [], None)), out
                        started.add(i)
                    yield sse(chunk(i, {"content": delta} if delta else {}, entries, out.finish_reason)), out

            return event_stream(finish_stream(chunks(), request_id, "chat.completion.chunk", include_usage, ids,
                                              body.n))

        outs = await runner.final_outputs(ids, queue, request)
        if outs is None:
            return Response(status_code=499)
        choices = [{"index": i, "message": {"role": "assistant", "content": out.text},
                    "logprobs": chat_logprobs(tokenizer, out.logprobs) if out.logprobs is not None else None,
                    "finish_reason": out.finish_reason} for i, out in enumerate(outs)]
        return {**header("chat.completion", request_id), "choices": choices, "usage": usage(outs, body.n)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": int(time.time()),
                                            "owned_by": "fivefold", "max_model_len": engine.max_model_len,
                                            **({"parent": model_name} if name != model_name else {})}
                                           for name in served]}

    # vLLM's tokenizer endpoints: what clients that count or build token ids themselves ask for (e.g.
    # lm-evaluation-harness's remote tokenizer, which then needs no copy of the tokenizer).
    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return {"tokenizer_class": "fivefold", "eos_token": eos_token or None, "bos_token": bos_token or None,
                "pad_token": None, "chat_template": template.source, "model_max_length": engine.max_model_len}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send a prompt (text) or messages (chat), one of the two", "prompt")
        if body.messages is not None:
            ids = chat_prompt(message_dicts(body.messages), body.add_generation_prompt)
        else:
            ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens).ids
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        vocab = engine.model.cfg.vocab_size
        if not all(0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"tokens must be ids in 0..{vocab - 1}", "tokens")
        return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=metrics.content_type)

    return app


@contextmanager
def running_in_thread(app: FastAPI, host: str = "127.0.0.1", timeout: float = 30.0):
    """Serve `app` with uvicorn in a background thread of this process, on a free port, until the block
    ends (tests, benchmarks, notebooks); yields the base URL."""
    import socket

    import uvicorn

    sock = socket.socket()
    sock.bind((host, 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start within {timeout:.0f} s (see uvicorn's log above)")
        time.sleep(0.01)
    try:
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()


def serve(engine: Engine, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          chat_template: str | None = None, **app_options) -> None:
    """Run the app with uvicorn until Ctrl-C / SIGTERM, then return (in-flight requests finish first);
    `app_options` go to create_app."""
    import signal

    import uvicorn

    class Server(uvicorn.Server):
        first_signal = None

        def handle_exit(self, sig, frame) -> None:
            # Shut down gracefully and return to the caller (uvicorn would re-raise the signal after
            # shutting down, into the middle of the event loop's teardown). Another Ctrl-C forces it, but
            # only a second or more later: under torchrun each worker gets the terminal's SIGINT and then
            # the agent's copy of it at once.
            now = time.monotonic()
            if self.first_signal is None:
                self.first_signal = now
            elif sig == signal.SIGINT and now - self.first_signal > 1.0:
                self.force_exit = True
            self.should_exit = True

    app = create_app(engine, model_name, chat_template, **app_options)
    Server(uvicorn.Config(app, host=host, port=port, log_level="info")).run()
