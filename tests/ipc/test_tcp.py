"""The TCP path for ranks on other machines: tensors as zmq frames, CURVE authentication."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import pytest
import torch
import zmq
import zmq.utils.monitor

from asyncexec import ConfigError, EngineConfig, Executor, WorkerFailedError
from asyncexec.errors import ProtocolError
from asyncexec.executor.multiproc import MultiProcExecutor
from asyncexec.ipc.codec import EXT_FRAME, EXT_SHM, Decoder, Encoder, FrameRef, TensorRef
from tests.conftest import asyncexec_segments
from tests.executor.conftest import EXT


def _roundtrip(value: Any) -> Any:
    frames = Encoder(None, 64).encode_frames(value)
    dec = Decoder(None)
    dec.frames = frames
    return dec.decode(frames[0])


def test_large_tensors_travel_as_frames_of_their_own() -> None:
    big, small = torch.randn(64, 64).t(), torch.arange(4)
    frames = Encoder(None, 64).encode_frames({"big": big, "small": small})
    assert len(frames) == 2 and memoryview(frames[1]).nbytes == big.numel() * 4
    out = _roundtrip({"big": big, "small": small, "bf": torch.ones(100, dtype=torch.bfloat16)})
    assert torch.equal(out["big"], big) and torch.equal(out["small"], small)
    assert out["bf"].dtype == torch.bfloat16 and torch.equal(out["bf"], torch.ones(100, dtype=torch.bfloat16))


def test_a_frame_is_a_private_copy_taken_at_send() -> None:
    t = torch.zeros(1000)
    frames = Encoder(None, 0).encode_frames(t)
    t.fill_(7)
    dec = Decoder(None)
    dec.frames = frames
    assert float(dec.decode(frames[0]).sum()) == 0.0


def test_forged_frame_refs_are_rejected() -> None:
    dec = Decoder(None)
    dec.frames = [b"", bytes(16)]
    for ref in (
        FrameRef(5, 16, "float32", [4]),
        FrameRef(0, 16, "float32", [4]),
        FrameRef(1, 8, "float32", [2, 2]),
    ):
        with pytest.raises(ProtocolError):
            dec.decode(msgspec.msgpack.encode(msgspec.msgpack.Ext(EXT_FRAME, msgspec.msgpack.encode(ref))))
    shm = TensorRef("asyncexec-1-deadbeef", 64, 16, "float32", [4], 0)
    with pytest.raises(ProtocolError, match="without shared memory"):
        dec.decode(msgspec.msgpack.encode(msgspec.msgpack.Ext(EXT_SHM, msgspec.msgpack.encode(shm))))


def test_distributed_host_must_be_an_own_address() -> None:
    for bad in ("*", "0.0.0.0", "::", "localhost"):
        with pytest.raises(ConfigError, match="distributed_host"):
            EngineConfig(distributed_host=bad)


async def test_executor_over_tcp_uses_no_shared_memory() -> None:
    cfg = EngineConfig(
        executor="mp", tensor_parallel_size=2, worker_extension=EXT, distributed_host="127.0.0.1"
    )
    before = asyncexec_segments()
    async with Executor.create(cfg) as ex:
        assert isinstance(ex, MultiProcExecutor) and ex._channel.reply_addr.startswith("tcp://127.0.0.1:")
        assert await ex.collective_rpc("whoami") == [0, 1]
        t = torch.randn(1 << 20)  # 4 MiB each way
        for out in await ex.collective_rpc("add", (t, 1.0)):
            assert torch.equal(out, t + 1.0)
        with pytest.raises(WorkerFailedError) as info:
            await ex.collective_rpc("fail_on", (1,))
        assert info.value.rank == 1
        assert asyncexec_segments() == before, "the TCP path must not touch /dev/shm"


def _handshake_fails(ctx: zmq.Context[Any], addr: str, keys: tuple[bytes, bytes, bytes] | None) -> bool:
    """Connect a PUSH (with CURVE `keys` = server, public, secret, or none) and watch its handshake."""
    sock = ctx.socket(zmq.PUSH)
    monitor = sock.get_monitor_socket()  # before connecting, so no event is missed
    try:
        if keys is not None:
            sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = keys
        sock.connect(addr)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            if monitor.poll(50):
                event = zmq.utils.monitor.recv_monitor_message(monitor)["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    return False
                if event in (
                    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
                    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
                ):
                    return True
        return False
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)


async def test_a_peer_without_the_key_cannot_connect() -> None:
    cfg = EngineConfig(
        executor="mp", tensor_parallel_size=1, worker_extension=EXT, distributed_host="127.0.0.1"
    )
    async with Executor.create(cfg) as ex:
        assert isinstance(ex, MultiProcExecutor) and ex._channel.client_keys is not None
        seen: list[int] = []
        real = ex._dispatch

        def counting(frames: Any) -> None:
            seen.append(len(frames))
            real(frames)

        ex._dispatch = counting  # type: ignore[method-assign]
        ctx: zmq.Context[Any] = zmq.Context()
        try:
            addr = ex._channel.reply_addr
            server = ex._channel.client_keys.server_public.encode()
            assert await asyncio.to_thread(_handshake_fails, ctx, addr, None), "a plain peer must be refused"
            other = (server, *zmq.curve_keypair())  # knows the server key, but its own key is not admitted
            assert await asyncio.to_thread(_handshake_fails, ctx, addr, other), (
                "an unknown key must be refused"
            )
            k = ex._channel.client_keys
            admitted = (server, k.client_public.encode(), k.client_secret.encode())
            assert not await asyncio.to_thread(_handshake_fails, ctx, addr, admitted), (
                "the ranks' key is admitted"
            )
            await asyncio.sleep(0.2)
            assert seen == [], "nothing from an unauthenticated peer reached the executor"
            assert await ex.collective_rpc("whoami") == [0]
        finally:
            ctx.term()
