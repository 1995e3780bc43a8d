"""Prefix cache: outputs identical with and without it, hits where the policy says, resources balance."""
from __future__ import annotations

import pytest
import torch

import ninfer
from tiny_checkpoints import TinyCheckpoint


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 448, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _load(ckpt: TinyCheckpoint, **kw) -> ninfer.LLM:
    kw.setdefault("max_concurrency", 2)
    return ninfer.load(ckpt.path, device="cpu", progress=False, **kw)


def _greedy(llm: ninfer.LLM, prompts: list[list[int]], n: int = 8):
    reqs = [llm._request(p, n, llm.sampling_params(greedy=True)) for p in prompts]
    llm._run(reqs)
    return reqs


def _assert_balanced(llm: ninfer.LLM) -> None:
    engine = llm.engine
    if engine.prefix is not None:
        assert engine.runner.host.pool.used_bytes == engine.prefix.host_bytes  # every dropped host copy gave its blocks back
        engine.prefix.clear()
    assert engine.runner.host.pool.used_bytes == 0 and engine.runner.host.pool.held_bytes <= engine.runner.host.pool.limit
    assert engine.pages.num_free == engine.pages.num_pages and engine.pages.reserved == 0
    assert engine.slots.num_free == engine.slots.num_slots
    assert not engine.requests


def _page_copies(llm: ninfer.LLM) -> list[int]:
    """The KV pages the engine copies to host memory from now on (a list that grows)."""
    copied: list[int] = []
    save_pages = llm.engine.runner.host.save_pages
    llm.engine.runner.host.save_pages = lambda pages: copied.extend(pages) or save_pages(pages)
    return copied


@pytest.fixture(scope="module")
def plain(dense_ckpt: TinyCheckpoint) -> ninfer.LLM:
    return _load(dense_ckpt)


@pytest.fixture
def cached(dense_ckpt: TinyCheckpoint) -> ninfer.LLM:
    return _load(dense_ckpt, prefix_cache=True, checkpoint_interval=16, checkpoint_slots=16)


def _expected(plain: ninfer.LLM, prompts: list[list[int]], n: int = 8) -> list[list[int]]:
    return [_greedy(plain, [p], n)[0].output_ids for p in prompts]


def test_repeated_prompt_hits_all_but_its_last_token(plain, cached) -> None:
    prompt = _tokens(37, 1)  # shorter than two checkpoint intervals, not page-aligned
    first, second = _greedy(cached, [prompt])[0], _greedy(cached, [prompt])[0]
    assert first.output_ids == second.output_ids == _expected(plain, [prompt])[0]
    assert first.cached_tokens == 0 and second.cached_tokens == len(prompt) - 1
    _assert_balanced(cached)


def test_shared_system_prompt_hits_at_an_interval_checkpoint(plain, cached) -> None:
    system = _tokens(40, 2)
    a, b = system + _tokens(9, 3), system + _tokens(12, 4)
    ra, rb = _greedy(cached, [a])[0], _greedy(cached, [b])[0]
    assert [ra.output_ids, rb.output_ids] == _expected(plain, [a, b])
    assert rb.cached_tokens == 32  # the last multiple of the interval inside the shared 40 tokens
    _assert_balanced(cached)


def test_next_turn_resumes_where_the_last_generation_stopped(plain, cached) -> None:
    turn1 = _tokens(30, 5)
    r1 = _greedy(cached, [turn1], n=10)[0]
    turn2 = turn1 + r1.output_ids + _tokens(7, 6)
    r2 = _greedy(cached, [turn2])[0]
    assert r2.output_ids == _expected(plain, [turn2])[0]
    assert r2.cached_tokens == len(turn1) + len(r1.output_ids) - 1
    _assert_balanced(cached)


def test_divergence_inside_a_page_and_concurrent_sharing(plain, cached) -> None:
    base = _tokens(70, 7)
    prompts = [base + _tokens(5, 8), base[:50] + _tokens(30, 9), base + _tokens(3, 10)]
    _greedy(cached, [base])  # seeds checkpoints at 16, 32, 48, 64 and 69
    reqs = _greedy(cached, prompts)  # two lanes: the three run partly concurrently
    assert [r.output_ids for r in reqs] == _expected(plain, prompts)
    assert [r.cached_tokens for r in reqs] == [69, 48, 69]
    _assert_balanced(cached)


def test_tiny_pool_evicts_and_still_matches(dense_ckpt: TinyCheckpoint, plain) -> None:
    llm = _load(dense_ckpt, prefix_cache=True, checkpoint_interval=16, kv_capacity=192, checkpoint_slots=2)
    prompts = [_tokens(60, s) for s in range(11, 16)] + [_tokens(60, 11)]
    outs = [_greedy(llm, [p], 20)[0] for p in prompts]
    assert [o.output_ids for o in outs] == _expected(plain, prompts, 20)
    assert llm.engine.prefix.stats.evicted > 0
    _assert_balanced(llm)


def test_host_offload_restores_evicted_checkpoints(dense_ckpt: TinyCheckpoint, plain) -> None:
    # One checkpoint slot: every new checkpoint pushes the previous one to host memory.
    llm = _load(dense_ckpt, prefix_cache=True, checkpoint_interval=1000, checkpoint_slots=1, host_cache_gib=0.01)
    a, b = _tokens(50, 21), _tokens(45, 22)
    _greedy(llm, [a])
    _greedy(llm, [b])
    prefix = llm.engine.prefix
    assert prefix.stats.offloaded > 0 and prefix.host_bytes > 0
    again = _greedy(llm, [a + _tokens(6, 23)])[0]  # resumes from a's end-of-generation checkpoint on the host
    assert again.output_ids == _expected(plain, [a + _tokens(6, 23)])[0]
    assert prefix.stats.restored == 1 and again.cached_tokens == len(a) - 1  # the end-of-prompt checkpoint
    _assert_balanced(llm)
    assert prefix.host_bytes == 0


def test_chat_turn_boundaries_hit_when_the_template_drops_reasoning(dense_ckpt: TinyCheckpoint, plain) -> None:
    llm = _load(dense_ckpt, prefix_cache=True, checkpoint_slots=8)
    system = {"role": "system", "content": "You answer briefly and precisely. " * 4}
    turn1 = [system, {"role": "user", "content": "What is the capital of France?"}]
    r1 = llm.chat(turn1, max_new_tokens=12, greedy=True)
    turn2 = turn1 + [{"role": "assistant", "content": r1.text, "reasoning_content": r1.reasoning},
                     {"role": "user", "content": "And of Italy?"}]
    r2 = llm.chat(turn2, max_new_tokens=12, greedy=True)
    assert r2.token_ids == plain.chat(turn2, max_new_tokens=12, greedy=True).token_ids
    prompt1 = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(turn1))
    assistant_start = max(i for i, t in enumerate(prompt1) if t == llm.tokenizer.token_id("<|im_start|>"))
    assert llm.engine.prefix.stats.hit_tokens == assistant_start  # resumed right before turn 1's assistant turn
    _assert_balanced(llm)


def test_agent_loop_moves_only_states_to_host_while_pages_last(dense_ckpt: TinyCheckpoint, plain) -> None:
    # Each turn resends the history plus new tokens and checkpoints its prompt's end and its generation's
    # end, so with two checkpoint slots older checkpoints leave their slots every turn. Their KV pages are
    # shared with newer checkpoints and the pool has room: only the state may move to the host, not the
    # whole prefix's KV (at 27B, 64 KiB per token against ~150 MiB of state).
    llm = _load(dense_ckpt, prefix_cache=True, checkpoint_interval=1000, checkpoint_slots=2, host_cache_gib=0.01)
    copied = _page_copies(llm)
    history, prompts = [], []
    for turn in range(4):
        history = history + _tokens(20, 30 + turn)
        prompts.append(history)
    outs = [_greedy(llm, [p], 1)[0] for p in prompts]
    assert [o.output_ids for o in outs] == _expected(plain, prompts, 1)
    assert [o.cached_tokens for o in outs] == [0, 20, 40, 60]
    prefix = llm.engine.prefix
    assert prefix.stats.offloaded > 0 and copied == []
    branch = prompts[1] + _tokens(5, 40)  # resumes from turn 1's end: state on the host, KV pages on the device
    again = _greedy(llm, [branch], 4)[0]
    assert again.output_ids == _expected(plain, [branch], 4)[0]
    assert again.cached_tokens == 40 and prefix.stats.restored == 1 and copied == []
    _assert_balanced(llm)
    assert prefix.host_bytes == 0


def test_page_pressure_moves_kv_to_host_and_restores_it(dense_ckpt: TinyCheckpoint, plain) -> None:
    llm = _load(dense_ckpt, prefix_cache=True, checkpoint_interval=16, kv_capacity=192, checkpoint_slots=2,
                host_cache_gib=0.01, max_concurrency=1)
    copied = _page_copies(llm)
    prompts = [_tokens(60, s) for s in range(61, 65)] + [_tokens(60, 61) + _tokens(4, 66)]
    outs = [_greedy(llm, [p], 20)[0] for p in prompts]
    assert [o.output_ids for o in outs] == _expected(plain, prompts, 20)
    prefix = llm.engine.prefix
    assert copied  # admission ran short of pages: checkpoints' KV moved to the host
    assert outs[-1].cached_tokens == 59 and prefix.stats.restored == 1  # the first prompt's KV came back from the host
    _assert_balanced(llm)
    assert prefix.host_bytes == 0


def test_host_copies_reuse_the_pool_and_give_it_back_when_dropped(dense_ckpt: TinyCheckpoint, plain) -> None:
    # A host budget of three state copies: offloads beyond it drop the oldest host copies, whose pinned
    # blocks serve the next offload; a second identical pass pins nothing new.
    probe = _load(dense_ckpt, prefix_cache=True)
    budget = 3 * probe.engine.runner.host.host_nbytes(slot=True)
    llm = _load(dense_ckpt, prefix_cache=True, checkpoint_interval=1000, checkpoint_slots=1,
                host_cache_gib=budget / (1 << 30), pause_host_gib=0.0)
    engine, prefix = llm.engine, llm.engine.prefix
    assert engine.runner.host.pool.limit == budget
    prompts = [_tokens(30, s) for s in range(70, 77)]
    outs = [_greedy(llm, [p], 3)[0] for p in prompts]
    assert [o.output_ids for o in outs] == _expected(plain, prompts, 3)
    assert prefix.stats.offloaded > 3 and prefix.stats.evicted > 0  # host copies were dropped to fit
    assert engine.runner.host.pool.used_bytes == prefix.host_bytes <= budget
    allocated = engine.runner.host.pool.allocated
    assert allocated * engine.runner.host.pool.block_bytes <= budget  # dropped copies' blocks were reused
    prefix.clear()
    assert engine.runner.host.pool.used_bytes == 0 and engine.runner.host.pool.free_bytes == budget
    again = [_greedy(llm, [p], 3)[0] for p in prompts]
    assert [o.output_ids for o in again] == [o.output_ids for o in outs]
    assert engine.runner.host.pool.allocated == allocated  # every offload of the second pass reused a block
    _assert_balanced(llm)


def test_prompt_end_mark_gives_way_to_a_chat_mark_just_before_it() -> None:
    from ninfer.runtime.prefix_cache import END_MARK_REACH, prompt_end_mark

    assert prompt_end_mark(50, ()) == 49  # a raw prompt: a repeat hits one token before the end
    assert prompt_end_mark(50, (10,)) == 49  # a mark far from the end does not stand in for it
    assert prompt_end_mark(50, (49 - END_MARK_REACH,)) is None  # the assistant turn's start does
    assert prompt_end_mark(1, ()) is None


def test_a_chat_prompt_prefills_in_one_forward(dense_ckpt: TinyCheckpoint, plain) -> None:
    # "<|im_start|>user ...<|im_end|>\n<|im_start|>assistant\n": one mark at the assistant turn's start, a few
    # tokens before the end, which also serves a repeated prompt; the forward writes its state itself:
    # one forward, where ending the chunk at each mark took three.
    from ninfer.runtime.prefix_cache import END_MARK_REACH

    llm = _load(dense_ckpt, prefix_cache=True, checkpoint_slots=8)
    messages = [{"role": "user", "content": "Name three rivers of Europe, briefly."}]
    forwards = []
    real = llm.engine._mixed_step
    llm.engine._mixed_step = lambda *a, **k: forwards.append(1) or real(*a, **k)
    first = llm.chat(messages, max_new_tokens=1, greedy=True)
    assert first.token_ids == plain.chat(messages, max_new_tokens=1, greedy=True).token_ids
    prompt = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(messages))
    assistant_start = max(i for i, t in enumerate(prompt) if t == llm.tokenizer.token_id("<|im_start|>"))
    assert len(prompt) - 1 - assistant_start <= END_MARK_REACH
    assert len(forwards) == 1
    again = llm.chat(messages, max_new_tokens=1, greedy=True)  # a repeat hits at the assistant turn's start
    assert again.token_ids == first.token_ids and llm.engine.prefix.stats.hit_tokens == assistant_start
    _assert_balanced(llm)


def test_load_pins_host_blocks_ahead(dense_ckpt: TinyCheckpoint) -> None:
    llm = ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=1, prefix_cache=True, host_cache_gib=0.01,
                      pause_host_gib=0.0, host_prepin_gib=0.005, progress=False)
    pool = llm.engine.runner.host.pool
    assert pool.allocated > 0 and pool.allocated * pool.block_bytes <= 0.01 * (1 << 30)


def _counting(llm) -> list[int]:
    forwards, real = [], llm.engine._mixed_step
    llm.engine._mixed_step = lambda *a, **k: forwards.append(1) or real(*a, **k)
    return forwards


def test_checkpoints_inside_the_forward_keep_outputs_and_hits(dense_ckpt: TinyCheckpoint, plain) -> None:
    # A raw 150-token prompt: checkpoints at 100 (interval) and 149 (end) inside one 256-token chunk; the
    # first ends the chunk, the forward writes the second. A repeat resumes at 149, a longer prompt at 149 too.
    llm = _load(dense_ckpt, prefix_cache=True, checkpoint_interval=100, checkpoint_slots=4, prefill_chunk=256)
    forwards = _counting(llm)
    prompt = _tokens(150, 61)
    first = _greedy(llm, [prompt], 6)[0]
    assert first.output_ids == _expected(plain, [prompt], 6)[0]
    assert len(forwards) == 2  # prefill forwards: [0, 100), [100, 150) with the end checkpoint inside
    again = _greedy(llm, [prompt], 6)[0]
    assert again.output_ids == first.output_ids and again.cached_tokens == 149
    longer = prompt + _tokens(30, 62)
    out = _greedy(llm, [longer], 4)[0]
    assert out.output_ids == _expected(plain, [longer], 4)[0] and out.cached_tokens >= 149
    _assert_balanced(llm)


def test_no_slot_for_a_checkpoint_skips_it_without_a_forward(dense_ckpt: TinyCheckpoint, plain) -> None:
    llm = _load(dense_ckpt, prefix_cache=True, checkpoint_interval=1000, checkpoint_slots=1, prefill_chunk=256)
    prompt = _tokens(90, 63)
    slots = llm.engine.slots
    held = [slots.acquire() for _ in range(slots.num_free - 1)]  # one slot left: the request's own
    forwards = _counting(llm)
    out = _greedy(llm, [prompt], 3)[0]
    assert out.output_ids == _expected(plain, [prompt], 3)[0]
    assert len(forwards) == 1 and len(llm.engine.prefix) == 0  # no checkpoint, and no extra forward
    for slot in held:
        slots.release(slot)
    _assert_balanced(llm)


def test_checkpoints_inside_the_forward_on_the_triton_kernel(dense_ckpt: TinyCheckpoint, plain, monkeypatch) -> None:
    # The same as above with the chunked DeltaNet Triton kernel (interpreter) writing the checkpoint in-launch.
    import ninfer.kernels.deltanet.dispatch as deltanet

    monkeypatch.setattr(deltanet, "use_triton", lambda x: True)
    llm = _load(dense_ckpt, prefix_cache=True, checkpoint_interval=100, checkpoint_slots=4, prefill_chunk=256)
    prompt = _tokens(150, 71)
    first = _greedy(llm, [prompt], 4)[0]
    assert first.output_ids == _expected(plain, [prompt], 4)[0]
    longer = prompt + _tokens(20, 72)
    again = _greedy(llm, [longer], 4)[0]
    assert again.output_ids == _expected(plain, [longer], 4)[0] and again.cached_tokens == 149
    _assert_balanced(llm)


def test_checkpoint_inside_a_mixed_step_with_decode_rows(dense_ckpt: TinyCheckpoint, plain) -> None:
    # A short request decodes while a longer prompt's chunk (with its end checkpoint inside) rides in the
    # same forward: the checkpoint's batch row and token offset must skip the decode rows.
    llm = _load(dense_ckpt, prefix_cache=True, checkpoint_interval=1000, checkpoint_slots=4, prefill_chunk=64)
    short, long = _tokens(10, 81), _tokens(120, 82)
    reqs = [llm._request(p, 12, llm.sampling_params(greedy=True)) for p in (short, long)]
    llm._run(reqs)
    assert [r.output_ids for r in reqs] == _expected(plain, [short, long], 12)
    longer = long + _tokens(9, 83)
    again = _greedy(llm, [longer], 4)[0]
    assert again.output_ids == _expected(plain, [longer], 4)[0] and again.cached_tokens == 119
    _assert_balanced(llm)
