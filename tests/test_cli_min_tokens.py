"""``--min-tokens`` of ``ninfer generate`` and ``ninfer chat``: it reaches the request and holds the stops off."""
from __future__ import annotations

import io

import pytest

from cli_testing import requests  # noqa: F401  (fixture)
from cli_testing import run_cli
from tiny_checkpoints import TinyCheckpoint



def test_min_tokens_holds_off_the_stop_token(capsys, requests, dense_ckpt: TinyCheckpoint) -> None:
    args = ["generate", str(dense_ckpt.path), "--prompt", "Hello", "--max-new", "12", "--greedy", "--device", "cpu",
            "--raw"]
    code, _, err = run_cli(capsys, *args)
    assert code == 0, err
    free = requests[-1].output_ids
    i = next(i for i in range(2, len(free)) if free[i] not in free[:i])
    code, _, err = run_cli(capsys, *args, "--stop-token-id", str(free[i]))
    assert code == 0 and "(stop)" in err and len(requests[-1].output_ids) == i + 1
    code, _, err = run_cli(capsys, *args, "--stop-token-id", str(free[i]), "--min-tokens", "8")
    assert code == 0, err
    req = requests[-1]
    assert req.params.min_tokens == 8 and len(req.output_ids) > 8 and free[i] not in req.output_ids[:8]


def test_chat_passes_min_tokens(capsys, monkeypatch, requests, dense_ckpt: TinyCheckpoint) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\n/exit\n"))
    code, _, err = run_cli(capsys, "chat", str(dense_ckpt.path), "--device", "cpu", "--max-new", "6",
                           "--no-thinking", "--greedy", "--min-tokens", "6")
    assert code == 0, err
    assert requests[-1].params.min_tokens == 6 and len(requests[-1].output_ids) == 6


@pytest.mark.parametrize("argv, message", [
    (["generate", "--prompt", "x", "--max-new", "4", "--min-tokens", "5"], "--min-tokens 5 is more than --max-new 4"),
    (["generate", "--prompt", "x", "--min-tokens", "-1"], "--min-tokens"),
    (["chat", "--max-new", "2", "--min-tokens", "3"], "--min-tokens 3 is more than --max-new 2"),
])
def test_min_tokens_flag_errors(capsys, argv: list[str], message: str) -> None:
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and message in err, err
