"""Every message that crosses a process boundary, as typed msgspec Structs.

Nothing else is ever sent, and nothing is pickled. All Structs are `array_like` (no field names on the
wire) and `gc=False` (they hold no cycles). The top-level envelopes are tagged, so that one typed
`Decoder(Union[...])` per inbox validates a frame and `match` dispatches it.

Envelopes come in pairs that share a tag and a field layout: the sender encodes `RPCRequest` with the
call's arguments as values, the receiver decodes `RPCRequestFrame`, whose arguments stay `msgspec.Raw`
until the receiver knows the method and so the types to decode them as. The same holds for
`RPCReply` / `RPCReplyFrame`.

Start-up order on every channel: executor spawns every rank (a `WorkerSpawn` on the worker's stdin)
-> each worker connects and sends `Ready` or `StartupFailed` -> the executor waits for all ranks.
"""

from __future__ import annotations

from typing import Any

import msgspec
import torch

from asyncexec.config import EngineConfig
from asyncexec.ipc.channel import CurveClientKeys
from asyncexec.sampling_params import SamplingParams

__all__ = [
    "CachedRequestData",
    "ExecutorInbox",
    "Logprobs",
    "ModelRunnerOutput",
    "NewRequestData",
    "PromptLogprobs",
    "RPCReply",
    "RPCReplyFrame",
    "RPCRequest",
    "RPCRequestFrame",
    "Ready",
    "RemoteError",
    "SchedulerOutput",
    "Shutdown",
    "StartupFailed",
    "WorkerInbox",
    "WorkerSpawn",
]


class _Wire(msgspec.Struct, array_like=True, gc=False, forbid_unknown_fields=True):
    pass


# ----- the step: scheduler -> workers -> scheduler -------------------------------------------------


class NewRequestData(_Wire):
    """A request scheduled for the first time (or again after preemption): sent in full, once.

    `prompt_token_ids` is every token so far (a request sent again after the workers were replaced
    carries its output too); `num_prompt_tokens` says where its real prompt ends, which penalties and
    prompt logprobs need (-1: all of them).
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    num_prompt_tokens: int = -1


class CachedRequestData(_Wire):
    """Requests the workers already hold, as column deltas (one entry per request, same order).

    `new_block_ids` holds the blocks appended this step, or, for a request resumed after preemption
    (`resumed_from_preemption`), all of its blocks, which replace the ones it lost. `new_token_ids` holds
    tokens the workers do not have yet; the engine's scheduler always sends it empty, since every rank
    appends the tokens it samples itself and keeps a preempted request's tokens (only its blocks are
    dropped), while a request the workers do not hold at all is sent in full as `NewRequestData`. It
    stays on the wire, as in vLLM, for a scheduler that changes tokens behind the workers' back.
    """

    req_ids: list[str] = msgspec.field(default_factory=list)
    resumed_from_preemption: list[bool] = msgspec.field(default_factory=list)
    new_token_ids: list[list[int]] = msgspec.field(default_factory=list)
    new_block_ids: list[list[int]] = msgspec.field(default_factory=list)
    num_computed_tokens: list[int] = msgspec.field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


class SchedulerOutput(_Wire):
    """One step's work for every rank.

    Structured outputs: `grammar_bitmask` (int32 `[len(structured_output_request_ids), ceil(V / 32)]`,
    bit `t % 32` of word `t // 32` set where token `t` is allowed) holds one row per constrained request
    that samples in this step, in `structured_output_request_ids` order; every rank applies it to those
    requests' logits before sampling. Large masks travel through the shared-memory tensor path.

    Speculative decoding: `scheduled_spec_decode_tokens[req_id]` holds a decoding request's draft tokens
    (vLLM's name); its `num_scheduled_tokens` is then 1 + their number, and its row verifies them.
    """

    step_id: int
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: list[str] = msgspec.field(default_factory=list)
    preempted_req_ids: list[str] = msgspec.field(default_factory=list)
    structured_output_request_ids: list[str] = msgspec.field(default_factory=list)
    grammar_bitmask: torch.Tensor | None = None
    scheduled_spec_decode_tokens: dict[str, list[int]] = msgspec.field(default_factory=dict)


class Logprobs(_Wire):
    """One row per sampled token, requests in `ModelRunnerOutput.req_ids` order (a request's tokens of a
    step consecutive): entry 0 is the sampled token, entries 1.. the top-n, each with its log-probability."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    sampled_token_ranks: list[int]


class PromptLogprobs(_Wire):
    """One request's prompt logprobs from one prefill chunk: entry `i` scores the prompt token at
    position `start + i` (its logprob, then the top-k's), from the logits of the row before it. A
    chunked prefill sends consecutive pieces over several steps; full-vocabulary rows never travel."""

    start: int
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


class ModelRunnerOutput(_Wire):
    """What a step produced, one entry per scheduled request in `req_ids` order (`prompt_logprobs` only
    for the requests that asked and were prefilled in this step)."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: Logprobs | None = None
    prompt_logprobs: dict[str, PromptLogprobs] = msgspec.field(default_factory=dict)


# ----- control plane: executor <-> worker -----------------------------------------------------------


class RemoteError(_Wire):
    """An exception raised on a worker, as text (exceptions are not sent as objects)."""

    type: str
    message: str
    traceback: str


class RPCRequest(_Wire, tag="rpc"):
    """Executor -> every rank: call `method(*args, **kwargs)` on the worker. Sender's view."""

    call_id: int
    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class RPCRequestFrame(_Wire, tag="rpc"):
    """Receiver's view of `RPCRequest`: arguments are decoded once the method's types are known."""

    call_id: int
    method: str
    args: list[msgspec.Raw]
    kwargs: dict[str, msgspec.Raw]


class RPCReply(_Wire, tag="reply"):
    """Rank -> executor: the result of one call, or the error it raised. Sender's view."""

    call_id: int
    rank: int
    result: Any
    error: RemoteError | None = None


class RPCReplyFrame(_Wire, tag="reply"):
    """Receiver's view of `RPCReply`."""

    call_id: int
    rank: int
    result: msgspec.Raw
    error: RemoteError | None = None


class Shutdown(_Wire, tag="shutdown"):
    """Executor -> rank: leave the loop, release resources, exit 0."""


class Ready(_Wire, tag="ready"):
    """Rank -> executor, once at start: the worker is built and serving."""

    rank: int
    pid: int
    arena: str | None


class StartupFailed(_Wire, tag="startup_failed"):
    """Rank -> executor, once at start, instead of `Ready`."""

    rank: int
    error: RemoteError


class WorkerSpawn(_Wire):
    """Executor -> new worker process, on its stdin: everything the rank needs to start."""

    rank: int
    local_rank: int
    world_size: int
    config: EngineConfig
    request_addr: str
    reply_addr: str
    executor_pid: int
    executor_arena: str | None
    sys_path: list[str]
    distributed_init_method: str | None = None
    curve: CurveClientKeys | None = None  # set where the channel is TCP (no shared memory)


WorkerInbox = RPCRequestFrame | Shutdown
ExecutorInbox = RPCReplyFrame | Ready | StartupFailed
