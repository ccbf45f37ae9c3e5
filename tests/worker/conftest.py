"""Worker tests share the suite-wide tiny models (tests/conftest.py)."""

from __future__ import annotations

import copy
from pathlib import Path
from types import ModuleType

import pytest

from asyncexec.ops.build import CppKernel


def unload_kernel(module: ModuleType, monkeypatch: pytest.MonkeyPatch, source: Path | None = None) -> None:
    """`module`'s C++ kernel as if no engine had loaded it yet, built from `source` if given (monkeypatch
    restores it): a fresh `CppKernel` and the module's handles cleared."""
    kernel: CppKernel = copy.copy(module._KERNEL)
    kernel.__init__(source or kernel.source, kernel.what, kernel.fallback, module.logger)  # type: ignore[misc]
    monkeypatch.setattr(module, "_KERNEL", kernel)
    for name, value in (("_fn", None), ("_width", 0), ("_ready", False)):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, value)


@pytest.fixture
def without_int8_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    """int8 as a CPU without AVX-512 VNNI runs it: the GEMV (or PyTorch's kernel) for 1-4 rows and a dense
    copy above, not `int8_gemm` at every size."""
    from asyncexec.ops import int8_gemm

    monkeypatch.setattr(int8_gemm, "fits", lambda weight: False)
