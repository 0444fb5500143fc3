"""Checkpoints: safetensors + JSON only (nothing is unpickled), sharded, written atomically.

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

A save writes everything into `<name>.tmp-<pid>` in the same directory (all ranks, on a shared file
system when multi-node), fsyncs it, then rank 0 renames it into place and finally swaps the `latest`
pointer with os.replace. A process killed at any moment leaves either the old or the new checkpoint
complete, never a half-written one under a final name.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
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


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _dcp():
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader, HuggingFaceStorageWriter

    return dcp, HuggingFaceStorageReader, HuggingFaceStorageWriter


class Piece(torch.Tensor):
    """A rank's rectangular piece of a larger tensor: a view of the local tensor that also knows the
    global shape and where the piece sits in it. torch.distributed.checkpoint saves each piece under its
    offsets and reads back, for any other layout's pieces, exactly the overlapping regions, through the
    same three hooks DTensor implements. Pieces are what ZeRO rows of tensor-parallel shards are; an
    arbitrary (shard dim, then rows) nesting that DTensor placements cannot express."""

    @staticmethod
    def __new__(cls, local: torch.Tensor, global_shape, offsets):
        # A wrapper (no storage of its own) whose size is the global one, as DCP's planners check.
        piece = torch.Tensor._make_wrapper_subclass(cls, torch.Size(global_shape), dtype=local.dtype,
                                                    device=local.device)
        piece.global_shape, piece.offsets = torch.Size(global_shape), torch.Size(offsets)
        piece.local = local.detach()
        return piece

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError(f"a checkpoint Piece only carries a shard for saving and loading, not for {func}")

    def __create_write_items__(self, fqn: str, obj):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [WriteItem(index=MetadataIndex(fqn, self.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=self.offsets, sizes=self.local.shape),
                              properties=TensorProperties.create_from_tensor(self.local),
                              size=self.global_shape))]

    def __create_chunk_list__(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=self.offsets, sizes=self.local.shape)]

    def __get_tensor_shard__(self, index):
        return self.local


def write_checkpoint(root: str | Path, name: str, cfg: Config, tensors: dict[str, torch.Tensor],
                     trainer_state: dict | None = None, rng: dict[str, torch.Tensor] | None = None,
                     keep: int | None = None, extra_files: dict[str, bytes] | None = None) -> Path:
    """Atomically write checkpoint `root/name`, point `root/latest` at it, keep the newest `keep`.

    Under torch.distributed every rank calls this with its own `tensors` (Pieces for sharded ones,
    plain tensors for replicated ones); the JSON, RNG and extra files come from rank 0."""
    root = Path(root)
    final = root / name
    main = not _distributed() or dist.get_rank() == 0
    tmp = [root / f"{name}.tmp-{os.getpid()}"]
    if main:
        root.mkdir(parents=True, exist_ok=True)
        if tmp[0].exists():
            shutil.rmtree(tmp[0])
        tmp[0].mkdir()
    if _distributed():
        dist.broadcast_object_list(tmp, src=0)  # every rank writes into rank 0's temporary directory
    tmp = tmp[0]
    dcp, _, Writer = _dcp()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's notes on its own deprecated collectives, "single process"
        dcp.save({k: v if isinstance(v, Piece) else v.detach() for k, v in tensors.items()},
                 storage_writer=Writer(str(tmp / "state"), save_distributed=True))  # fsyncs each file
    if not main:
        dist.barrier()  # rank 0 publishes
        return final
    _write_json(tmp / "config.json", cfg.to_dict())
    if rng is not None:
        _save_tensors(tmp / "rng.safetensors", rng)
    if trainer_state is not None:
        _write_json(tmp / "trainer_state.json", trainer_state)
    for filename, data in (extra_files or {}).items():
        with open(tmp / filename, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    _fsync_dir(tmp / "state")
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
    if _distributed():
        dist.barrier()
    return final


def read_state(ckpt: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Fill `tensors` (name -> plain tensor, or a Piece of this rank's) in place from `ckpt`."""
    dcp, Reader, _ = _dcp()
    available = set(Reader(str(ckpt / "state")).read_metadata().state_dict_metadata)
    missing = sorted(set(tensors) - available)
    if missing:
        raise ValueError(f"checkpoint {ckpt} lacks {len(missing)} tensors the model needs, e.g. {missing[:3]}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process", etc.
        dcp.load(tensors, storage_reader=Reader(str(ckpt / "state")))


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
        if (root / "state").is_dir() and (root / "config.json").is_file():
            return root
        pointer = root / "latest"
        if pointer.is_file():
            target = root / pointer.read_text().strip()
            if (target / "state").is_dir():
                return target
        found = list_checkpoints(root)
        if found:
            return found[-1]
    raise FileNotFoundError(f"no checkpoint found at {str(path)!r} (expected state/ + config.json, "
                            f"a 'latest' pointer, or step_* directories)")


def read_config(ckpt: Path) -> Config:
    return config_from_dict(json.loads((ckpt / "config.json").read_text(encoding="utf-8")))


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path)) if path.is_file() else {}


def read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def load_model(path: str | Path, device="cpu", dtype: torch.dtype = torch.float32):
    """(config, model) from any checkpoint written by fivefold (training run under any layout, import-hf)."""
    from fivefold.model import Transformer, materialize

    ckpt = resolve_checkpoint(path)
    cfg = read_config(ckpt)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    materialize(model, device, seed=0, dtype=torch.float32)
    with torch.no_grad():
        read_state(ckpt, {f"model.{n}": p for n, p in model.named_parameters()})
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


def save_model(out_dir: str | Path, cfg: Config, model: torch.nn.Module,
               extra_files: dict[str, bytes] | None = None) -> Path:
    """A weights-only checkpoint (used by import-hf): out_dir/step_00000000, with `latest`. `extra_files`
    (e.g. the tokenizer) are renamed into place with the weights: never one model's weights with
    another's tokenizer."""
    weights = {f"model.{n}": p.detach().float() for n, p in model.named_parameters()}
    return write_checkpoint(out_dir, "step_00000000", cfg, weights, extra_files=extra_files)
