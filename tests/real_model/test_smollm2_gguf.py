"""The built-in model is its GGUF file, served as it ships: what the default mode costs in quality.

smollm2's file holds Q4_1 linears and a Q8_0 embedding (tied to the lm_head). The default mode
(`dtype="auto"`) keeps them: the int4 and int8 GEMMs on the file's codes, bf16 activations. Measured
against float32 (every tensor dequantized, which equals transformers' own GGUF load token for token:
tests/real_model/test_smollm2.py) by teacher-forced argmax agreement over ~840 tokens of real text.
"""

from __future__ import annotations

from typing import Any

from tests.real_model.test_smollm2_int8 import QUESTION, TEXT, _argmax_agreement, _score


async def test_the_default_mode_keeps_float32s_argmax_and_answers_paris(smollm2_tokenizer: Any) -> None:
    ids = smollm2_tokenizer.encode(TEXT)
    chat = list(
        smollm2_tokenizer.apply_chat_template(
            [{"role": "user", "content": QUESTION}],
            add_generation_prompt=True, tokenize=True, return_dict=False,
        )
    )  # fmt: skip
    kept, answer, stats = await _score(ids, chat, dtype="auto")
    assert stats["graph_steps"] > 0, stats
    reference, _, _ = await _score(ids, None, dtype="float32")
    dense, _, _ = await _score(ids, None, dtype="bfloat16")
    agreement = _argmax_agreement(kept, reference)
    print(f"as shipped: argmax agreement with float32 {agreement:.1%}, bf16 dequantized "
          f"{_argmax_agreement(dense, reference):.1%}, over {len(reference)} positions")  # fmt: skip
    assert agreement >= 0.95, f"the file as shipped agrees with float32 at only {agreement:.1%} of positions"
    assert answer is not None and "Paris" in (answer.text or ""), answer
