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
    monkeypatch.setattr(model_runner, "warmup_chunk_lengths", lambda n, *_: seen.append(n) or [])
    llm.engine.warm_up()
    assert seen == [longest] and llm.engine.is_idle()


def test_warm_up_prefills_packed_batches_of_each_count_class(dense_ckpt: TinyCheckpoint, monkeypatch) -> None:
    """Serving packs decode rows and prompt chunks into one chunked DeltaNet launch, whose kernels compile per
    sequence-count class and checkpoint flag: warm-up runs each class with and without a checkpoint, then
    gives every page and slot back."""
    from ninfer.kernels.deltanet import chunked_batch_sizes
    from ninfer.runtime import model_runner

    llm = ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=4, progress=False)
    monkeypatch.setattr(model_runner, "warmup_chunk_lengths", lambda n, *_: [])
    seen = []
    forward = llm.engine.model.forward
    monkeypatch.setattr(llm.engine.model, "forward", lambda batch, cache, *a: seen.append(batch) or forward(batch, cache, *a))
    free_pages, free_slots = llm.engine.pages.num_available, llm.engine.slots.num_free
    llm.engine.warm_up()
    short, seen = seen[:1], seen[1:]  # the short checkpointed chunk (the next test) comes first
    assert short[0].max_seqlen <= model_runner.RECURRENT_MAX_SEQLEN
    packed = [(b.cu_seqlens.numel() - 1, b.ckpt_offsets is not None) for b in seen]
    assert packed == [(n, ckpt) for n in chunked_batch_sizes(4) for ckpt in (False, True)]
    for b in seen:
        assert b.max_seqlen > model_runner.RECURRENT_MAX_SEQLEN  # the chunked kernels, not the recurrent one
        if b.ckpt_offsets is not None:
            row, r, own, slot = b.checkpoints[0]
            assert int(b.ckpt_offsets[-1]) == r and int(b.ckpt_slots[-1]) == slot and slot not in b.state_slots.tolist()
    assert llm.engine.is_idle() and llm.engine.pages.num_available == free_pages
    assert llm.engine.slots.num_free == free_slots
    assert not llm.engine.runner.block_tables.any()


def test_warm_up_meets_the_short_conv_tiles_with_a_checkpoint(dense_ckpt: TinyCheckpoint, monkeypatch) -> None:
    """A chunk of a few tokens with a checkpoint inside runs the composed conv (not the one-launch decode
    kernel) with its short tile: warm-up prefills one such chunk per short tile length that can hold a
    checkpoint, on its own state slot and a scratch checkpoint slot, and gives both back."""
    from ninfer.kernels import conv
    from ninfer.runtime import model_runner

    llm = ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=4, progress=False)
    monkeypatch.setattr(model_runner, "warmup_chunk_lengths", lambda n, *_: [])
    seen = []
    forward = llm.engine.model.forward
    monkeypatch.setattr(llm.engine.model, "forward",
                        lambda batch, cache, *a: seen.append(batch) or forward(batch, cache, *a))
    free_slots = llm.engine.slots.num_free
    llm.engine.warm_up()
    short = [b for b in seen if b.max_seqlen <= model_runner.RECURRENT_MAX_SEQLEN]
    assert [(b.max_seqlen, b.checkpoints[0][1]) for b in short] == [(conv.CONV_SHORT_TILE, conv.CONV_SHORT_TILE // 2)]
    assert all(b.ckpt_offsets is not None for b in short)  # which keeps the one-launch decode kernel off
    assert {conv._conv_config(b.max_seqlen, 4, 256)[0] for b in short} == {4}  # the short tile, not decode's 1
    assert llm.engine.is_idle() and llm.engine.slots.num_free == free_slots


def test_warm_up_runs_the_draft_head_over_each_chunk(composite_ckpt: TinyCheckpoint, monkeypatch) -> None:
    """With MTP speculation, a prompt's chunks also run the head (its K/V), whose kernels compile per length
    class like the target's: warm-up runs the head once over each one-sequence chunk, without the LM head."""
    from ninfer.runtime import model_runner

    llm = ninfer.load(composite_ckpt.path, device="cpu", max_concurrency=2, prefill_chunk=64, spec="mtp",
                      draft_tokens=2, progress=False)
    head = llm.engine.spec.head
    lengths, logits = [], []
    advance, lm_head = head.advance, head.target.logits
    monkeypatch.setattr(head, "advance", lambda h, ids, batch, cache: lengths.append(h.shape[0]) or
                        advance(h, ids, batch, cache))
    monkeypatch.setattr(head.target, "logits", lambda h: logits.append(h.shape[0]) or lm_head(h))
    llm.engine.warm_up()
    assert lengths == model_runner.warmup_chunk_lengths(64)
    assert max(logits) == 1  # the target's last row only: the head's pairs take no LM head
    assert llm.engine.is_idle()
