"""The serving engine: requests in, one batched forward per step, tokens out.

`Engine` owns the KV pool, the block manager and the scheduler, and runs the same `Transformer` that
trains, with a `PagedBatch` as the forward context's cache. `LLM` (fivefold.serve.llm) is the offline
front: a list of prompts in, their outputs back in order.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np
import torch

from fivefold.config import Config, ConfigError, ServeConfig
from fivefold.config_checks import validate_serve
from fivefold.kernels import apply_kernels, check_usable, triton_available
from fivefold.kernels.cpu_linear_rows import offered as rows_kernel_offered
from fivefold.kernels.cpu_paged_decode import kernel_problem, pairs, unsupported
from fivefold.kernels.paged_attention import warm_up
from fivefold.memory.units import human_bytes
from fivefold.model import ForwardContext, Transformer
from fivefold.model.moe import MoE
from fivefold.quant.cpu_gemv import ROWS_READ_FROM_CODES, gemv_problem
from fivefold.quant.linear import QuantLinear, warm_up_codes_products
from fivefold.serve.adapters import AdapterSet, load_adapter, take_model
from fivefold.serve.batch import InputBatch, StepInputs
from fivefold.serve.blocks import BlockManager, blocks_for
from fivefold.serve.buffers import StepBuffers
from fivefold.serve.compiled_decode import use_compiled_decode
from fivefold.serve.cpu_linear import candidates, is_input_major, onednn_problem, route_linears
from fivefold.serve.cuda_graphs import DecodeGraphs
from fivefold.serve.fused import FusedAttention, fuse_projections
from fivefold.serve.huge_pages import huge_pages_available, move_to_huge_pages
from fivefold.serve.kv_pool import KERNEL_CHUNK_CONTEXT, KVPlan, KVPool, PagedBatch, available_memory, kv_plan
from fivefold.serve.lean_forward import use_lean_forward
from fivefold.serve.sampling import RequestError, SampledTokens, SamplingParams, launch_sampling, score_rows
from fivefold.serve.scheduler import Scheduler, Sequence
from fivefold.serve.plan import graph_pool_bytes
from fivefold.serve.step_memory import StepMemory, quantized_shapes, step_memory


# A sequence's last token while it is still being sampled on the device (asynchronous scheduling): never
# fed to the model (the forward reads the real token from the device) nor seen outside the engine.
PLACEHOLDER = -1


@dataclass
class Pending:
    """A launched draw whose tokens have not reached the host: the sequences, one row each."""
    seqs: list[Sequence]
    sampled: SampledTokens

    @property
    def tokens(self) -> torch.Tensor:
        return self.sampled.tokens


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    logprobs: list[dict] | None  # per output token: token_id, logprob, top [(token_id, logprob), ...]
    finish_reason: str | None  # "stop", "length", "abort"; None while running
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    ttft: float | None  # seconds from arrival to the first output token
    tpot: float | None  # seconds per output token after the first
    # With SamplingParams.prompt_logprobs: per prompt token (None for the first), as `logprobs`' entries plus
    # "rank" (1 + the tokens the model found likelier there)
    prompt_logprobs: list[dict | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def serve_config(options: Mapping) -> ServeConfig:
    """ServeConfig from keyword options, validated; unknown names are an error that lists the valid ones."""
    names = {f.name for f in fields(ServeConfig)}
    unknown = sorted(set(options) - names)
    if unknown:
        raise ConfigError(f"unknown engine option(s) {', '.join(unknown)}; valid: {', '.join(sorted(names))}")
    cfg = Config(serve=replace(ServeConfig(), **options))
    validate_serve(cfg)
    return cfg.serve


def check_tp_serving(tp: int, cfg: ServeConfig, adapters) -> None:
    """What tensor-parallel serving over `tp` ranks cannot do: refused before any process starts (the launcher
    and LLM ask first) and again by each rank's engine."""
    if tp > 1 and adapters:
        raise ConfigError("LoRA adapters are served with tp=1 (each rank would need its slices of them)")
    if tp > 1 and cfg.async_scheduling == "true":
        raise ConfigError("serve.async_scheduling=true cannot be used with tensor parallelism; set it to auto")


class Engine:
    """`tp`: this rank's tensor-parallel group (fivefold.serve.sharded) when the model is a shard;
    rank 0 then drives (schedules, samples, broadcasts each batch) and the others `follow()`."""

    def __init__(self, model: Transformer, tokenizer=None, serve: ServeConfig | None = None, seed: int = 0,
                 tp=None, adapters: Mapping[str, str | Path] | None = None):
        """`adapters`: {name: a LoRA run, checkpoint or PEFT directory} served beside the base
        (fivefold.serve.adapters); a request names one with add_request(..., adapter=name)."""
        check_tp_serving(tp.size if tp else 1, serve or ServeConfig(), adapters)
        self.model, self.tokenizer = model.eval(), tokenizer
        self.adapters = None
        take_model(model, self, adapters=bool(adapters))
        if adapters:
            self.adapters = AdapterSet(model)
            for name, source in adapters.items():
                self.adapters.check_name(name)
                self.adapters.add(load_adapter(name, source, model.cfg))
        for module in model.modules():
            if isinstance(module, MoE):  # dropping tokens would make an output depend on its batch companions
                module.capacity_factor = 0.0
        self.cfg = serve or ServeConfig()
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        mc = model.cfg
        self.eos_id = mc.eos_token_id
        self.max_model_len = self.cfg.max_model_len or mc.max_seq_len
        if mc.position == "learned" and self.max_model_len > mc.max_seq_len:
            raise ConfigError(f"serve.max_model_len={self.max_model_len} exceeds the learned positions of "
                              f"model.max_seq_len={mc.max_seq_len}")
        self.tp = tp
        self.residuals_fused = False
        self.kernel = self._use_kernels()
        # One GEMM for q/k/v and one for gate/up (checkpoint names unchanged); adapters hook the separate
        # projections, so an engine serving LoRA keeps them apart. Before the KV pool is sized: the fused
        # weights' concatenation and the CPU layout timing hold memory only until they are done.
        self.fused = 0 if self.adapters else fuse_projections(model)
        self.linears = self._route_linears()
        # The torch path's blocks as one loop of tensor ops (fivefold.serve.lean_forward), bit for bit the modules'.
        self.lean = not self.kernel and self.cfg.fuse_launches and use_lean_forward(model)
        self.compiled_decode = self._compile_decode()
        self.cpu_kernel = self._use_cpu_kernel()
        self.huge_pages = self._use_huge_pages()
        shards = tp.size if tp else 1
        free = available_memory(self.device)
        self.plan: KVPlan = kv_plan(mc, self.cfg.kv_memory, self.cfg.block_size, self.dtype,
                                    free_bytes=free, num_blocks=self.cfg.num_blocks,
                                    max_blocks=self.cfg.max_num_seqs * blocks_for(self.max_model_len, self.cfg.block_size),
                                    tp=shards)
        if tp:
            self.plan.num_blocks = tp.agree_on_blocks(self.plan.num_blocks)
        if self.plan.num_blocks < 1:
            raise ConfigError(f"serve.kv_memory={self.cfg.kv_memory} leaves no room for one KV block of "
                              f"{self.cfg.block_size} tokens ({self.plan.bytes_per_token * self.cfg.block_size:,} "
                              f"bytes); raise serve.kv_memory")
        path = "triton" if self.kernel else ("lean-cpp" if self.block_ops else "lean") if self.lean else "modules"
        self.step_memory: StepMemory = step_memory(mc, self.cfg, path, self.dtype.itemsize, tp=shards,
                                                   quantized=quantized_shapes(self.model), device=self.device.type,
                                                   dtype=str(self.dtype).removeprefix("torch."))
        graphs = 0 if self.cfg.cuda_graphs == "false" or self._graphs_obstacle() else \
            graph_pool_bytes(Config(model=mc, serve=self.cfg), self.dtype.itemsize)
        self._check_room(free, graphs)
        self.pool = KVPool(mc, self.plan, self.device, self.dtype, tp=shards, huge_pages=self.huge_pages)
        self.blocks = BlockManager(self.plan.num_blocks, self.cfg.block_size, self.cfg.prefix_cache)
        self.batch = InputBatch(self.cfg.max_num_seqs, self.max_model_len, self.cfg.block_size)
        self.scheduler = Scheduler(self.blocks, self.cfg.max_num_seqs, self.cfg.max_num_batched_tokens, self.batch,
                                   self.cfg.max_scored_tokens)
        self.buffers = StepBuffers(max(self.cfg.max_num_batched_tokens, self.cfg.max_num_seqs), self.cfg.max_num_seqs,
                                   self.cfg.max_num_seqs, self.batch.max_blocks_per_seq, self.device)
        self._warm_up_kernels()
        self._warm_up_quantized()
        self.graphs = self._graphs()
        # serve.async_scheduling: the next step is scheduled and launched before this one's tokens are on
        # the host. Pays only where the device runs apart from the host (CUDA); tensor-parallel followers
        # would need the driver's device tokens, so tp serves synchronously.
        choice = self.cfg.async_scheduling
        self.async_scheduling = choice == "true" or (choice == "auto" and self.device.type == "cuda" and not tp)
        self.pending: Pending | None = None
        self.undelivered: list[Sequence] = []
        self.requests: dict[str, Sequence] = {}
        self.seeds = torch.Generator().manual_seed(seed)  # for requests without a seed of their own
        self.ids = itertools.count()
        self.arrivals = itertools.count()
        # A step holds `lock` for its whole forward; new requests only take `inbox_lock` (briefly) and wait
        # in the inbox for the next step, so a client arriving mid-step is not held up by it.
        self.lock = threading.RLock()
        self.inbox: deque[Sequence] = deque()
        self.inbox_lock = threading.Lock()
        self.stats = {"steps": 0, "prompt_tokens": 0, "generation_tokens": 0, "finished": 0, "aborted": 0}

    def _check_room(self, free: int, graphs: int = 0) -> None:
        """Refuse a pool that leaves less than a step's working set (fivefold.serve.step_memory) and the CUDA
        graphs' pool (`graphs` bytes, fivefold.serve.plan.graph_pool_bytes; captured after the KV pool) of what
        was free: the capture or the first full prefill or scoring step would run out of memory instead."""
        need, left = self.step_memory.peak + graphs, free - self.plan.bytes
        if left >= need:
            return
        s = self.step_memory
        fraction = (free - need) / free if free > need else 0
        raise ConfigError(
            f"the KV pool ({human_bytes(self.plan.bytes)}, serve.kv_memory={self.cfg.kv_memory}) leaves "
            f"{human_bytes(max(left, 0))} of the {human_bytes(free)} free, and a step needs up to "
            f"{human_bytes(s.peak)} (the forward {human_bytes(s.forward)}, sampling {human_bytes(s.sampling)}, "
            f"scoring {human_bytes(s.scoring)})" + (f" beside {human_bytes(graphs)} of CUDA graphs" if graphs else "")
            + f": lower serve.kv_memory (below {fraction:.3f} of free memory) or serve.max_num_batched_tokens / "
            f"max_num_seqs / max_scored_tokens" + (" (or serve.cuda_graphs=false)" if graphs else ""))

    def _use_kernels(self) -> bool:
        """serve.kernels: whether attention runs the Triton paged kernel (and the model the Triton RMSNorm,
        RoPE and SwiGLU), or gathers blocks for SDPA."""
        choice = self.cfg.kernels
        if choice == "auto":
            choice = "triton" if self.device.type == "cuda" and triton_available() else "torch"
        if choice == "torch":
            return False
        check_usable("serve.kernels")
        apply_kernels(self.model, "triton")
        if self.cfg.fuse_launches and not self.tp:  # a tensor-parallel model's blocks carry its collectives' hooks
            from fivefold.serve.residual import fuse_residuals  # imports triton: only once it is known to work

            self.residuals_fused = fuse_residuals(self.model)
        return True

    def _warm_up_kernels(self) -> None:
        """On a GPU, compile every variant of the paged-attention kernels now (fivefold.kernels.paged_attention
        .warm_up), not at the step that first needs one: a compile there would stall every running request."""
        if not (self.kernel and self.device.type == "cuda"):
            return
        start = time.perf_counter()
        launched = warm_up(*self.pool.blocks(0), self.model.cfg.num_heads // (self.tp.size if self.tp else 1))
        torch.cuda.synchronize(self.device)
        print(f"paged attention: {len(launched)} kernel variants compiled in {time.perf_counter() - start:.1f} s",
              flush=True)

    def _warm_up_quantized(self) -> None:
        """On a CPU, compile the quantized linears' codes-reading products (fivefold.quant.cpu_gemv) now, not at
        the first decode step, which would stall every running request."""
        if self.device.type != "cpu":
            return
        calls, seconds = warm_up_codes_products(self.model)
        if calls:
            why = gemv_problem()
            done = "compiled" if why is None else f"not compiled ({why})"
            print(f"quantized products reading the codes: {done} in {seconds:.1f} s", flush=True)

    def _route_linears(self) -> Counter:
        """serve.linear: on a CPU, each linear's product chosen for its shape (fivefold.serve.cpu_linear), after
        the projections are fused; how many products each library runs (none: F.linear as the model has it)."""
        mode = self.cfg.linear
        if mode == "torch":
            return Counter()
        why = "the device is not a CPU" if self.device.type != "cpu" else \
            None if candidates(mode, False) else "this torch has no oneDNN"
        if mode == "onednn" and not why:
            why = onednn_problem(self.dtype)
        if mode == "onednn" and why:
            raise ConfigError(f"serve.linear=onednn cannot be used here: {why}; set serve.linear=auto or torch")
        # serve.cpu_kernel: fivefold's rows kernel (fivefold.kernels.cpu_linear_rows) among the candidates
        rows_kernel = rows_kernel_offered(self.cfg.cpu_kernel, self.device, self.dtype)
        return Counter() if why else route_linears(self.model, mode, rows_kernel=rows_kernel)

    def _use_huge_pages(self) -> bool:
        """serve.huge_pages: whether the weights (moved here, once) and the KV pool live in transparent huge
        pages (a CPU whose kernel offers them)."""
        choice = self.cfg.huge_pages
        why_not = ("the device is not a CPU" if self.device.type != "cpu" else
                   "this kernel does not offer transparent huge pages" if not huge_pages_available() else None)
        if choice == "true" and why_not:
            raise ConfigError(f"serve.huge_pages=true cannot be used here: {why_not}; "
                              f"set serve.huge_pages=auto or false")
        if choice == "false" or why_not:
            return False
        start = time.perf_counter()
        moved = move_to_huge_pages(self.model)
        if moved > 2**30:  # a large model's copy is start-up time worth saying where it goes
            print(f"weights moved into huge pages: {moved / 2**30:.2f} GiB in {time.perf_counter() - start:.1f} s",
                  flush=True)
        return True

    def _compile_decode(self) -> bool:
        """serve.compile_decode: the lean loop's decode steps as one inductor graph."""
        if not self.lean:
            if self.cfg.compile_decode:
                why = ("the engine runs the Triton kernels" if self.kernel else
                       "serve.fuse_launches=false runs the modules" if not self.cfg.fuse_launches else
                       "the lean loop does not reproduce this model (adapters, GPT-2, MoE or unfused projections)")
                raise ConfigError(f"serve.compile_decode=true compiles the CPU path's loop over the blocks, which "
                                  f"this engine does not run: {why}; set serve.compile_decode=false")
            return False
        return use_compiled_decode(self.model, self.cfg.compile_decode)

    def _use_cpu_kernel(self) -> bool:
        """serve.cpu_kernel: whether the CPU path's decodes attend through the C++ kernel reading the pool in
        place (fivefold.kernels.cpu_paged_decode), building it here on this machine's first use."""
        choice = self.cfg.cpu_kernel
        if choice == "false":
            return False
        why_not = ("the device is not a CPU" if self.device.type != "cpu" else
                   "serve.kernels runs the Triton kernels" if self.kernel else
                   unsupported(self.model.cfg.head_size, self.dtype))
        build_failed = why_not is None and kernel_problem()  # built only for an engine that would use it
        why_not = why_not or build_failed
        if why_not and choice == "true":
            raise ConfigError(f"serve.cpu_kernel=true cannot be used here: {why_not}; "
                              f"set serve.cpu_kernel=auto or false")
        if build_failed:
            print(f"CPU paged-decode kernel not used ({why_not}): decodes gather their blocks for SDPA",
                  file=sys.stderr, flush=True)
        return not why_not

    def _graphs_obstacle(self) -> str | None:
        """Why decode steps cannot replay CUDA graphs here, or None."""
        return ("the device is not CUDA" if self.device.type != "cuda" else
                "serve.kernels is torch (block gathers depend on the host)" if not self.kernel else
                "LoRA adapters are served" if self.adapters else
                "tensor parallelism (its collectives run through the host)" if self.tp else
                "a mixture-of-experts model (its dispatch has data-dependent shapes)"
                if any(isinstance(m, MoE) for m in self.model.modules()) else None)

    def _graphs(self) -> DecodeGraphs | None:
        """serve.cuda_graphs: decode steps replay CUDA graphs where the device and the model allow."""
        why_not = self._graphs_obstacle()
        if self.cfg.cuda_graphs == "false" or (self.cfg.cuda_graphs == "auto" and why_not):
            return None
        if why_not:
            raise ConfigError(f"serve.cuda_graphs=true cannot be used here: {why_not}; set serve.cuda_graphs=auto "
                              f"(graphs where possible) or false")
        graphs = DecodeGraphs(self.model, self.pool, self.buffers, self.cfg.max_num_seqs, self.kernel,
                              fused_launches=self.cfg.fuse_launches)
        print(graphs.describe(), flush=True)
        return graphs

    @property
    def block_ops(self) -> bool:
        """Whether the lean loop's norms and SwiGLU run as C++ calls (fivefold.kernels.cpu_block_ops): under
        serve.cpu_kernel, in float32 or bfloat16 (the dtypes its kernels take)."""
        return self.cpu_kernel and self.lean

    @property
    def path(self) -> str:
        """Which path each kind of step takes, in words (bench/serve.py prints and stores it)."""
        attention = "block gather + SDPA"
        if self.cpu_kernel:
            attention = (f"decodes by the C++ paged kernel reading the pool in place, and prompt chunks' tokens as rows "
                         f"of it up to {KERNEL_CHUNK_CONTEXT} tokens of context, longer chunks by block gather + SDPA")
            if self.dtype == torch.bfloat16:
                attention += (" (bfloat16 keys scored as bfloat16 pairs: AVX512_BF16)" if pairs() else
                              " (bfloat16 widened to float32 as read)")
        if self.kernel:
            rotary = sum(isinstance(m, FusedAttention) and m.use_rope for m in self.model.modules())
            rotary = rotary if self.cfg.fuse_launches else 0
            attention = (f"Triton paged attention, RoPE in the KV store's launch in {rotary} layers, residual adds "
                         f"in the next RMSNorm's: {'yes' if self.residuals_fused else 'no'}")
        elif self.lean:
            attention += ", blocks as one loop of tensor ops"
            if self.block_ops:  # fivefold.kernels.cpu_block_ops
                attention += (" with its norms and a decode step's RoPE, KV store and attention as C++ calls, all"
                              " blocks as one where C++ can run their products (the rows kernel, F.linear's)")
        decode = ("CUDA graphs" if self.graphs else "one inductor graph on steps of one attention group, else eager"
                  if self.compiled_decode else "eager")
        scheduling = "asynchronous" if self.async_scheduling else "synchronous"
        linears = "torch (F.linear)"
        if self.linears:
            blocks = [p for n, p in self.model.named_parameters() if n.startswith("layers.") and p.dim() == 2]
            laid = sum(is_input_major(p) for p in blocks)
            libraries = ", ".join(f"{name} {n}" for name, n in sorted(self.linears.items()))
            linears = f"per shape, the faster product on this CPU: {libraries}; {laid} of {len(blocks)} block " \
                      f"weights input-major"
        if self.huge_pages:
            linears += "; weights and KV pool in huge pages"
        quantized = sum(isinstance(m, QuantLinear) for m in self.model.modules())
        if quantized:
            rows = "/".join(f"{n} ({m})" for m, n in ROWS_READ_FROM_CODES.items())
            read = f"up to {rows} rows read from the codes by compiled products, more dequantized" \
                if self.device.type == "cpu" and gemv_problem() is None else "dequantized per product"
            linears += f"; {quantized} quantized linears ({read})"
        return (f"attention: {attention}; decode steps: {decode}; scheduling: {scheduling}; fused q/k/v and "
                f"gate/up: {self.fused} modules; linears: {linears}")

    # ---- requests

    def encode(self, prompt: str | list[int]) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this engine has no tokenizer: pass prompts as lists of token ids")
            return self.tokenizer.encode(prompt).ids, prompt
        ids = list(prompt)
        if not all(isinstance(t, int) and 0 <= t < self.model.cfg.vocab_size for t in ids):
            raise RequestError(f"prompt token ids must be integers in [0, {self.model.cfg.vocab_size})")
        return ids, None

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, adapter: str | None = None) -> str:
        """Queue a request (with LoRA adapter `adapter`, or the base); raises RequestError at once when it
        could never be served."""
        params = params or SamplingParams()
        if adapter is not None and (self.adapters is None or adapter not in self.adapters.adapters):
            known = ", ".join(self.adapters.adapters) if self.adapters else "none"
            raise RequestError(f"no LoRA adapter named {adapter!r} is loaded (loaded: {known})")
        ids, text = self.encode(prompt)
        if not ids:
            raise RequestError("the prompt is empty: it needs at least one token")
        total = len(ids) + params.max_tokens
        if total > self.max_model_len:
            raise RequestError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds the "
                               f"model's context of {self.max_model_len} tokens; shorten the prompt or lower max_tokens")
        if blocks_for(total, self.cfg.block_size) > self.plan.num_blocks:
            raise RequestError(f"prompt + max_tokens = {total} tokens needs {blocks_for(total, self.cfg.block_size)} "
                               f"KV blocks but the pool holds {self.plan.num_blocks}; raise serve.kv_memory")
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer; use stop_token_ids")
        if params.prompt_logprobs is not None and not self.cfg.max_scored_tokens:
            raise RequestError("this engine scores no prompts (serve.max_scored_tokens=0): ask without prompt_logprobs "
                               "(and echo with logprobs), or serve with serve.max_scored_tokens > 0")
        vocab = self.model.cfg.vocab_size
        if any(t >= vocab for t in params.logit_bias):
            raise RequestError(f"logit_bias names token {max(params.logit_bias)}; the vocabulary has ids "
                               f"0..{vocab - 1}")
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, (), generator=self.seeds))
        with self.inbox_lock:
            request_id = request_id or f"req-{next(self.ids)}"
            if request_id in self.requests:
                raise RequestError(f"request id {request_id!r} is already in use")
            generator = torch.Generator().manual_seed(seed)
            # Every uniform the request will draw its tokens with, drawn now from its own generator: its
            # i-th token uses the i-th, whatever shares its batch, however often it is preempted.
            uniforms = torch.rand(params.max_tokens, generator=generator).numpy()
            seq = Sequence(request_id, ids, params, generator, next(self.arrivals), text, uniforms=uniforms,
                           adapter=adapter, cache_salt=self.adapters.adapters[adapter].salt if adapter else b"")
            self.requests[request_id] = seq
            self.inbox.append(seq)
        return request_id

    def _take_inbox(self) -> None:
        with self.inbox_lock:
            while self.inbox:
                self.scheduler.add(self.inbox.popleft())

    def abort(self, request_id: str) -> None:
        """Stop a request (e.g. its client went away) and free its blocks; unknown or finished ids are ignored."""
        with self.lock:
            self._take_inbox()
            seq = self.requests.pop(request_id, None)
            if seq is not None and not seq.finished:
                if seq.pending:  # its token still being sampled is dropped with it
                    seq.pending = False
                    seq.output_ids.pop()
                    seq.token_ids.pop()
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
                self.stats["aborted"] += 1

    def has_unfinished(self) -> bool:
        return bool(self.inbox) or self.scheduler.has_work() or self.pending is not None or bool(self.undelivered)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.inbox) + len(self.scheduler.waiting)

    # ---- one step

    @torch.inference_mode()
    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """One forward over the scheduled tokens; the outputs of the requests that got a token (or finished);
        `finished_only`: of those that finished (an output copies the tokens so far: offline generation
        needs only the last).

        Under asynchronous scheduling the step's tokens are returned by the next call: the forward is
        launched first, and while the device runs it the host takes in the previous step's tokens
        (stop conditions, outputs, the prefix cache), then launches this step's sampling and returns. A
        sequence still being sampled is scheduled as if it continues, its input read from the device; if
        its token then ends it, the row computed for it is dropped."""
        with self.lock:
            self._take_inbox()
            work = self.scheduler.schedule()
            launched = None
            if work:
                work.sort(key=lambda e: e[1] != 1)  # single tokens first: they attend as one batch
                step = self.batch.prepare(work)
                if self.tp:
                    self.tp.broadcast(("forward", step))
                if self.adapters is not None:
                    self.adapters.select([s.adapter for s, n in work for _ in range(n)])
                logits = self._forward(step, self.pending.tokens if self.pending else None)
                if step.scored_targets is not None:
                    logits = self._score_prompts(work, step, logits)
                for s, n in work:
                    s.num_computed += n
                self.stats["steps"] += 1
                self.stats["prompt_tokens"] += step.num_tokens - len(step.sampled)  # fed, but not sampled from
                launched = (work, step, logits)
            # The previous step's tokens (none when scheduling synchronously), as outputs before any of
            # these sequences gets its next placeholder.
            outputs = self._outputs(self._take_pending(), finished_only)
            if launched:
                work, step, logits = launched
                for s, n in work:
                    if not s.finished:
                        self.blocks.register(s)  # its tokens are all known now
                self._launch_sampling(work, step, logits)
            if not self.async_scheduling:
                outputs += self._outputs(self._take_pending(), finished_only)
            return outputs

    def _outputs(self, seqs: list[Sequence], finished_only: bool) -> list[RequestOutput]:
        return [self.output(s) for s in seqs if s.finished or not finished_only]

    def _score_prompts(self, work, step: StepInputs, logits: torch.Tensor) -> torch.Tensor:
        """The logprobs of the prompt tokens this step scores, into their sequences (waited for: scoring is an
        evaluation path, it does not overlap with the next step); the sampled rows' logits."""
        n = len(step.sampled)
        owners = step.scored_owners
        if len(owners):
            asked = np.fromiter((work[i][0].params.prompt_logprobs for i in owners), dtype=np.int64,
                                count=len(owners))
            chosen, ranks, top_ids, top_lps = score_rows(logits[n:], step.scored_targets, int(asked.max()),
                                                         max(1, self.cfg.max_num_seqs // 4))
            for row, (i, target) in enumerate(zip(owners.tolist(), step.scored_targets.tolist())):
                k = int(asked[row])
                work[i][0].prompt_logprobs.append({"token_id": target, "logprob": float(chosen[row]),
                                                   "rank": int(ranks[row]),
                                                   "top": list(zip(top_ids[row, :k].tolist(),
                                                                   top_lps[row, :k].tolist()))})
        # A copy, not a view: the scored rows' logits (up to serve.max_scored_tokens x the vocabulary) are freed
        # before the sampling's own working set is allocated (fivefold.serve.plan counts them apart).
        return logits[:n].clone()

    def _launch_sampling(self, work, step: StepInputs, logits: torch.Tensor) -> None:
        """Sample the step's last tokens of the sequences still running (a token taken in since the forward
        may have ended some); each gets a placeholder until the tokens reach the host. A request for no
        tokens (max_tokens 0: its prompt computed, and scored if asked) finishes here instead."""
        seqs = [work[i][0] for i in step.sampled]
        if self.batch.no_tokens[step.slots[step.sampled]].any():  # a step without one pays one numpy test
            for seq in seqs:
                if seq.params.max_tokens == 0 and not seq.finished:
                    self._finish(seq, "length", time.perf_counter())
                    self.undelivered.append(seq)
        keep = [i for i, s in enumerate(seqs) if not s.finished]
        if not keep:
            return
        if len(keep) < len(seqs):
            seqs = [seqs[i] for i in keep]
            logits = logits[torch.tensor(keep, device=logits.device)]
        sampled = launch_sampling(logits, self.batch.sampling_params(seqs), seqs, self.eos_id)
        for row, seq in enumerate(seqs):
            seq.append(PLACEHOLDER)
            seq.pending, seq.pending_row = True, row
        self.pending = Pending(seqs, sampled)

    def _take_pending(self) -> list[Sequence]:
        """The pending draw's tokens into their sequences (stop conditions, finishing); the sequences."""
        pending, self.pending = self.pending, None
        if pending is None:
            return self._take_undelivered()
        tokens, entries = pending.sampled.result()
        now = time.perf_counter()
        taken = []
        for seq, token, entry in zip(pending.seqs, tokens, entries):
            if not seq.pending:  # aborted meanwhile
                continue
            seq.pending = False
            seq.output_ids[-1] = seq.token_ids[-1] = token
            self._accept(seq, token, entry, now)
            taken.append(seq)
        self.stats["generation_tokens"] += len(taken)
        return taken + self._take_undelivered()

    def _take_undelivered(self) -> list[Sequence]:
        out, self.undelivered = self.undelivered, []
        return out

    def _drain(self) -> None:
        """Take in the pending draw now (before the running sequences are rearranged); its outputs are
        returned by the next step."""
        if self.pending is not None:
            pending = self._take_pending()
            self.undelivered.extend(pending)

    def _forward(self, step: StepInputs, pending: torch.Tensor | None = None) -> torch.Tensor:
        """The model over one flattened batch; the logits (full vocabulary) of the sampled rows, then of the
        scored ones (fivefold.serve.batch.StepInputs.logits_indices). `pending`:
        the previous step's tokens on the device, which the step's placeholder rows take as input."""
        if (self.graphs is not None and step.decode_only and step.scored_targets is None
                and self.graphs.size_for(step.num_seqs)):
            logits = self.graphs.run(step, pending)
            return logits if len(step.sampled) == step.num_seqs else logits[torch.from_numpy(step.sampled).to(self.device)]
        dev = self.buffers.upload(step, pending=pending)
        batch = PagedBatch(self.pool, dev, step, kernel=self.kernel, fused_launches=self.cfg.fuse_launches,
                           cpu_kernel=self.cpu_kernel)
        ctx = ForwardContext(positions=batch.positions, kv_cache=batch, mask=batch, logits_at=dev.logits_indices)
        logits = self.model(dev.input_ids[None], ctx)
        return self.tp.gather_logits(logits) if self.tp else logits

    @torch.inference_mode()
    def follow(self):
        """A tensor-parallel follower: run the driver's forwards until it releases us; returns what the
        driver passed to `release_followers` (or raises its error)."""
        while True:
            command, *payload = self.tp.broadcast()
            if command == "forward":
                self._forward(*payload)
            elif command == "error":
                raise RequestError(payload[0]) if payload[1] else RuntimeError(payload[0])
            else:
                return payload[0]

    def release_followers(self, result=None, error: Exception | None = None) -> None:
        """The driver's end of a `follow()`: its result, or its error, on every rank."""
        if self.tp and self.tp.is_driver:
            if error is None:
                self.tp.broadcast(("done", result))
            else:
                self.tp.broadcast(("error", str(error), isinstance(error, RequestError)))

    def _accept(self, seq: Sequence, token: int, entry: dict | None, now: float) -> None:
        """A new last token of `seq` (already in its lists): its logprobs, and whether it ends the request."""
        if seq.first_token_time is None:
            seq.first_token_time = now
        if entry is not None:
            seq.logprobs.append(entry)
        p = seq.params
        early = len(seq.output_ids) < p.min_tokens  # no end yet: the sampler banned the ending tokens
        if not early and ((token == self.eos_id and not p.ignore_eos) or token in p.stop_token_ids):
            seq.finish_reason = "stop"
        elif p.stop:
            before = len(seq.text)
            self.detokenize(seq)
            # A new match ends in the new text or at the last character before it (which a split multi-byte
            # character may have changed), unless that character came before min_tokens: none is looked for
            # there, and none may end there.
            back = 0 if len(seq.output_ids) <= p.min_tokens else 1
            hits = [] if early else [i for i in (seq.text.find(s, max(0, before - len(s) + 1 - back)) for s in p.stop)
                                     if i >= 0]
            if hits:
                seq.text = seq.text[:min(hits)]
                seq.finish_reason = "stop"
        if seq.finish_reason is None and len(seq.output_ids) >= p.max_tokens:
            seq.finish_reason = "length"
        if seq.finished:
            self._finish(seq, seq.finish_reason, now, detokenize=not p.stop or seq.finish_reason != "stop")

    def _finish(self, seq: Sequence, reason: str, now: float, detokenize: bool = True) -> None:
        seq.finish_reason, seq.finish_time = reason, now
        self.scheduler.finish(seq)
        self.requests.pop(seq.request_id, None)
        self.stats["finished"] += 1
        if detokenize:
            self.detokenize(seq)

    def detokenize(self, seq: Sequence) -> str:
        """The output as text (a stop token is not part of it); also kept on the sequence."""
        if self.tokenizer is not None:
            ids = seq.output_ids
            if ids and seq.finish_reason == "stop" and (ids[-1] == self.eos_id or ids[-1] in seq.params.stop_token_ids):
                ids = ids[:-1]
            seq.text = self.tokenizer.decode(ids)
        return seq.text

    def output(self, seq: Sequence) -> RequestOutput:
        n = len(seq.output_ids)
        ttft = seq.first_token_time - seq.arrival_time if seq.first_token_time is not None else None
        tpot = ((seq.finish_time - seq.first_token_time) / (n - 1)) if seq.finish_time and n > 1 else None
        return RequestOutput(seq.request_id, seq.prompt, seq.prompt_ids, seq.text, list(seq.output_ids),
                             list(seq.logprobs) if seq.params.logprobs is not None else None,
                             seq.finish_reason, seq.num_cached, ttft, tpot,
                             list(seq.prompt_logprobs) if seq.params.prompt_logprobs is not None else None)

    # ---- weights

    @torch.no_grad()
    def update_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """New values for some or all parameters (fivefold names, whole tensors), between steps. Queued
        requests stay; running ones are recomputed under the new weights, and the prefix cache is forgotten.
        A tensor-parallel engine is updated on every rank with the same whole tensors (as generate is called
        on every rank); each rank copies in its own part of them."""
        params = dict(self.model.named_parameters())
        unknown = sorted(set(weights) - set(params))
        if unknown:
            raise ValueError(f"update_weights: no parameter named {unknown[:5]}")
        placements = self.tp.placements if self.tp else {}
        for name, value in weights.items():
            whole = placements[name].global_shape if name in placements else tuple(params[name].shape)
            if tuple(value.shape) != whole:
                raise ValueError(f"update_weights: {name} has shape {tuple(value.shape)}, the model's is {whole}")
        with self.lock:
            self._drain()  # the tokens being sampled were drawn under the old weights: take them in first
            for name, value in weights.items():
                params[name].copy_(placements[name].local(value) if name in placements else value)
            self.scheduler.preempt_all()
            self.blocks.reset_prefix_cache()
