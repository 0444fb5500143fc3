"""The chunked fused LM head + cross-entropy (train.loss_chunk, fivefold.train.chunked_loss): its loss and
gradients equal the plain head's for any chunk size, with ignored labels and a frozen head; and every
layout that runs it (tp with and without SP, where the vocabulary is split; pp x tp; dp with ZeRO-3, whose
head outlives the model's forward; cp; GPT-2's tied head) trains with the losses, gradient norms and final
weights of one process running the plain loss."""

import pytest
import torch
import torch.nn.functional as F

from fivefold.config import ConfigError
from fivefold.config_load import config_from_dict, load_config
from fivefold.train.chunked_loss import FeatureHead, chunked_cross_entropy
from fivefold.train.trainer import Trainer
from parity import BASE, WHOLE_SEQUENCE, assert_matches_plan, assert_parity, launch_layouts, measured_memory


def plain(x, w, labels):
    return F.cross_entropy(F.linear(x, w).float().flatten(0, 1), labels.flatten(), ignore_index=-100,
                           reduction="sum")


@pytest.mark.parametrize("chunk", [1, 7, 16, 74, 1000])
def test_loss_and_gradients_equal_the_plain_head(chunk):
    g = torch.Generator().manual_seed(chunk)
    x = torch.randn(2, 37, 24, generator=g, requires_grad=True)
    w = torch.randn(50, 24, generator=g, requires_grad=True)
    labels = torch.randint(0, 50, (2, 37), generator=g)
    labels[0, :5] = -100  # e.g. prompt tokens of SFT, or padding
    ref = plain(x, w, labels)
    ref_x, ref_w = torch.autograd.grad(ref * 0.37, (x, w))
    ours = chunked_cross_entropy(x, w, labels, chunk)
    ours_x, ours_w = torch.autograd.grad(ours * 0.37, (x, w))
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(ours_x, ref_x, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours_w, ref_w, rtol=1e-5, atol=1e-6)
    assert ours_x.abs()[0, :5].max() == 0  # ignored tokens give no gradient


def test_bf16_matches_the_plain_head_to_bf16_rounding():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 20, 32, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(64, 32, generator=g) / 4).bfloat16().requires_grad_()
    labels = torch.randint(0, 64, (3, 20), generator=g)
    ref, ours = plain(x, w, labels), chunked_cross_entropy(x, w, labels, 16)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-3)
    for a, b in zip(torch.autograd.grad(ours, (x, w)), torch.autograd.grad(ref, (x, w))):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


def test_frozen_head_gets_no_weight_gradient():
    x = torch.randn(1, 9, 8, requires_grad=True)
    w = torch.randn(12, 8)
    chunked_cross_entropy(x, w, torch.randint(0, 12, (1, 9)), 4).backward()
    assert x.grad is not None and w.grad is None


def test_model_keeps_its_parameter_names_and_tied_head(tiny_config):
    plain_run = Trainer(tiny_config("tiny-gpt2"), quiet=True)
    chunked = Trainer(tiny_config("tiny-gpt2", **{"train.loss_chunk": 16}), quiet=True)
    assert isinstance(chunked.model.lm_head, FeatureHead)
    assert chunked.model.lm_head.weight is chunked.model.embed_tokens.weight
    ours, ref = dict(chunked.model.named_parameters()), dict(plain_run.model.named_parameters())
    assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ref)
    # The same steps as the plain loss, evaluation included
    a = chunked.fit(until=3)
    b = plain_run.fit(until=3)
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], rel=1e-5)


def test_negative_chunk_is_rejected():
    with pytest.raises(ConfigError, match="train.loss_chunk=-1"):
        load_config(preset="tiny", overrides=["train.loss_chunk=-1"])


# -- every layout against one process running the plain loss ------------------------------------------------

GLOBAL = 8
CHUNK = {"train.loss_chunk": 24}  # 8 x 32 tokens in chunks that do not divide them
LAYOUTS = {  # name -> (processes, overrides)
    "tp2": (2, {"parallel.tp": 2}),
    "tp2_sp": (2, {"parallel.tp": 2, "parallel.sequence_parallel": True}),
    "dp2_zero3": (2, {"parallel.dp": 2, "parallel.zero": 3}),
    "cp2": (2, {"parallel.cp": 2}),
    "pp2_tp2_sp": (4, {"parallel.pp": 2, "parallel.tp": 2, "parallel.sequence_parallel": True,
                       "train.grad_accum": 2}),
}


def layout_config(cache, out, **overrides) -> dict:
    values = {**BASE, "model.num_heads": 8, "model.num_kv_heads": 4, "data.cache_dir": cache, "train.out_dir": str(out),
              "train.save_every": 0, "train.eval_every": 5, **overrides}
    dp, accum = values.get("parallel.dp", 1), values.get("train.grad_accum", 1)
    values["train.micro_batch_size"] = GLOBAL // (dp * accum)
    values["train.eval_batches"] = 16 // values["train.micro_batch_size"]  # the same 16 sequences in every layout
    return load_config(preset="tiny", overrides=[f"{k}={v}" for k, v in values.items()]).to_dict()


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory, data_cache):
    root = tmp_path_factory.mktemp("chunked_loss")
    Trainer(config_from_dict(layout_config(data_cache, root / "single")), quiet=True).fit()
    for nproc in sorted({n for n, _ in LAYOUTS.values()}):
        runs = [{"config": layout_config(data_cache, root / name, **CHUNK, **overrides)}
                for name, (n, overrides) in LAYOUTS.items() if n == nproc]
        launch_layouts(nproc, runs, root / f"chunked_{nproc}.json")
    return root


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_matches_one_process_with_the_plain_loss(layout_runs, name):
    assert_parity(layout_runs / name, layout_runs / "single")


def test_measured_memory_under_sequence_parallelism_matches_the_plan():
    """Each rank saves only its part of the sequence of the head's input, and gathers it for the chunks."""
    rows = measured_memory(2, "tiny", "model.num_heads=8", "model.num_kv_heads=4", "train.seq_len=128",
                           "train.micro_batch_size=2", "parallel.tp=2", "parallel.sequence_parallel=true",
                           "train.loss_chunk=64")
    assert_matches_plan(rows, late=WHOLE_SEQUENCE)
    # The total too: its peak is the input gradient's reduce-scatter at the end of the loss's backward (the
    # gathered input, the whole gradient, its rank-major copy and this rank's part), 98 kB (4.2%) over the
    # plan before the plan counted the last two; gloo's own copy of the input, made on its thread while the
    # collective runs, may add one whole sequence more (plan_memory's notes).
    over = rows["total"]["measured"] - rows["total"]["predicted"]
    assert -2048 <= over <= WHOLE_SEQUENCE + 2048, rows["total"]  # measured: 65,536 + 1,324 B


def test_planner_charges_the_recomputed_head():
    """fivefold plan: the fused loss plans far less activation memory at vocabulary 128k than the eager
    plain loss, and less than the compiled one, which keeps the bf16 logits; the speed model charges
    backward the head's matmul once more (about 2% of a llama3-8b step against either)."""
    from fivefold.memory.plan import plan_memory
    from fivefold.planner.hardware import load_profile
    from fivefold.planner.speed import predict_step

    def plan(chunk, compile):
        cfg = load_config(preset="llama3-8b", overrides=["train.precision=bf16-mixed", "train.seq_len=8192",
                                                         "train.micro_batch_size=1", "parallel.dp=8",
                                                         "parallel.zero=1", f"train.loss_chunk={chunk}",
                                                         f"train.compile={compile}"])
        return plan_memory(cfg, suggest=False).memory["activations"], predict_step(cfg, load_profile("h100-sxm"))

    logits = 8192 * 128256
    (plain_memory, plain), (fused_memory, fused) = plan(0, "blocks"), plan(1024, "blocks")
    assert plain_memory - fused_memory > 0.9 * logits * (2 + 4 + 4)  # bf16 + fp32 logits, log-probs
    assert 1.005 < fused.step_time_s / plain.step_time_s < 1.03
    (plain_memory, plain), (fused_memory, fused) = plan(0, "auto"), plan(1024, "auto")  # the loss compiled
    assert plain_memory - fused_memory > logits  # the kept bf16 logits, less the chunks' own peak
    assert 1.005 < fused.step_time_s / plain.step_time_s < 1.04
