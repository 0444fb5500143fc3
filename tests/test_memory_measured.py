"""Measured memory of real training steps (CPU) against the plan, category by category.

The issue's targets: parameters, gradients and optimizer states within 1%; the activation peak within
5% for every recompute mode and both attention implementations. The replay in
fivefold.memory.activations is exact on these models (errors of a few bytes: 0-dim scalars; the largest,
the chunked loss's, 0.26%; the tiny model is also held to bytes), so activations and the total are held to
0.5%: dropping eager attention's
output from the replay moves the planned activations by 2.8%, which 5% let pass. The total also counts
the transients of a block's backward, which the plan models (fivefold.memory.plan) rather than
replays: the few cases where that is off by more are given their own, measured tolerance where they run.
"""

import json
import os
import subprocess
import sys

import pytest

from fivefold.cli import main
from parity import measured_memory
from fivefold.config_load import load_config
from fivefold.memory.tracker import measure_memory, random_datasets
from fivefold.memory.units import CATEGORIES

TOLERANCE = {"parameters": 0.01, "gradients": 0.01, "optimizer_states": 0.01, "activations": 0.005,
             "temporary": 0.10, "total": 0.005}


STARTUP_PAGES = 128 * 2 ** 20  # bytes of code and library pages a Trainer's start-up may touch first


def measure(preset: str, *overrides: str, steps: int = 2):
    cfg = load_config(preset=preset, overrides=["train.seq_len=128", "train.micro_batch_size=2", *overrides])
    return measure_memory(cfg, steps=steps, datasets=random_datasets(cfg))


def assert_startup_within_one_parameter(predicted: float, measured: float, model: dict) -> None:
    """The planned start-up peak assumes the largest parameter is made last, when everything else is
    already held: a bound that the tensors made while the Trainer is built reach (when the last
    parameter made is the largest) or stay under by at most one full fp32 value of the largest
    parameter, which for the tiny models is the embedding."""
    largest = 4 * model["vocab_size"] * model["hidden_size"]
    assert predicted - largest <= measured <= 1.001 * predicted, (predicted, measured, largest)  # 0-dim tensors


def assert_matches_plan(timeline, **tolerances: float):
    """Every category within TOLERANCE of the plan; `tolerances` (category=fraction) loosen one case."""
    tolerance = {**TOLERANCE, **tolerances}
    rows = {name: (predicted, measured, error) for name, predicted, measured, error in timeline.comparison()}
    # The start-up peak: on CPU the tensors made while the Trainer is built (the resident set's growth,
    # megabytes of interpreter and library pages for a tiny model, is reported beside it as startup_rss;
    # bench/startup_memory.py checks that where it means something, a 300M model).
    assert set(rows) == set(CATEGORIES) | {"total", "startup"}
    predicted, measured, _ = rows.pop("startup")
    # The growth can be 0 (later tests in this process reuse pages; test_startup_peak_measures_a_known_
    # allocation checks the lower side) but not above the tensors plus the pages first touched: measured
    # 8-14 MB in a fresh process, 37 MB where fp8 imports torchao. A measurement that lost its base would
    # read the whole resident set, ~430 MB.
    assert 0 <= timeline.peaks["startup_rss"] <= predicted + STARTUP_PAGES, timeline.peaks["startup_rss"]
    assert_startup_within_one_parameter(predicted, measured, timeline.config["model"])
    for name, (predicted, measured, error) in rows.items():
        assert abs(error) <= tolerance[name], f"{name}: predicted {predicted:,.0f}, measured {measured:,.0f}"


KNOWN_ALLOCATION = """
import json, torch
from fivefold.memory.host import reset_resident_peak
from fivefold.memory.tracker import StartupPeak
size = 32 * 2 ** 20
if not reset_resident_peak():
    print(json.dumps(None))
    raise SystemExit
earlier = torch.ones(3 * size, dtype=torch.uint8)  # a higher peak before the measurement
del earlier
readings = []
for _ in range(2):
    with StartupPeak(torch.device("cpu")) as startup:
        block = torch.ones(size, dtype=torch.uint8)  # every page written
        del block
    readings.append(startup.bytes)
print(json.dumps(readings))
"""


def test_startup_peak_measures_a_known_allocation():
    """StartupPeak on CPU (the resident set's high-water mark over its base) reads a 32 MiB block allocated
    and freed inside it: within 4 MiB (measured: +1.3 MiB the first time, when code pages are touched too;
    -0.2 MiB after), not the larger peak before it, which a high-water mark not reset would read. In a
    process of its own, as at a Trainer's start-up: in a test worker, another test's threads freeing memory
    inside the window lower the resident set by as much as the block adds (it read 0 twice in the suite)."""
    run = subprocess.run([sys.executable, "-c", KNOWN_ALLOCATION], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr
    readings = json.loads(run.stdout.strip().splitlines()[-1])
    if readings is None:
        pytest.skip("this kernel does not let a process reset its resident-set peak (/proc/self/clear_refs)")
    size = 32 * 2 ** 20
    assert len(readings) == 2 and all(abs(r - size) <= 4 * 2 ** 20 for r in readings), readings


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("recompute", ["none", "selective", "ops", "full"])
def test_tiny_model_matches_plan(recompute, attention, precision):
    timeline = measure("tiny", f"train.recompute={recompute}", f"model.attention={attention}",
                       f"train.precision={precision}")
    assert_matches_plan(timeline)
    # To the bytes, not 0.5%: measured - planned is +8 bytes of activations (a 0-dim scalar) and +144 bytes in
    # total in all 16 cases. A term as small as one norm's saved rsqrt (1 KiB a norm), the labels' flattened copy
    # the loss saves (2 KiB) or a norm's weight gradient (256 bytes) shows. Eager attention under op-level and
    # full recomputation was +2.6% / -0.4% in fp32 (+1.4% / -0.2% in bf16) until the attention backward's point
    # dropped the MLP's kept products (released by then) and counted o_proj's and the norms' gradients.
    rows = {name: measured - predicted for name, predicted, measured, _ in timeline.comparison()}
    assert abs(rows["activations"]) <= 64, rows
    assert abs(rows["total"]) <= 256, rows


@pytest.mark.parametrize("overrides", [
    (),
    ("train.precision=bf16-mixed", "model.attention=eager"),
    ("train.recompute=selective",),
    ("train.recompute=full", "train.precision=bf16-mixed"),
    ("lora.r=8", "lora.targets=q,v"),  # q/k/v separate (adapted), gate/up fused and frozen: no input saved
    # 16 tokens: the concatenated gate/up weight (transient) is the activations' peak
    ("train.seq_len=16", "model.hidden_size=128", "model.ffn_hidden_size=512"),
])
def test_fused_projections_match_plan(overrides):
    """train.fused_projections=true: one product for q/k/v and one for gate/up, their concatenated weights made
    and dropped in forward and backward, v copied out of the product (attention keeps it), the SwiGLU
    factors slices of one product that silu and the mul keep whole."""
    assert_matches_plan(measure("tiny", "train.fused_projections=true", *overrides))


@pytest.mark.parametrize("overrides", [
    # GPT-2 layout: LayerNorm with biases, GELU, learned positions, tied embeddings, multi-head attention
    ("train.precision=bf16-mixed", "model.attention=eager"),
    ("train.recompute=selective", "model.attention=eager"),
    ("train.recompute=ops", "train.precision=bf16-mixed"),  # biases: addmm, kept like mm
])
def test_gpt2_layout_matches_plan(overrides):
    assert_matches_plan(measure("tiny-gpt2", *overrides))


@pytest.mark.parametrize("overrides", [
    ("train.recompute=none",),
    ("train.recompute=ops",),
    ("train.recompute=full", "model.capacity_factor=1.25"),
    ("train.precision=bf16-mixed", "train.recompute=ops", "model.shared_expert_size=96"),
    ("model.shared_expert_size=96", "model.moe_ffn_hidden_size=96", "model.attention=eager",
     "train.recompute=selective"),
    ("lora.r=8", "lora.targets=q,v", "train.recompute=ops"),  # frozen router and experts: inputs not saved
])
def test_mixture_of_experts_matches_plan(overrides):
    """The replay of MoE.forward: the router's fp32 logits and softmax (kept for the z- and balance losses),
    the routed copies of the tokens, the experts' grouped matmuls, their weighed outputs (index_add keeps
    its source) and the int64 indices that route them. Planned as a dense MLP as wide as the k chosen
    experts, tiny-moe's activations were 20% low; measured now: within 0.2% (capacity: the plan's bound)."""
    assert_matches_plan(measure("tiny-moe", *overrides))


def test_small_model_with_accumulation_and_fp32_main_grads():
    # hidden 128, 4 layers; two micro-batches folded into fp32 buffers by the post-accumulate hook
    timeline = measure("tiny", "model.hidden_size=128", "model.num_layers=4", "model.ffn_hidden_size=384",
                       "train.precision=bf16-mixed", "train.fp32_grad_accum=true", "train.grad_accum=2",
                       "train.recompute=selective", "model.attention=eager")
    assert_matches_plan(timeline)


def test_document_mask_matches_plan():
    assert_matches_plan(measure("tiny", "model.document_mask=true"))
    assert_matches_plan(measure("tiny", "model.document_mask=true", "model.attention=eager"))


def test_attention_scores_show_in_measured_activations():
    """Eager attention stores (4 + 4) bytes per score in fp32 (softmax output, its saved copy being the
    same tensor: 4, plus the score transient): the measured gap between eager and SDPA grows ~4x when
    the sequence doubles, while SDPA's own activations grow ~2x."""
    peaks = {(a, s): measure("tiny", f"model.attention={a}", f"train.seq_len={s}", steps=1).peaks["activations"]
             for a in ("eager", "sdpa") for s in (128, 256)}
    gap128, gap256 = (peaks["eager", s] - peaks["sdpa", s] for s in (128, 256))
    assert gap256 / gap128 == pytest.approx(4, rel=0.15)
    assert peaks["sdpa", 256] / peaks["sdpa", 128] == pytest.approx(2, rel=0.02)


def test_memory_cli_timeline(tmp_path, capsys):
    png = tmp_path / "timeline.png"
    assert main(["memory", "--preset", "tiny", "--set", "train.seq_len=64", "--set", "train.micro_batch_size=2",
                 "--steps", "4", "--synthetic", "--png", str(png), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert png.stat().st_size > 20_000
    assert out["steps"] == 4 and out["device"] == "cpu"
    assert out["peaks"]["startup"] >= 0  # measured while the Trainer was built (see assert_matches_plan)
    for row in out["comparison"]:
        if row["category"] != "startup":
            assert abs(row["error"]) <= TOLERANCE[row["category"]], row
    samples, marks = out["samples"], out["marks"]
    column = {c: i for i, c in enumerate(out["categories"])}
    starts = [i for i, label in marks if label.startswith("step")]
    forwards = [i for i, label in marks if label == "forward"]
    assert len(starts) == 4 and len(forwards) == 4
    # Adam's moments appear at the first optimizer step (fp32: nothing before it), then stay.
    assert samples[forwards[0]][column["optimizer_states"]] == 0
    assert samples[forwards[1]][column["optimizer_states"]] == out["peaks"]["optimizer_states"]
    # zero_grad(set_to_none=True) frees the gradients before the next step's forward.
    assert all(samples[i][column["gradients"]] == 0 for i in forwards)
    assert max(row[column["gradients"]] for row in samples) == out["peaks"]["gradients"] > 0
    # Activations go back to zero after every backward.
    assert all(samples[i - 1][column["activations"]] < 1000 for i in starts[1:])


def test_memory_cli_says_one_step_has_no_optimizer_states_in_its_total(capsys):
    """One step's forward and backward run before AdamW has made its moments; the planned total is every
    later step's, so the table says to measure more steps instead of reporting a 3% over-plan as such."""
    args = ["memory", "--preset", "tiny", "--set", "train.seq_len=64", "--set", "train.micro_batch_size=2",
            "--synthetic", "--steps"]
    assert main([*args, "1"]) == 0
    assert "measure 2 or more steps to compare it" in capsys.readouterr().out
    assert main([*args, "2"]) == 0
    assert "measure 2 or more steps" not in capsys.readouterr().out


@pytest.mark.parametrize("overrides", [
    ("lora.r=8",),
    ("lora.r=8", "lora.targets=q,v", "train.precision=bf16-mixed"),
    ("lora.r=8", "lora.dropout=0.1", "train.recompute=full"),
    ("lora.r=4", "lora.dropout=0.1", "train.recompute=selective", "model.attention=eager", "train.grad_accum=2"),
    ("lora.r=8", "lora.quantize_base=int4", "lora.group_size=32"),
    ("lora.r=8", "lora.quantize_base=int4", "train.precision=bf16-mixed", "train.recompute=full"),
    ("lora.r=8", "lora.dropout=0.1", "lora.targets=q,k,v,o,gate,up,down", "train.recompute=ops"),  # adapters' mms count
])
def test_lora_matches_plan(overrides):
    """LoRA (fivefold.finetune.lora): the frozen base holds no gradients or optimizer states, and saves
    fewer activations (no input of a frozen weight, no normalised x of a frozen gain, nothing for the first
    norm after a frozen embedding); each adapter saves its r-wide A output, with dropout its dropped input
    and mask. Exact on these runs, as for full training."""
    timeline = measure("tiny", *overrides)
    assert_matches_plan(timeline)
    # To the bytes. Full recomputation with dropout was -1.9% in total until the plan held, through the last
    # block's recomputation, the gradient the down_proj adapter has already scaled when backward asks for
    # its A's output (the first saved tensor it needs).
    rows = {name: measured - predicted for name, predicted, measured, _ in timeline.comparison()}
    assert abs(rows["activations"]) <= 64, rows
    assert abs(rows["total"]) <= 512, rows


def test_lora_in_gpt2_layout_matches_plan():
    assert_matches_plan(measure("tiny-gpt2", "lora.r=8", "lora.targets=q,k,v,o,up,down"))


@pytest.mark.parametrize("overrides", [
    ("train.loss_chunk=64",),
    ("train.loss_chunk=48", "train.precision=bf16-mixed", "train.recompute=full"),
    ("train.loss_chunk=100", "train.precision=bf16-mixed", "model.attention=eager", "train.recompute=selective"),
    ("train.loss_chunk=1000", "train.grad_accum=2"),  # one chunk holds every token
    ("train.loss_chunk=64", "lora.r=8"),  # a frozen head: no weight gradient, its input still saved
])
def test_chunked_loss_matches_plan(overrides):
    """The fused chunked head + loss (fivefold.train.chunked_loss): the normed input, 4 bytes of log-sum-exp
    and 10 of label masks per token are saved, one chunk's logits live at a time in forward and in backward,
    each beside its target logits and int64 indices."""
    timeline = measure("tiny", *overrides)
    assert_matches_plan(timeline)
    # To the bytes: the masks, the labels' flattened copy and the chunks' index tensors were 24 B a token short
    # (activations -0.24% to -0.32%, total to -0.19%) before the replay counted them (bench/memory_table.py).
    # A frozen head's total was -1.8% until the plan counted the final norm's backward, the peak once the
    # loss makes no weight gradient.
    rows = {name: measured - predicted for name, predicted, measured, _ in timeline.comparison()}
    assert abs(rows["activations"]) <= 64, rows
    assert abs(rows["total"]) <= 512, rows


def test_chunked_loss_needs_a_fraction_of_the_logits_memory():
    plain, chunked = (measure("tiny", "train.seq_len=256", f"train.loss_chunk={c}", steps=1).peaks for c in (0, 32))
    logits = 256 * 2 * 512 * 4  # one fp32 copy of the (tokens x vocabulary) logits
    assert plain["activations"] - chunked["activations"] > 1.9 * logits  # the fp32 logits and log-probabilities
    assert plain["total"] - chunked["total"] > 2 * logits  # at the step's peak, with the logits' gradients


@pytest.mark.parametrize("overrides", [
    ("parallel.tp=2", "train.precision=bf16-mixed"),  # each rank keeps a slice of the full values it draws
    ("parallel.dp=2", "parallel.zero=2"),  # ZeRO-2's gradient shards come after the parameters
    ("parallel.dp=2", "parallel.zero=1", "train.precision=bf16-mixed", "lora.r=8"),  # a frozen bf16 base
])
def test_startup_of_two_ranks_matches_plan(overrides):
    """The tensors each rank makes while its Trainer is built, against the plan's start-up peak: where
    the largest parameter (the LM head) is made last, the bound is reached exactly (a few bytes of 0-dim
    tensors aside). The bound counted before: a whole fp32 value of the largest parameter on top of what
    is kept (a frozen bf16 base holds 2 bytes more per element: under), and ZeRO-2's gradient shards on
    top of that (they come once the parameters are made: over)."""
    rows = measured_memory(2, "tiny", "train.seq_len=128", "train.micro_batch_size=2", *overrides)
    assert rows["startup"]["error"] == pytest.approx(0, abs=1e-3), rows["startup"]
