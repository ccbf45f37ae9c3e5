"""The engine process's side: `AsyncEngine` (the step loop), `EngineCore` (a step without the tokenizer:
schedule, run on every rank, update), the executor's supervisor, and the processing of inputs (tokenize,
validate) and outputs (detokenize, stop strings, `n > 1`), and the metrics."""

from asyncexec.engine.async_engine import AsyncEngine

__all__ = ["AsyncEngine"]
