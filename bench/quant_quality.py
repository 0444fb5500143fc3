"""What post-training quantization costs a trained model: validation perplexity, KL divergence from the fp32
model's predictions and bytes of fp32, int8, int4 round-to-nearest and GPTQ int4 at group 128, 64 (when every
width allows them) and one group per row (-1, the harshest), and GPTQ's gain over RTN at the same group size.
Trains nothing.

    python bench/quant_quality.py runs/default            # the demo model `fivefold train` writes
    python bench/quant_quality.py RUN --threads 1 --json bench/results/quant_quality.json

Each row goes through `fivefold quantize`'s own code (fivefold.commands.quantize): the same calibration windows
(GPTQ: --calib-samples windows of train.seq_len from the run's training split, seeded) and the same
held-out windows (the first --eval-samples windows of the validation split) for every method.
"linear bytes" are the block linears as stored (codes + scales + zero points); "model bytes" adds every
parameter left in fp32 (embedding, LM head, norms): what model.safetensors holds, less its header.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch


def main() -> None:
    from fivefold.config import ConfigError
    from fivefold.commands.quantize import (check_group_size, format_table, fp32_row, linear_bytes_fp32, load_data,
                                         load_source, quality_row)

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run", nargs="?", default="runs/default", help="trained run directory or checkpoint")
    parser.add_argument("--calib-samples", type=int, default=128)
    parser.add_argument("--eval-samples", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads (0: torch's default); GPTQ's column loop is many small ops, "
                             "which extra threads slow down on a busy machine")
    parser.add_argument("--json", default=str(Path(__file__).parent / "results" / "quant_quality.json"))
    args = parser.parse_args()

    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    source = load_source(args.run)
    model, cfg = source.model.to(args.device), source.cfg
    data = load_data(source, None, args.calib_samples, args.eval_samples)
    others = sum(4 * p.numel() for p in model.parameters()) - linear_bytes_fp32(model)

    rows = [fp32_row(model, cfg, data, args.device)]
    rows.append(quality_row(model, cfg, "int8", 0, data, args.device)[0])
    groups = []
    for group in (128, 64, -1):  # -1: one group per row, where rounding errors are largest
        try:
            check_group_size(model, "int4", group)
        except ConfigError as e:
            print(f"group {group} left out: {e}")
            continue
        groups.append(group)
        for method in ("int4", "gptq"):
            rows.append(quality_row(model, cfg, method, group, data, args.device)[0])
    for r in rows:
        r["model_bytes"] = r["linear_bytes"] + others

    print(f"{args.run}: {cfg.model.num_layers} layers, hidden {cfg.model.hidden_size}, ffn {cfg.model.ffn_hidden_size}; "
          f"held-out: {data.held_out_info}; GPTQ calibration: {data.calibration_info['windows']} training windows")
    print(format_table(rows))
    for r in rows:
        print(f"  {r['method']:8s} group {str(r['group_size'] or '-'):>4s}: model bytes {r['model_bytes']:,d}, "
              f"quantized in {r['seconds']:.1f} s")
    gains = {}
    for group in groups:
        rtn, gptq = (next(r for r in rows if r["method"] == m and r["group_size"] == group) for m in ("int4", "gptq"))
        fp = rows[0]["perplexity"]
        gain = 100 * (rtn["perplexity"] - gptq["perplexity"]) / rtn["perplexity"]
        # The share of RTN's perplexity loss GPTQ wins back; meaningless when RTN loses nothing.
        gap = rtn["perplexity"] - fp
        closed = 100 * (rtn["perplexity"] - gptq["perplexity"]) / gap if gap > 0 else None
        gains[str(group)] = {"perplexity_gain_percent": gain, "gap_to_fp32_closed_percent": closed,
                             "kl_ratio_rtn_over_gptq": rtn["kl"] / gptq["kl"]}
        name = "per row" if group == -1 else group
        who = "GPTQ beats RTN" if gain >= 0 else "RTN beats GPTQ"
        recovered = f"{closed:.0f}% of RTN's loss to fp32 recovered" if closed is not None else \
            "RTN is no worse than fp32 here"
        print(f"group {name}: {who} by {abs(gain):.2f}% perplexity ({rtn['perplexity']:.3f} -> {gptq['perplexity']:.3f}; "
              f"{recovered}); KL to fp32 {rtn['kl']:.2e} -> {gptq['kl']:.2e} ({rtn['kl'] / gptq['kl']:.1f}x lower)")

    result = {"run": str(args.run), "model": {"layers": cfg.model.num_layers, "hidden": cfg.model.hidden_size,
                                              "ffn": cfg.model.ffn_hidden_size, "vocab": cfg.model.vocab_size},
              "held_out": data.held_out_info, "calibration": data.calibration_info, "rows": rows,
              "gptq_over_rtn": gains, "device": args.device, "torch": torch.__version__,
              "threads": torch.get_num_threads(), "machine": platform.machine(), "date": time.strftime("%Y-%m-%d")}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
