"""Trainer: the loss convention under accumulation, recomputation, mixed precision, resume, failures."""

import contextlib
import math

import pytest
import torch

from fivefold.train.trainer import Trainer, TrainingError


def grads(trainer):
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters()}


def first_batch(trainer, accum):
    """(inputs, labels) of the first global batch."""
    return trainer.global_batch(accum)


def test_accumulated_gradients_equal_big_batch_gradients(tiny_config):
    big = Trainer(tiny_config(**{"train.micro_batch_size": 8}), quiet=True)
    small = Trainer(tiny_config(**{"train.micro_batch_size": 2, "train.grad_accum": 4}), quiet=True)
    batch = first_batch(big, 1)
    assert torch.equal(batch[0], first_batch(small, 4)[0])  # same global batch whatever the micro-batching
    loss_big, loss_small = big.accumulate_gradients(*batch), small.accumulate_gradients(*batch)
    torch.testing.assert_close(loss_small, loss_big, rtol=1e-6, atol=0)
    torch.testing.assert_close(grads(small), grads(big), rtol=1e-5, atol=1e-7)


def test_accumulation_gives_the_same_losses_over_several_steps(tiny_config):
    runs = [Trainer(tiny_config(**{"train.micro_batch_size": mb, "train.grad_accum": ga}), quiet=True).fit()
            for mb, ga in ((8, 1), (4, 2), (1, 8))]
    ref = [r["loss"] for r in runs[0]]
    for other in runs[1:]:
        torch.testing.assert_close([r["loss"] for r in other], ref, rtol=1e-5, atol=0)
    assert all(r["batch_tokens"] == 8 * 32 for run in runs for r in run)


def test_padding_tokens_do_not_count(tiny_config):
    """The loss is the mean over non-padding labels of the whole global batch, across micro-batches."""
    from fivefold.train.loss import token_loss_sum
    trainer = Trainer(tiny_config(**{"train.micro_batch_size": 2, "train.grad_accum": 2}), quiet=True)
    inputs, labels = first_batch(trainer, 2)
    labels = labels.clone()
    labels[0, 10:] = -100  # most of the first micro-batch's first sequence is padding
    loss = trainer.accumulate_gradients(inputs, labels).item()
    with torch.no_grad():
        expected = token_loss_sum(trainer.model, inputs, labels, trainer.cfg).item() / (labels != -100).sum().item()
    assert loss == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_recompute_modes_give_identical_gradients(tiny_config, attention):
    results = {}
    for mode in ("none", "selective", "ops", "full"):
        trainer = Trainer(tiny_config(**{"train.recompute": mode, "model.attention": attention,
                                         "train.grad_accum": 2}), quiet=True)
        loss = trainer.accumulate_gradients(*first_batch(trainer, 2))
        results[mode] = (loss, grads(trainer))
    for mode in ("selective", "ops", "full"):
        torch.testing.assert_close(results[mode][0], results["none"][0], rtol=0, atol=0)
        torch.testing.assert_close(results[mode][1], results["none"][1], rtol=1e-6, atol=1e-9)


def test_recompute_saves_activation_memory(tiny_config):
    saved = {}  # (ops keeps its matmul outputs outside autograd's saved tensors: test_memory_measured sees them)
    for mode in ("none", "selective", "full"):
        trainer = Trainer(tiny_config(**{"train.recompute": mode, "model.attention": "eager"}), quiet=True)
        inputs, _ = first_batch(trainer, 1)
        total = [0]

        def pack(t):
            total[0] += t.numel() * t.element_size()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            trainer.model(inputs)
        saved[mode] = total[0]
    assert saved["full"] < saved["selective"] < saved["none"]


def test_bf16_mixed_keeps_fp32_masters(tiny_config):
    trainer = Trainer(tiny_config(**{"train.precision": "bf16-mixed"}), quiet=True)
    assert all(p.dtype == torch.bfloat16 for p in trainer.model.parameters())
    assert all(m.dtype == torch.float32 for m in trainer.optimizer.masters)
    states = trainer.optimizer.inner
    trainer.fit(until=3)
    for p, m in zip(trainer.optimizer.params, trainer.optimizer.masters):
        assert torch.equal(p, m.to(torch.bfloat16))  # the model runs on the rounded masters
        assert states.state[m]["exp_avg"].dtype == torch.float32
    # The masters carry precision the bf16 copy cannot: updates smaller than a bf16 ulp accumulate.
    assert any(not torch.equal(m, p.float()) for p, m in zip(trainer.optimizer.params, trainer.optimizer.masters))


def test_fp32_gradient_accumulation_buffers(tiny_config):
    overrides = {"train.precision": "bf16-mixed", "train.grad_accum": 2}
    mixed = Trainer(tiny_config(**overrides, **{"train.fp32_grad_accum": True}), quiet=True)
    plain = Trainer(tiny_config(**overrides), quiet=True)
    ref = Trainer(tiny_config(**{"train.grad_accum": 2}), quiet=True)
    inputs, labels = first_batch(ref, 2)
    mixed.accumulate_gradients(inputs, labels)
    ref.accumulate_gradients(inputs, labels)
    assert all(p.grad is None for p in mixed.model.parameters())  # bf16 grads folded away immediately
    # Exactly the fp32 sum of each micro-batch's bf16 gradient (no bf16 rounding of the running sum).
    expected = [torch.zeros_like(m) for m in plain.optimizer.masters]
    num_tokens = labels.numel()
    for mb in torch.arange(len(inputs)).split(4):
        plain.parallel.forward_backward(inputs[mb], labels[mb], torch.tensor(num_tokens))
        for e, p in zip(expected, plain.model.parameters()):
            e += p.grad.float()
            p.grad = None
    for buf, e in zip(mixed.optimizer.main_grads, expected):
        assert buf.dtype == torch.float32 and torch.equal(buf, e)
    # And close to the fp32 model's gradient, up to bf16 forward/backward noise.
    for buf, p in zip(mixed.optimizer.main_grads, ref.model.parameters()):
        assert (buf - p.grad).norm() <= 0.05 * p.grad.norm()
    mixed.optimizer.step(1e-3, 1.0)
    mixed.optimizer.zero_grad()
    assert all(buf.abs().sum() == 0 for buf in mixed.optimizer.main_grads)


def optimizer_state(trainer, parameters=True):
    """Every value an optimizer step may change: parameters, masters, moments, step counts."""
    inner = trainer.optimizer.inner
    return ([p.detach().clone() for p in trainer.model.parameters()] * parameters
            + [m.detach().clone() for m in trainer.optimizer.masters]
            + [v.clone() for state in inner.state.values() for v in state.values()])


@pytest.mark.parametrize("impl", ["fused", "foreach", "compiled"])
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_a_nan_loss_is_reported_with_the_step_and_its_update_is_not_applied(tiny_config, impl, precision):
    trainer = Trainer(tiny_config(**{"train.optimizer_impl": impl, "train.precision": precision}), quiet=True)
    trainer.fit(until=2)
    with torch.no_grad():
        trainer.model.layers[0].mlp.up_proj.weight.fill_(float("nan"))
    # the masters and moments; under bf16-mixed the parameters are the masters' rounding, rewritten from them
    before = optimizer_state(trainer, parameters=False)
    with pytest.raises(TrainingError, match=r"loss is nan at step 3 \(the step's update was not applied\)"):
        trainer.train_step()
    after = optimizer_state(trainer, parameters=False)
    assert len(after) == len(before)
    assert all(torch.allclose(a, b, rtol=0, atol=0, equal_nan=True) for a, b in zip(after, before))


@pytest.mark.parametrize("impl", ["fused", "foreach", "compiled"])
def test_an_infinite_gradient_with_a_finite_loss_changes_no_weight(tiny_config, impl):
    trainer = Trainer(tiny_config(**{"train.optimizer_impl": impl}), quiet=True)
    trainer.fit(until=2)
    before = optimizer_state(trainer)
    handle = trainer.model.layers[1].mlp.down_proj.weight.register_hook(lambda g: g * float("inf"))
    with pytest.raises(TrainingError, match=r"gradient norm is (inf|nan) at step 3 \(the step's update was not"):
        trainer.train_step()
    handle.remove()
    after = optimizer_state(trainer)
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    # and the run goes on from the same state: the next step is the one a fresh run takes there
    record = trainer.train_step()
    assert math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"])


@pytest.mark.parametrize("grad_clip", [0.0, 1e4])
@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_the_chunked_update_is_torch_adamw_step_bit_for_bit(tiny_config, impl, grad_clip):
    """MasterWeightAdamW calls the functional AdamW chunk by chunk (told on the device that the step is finite):
    masters, moments and step counts equal torch.optim.AdamW.step's over the same gradients, bit for bit. A
    clipping norm far above the gradients' changes nothing: clipping only ever scales down (a coefficient above
    1 would move every bit of Adam's update, though hardly its size)."""
    from fivefold.memory.formulas import is_no_decay

    trainer = Trainer(tiny_config(**{"train.optimizer_impl": impl, "train.precision": "bf16-mixed"}), quiet=True)
    opt, t = trainer.optimizer, trainer.cfg.train
    masters = [m.detach().clone() for m in opt.masters]
    groups = [{"params": [m for n, m in zip(opt.names, masters) if not is_no_decay(n)], "weight_decay": t.weight_decay},
              {"params": [m for n, m in zip(opt.names, masters) if is_no_decay(n)], "weight_decay": 0.0}]
    reference = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                                  **({"fused": True} if impl == "fused" else {"foreach": True}))
    for step in range(3):
        trainer.accumulate_gradients(*trainer.global_batch(1))
        for m, p in zip(masters, trainer.model.parameters()):
            m.grad = p.grad.float()
        norm = opt.step(1e-3 * (step + 1), grad_clip, torch.tensor(2.5))
        assert float(norm) < grad_clip or not grad_clip
        opt.zero_grad()
        for group in reference.param_groups:
            group["lr"] = 1e-3 * (step + 1)
        reference.step()
        reference.zero_grad()
        assert math.isfinite(float(norm))
    assert all(torch.equal(a, b) for a, b in zip(opt.masters, masters))
    for ours, ref in zip(opt.masters, masters):
        mine, theirs = opt.inner.state[ours], reference.state[ref]
        assert all(torch.equal(mine[k], theirs[k]) for k in ("exp_avg", "exp_avg_sq", "step"))


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp32"])
def test_the_compiled_update_is_torch_adamw_within_fp32_rounding(tiny_config, precision):
    """train.optimizer_impl=compiled (one compiled kernel a tensor, reading the bf16 gradients as they are):
    over three clipped steps with a changing learning rate, masters and moments within fp32 rounding of
    torch.optim.AdamW.step's over the same clipped fp32 gradients, step counts equal, the bf16 parameters the
    masters' rounding, and no fp32 copy of any gradient made."""
    from fivefold.memory.formulas import is_no_decay

    trainer = Trainer(tiny_config(**{"train.optimizer_impl": "compiled", "train.precision": precision}), quiet=True)
    opt, t = trainer.optimizer, trainer.cfg.train
    masters = [m.detach().clone() for m in opt.masters]
    groups = [{"params": [m for n, m in zip(opt.names, masters) if not is_no_decay(n)], "weight_decay": t.weight_decay},
              {"params": [m for n, m in zip(opt.names, masters) if is_no_decay(n)], "weight_decay": 0.0}]
    reference = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, fused=True)
    import fivefold.train.optim as optim
    copies = []
    real_copies = optim._fp32_copies
    optim._fp32_copies = lambda grads: copies.append(1) or real_copies(grads)
    try:
        for step in range(3):
            trainer.accumulate_gradients(*trainer.global_batch(1))
            grads = [p.grad.float() for p in trainer.model.parameters()]
            norm = opt.step(1e-3 * (step + 1), 0.5)
            coef = min(1.0, 0.5 / (float(norm) + 1e-6))
            for m, g in zip(masters, grads):
                m.grad = g * coef
            opt.zero_grad()
            for group in reference.param_groups:
                group["lr"] = 1e-3 * (step + 1)
            reference.step()
            reference.zero_grad()
            assert coef < 1  # the clip took part
    finally:
        optim._fp32_copies = real_copies
    assert not copies
    for ours, ref in zip(opt.masters, masters):
        torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-7)
        mine, theirs = opt.inner.state[ours], reference.state[ref]
        torch.testing.assert_close(mine["exp_avg"], theirs["exp_avg"], rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(mine["exp_avg_sq"], theirs["exp_avg_sq"], rtol=1e-6, atol=1e-12)
        assert torch.equal(mine["step"].cpu(), theirs["step"].cpu()) and float(mine["step"]) == 3
    for p, m in zip(trainer.model.parameters(), opt.masters):
        assert torch.equal(p, m.to(p.dtype))


def test_a_step_reads_nothing_back_before_its_update_is_queued(tiny_config, monkeypatch):
    """The step's one wait for the device comes after the optimizer has queued the update, so a GPU never idles
    while the host works through the optimizer's launches."""
    trainer = Trainer(tiny_config(**{"train.precision": "bf16-mixed"}), quiet=True)
    trainer.train_step()
    events = []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy"):
        original = getattr(torch.Tensor, name)

        def reading(self, *args, _name=name, _original=original, **kwargs):
            events.append(_name)
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, reading)
    step = trainer.optimizer.step

    def stepping(*args, **kwargs):
        out = step(*args, **kwargs)
        events.append("update queued")
        return out
    monkeypatch.setattr(trainer.optimizer, "step", stepping)
    trainer.train_step()
    assert "update queued" in events
    assert events.index("update queued") == 0, events
    assert events[1] == "tolist", events  # the loss, the gradient norm and the token count, read together


def test_loss_decreases(tiny_config):
    history = Trainer(tiny_config(**{"train.steps": 30, "train.micro_batch_size": 8}), quiet=True).fit()
    first = sum(r["loss"] for r in history[:3]) / 3
    last = sum(r["loss"] for r in history[-3:]) / 3
    assert last < first - 0.5
    assert all(math.isfinite(r["grad_norm"]) and r["mfu"] > 0 for r in history)


def test_batch_size_schedule_grows_the_batch_and_scales_lr(tiny_config):
    cfg = tiny_config(**{"train.batch_schedule": "256:2,768:4", "train.lr_scaling": "linear",
                         "train.lr_schedule": "constant", "train.warmup_steps": 0, "train.steps": 5})
    history = Trainer(cfg, quiet=True).fit()
    # Global batch is 4 x 32 = 128 tokens, then 256 once 256 tokens were seen, then 512 after 768.
    assert [r["batch_tokens"] for r in history] == [128, 128, 256, 256, 512]
    assert [r["lr"] / cfg.train.lr for r in history] == pytest.approx([1, 1, 2, 2, 4])


def test_weight_decay_skips_norms_biases_and_embeddings(tiny_config):
    trainer = Trainer(tiny_config(preset="tiny-gpt2"), quiet=True)
    decay, rest = trainer.optimizer.inner.param_groups
    by_id = {id(m): n for n, m in zip(trainer.optimizer.names, trainer.optimizer.masters)}
    decayed = sorted(by_id[id(p)] for p in decay["params"])
    assert decay["weight_decay"] == trainer.cfg.train.weight_decay and rest["weight_decay"] == 0.0
    assert decayed and all(n.endswith(("_proj.weight",)) for n in decayed)
    assert {"embed_tokens.weight", "embed_positions.weight", "norm.weight", "layers.0.attn.q_proj.bias"} <= {
        by_id[id(p)] for p in rest["params"]}


def test_compiled_blocks_and_loss_give_the_same_steps(tiny_config):
    """train.compile=true (torch.compile per block, the final norm and the loss) and =blocks (the blocks
    only) train to the same losses and gradient norms as eager PyTorch; dynamo's count of graphs says the
    norm and the loss were compiled (one graph each) under true and not under blocks."""
    from torch._dynamo.utils import counters

    eager = Trainer(tiny_config(**{"train.steps": 3}), quiet=True).fit()
    graphs = {}
    for compile in ("blocks", "true"):
        torch._dynamo.reset()
        counters.clear()
        compiled = Trainer(tiny_config(**{"train.steps": 3, "train.compile": compile}), quiet=True).fit()
        graphs[compile] = counters["stats"]["unique_graphs"]
        for key in ("loss", "grad_norm"):
            torch.testing.assert_close([r[key] for r in compiled], [r[key] for r in eager], rtol=1e-5, atol=0)
    assert graphs["blocks"] >= 1 and graphs["true"] >= graphs["blocks"] + 2, graphs


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_chunked_master_weight_step_equals_torch_adamw(tiny_config, precision):
    """Our step (global-norm clip, then one block at a time over fp32 masters) equals torch's AdamW +
    clip_grad_norm_ over an fp32 copy holding the same gradients."""
    from fivefold.model import build_model
    from fivefold.memory.formulas import is_no_decay
    trainer = Trainer(tiny_config(**{"train.precision": precision, "train.grad_clip": 0.05}), quiet=True)
    ref = build_model(trainer.cfg.model, seed=trainer.cfg.train.seed)
    named = list(ref.named_parameters())
    t = trainer.cfg.train
    adamw = torch.optim.AdamW([{"params": [p for n, p in named if not is_no_decay(n)], "weight_decay": t.weight_decay},
                               {"params": [p for n, p in named if is_no_decay(n)], "weight_decay": 0.0}],
                              lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, foreach=False)
    for _ in range(2):
        trainer.accumulate_gradients(*first_batch(trainer, 1))
        for (_, r), p in zip(named, trainer.model.parameters()):
            r.grad = p.grad.float().clone()
        norm = trainer.optimizer.step(t.lr, t.grad_clip)
        trainer.optimizer.zero_grad()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), t.grad_clip)
        adamw.step()
        adamw.zero_grad()
        torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
    for (name, r), m in zip(named, trainer.optimizer.masters):
        torch.testing.assert_close(m, r, rtol=1e-5, atol=1e-7, msg=name)


def test_evaluation_runs_on_its_own_schedule(tiny_config):
    """eval_every need not be a multiple of log_every: every evaluation step is logged with val_loss."""
    import json
    trainer = Trainer(tiny_config(**{"train.steps": 7, "train.log_every": 3, "train.eval_every": 2}), quiet=True)
    trainer.fit()
    records = [json.loads(line) for line in (trainer.out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 3, 4, 6, 7]
    assert [r["step"] for r in records if "val_loss" in r] == [2, 4, 6, 7]
    with torch.no_grad():
        assert records[-1]["val_loss"] == pytest.approx(trainer.evaluate(), rel=1e-6)


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_trainer_memory_is_freed_on_del_without_gc(tiny_config, precision):
    """No reference cycle keeps a finished trainer's parameters, masters or Adam moments alive until the
    cycle collector runs (tests/run_layouts.py checks the same for every parallel layout)."""
    import gc
    import weakref

    gc.collect()
    gc.disable()
    try:
        trainer = Trainer(tiny_config(**{"train.precision": precision}), quiet=True)
        trainer.train_step()
        opt = trainer.optimizer
        refs = [weakref.ref(t) for t in (*trainer.model.parameters(), *opt.masters,
                                         *(v for s in opt.inner.state.values() for v in s.values()))]
        del trainer, opt
        assert [r() for r in refs].count(None) == len(refs)
    finally:
        gc.enable()


def test_peak_flops_of_an_emulated_dtype_keeps_the_probe(monkeypatch):
    """MFU's peak is measured at 2048^3 unless a 512^3 probe says that would take minutes (bf16 on a CPU
    without native bf16): then the probe's figure stands, and no full-size matmul runs."""
    from fivefold.train import metrics

    sizes = []

    def fake(device, dtype, size=2048, reps=8):
        sizes.append(size)
        return {torch.float32: 1.5e11, torch.bfloat16: 2e9}[dtype]  # bf16 at ~1% of fp32, as emulated
    monkeypatch.setattr(metrics, "measure_peak_flops", fake)
    assert metrics.probed_peak_flops(torch.device("cpu"), torch.bfloat16) == 2e9 and sizes == [512]
    sizes.clear()
    assert metrics.probed_peak_flops(torch.device("cpu"), torch.float32) == 1.5e11 and sizes == [512, 2048]


def test_the_measured_peak_is_the_best_ever_seen(monkeypatch, tmp_path):
    """A peak measured while the machine is busy reads low and would inflate MFU: each run measures again, and
    the best figure ever seen for the device, dtype and threads is the one used and remembered."""
    import json

    from fivefold.train import metrics

    readings = iter([1e11, 5e10, 1.5e11])
    monkeypatch.setattr(metrics, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(metrics, "probed_peak_flops", lambda device, dtype: next(readings))
    seen = []
    for _ in range(3):  # three runs: the cache in memory is per process
        metrics.peak_flops.cache_clear()
        seen.append(metrics.peak_flops(torch.device("cpu"), torch.float32, 2))
    metrics.peak_flops.cache_clear()
    assert seen == [1e11, 1e11, 1.5e11]
    assert list(json.loads((tmp_path / "peak_flops.json").read_text()).values()) == [1.5e11]


@pytest.mark.parametrize("device, gpu, override, expected", [
    ("cuda", "NVIDIA H200", 0.0, (989e12, "bf16 datasheet, hardware profile h200", 7e14)),
    ("cuda", "NVIDIA A100-SXM4-80GB", 0.0, (312e12, "bf16 datasheet, hardware profile a100-80gb", 7e14)),
    ("cuda", "NVIDIA H200", 5e14, (5e14, "train.peak_flops", None)),
    ("cuda", "NVIDIA H100 PCIe", 0.0, (7e14, "measured: no hardware profile matches 'NVIDIA H100 PCIe', so MFU "
                                             "is against the measured achievable peak", None)),
    ("cpu", None, 0.0, (2e11, "measured", None)),
    ("cpu", None, 1e11, (1e11, "train.peak_flops", None)),
])
def test_mfu_peak_is_the_datasheet_of_a_known_gpu(monkeypatch, device, gpu, override, expected):
    """MFU divides by a known GPU's dense datasheet peak, with the measured achievable peak beside it;
    train.peak_flops wins and measures nothing; an unknown GPU and a CPU use the measured peak. The device
    name and the measurement are stubbed, so no GPU is needed."""
    from fivefold.train import metrics

    measured = []

    def fake_measured(dev, dtype, threads):
        measured.append(dev.type)
        return 7e14 if dev.type == "cuda" else 2e11
    monkeypatch.setattr(metrics, "peak_flops", fake_measured)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu)
    peaks = metrics.mfu_peaks(torch.device(device), torch.bfloat16, override, threads=2)
    assert (peaks.peak, peaks.source, peaks.achievable) == expected
    assert measured == ([] if override else [device])


def test_trainer_logs_and_prints_mfu_against_both_peaks(tiny_config, monkeypatch, capsys):
    """With a datasheet peak, each step logs `mfu` against it and `mfu_achievable` against the measured peak,
    and prints both; with one peak (here train.peak_flops) there is one figure."""
    from fivefold.train import trainer as trainer_module
    from fivefold.train.metrics import MfuPeaks

    single = Trainer(tiny_config(**{"train.steps": 1}), quiet=True).train_step()
    assert "mfu_achievable" not in single
    monkeypatch.setattr(trainer_module, "mfu_peaks", lambda *args: MfuPeaks(1e12, "bf16 datasheet", 2.5e11))
    trainer = Trainer(tiny_config(**{"train.steps": 1}))
    record = trainer.train_step()
    assert record["mfu_achievable"] == pytest.approx(4 * record["mfu"], rel=1e-12)
    trainer._print(record)
    assert f"mfu {100 * record['mfu']:.1f}% of datasheet, {100 * record['mfu_achievable']:.1f}% of measured " \
           f"achievable" in capsys.readouterr().out


def test_cuda_peak_is_timed_by_events_over_back_to_back_products(monkeypatch):
    """measure_cuda_peak_flops' arithmetic, on stand-in events (no GPU): `reps` products between two events
    per round, the fastest round kept, milliseconds to seconds."""
    from fivefold.train import metrics

    rounds = iter([30.0, 20.0, 25.0])  # ms per round of 10 products: the best is 2 ms a product

    class Event:
        def __init__(self, enable_timing):
            pass

        def record(self):
            pass

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return next(rounds)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(metrics, "CUDA_PEAK_SIZE", {torch.float32: 64})
    flops = metrics.measure_cuda_peak_flops(torch.device("cpu"), torch.float32, reps=10, rounds=3)
    assert flops == pytest.approx(2 * 64 ** 3 / 2e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_measured_cuda_peak_is_below_the_datasheet():
    """On a GPU a profile describes, the measured achievable bf16 peak lies under the datasheet's (so MFU
    against either stays under 100%) and well above what the old 2048^3 host-timed figure read (55%)."""
    from fivefold.train.metrics import datasheet_peak_flops, measure_cuda_peak_flops

    device = torch.device("cuda")
    datasheet = datasheet_peak_flops(device, torch.bfloat16)
    if datasheet is None:
        pytest.skip(f"no hardware profile describes {torch.cuda.get_device_name(device)}")
    assert 0.6 * datasheet[0] < measure_cuda_peak_flops(device, torch.bfloat16) < datasheet[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_step_waits_for_the_device_only_after_its_update_is_queued(tiny_config):
    """CUDA's sync debug mode flags every implicit wait (a read, a copy from pageable memory, nonzero): from the
    forward of the first micro-batch to the queued update there is none, micro-batches and bf16 included."""
    import warnings

    trainer = Trainer(tiny_config(**{"train.device": "cuda", "train.precision": "bf16-mixed", "train.grad_accum": 2,
                                     "train.micro_batch_size": 2, "train.compile": "false"}), quiet=True)
    trainer.train_step()
    marks = {}
    accumulate, step = trainer.accumulate_gradients, trainer.optimizer.step

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        def accumulating(*args, **kwargs):
            marks["forward"] = len(caught)
            return accumulate(*args, **kwargs)

        def stepping(*args, **kwargs):
            out = step(*args, **kwargs)
            marks["queued"] = len(caught)
            return out
        trainer.accumulate_gradients, trainer.optimizer.step = accumulating, stepping
        torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer.train_step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = [str(w.message) for w in caught[marks["forward"]:marks["queued"]] if "synchroniz" in str(w.message)]
    assert syncs == [], syncs
    assert any("synchroniz" in str(w.message) for w in caught[marks["queued"]:])  # the mode did flag the read
