"""Generation behaviour: seeds, stops, chat template and reasoning split, default model."""
from __future__ import annotations

import torch

import ninfer
from ninfer.kernels.sampling import SamplingTensors, sample_reference
from ninfer.runtime.reasoning import split_final
from tiny_checkpoints import TinyCheckpoint


def test_same_seed_same_output_and_different_seed_differs(dense_ckpt: TinyCheckpoint) -> None:
    llm = ninfer.load(dense_ckpt.path, device="cpu", progress=False)
    a = llm.generate("hello", max_new_tokens=24, temperature=1.0, top_p=1.0, top_k=0, seed=7)
    b = llm.generate("hello", max_new_tokens=24, temperature=1.0, top_p=1.0, top_k=0, seed=7)
    c = llm.generate("hello", max_new_tokens=24, temperature=1.0, top_p=1.0, top_k=0, seed=8)
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids


def test_batch_of_prompts_and_stop_tokens(dense_ckpt: TinyCheckpoint) -> None:
    llm = ninfer.load(dense_ckpt.path, device="cpu", progress=False)
    outs = llm.generate(["one", "two"], max_new_tokens=5, greedy=True)
    assert len(outs) == 2 and all(o.finish_reason == "length" and len(o.token_ids) == 5 for o in outs)
    first = outs[0].token_ids[2]
    stopped = llm.generate("one", max_new_tokens=5, greedy=True, stop_token_ids=[first])
    assert stopped.finish_reason == "stop" and stopped.token_ids == outs[0].token_ids[:3]


def test_top_k_one_is_greedy_and_padding_ids_never_sampled(dense_ckpt: TinyCheckpoint) -> None:
    llm = ninfer.load(dense_ckpt.path, device="cpu", progress=False)
    greedy = llm.generate("abc", max_new_tokens=10, greedy=True)
    topk1 = llm.generate("abc", max_new_tokens=10, temperature=1.0, top_k=1, seed=1)
    assert greedy.token_ids == topk1.token_ids
    assert all(t < llm.valid_vocab for t in greedy.token_ids)


def test_top_p_keeps_the_smallest_nucleus() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    picks = set()
    for seed in range(200):
        st = SamplingTensors.full(1, top_p=0.7, seed=seed)
        out = sample_reference(logits, st, torch.zeros(1, 4, dtype=torch.int32), torch.zeros(1, 4, dtype=torch.int8),
                               vocab_limit=4)
        picks.add(int(out.token_ids[0]))
    assert picks == {0, 1}


def test_chat_splits_reasoning_and_thinking_switch(dense_ckpt: TinyCheckpoint) -> None:
    llm = ninfer.load(dense_ckpt.path, device="cpu", progress=False)
    messages = [{"role": "user", "content": "hi"}]
    assert llm.tokenizer.apply_chat_template(messages).endswith("<|im_start|>assistant\n<think>\n")
    off = llm.tokenizer.apply_chat_template(messages, enable_thinking=False)
    assert off.endswith("<think>\n\n</think>\n\n")
    reply = llm.chat(messages, enable_thinking=False, max_new_tokens=4, greedy=True)
    assert reply.reasoning is None and reply.prompt_tokens == len(llm.tokenizer.encode(off))
    assert split_final("I think.\n</think>\n\nAnswer", True) == ("I think.", "Answer")
    assert split_final("still going", True) == ("still going", "")


def test_default_model_loads_and_generates(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("NINFER_HOME", str(tmp_path))
    llm = ninfer.load(device="cpu", progress=False)
    assert llm.config.model_type == "qwen3_5" and llm.load_report.mtp
    out = llm.chat([{"role": "user", "content": "Hello"}], max_new_tokens=6, greedy=True)
    assert out.prompt_tokens > 0 and 1 <= len(out.token_ids) <= 6


def test_model_aware_presets_for_chats(dense_ckpt: TinyCheckpoint, tmp_path) -> None:
    import shutil

    named = tmp_path / "Qwen3.6-35B-A3B-tiny"
    shutil.copytree(dense_ckpt.path, named)
    llm = ninfer.load(named, device="cpu", progress=False)
    thinking, plain = llm.sampling_params(thinking=True), llm.sampling_params(thinking=False)
    assert (thinking.temperature, thinking.top_p, thinking.top_k, thinking.presence_penalty) == (1.0, 0.95, 20, 1.5)
    assert (plain.temperature, plain.top_p, plain.presence_penalty) == (0.7, 0.8, 1.5)
    assert llm.sampling_params(thinking=False, temperature=0.2, presence_penalty=0.0).temperature == 0.2
    raw = llm.sampling_params()  # raw completions keep generation_config.json's values
    assert (raw.temperature, raw.top_k, raw.presence_penalty) == (0.6, 20, 0.0)
