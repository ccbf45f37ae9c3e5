"""The `asyncexec` command line's parser: one subcommand per duty, the engine's flags from
`EngineConfig` (`config_args`)."""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

from asyncexec.entrypoints.config_args import add_engine_args

__all__ = ["BENCHMARKS", "build_parser"]

BENCHMARKS = {"ipc": "bench_ipc.py", "engine": "bench_engine.py", "serve": "bench_serve.py"}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="asyncexec", description="An asyncio-native execution runtime for LLM inference.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    _add_make_model(sub)
    _add_generate(sub)
    _add_serve(sub)
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


def _add_make_model(sub: Any) -> None:
    from asyncexec.testing import ARCHS

    p = sub.add_parser(
        "make-model", help="write a tiny random Hugging Face model folder (nothing is downloaded)"
    )
    p.add_argument("dir", metavar="DIR", help="the folder to write")
    p.add_argument("--arch", choices=ARCHS, default="llama", help="the architecture (default: llama)")
    p.add_argument("--seed", type=int, default=0, help="the weights' random seed (default: 0)")
    p.add_argument("--num-layers", type=int, default=None, help="transformer layers (default: 2)")
    p.add_argument("--hidden-size", type=int, default=None, help="hidden size (default: 64)")
    p.add_argument("--force", action="store_true", help="write into a folder that is not empty")


def _add_generate(sub: Any) -> None:
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


def _add_serve(sub: Any) -> None:
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


def _common(p: argparse.ArgumentParser, default_level: str = "warning", model: bool = True) -> None:
    from asyncexec.model_registry import DEFAULT_MODEL

    p.add_argument(
        "--log-level",
        default=default_level,
        choices=["debug", "info", "warning", "error"],
        help=f"logging level (default: {default_level})",
    )
    add_engine_args(p, default_model=DEFAULT_MODEL if model else None)
