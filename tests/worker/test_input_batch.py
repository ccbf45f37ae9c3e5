"""The persistent batch and `InputBatch.prepare`: slots, block tables, chunking, preemption edge cases."""

from __future__ import annotations

import pytest

from asyncexec import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
from asyncexec.errors import ProtocolError
from asyncexec.worker.input_batch import InputBatch

SP = SamplingParams(temperature=0.0)


def _batch() -> InputBatch:
    return InputBatch(max_num_tokens=64, max_num_seqs=8, max_blocks_per_seq=16, block_size=4)


def _new(rid: str, prompt: list[int], blocks: list[int], n: int, computed: int = 0) -> SchedulerOutput:
    return SchedulerOutput(
        0, [NewRequestData(rid, prompt, SP, blocks, computed)], CachedRequestData(), {rid: n}, n
    )


def _cached(rid: str, new_blocks: list[int], computed: int, n: int, resumed: bool = False) -> SchedulerOutput:
    c = CachedRequestData([rid], [resumed], [[]], [new_blocks], [computed])
    return SchedulerOutput(1, [], c, {rid: n}, n)


def test_prompt_that_fills_blocks_exactly_then_crosses_into_a_new_block() -> None:
    b = _batch()
    so = _new("a", list(range(100, 108)), [7, 3], 8)  # 8 tokens = exactly 2 blocks of 4
    b.update_states(so)
    p = b.prepare(so)
    assert p.slot_mapping.tolist() == [28, 29, 30, 31, 12, 13, 14, 15]
    assert p.positions.tolist() == list(range(8)) and p.sample_rows == [0]
    assert p.prefills == [(0, 8, 8)] and p.prefill_block_ids[0].tolist() == [7, 3]
    b.append_sampled(["a"], [[555]])
    so = _cached("a", [9], 8, 1)  # the 9th token opens block 9
    b.update_states(so)
    p = b.prepare(so)
    assert p.input_ids.tolist() == [555] and p.positions.tolist() == [8] and p.slot_mapping.tolist() == [36]
    assert p.num_decodes == 1 and p.decode_seq_lens.tolist() == [9]
    assert p.decode_block_tables.tolist() == [[7, 3, 9]]


def test_sequence_of_length_one() -> None:
    b = _batch()
    so = _new("one", [42], [5], 1)
    b.update_states(so)
    p = b.prepare(so)
    assert p.num_decodes == 1 and p.slot_mapping.tolist() == [20] and p.decode_seq_lens.tolist() == [1]
    assert p.sample_rows == [0] and p.logits_indices.tolist() == [0]


def test_chunked_prefill_samples_only_at_the_end_of_the_prompt() -> None:
    b = _batch()
    so = _new("c", list(range(10)), [0, 1], 6)
    b.update_states(so)
    assert b.prepare(so).sample_rows == []
    so = _cached("c", [2], 6, 4)
    b.update_states(so)
    p = b.prepare(so)
    assert p.positions.tolist() == [6, 7, 8, 9] and p.slot_mapping.tolist() == [6, 7, 8, 9]
    assert p.prefills == [(0, 4, 10)] and p.sample_rows == [0]


def test_decode_rows_come_first_and_padded_table_entries_are_reset() -> None:
    b = _batch()
    b.update_states(_new("long", list(range(12)), [1, 2, 3], 12))
    b.append_sampled(["long"], [[1]])
    so = SchedulerOutput(
        1,
        [NewRequestData("short", [5, 6, 7], SP, [4], 0)],
        CachedRequestData(["long"], [False], [[]], [[6]], [12]),
        {"short": 3, "long": 1},
        4,
    )
    b.update_states(so)
    p = b.prepare(so)
    assert p.req_ids == ["long", "short"] and p.num_decodes == 1
    assert p.decode_block_tables.tolist() == [[1, 2, 3, 6]]


def test_preempted_request_is_resumed_with_new_blocks_and_keeps_its_tokens() -> None:
    b = _batch()
    b.update_states(_new("p", [1, 2, 3], [0], 3))
    b.append_sampled(["p"], [[99]])
    b.update_states(SchedulerOutput(1, [], CachedRequestData(), {}, 0, preempted_req_ids=["p"]))
    assert b.requests["p"].block_ids == [] and b.requests["p"].token_ids == [1, 2, 3, 99]
    so = _cached("p", [11], 0, 4, resumed=True)
    b.update_states(so)
    p = b.prepare(so)
    assert p.input_ids.tolist() == [1, 2, 3, 99] and p.slot_mapping.tolist() == [44, 45, 46, 47]
    assert p.sample_rows == [0]


def test_inconsistent_outputs_are_rejected() -> None:
    b = _batch()
    so = _new("x", [1, 2, 3, 4, 5], [0], 5)  # 5 tokens but one block of 4
    b.update_states(so)
    with pytest.raises(ProtocolError, match="blocks"):
        b.prepare(so)
    with pytest.raises(ProtocolError, match="never saw"):
        b.update_states(_cached("ghost", [], 0, 1))
