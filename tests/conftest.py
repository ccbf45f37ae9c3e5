"""Suite-wide fixtures: no leaked process or segment, and tiny random models with their HF references."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import psutil
import pytest
import torch

from asyncexec.ipc.channel import socket_dir_owner
from asyncexec.ipc.shm import SHM_DIR, pid_alive, segment_owner
from asyncexec.testing import ARCHS, make_tiny_model


def asyncexec_segments() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith("asyncexec-")}


def our_segments() -> set[str]:
    """`asyncexec_segments()` of this process, its descendants (Ray's actors too) or dead processes: not
    those of other live processes, such as another test run on the same machine."""
    ours = {os.getpid(), *(p.pid for p in psutil.Process().children(recursive=True))}
    return {n for n in asyncexec_segments() if (o := segment_owner(n)) in ours or _ours_or_dead(o)}


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
    # Only ours or a dead process's: other test runs of this user may be creating segments meanwhile.
    leaked = {n for n in asyncexec_segments() - segments_before if _ours_or_dead(segment_owner(n))}
    for name in leaked:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, name))
    assert not left, f"test left child processes behind: {[(p.pid, p.cmdline()) for p in left]}"
    assert not leaked, f"test left shared-memory segments behind: {sorted(leaked)}"


def asyncexec_socket_dirs() -> set[str]:
    """This process's executor socket directories under the temp dir (their marker names this pid)."""
    root = tempfile.gettempdir()
    return {p for n in os.listdir(root) if socket_dir_owner(p := os.path.join(root, n)) == os.getpid()}


def _ours_or_dead(pid: int | None) -> bool:
    return pid is not None and (pid == os.getpid() or not pid_alive(pid))


class LeakCheck:
    """`no_leaks` for what outlives one test (a module-scoped executor): make one before starting it,
    call `assert_clean` after its shutdown. Checks child processes, segments and socket directories."""

    def __init__(self) -> None:
        self.segments = asyncexec_segments()
        self.children = {p.pid for p in _children()}
        self.socket_dirs = asyncexec_socket_dirs()

    def assert_clean(self, what: str) -> None:
        deadline = time.monotonic() + 3.0
        while True:
            left = [p for p in _children() if p.pid not in self.children]
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        for p in left:
            p.kill()
        # Only ours or a dead process's: other processes of this user may be creating segments meanwhile.
        leaked = {n for n in asyncexec_segments() - self.segments if _ours_or_dead(segment_owner(n))}
        for name in leaked:
            os.unlink(os.path.join(SHM_DIR, name))
        dirs = asyncexec_socket_dirs() - self.socket_dirs
        for path in dirs:
            shutil.rmtree(path, ignore_errors=True)
        assert not left, f"{what} left child processes behind: {[(p.pid, p.cmdline()) for p in left]}"
        assert not leaked, f"{what} left shared-memory segments behind: {sorted(leaked)}"
        assert not dirs, f"{what} left socket directories behind: {sorted(dirs)}"


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: make_tiny_model(root / arch, arch) for arch in ARCHS}


def hf_greedy(path: Path, prompts: list[list[int]], max_new_tokens: int | Sequence[int]) -> list[list[int]]:
    """`model.generate(do_sample=False)` in float32, one prompt at a time (it stops at EOS); a GGUF file
    through transformers' own GGUF load."""
    from asyncexec.gguf.file import load_reference_model

    model = load_reference_model(str(path), torch.float32)
    refs = []
    limits = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    for p, limit in zip(prompts, limits, strict=True):
        ids = torch.tensor([p])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=limit, do_sample=False)
        refs.append(out[0, len(p) :].tolist())
    return refs
