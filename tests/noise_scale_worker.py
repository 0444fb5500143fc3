"""Worker for tests/test_noise_scale.py, run under torchrun: trains each config of a JSON list in turn
(one launch for every layout) and writes every rank's step records and notes to rank<N>.json in the
run's out_dir, so the test can check that all ranks measured and decided alike.

    torchrun --nproc-per-node 2 tests/noise_scale_worker.py runs.json
"""

import json
import sys
from pathlib import Path

from fivefold.config_load import config_from_dict
from fivefold.parallel.mesh import exit_worker
from fivefold.train.trainer import Trainer

if __name__ == "__main__":
    for values in json.loads(Path(sys.argv[1]).read_text()):
        trainer = Trainer(config_from_dict(values), quiet=True)
        history = trainer.fit()
        (trainer.out_dir / f"rank{trainer.mesh.rank}.json").write_text(
            json.dumps({"history": history, "notes": sorted(trainer.notes)}))
        del trainer
    exit_worker()
