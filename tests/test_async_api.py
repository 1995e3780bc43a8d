"""The public async API: deltas, n, chat channels, and cancellation freeing the engine's lane.

Waits are bounded (``BOUND_S``) so that a broken mechanism fails instead of hanging; nothing asserts durations.
"""
from __future__ import annotations

import asyncio
import contextlib

import pytest

import ninfer
from tiny_checkpoints import TinyCheckpoint

BOUND_S = 120.0
LONG = ninfer.SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(dense_ckpt: TinyCheckpoint) -> ninfer.LLM:
    model = ninfer.load(dense_ckpt.path, device="cpu", progress=False)
    yield model
    model.async_llm.shutdown()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, BOUND_S))


async def collect(stream) -> dict[int, list[ninfer.StreamOutput]]:
    by_index: dict[int, list[ninfer.StreamOutput]] = {}
    async for out in stream:
        by_index.setdefault(out.index, []).append(out)
    return by_index


async def wait_idle(llm: ninfer.LLM) -> bool:
    """Idle on the engine thread; a bounded poll, for cancellations that reach the engine asynchronously."""
    for _ in range(100):
        if await llm.async_llm.is_idle():
            return True
        await asyncio.sleep(0.05)
    return False


def test_deltas_add_up_to_the_synchronous_result(llm: ninfer.LLM) -> None:
    params = ninfer.SamplingParams(temperature=0, max_tokens=6, n=2, logprobs=2)
    deltas = run(collect(llm.generate_async([5, 6, 7, 8], params)))
    sync = llm.generate([[5, 6, 7, 8]], params)[0].outputs  # stops the engine thread, then runs here
    assert sorted(deltas) == [0, 1]
    for index, outs in deltas.items():
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        last = outs[-1]
        ids = [t for o in outs for t in o.token_ids]
        assert ids == sync[index].token_ids and "".join(o.text for o in outs) == sync[index].text
        streamed = [lp for o in outs for lp in o.logprobs]
        assert [{t: (lp.rank, lp.decoded_token) for t, lp in e.items()} for e in streamed] == \
            [{t: (lp.rank, lp.decoded_token) for t, lp in e.items()} for e in sync[index].logprobs]
        # the synchronous run resumes from the prefix cache: the same values up to float rounding
        assert [lp.logprob for e in streamed for lp in e.values()] == pytest.approx(
            [lp.logprob for e in sync[index].logprobs for lp in e.values()], abs=1e-4)
        assert last.finish_reason == sync[index].finish_reason
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (4, len(ids))
    assert deltas[1][-1].usage.cached_tokens == 3  # the second sample resumed from the first's prefill


def test_chat_streams_reasoning_and_answer(llm: ninfer.LLM) -> None:
    messages = [{"role": "user", "content": "hi"}]
    params = ninfer.SamplingParams(temperature=0, max_tokens=6)
    outs = run(collect(llm.chat_async(messages, params)))[0]
    sync = llm.chat([messages], params)[0].outputs[0]
    assert "".join(o.reasoning for o in outs) == sync.reasoning and "".join(o.text for o in outs) == sync.text
    assert outs[-1].usage.prompt_tokens == sync.prompt_tokens


def test_leaving_the_loop_early_cancels_the_request(llm: ninfer.LLM) -> None:
    async def main() -> tuple[bool, bool, int]:
        async with contextlib.aclosing(llm.generate_async("a long one", LONG)) as stream:
            async for _ in stream:
                break
        closed = await llm.async_llm.is_idle()  # the cancellation was sent before aclose returned
        seen = 0
        async for _ in llm.generate_async("another long one", LONG):  # plain break: closed by the loop later
            seen += 1
            if seen == 2:
                break
        return closed, await wait_idle(llm), seen

    closed, idle, seen = run(main())
    assert closed and idle and seen == 2


def test_cancelling_the_task_cancels_the_request(llm: ninfer.LLM) -> None:
    async def main() -> bool:
        started = asyncio.Event()

        async def consume() -> None:
            async for _ in llm.generate_async("cancel me", ninfer.SamplingParams(
                    temperature=1.0, max_tokens=400, ignore_eos=True, n=2)):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        assert not await llm.async_llm.is_idle()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await llm.async_llm.is_idle()

    assert run(main())


def test_the_synchronous_api_waits_for_open_streams(llm: ninfer.LLM) -> None:
    async def main() -> None:
        stream = llm.generate_async("open", LONG)
        await stream.__anext__()
        with pytest.raises(RuntimeError, match="still open"):
            llm.generate("blocked", max_new_tokens=2)
        await stream.aclose()

    run(main())
    assert llm.generate("now fine", max_new_tokens=2, greedy=True).finish_reason in ("stop", "length")
    assert llm.engine.is_idle()


def test_bad_input_raises_before_anything_runs(llm: ninfer.LLM) -> None:
    async def first(stream) -> None:
        async for _ in stream:
            break

    with pytest.raises(ValueError, match="one prompt"):
        run(first(llm.generate_async(["a", "b"], LONG)))
    with pytest.raises(TypeError, match="sampling_params"):
        run(first(llm.generate_async("a", {"max_tokens": 3})))
    with pytest.raises(ValueError, match="max_context"):
        run(first(llm.generate_async([1] * llm.engine.config.max_context, LONG)))
    assert run(llm.async_llm.is_idle())
