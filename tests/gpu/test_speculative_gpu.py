"""Speculative decoding on the GPU: Triton kernels (per-token conv windows and DeltaNet states,
multi-token decode attention) and CUDA graphs of the draft + verify round."""
from __future__ import annotations

import pytest
import torch

import ninfer
from ninfer.kernels.quant_gemm.fragments import FRAGMENTS
from ninfer.quant.linear import QuantLinear
from tiny_checkpoints import REAL_HEADS, TinyCheckpoint, make_composite

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]



def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 448, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [_prompt(n, seed=n) for n in (3, 90, 200, 17)]


@pytest.fixture(scope="module", params=["dense", "moe"])
def ckpt(request, tmp_path_factory) -> TinyCheckpoint:
    moe = request.param == "moe"
    extra = {"moe_intermediate_size": 128, "shared_expert_intermediate_size": 128} if moe else {}
    return make_composite(tmp_path_factory.mktemp(f"gspec-{request.param}"), moe=moe, seed=3,
                          overrides={**REAL_HEADS, **extra})


def _load(ckpt: TinyCheckpoint, **kw) -> ninfer.LLM:
    return ninfer.load(ckpt.path, device="cuda", dtype=kw.pop("dtype", torch.float32), max_concurrency=3,
                       prefill_chunk=64, progress=False, **kw)


def _run(llm: ninfer.LLM, max_new: int = 32) -> list[list[int]]:
    reqs = [llm._request(p, max_new, llm.sampling_params(greedy=True)) for p in PROMPTS]
    out = [c.token_ids for c in llm._run(reqs)]
    assert llm.engine.is_idle()
    return out


def _saboteur(llm: ninfer.LLM, reqs_tokens: dict[int, list[int]], k: int) -> None:
    """Drafts: the plain run's tokens up to a cut cycling 0..K, then wrong ones (eager rounds)."""
    cut = iter(range(10 ** 9))

    def propose(lanes, n, drafts):
        out = drafts.clone()
        by_lane = {r.lane: r.prompt_ids + reqs_tokens[tuple(r.prompt_ids)]
                   for r in llm.engine.requests.values() if r.lane is not None}
        for b, (lane, pos) in enumerate(zip(lanes.tolist(), n.tolist())):
            good, seq = next(cut) % (k + 1), by_lane[lane]
            for i in range(k):
                truth = seq[pos + 1 + i] if pos + 1 + i < len(seq) else 0
                out[b, i] = truth if i < good else (truth + 1) % 448
        return out

    llm.engine.spec.propose = propose


@pytest.fixture(scope="module")
def plain(ckpt: TinyCheckpoint) -> list[list[int]]:
    return _run(_load(ckpt))


# One K per checkpoint: each new (dtype, shape) compiles every kernel again, which dominates the run.
@pytest.mark.parametrize("k", [3])
def test_speculative_greedy_equals_plain_with_graphs(ckpt: TinyCheckpoint, plain: list[list[int]], k: int) -> None:
    want = plain
    graphs = _load(ckpt, spec="mtp", draft_tokens=k)
    assert graphs.engine.spec.graphs  # the rounds replay CUDA graphs
    assert _run(graphs) == want
    eager = _load(ckpt, spec="mtp", draft_tokens=k, cuda_graphs=False)
    _saboteur(eager, {tuple(p): w for p, w in zip(PROMPTS, want)}, k)
    assert _run(eager) == want
    stats = eager.engine.spec_totals
    assert 0 < stats.accepted < stats.drafted


@pytest.mark.parametrize("kv_dtype", ["fp8"])
def test_speculative_bf16_runs_with_quantized_kv(ckpt: TinyCheckpoint, kv_dtype: str) -> None:
    """bf16 verification rounds (4 tokens through M = 4 GEMMs) need not match plain bf16 decoding bit for
    bit, so this checks that the Triton bf16 path runs, replays its graphs and keeps the pools balanced."""
    llm = _load(ckpt, spec="mtp", draft_tokens=3, dtype=torch.bfloat16, kv_dtype=kv_dtype)
    outs = _run(llm, max_new=64)
    assert all(len(o) > 0 for o in outs)
    assert llm.engine.spec_totals.rounds > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_speculative_over_a_quantized_head(ckpt: TinyCheckpoint, dtype: torch.dtype) -> None:
    """The recipe's ``mtp.*`` rules pack the head's projections and experts (bf16: through the register decode
    and the expert kernels, in the rounds' graphs); in fp32 greedy decoding over it equals plain decoding."""
    llm = _load(ckpt, spec="mtp", draft_tokens=3, quantize="int4", dtype=dtype)
    head = llm.engine.spec.head
    assert sum(isinstance(m, QuantLinear) for m in head.modules()) >= 3 and llm.engine.spec.graphs
    outs = _run(llm)
    if dtype == torch.float32:
        assert outs == _run(_load(ckpt, quantize="int4"))
    else:
        assert all(len(o) > 0 for o in outs) and llm.engine.spec_totals.rounds > 0


def test_without_spec_the_head_waits_in_host_memory(ckpt: TinyCheckpoint) -> None:
    """A load that does not draft keeps the ``mtp.*`` tensors off the device, and the head still builds from them."""
    from ninfer.models.mtp import MTPHead

    llm = _load(ckpt)
    assert llm.load_report.mtp and all(t.device.type == "cpu" for t in llm.load_report.mtp.values())
    head = MTPHead.from_report(llm.model, llm.load_report.mtp)
    assert all(p.is_cuda for p in head.parameters())


def test_speculative_over_a_draft_vocabulary(ckpt: TinyCheckpoint) -> None:
    """Drafts among the 64 lowest ids: the LM head's rows dequantized from the fragment-laid int8-g64 head (the
    int4 recipe's), the rounds replayed from graphs; greedy decoding equals plain decoding over the same weights."""
    llm = _load(ckpt, spec="mtp", draft_tokens=3, quantize="int4", draft_vocab=64)
    spec = llm.engine.spec
    lm_head = llm.engine.runner.model.lm_head
    assert isinstance(lm_head, QuantLinear) and lm_head.layout == FRAGMENTS and spec.graphs
    ids = torch.arange(64, device="cuda")
    torch.testing.assert_close(spec.draft_rows, lm_head.packed().dequantize(spec.draft_rows.dtype)[ids])
    assert _run(llm) == _run(_load(ckpt, quantize="int4"))
    assert spec.head is not None and llm.engine.spec_totals.rounds > 0
