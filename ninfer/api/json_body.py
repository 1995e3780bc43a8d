"""Safe parsing of a JSON request body: every malformed or hostile body is a 400, never a 500.

Checks, cheapest first: strict UTF-8; a bound on the number of JSON values (counted on the raw
bytes before parsing, so a body of millions of tiny values is refused before it is built); then
the parse itself, where NaN / Infinity literals, numbers that overflow a float and duplicate keys
are refused and runaway nesting stops at the interpreter's recursion limit; finally one walk over
the result that enforces :data:`MAX_DEPTH` and :data:`MAX_INT_DIGITS` and finds lone UTF-16
surrogates (``"\\ud800"``, which no text field can hold), naming the field's path.
"""
from __future__ import annotations

import json
import math
from typing import Any

from ninfer.api.errors import APIError, invalid

MAX_DEPTH = 128  # nesting of objects and arrays (a tool schema of 32 levels nests about 70 deep)
MAX_VALUES = 1_000_000  # JSON values in one body (objects, arrays, strings, numbers, literals)
MAX_INT_DIGITS = 64  # far beyond any 64-bit field (Python itself refuses to convert 4300+ digits)
_INT_LIMIT = 10**MAX_INT_DIGITS
_SLICE = 1 << 22


class _Refused(Exception):
    """Raised from the parser's hooks; turned into a 400 once parsing has unwound."""


def parse_body(raw: bytes) -> Any:
    """The JSON document of a request body, or a 400 ``invalid_json`` / ``request_too_complex``."""
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise invalid(f"the request body is not valid JSON: invalid UTF-8 at byte {err.start}",
                      code="invalid_json") from None
    if not text.strip():
        raise invalid("the request body is empty: a JSON object is expected", code="invalid_json")
    if _value_bound(raw) > MAX_VALUES and _value_count(raw) > MAX_VALUES:
        raise invalid(f"the request body has more than {MAX_VALUES} JSON values", code="request_too_complex")
    return _parse(text, b"\\ud" in raw or b"\\uD" in raw, None, "invalid_json")


def parse_text(text: str, path: str, code: str = "invalid_json") -> Any:
    """JSON held in a string field (tool-call arguments) under the same rules; errors name ``path``."""
    raw = text.encode()
    if _value_bound(raw) > MAX_VALUES and _value_count(raw) > MAX_VALUES:
        raise invalid(f"'{path}' has more than {MAX_VALUES} JSON values", path, code="request_too_complex")
    return _parse(text, "\\ud" in text or "\\uD" in text, path, code)


def _parse(text: str, surrogates: bool, path: str | None, code: str) -> Any:
    """``surrogates``: the text has a \\uD... escape, so a string may hold a lone surrogate."""
    where = "the request body" if path is None else f"'{path}'"
    try:
        value = json.loads(text, parse_float=_float, parse_constant=_constant, object_pairs_hook=_object)
    except json.JSONDecodeError as err:
        raise invalid(f"{where} is not valid JSON: {err}", path, code=code) from None
    except ValueError:  # int(): "Exceeds the limit (4300 digits) for integer string conversion"
        raise invalid(f"{where} is not valid JSON: an integer has more than {MAX_INT_DIGITS} digits", path,
                      code=code) from None
    except RecursionError:
        raise invalid(f"{where} nests objects and arrays deeper than {MAX_DEPTH} levels", path,
                      code="request_too_complex") from None
    except _Refused as err:
        raise invalid(f"{where} is not valid JSON: {err}", path, code=code) from None
    _walk(value, surrogates, () if path is None else (_Raw(path),))
    return value


class _Raw(str):
    """A path prefix that is already rendered."""


def _value_bound(raw: bytes) -> int:
    """An upper bound on the values of a body: every value but the first of a container follows a comma."""
    return raw.count(b",") + raw.count(b"[") + raw.count(b"{") + 1


def _value_count(raw: bytes) -> int:
    """The same bound with the commas and brackets inside strings left out (vectorized, in slices)."""
    import numpy as np

    # With escaped backslashes and then escaped quotes removed, every quote left opens or closes a string.
    plain = np.frombuffer(raw.replace(b"\\\\", b"").replace(b'\\"', b""), np.uint8)
    count, inside = 1, 0
    for start in range(0, len(plain), _SLICE):
        part = plain[start:start + _SLICE]
        parity = (np.cumsum(part == 0x22, dtype=np.uint8) + inside) & 1  # 1 inside a string
        structural = (part == 0x2C) | (part == 0x5B) | (part == 0x7B)
        count += int(np.count_nonzero(structural & (parity == 0)))
        inside = int(parity[-1])
    return count


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"the number {text[:40]} is out of range")
    return value


def _constant(name: str) -> Any:
    raise _Refused(f"{name} is not a JSON number")


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _Refused(f"duplicate key {key[:80]!r} in an object")
            seen.add(key)
    return out


def _walk(body: Any, surrogates: bool, root: tuple[Any, ...] = ()) -> None:
    """Depth, integer sizes and (if ``surrogates``) lone surrogates, iteratively; only containers are pushed,
    and a path is built only for an error."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(body, root)] if isinstance(body, (dict, list)) else []
    depth0 = len(root)
    while stack:
        value, path = stack.pop()
        if len(path) - depth0 >= MAX_DEPTH:
            raise invalid(f"'{_path(path)[:200]}' nests objects and arrays deeper than {MAX_DEPTH} levels",
                          _path(path), code="request_too_complex")
        for key, item in value.items() if type(value) is dict else enumerate(value):
            kind = type(item)
            if kind is dict or kind is list:
                stack.append((item, path + (key,)))
            elif kind is int:
                if not -_INT_LIMIT < item < _INT_LIMIT:
                    where = _path(path + (key,))
                    raise invalid(f"'{where}': an integer has more than {MAX_INT_DIGITS} digits", where,
                                  code="invalid_json")
            elif kind is str and surrogates and _has_surrogate(item):
                raise _surrogate(path + (key,))
            if surrogates and type(key) is str and _has_surrogate(key):
                raise _surrogate(path + (key,), key=True)


def _has_surrogate(text: str) -> bool:
    if text.isascii():
        return False
    try:
        text.encode("utf-8")  # a C loop, much faster than a regex over long text
    except UnicodeEncodeError:
        return True
    return False


def _surrogate(path: tuple[Any, ...], key: bool = False) -> APIError:
    where = _path(path)
    what = "the key" if key else "the string"
    return invalid(f"'{where}': {what} holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape without its pair), "
                   "which is not text", where, code="invalid_json")


def _path(parts: tuple[Any, ...]) -> str:
    out = ""
    for part in parts:
        if isinstance(part, _Raw):
            out += part
        elif isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier():
            out += f".{part}" if out else part
        else:
            out += f"[{json.dumps(part, ensure_ascii=True)[:60]}]"
    return out or "(body)"
