"""Run under torchrun: LLM(checkpoint, tp=WORLD_SIZE) scoring a 1,000-token prompt at 200 rows a step beside 14
decoding requests, each phase's peak measured on each rank (fivefold.serve.step_memory.measured_phases); each
rank writes its peaks, its engine's planned step, its weights' and KV pool's bytes to OUT.<rank>.
tests/test_serve_tp.py compares them with the plan."""

import dataclasses
import json
import os
import sys

import torch

from fivefold.parallel.mesh import exit_worker
from fivefold.serve import LLM, SamplingParams
from fivefold.serve.step_memory import measured_phases

source, out = sys.argv[1:3]
llm = LLM(source, device="cpu", tp=int(os.environ["WORLD_SIZE"]), max_num_seqs=16, max_num_batched_tokens=216,
          max_scored_tokens=200, num_blocks=256)
vocab = llm.engine.model.cfg.vocab_size
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(0, vocab, (4,), generator=g).tolist() for _ in range(14)]
params = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)] * 14
prompts.append(torch.randint(0, vocab, (1000,), generator=g).tolist())
params.append(SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
with measured_phases(llm.engine) as peaks:
    llm.generate(prompts, params)
with open(f"{out}.{os.environ['RANK']}", "w") as f:
    json.dump({"peaks": peaks, "planned": dataclasses.asdict(llm.engine.step_memory),
               "weights": sum(p.numel() * p.element_size() for p in llm.engine.model.parameters()),
               "kv": llm.engine.pool.bytes}, f)
exit_worker()  # no interpreter finalization after gloo: it can abort a finished worker (SIGABRT)
