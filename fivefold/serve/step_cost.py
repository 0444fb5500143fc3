"""What one serving step costs on given hardware: the clock of the serving simulator (fivefold.serve.simulator).

A step is a batch of decode rows and prompt chunks (fivefold.serve.scheduler). Its time is the sum of:
- the linear layers: each product takes its FLOPs at the matmul rate or its weight bytes at the memory
  bandwidth, whichever binds. A serving step's products are skinny (the batch's tokens by the weight), so
  the token dimension m runs at m / (m + skinny_knee) of the rate (a calibrated profile's [serving] table,
  fitted to skinny products on this machine);
- paged attention: the keys and values it reads (once where a kernel reads them in place: CUDA's Triton
  kernel, the CPU's C++ decode kernel; three times over where the CPU path gathers blocks then runs SDPA over
  the copy, as it does for prompt chunks, and for decodes under serve.cpu_kernel=false), or its FLOPs for
  long prompt chunks;
- the LM head at the sampled rows, sampling, and elementwise work (norms, residuals, RoPE);
- tensor parallelism's all-reduces (two per layer) and the logits' all-gather, on the profile's links;
- the engine's own host work: per step, per sequence, and per layer when the step runs eagerly (launches;
  a CUDA-graph replay has none), measured by `fivefold calibrate --serve` (`measure_serving`).

Defaults where a profile has no [serving] table are assumptions for CUDA graphs on a datacenter GPU,
until a GPU run calibrates them.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch

from fivefold.config import Config, ModelConfig, ServeConfig
from fivefold.kernels.cpu_linear_rows import offered as rows_kernel_offered
from fivefold.model import build_model
from fivefold.parallel.mesh import synchronize
from fivefold.planner.hardware import HardwareProfile
from fivefold.presets import PRESETS
from fivefold.serve.cpu_linear import serving_product
from fivefold.serve.llm import LLM
from fivefold.serve.kv_pool import DECODE_GROUP
from fivefold.serve.sampling import SamplingParams
from fivefold.serve.step_memory import cpu_kernels

# Without a [serving] table: tensor-core tiles of 64 rows; host work of a graph-replayed decode step
# (scheduling, inputs, sampling) ~0.3 ms plus ~4 us a sequence; an eager step's launches per layer.
SERVING_DEFAULTS = {"skinny_knee": 64.0, "step_s": 3e-4, "seq_s": 4e-6, "layer_s": 1.5e-4, "layer_seq_s": 0.0}


# serve.dtype -> the name a profile's tables use for it, and back to torch's dtype
SHORT_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
TORCH_DTYPES = {short: getattr(torch, name) for name, short in SHORT_DTYPES.items()}


def matmul_rate(profile: HardwareProfile, peak: float) -> float:
    """The large-product rate the skinny knee is relative to: a datasheet peak discounted by the profile's
    matmul_efficiency; a calibrated profile's measured [flops] as it stands (its efficiency, an asymptote
    fitted for the training model, may exceed 1)."""
    return peak * min(1.0, profile.matmul_efficiency)


@dataclass
class StepShape:
    """One engine step as the cost model sees it: per sequence, tokens computed now and context after."""
    tokens: np.ndarray  # (B,) int
    context: np.ndarray  # (B,) int: each sequence's length after this step
    sampled: int  # rows whose logits are sampled
    graphed: bool = False  # replayed as a CUDA graph (decode-only steps under serve.cuda_graphs)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.sum())


class StepCostModel:
    def __init__(self, cfg: Config, profile: HardwareProfile, tp: int = 1):
        m, s = cfg.model, cfg.serve
        dt = SHORT_DTYPES[s.dtype]  # the profile's name for the serving dtype
        profile = profile.for_dtype(dt)  # its matmul and attention figures in that dtype, where measured apart
        self.cfg, self.hw, self.tp = cfg, profile, tp
        self.itemsize = torch.empty((), dtype=getattr(torch, s.dtype)).element_size()
        self.peak = profile.peak_flops(dt)
        self.bandwidth = profile.memory_bandwidth * profile.memory_efficiency
        self.serving = {**SERVING_DEFAULTS, **profile.serving}
        # The engine's own linear, where calibrate --serve timed it (at 2048 x 2048 weights: the width factor
        # below taken out); else the training matmul's rate.
        timed = self.serving.get(f"linear_flops_{dt}")
        self.rate = timed / self._width(2048, 2048) if timed else matmul_rate(profile, self.peak)
        self.cpu_attention = profile.device == "cpu"  # the gather + SDPA path reads the keys and values thrice
        # ...except a CPU's decodes under serve.cpu_kernel, which read them once in place. Priced from the
        # config (a plan builds nothing): a machine that cannot build the kernel gathers, and reads thrice.
        self.cpu_decode_kernel = cpu_kernels(m, s)
        h, q, kv, f = m.hidden_size, m.q_size // tp, m.kv_size // tp, m.ffn_hidden_size // tp
        up = 2 * f if m.activation == "swiglu" else f
        # (K, N) of each block product, the fused ones as served (fivefold.serve.fused).
        self.attention_products = [(h, q + 2 * kv), (q, h)]
        self.mlp_products = [(h, up), (f, h)]
        self.kv_row_bytes = 2 * kv * self.itemsize  # one token's keys and values in one layer
        # Bytes one token's elementwise work moves in one layer, reads and writes: two RMSNorms (~6 passes of
        # h each), two residual adds (3 each), RoPE on q and k (~4 passes), attention's output brought back
        # to (tokens, heads x d) (2 of q), and the MLP's activation and product (5 passes of the FFN width).
        ffn = f if m.activation == "swiglu" else 2 * f
        self.elementwise_bytes = (18 * h + 6 * q + 4 * kv + 5 * ffn) * self.itemsize
        # The rate those bytes move at in the engine (calibrate --serve times a prefill step): a CPU's eager
        # kernels on a few threads reach well under its streaming bandwidth; without a measurement, that.
        self.elementwise_rate = self.serving.get("elementwise_bandwidth") or self.bandwidth

    def matmul(self, m: float, k: float, n: float, experts: float = 1.0) -> float:
        """A (m x k) @ (k x n) product: FLOPs at the skinny rate, or the weights' bytes, whichever binds."""
        if m <= 0:
            return 0.0
        knee = self.serving["skinny_knee"]
        compute = 2 * m * k * n / (self.rate * self._width(k, n) * m / (m + knee))
        return max(compute, experts * k * n * self.itemsize / self.bandwidth)

    def _width(self, k: float, n: float) -> float:
        """The weight's dimensions at d / (d + matmul_knee) each, as the training model prices them: a narrow
        model's products run further below the peak than a square one's."""
        knee = self.hw.matmul_knee
        return (k / (k + knee)) * (n / (n + knee))

    def mlp(self, tokens: int) -> float:
        m = self.cfg.model
        if not m.num_experts:
            return sum(self.matmul(tokens, k, n) for k, n in self.mlp_products)
        # Top-k routing: each token's k experts compute; the experts touched are read once each.
        routed = tokens * m.experts_per_token
        touched = min(m.num_experts, routed)
        scale = m.expert_size / m.ffn_hidden_size
        return sum(self.matmul(routed, k * (1 if i == 0 else scale), n * (scale if i == 0 else 1), touched)
                   for i, (k, n) in enumerate(self.mlp_products))

    def attention(self, shape: StepShape) -> float:
        """One layer's paged attention over the step's sequences."""
        m = self.cfg.model
        n, ctx = shape.tokens.astype(np.float64), shape.context.astype(np.float64)
        pairs = float((n * ctx - n * (n - 1) / 2).sum())  # (query, key) pairs, causal within a chunk
        flops = 4 * pairs * m.q_size / self.tp
        if self.cpu_attention:
            # fivefold.serve.kv_pool's CPU path: prompt chunks gather their whole blocks (the gather reads and
            # writes them, SDPA reads them again); decodes read their keys once in the C++ kernel, else they
            # gather too, in length-sorted groups of DECODE_GROUP each padded to its longest.
            bs = self.cfg.serve.block_size
            rows = 3 * float(np.ceil(ctx[n != 1] / bs).sum() * bs)
            decodes = np.sort(ctx[n == 1])
            if self.cpu_decode_kernel:
                rows += float(decodes.sum())
            else:
                groups = [decodes[i:i + DECODE_GROUP] for i in range(0, len(decodes), DECODE_GROUP)]
                rows += 3 * sum(len(g) * -(-g[-1] // bs) * bs for g in groups)
            # at the rate calibrate --serve measured them moving, where it did (not a sum's streaming rate)
            seconds = rows * self.kv_row_bytes / (self.serving.get("kv_bandwidth") or self.bandwidth)
        else:  # the kernel reads each key and value once, in place
            seconds = float(ctx.sum()) * self.kv_row_bytes / self.bandwidth
        return max(flops / (self.peak * self.hw.attention_efficiency), seconds)

    def collectives(self, tokens: int, sampled: int) -> float:
        if self.tp == 1:
            return 0.0
        m, hw, g = self.cfg.model, self.hw, self.tp
        bw, lat = hw.intra_node_bandwidth, hw.intra_node_latency
        if not bw:
            return 0.0
        reduce = 2 * (g - 1) / g * tokens * m.hidden_size * self.itemsize / bw + 2 * (g - 1) * lat
        gather = (g - 1) / g * sampled * m.vocab_size * 4 / bw + (g - 1) * lat
        return 2 * m.num_layers * reduce + gather

    def host(self, shape: StepShape) -> float:
        s, b = self.serving, len(shape.tokens)
        layers = 0.0 if shape.graphed else self.cfg.model.num_layers * (s["layer_s"] + s["layer_seq_s"] * b)
        return s["step_s"] + s["seq_s"] * b + layers

    def seconds(self, shape: StepShape) -> float:
        m = self.cfg.model
        t = shape.num_tokens
        layer = self.linears(t) + self.attention(shape)
        elementwise = self.elementwise(t)
        head = self.matmul(shape.sampled, m.hidden_size, m.vocab_size / self.tp)
        sampling = 4 * shape.sampled * m.vocab_size * 4 / self.bandwidth
        return (m.num_layers * (layer + elementwise) + head + sampling + self.collectives(t, shape.sampled)
                + self.host(shape))

    def elementwise(self, tokens: int) -> float:
        """One layer's norms, residuals, RoPE and activation over `tokens` tokens."""
        return tokens * self.elementwise_bytes / self.elementwise_rate

    def linears(self, tokens: int) -> float:
        """One layer's block products over `tokens` tokens."""
        return sum(self.matmul(tokens, k, n) for k, n in self.attention_products) + self.mlp(tokens)

    def breakdown(self, shape: StepShape) -> dict[str, float]:
        m, t = self.cfg.model, shape.num_tokens
        return {"linear": m.num_layers * self.linears(t), "attention": m.num_layers * self.attention(shape),
                "elementwise": m.num_layers * self.elementwise(t),
                "head": self.matmul(shape.sampled, m.hidden_size, m.vocab_size / self.tp),
                "collectives": self.collectives(t, shape.sampled), "host": self.host(shape)}


# ---- calibration (fivefold calibrate --serve)


def _linear_rates(device: torch.device, dtype: torch.dtype, rows_kernel: bool = False) -> tuple[float, float]:
    """(the square-product rate, the skinny knee) of the linear the engine runs (serve.linear: on a CPU the
    product chosen for this shape, with fivefold's rows kernel among the candidates where `rows_kernel`). The
    rate: m = 2048 rows; the knee: products of m rows by weights larger than any cache (as a served model's
    are), timed at m = 2, 8 and 32 (a decode tail, a small and a full batch), each giving knee = m (rate /
    measured - 1); their median."""
    k = n = 2048
    linear, layout = serving_product(device, (n, k), dtype, rows_kernel=rows_kernel)
    weights = [layout(torch.randn(n, k, device=device).to(dtype)) for _ in range(8 if device.type == "cpu" else 64)]

    def flops(m: int, reps: int = 3) -> float:
        x = torch.randn(m, k, device=device).to(dtype)
        for w in weights[:2]:
            linear(x, w)
        best = float("inf")
        for _ in range(reps):
            synchronize(device)
            start = time.perf_counter()
            for w in weights:
                linear(x, w)
            synchronize(device)
            best = min(best, time.perf_counter() - start)
        return 2 * m * k * n * len(weights) / best

    rate = flops(2048, reps=2)
    knees = [max(0.0, m * (rate / flops(m) - 1)) for m in (2, 8, 32)]
    return rate, float(np.median(knees))


def _engine_step_seconds(device: torch.device, layers: int, batch: int, steps: int = 12) -> float:
    """Median decode step of the engine on a model too small to compute anything: its host work."""
    cfg = dataclasses.replace(PRESETS["tiny"], num_layers=layers)
    llm = LLM(build_model(cfg, device, seed=0).eval(), device=str(device), max_num_seqs=max(batch, 1))
    engine = llm.engine
    for i in range(batch):
        engine.add_request([1 + i % 100] * 8, SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True))
    while engine.num_waiting or any(s.remaining > 1 for s in engine.scheduler.running):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# A prefill step of calibrate --serve: 16 prompts of 128 tokens (one full 2,048-token budget) on layers of a
# small Llama block, wider than "tiny" so its elementwise kernels move realistic amounts.
PREFILL_PROMPTS, PREFILL_LEN = 16, 128


def _prefill_model(layers: int) -> ModelConfig:
    return ModelConfig(vocab_size=512, hidden_size=512, num_layers=layers, num_heads=8, num_kv_heads=4,
                       ffn_hidden_size=1536)


def _without_products(model: torch.nn.Module) -> None:
    """Every linear of a served model answers zeros of its output's shape, so that a step's time is what is
    left: elementwise work, attention and the engine's host work. The zeros are made once per shape: a fresh
    buffer each call would time the allocator, which the real product's output pays inside its own time."""
    made: dict[tuple, torch.Tensor] = {}

    def zeros(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = (*x.shape[:-1], weight.shape[0])
        if shape not in made:
            made[shape] = x.new_zeros(shape)
        return made[shape]

    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.forward = lambda x, weight=module.weight: zeros(x, weight)
        elif hasattr(module, "linear_fn"):  # fused q/k/v and gate/up (fivefold.serve.fused)
            module.linear_fn = zeros


def _hollow_engine(device: torch.device, layers: int, dtype: str, **options):
    """An engine serving `layers` of the calibration block (`_prefill_model`) with its products taken out."""
    model = build_model(_prefill_model(layers), device, seed=0, dtype=TORCH_DTYPES[dtype]).eval()
    engine = LLM(model, device=str(device), **options).engine
    _without_products(engine.model)
    return engine


def _calibration_cost(profile: HardwareProfile, dtype: str, partial: dict, layers: int) -> StepCostModel:
    """The step-cost model of the calibration block, priced with the [serving] figures measured so far."""
    serve = ServeConfig(dtype={short: name for name, short in SHORT_DTYPES.items()}[dtype])
    return StepCostModel(Config(model=_prefill_model(layers), serve=serve), dataclasses.replace(profile, serving=partial))


def _prompt(g: torch.Generator, length: int) -> list[int]:
    return torch.randint(1, _prefill_model(1).vocab_size, (length,), generator=g).tolist()


def _engine_prefill_seconds(device: torch.device, layers: int, dtype: str, reps: int = 5) -> float:
    """Fastest of `reps` prefill steps of PREFILL_PROMPTS x PREFILL_LEN fresh tokens (no prefix-cache hits)
    with the products taken out, after one untimed."""
    engine = _hollow_engine(device, layers, dtype, max_num_seqs=PREFILL_PROMPTS,
                            max_num_batched_tokens=PREFILL_PROMPTS * PREFILL_LEN)
    g = torch.Generator().manual_seed(0)
    best = float("inf")
    for rep in range(reps + 1):
        for _ in range(PREFILL_PROMPTS):
            engine.add_request(_prompt(g, PREFILL_LEN), SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        synchronize(device)
        start = time.perf_counter()
        engine.step()
        synchronize(device)
        if rep:
            best = min(best, time.perf_counter() - start)
        while engine.num_waiting or engine.scheduler.running:
            engine.step()
    return best


# Decode steps of calibrate --serve for the CPU path's cache reads: DECODE_BATCH sequences at a short and a
# long context (whole blocks of 16), on the prefill model's layers with the products taken out.
DECODE_BATCH, DECODE_CONTEXTS = 32, (16, 496)


def _engine_decode_seconds(device: torch.device, layers: int, context: int, dtype: str, steps: int = 8,
                           cpu_kernel: str = "auto") -> tuple[float, bool]:
    """Median decode step of DECODE_BATCH sequences whose prompts are `context` tokens, products taken out;
    and whether the engine's decodes read the pool in place (serve.cpu_kernel) or gathered it."""
    # Room to decode through the prefill steps (sequences prefilled first decode while the rest prefill) and
    # the timed ones, so that every sequence is still running when they are timed.
    tokens = steps + 4 + -(-DECODE_BATCH * context // 2048)
    engine = _hollow_engine(device, layers, dtype, max_num_seqs=DECODE_BATCH, max_model_len=context + tokens + 1,
                            cpu_kernel=cpu_kernel,
                            max_num_batched_tokens=max(2048, context))
    g = torch.Generator().manual_seed(0)
    for _ in range(DECODE_BATCH):
        engine.add_request(_prompt(g, context), SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    while engine.num_waiting or any(s.remaining > 1 for s in engine.scheduler.running):
        engine.step()
    engine.step()  # the first all-decode step, untimed
    times = []
    for _ in range(steps):
        synchronize(device)
        start = time.perf_counter()
        engine.step()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), engine.cpu_kernel


def _kv_bandwidth(device: torch.device, profile: HardwareProfile, dtype: str, partial: dict,
                  cpu_kernel: str = "auto") -> float:
    """The rate the CPU path's cache reads (StepCostModel.attention: one pass in place through the C++ decode
    kernel, else three over each decode group padded to its longest) move at: decode steps at a long context
    less at a short one, per layer, over those bytes."""
    layers = 4
    (short, _), (long, in_place) = (_engine_decode_seconds(device, layers, c, dtype, cpu_kernel=cpu_kernel)
                                    for c in DECODE_CONTEXTS)
    passes = 1 if in_place else 3
    cost = _calibration_cost(profile, dtype, partial, layers)
    extra_tokens = DECODE_BATCH * (DECODE_CONTEXTS[1] - DECODE_CONTEXTS[0])
    rest = (long - short) / layers
    # Never above the streaming rate: no slower with a longer context says nothing about the reads.
    return cost.bandwidth if rest <= 0 else min(cost.bandwidth, passes * extra_tokens * cost.kv_row_bytes / rest)


def _elementwise_bandwidth(device: torch.device, profile: HardwareProfile, dtype: str, partial: dict) -> float:
    """The rate a layer's elementwise bytes (StepCostModel.elementwise_bytes) move at in the engine: a prefill
    step without its products, less the engine's host work, per layer, less what the model gives attention."""
    layers = 4
    step = _engine_prefill_seconds(device, layers, dtype)
    host = partial["step_s"] + partial["seq_s"] * PREFILL_PROMPTS
    host += layers * (partial["layer_s"] + partial["layer_seq_s"] * PREFILL_PROMPTS)
    cost = _calibration_cost(profile, dtype, partial, layers)
    tokens = PREFILL_PROMPTS * PREFILL_LEN
    shape = StepShape(np.full(PREFILL_PROMPTS, PREFILL_LEN), np.full(PREFILL_PROMPTS, PREFILL_LEN), PREFILL_PROMPTS)
    rest = (step - host) / layers - cost.attention(shape)
    # Never above the streaming rate: a step faster than its attention alone says nothing about the rest.
    return cost.bandwidth if rest <= 0 else min(cost.bandwidth, tokens * cost.elementwise_bytes / rest)


def measure_serving(device: torch.device, profile: HardwareProfile, dtype: str = "fp32",
                    cpu_kernel: str = "auto") -> dict[str, float]:
    """The [serving] table of this machine's profile: the rate of the engine's linear and its skinny knee,
    the engine's host work from decode steps of 2- and 4-layer models at batch 1 and 32, and the rate of its
    elementwise work from a prefill step of a 4-layer block (on a CPU also of its attention's cache reads, from
    decode steps at two contexts, through the decode path `cpu_kernel`, serve.cpu_kernel, chooses)."""
    torch_dtype = TORCH_DTYPES[dtype]
    rate, knee = _linear_rates(device, torch_dtype, rows_kernel_offered(cpu_kernel, device, torch_dtype))
    t = {(layers, b): _engine_step_seconds(device, layers, b) for layers in (2, 4) for b in (1, 32)}
    per_layer = {b: (t[4, b] - t[2, b]) / 2 for b in (1, 32)}
    base = {b: t[2, b] - 2 * per_layer[b] for b in (1, 32)}
    layer_seq = max(0.0, (per_layer[32] - per_layer[1]) / 31)
    seq = max(0.0, (base[32] - base[1]) / 31)
    table = {"skinny_knee": knee, f"linear_flops_{dtype}": rate, "step_s": max(0.0, base[1] - seq), "seq_s": seq,
             "layer_s": max(0.0, per_layer[1] - layer_seq), "layer_seq_s": layer_seq}
    table["elementwise_bandwidth"] = _elementwise_bandwidth(device, profile, dtype, table)
    if device.type == "cpu":  # the gather + SDPA path; the CUDA kernel reads in place at the memory's rate
        table["kv_bandwidth"] = _kv_bandwidth(device, profile, dtype, table, cpu_kernel)
    return table
