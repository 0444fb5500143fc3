"""Run under torchrun by tests/test_moe.py: a mixture-of-experts layer with its experts spread over the
ranks (all-to-all dispatch and combine) against the same layer with every expert local, in float64:
outputs, input gradients, router gradients and each expert's gradient (summed over the ranks whose
tokens it served)."""

import torch
import torch.distributed as dist

from fivefold.config_load import load_config
from fivefold.model.moe import MoE
from fivefold.parallel.expert_parallel import apply_expert_parallel
from fivefold.parallel.mesh import exit_worker

TOL = dict(rtol=1e-10, atol=1e-12)


def check(a, b, what):
    if not torch.allclose(a, b, **TOL):
        raise AssertionError(f"rank {dist.get_rank()}: {what} differs by {(a - b).abs().max().item():.3e}")


if __name__ == "__main__":
    dist.init_process_group("gloo")
    ep, rank = dist.get_world_size(), dist.get_rank()
    for capacity in (0.0, 1.0):
        cfg = load_config(preset="tiny-moe", overrides=[f"model.capacity_factor={capacity}",
                                                        "model.shared_expert_size=32"]).model
        torch.manual_seed(0)
        ref = MoE(cfg).double()
        torch.manual_seed(0)
        moe = MoE(cfg).double()
        holder = torch.nn.Module()
        holder.moe = moe
        apply_expert_parallel(holder, dist.group.WORLD)
        x = torch.randn(3, 16, cfg.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
        x_ref, x_ep = x.clone().requires_grad_(), x.clone().requires_grad_()
        y_ref, y = ref(x_ref), moe(x_ep)
        check(y, y_ref, f"output (capacity {capacity})")
        grad = torch.randn_like(y)
        (y_ref * grad).sum().backward()
        (y * grad).sum().backward()
        check(x_ep.grad, x_ref.grad, "input gradient")
        check(moe.router.weight.grad, ref.router.weight.grad, "router gradient")
        check(moe.shared_expert.down_proj.weight.grad, ref.shared_expert.down_proj.weight.grad, "shared expert")
        per_rank = cfg.num_experts // ep
        for name in ("gate_proj", "up_proj", "down_proj"):
            total = getattr(ref.experts, name).grad.clone()
            dist.all_reduce(total)  # each expert's owner served every rank's tokens
            mine = getattr(moe.experts, name).grad
            check(mine, total[rank * per_rank:(rank + 1) * per_rank], f"experts {name}")
    dist.barrier()
    if rank == 0:
        print("expert-parallel dispatch matches local experts")
    exit_worker()
