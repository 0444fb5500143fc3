"""torch.compile in every layout: each block compiled with CPU inductor, against one eager process.

dp with ZeRO-2 and ZeRO-3 (whose hooks gather and free parameters around every block), tp with sequence
parallelism and full recomputation, pp under each schedule (afab, 1f1b, interleaved, zero-bubble, whose
deferred weight gradients run outside the compiled graph), cp (ring attention) and ep (a mixture of
experts, all-to-all dispatch): every step's loss and gradient norm and the final weights equal the
eager single process's (parity.assert_parity); four of them with fused projections, against the separate
eager ones. Each compiled rank records what dynamo made of its blocks
(tests/run_layouts.py): at least one graph, so a silent fallback to eager cannot pass."""

import json

import pytest

from fivefold.config_load import config_from_dict, load_config
from fivefold.train.trainer import Trainer
from parity import BASE, assert_parity, launch_layouts

STEPS, GLOBAL = 4, 8
MODEL = {"model.num_layers": 4, "model.num_heads": 8, "model.num_kv_heads": 4}
LAYOUTS = {  # name -> (preset, overrides), all on 2 processes
    "dp2_zero2": ("tiny", {"parallel.dp": 2, "parallel.zero": 2}),
    # fused projections (q/k/v and gate/up as one GEMM each), compiled as CUDA compiles them by default
    "dp2_zero3_fused": ("tiny", {"parallel.dp": 2, "parallel.zero": 3, "train.fused_projections": "true"}),
    "tp2_sp_full_recompute_fused": ("tiny", {"parallel.tp": 2, "parallel.sequence_parallel": True,
                                             "train.recompute": "full", "train.fused_projections": "true"}),
    "tp2_ops_recompute": ("tiny", {"parallel.tp": 2, "train.recompute": "ops"}),
    "pp2_afab": ("tiny", {"parallel.pp": 2, "parallel.pp_schedule": "afab", "train.grad_accum": 2}),
    "pp2_1f1b_fused": ("tiny", {"parallel.pp": 2, "train.grad_accum": 2, "train.recompute": "selective",
                                "train.fused_projections": "true"}),
    "pp2_interleaved": ("tiny", {"parallel.pp": 2, "parallel.pp_schedule": "interleaved",
                                 "parallel.pp_virtual_stages": 2, "train.grad_accum": 2}),
    "pp2_zero_bubble": ("tiny", {"parallel.pp": 2, "parallel.pp_schedule": "zero-bubble", "train.grad_accum": 2}),
    "cp2_fused": ("tiny", {"parallel.cp": 2, "train.fused_projections": "true"}),
    "ep2": ("tiny-moe", {"parallel.dp": 2, "parallel.ep": 2}),
}


def layout_config(cache, out, preset, compiled, **overrides) -> dict:
    values = {**BASE, **MODEL, "data.cache_dir": cache, "train.out_dir": str(out), "train.steps": STEPS,
              "train.save_every": 0, "train.compile": compiled, **overrides}
    dp, accum = values.get("parallel.dp", 1), values.get("train.grad_accum", 1)
    values["train.micro_batch_size"] = GLOBAL // (dp * accum)
    return load_config(preset=preset, overrides=[f"{k}={v}" for k, v in values.items()]).to_dict()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    root = tmp_path_factory.mktemp("compile")
    for preset in ("tiny", "tiny-moe"):
        # A mixture of experts routes and balances per micro-batch: the reference runs ep2's micro-batches.
        accum = {"train.grad_accum": 2} if preset == "tiny-moe" else {}
        Trainer(config_from_dict(layout_config(data_cache, root / f"eager_{preset}", preset, False, **accum)),
                quiet=True).fit()
    todo = [{"config": layout_config(data_cache, root / name, preset, True, **overrides)}
            for name, (preset, overrides) in LAYOUTS.items()]
    launch_layouts(2, todo, root / "compile.json", timeout=1500)
    return root


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_compiled_layout_matches_one_eager_process(runs, name):
    preset = LAYOUTS[name][0]
    assert_parity(runs / name, runs / f"eager_{preset}", steps=STEPS)
    for rank in (0, 1):
        stats = json.loads((runs / name / f"compile_stats_rank{rank}.json").read_text())
        assert stats["unique_graphs"] >= 1, stats


def test_compile_defaults_to_cuda_only():
    cfg = load_config(preset="tiny")
    assert cfg.train.compile == "auto" and cfg.train.compiled("cuda") and not cfg.train.compiled("cpu")
    for value, expected in (("true", True), ("blocks", True), ("false", False), (True, True)):
        cfg = load_config(preset="tiny", overrides=[f"train.compile={value}"])
        assert cfg.train.compiled("cpu") is expected
