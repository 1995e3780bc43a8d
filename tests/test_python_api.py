"""The Python API: SamplingParams, prompt kinds, n samples sharing a prefill, logprobs, chat batches, tool calls."""
from __future__ import annotations

import pytest

import ninfer
from ninfer.results import RequestResults
from ninfer.runtime.request import Request, RequestOutput
from tiny_checkpoints import TinyCheckpoint

GREEDY = ninfer.SamplingParams(temperature=0, max_tokens=5)


@pytest.fixture(scope="module")
def llm(dense_ckpt: TinyCheckpoint) -> ninfer.LLM:
    return ninfer.load(dense_ckpt.path, device="cpu", progress=False)


def test_sampling_params_reject_what_the_engine_cannot_honour() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        ninfer.SamplingParams(min_tokens=17)  # above max_tokens (16)
    with pytest.raises(ValueError, match="min_tokens"):
        ninfer.SamplingParams(min_tokens=-1)
    with pytest.raises(TypeError, match="prompt_logprobs"):
        ninfer.SamplingParams(prompt_logprobs=1)
    for bad, field in [({"n": 0}, "n"), ({"max_tokens": 0}, "max_tokens"), ({"stop": [""]}, "stop"),
                       ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"logprobs": 21}, "logprobs"),
                       ({"top_p": 0}, "top_p")]:
        with pytest.raises(ValueError, match=field):
            ninfer.SamplingParams(**bad)


def test_token_id_text_and_dict_prompts_mix(llm: ninfer.LLM) -> None:
    ids = llm.tokenizer.encode("one two")
    outs = llm.generate([ids, "one two", {"prompt_token_ids": ids}, {"prompt": "one two"}], GREEDY)
    assert [o.prompt for o in outs] == [None, "one two", None, "one two"]
    assert all(o.prompt_token_ids == ids for o in outs)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1  # greedy: one prompt, one continuation
    assert llm.generate(ids, max_new_tokens=5, greedy=True).token_ids == outs[0].outputs[0].token_ids
    assert llm.generate([[1, 2, 3]], GREEDY)[0].prompt_token_ids == [1, 2, 3]


def test_bad_prompts_name_what_is_wrong_and_leave_the_engine_clean(llm: ninfer.LLM) -> None:
    vocab = llm.config.vocab_size
    cases = [([[1, 2], [vocab]], r"prompts\[1\]\[0\]"), ([[1, 2], []], r"prompts\[1\] is empty"),
             ({"prompt_token_ids": [1], "multi_modal_data": {}}, "multi_modal_data"), ([], "empty"),
             ([1, True], "token id")]
    for prompts, message in cases:
        with pytest.raises((ValueError, TypeError), match=message):
            llm.generate(prompts, GREEDY)
    with pytest.raises(ValueError, match="2 entries for 3 prompts"):
        llm.generate(["a", "b", "c"], [GREEDY, GREEDY])
    with pytest.raises(TypeError, match="not both.*temperature"):
        llm.generate("a", GREEDY, temperature=0.5)
    with pytest.raises(TypeError, match="'n'"):
        llm.generate("a", n=2)
    too_long = [1] * llm.engine.config.max_context
    with pytest.raises(ValueError, match="max_context"):
        llm.generate(["fine", too_long], GREEDY)
    assert llm.engine.is_idle()  # the first prompt of the failed call was cancelled


def test_n_samples_prefill_the_prompt_once(llm: ninfer.LLM) -> None:
    llm.engine.prefix.clear()
    model, fed = llm.engine.model, []
    forward = model.forward

    def counting(batch, *args, **kwargs):
        fed.append(int(batch.input_ids.numel()))
        return forward(batch, *args, **kwargs)

    prompt = llm.tokenizer.encode("a prompt that all three samples share, prefilled once")
    params = ninfer.SamplingParams(temperature=1.0, max_tokens=4, n=3, seed=5, ignore_eos=True)
    model.forward = counting
    try:
        out = llm.generate({"prompt_token_ids": prompt}, params)[0]
    finally:
        del model.forward
    samples = out.outputs
    assert [s.index for s in samples] == [0, 1, 2] and all(len(s.token_ids) == 4 for s in samples)
    assert [s.cached_tokens for s in samples] == [0, len(prompt) - 1, len(prompt) - 1]
    decode_tokens = sum(len(s.token_ids) - 1 for s in samples)
    assert sum(fed) - decode_tokens == len(prompt) + 2  # the prompt once, then one token per extra sample
    assert len({tuple(s.token_ids) for s in samples}) > 1  # each sample draws from its own seed
    again = llm.generate({"prompt_token_ids": prompt}, params)[0]
    assert [s.token_ids for s in again.outputs] == [s.token_ids for s in samples]
    single = llm.generate({"prompt_token_ids": prompt}, ninfer.SamplingParams(
        temperature=1.0, max_tokens=4, seed=5, ignore_eos=True))[0]
    assert single.outputs[0].token_ids == samples[0].token_ids
    assert llm.engine.is_idle()


def test_logprobs_with_alternatives(llm: ninfer.LLM) -> None:
    out = llm.generate("logprobs please", ninfer.SamplingParams(temperature=0, max_tokens=4, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids)
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and len(entry) == 3  # greedy: the sampled token is the best alternative
        best = max(entry.values(), key=lambda lp: lp.logprob)
        assert entry[token] is best and best.rank == 1 and best.logprob <= 0
        assert sorted(lp.rank for lp in entry.values()) == [1, 2, 3]
        assert entry[token].decoded_token == llm.tokenizer.decode([token])
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for e, t in zip(out.logprobs, out.token_ids)))
    keyword = llm.generate("logprobs please", max_new_tokens=4, greedy=True, logprobs=0)
    assert [list(e) for e in keyword.logprobs] == [[t] for t in out.token_ids]
    assert llm.generate("logprobs please", GREEDY)[0].outputs[0].logprobs is None


def test_stops_and_ignore_eos(llm: ninfer.LLM) -> None:
    base = llm.generate("stop here", ninfer.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    assert len(base.token_ids) == 8 and base.finish_reason == "length" and base.stop_reason is None
    token = base.token_ids[2]
    by_id = llm.generate("stop here", ninfer.SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[token],
                                                              ignore_eos=True))[0].outputs[0]
    assert by_id.token_ids == base.token_ids[:3] and (by_id.finish_reason, by_id.stop_reason) == ("stop", token)
    text = base.text
    cut = next(i for i in range(1, len(text)) if text[i] not in text[:i] and text[i] != "\ufffd")
    by_text = llm.generate("stop here", ninfer.SamplingParams(temperature=0, max_tokens=8, stop=text[cut],
                                                               ignore_eos=True))[0].outputs[0]
    assert (by_text.text, by_text.finish_reason, by_text.stop_reason) == (text[:cut], "stop", text[cut])


def test_one_sampling_params_per_prompt(llm: ninfer.LLM) -> None:
    short, long = ninfer.SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), \
        ninfer.SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outs = llm.generate(["first", "second"], [short, long])
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 5]


def test_chat_over_a_batch_of_conversations(llm: ninfer.LLM) -> None:
    conversations = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "hello there"}]]
    params = ninfer.SamplingParams(temperature=0, max_tokens=4, logprobs=1)
    outs = llm.chat(conversations, params)
    assert len(outs) == 2 and all(o.outputs[0].reasoning is not None for o in outs)  # thinking on by default
    for conversation, out in zip(conversations, outs):
        one = llm.chat(conversation, max_new_tokens=4, greedy=True, logprobs=1)
        assert (one.token_ids, one.text, one.reasoning) == (out.outputs[0].token_ids, out.outputs[0].text,
                                                            out.outputs[0].reasoning)
        assert one.logprobs is not None and len(one.logprobs) == len(one.token_ids)  # chat(logprobs=) is honoured
    plain = llm.chat(conversations, max_new_tokens=3, greedy=True, enable_thinking=False)
    assert len(plain) == 2 and all(c.reasoning is None for c in plain)
    with pytest.raises(ValueError, match="chat_template_kwargs.*foo"):
        llm.chat(conversations[0], params, chat_template_kwargs={"foo": 1})
    with pytest.raises(ValueError, match=r"tools\[0\]"):
        llm.chat(conversations[0], params, tools=[{"name": "x"}])


def test_tool_calls_are_parsed_from_the_answer(llm: ninfer.LLM) -> None:
    """The result wiring, fed the events a model emitting a call would produce (the random model does not)."""
    tools = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}
    req = Request(prompt_ids=[1, 2], params=ninfer.SamplingParams(max_tokens=50), max_new_tokens=50, thinking=True)
    results = RequestResults(req, llm.tokenizer, llm.stop_ids, tools)
    pieces = ["Let me look.", "Checking.", "\n<tool_call>\n<function=get_weather>\n<parameter=city>\n",
              "Paris\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"]
    deltas = []
    for i, text in enumerate(pieces):
        reasoning, answer = (text, "") if i == 0 else ("", text)
        req.output_ids.append(10 + i)
        deltas.append(results.push(RequestOutput(req.request_id, [10 + i], text=answer, reasoning=reasoning,
                                                 finished=i == len(pieces) - 1, finish_reason="stop")))
    req.finish_reason = "stop"
    calls = [c for d in deltas for c in d.tool_calls]
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Paris", "days": 3})]
    done = results.completion()
    assert done.tool_calls == calls and "<tool_call>" not in done.text and done.text.strip() == "Checking."
    assert deltas[-1].finished and deltas[-1].usage.completion_tokens == 4
