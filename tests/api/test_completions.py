"""/v1/completions through the official openai SDK on loopback, against the tiny CPU model.

References come from a second load of the same checkpoint (``ref``): the server's engine thread owns
the session model's engine, which the synchronous Python API must not step meanwhile."""
from __future__ import annotations

import math

import httpx
import openai
import pytest
import torch

import ninfer

from api_testing import wait_idle
from tiny_checkpoints import TinyCheckpoint


@pytest.fixture(scope="module")
def ref(dense_ckpt: TinyCheckpoint) -> ninfer.LLM:
    return ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=2, progress=False)


def test_text_prompt_matches_python_api(oai: openai.OpenAI, llm: ninfer.LLM, ref: ninfer.LLM) -> None:
    out = oai.completions.create(model="tiny", prompt="Hello there", max_tokens=5, temperature=0)
    ref = ref.generate("Hello there", max_new_tokens=5, greedy=True)
    assert out.object == "text_completion" and out.model == "tiny"
    assert out.choices[0].text == ref.text
    assert out.usage.prompt_tokens == len(llm.tokenizer.encode("Hello there"))
    assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "length"


def test_token_ids_batch_and_n(oai: openai.OpenAI, llm: ninfer.LLM, ref: ninfer.LLM) -> None:
    ids = llm.tokenizer.encode("The cat")
    out = oai.completions.create(model="tiny", prompt=[ids, "A dog"], max_tokens=3, temperature=0, n=2)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    ref = [ref.generate(p, max_new_tokens=3, greedy=True).text for p in ({"prompt_token_ids": ids}, "A dog")]
    assert [c.text for c in out.choices] == [ref[0], ref[0], ref[1], ref[1]]  # greedy: the samples agree
    assert out.usage.completion_tokens == 12
    wait_idle(llm)


def test_n_seeded_samples_are_the_python_apis(oai: openai.OpenAI, llm: ninfer.LLM, ref: ninfer.LLM) -> None:
    out = oai.completions.create(model="tiny", prompt="Once", max_tokens=4, temperature=1.0, top_p=1.0, n=3,
                                 seed=11, logprobs=0)
    params = ninfer.SamplingParams(max_tokens=4, temperature=1.0, top_p=1.0, top_k=0, n=3, seed=11)
    expected = ref.generate("Once", params)[0].outputs
    # the first draw of each sample (later ones may differ in the last bits between batch shapes)
    assert [c.logprobs.tokens[0] for c in out.choices] == [ref.tokenizer.decode(c.token_ids[:1]) for c in expected]
    assert out.choices[0].text == expected[0].text
    assert len({c.text for c in out.choices}) > 1


def test_echo_logprobs_are_the_models_scores(oai: openai.OpenAI, llm: ninfer.LLM, ref: ninfer.LLM) -> None:
    text = "one two three four"
    ids = llm.tokenizer.encode(text)
    out = oai.completions.create(model="tiny", prompt=text, max_tokens=1, temperature=0, echo=True, logprobs=2)
    lp = out.choices[0].logprobs
    assert out.choices[0].text.startswith(text)
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    # The reference: the model's next-token distributions over the tokenizer's vocabulary (the rows past it
    # are padding, which the sampler never draws either); over the whole width they are LLM.score's.
    ref.runner.start(len(ids))
    with torch.no_grad():
        logits = ref.model.logits(ref.runner.extend(ids)[:-1]).float()
    targets = torch.tensor(ids[1:])[:, None]
    assert torch.allclose(logits.log_softmax(-1).gather(-1, targets)[:, 0], ref.score(ids), atol=1e-4)
    expected = logits[:, :ref.valid_vocab].log_softmax(-1).gather(-1, targets)[:, 0]
    assert torch.allclose(torch.tensor(lp.token_logprobs[1:len(ids)]), expected, atol=1e-4)
    assert all(len(t) <= 2 and max(t.values()) >= v - 1e-6 for t, v in zip(lp.top_logprobs[1:], lp.token_logprobs[1:]))
    assert lp.text_offset[:2] == [0, len(lp.tokens[0])]
    assert "".join(lp.tokens[:len(ids)]) == text


def test_echo_without_generation(oai: openai.OpenAI, llm: ninfer.LLM, ref: ninfer.LLM) -> None:
    out = oai.completions.create(model="tiny", prompt="alpha beta", max_tokens=0, echo=True, logprobs=0)
    assert out.choices[0].text == "alpha beta" and out.usage.completion_tokens == 0
    assert out.choices[0].logprobs.token_logprobs[0] is None
    assert all(math.isfinite(v) for v in out.choices[0].logprobs.token_logprobs[1:])


def test_streaming_with_n_and_usage(oai: openai.OpenAI, llm: ninfer.LLM, ref: ninfer.LLM) -> None:
    stream = oai.completions.create(model="tiny", prompt="Hi", max_tokens=4, temperature=0, n=2, stream=True,
                                    stream_options={"include_usage": True}, logprobs=1)
    texts, finishes, usage, tokens = {0: "", 1: ""}, {}, None, {0: 0, 1: 0}
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.logprobs is not None:
                tokens[c.index] += len(c.logprobs.tokens)
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    ref = ref.generate("Hi", max_new_tokens=4, greedy=True).text
    assert texts == {0: ref, 1: ref} and finishes == {0: "length", 1: "length"} and tokens == {0: 4, 1: 4}
    assert usage is not None and usage.completion_tokens == 8
    wait_idle(llm)


def test_stream_echo(oai: openai.OpenAI) -> None:
    text = "".join(c.choices[0].text for c in oai.completions.create(model="tiny", prompt="Hey", max_tokens=2,
                                                                      echo=True, stream=True) if c.choices)
    assert text.startswith("Hey")


@pytest.mark.parametrize("field,value", [("suffix", "x"), ("best_of", 3), ("min_tokens", 17), ("prompt_logprobs", 1),
                                         ("logit_bias", {"5": 3}), ("bogus_field", 1),
                                         ("include_stop_str_in_output", True), ("logprobs", 21)])
def test_unsupported_fields_are_400s_naming_them(server, field: str, value: object) -> None:
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "a", field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_bad_prompts(server) -> None:
    for prompt, param in ((None, "prompt"), ([], "prompt"), ([[1, 2], [10 ** 9]], "prompt[1]"), ([[]], "prompt[0]"),
                          ([1.5], "prompt[0]")):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": prompt})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (prompt, r.text)


def test_stop_token_ids_and_ignore_eos(oai: openai.OpenAI, llm: ninfer.LLM, ref: ninfer.LLM) -> None:
    ids = llm.tokenizer.encode("x")
    first = ref.generate({"prompt_token_ids": ids}, max_new_tokens=1, greedy=True).token_ids[0]
    out = oai.completions.create(model="tiny", prompt=ids, max_tokens=3, temperature=0,
                                 extra_body={"stop_token_ids": [first]})
    assert out.usage.completion_tokens == 1 and out.choices[0].finish_reason == "stop"
    # the model's own end-of-sequence token, forced as the answer by a one-token choice: ignore_eos goes on
    eos = sorted(llm.stop_ids)[0]
    params = ninfer.SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    expected = ref.generate({"prompt_token_ids": ids}, params)[0].outputs[0]
    out = oai.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0,
                                 extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == len(expected.token_ids) == 5 and out.choices[0].text == expected.text
    assert eos in llm.stop_ids


def test_long_prompts_are_bounded_by_the_context(server, llm: ninfer.LLM) -> None:
    # tokenized on a worker thread (over the inline size); too long for the context: a 400 naming the prompt
    for prompt, param in (("word " * 20000, "prompt"), (["ok", "word " * 20000], "prompt[1]")):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert r.json()["error"]["param"] == param


def test_n_samples_each_follow_the_constraint(oai: openai.OpenAI, llm: ninfer.LLM) -> None:
    # every sample has its own grammar state: each answer is one of the choices
    out = oai.completions.create(model="tiny", prompt="Pick:", max_tokens=8, temperature=1.0, n=3, seed=3,
                                 extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
    assert len(out.choices) == 3 and all(c.text in ("yes", "no", "maybe") for c in out.choices)
    chat = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Pick"}], n=2, seed=1,
                                       max_tokens=8, extra_body={"guided_choice": ["red", "blue"],
                                                                 "enable_thinking": False})
    assert [c.message.content in ("red", "blue") for c in chat.choices] == [True, True]
    wait_idle(llm)


def test_stream_of_the_prompt_only(oai: openai.OpenAI) -> None:
    chunks = list(oai.completions.create(model="tiny", prompt="alpha beta", max_tokens=0, echo=True, logprobs=0,
                                         stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert texts == ["alpha beta"] and chunks[0].choices[0].finish_reason == "length"
    assert chunks[0].choices[0].logprobs.token_logprobs[0] is None
    assert chunks[-1].usage.prompt_tokens > 0 and chunks[-1].usage.completion_tokens == 0
