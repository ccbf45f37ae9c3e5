"""The shared-memory arena: permissions, recycling, one-off segments, stale sweeps."""

from __future__ import annotations

import gc
import os
import stat
import subprocess
import sys

import pytest
import torch

from asyncexec.errors import ProtocolError
from asyncexec.ipc.codec import Decoder, Encoder
from asyncexec.ipc.shm import SHM_DIR, ShmArena, ShmReader, sweep_stale_segments
from tests.conftest import asyncexec_segments


def test_arena_is_private_and_named_by_owner_pid() -> None:
    arena = ShmArena(1 << 16)
    st = os.stat(os.path.join(SHM_DIR, arena.name))
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert arena.name.startswith(f"asyncexec-{os.getpid()}-")
    arena.close()
    assert arena.name not in asyncexec_segments()


def test_regions_are_recycled_when_every_receiver_is_done() -> None:
    arena = ShmArena(1 << 16)
    enc = Encoder(arena, 0)
    readers = [ShmReader(receiver_index=r) for r in range(2)]
    for r in readers:
        r.allow(arena.name)
    for _ in range(100):  # 100 x 8 KiB through a 64 KiB arena only works if regions come back
        frame = enc.encode(torch.ones(2048), num_receivers=2)
        a: torch.Tensor = Decoder(readers[0]).decode(frame)
        b: torch.Tensor = Decoder(readers[1]).decode(frame)
        assert float(a.sum()) == float(b.sum()) == 2048
        del a
        assert arena.reclaim() == 0, "receiver 1 still holds the region"
        del b
    gc.collect()
    arena.reclaim()
    assert arena.num_live_regions == 0
    assert len(asyncexec_segments() - {arena.name}) == 0, "no one-off segment should have been needed"
    arena.close()


def test_tensor_larger_than_arena_takes_a_one_off_segment_that_is_freed() -> None:
    arena = ShmArena(1 << 16)
    reader = ShmReader(0)
    reader.allow(arena.name)
    big = torch.randn(1 << 16)  # 256 KiB
    frame = Encoder(arena, 0).encode(big)
    assert len(asyncexec_segments()) >= 2
    out: torch.Tensor = Decoder(reader).decode(frame)
    assert torch.equal(out, big)
    del out
    gc.collect()
    assert arena.reclaim() == 1
    assert {n for n in asyncexec_segments() if n.startswith(arena.name)} == {arena.name}
    arena.close()


def test_a_segment_with_loose_permissions_is_refused() -> None:
    arena = ShmArena(1 << 16)
    os.chmod(os.path.join(SHM_DIR, arena.name), 0o644)
    reader = ShmReader(0)
    reader.allow(arena.name)
    with pytest.raises(ProtocolError, match="not a private segment"):
        reader.view(arena.name, 64, 16, 0)
    arena.close()


def test_stale_segment_of_a_dead_pid_is_swept() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    name = f"asyncexec-{dead.pid}-0badf00d"
    fd = os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_RDWR, 0o600)
    os.close(fd)
    live = ShmArena(4096)  # our own pid: alive, must survive the sweep
    assert name in sweep_stale_segments()
    assert name not in asyncexec_segments()
    assert live.name in asyncexec_segments()
    live.close()


def test_a_forgotten_arena_is_unlinked_when_collected() -> None:
    arena = ShmArena(1 << 16)
    frame = Encoder(arena, 0).encode(torch.ones(1 << 15))  # 128 KiB: a one-off segment too
    names = {n for n in asyncexec_segments() if n.startswith(arena.name)}
    assert len(names) == 2
    del arena, frame
    gc.collect()
    assert not names & asyncexec_segments()
