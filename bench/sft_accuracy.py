"""Exact-match accuracy of fine-tuned runs on the held-out SFT examples, next to their base.

Each run answers every held-out example of the SFT set greedily (the prompt as training encoded it: the
prompt text, or the chat rendered with the default template up to the assistant's turn), and an answer counts
when its text equals the reference completion. Also printed: each model's loss on the held-out rows of the
SFT set (completion tokens only, as the fine-tuned runs' validation loss), the base's included.

    python bench/sft_accuracy.py runs/default runs/sft-full runs/sft-lora runs/sft-qlora
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from fivefold.data.sft import DEMO_PATH, read_examples, split_examples
from fivefold.serve import LLM, SamplingParams
from fivefold.data.chat import ChatTemplate


def prompts(examples):
    template = ChatTemplate()
    for ex in examples:
        if ex.messages:
            turns = [{"role": r, "content": c} for r, c in ex.messages]
            last = max(i for i, t in enumerate(turns) if t["role"] == "assistant")
            yield template.render(turns[:last]), turns[last]["content"]
        else:
            yield ex.prompt, ex.completion


def sft_config(runs: list[Path]):
    """The config of the first run that fine-tuned on SFT data: its held-out rows are every run's yardstick."""
    from fivefold.checkpoint.store import read_config, resolve_checkpoint

    for run in runs:
        cfg = read_config(resolve_checkpoint(run))
        if cfg.data.sft:
            return cfg
    raise SystemExit("none of the runs fine-tuned on SFT data (data.sft): nothing to measure the loss on")


def held_out_loss(run: Path, cfg) -> float:
    """Mean loss over the completion tokens of the held-out rows (as training's validation loss counts it), of
    the run's model (a LoRA run merged)."""
    import torch

    from fivefold.data.load import load_datasets
    from fivefold.weights import load_model
    from fivefold.data.labels import IGNORE_INDEX
    from fivefold.train.loss import token_loss_sum

    _, model = load_model(run)
    val = load_datasets(cfg).val
    inputs, labels = val.pairs(range(len(val)))
    with torch.no_grad():
        total = token_loss_sum(model.eval(), inputs, labels, cfg).item()
    return total / int((labels != IGNORE_INDEX).sum())


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run directories (a base and its fine-tuned runs)")
    p.add_argument("--data", default=str(DEMO_PATH), help="the SFT JSONL the runs used (default: the demo set)")
    p.add_argument("--val-fraction", type=float, default=0.05)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    cfg = sft_config([Path(r) for r in args.runs])
    held_out = split_examples(read_examples(args.data), args.val_fraction)["val"]
    pairs = list(prompts(held_out))
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    rows = []
    print(f"{len(pairs)} held-out examples of {args.data}")
    print(f"{'run':28s} {'exact match':>12s} {'val loss':>9s} {'seconds':>8s}")
    for run in map(Path, args.runs):
        start = time.perf_counter()
        outputs = LLM(run, max_num_seqs=32).generate([q for q, _ in pairs], greedy)
        correct = sum(o.text.strip() == answer.strip() for o, (_, answer) in zip(outputs, pairs))
        loss = held_out_loss(run, cfg)
        rows.append({"run": str(run), "exact_match": correct / len(pairs), "correct": correct, "examples": len(pairs),
                     "val_loss": loss, "seconds": time.perf_counter() - start,
                     "samples": [{"prompt": q, "answer": a, "output": o.text} for o, (q, a) in
                                 list(zip(outputs, pairs))[:4]]})
        shown = f"{loss:.4f}" if loss is not None else "-"
        print(f"{run.name:28s} {100 * correct / len(pairs):>11.1f}% {shown:>9s} {rows[-1]['seconds']:>8.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
