"""Activation-aware int8 scales: calibration at load, for `quantization="int8"`.

Plain int8 (one scale per output channel, round to nearest) perturbs every output by the weights' rounding
error times the activations. A few input channels of each linear carry most of the activation magnitude, so
their weights' rounding dominates. AWQ's remedy (Lin et al., 2023): scale input channel j of the weight by
`s_j = m_j ** alpha` (m_j: the channel's mean |activation|) before quantizing, and divide the activation by
`s_j` before the int8 matmul, which is exact in real arithmetic and puts the int8 grid where the activations
are. `alpha` is searched per linear (0 = plain int8) for the least output error on calibration activations.

The activations come from one bf16 forward, at load, over `CALIBRATION_TEXT` tokenized with the model's
tokenizer; for a chat model, as chat turns (each paragraph's first sentence the user's, the rest the
assistant's), the format it serves. A model folder without a tokenizer gets seeded random tokens (logged),
which carry little signal. Measured on SmolLM2-135M (the built-in `smollm2`), teacher-forced over the 822
tokens of `tests/real_model/test_smollm2_int8.py` on a 2-core AMX Xeon: mean |log-prob error| of the text's
tokens against float32 0.075 plain, 0.063 with these scales (bf16: 0.034); argmax agreement with the
engine's bf16 94.8% plain, 95.3% with these scales. With a scale per group of 32 inputs (Q8_0, what the
int8 GEMM on AVX-512 VNNI takes) they measured no gain (96.1% with and without, same text, teacher-forced
in transformers), and their search took about 220 s on a 1B llama (45 s of it the lm_head): the engine
calibrates only where some linear keeps one scale per channel (`ModelRunner._int8_scales`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from asyncexec import envs
from asyncexec.ops import int8_gemm

__all__ = [
    "CALIBRATION_TEXT",
    "activation_scales",
    "dequantize",
    "gemm_serves",
    "quantize_weight",
    "search_scales",
]

logger = logging.getLogger(__name__)

ALPHAS = tuple(i / 10 for i in range(11))
SAMPLE_ROWS = 128  # calibration rows each linear's search multiplies

CALIBRATION_TEXT = (
    "The library opened at nine, and by ten the reading room was full. Students bent over their notes, a "
    "retired engineer compared two maps of the same valley, and a child asked the librarian why the sky "
    "turns red in the evening. She explained that sunlight travels through more air when the sun is low, "
    "so the blue light is scattered away and the red and orange remain. Later that morning a delivery of "
    "new books arrived: a history of the railways, three novels, a cookbook of soups from around the world "
    "and a guide to repairing bicycles. The cookbook began with a simple recipe. Chop two onions, soften "
    "them in butter, add four potatoes cut into cubes and a litre of stock, then simmer for twenty minutes "
    "and season with salt and pepper. In the afternoon a lecture on climate drew a large crowd. The speaker "
    "showed that average temperatures had risen by more than one degree since 1900, that glaciers in the "
    "Alps had lost half of their volume, and that cities can cool their streets by planting trees. A man in "
    "the front row asked how much it would cost. About the price of one new road, she said, and the trees "
    "keep working for a hundred years. Questions followed about electric cars, solar panels on schools and "
    "whether rivers could be cleaned. At five the room emptied. The librarian wrote a short list for the "
    "next day: order more paper, fix the lamp by the window, and find a better book about the sky.\n\n"
    "def mean(values: list[float]) -> float:\n    return sum(values) / len(values)\n\n"
    "Q: How many legs does a spider have?\nA: Eight. Q: How many days are in a week?\nA: Seven."
)


def _chats(text: str) -> list[tuple[str, str]]:
    """The text's paragraphs as (question, answer) turns: each paragraph's first sentence asks."""
    turns = []
    for para in text.split("\n\n"):
        head, _, rest = para.partition(". ")
        turns.append((head + ".", rest or head))
    return turns


def _calibration_ids(model_path: str, vocab_size: int) -> torch.Tensor:
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path)
        if getattr(tokenizer, "chat_template", None):  # a chat model: the text as the chats it serves
            chats = [[{"role": "user", "content": q}, {"role": "assistant", "content": a}]
                     for q, a in _chats(CALIBRATION_TEXT)]  # fmt: skip
            ids = [
                i for c in chats for i in tokenizer.apply_chat_template(c, tokenize=True, return_dict=False)
            ]
        else:
            ids = tokenizer.encode(CALIBRATION_TEXT)
        return torch.tensor([ids])
    except (OSError, ValueError, KeyError, TypeError) as e:  # no (usable) tokenizer in the folder
        logger.warning("int8 calibration: no tokenizer in %s (%s): random tokens instead", model_path, e)
        return torch.randint(0, vocab_size, (1, 512), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def activation_scales(model: Any, model_path: str) -> dict[torch.nn.Linear, torch.Tensor]:
    """Each `nn.Linear`'s input-channel scales `s` (float32 [K]; absent: plain int8), from one forward."""
    inputs: dict[int, torch.Tensor] = {}  # sampled rows of each distinct input (siblings share one)
    seen: dict[torch.nn.Linear, int] = {}
    alive: list[torch.Tensor] = []  # each input lives until the end: no other tensor can take its id

    def hook(mod: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        x = args[0]
        x2 = x.reshape(-1, x.shape[-1])
        if id(x) not in inputs:
            alive.append(x)
            step = max(1, x2.shape[0] // SAMPLE_ROWS)
            inputs[id(x)] = x2[::step][:SAMPLE_ROWS].float()
        assert isinstance(mod, torch.nn.Linear)
        seen[mod] = id(x)

    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    handles = [m.register_forward_pre_hook(hook) for m in linears]
    attn = model.config._attn_implementation
    try:
        try:  # the paged attention needs the engine's metadata
            model.set_attn_implementation("sdpa")
        except (ValueError, ImportError):  # a model without SDPA support
            model.set_attn_implementation("eager")
        ids = _calibration_ids(model_path, model.config.vocab_size).to(next(model.parameters()).device)
        model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
        model.set_attn_implementation(attn)
    by_input: dict[int, list[torch.nn.Linear]] = {}
    for mod, key in seen.items():
        by_input.setdefault(key, []).append(mod)
    scales = {}
    for key, mods in by_input.items():  # siblings of one input share its scales: they are packed as one
        s = search_scales(torch.cat([m.weight.detach() for m in mods]), inputs[key])
        if s is not None:
            scales.update(dict.fromkeys(mods, s))
    logger.info("int8 calibration: %d of %d linears scaled by their activations", len(scales), len(linears))
    return scales


def gemm_serves(weight: torch.Tensor) -> bool:
    """Whether asyncexec's int8 GEMM serves this weight here (Q8_0, one copy for every step): AVX-512
    VNNI, a shape it takes, and not turned off (`ASYNCEXEC_INT8_GEMV=0`). Else one scale per channel,
    activation-aware, with the GEMV and a dense copy."""
    return envs.int8_gemv_enabled() and int8_gemm.fits(weight)


def quantize_weight(
    weight: torch.Tensor, input_scales: torch.Tensor | None = None, group: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: (q [N, K] int8, scales [N] in the weight's dtype); with `group`,
    a scale per output channel and group of that many inputs (llama.cpp's Q8_0 for 32, what the int8
    GEMM takes: scales [K / group, N]). With
    `input_scales` (float32 [K], `activation_scales`), it quantizes `weight * input_scales`: the activation is
    then divided by them before the int8 matmul.

    The weights are rounded against the scales as the kernel stores them (in the weight's dtype): rounding
    against the exact float32 scales and then storing those in bf16 adds a gain error of up to 0.4% per
    channel (measured on SmolLM2: mean KL to float32 0.0066 that way, 0.0055 this way)."""
    w = weight.detach().float()
    if input_scales is not None:
        w = w * input_scales
    if group is not None:
        n, k = w.shape
        blocks = w.reshape(n, k // group, group)
        scales = (blocks.abs().amax(dim=2).clamp(min=1e-12) / 127.0).to(weight.dtype)
        q = torch.round(blocks / scales.float()[..., None]).clamp(-127, 127).to(torch.int8).reshape(n, k)
        return q, scales.t().contiguous()
    scales = (w.abs().amax(dim=1).clamp(min=1e-12) / 127.0).to(weight.dtype)
    q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
    return q, scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, input_scales: torch.Tensor | None) -> torch.Tensor:
    """The float32 weight the int8 matmul computes with (`scales` [N], or [K / group, N] per group)."""
    if scales.dim() == 2:
        n, k = q.shape
        w = (q.float().reshape(n, scales.shape[0], -1) * scales.float().t()[..., None]).reshape(n, k)
    else:
        w = q.float() * scales.float()[:, None]
    return w if input_scales is None else w / input_scales


def search_scales(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
    """The `s = m ** alpha` of least output error on rows `x`, or None where plain int8 (alpha 0) wins."""
    w = weight.float()
    ref = x @ w.T
    m = x.abs().mean(dim=0).clamp(min=1e-6)
    best: tuple[float, torch.Tensor | None] = (float("inf"), None)
    for alpha in ALPHAS:
        s = m**alpha
        s = s / (s.max() * s.min()).sqrt()  # centred on 1: the int8 range stays where the weights are
        err = float(((x @ dequantize(*quantize_weight(weight, s), s).T - ref) ** 2).mean())
        if err < best[0]:
            best = (err, None if alpha == 0 else s)
    return best[1]
