"""Paged attention and the KV store (fivefold.kernels.paged_attention): the Triton kernels against the
PyTorch reference, and the reference itself against plain causal SDPA over whole sequences. On the CPU
through Triton's interpreter (TRITON_INTERPRET=1), so sizes are small but cover GQA groups that are
not powers of two, head sizes that are not, two block sizes, prefill chunks over earlier context mixed
with decode rows, a 2000-token decode, padding rows, and split-K.

Every pool starts as NaN and only the sequences' own tokens are written into it: a kernel that read a
slot it should not (past a sequence's length, a padding row's table, a block table's padding) would
turn its output NaN."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from interpreted import rerun_interpreted

# As in test_kernels.py: triton.jit chooses compiler or interpreter when a function is decorated, so the
# flag must be set before triton's first import: here when this file is the first to import it; otherwise
# test_in_a_fresh_process reruns this file in a child process started with it.
with pytest.MonkeyPatch.context() as mp:
    if "triton" not in sys.modules:
        mp.setenv("TRITON_INTERPRET", "1")
    triton = pytest.importorskip("triton")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fivefold.kernels as kernels  # noqa: E402
from fivefold.kernels.paged_attention import (  # noqa: E402
    choose_splits,
    paged_attention,
    paged_attention_reference,
    rope_store_kv,
    split_counts,
    store_kv,
    store_kv_reference,
    warm_up,
)

INTERPRETED = isinstance(triton.language.sum, InterpretedFunction)
TRITON_MODULE = "fivefold.kernels.paged_attention_triton"


@pytest.fixture
def interpreter(monkeypatch):
    """The ops run the Triton kernels in the interpreter (on the CPU they do only with the flag set and
    kernels defined under it), or the test skips when this process imported triton without it."""
    if not INTERPRETED:
        pytest.skip("triton was imported without TRITON_INTERPRET=1; test_in_a_fresh_process runs this test")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import importlib

    module = importlib.import_module(TRITON_MODULE)
    if not module.INTERPRETED:  # imported earlier without the flag: define its kernels again
        importlib.reload(module)
    assert kernels.triton_available() and module.INTERPRETED


def tolerance(dtype: torch.dtype) -> dict:
    # fp32: the same sums in another order (blocked online softmax against one softmax). 16-bit: the
    # output rounded once (2**-8 relative for bf16) plus the kernel's P rounded to the dtype before P @ V.
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


def make_batch(seqs, heads, kv_heads, head_dim, block_size, dtype, seed=0, spare_blocks=3):
    """seqs: (seq_len, queries) per sequence; seq_len 0 is a padding row. Whole sequences of random
    q, k, v; each sequence's k, v written into blocks of a NaN pool in shuffled order (block 0, the
    tables' padding, is never given out); q of each sequence's last `queries` tokens flattened.
    Returns the op's arguments and the whole sequences (for the SDPA check)."""
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-length // block_size) for length, _ in seqs]
    num_blocks = 1 + sum(counts) + spare_blocks
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    width = max(max(counts), 1)
    tables, whole, queries = [], [], []
    for (length, n), count in zip(seqs, counts):
        table, order = order[:count], order[count:]
        tables.append(table + [0] * (width - count))
        q, k, v = (torch.randn(length, h, head_dim, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads))
        whole.append((q, k, v))
        positions = torch.arange(length)
        slots = torch.tensor(table, dtype=torch.long)[positions // block_size] * block_size + positions % block_size
        store_kv_reference(k_cache, v_cache, k, v, slots)
        # A padding row's query: NaN, which must not reach its (zero) output.
        queries.append(q[length - n:] if length else torch.full((n, heads, head_dim), float("nan"), dtype=dtype))
    args = dict(q=torch.cat(queries), k_cache=k_cache, v_cache=v_cache,
                block_tables=torch.tensor(tables, dtype=torch.int32),
                seq_lens=torch.tensor([length for length, _ in seqs], dtype=torch.int32),
                query_start_loc=torch.tensor([0] + [n for _, n in seqs]).cumsum(0).to(torch.int32),
                max_query_len=max(n for _, n in seqs))
    return args, whole


# A prefill from scratch, prefill chunks over earlier context (one ending mid-block, one on a block
# edge), decodes of contexts 1, 18 and 101, a padding row (seq_len 0) and a sequence with no queries.
MIXED = [(37, 37), (70, 20), (101, 1), (1, 1), (0, 1), (64, 16), (5, 0), (18, 1)]

# heads, kv heads, head_dim, block_size, dtype
CONFIGS = [(32, 8, 16, 16, torch.float32), (9, 3, 32, 32, torch.float32), (9, 3, 24, 16, torch.bfloat16),
           (32, 8, 32, 32, torch.bfloat16), (4, 2, 80, 16, torch.float16), (4, 4, 16, 8, torch.float32)]


def config_id(config) -> str:
    heads, kv_heads, head_dim, block_size, dtype = config
    return f"{heads}/{kv_heads}h-d{head_dim}-bs{block_size}-{str(dtype).removeprefix('torch.')}"


def check_padding(args, seqs, out):
    """Rows of padding sequences are exactly zero."""
    for i, (length, _) in enumerate(seqs):
        if length == 0:
            rows = slice(int(args["query_start_loc"][i]), int(args["query_start_loc"][i + 1]))
            assert torch.equal(out[rows], torch.zeros_like(out[rows]))


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_mixed_batch_matches_reference(interpreter, config):
    heads, kv_heads, head_dim, block_size, dtype = config
    args, _ = make_batch(MIXED, heads, kv_heads, head_dim, block_size, dtype, seed=head_dim)
    want = paged_attention_reference(**args)
    assert not want.isnan().any()
    got = paged_attention(**args)
    assert got.dtype == dtype and got.shape == args["q"].shape
    torch.testing.assert_close(got, want, **tolerance(dtype))
    check_padding(args, MIXED, got)
    if heads == 32:  # in the interpreter a 32-head launch takes ~6 s; the variants below run on the others
        return
    # A scale other than 1/sqrt(d), and prefill chunks through split-K (the kernel allows it; the
    # heuristic never picks it): the same numbers.
    torch.testing.assert_close(paged_attention(**args, scale=0.3), paged_attention_reference(**args, scale=0.3),
                               **tolerance(dtype))
    torch.testing.assert_close(paged_attention(**args, split_k=3), want, **tolerance(dtype))


def test_max_query_len_only_sizes_the_tiles(interpreter):
    """A max_query_len below or above the truth changes the tiles, not the result."""
    args, _ = make_batch(MIXED, 9, 3, 32, 32, torch.float32, seed=2)
    want = paged_attention_reference(**args)
    for hint in (1, 5, 200):
        torch.testing.assert_close(paged_attention(**{**args, "max_query_len": hint}), want, rtol=1e-5, atol=1e-5)


# Decode contexts 1 .. 2000: within one block, on block edges, past them, and one long one.
DECODES = [(1, 1), (2, 1), (15, 1), (16, 1), (17, 1), (0, 1), (300, 1), (2000, 1)]


@pytest.mark.parametrize("head_dim, block_size, dtype", [(32, 16, torch.float32), (128, 32, torch.bfloat16)])
def test_long_decodes_and_split_k(interpreter, head_dim, block_size, dtype):
    args, _ = make_batch(DECODES, 4, 1, head_dim, block_size, dtype, seed=block_size)
    want = paged_attention_reference(**args)
    plain = paged_attention(**args, split_k=1)
    torch.testing.assert_close(plain, want, **tolerance(dtype))
    # 8 sequences x 1 kv head fill no GPU, and the longest holds three 512-key parts: split in 2 (a power
    # of two at most that). The bound comes from the block table's width (2000 tokens) unless max_seq_len
    # says it. split_k=5 and 3 (below): counts the kernel takes though choose_splits never picks them.
    assert choose_splits(len(DECODES), 1, 1, 2000) == 2
    for split in ({}, dict(split_k=5), dict(max_seq_len=2000), dict(split_k=16)):
        got = paged_attention(**args, **split)
        if dtype == torch.float32:  # split-K == plain to rounding
            torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-5)
        else:  # P rounds to bf16 against a different running max in each part
            torch.testing.assert_close(got, plain, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(got, want, **tolerance(dtype))
        check_padding(args, DECODES, got)


def test_split_heuristic():
    assert choose_splits(1, 8, 1, 32768) == 16  # one long decode: as many parts as SPLIT_MAX allows
    assert choose_splits(4, 8, 1, 4096) == 8  # 32 programs: 4096 // 512 parts
    assert choose_splits(4, 8, 1, 3583) == 4  # 6 parts would fit: rounded down to a power of two
    assert choose_splits(3, 8, 1, 32768) == 8  # 24 programs want 11 parts: 8
    assert choose_splits(4, 8, 1, 1023) == 1  # too short for two parts
    assert choose_splits(64, 4, 1, 32768) == 1  # 256 programs fill the GPU already
    assert choose_splits(1, 8, 2, 32768) == 1  # a prefill or speculative rows: never
    assert choose_splits(0, 8, 1, 32768) == 1


def test_every_split_count_is_one_the_warm_up_compiles():
    """choose_splits picks from split_counts() alone, over every batch, group and context, so that warm_up
    compiles each split-K variant a decode step can need before serving starts."""
    counts = set(split_counts())
    assert counts == {1, 2, 4, 8, 16}
    picked = {choose_splits(seqs, kv, 1, length) for seqs in range(0, 70) for kv in (1, 2, 3, 8)
              for length in range(0, 40000, 97)}
    assert picked == counts


def test_warm_up_launches_each_tile_size_and_split_count_once(interpreter):
    """Block size 16, 8 query heads over 2 kv heads (a group of 4, tile rows 16 / 32 / 64): decode rows
    with each split count, then one chunk length per larger tile. Nothing is written to the pool."""
    pool = torch.randn(6, 16, 2, 32)
    k_cache, v_cache = pool.clone(), pool.clone()
    module = __import__(TRITON_MODULE, fromlist=["tiles"])
    launched = warm_up(k_cache, v_cache, num_heads=8)
    assert launched == [(1, 1), (1, 2), (1, 4), (1, 8), (1, 16), (8, 1), (16, 1)]
    tiles = {module.tiles(n, 4, 32, torch.float32) for n in range(1, 200)}
    assert {module.tiles(n, 4, 32, torch.float32) for n, _ in launched} == tiles  # every tile a step can use
    assert torch.equal(k_cache, pool) and torch.equal(v_cache, pool)


def sdpa_tail(q, k, v, n, scale=None):
    """Plain causal attention over a whole sequence (GQA by SDPA), its last n query rows: (n, H, d)."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1).float(), k.transpose(0, 1).float(),
                                         v.transpose(0, 1).float(), is_causal=True, enable_gqa=True, scale=scale)
    return out.transpose(0, 1)[q.shape[0] - n:].to(q.dtype)


@pytest.mark.parametrize("config", [CONFIGS[1], CONFIGS[2], CONFIGS[5]], ids=config_id)
def test_reference_matches_sdpa_over_whole_sequences(config):
    """The oracle itself: each sequence's rows equal causal SDPA over the whole sequence."""
    heads, kv_heads, head_dim, block_size, dtype = config
    args, whole = make_batch(MIXED, heads, kv_heads, head_dim, block_size, dtype, seed=1)
    for scale in (None, 0.3):
        out = paged_attention_reference(**args, scale=scale)
        starts = args["query_start_loc"].tolist()
        for i, ((length, n), (q, k, v)) in enumerate(zip(MIXED, whole)):
            if length:
                torch.testing.assert_close(out[starts[i]:starts[i + 1]], sdpa_tail(q, k, v, n, scale),
                                           **tolerance(dtype))
        check_padding(args, MIXED, out)


def test_op_on_cpu_without_triton_is_the_reference(monkeypatch):
    monkeypatch.setattr(kernels, "triton_available", lambda: False)
    args, _ = make_batch(MIXED, 9, 3, 24, 16, torch.float32)
    assert torch.equal(torch.ops.fivefold.paged_attention(**args), paged_attention_reference(**args))
    k_cache, v_cache = args["k_cache"].clone(), args["v_cache"].clone()
    k, v = torch.randn(2, 2, 3, 24).unbind(0)
    slots = torch.tensor([5, -1], dtype=torch.int32)
    torch.ops.fivefold.store_kv(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache.view(-1, 3, 24)[5], k[0]) and torch.equal(v_cache.view(-1, 3, 24)[5], v[0])


def test_imports_and_runs_without_triton():
    """The engine imports the module on every machine: with triton unimportable, the ops run the reference."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch\n"
            "from fivefold.kernels.paged_attention import paged_attention, paged_attention_reference as ref\n"
            "q = torch.randn(3, 4, 16); kc, vc = torch.randn(2, 4, 8, 2, 16).unbind(0)\n"
            "args = (q, kc, vc, torch.tensor([[1, 0], [0, 1]], dtype=torch.int32),\n"
            "        torch.tensor([6, 1], dtype=torch.int32), torch.tensor([0, 2, 3], dtype=torch.int32), 2)\n"
            "assert torch.equal(paged_attention(*args), ref(*args))\n"
            "assert 'fivefold.kernels.paged_attention_triton' not in sys.modules\n")
    child = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TRITON_INTERPRET": "1"},
                           cwd=Path(__file__).parent.parent, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-4000:]


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "reference"])
def test_store_kv_writes_exactly_the_given_slots(request, monkeypatch, slot_dtype, use_triton):
    if use_triton:
        request.getfixturevalue("interpreter")
    else:
        monkeypatch.setattr(kernels, "triton_available", lambda: False)
    kv_heads, head_dim, block_size, num_blocks = 3, 24, 8, 5
    gen = torch.Generator().manual_seed(0)
    # k and v as the attention layer has them: views into one fused projection, not contiguous.
    fused = torch.randn(7, 2 * kv_heads + 1, head_dim, generator=gen).to(torch.bfloat16)
    k, v = fused[:, :kv_heads], fused[:, kv_heads + 1:]
    assert not k.is_contiguous()
    slots = torch.tensor([3, -1, 8, 39, -1, 0, 17], dtype=slot_dtype)  # first, last, across blocks; 2 padding
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), -7.0, dtype=torch.bfloat16)
    v_cache = k_cache.clone()
    torch.ops.fivefold.store_kv(k_cache, v_cache, k, v, slots)
    want_k = torch.full((num_blocks * block_size, kv_heads, head_dim), -7.0, dtype=torch.bfloat16)
    want_v = want_k.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want_k[slot], want_v[slot] = k[t], v[t]
    assert torch.equal(k_cache.view_as(want_k), want_k) and torch.equal(v_cache.view_as(want_v), want_v)
    written = (k_cache.view(num_blocks * block_size, -1) != -7.0).any(-1).nonzero().flatten().tolist()
    assert written == [0, 3, 8, 17, 39]  # those slots and nothing else


def test_op_under_torch_compile(interpreter):
    """Traced through the fake implementations (no graph break), then run: the same as eager."""
    args, _ = make_batch(MIXED, 4, 2, 16, 16, torch.float32)
    k_new, v_new = torch.randn(2, 2, 2, 16).unbind(0)
    slots = torch.tensor([-1, 2], dtype=torch.int32)  # slot 2: sequence 0's third token

    def step(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len):
        store_kv(k_cache, v_cache, k_new, v_new, slots)
        return paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len)

    eager_args = {**args, "k_cache": args["k_cache"].clone(), "v_cache": args["v_cache"].clone()}
    want = step(**eager_args)
    got = torch.compile(step, backend="aot_eager", fullgraph=True)(**args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(args["k_cache"].nan_to_num(), eager_args["k_cache"].nan_to_num())


@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "reference"])
def test_opcheck(request, monkeypatch, use_triton):
    if use_triton:
        request.getfixturevalue("interpreter")
    else:
        monkeypatch.setattr(kernels, "triton_available", lambda: False)
    # A finite pool: opcheck compares outputs with NaN as unequal.
    args, _ = make_batch([(20, 4), (9, 1), (0, 1)], 4, 2, 16, 8, torch.float32)
    args["k_cache"], args["v_cache"] = args["k_cache"].nan_to_num(), args["v_cache"].nan_to_num()
    args["q"] = args["q"].nan_to_num()
    torch.library.opcheck(torch.ops.fivefold.paged_attention.default, tuple(args.values()))
    k, v = torch.randn(2, 3, 2, 16).unbind(0)
    torch.library.opcheck(torch.ops.fivefold.store_kv.default,
                          (args["k_cache"], args["v_cache"], k, v, torch.tensor([1, -1, 30], dtype=torch.int32)))
    q, k, v = torch.randn(3, 8, 16).split([4, 2, 2], dim=1)
    cos, sin = torch.randn(2, 3, 16).unbind(0)
    torch.library.opcheck(torch.ops.fivefold.rope_store_kv.default,
                          (q, k, v, cos, sin, args["k_cache"], args["v_cache"], torch.tensor([1, -1, 30], dtype=torch.int32)))


def fused_qkv(tokens, heads, kv_heads, head_dim, dtype, seed=0):
    """q, k, v as serving's fused projection gives them: column slices of one (T, (H + 2 Hkv) d) product,
    viewed as heads; rows a whole product apart, not contiguous."""
    gen = torch.Generator().manual_seed(seed)
    product = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q, k, v = product.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return tuple(x.view(tokens, -1, head_dim) for x in (q, k, v))


@pytest.mark.parametrize("heads, kv_heads, head_dim, dtype", [(32, 8, 16, torch.float32), (9, 3, 12, torch.bfloat16),
                                                              (4, 4, 64, torch.bfloat16)])
def test_rope_store_kv_is_rope_then_store(interpreter, heads, kv_heads, head_dim, dtype):
    """The one-launch RoPE + store against what it replaces (the Triton RoPE on q and k, then store_kv):
    the same bits in the returned q and in every slot of both pools, NaN where nothing was written; and
    against the PyTorch reference."""
    from fivefold.kernels.paged_attention import rope_store_kv_reference
    from fivefold.kernels.rope import apply_rope
    from fivefold.model.rope import rope_cos_sin

    tokens, block_size, num_blocks = 7, 8, 4
    q, k, v = fused_qkv(tokens, heads, kv_heads, head_dim, dtype)
    assert not q.is_contiguous() and not k.is_contiguous()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    positions = torch.tensor([[5, 0, 17, 3, 30, 1, 9]])
    cos, sin = rope_cos_sin(inv_freq, positions, dtype)  # (1, 1, T, d), as the model makes them
    slots = torch.tensor([3, -1, 8, 31, -1, 0, 17], dtype=torch.int32)  # two padding tokens
    pools = [torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype) for _ in range(2)]
    want_pools = [pool.clone() for pool in pools]
    ref_pools = [pool.clone() for pool in pools]

    got = rope_store_kv(q, k, v, cos[0, 0], sin[0, 0], *pools, slots)
    as_bhsd = lambda x: x.transpose(0, 1)[None]  # noqa: E731  (T, H, d) -> (1, H, T, d), Attention's layout
    want = apply_rope(as_bhsd(q), cos, sin)[0].transpose(0, 1)
    store_kv(*want_pools, apply_rope(as_bhsd(k), cos, sin)[0].transpose(0, 1), v, slots)
    assert got.is_contiguous() and got.shape == (tokens, heads, head_dim)
    assert torch.equal(got, want)
    for pool, want_pool in zip(pools, want_pools):
        assert torch.equal(pool.nan_to_num(nan=-9.0), want_pool.nan_to_num(nan=-9.0))
    written = (~pools[0].view(num_blocks * block_size, -1).isnan()).any(-1).nonzero().flatten().tolist()
    assert written == [0, 3, 8, 17, 31]
    ref = rope_store_kv_reference(q, k, v, cos[0, 0], sin[0, 0], *ref_pools, slots)
    # fp32: the same arithmetic, exactly. bf16: one rounding of the same fp32 values, which Triton's
    # interpreter truncates where torch rounds to nearest: within one bf16 step (2**-7 relative).
    exact = dtype == torch.float32
    tol = dict(rtol=0, atol=0) if exact else dict(rtol=2**-7, atol=0)
    torch.testing.assert_close(got, ref, **tol)
    torch.testing.assert_close(pools[0], ref_pools[0], equal_nan=True, **tol)
    assert torch.equal(pools[1].nan_to_num(nan=-9.0), ref_pools[1].nan_to_num(nan=-9.0))  # values are copied


def count_launches(fn):
    """(result, launches): fn() run with every kernel it starts counted: Triton kernels (the interpreter's
    launches) and aten ops that compute (not views, allocations, dtype queries, or fivefold's custom ops,
    whose Triton kernels are counted)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime import interpreter

    counts = {"triton": 0, "aten": 0}
    inside = [False]
    launch = interpreter.GridExecutor.__call__

    def counted_launch(self, *args, **kwargs):
        counts["triton"] += 1
        inside[0] = True  # the interpreter's own copies to and from the host are no launches
        try:
            return launch(self, *args, **kwargs)
        finally:
            inside[0] = False

    skip = {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like", "detach", "alias",
            "lift_fresh", "_local_scalar_dense", "promote_types"}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            if not (inside[0] or func.is_view or name in skip or func.namespace == "fivefold"):
                counts["aten"] += 1
            return func(*args, **(kwargs or {}))

    interpreter.GridExecutor.__call__ = counted_launch
    try:
        with Count():
            result = fn()
    finally:
        interpreter.GridExecutor.__call__ = launch
    return result, counts["triton"] + counts["aten"]


def test_fused_launches_give_the_same_logits_with_fewer_kernels(interpreter):
    """serve.fuse_launches (RoPE in the store's launch, residual adds in the norms') against the separate
    kernels on the engine's kernel path: the same logits and pool bit for bit, over a step of prompt chunks
    and one of decodes, with 2 launches a layer fewer for RoPE + store and 2 a layer less 1 for the
    residual adds."""
    import dataclasses

    from fivefold.model import build_model
    from fivefold.presets import PRESETS
    from fivefold.serve import LLM, SamplingParams

    cfg = dataclasses.replace(PRESETS["tiny"], num_layers=3)
    prompts = [[5, 9, 2, 7, 1, 3, 8, 8, 4], [11, 12, 13]]
    seen = {}
    for fuse in (False, True):
        llm = LLM(build_model(cfg, seed=1).eval(), kernels="triton", block_size=8, max_num_batched_tokens=64,
                  fuse_launches=fuse)
        engine = llm.engine
        assert engine.residuals_fused == fuse
        forward, steps = engine._forward, []

        def recorded(step, pending=None, forward=forward, steps=steps):
            logits, launches = count_launches(lambda: forward(step, pending))
            steps.append((step.decode_only, logits.clone(), launches))
            return logits

        engine._forward = recorded
        outs = llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        seen[fuse] = ([o.token_ids for o in outs], steps, engine.pool.k.clone(), engine.pool.v.clone())
    (tokens, plain, k, v), (fused_tokens, fused, fused_k, fused_v) = seen[False], seen[True]
    assert fused_tokens == tokens and len(fused) == len(plain) >= 3 and not plain[0][0] and plain[-1][0]
    for (_, want, n), (_, got, m) in zip(plain, fused):
        assert torch.equal(got, want)
        assert n - m == 2 * cfg.num_layers + (2 * cfg.num_layers - 1)
    assert torch.equal(fused_k, k) and torch.equal(fused_v, v)


def test_a_hook_added_after_the_swap_runs(interpreter):
    """The fused residual loop calls each block's parts, not the blocks: a forward hook put on a block (or
    the model, or a norm) once an engine has swapped the class makes the forward the plain one again, so the
    hook runs; and a later engine does not swap such a model."""
    from fivefold.model import build_model
    from fivefold.presets import PRESETS
    from fivefold.serve import LLM, SamplingParams
    from fivefold.serve.residual import FusedResidualTransformer, fuse_residuals

    model = build_model(PRESETS["tiny"], seed=1).eval()
    llm = LLM(model, kernels="triton", block_size=8)
    assert isinstance(model, FusedResidualTransformer)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    before = llm.generate([[5, 6, 7]], params)[0].token_ids
    calls = []
    handle = model.layers[1].register_forward_pre_hook(lambda module, args: calls.append(1))
    assert llm.generate([[5, 6, 7]], params)[0].token_ids == before
    assert len(calls) == 3  # the prompt's step and two decodes
    assert not fuse_residuals(model)
    handle.remove()
    assert fuse_residuals(model)


def test_bad_inputs_name_the_fix():
    args, _ = make_batch([(10, 2)], 4, 2, 16, 8, torch.float32)

    def fails(match, **changes):
        with pytest.raises(ValueError, match=match):
            paged_attention(**{**args, **changes})

    fails(r"q must be \(tokens, heads, head_dim\)", q=args["q"][None])
    fails("not a multiple of 2 kv heads", q=torch.randn(2, 3, 16))
    fails("head_dim 8 differs", q=torch.randn(2, 4, 8))
    fails("must be contiguous", k_cache=args["k_cache"].transpose(1, 2).contiguous().transpose(1, 2))
    fails("share a dtype.*cast q", q=args["q"].bfloat16())
    fails("block_tables must be a 2-d int32", block_tables=args["block_tables"].float())
    fails("query_start_loc 2 entries", query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32))
    fails("split_k must be None", split_k=0)
    fails("max_query_len must be >= 0", max_query_len=-1)
    k = torch.randn(2, 2, 16)
    with pytest.raises(ValueError, match="share a dtype"):
        store_kv(args["k_cache"], args["v_cache"], k.bfloat16(), k.bfloat16(), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="slot_mapping must be int32 or int64"):
        store_kv(args["k_cache"], args["v_cache"], k, k, torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match=r"k and v must both be \(tokens, 2, 16\)"):
        store_kv(args["k_cache"], args["v_cache"], k[:, :1], k[:, :1], torch.tensor([0, 1]))


def test_engine_with_the_kernel_gives_the_reference_tokens(interpreter):
    """The serving engine with serve.kernels=triton (paged kernel, KV store, Triton RMSNorm / RoPE / SwiGLU)
    against serve.kernels=torch (block gathers + SDPA): chunked prompts over earlier context, decodes of
    many lengths in one step, greedy and seeded sampling, the same tokens."""
    from fivefold.model import build_model
    from fivefold.presets import PRESETS
    from fivefold.serve import LLM, SamplingParams

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 384, (n,), generator=g).tolist() for n in (3, 37, 12, 70, 1, 25)]
    params = [SamplingParams(max_tokens=6, ignore_eos=True, temperature=0 if i % 2 else 0.8, seed=i)
              for i in range(len(prompts))]
    outs = {}
    for choice in ("torch", "triton"):
        llm = LLM(build_model(PRESETS["tiny"], seed=1).eval(), kernels=choice, block_size=8,
                  max_num_batched_tokens=32)  # prompts split into chunks beside the decodes
        assert llm.engine.kernel == (choice == "triton")
        outs[choice] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs["triton"] == outs["torch"]


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_a_quantized_model_fuses_gate_up_on_the_kernel_path(interpreter, method):
    """On the kernel path the MLP is the Triton one; a quantized model's gate/up fuse there as on the torch
    path (one QuantLinear over both parts' codes, which the parts view: what `fivefold plan --serve --model`
    counts), and both paths give the same greedy tokens; unfusing gives the Triton MLP back."""
    from fivefold.kernels.swiglu import TritonMLP
    from fivefold.model import build_model
    from fivefold.presets import PRESETS
    from fivefold.quant.gptq import quantize_model
    from fivefold.quant.linear import swap_linears
    from fivefold.serve import LLM, SamplingParams
    from fivefold.serve.fused import unfuse_projections

    prompts = [[5, 9, 2, 7, 1, 3, 8, 8, 4], [11, 12, 13]]
    outs = {}
    for choice in ("torch", "triton"):
        model = build_model(PRESETS["tiny"], seed=1).eval()
        swap_linears(model, quantize_model(model, method, group_size=16))
        llm = LLM(model, kernels=choice, block_size=8)
        assert llm.engine.fused == 2 * model.cfg.num_layers
        outs[choice] = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0,
                                                                                       ignore_eos=True))]
    mlp = model.layers[0].mlp
    assert type(mlp).__name__ == "FusedQuantTritonMLP" and isinstance(mlp, TritonMLP)
    assert mlp.up_proj.qweight.untyped_storage().data_ptr() == mlp.gate_up_quant.qweight.untyped_storage().data_ptr()
    assert outs["triton"] == outs["torch"]
    assert unfuse_projections(model) == 2 * model.cfg.num_layers and type(model.layers[0].mlp) is TritonMLP


@pytest.mark.skipif(INTERPRETED, reason="this process runs the kernels in the interpreter itself")
def test_in_a_fresh_process():
    """This file's tests in a child process that imports triton with TRITON_INTERPRET=1 (see the top)."""
    rerun_interpreted(__file__)
