"""Run under torchrun: LLM(source, tp=WORLD_SIZE) over the prompts of a JSON file; rank 0 writes each
request's token ids (and logprobs) to the output file. tests/test_serve_tp.py compares them with tp=1."""

import json
import os
import sys

from fivefold.parallel.mesh import exit_worker
from fivefold.serve import LLM, SamplingParams

source, requests_path, out_path = sys.argv[1:4]
spec = json.loads(open(requests_path).read())
llm = LLM(source, device="cpu", tp=int(os.environ["WORLD_SIZE"]), block_size=4, max_num_batched_tokens=48)
outs = llm.generate(spec["prompts"], [SamplingParams(**p) for p in spec["params"]])
if int(os.environ["RANK"]) == 0:
    with open(out_path, "w") as f:
        json.dump([{"token_ids": o.token_ids, "logprobs": [e["logprob"] for e in o.logprobs or []]} for o in outs], f)
# Every rank got the outputs from the driver.
assert [len(o.token_ids) for o in outs] == [p["max_tokens"] for p in spec["params"]]
exit_worker()  # no interpreter finalization after gloo: it can abort a finished worker (SIGABRT)
