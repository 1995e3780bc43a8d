"""Vision through the public API: ``ninfer.load(..., vision=True).chat(...)`` runs the batching engine."""
from __future__ import annotations

import pytest

import ninfer
from ninfer.vision import VisionDisabledError
from ninfer.vision.prefill import MultimodalRunner

from test_model_parity import _cases


@pytest.fixture(scope="module")
def vision_llm(vision_setup):
    return ninfer.load(vision_setup.ckpt.path, device="cpu", vision=True, max_concurrency=2, prefill_chunk=32,
                       progress=False)


@pytest.mark.parametrize("case", ["one_image", "text_between"])
def test_chat_with_media_equals_the_multimodal_runner(vision_setup, vision_llm, pipeline, case: str) -> None:
    messages = _cases(vision_setup.media_dir)[case]
    reply = vision_llm.chat(messages, enable_thinking=False, max_new_tokens=10, greedy=True)
    prompt = pipeline.prompt_from_messages(messages, vision_llm.tokenizer, enable_thinking=False)
    embeds = pipeline.encode(prompt)
    expected = MultimodalRunner(vision_llm.model).greedy(prompt, embeds, 10, stop_ids=sorted(vision_llm.stop_ids),
                                                         vocab_limit=vision_llm.valid_vocab)
    assert reply.prompt_tokens == len(prompt.input_ids)
    assert reply.token_ids == expected
    assert vision_llm.count_tokens(messages, enable_thinking=False) == len(prompt.input_ids)
    assert vision_llm.engine.is_idle()


def test_media_without_vision_is_a_clear_error(vision_setup, llm) -> None:
    messages = _cases(vision_setup.media_dir)["one_image"]
    with pytest.raises(VisionDisabledError, match="vision is disabled"):
        llm.chat(messages, max_new_tokens=2)
    with pytest.raises(ValueError, match="no vision_config"):
        from tiny_checkpoints import make_dense

        ninfer.load(make_dense(vision_setup.media_dir / "textonly").path, device="cpu", vision=True)


def test_media_prompts_bypass_the_prefix_cache(vision_setup, vision_llm) -> None:
    # Two different images render to the same token ids (one pad id), so token ids cannot key them.
    media = vision_setup.media_dir
    ask = lambda name: [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": str(media / name)}},
                                                     {"type": "text", "text": "Describe it."}]}]
    before = vision_llm.engine.prefix.stats.inserted
    vision_llm.chat(ask("wide.png"), enable_thinking=False, max_new_tokens=3, greedy=True)
    assert vision_llm.engine.prefix.stats.inserted == before
