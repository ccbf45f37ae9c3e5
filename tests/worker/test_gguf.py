"""GGUF files as the model: loaded as they ship, tensor by tensor, each in the form a kernel serves.

Tiny random llamas written with `gguf`'s own writer and quantizers (`asyncexec.gguf.writer`): float32
equals transformers' GGUF load token for token (through the engine's scheduler: chunked prefill, mixed
steps, preemption); the default mode keeps Q4_0/Q4_1/Q8_0 tensors as the file holds them (the packed
weights read back to the file's values exactly) and requantizes the K-quants within half a step of
their new grid.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from asyncexec import ConfigError
from asyncexec.gguf.file import GGUFFile, load_reference_model
from asyncexec.gguf.loader import load_gguf_model
from asyncexec.gguf.weights import dequantize_rows
from asyncexec.gguf.writer import write_gguf
from asyncexec.ops import int4_gemm, int8_gemm
from asyncexec.ops.packed_linear import REGISTRY, PackedWeight
from asyncexec.quantization.pack import pack_linears
from asyncexec.testing import make_tiny_model
from tests.worker.test_greedy_equality import config, run_and_compare

needs_vnni = pytest.mark.skipif(
    not (int4_gemm.load() and int8_gemm.load()), reason="the int4/int8 GEMMs need AVX-512 VNNI"
)
TYPES = ("Q8_0", "Q4_0", "Q4_1")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """A tiny llama whose every linear the GEMMs serve (widths in 16s and 32s), its head tied and its
    vocabulary padded to 272 (a multiple of 16): the embedding is kept quantized too."""
    import transformers

    src = make_tiny_model(tmp_path_factory.mktemp("src"), "llama", vocab_size=272, tie_word_embeddings=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    return model, transformers.AutoTokenizer.from_pretrained(src)


@pytest.fixture(scope="module")
def files(llama: tuple[Any, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("gguf")
    model, tok = llama
    return {t: write_gguf(model, out / f"tiny-{t}.gguf", t, tokenizer=tok) for t in (*TYPES, "F32")}


@pytest.mark.parametrize("weight_type", TYPES)
async def test_float32_greedy_equals_transformers_gguf_load(files: dict[str, Path], weight_type: str) -> None:
    """dtype=float32 dequantizes every tensor as transformers does: the same tokens as its GGUF load's
    `generate`, through chunked prefill, mixed steps and preemption, in graph mode."""
    path = files[weight_type]
    _, stats, _ = await run_and_compare(path, config(path, "uni", 1, dtype="float32"), seed=3)
    assert stats[0]["graph_steps"] > 0


def _weight(packed: PackedWeight) -> torch.Tensor:
    """The float32 [N, K] weight a packed int4 or int8 weight computes with."""
    if packed.nibbles is not None:
        assert packed.d is not None
        codes = int4_gemm.unpack(packed.nibbles).float()
        d = packed.d.float().t().repeat_interleave(32, dim=1)
        mn = -8 * d if packed.mn is None else packed.mn.float().t().repeat_interleave(32, dim=1)
        return codes * d + mn
    assert packed.blocked is not None and packed.scales is not None
    q = int8_gemm.unpack(packed.blocked).float()
    return q * packed.scales.float().t().repeat_interleave(32, dim=1)


def _packed(model: Any) -> dict[str, PackedWeight]:
    """Each linear's packed weight (a group member's slice of its group's), by module name."""
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and mod.weight.data_ptr() in REGISTRY:
            out[name] = REGISTRY[mod.weight.data_ptr()]
    return out


def _member(model: Any, name: str, packed: PackedWeight) -> torch.Tensor:
    mod = model.get_submodule(name)
    if packed.group is None:
        return _weight(packed)
    start = packed.start
    return _weight(packed.group.packed)[start : start + mod.out_features]


@needs_vnni
@pytest.mark.parametrize("weight_type", TYPES)
def test_the_default_mode_keeps_the_files_weights_exactly(files: dict[str, Path], weight_type: str) -> None:
    """Every linear and the tied embedding stay in the file's type: the packed codes and fp16 scales
    give back the file's dequantized values bit for bit (Q4_0 without stored minimums)."""
    path = files[weight_type]
    loaded = load_gguf_model(str(path), torch.bfloat16, keep_quantized=True, progress=False)
    assert loaded.forms["dense"][0] == 5  # the norms
    form = "int8" if weight_type == "Q8_0" else "int4"
    assert loaded.forms[form][0] == 15  # 14 linears and the embedding, the head tied to it
    pack_linears(loaded.model, None, sources=loaded.sources)
    reference = load_reference_model(str(path), torch.float32)
    packed = _packed(loaded.model)
    assert len(packed) == 15
    for name, p in packed.items():
        want = reference.get_submodule(name).weight.detach()
        assert torch.equal(_member(loaded.model, name, p), want), f"{name} is not the file's weight"
        if weight_type == "Q4_0":
            assert (p.group.packed if p.group else p).mn is None, "Q4_0 stores no minimums"
    ids = torch.tensor([[0, 17, 271, 5]])
    table = reference.get_input_embeddings().weight.detach()
    assert torch.equal(loaded.model.get_input_embeddings()(ids).float(), table[ids].bfloat16().float())


def _kquant_blocks(type_name: str, rows: int, k: int, seed: int) -> np.ndarray:
    """Random K-quant blocks with sane fp16 scales: every other byte pattern is a valid block."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, k // block, size), dtype=np.uint8)
    scale = np.full((rows, k // block), 0.002, dtype=np.float16).view(np.uint8).reshape(rows, -1, 2)
    if type_name == "Q4_K":  # d, dmin, scales[12], qs[128]
        raw[..., 0:2] = scale
        raw[..., 2:4] = scale
    else:  # Q6_K: ql[128], qh[64], scales[16] (int8), d
        raw[..., -2:] = scale
    return raw.reshape(rows, -1)


@needs_vnni
def test_k_quants_are_requantized_within_half_a_step_of_the_new_grid(tmp_path: Path) -> None:
    """Q4_K becomes int4 (Q4_1 per 32), Q6_K int8 (Q8_0 per 32); each weight within half a quantization
    step of the file's values, said in the start-up line. (K-quants come in blocks of 256 inputs.)"""
    import transformers

    src = make_tiny_model(tmp_path / "src", "llama", vocab_size=272, intermediate_size=256)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(src)
    raw = {
        "blk.0.ffn_down.weight": (_kquant_blocks("Q4_K", 64, 256, 1), "Q4_K"),
        "blk.1.ffn_down.weight": (_kquant_blocks("Q6_K", 64, 256, 2), "Q6_K"),
    }
    path = write_gguf(model, tmp_path / "k.gguf", "Q8_0", tokenizer=tok, weight_types=raw)
    loaded = load_gguf_model(str(path), torch.bfloat16, keep_quantized=True, progress=False)
    assert "1 Q4_K" in loaded.summary() and "1 Q6_K" in loaded.summary()
    pack_linears(loaded.model, None, sources=loaded.sources)
    packed = _packed(loaded.model)
    for layer, (blocks, type_name) in enumerate(raw.values()):
        name = f"model.layers.{layer}.mlp.down_proj"
        want = torch.from_numpy(dequantize_rows(blocks, type_name).reshape(64, 256))
        got = _member(loaded.model, name, packed[name])
        groups = want.reshape(64, 8, 32)
        if type_name == "Q4_K":
            step = (groups.amax(-1) - groups.amin(-1)) / 15
        else:
            step = groups.abs().amax(-1) / 127
        err = (got - want).abs().reshape(64, 8, 32).amax(-1)
        fp16 = 2**-9 * groups.abs().amax(-1)  # the new scale and minimum are stored in fp16
        assert bool((err <= step / 2 + fp16 + 1e-7).all()), (
            f"{type_name}: {float((err / step).max()):.2f} steps"
        )
        assert float(err.max()) > 0.05 * float(step.max()), f"{type_name} exact? a bad grid would pass unseen"


def test_a_quantized_tensor_is_never_dequantized_whole_when_kept(
    files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No whole-model float copy: in the default mode only the F32 norms go through dequantization."""
    import asyncexec.gguf.loader as loader

    seen: list[str] = []

    def spy(raw: np.ndarray, type_name: str) -> np.ndarray:
        seen.append(type_name)
        return dequantize_rows(raw, type_name)

    monkeypatch.setattr(loader, "dequantize_rows", spy)
    loaded = load_gguf_model(
        str(files["Q4_0"]), torch.bfloat16, keep_quantized=int4_gemm.load(), progress=False
    )
    if int4_gemm.load():
        assert set(seen) == {"F32"}, seen
    assert loaded.types["Q4_0"] == 15


def _corrupt_type(path: Path, tensor: str, type_id: int) -> None:
    """Overwrite a tensor's type id in the file's tensor table."""
    reader = GGUFFile.open(str(path)).reader
    t = next(t for t in reader.tensors if t.name == tensor)
    offset = t.field.offset + sum(int(p.nbytes) for p in t.field.parts[:4])
    del reader
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(np.uint32(type_id).tobytes())


def test_bad_files_are_refused_by_name(
    files: dict[str, Path], llama: tuple[Any, Any], tmp_path: Path
) -> None:
    good = files["Q8_0"].read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good[: len(good) * 2 // 3])
    with pytest.raises(ConfigError, match="is truncated"):
        GGUFFile.open(str(truncated))
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    with pytest.raises(ConfigError, match="is not a GGUF file"):
        GGUFFile.open(str(text))
    unknown = tmp_path / "unknown.gguf"
    unknown.write_bytes(good)
    _corrupt_type(unknown, "blk.0.attn_q.weight", 99)
    with pytest.raises(ConfigError, match=r"unknown type id 99; supported: F32, F16, BF16, Q8_0, Q4_0"):
        GGUFFile.open(str(unknown))
    unsupported = tmp_path / "iq4.gguf"
    unsupported.write_bytes(good)
    _corrupt_type(unsupported, "blk.0.attn_q.weight", 20)  # IQ4_NL
    with pytest.raises(
        ConfigError, match=r"tensors of type IQ4_NL, which asyncexec does not load; supported"
    ):
        GGUFFile.open(str(unsupported))


def test_metadata_that_disagrees_with_the_tensors_is_refused_naming_the_tensor(
    llama: tuple[Any, Any], tmp_path: Path
) -> None:
    model, tok = llama
    model.config.intermediate_size = 96  # the metadata says 96, the tensors hold 128
    try:
        path = write_gguf(model, tmp_path / "lies.gguf", "Q8_0", tokenizer=tok)
    finally:
        model.config.intermediate_size = 128
    with pytest.raises(ConfigError, match=r"tensor 'blk.0.ffn_(gate|up|down).weight' has shape .* disagrees"):
        load_gguf_model(str(path), torch.bfloat16, keep_quantized=True, progress=False)


async def test_a_bad_file_fails_the_engine_start_in_the_engine_process(tmp_path: Path) -> None:
    from asyncexec import AsyncEngine, EngineConfig

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 12)
    engine = AsyncEngine(EngineConfig(model=str(bad), executor="mp"))
    with pytest.raises(ConfigError, match=r"bad\.gguf"):
        await engine.start()
    await engine.shutdown()


def test_the_start_up_line_counts_tensors_and_bytes_per_form(
    files: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    loaded = load_gguf_model(str(files["Q4_1"]), torch.bfloat16, keep_quantized=True, progress=False)
    said = loaded.summary()
    kept = "int4" if int4_gemm.load() else "dense"
    assert said.startswith("tensors 5 F32, 15 Q4_1 -> "), said
    assert f"15 {kept} (" in said and "MiB)" in said
    logging.getLogger(__name__).info(said)


@needs_vnni
@pytest.mark.parametrize("weight_type", TYPES)
def test_the_kept_model_computes_what_the_dequantized_one_does(
    files: dict[str, Path], weight_type: str
) -> None:
    """The default mode's forward (the int4/int8 GEMMs on the file's codes, fp16 scales, Q4_0 without
    minimums; the embedding's rows read from the quantized table) against the same weights dequantized
    to bf16: the logits agree within the GEMMs' int8 activations' error (measured: ~1% of the range)."""
    kept = load_gguf_model(str(files[weight_type]), torch.bfloat16, keep_quantized=True, progress=False)
    pack_linears(kept.model, None, sources=kept.sources)
    dense = load_gguf_model(str(files[weight_type]), torch.bfloat16, keep_quantized=False, progress=False)
    ids = torch.tensor([[3, 77, 140, 271, 9, 12, 200, 31]])
    with torch.no_grad():
        a, b = kept.model(ids).logits.float(), dense.model(ids).logits.float()
    err = float((a - b).abs().max() / b.abs().max())
    assert err < 0.05, f"{weight_type}: logits off by {err:.3f} of their range"


async def test_tensor_parallelism_is_refused_for_a_gguf_file_by_name(files: dict[str, Path]) -> None:
    """Not built yet (each rank would read its shard): refused at start, naming it, nothing left running."""
    from asyncexec import Executor, WorkerStartupError

    ex = Executor.create(config(files["Q8_0"], "mp", 2))
    with pytest.raises(WorkerStartupError, match=r"GGUF files load on one rank \(tensor_parallel_size=1\)"):
        await ex.start()
