"""Prefill budgets of the step plan: one large chunk while nothing decodes, a bounded one while others do.

The scheduler tests plan steps without a model; the engine tests run the tiny checkpoints on CPU and
check that the chunking the budgets choose never changes a token (against a one-chunk prefill).
"""
from __future__ import annotations

import pytest
import torch

import ninfer
from ninfer.runtime.engine_config import EngineConfig
from ninfer.runtime.pools import PagePool, SlotPool
from ninfer.runtime.request import Request
from ninfer.runtime.sampling import SamplingParams
from ninfer.runtime.scheduler import Scheduler
from tiny_checkpoints import TinyCheckpoint


def _scheduler(**kw) -> Scheduler:
    args = dict(max_concurrency=4, max_context=40000, page_size=64, prefill_chunk=8192,
                prefill_tokens_while_decoding=1024, pages=PagePool(4 * 40000 // 64), slots=SlotPool(8))
    return Scheduler(**{**args, **kw})


def _request(n: int) -> Request:
    return Request(prompt_ids=[1] * n, params=SamplingParams(), max_new_tokens=16)


def _chunks(plan) -> list[int]:
    return [end - req.num_computed for req, end in plan.prefills]


def _run_plan(plan) -> None:
    """What the engine does with a plan, minus the model: the chunks are computed, decodes grow by one."""
    for req in plan.decode:
        req.num_computed += 1
        req.output_ids.append(0)
    for req, end in plan.prefills:
        req.num_computed = end
        if req.prefill_done:
            req.output_ids.append(0)


def test_engine_defaults() -> None:
    config = EngineConfig()
    assert config.prefill_chunk == 8192 and config.prefill_tokens_while_decoding == 1024


def test_a_prompt_alone_prefills_in_chunks_of_prefill_chunk() -> None:
    sched = _scheduler()
    sched.add(_request(20000))
    sched.admit()
    sizes = []
    while sched.running[0].num_computed < 20000:
        plan = sched.plan()
        assert not plan.decode
        sizes += _chunks(plan)
        _run_plan(plan)
    assert sizes == [8192, 8192, 3616]


def test_prompts_arriving_together_share_one_large_step() -> None:
    sched = _scheduler()
    for n in (1000, 1000, 1000, 1000):
        sched.add(_request(n))
    sched.admit()
    plan = sched.plan()
    assert _chunks(plan) == [1000] * 4 and not plan.decode


def test_while_others_decode_chunks_stay_within_the_decoding_budget() -> None:
    sched = _scheduler()
    for n in (10, 10, 32768):
        sched.add(_request(n))
    sched.admit()
    first = sched.plan()
    assert _chunks(first) == [10, 10, 8192 - 20]  # nobody decodes yet: one large step
    _run_plan(first)
    sizes = []
    while not sched.running[2].prefill_done:
        plan = sched.plan()
        assert len(plan.decode) == 2  # the short ones decode in every step of the long prefill
        sizes += _chunks(plan)
        _run_plan(plan)
    assert max(sizes) == 1024 and sum(sizes) == 32768 - 8172 and sizes[-1] == (32768 - 8172) % 1024
    # Once nothing decodes (the others finished), the rest of a prompt takes large chunks again.
    sched.add(_request(20000))
    sched.admit()
    for req in sched.running[:3]:
        sched.finish(req)
    assert _chunks(sched.plan()) == [8192]


def test_the_decoding_budget_is_capped_by_prefill_chunk_and_validated() -> None:
    assert _scheduler(prefill_chunk=256, prefill_tokens_while_decoding=1024).prefill_budget(decoding=3) == 256
    assert _scheduler(prefill_tokens_while_decoding=None).prefill_budget(decoding=1) == 8192  # old behaviour
    sched = _scheduler(prefill_tokens_while_decoding=300)
    assert sched.prefill_budget(0) == 8192 and sched.prefill_budget(1) == 300
    with pytest.raises(ValueError, match="prefill_tokens_while_decoding must be >= 1, got 0"):
        _scheduler(prefill_tokens_while_decoding=0)


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 448, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("ckpt_name", ["dense_ckpt", "moe_ckpt"])
def test_bounded_chunks_next_to_decodes_give_the_one_chunk_tokens(ckpt_name: str, request) -> None:
    ckpt: TinyCheckpoint = request.getfixturevalue(ckpt_name)
    short, long = _prompts([6, 150], seed=5)
    # The oracle: each prompt alone, prefilled in one chunk.
    ref = ninfer.load(ckpt.path, device="cpu", max_concurrency=1, prefill_chunk=4096, prefix_cache=False,
                      progress=False)
    params = ref.sampling_params(greedy=True)
    expected = [ref.generate_ids(p, 24, params).token_ids for p in (short, long)]
    llm = ninfer.load(ckpt.path, device="cpu", max_concurrency=2, prefill_chunk=4096, prefill_tokens_while_decoding=16,
                      prefix_cache=False, progress=False)
    engine = llm.engine
    reqs = [llm._request(p, 24, llm.sampling_params(greedy=True)) for p in (short, long)]
    steps: list[tuple[int, list[int]]] = []
    real_plan = engine.scheduler.plan

    def spy():
        plan = real_plan()
        steps.append((len(plan.decode), _chunks(plan)))
        return plan

    engine.scheduler.plan = spy
    engine.add_request(reqs[0])
    engine.step()  # the short prompt alone: one chunk
    engine.add_request(reqs[1])  # arrives while the short one decodes
    engine.run_until_done()
    assert [r.output_ids for r in reqs] == expected
    assert steps[0] == (0, [6])
    long_chunks = [chunks for decoding, chunks in steps[1:] if chunks]
    assert all(decoding == 1 for decoding, chunks in steps[1:] if chunks)
    assert [c for chunks in long_chunks for c in chunks] == [16] * 9 + [6]
    assert engine.is_idle()


def test_a_prompt_alone_is_one_step_with_the_defaults(dense_ckpt: TinyCheckpoint) -> None:
    llm = ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=2, prefix_cache=False, progress=False)
    chunks: list[list[int]] = []
    real_plan = llm.engine.scheduler.plan

    def spy():
        plan = real_plan()
        chunks.append(_chunks(plan))
        return plan

    llm.engine.scheduler.plan = spy
    llm.generate_ids(_prompts([3000], seed=6)[0], 2, llm.sampling_params(greedy=True))
    assert chunks[0] == [3000] and chunks[1:] == [[]]


@pytest.mark.parametrize("chunk,while_decoding,longest", [(8192, 1024, 8192), (64, 64, 68), (64, 16, 64)])
def test_warm_up_reaches_the_longest_step_the_budgets_allow(dense_ckpt: TinyCheckpoint, monkeypatch, chunk: int,
                                                            while_decoding: int, longest: int) -> None:
    """A step without decode rows prefills up to ``prefill_chunk``; one with (up to 4 here) up to the budget
    while decoding plus those rows: warm-up's longest chunk is the larger of the two, no more."""
    from ninfer.runtime import model_runner

    llm = ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=4, max_context=16384, kv_capacity=16384,
                      prefill_chunk=chunk, prefill_tokens_while_decoding=while_decoding, progress=False)
    seen = []
    monkeypatch.setattr(model_runner, "warmup_chunk_lengths", lambda n: seen.append(n) or [])
    llm.engine.warm_up()
    assert seen == [longest] and llm.engine.is_idle()

