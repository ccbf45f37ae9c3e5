"""ZeroMQ channels between the executor and its ranks.

Topology, per executor::

    executor (zmq.asyncio)                         rank r (blocking zmq)
    PUSH  bound  <dir>/req-<r>   ---- requests ---> PULL connect
    PULL  bound  <dir>/reply     <--- replies ----- PUSH connect   (all ranks share it)

ipc:// sockets live in a private 0700 temporary directory per executor, removed at close, named
``asyncexec-<owner pid>-<8 random>`` with a marker file ``asyncexec-owner`` inside holding the owner pid.
A SIGKILLed executor cannot remove its directory; the next start sweeps it (`sweep_stale_socket_dirs`),
but only a directory that is provably ours: the name's pid and the marker agree, both are this uid's, and
that pid is dead. A name that merely starts with ``asyncexec-`` is never enough. TCP is used
only when a host is given (ranks on other machines), bound to that IP on random ports, never to `*`,
and authenticated with ZeroMQ CURVE: the executor's sockets are CURVE servers, keys are made per
executor, and a ZAP handler admits only the client key handed to the ranks at spawn. On TCP a message
may span several frames (tensors travel as frames of their own, see `codec.py`); on ipc it is one frame.

Each executor owns one `zmq.asyncio.Context` and terminates it at close with linger 0; workers own a
plain `zmq.Context`.

The executor's hot path skips zmq.asyncio's per-message futures, which cost about 60 us a receive on
these machines (`scripts/bench_ipc.py` measures the difference): sends try a non-blocking send first and
await the zmq.asyncio send only when the queue is full, and replies are drained by a loop reader on the
socket's edge-triggered ZMQ_FD, which receives with NOBLOCK while ZMQ_EVENTS says POLLIN and hands each
message to a callback, in the loop's thread, in arrival order.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import re
import shutil
import stat
import tempfile
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio
import zmq.auth.asyncio

from asyncexec.ipc.shm import pid_alive

__all__ = [
    "OWNER_FILE",
    "CurveClientKeys",
    "ExecutorChannel",
    "WorkerChannel",
    "socket_dir_owner",
    "sweep_stale_socket_dirs",
]

Frames = Sequence[Any]  # bytes, memoryview or zmq.Frame; frame 0 is the msgpack
_ZERO_COPY_MIN = 65536
OWNER_FILE = "asyncexec-owner"
_DIR_RE = re.compile(r"^asyncexec-(\d+)-[a-z0-9_]{8}$")  # what `tempfile.mkdtemp(prefix=...)` makes
_MAX_MARKER = 32


class CurveClientKeys(msgspec.Struct, array_like=True, gc=False):
    """What a rank needs to reach the executor over TCP: the server's public key and its own pair (z85)."""

    server_public: str
    client_public: str
    client_secret: str


def _check_bind_host(host: str) -> str:
    if host in ("*", "", "0.0.0.0", "::"):
        raise ValueError(f"refusing to bind to {host!r}: give the node's own address")
    try:
        ipaddress.ip_address(host)
    except ValueError as e:
        raise ValueError(f"bind host must be an IP address, got {host!r}") from e
    return host


# The base class's methods, called on zmq.asyncio sockets: they act now instead of returning futures.
# (`send_multipart`/`recv_multipart` are not used: they call back into the async `send`/`recv`.)
_SYNC_SEND = zmq.Socket.send
_SYNC_RECV = zmq.Socket.recv


def _sync_send_frames(sock: zmq.Socket[Any], frames: Frames) -> None:
    last = len(frames) - 1
    for i, f in enumerate(frames):
        _SYNC_SEND(sock, f, zmq.NOBLOCK | (zmq.SNDMORE if i < last else 0), copy=False)


def _sync_recv_frames(sock: zmq.Socket[Any]) -> list[Any]:
    frames = [_SYNC_RECV(sock, zmq.NOBLOCK, copy=False)]
    while sock.getsockopt(zmq.RCVMORE):
        frames.append(_SYNC_RECV(sock, zmq.NOBLOCK, copy=False))
    return frames


def _make_socket_dir() -> str:
    """A fresh 0700 directory under the temp dir, marked with this process's pid."""
    path = tempfile.mkdtemp(prefix=f"asyncexec-{os.getpid()}-")  # mkdtemp makes it 0700
    try:
        os.chmod(path, 0o700)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(os.path.join(path, OWNER_FILE), flags, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"{os.getpid()}\n")
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    return path


def socket_dir_owner(path: str) -> int | None:
    """The owner pid of the executor socket directory `path`, or None where it is not provably one.

    Provably one: a real directory of this uid named ``asyncexec-<pid>-<8>``, holding a regular
    ``asyncexec-owner`` file of this uid whose content is that same pid.
    """
    m = _DIR_RE.match(os.path.basename(path))
    if m is None:
        return None
    try:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            return None
        fd = os.open(os.path.join(path, OWNER_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            mst = os.fstat(fd)
            if not stat.S_ISREG(mst.st_mode) or mst.st_uid != os.geteuid():
                return None
            marker = os.read(fd, _MAX_MARKER)
        finally:
            os.close(fd)
    except OSError:  # gone meanwhile, no marker, or not ours to read
        return None
    return int(m.group(1)) if marker == f"{m.group(1)}\n".encode() else None


def sweep_stale_socket_dirs(root: str | None = None) -> list[str]:
    """Remove this user's executor socket directories whose owner process is gone; returns their paths.

    `root` defaults to the temp dir, where `ExecutorChannel` makes them.
    """
    root = tempfile.gettempdir() if root is None else root
    removed = []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        pid = socket_dir_owner(path)
        if pid is not None and pid != os.getpid() and not pid_alive(pid):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


class _OnlyKey:
    """ZAP credentials: admit exactly one client public key."""

    def __init__(self, key: bytes) -> None:
        self.key = key

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.key


class ExecutorChannel:
    """The executor's end: one PUSH per rank and one shared PULL, all bound."""

    def __init__(self, world_size: int, tcp_host: str | None = None) -> None:
        self.ctx = zmq.asyncio.Context()
        self.dir: str | None = None
        self.requests: list[zmq.asyncio.Socket] = []
        self.multipart = tcp_host is not None
        self.client_keys: CurveClientKeys | None = None
        self._auth: zmq.auth.asyncio.AsyncioAuthenticator | None = None
        try:
            if tcp_host is None:
                self.dir = _make_socket_dir()
                self._rmdir = weakref.finalize(self, shutil.rmtree, self.dir, ignore_errors=True)
            else:
                self._start_curve()
            self.reply = self._socket(zmq.PULL)
            self.reply_addr = self._bind(self.reply, "reply", tcp_host)
            self.request_addrs = []
            for rank in range(world_size):
                sock = self._socket(zmq.PUSH)
                self.requests.append(sock)
                self.request_addrs.append(self._bind(sock, f"req-{rank}", tcp_host))
        except BaseException:
            self.close()
            raise

    def _start_curve(self) -> None:
        server_public, self._server_secret = zmq.curve_keypair()
        self._server_public = server_public
        client_public, client_secret = zmq.curve_keypair()
        self.client_keys = CurveClientKeys(
            server_public.decode(), client_public.decode(), client_secret.decode()
        )
        self._auth = zmq.auth.asyncio.AsyncioAuthenticator(self.ctx)
        self._auth.start()
        self._auth.configure_curve_callback("*", credentials_provider=_OnlyKey(client_public))

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if self.client_keys is not None:
            sock.curve_secretkey = self._server_secret
            sock.curve_publickey = self._server_public
            sock.curve_server = True
        return sock

    def _bind(self, sock: zmq.asyncio.Socket, name: str, tcp_host: str | None) -> str:
        if tcp_host is None:
            assert self.dir is not None
            addr = f"ipc://{self.dir}/{name}"
            sock.bind(addr)
            return addr
        host = _check_bind_host(tcp_host)
        shown = f"[{host}]" if ":" in host else host
        port = sock.bind_to_random_port(f"tcp://{shown}")
        return f"tcp://{shown}:{port}"

    async def send(self, rank: int, frames: Frames) -> None:
        sock = self.requests[rank]
        try:
            if len(frames) == 1:
                _SYNC_SEND(sock, frames[0], zmq.NOBLOCK, copy=len(frames[0]) < _ZERO_COPY_MIN)
            else:  # the first part going out means all go out (zmq queues whole messages)
                _sync_send_frames(sock, frames)
        except zmq.Again:
            await sock.send_multipart(frames, copy=False)

    def send_nowait(self, rank: int, frame: bytes) -> bool:
        """Send without waiting; False where the queue is full or the socket is gone."""
        try:
            _SYNC_SEND(self.requests[rank], frame, zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        return True

    def start_reading(self, loop: asyncio.AbstractEventLoop, on_message: Callable[[Frames], None]) -> None:
        """Call `on_message(frames)` in the loop for every reply, until `close()`."""
        self._loop = loop
        self._on_message = on_message
        self._fd: int | None = int(self.reply.getsockopt(zmq.FD))
        loop.add_reader(self._fd, self._drain)
        loop.call_soon(self._drain)  # the fd is edge-triggered: take what came before we registered

    def _drain(self) -> None:
        sock = self.reply
        # Reading ZMQ_EVENTS re-arms the edge trigger; it is also cheaper than catching zmq.Again.
        while not sock.closed and int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            if self.multipart:
                self._on_message(_sync_recv_frames(sock))
            else:
                self._on_message([_SYNC_RECV(sock, zmq.NOBLOCK)])

    def close(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            self._loop.remove_reader(fd)
            self._fd = None
        for sock in [*self.requests, getattr(self, "reply", None)]:
            if sock is not None:
                sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self.ctx.term()
        if self.dir is not None:
            self._rmdir()
            self.dir = None


class WorkerChannel:
    """A rank's end: PULL for requests, PUSH for replies, both connected; blocking."""

    def __init__(self, request_addr: str, reply_addr: str, curve: CurveClientKeys | None = None) -> None:
        self.ctx = zmq.Context()
        self.multipart = curve is not None
        self.requests = self.ctx.socket(zmq.PULL)
        self.reply = self.ctx.socket(zmq.PUSH)
        for sock, addr in ((self.requests, request_addr), (self.reply, reply_addr)):
            sock.setsockopt(zmq.LINGER, 1000)  # let a final reply out before the process exits
            if curve is not None:
                sock.curve_serverkey = curve.server_public.encode()
                sock.curve_publickey = curve.client_public.encode()
                sock.curve_secretkey = curve.client_secret.encode()
            sock.connect(addr)

    def recv(self) -> list[Any]:
        if self.multipart:
            return self.requests.recv_multipart(copy=False)
        return [self.requests.recv()]

    def send(self, frames: Frames) -> None:
        if len(frames) == 1:
            self.reply.send(frames[0], copy=len(frames[0]) < _ZERO_COPY_MIN)
        else:
            self.reply.send_multipart(frames, copy=False)

    def close(self) -> None:
        self.requests.close(linger=0)
        self.reply.close()
        self.ctx.term()
