"""Structured-output request fields of every protocol, parsed into one :class:`Constraint`.

OpenAI Chat: ``response_format`` (``text``, ``json_object``, ``json_schema``) and vLLM's extras
(``structured_outputs`` with ``json`` / ``regex`` / ``choice`` / ``grammar`` / ``json_object``, and the
older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``). Responses:
``text.format``. Anthropic: ``output_config.format`` (``json_schema``). At most one constraint per
request; two are a 400 naming the second. Errors name the field; compilation (off the event loop,
:func:`grammar_for`) reports an impossible schema or a bad grammar the same way.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any

from ninfer.api import convert
from ninfer.api.errors import APIError, invalid, unsupported
from ninfer.api.validation import Fields
from ninfer.runtime.structured import Constraint, GrammarState, StructuredError, StructuredUnavailable

GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
BACKENDS = (None, "auto", "xgrammar")  # what "guided_decoding_backend" / "structured_outputs.backend" may ask for


def api_error(err: StructuredError) -> APIError:
    """A constraint error as a 400 naming its field."""
    code = "structured_output_unavailable" if isinstance(err, StructuredUnavailable) else "invalid_structured_output"
    return APIError(400, str(err), code=code, param=err.param)


def _build(make: Any, *args: Any) -> Constraint:
    try:
        return make(*args)
    except StructuredError as err:
        raise api_error(err) from None


def _schema_of(value: Any, param: str) -> Constraint:
    if not isinstance(value, (dict, str)):
        raise invalid(f"'{param}' must be a JSON Schema object", param)
    return _build(Constraint.json_schema, value, param)


def _openai_format(fmt: Fields, nested: bool) -> Constraint | None:
    """``response_format`` (Chat: the schema under ``json_schema``) or ``text.format`` (Responses: flat)."""
    kind = fmt.str("type", required=True, choices=("text", "json_object", "json_schema"))
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint.json_object(fmt.prefix.rstrip(".") or "response_format")
    spec = fmt.sub("json_schema", required=True) if nested else fmt
    spec.str("name", required=not nested)
    spec.str("description")
    spec.bool("strict")  # strict or not, the schema is enforced (OpenAI's strict semantics)
    if not spec.has("schema"):
        raise invalid(f"'{spec.path('schema')}' is required", spec.path("schema"), code="missing_required_parameter")
    return _schema_of(spec.data["schema"], spec.path("schema"))


def _vllm(f: Fields) -> list[Constraint]:
    found: list[Constraint] = []
    so = f.sub("structured_outputs")
    if so is not None:
        for key in so.data:
            if key not in (*STRUCTURED_KEYS, "backend") and so.data[key] is not None:
                raise unsupported(so.path(key), "structured_outputs supports json, regex, choice, grammar and "
                                                "json_object")
        if so.str("backend") not in BACKENDS:
            raise unsupported(so.path("backend"), "only the xgrammar backend is available")
        found += _vllm_values(so, {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar"})
        if so.bool("json_object"):
            found.append(Constraint.json_object(so.path("json_object")))
    found += _vllm_values(f, {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                              "guided_grammar": "grammar"})
    if f.str("guided_decoding_backend") not in BACKENDS:
        raise unsupported("guided_decoding_backend", "only the xgrammar backend is available")
    if f.data.get("guided_whitespace_pattern") is not None:
        raise unsupported("guided_whitespace_pattern", "JSON is generated compactly")
    return found


def _vllm_values(f: Fields, names: dict[str, str]) -> list[Constraint]:
    found = []
    for name, kind in names.items():
        value, path = f.data.get(name), f.path(name)
        if value is None:
            continue
        if kind == "json":
            found.append(_schema_of(value, path))
        elif kind == "choice":
            items = f.list(name, nonempty=True)
            found.append(_build(Constraint.choice, items, path))
        else:
            text = f.str(name)
            if not text:
                raise invalid(f"'{path}' must be a non-empty string", path)
            found.append(_build(Constraint.regex if kind == "regex" else Constraint.grammar, text, path))
    return found


def _one(found: list[Constraint]) -> Constraint | None:
    if len(found) > 1:
        raise invalid(f"'{found[1].param}' conflicts with '{found[0].param}': a request takes one output constraint",
                      found[1].param, code="conflicting_structured_output")
    return found[0] if found else None


def from_chat(f: Fields, tools: Constraint | None = None) -> Constraint | None:
    """The constraint of a Chat Completions body (``response_format``, vLLM's extras, or ``tools``: the
    forced tool call of :func:`tool_choice`), or None."""
    found = [tools] if tools is not None else []
    fmt = f.sub("response_format")
    if fmt is not None and (c := _openai_format(fmt, nested=True)) is not None:
        found.append(c)
    return _one(found + _vllm(f))


def from_responses(text: Fields | None, tools: Constraint | None = None) -> Constraint | None:
    """The constraint of a Responses body's ``text.format`` (or ``tools``, a forced tool call), or None."""
    fmt = text.sub("format") if text is not None else None
    c = _openai_format(fmt, nested=False) if fmt is not None else None
    return _one([x for x in (tools, c) if x is not None])


def from_anthropic(output_config: Fields | None, tools: Constraint | None = None) -> Constraint | None:
    """The constraint of a Messages body's ``output_config.format`` (``{"type": "json_schema", "schema"}``)
    or ``tools`` (a forced tool call), or None."""
    fmt = output_config.sub("format") if output_config is not None else None
    found = [tools] if tools is not None else []
    if fmt is not None:
        fmt.str("type", required=True, choices=("json_schema",))
        if not fmt.has("schema"):
            raise invalid(f"'{fmt.path('schema')}' is required", fmt.path("schema"),
                          code="missing_required_parameter")
        found.append(_schema_of(fmt.data["schema"], fmt.path("schema")))
    return _one(found)


def echo_format(c: Constraint | None) -> dict[str, Any]:
    """The ``text.format`` a Responses object repeats."""
    if c is None:
        return {"type": "text"}
    if c.kind == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "schema": json.loads(c.text), "strict": True}


async def grammar_for(llm: Any, c: Constraint, thinking: bool) -> GrammarState:
    """Compile ``c`` on a worker thread (never on the event loop or the engine thread)."""
    try:
        return await asyncio.to_thread(llm.structured.state, c, thinking)
    except StructuredError as err:
        raise api_error(err) from None


def tool_choice(value: Any, tools: list[dict[str, Any]] | None, path: str = "tool_choice",
                parallel: bool | None = None) -> tuple[str, Constraint | None]:
    """``(template tool_choice, constraint)``: ``auto`` / ``none`` as before; a forced call (OpenAI
    ``required`` or a named function, Anthropic ``any`` or ``tool``) renders the tools as ``auto`` does and
    constrains the answer to tool calls in the model's XML format whose arguments fit the schemas."""
    kind = value.get("type") if isinstance(value, dict) else value
    if kind not in ("required", "any", "function", "tool"):
        return convert.tool_choice(value, path), None
    if not tools:
        where = f"{path}.type" if isinstance(value, dict) else path
        raise invalid(f"'{where}' forces a tool call but no tools are declared", where)
    name = None
    if kind in ("function", "tool"):
        fn = value.get("function") if isinstance(value.get("function"), dict) else value
        name = fn.get("name")
        where = f"{path}.function.name" if fn is not value else f"{path}.name"
        if not isinstance(name, str) or not name:
            raise invalid(f"'{where}' must be a function name", where)
    else:
        where = path
    if isinstance(value, dict) and value.get("disable_parallel_tool_use") is True:  # Anthropic's spelling
        parallel = False
    return "auto", _build(Constraint.tool_call, tools, name, parallel is not False, where)
