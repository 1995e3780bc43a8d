"""``ninfer token-map``: token counts of text files into a draft token map the engine reads."""
from __future__ import annotations

from collections import Counter

import pytest

import ninfer
from cli_testing import run_cli
from ninfer.cli_token_map import token_map
from ninfer.runtime.draft_vocab import read_token_map
from ninfer.tokenizer import Tokenizer, stop_token_ids
from tiny_checkpoints import TinyCheckpoint

TEXT = "The cat sat on the mat. The cat sat again, and the dog watched the cat.\n" * 3


def test_the_most_frequent_ids_then_the_turn_ends() -> None:
    counts = Counter({5: 3, 9: 7, 2: 3, 11: 1})
    assert token_map(counts, 3, {11, 40}) == [9, 2, 5, 11, 40]  # ties: the lower id first
    assert token_map(counts, 10, {9}) == [9, 2, 5, 11]


@pytest.mark.parametrize("suffix", [".pt", ".json", ".txt"])
def test_writes_a_map_the_engine_reads(capsys, composite_ckpt: TinyCheckpoint, tmp_path, suffix: str) -> None:
    (tmp_path / "a.txt").write_text(TEXT)
    (tmp_path / "b.txt").write_text("mat mat mat\n")
    out = tmp_path / f"hot{suffix}"
    code, _, err = run_cli(capsys, "token-map", str(composite_ckpt.path), "--text", str(tmp_path / "a.txt"),
                           str(tmp_path / "b.txt"), "--top", "4", "--out", str(out))
    assert code == 0, err
    tokenizer = Tokenizer(composite_ckpt.path)
    counts = Counter(tokenizer.encode(TEXT) + tokenizer.encode("mat mat mat\n"))
    ends = stop_token_ids(composite_ckpt.path, tokenizer, ())
    ids = read_token_map(out)
    assert ids[:4] == sorted(counts, key=lambda t: (-counts[t], t))[:4] and set(ids[4:]) == ends - set(ids[:4])
    covered = sum(counts[t] for t in ids) / sum(counts.values())
    assert f"{len(ids)} token ids; they cover {covered:.1%} of the {sum(counts.values())} tokens" in err
    llm = ninfer.load(composite_ckpt.path, device="cpu", progress=False, max_concurrency=1, spec="mtp",
                      draft_token_map=str(out))
    assert llm.engine.spec.draft_ids.tolist() == sorted(ids)


@pytest.mark.parametrize(("files", "extra", "message"), [
    (["missing.txt"], [], "--text: file"),
    (["latin1.txt"], [], "is not UTF-8"),
    (["empty.txt"], [], "the files hold no tokens"),
    (["a.txt"], ["--top", "0"], "--top must be >= 1"),
])
def test_errors_name_the_flag(capsys, composite_ckpt: TinyCheckpoint, tmp_path, files, extra, message) -> None:
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "a.txt").write_text(TEXT)
    code, _, err = run_cli(capsys, "token-map", str(composite_ckpt.path), "--text",
                           *[str(tmp_path / f) for f in files], *extra, "--out", str(tmp_path / "m.pt"))
    assert code == 2 and message in err, err
