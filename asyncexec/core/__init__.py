"""The scheduler's side of the engine: `Scheduler` (continuous batching, chunked prefill, preemption), the
paged KV cache's block manager (`kv_cache`) and the engine's record of a request (`request`). Nothing here
touches a tokenizer, an executor or an event loop."""
