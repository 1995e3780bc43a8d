"""The model runner: the lanes' block tables follow the requests' pages through the engine's steps."""
from __future__ import annotations

import torch

import ninfer
from ninfer.runtime.request import Request
from tiny_checkpoints import TinyCheckpoint


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 448, (n,), generator=g).tolist() for n in lengths]


def _assert_tables_match(llm: ninfer.LLM) -> int:
    runner, checked = llm.engine.runner, 0
    for req in llm.engine.scheduler.running:
        assert runner.block_tables[req.lane, :len(req.pages)].tolist() == req.pages, req.request_id
        checked += bool(req.pages)
    return checked


def test_block_tables_follow_every_lanes_pages(dense_ckpt: TinyCheckpoint) -> None:
    """Long prompts in short chunks over small pages: each step's tables list exactly each resident request's
    pages (prefill, mixed steps, decode growth), and the outputs are those of a fresh one-at-a-time engine."""
    llm = ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=3, max_context=512, page_size=16,
                      prefill_chunk=40, progress=False)
    solo = ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=1, max_context=512, page_size=16,
                       progress=False)
    params = llm.sampling_params(greedy=True)
    prompts = _prompts([70, 5, 130])
    reqs: list[Request] = [llm._request(p, 20, params) for p in prompts]
    for req in reqs:
        llm.engine.add_request(req)
    checked = 0
    while llm.engine.has_work:
        llm.engine.step()
        checked += _assert_tables_match(llm)
    assert checked > 10
    want = [solo._run([solo._request(p, 20, params)])[0].token_ids for p in prompts]
    assert [r.output_ids for r in reqs] == want
    assert llm.engine.is_idle()


def test_each_lane_row_of_the_block_tables_starts_16_byte_aligned(dense_ckpt: TinyCheckpoint) -> None:
    """A prompt prefilled alone reads its lane's row as a slice: padded rows keep every slice aligned as lane
    0's is, so its kernels are the variants warm-up compiled (Triton specialises on pointer alignment)."""
    llm = ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=3, max_context=100, page_size=16, progress=False)
    tables = llm.engine.runner.block_tables
    assert tables.shape == (3, 16)  # 7 pages, padded
    assert all(tables[lane:lane + 1].data_ptr() % 16 == 0 for lane in range(3))


def test_set_pages_clear_and_slot_mapping(dense_ckpt: TinyCheckpoint) -> None:
    llm = ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=2, max_context=256, page_size=16, progress=False)
    runner = llm.engine.runner
    assert runner.block_tables.shape == (2, 256 // 16) and runner.block_tables.dtype == torch.int32
    runner.set_pages(1, [5, 7])
    runner.set_pages(1, [9], first=2)
    assert runner.block_tables[1, :4].tolist() == [5, 7, 9, 0] and not runner.block_tables[0].any()
    runner.clear(1)
    assert not runner.block_tables.any()
    # positions 14 .. 17 of a sequence on pages [3, 1]: the last two of page 3, the first two of page 1
    assert runner.slot_mapping([3, 1], 14, 18) == [3 * 16 + 14, 3 * 16 + 15, 1 * 16, 1 * 16 + 1]


def test_the_runner_holds_the_process_tuner_state(dense_ckpt: TinyCheckpoint) -> None:
    """The runner reports the state the kernels' tuners use: the process's, also one swapped in later."""
    from ninfer.kernels.tuning import TunerState, default_tuner, use_tuner

    llm = ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=1, max_context=128, progress=False)
    assert llm.engine.runner.tuner is default_tuner()
    with use_tuner(TunerState(enabled=False)) as mine:
        assert llm.engine.runner.tuner is mine
    assert llm.engine.runner.tuner is default_tuner() and default_tuner() is not mine
