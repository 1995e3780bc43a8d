"""Pausing under memory pressure: outputs identical to a big pool, both resume modes, resources balance."""
from __future__ import annotations

import pytest
import torch

import ninfer
from ninfer.api.metrics import engine_snapshot
from ninfer.runtime.request import Request, Status
from ninfer.runtime.sampling import SamplingParams
from tiny_checkpoints import TinyCheckpoint

PAGE = 16  # small pages, so short sequences grow through several of them
MODES = {"snapshot": 4.0, "recompute": 0.0}  # pause_host_gib: room for every snapshot, or none


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 448, (n,), generator=g).tolist() for n in lengths]


def _load(ckpt: TinyCheckpoint, **kw) -> ninfer.LLM:
    kw.setdefault("max_concurrency", 3)
    kw.setdefault("prefix_cache", False)
    llm = ninfer.load(ckpt.path, device="cpu", page_size=PAGE, progress=False, **kw)
    llm.stop_ids = frozenset()  # every request runs to its length, so the pressure is the same in every run
    return llm


def _tiny(ckpt: TinyCheckpoint, mode: str, **kw) -> ninfer.LLM:
    """Six 16-token pages for three lanes: the tests' concurrent sequences outgrow them as they decode."""
    return _load(ckpt, kv_capacity=6 * PAGE, pause_host_gib=MODES[mode], **kw)


@pytest.fixture(scope="module")
def big(dense_ckpt: TinyCheckpoint) -> ninfer.LLM:
    return _load(dense_ckpt)


def _run(llm: ninfer.LLM, prompts: list[list[int]], n: int, params: list[SamplingParams]) -> list[Request]:
    reqs = [llm._request(p, n, sp) for p, sp in zip(prompts, params)]
    llm._run(reqs)
    return reqs


def _greedy(llm: ninfer.LLM, prompts: list[list[int]], n: int) -> list[Request]:
    return _run(llm, prompts, n, [SamplingParams(greedy=True)] * len(prompts))


def _assert_balanced(llm: ninfer.LLM, reqs: list[Request]) -> None:
    engine = llm.engine
    assert engine.is_idle()
    assert engine.pauser.host_bytes == 0 and all(r.paused is None for r in reqs)
    assert engine.pauser.stats.resumes <= engine.pauser.stats.pauses  # the difference: cancelled while paused
    # Resumed and cancelled snapshots gave their host blocks back (the prefix cache may still hold some).
    assert engine.runner.host.pool.used_bytes == (engine.prefix.host_bytes if engine.prefix is not None else 0)
    if engine.prefix is not None:
        engine.prefix.clear()
    assert engine.runner.host.pool.used_bytes == 0 and engine.runner.host.pool.held_bytes <= engine.runner.host.pool.limit
    cfg = engine.config  # the pool holds at most the two host budgets together
    assert engine.runner.host.pool.limit == cfg.pause_host_bytes + (cfg.host_cache_bytes if cfg.prefix_cache else 0)
    if engine.pauser.stats.snapshots:
        assert engine.runner.host.pool.free_bytes > 0  # the snapshots' blocks, kept for the next ones
    assert engine.pages.num_free == engine.pages.num_pages and engine.pages.reserved == 0
    assert engine.slots.num_free == engine.slots.num_slots
    assert len(engine.scheduler.free_lanes) == engine.config.max_concurrency
    assert not engine.requests and not engine.outputs


PREFIX = {"no-prefix": dict(prefix_cache=False), "prefix": dict(prefix_cache=True, checkpoint_interval=16),
          "prefix-host": dict(prefix_cache=True, checkpoint_interval=16, host_cache_gib=0.01)}  # evicted
# checkpoints survive on the host


@pytest.mark.parametrize("prefix", list(PREFIX))
@pytest.mark.parametrize("mode", list(MODES))
def test_tiny_pool_pauses_and_matches_a_big_pool(dense_ckpt: TinyCheckpoint, big, mode: str, prefix: str) -> None:
    prompts = _prompts([5, 9, 30, 20, 3, 15], seed=1)
    expected = [r.output_ids for r in _greedy(big, prompts, 48)]
    llm = _tiny(dense_ckpt, mode, prefill_chunk=8, **PREFIX[prefix])
    reqs = _greedy(llm, prompts, 48)
    assert [r.output_ids for r in reqs] == expected
    stats = llm.engine.pauser.stats
    assert stats.pauses > 1 and stats.resumes == stats.pauses
    if mode == "snapshot":
        assert stats.snapshots == stats.pauses and stats.recomputes == 0
    else:
        assert stats.recomputes == stats.pauses and stats.snapshots == 0
    if mode == "recompute" and prefix == "prefix-host":
        assert llm.engine.prefix.stats.hits > 0  # replays started from cached prefixes...
    assert all(r.cached_tokens == 0 for r in reqs)  # ...which usage does not report as cached prompt tokens
    snap = engine_snapshot(llm.engine)
    assert (snap["pauses"], snap["resumes"], snap["pause_host_bytes"]) == (stats.pauses, stats.resumes, 0)
    _assert_balanced(llm, reqs)


@pytest.mark.parametrize("mode", list(MODES))
def test_seeded_sampling_survives_pauses(dense_ckpt: TinyCheckpoint, big, mode: str) -> None:
    prompts = _prompts([7, 30, 18], seed=2)
    # Penalties too: their counts are rebuilt from the tokens when a lane resumes.
    params = [SamplingParams(temperature=1.0, seed=10 + i, repetition_penalty=1.3 if i == 1 else 1.0,
                             frequency_penalty=0.5 if i == 2 else 0.0) for i in range(len(prompts))]
    expected = [r.output_ids for r in _run(big, prompts, 30, params)]
    llm = _tiny(dense_ckpt, mode)
    reqs = _run(llm, prompts, 30, params)
    assert [r.output_ids for r in reqs] == expected
    assert llm.engine.pauser.stats.pauses > 0
    _assert_balanced(llm, reqs)


@pytest.mark.parametrize("mode", list(MODES))
def test_pausing_at_any_point_is_invisible(dense_ckpt: TinyCheckpoint, big, mode: str) -> None:
    """Pause the newest request, whatever the pressure, once in each state it passes through:
    inside its prompt, decoding, and (recompute mode) inside the replay of a previous pause."""
    prompts = _prompts([30, 9, 21], seed=3)
    expected = [r.output_ids for r in _greedy(big, prompts, 12)]
    llm = _load(dense_ckpt, pause_host_gib=MODES[mode], prefill_chunk=4)
    engine = llm.engine
    reqs = [llm._request(p, 12, SamplingParams(greedy=True)) for p in prompts]
    for r in reqs:
        engine.add_request(r)
    paused_in = set()
    while engine.has_work:
        victim = engine.scheduler.running[-1] if engine.scheduler.running else None
        if victim is not None and victim.num_computed > 0:
            state = "decoding" if victim.prefill_done else "replay" if victim.output_ids else "prompt"
            if state not in paused_in:
                engine.pauser.pause(victim)
                paused_in.add(state)
                assert victim.status is Status.PAUSED and engine.scheduler.waiting[0] is victim
                assert victim.lane is None and victim.slot is None and not victim.pages and not victim.reserved_pages
        engine.step()
    assert [r.output_ids for r in reqs] == expected
    assert paused_in == {"prompt", "decoding"} | ({"replay"} if mode == "recompute" else set())
    _assert_balanced(llm, reqs)


@pytest.mark.parametrize("mode", list(MODES))
def test_cancel_while_paused_frees_the_snapshot(dense_ckpt: TinyCheckpoint, big, mode: str) -> None:
    prompts = _prompts([12, 20, 6], seed=4)
    expected = [r.output_ids for r in _greedy(big, prompts, 40)]
    llm = _tiny(dense_ckpt, mode)
    engine = llm.engine
    reqs = [llm._request(p, 40, SamplingParams(greedy=True)) for p in prompts]
    for r in reqs:
        engine.add_request(r)
    while engine.has_work and not any(r.status is Status.PAUSED for r in reqs):
        engine.step()
    victim = next(r for r in reqs if r.status is Status.PAUSED)
    assert (engine.pauser.host_bytes > 0) == (mode == "snapshot") == (victim.paused.host is not None)
    held = victim.paused.nbytes
    assert engine.runner.host.pool.used_bytes == held
    final = engine.cancel(victim.request_id)
    assert final is not None and final.finished and final.finish_reason == "cancelled"
    assert victim.status is Status.FINISHED and victim.paused is None and engine.pauser.host_bytes == 0
    assert engine.runner.host.pool.used_bytes == 0 and engine.runner.host.pool.free_bytes >= held
    assert engine.cancel(victim.request_id) is None
    engine.run_until_done()
    for r, want in zip(reqs, expected):
        if r is not victim:
            assert r.output_ids == want and r.finish_reason == "length"
    _assert_balanced(llm, reqs)


def test_long_max_tokens_no_longer_block_admission(dense_ckpt: TinyCheckpoint, big) -> None:
    """Budgets beyond the pool are admitted side by side; alone, a sequence may fill the whole pool."""
    prompts = _prompts([10, 14], seed=5)
    expected = [r.output_ids for r in _greedy(big, prompts, 60)]
    llm = _load(dense_ckpt, kv_capacity=8 * PAGE)  # 128 tokens: one 70-token sequence, not two
    reqs = [llm._request(p, 60, SamplingParams(greedy=True)) for p in prompts]
    for r in reqs:
        llm.engine.add_request(r)
    llm.engine.step()
    assert len(llm.engine.scheduler.running) == 2  # reserving prompt + 60 tokens each would admit one
    llm.engine.run_until_done()
    assert [r.output_ids for r in reqs] == expected and llm.engine.pauser.stats.pauses > 0
    # A budget beyond the pool runs to the pool's end and stops with "length".
    alone = llm._request(prompts[0], 1000, SamplingParams(greedy=True))
    llm._run([alone])
    assert alone.finish_reason == "length" and alone.total_tokens == 8 * PAGE
    _assert_balanced(llm, [*reqs, alone])


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("drafter", ["head", "saboteur"])
def test_pauses_with_speculative_decoding(composite_ckpt: TinyCheckpoint, mode: str, drafter: str) -> None:
    """Speculation under pressure: verification needs K pages ahead and K + 1 spare slots; a snapshot keeps
    the lane's draft state, a recompute replays through the MTP prefill. Outputs equal a big pool's."""
    prompts = _prompts([5, 9, 30, 20, 3, 15], seed=2)
    plain = _load(composite_ckpt)
    expected = [r.output_ids for r in _greedy(plain, prompts, 40)]
    llm = _load(composite_ckpt, kv_capacity=8 * PAGE, pause_host_gib=MODES[mode], spec="mtp", draft_tokens=3,
                prefill_chunk=8)
    if drafter == "saboteur":  # accept 0..3 of the plain run's tokens in turn, so rounds commit 1..4 tokens
        truth = {tuple(p): p + out for p, out in zip(prompts, expected)}
        turn = iter(range(10 ** 9))

        def propose(lanes, n, drafts):
            out = drafts.clone()
            by_lane = {r.lane: truth[tuple(r.prompt_ids)] for r in llm.engine.requests.values() if r.lane is not None}
            for b, (lane, pos) in enumerate(zip(lanes.tolist(), n.tolist())):
                good, seq = next(turn) % 4, by_lane[lane]
                for i in range(3):
                    t = seq[pos + 1 + i] if pos + 1 + i < len(seq) else 0
                    out[b, i] = t if i < good else (t + 1) % 448
            return out

        llm.engine.spec.propose = propose
    reqs = _greedy(llm, prompts, 40)
    assert [r.output_ids for r in reqs] == expected
    stats = llm.engine.pauser.stats
    assert stats.pauses > 0 and stats.resumes == stats.pauses
    if drafter == "saboteur":
        assert llm.engine.spec_totals.accepted > 0
    _assert_balanced(llm, reqs)
