"""The parallel compile's dry passes in the model runner: the warm-up's and the decode graphs' forwards,
as the passes they precede run them (:mod:`ninfer.kernels.precompile` compiles what a dry pass launches)."""
from __future__ import annotations

import torch

import ninfer
from tiny_checkpoints import TinyCheckpoint


def test_warm_up_compiles_in_parallel_the_same_forwards_it_then_runs(dense_ckpt: TinyCheckpoint, monkeypatch) -> None:
    """The parallel compile's dry pass is the warm-up's own passes (each chunk length, the checkpointed and
    packed chunks), run before them: what it compiles is what they launch."""
    from ninfer.kernels.deltanet import chunked_batch_sizes
    from ninfer.runtime import model_runner, startup

    llm = ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=2, max_context=4096, kv_capacity=4096,
                      prefill_chunk=256, prefill_tokens_while_decoding=64, progress=False)
    seen: list[tuple[str, list[int]]] = []
    stage = ["real"]
    make_batch = model_runner.make_batch
    monkeypatch.setattr(model_runner, "make_batch",
                        lambda **kw: (seen.append((stage[0], list(kw["seq_lens"]))), make_batch(**kw))[1])

    def parallel_compile(dry_pass):
        stage[0] = "dry"
        dry_pass()
        stage[0] = "real"

    monkeypatch.setattr(startup, "parallel_compile", parallel_compile)
    llm.engine.warm_up()
    dry = [lens for s, lens in seen if s == "dry"]
    real = [lens for s, lens in seen if s == "real"]
    single = [lens[0] for lens in real if len(lens) == 1]
    packed = [len(lens) for lens in real if len(lens) > 1 or lens[0] == model_runner.PACKED_WARMUP_CHUNK]
    assert dry == real and single[:len(model_runner.warmup_chunk_lengths(256))] == model_runner.warmup_chunk_lengths(256)
    assert packed == [n for n in chunked_batch_sizes(2) for _ in (False, True)]  # then the packed prefills
    assert [s for s, _ in seen] == ["dry"] * len(dry) + ["real"] * len(real) and llm.engine.is_idle()



class _Graph:
    def pool(self) -> None:
        return None


def test_prefill_attention_chunks_warm_up_at_the_end_of_the_longest_prompt(dense_ckpt: TinyCheckpoint,
                                                                          monkeypatch) -> None:
    """Each one-sequence warm-up chunk that takes the prefill attention kernel ends where the longest does (its
    keys reach back over the scratch pages: tuned as a chunk of a long prompt); the decode kernel's few-token
    chunks start at 0."""
    from ninfer.kernels.attention.decode import DECODE_MAX_TOKENS
    from ninfer.runtime import model_runner

    llm = ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=2, max_context=4096, kv_capacity=4096,
                      prefill_chunk=256, progress=False)
    seen: list[tuple[int, int, int]] = []
    make_batch = model_runner.make_batch

    def noting(**kw):
        batch = make_batch(**kw)
        if len(kw["seq_lens"]) == 1 and "checkpoints" not in kw:
            seen.append((kw["seq_lens"][0], int(batch.positions.reshape(-1, kw["seq_lens"][0])[0, 0]),
                         int(kw["context_lens"][0])))
        return batch

    monkeypatch.setattr(model_runner, "make_batch", noting)
    monkeypatch.setattr(model_runner.startup, "parallel_compile", lambda dry_pass: None)
    llm.engine.warm_up()
    longest = max(n for n, _, _ in seen)
    assert [n for n, _, _ in seen] == model_runner.warmup_chunk_lengths(longest)
    for n, start, context in seen:
        assert (start, context) == ((longest - n, longest) if n > DECODE_MAX_TOKENS else (0, n)), (n, start, context)


def test_the_decode_dry_pass_builds_the_batches_the_graphs_capture(dense_ckpt: TinyCheckpoint, monkeypatch) -> None:
    """Same sizes, dtypes, shapes and strides (Triton specialises on strides) for each batch size."""
    from ninfer.runtime import graphs, model_runner

    llm = ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=3, max_context=512, kv_capacity=1024,
                      progress=False)
    runner = llm.engine.runner

    def recorder(module, into: list) -> None:
        make_batch = module.make_batch

        def record(**kw):
            into.append({k: (v.dtype, tuple(v.shape), v.stride()) if isinstance(v, torch.Tensor) else v
                         for k, v in kw.items()})
            return make_batch(**kw)
        monkeypatch.setattr(module, "make_batch", record)

    dry, captured = [], []
    recorder(model_runner, dry)
    recorder(graphs, captured)
    monkeypatch.setattr(graphs, "capture", lambda fn, pool=None: (_Graph(), fn()))
    with torch.inference_mode():
        runner._decode_passes(3)
        graphs.DecodeGraphs(runner.model, runner.cache, runner.block_tables, 3)
    assert len(dry) == 3 and dry == captured
