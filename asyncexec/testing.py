"""Tiny random Hugging Face models for tests, demos and benchmarks (nothing is downloaded).

`make_tiny_model(path, arch)` writes a real model folder (config, safetensors weights, and a byte-level
tokenizer built with `tokenizers`), which loads through the ordinary `from_pretrained` path. Weights use
`initializer_range=0.1`, so that outputs depend on positions and masks (at 0.02 attention is near
uniform and hides position bugs).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal

__all__ = ["ARCHS", "BENCH_MODEL", "TINY_VOCAB_SIZE", "make_tiny_model"]

logger = logging.getLogger(__name__)

Arch = Literal["llama", "qwen2", "mistral", "gpt2"]
ARCHS: tuple[Arch, ...] = ("llama", "qwen2", "mistral", "gpt2")
BOS, EOS, PAD = 256, 257, 258
TINY_VOCAB_SIZE = 259
# The benchmarks' llama: 4 layers of width 256, big enough that the forward is not all overhead.
BENCH_MODEL = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "max_position_embeddings": 1024,
}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _config(arch: Arch, overrides: dict[str, Any]) -> Any:
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB_SIZE,
        initializer_range=0.1,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        tie_word_embeddings=False,
    )
    if arch == "gpt2":
        cfg = dict(common, n_positions=2048, n_embd=64, n_layer=2, n_head=4)
        cfg.update(overrides)
        return transformers.GPT2Config(**cfg)
    cls = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "mistral": "MistralConfig"}[arch]
    cfg = dict(
        common,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    )
    if arch == "mistral":
        cfg["sliding_window"] = None
    cfg.update(overrides)
    return getattr(transformers, cls)(**cfg)


def _tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>"
    )
    assert fast.convert_tokens_to_ids(["<|bos|>", "<|eos|>", "<|pad|>"]) == [BOS, EOS, PAD]
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_model(path: str | Path, arch: Arch = "llama", seed: int = 0, **config_overrides: Any) -> Path:
    """Write a tiny random `arch` model and its tokenizer to `path`; returns the folder.

    `config_overrides` go to the transformers config (`num_hidden_layers=4`, `hidden_size=256`, ...).
    """
    import torch
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = _config(arch, config_overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    _tokenizer().save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    logger.info("wrote a random %s model (%.2fM parameters) to %s", arch, n / 1e6, out)
    return out
