"""Worker for the parity tests, run under torchrun: trains each config of a JSON list in turn in the
same process group (one launch instead of one per layout), each into its own train.out_dir.

    torchrun --nproc-per-node 4 tests/run_layouts.py runs.json
"""

import json
import sys

from fivefold.config import config_from_dict
from fivefold.parallel.mesh import exit_worker
from fivefold.train.trainer import Trainer

if __name__ == "__main__":
    for run in json.loads(open(sys.argv[1]).read()):
        trainer = Trainer(config_from_dict(run["config"]), resume=run.get("resume", False), quiet=True)
        trainer.fit(until=run.get("until"))
    exit_worker()
