"""Which JSON Schema keywords structured output enforces; anything else is reported, never dropped.

xgrammar accepts many keywords without enforcing them, so a schema is checked against the set the
grammar really honours before it is compiled: an unsupported keyword is an error naming its path.
Annotations (``title``, ``description``, ...) are allowed and have no effect on the output.
"""
from __future__ import annotations

from typing import Any

ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly",
    "writeOnly", "$anchor", "contentEncoding", "contentMediaType", "discriminator",
})
STRUCTURE = frozenset({"type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions"})
BY_TYPE = {
    "string": frozenset({"minLength", "maxLength", "pattern", "format"}),
    "integer": frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}),
    "number": frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}),
    "array": frozenset({"items", "prefixItems", "minItems", "maxItems"}),
    "object": frozenset({"properties", "required", "additionalProperties", "minProperties", "maxProperties"}),
}
SUPPORTED = ANNOTATIONS | STRUCTURE | frozenset().union(*BY_TYPE.values())
FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "uuid", "uri", "uri-reference", "ipv4",
                     "ipv6", "hostname"})
TYPES = frozenset({"string", "integer", "number", "boolean", "null", "array", "object"})


def check_schema(schema: Any, param: str) -> None:
    """Raise ``StructuredError`` naming the first keyword of ``schema`` that the grammar would not enforce."""
    _check(schema, param, param)


def _fail(message: str, param: str) -> None:
    from ninfer.runtime.structured import StructuredError

    raise StructuredError(message, param)


def _check(node: Any, path: str, param: str) -> None:
    if isinstance(node, bool):
        return
    if not isinstance(node, dict):
        _fail(f"'{path}' must be a JSON Schema object, got {type(node).__name__}", param)
    for key, value in node.items():
        where = f"{path}.{key}"
        if key not in SUPPORTED:
            _fail(f"'{where}': the JSON Schema keyword {key!r} is not supported by structured output", param)
        if key == "type":
            names = value if isinstance(value, list) else [value]
            bad = [t for t in names if t not in TYPES]
            if bad or not names:
                _fail(f"'{where}': unknown type {bad[0] if bad else value!r}", param)
        elif key == "format" and value not in FORMATS:
            _fail(f"'{where}': the string format {value!r} is not supported (supported: "
                  f"{', '.join(sorted(FORMATS))})", param)
        elif key == "allOf" and (not isinstance(value, list) or len(value) != 1):
            _fail(f"'{where}': allOf is supported with one subschema only", param)
        elif key in ("properties", "$defs", "definitions"):
            if not isinstance(value, dict):
                _fail(f"'{where}' must be an object", param)
            for name, sub in value.items():
                _check(sub, f"{where}.{name}", param)
        elif key in ("anyOf", "oneOf", "allOf", "prefixItems"):
            if not isinstance(value, list) or not value:
                _fail(f"'{where}' must be a non-empty list of schemas", param)
            for i, sub in enumerate(value):
                _check(sub, f"{where}[{i}]", param)
        elif key in ("items", "additionalProperties"):
            _check(value, where, param)
        elif key == "required" and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            _fail(f"'{where}' must be a list of property names", param)
