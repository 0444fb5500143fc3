#!/usr/bin/env bash
# One GPU session for the serving benchmark (bench/README.md, serve.py): run from anywhere in the repo on a
# machine with torch + CUDA + triton + transformers installed and no internet. At most ~9 minutes: every
# step has its own time limit, a failing or timed-out step does not stop the next, and a summary ends
# the output. bench/serve.py writes its JSON after each stage, so a run cut short keeps what it measured.
#
#   bash bench/gpu_serve.sh               # PYTHON=/path/to/python to choose the interpreter;
#                                         # COPY_TO=DIR also copies the results and the log there
#
# Writes bench/results/serve_anchors_<gpu>.json, serve_default_<gpu>.json and gpu_serve_<gpu>.log, where
# <gpu> is a slug of the GPU's name (h100, h200, a100, ...).

source "$(dirname "$0")/gpu_common.sh"
MODEL=llama3.2-1b   # Llama-3.2-1B's shape, random weights (fivefold.presets)
gpu_setup gpu_serve

# (a) the paged-attention and engine tests. test_paged_attention.py runs its Triton kernels in the
#     interpreter when it is the first to import triton, so the CUDA-only tests (CUDA-graph decode,
#     test_serve_fast_path.py) run in a second process, where triton compiles for the GPU.
pytest_step "tests" 90 tests/test_paged_attention.py tests/test_serve_engine.py
pytest_step "cuda-tests" 45 tests/test_serve_fast_path.py
# (b) the anchor workload: 256 requests, prompts and outputs uniform 100..1024, against transformers
#     static batches of 256, 128 and 64; per-step times, batch-1 decode, and the profiled batch-256 decode step
step "anchors" 255 "$PY" bench/serve.py --device cuda --model "$MODEL" --workload anchors --profile \
    --json "bench/results/serve_anchors_$gpu.json"
# (c) the default workload (the CPU results' request set: 32 requests, log-uniform outputs 16..256)
step "default" 90 "$PY" bench/serve.py --device cuda --model "$MODEL" \
    --json "bench/results/serve_default_$gpu.json"
step "serve-predict" 75 "$PY" bench/serve_predict.py --device cuda --model "$MODEL" \
    --json "bench/results/serve_predict_$gpu.json"

print_steps
"$PY" - "bench/results/serve_anchors_$gpu.json" "bench/results/serve_default_$gpu.json" <<'EOF'
import json, os, sys

for path in sys.argv[1:]:
    if not os.path.exists(path):
        print(f"  {path}: not written")
        continue
    with open(path) as f:
        d = json.load(f)
    print(f"  {path} (stage reached: {d.get('stage')})")
    ours = d.get("fivefold")
    if ours:
        steps = ours["step_times"]
        print(f"    fivefold {ours['output_tokens_per_s']:,.0f} output tok/s in {ours['wall_s']:.1f} s; step max / median "
              f"{steps['max_over_median']:.2f} (median {1e3 * steps['median_s']:.1f} ms, {steps['steps']} steps)")
    for r in d.get("transformers") or []:
        print(f"    transformers bs={r['batch_size']}: {r['output_tokens_per_s']:,.0f} output tok/s")
    if d.get("ratio_vs_transformers_best"):
        print(f"    fivefold / transformers best: {d['ratio_vs_transformers_best']:.2f}x")
    decode = d.get("decode_batch1") or {}
    if "fivefold" in decode and "bandwidth_roofline_fraction" in decode["fivefold"]:
        print(f"    batch-1 decode {decode['fivefold']['best']:.0f} tok/s = "
              f"{100 * decode['fivefold']['bandwidth_roofline_fraction']:.0f}% of the HBM roofline")
    profile = d.get("profile") or {}
    if profile.get("wall_over_kernel"):
        m = profile["median"]
        print(f"    decode step at batch {profile['batch']}: wall / kernel time {profile['wall_over_kernel']:.2f} "
              f"({1e3 * profile['step_wall_s']:.2f} / {1e3 * m['kernel_s']:.2f} ms); per step {m['kernel_launches']:g} "
              f"launches, {m['graph_launches']:g} graph launches, {m['copies']:g} copies, {m['syncs']:g} syncs")
    elif profile.get("failed"):
        print(f"    profile failed: {profile['failed']}")
    for key, t in (d.get("targets") or {}).items():
        shown = "not measured" if t["met"] is None else ("met" if t["met"] else "NOT met")
        value = "-" if t["value"] is None else f"{t['value']:,.2f}"
        print(f"    target {key} {t['op']} {t['target']:g}: {value} {shown}")
EOF

if [ -n "${COPY_TO:-}" ]; then
    mkdir -p "$COPY_TO" && cp -f bench/results/serve_anchors_"$gpu".json bench/results/serve_default_"$gpu".json \
        "$log" "$COPY_TO"/ 2>/dev/null
    echo "== copied the results to $COPY_TO"
fi
