"""Helpers the three protocols share: ids, text content, tool definitions, thinking options, usage."""
from __future__ import annotations

import json
import secrets
from typing import Any

from ninfer.api.errors import APIError, invalid
from ninfer.api.json_body import parse_text
from ninfer.api.tool_schema import check_parameters
from ninfer.api.validation import Fields, type_name

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
_MEDIA_TYPES = ("image_url", "image", "input_image", "video_url", "video", "input_audio", "input_file", "file",
                "document", "audio")
VISION_TYPES = ("image_url", "image", "input_image", "video_url", "video", "input_video")


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def text_content(value: Any, path: str, text_types: tuple[str, ...] = ("text",), served: bool = False
                 ) -> str:
    """A message content (a string, null, or an array of parts) as plain text; media parts are refused.

    ``served``: the server serves vision, so media here are misplaced (``invalid_media``), not disabled.
    """
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise invalid(f"'{path}' must be a string or an array of content parts, got {type_name(value)}", path)
    texts = []
    for i, part in enumerate(value):
        p = f"{path}[{i}]"
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise invalid(f"'{p}' must be an object, got {type_name(part)}", p)
        kind = part.get("type")
        if kind in text_types or (kind is None and "text" in part):
            text = part.get("text")
            if not isinstance(text, str):
                raise invalid(f"'{p}.text' must be a string, got {type_name(text)}", f"{p}.text")
            texts.append(text)
        elif kind in _MEDIA_TYPES and served:
            where = ("images and videos only as parts of user messages" if kind in VISION_TYPES
                     else "images and videos only")
            raise invalid(f"'{p}' is a {kind} part; this server accepts {where}", p, code="invalid_media")
        elif kind in _MEDIA_TYPES:
            raise invalid(f"'{p}' is a {kind} part, but this server serves text only (vision is disabled; "
                          "start it with --vision)", p, code="vision_disabled")
        else:
            raise invalid(f"'{p}.type' {kind!r} is not a supported content part type", f"{p}.type")
    return "".join(texts)


def message_content(value: Any, path: str, text_types: tuple[str, ...] = ("text",), media: bool = False,
                    served: bool | None = None) -> str | list[dict[str, Any]]:
    """Like :func:`text_content`, but with ``media`` (vision served, a user turn) image and video parts are kept.

    ``served`` (default ``media``): vision is served, so media where ``media`` is off are misplaced.

    The result is a string when there is no media, else a list of ``{"type": "text", "text"}``
    parts and canonical media parts (``{"type": "image", "image": source}``, see
    :func:`ninfer.vision.canonical_part`) in order, which the chat template and
    :func:`ninfer.vision.collect_media` both read.
    """
    if not media or not isinstance(value, list) or not any(
            isinstance(p, dict) and p.get("type") in _MEDIA_TYPES for p in value):
        return text_content(value, path, text_types, media if served is None else served)
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(value):
        p = f"{path}[{i}]"
        if isinstance(part, dict) and part.get("type") in VISION_TYPES:
            parts.append(media_part(part, p))
            continue
        if isinstance(part, str):
            text = part
        elif isinstance(part, dict):
            text = _one_text(part, p, text_types)
        else:
            raise invalid(f"'{p}' must be an object, got {type_name(part)}", p)
        if parts and parts[-1].get("type") == "text":
            parts[-1] = {"type": "text", "text": parts[-1]["text"] + text}
        else:
            parts.append({"type": "text", "text": text})
    return parts


def media_part(part: dict[str, Any], path: str) -> dict[str, Any]:
    """One image/video part (any protocol's shape) in the canonical ``{"type": kind, kind: source}`` shape."""
    from ninfer.vision import MediaError, canonical_part

    try:
        canonical = canonical_part(_media_source(part, path))
    except MediaError as err:
        raise invalid(f"'{path}': {err}", path, code="invalid_media") from None
    if canonical is None:
        raise invalid(f"'{path}' is not an image or video part", path, code="invalid_media")
    return canonical


def _one_text(part: dict[str, Any], p: str, text_types: tuple[str, ...]) -> str:
    kind = part.get("type")
    if kind in text_types or (kind is None and "text" in part):
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid(f"'{p}.text' must be a string, got {type_name(text)}", f"{p}.text")
        return text
    if kind in _MEDIA_TYPES:
        raise invalid(f"'{p}' is a {kind} part; this server reads images and videos only", p,
                      code="invalid_media")
    raise invalid(f"'{p}.type' {kind!r} is not a supported content part type", f"{p}.type")


def _media_source(part: dict[str, Any], p: str) -> dict[str, Any]:
    """Check the source field of a media part before :func:`canonical_part` reads it."""
    kind = part.get("type")
    if kind == "input_image" and part.get("image_url") is None and part.get("file_id") is not None:
        raise invalid(f"'{p}.file_id' is not supported: send the image as image_url (a URL or data URI)",
                      f"{p}.file_id", code="unsupported_parameter")
    source = part.get("source")
    if kind == "image" and isinstance(source, dict):
        stype = source.get("type")
        if stype == "base64":
            for key in ("media_type", "data"):
                if not isinstance(source.get(key), str) or not source.get(key):
                    raise invalid(f"'{p}.source.{key}' must be a non-empty string", f"{p}.source.{key}",
                                  code="invalid_media")
        elif stype == "url":
            if not isinstance(source.get("url"), str) or not source.get("url"):
                raise invalid(f"'{p}.source.url' must be a non-empty string", f"{p}.source.url", code="invalid_media")
        else:
            raise invalid(f"'{p}.source.type' {stype!r} is not supported: use 'base64' or 'url'",
                          f"{p}.source.type", code="invalid_media")
    return part


def function_tool(name: Any, description: Any, parameters: Any, path: str, schema_field: str = "parameters"
                  ) -> dict[str, Any]:
    """One tool definition in the OpenAI chat shape the chat template renders (``schema_field``: the
    parameters schema's name in the request, for errors)."""

    if not isinstance(name, str) or not name.strip():
        raise invalid(f"'{path}.name' must be a non-empty string", f"{path}.name")
    if any(c.isspace() or c in "<>=\"'" for c in name):
        raise invalid(f"'{path}.name' {name!r} may not contain whitespace, quotes, '<', '>' or '='", f"{path}.name")
    if description is not None and not isinstance(description, str):
        raise invalid(f"'{path}.description' must be a string, got {type_name(description)}", f"{path}.description")
    if parameters is not None and not isinstance(parameters, dict):
        raise invalid(f"'{path}.{schema_field}' must be a JSON-schema object, got {type_name(parameters)}",
                      f"{path}.{schema_field}")
    if parameters is not None:
        check_parameters(parameters, f"{path}.{schema_field}")
    function: dict[str, Any] = {"name": name}
    if description:
        function["description"] = description
    function["parameters"] = parameters if parameters is not None else {"type": "object", "properties": {}}
    return {"type": "function", "function": function}


def unique_tools(tools: list[dict[str, Any]], path: str) -> list[dict[str, Any]] | None:
    seen = set()
    for i, t in enumerate(tools):
        name = t["function"]["name"]
        if name in seen:
            raise invalid(f"'{path}[{i}]' repeats the tool name {name!r}", f"{path}[{i}].name")
        seen.add(name)
    return tools or None


def arguments_object(value: Any, path: str) -> dict[str, Any]:
    """Tool-call arguments from history: a JSON string or an object (the template needs a mapping)."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        value = parse_text(value, path, code="invalid_tool_history")
    if not isinstance(value, dict):
        raise invalid(f"'{path}' must be a JSON object, got {type_name(value)}", path, code="invalid_tool_history")
    return value


def tool_choice(value: Any, path: str = "tool_choice") -> str:
    """``auto`` (default) or ``none``; a forced call is ``ninfer.api.structured.tool_choice``'s."""
    if value is None:
        return "auto"
    if value in ("auto", "none"):
        return value
    if isinstance(value, dict) and value.get("type") in ("auto", "none"):
        return value["type"]
    shown = value if isinstance(value, str) else json.dumps(value)[:80]
    raise invalid(f"'{path}' {shown!r} is not supported: only 'auto' and 'none' are", path,
                  code="unsupported_parameter")


def thinking_options(f: Fields, kwargs: Fields | None) -> tuple[bool | None, bool | None, str | None]:
    """``(enable_thinking, preserve_thinking, reasoning_effort)`` from the top level and chat_template_kwargs."""
    enable = f.bool("enable_thinking")
    preserve = f.bool("preserve_thinking")
    effort = f.str("reasoning_effort", choices=EFFORTS)
    if kwargs is not None:
        for key, value in kwargs.data.items():
            if key not in ("enable_thinking", "preserve_thinking", "reasoning_effort") and value is not None:
                raise invalid(f"'{kwargs.path(key)}' is not a variable of this chat template", kwargs.path(key),
                              code="conflicting_template_option")
        for name, current in (("enable_thinking", enable), ("preserve_thinking", preserve)):
            value = kwargs.bool(name)
            if value is None:
                continue
            if current is not None and value != current:
                raise invalid(f"'{kwargs.path(name)}' contradicts the top-level value", kwargs.path(name),
                              code="conflicting_template_option")
            if name == "preserve_thinking":
                preserve = value
            else:
                enable = value
        k_effort = kwargs.str("reasoning_effort", choices=EFFORTS)
        if k_effort is not None and effort is not None and k_effort != effort:
            raise invalid(f"'{kwargs.path('reasoning_effort')}' contradicts 'reasoning_effort'",
                          kwargs.path("reasoning_effort"), code="conflicting_template_option")
        effort = effort or k_effort
    if effort is not None:
        wants = effort != "none"
        if enable is not None and enable != wants:
            raise invalid(f"'reasoning_effort' {effort!r} contradicts 'enable_thinking' {enable}", "reasoning_effort",
                          code="conflicting_template_option")
        enable = wants
    return enable, preserve, effort


def openai_usage(usage: Any) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens,
                                          "accepted_prediction_tokens": usage.accepted_prediction_tokens,
                                          "rejected_prediction_tokens": usage.rejected_prediction_tokens}}


def engine_failure(reason: str | None, error: str | None) -> APIError | None:
    if reason == "error":
        return APIError(500, f"the engine failed while generating: {error or 'unknown error'}", code="engine_error")
    return None


def logprob_entries(entries: list[Any], tokenizer: Any) -> list[dict[str, Any]]:
    """Engine logprobs ``(token_id, logprob, [(alt_id, alt_logprob), ...])`` in the OpenAI shape."""
    def one(token_id: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
    return [{**one(tid, lp), "top_logprobs": [one(a, alp) for a, alp in alts]} for tid, lp, alts in entries]
