"""Speculative decoding without a draft model (vLLM's `speculative_config`, method "ngram").

- `config.SpeculativeConfig`: the validated `EngineConfig.speculative_config`;
- `ngram.NgramProposer`: prompt lookup, the continuation of the request's last n-gram where it occurred
  before in its prompt or output;
- `policy.SpecDecodePolicy`: which requests propose how many draft tokens in a step (per-request
  acceptance and the batch size decide), and the `spec_decode` counters.

The scheduler asks the policy for each decoding request's drafts and schedules them as extra query
tokens; the worker verifies them in the same forward and keeps the longest prefix its sampler agrees
with (`asyncexec.worker.spec_verify`).
"""

from asyncexec.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
