"""vLLM's ``POST /tokenize`` and ``POST /detokenize``, and ``GET /version``.

``/tokenize`` takes a raw ``prompt`` or chat ``messages`` (rendered by the served chat template with
the generation prompt, images and videos expanded to their pad tokens as a chat request's are) and answers ``{"count", "max_model_len", "tokens"}`` (plus
``token_strs`` with ``return_token_strs``). ``add_special_tokens`` (default: true for a prompt, false
for messages, as vLLM) is honoured; the Qwen tokenizers add no special tokens either way.
``/detokenize`` takes ``tokens`` and answers ``{"prompt"}``. ``GET /tokenizer_info`` describes the
tokenizer (special tokens, the served chat template), as vLLM's does: lm-evaluation-harness's
``local-completions`` then tokenizes through these routes instead of loading a tokenizer itself.
"""
from __future__ import annotations

from importlib import metadata
from typing import Any

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

from ninfer.api import convert
from ninfer.api.errors import invalid
from ninfer.api.openai_chat import function_tools, parse_messages
from ninfer.api.service import ChatInput, Service
from ninfer.api.validation import Fields, check_unknown, read_json

TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                             "continue_final_message", "return_token_strs", "tools", "chat_template_kwargs",
                             "enable_thinking"})
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


async def tokenize(request: HTTPRequest, service: Service) -> Response:
    async with service.preparing_request():
        body = await read_json(request, service.config.max_request_bytes)
        f = Fields(body)
        check_unknown(f, TOKENIZE_FIELDS)
        service.model_name(f.str("model"))
        has_prompt, has_messages = f.has("prompt"), f.has("messages")
        if has_prompt == has_messages:
            raise invalid("give exactly one of 'prompt' and 'messages'", "messages" if has_messages else "prompt",
                          code="missing_required_parameter" if not has_prompt else None)
        tokenizer = service.tokenizer
        if has_prompt:
            for name in ("add_generation_prompt", "tools", "chat_template_kwargs", "enable_thinking"):
                if f.has(name):
                    raise invalid(f"'{name}' applies to 'messages' only", name)
            text = f.str("prompt", required=True)
            assert text is not None
            service.check_prompt_size(text, "prompt")
            add_special = f.bool("add_special_tokens") is not False
            ids = tokenizer.hf.encode(text, add_special_tokens=True) if add_special else tokenizer.encode(text)
        else:  # rendered and tokenized as a chat request would be: media pads expanded, long prompts off the loop
            if f.bool("add_special_tokens") and tokenizer.hf.encode("", add_special_tokens=True):
                raise invalid("'add_special_tokens': true is not supported for messages: the chat template "
                              "places the special tokens", "add_special_tokens", code="unsupported_parameter")
            ids = (await service.prompt(_chat(f, service), request)).ids
    out: dict[str, Any] = {"count": len(ids), "max_model_len": service.max_context, "tokens": list(ids)}
    if f.bool("return_token_strs"):
        out["token_strs"] = tokenizer.hf.convert_ids_to_tokens(list(ids))
    return JSONResponse(out)


def _chat(f: Fields, service: Service) -> ChatInput:
    """The chat of ``messages`` (and ``tools``, thinking options), as a chat completion would read it."""
    if f.bool("continue_final_message"):
        raise invalid("'continue_final_message' is not supported by this server", "continue_final_message",
                      code="unsupported_parameter")
    if f.bool("add_generation_prompt") is False:
        raise invalid("'add_generation_prompt': false is not supported by this server (the prompt ends with the "
                      "assistant turn's opening)", "add_generation_prompt", code="unsupported_parameter")
    messages = parse_messages(f, service.vision is not None)
    tools = [convert.function_tool(t.sub("function", required=True).data.get("name"),
                                   t.data["function"].get("description"), t.data["function"].get("parameters"),
                                   t.path("function"))
             for t in function_tools(f)]
    enable, preserve, effort = convert.thinking_options(f, f.sub("chat_template_kwargs"))
    return ChatInput(messages, convert.unique_tools(tools, "tools"), "auto", enable, preserve, effort)


async def detokenize(request: HTTPRequest, service: Service) -> Response:
    body = await read_json(request, service.config.max_request_bytes)
    f = Fields(body)
    check_unknown(f, DETOKENIZE_FIELDS)
    service.model_name(f.str("model"))
    tokens = f.list("tokens", required=True) or []
    vocab = service.tokenizer.vocab_size
    for i, t in enumerate(tokens):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
            raise invalid(f"'tokens[{i}]' must be a token id in [0, {vocab}), got {t!r}"[:200], f"tokens[{i}]")
    return JSONResponse({"prompt": service.tokenizer.decode(tokens)})


async def tokenizer_info(request: HTTPRequest, service: Service) -> Response:
    hf = service.tokenizer.hf
    info: dict[str, Any] = {"tokenizer_class": type(hf).__name__, "model_max_length": service.max_context,
                            "chat_template": service.chat_template or getattr(hf, "chat_template", None)}
    for name in ("eos_token", "bos_token", "pad_token", "unk_token"):
        info[name] = getattr(hf, name, None)
    return JSONResponse(info)


async def version(request: HTTPRequest, service: Service) -> Response:
    try:
        number = metadata.version("ninfer")
    except metadata.PackageNotFoundError:  # run from a source tree
        number = "unknown"
    return JSONResponse({"version": number})
