"""Responses API items: request input to stored items (with ids) and stored items to template messages.

Item kinds: ``message`` (also the short ``{role, content}`` form), ``function_call``,
``function_call_output`` and ``reasoning``. A reasoning item attaches to the assistant turn that
follows it; function calls join the assistant turn before them (or open one).
"""
from __future__ import annotations

from typing import Any

from ninfer.api import convert
from ninfer.api.errors import invalid
from ninfer.api.output import Collected
from ninfer.api.validation import Fields, type_name

_INPUT_TEXT = ("input_text", "output_text", "text", "refusal")
_ROLES = ("user", "system", "developer", "assistant")


def input_items(value: Any, media: bool = False) -> list[dict[str, Any]]:
    """Normalized input items, each with an id; ``media``: keep ``input_image`` parts of user messages."""
    if isinstance(value, str):
        return [_message_item("user", value)]
    if not isinstance(value, list):
        raise invalid(f"'input' must be a string or an array of items, got {type_name(value)}", "input")
    items = []
    for i, raw in enumerate(value):
        path = f"input[{i}]"
        if not isinstance(raw, dict):
            raise invalid(f"'{path}' must be an object, got {type_name(raw)}", path)
        f = Fields(raw, path)
        kind = f.str("type") or ("message" if "role" in raw else None)
        if kind == "message":
            role = f.str("role", required=True, choices=_ROLES)
            content = convert.message_content(raw.get("content"), f.path("content"), _INPUT_TEXT,
                                              media and role == "user", media)
            if isinstance(content, str):
                items.append(_message_item(role, content, f.str("id")))
            else:
                items.append({"type": "message", "id": f.str("id") or convert.new_id("msg_"), "role": role,
                              "status": "completed", "content": [_stored_part(p) for p in content]})
        elif kind == "function_call":
            convert.arguments_object(f.str("arguments"), f.path("arguments"))
            items.append({"type": "function_call", "id": f.str("id") or convert.new_id("fc_"),
                          "call_id": f.str("call_id", required=True), "name": f.str("name", required=True),
                          "arguments": f.str("arguments") or "{}", "status": "completed"})
        elif kind == "function_call_output":
            output = raw.get("output")
            text = convert.text_content(output, f.path("output"), _INPUT_TEXT, media)
            items.append({"type": "function_call_output", "id": f.str("id") or convert.new_id("fco_"),
                          "call_id": f.str("call_id", required=True), "output": text, "status": "completed"})
        elif kind == "reasoning":
            items.append(reasoning_item(_reasoning_text(f), f.str("id")))
        elif kind is None:
            raise invalid(f"'{path}.type' is required", f"{path}.type")
        else:
            raise invalid(f"'{path}.type' {kind!r} is not a supported input item type", f"{path}.type")
    return items


def _stored_part(part: dict[str, Any]) -> dict[str, Any]:
    """A canonical text/media part as a Responses input content part."""
    kind = part["type"]
    if kind == "text":
        return {"type": "input_text", "text": part["text"]}
    if kind == "image":
        return {"type": "input_image", "image_url": part["image"], "detail": "auto"}
    return {"type": "input_video", "video_url": part["video"]}


def _template_content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """A stored message's content for the chat template: a string, or text + canonical media parts."""
    from ninfer.vision import canonical_part

    if not any(p.get("type") in ("input_image", "input_video") for p in parts):
        return "".join(p.get("text", "") for p in parts)
    return [canonical_part(p) or {"type": "text", "text": p.get("text", "")} for p in parts]


def _reasoning_text(f: Fields) -> str:
    parts = [p.str("text") or "" for p in f.items("content")]
    if not parts:
        parts = [p.str("text") or "" for p in f.items("summary")]
    return "".join(parts)


def _message_item(role: str, text: str, item_id: str | None = None) -> dict[str, Any]:
    part_type = "output_text" if role == "assistant" else "input_text"
    part: dict[str, Any] = {"type": part_type, "text": text}
    if role == "assistant":
        part["annotations"] = []
    return {"type": "message", "id": item_id or convert.new_id("msg_"), "role": role, "status": "completed",
            "content": [part]}


def reasoning_item(text: str, item_id: str | None = None, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id or convert.new_id("rs_"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def message_output(text: str, item_id: str | None = None, status: str = "completed",
                   logprobs: list[Any] | None = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id or convert.new_id("msg_"), "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]}


def function_call_output(call: Any, item_id: str | None = None, call_id: str | None = None,
                         status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id or convert.new_id("fc_"),
            "call_id": call_id or convert.new_id("call_"), "name": call.name, "arguments": call.arguments_json,
            "status": status}


def output_items(result: Collected, incomplete: bool, logprobs: list[Any] | None = None) -> list[dict[str, Any]]:
    """The output of a whole generation: reasoning, then the answer, then the calls."""
    out = []
    if result.reasoning:
        out.append(reasoning_item(result.reasoning))
    if result.text or not result.tool_calls:
        out.append(message_output(result.text, status="incomplete" if incomplete else "completed",
                                  logprobs=logprobs))
    out.extend(function_call_output(c) for c in result.tool_calls)
    return out


def template_messages(items: list[dict[str, Any]], instructions: str | None) -> list[dict[str, Any]]:
    """Stored items as chat-template messages."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    reasoning: str | None = None
    for item in items:
        kind = item["type"]
        if kind == "reasoning":
            reasoning = (reasoning or "") + "".join(c.get("text", "") for c in item.get("content") or [])
        elif kind == "message":
            message: dict[str, Any] = {"role": item["role"], "content": _template_content(item["content"])}
            if item["role"] == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif kind == "function_call":
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                if reasoning is not None:
                    last["reasoning_content"], reasoning = reasoning, None
                messages.append(last)
            last.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                "name": item["name"], "arguments": convert.arguments_object(item["arguments"], "input")}})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "content": item["output"], "tool_call_id": item["call_id"]})
    return messages
