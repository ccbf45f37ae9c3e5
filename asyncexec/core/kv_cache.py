"""The scheduler's view of the paged KV cache: a block pool with reference counts and prefix caching.

Blocks 1..num_blocks-1 are handed out; block 0 is the null block (see `asyncexec.worker.attention`).

Prefix caching: once a block is full, it is named by a hash chained over every token up to its end:
`hash_block_tokens(parent_hash, tokens of this block)`, SHA-256 over the parent's digest and the token
ids as little-endian int64. Python's `hash()` is not used: a tuple hash can be collided on purpose,
which would let one request read another's KV (vLLM's CVE-2025-25183). A new request first looks up the
hashes of its full prompt blocks, in order, and shares every block found (reference count +1) instead of
computing it. A hit also needs the cached block to have been made from the same parent hash and the
same token ids (both kept with it), so a colliding digest alone is never a hit: a false hit would take
two different prefixes whose SHA-256 chains meet. A block whose count drops to 0 goes to the tail of the
free queue but keeps its hash, so it can still be hit; allocation takes from the head (least recently
freed) and evicts the hash of what it takes. Requests free their blocks in reverse, so a prefix's tail is
evicted before its head.

Forking (parallel sampling, `n > 1`): once a request's prompt is computed, `fork` shares its full
prompt blocks with each copy by reference count, whether or not prefix caching is on, so the prompt is
prefilled once; each copy computes only the rest of its last, partial block, into a block of its own.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

__all__ = [
    "BlockHash",
    "BlockPool",
    "HashFn",
    "KVCacheManager",
    "PrefixCacheStats",
    "hash_block_tokens",
    "tokens_held",
]

BlockHash = bytes
HashFn = Callable[[BlockHash | None, Sequence[int]], BlockHash]


def tokens_held(num_blocks: int, block_size: int) -> int:
    """The computed tokens a cache of `num_blocks` holds: all but block 0, the null block."""
    return (num_blocks - 1) * block_size


def hash_block_tokens(parent: BlockHash | None, tokens: Sequence[int]) -> BlockHash:
    """SHA-256 of the parent block's hash (empty for the first block) and this block's token ids."""
    packed = array("q", tokens)
    if sys.byteorder != "little":
        packed.byteswap()
    return hashlib.sha256((parent or b"") + packed.tobytes()).digest()


@dataclass
class _Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    # What the hash was made from, checked on every hit: a hash collision must not be a cache hit.
    parent_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = ()


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
        self.cached: dict[BlockHash, _Block] = {}

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
                block.block_hash, block.parent_hash, block.token_ids = None, None, ()
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
    hashes: list[BlockHash] = field(default_factory=list)  # of this request's full blocks, in order
    num_cached: int = 0  # full blocks already registered in the prefix cache


class KVCacheManager:
    """Blocks per request: prefix lookup, slot allocation, caching of full blocks, freeing."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        hash_fn: HashFn = hash_block_tokens,
    ) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self.stats = PrefixCacheStats()
        self.reqs: dict[str, _ReqBlocks] = {}
        # Requests that must compute every prompt position (prompt logprobs): never served from cache.
        self.no_prefix_lookup: set[str] = set()

    def block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self.reqs[req_id].blocks] if req_id in self.reqs else []

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_usable

    def _hashes(self, state: _ReqBlocks, tokens: Sequence[int]) -> list[BlockHash]:
        bs = self.block_size
        for i in range(len(state.hashes), len(tokens) // bs):
            parent = state.hashes[-1] if state.hashes else None
            state.hashes.append(self.hash_fn(parent, tokens[i * bs : (i + 1) * bs]))
        return state.hashes

    def get_computed_blocks(self, req_id: str, tokens: Sequence[int]) -> int:
        """Share the cached blocks of `tokens`' longest cached prefix; returns how many tokens that covers.

        At least one token is always left to compute, so the step produces logits.
        """
        state = self.reqs.setdefault(req_id, _ReqBlocks())
        assert not state.blocks, "prefix lookup happens before a request holds blocks"
        if not self.enable_prefix_caching or req_id in self.no_prefix_lookup:
            return 0
        hits: list[_Block] = []
        bs = self.block_size
        for i, h in enumerate(self._hashes(state, tokens)[: (len(tokens) - 1) // bs]):
            block = self.pool.cached.get(h)
            parent = state.hashes[i - 1] if i else None
            if block is None or not _made_from(block, parent, tokens[i * bs : (i + 1) * bs]):
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
                block.parent_hash = hashes[i - 1] if i else None
                block.token_ids = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
                self.pool.cached[hashes[i]] = block
        state.num_cached = max(state.num_cached, full)

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> int:
        """Share the parent's blocks that hold its first `num_tokens` tokens (whole blocks only) with
        `child_id` (reference count +1 each), so the child need not compute them; returns how many
        tokens they hold. The child writes only past them, into blocks of its own: no copy-on-write."""
        src = self.reqs.get(parent_id)
        assert child_id not in self.reqs, "a request is forked into before it holds blocks"
        if src is None:
            return 0
        n = min(num_tokens // self.block_size, len(src.blocks))
        shared = src.blocks[:n]
        for block in shared:
            self.pool.touch(block)
        self.reqs[child_id] = _ReqBlocks(list(shared), src.hashes[:n], min(src.num_cached, n))
        return n * self.block_size

    def free(self, req_id: str) -> None:
        state = self.reqs.pop(req_id, None)
        if state is not None:
            self.pool.release(state.blocks)


def _made_from(block: _Block, parent: BlockHash | None, tokens: Sequence[int]) -> bool:
    """Whether a cached block holds exactly `tokens` after the prefix named `parent`: a hit must not rest
    on the hash alone."""
    return block.parent_hash == parent and block.token_ids == tuple(tokens)
