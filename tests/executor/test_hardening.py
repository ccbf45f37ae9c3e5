"""Hardening the stress runs called for: junk at a worker's socket, other users, survivors stuck in C++."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import msgspec
import pytest

from asyncexec import EngineConfig, Executor, WorkerDiedError, WorkerStartupError
from asyncexec.executor.multiproc import MultiProcExecutor
from tests.conftest import asyncexec_segments
from tests.executor.conftest import make_config

SYSTEM_PYTHON = "/usr/bin/python3"


async def test_malformed_frames_at_a_worker_are_dropped_logged_and_survived(
    capfd: pytest.CaptureFixture[str],
) -> None:
    ex = Executor.create(make_config("mp", 2, shm_arena_bytes=8 << 20))
    await ex.start()
    try:
        assert isinstance(ex, MultiProcExecutor)
        junk: list[list[bytes]] = [
            [b""],
            [b"\xc1"],
            [b"garbage" * 10],
            [msgspec.msgpack.encode(["rpc", "not-an-id", 1, 2])],
            [msgspec.msgpack.encode(["shutdown", "extra", "fields", 1])],
            [msgspec.msgpack.encode({"tag": "rpc"})],
            [b"\x93\xa3rpc\x01", b"second frame"],
        ]
        for rank in (0, 1):
            for frames in junk:
                await ex._channel.send(rank, frames)
        assert await ex.collective_rpc("whoami") == [0, 1]  # both ranks still serve, in order
        assert await ex.collective_rpc("echo", ({"k": [1, 2]},)) == [{"k": [1, 2]}] * 2
    finally:
        await ex.shutdown()
    err = capfd.readouterr().err
    for rank in (0, 1):
        assert err.count(f"rank {rank} dropped a malformed message") >= len(junk), err[-2000:]


_PROBE = """
import json, os, socket, sys
out = {}
try:
    os.close(os.open(sys.argv[1], os.O_RDWR)); out["segment"] = "opened"
except OSError as e:
    out["segment"] = type(e).__name__
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sys.argv[2]); out["socket"] = "connected"
except OSError as e:
    out["socket"] = type(e).__name__
print(json.dumps(out))
"""


def _probe(segment: str, sock: str, *, as_nobody: bool) -> dict[str, str]:
    def drop() -> None:
        os.setgid(65534)
        os.setuid(65534)

    r = subprocess.run(
        [SYSTEM_PYTHON, "-I", "-S", "-c", _PROBE, segment, sock],
        capture_output=True,
        text=True,
        preexec_fn=drop if as_nobody else None,
        timeout=30,
        check=True,
    )
    return dict(json.loads(r.stdout))


@pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists(SYSTEM_PYTHON), reason="needs root to become nobody"
)
async def test_another_uid_can_neither_map_segments_nor_connect() -> None:
    before = asyncexec_segments()
    ex = Executor.create(make_config("mp", 1, shm_arena_bytes=8 << 20))
    await ex.start()
    try:
        assert isinstance(ex, MultiProcExecutor) and ex._channel.dir is not None
        mine = sorted(asyncexec_segments() - before)
        assert mine, "the executor and its worker hold arenas"
        for name in mine:
            assert os.stat(f"/dev/shm/{name}").st_mode & 0o777 == 0o600
        assert os.stat(ex._channel.dir).st_mode & 0o777 == 0o700
        sock = os.path.join(ex._channel.dir, "reply")
        assert os.path.exists(sock)  # noqa: ASYNC240
        # The same probe as this user succeeds, so the refusals below are the permissions' doing.
        assert _probe(f"/dev/shm/{mine[0]}", sock, as_nobody=False) == {
            "segment": "opened",
            "socket": "connected",
        }
        for name in mine:
            got = _probe(f"/dev/shm/{name}", sock, as_nobody=True)
            assert got == {"segment": "PermissionError", "socket": "PermissionError"}, got
        assert await ex.collective_rpc("whoami") == [0]
    finally:
        await ex.shutdown()


def _rank0_fails(tiny_models: dict[str, Path]) -> EngineConfig:
    return EngineConfig(
        model=str(tiny_models["llama"]),
        executor="mp",
        tensor_parallel_size=2,
        kv_cache_memory_bytes=1 << 20,
        worker_extension="tests.extensions:Rank0FailsAtInitExtension",
    )


async def test_a_survivor_stuck_in_the_rendezvous_is_killed_at_once(
    tiny_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stamp = tmp_path / "death"
    monkeypatch.setenv("ASYNCEXEC_TEST_INIT_FAILURE", "exit")
    monkeypatch.setenv("ASYNCEXEC_TEST_STAMP", str(stamp))
    with pytest.raises(WorkerDiedError) as died:
        await Executor.create(_rank0_fails(tiny_models)).start()  # a failed start shuts down first
    assert died.value.rank == 0
    # Rank 1 sat in the process-group rendezvous, where neither Shutdown nor SIGTERM's Python handler
    # reaches it: giving up took 2 s (Shutdown) + 3 s (SIGTERM); now it is killed after 0.5 s.
    assert time.time() - float(stamp.read_text()) < 2.0


async def test_a_rank_failing_init_does_not_wait_for_its_stuck_peer(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASYNCEXEC_TEST_INIT_FAILURE", "raise")
    start = time.monotonic()
    with pytest.raises(WorkerStartupError) as failed:
        await Executor.create(_rank0_fails(tiny_models)).start()
    assert failed.value.rank == 0 and "rank 0 has no device" in str(failed.value)
    assert "Traceback" in failed.value.remote_traceback
    # It waited for rank 1's reply, which never comes (worker_start_timeout_s is 300 s): now the first
    # error fails the start, and shutdown takes rank 1 down within its 5 s ladder.
    assert time.monotonic() - start < 30
