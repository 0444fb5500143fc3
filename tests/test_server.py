"""The OpenAI-compatible server over a tiny random model, driven by the official `openai` client and
httpx: its outputs against the engine's own, its formats, its errors, its metrics and its aborts."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from fivefold.cli import main  # noqa: E402
from fivefold.config import ModelConfig  # noqa: E402
from fivefold.data.tokenizer import EOS_TOKEN, train_tokenizer  # noqa: E402
from fivefold.model import Transformer, materialise  # noqa: E402
from fivefold.serve import LLM, Engine, SamplingParams  # noqa: E402
from fivefold.data.chat import ChatTemplate, ChatTemplateError, special_tokens  # noqa: E402
from fivefold.serve.engine import serve_config  # noqa: E402
from fivefold.serve.protocol import TextStream  # noqa: E402
from fivefold.serve.server import create_app, running_in_thread  # noqa: E402

NAME = "tiny"
PROMPT = "The quick brown fox"
ENGINE = {"block_size": 16, "num_blocks": 64, "max_num_seqs": 8}
TEMPLATE = "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] "
DOCS = ["The quick brown fox jumps over the lazy dog.", "A quick brown dog outpaces a lazy fox!",
        "def add(x, y):\n    return x + y\n", "Numbers: 1, 22, 333 and 4444.",
        "Ünïcödé: héllo wörld, 🙂 ok"] * 8


@pytest.fixture(scope="module")
def tiny():
    tokenizer = train_tokenizer(DOCS, 300)
    cfg = ModelConfig(vocab_size=300, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=128,
                      max_seq_len=256)
    with torch.device("meta"):
        model = Transformer(cfg)
    materialise(model, "cpu", seed=1, dtype=torch.float32)  # seed 0 says eos after 6 tokens
    model.reset_buffers()
    return model.eval(), tokenizer


def running(app):
    return running_in_thread(app, timeout=10)


@pytest.fixture(scope="module")
def server(tiny):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, serve_config(ENGINE))
    app = create_app(engine, NAME, chat_template=TEMPLATE, bos_token=EOS_TOKEN)
    with running(app) as url:
        yield url, engine, app
    assert app.state.runner.thread is None  # the lifespan stopped the stepping thread


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="x", max_retries=0)


def reference(tiny, prompt, **params):
    """The engine's own output for `prompt`, on a fresh engine over the same model."""
    model, tokenizer = tiny
    return LLM(model, tokenizer=tokenizer, **ENGINE).generate(prompt, SamplingParams(**params))[0]


def wait_until(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def idle(engine) -> bool:
    return not engine.has_unfinished() and engine.blocks.num_used == 0


def scrape(url) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    return {(s.name + json.dumps(s.labels, sort_keys=True) if s.labels else s.name): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


# ---- completions and chat


def test_completion_is_the_engines_greedy_output(tiny, client):
    _, tokenizer = tiny
    ref = reference(tiny, PROMPT, max_tokens=12, temperature=0)
    assert ref.finish_reason == "length" and len(ref.token_ids) == 12  # the random model does not stop at once
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    assert out.object == "text_completion" and out.model == NAME and out.id.startswith("cmpl-")
    assert out.choices[0].text == ref.text == tokenizer.decode(ref.token_ids)
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].logprobs is None
    prompt_len = len(tokenizer.encode(PROMPT).ids)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == \
        (prompt_len, 12, prompt_len + 12)
    # The prompt as token ids, and as a one-element list, give the same.
    ids = tokenizer.encode(PROMPT).ids
    for prompt in (ids, [ids], [PROMPT]):
        again = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0)
        assert again.choices[0].text == ref.text


def test_stop_strings_cut_the_text_streamed_or_not(tiny, client):
    ref = reference(tiny, PROMPT, max_tokens=12, temperature=0)
    # A stop string from the middle of the output, of whole characters.
    start = next(i for i in range(len(ref.text) // 2, len(ref.text)) if "\ufffd" not in ref.text[i:i + 3])
    stop = ref.text[start:start + 3]
    expected = ref.text[:ref.text.find(stop)]
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0, stop=stop)
    assert (out.choices[0].text, out.choices[0].finish_reason) == (expected, "stop")
    chunks = list(client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop],
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert [c.choices[0].finish_reason for c in chunks][-1] == "stop"


def test_streamed_completion_equals_the_whole(tiny, client):
    whole = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=20, temperature=0)
    chunks = list(client.completions.create(model=NAME, prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert len(chunks) >= 5  # token by token, not one piece
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks] == [None] * (len(text_chunks) - 1) + ["length"]
    assert all(c.usage is None for c in text_chunks)
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 20
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_renders_the_template_and_streams(tiny, client):
    _, tokenizer = tiny
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "A quick dog?"}]
    rendered = f"{EOS_TOKEN}[system] Be brief.\n[user] A quick dog?\n[assistant] "
    ids = tokenizer.encode(rendered, add_special_tokens=False).ids
    assert ids[0] == 0  # the template's bos_token is the special token itself, not its characters
    ref = reference(tiny, ids, max_tokens=10, temperature=0, ignore_eos=True)
    out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.text
    assert (out.choices[0].finish_reason, out.usage.prompt_tokens, out.usage.completion_tokens) == \
        ("length", len(ids), 10)
    # max_completion_tokens is the newer name of max_tokens; content parts are joined.
    parts = [messages[0], {"role": "user", "content": [{"type": "text", "text": "A quick "},
                                                       {"type": "text", "text": "dog?"}]}]
    again = client.chat.completions.create(model=NAME, messages=parts, max_completion_tokens=10, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert again.choices[0].message.content == ref.text

    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert (chunks[0].choices[0].delta.role, chunks[0].choices[0].delta.content) == ("assistant", "")
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_chat_default_max_tokens_fills_the_context(tiny, client):
    out = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], temperature=0,
                                         extra_body={"ignore_eos": True})
    assert out.usage.prompt_tokens + out.usage.completion_tokens == 256  # model.max_seq_len
    assert out.choices[0].finish_reason == "length"


def test_logprobs_match_the_engine(tiny, client):
    ref = reference(tiny, PROMPT, max_tokens=5, temperature=0, logprobs=3)
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    torch.testing.assert_close(lp.token_logprobs, [e["logprob"] for e in ref.logprobs], atol=1e-5, rtol=0)
    _, tokenizer = tiny
    for top, entry in zip(lp.top_logprobs, ref.logprobs):
        expected = {}  # token text -> logprob; of two tokens with the same text, the likelier
        for token_id, logprob in entry["top"]:
            expected.setdefault(tokenizer.decode([token_id], skip_special_tokens=False), logprob)
        assert list(top) == list(expected)
        torch.testing.assert_close(list(top.values()), list(expected.values()), atol=1e-5, rtol=0)
    assert sum(len(top) for top in lp.top_logprobs) >= 12  # 3 each, less the few collisions
    # Greedy: the chosen token is the most likely one.
    assert all(abs(t - max(top.values())) < 1e-6 for t, top in zip(lp.token_logprobs, lp.top_logprobs))
    assert lp.tokens == [tokenizer.decode([t], skip_special_tokens=False) for t in ref.token_ids]
    assert lp.text_offset == [len(PROMPT) + len("".join(lp.tokens[:i])) for i in range(5)]

    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 4
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 and c.logprob == c.top_logprobs[0].logprob
               for c in content)
    assert all(c.bytes == list(c.token.encode()) for c in content)


def test_echo_scores_continuations_as_evaluation_harnesses_ask(tiny, server):
    """lm-evaluation-harness's loglikelihood request: context + continuation as token ids, a batch of them,
    max_tokens 1, logprobs 1, echo, greedy. token_logprobs[ctxlen:-1] are the continuation's logprobs under a
    full forward, the first token's is null, is_greedy reads the same off top_logprobs, and the text is the
    prompt's followed by the completion's."""
    model, tokenizer = tiny
    url, engine, _ = server
    ctx = tokenizer.encode("The quick brown").ids
    continuations = [tokenizer.encode(c).ids for c in (" fox jumps", " dog", " 22 and")]
    prompts = [ctx + c for c in continuations]
    body = {"model": NAME, "prompt": prompts, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    for prompt, cont, choice in zip(prompts, continuations, choices):
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([prompt]))[0].float(), dim=-1)
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(prompt) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None and lp["text_offset"][0] == 0
        scores = lp["token_logprobs"][len(ctx):-1]
        want = [float(ref[i - 1, prompt[i]]) for i in range(len(ctx), len(prompt))]
        assert scores == pytest.approx(want, abs=1e-5)
        is_greedy = all(t == max(top.values()) for t, top in zip(scores, lp["top_logprobs"][len(ctx):-1]))
        assert is_greedy == all(int(ref[i - 1].argmax()) == prompt[i] for i in range(len(ctx), len(prompt)))
        generated = reference(tiny, prompt, max_tokens=1, temperature=0)
        assert choice["text"] == tokenizer.decode(prompt) + generated.text
        assert lp["token_logprobs"][-1] == pytest.approx(float(ref[-1].max()), abs=1e-5)  # the greedy token's
    assert r.json()["usage"]["completion_tokens"] == 3


def test_echo_with_max_tokens_0_scores_the_prompt_only(tiny, server):
    """max_tokens 0 with echo: the prompt back with its tokens' logprobs, nothing generated; streamed, the
    same text and logprobs in one chunk; without logprobs, the prompt's text alone."""
    _, tokenizer = tiny
    url, engine, _ = server
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 2}
    whole = httpx.post(f"{url}/v1/completions", json=body).json()
    choice = whole["choices"][0]
    ids = tokenizer.encode(PROMPT).ids
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert whole["usage"]["completion_tokens"] == 0 and whole["usage"]["prompt_tokens"] == len(ids)
    events = [json.loads(line[6:]) for line in httpx.post(f"{url}/v1/completions", json={**body, "stream": True}
                                                          ).text.splitlines() if line.startswith("data: {")]
    assert [e["choices"][0]["text"] for e in events] == [PROMPT]
    assert events[0]["choices"][0]["logprobs"] == choice["logprobs"]
    plain = httpx.post(f"{url}/v1/completions", json={**body, "logprobs": None}).json()["choices"][0]
    assert plain["text"] == PROMPT and plain["logprobs"] is None
    assert idle(engine)


def test_vllms_prompt_logprobs_field(tiny, server):
    """vLLM's prompt_logprobs: each choice's per-token {id: {logprob, rank, decoded_token}}, the prompt token
    itself first (its rank: 1 + the tokens a full forward finds likelier), then the k likeliest ranked 1..k;
    the first token's null. Beside echo's logprobs of another k, each keeps its own; streamed, it comes
    with a choice's first chunk. k past 20 is a 400 naming the field."""
    model, tokenizer = tiny
    url, engine, _ = server
    ids = tokenizer.encode(PROMPT).ids
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids]))[0, :-1].float(), dim=-1)
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 3, "echo": True,
            "logprobs": 1}
    choice = httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0]
    scored = choice["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    for position, token, row in zip(scored[1:], ids[1:], ref):
        first_id, first = next(iter(position.items()))
        assert int(first_id) == token and first["decoded_token"] == tokenizer.decode([token], skip_special_tokens=False)
        assert first["logprob"] == pytest.approx(float(row[token]), abs=1e-5)
        assert first["rank"] == int((row > row[token]).sum()) + 1
        top = row.topk(3)
        for rank, (t, lp) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
            assert position[str(t)]["rank"] == (rank if t != token else first["rank"])
            assert position[str(t)]["logprob"] == pytest.approx(lp, abs=1e-5)
        assert len(position) == 3 + (token not in top.indices.tolist())
    echoed = choice["logprobs"]["top_logprobs"]
    assert echoed[0] is None and all(len(top) == 1 for top in echoed[1:])  # echo's own k
    events = [json.loads(line[6:]) for line in httpx.post(f"{url}/v1/completions", json={**body, "stream": True}
                                                          ).text.splitlines() if line.startswith("data: {")]
    assert events[0]["choices"][0]["prompt_logprobs"] == scored
    assert all("prompt_logprobs" not in e["choices"][0] for e in events[1:])
    r = httpx.post(f"{url}/v1/completions", json={**body, "prompt_logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    assert idle(engine)


def test_streamed_echo_is_the_whole_response_in_pieces(server):
    """Streamed with echo, a choice's first chunk starts with the prompt: its texts joined are the
    non-streamed text, and its logprob tokens and offsets joined are the non-streamed ones."""
    url, _, _ = server
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 12, "echo": True, "logprobs": 1, "temperature": 0,
            "ignore_eos": True, "n": 2}
    whole = sorted(httpx.post(f"{url}/v1/completions", json=body).json()["choices"], key=lambda c: c["index"])
    events = [json.loads(line[6:]) for line in httpx.post(f"{url}/v1/completions", json={**body, "stream": True}
                                                          ).text.splitlines() if line.startswith("data: {")]
    for choice in whole:
        parts = [e["choices"][0] for e in events if e["choices"][0]["index"] == choice["index"]]
        assert "".join(p["text"] for p in parts) == choice["text"] and choice["text"].startswith(PROMPT)
        for key in ("tokens", "token_logprobs", "text_offset"):
            assert sum((p["logprobs"][key] for p in parts), []) == choice["logprobs"][key]


def test_tokenizer_endpoints_answer_as_vllms(tiny, server):
    """/tokenizer_info, /tokenize and /detokenize in vLLM's shapes, as lm-evaluation-harness's remote tokenizer
    probes and uses them: a text's ids are the engine's (its add_special_tokens as asked), chat messages
    give the ids the chat endpoint feeds the model, and ids decode back to the text. Bad bodies are 400s."""
    _, tokenizer = tiny
    url, engine, _ = server
    info = httpx.get(f"{url}/tokenizer_info").json()
    assert info["eos_token"] == tokenizer.id_to_token(engine.eos_id) and info["chat_template"] == TEMPLATE
    assert info["model_max_length"] == engine.max_model_len
    probe = httpx.post(f"{url}/tokenize", json={"prompt": "test", "add_special_tokens": False}).json()
    assert probe["tokens"] == tokenizer.encode("test", add_special_tokens=False).ids  # lm-eval's probe
    r = httpx.post(f"{url}/tokenize", json={"model": NAME, "prompt": PROMPT}).json()
    assert r == {"tokens": tokenizer.encode(PROMPT).ids, "count": len(tokenizer.encode(PROMPT).ids),
                 "max_model_len": engine.max_model_len}
    assert httpx.post(f"{url}/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": PROMPT}
    messages = [{"role": "user", "content": "Hi"}]
    chat = httpx.post(f"{url}/tokenize", json={"messages": messages}).json()
    answer = httpx.post(f"{url}/v1/chat/completions", json={"model": NAME, "messages": messages, "max_tokens": 1})
    assert chat["count"] == answer.json()["usage"]["prompt_tokens"]
    assert httpx.post(f"{url}/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"] == \
        f"{EOS_TOKEN}[user] Hi\n[assistant] "
    for path, body, param in [("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": "a", "messages": messages}, "prompt"),
                              ("/detokenize", {"tokens": [300]}, "tokens"), ("/detokenize", {"tokens": [-1]}, "tokens"),
                              ("/detokenize", {}, "tokens")]:
        r = httpx.post(f"{url}{path}", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body, r.text)
    r = httpx.post(f"{url}/tokenize", json={"model": "gpt-4", "prompt": "a"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert idle(engine)


def test_models_health_and_metrics(tiny, server, client):
    url, engine, _ = server
    assert [m.id for m in client.models.list().data] == [NAME]
    health = httpx.get(f"{url}/health")
    assert (health.status_code, health.json()) == (200, {"status": "ok"})

    before, hits = scrape(url), engine.blocks.hit_tokens
    for name in ("fivefold_requests_running", "fivefold_requests_waiting", "fivefold_kv_blocks_used",
                 "fivefold_kv_cache_usage_ratio", "fivefold_prefix_cache_hit_rate",
                 "fivefold_generation_tokens_per_second", "fivefold_time_per_output_token_seconds_count"):
        assert name in before, name
    prompt = f"{PROMPT} jumps over the lazy dog. " * 2
    prompt_len = len(tiny[1].encode(prompt).ids)
    assert prompt_len > ENGINE["block_size"]  # so the second request finds a cached block
    for _ in range(2):
        client.completions.create(model=NAME, prompt=prompt, max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    after = scrape(url)

    def grew(name):
        return after[name] - before.get(name, 0)

    assert grew("fivefold_generation_tokens_total") == 10
    assert grew("fivefold_prompt_tokens_total") == 2 * prompt_len
    assert grew('fivefold_requests_finished_total{"reason": "length"}') == 2
    assert grew('fivefold_requests_finished_total{"reason": "abort"}') == 0
    assert grew("fivefold_time_to_first_token_seconds_count") == 2
    assert grew("fivefold_time_per_output_token_seconds_count") == 2
    assert after["fivefold_generation_tokens_per_second"] > 0
    assert after["fivefold_kv_blocks_used"] == after["fivefold_requests_running"] == 0
    assert after["fivefold_kv_cache_usage_ratio"] == 0
    # The second request found the first's full prompt blocks; the gauge is the engine's rate.
    assert engine.blocks.hit_tokens - hits == (prompt_len - 1) // ENGINE["block_size"] * ENGINE["block_size"]
    assert after["fivefold_prefix_cache_hit_rate"] == pytest.approx(engine.blocks.hit_rate)


# ---- errors


def test_bad_requests_are_400_in_openais_shape(server, client):
    url = server[0]
    with pytest.raises(openai.BadRequestError, match="exceeds the model's context of 256 tokens"):
        client.completions.create(model=NAME, prompt="fox " * 300, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="temperature must be >= 0"):
        client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, temperature=-1)
    with pytest.raises(openai.BadRequestError, match="n=0: ask for 1 to 128 choices"):
        client.completions.create(model=NAME, prompt=PROMPT, n=0)
    with pytest.raises(openai.BadRequestError, match="logprobs must be in 0..20"):
        client.completions.create(model=NAME, prompt=PROMPT, echo=True, logprobs=21)
    with pytest.raises(openai.NotFoundError, match="'gpt-4' does not exist"):
        client.completions.create(model="gpt-4", prompt=PROMPT)

    r = httpx.post(f"{url}/v1/completions", json={"model": NAME, "prompt": PROMPT, "max_tokens": "many"})
    assert r.status_code == 400
    assert r.json() == {"error": {"message": "max_tokens: Input should be a valid integer, unable to parse string "
                                             "as an integer", "type": "invalid_request_error",
                                  "param": "max_tokens", "code": 400}}
    r = httpx.post(f"{url}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("the request body is not valid JSON")
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": NAME, "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.get(f"{url}/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert idle(server[1])


def test_full_queue_is_429(tiny):
    """No lifespan under httpx's ASGI transport, so nothing steps: the first request waits, the second
    finds the queue full."""
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, serve_config(ENGINE))
    app = create_app(engine, NAME, max_waiting=1)

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as http:
            body = {"model": NAME, "prompt": PROMPT, "max_tokens": 4}
            # n choices take n places: two can never fit in one, which is a 400 (retrying will not help)
            too_many = await http.post("/v1/completions", json={**body, "n": 2})
            assert too_many.status_code == 400 and "split the request" in too_many.json()["error"]["message"]
            assert engine.num_waiting == 0
            first = asyncio.create_task(http.post("/v1/completions", json=body))
            while engine.num_waiting == 0:
                await asyncio.sleep(0.01)
            second = await http.post("/v1/completions", json=body)
            first.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await first
            return second

    second = asyncio.run(asyncio.wait_for(scenario(), 20))
    assert second.status_code == 429
    error = second.json()["error"]
    assert error["type"] == "rate_limit_error" and "queue is full (1 requests waiting" in error["message"]
    # The cancelled first request is aborted by the stepping thread once it runs.
    runner = app.state.runner
    runner.start()
    try:
        wait_until(lambda: idle(engine))
    finally:
        runner.stop()
    assert engine.stats["aborted"] == 1 and engine.stats["generation_tokens"] == 0


def test_clients_that_leave_abort_their_requests(server):
    url, engine, _ = server
    aborted = engine.stats["aborted"]
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 240, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        first = next(r.iter_lines())
        assert first.startswith("data: {")
    wait_until(lambda: idle(engine))
    assert engine.stats["aborted"] == aborted + 1
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "n": 3}) as r:  # every choice goes
        assert r.status_code == 200 and next(r.iter_lines()).startswith("data: {")
    wait_until(lambda: idle(engine))
    assert engine.stats["aborted"] == aborted + 4

    # A non-streaming client that gives up. Each step is slowed down, so that the request outlasts the
    # client's timeout on any host (the tiny model writes 240 tokens in under 0.3 s on a fast one).
    slow = engine.model.register_forward_pre_hook(lambda module, args: time.sleep(0.02))
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", json={**body, "stream": False}, timeout=0.3)
        wait_until(lambda: idle(engine))
    finally:
        slow.remove()
    assert engine.stats["aborted"] == aborted + 5
    assert scrape(url)['fivefold_requests_finished_total{"reason": "abort"}'] >= 5


def test_a_failing_step_fails_its_requests_and_the_server_goes_on(server, client):
    url, engine, _ = server

    def fail_once(module, args):
        hook.remove()
        raise RuntimeError("injected")

    hook = engine.model.register_forward_pre_hook(fail_once)
    with pytest.raises(openai.InternalServerError, match="the engine failed during a step: RuntimeError: injected"):
        client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4)
    assert idle(engine)

    hook = engine.model.register_forward_pre_hook(fail_once)
    with httpx.stream("POST", f"{url}/v1/completions", json={"model": NAME, "prompt": PROMPT, "stream": True}) as r:
        events = [line for line in r.iter_lines() if line]
    assert json.loads(events[0].removeprefix("data: "))["error"]["type"] == "server_error"
    assert events[1:] == ["data: [DONE]"]

    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 4 and idle(engine)
    assert scrape(url)['fivefold_requests_finished_total{"reason": "error"}'] == 2


# ---- pieces


def test_default_chat_template_and_template_errors(tmp_path):
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert ChatTemplate().render(messages) == "<|system|>\nS\n<|user|>\nU\n<|assistant|>\n"
    strict = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}")
    with pytest.raises(ChatTemplateError, match="user first"):
        strict.render(messages)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    assert special_tokens(tmp_path) == ("<s>", "</s>")
    assert special_tokens(tmp_path / "none") == ("", "")


def test_text_stream_holds_back_partial_characters_and_stop_prefixes(tiny):
    _, tokenizer = tiny
    text = "héllo 🙂 wörld"
    ids = tokenizer.encode(text).ids
    stream = TextStream(tokenizer, [])
    deltas = [stream.push(ids[:i]) for i in range(1, len(ids) + 1)]
    assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)
    assert deltas[6:9] == ["", "", ""]  # the emoji's four bytes are four tokens: sent with the last one
    stream = TextStream(tokenizer, ["STOP", "x"])
    sent = "".join(stream.push(ids[:i]) for i in range(1, len(ids) + 1))
    assert sent == text[:-3]  # the longest stop string could start in the last 3 characters
    assert sent + stream.finish(text) == text


def test_serve_command_errors_are_one_line(tmp_path, capsys):
    assert main(["serve", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fivefold serve: error: no checkpoint found at") and err.count("\n") == 1
    assert main(["serve", str(tmp_path), "--set", "serve.block_size=big"]) == 2
    err = capsys.readouterr().err
    assert err == "fivefold serve: error: serve.block_size='big' is not valid; expected an integer\n"
    assert main(["serve", str(tmp_path), "--set", "model.hidden_size=8"]) == 2
    assert "takes only serve.* keys" in capsys.readouterr().err


def test_non_positive_max_tokens_is_400_naming_the_field(server):
    """max_tokens (and chat's max_completion_tokens) of 0 or less is refused when the body is validated:
    400 in OpenAI's shape, the field the client sent as param, and nothing reaches the engine. Completions
    take 0 with echo (scoring the prompt), and say so when it comes without."""
    url, engine, _ = server
    stats = dict(engine.stats)
    chat = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}]}
    completion = {"model": NAME, "prompt": PROMPT}
    cases = [("/v1/completions", completion, "max_tokens", -1, 0),
             ("/v1/chat/completions", chat, "max_tokens", 0, 1), ("/v1/chat/completions", chat, "max_tokens", -1, 1),
             ("/v1/chat/completions", chat, "max_completion_tokens", 0, 1),
             ("/v1/chat/completions", chat, "max_completion_tokens", -1, 1)]
    for path, body, field, value, least in cases:
        r = httpx.post(f"{url}{path}", json={**body, field: value})
        assert r.status_code == 400, (path, field, value, r.text)
        assert r.json() == {"error": {"message": f"{field}: Input should be greater than or equal to {least}",
                                      "type": "invalid_request_error", "param": field, "code": 400}}
    r = httpx.post(f"{url}/v1/completions", json={**completion, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert "max_tokens=0 generates nothing: it scores the prompt, with echo: true" in r.json()["error"]["message"]
    assert idle(engine) and engine.stats == stats
    cases = [c for c in cases if c[3] == -1]
    # 1 is the smallest allowed: one token, finish_reason length.
    for path, body, field, _, _ in cases:
        r = httpx.post(f"{url}{path}", json={**body, field: 1, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 1 and r.json()["choices"][0]["finish_reason"] == "length"


def test_sampling_fields_at_their_edges(server):
    """top_k -1 means off (vLLM's convention, as 0 here) and answers as 0 does; -2 is a 400 that says what
    top_k takes. Chat's top_logprobs without logprobs: true is a 400 naming top_logprobs (OpenAI's rule),
    not a silent answer without them."""
    url, engine, _ = server
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 3, "seed": 1, "ignore_eos": True}
    texts = []
    for top_k in (0, -1):
        r = httpx.post(f"{url}/v1/completions", json={**body, "top_k": top_k})
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["text"])
    assert texts[0] == texts[1]
    r = httpx.post(f"{url}/v1/completions", json={**body, "top_k": -2})
    assert r.status_code == 400 and "top_k must be an integer >= 0" in r.json()["error"]["message"]
    chat = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    r = httpx.post(f"{url}/v1/chat/completions", json={**chat, "top_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    r = httpx.post(f"{url}/v1/chat/completions", json={**chat, "top_logprobs": 2, "logprobs": True})
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2
    assert idle(engine)


def test_logit_bias_and_the_fields_it_refuses(tiny, server):
    """logit_bias arrives as OpenAI sends it (token ids as strings) and does what the engine's does: +100
    on a token makes every generated token that one. Fields that would change what a client gets back and
    that this server does not do are refused with a 400 naming them, not ignored: best_of, response_format
    other than text, suffix, tools and functions; so are logit_bias keys that are not token ids, biases
    past +-100 and ids past the vocabulary."""
    url, engine, _ = server
    _, tokenizer = tiny
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 4, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json={**body, "logit_bias": {"42": 100}, "seed": 3})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == tokenizer.decode([42] * 4)
    chat = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    refused = [("/v1/completions", {**body, "best_of": 3}, "best_of"),
               ("/v1/completions", {**body, "n": 129}, "n"),
               ("/v1/completions", {**body, "suffix": "end"}, "suffix"),
               ("/v1/chat/completions", {**chat, "response_format": {"type": "json_object"}}, "response_format"),
               ("/v1/chat/completions", {**chat, "tools": [{"type": "function", "function": {"name": "f"}}]},
                "tools"),
               ("/v1/chat/completions", {**chat, "functions": [{"name": "f"}]}, "functions"),
               ("/v1/completions", {**body, "logit_bias": {"fox": 1}}, "logit_bias"),
               ("/v1/completions", {**body, "logit_bias": {"1": 101}}, "logit_bias"),
               ("/v1/completions", {**body, "frequency_penalty": 3}, "frequency_penalty")]
    for path, request, field in refused:
        r = httpx.post(f"{url}{path}", json=request)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)
    r = httpx.post(f"{url}/v1/completions", json={**body, "logit_bias": {"300": 1}})
    assert r.status_code == 400 and "the vocabulary has ids 0..299" in r.json()["error"]["message"]
    for request in ({**body, "best_of": 1}, {**body, "n": 2, "best_of": 2}, {**chat, "response_format": {"type": "text"}},
                    {**chat, "tools": []}):
        path = "/v1/chat/completions" if "messages" in request else "/v1/completions"
        assert httpx.post(f"{url}{path}", json=request).status_code == 200
    assert idle(engine)


def test_n_choices_are_the_seeded_requests_they_stand_for(tiny, server, client):
    """n > 1: choice i is what one request with seed + i returns, through completions and chat, streamed
    (each index's pieces joined) or not; usage counts the prompt once and every choice's tokens; a stream's
    chunks name their choice; with no seed the choices still differ (each draws its own)."""
    url, engine, _ = server
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 5, "temperature": 1.0, "ignore_eos": True}
    alone = [httpx.post(f"{url}/v1/completions", json={**body, "seed": 10 + i}).json() for i in range(3)]
    r = httpx.post(f"{url}/v1/completions", json={**body, "seed": 10, "n": 3})
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert [c["text"] for c in out["choices"]] == [a["choices"][0]["text"] for a in alone]
    assert out["usage"]["prompt_tokens"] == alone[0]["usage"]["prompt_tokens"]
    assert out["usage"]["completion_tokens"] == 15
    streamed = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=5, seed=10, n=3, stream=True,
                                         extra_body={"ignore_eos": True}, stream_options={"include_usage": True})
    texts, usage = ["", "", ""], None
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
        usage = chunk.usage or usage
    assert texts == [c["text"] for c in out["choices"]] and usage.completion_tokens == 15
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          seed=3, n=2, extra_body={"ignore_eos": True})
    chat_alone = [client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=4, seed=3 + i, extra_body={"ignore_eos": True})
                  for i in range(2)]
    assert [c.message.content for c in chat.choices] == [a.choices[0].message.content for a in chat_alone]
    deltas = ["", ""]
    for chunk in client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=4, seed=3, n=2, stream=True,
                                                extra_body={"ignore_eos": True}):
        for choice in chunk.choices:
            deltas[choice.index] += choice.delta.content or ""
    assert deltas == [c.message.content for c in chat.choices]
    unseeded = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 8, "n": 4}).json()
    assert len({c["text"] for c in unseeded["choices"]}) > 1
    assert idle(engine)


def test_a_batch_of_prompts_is_each_prompt_alone(tiny, server, client):
    """A completions request with a list of prompts (text or token ids) answers choice prompt x n + j with
    what that prompt alone returns with seed + j, streamed or not; usage counts each prompt once. More
    choices than the queue can ever hold is a 400, not a 429 worth retrying."""
    url, engine, _ = server
    _, tokenizer = tiny
    prompts = ["The quick", "A lazy dog", "Numbers: 1, 22"]
    body = {"model": NAME, "max_tokens": 4, "temperature": 0.9, "seed": 5, "ignore_eos": True}
    alone = [[httpx.post(f"{url}/v1/completions", json={**body, "prompt": p, "seed": 5 + j}).json()
              for j in range(2)] for p in prompts]
    r = httpx.post(f"{url}/v1/completions", json={**body, "prompt": prompts, "n": 2})
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == list(range(6))
    assert [c["text"] for c in out["choices"]] == [a[j]["choices"][0]["text"] for a in alone for j in range(2)]
    assert out["usage"]["prompt_tokens"] == sum(a[0]["usage"]["prompt_tokens"] for a in alone)
    assert out["usage"]["completion_tokens"] == 6 * 4
    texts = [""] * 6
    for chunk in client.completions.create(model=NAME, prompt=prompts, max_tokens=4, temperature=0.9, seed=5, n=2,
                                           stream=True, extra_body={"ignore_eos": True}):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c["text"] for c in out["choices"]]
    ids = [tokenizer.encode(p).ids for p in prompts]  # a batch of token-id prompts: the same answers
    r = httpx.post(f"{url}/v1/completions", json={**body, "prompt": ids, "n": 2})
    assert [c["text"] for c in r.json()["choices"]] == texts
    r = httpx.post(f"{url}/v1/completions", json={**body, "prompt": ["x"] * 3, "n": 100})
    assert r.status_code == 400 and "serve.max_waiting" in r.json()["error"]["message"]
    assert idle(engine)


def test_min_tokens_through_the_server(tiny, server):
    """min_tokens reaches the engine: a request forced to emit one token whose text is its stop string
    ends at its first token, and with min_tokens 3 after three, its text the first two (a match inside them
    is not one); min_tokens past max_tokens is a 400 naming it."""
    url, engine, _ = server
    _, tokenizer = tiny
    token = next(t for t in range(5, 300) if len(tokenizer.decode([t])) == 1 and tokenizer.decode([t]).isalpha())
    letter = tokenizer.decode([token])
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 8, "logit_bias": {str(token): 100}, "stop": [letter],
            "ignore_eos": True}
    for min_tokens, tokens in ((0, 1), (3, 3)):
        r = httpx.post(f"{url}/v1/completions", json={**body, "min_tokens": min_tokens})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["choices"][0]["finish_reason"] == "stop" and out["usage"]["completion_tokens"] == tokens, out
        # The text ends before the first match that ends after min_tokens: not at one inside the first two.
        assert out["choices"][0]["text"] == letter * (tokens - 1), out
    r = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 2, "min_tokens": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"
    assert idle(engine)


def test_an_api_key_guards_the_v1_routes(tiny):
    """With an API key, a /v1 request without `Authorization: Bearer KEY`, or with another key, is a 401 in
    OpenAI's shape and reaches nothing; the right key (as the official client sends it) is served; /health
    and /metrics stay open for probes and scrapers, the tokenizer endpoints do not."""
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, serve_config(ENGINE))
    app = create_app(engine, NAME, api_key="s3cret")
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 2}
    with running(app) as url:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = httpx.post(f"{url}/v1/completions", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
        assert httpx.get(f"{url}/v1/models").status_code == 401
        assert engine.stats.get("steps", 0) == 0 and not engine.has_unfinished()  # nothing reached the engine
        keyed = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0)
        assert keyed.completions.create(**body).usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0).models.list()
        assert httpx.get(f"{url}/health").status_code == 200 and httpx.get(f"{url}/metrics").status_code == 200
        # The tokenizer endpoints sit outside /v1 (as vLLM's) and are guarded all the same.
        assert httpx.post(f"{url}/tokenize", json={"prompt": PROMPT}).status_code == 401
        assert httpx.get(f"{url}/tokenizer_info").status_code == 401
        assert httpx.post(f"{url}/tokenize", json={"prompt": PROMPT},
                          headers={"Authorization": "Bearer s3cret"}).status_code == 200


def test_scoring_refused_when_the_engine_scores_nothing(tiny):
    """serve.max_scored_tokens=0: an echo with logprobs (or vLLM's prompt_logprobs) is a 400 that names the
    setting; an echo for no tokens without them is taken. ASGI transport without the lifespan: the refusal
    comes before anything steps."""
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, serve_config({**ENGINE, "max_scored_tokens": 0}))
    app = create_app(engine, NAME)

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as http:
            body = {"model": NAME, "prompt": PROMPT, "max_tokens": 1}
            for extra in ({"echo": True, "logprobs": 1}, {"prompt_logprobs": 0}):
                refused = await http.post("/v1/completions", json={**body, **extra})
                assert refused.status_code == 400, extra
                assert "serve.max_scored_tokens=0" in refused.json()["error"]["message"]
            assert engine.num_waiting == 0
            # An echo for no tokens without logprobs scores nothing: it is queued (nothing steps here).
            queued = asyncio.create_task(http.post("/v1/completions", json={**body, "max_tokens": 0, "echo": True}))
            while engine.num_waiting == 0:
                await asyncio.sleep(0.01)
            queued.cancel()

    asyncio.run(scenario())
