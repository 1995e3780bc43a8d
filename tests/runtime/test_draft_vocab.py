"""The drafts' vocabulary (``draft_vocab`` / ``draft_token_map``): reading token maps, the LM head's rows in every
layout, and speculative decoding over a narrowed vocabulary (same outputs; drafts only from the subset)."""
from __future__ import annotations

import json

import pytest
import torch

import ninfer
from kernel_testing import fragment_laid
from ninfer.quant.formats import quantize
from ninfer.runtime.draft_vocab import DraftVocabError, draft_token_ids, read_token_map
from ninfer.runtime.engine_config import EngineConfig
from ninfer.runtime.memory import draft_head_bytes
from ninfer.runtime.options import OptionError
from ninfer.runtime.sampling import SamplingParams

PROMPTS = [[5, 17, 33, 99, 12, 7, 201, 45], list(range(20, 57)), [300, 301, 302]]


def test_token_maps_in_every_format(tmp_path) -> None:
    ids = [7, 3, 3, 250, 0]
    torch.save(torch.tensor(ids), tmp_path / "hot.pt")
    torch.save(ids, tmp_path / "list.pt")
    (tmp_path / "hot.json").write_text(json.dumps(ids))
    (tmp_path / "hot.txt").write_text("7 3\n3, 250\n0\n")
    for name in ("hot.pt", "list.pt", "hot.json", "hot.txt"):
        assert read_token_map(tmp_path / name) == ids, name
        assert draft_token_ids(str(tmp_path / name), 300, "cpu").tolist() == [0, 3, 7, 250], name


@pytest.mark.parametrize(("text", "problem"), [("", "non-empty list"), ("1 two 3", "cannot read"),
                                               ("[1.5]", "integer token ids")])
def test_bad_token_maps_are_named(tmp_path, text: str, problem: str) -> None:
    path = tmp_path / ("map.json" if text.startswith("[") else "map.txt")
    path.write_text(text)
    with pytest.raises(DraftVocabError, match=problem) as err:
        draft_token_ids(str(path), 300, "cpu")
    assert str(path) in str(err.value)


def test_ids_outside_the_vocabulary_are_refused(tmp_path) -> None:
    (tmp_path / "map.txt").write_text("1 2 300")
    with pytest.raises(DraftVocabError, match="token id 300 is outside the vocabulary"):
        draft_token_ids(str(tmp_path / "map.txt"), 300, "cpu")


def test_counts_and_the_whole_vocabulary() -> None:
    assert draft_token_ids(None, 300, "cpu") is None
    assert draft_token_ids(5, 300, "cpu").tolist() == [0, 1, 2, 3, 4]
    assert draft_token_ids(300, 300, "cpu") is None and draft_token_ids(10**6, 300, "cpu") is None


@pytest.mark.parametrize(("fmt", "relaid"), [(fmt, False) for fmt in ("int4-g64", "int8-g64", "nvfp4", "fp8")]
                         + [(fmt, True) for fmt in ("int4-g64", "int8-g64", "nvfp4")])  # fp8 is never re-laid
def test_rows_of_a_quantized_weight_in_either_layout(fmt: str, relaid: bool) -> None:
    weight = quantize(torch.randn(96, 256, generator=torch.Generator().manual_seed(1)) * 0.05, fmt)
    whole = weight.dequantize(torch.float32)
    if relaid:
        weight = fragment_laid(weight)
    rows = torch.tensor([95, 0, 17, 40, 41, 64, 17])
    got = weight.dequantize_rows(rows, torch.float32, block=32)  # three blocks, rows in all of them
    assert torch.equal(got, whole[rows])


def _load(ckpt, **kw) -> ninfer.LLM:
    kw = dict(device="cpu", progress=False, max_concurrency=3, max_context=512) | kw
    return ninfer.load(ckpt.path, **kw)


def test_lm_head_rows_give_the_logits_columns(composite_ckpt) -> None:
    model = _load(composite_ckpt).engine.runner.model
    ids = torch.tensor([3, 0, 77, 250])
    hidden = torch.randn(5, model.config.hidden_size, dtype=model.dtype)
    torch.testing.assert_close(hidden @ model.lm_head_rows(ids).T, model.logits(hidden)[:, ids])


@pytest.mark.parametrize("source", ["count", "token map"])
def test_greedy_over_a_narrow_draft_vocabulary_equals_plain(composite_ckpt, tmp_path, source: str) -> None:
    plain = _load(composite_ckpt)
    params = SamplingParams(greedy=True)
    want = [c.token_ids for c in plain._run([plain._request(list(p), 24, params) for p in PROMPTS])]
    allowed = list(range(40)) if source == "count" else sorted({*range(7, 400, 9), *want[0]})
    if source == "count":
        llm = _load(composite_ckpt, spec="mtp", draft_tokens=3, draft_vocab=40)
    else:
        (tmp_path / "hot.json").write_text(json.dumps(allowed[::-1]))
        llm = _load(composite_ckpt, spec="mtp", draft_tokens=3, draft_token_map=str(tmp_path / "hot.json"))
    spec = llm.engine.spec
    assert spec.draft_ids.tolist() == allowed and spec.draft_rows.shape[0] == len(allowed)
    seen: list[torch.Tensor] = []

    def observe(lanes: torch.Tensor, n: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        seen.append(drafts.clone())
        return drafts

    spec.propose = observe
    reqs = [llm._request(list(p), 24, params) for p in PROMPTS]
    assert [c.token_ids for c in llm._run(reqs)] == want
    drafts = torch.cat([d.reshape(-1) for d in seen])
    assert drafts.numel() > 0 and set(drafts.tolist()) <= set(allowed)
    assert llm.engine.is_idle()


def test_draft_vocabulary_options_are_checked(composite_ckpt, tmp_path) -> None:
    with pytest.raises(OptionError, match="draft_vocab needs spec"):
        _load(composite_ckpt, draft_vocab=10)
    with pytest.raises(OptionError, match="alternatives"):
        _load(composite_ckpt, spec="mtp", draft_vocab=10, draft_token_map=__file__)
    (tmp_path / "map.txt").write_text("1 2 999999")
    with pytest.raises(DraftVocabError, match="outside the vocabulary"):
        _load(composite_ckpt, spec="mtp", draft_token_map=str(tmp_path / "map.txt"))


def test_the_memory_plan_counts_the_draft_rows(composite_ckpt, tmp_path) -> None:
    cfg = _load(composite_ckpt).engine.runner.model.config
    (tmp_path / "map.txt").write_text("1 2 2 9")
    assert (draft_head_bytes(cfg, EngineConfig(draft_tokens=3, draft_vocab=40), torch.bfloat16)
            == 40 * cfg.hidden_size * 2)
    assert draft_head_bytes(cfg, EngineConfig(draft_tokens=3, draft_vocab=str(tmp_path / "map.txt")),
                            torch.float32) == 3 * cfg.hidden_size * 4
    assert draft_head_bytes(cfg, EngineConfig(draft_tokens=0, draft_vocab=40), torch.float32) == 0
    assert draft_head_bytes(cfg, EngineConfig(draft_tokens=3), torch.float32) == 0
    assert draft_head_bytes(cfg, EngineConfig(draft_tokens=3, draft_vocab=cfg.vocab_size), torch.float32) == 0
