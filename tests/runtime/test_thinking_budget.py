"""``thinking_budget``: a chat reply with thinking on reasons for at most that many tokens, then the engine
forces ``</think>`` and the answer follows; plain greedy up to the budget, the same with MTP; Anthropic's
``thinking.budget_tokens`` becomes the budget; a raw prompt with a budget is an error naming it."""
from __future__ import annotations

import pytest

import ninfer
from ninfer.api import anthropic as messages_api
from tiny_checkpoints import TinyCheckpoint, make_composite

CHAT = [{"role": "user", "content": "Tell me a story"}]
MAX = 24


@pytest.fixture(scope="module")
def llm(dense_ckpt: TinyCheckpoint) -> ninfer.LLM:
    return ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=2, progress=False)


def _reply(llm: ninfer.LLM, params: ninfer.SamplingParams, **kw):
    return llm.chat(CHAT, params, **kw)[0].outputs[0]


def _think_end(llm: ninfer.LLM) -> int:
    tid = llm.tokenizer.token_id("</think>")
    assert tid is not None
    return tid


@pytest.mark.parametrize("budget", [0, 3, 9])
def test_the_reasoning_closes_at_the_budget(llm: ninfer.LLM, budget: int) -> None:
    end = _think_end(llm)
    free = _reply(llm, ninfer.SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True))
    assert end not in free.token_ids[:budget + 1]  # a random model does not close its reasoning on its own
    out = _reply(llm, ninfer.SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True,
                                               thinking_budget=budget))
    assert out.token_ids[:budget] == free.token_ids[:budget]  # untouched until the budget is spent
    assert out.token_ids[budget] == end
    assert len(out.token_ids) == MAX and out.token_ids.count(end) == 1  # the answer follows, nothing forced again
    assert out.reasoning is not None and out.text is not None


def test_a_budget_the_reasoning_does_not_reach_changes_nothing(llm: ninfer.LLM) -> None:
    free = _reply(llm, ninfer.SamplingParams(temperature=0, max_tokens=MAX))
    out = _reply(llm, ninfer.SamplingParams(temperature=0, max_tokens=MAX, thinking_budget=MAX + 5))
    assert out.token_ids == free.token_ids
    off = _reply(llm, ninfer.SamplingParams(temperature=0, max_tokens=MAX, thinking_budget=2), enable_thinking=False)
    assert _think_end(llm) not in off.token_ids[2:3]  # thinking off: no reasoning to close


def test_mtp_forces_the_same_token(tmp_path) -> None:
    ckpt = make_composite(tmp_path / "mtp", seed=3)
    plain = ninfer.load(ckpt.path, device="cpu", max_concurrency=2, progress=False)
    spec = ninfer.load(ckpt.path, device="cpu", max_concurrency=2, progress=False, spec="mtp", draft_tokens=3)
    params = ninfer.SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True, thinking_budget=5)
    a, b = _reply(plain, params), _reply(spec, params)
    assert a.token_ids == b.token_ids and a.token_ids[5] == _think_end(plain)


def test_a_raw_prompt_with_a_budget_is_an_error(llm: ninfer.LLM) -> None:
    with pytest.raises(ValueError, match="thinking_budget"):
        llm.generate([[5, 17, 33]], ninfer.SamplingParams(max_tokens=4, thinking_budget=2))
    with pytest.raises(ValueError, match="thinking_budget"):
        ninfer.SamplingParams(thinking_budget=-1)


def test_anthropic_budget_tokens_is_the_budget() -> None:
    body = {"model": "tiny", "max_tokens": 2048, "messages": CHAT,
            "thinking": {"type": "enabled", "budget_tokens": 1024}}
    chat, spec, _ = messages_api.parse(body)
    assert chat.thinking is True and spec.sampling["thinking_budget"] == 1024
    chat, spec, _ = messages_api.parse({**body, "thinking": {"type": "disabled"}})
    assert chat.thinking is False and "thinking_budget" not in spec.sampling
