"""Data parallelism under torchrun (gloo): the same losses and final weights as one process with the
same seed and global batch; layout errors before any worker starts."""

import json
import os
import subprocess
import sys

from pathlib import Path

import pytest

from parity import assert_parity, torchrun

COMMON = ["--preset", "tiny", "--set", "train.steps=10", "--set", "train.seq_len=32", "--set", "train.log_every=1",
          "--set", "train.peak_flops=1e11", "--set", "train.eval_every=0", "--set", "train.lr=1e-2",
          "--set", "train.warmup_steps=2", "--set", "train.tensorboard=false", "--set", "train.eps=1e-6"]
GLOBAL_SEQUENCES = 8


def train(out, cache, *extra, check=True):
    env = {**os.environ, "FIVEFOLD_CACHE": cache, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "fivefold", "train", *COMMON, "--out", str(out), *extra],
                          capture_output=True, text=True, env=env, timeout=600)
    if check and proc.returncode:
        raise AssertionError(f"train failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


@pytest.fixture(scope="module")
def single(tmp_path_factory, data_cache):
    out = tmp_path_factory.mktemp("single")
    train(out, data_cache, "--set", f"train.micro_batch_size={GLOBAL_SEQUENCES}")
    return out


@pytest.mark.parametrize("dp, accum, bucket_mb", [(2, 2, 0.02)])
def test_data_parallel_matches_one_process(single, data_cache, tmp_path, dp, accum, bucket_mb):
    """Through `fivefold train --nproc`, with buckets of a few parameters each (tests/test_zero.py runs the
    whole dp x zero x accumulation matrix)."""
    out = tmp_path / "dp"
    micro = GLOBAL_SEQUENCES // (dp * accum)
    train(out, data_cache, "--nproc", str(dp), "--set", f"train.micro_batch_size={micro}",
          "--set", f"train.grad_accum={accum}", "--set", f"parallel.bucket_mb={bucket_mb}")
    assert_parity(out, single)


def test_a_parameter_no_rank_touched_keeps_no_gradient():
    """The experts' reduction (overlap=False): sums over the ranks that had a gradient, and None where no rank
    had one (tests/reducer_worker.py), so that the optimizer skips it as one process does."""
    proc = torchrun(2, Path(__file__).parent / "reducer_worker.py")
    assert proc.returncode == 0 and "reduced as one process" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_layout_errors_come_before_any_worker_starts(data_cache, tmp_path):
    proc = train(tmp_path / "a", data_cache, "--nproc", "2", "--set", "parallel.dp=4", check=False)
    assert proc.returncode == 2 and "world size 2 != dp*tp*pp*cp = 4*1*1*1 = 4" in proc.stderr
    proc = train(tmp_path / "b", data_cache, "--nproc", "2", "--set", "parallel.ep=2", check=False)
    assert proc.returncode == 2 and "parallel.ep=2 must divide model.num_experts=0" in proc.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_killed_rank_ends_the_whole_job(tiny_config, tmp_path):
    """Rank 1 is SIGKILLed after two steps while rank 0 goes on into the next step's all-reduce: torchrun's
    agent must end the job with a non-zero exit naming rank 1, well within 60 s, never hang."""
    import time
    cfg = tiny_config(**{"train.steps": 50, "parallel.dp": 2})
    script = tmp_path / "worker.py"
    script.write_text(
        "import json, os, signal, sys\n"
        "from fivefold.config_load import config_from_dict\n"
        "from fivefold.train.trainer import Trainer\n"
        f"cfg = config_from_dict(json.loads({json.dumps(json.dumps(cfg.to_dict()))}))\n"
        "trainer = Trainer(cfg, quiet=True)\n"
        "trainer.fit(until=2)\n"
        "if os.environ['RANK'] == '1':\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "trainer.fit()\n")
    start = time.monotonic()
    proc = torchrun(2, script)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert "rank      : 1" in proc.stderr or "rank: 1" in proc.stderr, proc.stderr[-2000:]
    assert "Signal 9" in proc.stderr or "SIGKILL" in proc.stderr, proc.stderr[-2000:]
    assert elapsed < 60, elapsed


def test_a_data_parallel_checkpoint_resumes_in_one_process(data_cache, tmp_path):
    """Written by dp=2 at step 5, resumed by a single process: steps 6-10 match the dp=2 run's."""
    import shutil
    dp_run = tmp_path / "dp"
    train(dp_run, data_cache, "--nproc", "2", "--set", "train.micro_batch_size=4", "--set", "train.save_every=5",
          "--set", "train.keep_checkpoints=3")
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(dp_run / "checkpoints" / "step_00000005", resumed / "checkpoints" / "step_00000005")
    (resumed / "checkpoints" / "latest").write_text("step_00000005\n")
    proc = train(resumed, data_cache, "--set", f"train.micro_batch_size={GLOBAL_SEQUENCES}")
    assert "resumed from" in proc.stdout
    assert_parity(resumed, dp_run, steps=5)


def test_the_compiled_update_under_data_parallel_matches_one_process(data_cache, tmp_path):
    """train.optimizer_impl=compiled on 2 ranks against one process with the same update: losses, gradient norms
    and final weights (assert_parity)."""
    compiled = ("--set", "train.optimizer_impl=compiled")
    single = tmp_path / "single"
    train(single, data_cache, *compiled, "--set", f"train.micro_batch_size={GLOBAL_SEQUENCES}")
    out = tmp_path / "dp"
    train(out, data_cache, *compiled, "--nproc", "2", "--set", f"train.micro_batch_size={GLOBAL_SEQUENCES // 2}")
    assert_parity(out, single)
