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
from typing import Any, NoReturn, TypeVar

from asyncexec import envs
from asyncexec.entrypoints.config_args import add_engine_args, engine_config_from_args
from asyncexec.errors import AsyncExecError, ConfigError

__all__ = ["main"]

_T = TypeVar("_T")

BENCHMARKS = {"ipc": "bench_ipc.py", "engine": "bench_engine.py", "serve": "bench_serve.py"}
_SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class UsageError(Exception):
    """A bad command line: one line on stderr and exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    from asyncexec.models import ARCHS

    parser = _Parser(prog="asyncexec", description="An asyncio-native execution runtime for LLM inference.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser(
        "make-model", help="write a tiny random Hugging Face model folder (nothing is downloaded)"
    )
    p.add_argument("dir", metavar="DIR", help="the folder to write")
    p.add_argument("--arch", choices=ARCHS, default="llama", help="the architecture (default: llama)")
    p.add_argument("--seed", type=int, default=0, help="the weights' random seed (default: 0)")
    p.add_argument("--num-layers", type=int, default=None, help="transformer layers (default: 2)")
    p.add_argument("--hidden-size", type=int, default=None, help="hidden size (default: 64)")
    p.add_argument("--force", action="store_true", help="write into a folder that is not empty")

    p = sub.add_parser("generate", help="stream completions of PROMPTs to the terminal")
    p.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompt texts, generated concurrently")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt (default: 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default: 1)")
    p.add_argument("--top-k", type=int, default=0, help="top-k sampling, 0 disables it (default: 0)")
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template as a user turn")
    _common(p)

    p = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    p.add_argument("--host", default="127.0.0.1", help="the address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="the port to bind (default: 8000)")
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model's name in the API (default: the --model argument)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=int,
        default=30,
        help="on SIGTERM, seconds running requests may take to finish before they are aborted (default: 30)",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=4 << 20,
        help="larger request bodies are refused with 413 (default: 4194304, 4 MiB)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=["hermes"],
        default=None,
        help="read tool calls from the model's text (<tool_call>{json}</tool_call>): tool_choice auto, none",
    )
    p.add_argument(
        "--allowed-hosts",
        default=None,
        metavar="HOST[,HOST...]",
        help="Host header values answered, a port aside; others get 421, which stops DNS rebinding "
        "(default: the --host address, localhost, 127.0.0.1, [::1]; * answers any)",
    )
    p.add_argument(
        "--allowed-origins",
        default=None,
        metavar="ORIGIN[,ORIGIN...]",
        help="origins (https://app.example.com) whose web pages may call the API: CORS headers are "
        "answered to them only (default: none, no CORS headers; * allows any)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="require `Authorization: Bearer KEY` on /v1/*, /tokenize and /detokenize (401 otherwise); "
        "/health, /metrics and /version stay open (default: the ASYNCEXEC_API_KEY environment variable, "
        "else no key)",
    )
    _common(p, default_level="info")

    p = sub.add_parser("bench", help="run the benchmark scripts (each prints a table and writes JSON)")
    p.add_argument(
        "which", choices=[*BENCHMARKS, "all"], nargs="?", default="all", help="which (default: all)"
    )
    p.add_argument("--quick", action="store_true", help="the scripts' short versions")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="more arguments for the script(s), after --")

    from asyncexec.stress import add_stress_args

    p = sub.add_parser("stress", help="a bounded stress run that checks the runtime's invariants")
    add_stress_args(p)
    _common(p, model=False)
    return parser


def _common(p: argparse.ArgumentParser, default_level: str = "warning", model: bool = True) -> None:
    from asyncexec.model_registry import DEFAULT_MODEL

    p.add_argument(
        "--log-level",
        default=default_level,
        choices=["debug", "info", "warning", "error"],
        help=f"logging level (default: {default_level})",
    )
    add_engine_args(p, default_model=DEFAULT_MODEL if model else None)


def _check_model_dir(path: str) -> None:
    from asyncexec.model_registry import builtin_model, builtin_names

    if builtin_model(path) is not None and not os.path.isdir(path):
        return  # a built-in name: converted (once) when the engine starts
    if not os.path.isdir(path):
        raise UsageError(
            f"model {path!r} is neither a folder nor a built-in model ({', '.join(builtin_names())}); "
            "make a tiny one with `asyncexec make-model DIR`"
        )
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise UsageError(f"model folder {path!r} has no config.json: not a Hugging Face model folder")


def _make_model(ns: argparse.Namespace) -> int:
    from asyncexec.models import make_tiny_model

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
        prompts: list[str | list[int]] = list(ns.prompts)
        if ns.chat:
            tok = engine.tokenizer
            if tok is None or not getattr(tok, "chat_template", None):
                raise UsageError("--chat: this model's tokenizer has no chat template")
            prompts = [
                list(
                    tok.apply_chat_template(
                        [{"role": "user", "content": p}],
                        add_generation_prompt=True,
                        tokenize=True,
                        return_dict=False,
                    )
                )
                for p in ns.prompts
            ]
        # Prompts print in order: the one at the cursor streams live, later ones buffer until it is done.
        texts = [""] * len(prompts)
        done = [False] * len(prompts)
        printed, cursor = [0], [0]
        t0, total = time.perf_counter(), [0]

        def flush() -> None:
            while cursor[0] < len(prompts):
                i = cursor[0]
                if printed[0] == 0 and len(prompts) > 1:
                    sys.stdout.write(f"[{i}] ")
                sys.stdout.write(texts[i][printed[0] :])
                printed[0] = len(texts[i])
                if not done[i]:
                    break
                sys.stdout.write("\n")
                cursor[0], printed[0] = i + 1, 0
            sys.stdout.flush()

        async def one(i: int, prompt: str | list[int]) -> None:
            async for out in engine.generate(prompt, sp):
                texts[i] = out.text or ""
                if out.finished:
                    done[i] = True
                    total[0] += len(out.token_ids)
                if i == cursor[0]:
                    flush()

        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        dt = time.perf_counter() - t0
        print(f"{total[0]} tokens in {dt:.2f} s ({total[0] / dt:.1f} tokens/s)", file=sys.stderr)
    return 0


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
