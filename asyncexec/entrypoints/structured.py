"""The server's structured-output fields, as one `StructuredOutputsParams` for the engine.

Sources, of which a request may use one (two that both constrain the output are refused, naming them):
- `response_format`: OpenAI's `{"type": "json_object"}` and `{"type": "json_schema", "json_schema":
  {"name", "schema", "strict"}}` (`"text"` constrains nothing). The output is always held to the schema,
  whatever `strict` says;
- `structured_outputs`: vLLM's extra body, the `StructuredOutputsParams` fields;
- `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (with `guided_whitespace_pattern`
  for `guided_json`): vLLM's older aliases;
- a named or `"required"` `tool_choice` (see `tool_calls`).
Errors name the field the request used (`guided_choice`, `response_format`, ...), here and when the
engine's compile of the grammar fails later.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from asyncexec.errors import InvalidRequestError
from asyncexec.sampling_params import StructuredOutputsParams

__all__ = ["JsonSchemaFormat", "ResponseFormat", "StructuredFields", "structured_outputs_from"]


class JsonSchemaFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredFields(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The request fields both endpoints share (a base of `_Sampling`)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None


def structured_outputs_from(
    req: StructuredFields, tool_schema: dict[str, Any] | None = None
) -> tuple[str, StructuredOutputsParams] | None:
    """The one constraint `req` asks for, with the field that asked; `tool_schema` is a tool choice's."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    if req.structured_outputs is not None:
        found.append(("structured_outputs", req.structured_outputs))
    rf = req.response_format
    if rf is not None and rf.type != "text":
        found.append(("response_format", _params("response_format", **_response_format(rf))))
    if req.guided_whitespace_pattern is not None and req.guided_json is None:
        raise InvalidRequestError(
            "guided_whitespace_pattern applies to guided_json only", param="guided_whitespace_pattern"
        )
    for field, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                        ("guided_grammar", "grammar")):  # fmt: skip
        value = getattr(req, field)
        if value is not None:
            extra = {"whitespace_pattern": req.guided_whitespace_pattern} if kind == "json" else {}
            found.append((field, _params(field, **{kind: value}, **extra)))
    if tool_schema is not None:
        found.append(("tool_choice", _params("tool_choice", json=tool_schema)))
    if len(found) > 1:
        names = " and ".join(f for f, _ in found)
        raise InvalidRequestError(
            f"{found[1][0]}: {names} both constrain the output; give one", param=found[1][0]
        )
    return found[0] if found else None


def _response_format(rf: ResponseFormat) -> dict[str, Any]:
    if rf.type == "json_object":
        return {"json_object": True}
    if rf.json_schema is None or rf.json_schema.schema is None:
        raise InvalidRequestError(
            "response_format: type json_schema needs json_schema.schema", param="response_format"
        )
    return {"json": rf.json_schema.schema}


def _params(field: str, **fields: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except InvalidRequestError as e:
        raise InvalidRequestError(f"{field}: {e}", param=field) from None
