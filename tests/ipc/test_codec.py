"""Codec round trips, copy-at-send, and rejection of forged or garbage input."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import torch

from asyncexec.errors import ProtocolError
from asyncexec.ipc.codec import DTYPES, EXT_INLINE, EXT_SHM, Decoder, Encoder, InlineTensor, TensorRef
from asyncexec.ipc.shm import ShmArena, ShmReader
from asyncexec.messages import CachedRequestData, NewRequestData, SchedulerOutput
from asyncexec.sampling_params import SamplingParams


class Pair:
    def __init__(self, arena_bytes: int, inline: int) -> None:
        self.arena = ShmArena(arena_bytes)
        self.encoder = Encoder(self.arena, inline)
        reader = ShmReader(receiver_index=0)
        reader.allow(self.arena.name)
        self.decoder = Decoder(reader)

    def roundtrip(self, value: Any, type_: Any = Any) -> Any:
        return self.decoder.decode(self.encoder.encode(value), type_)


@pytest.fixture(params=["inline", "shm"])
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    p = Pair(1 << 20, 1 << 30 if request.param == "inline" else 0)
    yield p
    gc.collect()
    p.arena.close()


def _sample(dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.tensor([[True, False, True], [False, False, True]])
    if dtype.is_complex:
        return torch.randn(2, 3, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(2, 3).to(dtype)
    return torch.arange(6, dtype=torch.int64).reshape(2, 3).to(dtype)


@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
def test_every_dtype_round_trips(pair: Pair, dtype_name: str) -> None:
    t = _sample(DTYPES[dtype_name])
    out = pair.roundtrip(t)
    assert out.dtype == t.dtype and out.shape == t.shape
    assert torch.equal(out.view(torch.uint8), t.view(torch.uint8))


def test_non_contiguous_empty_and_zero_dim(pair: Pair) -> None:
    base = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    cases = [
        base.t(),
        base[::2, 1::3],
        torch.empty(0, 5),
        torch.tensor(3.5),
        torch.tensor(7, dtype=torch.int8),
    ]
    for t in cases:
        out = pair.roundtrip(t)
        assert out.shape == t.shape and out.dtype == t.dtype
        assert torch.equal(out, t)
        assert out.is_contiguous()


def test_tensors_nested_in_lists_and_dicts(pair: Pair) -> None:
    ones = torch.ones(3, dtype=torch.bfloat16)
    msg = {"a": [ones, {"b": torch.zeros(2, 2)}], "n": 3, "s": "x"}
    out = pair.roundtrip(msg)
    assert out["n"] == 3 and out["s"] == "x"
    assert torch.equal(out["a"][0], ones) and out["a"][0].dtype == torch.bfloat16
    assert torch.equal(out["a"][1]["b"], torch.zeros(2, 2))


def test_typed_struct_round_trip(pair: Pair) -> None:
    so = SchedulerOutput(
        step_id=4,
        scheduled_new_reqs=[NewRequestData("r0", [1, 2, 3], SamplingParams(temperature=0.0), [0], 0)],
        scheduled_cached_reqs=CachedRequestData(["r1"], [False], [[]], [[7]], [12]),
        num_scheduled_tokens={"r0": 3, "r1": 1},
        total_num_scheduled_tokens=4,
    )
    assert pair.roundtrip(so, SchedulerOutput) == so


def test_threshold_picks_inline_or_shm() -> None:
    p = Pair(1 << 20, 64)
    small, large = torch.ones(16), torch.ones(17)  # 64 bytes inline, 68 bytes through shm
    inline_frame, shm_frame = p.encoder.encode(small), p.encoder.encode(large)
    assert msgspec.msgpack.decode(inline_frame).code == EXT_INLINE
    assert msgspec.msgpack.decode(shm_frame).code == EXT_SHM
    assert p.arena.num_live_regions == 1
    del shm_frame
    p.arena.close()


def test_mutation_after_send_does_not_change_what_was_received() -> None:
    p = Pair(1 << 20, 0)
    t = torch.arange(1000, dtype=torch.float32)
    frame = p.encoder.encode(t)
    t.fill_(-1)
    assert torch.equal(p.decoder.decode(frame), torch.arange(1000, dtype=torch.float32))
    p.arena.close()


def test_receiver_view_is_zero_copy_and_releases_its_region() -> None:
    p = Pair(1 << 20, 0)
    out = p.roundtrip(torch.ones(1000))
    derived = out[10:20]
    del out
    assert p.arena.reclaim() == 0, "a live view must keep its region"
    del derived
    gc.collect()
    assert p.arena.reclaim() == 1
    p.arena.close()


def _ext(code: int, payload: Any) -> bytes:
    return msgspec.msgpack.encode(msgspec.msgpack.Ext(code, msgspec.msgpack.encode(payload)))


def test_forged_handles_and_garbage_are_rejected() -> None:
    p = Pair(1 << 20, 0)
    name = p.arena.name
    forged = {
        "out of bounds": TensorRef(name, 1 << 30, 16, "float32", [4], 0),
        "straddles the end": TensorRef(name, (1 << 20) - 8, 16, "float32", [4], 0),
        "negative offset": TensorRef(name, -64, 16, "float32", [4], 0),
        "flags inside payload": TensorRef(name, 64, 16, "float32", [4], 64),
        "foreign segment": TensorRef("asyncexec-1-deadbeef", 64, 16, "float32", [4], 0),
        "not a segment name": TensorRef("../../etc/passwd", 64, 16, "float32", [4], 0),
        "nbytes mismatch": TensorRef(name, 64, 8, "float32", [4], 0),
        "unknown dtype": TensorRef(name, 64, 16, "object", [4], 0),
        "negative dim": TensorRef(name, 64, 16, "float32", [-4], 0),
    }
    for ref in forged.values():
        with pytest.raises(ProtocolError):
            p.decoder.decode(_ext(EXT_SHM, ref))
    with pytest.raises(ProtocolError, match="carries"):
        p.decoder.decode(_ext(EXT_INLINE, InlineTensor("float32", [4], memoryview(b"123"))))
    with pytest.raises(ProtocolError, match="extension code"):
        p.decoder.decode(_ext(99, b""))
    for garbage in (b"\xc1", b"\x93\x01", b"", bytes(range(256))):
        with pytest.raises(ProtocolError):
            p.decoder.decode(garbage, SchedulerOutput)
    p.arena.close()


def test_unsendable_objects_raise_type_error() -> None:
    p = Pair(1 << 20, 0)
    with pytest.raises(TypeError, match="cannot be sent"):
        p.encoder.encode({"x": object()})
    p.arena.close()
