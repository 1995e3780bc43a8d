"""ninfer computes what transformers computes: per-token logprobs, greedy continuations, perplexity."""
from __future__ import annotations

import math

import pytest
import torch

import ninfer
from tiny_checkpoints import TinyCheckpoint, make_dense, make_moe

PROMPT_LEN = 150  # more than two DeltaNet chunks of 64
TOL = 1e-4


def _prompt(n: int = PROMPT_LEN, seed: int = 0) -> list[int]:
    return torch.randint(0, 448, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def _hf_logprobs(ckpt: TinyCheckpoint, ids: list[int]) -> torch.Tensor:
    logits = ckpt.hf_model(torch.tensor([ids])).logits[0].float()
    return logits.log_softmax(-1)[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def _assert_parity(ckpt: TinyCheckpoint) -> None:
    llm = ninfer.load(ckpt.path, device="cpu", progress=False)
    ids = _prompt()
    ours, ref = llm.score(ids), _hf_logprobs(ckpt, ids)
    assert ours.shape == ref.shape == (PROMPT_LEN - 1,)
    assert (ours - ref).abs().max().item() < TOL


def test_dense_logprobs_match_transformers(dense_ckpt: TinyCheckpoint) -> None:
    _assert_parity(dense_ckpt)


def test_moe_per_expert_logprobs_match_transformers(moe_ckpt: TinyCheckpoint) -> None:
    _assert_parity(moe_ckpt)


def test_composite_dense_logprobs_match_transformers(composite_ckpt: TinyCheckpoint) -> None:
    _assert_parity(composite_ckpt)


def test_composite_moe_fused_experts_logprobs_match_transformers(composite_moe_ckpt: TinyCheckpoint) -> None:
    _assert_parity(composite_moe_ckpt)


def test_non_default_layer_types_sharded_and_tied(tmp_path) -> None:
    types = ["full_attention", "linear_attention", "full_attention", "linear_attention", "linear_attention"]
    _assert_parity(make_dense(tmp_path / "a", layer_types=types, tie_word_embeddings=True, shard_size="60KB",
                              seed=3))
    assert len(list((tmp_path / "a").glob("*.safetensors"))) > 1


def test_moe_fused_layout_with_custom_layer_types(tmp_path) -> None:
    _assert_parity(make_moe(tmp_path / "m", expert_layout="fused",
                            layer_types=["linear_attention", "full_attention", "linear_attention"], seed=5))


def test_greedy_generation_matches_transformers(dense_ckpt: TinyCheckpoint) -> None:
    llm = ninfer.load(dense_ckpt.path, device="cpu", progress=False)
    ids = _prompt(40, seed=1)
    out = llm.generate_ids(ids, 32, llm.sampling_params(greedy=True), stop_token_ids=None)
    # transformers must not pick the embedding's padding rows either (ninfer never samples them).
    padding = list(range(llm.valid_vocab, llm.config.vocab_size))
    ref = dense_ckpt.hf_model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                       suppress_tokens=padding, eos_token_id=sorted(llm.stop_ids),
                                       pad_token_id=448)[0, len(ids):].tolist()
    assert out.token_ids == ref


def test_chunked_prefill_and_decode_equal_one_pass(moe_ckpt: TinyCheckpoint) -> None:
    llm = ninfer.load(moe_ckpt.path, device="cpu", progress=False)
    ids = _prompt(140, seed=2)
    runner = llm.runner
    runner.prefill_chunk = 1024
    runner.start(len(ids))
    one_pass = runner.extend(ids)
    for chunk in (64, 37, 1):
        runner.prefill_chunk = chunk
        runner.start(len(ids))
        pieces = runner.extend(ids[:100]), *(runner.extend([t]) for t in ids[100:])
        # fp32: chunking only reorders sums (one fp32 ulp of logits ~10 is 1e-6)
        torch.testing.assert_close(torch.cat(pieces), one_pass, rtol=1e-5, atol=1e-5)


def test_sliding_window_scores_every_token_once(dense_ckpt: TinyCheckpoint) -> None:
    llm = ninfer.load(dense_ckpt.path, device="cpu", progress=False)
    ids = _prompt(100, seed=4)
    windows = list(llm.score_windows(ids, context=40, stride=25))
    covered = [t for w in windows for t in range(w.first_target, w.end)]
    assert covered == list(range(1, 100))
    # Each window starts from an empty state: its scores equal scoring the window alone.
    for w in windows:
        alone = llm.score(ids[w.start:w.end])
        assert torch.allclose(w.logprobs, alone[w.first_target - w.start - 1:], atol=1e-6)


def test_perplexity_equals_exp_mean_nll_from_transformers(dense_ckpt: TinyCheckpoint) -> None:
    llm = ninfer.load(dense_ckpt.path, device="cpu", progress=False)
    text = "The quick brown fox jumps over the lazy dog. " * 12
    ids = llm.tokenizer.encode(text)
    context, stride = 64, 40
    result = ninfer.perplexity(llm, text, context=context, stride=stride, progress=False)
    nll, count, start, scored = 0.0, 0, 0, 1
    while scored < len(ids):
        end = min(start + context, len(ids))
        window = ids[start:end]
        lp = _hf_logprobs(dense_ckpt, window)[scored - start - 1:]
        nll, count = nll - lp.double().sum().item(), count + lp.numel()
        scored, start = end, start + stride
    assert result.tokens == count == len(ids) - 1
    assert math.isclose(result.mean_nll, nll / count, abs_tol=1e-5)
    assert math.isclose(result.perplexity, math.exp(nll / count), rel_tol=1e-5)
    assert len(result.windows) > 1


def test_score_rejects_bad_arguments(dense_ckpt: TinyCheckpoint) -> None:
    llm = ninfer.load(dense_ckpt.path, device="cpu", progress=False)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        llm.score([1])
    with pytest.raises(ValueError, match="stride"):
        llm.score([1, 2, 3], context=2, stride=5)
