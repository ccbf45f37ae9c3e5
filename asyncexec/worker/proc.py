"""The worker process: `python -m asyncexec.worker`, one per rank, spawned (never forked).

Start-up, in order (a spare process started with `--preload MODEL_DIR` first imports that model's
transformers code, then waits here for as long as it takes to be needed):
1. read one length-prefixed `WorkerSpawn` from stdin (8-byte little-endian length, then msgpack);
2. start the parent watcher: stdin stays open as the death pipe, and EOF (the executor process is gone,
   even by SIGKILL) unlinks this process's segments and exits at once;
3. create the outbound arena, connect both sockets, build the worker;
4. send `Ready` (or `StartupFailed` with the traceback) on the reply socket.

Then the loop: blocking receive -> validate the frame as `WorkerInbox` (malformed frames are logged and
dropped, never acted on) -> decode the arguments as the method's annotated types -> call -> reply with the
result or the error. An exception becomes an error reply and the loop keeps serving. `Shutdown`, SIGTERM or
parent death end it. SIGINT is ignored: the executor owns shutdown.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import struct
import sys
import threading
import traceback
from collections.abc import Sequence
from typing import IO, Any

import msgspec

from asyncexec.errors import ProtocolError
from asyncexec.ipc.channel import WorkerChannel
from asyncexec.ipc.codec import Decoder, Encoder
from asyncexec.ipc.shm import ShmArena, ShmReader, remove_segments_of
from asyncexec.messages import (
    Ready,
    RemoteError,
    RPCReply,
    RPCRequestFrame,
    Shutdown,
    StartupFailed,
    WorkerInbox,
    WorkerSpawn,
)
from asyncexec.worker.worker import MethodSpec, Worker, build_worker, lookup_method

logger = logging.getLogger("asyncexec.worker")

EXIT_PARENT_DIED = 3
_LEN = struct.Struct("<Q")


def write_spawn(stream: IO[bytes], spawn: WorkerSpawn) -> None:
    """Executor side: hand the worker its `WorkerSpawn`."""
    payload = msgspec.msgpack.encode(spawn)
    stream.write(_LEN.pack(len(payload)) + payload)
    stream.flush()


def _read_exact(fd: int, n: int) -> bytes:
    chunks = []
    while n:
        chunk = os.read(fd, n)
        if not chunk:
            raise EOFError("executor closed the spawn pipe")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _watch_parent(fd: int) -> None:
    while os.read(fd, 4096):
        pass
    remove_segments_of(os.getpid())
    os._exit(EXIT_PARENT_DIED)


def remote_error(e: BaseException) -> RemoteError:
    return RemoteError(type(e).__qualname__, str(e), traceback.format_exc())


class WorkerLoop:
    """One rank's receive -> dispatch -> reply loop."""

    def __init__(self, worker: Worker, channel: WorkerChannel, encoder: Encoder, decoder: Decoder) -> None:
        self.worker = worker
        self.channel = channel
        self.encoder = encoder
        self.decoder = decoder
        self._specs: dict[str, MethodSpec] = {}

    def run(self) -> None:
        while True:
            frames = self.channel.recv()
            self.decoder.frames = frames  # tensor frames of this message, for it and its Raw arguments
            try:
                msg = self._decode(frames)
                if isinstance(msg, Shutdown):
                    return
                reply = self._serve(msg) if msg is not None else None
            finally:
                self.decoder.frames = ()
            del frames, msg  # the received views go before the reply does, releasing their regions
            if reply is not None:
                self.channel.send(reply)

    def _decode(self, frames: Sequence[Any]) -> RPCRequestFrame | Shutdown | None:
        """The message, validated as `WorkerInbox`; None (logged) for a malformed one."""
        try:
            msg: RPCRequestFrame | Shutdown = self.decoder.decode(memoryview(frames[0]), WorkerInbox)
        except ProtocolError as e:
            logger.warning(
                "rank %d dropped a malformed message (%d frames): %s", self.worker.rank, len(frames), e
            )
            return None
        return msg

    def _serve(self, req: RPCRequestFrame) -> list[bytes | memoryview]:
        reply = self._call(req)
        try:
            return self.encoder.encode_frames(reply)
        except (TypeError, ValueError) as e:
            err = RemoteError(type(e).__qualname__, f"result of {req.method!r} cannot be sent: {e}", "")
            return self.encoder.encode_frames(RPCReply(req.call_id, self.worker.rank, None, err))
        finally:
            del reply
            if self.encoder.arena is not None:
                self.encoder.arena.reclaim()

    def _call(self, req: RPCRequestFrame) -> RPCReply:
        rank = self.worker.rank
        try:
            spec = self._spec(req.method)
        except AttributeError as e:
            spec, lookup_error = None, e
        try:
            args, kwargs = self._decode_args(req, spec)
            if spec is None:
                raise lookup_error
            result = spec.fn(*args, **kwargs)
        except Exception as e:
            return RPCReply(req.call_id, rank, None, remote_error(e))
        finally:  # drop received tensor views now, so their regions are released before the reply
            args, kwargs = [], {}
        return RPCReply(req.call_id, rank, result, None)

    def _spec(self, method: str) -> MethodSpec:
        spec = self._specs.get(method)
        if spec is None:
            spec = self._specs[method] = _decodable(self.decoder, lookup_method(self.worker, method))
        return spec

    def _decode_args(self, req: RPCRequestFrame, spec: MethodSpec | None) -> tuple[list[Any], dict[str, Any]]:
        dec = self.decoder.decode
        if spec is None:
            return [dec(a) for a in req.args], {k: dec(v) for k, v in req.kwargs.items()}
        n = len(spec.positional)
        rest = spec.var_positional if spec.var_positional is not None else Any
        args = [dec(a, spec.positional[i] if i < n else rest) for i, a in enumerate(req.args)]
        kwargs = {k: dec(v, spec.keyword.get(k, Any)) for k, v in req.kwargs.items()}
        return args, kwargs


def _decodable(decoder: Decoder, spec: MethodSpec) -> MethodSpec:
    """`spec` with annotations msgspec cannot decode replaced by Any, so such methods still serve."""

    def ok(t: Any) -> Any:
        try:
            decoder.decoder_for(t)
        except TypeError:
            return Any
        return t

    return dataclasses.replace(
        spec,
        positional=tuple(ok(t) for t in spec.positional),
        var_positional=None if spec.var_positional is None else ok(spec.var_positional),
        keyword={k: ok(t) for k, t in spec.keyword.items()},
    )


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def preload(model: str) -> None:
    """Import `model`'s transformers code (most of a worker's start-up) before the spawn message comes."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        from asyncexec.gguf.file import load_hf_config

        MODEL_FOR_CAUSAL_LM_MAPPING.get(type(load_hf_config(model)), None)
    except Exception:  # loading the model for real reports whatever is wrong with it
        logger.debug("preloading %s failed", model, exc_info=True)


def main(argv: Sequence[str] = ()) -> int:
    """A spawned worker process: the spawn message on stdin, stdin kept as the death pipe."""
    if len(argv) == 2 and argv[0] == "--preload":
        preload(argv[1])
    stdin = sys.stdin.fileno()
    try:
        spawn = msgspec.msgpack.decode(
            _read_exact(stdin, _LEN.unpack(_read_exact(stdin, 8))[0]), type=WorkerSpawn
        )
    except EOFError:  # the executor (or a spare's owner) went away before handing us a rank
        return EXIT_PARENT_DIED
    _prepare(spawn)
    threading.Thread(target=_watch_parent, args=(stdin,), name="parent-watch", daemon=True).start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _raise_exit)
    return serve(spawn)


def _prepare(spawn: WorkerSpawn) -> None:
    sys.path[:] = spawn.sys_path + [p for p in sys.path if p not in spawn.sys_path]
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s [rank {spawn.rank}] %(levelname)s %(name)s: %(message)s"
    )


def serve_encoded(spawn_msg: bytes) -> int:
    """The same loop inside a host that is not our own process (a Ray actor): its host owns lifetime."""
    spawn = msgspec.msgpack.decode(spawn_msg, type=WorkerSpawn)
    _prepare(spawn)
    return serve(spawn)


def serve(spawn: WorkerSpawn) -> int:
    """Build the rank, announce it, and run its loop until `Shutdown`; returns the exit status."""
    rank = spawn.rank
    arena: ShmArena | None = None
    channel = WorkerChannel(spawn.request_addr, spawn.reply_addr, spawn.curve)
    worker: Worker | None = None
    try:
        try:
            reader = None
            if spawn.curve is None:  # same machine: tensors through shared memory
                arena = ShmArena(spawn.config.shm_arena_bytes)
                reader = ShmReader(receiver_index=rank)
                reader.allow(spawn.executor_arena)
            encoder = Encoder(arena, spawn.config.inline_tensor_bytes)
            worker = build_worker(
                spawn.config, rank, spawn.local_rank, spawn.world_size, spawn.distributed_init_method
            )
        except Exception as e:
            logger.exception("rank %d failed to start", rank)
            channel.send([msgspec.msgpack.encode(StartupFailed(rank, remote_error(e)))])
            return 1
        channel.send([msgspec.msgpack.encode(Ready(rank, os.getpid(), arena.name if arena else None))])
        WorkerLoop(worker, channel, encoder, Decoder(reader)).run()
        return 0
    finally:
        if worker is not None:
            worker.shutdown()
        channel.close()
        if arena is not None:
            arena.close()
