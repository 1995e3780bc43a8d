"""One request's fault ends that request alone: the others of its batch finish with the very tokens they
would have had, the faulty one ends with an error event, and every lane, page and slot goes back."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

import ninfer
from ninfer.runtime.request import Request, RequestOutput
from tiny_checkpoints import TinyCheckpoint

PROMPTS = [[5, 17, 33, 99, 12], list(range(20, 40)), [300, 301, 302, 7, 8, 9, 10, 11, 12], list(range(60, 72))]
VICTIM = 1  # PROMPTS[1] is 20 tokens: two prefill chunks of 16 + 4
NEW_TOKENS = 10
MAX_STEPS = 400  # every run here ends in far fewer steps; a hang fails instead of looping forever


class Injected(RuntimeError):
    """The fault the tests inject."""


def _greedy(llm: ninfer.LLM, prompt: list[int]) -> Request:
    return llm._request(list(prompt), NEW_TOKENS, llm.sampling_params(greedy=True))


def _load(ckpt: TinyCheckpoint, **kw) -> ninfer.LLM:
    kw = dict(device="cpu", progress=False, max_concurrency=4, prefill_chunk=16) | kw
    return ninfer.load(ckpt.path, **kw)


def _drive(llm: ninfer.LLM, reqs: list[Request]) -> dict[str, list[RequestOutput]]:
    events: dict[str, list[RequestOutput]] = {r.request_id: [] for r in reqs}
    for _ in range(MAX_STEPS):
        if not llm.engine.has_work:
            return events
        for event in llm.engine.step():
            events[event.request_id].append(event)
    raise AssertionError(f"the engine still has work after {MAX_STEPS} steps")


def _assert_balanced(llm: ninfer.LLM) -> None:
    engine = llm.engine
    assert engine.is_idle()
    if engine.prefix is not None:
        engine.prefix.clear()
    assert not engine.requests and not engine.outputs
    assert engine.pages.num_free == engine.pages.num_pages and engine.pages.reserved == 0
    assert engine.slots.num_free == engine.slots.num_slots
    assert len(engine.scheduler.free_lanes) == engine.config.max_concurrency


def _assert_isolated(reqs: list[Request], events: dict[str, list[RequestOutput]], expected: list[list[int]],
                     stage: str, victim: int = VICTIM) -> None:
    for i, (req, want) in enumerate(zip(reqs, expected)):
        finals = [e for e in events[req.request_id] if e.finished]
        assert len(finals) == 1, f"request {i}: {len(finals)} finished events"
        if i == victim:
            assert req.finish_reason == finals[0].finish_reason == "error"
            assert stage in finals[0].error and "Injected" in finals[0].error, finals[0].error
        else:
            assert finals[0].finish_reason in ("length", "stop") and finals[0].error is None
            assert req.output_ids == want, f"request {i} changed by another request's fault"


@pytest.fixture(scope="module")
def llm(dense_ckpt: TinyCheckpoint) -> ninfer.LLM:
    return _load(dense_ckpt)


@pytest.fixture(scope="module")
def expected(llm: ninfer.LLM) -> list[list[int]]:
    reqs = [_greedy(llm, p) for p in PROMPTS]
    for r in reqs:
        llm.engine.add_request(r)
    _drive(llm, reqs)
    _assert_balanced(llm)
    return [r.output_ids for r in reqs]


def _slots_fault(when: Callable[[Request, int, int], bool]) -> Callable:
    def inject(llm: ninfer.LLM, victim: Request, monkeypatch: pytest.MonkeyPatch) -> None:
        real = llm.engine._slots_for

        def slots_for(req: Request, start: int, end: int) -> list[int]:
            if req is victim and when(req, start, end):
                raise Injected("no pages for you")
            return real(req, start, end)
        monkeypatch.setattr(llm.engine, "_slots_for", slots_for)
    return inject


def _sampling_fault(llm: ninfer.LLM, victim: Request, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ways a batch is sampled raise for the victim: ``launch`` (a decode step's draw, left on the device) and
    ``sample`` (which the engine falls back to row by row)."""
    for name in ("launch", "sample"):
        def faulty(logits: torch.Tensor, reqs: list[Request], real=getattr(llm.engine.sampler, name)):
            if victim in reqs and len(victim.output_ids) >= 2:
                raise Injected("bad sampling values")
            return real(logits, reqs)
        monkeypatch.setattr(llm.engine.sampler, name, faulty)


def _admission_fault(llm: ninfer.LLM, victim: Request, monkeypatch: pytest.MonkeyPatch) -> None:
    real = llm.engine.sampler.start

    def start(req: Request, resume=None) -> None:
        if req is victim:
            raise Injected("lane setup")
        real(req, resume)
    monkeypatch.setattr(llm.engine.sampler, "start", start)


def _detokenizer_fault(llm: ninfer.LLM, victim: Request, monkeypatch: pytest.MonkeyPatch) -> None:
    detok = llm.engine.outputs[victim.request_id].detok
    real, calls = detok.push, []

    def push(token: int) -> str:
        calls.append(token)
        if len(calls) == 4:
            raise Injected("undecodable")
        return real(token)
    monkeypatch.setattr(detok, "push", push)


def _finish_fault(llm: ninfer.LLM, victim: Request, monkeypatch: pytest.MonkeyPatch) -> None:
    def finish(last, reason):
        raise Injected("flush")
    monkeypatch.setattr(llm.engine.outputs[victim.request_id], "finish", finish)


FAULTS = {
    "admission": _admission_fault,
    "prefill preparation": _slots_fault(lambda req, start, end: 0 < start < len(req.prompt_ids)),
    "decode preparation": _slots_fault(lambda req, start, end: start == len(req.prompt_ids) + 3),
    "sampling": _sampling_fault,
    "detokenization": _detokenizer_fault,
    "output processing": _finish_fault,
}


@pytest.mark.parametrize("stage", list(FAULTS))
def test_a_fault_in_one_request_ends_only_that_request(llm, expected, stage: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    reqs = [_greedy(llm, p) for p in PROMPTS]
    for r in reqs:
        llm.engine.add_request(r)
    FAULTS[stage](llm, reqs[VICTIM], monkeypatch)
    events = _drive(llm, reqs)
    _assert_isolated(reqs, events, expected, stage)
    _assert_balanced(llm)


def test_an_overflowing_sampling_value_fails_its_request_with_a_clear_error(llm, expected) -> None:
    # Values no range check caught (SamplingParams built directly) must not take the batch down with them.
    reqs = [_greedy(llm, p) for p in PROMPTS]
    params = dataclasses.replace(reqs[VICTIM].params)
    object.__setattr__(params, "top_k", 2**40)
    reqs[VICTIM].params = params
    for r in reqs:
        llm.engine.add_request(r)
    events = _drive(llm, reqs)
    final = events[reqs[VICTIM].request_id][-1]
    assert final.finish_reason == "error" and "top_k" in final.error, final.error
    for i, (req, want) in enumerate(zip(reqs, expected)):
        if i != VICTIM:
            assert req.output_ids == want
    _assert_balanced(llm)


def test_a_failing_batched_forward_fails_its_batch_and_the_engine_serves_on(llm, expected,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    real, calls = llm.engine.model.forward, []

    def forward(*args, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise Injected("device fault")
        return real(*args, **kw)
    monkeypatch.setattr(llm.engine.model, "forward", forward)
    reqs = [_greedy(llm, p) for p in PROMPTS]
    for r in reqs:
        llm.engine.add_request(r)
    events = _drive(llm, reqs)
    for req in reqs:  # the four shared that forward
        final = events[req.request_id][-1]
        assert final.finished and final.finish_reason == "error" and "Injected" in final.error
    _assert_balanced(llm)
    again = [_greedy(llm, p) for p in PROMPTS]
    for r in again:
        llm.engine.add_request(r)
    _drive(llm, again)
    assert [r.output_ids for r in again] == expected
    _assert_balanced(llm)


def test_an_error_event_survives_a_later_failure_in_the_same_step(llm, monkeypatch: pytest.MonkeyPatch) -> None:
    # The victim fails while its rows are prepared, then the step's forward fails too: the victim's own error
    # event must still come out of the step (its stream would otherwise wait forever), and the others end too.
    reqs = [_greedy(llm, p) for p in PROMPTS]
    for r in reqs:
        llm.engine.add_request(r)
    _slots_fault(lambda req, start, end: True)(llm, reqs[VICTIM], monkeypatch)
    real = llm.engine.model.forward

    def forward(*args, **kw):
        raise Injected("device fault")
    monkeypatch.setattr(llm.engine.model, "forward", forward)
    events = llm.engine.step()
    monkeypatch.setattr(llm.engine.model, "forward", real)
    finals = {e.request_id: e for e in events if e.finished}
    assert set(finals) == {r.request_id for r in reqs}
    assert "prefill preparation failed" in finals[reqs[VICTIM].request_id].error
    assert all("batched step failed" in finals[r.request_id].error for i, r in enumerate(reqs) if i != VICTIM)
    _assert_balanced(llm)


def test_requests_waiting_outside_a_failed_batch_are_unaffected(dense_ckpt: TinyCheckpoint, expected,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    llm = _load(dense_ckpt, max_concurrency=2)
    real, calls = llm.engine.model.forward, []

    def forward(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise Injected("device fault")
        return real(*args, **kw)
    monkeypatch.setattr(llm.engine.model, "forward", forward)
    reqs = [_greedy(llm, p) for p in PROMPTS]
    for r in reqs:
        llm.engine.add_request(r)
    _drive(llm, reqs)
    assert [r.finish_reason for r in reqs[:2]] == ["error", "error"]  # the two in the failed forward
    assert all(r.finish_reason in ("length", "stop") for r in reqs[2:])
    assert [r.output_ids for r in reqs[2:]] == expected[2:]
    _assert_balanced(llm)


# -- the speculative path ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def spec_pair(composite_ckpt: TinyCheckpoint) -> tuple[ninfer.LLM, list[list[int]]]:
    plain = _load(composite_ckpt, max_context=512)
    reqs = [_greedy(plain, p) for p in PROMPTS]
    for r in reqs:
        plain.engine.add_request(r)
    _drive(plain, reqs)
    return _load(composite_ckpt, max_context=512, spec="mtp", draft_tokens=2), [r.output_ids for r in reqs]


def _draw_fault(llm: ninfer.LLM, victim: Request, monkeypatch: pytest.MonkeyPatch) -> None:
    real = llm.engine.sampler.draw_rows

    def draw_rows(logits, reqs, drafts):
        if victim in reqs and len(victim.output_ids) >= 3:
            raise Injected("bad verification values")
        return real(logits, reqs, drafts)
    monkeypatch.setattr(llm.engine.sampler, "draw_rows", draw_rows)


def _spec_prefill_fault(llm: ninfer.LLM, victim: Request, monkeypatch: pytest.MonkeyPatch) -> None:
    real = llm.engine._prefill_logits

    def prefill_logits(req: Request, end: int):
        if req is victim and req.num_computed > 0:
            raise Injected("media chunk")
        return real(req, end)
    monkeypatch.setattr(llm.engine, "_prefill_logits", prefill_logits)


SPEC_FAULTS = {
    "sampling": _draw_fault,
    "prefill": _spec_prefill_fault,
    "speculation preparation": _slots_fault(lambda req, start, end: start == len(req.prompt_ids) + 2),
    "detokenization": _detokenizer_fault,
}


@pytest.mark.parametrize("stage", list(SPEC_FAULTS))
def test_speculative_rounds_isolate_a_faulty_request(spec_pair, stage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    llm, expected = spec_pair
    reqs = [_greedy(llm, p) for p in PROMPTS]
    for r in reqs:
        llm.engine.add_request(r)
    SPEC_FAULTS[stage](llm, reqs[VICTIM], monkeypatch)
    events = _drive(llm, reqs)
    _assert_isolated(reqs, events, expected, stage)
    _assert_balanced(llm)
