"""The grammar engine behind structured outputs: llguidance (Rust, no Python dependencies).

Chosen by measurement on SmolLM2's tokenizer (scripts/bench_grammar.py, numbers in docs/server.md):
a 20-field JSON schema compiles in about 2 ms (xgrammar: 10 ms, outlines-core: 225 ms), and the
bitmask of 32 constrained rows fills in about 0.35 ms per step (xgrammar: 0.12 ms, outlines-core:
1.9 ms), against a step of tens of milliseconds; its wheel is 3 MB with no dependencies, where xgrammar
pulls triton (286 MB) on Linux x86_64.

`compile_grammar` turns a request's `StructuredOutputsParams` into a matcher in its start state, or
raises `InvalidRequestError` naming the field whose value does not compile, with llguidance's error cut to
the line that says what is wrong (`_user_message`). Matchers of one grammar are `deep_copy`s of the
compiled one: the copy shares the compiled parser and costs microseconds.

A `choice` list is one lexeme (a Lark terminal `CHOICE: "a" | "b" | ...`), as a JSON schema's `enum` is:
as alternatives of a rule, each choice is an item of one Earley row, and llguidance caps a row at 2,000
items, an error it finds only while generating (5,000 choices failed after a token); its lexer takes any
number of alternatives.
"""

from __future__ import annotations

import json
import re
from typing import Any, cast

from asyncexec.errors import InvalidRequestError
from asyncexec.sampling_params import StructuredOutputsParams

__all__ = ["cache_key", "compile_grammar", "grammar_spec", "make_llg_tokenizer"]

# JSON written like json.dumps' default: one space after ',' and ':', nowhere else.
_COMPACT: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# "at line(column): " of a grammar llguidance wrote from a regex or choice: no position of the user's
_POSITION = re.compile(r"^at \d+\(\d+\): ")
_MAX_ERROR_CHARS = 300


def make_llg_tokenizer(tokenizer: Any, vocab_size: int) -> Any:
    """llguidance's view of the HF tokenizer (about 1-2 s: built once per engine, when first needed)."""
    import llguidance.hf

    if tokenizer is None:
        raise InvalidRequestError(
            "structured_outputs: needs a tokenizer in the model folder", param="structured_outputs"
        )
    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)


def cache_key(p: StructuredOutputsParams) -> str:
    """What the compiled grammar depends on, as one string (dict schemas in canonical order)."""
    schema = json.dumps(p.json, sort_keys=True) if isinstance(p.json, dict) else p.json
    return json.dumps(
        [p.kind, schema, p.regex, p.choice, p.grammar, p.disable_any_whitespace,
         p.disable_additional_properties, p.whitespace_pattern]
    )  # fmt: skip


def grammar_spec(p: StructuredOutputsParams) -> str:
    """The llguidance grammar for `p` (not yet checked: `compile_grammar` does that)."""
    from llguidance import LLMatcher, grammar_from

    kind = p.kind
    try:
        if kind in ("json", "json_object"):
            schema: Any = {"type": "object"} if kind == "json_object" else p.json
            if isinstance(schema, str):
                schema = json.loads(schema)
            if p.disable_additional_properties:
                schema = _no_additional_properties(schema)
            return str(LLMatcher.grammar_from_json_schema(schema, defaults=cast(Any, _json_options(p))))
        if kind == "regex":
            return str(LLMatcher.grammar_from_regex(p.regex or ""))
        if kind == "choice":
            return str(LLMatcher.grammar_from_lark(_choice_lark(p.choice or [])))
        return str(grammar_from("grammar", p.grammar or ""))
    except (ValueError, TypeError) as e:
        raise InvalidRequestError(f"{kind}: {_user_message(kind, str(e))}", param=kind) from None


def compile_grammar(llg_tokenizer: Any, p: StructuredOutputsParams) -> Any:
    """A matcher for `p` in its start state; `InvalidRequestError` naming the field that fails."""
    from llguidance import LLMatcher

    spec = grammar_spec(p)
    matcher = LLMatcher(llg_tokenizer, spec, log_level=0)
    if not matcher.is_error():
        matcher.compute_bitmask()  # the lexer is built lazily: build it here, in the compile thread
    if matcher.is_error():
        message = _user_message(p.kind, matcher.get_error())
        raise InvalidRequestError(f"{p.kind}: cannot be compiled: {message}", param=p.kind)
    return matcher


def _choice_lark(choice: list[str]) -> str:
    """One terminal of all the choices (see the module's notes); JSON string syntax is Lark's."""
    return "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in choice)


def _user_message(kind: str, error: str) -> str:
    """llguidance's error cut to its first line, which says what is wrong, without the parser state,
    grammar and source excerpt that follow. Two errors say it elsewhere: a regex parse error on its
    `error:` line, and a grammar that allows no text at all (a regex like `[^\\s\\S]`, a `$ref` to
    itself) only names the parser's stop reason, "NoExtensionBias"."""
    lines = error.strip().splitlines() or ["unknown error"]
    if lines[0] == "NoExtensionBias":
        return "no output can satisfy it"
    reason = next((line[len("error: ") :] for line in lines if line.startswith("error: ")), None)
    message = f"invalid regex: {reason}" if "regex parse error:" in lines[0] and reason else lines[0]
    if kind != "grammar":
        message = _POSITION.sub("", message)
    return message if len(message) <= _MAX_ERROR_CHARS else message[: _MAX_ERROR_CHARS - 3] + "..."


def _json_options(p: StructuredOutputsParams) -> dict[str, Any]:
    if p.whitespace_pattern is not None:
        return {"whitespace_flexible": True, "whitespace_pattern": p.whitespace_pattern}
    return dict(_COMPACT) if p.disable_any_whitespace else {"whitespace_flexible": True}


def _no_additional_properties(schema: Any) -> Any:
    """vLLM's `disable_additional_properties`: every object schema without its own
    `additionalProperties` gets `false`."""
    if isinstance(schema, list):
        return [_no_additional_properties(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _no_additional_properties(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out
