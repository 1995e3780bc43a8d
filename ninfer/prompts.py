"""Prompt inputs of the Python API: text, token ids, vLLM's prompt dicts, one or a batch; chat conversations."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

PROMPT_KEYS = ("prompt", "prompt_token_ids")  # vLLM's TextPrompt / TokensPrompt


@dataclass(frozen=True)
class PromptInput:
    """One prompt: its token ids, and its text when it was given as text."""

    token_ids: list[int]
    text: str | None = None


def parse_prompts(prompts: Any, encode: Callable[[str], list[int]], vocab_size: int) -> tuple[list[PromptInput], bool]:
    """The prompts of a call and whether a single one was given (not a list of them).

    A string, a list of token ids, or a dict ``{"prompt": text}`` / ``{"prompt_token_ids": ids}`` is
    one prompt; a list of those is a batch (so ``[[1, 2, 3], "text"]`` mixes both kinds).
    """
    if _is_single(prompts):
        return [_one(prompts, "prompt", encode, vocab_size)], True
    if not isinstance(prompts, Sequence) or isinstance(prompts, bytes):
        raise TypeError(f"prompts must be a string, a list of token ids, a prompt dict or a list of these, "
                        f"got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: give at least one prompt")
    return [_one(p, f"prompts[{i}]", encode, vocab_size) for i, p in enumerate(prompts)], False


def _is_single(prompt: Any) -> bool:
    if isinstance(prompt, (str, dict)):
        return True
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and all(_is_token(t) for t in prompt)


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _one(prompt: Any, where: str, encode: Callable[[str], list[int]], vocab_size: int) -> PromptInput:
    if isinstance(prompt, dict):
        unknown = sorted(set(prompt) - set(PROMPT_KEYS))
        if unknown:
            raise ValueError(f"{where}: unsupported prompt key(s) {unknown}; a prompt dict holds 'prompt' or "
                             f"'prompt_token_ids' (images and videos go through chat() message parts)")
        if len(prompt) != 1:
            raise ValueError(f"{where}: a prompt dict holds exactly one of 'prompt' or 'prompt_token_ids'")
        key, value = next(iter(prompt.items()))
        if key == "prompt":
            if not isinstance(value, str):
                raise TypeError(f"{where}['prompt'] must be a string, got {type(value).__name__}")
            return _text(value, where, encode)
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"{where}['prompt_token_ids'] must be a list of token ids, got {type(value).__name__}")
        return PromptInput(_token_ids(value, f"{where}['prompt_token_ids']", vocab_size))
    if isinstance(prompt, str):
        return _text(prompt, where, encode)
    if isinstance(prompt, (list, tuple)):
        return PromptInput(_token_ids(prompt, where, vocab_size))
    raise TypeError(f"{where} must be a string, a list of token ids or a prompt dict, got {type(prompt).__name__}")


def _text(text: str, where: str, encode: Callable[[str], list[int]]) -> PromptInput:
    ids = encode(text)
    if not ids:
        raise ValueError(f"{where} is empty: at least one token is needed")
    return PromptInput(ids, text)


def _token_ids(ids: Sequence[Any], where: str, vocab_size: int) -> list[int]:
    if len(ids) == 0:
        raise ValueError(f"{where} is empty: at least one token is needed")
    for i, t in enumerate(ids):
        if not _is_token(t) or not 0 <= t < vocab_size:
            raise ValueError(f"{where}[{i}] = {t!r} is not a token id (an integer in [0, {vocab_size}))")
    return list(ids)


def parse_conversations(messages: Any) -> tuple[list[list[dict[str, Any]]], bool]:
    """The conversations of a ``chat`` call (a list of messages, or a list of such lists) and whether one was given."""
    if not isinstance(messages, (list, tuple)) or len(messages) == 0:
        raise ValueError("messages must be a non-empty list of messages or a list of conversations")
    if all(isinstance(m, dict) for m in messages):
        return [list(messages)], True
    if all(isinstance(c, (list, tuple)) for c in messages):
        for i, c in enumerate(messages):
            if len(c) == 0 or not all(isinstance(m, dict) for m in c):
                raise ValueError(f"messages[{i}] must be a non-empty list of message dicts")
        return [list(c) for c in messages], False
    raise ValueError("messages must be a list of message dicts, or a list of conversations (lists of message dicts)")


def tool_schemas(tools: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """Declared tool name -> its parameters schema (OpenAI function-tool format), or None without tools."""
    if not tools:
        return None
    schemas: dict[str, Any] = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                             f"'parameters': {{...}}}}}}")
        schemas[function["name"]] = function.get("parameters") or {}
    return schemas
