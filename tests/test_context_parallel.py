"""Context parallelism: ring attention on zig-zag shards against full causal attention (float64,
forward and backward, cp 2 and 4, with GQA; tests/ring_attention_worker.py), and training under
torchrun (gloo, fp32): cp 2 and 4 alone, with dp=2 and with tp=2 give the single process's losses over 10
steps, and so do cp with tensor + sequence parallelism and cp with pipeline parallelism. cp alone (dp=1)
is the case where skipping the gradient reduction over cp ranks goes unnoticed by a loss that looks fine
at step 1 and drifts after: it must match at every step."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fivefold.config import ConfigError, config_from_dict, load_config
from fivefold.train.compare import compare_runs
from fivefold.train.trainer import Trainer
from parity import BASE, assert_matches_plan, launch_layouts, measured_memory

HEADS = {"model.num_heads": 8, "model.num_kv_heads": 4}


@pytest.mark.parametrize("nproc", [2, 4])
def test_ring_attention_matches_full_attention(nproc):
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                           str(Path(__file__).parent / "ring_attention_worker.py")],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 and "matches full attention" in proc.stdout, proc.stderr[-3000:]


def config(cache, out, **overrides) -> dict:
    values = {**BASE, **HEADS, "data.cache_dir": cache, "train.out_dir": str(out), **overrides}
    return load_config(preset="tiny", overrides=[f"{k}={v}" for k, v in values.items()]).to_dict()


def layout(cp, dp=1, tp=1, zero=0, pp=1, sp=False) -> dict:
    values = {"parallel.cp": cp, "parallel.dp": dp, "parallel.tp": tp, "parallel.zero": zero, "parallel.pp": pp,
              "parallel.sequence_parallel": sp, "train.micro_batch_size": 8 // dp}
    if pp > 1:  # the pipeline's micro-batches are accumulation micro-batches: same global batch of 8
        values.update({"train.micro_batch_size": 2 // dp, "train.grad_accum": 4, "model.num_layers": 4})
    return values


def name(cp, dp=1, tp=1, zero=0, pp=1, sp=False) -> str:
    return f"cp{cp}_dp{dp}_tp{tp}_zero{zero}_pp{pp}" + ("_sp" if sp else "")


# (cp, dp, tp, zero, pp, sp)
LAUNCHES = {2: [(2,)],
            4: [(4,), (2, 2), (2, 1, 2), (2, 2, 1, 1), (2, 1, 2, 0, 1, True), (2, 1, 1, 0, 2)],
            8: [(4, 2), (2, 2, 2), (2, 2, 1, 1, 2), (2, 1, 2, 0, 2, True)]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    root = tmp_path_factory.mktemp("cp")
    Trainer(config_from_dict(config(data_cache, root / "single", **{"train.micro_batch_size": 8})), quiet=True).fit()
    Trainer(config_from_dict(config(data_cache, root / "single_4layers",
                                    **{"train.micro_batch_size": 8, "model.num_layers": 4})), quiet=True).fit()
    for nproc, layouts in LAUNCHES.items():
        launch_layouts(nproc, [{"config": config(data_cache, root / name(*lay), **layout(*lay))} for lay in layouts],
                       root / f"cp_{nproc}.json")
    return root


@pytest.mark.parametrize("lay", [lay for layouts in LAUNCHES.values() for lay in layouts], ids=lambda lay: name(*lay))
def test_every_step_matches_one_process(runs, lay):
    reference = runs / ("single_4layers" if len(lay) > 4 and lay[4] > 1 else "single")
    result = compare_runs(runs / name(*lay), reference, rtol=1e-5)
    assert result.ok and len(result.steps) == BASE["train.steps"], result.summary()


@pytest.mark.parametrize("overrides, message", [
    ({"parallel.cp": 2, "train.seq_len": 30}, "choose seq_len divisible by 4"),
    ({**HEADS, "parallel.cp": 2, "parallel.tp": 4, "parallel.sequence_parallel": True, "train.seq_len": 36},
     "across cp x tp = 2 x 4 ranks; choose seq_len divisible by 8"),
])
def test_invalid_context_parallel_layouts_are_rejected(tiny_config, overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(**overrides)


def test_measured_activations_per_rank_are_divided_by_cp():
    """`fivefold memory --nproc 2` with cp=2: model states within 1% and activations within 5% of the
    plan, which divides the single process's by cp (ring attention keeps no s x s scores)."""
    assert_matches_plan(measured_memory(2, "tiny", "train.seq_len=128", "train.micro_batch_size=2", "parallel.cp=2"))
