"""The gradient noise scale (McCandlish et al. 2018, appendix A.1) and the batch ramp that follows it.

The estimator recovers a known B_simple from synthetic gradients; the trainer's first-micro-batch norm
equals hand-computed gradients in one process and under every layout that has it (torchrun, gloo), and
is the same across layouts whose small batch is the same; layouts without one log no gns; the auto ramp
grows the batch, agrees across ranks and resumes with it; `fivefold plot` draws a run."""

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from fivefold import cli
from fivefold.config import ConfigError
from fivefold.config_load import load_config
from fivefold.parallel.rules import first_micro_batch_points, unavailable
from fivefold.train.batch_ramp import AutoBatchRamp
from fivefold.train.noise_scale import NoiseScale, unbiased_estimates
from fivefold.train.optim import lr_at
from fivefold.train.trainer import Trainer
from parity import copy_checkpoint, metrics, torchrun

GNS_KEYS = ("gns", "gns_trace", "gns_grad_sq")


# -- the estimator -------------------------------------------------------------------------------------

def test_estimator_recovers_a_known_noise_scale():
    """Per-sample gradients g + e, e ~ N(0, s^2 I) in d dims: tr(S) = d s^2 and B_simple = d s^2 / |g|^2.
    Each step feeds the mean over a small batch and over the big batch that contains it, as a training
    step's first micro-batch and whole batch are; batches below the noise scale, where the ramp works."""
    gen = torch.Generator().manual_seed(0)
    d, sigma, small, big, true_gns = 1000, 0.5, 16, 64, 200.0
    g = torch.randn(d, generator=gen, dtype=torch.float64)
    g *= math.sqrt(d * sigma ** 2 / true_gns) / g.norm()
    noise = NoiseScale(ema=0.95)
    for _ in range(400):
        samples = g + sigma * torch.randn(big, d, generator=gen, dtype=torch.float64)
        noise.update(samples[:small].mean(0).square().sum().item(), small,
                     samples.mean(0).square().sum().item(), big)
    assert noise.value == pytest.approx(true_gns, rel=0.2)
    assert noise.trace == pytest.approx(d * sigma ** 2, rel=0.2)
    assert noise.grad_sq == pytest.approx(g.square().sum().item(), rel=0.2)


def test_estimator_bookkeeping():
    noise = NoiseScale(ema=0.9)
    assert noise.record() == {} and noise.value is None
    noise.update(1.0, 64, 2.0, 128)  # the small batch's norm below the big one's: tr(S) < 0, no gns
    assert "gns" not in noise.record() and noise.record()["gns_trace"] < 0
    noise.update(5.0, 64, 0.0, 64)  # not two batch sizes: ignored
    assert noise.count == 1
    noise.update(4.0, 64, 2.5, 128)
    grad_sq, trace = unbiased_estimates(4.0, 64, 2.5, 128)
    first = unbiased_estimates(1.0, 64, 2.0, 128)
    # Bias-corrected EMAs (Adam's correction): after two steps, (0.9 x first + second) / 1.9.
    assert noise.grad_sq == pytest.approx((0.9 * first[0] + grad_sq) / 1.9, rel=1e-12)
    assert noise.trace == pytest.approx((0.9 * first[1] + trace) / 1.9, rel=1e-12)
    again = NoiseScale(ema=0.9)
    again.load_state_dict(json.loads(json.dumps(noise.state_dict())))
    assert again.record() == noise.record()


def test_first_micro_batch_points_of_the_schedules():
    """After which action a rank's chunk holds micro-batch 0's gradient alone (pp=2, m=4: the orders of
    tests/test_pipeline.py ORDERS); zero-bubble's last rank runs B1 before W0, so it has none."""
    assert first_micro_batch_points("afab", 2, 4) == ({4: 0}, {4: 0})
    assert first_micro_batch_points("1f1b", 2, 4) == ({2: 0}, {1: 0})
    # rank 0: F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 ...; rank 1: F0.0 F1.0 F0.1 B0.1 ... B0.0 (7)
    assert first_micro_batch_points("interleaved", 2, 4, 2) == ({5: 1, 9: 0}, {3: 1, 7: 0})
    assert first_micro_batch_points("zero-bubble", 2, 4) is None


# -- the first micro-batch in one process ------------------------------------------------------------------

def squared_mean_gradient(trainer, inputs, labels, rows) -> float:
    """|gradient of the mean token loss over `rows`|^2, by hand, summed in float64."""
    trainer.model.zero_grad()
    (trainer.parallel.token_loss_sum(inputs[rows], labels[rows]) / labels[rows].numel()).backward()
    return sum(p.grad.double().square().sum().item() for p in trainer.model.parameters())


def step_one_estimates(cfg, small_sets: list[list[int]]) -> tuple[float, float]:
    """(|G|^2, tr(S)) of the first step, from hand-computed gradients at the initial weights: the small
    batches `small_sets` (rows of the global batch; several are averaged, as dp ranks are) against the
    whole global batch of cfg.train.micro_batch_size x grad_accum x dp rows."""
    trainer = Trainer(cfg, quiet=True)
    inputs, labels = trainer.global_batch(cfg.train.grad_accum)
    small_sq = sum(squared_mean_gradient(trainer, inputs, labels, rows) for rows in small_sets) / len(small_sets)
    big_sq = squared_mean_gradient(trainer, inputs, labels, list(range(len(inputs))))
    seq = cfg.train.seq_len
    return unbiased_estimates(small_sq, len(small_sets[0]) * seq, big_sq, len(inputs) * seq)


def test_first_step_equals_hand_computed_gradients(tiny_config):
    cfg = tiny_config(**{"train.micro_batch_size": 2, "train.grad_accum": 2})
    history = Trainer(cfg, quiet=True).fit()
    grad_sq, trace = step_one_estimates(tiny_config(**{"train.micro_batch_size": 4}), [[0, 1]])
    # |G|^2's estimate is a difference of two near-equal terms: fp32 rounding shows at ~1e-5 of them.
    assert history[0]["gns_grad_sq"] == pytest.approx(grad_sq, rel=1e-4, abs=1e-5)
    assert history[0]["gns_trace"] == pytest.approx(trace, rel=1e-5)
    assert all(set(GNS_KEYS[1:]) <= set(r) for r in history)
    last = history[-1]
    assert math.isfinite(last["gns"]) and last["gns"] > 0
    assert last["gns"] == pytest.approx(last["gns_trace"] / last["gns_grad_sq"], rel=1e-12)
    logged = metrics(Path(cfg.train.out_dir))
    assert [r["gns"] for r in logged if "gns" in r] == [r["gns"] for r in history if "gns" in r]


def test_one_micro_batch_logs_no_gns_and_says_why_once(tiny_config, capsys):
    trainer = Trainer(tiny_config(**{"train.steps": 3}))
    history = trainer.fit()
    assert not any(key in r for r in history for key in GNS_KEYS)
    out = capsys.readouterr().out
    assert out.count("note: gns (the gradient noise scale) is not measured") == 1
    assert "set train.grad_accum >= 2" in out


# -- every layout, under torchrun ------------------------------------------------------------------------

STEPS = 6
SAME_SMALL_BATCH = {  # layouts whose first micro-batch is the single process's (rows 0-1 of 4 x 32 tokens)
    "tp2": {"parallel.tp": 2}, "tp2_sp": {"parallel.tp": 2, "parallel.sequence_parallel": True},
    "pp2_1f1b": {"parallel.pp": 2, "parallel.pp_schedule": "1f1b"},
    "pp2_afab": {"parallel.pp": 2, "parallel.pp_schedule": "afab"},
    "cp2_zero2": {"parallel.cp": 2, "parallel.zero": 2},  # one gradient, reduced over the ring's tokens
}
INTERLEAVED = {"parallel.pp": 2, "parallel.pp_schedule": "interleaved", "parallel.pp_virtual_stages": 2,
               "model.num_layers": 4}  # two chunks per rank: micro-batch 0 is complete at a point per chunk
DATA_PARALLEL = {f"dp2_zero{z}": {"parallel.dp": 2, "parallel.zero": z, "train.micro_batch_size": 1}
                 for z in range(4)}
RAMP = {"train.seq_len": 16, "train.micro_batch_size": 1, "train.steps": 40, "train.batch_ramp": "auto",
        "train.max_grad_accum": 16, "train.gns_ema": 0.9, "train.lr_scaling": "sqrt"}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory, data_cache):
    """Every layout's run directory (rank<N>.json: each rank's records and notes), and the single
    process's, micro-batch 2 x grad_accum 2."""
    from conftest import TINY_DEFAULTS

    root = tmp_path_factory.mktemp("gns_layouts")

    def config(name, **overrides):
        values = {**TINY_DEFAULTS, "data.cache_dir": data_cache, "train.out_dir": str(root / name),
                  "train.steps": STEPS, "train.micro_batch_size": 2, "train.grad_accum": 2, **overrides}
        return load_config(preset="tiny", overrides=[f"{k}={v}" for k, v in values.items()])

    single = Trainer(config("single"), quiet=True)
    (root / "single" / "rank0.json").write_text(json.dumps({"history": single.fit(), "notes": []}))
    del single
    runs = {**SAME_SMALL_BATCH, **DATA_PARALLEL,
            "pp2_interleaved": INTERLEAVED,
            "pp2_zero_bubble": {"parallel.pp": 2, "parallel.pp_schedule": "zero-bubble"},
            "dp2_ramp": {"parallel.dp": 2, **RAMP}}
    spec = root / "runs.json"
    spec.write_text(json.dumps([config(name, **values).to_dict() for name, values in runs.items()]))
    proc = torchrun(2, Path(__file__).parent / "noise_scale_worker.py", str(spec), timeout=900)
    if proc.returncode:
        raise AssertionError(f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return root


def ranks(root, name) -> list[dict]:
    return [json.loads((root / name / f"rank{r}.json").read_text()) for r in range(2)]


def column(history, key):
    return [r.get(key) for r in history]


@pytest.mark.parametrize("name", list(SAME_SMALL_BATCH) + list(DATA_PARALLEL) + ["pp2_interleaved", "dp2_ramp"])
def test_every_rank_logs_the_same_noise_scale(layouts, name):
    """Derived from all-reduced norms only, so bit-identical on every rank: what the ramp decides on."""
    first, second = ranks(layouts, name)
    for key in (*GNS_KEYS, "grad_accum"):
        assert column(first["history"], key) == column(second["history"], key), key
    assert all(r["gns_trace"] is not None for r in first["history"])


@pytest.mark.parametrize("name", list(SAME_SMALL_BATCH))
def test_same_small_batch_same_noise_scale_as_one_process(layouts, name):
    (single,) = [json.loads((layouts / "single" / "rank0.json").read_text())["history"]]
    history = ranks(layouts, name)[0]["history"]
    torch.testing.assert_close(column(history, "gns_trace"), column(single, "gns_trace"), rtol=1e-4, atol=0)
    torch.testing.assert_close(column(history, "gns_grad_sq"), column(single, "gns_grad_sq"), rtol=1e-3, atol=1e-4)


def test_data_parallel_small_batches(layouts, tiny_config, tmp_path):
    """dp=2, micro-batch 1, grad_accum 2 (rank 0 rows 0-1, rank 1 rows 2-3). ZeRO-0/1 reduce on the last
    micro-batch: the small batches are rows 0 and 2 apart, their |G|^2 averaged (B_small 32 tokens).
    ZeRO-2/3 reduce each micro-batch: the small batch is rows 0 and 2 together (64 tokens). Layouts of
    the same kind give the same numbers at every step; the first step equals hand-computed gradients."""
    runs = {name: ranks(layouts, name)[0]["history"] for name in DATA_PARALLEL}
    for a, b in (("dp2_zero0", "dp2_zero1"), ("dp2_zero2", "dp2_zero3")):
        torch.testing.assert_close(column(runs[a], "gns_trace"), column(runs[b], "gns_trace"), rtol=1e-4, atol=0)
        torch.testing.assert_close(column(runs[a], "gns_grad_sq"), column(runs[b], "gns_grad_sq"),
                                   rtol=1e-3, atol=1e-4)
    reference = tiny_config(**{"train.micro_batch_size": 4, "train.out_dir": str(tmp_path / "ref")})
    for name, small_sets in (("dp2_zero0", [[0], [2]]), ("dp2_zero2", [[0, 2]])):
        grad_sq, trace = step_one_estimates(reference, small_sets)
        assert runs[name][0]["gns_grad_sq"] == pytest.approx(grad_sq, rel=1e-4, abs=1e-5), name
        assert runs[name][0]["gns_trace"] == pytest.approx(trace, rel=1e-5), name


def test_interleaved_pipeline_measures_each_chunk_at_its_own_point(layouts, tiny_config, tmp_path):
    """Rank 0 runs F0.0 F1.0 F0.1 F1.1 B0.1 B1.1 B0.0 B1.0: chunk 1 (layer 2) holds micro-batch 0's
    gradient after B0.1, chunk 0 (embeddings, layer 0) after B0.0, with B1.1 between them. Measured at
    both points, the first step equals hand-computed gradients."""
    history = ranks(layouts, "pp2_interleaved")[0]["history"]
    reference = tiny_config(**{"train.micro_batch_size": 4, "model.num_layers": 4,
                               "train.out_dir": str(tmp_path / "ref")})
    grad_sq, trace = step_one_estimates(reference, [[0, 1]])
    assert history[0]["gns_grad_sq"] == pytest.approx(grad_sq, rel=1e-4, abs=1e-5)
    assert history[0]["gns_trace"] == pytest.approx(trace, rel=1e-5)


def test_a_schedule_without_a_first_micro_batch_point_logs_no_gns(layouts):
    for rank in ranks(layouts, "pp2_zero_bubble"):
        assert not any(key in r for r in rank["history"] for key in GNS_KEYS)
        assert any("pp_schedule=zero-bubble" in note for note in rank["notes"])


def test_the_ramp_decides_alike_on_every_rank(layouts):
    history = ranks(layouts, "dp2_ramp")[0]["history"]
    accums = column(history, "grad_accum")
    assert accums == sorted(accums) and accums[-1] > 2, accums  # it grew, and never shrank


# -- train.batch_ramp = auto in one process ----------------------------------------------------------------

@pytest.fixture(scope="module")
def ramp_run(tmp_path_factory, data_cache):
    """40 steps of batch 2 x 16 tokens (x grad_accum), noise scale ~10^2 tokens: the batch grows."""
    from conftest import TINY_DEFAULTS

    out = tmp_path_factory.mktemp("ramp") / "run"
    values = {**TINY_DEFAULTS, "data.cache_dir": data_cache, "train.out_dir": str(out), **RAMP,
              "train.micro_batch_size": 2, "train.grad_accum": 2, "train.save_every": 10,
              "train.keep_checkpoints": 4}
    cfg = load_config(preset="tiny", overrides=[f"{k}={v}" for k, v in values.items()])
    Trainer(cfg, quiet=True).fit()
    return cfg, out


def test_auto_ramp_grows_the_batch_toward_the_noise_scale(ramp_run):
    cfg, out = ramp_run
    records = metrics(out)
    accums = column(records, "grad_accum")
    assert accums == sorted(accums) and 2 < accums[-1] <= cfg.train.max_grad_accum, accums
    base = 2 * 2 * 16  # the initial batch: lr_scaling is relative to it
    for r in records:
        assert r["batch_tokens"] == 2 * r["grad_accum"] * 16
        assert r["lr"] == lr_at(r["step"] - 1, cfg.train, r["batch_tokens"], base)  # the schedule path's rule
    every = 10  # the EMA's horizon at gns_ema=0.9: the batch changes only after such steps
    for before, after in zip(records, records[1:]):
        if after["grad_accum"] != before["grad_accum"]:
            assert before["step"] % every == 0
            assert after["grad_accum"] <= 2 * before["grad_accum"]
            tokens_per_accum = before["batch_tokens"] / before["grad_accum"]
            assert after["grad_accum"] * tokens_per_accum <= before["gns"]  # never past the noise scale


def test_a_resumed_ramp_continues_with_its_batch(ramp_run, tmp_path):
    """Resumed from the first checkpoint after the batch grew: the same grad_accum, and every later
    step's loss, batch and noise scale bit-identical to the uninterrupted run's."""
    cfg, out = ramp_run
    records = {r["step"]: r for r in metrics(out)}
    saved = [s for s in (10, 20, 30) if records[s + 1]["grad_accum"] > 2]
    assert saved, "the batch did not grow before the last checkpoint"
    resumed = tmp_path / "resumed"
    copy_checkpoint(out, resumed, saved[0])
    cfg = copy.deepcopy(cfg)
    cfg.train.out_dir = str(resumed)
    trainer = Trainer(cfg, resume=True, quiet=True)
    assert trainer.step == saved[0] and trainer.ramp.grad_accum == records[saved[0] + 1]["grad_accum"]
    for r in trainer.fit():
        for key in ("loss", "grad_accum", "lr", *GNS_KEYS):
            assert r.get(key) == records[r["step"]].get(key), (r["step"], key)


def test_a_grown_ramp_resumed_under_a_layout_it_does_not_fit_is_refused(ramp_run, tmp_path):
    """The same initial batch (micro-batch 1 x grad_accum 4 = 4 sequences), but the ramp had grown past what
    train.max_grad_accum allows under micro-batch 1: refused as the run is resumed, naming the key to raise."""
    cfg, out = ramp_run
    records = {r["step"]: r for r in metrics(out)}
    step = max(s for s in (10, 20, 30) if records[s + 1]["grad_accum"] > 2)
    reached = records[step + 1]["grad_accum"] * 2  # sequences per step: grad_accum x micro-batch 2
    resumed = tmp_path / "resumed"
    copy_checkpoint(out, resumed, step)
    cfg = copy.deepcopy(cfg)
    cfg.train.out_dir, cfg.train.micro_batch_size, cfg.train.grad_accum = str(resumed), 1, 4
    cfg.train.max_grad_accum = reached - 1
    with pytest.raises(ConfigError, match=f"cannot resume .*grad_accum={reached} .*raise train.max_grad_accum "
                                          f"to at least {reached}"):
        Trainer(cfg, resume=True, quiet=True)


def test_the_ramp_rule():
    cfg = load_config(preset="tiny", overrides=["train.grad_accum=2", "train.batch_ramp=auto", "train.max_grad_accum=6",
                                                "train.micro_batch_size=2", "train.gns_ema=0.9"]).train
    ramp = AutoBatchRamp(cfg, dp=2)
    noise = NoiseScale(0.9)
    for _ in range(10):
        noise.update(4.0, 64, 1.0, 256)  # tr(S) = 256, |G|^2 = 0: no noise scale yet
    assert noise.value is None and ramp.target(noise, 64) == 2
    noise = NoiseScale(0.9)
    for _ in range(9):
        noise.update(1.5, 64, 1.125, 256)  # tr(S) = 32, |G|^2 = 1: B_simple = 32 tokens
    assert ramp.target(noise, 8) == 2  # 9 steps measured: not settled (10)
    noise.update(1.5, 64, 1.125, 256)
    assert noise.value == pytest.approx(32)
    assert [ramp.due(s) for s in (5, 10, 20)] == [False, True, True]
    assert ramp.target(noise, 8) == 4  # 32 / 8 = 4 fits, and doubling allows 4
    assert ramp.target(noise, 2) == 4  # 16 fits, but at most double per decision
    assert ramp.target(noise, 20) == 2  # one unit of 20 tokens more would pass 32: stay
    assert ramp.grow(4) and ramp.grad_accum == 4 and not ramp.grow(3)
    assert ramp.grow(16) and ramp.grad_accum == 6  # capped at max_grad_accum
    assert ramp.state_dict() == {"batch_sequences": 6 * 2 * 2}
    one = AutoBatchRamp(cfg, dp=1)  # the same 24 sequences under dp=1: grad_accum 12, above the maximum
    with pytest.raises(ConfigError, match="raise train.max_grad_accum to at least 12"):
        one.load_state_dict(ramp.state_dict())
    with pytest.raises(ConfigError, match="does not divide"):
        AutoBatchRamp(cfg, dp=5).load_state_dict(ramp.state_dict())


@pytest.mark.parametrize("overrides, message", [
    ({"train.grad_accum": 2, "train.max_grad_accum": 8, "parallel.cp": 2},
     "this layout cannot measure: under parallel.cp=2"),
    ({"train.grad_accum": 2, "train.max_grad_accum": 8, "parallel.ep": 2, "parallel.dp": 2},
     "under parallel.ep=2"),
    ({"train.grad_accum": 2, "train.max_grad_accum": 8, "parallel.pp": 2, "parallel.pp_schedule": "zero-bubble"},
     "parallel.pp_schedule=zero-bubble adds a later micro-batch's gradient"),
    ({"train.grad_accum": 2, "train.max_grad_accum": 7, "parallel.pp": 2, "parallel.pp_schedule": "interleaved"},
     "max_grad_accum) a multiple of 2"),
])
def test_auto_ramp_refuses_layouts_without_a_noise_scale(overrides, message):
    values = {"train.batch_ramp": "auto", **overrides}
    preset = "tiny-moe" if "parallel.ep" in overrides else "tiny"
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(preset=preset, overrides=[f"{k}={v}" for k, v in values.items()])


def test_unavailable_reasons_name_the_fix(tiny_config):
    cfg = tiny_config(**{"train.grad_accum": 2})
    assert unavailable(cfg, 2) is None
    assert "set train.grad_accum >= 2" in unavailable(cfg, 1)


# -- fivefold plot -----------------------------------------------------------------------------------------

def test_plot_draws_a_run(ramp_run, tmp_path, capsys):
    _, out = ramp_run
    png = tmp_path / "ramp.png"
    assert cli.main(["plot", str(out), "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert f"wrote {png}" in capsys.readouterr().out


def test_plot_without_metrics_is_a_clear_error(tmp_path, capsys):
    code = cli.main(["plot", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.strip() == (f"fivefold plot: error: {tmp_path} has no metrics.jsonl; give the run directory "
                           f"`fivefold train --out` wrote (it logs every train.log_every steps)")
    (tmp_path / "metrics.jsonl").write_text("")
    assert cli.main(["plot", str(tmp_path)]) == 2
    assert "holds no step records yet" in capsys.readouterr().err
