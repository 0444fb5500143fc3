"""Run under torchrun: LLM(source, tp=WORLD_SIZE) over the prompts of a JSON file, then again after
update_weights with another seed's whole tensors (every rank passes them; each copies in its part); rank 0
writes each request's token ids (logprobs, prompt logprobs) of both runs to the output file. tests/test_serve_tp.py
compares them with tp=1."""

import json
import os
import sys

from fivefold.model import build_model
from fivefold.parallel.mesh import exit_worker
from fivefold.presets import PRESETS
from fivefold.serve import LLM, SamplingParams

source, requests_path, out_path = sys.argv[1:4]
spec = json.loads(open(requests_path).read())
llm = LLM(source, device="cpu", tp=int(os.environ["WORLD_SIZE"]), block_size=4, max_num_batched_tokens=48)
params = [SamplingParams(**p) for p in spec["params"]]
runs = [llm.generate(spec["prompts"], params)]
llm.engine.update_weights(build_model(PRESETS["tiny"], seed=spec["update_seed"]).state_dict())
runs.append(llm.generate(spec["prompts"], params))
if int(os.environ["RANK"]) == 0:
    with open(out_path, "w") as f:
        json.dump([[{"token_ids": o.token_ids, "logprobs": [e["logprob"] for e in o.logprobs or []],
                     "prompt_logprobs": [e["logprob"] for e in (o.prompt_logprobs or [])[1:]]} for o in outs]
                   for outs in runs], f)
# Every rank got the outputs from the driver.
assert all([len(o.token_ids) for o in outs] == [p["max_tokens"] for p in spec["params"]] for outs in runs)
exit_worker()  # no interpreter finalization after gloo: it can abort a finished worker (SIGABRT)
