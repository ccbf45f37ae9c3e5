"""The scheduler's view of the paged KV cache: a block pool with reference counts and prefix caching.

Blocks 1..num_blocks-1 are handed out; block 0 is the null block (see `asyncexec.worker.attention`).

Prefix caching: once a block is full, it is named by a hash chained over every token up to its end
(`hash((parent_hash, tokens of this block))`), so equal hashes mean equal prefixes. A new request first
looks up the hashes of its full prompt blocks, in order, and shares every block found (reference count
+1) instead of computing it. A block whose count drops to 0 goes to the tail of the free queue but keeps
its hash, so it can still be hit; allocation takes from the head (least recently freed) and evicts the
hash of what it takes. Requests free their blocks in reverse, so a prefix's tail is evicted before its
head.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["BlockPool", "KVCacheManager", "PrefixCacheStats"]


@dataclass
class _Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens found cached

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks, got {num_blocks}")
        self.blocks = [_Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, _Block] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self.cached: dict[int, _Block] = {}

    @property
    def num_usable(self) -> int:
        return len(self.blocks) - 1

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, n: int) -> list[_Block] | None:
        if n > len(self.free):
            return None
        out = []
        for _ in range(n):
            _, block = self.free.popitem(last=False)
            if block.block_hash is not None:
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, block: _Block) -> None:
        """Share a cached block with one more request."""
        if block.ref_cnt == 0:
            del self.free[block.block_id]
        block.ref_cnt += 1

    def release(self, blocks: Sequence[_Block]) -> None:
        for block in reversed(blocks):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free[block.block_id] = block


@dataclass
class _ReqBlocks:
    blocks: list[_Block] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # of this request's full blocks, in order
    num_cached: int = 0  # full blocks already registered in the prefix cache


class KVCacheManager:
    """Blocks per request: prefix lookup, slot allocation, caching of full blocks, freeing."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.stats = PrefixCacheStats()
        self.reqs: dict[str, _ReqBlocks] = {}

    def block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self.reqs[req_id].blocks] if req_id in self.reqs else []

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_usable

    def _hashes(self, state: _ReqBlocks, tokens: Sequence[int]) -> list[int]:
        bs = self.block_size
        for i in range(len(state.hashes), len(tokens) // bs):
            parent = state.hashes[-1] if state.hashes else None
            state.hashes.append(hash((parent, tuple(tokens[i * bs : (i + 1) * bs]))))
        return state.hashes

    def get_computed_blocks(self, req_id: str, tokens: Sequence[int]) -> int:
        """Share the cached blocks of `tokens`' longest cached prefix; returns how many tokens that covers.

        At least one token is always left to compute, so the step produces logits.
        """
        state = self.reqs.setdefault(req_id, _ReqBlocks())
        assert not state.blocks, "prefix lookup happens before a request holds blocks"
        if not self.enable_prefix_caching:
            return 0
        hits = []
        for h in self._hashes(state, tokens)[: (len(tokens) - 1) // self.block_size]:
            block = self.pool.cached.get(h)
            if block is None:
                break
            hits.append(block)
        for block in hits:
            self.pool.touch(block)
        state.blocks = hits
        state.num_cached = len(hits)
        self.stats.queries += len(tokens)
        self.stats.hits += len(hits) * self.block_size
        return len(hits) * self.block_size

    def allocate_slots(self, req_id: str, num_tokens_after: int) -> list[int] | None:
        """Grow `req_id` to hold `num_tokens_after` tokens; the new block ids, or None if they don't fit."""
        state = self.reqs.setdefault(req_id, _ReqBlocks())
        need = -(-num_tokens_after // self.block_size) - len(state.blocks)
        if need <= 0:
            return []
        new = self.pool.allocate(need)
        if new is None:
            return None
        state.blocks += new
        return [b.block_id for b in new]

    def has_uncached_full_blocks(self, req_id: str, num_computed: int) -> bool:
        """Whether `cache_full_blocks` has anything to do: lets callers skip building the token list."""
        state = self.reqs.get(req_id)
        return (
            self.enable_prefix_caching
            and state is not None
            and num_computed // self.block_size > state.num_cached
        )

    def cache_full_blocks(self, req_id: str, tokens: Sequence[int], num_computed: int) -> None:
        """Register the request's blocks that are full and computed, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        state = self.reqs[req_id]
        full = min(num_computed, len(tokens)) // self.block_size
        hashes = self._hashes(state, tokens[: full * self.block_size])
        for i in range(state.num_cached, full):
            block = state.blocks[i]
            if block.block_hash is None and hashes[i] not in self.pool.cached:
                block.block_hash = hashes[i]
                self.pool.cached[hashes[i]] = block
        state.num_cached = max(state.num_cached, full)

    def free(self, req_id: str) -> None:
        state = self.reqs.pop(req_id, None)
        if state is not None:
            self.pool.release(state.blocks)
