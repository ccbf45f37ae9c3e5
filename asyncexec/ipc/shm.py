"""Shared-memory tensor handoff: one outbound arena per process, zero-copy views for receivers.

Naming. Every segment lives in /dev/shm, is created 0600 by its owner, and is named
``asyncexec-<owner pid>-<8 hex>`` (the arena) or ``asyncexec-<owner pid>-<8 hex>-<n>`` (a one-off
segment for a tensor that does not fit the arena). The pid lets a later start sweep segments whose owner
died without unlinking (SIGKILL).

Layout of one region inside a segment (offsets 64-byte aligned)::

    offset F                      offset P = F + align(R)
    +----------------------------+-------------------------------------+
    | done flags: R bytes        | payload: the tensor's bytes         |
    | byte r = 1: receiver r     | (the sender's copy, made at send)   |
    |   dropped its last view    |                                     |
    +----------------------------+-------------------------------------+

Ownership rules:
- Only the sender writes a payload, once, at send time (so later mutation of the source tensor never
  changes what was sent) and clears the flags then. A receiver never writes the payload.
- Receiver r writes exactly one byte, flag r, when the last tensor viewing the payload is garbage (a
  `weakref.finalize` on the memoryview that backs the tensor's storage). No message is needed.
- The sender reclaims a region when all R flags are set, and only then reuses its bytes. One-off
  segments are unmapped and unlinked at that point.
- The creator unlinks its segments on close. A receiver's mapping stays valid after the unlink, until its
  last view is gone. Receivers open segments with plain `os.open`, so `resource_tracker` never sees them.
- Receivers accept a segment only if its name belongs to the peer that announced it, it is a regular file
  owned by this uid with no group/other bits, and every offset of the handle lies inside it.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
import stat
import weakref
from typing import NamedTuple

from asyncexec.errors import ProtocolError

__all__ = [
    "SHM_DIR",
    "Region",
    "ShmArena",
    "ShmReader",
    "pid_alive",
    "remove_segments_of",
    "segment_owner",
    "sweep_stale_segments",
]

SHM_DIR = "/dev/shm"
ALIGN = 64
_NAME_RE = re.compile(r"^asyncexec-(\d+)-([0-9a-f]{8})(?:-(\d+))?$")


def _align(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


class _Segment:
    """A /dev/shm file this process created, mapped read-write and pre-faulted."""

    def __init__(self, name: str, size: int) -> None:
        fd = os.open(_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)
            # Allocate every page now: a full /dev/shm fails here with ENOSPC, not later with SIGBUS.
            os.posix_fallocate(fd, 0, size)
            self.mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        except BaseException:
            os.unlink(_path(name))
            raise
        finally:
            os.close(fd)
        self.name = name
        self.size = size
        self.buf = memoryview(self.mm)

    def close(self) -> None:
        self.buf.release()
        with contextlib.suppress(BufferError):  # a view is still exported in this process; gc unmaps it
            self.mm.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_path(self.name))


class Region(NamedTuple):
    """Where one outbound tensor lives: what the `TensorRef` names, and the sender's view to fill."""

    segment: str
    offset: int
    flags: int
    payload: memoryview


class ShmArena:
    """This process's outbound arena: a first-fit free list over one pre-faulted segment.

    Not thread-safe: one encoder (one thread) owns it.
    """

    def __init__(self, size: int) -> None:
        self.name = f"asyncexec-{os.getpid()}-{secrets.token_hex(4)}"
        self._seg = _Segment(self.name, _align(size)) if size > 0 else None
        self._free: list[tuple[int, int]] = [(0, self._seg.size)] if self._seg else []
        self._live: dict[int, tuple[int, int, int]] = {}  # offset -> (length, flags offset, receivers)
        self._oneoffs: dict[str, tuple[_Segment, int]] = {}  # name -> (segment, receivers)
        self._seq = 0
        self._closed = False
        # Unlink at interpreter exit even if close() is never called (a forgotten shutdown).
        self._names = {self.name} if self._seg else set()
        self._finalizer = weakref.finalize(self, _unlink_names, self._names)

    @property
    def size(self) -> int:
        return self._seg.size if self._seg else 0

    @property
    def num_live_regions(self) -> int:
        return len(self._live) + len(self._oneoffs)

    def allocate(self, nbytes: int, num_receivers: int) -> Region:
        """A region for `nbytes` that `num_receivers` will view; its flags start cleared."""
        if self._closed:
            raise RuntimeError("shared-memory arena is closed")
        self.reclaim()
        head = _align(num_receivers)
        length = head + _align(nbytes)
        if self._seg is not None:
            for i, (off, free) in enumerate(self._free):
                if free >= length:
                    self._free[i : i + 1] = [(off + length, free - length)] if free > length else []
                    self._live[off] = (length, off, num_receivers)
                    self._seg.buf[off : off + head] = bytes(head)
                    return Region(self.name, off + head, off, self._seg.buf[off + head : off + head + nbytes])
        self._seq += 1
        seg = _Segment(f"{self.name}-{self._seq}", length)
        self._names.add(seg.name)
        self._oneoffs[seg.name] = (seg, num_receivers)
        return Region(seg.name, head, 0, seg.buf[head : head + nbytes])

    def reclaim(self) -> int:
        """Free every region all of whose receivers are done; returns how many were freed."""
        freed = 0
        if self._seg is not None and self._live:
            buf = self._seg.buf
            for off, (length, flags, n) in list(self._live.items()):
                if buf[flags : flags + n] == b"\x01" * n:
                    del self._live[off]
                    self._release(off, length)
                    freed += 1
        for name, (seg, n) in list(self._oneoffs.items()):
            if seg.buf[:n] == b"\x01" * n:
                del self._oneoffs[name]
                self._names.discard(name)
                seg.close()
                freed += 1
        return freed

    def _release(self, off: int, length: int) -> None:
        free = self._free
        free.append((off, length))
        free.sort()
        merged: list[tuple[int, int]] = []
        for o, n in free:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((o, n))
        self._free = merged

    def close(self) -> None:
        """Unlink every segment this arena created. Receivers' existing views stay valid."""
        if self._closed:
            return
        self._closed = True
        for seg, _ in self._oneoffs.values():
            seg.close()
        self._oneoffs.clear()
        if self._seg is not None:
            self._seg.close()
        self._names.clear()
        self._finalizer.detach()


def _unlink_names(names: set[str]) -> None:
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_path(name))


def _mark_done(buf: memoryview, flag: int) -> None:
    buf[flag] = 1


class ShmReader:
    """Maps peers' segments and hands out zero-copy views of validated handles.

    `receiver_index` is which done flag this process owns in every region it is sent (its rank for a
    broadcast from the executor, 0 for replies).
    """

    def __init__(self, receiver_index: int) -> None:
        self.receiver_index = receiver_index
        self._peers: set[str] = set()
        self._arenas: dict[str, memoryview] = {}

    def allow(self, arena_name: str | None) -> None:
        """Accept handles into `arena_name` (and its one-off segments) from now on."""
        if arena_name is not None:
            if not _NAME_RE.match(arena_name):
                raise ProtocolError(f"invalid shared-memory arena name {arena_name!r}")
            self._peers.add(arena_name)

    def view(self, segment: str, offset: int, nbytes: int, flags: int) -> memoryview:
        """A view of `nbytes` at `offset` in `segment`; flag `flags + receiver_index` is set when it dies."""
        m = _NAME_RE.match(segment)
        oneoff = m is not None and m.group(3) is not None
        if m is None or (segment.rsplit("-", 1)[0] if oneoff else segment) not in self._peers:
            raise ProtocolError(f"tensor handle names segment {segment!r}, which its sender does not own")
        buf = None if oneoff else self._arenas.get(segment)
        if buf is None:
            buf = _map_peer_segment(segment)
            if not oneoff:
                self._arenas[segment] = buf
        flag = flags + self.receiver_index
        if not (0 <= flags <= flag < offset and nbytes >= 0 and offset + nbytes <= len(buf)):
            raise ProtocolError(
                f"tensor handle out of bounds: offset={offset} nbytes={nbytes} flags={flags} "
                f"in segment {segment!r} of {len(buf)} bytes"
            )
        view = buf[offset : offset + nbytes]
        weakref.finalize(view, _mark_done, buf, flag)
        return view

    def close(self) -> None:
        """Forget cached mappings; live views keep theirs until they are garbage."""
        self._arenas.clear()


def _map_peer_segment(name: str) -> memoryview:
    try:
        fd = os.open(_path(name), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise ProtocolError(f"cannot open shared-memory segment {name!r}: {e}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise ProtocolError(f"shared-memory segment {name!r} is not a private segment of this user")
        if st.st_size == 0:
            raise ProtocolError(f"shared-memory segment {name!r} is empty")
        mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    finally:
        os.close(fd)
    return memoryview(mm)


def segment_owner(name: str) -> int | None:
    """The pid that created segment `name`, or None where the name is not an asyncexec segment's."""
    m = _NAME_RE.match(name)
    return int(m.group(1)) if m else None


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` exists (owned by anyone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _unlink_owned(name: str) -> bool:
    try:
        if os.stat(_path(name), follow_symlinks=False).st_uid != os.geteuid():
            return False
        os.unlink(_path(name))
    except FileNotFoundError:
        return False
    return True


def sweep_stale_segments() -> list[str]:
    """Unlink this user's `asyncexec-*` segments whose owner process is gone; returns their names."""
    removed = []
    for name in os.listdir(SHM_DIR):
        pid = segment_owner(name)
        if pid is not None and pid != os.getpid() and not pid_alive(pid) and _unlink_owned(name):
            removed.append(name)
    return removed


def remove_segments_of(pid: int) -> list[str]:
    """Unlink every segment created by `pid`, a process known to be dead (a worker we reaped)."""
    removed = []
    for name in os.listdir(SHM_DIR):
        if segment_owner(name) == pid and _unlink_owned(name):
            removed.append(name)
    return removed
