"""No checkpoint trusted blindly, no run lost: every file of a checkpoint is checked against its manifest,
damage of any kind is detected and the newest intact checkpoint used, failed saves (a full disk) keep the
earlier checkpoints, SIGINT / SIGTERM stop after a step with a checkpoint, and one run holds its directory."""

import copy
import errno
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import TINY_DEFAULTS

from fivefold.config_load import load_config
from fivefold.errors import CheckpointError, RunLockedError
from fivefold.checkpoint import store as ckpt
from fivefold.weights import load_model
from fivefold.train.run_lock import RunLock
from fivefold.train.trainer import Trainer

STEPS = {"train.steps": 4, "train.save_every": 2, "train.keep_checkpoints": 3,
         "train.lr_schedule": "constant"}  # constant lr: a run's lr does not depend on train.steps


def _files(step_dir):
    """One file of each kind a checkpoint holds."""
    shard = sorted((step_dir / "state").glob("*.safetensors"))[0].relative_to(step_dir)
    return {"weights shard": str(shard), "config": "config.json", "trainer state": "trainer_state.json",
            "rng": "rng.safetensors", "tokenizer": "tokenizer.json", "manifest": "manifest.json"}


def damage(path, how: str) -> None:
    data = path.read_bytes()
    if how == "flip":  # 100 bytes in the middle, as a bad disk or a stray write would
        middle = len(data) // 2
        data = data[:middle] + bytes(b ^ 0xA5 for b in data[middle:middle + 100]) + data[middle + 100:]
    elif how == "truncate":
        data = data[:len(data) // 2]
    elif how == "empty":
        data = b""
    elif how == "garbage":
        data = os.urandom(len(data))
    if how == "delete":
        path.unlink()
    else:
        path.write_bytes(data)


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory, data_cache):
    """A run with intact checkpoints at steps 2 and 4, and the losses of its steps."""
    out = tmp_path_factory.mktemp("intact") / "run"
    values = {**TINY_DEFAULTS, **STEPS, "data.cache_dir": data_cache, "train.out_dir": str(out)}
    cfg = load_config(preset="tiny", overrides=[f"{k}={v}" for k, v in values.items()])
    history = Trainer(cfg, quiet=True).fit()
    return cfg, out, [r["loss"] for r in history]


def copy_run(two_checkpoints, tmp_path):
    cfg, out, losses = two_checkpoints
    run = tmp_path / "run"
    shutil.copytree(out, run)
    cfg = copy.deepcopy(cfg)
    cfg.train.out_dir = str(run)
    return cfg, run, losses


@pytest.mark.parametrize("how", ["flip", "truncate", "empty", "garbage", "delete"])
@pytest.mark.parametrize("kind", ["weights shard", "config", "trainer state", "rng", "tokenizer", "manifest"])
def test_damage_of_any_file_is_detected_and_the_newest_intact_checkpoint_used(two_checkpoints, tmp_path, kind, how):
    cfg, run, losses = copy_run(two_checkpoints, tmp_path)
    newest = run / "checkpoints" / "step_00000004"
    bad = newest / _files(newest)[kind]
    damage(bad, how)
    with pytest.warns(ckpt.CheckpointWarning, match=f"step_00000004 is damaged: .*{bad.name}"):
        resumed = Trainer(cfg, resume=True, quiet=False)
    assert resumed.step == 2
    # The run goes on from step 2 exactly as it first did, and replaces the damaged checkpoint.
    assert [r["loss"] for r in resumed.fit()] == losses[2:]
    assert ckpt.verify_checkpoint(newest) == []


def test_fallback_off_refuses_a_damaged_newest_checkpoint_naming_the_file(two_checkpoints, tmp_path):
    cfg, run, _ = copy_run(two_checkpoints, tmp_path)
    bad = run / "checkpoints" / "step_00000004" / "trainer_state.json"
    damage(bad, "garbage")
    cfg.train.checkpoint_fallback = False
    with pytest.raises(CheckpointError, match=f"{bad}.*does not match its checksum.*--no-fallback"):
        Trainer(cfg, resume=True, quiet=True)


def test_all_checkpoints_damaged_is_an_error_listing_each(two_checkpoints, tmp_path):
    cfg, run, _ = copy_run(two_checkpoints, tmp_path)
    for step in ("step_00000002", "step_00000004"):
        damage(run / "checkpoints" / step / "rng.safetensors", "truncate")
    with pytest.raises(CheckpointError, match="no intact checkpoint.*step_00000004.*step_00000002.*--overwrite"):
        Trainer(cfg, resume=True, quiet=True)


def test_a_damaged_checkpoint_named_directly_is_refused_for_loading(two_checkpoints, tmp_path):
    _, run, _ = copy_run(two_checkpoints, tmp_path)
    newest = run / "checkpoints" / "step_00000004"
    damage(newest / _files(newest)["weights shard"], "flip")
    with pytest.raises(CheckpointError, match="step_00000004 is damaged"):
        load_model(newest)
    with pytest.warns(ckpt.CheckpointWarning):
        assert ckpt.resolve_checkpoint(run).name == "step_00000002"  # a run dir: its newest intact one


def test_checkpoints_from_before_manifests_load_with_a_warning(two_checkpoints, tmp_path):
    cfg, run, _ = copy_run(two_checkpoints, tmp_path)
    for step in ("step_00000002", "step_00000004"):  # as written before fivefold recorded checksums
        (run / "checkpoints" / step / "manifest.json").unlink()
    with pytest.warns(ckpt.CheckpointWarning, match="step_00000004 has no manifest.json"):
        assert Trainer(cfg, resume=True, quiet=True).step == 4
    with pytest.warns(ckpt.CheckpointWarning, match="no manifest.json"):
        load_model(run / "checkpoints" / "step_00000002")


def test_the_manifest_lists_every_file_with_size_and_checksum(two_checkpoints):
    _, run, _ = two_checkpoints
    step = run / "checkpoints" / "step_00000004"
    files = ckpt.read_manifest(step)
    on_disk = {str(p.relative_to(step)) for p in step.rglob("*") if p.is_file() and p.name != "manifest.json"}
    assert set(files) == on_disk
    for name, entry in files.items():
        assert entry == ckpt.file_entry(step / name)


def test_abandoned_temporaries_are_removed_at_start(two_checkpoints, tmp_path):
    cfg, run, _ = copy_run(two_checkpoints, tmp_path)
    root = run / "checkpoints"
    dead = _dead_pid()
    (root / f"step_00000006.tmp-{dead}" / "state").mkdir(parents=True)
    (root / f"step_00000002.old-{dead}").mkdir()
    (root / f"latest.tmp-{dead}").write_text("step_00000006\n")
    (root / f"step_00000008.tmp-{os.getpid()}").mkdir()  # a live writer's: left alone
    Trainer(cfg, resume=True, quiet=True)
    assert sorted(p.name for p in root.iterdir()) == [
        "latest", "step_00000002", "step_00000004", f"step_00000008.tmp-{os.getpid()}"]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# -- saving when the disk is full -------------------------------------------------------------------
def test_too_little_free_space_skips_the_save_and_the_next_one_retries(tiny_config, monkeypatch):
    trainer = Trainer(tiny_config(**STEPS), quiet=True)
    trainer.fit(until=2)
    root = trainer.checkpoint_root
    real = shutil.disk_usage
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    trainer.fit(until=3)  # the save at step 3 (the end of this fit) fails, training does not
    assert trainer.step == 3 and "not enough free space" in trainer.save_error
    assert [p.name for p in root.iterdir() if p.name != "latest"] == ["step_00000002"]
    assert ckpt.resolve_checkpoint(root).name == "step_00000002"
    monkeypatch.setattr(ckpt.shutil, "disk_usage", real)
    trainer.fit(until=4)
    assert trainer.save_error is None and ckpt.resolve_checkpoint(root).name == "step_00000004"


def test_a_write_error_mid_save_removes_the_temporary_and_keeps_the_earlier_checkpoints(tiny_config, monkeypatch):
    trainer = Trainer(tiny_config(**STEPS), quiet=True)
    trainer.fit(until=2)
    real = ckpt.write_json

    def failing(path, obj):  # the disk fills while the small files are written
        if path.name == "trainer_state.json":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, obj)
    monkeypatch.setattr(ckpt, "write_json", failing)
    trainer.fit(until=4)
    assert "No space left on device" in trainer.save_error
    names = sorted(p.name for p in trainer.checkpoint_root.iterdir())
    assert names == ["latest", "step_00000002"]
    assert ckpt.verify_checkpoint(trainer.checkpoint_root / "step_00000002") == []


def _limit_file_size(limit: int):
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


TRAIN_ARGS = ["--preset", "tiny", "--set", "train.seq_len=32", "--set", "train.micro_batch_size=4",
              "--set", "train.lr=1e-2", "--set", "train.warmup_steps=2", "--set", "train.lr_schedule=constant",
              "--set", "train.log_every=1", "--set", "train.eval_every=0", "--set", "train.progress=false",
              "--set", "train.tensorboard=false", "--set", "train.peak_flops=1e11"]


def fivefold_train(out, *extra, cache, preexec_fn=None, wait=True):
    env = {**os.environ, "FIVEFOLD_CACHE": cache, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "fivefold", "train", *TRAIN_ARGS, "--out", str(out), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=preexec_fn)
    if not wait:
        return proc
    stdout, stderr = proc.communicate(timeout=600)
    return proc.returncode, stdout, stderr


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_full_disk_loses_no_checkpoint_and_the_run_exits_nonzero(data_cache, tmp_path, nproc):
    out = tmp_path / "run"
    args = ["--set", "train.save_every=2", "--nproc", str(nproc)]
    code, _, stderr = fivefold_train(out, *args, "--set", "train.steps=2", cache=data_cache)
    assert code == 0, stderr
    # Files may not grow past 64 KiB: the weight shards (about 1.7 MB) cannot be written.
    code, _, stderr = fivefold_train(out, *args, "--set", "train.steps=6", cache=data_cache,
                                     preexec_fn=_limit_file_size(64 * 1024))
    assert code == 2, stderr
    assert "warning: could not save checkpoint" in stderr and "training goes on" in stderr
    assert "Traceback" not in stderr
    last = [line for line in stderr.splitlines() if line.startswith("fivefold train: error")]
    assert len(last) == 1 and "its final checkpoint is not on disk" in last[0]
    root = out / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000002"]  # no temporaries
    assert ckpt.verify_checkpoint(root / "step_00000002") == []
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["step"] == 6  # it trained on
    # With room again, the same command resumes from the last good checkpoint.
    code, stdout, stderr = fivefold_train(out, *args, "--set", "train.steps=6", cache=data_cache)
    assert code == 0, stderr
    assert "resumed from" in stdout and "step_00000002" in stdout


# -- interrupts ---------------------------------------------------------------------------------------
def _wait_for_step(out, step, proc, timeout=300):
    deadline = time.time() + timeout
    metrics = out / "metrics.jsonl"
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= step:
            return
        time.sleep(0.05)
    raise AssertionError("the run did not reach the step")


@pytest.mark.parametrize("sig, nproc", [(signal.SIGINT, 1), (signal.SIGTERM, 1), (signal.SIGTERM, 2)])
def test_a_signal_stops_after_the_step_with_a_checkpoint_and_resuming_gives_the_same_losses(
        data_cache, tmp_path, sig, nproc):
    out = tmp_path / "run"
    args = ["--nproc", str(nproc), "--set", "train.steps=100000"]
    proc = fivefold_train(out, *args, cache=data_cache, wait=False)
    try:
        _wait_for_step(out, 3, proc)
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + sig, stderr
    assert f"stopped by {sig.name} after step" in stderr and "Resume with the same command: fivefold train" in stderr
    assert f"--nproc {nproc}" in stderr
    assert "Traceback" not in stderr
    stopped = ckpt.resolve_checkpoint(out)
    assert ckpt.verify_checkpoint(stopped) == []
    step = json.loads((stopped / "trainer_state.json").read_text())["step"]
    first = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert first[-1]["step"] == step  # every rank stopped after the same step, the one saved
    code, _, stderr = fivefold_train(out, "--nproc", str(nproc), "--set", f"train.steps={step + 3}",
                                     cache=data_cache)
    assert code == 0, stderr
    resumed = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    straight_out = tmp_path / "straight"
    code, _, stderr = fivefold_train(straight_out, "--nproc", str(nproc), "--set", f"train.steps={step + 3}",
                                     cache=data_cache)
    assert code == 0, stderr
    straight = [json.loads(line) for line in (straight_out / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]  # bit-identical
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in straight]


# -- the run directory lock ---------------------------------------------------------------------------
def test_a_second_run_in_the_same_directory_is_refused_naming_the_holder(data_cache, tmp_path):
    out = tmp_path / "run"
    with RunLock(out):
        code, _, stderr = fivefold_train(out, "--set", "train.steps=1", cache=data_cache)
        with pytest.raises(RunLockedError):
            RunLock(out).acquire()
    assert code == 2
    assert f"is in use by PID {os.getpid()}" in stderr and "choose another --out" in stderr
    assert len(stderr.strip().splitlines()) == 1
    assert not (out / "checkpoints").exists()


def test_a_run_refused_before_it_writes_leaves_no_directory(data_cache, tmp_path):
    out = tmp_path / "new" / "run"
    code, _, stderr = fivefold_train(out, "--set", f"train.init_from={tmp_path / 'nowhere'}", cache=data_cache)
    assert code == 2 and "does not exist" in stderr
    assert not out.exists()  # the lock made it, and took it away again
    with RunLock(tmp_path):  # a directory that was there before stays
        pass
    assert tmp_path.is_dir()


def test_a_stale_lock_from_a_dead_process_is_taken_over(tmp_path, capsys):
    (tmp_path / ".lock").write_text(json.dumps({"pid": _dead_pid(), "host": "h", "since": 0, "command": "x"}))
    with RunLock(tmp_path):
        pass
    assert "taking over the lock" in capsys.readouterr().err
    with RunLock(tmp_path):  # a clean release leaves nothing to take over
        pass
    assert capsys.readouterr().err == ""


def test_a_damaged_sharded_checkpoint_falls_back_under_zero3(data_cache, tmp_path):
    """dp=2 with ZeRO-3: each rank wrote its rows; the ranks verify half the files each and agree."""
    out = tmp_path / "run"
    args = ["--nproc", "2", "--set", "parallel.zero=3", "--set", "train.save_every=2", "--set", "train.keep_checkpoints=3"]
    code, _, stderr = fivefold_train(out, *args, "--set", "train.steps=4", cache=data_cache)
    assert code == 0, stderr
    first = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    newest = out / "checkpoints" / "step_00000004"
    shards = sorted((newest / "state").glob("*.safetensors"))
    assert len(shards) == 2  # one per rank
    damage(shards[1], "flip")
    code, stdout, stderr = fivefold_train(out, *args, "--set", "train.steps=4", cache=data_cache)
    assert code == 0, stderr
    assert stderr.count(f"{shards[1].name} does not match its checksum") == 1  # rank 0 warns, once
    assert "resumed from" in stdout and "step_00000002" in stdout
    resumed = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in resumed[4:]] == [r["loss"] for r in first[2:]]
    assert ckpt.verify_checkpoint(newest) == []
