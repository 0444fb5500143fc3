"""Run under torchrun (2 ranks) by tests/test_zero.py: the order of ZeRO-3's parameter gathers over one training
step. Forward: the root's gather and block 1's start together; each block then completes its own gather and
starts the next block's, which so overlaps this block's compute. Backward: each block completes its own and
starts the previous block's. Without the prefetch every gather would wait in the open; the step's results
would not change, so only the order shows it.

    torchrun --nproc-per-node 2 tests/zero3_prefetch_worker.py run.json
"""

import json
import sys

from fivefold.config_load import config_from_dict
from fivefold.parallel import zero
from fivefold.parallel.collectives import in_backward
from fivefold.parallel.mesh import exit_worker
from fivefold.train.trainer import Trainer

if __name__ == "__main__":
    calls = []
    gather = zero.ZeroDataParallel._gather

    def logged(self, unit, wait):
        calls.append((unit, wait, in_backward()))
        return gather(self, unit, wait)

    zero.ZeroDataParallel._gather = logged
    trainer = Trainer(config_from_dict(json.loads(open(sys.argv[1]).read())), quiet=True)
    layers = len(trainer.model.layers)
    trainer.fit()
    forward = [(u, w) for u, w, back in calls if not back]
    backward = [(u, w) for u, w, back in calls if back]
    expected_forward = [(0, False), (1, False), (0, True)]
    for u in range(1, layers + 1):
        expected_forward += [(u, True), (u + 1, False)]
    expected_backward = []
    for u in range(layers, 0, -1):
        expected_backward += [(u, True)] + ([(u - 1, False)] if u > 1 else [])
    if forward != expected_forward or backward != expected_backward:
        raise AssertionError(f"gathers: forward {forward} (expected {expected_forward}); "
                             f"backward {backward} (expected {expected_backward})")
    print(f"gathers in order over {layers} blocks")
    exit_worker()
