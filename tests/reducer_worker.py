"""Run under torchrun (2 ranks) by tests/test_data_parallel.py: the bucketed all-reduce of parameters that some
ranks give no gradient (a mixture's experts that no token of a rank reached, reduced with overlap=False).
A parameter with a gradient on some ranks gets their sum; one that no rank touched keeps no gradient at all,
as in one process, so the optimizer leaves it alone (a zero gradient would still decay it and move its
moments). Checked with every parameter in one bucket and with a bucket each, over two steps."""

import torch
import torch.distributed as dist
from torch import nn

from fivefold.parallel.data_parallel import BucketedAllReduce
from fivefold.parallel.mesh import exit_worker

if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for bucket_bytes in (2**20, 4):  # one bucket; a bucket per parameter
        # every rank's gradient, rank 0's only, no rank's
        everyone, first, nobody = (nn.Parameter(torch.zeros(3)) for _ in range(3))
        reducer = BucketedAllReduce([everyone, first, nobody], dist.group.WORLD, bucket_bytes=bucket_bytes,
                                    first_bucket_bytes=bucket_bytes, overlap=False)
        for step in range(2):
            loss = (everyone * (rank + 1 + step)).sum() + (first.sum() * (step + 2) if rank == 0 else 0.0)
            loss.backward()
            reducer.finish()
            grads = reducer.local_grads()
            expected = [torch.full((3,), 3.0 + 2 * step), torch.full((3,), 2.0 + step), None]
            for name, got, want in zip(("everyone", "first", "nobody"), grads, expected):
                if (got is None) != (want is None) or (want is not None and not torch.equal(got, want)):
                    raise AssertionError(f"rank {rank}, step {step}, bucket {bucket_bytes} B: {name}'s reduced "
                                         f"gradient {got} != {want}")
    if rank == 0:
        print("reduced as one process")
    exit_worker()
