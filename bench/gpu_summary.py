"""The key figures of a GPU session's result files, printed at the end of its log (bench/gpu_serve.sh,
bench/gpu_train.sh): a file that was not written (its step failed or ran out of time) is named as such.

    python bench/gpu_summary.py serve bench/results/serve_anchors_h100.json bench/results/serve_default_h100.json
    python bench/gpu_summary.py train bench/results/train_throughput_1b_h100.json ...
"""

from __future__ import annotations

import json
import os
import sys


def serve_lines(d: dict) -> list[str]:
    """bench/serve.py's JSON: throughput against transformers, step-time spread, batch-1 decode, the
    profiled decode step and the targets."""
    out = []
    ours = d.get("fivefold")
    if ours:
        steps = ours["step_times"]
        out.append(f"fivefold {ours['output_tokens_per_s']:,.0f} output tok/s in {ours['wall_s']:.1f} s; step max / "
                   f"median {steps['max_over_median']:.2f} (median {1e3 * steps['median_s']:.1f} ms, "
                   f"{steps['steps']} steps)")
    for r in d.get("transformers") or []:
        out.append(f"transformers bs={r['batch_size']}: {r['output_tokens_per_s']:,.0f} output tok/s")
    if d.get("ratio_vs_transformers_best"):
        out.append(f"fivefold / transformers best: {d['ratio_vs_transformers_best']:.2f}x")
    decode = d.get("decode_batch1") or {}
    if "fivefold" in decode and "bandwidth_roofline_fraction" in decode["fivefold"]:
        out.append(f"batch-1 decode {decode['fivefold']['best']:.0f} tok/s = "
                   f"{100 * decode['fivefold']['bandwidth_roofline_fraction']:.0f}% of the memory-bandwidth roofline")
    for key in ("profile", "profile_batch1"):
        profile = d.get(key) or {}
        if profile.get("wall_over_kernel"):
            m = profile["median"]
            out.append(f"decode step at batch {profile['batch']}: wall / kernel time "
                       f"{profile['wall_over_kernel']:.2f} "
                       f"({1e3 * profile['step_wall_s']:.2f} / {1e3 * m['kernel_s']:.2f} ms); per step "
                       f"{m['kernel_launches']:g} launches, {m['graph_launches']:g} graph launches, "
                       f"{m['copies']:g} copies, {m['syncs']:g} syncs")
        elif profile.get("failed"):
            out.append(f"{key.replace('_', ' ')} failed: {profile['failed']}")
    decode_best = (decode.get("fivefold") or {}).get("best")
    for title in ("quantized", "paths"):
        for name, v in (d.get(title) or {}).items():
            ratio = f" ({v['output_tokens_per_s'] / ours['output_tokens_per_s']:.2f}x)" if ours else ""
            batch1 = f" ({v['decode_batch1']['best'] / decode_best:.2f}x)" if decode_best else ""
            out.append(f"{name}: {v['output_tokens_per_s']:,.0f} output tok/s{ratio}, batch-1 decode "
                       f"{v['decode_batch1']['best']:.0f} tok/s{batch1}; {v['engine_path']}")
    for key, t in (d.get("targets") or {}).items():
        shown = "not measured" if t["met"] is None else ("met" if t["met"] else "NOT met")
        value = "-" if t["value"] is None else f"{t['value']:,.2f}"
        out.append(f"target {key} {t['op']} {t['target']:g}: {value} {shown}")
    return out


def train_lines(d: dict) -> list[str]:
    """bench/train_throughput.py's JSON: each row's shape, tokens/s and MFU, its ratio to HF (or fp8's to our
    bf16), the planner's speed and memory errors, and each profiled step's wall and kernel time."""
    s = d["settings"]
    out = [f"{s['preset']}, seq {s['seq_len']}, {s['tokens_per_step']:,} tokens a step"]
    bf16 = {r["compiled"]: r for r in d["results"] if r["precision"] == "bf16" and r["impl"] == "ours"}
    for r in d["results"]:
        line = (f"{r['precision']} {r['impl']}{'+compile' if r['compiled'] else ''} (micro-batch "
                f"{r['micro_batch_size']} x {r['grad_accum']}, recompute {r['recompute']}): "
                f"{r['tokens_per_s']:,.0f} tok/s, MFU {100 * r['mfu']:.1f}%")
        if r.get("ratio_vs_hf") is not None and r["impl"] == "ours":
            line += f", {r['ratio_vs_hf']:.2f}x HF"
        if r["impl"] in ("ours-separate", "ours-waiting"):  # --fused-projections / --waits both: ours against it
            ours = next(x for x in d["results"] if x["impl"] == "ours" and x["precision"] == r["precision"]
                        and x["compiled"] == r["compiled"])
            what = "fused {:.3f}x separate" if r["impl"] == "ours-separate" else "reading once {:.3f}x waiting"
            line += ", " + what.format(ours["tokens_per_s"] / r["tokens_per_s"])
        if r["precision"] == "fp8" and r["compiled"] in bf16:
            line += f", {r['tokens_per_s'] / bf16[r['compiled']]['tokens_per_s']:.2f}x our bf16"
        if "predicted_error" in r:
            line += f"; planner speed {100 * r['predicted_error']:+.1f}%"
        if "peak_error" in r:
            line += f", memory {100 * r['peak_error']:+.1f}%"
        out.append(line)
    for name, p in d.get("profiles_bf16", {}).items():  # --profile: where a step's time goes
        kernels = f", kernels {1e3 * p['kernel_s']:.1f} ms in {p['kernels']} launches" if "kernel_s" in p else ""
        precision = "fp8" if name.endswith("fp8") else "bf16"
        out.append(f"profiled {precision} step, {name}: wall {1e3 * p['wall_s']:.1f} ms{kernels}")
        if "kernel_kinds_s" in p:  # measured by kernel name, with the planner's price beside where it made one
            predicted = p.get("predicted_kinds_s", {})
            out.append("  by kind: " + ", ".join(
                f"{kind} {1e3 * v:.1f}" + (f" (planned {1e3 * predicted[kind]:.1f})" if kind in predicted else "")
                for kind, v in p["kernel_kinds_s"].items()) + " ms")
    return out


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or argv[0] not in ("serve", "train"):
        raise SystemExit("usage: gpu_summary.py serve|train FILE.json ...")
    lines = serve_lines if argv[0] == "serve" else train_lines
    for path in argv[1:]:
        if not os.path.exists(path):
            print(f"  {path}: not written")
            continue
        with open(path) as f:
            d = json.load(f)
        stage = f" (stage reached: {d['stage']})" if "stage" in d else ""
        print(f"  {path}{stage}")
        for line in lines(d):
            print(f"    {line}")


if __name__ == "__main__":
    main()
