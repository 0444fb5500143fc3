"""parallelize(): a run's parallel layout applied to a plain model from outside, in one order, before
any parameter has memory.

    meta model (fivefold.model.meta_model, in the compute dtype: no memory)
      -> tensor / sequence parallel   linears and embedding swapped for their shards (tensor_parallel)
      -> expert parallel              other ranks' experts dropped, all-to-all dispatch (expert_parallel)
      -> context parallel             ring attention, routing counts summed over the ring (context_parallel)
      -> LoRA, kernels                adapters (fivefold.finetune.lora); fused Triton ops (fivefold.kernels)
      -> fp8, fused projections       float8 linears (fp8); q/k/v and gate/up as one GEMM each (fused_projections)
      -> pipeline split               other stages' blocks dropped (pipeline)
      -> placement record             global shape and shard axes of every local parameter (placement)
    materialise(values)
      -> this rank's parameters       each from its own slice of the full initial value, one at a time
      -> recomputation, compile       (fivefold.train.recompute; per block)
      -> data parallel / ZeRO         the gradient reducer; under ZeRO-3 only this rank's rows ever exist
      -> optimizer                    fp32 masters of what this rank updates

What it returns (ParallelModel) is everything the trainer needs to know about the layout: the local
model, how a global batch becomes this rank's tokens, the loss of (possibly vocabulary-sharded) logits,
sums of statistics over the ranks that split a batch, and the step executor. The trainer itself has no
per-dimension code.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from fivefold.config import Config
from fivefold.data.labels import IGNORE_INDEX
from fivefold.finetune.lora import apply_lora
from fivefold.finetune.qlora import quantize_base
from fivefold.kernels import apply_kernels
from fivefold.model import ForwardContext, doc_ids_from_tokens, materialise_parameters, meta_model
from fivefold.model.moe import MoE
from fivefold.parallel.context_parallel import DocumentBlocks, apply_context_parallel, zigzag_positions
from fivefold.parallel.data_parallel import BucketedAllReduce, Reducers
from fivefold.parallel.expert_parallel import apply_expert_parallel
from fivefold.parallel.hooks import weak
from fivefold.parallel.mesh import Mesh
from fivefold.parallel.pipeline import Pipeline, tied_group
from fivefold.parallel.placement import Placement, Placements, record
from fivefold.parallel.small_batch import SmallBatchGradient
from fivefold.parallel.tensor_parallel import apply_tensor_parallel, vocab_parallel_cross_entropy
from fivefold.parallel.zero import ZeroDataParallel, own_rows
from fivefold.train.chunked_loss import chunked_cross_entropy, use_feature_head
from fivefold.train.fp8 import WeightCast, apply_fp8
from fivefold.train.fused_projections import apply_fused_projections
from fivefold.train.loss import cross_entropy_sum, token_loss_sum
from fivefold.train.optim import MasterWeightAdamW
from fivefold.train.recompute import apply_recompute, compile_module
from fivefold.weights import ValueSource, initial_values, with_adapters

# A source of parameter values: (name, placement) -> this rank's part of the parameter, in fp32.


def compute_dtype(cfg: Config) -> torch.dtype:
    return torch.bfloat16 if cfg.train.mixed else torch.float32  # fp8: bf16 besides the float8 matmuls


class ParallelModel:
    """This rank's part of the model under `mesh`, still on the meta device until `materialise`."""

    def __init__(self, cfg: Config, mesh: Mesh, device: torch.device):
        self.cfg, self.mesh, self.device = cfg, mesh, device
        self.dtype = compute_dtype(cfg)
        model = meta_model(cfg.model, self.dtype)
        if cfg.train.loss_chunk:  # the head hands on its input; the loss applies the weight chunk by chunk
            use_feature_head(model)
        tp_axes, experts = {}, set()
        self.tp_group = mesh.tp_group if mesh.tp_size > 1 else None
        if self.tp_group is not None:
            tp_axes = apply_tensor_parallel(model, self.tp_group, cfg.parallel.sequence_parallel)
        if mesh.ep_size > 1:
            experts = apply_expert_parallel(model, mesh.ep_group)
        if mesh.cp_size > 1:
            apply_context_parallel(model, mesh.cp_group)
        if cfg.lora.r:  # the base freezes; adapters follow their layer's tensor-parallel split
            tp_axes.update(apply_lora(model, cfg.lora, self.tp_group, cfg.parallel.sequence_parallel))
        apply_kernels(model, cfg.train.kernels)  # fused norm / SwiGLU / RoPE: same modules, parameters and names
        # train.precision=fp8: the blocks' linears as float8 (same parameters)
        self.fp8_linears = apply_fp8(model, cfg, device)
        # q/k/v, gate/up: one GEMM each, the same parameters (Config.fused_projections: which, where)
        apply_fused_projections(model, *cfg.fused_projections(torch.device(device).type))
        self.model = model
        self.pipeline = None
        self.router_loss: Callable | None = None  # set by the trainer for models with experts
        self.reducer = None
        self.small_batch: SmallBatchGradient | None = None  # the gradient noise scale's probe, once materialised
        if mesh.pp_size > 1:  # keeps only this rank's stages
            # Weakly: the pipeline is ours, and must not keep us (and every tensor we hold) alive.
            self.pipeline = Pipeline(model, cfg, mesh, self.dtype, weak(self._current_reducer),
                                     weak(self.forward_context), weak(self._router_loss))
        self.moe_layers = [m for m in model.modules() if isinstance(m, MoE)]  # this rank's stages'
        ep_rank = dist.get_rank(mesh.ep_group) if mesh.ep_size > 1 else 0
        self.placements: Placements = record(model, tp_axes, experts, mesh.tp_rank, mesh.tp_size, ep_rank,
                                             mesh.ep_size)
        self.vocab_start = mesh.tp_rank * (cfg.model.vocab_size // mesh.tp_size)
        self._cross_entropy_sum = cross_entropy_sum  # compiled in `materialise` where Config.compiled_loss

    def _current_reducer(self):
        return self.reducer

    def _router_loss(self, layers: list) -> torch.Tensor | None:
        return self.router_loss(layers) if self.router_loss is not None else None

    # -- memory ---------------------------------------------------------------------------------------
    def materialise(self, values: ValueSource | None = None):
        """Give this rank's parameters their values (default: the seeded initialisation), then set up
        recomputation, compilation, the gradient reducer and the optimizer. Returns (optimizer, reducer).

        Peak while doing so: the parameters this rank keeps, its masters, and one full parameter."""
        cfg, mesh, model = self.cfg, self.mesh, self.model
        values = values or initial_values(cfg)
        if cfg.lora.r:  # adapters start from their own init (or a PEFT adapter), whatever the base's source
            values = with_adapters(values, cfg)
        if cfg.lora.quantize_base != "none":  # QLoRA: the blocks' linears become int4 codes, one at a time
            quantize_base(model, cfg.lora, lambda name: values(name, self.placements[name]), self.device)
        mixed = self.dtype != torch.float32
        zero = cfg.parallel.zero if mesh.grad_size > 1 else 0
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        placements = [self.placements[n] for n in names]
        masters: list | None = [None] * len(names) if mixed else None
        trained = {name: i for i, name in enumerate(names)}  # frozen parameters have no masters
        every = [n for n, _ in model.named_parameters()]
        engine = None
        if zero == 3:  # the parameters stay on meta: the engine keeps only this rank's rows of each value
            apply_recompute(model, cfg.train.recompute, cfg.train.recompute_layers)
            engine = self._zero(zero, placements, None, lambda i: values(names[i], placements[i]).to(self.device),
                                mixed)
            model.reset_buffers(self.device)
        else:
            def keep(i, value):  # the fp32 value, before the bf16 parameter replaces it: this rank's masters
                if every[i] in trained:
                    masters[trained[every[i]]] = own_rows(value, mesh.grad_size, mesh.grad_rank).clone() \
                        if zero else value

            materialise_parameters(model, lambda name, p: values(name, self.placements[name]), self.device,
                                   self.dtype, keep if mixed else None)
            apply_recompute(model, cfg.train.recompute, cfg.train.recompute_layers)
            if zero:
                engine = self._zero(zero, placements, masters, None, mixed)
        if cfg.train.compiled(self.device.type):
            for block in model.layers:
                if hasattr(block, "attn"):  # a pipeline stage holds placeholders for other stages' blocks
                    compile_module(block)  # per block: one compiled graph reused by every layer of the same shape
        if cfg.compiled_loss(self.device.type):
            if model.norm is not None:  # the last pipeline stage's (the others have no head)
                compile_module(model.norm)
            self._cross_entropy_sum = torch.compile(cross_entropy_sum)
        optimizer = MasterWeightAdamW(model, cfg.train, masters, sharding=engine, tp_group=self.tp_group,
                                      pp_group=mesh.pp_group if self.pipeline else None, ep_group=mesh.ep_group,
                                      placements=self.placements)
        self._tie_pipeline_copies(optimizer)
        if self.fp8_linears and cfg.fp8_cast_once(self.device.type) and zero != 3:  # (ZeRO-3: its engine's)
            cast = WeightCast(self._fp8_modules(), self.device, cfg.train.compiled(self.device.type))
            optimizer.after_update.append(cast.refresh)
        self.reducer = self._reducer(optimizer, engine)
        if self.reducer is not None:
            optimizer.gradient_source = self.reducer.local_grads
        self.small_batch = SmallBatchGradient(cfg, mesh, optimizer, self.reducer, self.pipeline)
        return optimizer, self.reducer

    def _zero(self, stage: int, placements: list[Placement], masters, value_of, mixed: bool) -> ZeroDataParallel:
        mesh = self.mesh
        params = [p for p in self.model.parameters() if p.requires_grad]
        device = self.device.type
        fp8 = {m.weight: m for m in self._fp8_modules()} if stage == 3 and self.cfg.fp8_cast_once(device) else None
        return ZeroDataParallel(self.model, params, stage, mesh.grad_mesh, mesh.grad_size, mesh.grad_rank,
                                self.device, placements, masters=masters, value_of=value_of, mixed=mixed,
                                bucket_bytes=int(self.cfg.parallel.bucket_mb * 2**20), fp8_modules=fp8,
                                fp8_compiled=self.cfg.train.compiled(device))

    def _fp8_modules(self) -> list[torch.nn.Module]:
        """This rank's float8 linears (a pipeline stage holds only its own blocks' modules)."""
        modules = dict(self.model.named_modules())
        return [modules[n] for n in self.fp8_linears if n in modules]

    def _tie_pipeline_copies(self, optimizer: MasterWeightAdamW) -> None:
        if self.pipeline is None or not self.cfg.model.tie_embeddings:
            return
        group = tied_group(self.mesh, self.cfg.parallel.pp)  # every rank takes part in creating the groups
        tied = self.pipeline.tied_parameter()
        # The first and last stages' copies of the matrix take the summed gradient (unless it is frozen).
        if tied is not None and tied.requires_grad:
            optimizer.sync_gradient(tied, group, counted=self.pipeline.first)

    def _reducer(self, optimizer: MasterWeightAdamW, engine: ZeroDataParallel | None):
        """The data-parallel gradient reducer feeding the optimizer: the ZeRO engine, or bucketed
        all-reduce (expert parameters apart, over the ranks that hold the same experts)."""
        mesh = self.mesh
        params = [p for p in self.model.parameters() if p.requires_grad]
        bucket_bytes = int(self.cfg.parallel.bucket_mb * 2**20)
        if engine is not None:
            engine.grad_of = optimizer.grad_of
            engine.root_used_after_forward = engine.stage == 3 and bool(self.cfg.train.loss_chunk)
            engine.register_hooks()  # after the optimizer's: fp32 accumulation folds each gradient first
            return engine
        if mesh.grad_size == 1:
            return None
        if not self.moe_layers:
            return BucketedAllReduce(params, mesh.grad_group, optimizer.grad_of, bucket_bytes=bucket_bytes)
        # Expert parameters are reduced over the ranks holding the same experts, after backward and in
        # order (an expert may get no token on some rank); everything else as usual.
        routed = {id(p) for m in self.moe_layers for p in m.experts.parameters()}
        dense, experts = [p for p in params if id(p) not in routed], [p for p in params if id(p) in routed]
        parts = [BucketedAllReduce(dense, mesh.grad_group, optimizer.grad_of, bucket_bytes=bucket_bytes)]
        if mesh.grad_size > mesh.ep_size:
            group = mesh.expert_grad_group if mesh.ep_size > 1 else mesh.grad_group
            parts.append(BucketedAllReduce(experts, group, optimizer.grad_of, bucket_bytes=bucket_bytes,
                                           overlap=False))
        return Reducers(params, parts, optimizer.grad_of)

    # -- tokens -----------------------------------------------------------------------------------------
    def local_rows(self, rows: int) -> slice:
        """This data-parallel rank's contiguous share of `rows` sequences (equal shares when dp divides
        rows, as it does for training batches; a ragged evaluation tail may leave a rank none)."""
        dp, rank = self.mesh.dp_size, self.mesh.dp_rank
        return slice(rank * rows // dp, (rank + 1) * rows // dp)

    def local_columns(self, inputs: torch.Tensor, labels: torch.Tensor):
        """This rank's tokens of every sequence (under context parallelism its zig-zag chunks r and
        2cp-1-r), and with packed documents masked the documents' ids in the whole sequence, else None
        (the model then finds them from its tokens)."""
        if self.mesh.cp_size == 1:
            return inputs, labels, None
        cols = zigzag_positions(inputs.shape[1], self.mesh.cp_size, self.mesh.cp_rank, inputs.device)
        docs = doc_ids_from_tokens(inputs, self.cfg.model.eos_token_id)[:, cols] \
            if self.cfg.model.document_mask else None
        return inputs[:, cols], labels[:, cols], docs

    def forward_context(self, inputs: torch.Tensor, doc_ids: torch.Tensor | None = None) -> ForwardContext:
        """The ForwardContext of a micro-batch of this rank's tokens: their global positions and, with
        packed documents, their documents (found from `inputs` unless given); under context parallelism
        the ring's document blocks are every attention core's mask (one gather per forward)."""
        if doc_ids is None and self.cfg.model.document_mask:
            doc_ids = doc_ids_from_tokens(inputs, self.cfg.model.eos_token_id)
        mask = DocumentBlocks(doc_ids, self.mesh.cp_group) if self.mesh.cp_size > 1 and doc_ids is not None else None
        return ForwardContext(positions=self.positions(inputs), doc_ids=doc_ids, mask=mask)

    def positions(self, inputs: torch.Tensor) -> torch.Tensor | None:
        """Global positions of this rank's tokens (None: 0..S-1, the model's default)."""
        if self.mesh.cp_size == 1:
            return None
        cols = zigzag_positions(inputs.shape[1] * self.mesh.cp_size, self.mesh.cp_size, self.mesh.cp_rank,
                                inputs.device)
        return cols.expand(inputs.shape[0], -1)

    # -- losses -----------------------------------------------------------------------------------------
    def loss_sum(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Summed cross-entropy of (B, S, V) logits, or of this rank's (B, S, V / tp) vocabulary shard
        (never gathered), over the labels that are not IGNORE_INDEX; fp32."""
        if self.cfg.train.loss_chunk:  # `logits` are the final hidden states: fivefold.train.chunked_loss
            return chunked_cross_entropy(logits, self.model.lm_head.weight, labels, self.cfg.train.loss_chunk,
                                         IGNORE_INDEX, self.tp_group, self.vocab_start,
                                         self.cfg.parallel.sequence_parallel)
        if self.tp_group is not None:
            return vocab_parallel_cross_entropy(logits.flatten(0, 1), labels.flatten(), self.vocab_start,
                                                self.tp_group, IGNORE_INDEX).sum()
        return self._cross_entropy_sum(logits, labels)

    def token_loss_sum(self, inputs: torch.Tensor, labels: torch.Tensor,
                       doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Forward of one micro-batch of this rank's tokens, and its summed token loss."""
        return token_loss_sum(self.model, inputs, labels, self.cfg, self.forward_context(inputs, doc_ids),
                              self.loss_sum)

    def eval_loss_sum(self, inputs: torch.Tensor, labels: torch.Tensor, docs: torch.Tensor | None) -> torch.Tensor:
        """Summed token loss of a batch of this rank's tokens, with no gradient (every stage's rank
        returns the same value)."""
        with torch.no_grad():
            if self.pipeline is None:
                loss = self.token_loss_sum(inputs, labels, docs)
                if isinstance(self.reducer, ZeroDataParallel) and self.reducer.root_used_after_forward:
                    self.reducer.release_root()
                return loss
            loss = self.pipeline.forward_only(inputs, labels, self.loss_sum)
            dist.all_reduce(loss, group=self.mesh.pp_group)  # only the last stage has it
            return loss

    # -- sums over ranks ----------------------------------------------------------------------------------
    def sum_over_batch(self, t: torch.Tensor) -> torch.Tensor:
        """Sum, in place, a statistic each rank counted over its own rows and tokens (dp x cp)."""
        if self.mesh.grad_size > 1:
            dist.all_reduce(t, group=self.mesh.grad_group)
        return t

    def sum_over_model(self, t: torch.Tensor) -> torch.Tensor:
        """Sum, in place, a statistic of the model's layers over every rank's tokens and stages."""
        self.sum_over_batch(t)
        if self.pipeline is not None:  # each stage counted its own layers
            dist.all_reduce(t, group=self.mesh.pp_group)
        return t

    # -- one step's forward and backward --------------------------------------------------------------
    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor, num_tokens: torch.Tensor,
                         docs: torch.Tensor | None = None, measure_small_batch: bool = False) -> torch.Tensor:
        """Forward and backward over this rank's tokens of a global batch, in micro-batches, through the
        pipeline schedule or one after the other; gradients are reduced as the layout requires. Returns
        the global batch's mean loss (the loss of every micro-batch is its token-loss sum divided by the
        global batch's `num_tokens`, so the gradients add up to the big-batch gradient). With
        `measure_small_batch`, the first micro-batch's gradient norm is captured where the layout allows
        (fivefold.parallel.small_batch; `small_batch.result` reads it after the step)."""
        reducer = self.reducer
        micro = self.cfg.train.micro_batch_size
        count = -(-len(inputs) // micro)
        probe = self.small_batch if measure_small_batch else None
        if probe is not None:
            probe.reset()
            probe = probe if probe.unavailable(count) is None else None
        if self.pipeline is not None:
            after = probe.pipeline_points(count, labels[:micro]) if probe is not None else None
            loss = self.pipeline.train_step(inputs, labels, num_tokens, self.loss_sum, after)
            if reducer is not None:
                reducer.finish()
            dist.all_reduce(loss, group=self.mesh.pp_group)  # only the last stage has it
            return self.sum_over_batch(loss)
        # slices, not index tensors: a host index applied to a GPU batch is copied over and waits for the device
        micro_batches = [slice(start, start + micro) for start in range(0, len(inputs), micro)]
        loss = torch.zeros((), device=self.device)
        for i, mb in enumerate(micro_batches):
            if reducer is not None:
                # Communicate on the last micro-batch only, except ZeRO-2/3, which keep gradient shards.
                reducer.sync = i == len(micro_batches) - 1 or reducer.reduces_every_micro_batch
            part = self.token_loss_sum(inputs[mb], labels[mb], None if docs is None else docs[mb]) / num_tokens
            total = part + self.router_loss(self.moe_layers) if self.moe_layers and self.router_loss else part
            total.backward()
            loss += part.detach()
            if reducer is not None and reducer.sync:
                reducer.finish()
            if i == 0 and probe is not None:  # gradients now hold the first micro-batch's (reduced, under ZeRO-2/3)
                probe.capture(labels[mb])
        return self.sum_over_batch(loss)


def parallelize(cfg: Config, mesh: Mesh, device: torch.device) -> ParallelModel:
    """The model of `cfg` split for this rank of `mesh`, on the meta device (see the module docstring);
    call `.materialise()` to give it memory and build its optimizer."""
    return ParallelModel(cfg, mesh, device)

