"""The prompt-chunk graph on the GPU (:mod:`ninfer.runtime.chunk_graphs`, on by default at this budget): captured
after warm-up, replayed for every chunk of its length beside decodes, with the same greedy tokens as the engine
without it (fp32, dense and MoE; int4 in bf16: the quantized GEMMs that chose the dequantization path take their
graph keys, and the tokens are not compared); nothing compiles or tunes after ready."""
from __future__ import annotations

import pytest
import torch

import ninfer
from ninfer.kernels import compile_watch
from ninfer.runtime import chunk_graphs
from tiny_checkpoints import TinyCheckpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BUDGET = 64


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 448, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(llm: ninfer.LLM) -> tuple[list[list[int]], int]:
    """Two decodes, then a 1,000-token prompt beside them (15 chunks of the budget, then 40 tokens); the
    tokens of all three and how many chunks replayed the graph."""
    engine, runs = llm.engine, [0]
    graph = engine.runner.chunk_graphs
    if graph is not None:
        run = graph.run
        graph.run = lambda *a: runs.__setitem__(0, runs[0] + 1) or run(*a)
    params = llm.sampling_params(greedy=True)
    decoders = [llm._request(_prompt(40 + 9 * i, seed=i), 48, params) for i in range(2)]
    for r in decoders:
        engine.add_request(r)
    while not all(r.output_ids for r in decoders):
        engine.step()
    long = llm._request(_prompt(1000, seed=7), 4, params)
    engine.add_request(long)
    engine.run_until_done()
    return [r.output_ids for r in (*decoders, long)], runs[0]


@pytest.mark.parametrize("ckpt_name, dtype, quantize", [("dense_ckpt", torch.float32, None),
                                                        ("moe_ckpt", torch.float32, None),
                                                        ("dense_ckpt", torch.bfloat16, "int4")])
def test_chunks_beside_decodes_replay_the_graph_with_the_same_tokens(request, ckpt_name: str, dtype: torch.dtype,
                                                                      quantize: str | None,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt: TinyCheckpoint = request.getfixturevalue(ckpt_name)

    def load() -> ninfer.LLM:
        llm = ninfer.load(ckpt.path, device="cuda", dtype=dtype, quantize=quantize, max_concurrency=4,
                          max_context=2048, prefill_tokens_while_decoding=BUDGET, prefix_cache=False, progress=False)
        llm.stop_ids = frozenset()
        return llm

    monkeypatch.setenv(chunk_graphs.ENV, "0")
    plain, runs = _run(load())
    assert runs == 0
    monkeypatch.delenv(chunk_graphs.ENV)
    llm = load()
    assert llm.engine.runner.chunk_graphs is not None and llm.engine.runner.chunk_graphs.graph is not None
    with compile_watch.watch() as after_ready:
        tokens, runs = _run(llm)
    assert runs == 1000 // BUDGET
    assert not after_ready.stalls(), after_ready.summary()
    if dtype == torch.float32:  # bf16 int4: the graph's GEMM configs round differently (their kernels are
        assert tokens == plain   # checked against the reference in test_quant_fragments_gpu.py)
