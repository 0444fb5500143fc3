"""The process layout: every process group a run uses and this rank's coordinates, on DeviceMesh.

The layout is checked (fivefold.parallel.rules) against the launched world size *before* any process
group starts, so a mismatch is a clear error instead of a hang.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from fivefold.config import Config, ConfigError
from fivefold.kernels import check_usable
from fivefold.parallel.expert_parallel import expert_groups
from fivefold.parallel.rules import check_layout
from fivefold.train.fp8 import torchao_missing

# Collectives that wait longer than this fail (and torchrun tears the job down) instead of hanging.
COLLECTIVE_TIMEOUT = timedelta(seconds=int(os.environ.get("FIVEFOLD_COLLECTIVE_TIMEOUT", "120")))


@dataclass
class Mesh:
    rank: int = 0
    world_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    dp_group: dist.ProcessGroup | None = None
    tp_rank: int = 0
    tp_size: int = 1
    tp_group: dist.ProcessGroup | None = None
    pp_rank: int = 0
    pp_size: int = 1
    pp_group: dist.ProcessGroup | None = None
    cp_rank: int = 0
    cp_size: int = 1
    cp_group: dist.ProcessGroup | None = None
    # Gradients are summed over dp x cp (context-parallel ranks hold different tokens of the same rows).
    grad_rank: int = 0
    grad_size: int = 1
    grad_group: dist.ProcessGroup | None = None
    grad_mesh: object = None
    ep_size: int = 1
    ep_group: dist.ProcessGroup | None = None
    expert_grad_group: dist.ProcessGroup | None = None  # ranks holding the same experts
    device_mesh: object = None  # torch.distributed.device_mesh.DeviceMesh ("dp", "tp") when distributed

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


def exit_worker(code: int = 0) -> None:
    """End a torchrun worker that finished cleanly: wait for the others, tear the process group down,
    and leave without interpreter finalization. Finalizing after gloo has run (even after
    destroy_process_group) sometimes destroys a still-joinable C++ thread, which aborts the process
    ("terminate called without an active exception", SIGABRT) and fails a job whose work is done."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def leave_failed_worker(code: int) -> None:
    """End a torchrun worker whose command failed, without interpreter finalization, for the reason
    exit_worker gives (gloo's threads can abort the process at finalization, turning an exit 2 with a
    one-line error into a SIGABRT). No barrier: the other ranks may be anywhere. A single process returns."""
    if dist.is_available() and dist.is_initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def launched_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_supported(cfg: Config, world_size: int | None = None) -> None:
    """The layout's rules (fivefold.parallel.rules: the same check `fivefold plan` and the layout search
    make), then what this machine must have for it: the one place availability is asked."""
    check_layout(cfg, world_size)
    if cfg.train.kernels == "triton":
        check_usable()
    if cfg.train.precision == "fp8":
        missing = torchao_missing()
        if missing:
            raise ConfigError(f"train.precision=fp8 runs torchao's float8 linears: {missing}; or use "
                              f"train.precision=bf16-mixed")


def init_mesh(cfg: Config, device: torch.device) -> Mesh:
    """Validate against the launched world, then start the process group (gloo on CPU, NCCL on CUDA)."""
    world = launched_world_size()
    if world > 1 and cfg.parallel.dp == 1 and cfg.parallel.world_size == 1:
        cfg.parallel.dp = world  # `--nproc N` with no explicit layout means data parallel over N
    check_supported(cfg, world)
    if world == 1:
        return Mesh()
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=COLLECTIVE_TIMEOUT)
    from torch.distributed.device_mesh import init_device_mesh

    # tp innermost (a tensor-parallel group is consecutive ranks, on one machine when it fits), pp outermost.
    p = cfg.parallel
    device_mesh = init_device_mesh(device.type, (p.pp, p.dp, p.cp, p.tp), mesh_dim_names=("pp", "dp", "cp", "tp"))
    grad_mesh = device_mesh["dp"] if p.cp == 1 else device_mesh["dp", "cp"]._flatten("dp_cp")
    return Mesh(rank=dist.get_rank(), world_size=world, dp_rank=device_mesh.get_local_rank("dp"),
                dp_size=p.dp, dp_group=device_mesh.get_group("dp"),
                tp_rank=device_mesh.get_local_rank("tp"), tp_size=p.tp, tp_group=device_mesh.get_group("tp"),
                pp_rank=device_mesh.get_local_rank("pp"), pp_size=p.pp, pp_group=device_mesh.get_group("pp"),
                cp_rank=device_mesh.get_local_rank("cp"), cp_size=p.cp, cp_group=device_mesh.get_group("cp"),
                grad_rank=grad_mesh.get_local_rank(), grad_size=p.dp * p.cp, grad_group=grad_mesh.get_group(),
                grad_mesh=grad_mesh, device_mesh=device_mesh, **_expert_groups(p, device_mesh))


def resolve_device(name: str, option: str = "train.device") -> torch.device:
    """train.device (or a command's --device) as a torch device: auto is cuda where there is one.

    `option` is how the user gave the name, so the error quotes what they typed."""
    given, use = (f"{option} {name}", f"{option} ") if option.startswith("--") else (f"{option}={name!r}", f"{option}=")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"{given} is not a device; use auto, cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"{given}: fivefold runs on cpu or cuda; use auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{given} but CUDA is not available; use {use}cpu or {use}auto")
    return device


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a CUDA GPU's; nothing to wait for on a CPU): before reading a clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def local_device(device: torch.device) -> torch.device:
    """One GPU per process: cuda:LOCAL_RANK under torchrun."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


def _expert_groups(p, device_mesh) -> dict:
    if p.ep == 1:
        return {}
    mine = (None, None)
    for stage in range(p.pp):  # each pipeline stage has its own expert groups
        groups = expert_groups(device_mesh.mesh[stage], p.ep)
        mine = groups if groups[0] is not None else mine
    return {"ep_size": p.ep, "ep_group": mine[0], "expert_grad_group": mine[1]}
