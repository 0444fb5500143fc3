"""The compiled blocks' saved tensors in the memory plan (fivefold.memory.replay_compiled.compiled_block)
against torch.compile's own choice: one block traced on the CPU through AOTAutograd with inductor's
decompositions and its min-cut partition function (what inductor runs), the forward graph's saved outputs
summed. Measured on an H100 the planned totals of compiled rows came within -0.0% to +2.6% (bench/results/
train_throughput_*_h100.json); the eager replay they used before was 7.5-18.6% high."""

import dataclasses

import pytest
import torch
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd
from torch._inductor.decomposition import select_decomp_table
from torch.multiprocessing.reductions import StorageWeakRef

from fivefold.config import Config, LoraConfig, ModelConfig, ParallelConfig, TrainConfig
from fivefold.finetune.lora import apply_lora
from fivefold.memory.activations import replay_forward
from fivefold.memory.plan import activation_shapes, compiled_blocks_modelled, plan_memory
from fivefold.memory.replay import Replay
from fivefold.memory.replay_compiled import compiled_block
from fivefold.model.context import ForwardContext
from fivefold.model.transformer import Transformer
from fivefold.train.fp8 import WeightCast
from fivefold.train.fused_projections import apply_fused_projections
from fivefold.train.recompute import apply_recompute
from fivefold.presets import get_preset

SHAPES = {  # GQA 4/2 and 3/1, multi-head 4/4, an FFN width that is no multiple of the hidden size
    "gqa": dict(hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=176),
    "three-to-one": dict(hidden_size=96, num_heads=3, num_kv_heads=1, ffn_hidden_size=256),
    "mha": dict(hidden_size=64, num_heads=4, num_kv_heads=4, ffn_hidden_size=128),
}


def model_config(shape: str) -> ModelConfig:
    return dataclasses.replace(get_preset("tiny"), num_layers=1, vocab_size=256, **SHAPES[shape])


def partitioner_saved_bytes(cfg: ModelConfig, dtype: torch.dtype, b: int, s: int, fp8: bool = False,
                            lora: LoraConfig | None = None, grad_in: bool = True, recompute: str = "none",
                            fused: bool = False) -> int:
    """Bytes the compiled block's forward saves for backward: its graph's outputs after the block's own
    output, less the inputs it saves as they are (weights, the shared RoPE tables) except the block input,
    the one activation among them, and less 0-dim tensors (fp8's amax scalars). `fp8`: the block's linears
    as torchao's float8 linears, emulated (the CPU's product in place of torch._scaled_mm). `lora`: adapters
    on a frozen block; `grad_in`: whether the block input needs a gradient (not the first block's under LoRA,
    whose embedding is frozen); `recompute`: the block checkpointed as train.recompute does it (the graph
    also keeps checkpoint's RNG state, uint8, left out: 16 bytes on a GPU); `fused`: q/k/v and gate/up as one
    product each (train.fused_projections=true)."""
    torch.manual_seed(0)
    model = Transformer(cfg).to(dtype)
    if lora is not None:
        apply_lora(model, lora)
        model.to(dtype)
    if fused:
        apply_fused_projections(model)
    if recompute != "none":
        apply_recompute(model, recompute)
    block = model.layers[0]
    if fp8:
        from torchao import float8

        float8.convert_to_float8_training(block, config=float8.Float8LinearConfig(emulate=True))
        # train.fp8_weight_cast=step: each linear multiplies by a float8 copy of its weight, made after the
        # update (an input of the compiled block, like the weight it stands for, so not counted)
        linears = [m for m in block.modules() if type(m).__name__ == "Float8Linear"]
        assert len(linears) == 7
        WeightCast(linears, torch.device("cpu"))
    ids = torch.randint(0, cfg.vocab_size, (b, s))
    ctx = ForwardContext()
    positions = model.positions(ids, ctx)
    x = model.embed(ids, positions).detach().requires_grad_(grad_in)
    rope, mask = model.context(ids, positions, ctx, x.dtype)
    # A recomputing block's forward is its checkpointing wrapper, which the trainer compiles (compile_module).
    fn, args = (block.forward, ()) if recompute != "none" else (type(block).forward, (block,))
    return graph_saved_bytes(fn, *args, x, rope, mask, keep=lambda value: tuple(value.shape) == (b, s, cfg.hidden_size),
                             skip=lambda value: value.dtype == torch.uint8)


def graph_saved_bytes(fn, *args, keep=lambda value: True, skip=lambda value: False) -> int:
    """Bytes the forward graph of torch.compile(fn) saves for backward under inductor's decompositions and
    min-cut partitioner: its outputs after the first (fn's own), less 0-dim tensors and the inputs `keep`
    refuses (those it saves as they are, e.g. weights) or `skip` names."""
    saved = {}  # storage -> bytes: views of one tensor (SDPA's output and o_proj's input) hold its memory once

    def forward_compiler(gm, _inputs):
        output = next(n for n in gm.graph.nodes if n.op == "output")
        for node in output.args[0][1:]:
            value = node.meta.get("val")
            if isinstance(value, torch.Tensor) and value.dim() and (node.op != "placeholder" or keep(value)) \
                    and not skip(value):
                storage = value.untyped_storage()
                saved[StorageWeakRef(storage)] = storage.nbytes()
        return make_boxed_func(gm)

    backend = aot_autograd(fw_compiler=forward_compiler, bw_compiler=lambda gm, _: make_boxed_func(gm),
                           partition_fn=min_cut_rematerialization_partition, decompositions=select_decomp_table())
    torch._dynamo.reset()
    try:
        out = torch.compile(fn, backend=backend, dynamic=False)(*args)
        out.float().sum().backward()
    finally:
        torch._dynamo.reset()
    assert saved, "the forward compiler was not called"
    return sum(saved.values())


def planned_block_bytes(model: ModelConfig, precision: str, b: int, s: int, fused: bool = False) -> float:
    cfg = Config(model=model, train=TrainConfig(precision=precision, compile="true", micro_batch_size=b, seq_len=s,
                                                fused_projections="true" if fused else "false"))
    d = activation_shapes(cfg, "cpu")
    assert d.compiled
    return replay_forward(d, 3).saved_bytes - replay_forward(d, 2).saved_bytes


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("precision,dtype", [("bf16-mixed", torch.bfloat16), ("fp32", torch.float32),
                                             ("fp8", torch.bfloat16)])
def test_compiled_block_saves_what_the_partitioner_keeps(shape, precision, dtype):
    cfg = model_config(shape)
    b, s = 2, 32
    assert planned_block_bytes(cfg, precision, b, s) == \
        partitioner_saved_bytes(cfg, dtype, b, s, fp8=precision == "fp8")


@pytest.mark.parametrize("grad_in", [True, False])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("targets", ["q,k,v,o,gate,up,down", "q,v", "o", "gate,up,down"])
def test_compiled_lora_block_saves_what_the_partitioner_keeps(targets, dropout, grad_in):
    """LoRA on a frozen block, compiled: each adapter's A output; under dropout its dropped input and, where
    that input needs a gradient, its bool mask; a frozen linear's input only where an adapter reads it; and
    no gradient path into the first block when the embedding is frozen (`grad_in`)."""
    cfg, b, s = model_config("gqa"), 2, 32
    lora = LoraConfig(r=8, targets=targets, dropout=dropout)
    d = activation_shapes(Config(model=cfg, lora=lora, train=TrainConfig(precision="bf16-mixed", compile="true",
                                                                         micro_batch_size=b, seq_len=s)), "cpu")
    assert d.compiled
    r = Replay()
    compiled_block(r, r.alloc(d.p * d.bsh), d, grad_in)
    assert r.saved_bytes == partitioner_saved_bytes(cfg, torch.bfloat16, b, s, lora=lora, grad_in=grad_in)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("precision,dtype", [("bf16-mixed", torch.bfloat16), ("fp32", torch.float32)])
def test_compiled_ops_recomputation_keeps_eagers_policy_less_the_last_product(shape, precision, dtype):
    """train.recompute=ops under torch.compile: the policy's kept outputs (q, v, gate; the attention output
    and its logsumexp) and the block input, but not down_proj's output, which eager's policy cache holds
    and nothing in backward reads."""
    cfg, b, s = model_config(shape), 2, 32
    saved = partitioner_saved_bytes(cfg, dtype, b, s, recompute="ops")
    compiled = Config(model=cfg, train=TrainConfig(precision=precision, compile="true", recompute="ops",
                                                   micro_batch_size=b, seq_len=s))
    eager = dataclasses.replace(compiled, train=dataclasses.replace(compiled.train, compile="false"))
    planned = {}
    for name, c in (("compiled", compiled), ("eager", eager)):
        d = activation_shapes(c, "cpu")
        planned[name] = replay_forward(d, 3, "ops").saved_bytes - replay_forward(d, 2, "ops").saved_bytes
    assert activation_shapes(compiled, "cpu").compiled and not activation_shapes(eager, "cpu").compiled
    assert planned["compiled"] == saved
    assert planned["eager"] - planned["compiled"] == b * s * cfg.hidden_size * dtype.itemsize


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("precision,dtype", [("bf16-mixed", torch.bfloat16), ("fp32", torch.float32)])
def test_compiled_fused_projections_save_what_separate_ones_do(shape, precision, dtype):
    """q/k/v and gate/up as one product each (fivefold.train.fused_projections): the partitioner keeps what it
    keeps for separate products, and no concatenated weight (backward makes its own, from the weights)."""
    cfg = model_config(shape)
    b, s = 2, 32
    planned = planned_block_bytes(cfg, precision, b, s, fused=True)
    assert planned == planned_block_bytes(cfg, precision, b, s)
    assert planned == partitioner_saved_bytes(cfg, dtype, b, s, fused=True)


@pytest.mark.parametrize("mode", ["selective", "full"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("fused", [False, True])
def test_compiled_recomputation_saves_what_the_partitioner_keeps(shape, mode, fused):
    """selective under torch.compile: the dense list less the attention output and its logsumexp (the
    backward graph runs the core again first); full: the block input. The same with fused projections."""
    cfg, b, s = model_config(shape), 2, 32
    saved = partitioner_saved_bytes(cfg, torch.bfloat16, b, s, recompute=mode, fused=fused)
    c = Config(model=cfg, train=TrainConfig(precision="bf16-mixed", compile="true", recompute=mode,
                                            micro_batch_size=b, seq_len=s,
                                            fused_projections="true" if fused else "false"))
    d = activation_shapes(c, "cpu")
    assert d.compiled
    assert replay_forward(d, 3, mode).saved_bytes - replay_forward(d, 2, mode).saved_bytes == saved


def test_compiled_plan_is_below_eager_and_says_so():
    """At Llama-3.2-1B's shape the partitioner saves 75,912 bytes a token and block where eager saves
    108,680; compiling the loss too frees 8 bytes a logit at the start of backward (eager: fp32
    log-probabilities and two fp32 gradients; compiled: the bf16 logits and their gradient). The plan's note
    says which replay it used."""
    base = Config(model=get_preset("llama3.2-1b"),
                  train=TrainConfig(precision="bf16-mixed", micro_batch_size=4, seq_len=2048, compile="false"))
    compiled = dataclasses.replace(base, train=dataclasses.replace(base.train, compile="blocks"))
    with_loss = dataclasses.replace(base, train=dataclasses.replace(base.train, compile="auto"))
    logits = 4 * 2048 * base.model.vocab_size
    freed = plan_memory(compiled, device="cuda").memory["total"] - plan_memory(with_loss, device="cuda").memory["total"]
    assert freed == pytest.approx(8 * logits, rel=0.01)
    eager_plan, compiled_plan = plan_memory(base, device="cuda"), plan_memory(compiled, device="cuda")
    per_token = {}
    for name, cfg in (("eager", base), ("compiled", compiled)):
        d = activation_shapes(cfg, "cuda")
        per_token[name] = (replay_forward(d, 3).saved_bytes - replay_forward(d, 2).saved_bytes) / (d.b * d.s)
    assert per_token == {"eager": 108_680, "compiled": 75_912}
    saved = (per_token["eager"] - per_token["compiled"]) * 4 * 2048 * 16
    assert eager_plan.memory["total"] - compiled_plan.memory["total"] == pytest.approx(saved, rel=1e-9)
    assert any("min-cut partitioning keeps" in n for n in compiled_plan.notes)
    assert not any("train.compile" in n for n in eager_plan.notes)


@pytest.mark.parametrize("change", [
    dict(train=dict(recompute="full", precision="fp8")), dict(train=dict(recompute="selective"), lora=dict(r=8)),
    dict(parallel=dict(tp=2)),
    dict(model=dict(activation="gelu", norm="layernorm", position="learned")),
    dict(lora=dict(r=8, quantize_base="int4")), dict(train=dict(recompute="ops", precision="fp8")),
    dict(train=dict(recompute="ops"), lora=dict(r=8)),
    dict(train=dict(kernels="triton")),
])
def test_other_compiled_runs_replay_the_eager_blocks(change):
    """Outside what was checked against the partitioner the plan keeps the eager replay (an upper bound)."""
    cfg = Config(model=get_preset("llama3.2-1b"), train=TrainConfig(precision="bf16-mixed", compile="auto"),
                 parallel=ParallelConfig())
    assert compiled_blocks_modelled(cfg, "cuda") and not compiled_blocks_modelled(cfg, "cpu")
    for part, fields in change.items():
        cfg = dataclasses.replace(cfg, **{part: dataclasses.replace(getattr(cfg, part), **fields)})
    assert not compiled_blocks_modelled(cfg, "cuda")
    assert any("replay the eager model" in n for n in plan_memory(cfg, device="cuda").notes)


@pytest.mark.parametrize("norm", ["rmsnorm", "layernorm"])
@pytest.mark.parametrize("precision,dtype", [("bf16-mixed", torch.bfloat16), ("fp32", torch.float32)])
def test_compiled_head_saves_what_the_partitioner_keeps(norm, precision, dtype):
    """train.compile=true compiles the final norm and the loss (Config.compiled_loss), the LM head's
    product eager between them: the plan's head keeps what the two graphs' partitioner keeps (the norm's
    input and rsqrt or statistics; the logits as they are and two fp32 figures a row) plus the product's
    input. Eager keeps fp32 log-probabilities (4 bytes a logit) and the norm's fp32 input and output."""
    from fivefold.train.loss import cross_entropy_sum

    model = dataclasses.replace(model_config("gqa"), norm=norm, vocab_size=1000)
    b, s = 2, 32
    torch.manual_seed(0)
    net = Transformer(model).to(dtype)
    x = torch.randn(b, s, model.hidden_size, dtype=dtype, requires_grad=True)
    norm_saved = graph_saved_bytes(type(net.norm).forward, net.norm, x,
                                   keep=lambda v: tuple(v.shape) == (b, s, model.hidden_size))
    logits = torch.randn(b, s, model.vocab_size, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, model.vocab_size, (b, s))
    labels[0, :5] = -100
    loss_saved = graph_saved_bytes(cross_entropy_sum, logits, labels, keep=lambda v: v.is_floating_point())
    head_input = b * s * model.hidden_size * dtype.itemsize  # the eager product saves its input
    planned = {}
    for compile in ("true", "blocks"):
        cfg = Config(model=model, train=TrainConfig(precision=precision, compile=compile, micro_batch_size=b,
                                                    seq_len=s))
        d = activation_shapes(cfg, "cpu")  # a LayerNorm's statistics in the input dtype, as traced here
        assert d.compiled_loss is (compile == "true")
        planned[compile] = replay_forward(d, 1).saved_bytes - replay_forward(d, 1, head=False).saved_bytes
    assert planned["true"] == norm_saved + loss_saved + head_input
    if dtype == torch.bfloat16:  # in fp32 both keep 4 bytes a logit (the compiled loss 8 more a row)
        assert planned["true"] < planned["blocks"]


@pytest.mark.parametrize("change", [dict(train=dict(compile="blocks")), dict(train=dict(loss_chunk=64)),
                                    dict(parallel=dict(tp=2)), dict(train=dict(compile="false"))])
def test_the_loss_compiles_only_where_config_says(change):
    """Config.compiled_loss, which the trainer and the plan both read: train.compile=true (auto on CUDA),
    the plain loss, no vocabulary-parallel loss."""
    cfg = Config(model=get_preset("llama3.2-1b"), train=TrainConfig(precision="bf16-mixed", compile="auto"),
                 parallel=ParallelConfig())
    assert cfg.compiled_loss("cuda") and not cfg.compiled_loss("cpu")
    for part, fields in change.items():
        cfg = dataclasses.replace(cfg, **{part: dataclasses.replace(getattr(cfg, part), **fields)})
    assert not cfg.compiled_loss("cuda")
