"""The checkpoint's files one at a time: written and fsynced (so a rename publishes complete bytes), read
back with a CheckpointError naming a file that is not what it should be, and hashed for the manifest."""

from __future__ import annotations

import contextlib
import json
import mmap
import os
from pathlib import Path
from typing import Any

import torch
import xxhash
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from fivefold.errors import CheckpointError

HASH_NAME = "xxh3_64"  # about 11 GB/s on one core (bench/checkpoint_verify.py measures the choices)
HASH_CHUNK = 16 * 2**20


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path))
    with open(path, "rb") as f:
        os.fsync(f.fileno())


# -- integrity ---------------------------------------------------------------------------------------
def file_entry(path: Path) -> dict:
    """Size and checksum of one file. The file is mapped rather than read: hashing the page cache in place
    is 4x faster than copying it out in chunks (bench/checkpoint_verify.py), and a shard larger than free
    memory is paged through, never held."""
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        try:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else contextlib.nullcontext(b"") as view:
                h.update(view)
        except (OSError, ValueError):  # a file system without mmap: read it in chunks
            f.seek(0)
            while chunk := f.read(HASH_CHUNK):
                h.update(chunk)
    return {"size": size, HASH_NAME: h.hexdigest()}


def digest_of(files: dict) -> str:
    return xxhash.xxh3_64(json.dumps(files, sort_keys=True).encode()).hexdigest()


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        return {}
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file ({e})") from None


def read_json(path: Path, missing_ok: bool = True) -> dict:
    """A JSON object from a checkpoint or model directory ({} for a missing file when `missing_ok`); a file
    that is not one is a CheckpointError naming it."""
    if not path.is_file():
        if missing_ok:
            return {}
        raise FileNotFoundError(f"{path} does not exist")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} holds a {type(value).__name__}, not a JSON object")
    return value
