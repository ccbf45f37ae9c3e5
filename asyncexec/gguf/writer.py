"""Write a transformers llama as a GGUF file, as llama.cpp's converter lays it out: the test fixtures'
and the scale benchmark's GGUF models (random weights of real shapes; nothing comes from a hub).

    write_gguf(model, "m.gguf", weight_type="Q4_0", tokenizer=tok)

Every 2-D weight whose rows fit the type's blocks is quantized with `gguf`'s own quantizers (Q4_0, Q4_1,
Q8_0, F16, BF16, F32); norms stay F32. q and k are permuted as the converter permutes them (transformers'
GGUF load and `asyncexec.gguf` undo it). `weight_types` overrides the type per GGUF tensor name (a K-quant
tensor, say, written as raw blocks by a test). The tokenizer, if given, is written as a byte-level BPE
("gpt2") with its chat template, enough for transformers to rebuild it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["write_gguf"]

# A tensor already in the file's form: (raw bytes [rows, bytes per row], the ggml type name)
RawTensor = tuple[np.ndarray, str]


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k permutation (the inverse of transformers' `_reverse_permute_weights`)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _metadata(writer: Any, config: Any, weight_type: str) -> None:
    from gguf import LlamaFileType

    text = config.get_text_config()
    heads = text.num_attention_heads
    writer.add_name(getattr(config, "name_or_path", "") or "asyncexec-llama")
    writer.add_context_length(text.max_position_embeddings)
    writer.add_embedding_length(text.hidden_size)
    writer.add_block_count(text.num_hidden_layers)
    writer.add_feed_forward_length(text.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(text.num_key_value_heads)
    writer.add_rope_freq_base(float(getattr(text, "rope_theta", None) or 10000.0))
    writer.add_layer_norm_rms_eps(float(text.rms_norm_eps))
    writer.add_vocab_size(text.vocab_size)
    writer.add_rope_dimension_count(getattr(text, "head_dim", None) or text.hidden_size // heads)
    names = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16"}
    file_type = names.get(weight_type, f"MOSTLY_{weight_type}")
    writer.add_file_type(LlamaFileType[file_type])


def _tokenizer(writer: Any, tok: Any, vocab_size: int) -> None:
    spec = json.loads(tok.backend_tokenizer.to_str())
    vocab: dict[str, int] = dict(spec["model"]["vocab"])
    for added in spec.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    tokens = [f"<|unused{i}|>" for i in range(vocab_size)]
    for text, i in vocab.items():
        tokens[i] = text
    special = {a["id"] for a in spec.get("added_tokens", []) if a.get("special")}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else 1 for i in range(vocab_size)])  # 3: control
    merges = spec["model"].get("merges", [])
    if merges:
        writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    else:  # transformers then derives the merges from the scores (none here: a byte-level vocabulary)
        writer.add_token_scores([0.0] * vocab_size)
    for kind in ("bos", "eos", "pad"):
        tid = getattr(tok, f"{kind}_token_id", None)
        if tid is not None:
            getattr(writer, f"add_{kind}_token_id")(tid)
    if getattr(tok, "chat_template", None):
        writer.add_chat_template(tok.chat_template)


def write_gguf(
    model: Any,
    path: str | Path,
    weight_type: str = "Q8_0",
    tokenizer: Any = None,
    weight_types: Mapping[str, str | RawTensor] | None = None,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Write `model` (a transformers llama, any dtype) to `path`; returns the path."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, quantize
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor, get_gguf_hf_weights_map

    config = model.config
    if config.model_type not in ("llama", "mistral"):
        raise ValueError(f"write_gguf writes llama models, got {config.model_type!r}")
    text = config.get_text_config()
    to_gguf = {hf: g for g, hf in get_gguf_hf_weights_map(model, LlamaTensorProcessor()).items()}
    writer = GGUFWriter(str(path), "llama")
    _metadata(writer, config, weight_type)
    if tokenizer is not None:
        _tokenizer(writer, tokenizer, text.vocab_size)
    overrides = dict(weight_types or {})
    for hf_name, param in model.state_dict().items():
        name = to_gguf.get(hf_name)
        if name is None or (config.tie_word_embeddings and name == "output.weight"):
            continue
        w = param.detach().float().numpy()
        if ".attn_q." in name:
            w = _permute(w, text.num_attention_heads)
        elif ".attn_k." in name:
            w = _permute(w, text.num_key_value_heads)
        chosen = overrides.get(name, weight_type if w.ndim == 2 else "F32")
        if isinstance(chosen, tuple):  # raw blocks given by the caller
            writer.add_tensor(name, chosen[0], raw_dtype=GGMLQuantizationType[chosen[1]])
            continue
        qtype = GGMLQuantizationType[chosen]
        if w.ndim != 2 or w.shape[1] % GGML_QUANT_SIZES[qtype][0]:
            qtype = GGMLQuantizationType.F32
        data = w if qtype == GGMLQuantizationType.F32 else quantize(w, qtype)
        writer.add_tensor(name, data, raw_dtype=qtype)
        if progress is not None:
            progress(name)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)
