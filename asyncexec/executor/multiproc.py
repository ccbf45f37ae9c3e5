"""`MultiProcExecutor`: one spawned worker process per rank, driven from the event loop.

Data path of one call: encode once (large tensors copied once into this process's arena) -> the same
frame to every rank's PUSH socket -> the reply reader task decodes each rank's reply and completes the
call when every rank has answered.

Liveness: every worker's pidfd is watched by the loop (`add_reader`); readable means the process exited,
confirmed with `poll()` before acting, since only an exit code proves a death. A death fails every
pending call with `WorkerDiedError` at once, marks the executor failed, terminates the other ranks and
tells the owner (`on_failure`), which may shut the executor down at once (see `asyncexec.engine.supervisor`).
Each worker also watches us through its stdin (see `asyncexec.worker.proc`).

Shutdown: `Shutdown` message -> SIGTERM after `SHUTDOWN_GRACE_S` -> SIGKILL after `TERM_GRACE_S`; then the
dead workers' segments are unlinked, and our own arena, sockets and socket directory are removed. After a
death the survivors get `Shutdown`, then SIGKILL after `FAILED_GRACE_S`: one may be blocked in a collective
with its dead peer (a gloo wait in C++), where neither a message nor SIGTERM's Python handler reaches it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from asyncexec.errors import (
    ExecutorClosedError,
    ProtocolError,
    WorkerDiedError,
    WorkerStartupError,
)
from asyncexec.executor.abstract import Executor
from asyncexec.executor.pending_calls import PendingCalls, Reply, fail_future, resolve_future
from asyncexec.executor.spares import SpareWorkers, popen_worker
from asyncexec.ipc.channel import ExecutorChannel, sweep_stale_socket_dirs
from asyncexec.ipc.codec import Decoder, Encoder
from asyncexec.ipc.shm import ShmArena, ShmReader, remove_segments_of, sweep_stale_segments
from asyncexec.messages import (
    ExecutorInbox,
    Ready,
    RemoteError,
    RPCReplyFrame,
    RPCRequest,
    Shutdown,
    StartupFailed,
    WorkerSpawn,
)
from asyncexec.worker.proc import write_spawn

__all__ = ["MultiProcExecutor"]

logger = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 2.0
TERM_GRACE_S = 3.0
FAILED_GRACE_S = 0.5
SHUTDOWN_FRAME = msgspec.msgpack.encode(Shutdown())


class MultiProcExecutor(Executor):
    """`tensor_parallel_size` worker processes on this machine."""

    _procs: list[subprocess.Popen[bytes]]
    spares: SpareWorkers | None = None  # set by the owner (AsyncEngine) before start
    # Set by the owner: called once, on the loop, when a worker death fails the executor (idle or not).
    on_failure: Callable[[BaseException], None] | None = None

    @property
    def worker_pids(self) -> list[int]:
        """The worker processes' ids, by rank (empty before start; those of other hosts are not here)."""
        return [p.pid for p in getattr(self, "_procs", [])]

    async def _start(self) -> None:
        for name in sweep_stale_segments():
            logger.info("removed stale shared-memory segment %s", name)
        for path in sweep_stale_socket_dirs():
            logger.info("removed stale socket directory %s", path)
        self._loop = asyncio.get_running_loop()
        self._calls = PendingCalls(self._loop, self.world_size)
        self._procs = []
        self._pidfds: list[int] = []
        self._worker_pids: list[int] = []
        self._ready: list[asyncio.Future[None]] = [self._loop.create_future() for _ in range(self.world_size)]
        self._terminating: asyncio.Task[None] | None = None
        tcp_host = await self._prepare_ranks()
        self._arena = ShmArena(self.config.shm_arena_bytes) if tcp_host is None else None
        self._encoder = Encoder(self._arena, self.config.inline_tensor_bytes)
        self._reader = ShmReader(receiver_index=0) if tcp_host is None else None
        self._decoder = Decoder(self._reader)
        self._channel = ExecutorChannel(self.world_size, tcp_host)
        self._channel.start_reading(self._loop, self._on_message)
        self._dist_init = f"tcp://{tcp_host or '127.0.0.1'}:{_free_port()}" if self.world_size > 1 else None
        for rank in range(self.world_size):  # launch every rank before waiting on any
            self._launch(rank, self._spawn_message(rank))
        try:
            await asyncio.wait_for(asyncio.gather(*self._ready), self.config.worker_start_timeout_s)
        except asyncio.TimeoutError:
            missing = [r for r, f in enumerate(self._ready) if not f.done()]
            raise WorkerStartupError(
                missing[0], f"ranks {missing} not ready after {self.config.worker_start_timeout_s:g} s"
            ) from None

    async def _prepare_ranks(self) -> str | None:
        """Before the channel exists: place the ranks; returns the TCP host, or None for ipc + shm."""
        return self.config.distributed_host

    def _spawn_message(self, rank: int) -> WorkerSpawn:
        return WorkerSpawn(
            rank=rank,
            local_rank=rank,
            world_size=self.world_size,
            config=self.config,
            request_addr=self._channel.request_addrs[rank],
            reply_addr=self._channel.reply_addr,
            executor_pid=os.getpid(),
            executor_arena=self._arena.name if self._arena is not None else None,
            sys_path=[p for p in sys.path if p],
            distributed_init_method=self._dist_init,
            curve=self._channel.client_keys,
        )

    def _launch(self, rank: int, spawn: WorkerSpawn) -> None:
        """Start rank `rank` as a spawned process (not forked), or take a spare, and watch its exit."""
        proc = self.spares.take() if self.spares is not None else None
        if proc is None:
            proc = popen_worker()
        self._procs.append(proc)
        self._worker_pids.append(proc.pid)
        self._watch_exit(rank, proc)
        assert proc.stdin is not None
        write_spawn(proc.stdin, spawn)

    def _watch_exit(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        fd = os.pidfd_open(proc.pid)
        self._pidfds.append(fd)

        def on_exit() -> None:
            code = proc.poll()
            if code is None:  # not an exit after all: look again shortly rather than spin
                self._loop.remove_reader(fd)
                self._loop.call_later(0.05, self._loop.add_reader, fd, on_exit)
                return
            self._loop.remove_reader(fd)
            if not self._closed:
                logger.error("worker rank %d (pid %d) exited with code %s", rank, proc.pid, code)
                self._fail(WorkerDiedError(rank, code))

        self._loop.add_reader(fd, on_exit)

    def _fail(self, exc: BaseException) -> None:
        first = self._failure is None
        if first:
            self._failure = exc
        self._calls.fail_all(exc)
        for f in self._ready:
            fail_future(f, exc)
        if self._terminating is None:
            self._terminating = self._loop.create_task(self._terminate_workers(), name="asyncexec-terminate")
        if first and self.on_failure is not None:
            self.on_failure(exc)

    # ----- replies ----------------------------------------------------------------------------------

    def _on_message(self, frames: Sequence[Any]) -> None:
        self._decoder.frames = frames
        try:
            self._dispatch(frames)
        finally:
            self._decoder.frames = ()

    def _dispatch(self, frames: Sequence[Any]) -> None:
        try:
            msg: RPCReplyFrame | Ready | StartupFailed = self._decoder.decode(
                memoryview(frames[0]), ExecutorInbox
            )
        except ProtocolError as e:
            logger.warning("executor dropped a malformed reply (%d frames): %s", len(frames), e)
            return
        match msg:
            case RPCReplyFrame():
                self._on_reply(msg)
            case Ready(rank=rank) if 0 <= rank < self.world_size:
                if msg.pid not in self._worker_pids:  # a rank hosted elsewhere (Ray) tells us its pid
                    self._worker_pids.append(msg.pid)
                if self._reader is not None:
                    self._reader.allow(msg.arena)
                resolve_future(self._ready[rank], None)
            case StartupFailed(rank=rank, error=err) if 0 <= rank < self.world_size:
                exc = WorkerStartupError(rank, f"{err.type}: {err.message}", err.traceback)
                fail_future(self._ready[rank], exc)
            case _:
                logger.warning("executor dropped an unexpected message: %r", msg)

    def _on_reply(self, msg: RPCReplyFrame) -> None:
        # always decode, even a late reply: that is what releases tensors the reply carries (a failed
        # call's result is None, whatever type a success would have had)
        result_type = self._calls.result_type(msg.call_id) if msg.error is None else Any
        try:
            reply: Reply = (self._decoder.decode(msg.result, result_type), msg.error)
        except ProtocolError as e:
            reply = (None, RemoteError("ProtocolError", str(e), ""))
        self._calls.reply(msg.call_id, msg.rank, reply)

    # ----- calls ------------------------------------------------------------------------------------

    async def _collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float | None,
        result_type: Any,
    ) -> list[Any]:
        call_id, future = self._calls.open(method, result_type)
        expiry = None
        if timeout is not None:
            expiry = self._loop.call_later(timeout, self._calls.expire, call_id, timeout)
        try:
            frames = self._encoder.encode_frames(RPCRequest(call_id, method, args, kwargs), self.world_size)
            for rank in range(self.world_size):
                await self._channel.send(rank, frames)
            replies = await future
        finally:
            self._calls.close(call_id)
            if expiry is not None:
                expiry.cancel()
            if self._arena is not None:
                self._arena.reclaim()
        return self._gather(method, replies)

    # ----- shutdown ---------------------------------------------------------------------------------

    async def _terminate_workers(self) -> None:
        failed = self._failure is not None
        for rank in range(self.world_size):
            self._channel.send_nowait(rank, SHUTDOWN_FRAME)
        await self._wait_exit(FAILED_GRACE_S if failed else SHUTDOWN_GRACE_S)
        if not failed:
            for proc in self._procs:
                if proc.poll() is None:
                    logger.warning("worker pid %d ignored shutdown; sending SIGTERM", proc.pid)
                    proc.terminate()
            await self._wait_exit(TERM_GRACE_S)
        for proc in self._procs:
            if proc.poll() is None:
                why = "is stuck after a rank died" if failed else "ignored SIGTERM"
                logger.warning("worker pid %d %s; sending SIGKILL", proc.pid, why)
                proc.kill()
        await self._wait_exit(None)

    async def _wait_exit(self, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while any(p.poll() is None for p in self._procs):
            if deadline is not None and time.monotonic() >= deadline:
                return
            await asyncio.sleep(0.01)

    async def _shutdown(self) -> None:
        if hasattr(self, "_channel"):
            if self._terminating is None:
                self._terminating = self._loop.create_task(self._terminate_workers())
            await self._terminating
            self._calls.fail_all(ExecutorClosedError("executor shut down while the call was pending"))
        self._release_ranks()
        for pid in getattr(self, "_worker_pids", []):
            remove_segments_of(pid)
        if hasattr(self, "_channel"):
            self._channel.close()
        reader: ShmReader | None = getattr(self, "_reader", None)
        if reader is not None:
            reader.close()
        arena: ShmArena | None = getattr(self, "_arena", None)
        if arena is not None:
            arena.close()

    def _release_ranks(self) -> None:
        """After the ranks stopped: close what watched them."""
        for proc, fd in zip(getattr(self, "_procs", []), getattr(self, "_pidfds", []), strict=False):
            self._loop.remove_reader(fd)
            os.close(fd)
            if proc.stdin is not None:
                proc.stdin.close()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
