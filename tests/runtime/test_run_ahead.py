"""Decode steps left in flight (``ninfer.runtime.run_ahead``): the tokens, stops, prefix checkpoints and
resources are those of the engine that reads each step's tokens before launching the next."""
from __future__ import annotations

import pytest
import torch

import ninfer
from ninfer.runtime import run_ahead
from ninfer.runtime.request import Request
from tiny_checkpoints import TinyCheckpoint


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 448, (n,), generator=g).tolist() for n in lengths]


def _load(ckpt: TinyCheckpoint, ahead: bool, **kw) -> ninfer.LLM:
    kw = dict(device="cpu", progress=False, max_concurrency=4, prefill_chunk=16) | kw
    return ninfer.load(ckpt.path, decode_ahead=ahead, **kw)


def _assert_balanced(llm: ninfer.LLM) -> None:
    engine = llm.engine
    if engine.prefix is not None:
        engine.prefix.clear()
    assert engine.is_idle() and not engine.requests and not engine.outputs
    assert engine.pages.num_free == engine.pages.num_pages and engine.pages.reserved == 0
    assert engine.slots.num_free == engine.slots.num_slots


def _drive(llm: ninfer.LLM, reqs: list[Request], arrivals: dict[int, list[Request]] | None = None,
           cancel_at: dict[int, Request] | None = None) -> tuple[dict[str, list], int]:
    """Step until done: ``arrivals[k]`` join before step k, ``cancel_at[k]`` is cancelled before it. Returns each
    request's events and how many steps ended with a step in flight."""
    events: dict[str, list] = {r.request_id: [] for r in reqs}
    for r in reqs:
        if not any(r in group for group in (arrivals or {}).values()):
            llm.engine.add_request(r)
    in_flight = 0
    for k in range(500):
        for r in (arrivals or {}).get(k, []):
            llm.engine.add_request(r)
        if k in (cancel_at or {}):
            cancelled = llm.engine.cancel(cancel_at[k].request_id)
            if cancelled is not None:
                events[cancelled.request_id].append(cancelled)
        if not llm.engine.has_work and k > max((arrivals or {0: 0}).keys()):
            return events, in_flight
        for e in llm.engine.step():
            events[e.request_id].append(e)
        in_flight += llm.engine.ahead is not None
    raise AssertionError("the engine still has work after 500 steps")


@pytest.mark.parametrize("sampling", ["greedy", "seeded", "penalties"])
def test_tokens_and_stops_match_the_engine_that_waits(dense_ckpt: TinyCheckpoint, sampling: str) -> None:
    """Several lanes with different budgets and stop ids, a prompt arriving mid-decode (the step in flight
    lands before its prefill), and sampled tokens whose RNG counters and penalty counts stay on the device."""
    runs = {}
    for ahead in (False, True):
        llm = _load(dense_ckpt, ahead)
        params = {"greedy": llm.sampling_params(greedy=True),
                  "seeded": llm.sampling_params(temperature=0.9, top_p=0.95, seed=11),
                  "penalties": llm.sampling_params(temperature=0.8, seed=5, repetition_penalty=1.3,
                                                   presence_penalty=0.5)}[sampling]
        prompts = _prompts([5, 23, 9, 40], seed=3)
        reqs = [llm._request(p, n, params, stop_token_ids=stop)
                for p, n, stop in zip(prompts, [3, 17, 1, 12], [None, None, None, [7, 100, 200]])]
        events, in_flight = _drive(llm, reqs[:3] + reqs[3:], arrivals={6: [reqs[3]]})
        runs[ahead] = ([r.output_ids for r in reqs], [r.finish_reason for r in reqs],
                       [[t for e in events[r.request_id] for t in e.token_ids] for r in reqs])
        assert (in_flight > 0) == ahead
        _assert_balanced(llm)
    assert runs[True] == runs[False]


def test_a_request_cancelled_while_its_step_is_in_flight(dense_ckpt: TinyCheckpoint) -> None:
    """Its row in the step in flight is dropped: no event after the cancel, the others' tokens unchanged."""
    outputs = {}
    for ahead in (False, True):
        llm = _load(dense_ckpt, ahead)
        reqs = [llm._request(p, 14, llm.sampling_params(greedy=True)) for p in _prompts([6, 11, 4], seed=8)]
        events, _ = _drive(llm, reqs, cancel_at={5: reqs[1]})
        after_cancel = events[reqs[1].request_id][-1]
        assert after_cancel.finished and after_cancel.finish_reason == "cancelled"
        outputs[ahead] = [reqs[0].output_ids, reqs[2].output_ids, reqs[1].output_ids]
        _assert_balanced(llm)
    assert outputs[True][:2] == outputs[False][:2]
    assert outputs[True][2] == outputs[False][2][:len(outputs[True][2])]


def test_the_prefix_cache_keeps_the_state_of_every_token(dense_ckpt: TinyCheckpoint) -> None:
    """A request that stops with a step in flight has consumed its last token: the checkpoint taken at its end
    covers ``tokens(0, num_computed)``, and the next turn, which resends all of it, decodes as without the cache."""
    turns = {}
    prompt = _prompts([30], seed=4)[0]
    probe = _load(dense_ckpt, False, max_concurrency=2, prefix_cache=False)
    greedy = probe._request(prompt, 9, probe.sampling_params(greedy=True))
    _drive(probe, [greedy])
    stop = next(t for i, t in enumerate(greedy.output_ids) if i >= 3 and t not in greedy.output_ids[:i])
    for ahead in (False, True):
        llm = _load(dense_ckpt, ahead, max_concurrency=2)
        first = llm._request(prompt, 9, llm.sampling_params(greedy=True), stop_token_ids=[stop])
        _drive(llm, [first])
        assert first.finish_reason == "stop" and first.output_ids[-1] == stop
        assert first.num_computed == len(prompt) + len(first.output_ids) - (0 if ahead else 1)
        again = llm._request(first.prompt_ids + first.output_ids + [17, 18], 6, llm.sampling_params(greedy=True))
        _drive(llm, [again])
        assert again.cached_tokens > len(first.prompt_ids)
        fresh = _load(dense_ckpt, False, max_concurrency=2, prefix_cache=False)
        alone = fresh._request(list(again.prompt_ids), 6, fresh.sampling_params(greedy=True))
        _drive(fresh, [alone])
        assert again.output_ids == alone.output_ids
        turns[ahead] = (first.output_ids, again.output_ids)
    assert turns[True] == turns[False]


def test_what_the_sampler_reads_on_the_host_keeps_the_step_waiting() -> None:
    """Grammars, logprobs, stop ids still forced by min_tokens and thinking budgets read the output length
    before each draw; a batch whose every request ends by length on its token in flight has no next step."""
    def req(**kw) -> Request:
        params = dict(logprobs=None, min_tokens=0, thinking_budget=None) | kw.pop("params", {})
        r = Request.__new__(Request)
        fields = dict(grammar=None, min_tokens_ids=(), think_end=None, output_ids=[1, 2], max_new_tokens=10,
                      params=type("P", (), params)()) | kw
        for k, v in fields.items():
            setattr(r, k, v)
        return r

    assert run_ahead.may_run_ahead([req(), req()])
    assert not run_ahead.may_run_ahead([req(), req(grammar=object())])
    assert not run_ahead.may_run_ahead([req(params=dict(logprobs=2))])
    assert not run_ahead.may_run_ahead([req(min_tokens_ids=(7,), params=dict(min_tokens=3))])
    assert run_ahead.may_run_ahead([req(min_tokens_ids=(7,), params=dict(min_tokens=2))])
    assert not run_ahead.may_run_ahead([req(think_end=9, params=dict(thinking_budget=4))])
    assert not run_ahead.may_run_ahead([req(max_new_tokens=3)])
    assert run_ahead.may_run_ahead([req(max_new_tokens=3), req(max_new_tokens=4)])


def test_steps_run_ahead_while_requests_wait_for_a_lane(dense_ckpt: TinyCheckpoint) -> None:
    """Every lane busy and a request queued: nothing can be admitted, so the steps still run ahead; the queued
    request starts once a lane frees, with the tokens the waiting engine gives it."""
    runs = {}
    for ahead in (False, True):
        llm = _load(dense_ckpt, ahead, max_concurrency=2)
        reqs = [llm._request(p, n, llm.sampling_params(greedy=True))
                for p, n in zip(_prompts([8, 5, 12], seed=9), [6, 15, 7])]
        queued_in_flight = 0
        for r in reqs:
            llm.engine.add_request(r)
        while llm.engine.has_work:
            llm.engine.step()
            queued_in_flight += bool(llm.engine.ahead is not None and llm.engine.scheduler.waiting)
        assert (queued_in_flight > 0) == ahead
        runs[ahead] = [r.output_ids for r in reqs]
        _assert_balanced(llm)
    assert runs[True] == runs[False]
