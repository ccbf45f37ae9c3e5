"""The block pool and prefix cache: reference counts, sharing, LRU eviction, the null block."""

from __future__ import annotations

import hashlib
from array import array

import pytest

from asyncexec.core.kv_cache import KVCacheManager, hash_block_tokens

BS = 4


def test_blocks_are_allocated_grown_and_freed_and_block_0_is_never_used() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BS, enable_prefix_caching=False)
    assert kv.allocate_slots("a", 5) is not None and len(kv.block_ids("a")) == 2
    assert kv.allocate_slots("a", 8) == []  # still fits in two blocks
    assert len(kv.allocate_slots("a", 9) or []) == 1
    assert 0 not in kv.block_ids("a")
    assert kv.allocate_slots("b", 9) is None, "2 blocks are left, 3 are needed"
    kv.free("a")
    assert kv.pool.num_free == kv.pool.num_usable == 5


def test_a_shared_prefix_is_hit_and_reference_counted() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    prefix = list(range(8))
    a = [*prefix, 100, 101]
    assert kv.get_computed_blocks("a", a) == 0
    kv.allocate_slots("a", len(a))
    kv.cache_full_blocks("a", a, num_computed=len(a))
    b = [*prefix, 200]
    assert kv.get_computed_blocks("b", b) == 8
    assert kv.block_ids("b") == kv.block_ids("a")[:2]
    kv.allocate_slots("b", len(b))
    kv.free("a")
    shared = kv.block_ids("b")[:2]
    assert all(kv.pool.blocks[i].ref_cnt == 1 for i in shared), "b still holds the shared blocks"
    kv.free("b")
    assert kv.pool.num_free == kv.pool.num_usable
    assert kv.get_computed_blocks("c", [*prefix, 7]) == 8, "freed blocks stay hittable until evicted"
    assert kv.stats.hits == 16 and kv.stats.queries == len(a) + len(b) + 9


def test_a_fully_cached_prompt_still_leaves_one_token_to_compute() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    p = list(range(8))
    kv.get_computed_blocks("a", p)
    kv.allocate_slots("a", 8)
    kv.cache_full_blocks("a", p, 8)
    kv.free("a")
    assert kv.get_computed_blocks("b", p) == 4


def test_eviction_takes_the_least_recently_freed_block() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=BS, enable_prefix_caching=True)  # 4 usable
    old, new = [1, 2, 3, 4, 9], [5, 6, 7, 8, 9]
    for rid, toks in (("old", old), ("new", new)):
        kv.get_computed_blocks(rid, toks)
        kv.allocate_slots(rid, len(toks))
        kv.cache_full_blocks(rid, toks, len(toks))
        kv.free(rid)
    kv.allocate_slots("filler", 2 * BS)  # takes the two least recently freed blocks: both of "old"
    assert kv.get_computed_blocks("x", old) == 0
    assert kv.get_computed_blocks("y", new) == 4


def test_a_pool_needs_two_blocks() -> None:
    with pytest.raises(ValueError, match="at least 2 blocks"):
        KVCacheManager(num_blocks=1, block_size=BS, enable_prefix_caching=True)


def _cache(kv: KVCacheManager, rid: str, tokens: list[int]) -> int:
    """Run `tokens` through the cache as one request (lookup, allocate, register, free); its hits."""
    hit = kv.get_computed_blocks(rid, tokens)
    kv.allocate_slots(rid, len(tokens))
    kv.cache_full_blocks(rid, tokens, len(tokens))
    kv.free(rid)
    return hit


def test_block_hashes_are_sha256_chained_over_the_parent_and_the_token_ids() -> None:
    first = hash_block_tokens(None, [1, 2, 3, 4])
    assert first == hashlib.sha256(array("q", [1, 2, 3, 4]).tobytes()).digest()
    assert (
        hash_block_tokens(first, [5, 6, 7, 8])
        == hashlib.sha256(first + array("q", [5, 6, 7, 8]).tobytes()).digest()
    )
    assert hash_block_tokens(first, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    assert hash_block_tokens(None, [2**40, 1]) != hash_block_tokens(None, [0, 1])  # no truncation
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    p = list(range(9))
    _cache(kv, "a", p)
    h0 = hash_block_tokens(None, p[:4])
    assert set(kv.pool.cached) == {h0, hash_block_tokens(h0, p[4:8])}


def test_a_hash_collision_is_never_a_cache_hit() -> None:
    """With a hash function that collides on everything, only a block of the same tokens at the same
    depth may be shared: a colliding digest alone never hands one request another's KV."""
    kv = KVCacheManager(16, BS, enable_prefix_caching=True, hash_fn=lambda parent, tokens: b"same")
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert _cache(kv, "a", a) == 0
    assert _cache(kv, "b", [9, 9, 9, 9, 5, 6, 7, 8, 9]) == 0, "other tokens, same digest: no hit"
    assert kv.get_computed_blocks("c", [1, 2, 3, 4, 1, 2, 3, 4, 0]) == 4, (
        "block 1 names the same digest and holds the tokens of a's block 0, but at another depth"
    )
    kv.free("c")
    assert kv.get_computed_blocks("a2", a) == 4, "the same prompt still hits what it really shares"


def test_fork_shares_whole_blocks_by_reference_count_and_frees_them_last() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    kv.allocate_slots("p", 11)  # 3 blocks; the third holds tokens 8..10
    assert kv.fork("p", "c1", 10) == 8 and kv.fork("p", "c2", 10) == 8, "whole blocks only"
    shared = kv.block_ids("p")[:2]
    assert kv.block_ids("c1") == kv.block_ids("c2") == shared
    assert [kv.pool.blocks[b].ref_cnt for b in kv.block_ids("p")] == [3, 3, 1]
    new = kv.allocate_slots("c1", 11)
    assert new is not None and len(new) == 1 and new[0] not in kv.block_ids("p"), "its own last block"
    kv.free("p")
    kv.free("c2")
    assert [kv.pool.blocks[b].ref_cnt for b in shared] == [1, 1] and kv.pool.num_free == 15 - 3
    kv.free("c1")
    assert kv.pool.num_free == kv.pool.num_usable
