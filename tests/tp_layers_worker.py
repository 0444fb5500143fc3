"""Run under torchrun by tests/test_tensor_parallel.py: each tensor-parallel layer, and a whole model,
against its unsharded self in float64 (so any real difference stands out of rounding): outputs, input
gradients and weight gradients (each rank's shard against the same slice of the full gradient)."""

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fivefold.config_load import load_config
from fivefold.model import build_model
from fivefold.parallel import tensor_parallel as tpl
from fivefold.parallel.mesh import exit_worker

TOL = dict(rtol=1e-10, atol=1e-12)


def close(a, b, what):
    if not torch.allclose(a, b, **TOL):
        raise AssertionError(f"rank {dist.get_rank()}: {what} differs by {(a - b).abs().max().item():.3e}")


def seq_part(x, rank, tp):
    return x.chunk(tp, dim=1)[rank]


def check_linears(group, rank, tp, sp):
    torch.manual_seed(0)
    full_in, hidden, out = 8, 16, 12
    for kind in ("column", "row"):
        ref = nn.Linear(full_in if kind == "column" else hidden, out if kind == "column" else full_in,
                        bias=True, dtype=torch.float64)
        x = torch.randn(2, 4 * tp, ref.in_features, dtype=torch.float64)
        if kind == "column":
            layer = tpl.ColumnParallelLinear(ref, group, "gather" if sp else "copy")
        else:
            layer = tpl.RowParallelLinear(ref, group, sp)
        if kind == "row":  # its input is the column-parallel output: this rank's feature slice
            mine = x.chunk(tp, dim=-1)[rank]
        else:
            mine = seq_part(x, rank, tp) if sp else x
        mine = mine.detach().clone().requires_grad_()
        x = x.detach().clone().requires_grad_()
        y_ref, y = ref(x), layer(mine)
        if kind == "column":
            close(y, y_ref.chunk(tp, dim=-1)[rank], "column output")
        else:
            close(y, seq_part(y_ref, rank, tp) if sp else y_ref, "row output")
        grad = torch.randn_like(y_ref)
        y_ref.backward(grad)
        y.backward(grad.chunk(tp, dim=-1)[rank] if kind == "column" else (seq_part(grad, rank, tp) if sp else grad))
        if kind == "column":
            close(mine.grad, seq_part(x.grad, rank, tp) if sp else x.grad, "column input grad")
            close(layer.weight.grad, ref.weight.grad.chunk(tp, dim=0)[rank], "column weight grad")
            close(layer.bias.grad, ref.bias.grad.chunk(tp)[rank], "column bias grad")
        else:
            close(mine.grad, x.grad.chunk(tp, dim=-1)[rank], "row input grad")
            close(layer.weight.grad, ref.weight.grad.chunk(tp, dim=1)[rank], "row weight grad")
            bias_grad = layer.bias.grad.clone()
            if sp:  # each rank's bias gradient covers its part of the sequence
                dist.all_reduce(bias_grad, group=group)
            close(bias_grad, ref.bias.grad, "row bias grad")


def check_embedding_and_loss(group, rank, tp):
    torch.manual_seed(1)
    vocab, hidden = 8 * tp, 6
    ref = nn.Embedding(vocab, hidden, dtype=torch.float64)
    layer = tpl.VocabParallelEmbedding(ref, group)
    ids = torch.randint(0, vocab, (3, 5))
    close(layer(ids), ref(ids), "embedding output")
    grad = torch.randn(3, 5, hidden, dtype=torch.float64)
    ref(ids).backward(grad)
    layer(ids).backward(grad)
    close(layer.weight.grad, ref.weight.grad.chunk(tp)[rank], "embedding weight grad")

    logits = torch.randn(10, vocab, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, vocab, (10,))
    labels[3] = -100
    ref_loss = F.cross_entropy(logits, labels, ignore_index=-100, reduction="none")
    mine = logits.detach().chunk(tp, dim=-1)[rank].clone().requires_grad_()
    loss = tpl.vocab_parallel_cross_entropy(mine, labels, rank * (vocab // tp), group)
    close(loss.double(), ref_loss, "vocab-parallel cross-entropy")
    weights = torch.rand(10, dtype=torch.float64)
    (ref_loss * weights).sum().backward()
    (loss * weights).sum().backward()
    close(mine.grad.double(), logits.grad.chunk(tp, dim=-1)[rank], "cross-entropy logits grad")


def check_model(group, rank, tp, sp, preset):
    heads = ["model.num_heads=8", "model.num_kv_heads=4"] if preset == "tiny" else []  # GQA, tp up to 4
    cfg = load_config(preset=preset, overrides=["model.vocab_size=512", *heads]).model
    ref = build_model(cfg, "cpu", seed=3, dtype=torch.float64)
    model = build_model(cfg, "cpu", seed=3, dtype=torch.float64)
    axes = tpl.apply_tensor_parallel(model, group, sp)
    ids = torch.randint(0, cfg.vocab_size, (2, 8 * tp), generator=torch.Generator().manual_seed(4))
    labels = ids.roll(-1, dims=1)
    ref_loss = F.cross_entropy(ref(ids).flatten(0, 1), labels.flatten(), reduction="sum")
    loss = tpl.vocab_parallel_cross_entropy(model(ids).flatten(0, 1), labels.flatten(), model.embed_tokens.start,
                                            group).sum()
    close(loss.double(), ref_loss, f"{preset} loss")
    ref_loss.backward()
    loss.backward()
    full = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        expected = full[name].grad
        if name in axes:  # this rank's slice of the full gradient
            dim = axes[name]
            expected = expected.narrow(dim, rank * p.shape[dim], p.shape[dim])
        close(p.grad, expected, f"{preset} grad of {name}")


if __name__ == "__main__":
    dist.init_process_group("gloo")
    group, rank, tp = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    for sp in (False, True):
        check_linears(group, rank, tp, sp)
    check_embedding_and_loss(group, rank, tp)
    for preset in sys.argv[1:] or ["tiny"]:
        for sp in (False, True):
            check_model(group, rank, tp, sp, preset)
    dist.barrier()
    if rank == 0:
        print("all tensor-parallel checks passed")
    exit_worker()
