"""Suite-wide fixtures: every test must leave no child process and no asyncexec segment behind."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import psutil
import pytest

from asyncexec.ipc.shm import SHM_DIR


def asyncexec_segments() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith("asyncexec-")}


def _children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    """Fails the test if it leaves a child process or a new /dev/shm/asyncexec-* segment."""
    segments_before = asyncexec_segments()
    children_before = {p.pid for p in _children()}
    yield
    deadline = time.monotonic() + 3.0
    while True:
        left = [p for p in _children() if p.pid not in children_before]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for p in left:
        p.kill()
    leaked = asyncexec_segments() - segments_before
    for name in leaked:
        os.unlink(os.path.join(SHM_DIR, name))
    assert not left, f"test left child processes behind: {[(p.pid, p.cmdline()) for p in left]}"
    assert not leaked, f"test left shared-memory segments behind: {sorted(leaked)}"
