"""int8's activation-aware scales: the search, the op's two paths with them, and the calibration forward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncexec.quantization.int8 import activation_scales, search_scales
from asyncexec.quantization.pack import INT8_MAX_ROWS, pack_linears


def _outlier_rows(rows: int, k: int, seed: int) -> torch.Tensor:
    """Activations whose few loud channels carry most of the magnitude, as in a transformer's."""
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))
    x[:, :4] *= 40.0
    return x


def _pair(k: int = 128, n: int = 96) -> tuple[torch.nn.Linear, torch.nn.Linear]:
    gen = torch.Generator().manual_seed(0)
    plain = torch.nn.Linear(k, n, bias=False)
    with torch.no_grad():  # a heavy-tailed weight per row sets a coarse int8 step
        plain.weight.copy_(torch.randn(n, k, generator=gen) ** 3 * 0.05)
    plain = plain.to(torch.bfloat16)
    aware = torch.nn.Linear(k, n, bias=False).to(torch.bfloat16)
    aware.load_state_dict(plain.state_dict())
    return plain, aware


@pytest.mark.parametrize("rows", [1, INT8_MAX_ROWS + 4])
def test_activation_aware_int8_cuts_the_error_of_loud_input_channels_on_both_paths(rows: int) -> None:
    """1 row runs the int8 kernel on the input divided by the scales, 8 rows the dequantized copy."""
    plain, aware = _pair()
    w = plain.weight.detach().float()
    s = search_scales(plain.weight.detach(), _outlier_rows(128, 128, seed=1))
    assert s is not None and s[:4].min() > 2 * s[4:].max()  # the loud channels got the fine grid
    pack_linears(torch.nn.Sequential(plain), "int8")
    pack_linears(torch.nn.Sequential(aware), "int8", input_scales={aware: s})
    x = _outlier_rows(rows, 128, seed=2).bfloat16()  # not the calibration rows
    want = x.float() @ w.T
    with torch.inference_mode():
        err_plain = (plain(x).float() - want).pow(2).mean().sqrt()
        err_aware = (aware(x).float() - want).pow(2).mean().sqrt()
    assert err_aware < 0.5 * err_plain, (err_aware, err_plain)


def test_scales_of_sibling_projections_are_shared_and_equal_over_sizes(tiny_models: dict[str, Path]) -> None:
    """q/k/v (and gate/up) read one input and are packed as one weight: one scale vector for them all.
    The calibration forward leaves the model's attention implementation as it found it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.bfloat16)
    before = model.config._attn_implementation
    scales = activation_scales(model, str(tiny_models["llama"]))
    assert model.config._attn_implementation == before
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.q_proj in scales and scales[attn.q_proj] is scales[attn.k_proj] is scales[attn.v_proj]
    if mlp.gate_proj in scales:
        assert scales[mlp.gate_proj] is scales[mlp.up_proj]
    assert all(s.shape == (m.in_features,) and s.dtype == torch.float32 for m, s in scales.items())
    stats = pack_linears(model, "int8", input_scales=scales)
    assert stats["groups"] == 2 * len(model.model.layers)
    ids = torch.tensor([[3, 14, 15, 9, 2, 6, 5, 35, 8]])
    with torch.inference_mode():  # every row alone (the int8 kernel) equals the batch (the dequantized copy)
        whole = model(ids).logits
        one = torch.cat([model(ids[:, : i + 1]).logits[:, -1:] for i in range(ids.shape[1])], dim=1)
    torch.testing.assert_close(one.float(), whole.float(), rtol=0.05, atol=0.05)
