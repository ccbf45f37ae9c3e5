"""Tiny random models (one per architecture, per session) and their greedy references."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncexec.models import ARCHS, make_tiny_model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: make_tiny_model(root / arch, arch) for arch in ARCHS}


def hf_greedy(path: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """`model.generate(do_sample=False)` in float32, one prompt at a time (it stops at EOS)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    refs = []
    for p in prompts:
        ids = torch.tensor([p])
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
        )
        refs.append(out[0, len(p) :].tolist())
    return refs
