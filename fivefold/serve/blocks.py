"""The KV block manager: which pool blocks each sequence owns, which prefixes are shared, what is reused.

Blocks are reference counted. A block filled completely gets a chain hash (its parent block's hash
and its own tokens), so a later sequence starting with the same tokens takes the same blocks instead
of recomputing them (PagedAttention's prefix sharing, Kwon et al. 2023). A block whose last sequence
finishes keeps its hash and its keys and values until the block is needed again; free blocks are
reused least recently used first, so popular prefixes stay cached longest.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from array import array


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def chain_hash(parent: bytes, tokens) -> bytes:
    """Identity of a full block: its tokens and everything before them (through the parent's hash).
    SHA-256, not Python's hash(): a collision would silently serve another prompt's keys and values."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_cache: bool = True):
        self.num_blocks, self.block_size, self.prefix_cache = num_blocks, block_size, prefix_cache
        self.ref = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        # Free blocks in eviction order: the first is reused first (never-useful blocks, then least recent).
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.queried_tokens = 0  # prompt tokens looked up in the prefix cache
        self.hit_tokens = 0  # of which found

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def match_prefix(self, tokens: list[int], salt: bytes = b"") -> list[int]:
        """Cached blocks holding the longest full-block prefix of `tokens`, leaving at least the last
        token to compute (its logits are what the next token is sampled from). `salt` roots the chain (a
        LoRA adapter's name: the same tokens have other keys and values under another adapter)."""
        if not self.prefix_cache:
            return []
        found, parent, bs = [], salt, self.block_size
        for i in range((len(tokens) - 1) // bs):
            parent = chain_hash(parent, tokens[i * bs:(i + 1) * bs])
            block = self.cached.get(parent)
            if block is None:
                break
            found.append(block)
        return found

    def start(self, seq, token_budget: int, reserve: int = 0) -> int:
        """Give a sequence with no blocks its cached prefix and room for its next chunk, leaving `reserve`
        blocks free; returns the tokens scheduled (0: it does not fit now, nothing changed)."""
        hits = [] if seq.scoring else self.match_prefix(seq.token_ids, seq.cache_salt)
        computed = len(hits) * self.block_size
        n = min(len(seq.token_ids) - computed, token_budget)
        fresh = blocks_for(computed + n, self.block_size) - len(hits)
        revived = sum(1 for b in hits if self.ref[b] == 0)  # cached but free: leaving the free list
        if fresh + revived + reserve > self.num_free:
            return 0
        for b in hits:
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1
        seq.block_table = hits + [self._take() for _ in range(fresh)]
        seq.block_hashes = [self.hash_of[b] for b in hits]
        seq.num_computed = seq.num_cached = computed
        if not seq.scoring:  # a prompt being scored does not look
            self.queried_tokens += len(seq.token_ids)
            self.hit_tokens += computed
        return n

    def grow(self, seq, n: int) -> bool:
        """Room for `n` more tokens of a sequence that has blocks; False (nothing taken) if the pool is short."""
        need = blocks_for(seq.num_computed + n, self.block_size) - len(seq.block_table)
        if need > self.num_free:
            return False
        seq.block_table.extend(self._take() for _ in range(need))
        return True

    def register(self, seq) -> None:
        """Publish the sequence's newly completed blocks to the prefix cache (prompt and output alike)."""
        bs = self.block_size
        while (len(seq.block_hashes) + 1) * bs <= seq.num_computed:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if i else seq.cache_salt
            h = chain_hash(parent, seq.token_ids[i * bs:(i + 1) * bs])
            seq.block_hashes.append(h)
            block = seq.block_table[i]
            if self.prefix_cache and h not in self.cached:  # else the same tokens already have a block
                self.cached[h] = block
                self.hash_of[block] = h

    def release(self, seq) -> None:
        """Drop the sequence's references. Its tail blocks are freed first, so they are reused before its
        head: a prefix outlives the text that followed it."""
        for b in reversed(seq.block_table):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None
                if self.hash_of[b] is None:
                    self.free.move_to_end(b, last=False)
        seq.block_table, seq.block_hashes = [], []
        seq.num_computed = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (their keys and values no longer match the weights)."""
        self.cached.clear()
        self.hash_of = [None] * self.num_blocks

    def _take(self) -> int:
        block, _ = self.free.popitem(last=False)
        h = self.hash_of[block]
        if h is not None:  # evicting a cached block: its prefix is gone
            del self.cached[h]
            self.hash_of[block] = None
        self.ref[block] = 1
        return block
