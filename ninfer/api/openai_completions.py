"""OpenAI (legacy) Completions: ``POST /v1/completions``, streaming and not.

Raw prompts, no chat template: a string, an array of token ids, or an array of either (a batch;
choice ``index`` = prompt index * ``n`` + sample index). ``echo`` puts the prompt before the
completion; ``logprobs`` (0..20) gives the legacy log-probability lists, and with ``echo`` the
prompt tokens' too (:mod:`ninfer.api.legacy_logprobs`). ``max_tokens`` defaults to 16 (OpenAI's
and vLLM's default); 0 only processes the prompt. Stream grammar: one chunk per text delta, each
choice's finish chunk, the optional usage chunk (empty ``choices``), ``[DONE]``. Unknown fields and
fields the engine cannot honour are 400s naming them.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

from ninfer.api import convert, extra_fields, request_id, structured
from ninfer.api.errors import APIError, invalid, unsupported
from ninfer.api.legacy_logprobs import LegacyLogprobs, prompt_entries
from ninfer.api.output import OutputStream, Usage
from ninfer.api.samples import Samples, check_n, sample_requests
from ninfer.api.sampling import check_min_tokens, logit_bias, parse_fields, stop_strings
from ninfer.api.service import INLINE_PROMPT_CHARS, GenerationSpec, Service
from ninfer.api.streaming import json_text, sse_frame, sse_response
from ninfer.api.validation import Fields, check_unknown, read_json
from ninfer.runtime.sampling import MAX_LOGPROBS

DEFAULT_MAX_TOKENS = 16
MAX_PROMPTS = 64  # prompts of one batch request
KNOWN = frozenset({
    "model", "prompt", "suffix", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "logprobs",
    "echo", "stop", "presence_penalty", "frequency_penalty", "best_of", "logit_bias", "user", "seed",
    # vLLM's extensions
    "top_k", "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids", "min_tokens", "add_special_tokens",
    "response_format", "structured_outputs", *structured.GUIDED, "guided_decoding_backend", "guided_whitespace_pattern",
    *extra_fields.NAMES,
})
@dataclass
class Parsed:
    prompts: list[list[int]]  # token ids of each prompt
    texts: list[str | None]  # each prompt's text (None for token-id prompts: decoded when echoed)
    spec: GenerationSpec
    echo: bool
    stream: bool
    include_usage: bool
    model: str | None


def parse(body: dict[str, Any], service: Service) -> Parsed:
    f = Fields(body)
    check_unknown(f, KNOWN)
    model = f.str("model")
    if f.data.get("suffix") not in (None, ""):
        raise unsupported("suffix", "insertion (fill-in-the-middle) is not served")
    extra_fields.check(f)
    if any(logit_bias(f, service.tokenizer.vocab_size).values()):
        raise unsupported("logit_bias", "only an empty or all-zero bias is accepted")
    f.str("user")
    n = check_n(f.int("n"), service)
    best_of = f.int("best_of")
    if best_of is not None and best_of != n:
        raise unsupported("best_of", f"only best_of == n ({n}) is served: samples are not ranked")
    add_special = f.bool("add_special_tokens")
    prompts, texts = _prompts(f, service, add_special is not False)
    if len(prompts) * n > service.lanes + service.config.max_pending:
        raise invalid(f"{len(prompts)} prompts x n={n} samples exceed the server's {service.lanes} lanes and "
                      f"{service.config.max_pending} queue places", "prompt")
    max_tokens = f.int("max_tokens", lo=0)
    logprobs = f.int("logprobs", lo=0, hi=MAX_LOGPROBS)
    spec = GenerationSpec(DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
                          stop_strings(f, "stop", service.config.max_stop), parse_fields(f), logprobs,
                          structured.from_chat(f), n, bool(f.bool("ignore_eos")))
    spec.stop_token_ids = extra_fields.stop_token_ids(f, service.tokenizer.vocab_size)
    check_min_tokens(spec.sampling, spec.max_tokens)
    options = f.sub("stream_options")
    include_usage = bool(options.bool("include_usage")) if options is not None else False
    if options is not None and options.bool("continuous_usage_stats"):
        raise unsupported("stream_options.continuous_usage_stats", "usage comes in the last chunk")
    return Parsed(prompts, texts, spec, bool(f.bool("echo")), bool(f.bool("stream")), include_usage, model)


def _prompts(f: Fields, service: Service, add_special: bool) -> tuple[list[list[int]], list[str | None]]:
    """``prompt``: a string, token ids, or an array of strings / token-id arrays (a batch)."""
    value = f.data.get("prompt")
    if value is None:
        raise invalid("'prompt' is required", "prompt", code="missing_required_parameter")
    single = isinstance(value, str) or (isinstance(value, list) and bool(value) and all(_is_id(v) for v in value))
    if single:
        value = [value]
    if not isinstance(value, list) or not value:
        raise invalid("'prompt' must be a string, an array of token ids, or a non-empty array of these", "prompt")
    if len(value) > MAX_PROMPTS:
        raise invalid(f"'prompt' has {len(value)} prompts; at most {MAX_PROMPTS} are allowed", "prompt")
    ids, texts = [], []
    vocab = service.tokenizer.vocab_size
    for i, item in enumerate(value):
        path = "prompt" if single else f"prompt[{i}]"
        if isinstance(item, str):
            service.check_prompt_size(item, path)
            encoded = (service.tokenizer.hf.encode(item, add_special_tokens=True) if add_special
                       else service.tokenizer.encode(item))
            ids.append(list(encoded))
            texts.append(item)
        elif isinstance(item, list) and all(_is_id(t) for t in item):
            bad = next((t for t in item if not 0 <= t < vocab), None)
            if bad is not None:
                raise invalid(f"'{path}' holds the token id {bad}, outside [0, {vocab})", path)
            ids.append(list(item))
            texts.append(None)
        else:
            raise invalid(f"'{path}' must be a string or an array of token ids", path)
        if not ids[-1]:
            raise invalid(f"'{path}' is empty: at least one token is needed", path, code="invalid_prompt")
        service.check_context(len(ids[-1]), path)
    return ids, texts


def _size(prompt: Any) -> int:
    """Characters (or token ids) of a ``prompt`` field, roughly: what tokenizing it costs."""
    if isinstance(prompt, (str, list)):
        return sum(len(p) if isinstance(p, (str, list)) else 1 for p in prompt) if isinstance(prompt, list) \
            else len(prompt)
    return 0


def _is_id(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class Choice:
    """One choice's text and logprobs as they build up."""

    def __init__(self, service: Service, out: OutputStream | None, prefix: str, logprobs: bool) -> None:
        self.out, self.prefix = out, prefix
        self.lp = LegacyLogprobs(service.tokenizer) if logprobs else None


async def _choices(service: Service, p: Parsed, groups: list[list[Any]]) -> list[Choice]:
    """A :class:`Choice` per sample; echoed prompts (and their scored tokens) go in first."""
    choices = []
    top = p.spec.logprobs or 0
    for ids, text, reqs in zip(p.prompts, p.texts, groups):
        prompt_text = (text if text is not None else service.tokenizer.decode(ids)) if p.echo else ""
        scored = await prompt_entries(service, ids, top) if p.echo and p.spec.logprobs is not None else None
        for req in reqs:
            c = Choice(service, service.output(req, None) if req is not None else None, prompt_text,
                       p.spec.logprobs is not None)
            if c.lp is not None and scored is not None:
                c.lp.add(scored)
            choices.append(c)
    return choices


async def handle(request: HTTPRequest, service: Service) -> Response:
    async with service.preparing_request():
        body = await read_json(request, service.config.max_request_bytes)
        # long prompts are tokenized on a worker thread, so the event loop keeps streaming meanwhile
        p = parse(body, service) if _size(body.get("prompt")) <= INLINE_PROMPT_CHARS else \
            await asyncio.to_thread(parse, body, service)
        model = service.model_name(p.model)
        generate = p.spec.max_tokens != 0
        groups: list[list[Any]] = []
        for ids in p.prompts:
            if not generate:
                groups.append([None] * p.spec.n)
                continue
            first = service.request(ids, None, p.spec, param="prompt")
            if p.spec.structured is not None:
                first.params = dataclasses.replace(first.params, structured=p.spec.structured)
                first.grammar = await structured.grammar_for(service.llm, p.spec.structured, False)
            groups.append(await sample_requests(service, first, p.spec))
        choices = await _choices(service, p, groups)
    cid, created = request_id.body_id(request, "cmpl-"), int(time.time())
    base = {"id": cid, "object": "text_completion", "created": created, "model": model}
    prompt_tokens = sum(len(ids) for ids in p.prompts)
    if not generate:  # the prompt only (echoed and scored)
        if p.stream:
            return sse_response(_prompt_only_stream(choices, base, p, prompt_tokens), service.config.keepalive_s,
                                lambda: None)
        return JSONResponse({**base, "choices": [_choice(i, c, "length") for i, c in enumerate(choices)],
                             "usage": convert.openai_usage(Usage(prompt_tokens)), "system_fingerprint": None})
    samples = Samples(service, [r for g in groups for r in g], groups=[len(g) for g in groups])
    await samples.start(request)
    if p.stream:
        return sse_response(_stream(service, samples, choices, base, p, prompt_tokens), service.config.keepalive_s,
                            samples.close)
    outs = [c.out for c in choices]
    results = await samples.collect(outs, request)  # type: ignore[arg-type]
    for c, out in zip(choices, outs):
        if c.lp is not None:
            c.lp.add(out.logprobs)  # type: ignore[union-attr]
    usage = _usage(prompt_tokens, [r.usage for r in results], samples.leaders())
    return JSONResponse({**base, "choices": [_choice(i, c, _finish(r.finish_reason), r.text)
                                             for i, (c, r) in enumerate(zip(choices, results))],
                         "usage": convert.openai_usage(usage), "system_fingerprint": None})


def _usage(prompt_tokens: int, usages: list[Usage], leaders: list[int]) -> Usage:
    """Each prompt counted once, with the cached tokens its first sample read; every sample's completion."""
    return Usage(prompt_tokens, completion_tokens=sum(u.completion_tokens for u in usages),
                 cached_tokens=sum(usages[i].cached_tokens for i in leaders))


def _finish(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"


def _choice(index: int, c: Choice, finish: str | None, text: str = "") -> dict[str, Any]:
    return {"index": index, "text": c.prefix + text, "logprobs": c.lp.body() if c.lp is not None else None,
            "finish_reason": finish}


async def _prompt_only_stream(choices: list[Choice], base: dict[str, Any], p: Parsed,
                              prompt_tokens: int) -> AsyncIterator[bytes]:
    head = {**base, "usage": None} if p.include_usage else base
    for i, c in enumerate(choices):
        yield sse_frame(json_text({**head, "choices": [{"index": i, "text": c.prefix, "finish_reason": "length",
                                                        "logprobs": c.lp.body() if c.lp is not None else None}]}))
    if p.include_usage:
        yield sse_frame(json.dumps({**head, "choices": [], "usage": convert.openai_usage(Usage(prompt_tokens))}))
    yield sse_frame("[DONE]")


async def _stream(service: Service, samples: Samples, choices: list[Choice], base: dict[str, Any], p: Parsed,
                  prompt_tokens: int) -> AsyncIterator[bytes]:
    head = {**base, "usage": None} if p.include_usage else base

    def chunk(index: int, text: str, lp: Any = None, finish: str | None = None) -> bytes:
        return sse_frame(json_text({**head, "choices": [{"index": index, "text": text, "logprobs": lp,
                                                         "finish_reason": finish}]}))
    try:
        for i, c in enumerate(choices):  # echoed prompts first
            if c.prefix or (c.lp is not None and c.lp.tokens):
                yield chunk(i, c.prefix, c.lp.body() if c.lp is not None else None)
        async for i, event in samples.events():
            c = choices[i]
            assert c.out is not None
            pieces = c.out.push(event)
            text = "".join(v for kind, v in pieces if kind == "text")
            lp = c.lp.add(event.logprobs) if c.lp is not None and event.logprobs else None
            if text or lp is not None:
                yield chunk(i, text, lp)
            if event.finished:
                if (err := convert.engine_failure(c.out.finish_reason, c.out.error)) is not None:
                    raise err
                yield chunk(i, "", None, _finish(c.out.finish_reason))
        if p.include_usage:
            usage = _usage(prompt_tokens, [c.out.usage() for c in choices if c.out is not None], samples.leaders())
            yield sse_frame(json.dumps({**head, "choices": [], "usage": convert.openai_usage(usage)}))
    except APIError as err:
        yield sse_frame(json.dumps(err.body("openai")))
    finally:
        samples.close()
    yield sse_frame("[DONE]")
