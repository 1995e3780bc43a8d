"""Qwen3-Coder XML tool calls in the answer stream (reference §13.2)::

    <tool_call>
    <function=NAME>
    <parameter=ARG>
    VALUE
    </parameter>
    </function>
    </tool_call>

The parser runs on the content channel (the reasoning splitter already ends the reasoning at
``<tool_call>``). Text outside call blocks passes through; a block is held back until its
``</tool_call>`` arrives and is then emitted as one :class:`ToolCall`, so streaming and
whole-text parsing give the same result whatever the delta boundaries. A block that does not
have the structure above (no ``<function=…>``, text between parameters, a nested unmatched
``<parameter=``, a duplicate parameter, an invalid name) is given back as plain text: a
malformed call degrades to text and never raises. At the end of the stream an unterminated
block is accepted if its ``</function>`` is complete, and is text otherwise.

Values are raw text (one newline after the opening tag and one before the closing tag are
framing); the parameter's JSON-schema ``type`` (or ``anyOf``/``oneOf`` of types) decides the
conversion. A value that does not fit its declared type is kept as the raw string, so the agent
loop can continue. Whitespace between the answer text and a call, and between calls, is dropped.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_FUNCTION = re.compile(r"<function=([^>\n]*)>(.*)</function>", re.DOTALL)
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]*)>(.*?)</parameter>", re.DOTALL)
_NAME = re.compile(r"[^\s<>=\"']+")
_INT = re.compile(r"[-+]?\d+")
_JSON_TYPES = {str: "string", bool: "boolean", int: "integer", float: "number", type(None): "null", list: "array",
               dict: "object"}

PieceKind = Literal["text", "tool_call"]


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    index: int = 0  # position among this response's calls
    declared: bool = True  # the name is one of the request's tools

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass
class ParseResult:
    pieces: list[tuple[PieceKind, Any]] = field(default_factory=list)
    diagnostics: list[str] = field(default_factory=list)


def schema_types(schema: Any) -> list[str]:
    """Declared JSON types of a parameter schema, in order (``type``, a list of types, or anyOf/oneOf)."""
    if not isinstance(schema, dict):
        return []
    t = schema.get("type")
    if isinstance(t, str):
        return [t]
    if isinstance(t, list):
        return [x for x in t if isinstance(x, str)]
    out: list[str] = []
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            out.extend(x for x in schema_types(sub) if x not in out)
    if not out and ("enum" in schema or "const" in schema):  # an untyped enum: the types of its values
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        for v in values if isinstance(values, list) else []:
            name = _JSON_TYPES.get(type(v))
            if name is not None and name not in out:
                out.append(name)
    return out


def convert_value(raw: str, schema: Any) -> Any:
    """Type a raw parameter value by its schema; a mismatch keeps the string."""
    types = schema_types(schema)
    for t in sorted(types, key=lambda t: t == "string"):  # try the non-string types first
        ok, value = _try_type(t, raw)
        if ok:
            return value
    return raw


def _try_type(t: str, raw: str) -> tuple[bool, Any]:
    s = raw.strip()
    if t == "string":
        return True, raw
    if t == "integer":
        return (True, int(s)) if _INT.fullmatch(s) else (False, None)
    if t == "number":
        if _INT.fullmatch(s):
            return True, int(s)
        try:
            value = float(s)
        except ValueError:
            return False, None
        return (True, value) if math.isfinite(value) else (False, None)
    if t == "boolean":
        return (True, s.lower() == "true") if s.lower() in ("true", "false") else (False, None)
    if t == "null":
        return (True, None) if s.lower() in ("null", "none") else (False, None)
    if t in ("object", "array"):
        try:
            value = json.loads(s)
        except ValueError:
            return False, None
        return (True, value) if isinstance(value, dict if t == "object" else list) else (False, None)
    return False, None


def _strip_framing(value: str) -> str:
    value = value.removeprefix("\n")
    value = value.removesuffix("\n")
    return value


def _prefix_hold(s: str, tag: str) -> int:
    """Length of the longest suffix of ``s`` that is a proper prefix of ``tag``."""
    for k in range(min(len(s), len(tag) - 1), 0, -1):
        if s.endswith(tag[:k]):
            return k
    return 0


class ToolCallParser:
    """Streaming parser: ``feed(delta)`` and ``flush()`` return ``("text", str)`` / ``("tool_call", ToolCall)``.

    ``tools`` maps each declared tool name to its JSON-schema ``parameters`` object.
    """

    def __init__(self, tools: dict[str, Any]) -> None:
        self.tools = tools
        self.diagnostics: list[str] = []
        self.calls: list[ToolCall] = []
        self._buf = ""  # outside a block: held-back text that may begin "<tool_call>"
        self._block: str | None = None  # inside a block: everything since "<tool_call>"
        self._scan_from = 0
        self._ws = ""  # trailing whitespace of the emitted text, held until more text follows
        self._after_call = False

    def feed(self, delta: str) -> list[tuple[PieceKind, Any]]:
        out: list[tuple[PieceKind, Any]] = []
        self._feed(delta, out)
        return _merge(out)

    def flush(self) -> list[tuple[PieceKind, Any]]:
        out: list[tuple[PieceKind, Any]] = []
        if self._block is not None:
            block, self._block = self._block, None
            body = block[len(TOOL_CALL_START):]
            call = self._parse(body) if body.rstrip().endswith("</function>") else None
            if call is None:
                self.diagnostics.append("malformed_structure")
                self._text(block, out)
            else:
                self._call(call, out)
        elif self._buf:
            self._text(self._buf, out)
            self._buf = ""
        if not self.calls and self._ws:
            out.append(("text", self._ws))
        self._ws = ""
        return _merge(out)

    def _feed(self, delta: str, out: list[tuple[PieceKind, Any]]) -> None:
        while delta:
            if self._block is None:
                s = self._buf + delta
                i = s.find(TOOL_CALL_START)
                if i < 0:
                    hold = _prefix_hold(s, TOOL_CALL_START)
                    self._text(s[:len(s) - hold], out)
                    self._buf = s[len(s) - hold:]
                    return
                self._text(s[:i], out)
                self._buf = ""
                self._block, self._scan_from = "", 0
                delta = s[i:]
            self._block += delta
            j = self._block.find(TOOL_CALL_END, self._scan_from)
            if j < 0:
                self._scan_from = max(0, len(self._block) - len(TOOL_CALL_END) + 1)
                return
            end = j + len(TOOL_CALL_END)
            block, delta = self._block[:end], self._block[end:]
            self._block = None
            call = self._parse(block[len(TOOL_CALL_START):-len(TOOL_CALL_END)])
            if call is None:
                self.diagnostics.append("malformed_structure")
                self._text(block, out)
            else:
                self._call(call, out)

    def _parse(self, body: str) -> ToolCall | None:
        m = _FUNCTION.fullmatch(body.strip())
        if m is None:
            return None
        name, inner = m.group(1).strip(), m.group(2)
        if not _NAME.fullmatch(name):
            return None
        schema = self.tools.get(name)
        props = schema.get("properties") if isinstance(schema, dict) else None
        props = props if isinstance(props, dict) else {}
        args: dict[str, Any] = {}
        pos = 0
        while True:
            p = _PARAMETER.match(inner, pos)
            if p is None:
                break
            pname, value = p.group(1).strip(), p.group(2)
            if not _NAME.fullmatch(pname) or "<parameter=" in value or pname in args:
                return None  # nested unmatched <parameter=, or a duplicate: not a call
            args[pname] = convert_value(_strip_framing(value), props.get(pname))
            pos = p.end()
        if inner[pos:].strip():
            return None  # text between or after the parameters
        if name not in self.tools:
            self.diagnostics.append("undeclared_tool")
        return ToolCall(name, args, declared=name in self.tools)

    def _call(self, call: ToolCall, out: list[tuple[PieceKind, Any]]) -> None:
        call.index = len(self.calls)
        self.calls.append(call)
        self._ws, self._after_call = "", True
        out.append(("tool_call", call))

    def _text(self, s: str, out: list[tuple[PieceKind, Any]]) -> None:
        if self._after_call:
            s = s.lstrip()
            if not s:
                return
            self._after_call = False
            self.diagnostics.append("trailing_content")
        body = s.rstrip()
        if body:
            out.append(("text", self._ws + body))
            self._ws = s[len(body):]
        else:
            self._ws += s


def _merge(pieces: list[tuple[PieceKind, Any]]) -> list[tuple[PieceKind, Any]]:
    merged: list[tuple[PieceKind, Any]] = []
    for kind, value in pieces:
        if kind == "text" and not value:
            continue
        if kind == "text" and merged and merged[-1][0] == "text":
            merged[-1] = ("text", merged[-1][1] + value)
        else:
            merged.append((kind, value))
    return merged


def parse_text(text: str, tools: dict[str, Any]) -> ParseResult:
    """Whole-text parse, identical to feeding ``text`` in any number of deltas."""
    parser = ToolCallParser(tools)
    pieces = _merge(parser.feed(text) + parser.flush())
    return ParseResult(pieces, parser.diagnostics)
