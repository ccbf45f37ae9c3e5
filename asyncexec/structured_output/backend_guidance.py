"""The grammar engine behind structured outputs: llguidance (Rust, no Python dependencies).

Chosen by measurement on SmolLM2's tokenizer (scripts/bench_grammar.py, numbers in docs/server.md):
a 20-field JSON schema compiles in about 2 ms (xgrammar: 10 ms, outlines-core: 225 ms), and the
bitmask of 32 constrained rows fills in about 0.35 ms per step (xgrammar: 0.12 ms, outlines-core:
1.9 ms), against a step of tens of milliseconds; its wheel is 3 MB with no dependencies, where xgrammar
pulls triton (286 MB) on Linux x86_64.

`compile_grammar` turns a request's `StructuredOutputsParams` into a matcher in its start state, or
raises `InvalidRequestError` naming the field whose value does not compile. Matchers of one grammar are
`deep_copy`s of the compiled one: the copy shares the compiled parser and costs microseconds.
"""

from __future__ import annotations

import json
from typing import Any, cast

from asyncexec.errors import InvalidRequestError
from asyncexec.sampling_params import StructuredOutputsParams

__all__ = ["cache_key", "compile_grammar", "grammar_spec", "make_llg_tokenizer"]

# JSON written like json.dumps' default: one space after ',' and ':', nowhere else.
_COMPACT: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


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
            return str(grammar_from("choice", json.dumps(p.choice)))
        return str(grammar_from("grammar", p.grammar or ""))
    except (ValueError, TypeError) as e:
        raise InvalidRequestError(f"{kind}: {e}", param=kind) from None


def compile_grammar(llg_tokenizer: Any, p: StructuredOutputsParams) -> Any:
    """A matcher for `p` in its start state; `InvalidRequestError` naming the field that fails."""
    from llguidance import LLMatcher

    spec = grammar_spec(p)
    matcher = LLMatcher(llg_tokenizer, spec, log_level=0)
    if matcher.is_error():
        raise InvalidRequestError(f"{p.kind}: cannot be compiled: {matcher.get_error()}", param=p.kind)
    matcher.compute_bitmask()  # the lexer is built lazily: build it here, in the compile thread
    if matcher.is_error():
        raise InvalidRequestError(f"{p.kind}: cannot be compiled: {matcher.get_error()}", param=p.kind)
    return matcher


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
