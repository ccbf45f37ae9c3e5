"""EngineConfig and SamplingParams: frozen, validated, with messages that name the field."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from asyncexec import ConfigError, EngineConfig, InvalidRequestError, SamplingParams


def test_defaults_and_derived_values() -> None:
    cfg = EngineConfig()
    assert cfg.model is None and cfg.world_size == 1 and cfg.executor_kind == "uni"
    assert EngineConfig(tensor_parallel_size=2).executor_kind == "mp"
    assert EngineConfig(tensor_parallel_size=2, executor="uni").executor_kind == "uni"


def test_config_is_frozen() -> None:
    cfg = EngineConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.tensor_parallel_size = 2  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tensor_parallel_size", 0),
        ("tensor_parallel_size", True),
        ("executor", "threads"),
        ("device", "tpu"),
        ("worker_extension", "no_colon"),
        ("worker_extension", "a:b:c"),
        ("rpc_timeout_s", 0),
        ("rpc_timeout_s", -1.0),
        ("worker_start_timeout_s", 0),
        ("shm_arena_bytes", -1),
        ("inline_tensor_bytes", 1.5),
        ("model", ""),
        ("batch_invariant", "yes"),
    ],
)
def test_invalid_fields_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        EngineConfig(**{field: value})  # type: ignore[arg-type]


def test_the_batch_invariant_mode_is_refused_on_cuda() -> None:
    with pytest.raises(ConfigError, match="batch_invariant=True runs on CPU only"):
        EngineConfig(batch_invariant=True, device="cuda")
    assert EngineConfig(batch_invariant=True, device="cpu").batch_invariant


def test_config_travels_as_msgpack_and_is_validated_on_decode() -> None:
    cfg = EngineConfig(tensor_parallel_size=2, worker_extension="a.b:C", rpc_timeout_s=None)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(cfg), type=EngineConfig) == cfg
    bad = msgspec.msgpack.encode({**msgspec.to_builtins(cfg), "tensor_parallel_size": 0})
    with pytest.raises(msgspec.ValidationError, match="tensor_parallel_size"):
        msgspec.msgpack.decode(bad, type=EngineConfig)


def test_replace_validates_again() -> None:
    with pytest.raises(ConfigError):
        EngineConfig().replace(tensor_parallel_size=-3)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", 2.0),
        ("seed", "x"),
        ("stop_token_ids", [-1]),
        ("logprobs", -2),
        ("top_k", 1.5),
    ],
)
def test_bad_sampling_params_name_the_field(field: str, value: object) -> None:
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_capture_sizes_all_above_max_num_seqs_are_refused() -> None:
    # every worker died at start-up with "max() arg is an empty sequence" before
    with pytest.raises(ConfigError, match=r"cudagraph_capture_sizes \[16, 32\] are all above max_num_seqs=8"):
        EngineConfig(max_num_seqs=8, cudagraph_capture_sizes=(32, 16))
    assert EngineConfig(max_num_seqs=8, cudagraph_capture_sizes=(32, 8)).capture_sizes == [8]
