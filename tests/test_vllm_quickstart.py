"""vLLM's quick-start examples with ``import ninfer`` in place of ``from vllm import LLM, SamplingParams``.

Offline batched inference, the chat example and the async streaming example, as the vLLM docs write
them, run against the tiny dense checkpoint: only the construction (``ninfer.load``) differs.
"""
from __future__ import annotations

import asyncio

import pytest

import ninfer
from tiny_checkpoints import TinyCheckpoint


@pytest.fixture(scope="module")
def llm(dense_ckpt: TinyCheckpoint) -> ninfer.LLM:
    return ninfer.load(dense_ckpt.path, device="cpu", progress=False)  # vLLM: LLM(model="facebook/opt-125m")


def test_offline_batched_inference(llm: ninfer.LLM) -> None:
    prompts = [
        "Hello, my name is",
        "The president of the United States is",
        "The capital of France is",
        "The future of AI is",
    ]
    sampling_params = ninfer.SamplingParams(temperature=0.8, top_p=0.95, max_tokens=6)
    outputs = llm.generate(prompts, sampling_params)
    assert [output.prompt for output in outputs] == prompts
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        assert isinstance(prompt, str) and isinstance(generated_text, str)
        completion = output.outputs[0]
        assert 1 <= len(completion.token_ids) <= 6 and completion.finish_reason in ("stop", "length")
        assert completion.text == llm.tokenizer.decode(
            [t for t in completion.token_ids if t not in llm.stop_ids], skip_special_tokens=True)
        assert output.prompt_token_ids == llm.tokenizer.encode(prompt) and output.finished


def test_sampling_params_defaults_are_vllms() -> None:
    params = ninfer.SamplingParams()
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens, params.n) == (1.0, 1.0, 0, 16, 1)
    assert ninfer.SamplingParams(top_k=-1).top_k == 0  # vLLM's "off"
    assert ninfer.SamplingParams(stop="###").stop == ("###",)


def test_chat_example(llm: ninfer.LLM) -> None:
    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I assist you today?"},
        {"role": "user", "content": "Write an essay about the importance of higher education."},
    ]
    sampling_params = ninfer.SamplingParams(temperature=0.5, max_tokens=5, seed=0)
    outputs = llm.chat(conversation, sampling_params, chat_template_kwargs={"enable_thinking": False})
    assert len(outputs) == 1
    output = outputs[0]
    assert output.prompt == llm.tokenizer.apply_chat_template(conversation, enable_thinking=False)
    assert output.outputs[0].reasoning is None and len(output.outputs[0].token_ids) <= 5


def test_async_streaming_example(llm: ninfer.LLM) -> None:
    async def main() -> tuple[str, list[int], ninfer.StreamOutput]:
        params = ninfer.SamplingParams(temperature=0, max_tokens=6)
        text, ids, last = "", [], None
        async for output in llm.generate_async("The future of AI is", params, request_id="quickstart"):
            text += output.text
            ids += output.token_ids
            last = output
        return text, ids, last

    try:
        text, ids, last = asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        llm.async_llm.shutdown()
    assert last.finished and last.request_id == "quickstart" and last.usage.completion_tokens == len(ids)
    same = llm.generate("The future of AI is", ninfer.SamplingParams(temperature=0, max_tokens=6))[0].outputs[0]
    assert (text, ids) == (same.text, same.token_ids)
