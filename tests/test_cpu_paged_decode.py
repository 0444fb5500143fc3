"""The CPU paged-decode kernel (fivefold.kernels.cpu_paged_decode, serve.cpu_kernel): one query token per
sequence attending over its paged context, read in place through the block tables, against float64 SDPA
over the whole sequence; and the engine with it against the engine gathering blocks for SDPA.

Pools start as NaN and only each sequence's own tokens are written into shuffled blocks: a kernel that read
past a sequence's length, a padding row's table or a table's padding would turn its output NaN."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from fivefold.config import ConfigError
import fivefold.kernels.cpu_paged_decode as cpu_paged_decode
import fivefold.serve.kv_pool as kv_pool
from fivefold.kernels.cpu_paged_decode import HEAD_SIZES, decode_attention, kernel_problem, unsupported
from fivefold.model import build_model
from fivefold.presets import PRESETS
from fivefold.serve import LLM, SamplingParams

if kernel_problem():
    pytest.skip(f"the CPU paged-decode kernel cannot be built here: {kernel_problem()}", allow_module_level=True)

# float32 against float64: the same sums in another order (online softmax by blocks) and a polynomial exp
# of ~1 ulp; measured at most 4.2e-7 over these cases.
TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def make_decodes(lengths, heads, kv_heads, head_dim, block_size, seed=0, dtype=torch.float32):
    """One decode row per length (0: a padding row with a NaN query), queries and pools in `dtype`. Returns the
    kernel's arguments and each row's float64 SDPA answer over its whole context (None for padding)."""
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-n // block_size) for n in lengths]
    num_blocks = 1 + sum(counts) + 2
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0: the tables' padding
    k_pool = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    v_pool = k_pool.clone()
    width = max(max(counts), 1)
    tables, queries, expected = [], [], []
    for n, count in zip(lengths, counts):
        table, order = order[:count], order[count:]
        tables.append(table + [0] * (width - count))
        q = torch.randn(heads, head_dim, generator=gen, dtype=torch.float64)
        k, v = (torch.randn(n, kv_heads, head_dim, generator=gen, dtype=torch.float64) for _ in range(2))
        for i in range(n):
            k_pool[table[i // block_size], i % block_size] = k[i].to(dtype)
            v_pool[table[i // block_size], i % block_size] = v[i].to(dtype)
        if n == 0:
            queries.append(torch.full((heads, head_dim), float("nan"), dtype=dtype))
            expected.append(None)
            continue
        queries.append(q.to(dtype))
        groups = heads // kv_heads  # the reference sees the rounded inputs the kernel sees
        qf, kf, vf = q.to(dtype).double(), k.to(dtype).double(), v.to(dtype).double()
        out = F.scaled_dot_product_attention(qf[:, None], kf.transpose(0, 1).repeat_interleave(groups, 0),
                                             vf.transpose(0, 1).repeat_interleave(groups, 0))
        expected.append(out[:, 0])
    args = (torch.stack(queries), k_pool, v_pool, torch.tensor(tables, dtype=torch.int32),
            torch.tensor(lengths, dtype=torch.int32))
    return args, expected


# Contexts of one token, one short of a block, exactly a block, one past it, a long one, and padding rows.
LENGTHS = [1, 15, 16, 17, 101, 0, 2000, 33, 0]
# heads, kv heads, head size, block size
# (Groups of 1-8 query heads a key/value head; the AVX-512 form adds a group's values together up to 8: 12, past
# it, row by row.)
CASES = [(32, 8, 64, 16), (9, 3, 64, 32), (9, 3, 16, 16), (4, 4, 128, 16), (8, 1, 32, 16), (16, 2, 80, 32),
         (4, 2, 256, 16), (6, 2, 48, 16), (4, 2, 96, 16), (4, 2, 32, 8), (10, 2, 64, 16), (14, 2, 64, 16),
         (12, 2, 64, 16), (12, 1, 32, 16)]


@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", CASES,
                         ids=[f"{h}/{kv}h-d{d}-bs{bs}" for h, kv, d, bs in CASES])
def test_decode_rows_match_sdpa_over_the_whole_context(heads, kv_heads, head_dim, block_size, portable):
    """Both forms of scoring the keys: this CPU's (AVX-512's transposed sums where it has them) and the one a
    CPU without AVX-512 compiles (one dot product a key)."""
    args, expected = make_decodes(LENGTHS, heads, kv_heads, head_dim, block_size)
    out = decode_attention(*args, portable=portable)
    assert out.shape == (len(LENGTHS), heads, head_dim)
    for row, want in enumerate(expected):
        if want is None:
            assert torch.equal(out[row], torch.zeros_like(out[row]))  # padding: zeros, its NaN query unread
        else:
            torch.testing.assert_close(out[row].double(), want, **TOLERANCE)


# The bfloat16 forms: this CPU's (the keys scored as bfloat16 pairs where it has AVX512_BF16), widened (as an
# AVX-512 CPU without it does) and portable; every head size the pairs' masked tail meets (16, 48, 80: 16 past a
# multiple of 32).
BF16_FORMS = {"native": {}, "widened": {"widened": True}, "portable": {"portable": True}}
BF16_CASES = CASES[:4] + [(16, 2, 80, 32), (6, 2, 48, 16)]


@pytest.mark.parametrize("form", BF16_FORMS)
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", BF16_CASES,
                         ids=[f"{h}/{kv}h-d{d}-bs{bs}" for h, kv, d, bs in BF16_CASES])
def test_a_bfloat16_pool_is_read_in_place(heads, kv_heads, head_dim, block_size, form):
    """A bfloat16 engine's pool and queries: the keys and values read as they are, all sums float32, the output
    rounded to bfloat16 once: within half a bfloat16 step (2^-8 of the value) of float64 SDPA over the same
    bfloat16 values; a row alone bit for bit that row in the batch."""
    args, expected = make_decodes(LENGTHS, heads, kv_heads, head_dim, block_size, dtype=torch.bfloat16)
    out = decode_attention(*args, **BF16_FORMS[form])
    assert out.shape == (len(LENGTHS), heads, head_dim) and out.dtype == torch.bfloat16
    for row, want in enumerate(expected):
        if want is None:
            assert torch.equal(out[row], torch.zeros_like(out[row]))
        else:
            err = (out[row].double() - want).abs()
            assert bool((err <= 2.0**-8 * want.abs() + 1e-5).all()), float(err.max())
    q, k_pool, v_pool, tables, lens = args
    for row in (0, 4, 6):
        alone = decode_attention(q[row:row + 1], k_pool, v_pool, tables[row:row + 1], lens[row:row + 1],
                                 **BF16_FORMS[form])
        assert torch.equal(alone[0], out[row])


@pytest.mark.skipif(not cpu_paged_decode.pairs(), reason="this CPU does not multiply bfloat16 pairs (AVX512_BF16)")
def test_bfloat16_pairs_are_what_this_cpu_runs():
    """Where the CPU has AVX512_BF16, a bfloat16 decode's scores come from the pairs (another order of float32
    sums than widening: some outputs differ in their last bits), and a float32 one's are as before."""
    args, _ = make_decodes(LENGTHS, 32, 8, 64, 16, dtype=torch.bfloat16)
    assert not torch.equal(decode_attention(*args), decode_attention(*args, widened=True))
    fp32, _ = make_decodes(LENGTHS, 32, 8, 64, 16)
    assert torch.equal(decode_attention(*fp32), decode_attention(*fp32, widened=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_large_scores_keep_the_softmax_finite(block_size, dtype):
    """Queries 40x the usual size put scores hundreds apart: each block's exponentials must be taken below that
    block's largest score (one above it past ~88 overflows float32), so the outputs stay finite and right: float32
    within 5e-4 relative (scores of a few hundred carry float32 rounding of ~1e-5; measured 1.3e-4), bfloat16 within
    half a bfloat16 step."""
    rtol = 5e-4 if dtype == torch.float32 else 2.0**-8
    args, _ = make_decodes([block_size, 3 * block_size - 5, 7], 8, 2, 64, block_size, seed=3, dtype=dtype)
    q, k_pool, v_pool, tables, lens = args
    q = (q.float() * 40).to(dtype)
    out = decode_attention(q, k_pool, v_pool, tables, lens)
    assert bool(out.isfinite().all())
    for row, n in enumerate(lens.tolist()):
        blocks = tables[row, :-(-n // block_size)].long()
        k = k_pool[blocks].flatten(0, 1)[:n].double().transpose(0, 1).repeat_interleave(4, 0)
        v = v_pool[blocks].flatten(0, 1)[:n].double().transpose(0, 1).repeat_interleave(4, 0)
        want = F.scaled_dot_product_attention(q[row].double()[:, None], k, v)[:, 0]
        err = (out[row].double() - want).abs()
        assert bool((err <= rtol * want.abs() + 1e-4).all()), float(err.max())


def test_a_row_alone_equals_that_row_in_a_batch_bit_for_bit():
    """A row's output does not depend on its companions, nor on whether its heads are split into work items
    of their own (fewer sequences than twice the threads) or not."""
    args, _ = make_decodes(LENGTHS * 2, 9, 3, 64, 16, seed=1)
    q, k_pool, v_pool, tables, lens = args
    for portable in (False, True):
        batch = decode_attention(*args, portable=portable)
        for row in range(len(lens)):
            alone = decode_attention(q[row:row + 1], k_pool, v_pool, tables[row:row + 1], lens[row:row + 1],
                                     portable=portable)
            assert torch.equal(alone[0], batch[row])


def test_rows_read_the_tables_their_owners_name():
    """`owners`: each row reads the block table it names (a prompt chunk's tokens share their sequence's), bit for
    bit the rows given their own tables; an owner past the tables is refused before anything is read."""
    args, _ = make_decodes([40, 7, 0, 300], 8, 2, 32, 16, seed=4)
    q, k_pool, v_pool, tables, lens = args
    owners = torch.tensor([3, 0, 3, 1, 2, 3], dtype=torch.int32)
    rows = torch.randn(len(owners), 8, 32)
    row_lens = torch.tensor([300, 40, 17, 7, 0, 1], dtype=torch.int32)
    expected = decode_attention(rows, k_pool, v_pool, tables[owners.long()].contiguous(), row_lens)
    assert torch.equal(decode_attention(rows, k_pool, v_pool, tables, row_lens, owners=owners), expected)
    with pytest.raises(RuntimeError, match="owners: row 1 names table 4 of 4"):
        decode_attention(rows, k_pool, v_pool, tables, row_lens, owners=torch.tensor([0, 4, 0, 0, 0, 0],
                                                                                       dtype=torch.int32))


def test_queries_are_read_through_their_strides():
    """q as the engine hands it: rows of a fused q/k/v product, a view whose row stride is not H x d."""
    args, _ = make_decodes([40, 7, 0, 300], 8, 2, 32, 16, seed=2)
    q = args[0]
    fused = torch.cat([q.flatten(1), torch.randn(q.shape[0], 2 * 2 * 32)], dim=1)  # (B, (H + 2 Hkv) d)
    view = fused[:, :8 * 32].view(-1, 8, 32)
    assert not view.is_contiguous()
    assert torch.equal(decode_attention(view, *args[1:]), decode_attention(q, *args[1:]))


def test_what_it_cannot_run_is_named():
    assert unsupported(64, torch.float32) is None
    assert unsupported(64, torch.bfloat16) is None
    assert "float16" in unsupported(64, torch.float16)
    assert "head size 24" in unsupported(24, torch.float32)
    assert all(unsupported(d, torch.float32) is None for d in HEAD_SIZES)


def tiny_model(seed=3, **changes):
    cfg = dataclasses.replace(PRESETS["tiny"], max_seq_len=512, **changes)
    return build_model(cfg, seed=seed).eval()


@pytest.mark.parametrize("limit", [kv_pool.KERNEL_CHUNK_CONTEXT, 50], ids=["chunks-as-rows", "long-chunks-gathered"])
def test_engine_with_the_kernel_generates_what_gathering_does(limit, monkeypatch):
    """Decodes, and prompt chunks' tokens as rows of their own, through the kernel against both gathered for SDPA:
    the same greedy tokens, and logprobs of the outputs and of every prompt token to float rounding (1e-5), over
    a batch whose sequences grow past several blocks, with prompt chunks mixed in (max_num_batched_tokens below
    the prompts' total) and one sequence alone. With the rows' context limit at 50 tokens, the 64- and 120-token
    prompts' chunks gather in the same steps as the others' rows."""
    monkeypatch.setattr(kv_pool, "KERNEL_CHUNK_CONTEXT", limit)
    prompts = [[(7 * i + 3 * j) % 250 + 1 for j in range(n)] for i, n in enumerate([5, 40, 17, 120, 64, 3])]
    params = SamplingParams(max_tokens=70, temperature=0, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    runs = {}
    for choice in ("true", "false"):
        llm = LLM(tiny_model(), seed=0, cpu_kernel=choice, max_num_batched_tokens=96, block_size=16)
        assert ("C++ paged kernel" in llm.engine.path) == (choice == "true")
        runs[choice] = (llm.generate(prompts, params), llm.generate(prompts[3:4], params))
    for ours, theirs in zip(*(batch + alone for batch, alone in runs.values())):
        assert ours.token_ids == theirs.token_ids
        for a, b in zip(ours.logprobs, theirs.logprobs, strict=True):
            assert a["token_id"] == b["token_id"] and abs(a["logprob"] - b["logprob"]) < 1e-5  # measured 4.8e-7
            assert [t for t, _ in a["top"]] == [t for t, _ in b["top"]]
        assert ours.prompt_logprobs[0] is None and theirs.prompt_logprobs[0] is None
        for a, b in zip(ours.prompt_logprobs[1:], theirs.prompt_logprobs[1:], strict=True):
            assert a["token_id"] == b["token_id"] and abs(a["logprob"] - b["logprob"]) < 1e-5


def test_a_bfloat16_engine_with_the_kernel_generates_what_gathering_does():
    """serve.dtype=bfloat16 (the model and the pool), chunks mixed in: decodes through the kernel give gathering's
    greedy tokens and logprobs within bfloat16's rounding until the two part, and they part only at a near tie,
    where the kernel's second choice is gathering's token within that rounding (the kernel sums in float32 and
    rounds once; SDPA's bfloat16 attention rounds along the way: a random model's flat logits tie often)."""
    prompts = [[(7 * i + 3 * j) % 250 + 1 for j in range(n)] for i, n in enumerate([5, 40, 17, 120])]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=2)
    runs = {}
    for choice in ("true", "false"):
        llm = LLM(tiny_model().to(torch.bfloat16), seed=0, cpu_kernel=choice, max_num_batched_tokens=96)
        assert ("C++ paged kernel" in llm.engine.path) == (choice == "true")
        form = "bfloat16 pairs" if cpu_paged_decode.pairs() else "bfloat16 widened"
        assert (form in llm.engine.path) == (choice == "true")
        runs[choice] = llm.generate(prompts, params)
    agreed = 0
    for ours, theirs in zip(runs["true"], runs["false"]):
        for a, b in zip(ours.logprobs, theirs.logprobs):
            if a["token_id"] != b["token_id"]:
                top = dict(a["top"])
                assert b["token_id"] in top and a["logprob"] - top[b["token_id"]] < 0.05, (a, b)
                break
            assert abs(a["logprob"] - b["logprob"]) < 0.05
            agreed += 1
    assert agreed >= 80  # of 160 tokens: most of each run before a tie, if any


def test_engine_rejects_the_kernel_where_it_cannot_run():
    with pytest.raises(ConfigError, match=r"serve.cpu_kernel=true cannot be used here: head size 24 is not one of"):
        LLM(tiny_model(hidden_size=96), seed=0, cpu_kernel="true")
    llm = LLM(tiny_model(hidden_size=96), seed=0)  # auto: gathers, and says so in its path
    assert "C++" not in llm.engine.path and not llm.engine.cpu_kernel


def test_an_engine_that_cannot_build_the_kernel_gathers_and_says_why(monkeypatch, capsys):
    monkeypatch.setattr(cpu_paged_decode, "_build", lambda: (None, "building it failed: no C++ compiler"))
    llm = LLM(tiny_model(), seed=0)  # auto: falls back, with a notice on stderr
    assert not llm.engine.cpu_kernel and "block gather + SDPA" in llm.engine.path
    assert "no C++ compiler" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="serve.cpu_kernel=true cannot be used here: building it failed: no C"):
        LLM(tiny_model(), seed=0, cpu_kernel="true")
