"""OpenAI Responses: ``POST /v1/responses`` (+ store routes and ``/v1/responses/input_tokens``).

Stream grammar: every SSE frame's event name equals its JSON ``type`` and carries a rising
``sequence_number``: ``response.created`` → ``response.in_progress`` → per output item
``output_item.added`` / ``content_part.added`` → ``reasoning_text.delta`` / ``output_text.delta`` /
``function_call_arguments.delta`` → the ``.done`` events → exactly one terminal
``response.completed`` / ``response.incomplete`` / ``response.failed``; no ``[DONE]``.
Unknown top-level fields are ``unknown_parameter`` errors.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

from ninfer.api import convert, request_id, structured
from ninfer.api import responses_items as items_
from ninfer.api.errors import APIError, invalid, unsupported
from ninfer.api.output import OutputStream
from ninfer.api.sampling import check_min_tokens, parse_fields, stop_strings
from ninfer.api.service import ChatInput, GenerationSpec, Prompt, Run, Service
from ninfer.api.streaming import json_text, sse_frame, sse_response
from ninfer.api.validation import Fields, check_unknown, read_json

KNOWN = frozenset({
    "model", "input", "instructions", "previous_response_id", "tools", "tool_choice", "max_output_tokens",
    "temperature", "top_p", "reasoning", "stream", "stream_options", "store", "metadata", "text",
    "parallel_tool_calls", "truncation", "user", "include", "top_logprobs", "service_tier", "safety_identifier",
    "prompt_cache_key", "prompt_cache_retention", "background", "max_tool_calls", "conversation", "prompt",
    # extensions
    "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "stop", "min_tokens",
    "enable_thinking", "preserve_thinking", "chat_template_kwargs",
})


@dataclass
class Parsed:
    chat: ChatInput
    spec: GenerationSpec
    items: list[dict[str, Any]]  # the whole effective input, chain included
    echo: dict[str, Any]  # request fields the response object repeats
    stream: bool
    store: bool


def parse(body: dict[str, Any], service: Service, store: Any) -> Parsed:
    f = Fields(body)
    if "n" in body:  # before the generic unknown-field check: say why
        raise unsupported("n", "a response has one output; send one request per sample, or use Chat Completions' n")
    check_unknown(f, KNOWN)
    model = service.model_name(f.str("model"))
    if f.bool("background"):
        raise unsupported("background", "there are no background jobs")
    for name in ("conversation", "prompt", "max_tool_calls"):
        if f.has(name):
            raise unsupported(name)
    text = f.sub("text")
    f.str("truncation", choices=("disabled", "auto"))
    include = f.str_or_list("include", max_items=16)
    if f.str("service_tier") not in (None, "auto", "default"):
        raise unsupported("service_tier", "one tier is served: 'auto' or 'default'")
    if f.str("prompt_cache_retention") not in (None, "in_memory", "in-memory"):
        raise unsupported("prompt_cache_retention", "the prefix cache lives in memory (evicted under pressure)")
    for name in ("user", "safety_identifier", "prompt_cache_key"):  # identifiers: nothing to do with them
        f.str(name)
    instructions = f.str("instructions")
    media = service.vision is not None
    items = items_.input_items(body.get("input"), media) if body.get("input") is not None else []
    previous = f.str("previous_response_id")
    if previous is not None:
        record = store.get(previous)
        if record is None:
            raise APIError(404, f"previous_response_id {previous!r} is not in the response store",
                           code="response_not_found", param="previous_response_id")
        items = record.input_items + [_as_input(i) for i in record.response["output"]] + items
    if not items:
        raise invalid("'input' is required (or a previous_response_id)", "input", code="missing_required_parameter")
    tools, raw_tools = [], []
    for t in f.items("tools"):
        if t.str("type") != "function":
            raise invalid(f"'{t.path('type')}' {t.data.get('type')!r} is not supported: only function tools are",
                          t.path("type"))
        tools.append(convert.function_tool(t.data.get("name"), t.data.get("description"), t.data.get("parameters"),
                                           t.prefix))
        raw_tools.append(t.data)
    reasoning = f.sub("reasoning")
    effort = reasoning.str("effort", choices=convert.EFFORTS) if reasoning is not None else None
    enable, preserve, _ = convert.thinking_options(f, f.sub("chat_template_kwargs"))
    if effort is not None:
        if enable is not None and enable != (effort != "none"):
            raise invalid(f"'reasoning.effort' {effort!r} contradicts 'enable_thinking'", "reasoning.effort",
                          code="conflicting_template_option")
        enable = effort != "none"
    tools = convert.unique_tools(tools, "tools")
    choice, forced = structured.tool_choice(body.get("tool_choice"), tools, parallel=f.bool("parallel_tool_calls"))
    constraint = structured.from_responses(text, forced)
    chat = ChatInput(items_.template_messages(items, instructions), tools, choice, enable, preserve, effort)
    top = f.int("top_logprobs", lo=0, hi=20)
    # logprobs come back with top_logprobs > 0 or when include asks for them (then with top_logprobs alternatives)
    wanted = bool(top) or "message.output_text.logprobs" in include
    spec = GenerationSpec(f.int("max_output_tokens", lo=1), stop_strings(f, "stop", service.config.max_stop),
                          parse_fields(f), (top or 0) if wanted else None, constraint)
    check_min_tokens(spec.sampling, spec.max_tokens, "max_output_tokens")
    metadata = f.dict("metadata") or {}
    echo = {"model": model, "instructions": instructions, "max_output_tokens": spec.max_tokens,
            "previous_response_id": previous,
            "reasoning": {"effort": effort, "summary": None}, "tool_choice": body.get("tool_choice") or choice, "tools": raw_tools,
            "parallel_tool_calls": f.bool("parallel_tool_calls") is not False, "metadata": metadata,
            "text": {"format": structured.echo_format(constraint)}, "truncation": f.data.get("truncation") or "disabled",
            "user": f.str("user")}
    store_it = f.bool("store") is not False
    return Parsed(chat, spec, items, echo, bool(f.bool("stream")), store_it)


def _as_input(item: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in item.items() if k != "status"} | {"status": "completed"}


def response_object(service: Service, rid: str, created: int, p: Parsed, status: str, output: list[Any],
                    usage: Any = None, params: Any = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    usage_obj = None if usage is None else {
        "input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens}, "total_tokens": usage.total_tokens}
    return {"id": rid, "object": "response", "created_at": created, "status": status, "background": False,
            "error": error, "incomplete_details": incomplete, "model": service.model_id, "output": output,
            "usage": usage_obj, "store": p.store,
            "temperature": params.temperature if params is not None else None,
            "top_p": params.top_p if params is not None else None, **p.echo}


async def _prepare(request: HTTPRequest, service: Service, store: Any) -> tuple[Parsed, Prompt]:
    body = await read_json(request, service.config.max_request_bytes)
    p = parse(body, service, store)
    return p, await service.prompt(p.chat, request)


async def create(request: HTTPRequest, service: Service, store: Any) -> Response:
    async with service.preparing_request():
        p, prompt = await _prepare(request, service, store)
        req = await service.request_for(prompt, p.spec)
    rid, created = request_id.body_id(request, "resp_"), int(time.time())
    out = service.output(req, p.chat)
    run = await service.start(req, request)
    if p.stream:
        return sse_response(_stream(service, store, run, out, p, rid, created), service.config.keepalive_s,
                            run.close)
    result = await run.collect(out, request)
    incomplete = result.finish_reason == "length"
    logprobs = convert.logprob_entries(result.logprobs, service.tokenizer) if p.spec.logprobs is not None else None
    output = items_.output_items(result, incomplete, logprobs)
    response = response_object(service, rid, created, p, "incomplete" if incomplete else "completed", output,
                               result.usage, req.params)
    if p.store:
        store.put(response, p.items)
    return JSONResponse(response)


class _Events:
    """Builds the typed SSE frames of one streamed response."""

    def __init__(self) -> None:
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the reasoning or message item being streamed
        self.text = ""
        self.logprobs: list[Any] = []  # of the open message

    def frame(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse_frame(json_text(data), kind)

    def delta(self, kind: str, value: str, logprobs: list[Any] | None = None) -> list[bytes]:
        frames = []
        if self.open is None or self.open["type"] != ("reasoning" if kind == "reasoning" else "message"):
            frames += self.close()
            frames += self._start(kind)
        if not value:
            return frames
        self.text += value
        index, item = len(self.output) - 1, self.open
        assert item is not None
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": logprobs or []}
        if logprobs:
            self.logprobs.extend(logprobs)
        return frames + [self.frame(name, item_id=item["id"], output_index=index, content_index=0, delta=value,
                                    **extra)]

    def _start(self, kind: str) -> list[bytes]:
        if kind == "reasoning":
            item = items_.reasoning_item("", status="in_progress")
            item["content"] = []
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = items_.message_output("", status="in_progress")
            item["content"] = []
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.open, self.text, self.logprobs = item, "", []
        self.output.append(item)
        index = len(self.output) - 1
        return [self.frame("response.output_item.added", output_index=index, item=item),
                self.frame("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                           part=part)]

    def close(self, status: str = "completed") -> list[bytes]:
        item = self.open
        if item is None:
            return []
        self.open = None
        index = len(self.output) - 1
        if item["type"] == "reasoning":
            done = items_.reasoning_item(self.text, item["id"], status)
            part = done["content"][0]
            frames = [self.frame("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                 content_index=0, text=self.text)]
        else:
            done = items_.message_output(self.text, item["id"], status, self.logprobs)
            part = done["content"][0]
            frames = [self.frame("response.output_text.done", item_id=item["id"], output_index=index,
                                 content_index=0, text=self.text, logprobs=self.logprobs)]
        self.output[index] = done
        return frames + [self.frame("response.content_part.done", item_id=item["id"], output_index=index,
                                    content_index=0, part=part),
                         self.frame("response.output_item.done", output_index=index, item=done)]

    def tool_call(self, call: Any) -> list[bytes]:
        frames = self.close()
        done = items_.function_call_output(call)
        added = {**done, "arguments": "", "status": "in_progress"}
        self.output.append(done)
        index = len(self.output) - 1
        return frames + [
            self.frame("response.output_item.added", output_index=index, item=added),
            self.frame("response.function_call_arguments.delta", item_id=done["id"], output_index=index,
                       delta=done["arguments"]),
            self.frame("response.function_call_arguments.done", item_id=done["id"], output_index=index,
                       arguments=done["arguments"], name=done["name"]),
            self.frame("response.output_item.done", output_index=index, item=done)]


async def _stream(service: Service, store: Any, run: Run, out: OutputStream, p: Parsed, rid: str,
                  created: int) -> AsyncIterator[bytes]:
    ev = _Events()
    params = run.req.params
    try:
        start = response_object(service, rid, created, p, "in_progress", [], params=params)
        yield ev.frame("response.created", response=start)
        yield ev.frame("response.in_progress", response=start)
        async for event in run.events():
            lp = convert.logprob_entries(event.logprobs, service.tokenizer) if event.logprobs else None
            for kind, value in out.push(event):
                frames = ev.tool_call(value) if kind == "tool_call" else ev.delta(kind, value, lp)
                if kind == "text":
                    lp = None
                for frame in frames:
                    yield frame
        if (err := convert.engine_failure(out.finish_reason, out.error)) is not None:
            raise err
        incomplete = out.finish_reason == "length"
        if not out.text and not out.tool_calls and (ev.open is None or ev.open["type"] != "message"):
            for frame in ev.delta("text", ""):  # every response carries an answer message
                yield frame
        for frame in ev.close("incomplete" if incomplete else "completed"):
            yield frame
        status = "incomplete" if incomplete else "completed"
        final = response_object(service, rid, created, p, status, ev.output, out.usage(), params)
        if p.store:
            store.put(final, p.items)
        yield ev.frame(f"response.{status}", response=final)
    except APIError as err:
        failed = response_object(service, rid, created, p, "failed", ev.output, out.usage(), params,
                                 error={"code": err.code or "server_error", "message": err.message})
        yield ev.frame("response.failed", response=failed)
    finally:
        run.close()


async def input_tokens(request: HTTPRequest, service: Service, store: Any) -> Response:
    async with service.preparing_request():
        _, prompt = await _prepare(request, service, store)
    return JSONResponse({"object": "response.input_tokens", "input_tokens": len(prompt.ids)})


def _stored(store: Any, rid: str) -> Any:
    record = store.get(rid)
    if record is None:
        raise APIError(404, f"response {rid!r} is not in the response store", code="response_not_found",
                       param="response_id")
    return record


async def get(request: HTTPRequest, service: Service, store: Any) -> Response:
    return JSONResponse(_stored(store, request.path_params["response_id"]).response)


async def delete(request: HTTPRequest, service: Service, store: Any) -> Response:
    rid = request.path_params["response_id"]
    _stored(store, rid)
    store.delete(rid)
    return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})


async def list_input_items(request: HTTPRequest, service: Service, store: Any) -> Response:
    record = _stored(store, request.path_params["response_id"])
    q = request.query_params
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid(f"'order' must be asc or desc, got {order!r}", "order")
    try:
        limit = int(q.get("limit", "20"))
    except ValueError:
        raise invalid(f"'limit' must be an integer, got {q.get('limit')!r}", "limit") from None
    if not 1 <= limit <= 100:
        raise invalid(f"'limit' must be in [1, 100], got {limit}", "limit")
    data = list(record.input_items) if order == "asc" else list(reversed(record.input_items))
    after = q.get("after")
    if after is not None:
        ids = [i["id"] for i in data]
        if after not in ids:
            raise invalid(f"'after' {after!r} is not an item of this response", "after")
        data = data[ids.index(after) + 1:]
    page = data[:limit]
    return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None, "has_more": len(data) > limit})


async def not_supported(request: HTTPRequest, service: Service, store: Any) -> Response:
    if request.url.path.endswith("/compact"):
        raise APIError(400, "response compaction is not supported", code="compaction_not_supported")
    raise APIError(400, "responses run in the foreground: there is no background job to cancel",
                   code="background_not_supported")
