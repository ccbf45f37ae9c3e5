"""Every `EngineConfig` field as a command-line flag of the same name (`max_num_seqs` -> `--max-num-seqs`).

Types, choices and defaults come from the dataclass and help texts from its docstring, so the flags can
never drift from the config. Flags that are not given are not passed: `EngineConfig`'s defaults apply.
An optional field takes `none` for None; booleans come as `--flag` / `--no-flag`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import types
import typing
from typing import Any, Literal

from asyncexec.config import EngineConfig
from asyncexec.errors import ConfigError
from asyncexec.spec_decode import SpeculativeConfig

__all__ = ["add_engine_args", "engine_config_from_args"]

_FIELD_DOC = re.compile(r"^ {8}(\w+): (.*)$")
_ALIASES = {"tensor_parallel_size": ("--tp",)}  # vLLM's short spelling


def _field_docs() -> dict[str, str]:
    docs: dict[str, str] = {}
    name = None
    for line in (EngineConfig.__doc__ or "").splitlines():
        m = _FIELD_DOC.match(line)
        if m:
            name = m.group(1)
            docs[name] = m.group(2)
        elif name is not None and line.startswith(" " * 12):
            docs[name] += " " + line.strip()
        else:
            name = None
    return docs


def _converter(name: str, tp: Any) -> tuple[Any, dict[str, Any]]:
    """The argparse `type` and extra keywords for a field's annotation."""
    args = typing.get_args(tp)
    optional = typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args
    base = next(a for a in args if a is not type(None)) if optional else tp
    if base is bool:
        return None, {"action": argparse.BooleanOptionalAction}
    if base is SpeculativeConfig:
        return _nullable(_json_config, optional), {"metavar": "JSON"}
    if typing.get_origin(base) is tuple:
        return _nullable(int, optional), {"nargs": "+", "metavar": "N"}
    if typing.get_origin(base) is Literal:
        choices = [str(c) for c in typing.get_args(base)]

        def choice(text: str) -> str:
            if text not in choices:
                raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(choices)}")
            return text

        metavar = "{" + ",".join(choices + (["none"] if optional else [])) + "}"
        return _nullable(choice, optional), {"metavar": metavar}
    base_type = {int: int, float: float, str: str}[base]
    return _nullable(base_type, optional), {"metavar": base_type.__name__.upper()}


def _json_config(text: str) -> SpeculativeConfig:
    """`--speculative-config '{"method": "ngram", ...}'`: JSON, checked as the config checks it."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from e
    try:
        return SpeculativeConfig.from_value(value)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


_json_config.__name__ = "JSON"


def _nullable(conv: Any, optional: bool) -> Any:
    if not optional:
        return conv

    def convert(text: str) -> Any:
        return None if text.lower() == "none" else conv(text)

    convert.__name__ = getattr(conv, "__name__", "value")
    return convert


def add_engine_args(parser: argparse.ArgumentParser, *, default_model: str | None = None) -> None:
    """Add a flag for every `EngineConfig` field to `parser`; `--model` defaults to `default_model`."""
    docs = _field_docs()
    hints = typing.get_type_hints(EngineConfig)
    group = parser.add_argument_group("engine (every EngineConfig field)")
    for f in dataclasses.fields(EngineConfig):
        conv, extra = _converter(f.name, hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else None
        doc = docs.get(f.name, "").replace("%", "%%")
        shown = "none" if default is None else default
        if f.name == "model" and default_model is not None:
            shown = default_model
        help_text = f"{doc} (default: {shown})"
        kw: dict[str, Any] = dict(extra, default=argparse.SUPPRESS, help=help_text, dest=f.name)
        if conv is not None:
            kw["type"] = conv
        if f.name == "model":
            kw["metavar"] = "DIR|FILE.gguf|NAME"
            if default_model is not None:
                kw["default"] = default_model
        flags = ["--" + f.name.replace("_", "-"), *_ALIASES.get(f.name, ())]
        group.add_argument(*flags, **kw)


def engine_config_from_args(ns: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """An `EngineConfig` from the flags given (raises `ConfigError` naming a bad value)."""
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineConfig) if hasattr(ns, f.name)}
    if isinstance(values.get("cudagraph_capture_sizes"), list):
        values["cudagraph_capture_sizes"] = tuple(values["cudagraph_capture_sizes"])
    values.update(overrides)
    return EngineConfig(**values)
