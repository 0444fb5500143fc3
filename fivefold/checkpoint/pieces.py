"""The tensors of a checkpoint's state/: written and read by torch.distributed.checkpoint (DCP), each rank
its own rows. A `Piece` is a rank's rectangle of a larger tensor; DCP saves it under its offsets and
reads back, for any other layout's pieces, exactly the overlapping regions."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import torch

from fivefold.errors import CheckpointError


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


def write_tensors(state_dir: Path, tensors: dict[str, torch.Tensor]) -> None:
    dcp, _, Writer = _dcp()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's notes on its own deprecated collectives, "single process"
        dcp.save({k: v if isinstance(v, Piece) else v.detach() for k, v in tensors.items()},
                 storage_writer=Writer(str(state_dir), save_distributed=True))  # fsyncs each file


def describe(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        where = f" ({e.filename})" if e.filename else ""
        return f"{e.strerror}{where}"
    failures = getattr(e, "failures", None)  # torch.distributed.checkpoint's CheckpointException
    if failures:
        return "; ".join(dict.fromkeys(describe(f[0] if isinstance(f, tuple) else f) for f in failures.values()))
    return f"{type(e).__name__}: {e}"


def dcp_exception():
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    return CheckpointException


def read_state(ckpt: Path, tensors: dict[str, torch.Tensor], alone: bool = False) -> None:
    """Fill `tensors` (name -> plain tensor, or a Piece of this rank's) in place from `ckpt`; collectively
    with every rank, or `alone` (ranks reading different tensors at different times)."""
    dcp, Reader, _ = _dcp()
    try:
        available = set(Reader(str(ckpt / "state")).read_metadata().state_dict_metadata)
    except (Exception, dcp_exception()) as e:
        raise CheckpointError(f"checkpoint {ckpt} cannot be read: {describe(e)}") from e
    for key in sorted(set(tensors) - available):
        per_expert = _per_expert_targets(key, tensors[key], available)
        if per_expert is not None:
            tensors = {**{k: v for k, v in tensors.items() if k != key}, **per_expert}
    missing = sorted(set(tensors) - available)
    if missing:
        raise CheckpointError(f"checkpoint {ckpt} lacks {len(missing)} tensors the model needs, e.g. {missing[:3]}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process", etc.
            dcp.load(tensors, storage_reader=Reader(str(ckpt / "state")), no_dist=alone)
    except (Exception, dcp_exception()) as e:
        raise CheckpointError(f"checkpoint {ckpt} cannot be read: {describe(e)}") from e


_STACKED_EXPERT_KEY = re.compile(r"^(model|optim)\.(.+\.experts)\.(gate_proj|up_proj|down_proj)(\..+)?$")


def _per_expert_targets(key: str, target, available: set[str]) -> dict | None:
    """Checkpoints written before a mixture of experts' weights were stacked (fivefold before 7a0d6fa)
    hold each expert's matrix, and its Adam moments, under the expert's own name: the rows of the stacked
    `key` to read from them ({old key: row view}), or None where the checkpoint lacks them too."""
    match = _STACKED_EXPERT_KEY.match(key)
    if match is None:
        return None
    kind, prefix, proj, suffix = match.groups()
    piece = isinstance(target, Piece)
    local = target.local if piece else target
    first = target.offsets[0] if piece else 0
    out = {}
    for row in range(local.shape[0]):
        old = f"{kind}.{prefix}.{first + row}.{proj}.weight{suffix or ''}"
        if old not in available:
            return None
        out[old] = Piece(local[row], target.global_shape[1:], target.offsets[1:]) if piece else local[row]
    return out


class CheckpointWeights:
    """A value source for materialisation (fivefold.train.parallelize): each parameter's part (its placement's
    tensor-parallel slice) read from a checkpoint's fp32 weights, one parameter at a time, by each rank
    alone, so a rank never holds more than the slices it keeps."""

    def __init__(self, ckpt: Path):
        self.ckpt = ckpt

    def __call__(self, name: str, placement) -> torch.Tensor:
        local = torch.empty(placement.local_shape)
        target = Piece(local, placement.global_shape, placement.offsets) if placement.sharded else local
        read_state(self.ckpt, {f"model.{name}": target}, alone=True)
        return local
