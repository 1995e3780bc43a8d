"""Log-probabilities of the legacy Completions shape, and of the prompt's own tokens (``echo``).

The legacy ``logprobs`` object holds parallel lists: ``tokens``, ``token_logprobs``, ``top_logprobs``
(a ``{token: logprob}`` map per position) and ``text_offset`` (each token's start in the choice's
text). With ``echo`` the prompt's tokens come first, the first of them with null log-probabilities
(nothing precedes it): what lm-evaluation-harness's loglikelihood requests read.

The prompt is scored by the model's sequence runner (one prefill outside the engine's KV pool) on
the engine thread, between two engine steps, so it never runs the model concurrently with a step.
"""
from __future__ import annotations

import asyncio
from typing import Any

import torch

# (token id, logprob or None, [(alternative id, logprob), ...] or None)
Entry = tuple[int, float | None, list[tuple[int, float]] | None]
SCORE_SLICE = 256  # prompt rows whose logits (a vocabulary wide each) are materialised at once


def score_prompt(llm: Any, ids: list[int], top: int) -> list[Entry]:
    """Each prompt token's logprob given the tokens before it and its ``top`` most likely alternatives
    (first token: None). Runs the model: call it on the engine thread."""
    entries: list[Entry] = [(ids[0], None, None)]
    if len(ids) < 2:
        return entries
    vocab = getattr(llm, "valid_vocab", None)
    llm.runner.start(len(ids))  # outside inference mode, as LLM.score calls it: the cache stays usable by both
    with torch.no_grad():
        hidden = llm.runner.extend(ids)
        targets = torch.tensor(ids[1:], device=hidden.device)
        for i in range(0, len(ids) - 1, SCORE_SLICE):
            logits = llm.model.logits(hidden[i:i + SCORE_SLICE][: len(ids) - 1 - i]).float()
            lp = (logits[:, :vocab] if vocab else logits).log_softmax(-1)
            chosen = lp.gather(-1, targets[i:i + SCORE_SLICE, None])[:, 0].tolist()
            alts = lp.topk(top, dim=-1) if top > 0 else None
            alt_ids = alts.indices.tolist() if alts is not None else None
            alt_lps = alts.values.tolist() if alts is not None else None
            for j, logprob in enumerate(chosen):
                pairs = list(zip(alt_ids[j], alt_lps[j])) if alt_ids is not None and alt_lps is not None else []
                entries.append((ids[i + 1 + j], logprob, pairs))
    return entries


async def prompt_entries(service: Any, ids: list[int], top: int) -> list[Entry]:
    """:func:`score_prompt` run on the engine thread; its error (if any) is raised here."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def deliver(result: Any, error: BaseException | None) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)

    def work(_engine: Any) -> None:
        try:
            result: Any = score_prompt(service.llm, ids, top)
            error = None
        except Exception as err:  # delivered to the request, never raised on the engine thread
            result, error = None, err
        loop.call_soon_threadsafe(deliver, result, error)

    service.engine.call(work)
    return await future


class LegacyLogprobs:
    """Builds one choice's legacy ``logprobs`` object as tokens arrive."""

    def __init__(self, tokenizer: Any, text_offset: int = 0) -> None:
        self.tokenizer = tokenizer
        self.offset = text_offset  # where the next token's text starts in the choice's text
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def add(self, entries: list[Entry]) -> dict[str, Any]:
        """Append ``entries`` and return just their part (a stream chunk's ``logprobs``)."""
        part: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, logprob, alts in entries:
            text = self.tokenizer.decode([token_id])
            top = None if alts is None else {self.tokenizer.decode([a]): alp for a, alp in alts}
            for key, value in (("tokens", text), ("token_logprobs", logprob), ("top_logprobs", top),
                               ("text_offset", self.offset)):
                part[key].append(value)
            self.offset += len(text)
        self.tokens += part["tokens"]
        self.token_logprobs += part["token_logprobs"]
        self.top_logprobs += part["top_logprobs"]
        self.text_offset += part["text_offset"]
        return part

    def body(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
                "text_offset": self.text_offset}
