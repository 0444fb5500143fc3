"""The planned == measured memory table of docs/memory.md, measured again: every layout the memory tests
check, each through `fivefold memory --synthetic --steps 2 --json` (two processes under torchrun where the
row says so; rank 0 reports), printed as one markdown table of plan errors, (planned - measured) / measured.

    python bench/memory_table.py                          # every row (~10 min on 2 vCPUs)
    python bench/memory_table.py --rows tiny,zero --json bench/results/memory_table_cpu.json

A cell with one figure holds for every variant of its row; otherwise the variants' figures in the row's
order, joined by " / ". The tests (tests/test_memory_measured.py and the parity files' measured-memory
tests) hold the same layouts to their tolerances; this prints where each one stands today.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from machine import base_info, write_results

SMALL = ("train.seq_len=128", "train.micro_batch_size=2")
HEADS = ("model.num_heads=8", "model.num_kv_heads=4")  # whole heads for tp=2, still GQA
RECOMPUTE = ("none", "selective", "ops", "full")


def modes(*fixed: str) -> list[tuple[str, ...]]:
    return [(*fixed, f"train.recompute={mode}") for mode in RECOMPUTE]


# (key, label, preset, processes, variants); every variant starts from SMALL unless it sets the keys again
ROWS = [
    ("tiny", "tiny fp32 sdpa, none / selective / ops / full", "tiny", 1, modes("train.precision=fp32")),
    ("tiny", "tiny fp32 eager, none / selective / ops / full", "tiny", 1,
     modes("train.precision=fp32", "model.attention=eager")),
    ("tiny", "tiny bf16 sdpa, none / selective / ops / full", "tiny", 1, modes("train.precision=bf16-mixed")),
    ("tiny", "tiny bf16 eager, none / selective / ops / full", "tiny", 1,
     modes("train.precision=bf16-mixed", "model.attention=eager")),
    ("tiny", "tiny-gpt2 (LayerNorm, GELU, tied, biases): bf16 eager / selective eager / bf16 ops", "tiny-gpt2", 1,
     [("train.precision=bf16-mixed", "model.attention=eager"),
      ("train.recompute=selective", "model.attention=eager"),
      ("train.recompute=ops", "train.precision=bf16-mixed")]),
    ("tiny", "h=128, 4 layers, bf16, fp32 grad accum, grad_accum 2, selective eager", "tiny", 1,
     [("model.hidden_size=128", "model.num_layers=4", "model.ffn_hidden_size=384", "train.precision=bf16-mixed",
       "train.fp32_grad_accum=true", "train.grad_accum=2", "train.recompute=selective", "model.attention=eager")]),
    ("tiny", "tiny with document mask, sdpa / eager", "tiny", 1,
     [("model.document_mask=true",), ("model.document_mask=true", "model.attention=eager")]),
    ("fused", "tiny, fused q/k/v and gate/up: fp32 / bf16 eager / selective / bf16 full / LoRA q, v / 16 tokens h=128",
     "tiny", 1,
     [("train.fused_projections=true", *extra) for extra in [
         (), ("train.precision=bf16-mixed", "model.attention=eager"), ("train.recompute=selective",),
         ("train.recompute=full", "train.precision=bf16-mixed"), ("lora.r=8", "lora.targets=q,v"),
         ("train.seq_len=16", "model.hidden_size=128", "model.ffn_hidden_size=512")]]),
    ("moe", "tiny-moe: none / ops / full + capacity 1.25 / bf16 ops + shared expert 96 / selective eager + shared "
     "expert / LoRA q, v with ops", "tiny-moe", 1,
     [("train.recompute=none",), ("train.recompute=ops",), ("train.recompute=full", "model.capacity_factor=1.25"),
      ("train.precision=bf16-mixed", "train.recompute=ops", "model.shared_expert_size=96"),
      ("model.shared_expert_size=96", "model.moe_ffn_hidden_size=96", "model.attention=eager",
       "train.recompute=selective"),
      ("lora.r=8", "lora.targets=q,v", "train.recompute=ops")]),
    ("lora", "tiny LoRA r=8: all / q, v bf16 / dropout + full / r=4 dropout selective eager accum 2 / QLoRA int4 / "
     "QLoRA bf16 full / every target with ops", "tiny", 1,
     [("lora.r=8",), ("lora.r=8", "lora.targets=q,v", "train.precision=bf16-mixed"),
      ("lora.r=8", "lora.dropout=0.1", "train.recompute=full"),
      ("lora.r=4", "lora.dropout=0.1", "train.recompute=selective", "model.attention=eager", "train.grad_accum=2"),
      ("lora.r=8", "lora.quantize_base=int4", "lora.group_size=32"),
      ("lora.r=8", "lora.quantize_base=int4", "train.precision=bf16-mixed", "train.recompute=full"),
      ("lora.r=8", "lora.dropout=0.1", "lora.targets=q,k,v,o,gate,up,down", "train.recompute=ops")]),
    ("loss", "tiny chunked loss: 64 / 48 bf16 full / 100 bf16 eager selective / 1000 accum 2 / 64 LoRA", "tiny", 1,
     [("train.loss_chunk=64",), ("train.loss_chunk=48", "train.precision=bf16-mixed", "train.recompute=full"),
      ("train.loss_chunk=100", "train.precision=bf16-mixed", "model.attention=eager", "train.recompute=selective"),
      ("train.loss_chunk=1000", "train.grad_accum=2"), ("train.loss_chunk=64", "lora.r=8")]),
    ("tp", "tiny tp=2 (heads 8/4): fp32 / + SP / full / full + SP / ops / ops + SP (2 processes, rank 0)", "tiny", 2,
     [(*HEADS, "parallel.tp=2", f"parallel.sequence_parallel={sp}", f"train.recompute={mode}")
      for mode in ("none", "full", "ops") for sp in ("false", "true")]),
    ("tp", "tiny tp=2 + SP, chunked loss 64 (2 processes, rank 0)", "tiny", 2,
     [(*HEADS, "parallel.tp=2", "parallel.sequence_parallel=true", "train.loss_chunk=64")]),
    ("moe", "tiny-moe tp=2 + SP, shared expert 96 / dp=2 x ep=2, full, bf16 (2 processes, rank 0)", "tiny-moe", 2,
     [("parallel.tp=2", "parallel.sequence_parallel=true", "model.shared_expert_size=96"),
      ("parallel.dp=2", "parallel.ep=2", "train.recompute=full", "train.precision=bf16-mixed")]),
    ("zero", "tiny dp=2, seq 64: ZeRO-1 bf16 fp32 accum 2 / ZeRO-2 accum 2 small buckets / ZeRO-3 bf16 / ZeRO-2 / "
     "ZeRO-3 accum 2 full / ZeRO-3 fp8 / ZeRO-3 fp8 cast at use (2 processes, rank 0)", "tiny", 2,
     [("train.seq_len=64", *extra) for extra in [
         ("parallel.zero=1", "train.precision=bf16-mixed", "train.fp32_grad_accum=true", "train.grad_accum=2"),
         ("parallel.zero=2", "train.grad_accum=2", "parallel.bucket_mb=0.05"),
         ("parallel.zero=3", "train.precision=bf16-mixed"), ("parallel.zero=2",),
         ("parallel.zero=3", "train.grad_accum=2", "train.recompute=full"),
         ("parallel.zero=3", "train.precision=fp8"),
         ("parallel.zero=3", "train.precision=fp8", "train.fp8_weight_cast=use")]]),
    ("zero", "tiny dp=2, seq 16, micro-batch 1, full: DDP accum 2 / DDP bf16 small buckets / ZeRO-1 / ZeRO-1 bf16 "
     "accum 2 / ZeRO-2 / ZeRO-2 small buckets accum 2 (2 processes, rank 0)", "tiny", 2,
     [("train.seq_len=16", "train.micro_batch_size=1", "train.recompute=full", "parallel.dp=2", *extra) for extra in [
         ("parallel.zero=0", "train.grad_accum=2"),
         ("parallel.zero=0", "train.precision=bf16-mixed", "parallel.bucket_mb=0.05"),
         ("parallel.zero=1",), ("parallel.zero=1", "train.precision=bf16-mixed", "train.grad_accum=2"),
         ("parallel.zero=2",), ("parallel.zero=2", "parallel.bucket_mb=0.05", "train.grad_accum=2")]]),
    ("pp", "tiny 4 layers, seq 64, pp=2, 4 micro-batches: 1F1B / AFAB / interleaved / zero-bubble (2 processes, "
     "stage 0)", "tiny", 2,
     [("model.num_layers=4", "train.seq_len=64", "train.grad_accum=4", "parallel.pp=2",
       f"parallel.pp_schedule={schedule}") for schedule in ("1f1b", "afab", "interleaved", "zero-bubble")]),
    ("cp", "tiny cp=2: ZeRO-1 bf16 / fp32 seq 512 causal / packed documents (2 processes, rank 0)", "tiny", 2,
     [("parallel.cp=2", "parallel.zero=1", "train.precision=bf16-mixed"),
      ("parallel.cp=2", "train.seq_len=512", "model.document_mask=false"),
      ("parallel.cp=2", "train.seq_len=512", "model.document_mask=true")]),
]
COLUMNS = ("parameters", "gradients", "optimizer_states", "activations", "temporary", "total")


def measure(preset: str, nproc: int, overrides: tuple[str, ...]) -> dict:
    """Rank 0's rows (category -> {predicted, measured, error}) of `fivefold memory`."""
    cmd = [sys.executable, "-m", "fivefold", "memory", "--preset", preset, "--synthetic", "--steps", "2", "--json"]
    if nproc > 1:
        cmd += ["--nproc", str(nproc)]
    for override in (*SMALL, *overrides):
        cmd += ["--set", override]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1"} if nproc > 1 else None)
    if proc.returncode != 0:
        raise SystemExit(f"fivefold memory failed for {preset} {overrides}:\n{proc.stderr[-3000:]}")
    return {row["category"]: row for row in json.loads(proc.stdout.strip().splitlines()[-1])["comparison"]}


def cell(results: list[dict], category: str) -> str:
    figures = [f"{100 * r[category]['error']:+.3f}%" if category in r else "" for r in results]
    figures = [f.replace("+0.000%", "0.000%").replace("-0.000%", "0.000%") for f in figures]
    return figures[0] if len(set(figures)) == 1 else " / ".join(figures)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", help="comma-separated row keys: " + ", ".join(dict.fromkeys(r[0] for r in ROWS)))
    parser.add_argument("--json", help="also write every variant's rows here")
    args = parser.parse_args(argv)
    keys = set(args.rows.split(",")) if args.rows else None
    unknown = (keys or set()) - {r[0] for r in ROWS}
    if unknown:
        parser.error(f"unknown row keys {sorted(unknown)}; choose among {sorted({r[0] for r in ROWS})}")
    print("| config | parameters | gradients | optimizer states | activations | temporary | total |")
    print("|---|---|---|---|---|---|---|")
    kept, start = [], time.perf_counter()
    for key, label, preset, nproc, variants in ROWS:
        if keys and key not in keys:
            continue
        results = [measure(preset, nproc, v) for v in variants]
        print(f"| {label} | " + " | ".join(cell(results, c) for c in COLUMNS) + " |", flush=True)
        kept.append({"label": label, "preset": preset, "nproc": nproc,
                     "variants": [{"overrides": [*SMALL, *v], "rows": r} for v, r in zip(variants, results)]})
    print(f"({len(kept)} rows, {sum(len(r['variants']) for r in kept)} runs in {time.perf_counter() - start:.0f} s; "
          "error = (planned - measured) / measured, rank 0's peaks over 2 steps)", file=sys.stderr)
    if args.json:
        write_results(args.json, {**base_info(), "date": time.strftime("%Y-%m-%d"), "rows": kept})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
