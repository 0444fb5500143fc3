"""Checkpoints: safetensors + JSON only (nothing is unpickled), sharded, written atomically, verified.

Layout of one checkpoint directory:
    config.json            the full config tree
    state/*.safetensors    model weights ("model.<name>", fp32: the masters under bf16-mixed) and Adam
                           moments ("optim.<name>.exp_avg", ".exp_avg_sq"), written by
                           torch.distributed.checkpoint: each rank writes the rows it owns, with their
                           offsets in the file header, so any layout (one process, dp=4 with ZeRO-3, ...)
                           reads back exactly its own rows. Replicated tensors are written once.
    trainer_state.json     step, tokens seen, schedulers, data sampler position
    tokenizer.json         the tokenizer the model was trained with (so generate needs nothing else)
    rng.safetensors        torch CPU (and CUDA) RNG states of rank 0
    manifest.json          every other file's size and xxh3-64 checksum; written last

A save writes everything into `<name>.tmp-<pid>` in the same directory (all ranks, on a shared file
system when multi-node), fsyncs it, then rank 0 renames it into place and finally swaps the `latest`
pointer with os.replace. A process killed at any moment leaves either the old or the new checkpoint
complete, never a half-written one under a final name. A save that fails (disk full, quota) removes its
temporary and raises CheckpointSaveError on every rank; the earlier checkpoints are untouched.

Loading verifies the manifest first (each rank checks a share of the files). A damaged checkpoint is
named with the file and what is wrong with it, and the newest intact one is used instead, with a
warning, unless fallback is turned off.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from fivefold.checkpoint.files import (HASH_NAME, digest_of, file_entry, fsync_dir, read_json, save_tensors,
                                       write_json)
from fivefold.checkpoint.pieces import dcp_exception, describe, write_tensors
from fivefold.config import Config, ConfigError
from fivefold.config_load import config_from_dict
from fivefold.errors import CheckpointError, CheckpointSaveError


CHECKPOINT_RE = re.compile(r"^step_(\d{8})$")
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
NO_MANIFEST = "is missing: the checkpoint is incomplete, or older than checksums"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def write_checkpoint(root: str | Path, name: str, cfg: Config, tensors: dict[str, torch.Tensor],
                     trainer_state: dict | None = None, rng: dict[str, torch.Tensor] | None = None,
                     keep: int | None = None, extra_files: dict[str, bytes] | None = None,
                     expected_bytes: int = 0) -> Path:
    """Atomically write checkpoint `root/name`, point `root/latest` at it, keep the newest `keep`.

    Under torch.distributed every rank calls this with its own `tensors` (Pieces for sharded ones,
    plain tensors for replicated ones); the JSON, RNG and extra files come from rank 0. `expected_bytes`
    (the whole checkpoint's size) is checked against the free space first. Any failure raises
    CheckpointSaveError on every rank, after the temporary directory is removed."""
    root = Path(root)
    final = root / name
    rank, world = _rank_world()
    tmp = root / f"{name}.tmp-{os.getpid()}"
    error = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            remove_abandoned(root)
            _check_free_space(root, expected_bytes)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        except OSError as e:
            error = describe(e)
    tmp, error = _from_rank0((tmp, error))  # every rank writes into rank 0's temporary directory
    if error is None:
        try:
            write_tensors(tmp / "state", tensors)
            files = sorted(str(p.relative_to(tmp)) for p in (tmp / "state").iterdir())
            entries = {f: file_entry(tmp / f) for f in files[rank::world]}
        except (Exception, dcp_exception()) as e:  # DCP raises the same failure on every rank
            error, entries = describe(e), {}
        error, entries = _merge(gather((error, entries)))
    if error is None and rank == 0:
        try:
            _publish(tmp, final, root, cfg, entries, trainer_state, rng, extra_files)
        except OSError as e:
            error = describe(e)
    error = _from_rank0(error)
    if error is not None:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointSaveError(f"could not save checkpoint {final}: {error}; the earlier checkpoints in "
                                  f"{root} are untouched")
    if rank == 0 and keep:
        for stale in list_checkpoints(root)[:-keep]:
            shutil.rmtree(stale, ignore_errors=True)
    if _distributed():
        dist.barrier()
    return final


def _publish(tmp: Path, final: Path, root: Path, cfg: Config, entries: dict, trainer_state, rng,
             extra_files) -> None:
    """Rank 0: the small files, then the manifest (last), then rename into place and swap `latest`."""
    write_json(tmp / "config.json", cfg.to_dict())
    small = ["config.json"]
    if rng is not None:
        save_tensors(tmp / "rng.safetensors", rng)
        small.append("rng.safetensors")
    if trainer_state is not None:
        write_json(tmp / "trainer_state.json", trainer_state)
        small.append("trainer_state.json")
    for filename, data in (extra_files or {}).items():
        with open(tmp / filename, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        small.append(filename)
    files = {**entries, **{f: file_entry(tmp / f) for f in small}}
    write_json(tmp / MANIFEST, {"format": MANIFEST_FORMAT, "hash": HASH_NAME, "files": files,
                                 "self": digest_of(files)})
    fsync_dir(tmp / "state")
    fsync_dir(tmp)
    if final.exists():  # re-saving the same step: move the old one aside first, then drop it
        old = root / f"{final.name}.old-{os.getpid()}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    pointer_tmp = root / f"latest.tmp-{os.getpid()}"
    pointer_tmp.write_text(final.name + "\n")
    os.replace(pointer_tmp, root / "latest")
    fsync_dir(root)


def _check_free_space(root: Path, expected_bytes: int) -> None:
    free = shutil.disk_usage(root).free
    needed = int(expected_bytes * 1.02) + 16 * 2**20  # headers, JSON, the tokenizer
    if expected_bytes and free < needed:
        raise OSError(errno.ENOSPC, f"not enough free space on {root}: the checkpoint needs about "
                                    f"{needed / 2**30:.2f} GiB, {free / 2**30:.2f} GiB are free. Free some space, "
                                    f"lower train.keep_checkpoints, or move train.out_dir")


# -- collectives over all ranks (identity in one process) -------------------------------------------
def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)


def _from_rank0(obj):
    if not _distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather(obj) -> list:
    """`obj` from every rank, in rank order ([obj] in one process)."""
    if not _distributed():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _merge(results: list[tuple[str | None, dict]]) -> tuple[str | None, dict]:
    errors = [e for e, _ in results if e is not None]
    merged = {}
    for _, entries in results:
        merged.update(entries)
    return (errors[0] if errors else None), merged


def read_manifest(ckpt: Path) -> dict | None:
    """The manifest's file table; None for a checkpoint written before fivefold recorded checksums.
    Raises CheckpointError when the manifest itself is damaged."""
    path = ckpt / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        files = manifest["files"]
        ok = manifest.get("hash") == HASH_NAME and manifest["self"] == digest_of(files)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        ok = False
    if not ok:
        raise CheckpointError(f"{path} is damaged (not the manifest fivefold wrote)")
    return files


def verify_checkpoint(ckpt: Path, share: tuple[int, int] = (0, 1)) -> list[str]:
    """What is wrong with checkpoint `ckpt` (empty: intact), checking rank `share[0]`'s share of its
    files out of `share[1]` ranks. Every problem names the file."""
    ckpt = Path(ckpt)
    try:
        files = read_manifest(ckpt)
    except CheckpointError as e:
        return [str(e)]
    if files is None:
        if not (ckpt / "state").is_dir() or not (ckpt / "config.json").is_file():
            return [f"{ckpt} is not a complete checkpoint (no manifest.json, state/ or config.json)"]
        return [f"{ckpt / MANIFEST} {NO_MANIFEST}"]
    problems = []
    rank, world = share
    for name in sorted(files)[rank::world]:
        path, expected = ckpt / name, files[name]
        size = path.stat().st_size if path.is_file() else None
        if size is None:
            problems.append(f"{path} is missing")
        elif size != expected["size"]:
            problems.append(f"{path} has {size} bytes, {expected['size']} were written (truncated or overwritten)")
        elif file_entry(path)[HASH_NAME] != expected[HASH_NAME]:
            problems.append(f"{path} does not match its checksum (its bytes changed after it was written)")
    return problems


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped or loaded unverified; the run goes on."""


def checkpoint_candidates(root: Path) -> list[Path]:
    """The checkpoints under `root`, the one `latest` names first, then the others newest first."""
    found = list_checkpoints(root)[::-1]
    pointer = root / "latest"
    if pointer.is_file():
        try:
            target = root / pointer.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            target = None
        if target in found:
            found.remove(target)
            found.insert(0, target)
    return found


def _unverifiable(problems: list[str]) -> bool:
    return len(problems) == 1 and problems[0].endswith(NO_MANIFEST)


def _warn_unverified(path: Path) -> None:
    warnings.warn(f"checkpoint {path} has no manifest.json (written by a fivefold older than checksums): it is "
                  f"loaded without verifying its files", CheckpointWarning, stacklevel=3)


def find_intact(root: Path, fallback: bool = True, verify=verify_checkpoint) -> Path:
    """The newest intact checkpoint under `root` (a `step_*` parent). A damaged newer one is skipped with
    a warning naming the bad file; with `fallback=False` it is an error instead. A checkpoint without a
    manifest counts as damaged, unless no checkpoint there has one (all written before checksums): then
    the newest is used, unverified, with a warning. `verify(path)` returns the problems found
    (collectively under torch.distributed)."""
    damaged = []
    for candidate in checkpoint_candidates(root):
        problems = verify(candidate)
        if not problems:
            for path, found in damaged:
                warnings.warn(f"checkpoint {path} is damaged: {found[0]}; using {candidate.name} instead",
                              CheckpointWarning, stacklevel=2)
            return candidate
        if not fallback:
            raise CheckpointError(f"checkpoint {candidate} is damaged: {problems[0]}; to resume from the newest "
                                  f"intact checkpoint instead, drop --no-fallback (train.checkpoint_fallback=true)")
        damaged.append((candidate, problems))
    if damaged and all(_unverifiable(found) for _, found in damaged):
        _warn_unverified(damaged[0][0])
        return damaged[0][0]
    if damaged:
        detail = "; ".join(f"{found[0]}" for _, found in damaged)
        raise CheckpointError(f"no intact checkpoint under {root}: {detail}. Train from scratch with --overwrite, "
                              f"or restore a copy of a checkpoint")
    raise FileNotFoundError(f"no checkpoint found under {str(root)!r}")


def remove_abandoned(root: Path) -> None:
    """Delete what a writer killed mid-save left behind (temporaries, a checkpoint moved aside), once
    the pid in its name no longer runs."""
    for path in [*root.glob("*.tmp-*"), *root.glob("*.old-*")]:
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


def is_checkpoint_dir(path: Path) -> bool:
    return (path / "state").is_dir() and (path / "config.json").is_file()


def resolve_checkpoint(path: str | Path, fallback: bool = True) -> Path:
    """A verified checkpoint from a checkpoint dir, a checkpoints root (its newest intact one) or a run
    dir (the same under checkpoints/). A checkpoint named directly must be intact; under a root a damaged
    newer one is skipped with a warning (unless `fallback` is False)."""
    path = Path(path)
    if is_checkpoint_dir(path):
        problems = _verified(path)
        if _unverifiable(problems):
            _warn_unverified(path)
        elif problems:
            raise CheckpointError(f"checkpoint {path} is damaged: {problems[0]}; give another checkpoint, or its "
                                  f"run directory to use the newest intact one")
        return path
    for root in (path, path / "checkpoints"):
        if checkpoint_candidates(root):
            return find_intact(root, fallback, _verified)
    raise FileNotFoundError(f"no checkpoint found at {str(path)!r} (expected state/ + config.json, "
                            f"a 'latest' pointer, or step_* directories)")


_VERIFIED: dict[tuple[str, int], list[str]] = {}


def _verified(path: Path) -> list[str]:
    """verify_checkpoint, remembered per manifest version: a process that resolves the same checkpoint
    twice (the tokenizer, then the weights) reads it once."""
    manifest = path / MANIFEST
    key = (str(path.resolve()), manifest.stat().st_mtime_ns if manifest.is_file() else 0)
    if key not in _VERIFIED:
        _VERIFIED[key] = verify_checkpoint(path)
    return _VERIFIED[key]


def read_config(ckpt: Path) -> Config:
    values = read_json(ckpt / "config.json", missing_ok=False)
    try:
        return config_from_dict(values)
    except ConfigError as e:
        raise CheckpointError(f"{ckpt / 'config.json'} does not hold a valid config: {e}") from None


@torch.no_grad()
def load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(weights))
    unexpected = sorted(set(weights) - set(params))
    if missing or unexpected:
        raise CheckpointError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, p in params.items():
        if weights[name].shape != p.shape:
            raise CheckpointError(f"checkpoint tensor {name} has shape {tuple(weights[name].shape)}, "
                                  f"model expects {tuple(p.shape)}")
        p.copy_(weights[name])


def save_model(out_dir: str | Path, cfg: Config, model: torch.nn.Module,
               extra_files: dict[str, bytes] | None = None) -> Path:
    """A weights-only checkpoint (used by import-hf): out_dir/step_00000000, with `latest`. `extra_files`
    (e.g. the tokenizer) are renamed into place with the weights: never one model's weights with
    another's tokenizer."""
    weights = {f"model.{n}": p.detach().float() for n, p in model.named_parameters()}
    return write_checkpoint(out_dir, "step_00000000", cfg, weights, extra_files=extra_files,
                            expected_bytes=sum(w.numel() * w.element_size() for w in weights.values()))
