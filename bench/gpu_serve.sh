#!/usr/bin/env bash
# One GPU session for the serving benchmark (bench/README.md, serve.py): run from anywhere in the repo on a
# machine with torch + CUDA + triton + transformers installed and no internet. At most ~9 minutes: every
# step has its own time limit, a failing or timed-out step does not stop the next, and a summary ends
# the output. bench/serve.py writes its JSON after each stage, so a run cut short keeps what it measured.
#
#   bash bench/gpu_serve.sh               # PYTHON=/path/to/python to choose the interpreter;
#                                         # COPY_TO=DIR packs the results and log into DIR/results.tgz;
#                                         # BATCH_SIZES=256 times fewer transformers static batches
#
# Writes bench/results/serve_anchors_<gpu>.json, serve_default_<gpu>.json, serve_paths_<gpu>.json,
# serve_step_memory_<gpu>.json, serve_sampling_draws_<gpu>.json, quant_dequantize_<gpu>.json and
# gpu_serve_<gpu>.log, where <gpu> is a slug of the GPU's name (h100, h200, a100, ...).
#
# A dry run on a CPU checks the plumbing (a tiny model; the CUDA-only profile and tests are skipped there):
#   DEVICE=cpu MODEL=tiny GPU_SLUG=dry bash bench/gpu_serve.sh

source "$(dirname "$0")/gpu_common.sh"
MODEL=${MODEL:-llama3.2-1b}   # Llama-3.2-1B's shape, random weights (fivefold.presets)
DEVICE=${DEVICE:-cuda}
gpu_setup gpu_serve

# (a) the paged-attention and engine tests. test_paged_attention.py runs its Triton kernels in the
#     interpreter when it is the first to import triton, so the CUDA-only tests (CUDA-graph decode,
#     test_serve_fast_path.py) run in a second process, where triton compiles for the GPU.
pytest_step "tests" 90 tests/test_paged_attention.py tests/test_serve_engine.py
pytest_step "cuda-tests" 90 tests/test_serve_fast_path.py  # 26 tests: 28 s warm, past 45 s cold
# (b) the anchor workload: 256 requests, prompts and outputs uniform 100..1024, against transformers
#     static batches of 256, 128 and 64; per-step times, batch-1 decode, and the profiled batch-256 decode step
step "anchors" 255 "$PY" bench/serve.py --device "$DEVICE" --model "$MODEL" --workload anchors --profile \
    ${BATCH_SIZES:+--batch-sizes "$BATCH_SIZES"} --json "bench/results/serve_anchors_$gpu.json"
# (c) the default workload (the CPU results' request set: 32 requests, log-uniform outputs 16..256)
step "default" 90 "$PY" bench/serve.py --device "$DEVICE" --model "$MODEL" \
    --json "bench/results/serve_default_$gpu.json"
# (d) the engine's other paths on the same weights: eager decode (no CUDA graphs), a LoRA adapter loaded
#     (projections unfused, decode eager) with base requests and with every request on it, int8 and int4 weights
#     (dequantized per product on a GPU; q/k/v and gate/up fused on the Triton path too)
step "paths" 195 "$PY" bench/serve.py --device "$DEVICE" --model "$MODEL" --workload anchors --requests 64 \
    --skip-hf --paths --quant int8,int4 --json "bench/results/serve_paths_$gpu.json"
# (e) a step's working set: the plan's forward, sampler and scored rows against LivePeak and the allocator
step "step-memory" 60 "$PY" bench/serve_step_memory.py --device "$DEVICE" --model "$MODEL" --dtype bfloat16 \
    --max-num-seqs 256 --max-model-len 8192 --json "bench/results/serve_step_memory_$gpu.json"
# (f) the sampler's draw of 256 flat rows of Llama 3's vocabulary, in one pass and DRAW_BUDGET's rows at a time
step "draws" 30 "$PY" bench/serve_sampling.py --rows 8 --vocab 4000 --reps 3 --device "$DEVICE" --draw-rows 256 \
    --json "bench/results/serve_sampling_draws_$gpu.json"
# (g) a quantized weight dequantized in chunks against the whole weight, the 1B's shapes
step "dequantize" 30 "$PY" bench/quant_dequantize.py --preset "$MODEL" --device "$DEVICE" --reps 5 \
    --json "bench/results/quant_dequantize_$gpu.json"
step "serve-predict" 75 "$PY" bench/serve_predict.py --device "$DEVICE" --model "$MODEL" \
    --json "bench/results/serve_predict_$gpu.json"

print_steps
"$PY" bench/gpu_summary.py serve "bench/results/serve_anchors_$gpu.json" "bench/results/serve_default_$gpu.json" \
    "bench/results/serve_paths_$gpu.json"

copy_results  # the summary's lines are in the log: pack it once more
