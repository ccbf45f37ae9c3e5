"""Socket directories: private, marked with their owner's pid, swept only when provably stale."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from asyncexec.ipc.channel import OWNER_FILE, ExecutorChannel, socket_dir_owner, sweep_stale_socket_dirs


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: the pid names no process (a zombie would still count as alive)
    return proc.pid


def _socket_dir(root: Path, name: str, marker: str | None) -> Path:
    path = root / name
    path.mkdir(mode=0o700)
    (path / "reply").touch()
    if marker is not None:
        (path / OWNER_FILE).write_text(marker)
    return path


def test_socket_directory_is_private_named_and_marked_by_its_owner() -> None:
    channel = ExecutorChannel(1)
    assert channel.dir is not None
    path = channel.dir
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
        assert os.path.basename(path).startswith(f"asyncexec-{os.getpid()}-")
        assert socket_dir_owner(path) == os.getpid()
        assert path not in sweep_stale_socket_dirs(os.path.dirname(path))  # its owner is running
        assert os.path.isdir(path)
    finally:
        channel.close()
    assert not os.path.exists(path)


def test_sweep_removes_only_marked_directories_of_dead_owners(tmp_path: Path) -> None:
    dead, live = _dead_pid(), os.getppid()
    elsewhere = _socket_dir(tmp_path, "elsewhere", f"{dead}\n")
    root = tmp_path / "root"
    root.mkdir()
    stale = _socket_dir(root, f"asyncexec-{dead}-abcd1234", f"{dead}\n")
    kept = [
        _socket_dir(root, f"asyncexec-{dead}-nomarker", None),
        _socket_dir(root, f"asyncexec-{dead}-otherpid", f"{live}\n"),
        _socket_dir(root, f"asyncexec-{dead}-garbage1", f"{dead} and more\n"),
        _socket_dir(root, f"asyncexec-{live}-liveownr", f"{live}\n"),
        _socket_dir(root, f"asyncexec-{os.getpid()}-myownpid", f"{os.getpid()}\n"),
        _socket_dir(root, "asyncexec-notes", f"{dead}\n"),
        _socket_dir(root, f"asyncexec-{dead}-abcd1234x", f"{dead}\n"),
    ]
    link = root / f"asyncexec-{dead}-symlink1"
    link.symlink_to(elsewhere)
    linked_marker = _socket_dir(root, f"asyncexec-{dead}-lnmarker", None)
    (linked_marker / OWNER_FILE).symlink_to(elsewhere / OWNER_FILE)
    plain_file = root / f"asyncexec-{dead}-plainfil"
    plain_file.write_text(f"{dead}\n")

    assert sweep_stale_socket_dirs(str(root)) == [str(stale)]

    assert not stale.exists()
    for path in [*kept, link, linked_marker, plain_file]:
        assert path.exists(), path.name
    assert sorted(p.name for p in elsewhere.iterdir()) == [OWNER_FILE, "reply"]
