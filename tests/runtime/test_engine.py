"""The batching engine: batched == one at a time, chunking is invisible, resources always balance."""
from __future__ import annotations

import pytest
import torch

import ninfer
from ninfer.runtime import engine as engine_module
from ninfer.runtime.request import Request
from ninfer.runtime.scheduler import AdmissionError, QueueFull
from tiny_checkpoints import TinyCheckpoint


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 448, (n,), generator=g).tolist() for n in lengths]


def _assert_balanced(llm: ninfer.LLM) -> None:
    engine = llm.engine
    assert engine.is_idle()
    if engine.prefix is not None:
        engine.prefix.clear()
    assert not engine.has_work and not engine.requests and not engine.outputs
    assert engine.pages.num_free == engine.pages.num_pages and engine.pages.reserved == 0
    assert engine.slots.num_free == engine.slots.num_slots
    assert len(engine.scheduler.free_lanes) == engine.config.max_concurrency


def _greedy(llm: ninfer.LLM, prompt: list[int], n: int = 12, **kw) -> Request:
    return llm._request(prompt, n, llm.sampling_params(greedy=True), **kw)


@pytest.fixture(scope="module")
def solo(dense_ckpt: TinyCheckpoint) -> ninfer.LLM:
    return ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=1, progress=False)


def test_batched_equals_one_at_a_time_with_staggered_arrivals(dense_ckpt: TinyCheckpoint, solo) -> None:
    prompts = _prompts([5, 70, 1, 33, 130])
    expected = [solo._run([_greedy(solo, p)])[0].token_ids for p in prompts]
    _assert_balanced(solo)
    llm = ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=3, prefill_chunk=16, progress=False)
    reqs = [_greedy(llm, p) for p in prompts]
    llm.engine.add_request(reqs[0])
    llm.engine.add_request(reqs[1])
    llm.engine.step()
    llm.engine.step()
    for r in reqs[2:]:  # arrive mid-flight, one per step
        llm.engine.add_request(r)
        llm.engine.step()
    llm.engine.run_until_done()
    assert [r.output_ids for r in reqs] == expected
    _assert_balanced(llm)


@pytest.mark.parametrize("ckpt_name,ride", [("dense_ckpt", True), ("moe_ckpt", True), ("dense_ckpt", False)])
def test_prompts_arriving_together_prefill_packed_with_decode_rows(ckpt_name: str, ride: bool, request, solo,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # One forward carries the decode rows and the chunks of several prompts (a 40-token budget splits the
    # third prompt across steps); the tokens must equal one-at-a-time generation. Without riding (long
    # contexts) the decode rows take their own forward and the chunks are still packed.
    if not ride:
        monkeypatch.setattr(engine_module, "MIXED_MAX_CONTEXT", 0)
    ckpt = request.getfixturevalue(ckpt_name)
    ref = solo if ckpt_name == "dense_ckpt" else ninfer.load(ckpt.path, device="cpu", max_concurrency=1, progress=False)
    prompts = _prompts([5, 12, 30, 9, 3], seed=3)
    expected = [ref._run([_greedy(ref, p, 8)])[0].token_ids for p in prompts]
    # (prefix cache off: its checkpoint one token before each prompt's end would cut the chunks too)
    llm = ninfer.load(ckpt.path, device="cpu", max_concurrency=4, prefill_chunk=40, prefix_cache=False, progress=False)
    reqs = [_greedy(llm, p, 8) for p in prompts]
    for r in reqs[:4]:
        llm.engine.add_request(r)
    packed = []
    real_plan = llm.engine.scheduler.plan

    def spy():
        plan = real_plan()
        packed.append([(r.request_id, end - r.num_computed) for r, end in plan.prefills])
        return plan

    llm.engine.scheduler.plan = spy
    llm.engine.step()
    llm.engine.add_request(reqs[4])  # arrives while the others decode
    llm.engine.run_until_done()
    assert [r.output_ids for r in reqs] == expected
    assert [n for _, n in packed[0]] == [5, 12, 23]  # three prompts in the first step, the third cut at the budget
    assert [n for _, n in packed[1]] == [7, 9]  # the rest of the third prompt and the fourth, next to 3 decode rows
    _assert_balanced(llm)


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_prefill_chunk_size_is_invisible(moe_ckpt: TinyCheckpoint, chunk: int) -> None:
    prompt = _prompts([150], seed=1)[0]
    ref = ninfer.load(moe_ckpt.path, device="cpu", max_concurrency=1, prefill_chunk=4096, progress=False)
    llm = ninfer.load(moe_ckpt.path, device="cpu", max_concurrency=1, prefill_chunk=chunk, progress=False)
    assert llm.generate_ids(prompt, 10, llm.sampling_params(greedy=True)).token_ids == \
        ref.generate_ids(prompt, 10, ref.sampling_params(greedy=True)).token_ids
    _assert_balanced(llm)


def test_full_pool_makes_requests_wait_not_fail(dense_ckpt: TinyCheckpoint, solo) -> None:
    prompts = _prompts([60, 60, 60], seed=2)
    expected = [solo._run([_greedy(solo, p, 20)])[0].token_ids for p in prompts]
    # Room for one 80-token sequence at a time although three lanes exist.
    llm = ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=3, kv_capacity=128, progress=False)
    reqs = [_greedy(llm, p, 20) for p in prompts]
    for r in reqs:
        llm.engine.add_request(r)
    llm.engine.step()
    assert len(llm.engine.scheduler.running) == 1 and len(llm.engine.scheduler.waiting) == 2
    llm.engine.run_until_done()
    assert [r.output_ids for r in reqs] == expected
    _assert_balanced(llm)


def test_over_long_prompts_are_rejected_with_both_numbers(dense_ckpt: TinyCheckpoint) -> None:
    llm = ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=1, max_context=64, progress=False)
    with pytest.raises(AdmissionError, match="prompt has 64 tokens but max_context is 64"):
        llm.engine.add_request(_greedy(llm, _prompts([64])[0]))
    small_pool = ninfer.load(dense_ckpt.path, device="cpu", max_context=1024, kv_capacity=64, progress=False)
    with pytest.raises(AdmissionError, match="prompt has 100 tokens but the KV pool holds only 64 tokens"):
        small_pool.engine.add_request(_greedy(small_pool, _prompts([100])[0]))
    _assert_balanced(llm)
    _assert_balanced(small_pool)


def test_generation_stops_at_max_context(dense_ckpt: TinyCheckpoint) -> None:
    llm = ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=1, max_context=40, progress=False)
    out = llm.generate_ids(_prompts([30])[0], 100, llm.sampling_params(greedy=True))
    assert out.finish_reason == "length" and len(out.token_ids) == 10


def test_seeds_reproduce_whatever_else_is_in_the_batch(dense_ckpt: TinyCheckpoint) -> None:
    llm = ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=3, progress=False)
    params = ninfer.llm.SamplingParams(temperature=1.0, top_p=1.0, top_k=0, seed=11)
    prompt = _prompts([9], seed=3)[0]
    alone = llm._run([llm._request(prompt, 16, params)])[0].token_ids
    others = [llm._request(p, 16, ninfer.llm.SamplingParams(temperature=1.0, seed=i)) for i, p in
              enumerate(_prompts([4, 20], seed=4))]
    together = llm._run([others[0], llm._request(prompt, 16, params), others[1]])
    assert together[1].token_ids == alone
    _assert_balanced(llm)


def test_cancel_frees_lane_pages_and_slot(dense_ckpt: TinyCheckpoint) -> None:
    llm = ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=2, progress=False)
    a, b = (_greedy(llm, p, 50) for p in _prompts([10, 10], seed=5))
    llm.engine.add_request(a)
    llm.engine.add_request(b)
    llm.engine.step()
    llm.engine.step()
    final = llm.engine.cancel(a.request_id)
    assert final is not None and final.finished and final.finish_reason == "cancelled"
    assert llm.engine.cancel(a.request_id) is None
    llm.engine.run_until_done()
    assert b.finish_reason == "length"
    _assert_balanced(llm)


def test_bounded_queue(dense_ckpt: TinyCheckpoint) -> None:
    llm = ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=1, progress=False)
    llm.engine.scheduler.max_pending = 2
    for p in _prompts([3, 3], seed=6):
        llm.engine.add_request(_greedy(llm, p, 2))
    with pytest.raises(QueueFull):
        llm.engine.add_request(_greedy(llm, [1, 2], 2))
    llm.engine.run_until_done()
    _assert_balanced(llm)


def test_stream_and_stop_strings(dense_ckpt: TinyCheckpoint, solo) -> None:
    full = solo.generate("hello there", max_new_tokens=20, greedy=True)
    assert "".join(solo.stream("hello there", max_new_tokens=20, greedy=True)) == full.text
    if len(full.text) > 6:
        stop = full.text[3:6]
        cut = solo.generate("hello there", max_new_tokens=20, greedy=True, stop=[stop])
        assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.index(stop)]
    _assert_balanced(solo)


def test_logprobs_match_scores_and_penalties_change_choices(solo) -> None:
    from ninfer.runtime.sampling import SamplingParams

    prompt = _prompts([12], seed=7)[0]
    req = solo._request(prompt, 4, SamplingParams(greedy=True, logprobs=3))
    solo.engine.add_request(req)
    events = solo.engine.run_until_done()
    entries = [lp for e in events if e.logprobs for lp in e.logprobs]
    assert [e[0] for e in entries] == req.output_ids
    # Logprobs are over the tokenizer's ids only (the embedding's padding rows are never valid).
    solo.runner.start(16 + 4)
    hidden = solo.runner.extend(prompt + req.output_ids)[len(prompt) - 1:-1]
    logits = solo.model.logits(hidden)[:, : solo.valid_vocab].float().log_softmax(-1)
    expected = logits.gather(-1, torch.tensor(req.output_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor([e[1] for e in entries]), expected, atol=1e-4)
    assert all(len(e[2]) == 3 and e[2][0][0] == e[0] for e in entries)  # greedy token is the top one
    # A huge repetition penalty forbids reusing any prompt token.
    banned = solo._request(prompt, 4, SamplingParams(greedy=True, repetition_penalty=1e9))
    solo._run([banned])
    assert not set(banned.output_ids) & set(prompt)
    _assert_balanced(solo)


def test_warmup_lengths_reach_every_tuning_bucket() -> None:
    from ninfer.runtime.model_runner import warmup_chunk_lengths

    assert warmup_chunk_lengths(4096) == [1, 2, 3, 4, 5, 6, 7, 8, 15, 16, 31, 32, 63, 64, 127, 128, 255, 256, 511, 512,
                                        1023, 1024, 2047, 2048, 4095, 4096]
    assert warmup_chunk_lengths(100) == [1, 2, 3, 4, 5, 6, 7, 8, 15, 16, 31, 32, 63, 64, 99, 100]
    assert warmup_chunk_lengths(3) == [1, 2, 3]


def test_warmup_lengths_reach_every_prefill_attention_variant(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a 132-SM GPU the 27B's chunks of 257-320 tokens split 3 ways in the 512 bucket, which no power of two
    (or one below it) reaches: 257 joins the lengths. With it, every length from 9 to 8192 meets a variant the
    warm-up ran, for the 27B's 24 heads, the 35B-A3B's 16 (nothing to add) and others."""
    from ninfer.kernels.attention import prefill
    from ninfer.runtime.model_runner import warmup_chunk_lengths

    monkeypatch.setattr(prefill, "sm_count", lambda device: 132)
    cpu = torch.device("cpu")
    base = warmup_chunk_lengths(8192)
    for heads, added in ((24, [257]), (16, []), (32, None), (40, None)):
        variant = lambda n, heads=heads: prefill.launch_variant(cpu, heads, n)  # noqa: E731
        lengths = warmup_chunk_lengths(8192, variant)
        if added is not None:
            assert sorted(set(lengths) - set(base)) == added
        warmed = {variant(n) for n in lengths if n >= 9}
        assert all(variant(n) in warmed for n in range(9, 8193))
    monkeypatch.setattr(prefill, "sm_count", lambda device: 1)  # a CPU: nothing splits, nothing to add
    assert warmup_chunk_lengths(8192, lambda n: prefill.launch_variant(cpu, 24, n)) == base


def test_warmup_is_off_on_cpu_and_leaves_nothing_behind(dense_ckpt: TinyCheckpoint, solo, monkeypatch) -> None:
    from ninfer.runtime.engine import Engine

    calls = []
    monkeypatch.setattr(Engine, "warm_up", lambda self: calls.append(self))
    llm = ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=1, prefill_chunk=40, progress=False)
    assert calls == []  # CPU: no start-up work
    monkeypatch.undo()
    llm.engine.warm_up()  # what a CUDA engine runs at start-up, here on the reference kernels
    _assert_balanced(llm)
    prompt = _prompts([50], seed=3)[0]
    assert llm._run([_greedy(llm, prompt)])[0].token_ids == solo._run([_greedy(solo, prompt)])[0].token_ids
