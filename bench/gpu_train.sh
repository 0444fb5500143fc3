#!/usr/bin/env bash
# One GPU session for issue 32's training figures (bench/README.md, train_throughput.py): run from anywhere in
# the repo on a machine with torch + CUDA + triton + transformers (torchao for fp8) and no internet. About
# 12 minutes at most (ONLY="..." picks steps to fit a call): every step has its own time limit, a failing or
# timed-out step does not stop the next, and a summary ends the output. Each row is printed once timed.
#
#   bash bench/gpu_train.sh               # PYTHON=/path/to/python to choose the interpreter;
#                                         # COPY_TO=DIR packs the results and log into DIR/results.tgz
#
# torchao is not in the lent machines' image: carry its wheel (bench/README.md, "GPU sessions") or the fp8
# steps are left out. Writes bench/results/train_throughput_<row>_<gpu>.json for the rows 1b, 1b_fit, 3b_fp8,
# 3b_fp8_compiled, 1b_fp8, 3b_profile, 135m, 135m_profile, 1b_profile, host_135m and host_1b, and kernels_<gpu>.json,
# matmul_shapes_<gpu>.json and gpu_train_<gpu>.log.
#
# A dry run on a CPU checks the plumbing (tiny shapes; fp8 is left out there):
#   DEVICE=cpu DEVICE_MEMORY=0.3 SEQ=64 M1B=tiny M135=tiny M3B=tiny GPU_SLUG=dry bash bench/gpu_train.sh

source "$(dirname "$0")/gpu_common.sh"
DEVICE=${DEVICE:-cuda}
SEQ=${SEQ:-2048}
M1B=${M1B:-llama3.2-1b} M135=${M135:-smollm2-135m} M3B=${M3B:-llama3.2-3b}
gpu_setup gpu_train
bench() {  # bench NAME LIMIT_S JSON_TAG ARGS...: one train_throughput.py run, its JSON under bench/results/
    local label=$1 limit=$2 tag=$3
    shift 3
    step "$label" "$limit" "$PY" bench/train_throughput.py --device "$DEVICE" --seq-len "$SEQ" --warmup 2 --steps 6 \
        ${DEVICE_MEMORY:+--device-memory "$DEVICE_MEMORY"} --json "bench/results/train_throughput_${tag}_$gpu.json" "$@"
}

# (a) the honest-MFU choice and the measured peak on this GPU (the datasheet-above-measured check is CUDA-only)
step "tests" 30 "$PY" -m pytest -q -x -p no:cacheprovider tests/test_train.py -k "peak or mfu"
# (b) Llama-3.2-1B shape, bf16-mixed, eager and compiled, against HF the same, at the issue's shape
#     (micro-batch 4); the planner's speed and memory beside each row (targets: planner within 10% / 2%; the
#     memory plan replays the eager model's saved tensors, so the eager rows are its check)
bench "1b" 160 1b --preset "$M1B" --batch 4 --precision bf16 --compile both
# (c) the same model at 16 sequences a step, micro-batch and recomputation chosen by `plan --fit` for this
#     GPU (target: >= 55% MFU of the datasheet; the optimizer step is ~10% of a micro-batch-4 step)
bench "1b-fit" 150 1b_fit --preset "$M1B" --batch 4 --grad-accum 4 --precision bf16 --compile on --skip-hf --fit
# (d) fp8 against our bf16 on the Llama-3.2-3B shape (target: >= 1.3x). Ours only: two 3B runners' states
#     do not fit one 80 GB card together, so the memory plan times them one after the other. Micro-batch 4
#     (bf16 plans 65.2 GiB with the compiled loss): the weights' casts and the optimizer step are fixed
#     costs a step, so the planner puts fp8 at 1.21x our bf16 there against 1.16x at micro-batch 2 (the
#     stored H100 run, which measured 1.07x). train.fp8_weight_cast=auto now casts each weight once a step
#     with a compiled kernel (1.23x predicted; the stored run cast at each use); the row records which ran.
#     On a fresh machine (2026-11-27) the bf16 row took ~60 s and the fp8 compile ran past the old 150 s.
if [ "$DEVICE" = cuda ] && "$PY" -c "import torchao.float8" >/dev/null 2>&1; then
    bench "fp8-3b" 240 3b_fp8 --preset "$M3B" --batch 4 --precision bf16,fp8 --compile on --skip-hf
    # the issue's other fp8 shape, the 1B (1.10x on an H200 casting at each use); not in the lease plan's ONLY
    bench "fp8-1b" 150 1b_fp8 --preset "$M1B" --batch 4 --precision bf16,fp8 --compile on --skip-hf
    # (d1) one profiled step of each side of (d), kernels by kind beside the planner's price of each: where fp8's
    #      step keeps time that bf16's does not (the float8 casts and scales are elementwise kernels), and which
    #      term of the model prices the 3B's bf16 row 9% slow
    bench "3b-profile" 300 3b_profile --preset "$M3B" --batch 4 --precision bf16,fp8 --compile on --skip-hf \
        --warmup 1 --steps 3 --profile
else
    echo "== fp8-3b, fp8-1b, 3b-profile: left out (need --device cuda and torchao: carry its wheel)"
fi
# (e) smollm2-135m against HF compiled (target: >= 1.3x). Limits from the H100 lease of 2026-11-26: 1b took
#     123 s, 1b-fit 35, fp8-3b 87; 135m overran 80 s with two cold compiles (64 s once inductor's cache was warm).
#     The compiled loss (train.compile) adds two small graphs to each compiled run of ours; 1b-fit has 150 s
#     for a fresh machine's cold inductor cache (35 s warm).
#     --waits both: ours (one read from the device a step, after the update is queued) beside the same Trainer
#     made to wait where the step used to (for the loss before the optimizer, for the norm after it): the host
#     work the device idled through, at the size where it weighs most. One more compile: ~50 s. (Fused against
#     separate projections, the planner's 75 against 81 ms, measured equal at 2026-11-27's lease: 94.7 / 93.8.)
#     12 steps in 3 windows of 4 a side: at 2026-11-27's one step a window, the three sides' medians lay within
#     1.5% (93.8-95.1 ms) while single steps ran 78-106 ms, as if each switch between three models cost a step
#     something (allocator, caches, clocks); steps inside a window show whether it does.
bench "135m" 190 135m --preset "$M135" --batch 8 --precision bf16 --compile on --waits both --steps 12 \
    --rounds 3
# (f) one profiled step of each side of (e): kernel time against wall time and the top kernels, to say where
#     the 135M step differs from HF's (bench/results/train_throughput_135m_profile_<gpu>.json, "profiles_bf16")
bench "135m-profile" 150 135m_profile --preset "$M135" --batch 8 --precision bf16 --compile on --warmup 1 --steps 2 \
    --profile
# (f1) one profiled step of the 1B's --fit row, ours only: its kernels by kind (matmul, attention, elementwise,
#     optimizer) beside the planner's price of each (fivefold.planner.speed.kernel_time), to say which term of
#     the model misses on the large shapes (the H200's 1B and 3B rows read 9-12% slow while their products run
#     a median 36% faster than priced: bench/results/matmul_shapes_h200.json)
bench "1b-profile" 200 1b_profile --preset "$M1B" --batch 4 --grad-accum 4 --precision bf16 --compile on --skip-hf \
    --fit --warmup 1 --steps 2 --profile
# (f2) fused projections on CUDA (train.fused_projections): compiled bf16 steps equal the separate ones', and
#     a compiled bf16 block's gradients the separate block's, with no fused weight kept for backward (its CUDA
#     case only: the CPU case's C++ compile took the whole 55 s of the 2026-11-27 lease's try)
step "cuda-train-tests" 90 "$PY" -m pytest -q -p no:cacheprovider \
    "tests/test_fused_projections.py::test_cuda_compiled_fused_projections_train_as_separate" \
    "tests/test_fused_projections.py::test_a_compiled_bf16_fused_block_has_the_separate_gradients_and_keeps_no_fused_weight[cuda]" \
    "tests/test_train.py::test_a_cuda_step_waits_for_the_device_only_after_its_update_is_queued"
# (g) the Triton RMSNorm / SwiGLU / RoPE (train.kernels=triton) against eager and compiled PyTorch at the 1B
#     layer, fwd+bwd: train.kernels stays torch by default until they beat the compiled blocks, the training
#     default on CUDA (the issue's 0.61-0.72x is against eager). On a CPU a correctness check only.
step "kernels" 60 "$PY" bench/kernels.py --device "$DEVICE" --json "bench/results/kernels_$gpu.json"
# (h) each linear's three products at the rows' token counts, against the planner's price for each, and the
#     matmul knee that prices them best (the 1B and 3B rows read 10-14% slow, published runs optimistic)
step "matmuls" 60 "$PY" bench/matmul_shapes.py --device "$DEVICE" --json "bench/results/matmul_shapes_$gpu.json"
# (h2) one 8192^3 product back to back for two minutes: does the rate the profiles take from (h)'s brief timing
#      hold once the GPU is hot? (the published runs, under load for days, read the planner 14 of 16 optimistic)
step "sustained" 150 "$PY" bench/matmul_sustained.py --device "$DEVICE" --seconds 120 \
    --json "bench/results/matmul_sustained_$gpu.json"
# (i) the optimizer step's host work against its device time over smollm2-135m's 272 parameters: what the
#     device idled through while the step waited for the loss before queueing the update (it no longer does)
step "optimizer-host" 30 "$PY" bench/optimizer_host.py --device "$DEVICE" --json "bench/results/optimizer_host_$gpu.json"
# (i2) the compiled update (train.optimizer_impl=compiled, one kernel a tensor: 30 bytes a parameter) against the
#      fused one's 50, on the device (135M's parameters), then on the 3B fp8 row, where the optimizer's 47-49 ms of
#      a 263 ms step is the largest fixed cost left (the planner prices compiled at -19 ms; target fp8 >= 1.3x)
step "optimizer-compiled" 60 "$PY" bench/optimizer_host.py --device "$DEVICE" --impl fused,compiled \
    --json "bench/results/optimizer_compiled_$gpu.json"
if [ "$DEVICE" = cuda ] && "$PY" -c "import torchao.float8" >/dev/null 2>&1; then
    bench "fp8-3b-compiled" 300 3b_fp8_compiled --preset "$M3B" --batch 4 --precision bf16,fp8 --compile on \
        --skip-hf --optimizer-impl compiled
fi
# (j) the host's floor: smollm2-135m and the 1B at 128 tokens a step, where the device's work is a few ms and a
#     step takes what the host takes to issue it (one profiled step each counts its launches): what the
#     planner's host figures price (fivefold.planner.speed.host_bound), apart from the rows they are checked on
bench "host-135m" 120 host_135m --preset "$M135" --seq-len 128 --batch 1 --precision bf16 --compile on --skip-hf \
    --warmup 3 --steps 12 --profile
bench "host-1b" 120 host_1b --preset "$M1B" --seq-len 128 --batch 1 --precision bf16 --compile on --skip-hf \
    --warmup 3 --steps 12 --profile

print_steps
"$PY" bench/gpu_summary.py train \
    bench/results/train_throughput_{1b,1b_fit,3b_fp8,3b_fp8_compiled,1b_fp8,3b_profile,135m,135m_profile,1b_profile,host_135m,host_1b}_"$gpu".json

copy_results  # the summary's lines are in the log: pack it once more
