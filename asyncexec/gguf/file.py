"""A GGUF file, opened and checked before anything is built from it.

`GGUFFile.open(path)` reads the header through `gguf`'s memory map (no tensor data is read) and refuses,
with the file named, what would otherwise fail half-way through a load:
- a path that is not a GGUF file (the magic), or one `gguf` cannot parse;
- a truncated file: a tensor whose data ends past the end of the file;
- an architecture transformers' GGUF support does not cover, or a tensor type asyncexec does not load
  (`SUPPORTED_TYPES`, listed in the error).
Whether the metadata agrees with the tensors (shapes against the config) is checked by the loader, tensor
by tensor, before any weight is kept (`gguf.loader`).

The config, tokenizer and chat template come from the file's metadata through transformers
(`from_pretrained(folder, gguf_file=name)`, which reads the metadata only).
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncexec.errors import ConfigError

__all__ = [
    "GGUF_MAGIC",
    "SUPPORTED_TYPES",
    "GGUFFile",
    "all_float32",
    "check",
    "is_gguf",
    "load_hf_config",
    "load_reference_model",
    "load_tokenizer",
    "pretrained_args",
]

GGUF_MAGIC = b"GGUF"
# ggml tensor types asyncexec loads, and what each becomes by default (`gguf.weights.form_of`)
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


def is_gguf(model: str | os.PathLike[str] | None) -> bool:
    """Whether `model` names a GGUF file (by its suffix: a folder or built-in name is not one)."""
    return model is not None and str(model).lower().endswith(".gguf")


def pretrained_args(path: str) -> tuple[str, dict[str, Any]]:
    """transformers' `from_pretrained` arguments for `path`: (folder, {"gguf_file": name}) for a GGUF
    file, else (path, {})."""
    if not is_gguf(path):
        return path, {}
    p = Path(path)
    return str(p.parent), {"gguf_file": p.name}


def _stamp(path: str) -> tuple[str, int, int]:
    """The key of what is cached per file: a file replaced on disk is read again."""
    st = os.stat(path)
    return os.path.abspath(path), st.st_size, st.st_mtime_ns


_CHECKED: dict[tuple[str, int, int], frozenset[str]] = {}  # every file `GGUFFile.open` has checked


def check(path: str) -> frozenset[str]:
    """Open and check the GGUF file at `path` (`GGUFFile.open`'s errors) once per process and version of
    the file; returns its tensor types. gguf's reader parses every metadata value: 3 s for smollm2's
    49k-token vocabulary on these machines, so each process parses a file as few times as it can."""
    if not os.path.isfile(path):
        raise ConfigError(f"GGUF file {path!r} does not exist")
    stamp = _stamp(path)
    if stamp not in _CHECKED:
        GGUFFile.open(path)
    return _CHECKED[stamp]


def all_float32(path: str) -> bool:
    """Whether every tensor of the GGUF file at `path` is F32 (`dtype="auto"` then loads it in float32)."""
    return check(path) == {"F32"}


_CONFIGS: dict[tuple[str, int, int], Any] = {}
# One patch of the `gguf` module at a time (engines in one process may load at once): nested patches
# restored out of order would leave one installed.
PATCHING = threading.RLock()


@contextlib.contextmanager
def _reusing(opened: GGUFFile | None) -> Iterator[None]:
    """transformers' GGUF functions open the file with `gguf.GGUFReader` each time; inside, one already
    opened is handed to them instead of parsing its header again."""
    import gguf

    if opened is None:
        yield
        return
    mine = os.path.abspath(opened.path)
    with PATCHING:
        parse = gguf.GGUFReader

        def reader(path: Any, *args: Any, **kwargs: Any) -> Any:
            return opened.reader if os.path.abspath(path) == mine else parse(path, *args, **kwargs)

        gguf.GGUFReader = reader  # type: ignore[assignment, misc]
        try:
            yield
        finally:
            gguf.GGUFReader = parse  # type: ignore[misc]


def load_hf_config(path: str, opened: GGUFFile | None = None) -> Any:
    """The transformers config of a model folder or GGUF file (a GGUF's parsed once per process: a copy
    of it each call, since transformers writes to the configs of the models it builds). `opened`: the
    GGUF file, already opened."""
    import transformers

    folder, kwargs = pretrained_args(path)
    if not kwargs:
        return transformers.AutoConfig.from_pretrained(folder)
    if opened is None:
        check(path)  # a clear error before transformers' own
    stamp = _stamp(path)
    if stamp not in _CONFIGS:
        with _reusing(opened):
            _CONFIGS[stamp] = transformers.AutoConfig.from_pretrained(folder, **kwargs)
    return copy.deepcopy(_CONFIGS[stamp])


def load_reference_model(path: str, dtype: Any) -> Any:
    """transformers' own load of a model folder or GGUF file (every GGUF tensor dequantized to float32
    first, then cast to `dtype`): the reference tests and benchmarks compare the engine with."""
    import transformers

    folder, kwargs = pretrained_args(path)
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs).eval()


def load_tokenizer(path: str) -> Any:
    """The tokenizer (with its chat template) of a model folder or GGUF file."""
    from transformers import AutoTokenizer

    folder, kwargs = pretrained_args(path)
    return AutoTokenizer.from_pretrained(folder, **kwargs)


@dataclass
class GGUFFile:
    """An opened and checked GGUF file: `reader` (gguf's `GGUFReader`) and its `architecture`."""

    path: str
    reader: Any
    architecture: str

    @classmethod
    def open(cls, path: str) -> GGUFFile:
        if not os.path.isfile(path):
            raise ConfigError(f"GGUF file {path!r} does not exist")
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise ConfigError(f"{path!r} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")
        try:
            from gguf import GGUFReader
        except ImportError as e:
            raise ConfigError(f"reading {path!r} needs the 'gguf' package: run `pip install gguf`") from e
        try:
            reader = GGUFReader(path)
        except ValueError as e:
            raise ConfigError(_reader_error(path, e)) from e
        except (KeyError, IndexError, TypeError) as e:
            raise ConfigError(f"{path!r} is not a readable GGUF file: {e}") from e
        found = cls(path, reader, _architecture(path, reader))
        found._check_tensors()
        _CHECKED[_stamp(path)] = frozenset(t.tensor_type.name for t in reader.tensors)
        return found

    def field(self, key: str, default: Any = None) -> Any:
        """A metadata value (a string, number or list), or `default`."""
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def _check_tensors(self) -> None:
        size = os.path.getsize(self.path)
        bad = sorted({t.tensor_type.name for t in self.reader.tensors} - set(SUPPORTED_TYPES))
        if bad:
            raise ConfigError(
                f"{self.path!r} holds tensors of type {', '.join(bad)}, which asyncexec does not load; "
                f"supported: {', '.join(SUPPORTED_TYPES)}"
            )
        for t in self.reader.tensors:
            end = int(t.data_offset) + int(t.n_bytes)
            if end > size or t.data.nbytes != int(t.n_bytes):
                raise ConfigError(
                    f"{self.path!r} is truncated: tensor {t.name!r} ends at byte {end}, the file has {size}"
                )


def _reader_error(path: str, e: ValueError) -> str:
    """What gguf's reader failed on, said for a user: an unknown tensor type, a truncated file."""
    unknown = re.search(r"(\d+)\)? is not a valid GGMLQuantizationType", str(e))
    if unknown:
        return (f"{path!r} holds a tensor of unknown type id {unknown.group(1)}; supported: "
                f"{', '.join(SUPPORTED_TYPES)}")  # fmt: skip
    if "reshape" in str(e):
        return f"{path!r} is truncated: its tensor table points past the end of the file ({e})"
    return f"{path!r} is not a readable GGUF file: {e}"


def _architecture(path: str, reader: Any) -> str:
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    field = reader.fields.get("general.architecture")
    if field is None:
        raise ConfigError(f"{path!r} has no general.architecture in its metadata")
    arch = str(field.contents())
    if arch not in GGUF_SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            f"{path!r} is a {arch!r} model, which transformers' GGUF support does not cover; supported: "
            f"{', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))}"
        )
    return arch
