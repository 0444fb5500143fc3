"""The KV block manager on its own: a block's identity is its tokens and everything before them."""

from types import SimpleNamespace

from fivefold.serve.blocks import BlockManager

BS = 4
A, B, C = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]  # three different first blocks
S, X = [20, 21, 22, 23], [30, 31, 32, 33]  # second blocks
TAIL = [40]  # the last token is always computed, so the two blocks before it can be cached


def seq(tokens, salt=b""):
    return SimpleNamespace(token_ids=list(tokens), cache_salt=salt, block_table=[], block_hashes=[],
                           num_computed=0, num_cached=0, scoring=False)


def prefill(blocks: BlockManager, s) -> None:
    """What the engine does with a prompt: its blocks, the forward over what is not cached, publication."""
    n = blocks.start(s, token_budget=1000)
    assert n == len(s.token_ids) - s.num_cached
    s.num_computed += n
    blocks.register(s)


def test_a_block_after_another_first_block_is_not_shared():
    """Two prompts whose second blocks are token-identical after different first blocks share no block:
    the second block's keys and values depend on the first block's tokens."""
    blocks = BlockManager(num_blocks=16, block_size=BS)
    first = seq(A + S + TAIL)
    prefill(blocks, first)
    assert first.num_cached == 0 and len(first.block_hashes) == 2
    assert blocks.match_prefix(A + S + TAIL) == first.block_table[:2]  # the same prompt: both blocks

    second = seq(C + S + TAIL)  # S again, after C
    assert blocks.match_prefix(second.token_ids) == []
    prefill(blocks, second)
    assert second.num_cached == 0
    assert not set(first.block_table) & set(second.block_table)
    assert second.block_hashes[1] != first.block_hashes[1]
    # Each second block is published under its own chain hash: both stay findable.
    assert blocks.cached[first.block_hashes[1]] == first.block_table[1]
    assert blocks.cached[second.block_hashes[1]] == second.block_table[1]


def test_a_cached_first_block_does_not_lead_to_another_prompts_second():
    """B followed by X is cached, and S is cached after A: a prompt B + S reuses B's block only. Were a
    block's hash its tokens alone, it would also take A + S's second block, whose keys and values were
    computed after A."""
    blocks = BlockManager(num_blocks=16, block_size=BS)
    a_s, b_x = seq(A + S + TAIL), seq(B + X + TAIL)
    tables = []
    for s in (a_s, b_x):
        prefill(blocks, s)
        tables.append(s.block_table[:2])
        blocks.release(s)  # finished: its full blocks stay cached
    assert blocks.num_used == 0
    a_s_blocks, b_x_blocks = tables
    assert blocks.match_prefix(A + S + TAIL) == a_s_blocks and blocks.match_prefix(B + X + TAIL) == b_x_blocks

    b_s = seq(B + S + TAIL)
    assert blocks.match_prefix(b_s.token_ids) == b_x_blocks[:1]
    prefill(blocks, b_s)
    assert b_s.num_cached == BS and b_s.block_table[0] == b_x_blocks[0]
    assert b_s.block_table[1] not in a_s_blocks
    assert blocks.hit_tokens == BS
    # Under another salt (a LoRA adapter) nothing is shared, not even the first block.
    assert blocks.match_prefix(A + S + TAIL, salt=b"adapter") == []


def test_a_fully_cached_block_aligned_prompt_still_computes_its_last_block():
    """A prompt of exactly two blocks, both cached, takes only the first from the cache and computes the
    second: the last token's logits are what the first output token is drawn from, so at least one token
    must be scheduled. Taking both blocks would leave nothing to compute: start() would return 0, which
    the scheduler reads as "does not fit", and the request would wait forever."""
    blocks = BlockManager(num_blocks=16, block_size=BS)
    longer = seq(A + B + TAIL)  # publishes A and A + B
    prefill(blocks, longer)
    head, second, tail = longer.block_table
    blocks.release(longer)
    assert blocks.match_prefix(A + B + TAIL) == [head, second]

    aligned = seq(A + B)
    assert blocks.match_prefix(aligned.token_ids) == [head]
    assert blocks.start(aligned, token_budget=1000) == BS
    assert aligned.num_cached == aligned.num_computed == BS
    # B is computed again into a fresh block: the tail block, the first free one (it held no prefix).
    assert aligned.block_table == [head, tail]
    assert blocks.hit_tokens == BS and blocks.queried_tokens == len(A + B + TAIL) + len(A + B)


def test_a_block_holding_no_prefix_is_reused_before_any_cached_block():
    """A freed block that holds no cached prefix (here a one-token sequence's partial block) goes to the
    front of the free list even when it is freed after cached blocks: reusing it costs nothing, while
    reusing a cached block throws away keys and values a later prompt could have shared."""
    blocks = BlockManager(num_blocks=4, block_size=BS)
    cached = seq(A + B)  # two full blocks, both published
    prefill(blocks, cached)
    head, second = cached.block_table
    partial = seq(TAIL)
    prefill(blocks, partial)
    (scratch,) = partial.block_table
    (never_used,) = blocks.free
    blocks.release(cached)
    blocks.release(partial)  # freed last, yet first in line
    assert list(blocks.free) == [scratch, never_used, second, head]

    other = seq(C + TAIL)  # two fresh blocks: the two that hold nothing
    prefill(blocks, other)
    assert other.block_table == [scratch, never_used]
    assert blocks.match_prefix(A + B + TAIL) == [head, second]


def test_a_released_sequence_frees_its_tail_before_its_head():
    """A finished sequence's blocks are freed last block first, so its later blocks are reused first and
    its first block, the prefix other prompts are likeliest to share (a system prompt), stays cached
    longest. Freed head first, taking a single block would evict the head and with it the whole chain."""
    blocks = BlockManager(num_blocks=3, block_size=BS)
    done = seq(A + B + C)
    prefill(blocks, done)
    head, second, third = done.block_table
    assert len(done.block_hashes) == 3  # all three full blocks are published
    blocks.release(done)
    assert list(blocks.free) == [third, second, head]

    other = seq(X + TAIL)  # two fresh blocks: evicts A + B + C, then A + B
    prefill(blocks, other)
    assert other.block_table == [third, second]
    assert blocks.match_prefix(A + B + C + TAIL) == [head]
    assert list(blocks.cached.values()) == [head, other.block_table[0]]


def test_a_block_computed_twice_at_once_stays_cached_under_the_first():
    """Two identical prompts admitted before either is computed both compute their blocks; the cache keeps
    the first sequence's blocks and the second's stay unpublished (no hash), to be reused like any block
    without a prefix. Publishing the twin's too would repoint the cache at the twin's blocks while the
    first's still carry the same hashes: the entry would be deleted once per copy on eviction, the
    second time a KeyError in the middle of admitting a request."""
    blocks = BlockManager(num_blocks=6, block_size=BS)
    first, twin = seq(A + S + TAIL), seq(A + S + TAIL)
    assert blocks.start(first, token_budget=1000) == 9
    assert blocks.start(twin, token_budget=1000) == 9  # nothing is published yet: no hit
    for s in (first, twin):
        s.num_computed = 9
        blocks.register(s)
    assert twin.block_hashes == first.block_hashes
    assert blocks.cached == {first.block_hashes[0]: first.block_table[0], first.block_hashes[1]: first.block_table[1]}
    assert [blocks.hash_of[b] for b in twin.block_table] == [None, None, None]
    assert blocks.match_prefix(A + S + TAIL) == first.block_table[:2]

    ones, twins = first.block_table, twin.block_table
    blocks.release(first)
    blocks.release(twin)
    # The twin's blocks hold no prefix: they go first, ahead of the first's tail, then its prefix.
    assert list(blocks.free) == twins + [ones[2], ones[1], ones[0]]
    everything = seq(range(100, 100 + 6 * BS))  # needs every block of the pool: evicts both cached ones
    assert blocks.start(everything, token_budget=1000) == 6 * BS
    assert blocks.num_free == 0
    assert blocks.cached == {}
    assert blocks.hash_of == [None] * 6
