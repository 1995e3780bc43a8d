"""Multimodal prompts give the logprobs and greedy continuations of transformers' Qwen3_5ForConditionalGeneration.

Tiny composite checkpoint, all weights random, fp32. Our side: VisionPipeline (preprocess, expand,
positions) + vision tower + MultimodalRunner (embeddings scattered into a chunked prefill, then
decode at ``len + rope_delta``). transformers' side gets the same ids and pixels.

Why two logprob tests: the two towers agree to fp32 rounding (~1e-6, the size of transformers'
own eager-vs-SDPA difference), but this random text model amplifies vision-embedding noise by
~1000x (transformers against itself with 1e-7 noise on the vision rows moves logprobs by ~1e-4).
So the 1e-4 check runs our prompt construction, positions, scatter and text model on
transformers' tower output against an untouched transformers forward, the tower is checked on its
own at 1e-5, and the fully independent end-to-end run is held to 2e-3; greedy runs are end to end.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ninfer.vision import (
    MultimodalPrompt,
    MultimodalRunner,
    VisionPipeline,
    encode_media,
)
from ninfer.vision.prompt import IMAGE, VIDEO

TOL = 1e-4


def _image(path: Path) -> dict:
    return {"type": "image_url", "image_url": {"url": str(path)}}


def _video(path: Path) -> dict:
    return {"type": "video_url", "video_url": {"url": str(path)}}


def _cases(media: Path) -> dict[str, list[dict]]:
    text = lambda t: {"type": "text", "text": t}
    return {
        "one_image": [{"role": "user", "content": [_image(media / "wide.png"), text("Describe it.")]}],
        "aspect_ratios": [{"role": "user", "content": [
            _image(media / n) for n in ("wide.png", "tall.jpg", "tiny.png", "big.png", "alpha.png")]}],
        "video": [{"role": "user", "content": [_video(media / "clip.mp4"), text("What happens?")]}],
        "text_between": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [text("Before "), _image(media / "tall.jpg"), text(" between "),
                                         _video(media / "clip.mp4"), text(" and "), _image(media / "tiny.png"),
                                         text(" after.")]},
            {"role": "assistant", "content": "Seen."},
            {"role": "user", "content": [text("Again: "), _image(media / "wide.png")]},
        ],
    }


def _hf_kwargs(prompt: MultimodalPrompt) -> dict:
    kwargs: dict = {"input_ids": torch.tensor([prompt.input_ids]),
                    "mm_token_type_ids": torch.tensor([prompt.mm_types])}
    for kind, px, grid in (("image", "pixel_values", "image_grid_thw"), ("video", "pixel_values_videos",
                                                                         "video_grid_thw")):
        items = [m for m in prompt.media if m.kind == kind]
        if items:
            kwargs[px] = torch.cat([m.pixels for m in items])
            kwargs[grid] = torch.tensor([m.grid for m in items])
    return kwargs


def _hf_embeds(hf, prompt: MultimodalPrompt) -> torch.Tensor:
    """transformers' merged vision features, rearranged into prompt order (our embedding layout)."""
    kw = _hf_kwargs(prompt)
    with torch.no_grad():
        feats = {
            "image": iter(hf.model.get_image_features(kw["pixel_values"], kw["image_grid_thw"]).pooler_output
                          if "pixel_values" in kw else ()),
            "video": iter(hf.model.get_video_features(kw["pixel_values_videos"], kw["video_grid_thw"]).pooler_output
                          if "pixel_values_videos" in kw else ()),
        }
    return torch.cat([next(feats[m.kind]) for m in prompt.media])


def _logprobs(llm, prompt: MultimodalPrompt, embeds: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    runner = MultimodalRunner(llm.model)
    runner.start(len(prompt.input_ids))
    return llm.model.logits(runner.prefill(prompt, embeds, chunk=chunk)).float().log_softmax(-1)


def _prepare(vision_setup, llm, pipeline: VisionPipeline, case: str) -> tuple[MultimodalPrompt, torch.Tensor]:
    messages = _cases(vision_setup.media_dir)[case]
    prompt = pipeline.prompt_from_messages(messages, llm.tokenizer)
    return prompt, pipeline.encode(prompt)


CASES = ["one_image", "aspect_ratios", "video", "text_between"]


def _max_target_diff(ours: torch.Tensor, ref: torch.Tensor, ids: list[int]) -> float:
    targets = torch.tensor(ids[1:])[:, None]
    return (ours[:-1].gather(-1, targets) - ref[:-1].gather(-1, targets)).abs().max().item()


@pytest.mark.parametrize("case", CASES)
def test_prompt_logprobs_match(vision_setup, llm, pipeline: VisionPipeline, case: str) -> None:
    prompt, _ = _prepare(vision_setup, llm, pipeline, case)
    assert {IMAGE, VIDEO} & set(prompt.mm_types)
    hf = vision_setup.ckpt.hf_model
    with torch.no_grad():
        ref = hf(**_hf_kwargs(prompt)).logits[0].float().log_softmax(-1)
    ours = _logprobs(llm, prompt, _hf_embeds(hf, prompt))  # 64-token chunks: edges fall inside media
    assert _max_target_diff(ours, ref, prompt.input_ids) < TOL
    assert (ours[-1] - ref[-1]).abs().max().item() < TOL  # the distribution of the first generated token


@pytest.mark.parametrize("case", CASES)
def test_end_to_end_logprobs_close(vision_setup, llm, pipeline: VisionPipeline, case: str) -> None:
    prompt, embeds = _prepare(vision_setup, llm, pipeline, case)
    with torch.no_grad():
        ref = vision_setup.ckpt.hf_model(**_hf_kwargs(prompt)).logits[0].float().log_softmax(-1)
    assert (_logprobs(llm, prompt, embeds, chunk=4096) - ref).abs().max().item() < 2e-3


@pytest.mark.parametrize("case", ["one_image", "text_between"])
def test_positions_and_rope_delta_match_get_rope_index(vision_setup, llm, pipeline: VisionPipeline,
                                                       case: str) -> None:
    prompt, _ = _prepare(vision_setup, llm, pipeline, case)
    kwargs = _hf_kwargs(prompt)
    ref_pos, ref_delta = vision_setup.ckpt.hf_model.model.get_rope_index(
    kwargs["input_ids"], kwargs["mm_token_type_ids"], kwargs.get("image_grid_thw"), kwargs.get("video_grid_thw"))
    assert torch.equal(prompt.positions, ref_pos[:, 0])
    assert prompt.rope_delta == int(ref_delta) and prompt.rope_delta < 0  # media compress the position range


@pytest.mark.parametrize("case", ["one_image", "text_between"])
def test_greedy_continuation_matches(vision_setup, llm, pipeline: VisionPipeline, case: str) -> None:
    prompt, embeds = _prepare(vision_setup, llm, pipeline, case)
    stop = sorted(llm.stop_ids)
    ours = MultimodalRunner(llm.model).greedy(prompt, embeds, 12, stop_ids=stop, vocab_limit=llm.valid_vocab)
    padding = list(range(llm.valid_vocab, llm.config.vocab_size))
    kwargs = _hf_kwargs(prompt)
    out = vision_setup.ckpt.hf_model.generate(**kwargs, attention_mask=torch.ones_like(kwargs["input_ids"]),
                                              max_new_tokens=12, do_sample=False, suppress_tokens=padding,
                                              eos_token_id=stop, pad_token_id=stop[0])
    assert ours == out[0, len(prompt.input_ids):].tolist()


def test_decode_step_uses_rope_delta(vision_setup, llm, pipeline: VisionPipeline) -> None:
    """The token after the prompt sits at ``len + rope_delta``; the same token at ``len`` would differ."""
    prompt, embeds = _prepare(vision_setup, llm, pipeline, "one_image")
    nxt = 65
    kwargs = _hf_kwargs(prompt)
    with torch.no_grad():
        hf = vision_setup.ckpt.hf_model
        out = hf(**kwargs, use_cache=True)
        step = hf(input_ids=torch.tensor([[nxt]]), cache=out.cache,
                  mm_token_type_ids=torch.zeros(1, 1, dtype=torch.long)).logits[0, -1]
    runner = MultimodalRunner(llm.model)
    runner.start(len(prompt.input_ids) + 1)
    runner.prefill(prompt, embeds)
    ours = llm.model.logits(runner.extend([nxt]))[0]
    assert (ours.log_softmax(-1) - step.log_softmax(-1)).abs().max().item() < TOL


def test_tower_matches_visual_and_batching_is_neutral(vision_setup, pipeline: VisionPipeline, llm) -> None:
    prompt, _ = _prepare(vision_setup, llm, pipeline, "text_between")  # images and a video
    together = torch.cat(encode_media(pipeline.tower, prompt.media))  # one tower call for all items
    ref = _hf_embeds(vision_setup.ckpt.hf_model, prompt)
    assert together.shape == (prompt.num_media_tokens, llm.config.hidden_size)
    assert (together - ref).abs().max().item() < 1e-5
    alone = torch.cat([encode_media(pipeline.tower, [m])[0] for m in prompt.media])
    assert (together - alone).abs().max().item() < 1e-5
