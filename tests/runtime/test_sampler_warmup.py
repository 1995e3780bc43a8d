"""``Sampler.warm_up``: one launch per top-logprobs class and mask variant (without / with the structured-output
bitmask) on the model's own logits row, lane state untouched."""
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

    def spy(logits, st, counts, seen, *, vocab_limit, num_logprobs, bitmask=None, mask_rows=None):
        if bitmask is not None:  # allows every token of the row
            assert bool((bitmask == -1).all()) and mask_rows.tolist() == [0]
            assert bitmask.shape[1] * 32 >= logits.shape[1]
        launches.append((tuple(logits.shape), logits.dtype, num_logprobs, vocab_limit, bitmask is not None))
        return real(logits, st, counts, seen, vocab_limit=vocab_limit, num_logprobs=num_logprobs, bitmask=bitmask,
                    mask_rows=mask_rows)

    monkeypatch.setattr(sampler_module, "sample", spy)
    sampler.warm_up(llm.model)
    vocab = llm.config.vocab_size
    assert launches == [((1, vocab), llm.model.dtype, n, sampler.vocab_limit, masked)
                        for n in LOGPROB_CLASSES for masked in (False, True)]
    assert all(torch.equal(getattr(sampler, k), v) for k, v in before.items())
    assert all(torch.equal(getattr(sampler.st, f), t) for f, t in lanes.items())


def test_engine_compiles_the_sampler_variants_in_a_dry_pass_first(dense_ckpt: TinyCheckpoint, monkeypatch) -> None:
    """Engine warm-up hands the sampler's warm-up to the parallel compile (its variants compile together on the
    pool) before running it for real, as it does the runner's passes."""
    from ninfer.runtime import startup

    llm = ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=2, progress=False)
    order = []
    monkeypatch.setattr(llm.engine.runner, "warm_up", lambda *a, **k: order.append("runner"))
    monkeypatch.setattr(llm.engine.sampler, "warm_up", lambda model: order.append("sampler"))

    def dry(work):
        order.append("dry:")
        work()
        order.append(":dry")

    monkeypatch.setattr(startup, "parallel_compile", dry)
    llm.engine.warm_up()
    assert order == ["dry:", "sampler", ":dry", "runner", "sampler"]
