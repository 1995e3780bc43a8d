"""perf/bench_spec.py on CPU (the tiny shape): a draft vocabulary is measured over the model's whole vocabulary, not
the bundled tokenizer's 481 ids (of which a 32,768-id subset is all: run 2026-12-05.9 timed the same code twice)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "perf"))
import bench_spec  # noqa: E402
from random_model import random_model  # noqa: E402

from ninfer.runtime.engine_config import EngineConfig  # noqa: E402


def test_the_full_vocabulary_lets_a_draft_vocabulary_narrow_the_drafts() -> None:
    model = random_model("tiny", device="cpu")
    head = bench_spec.random_head(model)
    cfg = EngineConfig(max_concurrency=1, max_context=256, draft_tokens=2, draft_vocab=600, cuda_graphs=False)
    narrow = bench_spec.make_llm(model, head, "tiny", cfg, full_vocab=True)
    assert narrow.valid_vocab == model.config.vocab_size > 600
    assert narrow.engine.spec.draft_ids is not None and len(narrow.engine.spec.draft_ids) == 600
    assert bench_spec.make_llm(model, head, "tiny", cfg).engine.spec.draft_ids is None  # 481 ids: all of them


def test_a_draft_vocabulary_that_is_the_whole_vocabulary_is_refused(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["bench_spec.py", "--shape", "tiny", "--device", "cpu", "--lanes", "1",
                                      "--steps", "1", "--draft-tokens", "1", "--draft-vocab", "100000"])
    with pytest.raises(SystemExit, match="covers the whole vocabulary"):
        import runpy

        runpy.run_path(str(ROOT / "perf" / "bench_spec.py"), run_name="__main__")
