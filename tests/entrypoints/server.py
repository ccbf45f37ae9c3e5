"""A real `asyncexec serve` (uvicorn) process on 127.0.0.1 and a random port, owned by the test."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """`with ServerProcess(model, "--max-num-seqs", "4") as srv: httpx.get(srv.url + "/health")`."""

    def __init__(self, model: Path, *flags: str, script: list[str] | None = None, start_timeout: float = 90):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = script or [sys.executable, "-m", "asyncexec", "serve", "--model", str(model)]
        self.argv += ["--port", str(self.port), *flags]
        self.start_timeout = start_timeout
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (closed in __exit__)
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ServerProcess:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + self.start_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not become healthy:\n{self.output()}")
            time.sleep(0.2)

    def output(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then SIGKILL after `timeout`; returns the exit status."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
        self._log.close()
