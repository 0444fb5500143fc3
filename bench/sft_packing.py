"""Supervised fine-tuning on the demo set: packed rows against one example per padded row.

Both sides train the default model (5.2M parameters, seq_len 256, micro-batch 8, fp32, CPU) from the same
seeded init on `data.sft=demo`, with the embedded corpus's tokenizer:
  * pack: several examples per row, model.document_mask=true (each example attends only to itself);
  * pad:  one example per row, no document mask (causal attention already keeps padding out of the example).
A step costs the same whatever the rows hold, so what packing changes is how many of a step's labels are
target tokens (the ones the loss counts). The sides take turns one step at a time, so bursts of outside
load hit both; the table gives the median step time, tokens/s over every position, target tokens/s, and
the padding fraction of the rows (fivefold.data.sft.SFTStats).

    OMP_NUM_THREADS=1 python bench/sft_packing.py --steps 12 [--json bench/results/sft_packing.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from fivefold.config_load import load_config
from fivefold.data.labels import IGNORE_INDEX
from fivefold.train.trainer import Trainer

SIDES = {"pack": {"data.sft_packing": "pack", "model.document_mask": True},
         "pad": {"data.sft_packing": "pad", "model.document_mask": False}}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12, help="timed steps per side")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per side first")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8, help="micro-batch size (rows per step)")
    p.add_argument("--cache", default="", help="data.cache_dir (default: $FIVEFOLD_CACHE or ~/.cache/fivefold)")
    p.add_argument("--json", default="", help="write the numbers here")
    return p.parse_args(argv)


class Side:
    """One trainer, and the target tokens of every global batch it draws."""

    def __init__(self, name: str, args, out_dir: str):
        overrides = {"data.sft": "demo", "train.seq_len": args.seq_len, "train.micro_batch_size": args.batch,
                     "train.peak_flops": 1e11, "train.progress": False, "train.tensorboard": False,
                     "train.out_dir": f"{out_dir}/{name}", **SIDES[name]}
        if args.cache:
            overrides["data.cache_dir"] = args.cache
        self.trainer = Trainer(load_config(overrides=[f"{k}={v}" for k, v in overrides.items()]), quiet=True)
        self.name, self.targets, self.times = name, [], []
        draw = self.trainer.global_batch

        def counting(accum):
            inputs, labels = draw(accum)
            self.targets.append(int((labels != IGNORE_INDEX).sum()))
            return inputs, labels
        self.trainer.global_batch = counting

    def step(self, timed: bool) -> None:
        start = time.perf_counter()
        self.trainer.train_step()
        if timed:
            self.times.append(time.perf_counter() - start)
        else:
            self.targets.pop()

    def result(self) -> dict:
        stats = self.trainer.data.train.stats
        step_tokens = self.trainer.cfg.global_batch_tokens
        total = sum(self.times)
        return {"side": self.name, "median_step_s": statistics.median(self.times),
                "tokens_per_s": step_tokens * len(self.times) / total, "target_tokens_per_s": sum(self.targets) / total,
                "targets_per_step": sum(self.targets) / len(self.targets), "padding_fraction": stats.padding_fraction,
                "rows": stats.rows, "examples": stats.examples, "target_tokens": stats.target_tokens}


def main(argv=None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as out_dir:
        sides = [Side(name, args, out_dir) for name in SIDES]
        for side in sides:
            print(side.trainer.data.train.summary)
        for i in range(args.warmup + args.steps):
            for side in sides:
                side.step(timed=i >= args.warmup)
        results = [side.result() for side in sides]
    print(f"{'side':>5} {'step s':>8} {'tok/s':>8} {'target tok/s':>13} {'targets/step':>13} {'padding':>8} "
          f"{'rows':>6}")
    for r in results:
        print(f"{r['side']:>5} {r['median_step_s']:8.3f} {r['tokens_per_s']:8.0f} {r['target_tokens_per_s']:13.0f} "
              f"{r['targets_per_step']:13.1f} {r['padding_fraction']:8.1%} {r['rows']:6d}")
    ratio = results[0]["target_tokens_per_s"] / results[1]["target_tokens_per_s"]
    print(f"pack / pad target tokens per second: {ratio:.2f}x ({torch.get_num_threads()} threads, "
          f"{args.steps} timed steps each)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "threads": torch.get_num_threads(), "results": results,
                       "ratio": ratio}, f, indent=2)


if __name__ == "__main__":
    main()
