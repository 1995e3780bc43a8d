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


def test_prefix_cache_keys_media_by_content(vision_setup, vision_llm, tmp_path) -> None:
    from vision_helpers import make_image

    # Two different images of one size render to the same token ids (one pad id for all images).
    make_image(64, 64, 31).save(tmp_path / "a.png")
    make_image(64, 64, 32).save(tmp_path / "b.png")
    ask = lambda name: [{"role": "user", "content": [{"type": "text", "text": "Look: "},
                                                     {"type": "image_url", "image_url": {"url": str(tmp_path / name)}},
                                                     {"type": "text", "text": " Describe it."}]}]
    fresh = ninfer.load(vision_setup.ckpt.path, device="cpu", vision=True, prefix_cache=False, progress=False)
    expected = {n: fresh.chat(ask(n), enable_thinking=False, max_new_tokens=6, greedy=True).token_ids
                for n in ("a.png", "b.png")}
    stats = vision_llm.engine.prefix.stats
    first = vision_llm.chat(ask("a.png"), enable_thinking=False, max_new_tokens=6, greedy=True)
    hit_tokens = stats.hit_tokens
    other = vision_llm.chat(ask("b.png"), enable_thinking=False, max_new_tokens=6, greedy=True)
    image_start = vision_llm.tokenizer.encode(vision_llm.tokenizer.apply_chat_template(
        ask("a.png"), enable_thinking=False)).index(vision_llm.tokenizer.token_id("<|image_pad|>"))
    assert stats.hit_tokens - hit_tokens <= image_start  # b never reuses a's image
    again = vision_llm.chat(ask("a.png"), enable_thinking=False, max_new_tokens=6, greedy=True)
    assert again.prompt_tokens > 0 and stats.hit_tokens - hit_tokens > image_start  # a's own image hits
    assert first.token_ids == again.token_ids == expected["a.png"] and other.token_ids == expected["b.png"]
    assert vision_llm.engine.is_idle()


@pytest.mark.parametrize("case", ["one_image", "text_between"])
def test_speculative_chat_with_media_equals_plain(vision_setup, vision_llm, case: str) -> None:
    """MTP drafting after a multimodal prompt: the prompt's 3-axis positions feed the head's prefill and
    rope_delta its rounds; the reply equals plain decoding."""
    messages = _cases(vision_setup.media_dir)[case]
    want = vision_llm.chat(messages, enable_thinking=False, max_new_tokens=10, greedy=True).token_ids
    spec = ninfer.load(vision_setup.ckpt.path, device="cpu", vision=True, max_concurrency=2, prefill_chunk=32,
                       spec="mtp", draft_tokens=3, progress=False)
    reply = spec.chat(messages, enable_thinking=False, max_new_tokens=10, greedy=True)
    assert reply.token_ids == want
    assert reply.speculation["rounds"] > 0
    assert spec.engine.is_idle()
