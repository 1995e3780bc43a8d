"""OpenAI Chat Completions: ``POST /v1/chat/completions``, streaming and not.

Stream grammar: an assistant-role chunk, then reasoning (``reasoning_content``), content and
tool-call deltas, a finish chunk, the optional usage chunk (empty ``choices``), ``[DONE]``.
Every field of OpenAI's and vLLM's request is either honoured or a 400 naming it (vLLM's extensions:
:mod:`ninfer.api.extra_fields`); a field in neither list is a 400 ``unknown_parameter``, as OpenAI answers.
"""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

from ninfer.api import convert, extra_fields, request_id, structured
from ninfer.api.errors import APIError, invalid, unsupported
from ninfer.api.output import Collected, OutputStream, Usage
from ninfer.api.samples import Samples, check_n, sample_requests
from ninfer.api.sampling import check_min_tokens, logit_bias, parse_fields, stop_strings
from ninfer.api.service import ChatInput, GenerationSpec, Service
from ninfer.api.streaming import json_text, sse_frame, sse_response
from ninfer.api.validation import Fields, check_unknown, read_json
from ninfer.runtime.sampling import INT32_MAX

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
KNOWN = frozenset({
    # OpenAI's
    "model", "messages", "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
    "max_completion_tokens", "max_tokens", "metadata", "modalities", "moderation", "n", "parallel_tool_calls",
    "prediction", "presence_penalty", "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention",
    "reasoning_effort", "response_format", "safety_identifier", "seed", "service_tier", "stop", "store", "stream",
    "stream_options", "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user", "verbosity",
    "web_search_options",
    # vLLM's and ninfer's extensions
    "top_k", "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids", "min_tokens", "chat_template_kwargs",
    "enable_thinking", "preserve_thinking", "structured_outputs", *structured.GUIDED, "guided_decoding_backend",
    "guided_whitespace_pattern", *extra_fields.NAMES, *extra_fields.CHAT_NEUTRAL,
})


def parse(body: dict[str, Any], max_stop: int, media: bool = False, vocab_size: int = INT32_MAX
          ) -> tuple[ChatInput, GenerationSpec, bool, bool]:
    """``(chat, spec, stream, include_usage)`` of a request body; ``media``: keep image/video parts of user turns;
    ``vocab_size`` bounds the token ids of ``logit_bias``."""
    f = Fields(body)
    check_unknown(f, KNOWN)
    f.str("model")
    messages = parse_messages(f, media)
    _reject_unsupported(f, vocab_size)
    tools = [convert.function_tool(t.sub("function", required=True).data.get("name"),
                                   t.data["function"].get("description"), t.data["function"].get("parameters"),
                                   t.path("function"))
             for t in function_tools(f)]
    enable, preserve, effort = convert.thinking_options(f, f.sub("chat_template_kwargs"))
    tools = convert.unique_tools(tools, "tools")
    choice, forced = structured.tool_choice(body.get("tool_choice"), tools, parallel=f.bool("parallel_tool_calls"))
    chat = ChatInput(messages, tools, choice, enable, preserve, effort)
    max_tokens = f.int("max_completion_tokens", lo=0)
    if max_tokens is None:
        max_tokens = f.int("max_tokens", lo=0)
    spec = GenerationSpec(max_tokens, stop_strings(f, "stop", max_stop), parse_fields(f), _logprobs(f),
                          n=f.int("n", lo=1) or 1, ignore_eos=bool(f.bool("ignore_eos")),
                          stop_token_ids=extra_fields.stop_token_ids(f, vocab_size))
    check_min_tokens(spec.sampling, max_tokens)
    spec.structured = structured.from_chat(f, forced)
    stream = bool(f.bool("stream"))
    options = f.sub("stream_options")
    include_usage = bool(options.bool("include_usage")) if options is not None else False
    return chat, spec, stream, include_usage


def parse_messages(f: Fields, media: bool = False) -> list[dict[str, Any]]:
    """The template messages of ``messages`` (required, non-empty)."""
    return [_message(m, media) for m in f.items("messages", required=True, nonempty=True)]


def function_tools(f: Fields) -> list[Fields]:
    tools = f.items("tools")
    for t in tools:
        if t.str("type") not in (None, "function"):
            raise invalid(f"'{t.path('type')}' {t.data['type']!r} is not supported: only function tools are",
                          t.path("type"))
    return tools


def _message(m: Fields, media: bool = False) -> dict[str, Any]:
    role = m.str("role", required=True, choices=ROLES)
    content = convert.message_content(m.data.get("content"), m.path("content"), ("text", "refusal"),
                                      media and role == "user", media)
    if role == "function":  # legacy function result
        role = "tool"
    out: dict[str, Any] = {"role": role, "content": content}
    if role == "assistant":
        reasoning = m.str("reasoning_content")
        if reasoning is None:
            reasoning = m.str("reasoning")
        if reasoning is not None:
            out["reasoning_content"] = reasoning
        calls = []
        for c in m.items("tool_calls"):
            fn = c.sub("function", required=True)
            name = fn.str("name", required=True)
            calls.append({"id": c.str("id") or convert.new_id("call_"), "type": "function",
                          "function": {"name": name, "arguments": convert.arguments_object(
                              fn.data.get("arguments"), fn.path("arguments"))}})
        if calls:
            out["tool_calls"] = calls
    elif role == "tool":
        m.str("tool_call_id")
    return out


def _reject_unsupported(f: Fields, vocab_size: int) -> None:
    if any(logit_bias(f, vocab_size).values()):
        raise unsupported("logit_bias", "only an empty or all-zero bias is accepted")
    if f.has("audio"):
        raise unsupported("audio")
    modalities = f.list("modalities")
    if modalities and modalities != ["text"]:
        raise unsupported("modalities", "only [\"text\"] is served")
    if f.has("functions") and f.data["functions"]:
        raise unsupported("functions", "use 'tools'")
    if f.bool("store"):
        raise unsupported("store", "stored completions are not kept")
    if f.has("web_search_options"):
        raise unsupported("web_search_options")
    if f.str("verbosity") not in (None, "medium"):
        raise unsupported("verbosity", "only 'medium' is accepted")
    if f.has("prediction"):
        raise unsupported("prediction")
    if f.has("function_call"):
        raise unsupported("function_call", "use 'tool_choice'")
    if f.has("moderation"):
        raise unsupported("moderation", "no moderation runs")
    if f.str("service_tier") not in (None, "auto", "default"):
        raise unsupported("service_tier", "one tier is served: 'auto' or 'default'")
    if f.str("prompt_cache_retention") not in (None, "in_memory", "in-memory"):
        raise unsupported("prompt_cache_retention", "the prefix cache lives in memory (evicted under pressure)")
    if f.has("prompt_cache_options"):
        raise unsupported("prompt_cache_options", "the prefix cache is automatic")
    for name in ("user", "safety_identifier", "prompt_cache_key"):  # identifiers: nothing to do with them
        f.str(name)
    f.dict("metadata")
    options = f.sub("stream_options")
    if options is not None:
        check_unknown(options, frozenset({"include_usage", "include_obfuscation", "continuous_usage_stats"}))
        if options.bool("include_obfuscation"):
            raise unsupported("stream_options.include_obfuscation", "chunks are not padded")
        if options.bool("continuous_usage_stats"):
            raise unsupported("stream_options.continuous_usage_stats", "usage comes in the last chunk")
    extra_fields.check(f)
    extra_fields.check(f, extra_fields.CHAT_NEUTRAL, {})


def _logprobs(f: Fields) -> int | None:
    wanted = f.bool("logprobs")
    top = f.int("top_logprobs", lo=0, hi=20)
    if top and not wanted:
        raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if wanted else None


def _finish_reason(out: Collected | OutputStream, reason: str) -> str:
    if reason == "length":
        return "length"
    return "tool_calls" if out.tool_calls else "stop"


def _tool_call(call: Any) -> dict[str, Any]:
    return {"id": convert.new_id("call_"), "type": "function",
            "function": {"name": call.name, "arguments": call.arguments_json}}


async def handle(request: HTTPRequest, service: Service) -> Response:
    async with service.preparing_request():
        body = await read_json(request, service.config.max_request_bytes)
        chat, spec, stream, include_usage = parse(body, service.config.max_stop, service.vision is not None,
                                                  service.tokenizer.vocab_size)
        check_n(spec.n, service)
        model = service.model_name(body.get("model") if isinstance(body.get("model"), str) else None)
        prompt = await service.prompt(chat, request)
        created, cid = int(time.time()), request_id.body_id(request, "chatcmpl-")
        if spec.max_tokens == 0:  # process the prompt only: nothing to generate
            service.check_context(len(prompt.ids))
            if stream:
                return sse_response(_empty_stream(_empty(model, cid, created, len(prompt.ids), spec.n),
                                                  include_usage), service.config.keepalive_s, lambda: None)
            return JSONResponse(_empty(model, cid, created, len(prompt.ids), spec.n))
        reqs = await sample_requests(service, await service.request_for(prompt, spec), spec)
    outs = [service.output(req, chat) for req in reqs]
    samples = Samples(service, reqs)
    await samples.start(request)
    if stream:
        return sse_response(_stream(service, samples, outs, model, cid, created, include_usage,
                                    spec.logprobs is not None), service.config.keepalive_s, samples.close)
    results = await samples.collect(outs, request)
    choices = []
    for index, result in enumerate(results):
        message: dict[str, Any] = {"role": "assistant",
                                   "content": result.text if result.text or not result.tool_calls else None,
                                   "refusal": None}
        if result.reasoning is not None:
            message["reasoning_content"] = result.reasoning
        if result.tool_calls:
            message["tool_calls"] = [_tool_call(c) for c in result.tool_calls]
        logprobs = ({"content": convert.logprob_entries(result.logprobs, service.tokenizer)}
                    if spec.logprobs is not None else None)
        choices.append({"index": index, "message": message, "logprobs": logprobs,
                        "finish_reason": _finish_reason(result, result.finish_reason)})
    return JSONResponse({"id": cid, "object": "chat.completion", "created": created, "model": model,
                         "choices": choices, "usage": convert.openai_usage(_total([r.usage for r in results])),
                         "system_fingerprint": None})


def _total(usages: list[Usage]) -> Usage:
    """One prompt's usage (its tokens counted once, as sample 0 read them) with every sample's completion."""
    first = usages[0]
    if len(usages) == 1:
        return first
    return Usage(first.prompt_tokens, sum(u.completion_tokens for u in usages), sum(u.reasoning_tokens for u in usages),
                 first.cached_tokens, sum(u.accepted_prediction_tokens for u in usages),
                 sum(u.rejected_prediction_tokens for u in usages))


def _empty(model: str, cid: str, created: int, prompt_tokens: int, n: int) -> dict[str, Any]:
    usage = convert.openai_usage(Usage(prompt_tokens=prompt_tokens))
    return {"id": cid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": i, "message": {"role": "assistant", "content": "", "refusal": None},
                         "logprobs": None, "finish_reason": "length"} for i in range(n)],
            "usage": usage, "system_fingerprint": None}


async def _empty_stream(done: dict[str, Any], include_usage: bool) -> AsyncIterator[bytes]:
    """The stream of an answer with nothing generated (``max_tokens: 0``)."""
    base = {k: done[k] for k in ("id", "created", "model", "system_fingerprint")}
    base["object"] = "chat.completion.chunk"
    for choice in done["choices"]:
        yield sse_frame(json_text({**base, "choices": [{"index": choice["index"], "logprobs": None,
                                                        "delta": {"role": "assistant", "content": ""},
                                                        "finish_reason": "length"}]}))
    if include_usage:
        yield sse_frame(json.dumps({**base, "choices": [], "usage": done["usage"]}))
    yield sse_frame("[DONE]")


async def _stream(service: Service, samples: Samples, outs: list[OutputStream], model: str, cid: str, created: int,
                  include_usage: bool, logprobs: bool) -> AsyncIterator[bytes]:
    base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": None}
    if include_usage:
        base["usage"] = None

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None, lp: Any = None) -> bytes:
        return sse_frame(json_text({**base, "choices": [{"index": index, "delta": delta, "logprobs": lp,
                                                         "finish_reason": finish}]}))
    try:
        for index in range(len(outs)):
            yield chunk(index, {"role": "assistant", "content": ""})
        async for index, event in samples.events():
            out = outs[index]
            lp = ({"content": convert.logprob_entries(event.logprobs, service.tokenizer)}
                  if logprobs and event.logprobs else None)
            for kind, value in out.push(event):
                if kind == "reasoning":
                    yield chunk(index, {"reasoning_content": value}, lp=lp)
                elif kind == "text":
                    yield chunk(index, {"content": value}, lp=lp)
                else:
                    yield chunk(index, {"tool_calls": [{"index": value.index, **_tool_call(value)}]}, lp=lp)
                lp = None
            if lp is not None:
                yield chunk(index, {}, lp=lp)
            if event.finished:
                if (err := convert.engine_failure(out.finish_reason, out.error)) is not None:
                    raise err
                yield chunk(index, {}, _finish_reason(out, out.finish_reason or "stop"))
        if include_usage:
            usage = _total([o.usage() for o in outs])
            yield sse_frame(json.dumps({**base, "choices": [], "usage": convert.openai_usage(usage)}))
    except APIError as err:
        yield sse_frame(json.dumps(err.body("openai")))
    finally:
        samples.close()
    yield sse_frame("[DONE]")
