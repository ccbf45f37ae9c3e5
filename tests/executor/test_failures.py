"""Dead workers, failed starts, parent death, shutdown escalation, and leaks over many calls."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import uvloop
import zmq

from asyncexec import (
    Executor,
    ExecutorClosedError,
    WorkerDiedError,
    WorkerFailedError,
    WorkerStartupError,
)
from asyncexec.executor.multiproc import SHUTDOWN_GRACE_S, TERM_GRACE_S, MultiProcExecutor
from asyncexec.ipc.channel import OWNER_FILE
from asyncexec.ipc.shm import sweep_stale_segments
from tests.conftest import asyncexec_segments
from tests.executor.conftest import make_config

SIGTERM_EXT = "tests.executor.conftest:SigtermRecorderExtension"


async def _mp(ranks: int = 2) -> Executor:
    ex = Executor.create(make_config("mp", ranks, shm_arena_bytes=8 << 20))
    await ex.start()
    return ex


@pytest.mark.parametrize(
    ("how", "exitcode"), [("sigkill", -signal.SIGKILL), ("exit", 7), ("segfault", -signal.SIGSEGV)]
)
async def test_dead_worker_fails_the_pending_call_within_a_second(how: str, exitcode: int) -> None:
    ex = await _mp()
    try:
        pids = await ex.collective_rpc("pid")
        if how == "sigkill":
            slow = asyncio.ensure_future(ex.collective_rpc("sleep", (30.0,)))
            await asyncio.sleep(0.2)
            start = time.monotonic()
            os.kill(pids[1], signal.SIGKILL)
            with pytest.raises(WorkerDiedError) as info:
                await slow
        else:
            start = time.monotonic()
            method, args = ("exit_now", (7,)) if how == "exit" else ("segfault", ())
            with pytest.raises(WorkerDiedError) as info:
                await ex.collective_rpc(method, args)
        assert time.monotonic() - start < 1.0
        assert info.value.exitcode == exitcode
        assert info.value.rank in (0, 1)
        with pytest.raises(ExecutorClosedError, match="failed") as closed:
            await ex.collective_rpc("whoami")
        assert isinstance(closed.value.__cause__, WorkerDiedError)
    finally:
        await ex.shutdown()
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids)


async def test_a_rank_that_fails_to_start_reports_its_rank_and_traceback() -> None:
    ex = Executor.create(make_config("mp", 2, worker_extension="tests.extensions:FailingInitExtension"))
    with pytest.raises(WorkerStartupError, match="rank 1 refuses to start") as info:
        await ex.start()
    assert info.value.rank == 1 and "extensions.py" in info.value.remote_traceback


async def test_a_missing_extension_fails_start_clearly() -> None:
    ex = Executor.create(make_config("uni", 1, worker_extension="tests.nowhere:Nothing"))
    with pytest.raises(WorkerStartupError, match="cannot load worker_extension"):
        await ex.start()


async def test_shutdown_escalates_to_sigterm_then_sigkill(tmp_path: Path) -> None:
    ex = Executor.create(make_config("mp", 2, shm_arena_bytes=8 << 20, worker_extension=SIGTERM_EXT))
    await ex.start()
    assert isinstance(ex, MultiProcExecutor)
    try:
        await ex.collective_rpc("record_sigterm", (str(tmp_path),))
        with pytest.raises(asyncio.TimeoutError):  # both ranks are now stuck in a call: deaf to Shutdown
            await ex.collective_rpc("sleep", (60.0,), timeout=0.1)
    finally:
        start = time.time()
        await ex.shutdown()
        took = time.time() - start
    kill_at = SHUTDOWN_GRACE_S + TERM_GRACE_S
    assert [p.returncode for p in ex._procs] == [-signal.SIGKILL] * 2, "SIGTERM was survived, so SIGKILL"
    for rank in (0, 1):
        stamps = [float(t) - start for t in (tmp_path / f"sigterm-{rank}").read_text().split()]
        assert len(stamps) == 1, f"rank {rank} got SIGTERM {len(stamps)} times"
        # SIGTERM comes once Shutdown went unanswered for its grace, and well before SIGKILL.
        assert SHUTDOWN_GRACE_S - 0.05 <= stamps[0] < SHUTDOWN_GRACE_S + 1.5, stamps
    assert kill_at - 0.05 <= took < kill_at + 2.0


async def test_parent_death_takes_the_workers_with_it(tmp_path: object) -> None:
    script = textwrap.dedent(
        """
        import asyncio, sys
        from asyncexec import EngineConfig, Executor
        async def main():
            cfg = EngineConfig(executor="mp", tensor_parallel_size=2,
                               worker_extension="tests.extensions:EchoExtension", shm_arena_bytes=1 << 20)
            ex = Executor.create(cfg)
            await ex.start()
            print(*(await ex.collective_rpc("pid")), flush=True)
            await asyncio.sleep(60)
        asyncio.run(main())
        """
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=os.getcwd()
    )
    try:
        assert parent.stdout is not None
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 2.0
        while any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids):
            assert time.monotonic() < deadline, "workers outlived their executor by 2 s"
            await asyncio.sleep(0.05)
        for name in asyncexec_segments():  # the dead parent's arena is only swept by the next start
            assert not any(name.startswith(f"asyncexec-{p}-") for p in pids), f"worker segment {name} left"
    finally:
        parent.kill()
        parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()
    sweep_stale_segments()  # the dead parent's own arena: what the next start would sweep


async def test_thousand_calls_leak_no_fds_segments_or_memory() -> None:
    ex = await _mp()
    try:
        me = psutil.Process()
        import torch

        t = torch.ones(64 << 10)  # 256 KiB: through the arena both ways
        for _ in range(100):
            await ex.collective_rpc("add", (t, 1.0))
        fds, worker_fds = me.num_fds(), await ex.collective_rpc("num_fds")
        rss, segments = me.memory_info().rss, asyncexec_segments()
        for _ in range(1000):
            await ex.collective_rpc("add", (t, 1.0))
        assert me.num_fds() == fds
        assert await ex.collective_rpc("num_fds") == worker_fds
        assert asyncexec_segments() == segments
        assert me.memory_info().rss - rss < 32 << 20
    finally:
        await ex.shutdown()


async def test_malformed_frames_at_the_executor_are_dropped() -> None:
    ex = await _mp(1)
    assert isinstance(ex, MultiProcExecutor)
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.PUSH)
        sock.connect(ex._channel.reply_addr)
        for junk in (b"", b"\xc1", b"\x93\xa5reply\x00", b"\x92\xa5ready\x05"):
            sock.send(junk)
        sock.close(linger=1000)
        await asyncio.sleep(0.1)
        assert await ex.collective_rpc("whoami") == [0]
    finally:
        ctx.term()
        await ex.shutdown()


async def test_socket_directory_is_private() -> None:
    ex = await _mp(1)
    assert isinstance(ex, MultiProcExecutor)
    try:
        assert ex._channel.dir is not None
        assert os.stat(ex._channel.dir).st_mode & 0o777 == 0o700
    finally:
        await ex.shutdown()


async def test_two_executors_in_one_loop() -> None:
    a, b = await asyncio.gather(_mp(1), _mp(1))
    try:
        ra, rb = await asyncio.gather(a.collective_rpc("pid"), b.collective_rpc("pid"))
        assert ra != rb
    finally:
        await asyncio.gather(a.shutdown(), b.shutdown())


def test_runs_under_uvloop_and_plain_asyncio() -> None:
    async def roundtrip() -> list[int]:
        async with Executor.create(make_config("mp", 1, shm_arena_bytes=1 << 20)) as ex:
            return await ex.collective_rpc("whoami")

    assert uvloop.run(roundtrip()) == [0]
    assert asyncio.run(roundtrip()) == [0]


async def test_failure_on_uni_carries_the_traceback() -> None:
    async with Executor.create(make_config("uni", 2)) as ex:
        with pytest.raises(WorkerFailedError) as info:
            await ex.collective_rpc("fail_on", (0,))
        assert info.value.rank == 0 and "boom on rank 0" in info.value.remote_traceback


async def test_a_missing_model_folder_fails_start_clearly() -> None:
    ex = Executor.create(make_config("uni", 1, model="/no/such/model"))
    with pytest.raises(WorkerStartupError, match="model folder '/no/such/model' does not exist"):
        await ex.start()


async def test_starting_an_executor_sweeps_segments_of_dead_owners() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = f"asyncexec-{dead.pid}-0badf00d"
    os.close(os.open(os.path.join("/dev/shm", stale), os.O_CREAT | os.O_RDWR, 0o600))
    ex = await _mp(1)
    try:
        assert stale not in asyncexec_segments()
    finally:
        await ex.shutdown()


def _socket_dir(pid: int, *, marked: bool = True) -> str:
    """A socket directory as an executor of `pid` leaves it (with a stand-in socket file)."""
    path = tempfile.mkdtemp(prefix=f"asyncexec-{pid}-")
    Path(path, "reply").touch()
    if marked:
        Path(path, OWNER_FILE).write_text(f"{pid}\n")
    return path


def _notes_dir() -> str:
    """A user's own directory that merely shares the prefix."""
    path = tempfile.mkdtemp(prefix="asyncexec-notes-")
    Path(path, "notes.txt").write_text("mine\n")
    return path


def _contents(paths: dict[str, str]) -> dict[str, list[str] | None]:
    return {what: sorted(os.listdir(p)) if os.path.isdir(p) else None for what, p in paths.items()}


async def test_starting_an_executor_sweeps_socket_directories_of_dead_owners() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dirs = {
        "stale": _socket_dir(dead.pid),
        "unmarked": _socket_dir(dead.pid, marked=False),
        "live owner": _socket_dir(live.pid),
        "notes": _notes_dir(),
    }
    try:
        ex = await _mp(1)
        await ex.shutdown()
        assert _contents(dirs) == {
            "stale": None,
            "unmarked": ["reply"],
            "live owner": [OWNER_FILE, "reply"],
            "notes": ["notes.txt"],
        }
    finally:
        live.kill()
        live.wait()
        for path in dirs.values():
            shutil.rmtree(path, ignore_errors=True)
