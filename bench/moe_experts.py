"""A mixture-of-experts layer's experts: one grouped matmul per projection against the loop fallback and
against the per-expert modules they replaced, in the same process on the same routed tokens.

The three sides hold the same weights and get the same tokens, routing and gradient:
  * grouped:    fivefold's GroupedExperts, tokens sorted by expert, F.grouped_mm per projection;
  * loop:       the same module with `grouped = False`: the sorted tokens split per expert, E matmuls each;
  * per-expert: one nn.Linear SwiGLU MLP per expert in an nn.ModuleList, each expert picking its tokens
                with a boolean mask and adding its weighted output back with index_add (fivefold's MoE
                before the experts were stacked, commit 2fa0306).
Each side runs forward + backward of the experts and the token gather / scatter around them (the router
is outside the timing: the same for all three). Outputs and gradients are checked equal first; then each
side is timed in turn, round-robin, and the median per side is printed with the ratio to per-expert.

    OMP_NUM_THREADS=2 python bench/moe_experts.py [--experts 8 64] [--tokens 4096] [--hidden 512]
        [--width 1024] [--k 2] [--dtype float32|bfloat16] [--device cpu|cuda] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.model.moe import GroupedExperts, LocalDispatch, _grouped_mm_supported


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, nargs="+", default=[8, 64])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--width", type=int, default=1024, help="each expert's hidden width f")
    p.add_argument("--k", type=int, default=2, help="experts per token")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", default="")
    return p.parse_args(argv)


class PerExpertModules(nn.Module):
    """The replaced layout: each expert its own SwiGLU MLP, run on the tokens a mask picks."""

    def __init__(self, stacked: GroupedExperts):
        super().__init__()
        self.experts = nn.ModuleList()
        for gate, up, down in zip(stacked.gate_proj, stacked.up_proj, stacked.down_proj):
            mlp = nn.Module()
            mlp.gate_proj, mlp.up_proj, mlp.down_proj = (nn.Linear(w.shape[1], w.shape[0], bias=False,
                                                                   device=w.device, dtype=w.dtype)
                                                         for w in (gate, up, down))
            with torch.no_grad():
                mlp.gate_proj.weight.copy_(gate), mlp.up_proj.weight.copy_(up), mlp.down_proj.weight.copy_(down)
            self.experts.append(mlp)

    def forward(self, tokens, expert_ids, token_ids, weights):
        out = torch.zeros_like(tokens)
        for e, mlp in enumerate(self.experts):
            mine = expert_ids == e
            if mine.any():
                rows = token_ids[mine]
                x = tokens[rows]
                y = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
                out.index_add_(0, rows, y * weights[mine, None].to(tokens.dtype))
        return out


def measure(args, num_experts: int) -> dict:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    experts = GroupedExperts(num_experts, args.hidden, args.width).to(device, dtype)
    reference = PerExpertModules(experts)
    layer = SimpleNamespace(experts=experts, num_experts=num_experts)  # what MoE's dispatch reads of its layer
    tokens = torch.randn(args.tokens, args.hidden, generator=gen).to(device, dtype)
    logits = torch.randn(args.tokens, num_experts, generator=gen).to(device)
    top, chosen = logits.topk(args.k, dim=-1)
    expert_ids, weights = chosen.flatten(), top.softmax(-1).flatten()
    token_ids = torch.arange(args.tokens, device=device).repeat_interleave(args.k)
    grad = torch.randn(args.tokens, args.hidden, generator=gen).to(device, dtype)

    def step(side: str):
        x = tokens.detach().requires_grad_()
        if side == "per-expert":
            y = reference(x, expert_ids, token_ids, weights)
        else:
            experts.grouped = side == "grouped"
            y = LocalDispatch()(layer, x, expert_ids, token_ids, weights)
        y.backward(grad)
        return y.detach(), x.grad

    sides = ["grouped", "loop", "per-expert"]
    results = {}
    for side in sides:  # correctness first, and a warm-up
        for p in [*experts.parameters(), *reference.parameters()]:
            p.grad = None
        y, gx = step(side)
        wgrad = (experts.gate_proj.grad if side != "per-expert" else
                 torch.stack([m.gate_proj.weight.grad for m in reference.experts]))
        results[side] = (y, gx, wgrad)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    for side in ("grouped", "loop"):
        for ours, ref in zip(results[side], results["per-expert"]):
            torch.testing.assert_close(ours.float(), ref.float(), **tol)
    times = {side: [] for side in sides}
    for _ in range(args.repeats):
        for side in sides:
            for p in [*experts.parameters(), *reference.parameters()]:
                p.grad = None
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            step(side)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[side].append(time.perf_counter() - start)
    median = {side: statistics.median(t) for side, t in times.items()}
    flops = 3 * 2 * 3 * args.tokens * args.k * args.hidden * args.width  # 3 matmuls, fwd + 2x bwd
    return {"experts": num_experts, "grouped_mm_used": _grouped_mm_supported(tokens, *experts.parameters()),
            "seconds": median, "tflops": {s: flops / t / 1e12 for s, t in median.items()},
            "speedup_vs_per_expert": {s: median["per-expert"] / t for s, t in median.items()}}


def main(argv=None):
    args = parse_args(argv)
    print(f"{args.tokens} tokens x top-{args.k}, hidden {args.hidden}, expert width {args.width}, {args.dtype} "
          f"on {args.device} (torch {torch.__version__}, {torch.get_num_threads()} threads); forward + backward")
    print(f"{'experts':>7} {'grouped mm':>10} {'grouped':>9} {'loop':>9} {'per-expert':>10} "
          f"{'grouped vs per-expert':>22} {'loop vs per-expert':>19}")
    rows = []
    for num_experts in args.experts:
        row = measure(args, num_experts)
        s, x = row["seconds"], row["speedup_vs_per_expert"]
        print(f"{num_experts:>7} {str(row['grouped_mm_used']):>10} {s['grouped'] * 1e3:>7.1f}ms "
              f"{s['loop'] * 1e3:>7.1f}ms {s['per-expert'] * 1e3:>8.1f}ms {x['grouped']:>21.2f}x {x['loop']:>18.2f}x")
        rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
