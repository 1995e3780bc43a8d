"""Failure isolation of the engine's per-request stages: what raises for one request fails that request alone.

Each helper takes ``fail(req, stage, err) -> events``, the engine's way to end one request with an error
event (releasing its lane, pages and slots), and appends those events to ``events``.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TypeVar

import torch

from ninfer.runtime.request import Request, RequestOutput
from ninfer.runtime.sampler import Draw, Sampler, TokenLogprobs

log = logging.getLogger("ninfer.engine")
Fail = Callable[[Request, str, Exception], list[RequestOutput]]
_Item = TypeVar("_Item")
_Out = TypeVar("_Out")


def error_message(stage: str, err: BaseException) -> str:
    """What the client is told: the failed stage and the exception."""
    return f"{stage} failed: {type(err).__name__}: {err}"


def prepare_each(items: Iterable[_Item], prepare: Callable[[_Item], _Out], stage: str, fail: Fail,
                 events: list[RequestOutput]) -> list[tuple[_Item, _Out]]:
    """``prepare`` each item (a request, or a ``(request, end)`` pair) on its own: those that raise are failed
    and left out; the others come with what ``prepare`` returned, in order."""
    done = []
    for item in items:
        try:
            done.append((item, prepare(item)))
        except Exception as err:
            events.extend(fail(item[0] if isinstance(item, tuple) else item, stage, err))
    return done


def sample_each(sampler: Sampler, logits: torch.Tensor, reqs: list[Request], fail: Fail,
                events: list[RequestOutput]) -> list[tuple[Request, int, TokenLogprobs | None]]:
    """Row i of ``logits`` sampled for ``reqs[i]``. Should the batched call raise, each row is sampled alone (rows
    are independent, so the tokens are the same), and only the requests whose own row raises are failed."""
    try:
        tokens, logprobs = sampler.sample(logits, reqs)
        return list(zip(reqs, tokens, logprobs))
    except Exception:
        log.warning("batched sampling failed; sampling the %d rows one at a time", len(reqs), exc_info=True)
    rows = []
    for i, req in enumerate(reqs):
        try:
            tokens, logprobs = sampler.sample(logits[i:i + 1], [req])
            rows.append((req, tokens[0], logprobs[0]))
        except Exception as err:
            events.extend(fail(req, "sampling", err))
    return rows


def draw_or_isolate(sampler: Sampler, logits: torch.Tensor, reqs: list[Request], drafts: torch.Tensor,
                    fail: Fail, events: list[RequestOutput]) -> Draw | None:
    """The speculative verification draw of ``reqs``, or None when it raised: then the requests whose rows fail
    alone are failed, and since nothing of the round was committed, the others simply run it again next step
    (same drafts, same tokens). When no request fails alone the fault is the batch's, and it is raised."""
    try:
        return sampler.draw_rows(logits, reqs, drafts)
    except Exception as batch_error:
        log.warning("speculative sampling failed; probing the %d requests one at a time", len(reqs), exc_info=True)
        t, culprits = drafts.shape[1] + 1, 0
        for b, req in enumerate(reqs):
            try:
                sampler.draw_rows(logits[b * t:(b + 1) * t], [req], drafts[b:b + 1])
            except Exception as err:
                culprits += 1
                events.extend(fail(req, "sampling", err))
        if not culprits:
            raise batch_error
    return None
