"""The parallel compile on CUDA (:mod:`ninfer.kernels.precompile`): kernels compiled on the pool compute what
kernels compiled at their first launch compute, the warm-up's real passes find nearly everything compiled,
and nothing compiles after ready.

Each start runs in a child process with empty Triton and tune caches of its own (in one process the
kernels compiled by an earlier test would be found in memory: nothing to compile). The model has the real
head geometry (attention head dim 256, 6 : 1 heads; DeltaNet dk = dv = 128), int4-quantized (the GEMM
tuner's paths) and bf16, loaded through ``ninfer.load`` with the warm-up and the decode CUDA graphs.

* parity: with the tuners and autotune off (each key's first candidate: the same kernels either way), the
  scores of a prompt and greedy continuations (decode through the graphs) are bitwise those of a start with
  ``NINFER_PARALLEL_COMPILE=0``;
* coverage: with tuning on, the dry passes request every kernel the warm-up and the graph capture launch
  (their phases compile at most 5% as many again: specialisations on values the dry pass did not compute),
  no compile fails, and the continuations after ready compile and tune nothing.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tiny_checkpoints import REAL_HEADS, TinyCheckpoint, make_composite

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROOT = Path(__file__).resolve().parents[2]
MISSED_AT_MOST = 0.05


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoint:
    return make_composite(tmp_path_factory.mktemp("parallel-compile"), seed=11, overrides=REAL_HEADS)


def _child(ckpt: TinyCheckpoint, quantize: str | None, tmp: Path, *, parallel: bool, tune: bool) -> dict:
    """Start the engine in a fresh process with fresh caches; its report, scores, tokens and stalls."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"TRITON_CACHE_DIR": str(tmp / "triton"), "NINFER_TUNE_CACHE": str(tmp / "tune"),
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    env.pop("NINFER_PARALLEL_COMPILE", None)
    if not parallel:
        env["NINFER_PARALLEL_COMPILE"] = "0"
    if not tune:
        env |= {"NINFER_QUANT_TUNE": "0", "NINFER_AUTOTUNE": "off"}
    out = tmp / "result.json"
    done = subprocess.run([sys.executable, __file__, str(ckpt.path), quantize or "none", str(out)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("quantize", ["int4", None])
def test_kernels_compiled_in_parallel_compute_what_serially_compiled_ones_do(
        ckpt: TinyCheckpoint, quantize: str | None, tmp_path: Path) -> None:
    parallel = _child(ckpt, quantize, tmp_path / "parallel", parallel=True, tune=False)
    serial = _child(ckpt, quantize, tmp_path / "serial", parallel=False, tune=False)
    pc = parallel["startup"]["parallel_compile"]
    assert pc["on"] and pc["kernels"] > 0 and pc["failed"] == 0, pc
    assert not serial["startup"]["parallel_compile"]["on"]
    assert parallel["scores"] == serial["scores"]  # bitwise: the same kernels, compiled on other threads
    assert parallel["tokens"] == serial["tokens"]


@pytest.mark.parametrize("quantize", ["int4", None])
def test_the_dry_passes_reach_what_warm_up_and_capture_launch(ckpt: TinyCheckpoint, quantize: str | None,
                                                              tmp_path: Path) -> None:
    r = _child(ckpt, quantize, tmp_path, parallel=True, tune=True)
    pc, compiles = r["startup"]["parallel_compile"], r["startup"]["phases_compiles"]
    assert pc["on"] and pc["failed"] == 0, pc
    missed = compiles.get("warm-up", 0) + compiles.get("graph capture", 0)
    assert missed <= MISSED_AT_MOST * pc["kernels"], (missed, pc, compiles, r["report"])
    assert r["after_ready"] == [], r["after_ready"]


def main(path: str, quantize: str, out: str) -> None:
    """The child: load with warm-up, then score one prompt and continue three (greedy, through the graphs)."""
    import ninfer
    from ninfer.kernels import compile_watch

    llm = ninfer.load(path, device="cuda", dtype=torch.bfloat16, quantize=None if quantize == "none" else quantize,
                      max_concurrency=4, max_context=4096, prefill_chunk=1024, progress=False)
    llm.stop_ids = frozenset()  # random weights: every continuation runs to its length
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 448, (n,), generator=gen).tolist() for n in (7, 300, 1500)]
    with compile_watch.watch() as after:  # the engine's serving path (scoring runs outside the engine)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], max_new_tokens=24, greedy=True)
    scores = llm.score(prompts[2]).float().cpu().tolist()
    Path(out).write_text(json.dumps({
        "startup": llm.startup.as_dict(), "report": llm.startup.describe(), "scores": scores,
        "tokens": [o.token_ids for o in outs], "after_ready": [str(e) for e in after.events[:40]]}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
