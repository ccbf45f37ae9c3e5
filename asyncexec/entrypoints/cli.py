"""The `asyncexec` command (also `python -m asyncexec`): make-model, generate, serve, bench, stress.

Usage errors (a bad flag or value, a missing model folder) print one line and exit with status 2;
runtime failures print one line and exit with status 1. Run `asyncexec COMMAND --help` for the flags.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

from asyncexec import envs
from asyncexec.entrypoints.cli_args import BENCHMARKS, build_parser
from asyncexec.entrypoints.config_args import engine_config_from_args
from asyncexec.errors import AsyncExecError, ConfigError

__all__ = ["build_parser", "main"]

_T = TypeVar("_T")

_SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


class UsageError(Exception):
    """A bad command line: one line on stderr and exit status 2."""


def _check_model_dir(path: str) -> None:
    from asyncexec.gguf.file import is_gguf
    from asyncexec.model_registry import builtin_model, builtin_names

    if builtin_model(path) is not None and not os.path.isdir(path):
        return  # a built-in name: its GGUF file, found when the engine starts
    if is_gguf(path) and os.path.isfile(path):
        return  # the engine checks the file itself, before any worker starts
    if not os.path.isdir(path):
        raise UsageError(
            f"model {path!r} is neither a folder, a GGUF file nor a built-in model "
            f"({', '.join(builtin_names())}); make a tiny one with `asyncexec make-model DIR`"
        )
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise UsageError(f"model folder {path!r} has no config.json: not a Hugging Face model folder")


def _make_model(ns: argparse.Namespace) -> int:
    from asyncexec.testing import make_tiny_model

    out = Path(ns.dir)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not ns.force)):
        raise UsageError(f"{str(out)!r} exists and is not an empty folder (pass --force to write into it)")
    overrides: dict[str, int] = {}
    if ns.num_layers is not None:
        overrides["num_hidden_layers" if ns.arch != "gpt2" else "n_layer"] = ns.num_layers
    if ns.hidden_size is not None:
        overrides["hidden_size" if ns.arch != "gpt2" else "n_embd"] = ns.hidden_size
    t0 = time.perf_counter()
    print(f"[1/2] building a random {ns.arch} model (seed {ns.seed}) ...", file=sys.stderr, flush=True)
    try:
        make_tiny_model(out, ns.arch, ns.seed, **overrides)
    except (TypeError, ValueError) as e:
        raise UsageError(f"cannot build that model: {e}") from None
    size = sum(f.stat().st_size for f in out.iterdir()) / 2**20
    print(f"[2/2] wrote {out} ({size:.1f} MiB) in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


async def _generate(ns: argparse.Namespace) -> int:
    from asyncexec import AsyncEngine, SamplingParams

    config = engine_config_from_args(ns)
    sp = SamplingParams(
        max_tokens=ns.max_tokens,
        temperature=ns.temperature,
        top_p=ns.top_p,
        top_k=ns.top_k,
        seed=ns.sampling_seed,
        ignore_eos=ns.ignore_eos,
    )
    print(f"starting the engine ({config.executor_kind}, {config.world_size} rank(s)) ...", file=sys.stderr)
    async with AsyncEngine(config) as engine:
        prompts = _chat_prompts(engine.tokenizer, ns.prompts) if ns.chat else list(ns.prompts)
        printer = _InOrder(len(prompts))
        t0 = time.perf_counter()

        async def one(i: int, prompt: str | list[int]) -> None:
            async for out in engine.generate(prompt, sp):
                printer.update(i, out.text or "", len(out.token_ids) if out.finished else None)

        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        dt = time.perf_counter() - t0
        print(f"{printer.tokens} tokens in {dt:.2f} s ({printer.tokens / dt:.1f} tokens/s)", file=sys.stderr)
    return 0


def _chat_prompts(tok: Any, prompts: Sequence[str]) -> list[str | list[int]]:
    """Each prompt as a user turn in the model's chat template, tokenized."""
    if tok is None or not getattr(tok, "chat_template", None):
        raise UsageError("--chat: this model's tokenizer has no chat template")
    return [
        list(
            tok.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for p in prompts
    ]


class _InOrder:
    """Streams to stdout in prompt order: the one at the cursor live, later ones buffered until it is
    done; `tokens` counts the finished outputs' tokens."""

    def __init__(self, n: int) -> None:
        self.texts = [""] * n
        self.done = [False] * n
        self.cursor = 0
        self.printed = 0  # characters of texts[cursor] already written
        self.labelled = False  # texts[cursor]'s "[i] " is written
        self.tokens = 0

    def update(self, i: int, text: str, finished_tokens: int | None) -> None:
        self.texts[i] = text
        if finished_tokens is not None:
            self.done[i] = True
            self.tokens += finished_tokens
        if i == self.cursor:
            self._flush()

    def _flush(self) -> None:
        n = len(self.texts)
        while self.cursor < n:
            i = self.cursor
            if not self.labelled and n > 1:
                sys.stdout.write(f"[{i}] ")
                self.labelled = True
            sys.stdout.write(self.texts[i][self.printed :])
            self.printed = len(self.texts[i])
            if not self.done[i]:
                break
            sys.stdout.write("\n")
            self.cursor, self.printed, self.labelled = i + 1, 0, False
        sys.stdout.flush()


async def _cancel_on_sigterm(coro: Coroutine[Any, Any, _T]) -> _T:
    """Run `coro`; SIGTERM cancels it, so `async with engine` shuts everything down on the way out."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    loop.add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        return await coro
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


def _serve(ns: argparse.Namespace) -> int:
    from asyncexec.entrypoints.api_server import run_server

    if not 0 <= ns.port <= 65535:
        raise UsageError(f"--port must be in 0..65535, got {ns.port}")
    if ns.shutdown_timeout < 0:
        raise UsageError(f"--shutdown-timeout must be >= 0, got {ns.shutdown_timeout}")
    if ns.max_request_bytes < 1:
        raise UsageError(f"--max-request-bytes must be >= 1, got {ns.max_request_bytes}")
    from asyncexec.entrypoints.guards import parse_allowed_hosts, parse_allowed_origins

    try:
        hosts = None if ns.allowed_hosts is None else parse_allowed_hosts(ns.allowed_hosts)
        origins = [] if ns.allowed_origins is None else parse_allowed_origins(ns.allowed_origins)
    except ValueError as e:
        raise UsageError(str(e)) from None
    api_key = ns.api_key if ns.api_key is not None else envs.api_key()
    if api_key is not None and not api_key.strip():
        raise UsageError("--api-key must not be empty")
    config = engine_config_from_args(ns)
    # uvicorn drains on SIGTERM, then re-raises it once its own handlers are gone: exit 0 then.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    run_server(
        config,
        ns.host,
        ns.port,
        ns.served_model_name,
        ns.shutdown_timeout,
        ns.log_level,
        max_request_bytes=ns.max_request_bytes,
        allowed_hosts=hosts,
        allowed_origins=origins,
        api_key=api_key,
        tool_call_parser=ns.tool_call_parser,
    )
    return 0


def _bench(ns: argparse.Namespace) -> int:
    names = list(BENCHMARKS) if ns.which == "all" else [ns.which]
    if not _SCRIPTS.is_dir():
        raise UsageError(
            f"the benchmark scripts live in a source checkout's scripts/ ({_SCRIPTS} is missing)"
        )
    args = (["--quick"] if ns.quick else []) + [a for a in ns.script_args if a != "--"]
    for i, name in enumerate(names, 1):
        print(f"[{i}/{len(names)}] {BENCHMARKS[name]} {' '.join(args)}", file=sys.stderr, flush=True)
        rc = subprocess.call([sys.executable, str(_SCRIPTS / BENCHMARKS[name]), *args])
        if rc != 0:
            print(f"asyncexec: error: {BENCHMARKS[name]} exited with status {rc}", file=sys.stderr)
            return rc
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    level = getattr(ns, "log_level", "warning").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if getattr(ns, "model", None) is not None:
            _check_model_dir(ns.model)
        if ns.command == "make-model":
            return _make_model(ns)
        if ns.command == "generate":
            import uvloop

            return uvloop.run(_cancel_on_sigterm(_generate(ns)))
        if ns.command == "serve":
            return _serve(ns)
        if ns.command == "bench":
            return _bench(ns)
        from asyncexec.stress import run_stress

        return run_stress(ns, wrap=_cancel_on_sigterm)
    except (UsageError, ConfigError) as e:
        parser.exit(2, f"asyncexec {ns.command}: error: {e}\n")
    except AsyncExecError as e:
        first = str(e).splitlines()[0]
        parser.exit(1, f"asyncexec {ns.command}: error: {first}\n")
    except (KeyboardInterrupt, asyncio.CancelledError):
        print(f"asyncexec {ns.command}: interrupted; the engine was shut down", file=sys.stderr)
        return 130
