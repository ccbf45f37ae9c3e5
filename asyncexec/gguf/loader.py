"""A transformers model built from a GGUF file, tensor by tensor, with no whole-model copy at any point.

    GGUFFile.open(path)                          header only; bad files refused here (`gguf.file`)
    config <- the file's metadata (transformers)
    model  <- from_config with its parameters on the meta device (no memory; buffers such as RoPE's real)
    for each tensor of the file (a progress bar):
        quantized, and a GEMM serves it  -> a `GGUFWeight` over the memory map; the parameter a stand-in
        else                              -> dequantized, transformers' processing, in the model's dtype
    tie, check nothing is left on meta   -> (model, sources)

`ModelRunner` then packs the sources straight into the GEMMs' layouts (`quantization.pack`), a slice of
channels at a time, and drops each one's pages from the map. transformers' own GGUF load dequantizes every
tensor to float32 first (4x a Q8_0 file, 7x a Q4_0 one) before the model exists; this loader's peak is the
kept weights plus one tensor.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from asyncexec.errors import ConfigError
from asyncexec.gguf.file import PATCHING, GGUFFile, load_hf_config
from asyncexec.gguf.weights import GGUFWeight, dequantize_rows, drop_pages, form_of, gemm_serves

__all__ = ["GGUFLoad", "load_gguf_model"]

logger = logging.getLogger(__name__)


@dataclass
class GGUFLoad:
    """What `load_gguf_model` built: the model, its kept-quantized weights by module, and what became of
    each tensor (form -> [tensors, bytes in the file])."""

    model: Any
    sources: dict[torch.nn.Module, GGUFWeight] = field(default_factory=dict)
    forms: dict[str, list[int]] = field(default_factory=dict)
    types: Counter[str] = field(default_factory=Counter)

    def summary(self) -> str:
        kinds = ", ".join(f"{n} {t}" for t, n in sorted(self.types.items()))
        forms = ", ".join(f"{n} {f} ({b / 2**20:.1f} MiB)" for f, (n, b) in sorted(self.forms.items()))
        return f"tensors {kinds} -> {forms}"


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside is made on the meta device (no memory, no init); buffers stay
    real (RoPE's frequencies are computed at construction)."""
    register = torch.nn.Module.register_parameter

    def on_meta(self: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register(self, name, param)
        if param is not None:
            self._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=False)

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def _row_order(processor: Any, name: str, rows: int) -> np.ndarray | None:
    """The row order transformers' tensor processor gives this tensor (llama's q/k reverse permutation),
    found by processing row numbers; None where it keeps the file's. A processor that does more than
    reorder rows is refused for quantized data (the caller dequantizes)."""
    ids = np.arange(rows, dtype=np.int64).reshape(rows, 1)
    out = processor.process(weights=ids, name=name)
    got = np.asarray(out.weights).reshape(-1)
    if out.name != name or got.shape != (rows,) or not np.array_equal(np.sort(got), ids[:, 0]):
        raise ValueError("not a row permutation")
    return None if np.array_equal(got, ids[:, 0]) else got


def _kept(t: Any, module: torch.nn.Module, want: tuple[int, ...], processor: Any) -> GGUFWeight | None:
    """Tensor `t` as a kept-quantized weight of `module`, or None where it is dequantized: a float type,
    not the weight of a plain linear or embedding (a subclass, such as gemma's scaled embedding, computes
    more than a lookup), a shape the GEMMs do not take, or a tensor processor that does more than
    reorder rows."""
    form = form_of(t.tensor_type.name)
    plain = type(module) is torch.nn.Linear or (
        type(module) is torch.nn.Embedding and module.max_norm is None
    )
    if form == "dense" or not plain or len(want) != 2 or not gemm_serves(form, want):
        return None
    try:
        order = _row_order(processor, t.name, want[0])
    except ValueError:
        return None
    return GGUFWeight(t.name, t.tensor_type.name, t.data, (want[0], want[1]), order)


def _set_parameter(model: Any, hf_name: str, value: torch.Tensor) -> None:
    module_name, _, pname = hf_name.rpartition(".")
    module = model.get_submodule(module_name)
    module._parameters[pname] = torch.nn.Parameter(value, requires_grad=False)


def _stand_in(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(1, dtype=dtype).expand(*shape)


@contextlib.contextmanager
def _one_name_map() -> Iterator[None]:
    """transformers' `get_gguf_hf_weights_map` recurses into every submodule and rebuilds gguf's name map
    of the whole architecture at each (397 times for smollm2: 6 s of a 10 s load); inside, it is built
    once per architecture and depth."""
    import gguf

    with PATCHING:
        build = gguf.get_tensor_name_map
        gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(build)
        try:
            yield
        finally:
            gguf.get_tensor_name_map = build


def load_gguf_model(
    path: str, dtype: torch.dtype, keep_quantized: bool, progress: bool = True, opened: GGUFFile | None = None
) -> GGUFLoad:
    """The model of the GGUF file at `path`, its dense tensors in `dtype`. `keep_quantized`: quantized
    tensors a GEMM serves stay quantized (`GGUFLoad.sources`), else every tensor is dequantized.
    `opened`: the file, if the caller has opened it already (parsing its header takes seconds)."""
    import transformers
    from tqdm import tqdm
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    f = opened or GGUFFile.open(path)
    config = load_hf_config(path, f)
    with _parameters_on_meta():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    processor = TENSOR_PROCESSORS.get(f.architecture, TensorProcessor)(config=config.to_dict())
    with _one_name_map():
        names = get_gguf_hf_weights_map(model, processor)
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = bool(getattr(config.get_text_config(), "tie_word_embeddings", False))
    head = model.get_output_embeddings()
    embed = model.get_input_embeddings()
    loaded = GGUFLoad(model)
    for t in tqdm(f.reader.tensors, desc="loading GGUF tensors", unit="tensor", disable=not progress):
        hf_name = names.get(t.name)
        if hf_name is None or hf_name not in params:
            logger.debug("GGUF tensor %s has no place in %s: skipped", t.name, type(model).__name__)
            continue
        type_name = t.tensor_type.name
        loaded.types[type_name] += 1
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        want = tuple(params[hf_name].shape)
        if shape != want and not (len(want) == 1 and int(np.prod(shape)) == want[0]):
            raise ConfigError(
                f"{path!r}: tensor {t.name!r} has shape {list(shape)}, but the metadata's "
                f"{config.model_type} config makes {hf_name} {list(want)}: the file's metadata disagrees "
                "with its tensors"
            )
        module = model.get_submodule(hf_name.rpartition(".")[0])
        source = _kept(t, module, want, processor) if keep_quantized else None
        if source is not None:
            form = source.form
            loaded.sources[module] = source
            if tied and module is embed and isinstance(head, torch.nn.Linear):
                loaded.sources[head] = source  # the head multiplies with it, the embedding reads its rows
            _set_parameter(model, hf_name, _stand_in(want, dtype))
        else:
            form = "dense"
            w = processor.process(weights=dequantize_rows(t.data, type_name), name=t.name).weights
            _set_parameter(model, hf_name, torch.from_numpy(np.copy(w)).reshape(want).to(dtype))
            drop_pages(t.data)
        count = loaded.forms.setdefault(form, [0, 0])
        count[0] += 1
        count[1] += int(t.n_bytes)
    if tied:
        model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ConfigError(
            f"{path!r} lacks tensors its {config.model_type} config needs: {', '.join(missing[:6])}"
            + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        )
    model.eval()
    return loaded
