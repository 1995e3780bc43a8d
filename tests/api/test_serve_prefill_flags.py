"""``ninfer serve``'s prefill budgets: the defaults, the flag reaching ``ninfer.load``, bad values refused."""
from __future__ import annotations

import argparse

import pytest

import ninfer
from ninfer.api.cli import add_serve_parser, run_serve
from ninfer.runtime.engine_config import EngineConfig


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


class _Loaded(Exception):
    pass


def test_budgets_reach_load(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict] = []

    def load(model, **kwargs):
        seen.append(kwargs)
        raise _Loaded

    monkeypatch.setattr(ninfer, "load", load)
    with pytest.raises(_Loaded):
        run_serve(_parse("m"))
    assert "prefill_chunk" not in seen[-1] and "prefill_tokens_while_decoding" not in seen[-1]  # EngineConfig's
    defaults = EngineConfig()
    assert (defaults.prefill_chunk, defaults.prefill_tokens_while_decoding) == (8192, 1024)
    with pytest.raises(_Loaded):
        run_serve(_parse("m", "--prefill-chunk", "4096", "--prefill-tokens-while-decoding", "256"))
    assert (seen[-1]["prefill_chunk"], seen[-1]["prefill_tokens_while_decoding"]) == (4096, 256)


def test_a_bad_budget_is_refused_naming_the_flag(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        _parse("m", "--prefill-tokens-while-decoding", "0")
    assert "--prefill-tokens-while-decoding must be >= 1" in capsys.readouterr().err


def test_the_stall_bound_reaches_load_and_a_bad_one_is_refused(monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture) -> None:
    seen: list[dict] = []
    monkeypatch.setattr(ninfer, "load", lambda model, **kw: seen.append(kw) or (_ for _ in ()).throw(_Loaded()))
    with pytest.raises(_Loaded):
        run_serve(_parse("m", "--max-decode-stall", "2.5x"))
    assert seen[-1]["max_decode_stall"] == "2.5x" and EngineConfig().max_decode_stall is None
    with pytest.raises(SystemExit):
        _parse("m", "--max-decode-stall", "40")
    assert "--max-decode-stall must be milliseconds ('40ms') or a multiple of a decode step ('3x')" in \
        capsys.readouterr().err
