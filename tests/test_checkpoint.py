"""Checkpoints: exact resume, atomic saves that survive SIGKILL, keep-last-K, no pickle on load."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from fivefold.checkpoint import store as ckpt
from fivefold.weights import load_model
from fivefold.train.trainer import Trainer


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_stopped_and_resumed_run_gives_the_same_losses(tiny_config, tmp_path, precision):
    overrides = {"train.steps": 8, "train.precision": precision, "train.grad_accum": 2}
    straight = Trainer(tiny_config(**overrides, **{"train.out_dir": str(tmp_path / "a")}), quiet=True).fit()
    cfg = tiny_config(**overrides, **{"train.out_dir": str(tmp_path / "b")})
    first = Trainer(cfg, quiet=True).fit(until=3)  # stops (and saves) at step 3 of 8
    resumed = Trainer(cfg, resume=True, quiet=True)
    assert resumed.step == 3
    rest = resumed.fit()
    assert [r["loss"] for r in first + rest] == [r["loss"] for r in straight]  # bit-identical
    assert [r["lr"] for r in first + rest] == [r["lr"] for r in straight]


def test_keeps_the_last_k_and_points_latest_at_the_newest(tiny_config):
    cfg = tiny_config(**{"train.steps": 5, "train.save_every": 1, "train.keep_checkpoints": 2})
    trainer = Trainer(cfg, quiet=True)
    trainer.fit()
    names = [p.name for p in ckpt.list_checkpoints(trainer.checkpoint_root)]
    assert names == ["step_00000004", "step_00000005"]
    assert ckpt.resolve_checkpoint(trainer.out_dir).name == "step_00000005"
    # `latest` names the checkpoint written last, which wins over a later step's name: a run that went back
    # and saved step 4 again resumes from that, not from a step 5 of the abandoned line.
    (trainer.checkpoint_root / "latest").write_text("step_00000004\n")
    assert ckpt.resolve_checkpoint(trainer.out_dir).name == "step_00000004"


def test_resume_refuses_a_different_model(tiny_config):
    cfg = tiny_config(**{"train.steps": 1})
    Trainer(cfg, quiet=True).fit()
    other = tiny_config(**{"model.num_layers": 3})
    with pytest.raises(Exception, match=r"the model differs \(model.num_layers\)"):
        Trainer(other, resume=True, quiet=True)


def test_sigkill_during_save_leaves_the_previous_checkpoint_intact(tiny_config, tmp_path):
    cfg = tiny_config(**{"train.steps": 4})
    ready = tmp_path / "saving"
    script = textwrap.dedent(f"""
        import json, time
        from pathlib import Path
        from fivefold.config_load import config_from_dict
        from fivefold.checkpoint import store as checkpoint
        from fivefold.train.trainer import Trainer
        cfg = config_from_dict(json.loads({json.dumps(json.dumps(cfg.to_dict()))}))
        trainer = Trainer(cfg, quiet=True)
        trainer.fit(until=2)  # a complete checkpoint at step 2
        real = checkpoint.save_tensors
        def slow(path, tensors):  # write part of the next checkpoint, then hang until killed
            real(path, tensors)
            Path({str(ready)!r}).touch()
            time.sleep(60)
        checkpoint.save_tensors = slow
        trainer.fit(until=4)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.time() + 120
        while not ready.exists():
            assert proc.poll() is None, "the writer exited before reaching the save"
            assert time.time() < deadline
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    root = tmp_path / "run" / "checkpoints"
    assert any(p.name.startswith("step_00000004.tmp-") for p in root.iterdir())  # the half-written one
    assert ckpt.resolve_checkpoint(root).name == "step_00000002"
    resumed = Trainer(cfg, resume=True, quiet=True)
    assert resumed.step == 2
    resumed.fit()  # and the run carries on to the end, cleaning up the abandoned temporary
    assert ckpt.resolve_checkpoint(root).name == "step_00000004"
    assert not any(".tmp-" in p.name for p in root.iterdir())


def test_checkpoint_files_are_safetensors_and_json_only(tiny_config):
    trainer = Trainer(tiny_config(**{"train.steps": 1}), quiet=True)
    trainer.fit()
    path = ckpt.resolve_checkpoint(trainer.out_dir)
    assert sorted(p.name for p in path.iterdir()) == [
        "config.json", "manifest.json", "rng.safetensors", "state", "tokenizer.json", "trainer_state.json"]
    assert all(p.suffix == ".safetensors" for p in (path / "state").iterdir())
    cfg, model = load_model(path)
    for (name, p), m in zip(model.named_parameters(), trainer.optimizer.masters):
        assert torch.equal(p, m), name


def test_loading_a_checkpoint_never_unpickles(tiny_config, monkeypatch):
    import pickle
    trainer = Trainer(tiny_config(**{"train.steps": 1}), quiet=True)
    trainer.fit()

    def forbidden(*args, **kwargs):
        raise AssertionError("pickle used while loading a checkpoint")
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(torch, "load", forbidden)
    Trainer(trainer.cfg, resume=True, quiet=True)
    load_model(trainer.out_dir)


def test_a_damaged_checkpoint_is_never_loaded_for_lack_of_a_manifest_elsewhere(tiny_config):
    """Loading unverified is for directories where no checkpoint has a manifest (all written before
    checksums). A damaged checkpoint beside one without a manifest is still damaged: an error naming both,
    not the damaged one loaded unverified."""
    cfg = tiny_config(**{"train.steps": 2, "train.save_every": 1})
    trainer = Trainer(cfg, quiet=True)
    trainer.fit()
    older, newer = ckpt.list_checkpoints(trainer.checkpoint_root)
    (older / ckpt.MANIFEST).unlink()
    shard = next((newer / "state").iterdir())
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match="no intact checkpoint") as error:
        ckpt.resolve_checkpoint(trainer.out_dir)
    assert "does not match its checksum" in str(error.value) and "older than checksums" in str(error.value)
