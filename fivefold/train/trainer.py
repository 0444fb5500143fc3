"""The single-process trainer: data -> micro-batches -> forward/backward -> optimizer step -> metrics
-> checkpoint. Parallel dimensions plug in from outside (fivefold/parallel) without changing this loop's
loss convention: the loss of a global batch is the mean over all its non-padding tokens, whatever the
micro-batching, so accumulated gradients equal the big-batch gradients.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fivefold.config import Config, ConfigError, validate
from fivefold.memory.formulas import count_params, flops_per_token
from fivefold.model import build_model, doc_ids_from_tokens
from fivefold.train import checkpoint as ckpt
from fivefold.train.metrics import MetricsLog, memory_bytes, peak_flops, progress_bar
from fivefold.train.optim import MasterWeightAdamW, grad_accum_at, lr_at
from fivefold.train.recompute import apply_recompute

IGNORE_INDEX = -100


class TrainingError(RuntimeError):
    """Training cannot continue (e.g. the loss became NaN); the message names the step and what to try."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"train.device={name!r} but CUDA is not available; use train.device=cpu or auto")
    return device


def compute_dtype(cfg: Config) -> torch.dtype:
    return torch.bfloat16 if cfg.train.precision == "bf16-mixed" else torch.float32



def token_loss_sum(model, inputs: torch.Tensor, labels: torch.Tensor, cfg: Config, tp_group=None,
                   positions: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Sum of next-token cross-entropy over the non-ignored labels of one micro-batch, in fp32. Under
    tensor parallelism (`tp_group`) the logits are this rank's vocabulary shard and stay sharded; under
    context parallelism the tokens are this rank's, at their global `positions` and in their documents
    of the whole sequence (`doc_ids`; otherwise found from `inputs` when documents are masked)."""
    if doc_ids is None and cfg.model.document_mask:
        doc_ids = doc_ids_from_tokens(inputs, cfg.model.eos_token_id)
    return logits_loss_sum(model, model(inputs, positions=positions, doc_ids=doc_ids), labels, tp_group)


def logits_loss_sum(model, logits: torch.Tensor, labels: torch.Tensor, tp_group=None) -> torch.Tensor:
    """Summed cross-entropy of (B, S, V) logits, or of this rank's (B, S, V / tp) vocabulary shard."""
    if tp_group is not None:
        from fivefold.parallel.tensor_parallel import vocab_parallel_cross_entropy

        return vocab_parallel_cross_entropy(logits.flatten(0, 1), labels.flatten(), model.vocab_start, tp_group,
                                            IGNORE_INDEX).sum()
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


class Trainer:
    def __init__(self, cfg: Config, out_dir: str | Path | None = None, resume: bool = False,
                 quiet: bool = False, datasets=None):
        validate(cfg)
        from fivefold.data.dataset import ResumableSampler, load_datasets
        from fivefold.parallel.mesh import init_mesh, local_device

        self.cfg = cfg
        self.out_dir = Path(out_dir or cfg.train.out_dir)
        self.device = local_device(resolve_device(cfg.train.device))
        self.mesh = init_mesh(cfg, self.device)  # validates the layout before any process group starts
        self.quiet = quiet or not self.mesh.is_main
        torch.manual_seed(cfg.train.seed)
        if datasets is None and not self.mesh.is_main:
            self.mesh.barrier()  # let rank 0 build the data cache (corpus, tokenizer, shards) first
        self.data = datasets or load_datasets(cfg)
        if datasets is None and self.mesh.is_main:
            self.mesh.barrier()
        self.model = build_model(cfg.model, self.device, seed=cfg.train.seed, dtype=torch.float32)
        self.tp_group = None
        if self.mesh.tp_size > 1:
            from fivefold.parallel.tensor_parallel import apply_tensor_parallel

            self.tp_group = self.mesh.tp_group
            apply_tensor_parallel(self.model, self.tp_group, cfg.parallel.sequence_parallel)
        from fivefold.model.moe import MoE

        self.moe_layers = [m for m in self.model.modules() if isinstance(m, MoE)]
        if self.mesh.ep_size > 1:
            from fivefold.parallel.expert_parallel import apply_expert_parallel

            apply_expert_parallel(self.model, self.mesh.ep_group)
        if self.mesh.cp_size > 1:
            from fivefold.parallel.context_parallel import apply_context_parallel

            apply_context_parallel(self.model, self.mesh.cp_group)
        self.pipeline = None
        if self.mesh.pp_size > 1:  # keeps only this rank's stages
            from fivefold.parallel.pipeline import Pipeline

            self.pipeline = Pipeline(self.model, cfg, self.mesh, compute_dtype(cfg), lambda: self.reducer,
                                     self._positions, self._router_loss if self.moe_layers else None)
            self.moe_layers = [m for m in self.model.modules() if isinstance(m, MoE)]  # this rank's stages'
        masters = None
        if compute_dtype(cfg) != torch.float32:  # masters keep the fp32 initial values, not bf16-rounded ones
            masters = [p.detach().clone() for p in self.model.parameters()]
            self.model.to(compute_dtype(cfg))
            self.model.reset_buffers()
        apply_recompute(self.model, cfg.train.recompute)
        if cfg.train.compile:
            for block in self.model.layers:
                block.compile()  # per block: one compiled graph reused by every layer of the same shape
        self.optimizer, self.reducer = self._build_optimizer(masters)
        self.sampler = ResumableSampler(len(self.data.train), cfg.train.seed)
        self.step = 0
        self.tokens_seen = 0
        self.base_batch_tokens = cfg.train.base_batch_tokens or cfg.global_batch_tokens
        self.flops_per_token = flops_per_token(cfg.model, cfg.train.seq_len)
        self.peak_flops = cfg.train.peak_flops or peak_flops(self.device, compute_dtype(cfg),
                                                             torch.get_num_threads())
        self.num_params = count_params(cfg.model)
        if resume:
            self.load_latest()

    def _build_optimizer(self, masters):
        """The optimizer and, under data parallelism, the gradient reducer feeding it: bucketed
        all-reduce (parallel.zero=0) or the ZeRO engine, which also owns the sharded masters."""
        cfg, mesh = self.cfg, self.mesh
        params = [p for p in self.model.parameters() if p.requires_grad]
        bucket_bytes = int(cfg.parallel.bucket_mb * 2**20)
        zero = None
        if mesh.grad_size > 1 and cfg.parallel.zero > 0:
            from fivefold.parallel.zero import ZeroDataParallel

            zero = ZeroDataParallel(self.model, params, masters or params, cfg.parallel.zero, mesh.grad_mesh,
                                    mesh.grad_size, mesh.grad_rank, bucket_bytes=bucket_bytes)
        optimizer = MasterWeightAdamW(self.model, cfg.train, masters, sharding=zero, tp_group=self.tp_group,
                                      pp_group=self.mesh.pp_group if self.pipeline else None,
                                      ep_group=mesh.ep_group)
        if self.pipeline is not None and cfg.model.tie_embeddings:
            from fivefold.parallel.pipeline import tied_group

            group = tied_group(mesh, cfg.parallel.pp)  # every rank takes part in creating the groups
            tied = self.pipeline.tied_parameter()
            if tied is not None:  # the first and last stages' copies of the matrix take the summed gradient
                optimizer.sync_gradient(tied, group, counted=self.pipeline.first)
        reducer = zero
        if zero is not None:
            zero.grad_of = optimizer.grad_of
            zero.register_hooks()  # after the optimizer's: fp32 accumulation folds each gradient first
        elif self.moe_layers and mesh.grad_size > 1:
            # Expert parameters are reduced over the ranks holding the same experts, after backward and in
            # order (an expert may get no token on some rank); everything else as usual.
            from fivefold.parallel.data_parallel import BucketedAllReduce, Reducers

            routed = {id(p) for m in self.moe_layers for p in m.experts.parameters()}
            dense, experts = [p for p in params if id(p) not in routed], [p for p in params if id(p) in routed]
            parts = [BucketedAllReduce(dense, mesh.grad_group, optimizer.grad_of, bucket_bytes=bucket_bytes)]
            if mesh.grad_size > mesh.ep_size:
                group = mesh.expert_grad_group if mesh.ep_size > 1 else mesh.grad_group
                parts.append(BucketedAllReduce(experts, group, optimizer.grad_of, bucket_bytes=bucket_bytes,
                                               overlap=False))
            reducer = Reducers(params, parts, optimizer.grad_of)
        elif mesh.grad_size > 1:
            from fivefold.parallel.data_parallel import BucketedAllReduce

            reducer = BucketedAllReduce(params, mesh.grad_group, optimizer.grad_of, bucket_bytes=bucket_bytes)
        if reducer is not None:
            optimizer.gradients = reducer.local_grads
        return optimizer, reducer

    # ---------------------------------------------------------------------------------------------
    def global_batch(self, grad_accum: int) -> torch.Tensor:
        """The step's global batch, (micro_batch_size * grad_accum * dp, seq_len + 1) token ids: the same
        tokens in the same order whatever the parallel layout."""
        n = self.cfg.train.micro_batch_size * grad_accum * self.mesh.dp_size
        return self.data.train.batch(self.sampler.take(n)).to(self.device)

    def local_rows(self, rows: int) -> slice:
        """This data-parallel rank's contiguous share of `rows` sequences (equal shares when dp divides
        rows, as it does for training batches; a ragged evaluation tail may leave a rank none)."""
        dp, rank = self.mesh.dp_size, self.mesh.dp_rank
        return slice(rank * rows // dp, (rank + 1) * rows // dp)

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor, num_tokens: torch.Tensor,
                         doc_ids: torch.Tensor | None = None):
        """One micro-batch: loss scaled by the global batch's token count, so summing micro-batch
        gradients yields the gradient of the global mean."""
        loss = token_loss_sum(self.model, inputs, labels, self.cfg, self.tp_group, self._positions(inputs),
                              doc_ids) / num_tokens
        total = loss + self._router_loss(self.moe_layers) if self.moe_layers else loss
        total.backward()
        return loss.detach()

    def _router_loss(self, layers: list) -> torch.Tensor:
        """The router losses of `layers`' latest forward, averaged over the global batch's micro-batches
        like the token loss; their routing statistics are counted into the step's record."""
        aux = sum(m.aux_loss for m in layers) / self._micro_batches
        self._routing["aux_loss"] += aux.detach()
        for m in layers:
            self._routing["tokens_per_expert"] += m.stats["tokens_per_expert"]
            self._routing["dropped"] += m.stats["dropped"]
            self._routing["assignments"] += m.stats["assignments"]
        return aux

    def _routing_record(self) -> dict:
        """Routing statistics of the step over all ranks: router loss, dropped assignments, and the most
        loaded expert's share relative to a perfectly even one (1.0)."""
        r = self._routing
        stats = torch.cat([r["tokens_per_expert"].double(), torch.stack([r["dropped"], r["assignments"]]).double(),
                           r["aux_loss"].double().reshape(1)])
        if self.mesh.grad_size > 1:
            dist.all_reduce(stats, group=self.mesh.grad_group)
        if self.pipeline is not None:  # each stage counted its own layers
            dist.all_reduce(stats, group=self.mesh.pp_group)
        experts = self.cfg.model.num_experts
        load, dropped, assignments = stats[:experts], stats[experts], stats[experts + 1]
        return {"router_loss": stats[-1].item(),
                "moe_dropped_fraction": (dropped / assignments).item(),
                "moe_max_expert_load": (load.max() / load.mean()).item()}

    def local_columns(self, inputs: torch.Tensor, labels: torch.Tensor):
        """This context-parallel rank's tokens of every sequence (zig-zag chunks r and 2cp-1-r), and with
        packed documents masked (cp > 1) their documents' ids in the whole sequence, else None."""
        if self.mesh.cp_size == 1:
            return inputs, labels, None
        from fivefold.parallel.context_parallel import zigzag_positions

        cols = zigzag_positions(inputs.shape[1], self.mesh.cp_size, self.mesh.cp_rank, inputs.device)
        docs = doc_ids_from_tokens(inputs, self.cfg.model.eos_token_id)[:, cols] if self.cfg.model.document_mask \
            else None
        return inputs[:, cols], labels[:, cols], docs

    def _positions(self, inputs: torch.Tensor) -> torch.Tensor | None:
        if self.mesh.cp_size == 1:
            return None
        from fivefold.parallel.context_parallel import zigzag_positions

        cols = zigzag_positions(inputs.shape[1] * self.mesh.cp_size, self.mesh.cp_size, self.mesh.cp_rank,
                                inputs.device)
        return cols.expand(inputs.shape[0], -1)

    def _loss_of_logits(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return logits_loss_sum(self.model, logits, labels, self.tp_group)

    def accumulate_gradients(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Forward and backward over a global batch (N, S) in micro-batches; returns the global mean loss
        over the labels that are not IGNORE_INDEX (padding)."""
        num_tokens = (labels != IGNORE_INDEX).sum()  # of the global batch: every rank holds all of it
        mine = self.local_rows(len(inputs))
        inputs, labels, docs = self.local_columns(inputs[mine], labels[mine])
        micro_batches = torch.arange(len(inputs)).split(self.cfg.train.micro_batch_size)
        self._micro_batches = len(micro_batches) * self.mesh.dp_size  # of the global batch; cp ranks share one
        if self.pipeline is not None:
            loss = self.pipeline.train_step(inputs, labels, num_tokens, self._loss_of_logits)
            if self.reducer is not None:
                self.reducer.finish()
            dist.all_reduce(loss, group=self.mesh.pp_group)  # only the last stage has it
            if self.reducer is not None:
                dist.all_reduce(loss, group=self.mesh.grad_group)
            return loss
        loss = torch.zeros((), device=self.device)
        for i, mb in enumerate(micro_batches):
            if self.reducer is not None:
                # Communicate on the last micro-batch only, except ZeRO-2/3, which keep gradient shards.
                self.reducer.sync = i == len(micro_batches) - 1 or self.reducer.reduces_every_micro_batch
            loss += self.forward_backward(inputs[mb], labels[mb], num_tokens, None if docs is None else docs[mb])
            if self.reducer is not None and self.reducer.sync:
                self.reducer.finish()
        if self.reducer is not None:
            dist.all_reduce(loss, group=self.mesh.grad_group)
        return loss

    def train_step(self) -> dict:
        cfg = self.cfg.train
        start = time.perf_counter()
        accum = grad_accum_at(self.tokens_seen, cfg)
        batch = self.global_batch(accum)
        if self.moe_layers:
            zero = torch.zeros((), dtype=torch.long, device=self.device)
            self._routing = {"aux_loss": torch.zeros((), device=self.device), "dropped": zero.clone(),
                             "assignments": zero.clone(),
                             "tokens_per_expert": torch.zeros(self.cfg.model.num_experts, dtype=torch.long,
                                                              device=self.device)}
        loss_value = self.accumulate_gradients(batch[:, :-1], batch[:, 1:]).item()
        if not math.isfinite(loss_value):
            raise TrainingError(f"loss is {loss_value} at step {self.step + 1}; lower train.lr, enable "
                                f"train.grad_clip, or use train.precision=fp32 to locate the overflow")
        batch_tokens = batch[:, 1:].numel()
        lr = lr_at(self.step, cfg, batch_tokens, self.base_batch_tokens)
        grad_norm = self.optimizer.step(lr, cfg.grad_clip).item()
        self.optimizer.zero_grad()
        if self.reducer is not None:
            self.reducer.zero_grad()
        if not math.isfinite(grad_norm):
            raise TrainingError(f"gradient norm is {grad_norm} at step {self.step + 1}; lower train.lr "
                                f"or use train.precision=fp32")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - start
        self.step += 1
        self.tokens_seen += batch_tokens
        tokens_per_sec = batch_tokens / elapsed
        routing = self._routing_record() if self.moe_layers else {}
        return {**routing, "step": self.step, "loss": loss_value, "lr": lr, "grad_norm": grad_norm,
                "tokens_per_sec": tokens_per_sec, "mfu": tokens_per_sec * self.flops_per_token / (self.peak_flops * self.mesh.world_size),
                "batch_tokens": batch_tokens, "grad_accum": accum, "tokens_seen": self.tokens_seen,
                "step_time": elapsed}

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean per-token loss on the first `eval_batches * micro_batch_size` validation sequences,
        shared out across data-parallel ranks like a training batch."""
        cfg = self.cfg.train
        n = min(len(self.data.val), cfg.eval_batches * cfg.micro_batch_size)
        per_step = cfg.micro_batch_size * self.mesh.dp_size
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss sum, token count
        for first in range(0, n, per_step):
            rows = list(range(first, min(n, first + per_step)))
            mine = rows[self.local_rows(len(rows))]
            # A rank left without rows by the ragged tail still runs a forward (ZeRO-3 gathers
            # parameters inside it, collectively), and counts nothing.
            batch = self.data.val.batch(mine or rows[:1]).to(self.device)
            inputs, labels, docs = self.local_columns(batch[:, :-1], batch[:, 1:])
            if self.pipeline is not None:
                loss = self.pipeline.forward_only(inputs, labels, self._loss_of_logits)
                dist.all_reduce(loss, group=self.mesh.pp_group)
            else:
                loss = token_loss_sum(self.model, inputs, labels, self.cfg, self.tp_group, self._positions(inputs),
                                      docs)
            if mine:
                totals += torch.tensor([loss.item(), labels.numel()], dtype=torch.float64, device=self.device)
        if self.mesh.grad_size > 1:
            dist.all_reduce(totals, group=self.mesh.grad_group)
        return (totals[0] / totals[1]).item()

    def unigram_loss(self) -> float:
        """Validation loss of the best context-free predictor (train-split token frequencies, add-one
        smoothed): the bar a model must clear to show it learned anything beyond token counts."""
        import numpy as np

        vocab = self.cfg.model.vocab_size
        train, val = self.data.train.store, self.data.val.store
        counts = np.bincount(train.read(0, train.num_tokens), minlength=vocab).astype(np.float64) + 1.0
        log_probs = np.log(counts / counts.sum())
        return float(-log_probs[val.read(0, val.num_tokens)].mean())

    # ---------------------------------------------------------------------------------------------
    def fit(self, until: int | None = None) -> list[dict]:
        """Train to step `until` (default train.steps), logging, evaluating and checkpointing on the way.
        Returns the record of every step run."""
        cfg = self.cfg.train
        until = cfg.steps if until is None else until
        log = MetricsLog(self.out_dir, cfg.tensorboard, append=self.step > 0) if self.mesh.is_main else None
        bar = progress_bar(until, self.step, cfg.progress and not self.quiet)
        history = []
        try:
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
                if cfg.save_every and self.step % cfg.save_every == 0 and not last:
                    self.save()
            if history:
                self.save()
        finally:
            bar.close()
            if log is not None:
                log.close()
        return history

    def _print(self, r: dict) -> None:
        if self.quiet:
            return
        val = f" val_loss {r['val_loss']:.4f}" if "val_loss" in r else ""
        msg = (f"step {r['step']:>5d} | loss {r['loss']:.4f}{val} | lr {r['lr']:.2e} | grad_norm "
               f"{r['grad_norm']:.3f} | {r['tokens_per_sec']:,.0f} tok/s | mfu {100 * r['mfu']:.1f}% | "
               f"batch {r['batch_tokens']} tok")
        from tqdm import tqdm
        tqdm.write(msg)

    # ---------------------------------------------------------------------------------------------
    @property
    def checkpoint_root(self) -> Path:
        return self.out_dir / "checkpoints"

    def save(self) -> Path:
        """Every rank writes the rows it owns (replicated tensors once); rank 0 the rest."""
        state = {"step": self.step, "tokens_seen": self.tokens_seen, "sampler": self.sampler.state_dict(),
                 "base_batch_tokens": self.base_batch_tokens}
        rng = {"torch_cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["torch_cuda"] = torch.cuda.get_rng_state(self.device)
        extra = {}
        tokenizer_json = getattr(self.data, "tokenizer", None)
        if tokenizer_json is not None:
            extra["tokenizer.json"] = tokenizer_json.to_str().encode()
        return ckpt.write_checkpoint(self.checkpoint_root, f"step_{self.step:08d}", self.cfg,
                                     self.optimizer.checkpoint_tensors(), state, rng,
                                     keep=self.cfg.train.keep_checkpoints, extra_files=extra)

    def load_latest(self) -> bool:
        """Resume from out_dir/checkpoints if a checkpoint is there; returns whether one was loaded."""
        try:
            path = ckpt.resolve_checkpoint(self.checkpoint_root)
        except FileNotFoundError:
            return False
        saved = ckpt.read_config(path)
        if saved.model != self.cfg.model:
            raise ConfigError(f"checkpoint {path} was trained with a different model config; use another "
                              f"train.out_dir or the same model.* settings")
        state = ckpt.read_json(path / "trainer_state.json")
        ckpt.read_state(path, self.optimizer.checkpoint_tensors())
        self.optimizer.loaded(state["step"])
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        self.base_batch_tokens = state["base_batch_tokens"]
        self.sampler.load_state_dict(state["sampler"])
        rng = ckpt.read_tensors(path / "rng.safetensors")
        if "torch_cpu" in rng:
            torch.set_rng_state(rng["torch_cpu"])
        if "torch_cuda" in rng and self.device.type == "cuda":
            torch.cuda.set_rng_state(rng["torch_cuda"], self.device)
        if not self.quiet:
            print(f"resumed from {path} (step {self.step}, {self.tokens_seen:,} tokens)")
        return True
