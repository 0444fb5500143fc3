"""How much of the published-run errors (docs/planner_validation.md (b)) the layout search's fill-ins explain.

Where a source leaves out a layout key (micro-batch size, schedule, virtual stages...), the check fills it
with the search's best choice, which leans optimistic by construction. This prints, for each verified run
with a filled key, the error with the best, the median and the worst of every legal fill:

    python bench/planner_fill_sensitivity.py     # ~1 min
"""
import math
import statistics

from fivefold.planner.published import load_runs, run_config, check_run
from fivefold.planner.hardware import load_profile
from fivefold.planner.search import search_layouts

for run in load_runs():
    if not run["verified"]: continue
    c = check_run(run)
    if not c.filled: continue
    cfg = run_config(run); profile = load_profile(run["hardware"])
    only = dict(run["layout"]); tokens = run["global_batch"] * run["seq_len"]
    res = search_layouts(cfg, profile, run["gpus"], tokens, top=10**6, fused=run.get("compiled", True), only=only, implemented_only=False,
                         **({} if c.memory_fits else {"device_memory": math.inf}))
    tps = [r.speed.tokens_per_s_per_gpu for r in res.ranked]
    pub = run["tokens_per_s_per_gpu"]
    print(f"{run['name']:42s} n={len(tps):4d} best {tps[0]/pub-1:+.1%} median {statistics.median(tps)/pub-1:+.1%} worst {tps[-1]/pub-1:+.1%}  filled={c.filled}")
