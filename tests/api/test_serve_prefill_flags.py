"""``ninfer serve``'s prefill budgets: the defaults, the flag reaching ``ninfer.load``, bad values refused."""
from __future__ import annotations

import argparse

import pytest

import ninfer
from ninfer.api.cli import add_serve_parser, run_serve


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
    for argv, chunk, budget in (((), 8192, 1024), (("--prefill-chunk", "4096", "--prefill-tokens-while-decoding",
                                                    "256"), 4096, 256)):
        with pytest.raises(_Loaded):
            run_serve(_parse("m", *argv))
        assert (seen[-1]["prefill_chunk"], seen[-1]["prefill_tokens_while_decoding"]) == (chunk, budget)


def test_a_bad_budget_is_refused_naming_the_flag(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        _parse("m", "--prefill-tokens-while-decoding", "0")
    assert "--prefill-tokens-while-decoding must be >= 1" in capsys.readouterr().err
