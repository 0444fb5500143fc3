"""Router losses and routing statistics of a mixture-of-experts model over one training step."""

from __future__ import annotations

from typing import Callable

import torch


class RouterLosses:
    """Adds the router losses of MoE layers to the loss, averaged over the global batch's micro-batches
    like the token loss, and counts their routing into the step's record."""

    def __init__(self, num_experts: int, device: torch.device,
                 sum_over_model: Callable[[torch.Tensor], torch.Tensor]):
        self.num_experts, self.device, self.sum_over_model = num_experts, device, sum_over_model
        self.start_step(1)

    def start_step(self, micro_batches: int) -> None:
        """`micro_batches`: of the global batch, over every data-parallel rank."""
        self.micro_batches = micro_batches
        zero = torch.zeros((), dtype=torch.long, device=self.device)
        self.aux_loss = torch.zeros((), device=self.device)
        self.dropped, self.assignments = zero.clone(), zero.clone()
        self.tokens_per_expert = torch.zeros(self.num_experts, dtype=torch.long, device=self.device)

    def __call__(self, layers: list) -> torch.Tensor:
        """The router losses of `layers`' latest forward (to add to the micro-batch's loss)."""
        aux = sum(m.aux_loss for m in layers) / self.micro_batches
        self.aux_loss += aux.detach()
        for m in layers:
            self.tokens_per_expert += m.stats["tokens_per_expert"]
            self.dropped += m.stats["dropped"]
            self.assignments += m.stats["assignments"]
        return aux

    def record(self) -> dict:
        """The step's routing over all ranks: router loss, dropped assignments, and the most loaded
        expert's share relative to a perfectly even one (1.0)."""
        stats = self.sum_over_model(torch.cat([self.tokens_per_expert.double(),
                                               torch.stack([self.dropped, self.assignments]).double(),
                                               self.aux_loss.double().reshape(1)]))
        e = self.num_experts
        load, dropped, assignments = stats[:e], stats[e], stats[e + 1]
        return {"router_loss": stats[-1].item(), "moe_dropped_fraction": (dropped / assignments).item(),
                "moe_max_expert_load": (load.max() / load.mean()).item()}
