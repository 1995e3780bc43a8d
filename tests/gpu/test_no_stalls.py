"""Nothing compiles or tunes after "ready" (issue 22): a scripted serving mix after start-up meets no new
Triton kernel, no tuner timing and no triton.autotune benchmark (:mod:`ninfer.kernels.compile_watch`).

The model has few layers and a small width but the real head geometry (attention head dim 256, 6 query
heads per KV head; DeltaNet dk = dv = 128, 3 value heads per key head) and goes through ``ninfer.load``
as a checkpoint would, int4- or nvfp4-quantized (the GEMM tuner's paths) or bf16, with MTP speculation on or off;
and a MoE model of the same geometry, int4 with MTP (the expert and float-GEMV tuners' keys).
The mix: C = 1..8 requests arriving together and one per step (prompts packed into one step, prompt
chunks next to decode rows), prompts of 1 token to 32k, the sampler's paths (greedy, temperature /
top-p / top-k / min-p, penalties, logprobs), prefix-cache hits of a conversation's next turn, and four
decodes sharing their steps with a 32k prefill. A failure lists every kernel and key that was compiled
or tuned, with the step that met it.

Also here: the memory plan's workspace estimate bounds what an 8192-token prefill (the default chunk)
allocates at the real 27B widths.
"""
from __future__ import annotations

import pytest
import torch

import ninfer
from ninfer.kernels import compile_watch
from ninfer.runtime.sampling import SamplingParams
from tiny_checkpoints import REAL_HEADS, TinyCheckpoint, make_composite

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LONG = 32768
LENGTHS = [1, 2, 3, 5, 8, 15, 16, 17, 31, 63, 64, 65, 100, 127, 257, 511, 1000, 1025, 2047, 3000, 4097, 6000]
PARAMS = [SamplingParams(greedy=True), SamplingParams(temperature=0.8, top_p=0.9),
          SamplingParams(temperature=0.7, top_k=20, min_p=0.05),
          SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.2, repetition_penalty=1.1),
          SamplingParams(greedy=True, logprobs=3), SamplingParams(temperature=0.6, top_p=0.8, top_k=20, logprobs=0)]


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 448, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> TinyCheckpoint:
    return make_composite(tmp_path_factory.mktemp("nostalls"), seed=7, overrides=REAL_HEADS)


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory) -> TinyCheckpoint:
    """MoE with expert widths the register decodes take (its keys: decode rows, rows aligned in blocks of 16 past
    64 pairs, the float GEMV's router and a/b gates)."""
    return make_composite(tmp_path_factory.mktemp("nostalls_moe"), moe=True, seed=8,
                          overrides={**REAL_HEADS, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128})


class Mix:
    """Drives the engine step by step and notes which part of the mix each compile / tune event met."""

    def __init__(self, llm: ninfer.LLM) -> None:
        self.llm, self.engine, self.seed = llm, llm.engine, 1000
        self.llm.stop_ids = frozenset()  # random weights: run every request to its length
        self.where: list[tuple[int, str]] = []  # (event count when a part began, the part)

    def request(self, n: int, max_new: int, i: int):
        self.seed += 1
        return self.llm._request(_prompt(n, self.seed), max_new, PARAMS[i % len(PARAMS)])

    def part(self, label: str) -> None:
        self.where.append((compile_watch.mark(), label))

    def together(self, c: int) -> None:
        self.part(f"C={c} together")
        for i in range(c):
            self.engine.add_request(self.request(LENGTHS[(c * 3 + i) % len(LENGTHS)], 4 + 3 * i, i))
        self.engine.run_until_done()

    def staggered(self, c: int) -> None:
        self.part(f"C={c} one per step")
        for i in range(c):
            self.engine.add_request(self.request(LENGTHS[(c * 5 + 2 * i) % len(LENGTHS)], 12, i + c))
            self.engine.step()
        self.engine.run_until_done()

    def next_turn(self) -> None:
        """A conversation's second turn: its first turn's prompt and reply, then new tokens (a prefix hit)."""
        self.part("next turn (prefix-cache hit)")
        first = self.request(700, 9, 0)
        self.engine.add_request(first)
        self.engine.run_until_done()
        turn = self.llm._request(first.prompt_ids + first.output_ids + _prompt(40, 5), 6, PARAMS[1])
        self.engine.add_request(turn)
        self.engine.run_until_done()
        assert turn.cached_tokens > 0, "the second turn did not hit the prefix cache"

    def long_prefill_beside_decodes(self) -> None:
        self.part("4 decodes beside a 32k prefill")
        decoders = [self.request(300 + 50 * i, 10 ** 6, i) for i in range(4)]
        for r in decoders:
            self.engine.add_request(r)
        while not all(r.output_ids for r in decoders):
            self.engine.step()
        long = self.request(LONG, 3, 0)
        self.engine.add_request(long)
        while not long.output_ids:
            self.engine.step()
        for r in decoders:
            self.engine.cancel(r.request_id)
        self.engine.run_until_done()

    def label(self, event_index: int) -> str:
        return next((lbl for at, lbl in reversed(self.where) if at <= event_index), "?")


@pytest.mark.parametrize("model,quantize,mtp", [("ckpt", "int4", False), ("ckpt", "int4", True),
                                               ("ckpt", "nvfp4", False), ("ckpt", None, False),
                                               ("moe_ckpt", "int4", True)],
                         ids=["int4", "int4-mtp", "nvfp4", "bf16", "moe-int4-mtp"])
def test_nothing_compiles_or_tunes_after_ready(request: pytest.FixtureRequest, model: str, quantize: str | None,
                                               mtp: bool) -> None:
    ckpt = request.getfixturevalue(model)
    llm = ninfer.load(ckpt.path, device="cuda", dtype=torch.bfloat16, quantize=quantize, max_concurrency=8,
                      max_context=LONG + 64, kv_capacity=3 * (LONG + 64), spec="mtp" if mtp else None,
                      progress=True)
    assert llm.startup is not None
    print(llm.startup.describe())  # (kernels an earlier case compiled are already in this process)
    assert llm.engine.config.prefill_chunk == 8192  # the defaults serving runs with
    mix = Mix(llm)
    with compile_watch.watch() as after_ready:
        for c in range(1, 9):
            mix.together(c)
            mix.staggered(c)
        mix.next_turn()
        mix.long_prefill_beside_decodes()
    assert llm.engine.is_idle()
    assert after_ready.complete, compile_watch.SUPPORT
    stalls = after_ready.stalls()
    start = after_ready.start
    detail = "\n".join(f"  [{mix.label(start + i)}] {e}" for i, e in enumerate(stalls))
    assert not stalls, f"after ready: {after_ready.summary()}\n{detail}"


def test_workspace_estimate_bounds_a_default_chunk_at_27b_widths(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four layers of the 27B shape (three DeltaNet, one attention), int4: what one 8192-token prefill
    allocates beyond the resident model and cache stays within the plan's workspace (tuning off: timing
    candidates allocates scratch that serving does not)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))
    from random_model import random_llm

    from ninfer.kernels.tuning import default_tuner
    from ninfer.runtime.engine_config import EngineConfig

    monkeypatch.setattr(default_tuner(), "enabled", False)
    config = EngineConfig(max_concurrency=1, max_context=16384, kv_capacity=16384, prefix_cache=False,
                          cuda_graphs=False, warmup=False)
    llm = random_llm("27b", config, num_layers=4, recipe="int4")
    llm.stop_ids = frozenset()
    engine = llm.engine
    engine.add_request(llm._request(_prompt(1024, 1), 1, PARAMS[0]))  # compile outside the measurement
    engine.run_until_done()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    engine.add_request(llm._request(_prompt(8192, 2), 1, PARAMS[0]))
    real_plan, chunks = engine.scheduler.plan, []

    def spy():
        plan = real_plan()
        chunks.append([end - req.num_computed for req, end in plan.prefills])
        return plan

    engine.scheduler.plan = spy
    engine.run_until_done()
    torch.cuda.synchronize()
    used = torch.cuda.max_memory_allocated() - base
    assert chunks[0] == [8192], chunks
    print(f"8192-token prefill: {used / 2**30:.2f} GiB beyond the resident state, "
          f"workspace estimate {engine.plan.workspace_bytes / 2**30:.2f} GiB")
    assert used <= engine.plan.workspace_bytes
