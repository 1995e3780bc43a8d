"""Typed access to JSON request fields: every error is a 400 that names the field by its path.

``Fields(body)`` wraps one JSON object; ``f.int("max_tokens", lo=0)`` returns the value or None
when absent (or null), and raises :class:`APIError` on a wrong type or an out-of-range value.
``f.sub("stream_options")`` gives the nested object with paths like ``stream_options.include_usage``.
"""
from __future__ import annotations

import asyncio
import math
from typing import Any

from starlette.requests import Request

from ninfer.api.errors import APIError, invalid
from ninfer.api.json_body import parse_body

# Bodies above this size are parsed on a worker thread, so the event loop keeps serving meanwhile.
INLINE_PARSE_BYTES = 1 << 20

_TYPE_NAMES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "an integer",
               float: "a number", type(None): "null"}


def type_name(value: Any) -> str:
    return _TYPE_NAMES.get(type(value), type(value).__name__)


async def read_json(request: Request, max_bytes: int) -> dict[str, Any]:
    """The request body as a JSON object; 413 above ``max_bytes`` (checked before parsing), else 400
    (see :mod:`ninfer.api.json_body` for what a body may not hold)."""
    too_large = APIError(413, f"the request body exceeds the limit of {max_bytes} bytes", code="request_too_large")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large
        chunks.append(chunk)
    raw = b"".join(chunks)
    body = parse_body(raw) if len(raw) <= INLINE_PARSE_BYTES else await asyncio.to_thread(parse_body, raw)
    if not isinstance(body, dict):
        raise invalid(f"the request body must be a JSON object, got {type_name(body)}", code="invalid_json")
    return body


class Fields:
    """Typed getters over one JSON object; ``prefix`` is the object's own path (``"tools[0].function"``)."""

    def __init__(self, data: dict[str, Any], prefix: str = "") -> None:
        self.data = data
        self.prefix = prefix

    def path(self, name: str) -> str:
        return f"{self.prefix}.{name}" if self.prefix else name

    def has(self, name: str) -> bool:
        return self.data.get(name) is not None

    def _get(self, name: str, required: bool) -> Any:
        value = self.data.get(name)
        if value is None and required:
            raise invalid(f"'{self.path(name)}' is required", self.path(name), code="missing_required_parameter")
        return value

    def _wrong(self, name: str, want: str, value: Any) -> APIError:
        return invalid(f"'{self.path(name)}' must be {want}, got {type_name(value)}", self.path(name))

    def str(self, name: str, *, required: bool = False, choices: tuple[str, ...] | None = None) -> str | None:
        value = self._get(name, required)
        if value is None:
            return None
        if not isinstance(value, str):
            raise self._wrong(name, "a string", value)
        if choices is not None and value not in choices:
            raise invalid(f"'{self.path(name)}' must be one of {', '.join(choices)}; got {value!r}", self.path(name))
        return value

    def bool(self, name: str, *, required: bool = False) -> bool | None:
        value = self._get(name, required)
        if value is None:
            return None
        if not isinstance(value, bool):
            raise self._wrong(name, "a boolean", value)
        return value

    def int(self, name: str, *, required: bool = False, lo: int | None = None, hi: int | None = None) -> int | None:
        value = self._get(name, required)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._wrong(name, "an integer", value)
        self._check_range(name, value, lo, hi)
        return value

    def float(self, name: str, *, required: bool = False, lo: float | None = None, hi: float | None = None,
              lo_open: bool = False) -> float | None:
        value = self._get(name, required)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self._wrong(name, "a finite number", value)
        if lo_open and lo is not None and value <= lo:
            upper = f" and <= {_num(hi)}" if hi is not None else ""
            raise invalid(f"'{self.path(name)}' must be > {_num(lo)}{upper}, got {value}", self.path(name))
        self._check_range(name, value, None if lo_open else lo, hi)
        return float(value)

    def _check_range(self, name: str, value: float, lo: float | None, hi: float | None) -> None:
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            bounds = f"in [{_num(lo)}, {_num(hi)}]" if lo is not None and hi is not None else (
                f">= {_num(lo)}" if lo is not None else f"<= {_num(hi)}")
            raise invalid(f"'{self.path(name)}' must be {bounds}, got {value}", self.path(name))

    def list(self, name: str, *, required: bool = False, nonempty: bool = False) -> list[Any] | None:
        value = self._get(name, required)
        if value is None:
            return None
        if not isinstance(value, list):
            raise self._wrong(name, "an array", value)
        if nonempty and not value:
            raise invalid(f"'{self.path(name)}' must not be empty", self.path(name))
        return value

    def dict(self, name: str, *, required: bool = False) -> dict[str, Any] | None:
        value = self._get(name, required)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise self._wrong(name, "an object", value)
        return value

    def sub(self, name: str, *, required: bool = False) -> Fields | None:
        value = self.dict(name, required=required)
        return None if value is None else Fields(value, self.path(name))

    def items(self, name: str, *, required: bool = False, nonempty: bool = False) -> list[Fields]:
        """An array of objects, each wrapped with its indexed path (``messages[2]``)."""
        out = []
        for i, item in enumerate(self.list(name, required=required, nonempty=nonempty) or []):
            path = f"{self.path(name)}[{i}]"
            if not isinstance(item, dict):
                raise invalid(f"'{path}' must be an object, got {type_name(item)}", path)
            out.append(Fields(item, path))
        return out

    def str_or_list(self, name: str, *, max_items: int) -> list[str]:
        """A string or an array of strings (``stop``)."""
        value = self.data.get(name)
        if value is None:
            return []
        if isinstance(value, str):
            return [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self._wrong(name, "a string or an array of strings", value)
        if len(value) > max_items:
            raise invalid(f"'{self.path(name)}' has {len(value)} entries; at most {max_items} are allowed",
                          self.path(name))
        return list(value)


def _num(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def check_unknown(fields: Fields, known: frozenset[str]) -> None:
    """400 ``unknown_parameter`` for a top-level field outside ``known`` (the Responses protocol is strict)."""
    for name in fields.data:
        if name not in known:
            raise invalid(f"unknown parameter '{fields.path(name)}'", fields.path(name), code="unknown_parameter")
