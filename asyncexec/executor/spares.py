"""Worker processes for the multiproc executor: how one is started, and spares started ahead of need."""

from __future__ import annotations

import os
import subprocess
import sys

__all__ = ["SpareWorkers", "popen_worker"]


def popen_worker(preload_model: str | None = None) -> subprocess.Popen[bytes]:
    """A `python -m asyncexec.worker` process, waiting on its stdin for a `WorkerSpawn`."""
    env = dict(os.environ)
    here = os.path.abspath(__file__)  # <root>/asyncexec/executor/spares.py: <root> holds the package
    pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(here)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
    argv = [sys.executable, "-m", "asyncexec.worker"]
    if preload_model is not None:
        argv += ["--preload", preload_model]
    return subprocess.Popen(argv, stdin=subprocess.PIPE, env=env, close_fds=True)


class SpareWorkers:
    """Worker processes started ahead of need, their model's code already imported, each waiting on its
    stdin (which is also its death pipe) for a spawn message. An executor that replaces a dead one takes
    them instead of paying Python's and transformers' start-up again. Owned by whoever made it: `close()`.
    """

    def __init__(self, model: str | None) -> None:
        self.model = model
        self._procs: list[subprocess.Popen[bytes]] = []

    def fill(self, n: int) -> None:
        """Start spares until `n` are waiting."""
        self._procs = [p for p in self._procs if p.poll() is None]
        while len(self._procs) < n:
            self._procs.append(popen_worker(self.model))

    def take(self) -> subprocess.Popen[bytes] | None:
        while self._procs:
            proc = self._procs.pop(0)
            if proc.poll() is None:
                return proc
        return None

    def close(self) -> None:
        for proc in self._procs:
            proc.kill()
        for proc in self._procs:
            proc.wait()
            if proc.stdin is not None:
                proc.stdin.close()
        self._procs.clear()
