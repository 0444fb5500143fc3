"""The KV block manager on its own: a block's identity is its tokens and everything before them."""

from types import SimpleNamespace

from fivefold.serve.blocks import BlockManager

BS = 4
A, B, C = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]  # three different first blocks
S, X = [20, 21, 22, 23], [30, 31, 32, 33]  # second blocks
TAIL = [40]  # the last token is always computed, so the two blocks before it can be cached


def seq(tokens, salt=b""):
    return SimpleNamespace(token_ids=list(tokens), cache_salt=salt, block_table=[], block_hashes=[],
                           num_computed=0, num_cached=0)


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
