"""`fivefold serve` (a model behind an OpenAI-compatible HTTP API), `fivefold generate` (one prompt) and
`fivefold score` (a text's log-likelihood and perplexity, through the same engine)."""

from __future__ import annotations

import math
import os
import signal
import sys
from pathlib import Path

from fivefold.checkpoint.kinds import model_directory
from fivefold.commands.args import port_number, positive_int
from fivefold.config import ConfigError
from fivefold.config_load import load_config
from fivefold.data.chat import special_tokens
from fivefold.parallel.mesh import local_device, resolve_device
from fivefold.serve import LLM, RequestError, SamplingParams
from fivefold.serve.engine import Engine, check_tp_serving
from fivefold.serve.loading import load_model_for_serving
from fivefold.serve.sharded import launch


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API (/v1/completions, "
                                     "/v1/chat/completions, /metrics)")
    p.add_argument("model", metavar="MODEL",
                   help="a Hugging Face model directory, a fivefold export, or a fivefold run or checkpoint")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=port_number, default=8000)
    p.add_argument("--tokenizer", help="tokenizer.json (default: the one next to the model)")
    p.add_argument("--model-name", help="the model id clients send (default: MODEL's directory name)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    p.add_argument("--seed", type=int, default=0, help="seeds the requests that bring no seed of their own")
    p.add_argument("--tp", type=positive_int, default=1, metavar="N",
                   help="tensor parallel over N processes (launched through torchrun): rank 0 serves HTTP and "
                        "drives, the others run their shard of every forward")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                   help="serve a LoRA adapter (a fivefold LoRA run or a PEFT directory) beside the base; clients "
                        "ask for it as model 'BASE:NAME' (repeatable; one batch mixes adapters)")
    p.add_argument("--api-key", default=os.environ.get("FIVEFOLD_API_KEY"), metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every request but /health and /metrics "
                        "(default: $FIVEFOLD_API_KEY; none: open to whoever reaches the port)")
    p.add_argument("--config", help="TOML config file; only its [serve] table is read")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="serve.KEY=VALUE",
                   help="engine option, e.g. --set serve.kv_memory=0.3 --set serve.max_num_seqs=32 (repeatable)")
    p.set_defaults(func=run_serve)

    gen = sub.add_parser("generate", help="generate text from a checkpoint (or a Hugging Face directory)")
    gen.add_argument("source", nargs="?", metavar="CHECKPOINT",
                     help="checkpoint dir, a run dir (uses its latest), or a Hugging Face directory")
    gen.add_argument("--checkpoint", help="the same as CHECKPOINT")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", type=positive_int, default=100)
    gen.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=50, help="0 = off")
    gen.add_argument("--top-p", type=float, default=0.95, help="1.0 = off")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--tokenizer", help="tokenizer.json (default: the one saved in the checkpoint)")
    gen.add_argument("--device", default="auto")
    add_dtype(gen)
    gen.add_argument("--tp", type=positive_int, default=1, metavar="N",
                     help="tensor parallel over N processes (launched through torchrun; gloo on CPU, NCCL on GPU)")
    gen.set_defaults(func=run_generate)

    score = sub.add_parser("score", help="a text's log-likelihood and perplexity under a checkpoint, token by token "
                                         "(the serving engine's prompt logprobs)")
    score.add_argument("source", metavar="CHECKPOINT",
                       help="checkpoint dir, a run dir (uses its latest), or a Hugging Face directory")
    text = score.add_mutually_exclusive_group(required=True)
    text.add_argument("--text", help="the text to score")
    text.add_argument("--file", help="a UTF-8 text file to score")
    score.add_argument("--window", type=positive_int, metavar="N",
                       help="tokens per window, the most context a token is scored with (default: the model's)")
    score.add_argument("--stride", type=positive_int, metavar="N",
                       help="tokens between the starts of windows (default: window - 1: each token scored once "
                            "with the least overlap; smaller gives later windows more context)")
    score.add_argument("--per-token", action="store_true",
                       help="also print each token, its logprob and the likeliest token in its place")
    score.add_argument("--tokenizer", help="tokenizer.json (default: the one saved in the checkpoint)")
    score.add_argument("--device", default="auto")
    add_dtype(score)
    score.set_defaults(func=run_score)


def add_dtype(parser) -> None:
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="the weights' and KV cache's dtype (serve.dtype; default float32). bfloat16 halves the "
                             "bytes a token reads: on a CPU with AVX512_BF16 it decodes faster than float32")


SERVE_EXTRA = ("fastapi", "starlette", "uvicorn", "prometheus_client", "jinja2", "pydantic")


def run_serve(args) -> int:
    try:
        from fivefold.serve.server import serve  # FastAPI and uvicorn: the optional [serve] extra
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in SERVE_EXTRA:
            raise
        raise ConfigError(f"fivefold serve needs {e.name}, which this environment lacks: install the server's "
                          f"packages with pip install 'fivefold[serve]'") from None

    # The model comes from MODEL, so an override of anything but the engine would be silently ignored.
    other = [text for text in args.overrides if not text.strip().startswith("serve.")]
    if other:
        raise ConfigError(f"--set {other[0]!r}: fivefold serve takes only serve.* keys (the model comes from MODEL)")
    cfg = load_config(args.config, None, args.overrides).serve
    adapters = {}
    for text in args.lora:
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--lora {text!r} must look like NAME=PATH (e.g. --lora sql=runs/sql-lora)")
        if name in adapters:
            raise ConfigError(f"--lora names the adapter {name!r} twice ({adapters[name]} and {path}); give each "
                              f"adapter its own name")
        adapters[name] = path
    check_tp_serving(args.tp, cfg, adapters)  # before any process starts
    device = resolve_device(args.device, "--device")
    if args.tp > 1 and "LOCAL_RANK" not in os.environ:
        return launch(args.model, args.tp, sys.argv[1:], "serve")
    device = local_device(device)
    try:
        loaded = load_model_for_serving(args.model, args.tokenizer, cfg.dtype, device, args.tp)
    except ValueError as e:  # e.g. an architecture import_hf does not support
        return _fail(e)
    if loaded.tokenizer is None:
        return _fail(f"{args.model} has no tokenizer.json; pass --tokenizer tokenizer.json")
    engine = Engine(loaded.model, loaded.tokenizer, cfg, seed=args.seed, tp=loaded.tp, adapters=adapters)
    if loaded.tp and not loaded.tp.is_driver:
        # Ctrl-C reaches every rank; the driver's server stops first and then releases us.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        engine.follow()
        return 0
    bos_token, eos_token = special_tokens(loaded.directory)
    name = args.model_name or Path(args.model).resolve().name
    n = sum(p.numel() for p in loaded.model.parameters())
    shard = f" on each of {args.tp} tensor-parallel ranks" if loaded.tp else ""
    print(f"model: {args.model} ({n:,} parameters{shard}, {cfg.dtype}, {device})")
    print(engine.plan.describe(engine.max_model_len))
    print(engine.step_memory.describe())
    print("chat template: " + ("the model's own" if loaded.chat_template else "the default (fivefold.data.chat)"))
    for adapter in adapters:
        print(f"LoRA adapter {adapter!r} from {adapters[adapter]}: ask for model {name + ':' + adapter!r}")
    key = "an API key" if args.api_key else "no API key"
    print(f"serving {name!r} at http://{args.host}:{args.port}/v1 ({key})", flush=True)
    try:
        serve(engine, name, args.host, args.port, loaded.chat_template, bos_token=bos_token,
              eos_token=eos_token or None, api_key=args.api_key)
    finally:
        try:
            engine.release_followers()
        except RuntimeError:  # the followers were stopped already (e.g. by torchrun): nothing to release
            pass
    return 0


def _fail(error) -> int:
    print(f"fivefold serve: error: {error}", file=sys.stderr)
    return 2


def _with_tokenizer(src: Path, tokenizer: str | None) -> Path:
    """`src`, once it is known to have a tokenizer (or one is given): checked before any weights load."""
    if not tokenizer:
        found = model_directory(src) / "tokenizer.json"
        if not found.is_file():
            raise FileNotFoundError(f"no tokenizer at {found}; pass --tokenizer tokenizer.json")
    return src


def run_generate(args) -> int:
    if not args.source and not args.checkpoint:
        raise RequestError("give the checkpoint to generate from: fivefold generate RUN_OR_CHECKPOINT --prompt TEXT")
    if args.source and args.checkpoint and args.source != args.checkpoint:
        raise RequestError(f"two checkpoints given ({args.source} and --checkpoint {args.checkpoint}); give one")
    src = _with_tokenizer(Path(args.source or args.checkpoint), args.tokenizer)
    if not args.prompt:
        raise RequestError("--prompt is empty; give the text to continue")
    try:
        params = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=args.seed)
    except RequestError as e:  # name the flag, not the field
        message = str(e).removeprefix("SamplingParams: ")
        for field, flag in (("max_tokens", "--max-new-tokens"), ("temperature", "--temperature"),
                            ("top_k", "--top-k"), ("top_p", "--top-p")):
            message = message.replace(field, flag) if message.startswith(field) else message
        raise RequestError(message) from None
    resolve_device(args.device, "--device")  # before any process starts
    if args.tp > 1 and "LOCAL_RANK" not in os.environ:
        return launch(src, args.tp, sys.argv[1:], "generate")
    # One prompt: a pool for one sequence, not for a server's worth.
    llm = LLM(src, tokenizer=args.tokenizer, device=args.device, tp=args.tp, max_num_seqs=1, dtype=args.dtype)
    text = llm.generate(args.prompt, params)[0].text
    if os.environ.get("RANK", "0") == "0":
        print(args.prompt + text)
    return 0


def _stride_error(stride: int, window: int) -> RequestError:
    return RequestError(f"--stride {stride}: give 1 to {window - 1} (less than --window {window}: a window needs "
                        f"a token of context from the one before)")


def run_score(args) -> int:
    """Each token's logprob given the tokens before it, every token but the first scored once: the text in
    windows of at most `--window` tokens (default: the model's context), each starting `--stride` tokens after
    the last (default: window - 1, so each window's first token is the last one's last) and scoring the tokens
    no earlier window did. A window is one request for its prompt's logprobs and no new token."""
    src = _with_tokenizer(Path(args.source), args.tokenizer)
    text = Path(args.file).read_text(encoding="utf-8") if args.file else args.text
    if not text:
        raise RequestError(f"{args.file or '--text'} is empty; give the text to score")
    resolve_device(args.device, "--device")
    if args.window and args.stride and args.stride >= args.window:  # before any weights load
        raise _stride_error(args.stride, args.window)
    llm = LLM(src, tokenizer=args.tokenizer, device=args.device, dtype=args.dtype)
    context = llm.engine.max_model_len
    window = args.window or context
    if not 2 <= window <= context:
        raise RequestError(f"--window {window}: give 2 to {context} tokens (the model's context)")
    stride = args.stride or window - 1
    if stride >= window:
        raise _stride_error(stride, window)
    ids = llm.tokenizer.encode(text).ids
    if len(ids) < 2:
        raise RequestError(f"the text is {len(ids)} token(s) long; scoring needs at least 2 (the first has no "
                           f"logprob: nothing comes before it)")
    windows, firsts = [], []  # each window, and its first entry that scores a token no earlier window did
    start = scored = 0  # `scored`: the last token scored so far
    while scored < len(ids) - 1:
        windows.append(ids[start:start + window])
        firsts.append(scored - start)
        scored = start + len(windows[-1]) - 1
        start += stride
    outs = llm.generate(windows, SamplingParams(max_tokens=0, prompt_logprobs=1))
    entries = [e for out, first in zip(outs, firsts) for e in out.prompt_logprobs[1 + first:]]
    total = sum(e["logprob"] for e in entries)
    if args.per_token:
        decode = llm.tokenizer.decode
        print(f"{'token':>20} {'logprob':>10}  likeliest")
        for e in entries:
            best, best_lp = e["top"][0]
            print(f"{decode([e['token_id']])!r:>20} {e['logprob']:10.4f}  {decode([best])!r} ({best_lp:.4f})")
    print(f"scored {len(entries):,} of {len(ids):,} tokens in {len(windows)} window(s) of up to {window}, "
          f"{stride} apart: log-likelihood {total:.4f} nats, {total / len(entries):.4f} per token, "
          f"perplexity {math.exp(-total / len(entries)):.4f}")
    return 0
