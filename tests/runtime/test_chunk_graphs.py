"""The prompt-chunk graph (:mod:`ninfer.runtime.chunk_graphs`) on CPU: the same forward on its static buffers,
run eagerly in place of a replay. A long prompt beside a decoding sequence takes it for every chunk of the
graph's length (the decode rows then run apart, in their own step), and both outputs are the ones the plain
engine gives."""
from __future__ import annotations

import pytest

import ninfer
from ninfer.runtime import chunk_graphs
from ninfer.runtime.chunk_graphs import ChunkGraphs
from ninfer.runtime.stall_budget import LEAST_TOKENS
from tiny_checkpoints import TinyCheckpoint

BUDGET = 32


def _install_graph(llm) -> list[int]:
    """Give the runner an eager chunk graph of ``BUDGET`` tokens; the returned list gets each run's start."""
    runner, runs = llm.engine.runner, []
    graph = ChunkGraphs(runner.model, runner.cache, runner.block_tables, BUDGET, captured=False)
    run = graph.run
    graph.run = lambda ids, start, *a: runs.append(start) or run(ids, start, *a)
    runner.chunk_graphs = graph
    return runs


def _run(llm, with_graph: bool) -> tuple[list[int], list[int], list[int]]:
    engine = llm.engine
    runs = _install_graph(llm) if with_graph else []
    params = llm.sampling_params(greedy=True, logprobs=1)
    decoder = llm._request(list(range(5, 25)), 40, params)
    engine.add_request(decoder)
    while not decoder.output_ids:
        engine.step()
    long = llm._request(list(range(30, 230)), 3, params)  # 200 tokens: 6 chunks of 32, then 8
    engine.add_request(long)
    engine.run_until_done()
    return decoder.output_ids, long.output_ids, runs


def test_a_long_prompt_beside_decodes_replays_the_chunk_graph(dense_ckpt: TinyCheckpoint) -> None:
    def load():
        return ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=2, prefill_tokens_while_decoding=BUDGET,
                           prefix_cache=False, progress=False)

    plain_decoder, plain_long, _ = _run(load(), with_graph=False)
    decoder, long, runs = _run(load(), with_graph=True)
    assert runs == list(range(0, 192, BUDGET))  # every full chunk; the last 8 tokens prefill eagerly
    assert decoder == plain_decoder and long == plain_long


def test_a_prefix_cache_hit_continues_in_the_graph(dense_ckpt: TinyCheckpoint) -> None:
    """A conversation's next turn beside a decode: its prompt starts at the cached prefix (not a multiple of the
    graph's length) and its chunks from there replay the graph, with the tokens of the plain engine."""
    def turns(with_graph: bool) -> tuple[list[list[int]], int, list[int]]:
        llm = ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=2, prefill_tokens_while_decoding=BUDGET,
                          progress=False)
        engine = llm.engine
        runs = _install_graph(llm) if with_graph else []
        params = llm.sampling_params(greedy=True)
        first = llm._request(list(range(30, 230)), 3, params)
        engine.add_request(first)
        engine.run_until_done()
        decoder = llm._request(list(range(7, 27)), 30, params)
        engine.add_request(decoder)
        while not decoder.output_ids:
            engine.step()
        turn = llm._request(first.prompt_ids + first.output_ids + list(range(300, 380)), 3, params)
        engine.add_request(turn)
        engine.run_until_done()
        return [first.output_ids, decoder.output_ids, turn.output_ids], turn.cached_tokens, runs

    plain, _, _ = turns(False)
    tokens, cached, runs = turns(True)
    assert tokens == plain and cached > 0 and cached % BUDGET
    assert runs == [cached, cached + BUDGET]  # ~80 new tokens: two chunks of 32 replayed, the rest eager


def test_only_a_single_text_chunk_of_the_graph_s_length_takes_it(dense_ckpt: TinyCheckpoint) -> None:
    llm = ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=2, progress=False)
    runner = llm.engine.runner
    assert runner.chunk_graphs is None and not runner.takes_chunk_graph([])  # none at the default budget, nor on CPU
    _install_graph(llm)
    req = llm._request(list(range(100)), 1, llm.sampling_params(greedy=True))
    assert runner.takes_chunk_graph([(req, BUDGET)]) and not runner.takes_chunk_graph([(req, BUDGET + 1)])
    assert not runner.takes_chunk_graph([(req, BUDGET), (req, BUDGET)])
    assert not runner.takes_chunk_graph([(req, BUDGET)], {req.request_id: 10})  # a checkpoint to write: eager


@pytest.mark.parametrize("value, small, large", [("1", True, True), ("on", True, True), ("0", False, False),
                                                  ("off", False, False), ("", True, False), ("auto", True, False),
                                                  (None, True, False)])
def test_the_switch(value: str | None, small: bool, large: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """On, off, or (unset, the default) for budgets up to AUTO_MAX_TOKENS, where eager steps are host-bound."""
    if value is None:
        monkeypatch.delenv(chunk_graphs.ENV, raising=False)
    else:
        monkeypatch.setenv(chunk_graphs.ENV, value)
    assert chunk_graphs.chunk_graphs_enabled(chunk_graphs.AUTO_MAX_TOKENS) is small
    assert chunk_graphs.chunk_graphs_enabled(chunk_graphs.AUTO_MAX_TOKENS + 1) is large


def test_a_bad_switch_value_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(chunk_graphs.ENV, "sometimes")
    with pytest.raises(ValueError, match="NINFER_CHUNK_GRAPHS='sometimes'"):
        chunk_graphs.chunk_graphs_enabled(128)


def test_which_engines_capture_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Switched on: plain decoding with CUDA graphs and a budget shorter than a sequence; the memory plan
    reserves by the same rule."""
    from ninfer.runtime.engine_config import EngineConfig

    monkeypatch.delenv(chunk_graphs.ENV, raising=False)
    assert chunk_graphs.chunk_graph_tokens(EngineConfig(max_context=4096)) == 0  # the default budget: eager
    config = EngineConfig(max_context=4096, prefill_tokens_while_decoding=256)
    assert chunk_graphs.chunk_graph_tokens(config) == 256
    monkeypatch.setenv(chunk_graphs.ENV, "0")
    assert chunk_graphs.chunk_graph_tokens(config) == 0
    monkeypatch.setenv(chunk_graphs.ENV, "1")
    assert chunk_graphs.chunk_graph_tokens(EngineConfig(max_context=4096)) == 1024
    assert chunk_graphs.chunk_graph_tokens(EngineConfig(max_context=4096, prefill_tokens_while_decoding=256,
                                                        cuda_graphs=False)) == 0
    assert chunk_graphs.chunk_graph_tokens(EngineConfig(max_context=256, prefill_tokens_while_decoding=256)) == 0


def test_a_stall_bound_never_plans_chunks_shorter_than_the_graph(dense_ckpt: TinyCheckpoint) -> None:
    """With ``max_decode_stall`` the budget follows measured step times, but not below the graph's length once
    warm-up has captured it: a shorter chunk would run eagerly."""
    tokens = 48  # above the floor without a graph (LEAST_TOKENS)
    llm = ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=2, max_decode_stall="1.01x",
                      prefill_tokens_while_decoding=tokens, progress=False)
    runner = llm.engine.runner
    assert llm.engine.scheduler.stall.least == LEAST_TOKENS
    runner.chunk_graphs = ChunkGraphs(runner.model, runner.cache, runner.block_tables, tokens, captured=False)
    llm.engine.warm_up()  # on CPU: the runner keeps the graph it was given
    assert llm.engine.scheduler.stall.least == tokens
