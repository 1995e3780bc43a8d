"""``Sampler.warm_up``: one launch per top-logprobs class on the model's own logits row, lane state untouched."""
from __future__ import annotations

import torch

import ninfer
from ninfer.kernels.sampling.dispatch import LOGPROB_CLASSES
from ninfer.runtime import sampler as sampler_module
from tiny_checkpoints import TinyCheckpoint


def test_one_launch_per_logprob_class_and_lanes_untouched(dense_ckpt: TinyCheckpoint, monkeypatch) -> None:
    llm = ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=2, progress=False)
    sampler = llm.engine.sampler
    before = {name: getattr(sampler, name).clone() for name in ("counts", "seen")}
    lanes = {f: t.clone() for f, t in vars(sampler.st).items()}
    launches = []
    real = sampler_module.sample

    def spy(logits, st, counts, seen, *, vocab_limit, num_logprobs):
        launches.append((tuple(logits.shape), logits.dtype, num_logprobs, vocab_limit))
        return real(logits, st, counts, seen, vocab_limit=vocab_limit, num_logprobs=num_logprobs)

    monkeypatch.setattr(sampler_module, "sample", spy)
    sampler.warm_up(llm.model)
    vocab = llm.config.vocab_size
    assert launches == [((1, vocab), llm.model.dtype, n, sampler.vocab_limit) for n in LOGPROB_CLASSES]
    assert all(torch.equal(getattr(sampler, k), v) for k, v in before.items())
    assert all(torch.equal(getattr(sampler.st, f), t) for f, t in lanes.items())
