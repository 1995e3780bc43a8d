"""Checks of a tool's parameters schema: an object schema whose subschemas are schemas, bounded in size.

The chat template renders the schema into the prompt and the tool-call parser reads property
types from it, so a schema that is not one (``"properties": "x"``), or one nested or sized past
reason, is a 400 naming the tool and the place in the schema.
"""
from __future__ import annotations

from typing import Any

from ninfer.api.errors import invalid
from ninfer.api.validation import type_name

MAX_SCHEMA_DEPTH = 32  # nested subschemas
MAX_SCHEMA_NODES = 10_000  # subschemas in one tool's schema
_ONE = ("items", "additionalProperties", "additionalItems", "not", "contains", "propertyNames", "if", "then",
        "else", "unevaluatedItems", "unevaluatedProperties")
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def check_parameters(schema: dict[str, Any], path: str) -> None:
    """Raise a 400 unless ``schema`` (at ``path``, e.g. ``tools[0].function.parameters``) is an object schema."""
    kind = schema.get("type")
    if kind is not None and kind != "object":
        raise invalid(f"'{path}.type' must be \"object\" (tool arguments are a JSON object), got {kind!r}",
                      f"{path}.type", code="invalid_tool_schema")
    stack: list[tuple[Any, str, int]] = [(schema, path, 0)]
    nodes = 0
    while stack:
        node, where, depth = stack.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            raise invalid(f"'{path}' has more than {MAX_SCHEMA_NODES} subschemas", path, code="invalid_tool_schema")
        if depth > MAX_SCHEMA_DEPTH:
            raise invalid(f"'{where}' nests subschemas deeper than {MAX_SCHEMA_DEPTH} levels", where,
                          code="invalid_tool_schema")
        if isinstance(node, bool):
            continue
        if not isinstance(node, dict):
            raise _bad(where, "a JSON schema (an object or a boolean)", node)
        _check_keywords(node, where)
        for key in _ONE:
            value = node.get(key)
            if key == "items" and isinstance(value, list):
                stack.extend((v, f"{where}.items[{i}]", depth + 1) for i, v in enumerate(value))
            elif value is not None:
                stack.append((value, f"{where}.{key}", depth + 1))
        for key in _MANY:
            value = node.get(key)
            if value is None:
                continue
            if not isinstance(value, list):
                raise _bad(f"{where}.{key}", "an array of schemas", value)
            stack.extend((v, f"{where}.{key}[{i}]", depth + 1) for i, v in enumerate(value))
        for key in _NAMED:
            value = node.get(key)
            if value is None:
                continue
            if not isinstance(value, dict):
                raise _bad(f"{where}.{key}", "an object mapping names to schemas", value)
            stack.extend((v, f"{where}.{key}.{name}", depth + 1) for name, v in value.items())


def _check_keywords(node: dict[str, Any], where: str) -> None:
    kind = node.get("type")
    if kind is not None and not isinstance(kind, str) and not (
            isinstance(kind, list) and all(isinstance(k, str) for k in kind)):
        raise _bad(f"{where}.type", "a string or an array of strings", kind)
    required = node.get("required")
    if required is not None and not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
        raise _bad(f"{where}.required", "an array of property names", required)


def _bad(where: str, want: str, value: Any) -> Exception:
    return invalid(f"'{where}' must be {want}, got {type_name(value)}", where, code="invalid_tool_schema")
