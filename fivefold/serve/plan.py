"""What serving a model costs in memory, before launch: weights, the KV pool, the persistent batch's block
tables, the CUDA graphs' pool, and the largest step's working set (fivefold.serve.step_memory).

The engine sizes its pool with the same `kv_plan`, so `fivefold plan --serve` and the engine's start-up
line agree by construction; tests/test_serve_engine.py measures the process against this plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from fivefold.config import Config, ModelConfig
from fivefold.memory.formulas import count_params, parameter_shapes
from fivefold.memory.units import human_bytes
from fivefold.model.init import meta_model
from fivefold.quant.directory import read_quantization
from fivefold.serve.blocks import blocks_for
from fivefold.serve.cuda_graphs import batch_ladder
from fivefold.serve.fused import GATE_UP, QKV
from fivefold.serve.kv_pool import KVPlan, kv_plan
from fivefold.serve.step_memory import PATH_WORDS, StepMemory, forward_path, step_memory


@dataclass
class ServePlan:
    weights: int  # bytes
    kv: KVPlan
    step: StepMemory  # what a step holds at its peak beyond the above: activations, logits, the sampler's
    max_model_len: int
    free_bytes: int | None  # what a fractional serve.kv_memory was taken of
    block_tables: int = 0  # bytes of the persistent batch's device block table (int32, a row per slot)
    graphs: int = 0  # bytes of the CUDA graphs' memory pool (an estimate; start-up prints the measured one)
    tp: int = 1  # tensor-parallel ranks: the bytes are one rank's
    quantized: str = ""  # the method of the model's quantized linears, if any

    @property
    def total(self) -> int:
        return self.weights + self.kv.bytes + self.step.peak + self.block_tables + self.graphs

    def to_json(self) -> dict:
        lengths = sorted({n for n in (512, 2048, 8192) if n < self.max_model_len} | {self.max_model_len})
        return {"tp": self.tp, "quantized": self.quantized or None, "weights_bytes": self.weights, "kv_bytes": self.kv.bytes, "step_bytes": self.step.peak,
                "step": {"path": self.step.path, "forward_bytes": self.step.forward,
                         "sampling_bytes": self.step.sampling, "scoring_bytes": self.step.scoring},
                "block_table_bytes": self.block_tables, "cuda_graph_bytes": self.graphs, "total_bytes": self.total, "kv_bytes_per_token": self.kv.bytes_per_token,
                "block_size": self.kv.block_size, "num_blocks": self.kv.num_blocks, "kv_tokens": self.kv.tokens,
                "max_model_len": self.max_model_len,
                "max_sequences": {str(n): self.kv.max_sequences(n) for n in lengths}}

    def table(self) -> str:
        data = self.to_json()
        weights = f"weights ({self.quantized})" if self.quantized else "weights"
        rows = [(weights, self.weights), ("KV pool", self.kv.bytes), ("step (largest)", self.step.peak),
                ("block tables", self.block_tables)] + ([("CUDA graphs (est.)", self.graphs)] if self.graphs else []) + \
               [("total", self.total)]
        lines = [f"{name:<20}{n:>16,d}  {human_bytes(n):>10}" for name, n in rows]
        if self.tp > 1:
            lines.insert(0, f"one rank of {self.tp} (tensor parallel: its shard of the weights and of each KV block)")
        s = self.step
        weight = f" with a dequantized weight's {human_bytes(s.dequantized)}" if s.dequantized else ""
        lines.append(f"step: the {PATH_WORDS[s.path]} forward {human_bytes(s.forward)}{weight}, sampling "
                     f"{human_bytes(s.sampling)}, scoring {human_bytes(s.scoring)}: the largest counts")
        lines.append(f"KV: {self.kv.bytes_per_token:,d} bytes/token, {self.kv.num_blocks:,d} blocks of "
                     f"{self.kv.block_size} tokens = {self.kv.tokens:,d} tokens"
                     + (f" (from {human_bytes(self.free_bytes)} free)" if self.free_bytes is not None else ""))
        lines += [f"  sequences of {n} tokens at once: {k:,d}" for n, k in data["max_sequences"].items()]
        return "\n".join(lines)


def graph_pool_bytes(cfg: Config, itemsize: int) -> int:
    """The CUDA graphs' pool (fivefold.serve.cuda_graphs): the working set of the largest captured decode
    forward, which the smaller graphs' captures reuse (its logits, and the widest moment of a block: the
    MLP's gate/up output, the activated product and the residual stream around them), plus every smaller
    graph's logits, which stay allocated as its output. For the Llama-3.2-1B shape in bf16 at
    max_num_seqs=256 (35 graphs) that is 1,057 MiB; an H100's start-up measured 1,078 and 1,110 MiB
    (bench/results/gpu_serve_h100.log), where the largest graph's working set alone, the estimate before, is
    85 MiB."""
    m, n = cfg.model, cfg.serve.max_num_seqs
    largest = n * (m.vocab_size + 4 * m.ffn_hidden_size + 6 * m.hidden_size)
    smaller = (sum(batch_ladder(n)) - n) * m.vocab_size
    return (largest + smaller) * itemsize


def replays_graphs(cfg: Config, device: str, tp: int) -> bool:
    """Whether the engine replays decode steps as CUDA graphs (fivefold.serve.engine's rule, before the model is
    built): on CUDA with the Triton kernels, unless serve.cuda_graphs=false, for a dense model on one rank."""
    s = cfg.serve
    return device == "cuda" and s.cuda_graphs != "false" and s.kernels != "torch" and tp == 1 and not cfg.model.num_experts


@dataclass(frozen=True)
class QuantizedLinears:
    """What a quantized model directory holds quantized (fivefold.quant.directory): its method, its quantized
    linears' names and their stored bytes (codes, scales, zeros)."""
    method: str
    modules: tuple[str, ...]
    nbytes: int

    @classmethod
    def read(cls, directory: str | Path) -> "QuantizedLinears":
        meta = read_quantization(directory)
        return cls(meta["method"], tuple(meta["modules"]), int(meta["bytes"]["quantized"]))

    def shapes(self, m: ModelConfig) -> dict[str, tuple[int, int]]:
        """(out, in) of each quantized linear, and of the products the engine fuses them into
        (fivefold.serve.fused: q/k/v and gate/up of one block, quantized alike), by name."""
        model = meta_model(m)
        out = {name: tuple(model.get_submodule(name).weight.shape) for name in self.modules}
        for parts, fused in ((QKV, "qkv"), (GATE_UP, "gate_up")):
            parents = {n.rpartition(".")[0] for n in self.modules if n.rpartition(".")[2] == parts[0]}
            for parent in parents:
                names = [f"{parent}.{p}" for p in parts]
                if all(n in out for n in names):
                    out[f"{parent}.{fused}"] = (sum(out[n][0] for n in names), out[names[0]][1])
        return out


def plan_serving(cfg: Config, device_memory: int | None = None, free_bytes: int | None = None,
                 device: str = "cuda", quantized: QuantizedLinears | None = None) -> ServePlan:
    """One rank's plan, tensor parallel over parallel.tp ranks (`fivefold serve --tp`): its shard of the
    weights and of every KV block, its step. `free_bytes`: memory free once the weights are loaded (what a
    fractional serve.kv_memory takes a share of); by default `device_memory` less the weights. On `device`
    "cuda", decode CUDA graphs are planned unless serve.cuda_graphs=false or the model cannot be captured (a
    mixture of experts, tensor parallelism). `quantized`: the model's linears as a quantized directory holds
    them (`fivefold plan --serve --model DIR`): their stored bytes in place of theirs at full size, and each
    one's dequantizing in the step."""
    s, m, tp = cfg.serve, cfg.model, cfg.parallel.tp
    dtype = getattr(torch, s.dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    weights = (count_params(m) if tp == 1 else sum(n for _, n in parameter_shapes(m, tp=tp))) * itemsize
    shapes = quantized.shapes(m) if quantized else {}
    if quantized:
        weights += quantized.nbytes - sum(shapes[n][0] * shapes[n][1] for n in quantized.modules) * itemsize
    if free_bytes is None and device_memory is not None:
        free_bytes = device_memory - weights
    max_model_len = s.max_model_len or m.max_seq_len
    kv = kv_plan(m, s.kv_memory, s.block_size, dtype, free_bytes=free_bytes, num_blocks=s.num_blocks,
                 max_blocks=s.max_num_seqs * blocks_for(max_model_len, s.block_size), tp=tp)
    tables = s.max_num_seqs * blocks_for(max_model_len, s.block_size) * 4
    graphs = replays_graphs(cfg, device, tp)
    linears = tuple(sorted({(quantized.method, shape, itemsize) for shape in shapes.values()})) if quantized else ()
    step = step_memory(m, s, forward_path(m, s, device, tp), itemsize, tp, quantized=linears, device=device)
    return ServePlan(weights, kv, step, max_model_len, free_bytes, tables,
                     graph_pool_bytes(cfg, itemsize) if graphs else 0, tp, quantized.method if quantized else "")
