"""vLLM's request extensions beyond OpenAI's fields, and OpenAI fields this server cannot honour.

A field is honoured, or accepted only with the value that changes nothing (``NEUTRAL``: what this
server always does), or refused whatever its value (``REFUSED``); each refusal is a 400 that names
the field and says why. Chat Completions and Completions share these lists.
"""
from __future__ import annotations

from typing import Any

from ninfer.api.errors import invalid, unsupported
from ninfer.api.validation import Fields

# name -> (the neutral value, why any other is refused)
NEUTRAL: dict[str, tuple[Any, str]] = {
    "skip_special_tokens": (True, "special tokens are always left out of the text"),
    "spaces_between_special_tokens": (True, "special tokens are left out of the text"),
    "include_stop_str_in_output": (False, "stop strings are cut from the text"),
    "return_tokens_as_token_ids": (False, "tokens are reported as text"),
    "return_token_ids": (False, "token ids are not reported (use /tokenize)"),
    "use_beam_search": (False, "there is no beam search"),
    "length_penalty": (1.0, "there is no beam search"),
    "priority": (0, "requests are served first come, first served"),
}
REFUSED: dict[str, str] = {
    "prompt_logprobs": "use 'echo': true with 'logprobs' on /v1/completions",
    "truncate_prompt_tokens": "prompts are never truncated",
    "allowed_token_ids": "the sampler takes no token allow-list",
    "bad_words": "the sampler takes no banned words",
    "logits_processors": "no custom logits processors run",
    "structural_tag": "use response_format or structured_outputs",
    "mm_processor_kwargs": "media preprocessing is fixed by the server",
    "media_io_kwargs": "media loading is fixed by the server",
    "cache_salt": "the prefix cache is not partitioned",
    "kv_transfer_params": "there is no KV transfer",
    "vllm_xargs": "there are no extra engine arguments",
    "request_id": "send the id as the X-Request-Id header",
    "documents": "the chat template takes no documents",
    "chat_template": "the served chat template is fixed when the server starts",
}
# Chat only: vLLM's chat-rendering switches, accepted with what the server always renders.
CHAT_NEUTRAL: dict[str, tuple[Any, str]] = {
    "echo": (False, "the last message is not repeated in the answer"),
    "add_generation_prompt": (True, "the prompt always ends with the assistant turn's opening"),
    "continue_final_message": (False, "a final assistant message is not continued (the Messages API's prefill "
                                      "does that)"),
    "add_special_tokens": (False, "the chat template places every special token"),
}
NAMES = frozenset(NEUTRAL) | frozenset(REFUSED)


def check(f: Fields, neutral: dict[str, tuple[Any, str]] = NEUTRAL, refused: dict[str, str] | None = None) -> None:
    """400 for each field set to something this server cannot honour (the first found)."""
    for name, (value, why) in neutral.items():
        given = f.data.get(name)
        if given is None:
            continue
        if type(given) is not type(value) and not (isinstance(value, float) and isinstance(given, int)
                                                   and not isinstance(given, bool)):
            raise invalid(f"'{name}' must be {type(value).__name__}, got {type(given).__name__}", name)
        if given != value:
            raise unsupported(name, f"only {value!r} is accepted: {why}".replace("True", "true")
                              .replace("False", "false"))
    for name, why in (REFUSED if refused is None else refused).items():
        if f.data.get(name) is not None:
            raise unsupported(name, why)


def stop_token_ids(f: Fields, vocab_size: int) -> frozenset[int]:
    """vLLM's ``stop_token_ids``: generation stops after any of these tokens."""
    ids = f.list("stop_token_ids") or []
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise invalid(f"'stop_token_ids[{i}]' must be a token id in [0, {vocab_size})", f"stop_token_ids[{i}]")
    return frozenset(ids)
