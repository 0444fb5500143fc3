"""Checkpoints: safetensors + JSON only (nothing is unpickled), written atomically.

Layout of one checkpoint directory:
    config.json            the full config tree
    model.safetensors      fp32 weights (the master copies under bf16-mixed); tied weights stored once
    optimizer.safetensors  optimizer state tensors, flattened to "<param name>/<state key>"
    trainer_state.json     step, tokens seen, schedulers, data sampler position, metrics
    tokenizer.json         the tokenizer the model was trained with (so generate needs nothing else)
    rng.safetensors        torch CPU (and CUDA) RNG states

A save writes everything into `<name>.tmp-<pid>` in the same directory, fsyncs it, then renames it
into place and finally swaps the `latest` pointer with os.replace. A process killed at any moment
leaves either the old or the new checkpoint complete, never a half-written one under a final name.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from fivefold.config import Config, config_from_dict

CHECKPOINT_RE = re.compile(r"^step_(\d{8})$")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def _save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path))
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters by name, each shared (tied) tensor once, as fp32."""
    return {name: p.detach().float() for name, p in model.named_parameters()}


def write_checkpoint(root: str | Path, name: str, cfg: Config, weights: dict[str, torch.Tensor],
                     optimizer: dict[str, torch.Tensor] | None = None, trainer_state: dict | None = None,
                     rng: dict[str, torch.Tensor] | None = None, keep: int | None = None,
                     extra_files: dict[str, bytes] | None = None) -> Path:
    """Atomically write checkpoint `root/name`, point `root/latest` at it, keep the newest `keep`."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / name
    tmp = root / f"{name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    _write_json(tmp / "config.json", cfg.to_dict())
    _save_tensors(tmp / "model.safetensors", weights)
    if optimizer is not None:
        _save_tensors(tmp / "optimizer.safetensors", optimizer)
    if rng is not None:
        _save_tensors(tmp / "rng.safetensors", rng)
    if trainer_state is not None:
        _write_json(tmp / "trainer_state.json", trainer_state)
    for filename, data in (extra_files or {}).items():
        with open(tmp / filename, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    _fsync_dir(tmp)
    if final.exists():  # re-saving the same step: move the old one aside first, then drop it
        old = root / f"{name}.old-{os.getpid()}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    pointer_tmp = root / f"latest.tmp-{os.getpid()}"
    pointer_tmp.write_text(name + "\n")
    os.replace(pointer_tmp, root / "latest")
    _fsync_dir(root)
    if keep:
        for stale in list_checkpoints(root)[:-keep]:
            shutil.rmtree(stale, ignore_errors=True)
    _remove_abandoned(root)
    return final


def _remove_abandoned(root: Path) -> None:
    """Delete temporaries left by a writer that was killed mid-save (its pid no longer runs)."""
    for path in root.glob("*.tmp-*"):
        pid = path.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _pid_alive(int(pid)):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0 only checks; PermissionError still means the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def list_checkpoints(root: str | Path) -> list[Path]:
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and CHECKPOINT_RE.match(p.name))


def resolve_checkpoint(path: str | Path) -> Path:
    """Accept a checkpoint dir, a checkpoints root (uses `latest`), or a run dir (uses checkpoints/latest)."""
    path = Path(path)
    for root in (path, path / "checkpoints"):
        if (root / "model.safetensors").is_file() and (root / "config.json").is_file():
            return root
        pointer = root / "latest"
        if pointer.is_file():
            target = root / pointer.read_text().strip()
            if (target / "model.safetensors").is_file():
                return target
        found = list_checkpoints(root)
        if found:
            return found[-1]
    raise FileNotFoundError(f"no checkpoint found at {str(path)!r} (expected model.safetensors + config.json, "
                            f"a 'latest' pointer, or step_* directories)")


def read_config(ckpt: Path) -> Config:
    return config_from_dict(json.loads((ckpt / "config.json").read_text(encoding="utf-8")))


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path)) if path.is_file() else {}


def read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def load_model(path: str | Path, device="cpu", dtype: torch.dtype = torch.float32):
    """(config, model) from any checkpoint written by fivefold (training run, import-hf, ...)."""
    from fivefold.model import Transformer, materialize

    ckpt = resolve_checkpoint(path)
    cfg = read_config(ckpt)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    materialize(model, device, seed=0, dtype=torch.float32)
    load_weights(model, read_tensors(ckpt / "model.safetensors"))
    model.to(dtype)
    model.reset_buffers()
    return cfg, model


@torch.no_grad()
def load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(weights))
    unexpected = sorted(set(weights) - set(params))
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, p in params.items():
        if weights[name].shape != p.shape:
            raise ValueError(f"checkpoint tensor {name} has shape {tuple(weights[name].shape)}, "
                             f"model expects {tuple(p.shape)}")
        p.copy_(weights[name])


def save_model(out_dir: str | Path, cfg: Config, model: torch.nn.Module) -> Path:
    """A weights-only checkpoint (used by import-hf): out_dir/step_00000000, with `latest`."""
    return write_checkpoint(out_dir, "step_00000000", cfg, model_state(model))
