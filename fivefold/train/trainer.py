"""The single-process trainer: data -> micro-batches -> forward/backward -> optimizer step -> metrics
-> checkpoint. Parallel dimensions plug in from outside (fivefold/parallel) without changing this loop's
loss convention: the loss of a global batch is the mean over all its non-padding tokens, whatever the
micro-batching, so accumulated gradients equal the big-batch gradients.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
import warnings
from pathlib import Path

import torch

from fivefold.checkpoint import store as ckpt
from fivefold.checkpoint.files import read_json, read_tensors
from fivefold.checkpoint.pieces import read_state
from fivefold.config import Config, ConfigError
from fivefold.config_checks import resume_conflicts
from fivefold.data.dataset import ResumableSampler
from fivefold.data.labels import IGNORE_INDEX
from fivefold.data.load import load_datasets
from fivefold.errors import CheckpointError, CheckpointSaveError, UserError
from fivefold.memory.formulas import checkpoint_bytes, count_params, flops_per_token
from fivefold.parallel.hooks import weak
from fivefold.parallel.mesh import init_mesh, local_device, resolve_device
from fivefold.train.batch_ramp import AutoBatchRamp
from fivefold.train.interrupt import GracefulStop
from fivefold.train.metrics import MetricsLog, memory_bytes, mfu_peaks, progress_bar
from fivefold.train.noise_scale import NoiseScale
from fivefold.train.optim import grad_accum_at, lr_at
from fivefold.train.parallelize import compute_dtype, parallelize
from fivefold.train.routing import RouterLosses
from fivefold.weights import init_from_values, take_source_shape


class TrainingError(UserError, RuntimeError):
    """Training cannot continue (e.g. the loss became NaN); the message names the step and what to try."""


class Trainer:
    def __init__(self, cfg: Config, out_dir: str | Path | None = None, resume: bool = False,
                 quiet: bool = False, datasets=None):
        self.cfg = take_source_shape(cfg)
        self.out_dir = Path(out_dir or cfg.train.out_dir)
        self.device = local_device(resolve_device(cfg.train.device))
        self.mesh = init_mesh(cfg, self.device)  # checks the layout before any process group starts
        self.quiet = quiet or not self.mesh.is_main
        torch.manual_seed(cfg.train.seed)
        if datasets is None and not self.mesh.is_main:
            self.mesh.barrier()  # let rank 0 build the data cache (corpus, tokenizer, shards) first
        self.data = datasets or load_datasets(cfg)
        if datasets is None and self.mesh.is_main:
            self.mesh.barrier()
        # The layout is applied to a model without memory; then this rank's parameters are materialised.
        self.parallel = parallelize(cfg, self.mesh, self.device)
        self.model = self.parallel.model
        self.routing = None
        if self.parallel.moe_layers:
            self.routing = RouterLosses(cfg.model.num_experts, self.device, weak(self.parallel.sum_over_model))
            self.parallel.router_loss = self.routing
        resuming = resume and bool(ckpt.checkpoint_candidates(self.checkpoint_root))
        self.optimizer, self.reducer = self.parallel.materialise(self._initial_weights(resuming))
        self.sampler = ResumableSampler(len(self.data.train), cfg.train.seed)
        self.step = 0
        self.tokens_seen = 0
        self.base_batch_tokens = cfg.train.base_batch_tokens or cfg.global_batch_tokens
        self.flops_per_token = flops_per_token(cfg.model, cfg.train.seq_len)
        # Float8 matmuls emulated off CUDA multiply in fp32: that is the peak they run against there.
        peak_dtype = torch.float32 if cfg.train.precision == "fp8" and self.device.type != "cuda" \
            else compute_dtype(cfg)
        # A known GPU's datasheet peak (with the measured one beside it), train.peak_flops, or the measured peak.
        self.peaks = mfu_peaks(self.device, peak_dtype, cfg.train.peak_flops, torch.get_num_threads())
        self.peak_flops = self.peaks.peak
        self.num_params = count_params(cfg.model)
        # The gradient noise scale, and the batch ramp that follows it (train.batch_ramp=auto).
        self.noise = NoiseScale(cfg.train.gns_ema)
        self.ramp = None
        if cfg.train.batch_ramp == "auto":
            interleaved = cfg.parallel.pp > 1 and cfg.parallel.pp_schedule == "interleaved"
            self.ramp = AutoBatchRamp(cfg.train, self.mesh.dp_size, cfg.parallel.pp if interleaved else 1)
        self.notes: set[str] = set()  # one-time notes already given (why gns is not measured)
        self.interrupted = 0  # the signal fit() stopped for
        self.save_error: str | None = None  # why the latest save failed (None: it succeeded)
        self.saved_step: int | None = None
        if self.mesh.is_main and self.checkpoint_root.is_dir():
            ckpt.remove_abandoned(self.checkpoint_root)  # what a killed save left behind
        if not (resume and self.load_latest()) and cfg.train.init_from and not self.quiet:
            print(f"initialised from {cfg.train.init_from}")

    def _initial_weights(self, resuming: bool):
        """The value source `materialise` makes this rank's parameters from (fivefold.train.parallelize.
        init_from_values), or None for the seeded init. A resumed run reads its checkpoint instead, except
        a LoRA run's frozen base, which its checkpoints do not hold."""
        if resuming and not self.cfg.lora.r:
            return None
        return init_from_values(self.cfg)

    # ---------------------------------------------------------------------------------------------
    def global_batch(self, grad_accum: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's global batch as (inputs, labels), each (micro_batch_size * grad_accum * dp, seq_len):
        the same tokens in the same order whatever the parallel layout; labels the loss does not count
        (fine-tuning prompts, padding) are IGNORE_INDEX."""
        n = self.cfg.train.micro_batch_size * grad_accum * self.mesh.dp_size
        inputs, labels = self.data.train.pairs(self.sampler.take(n))
        return inputs.to(self.device), labels.to(self.device)

    def accumulate_gradients(self, inputs: torch.Tensor, labels: torch.Tensor,
                             measure_small_batch: bool = False) -> torch.Tensor:
        """Forward and backward over a global batch (N, S) in micro-batches; returns the global mean loss
        over the labels that are not IGNORE_INDEX (padding). `measure_small_batch`: capture the first
        micro-batch's gradient norm for the noise scale (read by `parallel.small_batch.result`)."""
        num_tokens = (labels != IGNORE_INDEX).sum()  # of the global batch: every rank holds all of it
        mine = self.parallel.local_rows(len(inputs))
        inputs, labels, docs = self.parallel.local_columns(inputs[mine], labels[mine])
        if self.routing is not None:
            micro_batches = -(-len(inputs) // self.cfg.train.micro_batch_size)
            self.routing.start_step(micro_batches * self.mesh.dp_size)  # context-parallel ranks share one
        return self.parallel.forward_backward(inputs, labels, num_tokens, docs, measure_small_batch)

    def train_step(self) -> dict:
        cfg = self.cfg.train
        summary = getattr(self.data.train, "summary", "")  # fine-tuning data describes itself once
        if summary and summary not in self.notes:
            self.notes.add(summary)
            self._say(summary)
        start = time.perf_counter()
        accum = self.ramp.grad_accum if self.ramp is not None else grad_accum_at(self.tokens_seen, cfg)
        inputs, labels = self.global_batch(accum)
        targets = (labels != IGNORE_INDEX).sum()  # the labels that count: B_big of the noise scale
        loss = self.accumulate_gradients(inputs, labels, measure_small_batch=True)
        batch_tokens = labels.numel()
        lr = lr_at(self.step, cfg, batch_tokens, self.base_batch_tokens)
        # The update is queued before anything is read back (a non-finite loss or norm makes it change nothing,
        # fivefold.train.optim): on a GPU the host runs ahead through the optimizer while the backward
        # runs, and the step waits for the device once, here, where three waits used to stall it.
        norm = self.optimizer.step(lr, cfg.grad_clip, loss)
        self.optimizer.zero_grad()
        if self.reducer is not None:
            self.reducer.zero_grad()
        loss_value, grad_norm, target_tokens = torch.stack([loss.double(), norm.double(), targets.double()]).tolist()
        target_tokens = int(target_tokens)
        if not math.isfinite(loss_value):
            raise TrainingError(f"loss is {loss_value} at step {self.step + 1} (the step's update was not applied); "
                                f"lower train.lr, enable train.grad_clip, or use train.precision=fp32 to locate the "
                                f"overflow")
        if not math.isfinite(grad_norm):
            raise TrainingError(f"gradient norm is {grad_norm} at step {self.step + 1} (the step's update was not "
                                f"applied); lower train.lr or use train.precision=fp32")
        self._measure_noise(accum, grad_norm, target_tokens)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - start
        self.step += 1
        self.tokens_seen += batch_tokens
        tokens_per_sec = batch_tokens / elapsed
        routing = self.routing.record() if self.routing is not None else {}
        flops_per_device = tokens_per_sec * self.flops_per_token / self.mesh.world_size
        record = {**routing, "step": self.step, "loss": loss_value, "lr": lr, "grad_norm": grad_norm,
                  "tokens_per_sec": tokens_per_sec, "mfu": flops_per_device / self.peak_flops,
                  "batch_tokens": batch_tokens, "grad_accum": accum, "tokens_seen": self.tokens_seen,
                  "step_time": elapsed, **self.noise.record()}
        if self.peaks.achievable is not None:  # a datasheet MFU: the fraction of the measured peak beside it
            record["mfu_achievable"] = flops_per_device / self.peaks.achievable
        if self.ramp is not None and self.ramp.due(self.step):
            self._reconsider_batch(target_tokens / accum)
        return record

    def _measure_noise(self, accum: int, grad_norm: float, target_tokens: int) -> None:
        """Fold this step's two batch sizes into the noise scale: the first micro-batch's gradient (captured
        during backward) and the whole step's, whose norm is the clipping norm (fivefold.train.noise_scale)."""
        probe = self.parallel.small_batch
        small = probe.result(target_tokens)  # collective: every rank, every step
        if small is not None:
            self.noise.update(small[0], small[1], grad_norm ** 2, target_tokens)
            return
        reason = probe.unavailable(accum)
        if reason is not None and reason not in self.notes:
            self.notes.add(reason)
            self._say(f"note: gns (the gradient noise scale) is not measured: {reason}")

    def _reconsider_batch(self, tokens_per_accum: float) -> None:
        """train.batch_ramp=auto: grow grad_accum toward the noise scale, by the maximum of every rank's
        proposal (fivefold.train.batch_ramp)."""
        proposal = torch.tensor(self.ramp.target(self.noise, tokens_per_accum), device=self.device)
        if self.mesh.distributed:
            import torch.distributed as dist

            dist.all_reduce(proposal, op=dist.ReduceOp.MAX)
        before = self.ramp.grad_accum
        if self.ramp.grow(int(proposal.item())):
            self._say(f"batch ramp: gns {self.noise.value:,.0f} tokens; grad_accum {before} -> {self.ramp.grad_accum} "
                      f"from step {self.step + 1}")

    def _say(self, message: str) -> None:
        if not self.quiet:
            from tqdm import tqdm
            tqdm.write(message)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss per counted label (not IGNORE_INDEX) on the first `eval_batches * micro_batch_size`
        validation sequences, shared out across data-parallel ranks like a training batch."""
        cfg = self.cfg.train
        n = min(len(self.data.val), cfg.eval_batches * cfg.micro_batch_size)
        per_step = cfg.micro_batch_size * self.mesh.dp_size
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss sum, token count
        for first in range(0, n, per_step):
            rows = list(range(first, min(n, first + per_step)))
            mine = rows[self.parallel.local_rows(len(rows))]
            # A rank left without rows by the ragged tail still runs a forward (ZeRO-3 gathers
            # parameters inside it, collectively), and counts nothing.
            inputs, labels = (t.to(self.device) for t in self.data.val.pairs(mine or rows[:1]))
            inputs, labels, docs = self.parallel.local_columns(inputs, labels)
            loss = self.parallel.eval_loss_sum(inputs, labels, docs)
            if mine:  # summed on the device: the evaluation waits for it once, at the end
                totals += torch.stack([loss.double(), (labels != IGNORE_INDEX).sum().double()])
        self.parallel.sum_over_batch(totals)
        return (totals[0] / totals[1]).item()

    def unigram_loss(self) -> float:
        """Validation loss of the best context-free predictor (train-split token frequencies, add-one
        smoothed): the bar a model must clear to show it learned anything beyond token counts. On
        fine-tuning data, over the target tokens only, as the loss counts them."""
        import numpy as np

        def tokens(data) -> np.ndarray:
            if hasattr(data, "store"):  # a token store: every token
                return data.store.read(0, data.store.num_tokens)
            labels = data.pairs(range(len(data)))[1]
            return labels[labels != IGNORE_INDEX].numpy()

        vocab = self.cfg.model.vocab_size
        counts = np.bincount(tokens(self.data.train), minlength=vocab).astype(np.float64) + 1.0
        log_probs = np.log(counts / counts.sum())
        return float(-log_probs[tokens(self.data.val)].mean())

    # ---------------------------------------------------------------------------------------------
    def fit(self, until: int | None = None, handle_signals: bool = True) -> list[dict]:
        """Train to step `until` (default train.steps), logging, evaluating and checkpointing on the way.
        Returns the record of every step run. With `handle_signals`, a SIGINT / SIGTERM stops the run after
        the current step with a checkpoint saved, and `self.interrupted` holds the signal number. A save
        that fails is reported and retried at the next one; `self.save_error` says whether the last failed."""
        cfg = self.cfg.train
        until = cfg.steps if until is None else until
        log = MetricsLog(self.out_dir, cfg.tensorboard, append=self.step > 0) if self.mesh.is_main else None
        bar = progress_bar(until, self.step, cfg.progress and not self.quiet)
        history = []
        stop = GracefulStop(self.device, self.mesh.distributed, announce=not self.quiet)
        try:
            with stop if handle_signals else contextlib.nullcontext():
                while self.step < until:
                    record = self.train_step()
                    history.append(record)
                    bar.update(1)
                    bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_sec']:.0f}")
                    last = self.step == until
                    evaluate = cfg.eval_every and (self.step % cfg.eval_every == 0 or self.step == cfg.steps)
                    if self.step % cfg.log_every == 0 or last or evaluate:
                        record["memory_bytes"] = memory_bytes(self.device)
                        if evaluate:
                            record["val_loss"] = self.evaluate()
                        if log is not None:
                            log.log(record)
                        self._print(record)
                    signum = stop.requested() if handle_signals else 0
                    if signum:
                        self.interrupted = signum
                        break
                    if cfg.save_every and self.step % cfg.save_every == 0 and not last:
                        self.save_or_report()
                if history and self.saved_step != self.step:
                    self.save_or_report()
        finally:
            bar.close()
            if log is not None:
                log.close()
        return history

    def save_or_report(self) -> Path | None:
        """save(), but a failure (disk full, quota) is reported and training goes on: the earlier
        checkpoints are intact and the next save tries again."""
        try:
            path = self.save()
        except CheckpointSaveError as e:
            self.save_error = str(e)
            if self.mesh.is_main:
                from tqdm import tqdm
                tqdm.write(f"fivefold: warning: {e}; training goes on and the next save tries again",
                           file=sys.stderr)
            return None
        self.save_error = None
        return path

    def _print(self, r: dict) -> None:
        if self.quiet:
            return
        val = f" val_loss {r['val_loss']:.4f}" if "val_loss" in r else ""
        gns = f" | gns {r['gns']:,.0f} tok" if "gns" in r else ""
        mfu = f"mfu {100 * r['mfu']:.1f}%"
        if "mfu_achievable" in r:
            mfu += f" of datasheet, {100 * r['mfu_achievable']:.1f}% of measured achievable"
        msg = (f"step {r['step']:>5d} | loss {r['loss']:.4f}{val} | lr {r['lr']:.2e} | grad_norm "
               f"{r['grad_norm']:.3f} | {r['tokens_per_sec']:,.0f} tok/s | {mfu} | "
               f"batch {r['batch_tokens']} tok{gns}")
        from tqdm import tqdm
        tqdm.write(msg)

    # ---------------------------------------------------------------------------------------------
    @property
    def checkpoint_root(self) -> Path:
        return self.out_dir / "checkpoints"

    def save(self) -> Path:
        """Every rank writes the rows it owns (replicated tensors once); rank 0 the rest."""
        state = {"step": self.step, "tokens_seen": self.tokens_seen, "sampler": self.sampler.state_dict(),
                 "base_batch_tokens": self.base_batch_tokens, "noise_scale": self.noise.state_dict()}
        if self.ramp is not None:
            state["batch_ramp"] = self.ramp.state_dict()
        rng = {"torch_cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["torch_cuda"] = torch.cuda.get_rng_state(self.device)
        extra = {}
        tokenizer_json = getattr(self.data, "tokenizer", None)
        if tokenizer_json is not None:
            extra["tokenizer.json"] = tokenizer_json.to_str().encode()
        path = ckpt.write_checkpoint(self.checkpoint_root, f"step_{self.step:08d}", self.cfg,
                                     self.optimizer.checkpoint_tensors(), state, rng,
                                     keep=self.cfg.train.keep_checkpoints, extra_files=extra,
                                     expected_bytes=checkpoint_bytes(self.cfg.model))
        self.saved_step = self.step
        return path

    def load_latest(self) -> bool:
        """Resume from out_dir/checkpoints if a checkpoint is there; returns whether one was loaded. The
        newest intact checkpoint is used (each rank verifies a share of its files); a damaged newer one
        is skipped with a warning, or refused when train.checkpoint_fallback is false."""
        if not ckpt.checkpoint_candidates(self.checkpoint_root):
            return False
        share = (self.mesh.rank, self.mesh.world_size)
        with warnings.catch_warnings():
            if not self.mesh.is_main:  # rank 0 says it once
                warnings.simplefilter("ignore", ckpt.CheckpointWarning)
            path = ckpt.find_intact(self.checkpoint_root, self.cfg.train.checkpoint_fallback,
                                    lambda c: sum(ckpt.gather(ckpt.verify_checkpoint(c, share)), []))
        saved = ckpt.read_config(path)
        conflicts = resume_conflicts(saved, self.cfg)
        if conflicts:
            raise ConfigError(f"cannot resume {path} with this config: {'; '.join(conflicts)}. Keep those "
                              f"settings, or start a new run with another --out (or --overwrite)")
        state = read_json(path / "trainer_state.json")
        try:
            step, tokens_seen = int(state["step"]), int(state["tokens_seen"])
            base_batch_tokens, sampler = int(state["base_batch_tokens"]), dict(state["sampler"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path / 'trainer_state.json'} is incomplete or invalid ({e!r}); resume "
                                  f"from an older checkpoint by removing {path}") from None
        try:  # absent from checkpoints written before the noise scale existed: it starts afresh
            if "noise_scale" in state:
                self.noise.load_state_dict(state["noise_scale"])
            if self.ramp is not None and "batch_ramp" in state:
                self.ramp.load_state_dict(state["batch_ramp"])
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, ConfigError):
                raise ConfigError(f"cannot resume {path}: {e}") from None
            raise CheckpointError(f"{path / 'trainer_state.json'} has an invalid noise scale or batch ramp "
                                  f"state ({e!r}); resume from an older checkpoint by removing {path}") from None
        try:
            self.sampler.load_state_dict(sampler)
        except (KeyError, TypeError) as e:
            raise CheckpointError(f"{path / 'trainer_state.json'} has an invalid sampler state ({e!r})") from None
        except ValueError as e:
            raise ConfigError(f"cannot resume {path}: {e}") from None
        read_state(path, self.optimizer.checkpoint_tensors())
        self.optimizer.loaded(step)
        self.step, self.tokens_seen, self.base_batch_tokens = step, tokens_seen, base_batch_tokens
        self.saved_step = step
        rng = read_tensors(path / "rng.safetensors")
        if "torch_cpu" in rng:
            torch.set_rng_state(rng["torch_cpu"])
        if "torch_cuda" in rng and self.device.type == "cuda":
            torch.cuda.set_rng_state(rng["torch_cuda"], self.device)
        if not self.quiet:
            print(f"resumed from {path} (step {self.step}, {self.tokens_seen:,} tokens)")
        return True
