"""The one build-and-load routine for asyncexec's C++ kernels (`csrc/*.cpp`).

Built through inductor's C++ compiler driver (`torch._inductor.codecache.CppCodeCache`): it picks this
CPU's vector flags (CPU_CAPABILITY_AVX512 or _AVX2), puts torch's headers on the include path (ATen's
vector types, c10's BFloat16), links torch's OpenMP, and caches the library on disk under the compile
cache folder (`compile_cache_dir`), keyed by source and flags: 1-10 s cold, then a cache hit. The
libraries export plain C functions, called through ctypes (which releases the GIL while they run).

`CppKernel` builds its source once per process, under a lock (engines loading in several threads at once
see one build and its outcome); where it cannot build, a warning names the error and what runs instead.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["CSRC", "CppKernel", "compile_cache_dir", "compiler_missing", "source_text"]

CSRC = Path(__file__).with_name("csrc")


def compile_cache_dir() -> str:
    """Inductor's cache folder: the user's `TORCHINDUCTOR_CACHE_DIR`, else `asyncexec/torch-compile` under
    `$XDG_CACHE_HOME` (or `~/.cache`), beside the built-in models.

    Inductor has no other knob for it than that environment variable, which it reads (and sets to its
    default) whenever it opens its caches, so this sets it for the whole process: the worker processes
    are asyncexec's own, and with the uni executor it is the host's process, whose other compiles then
    share the folder too (README, "Graph mode")."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    configured = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if configured and os.path.abspath(configured) != os.path.abspath(default_cache_dir()):
        return configured  # the user's (inductor sets the variable to its default on first use)
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = os.path.join(root, "asyncexec", "torch-compile")
    os.makedirs(path, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    return path


def compiler_missing() -> str | None:
    """Why no C++ compiler works here (inductor's search: `CXX`, then the usual names), or None when one
    does. Graph mode on CPU and asyncexec's kernels need one."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except Exception as e:
        text = str(e).strip()
        return text.splitlines()[0] if text else type(e).__name__
    return None


_INCLUDE = re.compile(r'^#include "([\w.]+)"$', re.MULTILINE)


def source_text(source: Path) -> str:
    """`source` with each `#include "name"` of a file beside it replaced by that file's text (inductor's
    cache builds one text, so a header shared by two kernels is pasted in; its cache key covers it)."""
    return _INCLUDE.sub(lambda m: source.with_name(m.group(1)).read_text(), source.read_text())


class CppKernel:
    """One C++ source, built and loaded at most once per process.

    `load(setup)` builds `source` (or loads it from the disk cache) and calls `setup(library)`, which
    declares the entry points and returns the kernel's handle, or None where the library is no use on
    this CPU (setup warns why). The outcome is kept: later calls return it at once."""

    def __init__(self, source: Path, what: str, fallback: str, logger: logging.Logger) -> None:
        self.source = source
        self.what = what  # "int8 GEMV kernel": for the log
        self.fallback = fallback  # what runs where it cannot build
        self._logger = logger
        self._lock = threading.Lock()
        self._tried = False
        self._handle: Any = None

    def load(self, setup: Callable[[Any], Any]) -> Any:
        with self._lock:
            if not self._tried:
                self._tried = True
                lib = self._build()
                self._handle = setup(lib) if lib is not None else None
            return self._handle

    def load_function(self, name: str, argtypes: list[Any], unavailable: str) -> Any:
        """The library's C function `name` (returning int), or None where the library is unavailable or
        its `{name}_ready()` says this CPU cannot run it (logged once: `unavailable`)."""

        def setup(lib: Any) -> Any:
            if not int(getattr(lib, f"{name}_ready")()):
                self._logger.info("%s", unavailable)
                return None
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = ctypes.c_int, argtypes
            self._logger.info("%s ready", self.what)
            return fn

        return self.load(setup)

    def _build(self) -> Any | None:
        from torch._inductor.codecache import CppCodeCache

        compile_cache_dir()  # the libraries live next to the compiled decode graphs
        start = time.perf_counter()
        try:
            lib = CppCodeCache.load(source_text(self.source))
        except Exception as e:  # any build failure leaves the fallback, said once
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            self._logger.warning(
                "could not build asyncexec's %s (%s: %s); %s",
                self.what,
                type(e).__name__,
                first,
                self.fallback,
            )
            return None
        self._logger.debug("%s built or loaded in %.1f s", self.what, time.perf_counter() - start)
        return lib
