"""The chunked fused LM head + loss (train.loss_chunk) against the plain head at Llama-3's vocabulary.

Three runs of the same small model (hidden 256, 2 layers, seq_len 2048, micro-batch 2: 4,096 tokens a step)
are measured op by op with fivefold's memory tracker (fivefold.memory.tracker, two training steps each):
  * plain:   vocabulary 128,256, the full logits, their fp32 copy and log-probabilities;
  * chunked: vocabulary 128,256, train.loss_chunk tokens at a time;
  * base:    vocabulary 256: the same blocks with next to no head, so what the plain and chunked runs hold
             above it is their head + loss (the "logits memory").
Activations and temporaries are what a step holds beside the model states; the logits memory of a run is
its peak of (activations + temporaries) minus the base run's. The planner's prediction is printed beside
each measurement. Then both sides train a few steps in turn (random tokens, as for the memory) and their
median step times give the price of the recomputed head matmul. fp32 by default (bf16 matmuls are
emulated on most CPUs); on a GPU pass --precision bf16-mixed.

    OMP_NUM_THREADS=2 python bench/chunked_loss.py [--chunk 256] [--steps 4] [--no-memory]
                                                   [--json bench/results/chunked_loss.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from fivefold.config_load import load_config
from fivefold.memory.plan import plan_memory
from fivefold.memory.tracker import measure_memory, random_datasets

VOCAB = 128_256  # Llama 3


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunk", type=int, default=256, help="train.loss_chunk of the chunked side")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=2, help="micro-batch size")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16-mixed"])
    p.add_argument("--steps", type=int, default=4, help="timed training steps per side (0: memory only)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-memory", action="store_true", help="only the step times")
    p.add_argument("--json", default="", help="write the numbers here")
    return p.parse_args(argv)


def config(args, vocab: int, chunk: int, out_dir: str):
    overrides = {"model.vocab_size": vocab, "model.hidden_size": args.hidden, "model.num_layers": 2,
                 "model.num_heads": 4, "model.num_kv_heads": 4, "model.ffn_hidden_size": 4 * args.hidden,
                 "model.max_seq_len": args.seq_len, "train.seq_len": args.seq_len,
                 "train.micro_batch_size": args.batch, "train.precision": args.precision,
                 "train.loss_chunk": chunk, "train.device": args.device, "train.peak_flops": 1e11,
                 "train.progress": False, "train.tensorboard": False, "train.eval_every": 0,
                 "train.out_dir": out_dir}
    return load_config(preset="tiny", overrides=[f"{k}={v}" for k, v in overrides.items()])


def measure(cfg) -> dict:
    peaks = measure_memory(cfg, steps=2, datasets=random_datasets(cfg))  # step 2: Adam states exist
    plan = plan_memory(cfg, device=cfg.train.device, suggest=False).stages[0].memory
    series = [sum(row[3:5]) for row in peaks.samples]  # activations + temporary, op by op
    return {"activations": peaks.peaks["activations"], "temporary": peaks.peaks["temporary"],
            "beside_states": max(series), "total": peaks.peaks["total"],
            "planned": {k: plan[k] for k in ("activations", "temporary", "total")}}


def step_times(cfgs: dict, steps: int) -> dict:
    """Median seconds per step, the sides taking turns one step at a time."""
    from fivefold.train.trainer import Trainer

    trainers = {name: Trainer(cfg, quiet=True, datasets=random_datasets(cfg)) for name, cfg in cfgs.items()}
    times = {name: [] for name in cfgs}
    for i in range(steps + 1):
        for name, trainer in trainers.items():
            start = time.perf_counter()
            trainer.fit(until=trainer.step + 1)
            if i:  # the first step warms up
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        cfgs = {"plain": config(args, VOCAB, 0, f"{tmp}/plain"),
                "chunked": config(args, VOCAB, args.chunk, f"{tmp}/chunked")}
        tokens = args.seq_len * args.batch
        result = {"tokens": tokens, "vocab": VOCAB, "chunk": args.chunk, "precision": args.precision}
        if not args.no_memory:
            result.update(memory(args, cfgs, tmp))
        if args.steps:
            times = step_times(cfgs, args.steps)
            ratio = times["chunked"] / times["plain"]
            print(f"step time: plain {times['plain']:.2f}s, chunked {times['chunked']:.2f}s (chunked / plain = "
                  f"{ratio:.2f}x), median of {args.steps}")
            result["step_seconds"] = times
            result["step_time_ratio"] = ratio
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


def memory(args, cfgs: dict, tmp: str) -> dict:
    """Measure the three runs and print the table."""
    gb, tokens = 1e9, args.seq_len * args.batch
    runs = {name: measure(cfg) for name, cfg in cfgs.items()}
    runs["base"] = measure(config(args, 256, 0, f"{tmp}/base"))
    print(f"{tokens:,} tokens x vocabulary {VOCAB:,}, {args.precision}, chunk {args.chunk}; one fp32 copy of the "
          f"logits is {tokens * VOCAB * 4 / gb:.2f} GB")
    print(f"{'run':<8} {'activations':>12} {'(planned)':>10} {'temporary':>10} {'act+temp':>9} {'logits mem':>10} "
          f"{'total':>8} {'(planned)':>10}")
    for name, r in runs.items():
        r["logits_memory"] = r["beside_states"] - runs["base"]["beside_states"]
        print(f"{name:<8} {r['activations'] / gb:>10.3f}GB {r['planned']['activations'] / gb:>8.3f}GB "
              f"{r['temporary'] / gb:>8.3f}GB {r['beside_states'] / gb:>7.3f}GB {r['logits_memory'] / gb:>8.3f}GB "
              f"{r['total'] / gb:>6.3f}GB {r['planned']['total'] / gb:>8.3f}GB")
    cut = 1 - runs["chunked"]["logits_memory"] / runs["plain"]["logits_memory"]
    act_cut = 1 - runs["chunked"]["activations"] / runs["plain"]["activations"]
    print(f"logits memory cut by {100 * cut:.1f}%; activation peak cut by {100 * act_cut:.1f}%")
    return {"runs": runs, "logits_memory_cut": cut, "activation_peak_cut": act_cut}

if __name__ == "__main__":
    main()
