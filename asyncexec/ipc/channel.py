"""ZeroMQ channels between the executor and its ranks.

Topology, per executor::

    executor (zmq.asyncio)                         rank r (blocking zmq)
    PUSH  bound  <dir>/req-<r>   ---- requests ---> PULL connect
    PULL  bound  <dir>/reply     <--- replies ----- PUSH connect   (all ranks share it)

ipc:// sockets live in a private 0700 temporary directory per executor, removed at close. TCP is used
only when a host is given (Ray across nodes), bound to that host on a random port, never to `*`.
Each executor owns one `zmq.asyncio.Context` and terminates it at close with linger 0; workers own a
plain `zmq.Context`.

The executor's hot path skips zmq.asyncio's per-message futures, which cost about 60 us a receive on
these machines (`scripts/bench_ipc.py` measures the difference): sends try a non-blocking send first and
await the zmq.asyncio send only when the queue is full, and replies are drained by a loop reader on the
socket's edge-triggered ZMQ_FD, which receives with NOBLOCK while ZMQ_EVENTS says POLLIN and hands each
frame to a callback, in the loop's thread, in arrival order.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable

import zmq
import zmq.asyncio

__all__ = ["ExecutorChannel", "WorkerChannel"]


def _check_bind_host(host: str) -> str:
    if host in ("*", "", "0.0.0.0", "::"):
        raise ValueError(f"refusing to bind to {host!r}: give the node's own address")
    try:
        ipaddress.ip_address(host)
    except ValueError as e:
        raise ValueError(f"bind host must be an IP address, got {host!r}") from e
    return host


_SYNC_SEND = zmq.Socket.send
_SYNC_RECV = zmq.Socket.recv


class ExecutorChannel:
    """The executor's end: one PUSH per rank and one shared PULL, all bound."""

    def __init__(self, world_size: int, tcp_host: str | None = None) -> None:
        self.ctx = zmq.asyncio.Context()
        self.dir: str | None = None
        self.requests: list[zmq.asyncio.Socket] = []
        try:
            self.reply = self.ctx.socket(zmq.PULL)
            if tcp_host is None:
                self.dir = tempfile.mkdtemp(prefix="asyncexec-")  # mkdtemp makes it 0700
                os.chmod(self.dir, 0o700)
                self._rmdir = weakref.finalize(self, shutil.rmtree, self.dir, ignore_errors=True)
            self.reply_addr = self._bind(self.reply, "reply", tcp_host)
            self.request_addrs = []
            for rank in range(world_size):
                sock = self.ctx.socket(zmq.PUSH)
                self.requests.append(sock)
                self.request_addrs.append(self._bind(sock, f"req-{rank}", tcp_host))
        except BaseException:
            self.close()
            raise

    def _bind(self, sock: zmq.asyncio.Socket, name: str, tcp_host: str | None) -> str:
        sock.setsockopt(zmq.LINGER, 0)
        if tcp_host is None:
            assert self.dir is not None
            addr = f"ipc://{self.dir}/{name}"
            sock.bind(addr)
            return addr
        host = _check_bind_host(tcp_host)
        shown = f"[{host}]" if ":" in host else host
        port = sock.bind_to_random_port(f"tcp://{shown}")
        return f"tcp://{shown}:{port}"

    async def send(self, rank: int, frame: bytes) -> None:
        sock = self.requests[rank]
        try:
            _SYNC_SEND(sock, frame, zmq.NOBLOCK, copy=len(frame) < 65536)
        except zmq.Again:
            await sock.send(frame, copy=len(frame) < 65536)

    def send_nowait(self, rank: int, frame: bytes) -> bool:
        """Send without waiting; False where the queue is full or the socket is gone."""
        try:
            _SYNC_SEND(self.requests[rank], frame, zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        return True

    def start_reading(self, loop: asyncio.AbstractEventLoop, on_frame: Callable[[bytes], None]) -> None:
        """Call `on_frame(frame)` in the loop for every reply frame, until `close()`."""
        self._loop = loop
        self._on_frame = on_frame
        self._fd: int | None = int(self.reply.getsockopt(zmq.FD))
        loop.add_reader(self._fd, self._drain)
        loop.call_soon(self._drain)  # the fd is edge-triggered: take what came before we registered

    def _drain(self) -> None:
        sock = self.reply
        # Reading ZMQ_EVENTS re-arms the edge trigger; it is also cheaper than catching zmq.Again.
        while not sock.closed and int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            self._on_frame(_SYNC_RECV(sock, zmq.NOBLOCK))

    def close(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            self._loop.remove_reader(fd)
            self._fd = None
        for sock in [*self.requests, getattr(self, "reply", None)]:
            if sock is not None:
                sock.close(linger=0)
        self.ctx.term()
        if self.dir is not None:
            self._rmdir()
            self.dir = None


class WorkerChannel:
    """A rank's end: PULL for requests, PUSH for replies, both connected; blocking."""

    def __init__(self, request_addr: str, reply_addr: str) -> None:
        self.ctx = zmq.Context()
        self.requests = self.ctx.socket(zmq.PULL)
        self.reply = self.ctx.socket(zmq.PUSH)
        for sock, addr in ((self.requests, request_addr), (self.reply, reply_addr)):
            sock.setsockopt(zmq.LINGER, 1000)  # let a final reply out before the process exits
            sock.connect(addr)

    def recv(self) -> bytes:
        return self.requests.recv()

    def send(self, frame: bytes) -> None:
        if len(frame) < 65536:
            self.reply.send(frame)
        else:
            self.reply.send(frame, copy=False)

    def close(self) -> None:
        self.requests.close(linger=0)
        self.reply.close()
        self.ctx.term()
