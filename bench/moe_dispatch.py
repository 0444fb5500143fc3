"""A mixture of experts' dispatch traffic: the speed model's count against a measured step on this machine.

LocalDispatch (fivefold/model/moe.py) runs forward and backward with the experts' matmuls left out (the
experts return their input), so what is timed is what the model charges as memory traffic: the gather
of the routed tokens, the gate weighting, index_add and their backwards (plus the argsort and counts the
model does not charge). The prediction is fivefold.planner.speed's eager count at the memory bandwidth
`fivefold calibrate` measured (bench/results/planner_cpu.json, written by bench/planner_cpu.py on this
machine), beside the count it replaced (one copy and a weighting per routed element).

    OMP_NUM_THREADS=1 python bench/moe_dispatch.py        # ~10 s, quiet machine
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fivefold.model.moe import LocalDispatch  # noqa: E402
from fivefold.planner.speed import UNFUSED  # noqa: E402


class _NoMatmuls:
    """Stands in for a MoE layer: routing to `num_experts`, experts that return their input."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    @staticmethod
    def experts(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--profile", default=str(ROOT / "bench/results/planner_cpu.json"))
    args = parser.parse_args()
    profile = json.loads(Path(args.profile).read_text())["profile"]
    bandwidth = profile["memory_bandwidth"] * profile["memory_efficiency"]
    T, k, h = args.tokens, args.k, args.hidden
    layer, dispatch = _NoMatmuls(args.experts), LocalDispatch()
    torch.manual_seed(0)
    times = []
    for _ in range(args.repeats):
        tokens = torch.randn(T, h, requires_grad=True)
        expert_ids = torch.randint(0, args.experts, (T * k,))
        token_ids = torch.arange(T).repeat_interleave(k)
        weights = torch.rand(T * k, requires_grad=True)
        start = time.perf_counter()
        out = dispatch(layer, tokens, expert_ids, token_ids, weights)
        out.backward(torch.ones_like(out))
        times.append(time.perf_counter() - start)
    measured = min(times[2:])  # outside load only slows a run down; the first ones warm up

    # Forward + backward (twice the forward's bytes), fp32: 4 bytes an element.
    def seconds(per_routed: float, per_output: float) -> float:
        return 3 * 4 * (per_routed * T * k * h + per_output * T * h) / bandwidth

    rows = {"model (permute 7, combine 3)": seconds(UNFUSED["permute"][0], UNFUSED["combine"][0]),
            "count it replaced (permute 5)": seconds(5, 0)}
    print(f"LocalDispatch, T={T} k={k} h={h} fp32, forward + backward without the experts' matmuls; "
          f"memory bandwidth {bandwidth / 1e9:.1f} GB/s (calibrated x efficiency)")
    print(f"  measured {measured * 1e3:8.1f} ms")
    for name, value in rows.items():
        print(f"  {name:30s} {value * 1e3:8.1f} ms   predicted / measured {value / measured:.2f}")


if __name__ == "__main__":
    main()
