"""Anthropic Messages: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

Stream grammar: ``message_start``, then per content block ``content_block_start`` →
``content_block_delta`` (``thinking_delta`` + a final ``signature_delta``, ``text_delta``, or
``input_json_delta``) → ``content_block_stop``, then ``message_delta`` (stop reason, output
tokens) and ``message_stop``. A final text-only assistant message is a prefill: the answer
continues it (thinking off). ``thinking`` absent means the server default; ``budget_tokens`` caps the
reasoning: once that many tokens are out, the engine closes it with ``</think>`` and the answer follows. Sampling fields
(``temperature``, ``top_p``, ``top_k``) are accepted although current SDKs send them only
through ``extra_body``.
"""
from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

from ninfer.api import convert, request_id, structured
from ninfer.api.errors import APIError, invalid, unsupported
from ninfer.api.output import OutputStream
from ninfer.api.sampling import parse_fields, stop_strings
from ninfer.api.service import ChatInput, GenerationSpec, Run, Service
from ninfer.api.streaming import json_text, sse_frame, sse_response
from ninfer.api.validation import Fields, check_unknown, read_json, type_name

MAX_STOP_SEQUENCES = 16
KNOWN = frozenset({"model", "messages", "max_tokens", "system", "stop_sequences", "stream", "temperature", "top_p",
                   "top_k", "thinking", "tools", "tool_choice", "output_config", "metadata", "service_tier",
                   "cache_control", "container", "context_management", "mcp_servers", "speed", "inference_geo",
                   "diagnostics", "user_profile_id", "workspace_id"})
_BILLING_HEADER = "x-anthropic-billing-header:"


def parse(body: dict[str, Any], counting: bool = False, media: bool = False
          ) -> tuple[ChatInput, GenerationSpec, bool]:
    """``media``: keep image blocks of user turns (the server serves vision)."""
    f = Fields(body)
    check_unknown(f, KNOWN)
    f.str("model", required=True)
    _refuse_unsupported(f)
    max_tokens = None if counting else f.int("max_tokens", required=True, lo=1)
    system = _system(body.get("system"), media)
    messages = [{"role": "system", "content": system}] if system else []
    items = f.items("messages", required=True, nonempty=True)
    for m in items:
        messages.extend(_message(m, media))
    prefill = None
    last = items[-1]
    if last.data.get("role") == "assistant" and messages[-1]["role"] == "assistant" \
            and not messages[-1].get("tool_calls"):
        prefill = messages.pop()["content"]
    thinking, budget = _thinking(f.sub("thinking"), max_tokens)
    output_config = f.sub("output_config")
    effort = None
    if output_config is not None:
        effort = output_config.str("effort", choices=convert.EFFORTS[2:])
    tools = [_tool(t) for t in f.items("tools")]
    choice = f.sub("tool_choice")
    tools = convert.unique_tools(tools, "tools")
    if choice is not None:
        choice.str("type", required=True)
        choice.bool("disable_parallel_tool_use")
    tool_choice, forced = structured.tool_choice(choice.data if choice is not None else None, tools, "tool_choice")
    chat = ChatInput(messages, tools, tool_choice, thinking, reasoning_effort=effort, prefill=prefill)
    stops = f.list("stop_sequences") or []
    if not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOP_SEQUENCES:
        raise invalid(f"'stop_sequences' must be an array of at most {MAX_STOP_SEQUENCES} strings", "stop_sequences")
    stop_strings(f, "stop_sequences", MAX_STOP_SEQUENCES)
    sampling = parse_fields(f, ("temperature", "top_p", "top_k"), temperature_max=1.0)
    if budget is not None:
        sampling["thinking_budget"] = budget
    spec = GenerationSpec(max_tokens, stops, sampling, structured=structured.from_anthropic(output_config, forced))
    if spec.structured is not None and prefill is not None:  # as Anthropic: prefill and constraints exclude
        raise invalid(f"'{spec.structured.param}' cannot be combined with a prefilled assistant turn",
                      spec.structured.param, code="invalid_structured_output")
    return chat, spec, bool(f.bool("stream"))


def _refuse_unsupported(f: Fields) -> None:
    """Messages fields that would change what is served are a 400 naming them; identifiers and cache hints
    (the prefix cache is automatic) are checked for their type."""
    for name, why in (("container", "there are no code-execution containers"),
                      ("context_management", "context is not edited by the server"),
                      ("diagnostics", "no diagnostics are collected")):
        if f.has(name):
            raise unsupported(name, why)
    if f.list("mcp_servers"):
        raise unsupported("mcp_servers", "the server connects to no MCP servers")
    if f.str("service_tier") not in (None, "auto", "standard_only"):
        raise unsupported("service_tier", "one tier is served: 'auto' or 'standard_only'")
    if f.str("speed") not in (None, "standard"):
        raise unsupported("speed", "only 'standard' is served")
    cache = f.sub("cache_control")
    if cache is not None:
        cache.str("type", choices=("ephemeral",))
    for name in ("inference_geo", "user_profile_id", "workspace_id"):
        f.str(name)
    f.dict("metadata")


def _system(value: Any, served: bool = False) -> str:
    if value is None or isinstance(value, str):
        return value or ""
    if not isinstance(value, list):
        raise invalid(f"'system' must be a string or an array of text blocks, got {type_name(value)}", "system")
    blocks = list(value)
    if blocks and isinstance(blocks[0], dict) and str(blocks[0].get("text", "")).startswith(_BILLING_HEADER):
        blocks = blocks[1:]  # Claude Code's billing header is not part of the prompt
    return convert.text_content(blocks, "system", served=served)


def _message(m: Fields, media: bool = False) -> list[dict[str, Any]]:
    role = m.str("role", required=True, choices=("user", "assistant"))
    content = m.data.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    blocks = m.items("content", required=True)
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    parts: list[dict[str, Any]] = []  # text and media, when the turn has images
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for b in blocks:
        kind = b.str("type", required=True)
        if kind == "text":
            texts.append(b.str("text", required=True))
            parts.append({"type": "text", "text": texts[-1]})
        elif kind == "image" and role == "user" and media:
            parts.append(convert.media_part(b.data, b.prefix))
        elif kind == "thinking" and role == "assistant":
            reasoning.append(b.str("thinking") or "")
        elif kind == "redacted_thinking" and role == "assistant":
            continue
        elif kind == "tool_use" and role == "assistant":
            calls.append({"id": b.str("id", required=True), "type": "function",
                          "function": {"name": b.str("name", required=True),
                                       "arguments": convert.arguments_object(b.data.get("input"), b.path("input"))}})
        elif kind == "tool_result" and role == "user":
            b.str("tool_use_id", required=True)
            result = convert.text_content(b.data.get("content"), b.path("content"), served=media)
            out.append({"role": "tool", "content": ("Error: " + result) if b.bool("is_error") else result,
                        "tool_call_id": b.data["tool_use_id"]})
        elif kind == "image" and media:
            raise invalid(f"'{b.path('type')}' image blocks are accepted in user messages only", b.path("type"),
                          code="invalid_media")
        elif kind == "document" and media:
            raise invalid(f"'{b.path('type')}' document blocks are not supported: only images and videos are",
                          b.path("type"), code="invalid_media")
        elif kind in ("image", "document"):
            raise invalid(f"'{b.path('type')}' {kind!r} blocks need vision, which this server does not serve "
                          "(start it with --vision)", b.path("type"), code="vision_disabled")
        else:
            raise invalid(f"'{b.path('type')}' {kind!r} is not a supported {role} content block", b.path("type"))
    if role == "user":
        if any(p["type"] != "text" for p in parts):
            out.append({"role": "user", "content": parts})
        elif texts or not out:
            out.append({"role": "user", "content": "".join(texts)})
        return out
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return [message]


def _thinking(t: Fields | None, max_tokens: int | None) -> tuple[bool | None, int | None]:
    """The thinking mode (None: the server default) and the reasoning budget in tokens, if any."""
    if t is None:
        return None, None
    kind = t.str("type", required=True, choices=("enabled", "disabled", "adaptive", "between_tools"))
    if t.str("display") == "omitted":
        raise unsupported("thinking.display", "'omitted' is not available")
    budget = None
    if kind == "enabled":
        budget = t.int("budget_tokens", required=True, lo=1024)
        if max_tokens is not None and budget is not None and budget >= max_tokens:
            raise invalid(f"'thinking.budget_tokens' ({budget}) must be less than 'max_tokens' ({max_tokens})",
                          "thinking.budget_tokens")
    return kind != "disabled", budget


def _tool(t: Fields) -> dict[str, Any]:
    if t.str("type") not in (None, "custom"):
        raise invalid(f"'{t.path('type')}' {t.data['type']!r} is not supported: only custom tools are", t.path("type"))
    return convert.function_tool(t.data.get("name"), t.data.get("description"), t.dict("input_schema"), t.prefix,
                                 "input_schema")


def _stop_reason(reason: str, out: OutputStream, stop_sequence: str | None) -> str:
    if reason == "length":
        return "max_tokens"
    if out.tool_calls:
        return "tool_use"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def _signature(thinking: str) -> str:
    return base64.b64encode(hashlib.sha256(thinking.encode()).digest()).decode()


def _usage(usage: Any, output: bool = True) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens,
            "output_tokens": usage.completion_tokens if output else 0,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": usage.cached_tokens}


def _tool_use(call: Any) -> dict[str, Any]:
    return {"type": "tool_use", "id": convert.new_id("toolu_"), "name": call.name, "input": call.arguments}


async def count_tokens(request: HTTPRequest, service: Service) -> Response:
    async with service.preparing_request():
        body = await read_json(request, service.config.max_request_bytes)
        chat, _, _ = parse(body, counting=True, media=service.vision is not None)
        service.model_name(body["model"])  # strict_model_names: a model not served is a 404 here too
        prompt = await service.prompt(chat, request)
    return JSONResponse({"input_tokens": len(prompt.ids)})


async def create(request: HTTPRequest, service: Service) -> Response:
    async with service.preparing_request():
        body = await read_json(request, service.config.max_request_bytes)
        chat, spec, stream = parse(body, media=service.vision is not None)
        model = service.model_name(body["model"])
        prompt = await service.prompt(chat, request)
        req = await service.request_for(prompt, spec)
    mid = request_id.body_id(request, "msg_")
    out = service.output(req, chat)
    run = await service.start(req, request)
    if stream:
        return sse_response(_stream(service, run, out, mid, model), service.config.keepalive_s, run.close)
    result = await run.collect(out, request)
    content: list[dict[str, Any]] = []
    if result.reasoning:
        content.append({"type": "thinking", "thinking": result.reasoning, "signature": _signature(result.reasoning)})
    if result.text:
        content.append({"type": "text", "text": result.text})
    content.extend(_tool_use(c) for c in result.tool_calls)
    if not content:  # an empty answer still has one (empty) text block, as in the stream
        content.append({"type": "text", "text": ""})
    return JSONResponse({"id": mid, "type": "message", "role": "assistant", "model": model,
                         "content": content, "stop_reason": _stop_reason(result.finish_reason, out,
                                                                          result.stop_sequence),
                         "stop_sequence": result.stop_sequence, "usage": _usage(result.usage)})


def _frame(kind: str, **fields: Any) -> bytes:
    return sse_frame(json_text({"type": kind, **fields}), kind)


async def _stream(service: Service, run: Run, out: OutputStream, mid: str, model: str) -> AsyncIterator[bytes]:
    index = -1
    open_kind: str | None = None
    thinking: list[str] = []

    def close() -> list[bytes]:
        nonlocal open_kind
        frames = []
        if open_kind == "thinking":
            frames.append(_frame("content_block_delta", index=index,
                                 delta={"type": "signature_delta", "signature": _signature("".join(thinking))}))
        if open_kind is not None:
            frames.append(_frame("content_block_stop", index=index))
        open_kind = None
        return frames

    def start(block: dict[str, Any]) -> list[bytes]:
        nonlocal index, open_kind
        frames = close()
        index += 1
        open_kind = block["type"]
        return frames + [_frame("content_block_start", index=index, content_block=block)]

    try:
        message = {"id": mid, "type": "message", "role": "assistant", "model": model, "content": [],
                   "stop_reason": None, "stop_sequence": None, "usage": _usage(out.usage(), output=False)}
        yield _frame("message_start", message=message)
        async for event in run.events():
            for kind, value in out.push(event):
                frames: list[bytes] = []
                if kind == "reasoning":
                    if open_kind != "thinking":
                        frames += start({"type": "thinking", "thinking": "", "signature": ""})
                    thinking.append(value)
                    frames.append(_frame("content_block_delta", index=index,
                                         delta={"type": "thinking_delta", "thinking": value}))
                elif kind == "text":
                    if open_kind != "text":
                        frames += start({"type": "text", "text": ""})
                    frames.append(_frame("content_block_delta", index=index,
                                         delta={"type": "text_delta", "text": value}))
                else:
                    block = _tool_use(value)
                    frames += start({**block, "input": {}})
                    frames.append(_frame("content_block_delta", index=index,
                                         delta={"type": "input_json_delta", "partial_json": value.arguments_json}))
                    frames += close()
                for frame in frames:
                    yield frame
        if (err := convert.engine_failure(out.finish_reason, out.error)) is not None:
            raise err
        if index < 0:  # an empty answer still has one (empty) text block
            for frame in start({"type": "text", "text": ""}):
                yield frame
        for frame in close():
            yield frame
        stop_sequence = out.stop_sequence()
        yield _frame("message_delta", delta={"stop_reason": _stop_reason(out.finish_reason or "stop", out,
                                                                         stop_sequence),
                                             "stop_sequence": stop_sequence},
                     usage={"output_tokens": len(out.token_ids)})
        yield _frame("message_stop")
    except APIError as err:
        yield sse_frame(json.dumps(err.body("anthropic")), "error")
    finally:
        run.close()
